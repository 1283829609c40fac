"""The JAX router's adapters, each alone (issue 44): ``sage_optax/adapters/<library>.py``
adds the evidence of one library's models, loaded once that library is imported.  The
truth is Equinox's forward: ``eqx.nn.Linear`` computes ``weight @ x``, so its weight is
``(out, in)``."""

from __future__ import annotations

import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import sage_optax
from sage_optax import routing
from sage_optim.routing import Route


def test_the_equinox_adapter_loads_only_with_equinox():
    code = ("import sys, jax.numpy as jnp, sage_optax\n"
            "sage_optax.route_params({'b': jnp.zeros(3)})\n"
            "print(sorted(m for m in sys.modules if m.startswith('sage_optax.adapters.')))\n"
            "import equinox\n"
            "sage_optax.route_params({'b': jnp.zeros(3)})\n"
            "print(sorted(m for m in sys.modules if m.startswith('sage_optax.adapters.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[:2] == ["[]", "['sage_optax.adapters.equinox']"]


def test_equinox_adapter_reads_linear_as_weight_at_x():
    from sage_optax.adapters import equinox as adapter

    linear = eqx.nn.Linear(3, 5, key=jax.random.key(0))
    x = jnp.arange(3.0)
    assert jnp.allclose(linear(x), linear.weight @ x + linear.bias)  # (out, in)
    assert adapter.owns(linear) and not adapter.owns({"w": x})
    routes = adapter.routes(linear)
    assert routes["weight"] == Route("dense", -1, -2, evidence="module eqx.nn.Linear (out, in)")
    assert routes["bias"].kind == "vector"
    params, what = adapter.params(linear, None, None)
    assert what == "eqx.filter(model, eqx.is_inexact_array)"
    assert jax.tree.leaves(params)[0] is linear.weight
    assert routing.model_adapter(linear) is adapter.ADAPTER
    assert routing.model_adapter({"w": x}) is None


def test_a_registered_adapter_gives_a_model_its_routes():
    class Model:  # a library the router has never seen: one (out, in) matrix "w"
        def __init__(self):
            self.w = jnp.ones((4, 3))

    def routes(tree):
        return {"w": Route("dense", -1, -2, evidence="module Model (out, in)")}

    routing.register_adapter(routing.Adapter(
        "model_test", owns=lambda x: isinstance(x, Model), routes=routes))
    try:
        got = sage_optax.route_params({"w": jnp.ones((4, 3))}, model=Model())
        assert got.routes["w"].evidence == "module Model (out, in)"
        assert (got.routes["w"].fan_in, got.routes["w"].fan_out) == ((1,), (0,))
    finally:
        routing._ADAPTERS.pop("model_test")
    with pytest.raises(TypeError, match="register_adapter takes an Adapter"):
        routing.register_adapter(routes)
