"""Issue 28: what ``model.named_parameters()`` alone may decide, and what it must refuse.

Names are the weakest evidence.  Two silent wrong results came from them:

* GPT-2's ``Conv1D`` stores its ``weight`` ``(in, out)`` under the names ``c_attn``,
  ``c_proj``, ``c_fc`` that nanoGPT and GPTBigCode give to ``nn.Linear`` ``(out, in)``; the
  router read every one ``(out, in)``.  Such a weight is now refused, and the first remedy
  (ordered by the shapes of the model's weights of these names) is the module's reading.
* a head by shape alone: with ``vocab_size = 4 * n_embd``, GPT-2's ``mlp.c_proj`` has the
  token table's shape and was taken for the output head.  A weight inside numbered layers is
  never a head by shape, and by names only neither is one without a head name: each is
  refused, listing the candidates.

Every transformers architecture built here routes the same through ``named_parameters()``
as through the module (whose routes ``test_torch_zoo.py`` checks against hand-written
tables), or is refused with first remedies that, applied, give the module's routes; the
Conv1D remedy is also checked against the SinkGD step of the matrix in its true layout.
"""

from __future__ import annotations

import copy
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference_np import SinkGDRef
from routing_checks import ARCHITECTURES, WIDE, D, V, build, paste_block
from torch import nn

import sage_torch
from sage_torch import Route, RoutingError, make_optimizer, route_params

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("torch_one_thread")

LR = 1e-2


def routes_of(params, overrides=None) -> dict:
    return {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
            for r in route_params(params, overrides)}


def by_names(model: nn.Module) -> tuple[dict, RoutingError | None]:
    """The routes ``named_parameters()`` gives, after the first remedies if it is refused."""
    try:
        return routes_of(model.named_parameters()), None
    except RoutingError as err:
        assert paste_block(err) == err.overrides
        return routes_of(model.named_parameters(), err.overrides), err


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_named_parameters_route_as_the_module_or_the_first_remedies_do(arch):
    config, model_cls, kw = ARCHITECTURES[arch]
    model = build(config, model_cls, **kw)
    truth = routes_of(model)  # module types and the model API (test_torch_zoo's tables)
    got, err = by_names(model)
    assert got == truth, {n: (got.get(n), r) for n, r in truth.items() if got.get(n) != r}
    if err is not None:
        assert "Pass the model itself (make_optimizer(name, model)" in str(err)
        assert all(r.kind != "embedding" or truth[n][0] == "embedding"
                   for n, r in err.overrides.items())


def test_gpt2_conv1d_names_are_refused_naming_both_layouts():
    model = build(*ARCHITECTURES["gpt2"][:2], **ARCHITECTURES["gpt2"][2])
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model.named_parameters())
    err = info.value
    assert [p.leaf for p in err.problems] == [
        n for n, p in model.named_parameters() if re.search(r"\.c_\w+\.weight$", n)]
    message = str(err)
    assert "transformers' Conv1D stores it (in, out)" in message
    assert "nanoGPT and GPTBigCode give these names to nn.Linear" in message
    assert "say Conv1D (in, out)" in message
    for p in err.problems:  # both readings, Conv1D's first
        assert [r for r, _ in p.options[:2]] == [Route("dense", fan_in=0, fan_out=1),
                                                 Route("dense", fan_in=1, fan_out=0)]
    # the same model, passed itself, routes every Conv1D (in, out) with no override
    assert all(routes_of(model)[p.leaf] == ("dense", (0,), (1,)) for p in err.problems)


def test_gpt2_vocab_4d_c_proj_is_not_a_head_and_its_step_is_sinkgd_in_in_out():
    """The issue's case: vocab_size = 4 * n_embd, mlp.c_proj (4d, d) has wte's shape."""
    model = build(*ARCHITECTURES["gpt2-vocab-4d"][:2],
                  **ARCHITECTURES["gpt2-vocab-4d"][2]).double().eval()  # eval: no dropout
    name = "transformer.h.0.mlp.c_proj.weight"
    c_proj = model.transformer.h[0].mlp.c_proj.weight
    assert tuple(c_proj.shape) == tuple(model.transformer.wte.weight.shape) == (WIDE, D)
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model.named_parameters())
    assert info.value.overrides[name] == Route("dense", fan_in=0, fan_out=1)
    twin = copy.deepcopy(model)
    ids = torch.randint(0, WIDE, (2, 6), generator=torch.Generator().manual_seed(0))
    opts = [make_optimizer("sage-hybrid", model.named_parameters(), lr=LR,
                           route_overrides=info.value.overrides),
            make_optimizer("sage-hybrid", twin, lr=LR)]
    before = c_proj.detach().numpy().copy()
    for m in (model, twin):
        logits = m(ids).logits
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
    grad = c_proj.grad.detach().numpy().copy()
    for opt in opts:
        opt.step()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12, msg=n)
    # Conv1D: y = x @ W, W (in, out) = (4d, d): SinkGD normalises each output unit's fan-in
    # (axis 0) first; read as a head, the step would be SAGE's
    expected = SinkGDRef(alpha=10.0, normalization="unit", fan_in_axis=0,
                         fan_out_axis=1).step(before, grad, LR)
    np.testing.assert_allclose(c_proj.detach().numpy(), expected, rtol=0, atol=1e-10)


