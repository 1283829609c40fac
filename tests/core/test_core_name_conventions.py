"""Name conventions of other libraries' models (issue 44): registered, not in the core.

``sage_optim/adapters/<library>.py`` registers a :class:`sage_optim.naming.NameConvention`;
both routers' name reading (:func:`sage_optim.naming.torch_name_reading`) then refuses the
weights it flags, with the convention's own refusal.
"""

from __future__ import annotations

import pytest

from sage_optim import naming
from sage_optim.routing import Route, RoutingError


def test_the_gpt2_convention_is_registered_by_its_adapter():
    found = naming.name_convention("transformer.h.0.attn.c_attn.weight")
    assert found is not None and found.name == "conv1d"
    assert found.flags.__module__ == "sage_optim.adapters.transformers"
    assert naming.name_convention("transformer.h.0.attn.c_attn.bias") is None
    assert naming.torch_name_reading("transformer.h.0.mlp.c_fc.weight") == "convention"
    assert naming.torch_name_reading("model.layers.0.mlp.up_proj.weight") == "linear"


def test_the_shapes_order_the_conv1d_remedies():
    d = 8
    gpt2 = [("h.0.attn.c_attn.weight", (d, 3 * d)), ("h.0.mlp.c_proj.weight", (4 * d, d))]
    nanogpt = [("h.0.attn.c_attn.weight", (3 * d, d)), ("h.0.mlp.c_proj.weight", (d, 4 * d))]
    readings = naming.convention_readings(gpt2, d)
    assert readings == {"conv1d": "in_out"}
    assert naming.convention_readings(nanogpt, d) == {"conv1d": "out_in"}
    assert naming.convention_readings(gpt2 + nanogpt, d) == {"conv1d": None}
    err = naming.convention_refusal("h.0.attn.c_attn.weight", (d, 3 * d), readings, "Fix it")
    assert isinstance(err, RoutingError)
    assert err.options[0][0] == Route("dense", fan_in=0, fan_out=1)  # Conv1D (in, out) first
    err = naming.convention_refusal("h.0.attn.c_attn.weight", (3 * d, d),
                                    naming.convention_readings(nanogpt, d), "Fix it")
    assert err is not None and err.options[0][0] == Route("dense", fan_in=1, fan_out=0)
    assert naming.convention_refusal("h.0.attn.c_attn.weight", (2, 3, 4), readings, "x") is None


@pytest.fixture
def my_convention():
    def refusal(name, shape, reading, remedy, kind):
        return RoutingError(f"my convention: {name} ({reading}); {remedy}", leaf=name,
                            shape=shape, options=[("vector", "always")])

    convention = naming.NAME_CONVENTIONS.register(naming.NameConvention(
        "my_convention_test", flags=lambda name: name.endswith("my_mix.weight"),
        reading=lambda weights, width: f"{len(weights)} weights, width {width}",
        refusal=refusal))
    yield convention
    naming.NAME_CONVENTIONS.registered.pop("my_convention_test")


def test_a_registered_convention_refuses_its_names(my_convention):
    """A convention registered by hand is read like the shipped one; gone once removed."""
    assert naming.torch_name_reading("blocks.0.my_mix.weight") == "convention"
    readings = naming.convention_readings(
        [("blocks.0.my_mix.weight", (4, 6)), ("blocks.1.my_mix.weight", (4, 6)),
         ("blocks.0.my_mix.bias", (4,))], 6)
    assert readings["my_convention_test"] == "2 weights, width 6"
    err = naming.convention_refusal("blocks.0.my_mix.weight", (4, 6), readings, "do this")
    assert err is not None and str(err) == (
        "my convention: blocks.0.my_mix.weight (2 weights, width 6); do this")
    with pytest.raises(TypeError, match="register_adapter takes an Adapter"):
        naming.NAME_CONVENTIONS.register(lambda name: True)  # type: ignore[arg-type]


def test_without_the_convention_the_name_is_a_linear():
    """The property the registry carries: unregistered, the same name reads as nn.Linear."""
    assert naming.torch_name_reading("blocks.0.my_mix.weight") == "linear"