def test_nanogpt_style_linear_with_gpt2_names_gets_the_linear_reading_first():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.ModuleDict({"c_attn": nn.Linear(D, 3 * D), "c_proj": nn.Linear(D, D)})
            self.mlp = nn.ModuleDict({"c_fc": nn.Linear(D, 4 * D), "c_proj": nn.Linear(4 * D, D)})

    class NanoGPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict({"wte": nn.Embedding(V, D),
                                              "wpe": nn.Embedding(8, D),
                                              "h": nn.ModuleList([Block()])})

    model = NanoGPT()
    with pytest.raises(RoutingError) as info:
        route_params(model.named_parameters())
    assert "say nn.Linear (out, in)" in str(info.value)
    assert routes_of(model.named_parameters(), info.value.overrides) == routes_of(model)
    assert routes_of(model)["transformer.h.0.attn.c_proj.weight"] == ("dense", (1,), (0,))


def test_a_param_group_kind_does_not_give_conv1d_names_torch_axes():
    model = build(*ARCHITECTURES["gpt2"][:2], **ARCHITECTURES["gpt2"][2])
    attn = model.transformer.h[0].attn.c_attn.weight
    group = {"params": [("transformer.h.0.attn.c_attn.weight", attn)], "kind": "dense"}
    with pytest.raises(RoutingError, match="routed 'dense', but its name is a GPT-2 Conv1D"):
        make_optimizer("sage-hybrid", [group])
    routed = make_optimizer("sage-hybrid", [{**group, "fan_in_dim": 0, "fan_out_dim": 1}])
    assert (routed.param_groups[0]["fan_in_dim"], routed.param_groups[0]["fan_out_dim"]) == (0, 1)


# ---------------------------------------------------------------------------
# Heads by shape: never a layer's matrix, never by names alone
# ---------------------------------------------------------------------------


class TiedWideMLP(nn.Module):
    """A tied LM (logits = h @ E^T, no get_output_embeddings) whose MLP width is V."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(
            [nn.ModuleDict({"up": nn.Linear(D, V), "down": nn.Linear(V, D)})])

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer["down"](F.gelu(layer["up"](h)))
        return h @ self.embed.weight.T


@pytest.mark.parametrize("named", [False, True], ids=["module", "named_parameters"])
def test_a_layers_matrix_of_the_tables_shape_is_refused_not_a_head(named):
    model = TiedWideMLP()
    up = "layers.0.up.weight"
    assert tuple(model.layers[0]["up"].weight.shape) == tuple(model.embed.weight.shape)
    with pytest.raises(RoutingError) as info:
        route_params(model.named_parameters() if named else model)
    err = info.value
    assert [p.leaf for p in err.problems] == [up]
    assert "lies inside numbered layers" in str(err)
    assert err.overrides == {up: Route("dense", fan_in=1, fan_out=0)}  # not the head first
    routes = routes_of(model.named_parameters() if named else model, err.overrides)
    assert routes[up] == ("dense", (1,), (0,)) and routes["embed.weight"][0] == "embedding"


class UntiedNoHeadName(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc = nn.Linear(D, D)
        self.to_logits = nn.Linear(D, V, bias=False)

    def forward(self, ids):
        return self.to_logits(F.gelu(self.fc(self.embed(ids))))


def test_by_names_a_head_without_a_head_name_is_refused_with_the_head_first():
    model = UntiedNoHeadName()
    truth = routes_of(model)  # the module: the only nn.Linear of the table's shape
    assert truth["to_logits.weight"] == ("embedding", (1,), (0,))
    with pytest.raises(RoutingError) as info:
        route_params(model.named_parameters())
    message = str(info.value)
    assert "has no head name" in message and "Pass the model itself" in message
    assert "'to_logits.weight': 'embedding'" in message
    assert routes_of(model.named_parameters(), info.value.overrides) == truth
    evidence = {r.name: r.route.evidence for r in sage_torch.route_params(
        model.named_parameters(), {"to_logits.weight": "embedding"})}
    assert evidence["to_logits.weight"].startswith("override")
