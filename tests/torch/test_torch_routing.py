"""sage_torch's router: evidence, param groups, configurations, refusals and torch.optim's habits.

One file for the PyTorch router, in four sections (each once a file of its own):

* sage_torch's router: evidence before guesses, overrides that work, errors whose advice works.

  Every error the router raises names the parameter, its shape and an override; each test
  below applies the advised override (parsed from the message itself) and checks that the
  resulting route, or the resulting update, is the one the layout calls for, against an
  independent computation (an ``nn.Linear`` twin, or the float64 NumPy oracle).

* sage_torch's router, param groups, the eight configurations and their routing tables.

  The rule table and the state-size formulas below are written out by hand from docs/
  sections 2-4 (not read from :mod:`sage_optim.presets`), so a wrong preset or a wrong state
  shape shows up as a disagreement.

* Issue 28: what ``model.named_parameters()`` alone may decide, and what it must refuse.

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

* sage_torch's router on models built from the libraries themselves, and torch.optim's habits.

  Three things are checked here, each against the math of the layout that the model's own
  forward code uses (float64, one step, against the NumPy oracle of ``reference_np``):

  * heads next to tables with ordinary names (x-transformers' ``TransformerWrapper``, a
  ``word``/``pos`` model): the untied head is found by the shape of a table, and a
  position table whose shape an MLP weight shares makes a refusal, never a silent head;
  * the advice of one :class:`RoutingError` for every unplaceable parameter: options most
  likely first, one pasteable ``route_overrides = {...}`` block equal to ``err.overrides``,
  and that dict, applied, giving the reference math; module evidence for peft's LoRA
  ``Embedding`` and transformers' ``XLNetRelativeAttention``;
  * what ``torch.optim`` takes as ``params``: ``model.parameters()``,
  ``model.named_parameters()``, param-group dicts, and ``add_param_group`` without ``kind``.
"""

from __future__ import annotations

import copy
import fnmatch
import io
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference_np import SageRef, SinkGDRef
from routing_checks import ARCHITECTURES, WIDE, D, V, build, paste_block
from torch import nn

import sage_optax
import sage_optim.routing
import sage_torch
from sage_optim import CONFIG_NAMES
from sage_optim.presets import RULE_DEFAULTS
from sage_torch import (
    Route,
    RoutingError,
    make_optimizer,
    param_groups,
    route_params,
    routing_table,
)

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# -------------------- torch_router --------------------
# sage_torch's router: evidence before guesses, overrides that work, errors whose advice works.

VOCAB = 32  # the router and routing sections' vocabulary (the others use routing_checks' V)


def route_objects_of(model, overrides=None):
    return {r.name: r.route for r in route_params(model, overrides)}


def axes(route):
    return route.kind, route.fan_in, route.fan_out


def advised(message: str) -> list[dict]:
    """Every ``route_overrides={...}`` an error message advises, as override dicts."""
    found = re.findall(r"route_overrides=(\{[^{}]*\})", message)
    assert found, f"no override advised: {message}"
    return [eval(m, {"Route": Route})  # noqa: S307 - our own message, our own names
            for m in found]


def advice_for(message: str, words: str) -> dict:
    """The override advised on the message line that contains ``words``."""
    line = next(s for s in message.splitlines() if words in s)
    return advised(line)[0]


def sinkgd_step(p, g, lr=0.1, fan_in=1, fan_out=0):
    """The oracle's SinkGD step (unit, alpha 10, no decay) of one 2-D float64 matrix."""
    ref = SinkGDRef(alpha=10.0, weight_decay=0.0, fan_in_axis=fan_in, fan_out_axis=fan_out)
    return ref.step(p.detach().numpy(), g.numpy(), lr)


def step(model, overrides, loss):
    opt = make_optimizer("sage-hybrid", model, lr=0.1, weight_decay=0.0,
                         route_overrides=overrides)
    opt.zero_grad()
    loss().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    return before, grads


# ---------------------------------------------------------------------------
# API and evidence
# ---------------------------------------------------------------------------


def test_one_error_type_and_the_new_names():
    assert sage_torch.RoutingError is sage_optim.routing.RoutingError
    assert sage_torch.Route is sage_optim.routing.Route
    model = nn.Sequential(nn.Embedding(VOCAB, D), nn.Linear(D, 8))
    routed = route_params(model)
    assert [type(r).__name__ for r in routed] == ["RoutedParam"] * 3
    assert [(r.name, r.param is p) for r, (_, p) in zip(routed, model.named_parameters(),
                                                         strict=True)] == [
        ("0.weight", True), ("1.weight", True), ("1.bias", True)]
    assert routed[0].route.shape == (VOCAB, D) and routed[0].route.evidence == "module nn.Embedding"


class Tables(nn.Module):
    """No model API: a token table, positions and token types, and Linears whose
    out_features equal those tables' lengths (never a reason to be a head)."""

    def __init__(self, positions=D, head=True):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, D)
        self.pos = nn.Embedding(positions, D)
        self.types = nn.Embedding(2, D)
        self.q = nn.Linear(D, positions)  # out_features == number of positions
        self.classifier = nn.Linear(positions, 2)  # out_features == token types
        if head:
            self.proj = nn.Linear(D, VOCAB, bias=False)  # (V, d): the token table's shape


def test_heads_come_from_the_token_embedding_never_from_a_table_length():
    routes = route_objects_of(Tables())
    assert axes(routes["q.weight"]) == ("dense", (1,), (0,))
    assert axes(routes["classifier.weight"]) == ("dense", (1,), (0,))
    assert axes(routes["pos.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["proj.weight"]) == ("embedding", (1,), (0,))  # vocab axis 0: fan-out
    assert routes["proj.weight"].evidence == "head: shape of the token embedding 'tok_emb.weight'"
    routes = route_objects_of(Tables(head=False))
    assert all(routes[n].kind == "dense" for n in ("q.weight", "classifier.weight"))


def test_without_a_token_embedding_every_table_is_a_candidate():
    """No token table is known (two tables, neither named so): every table's shape counts,
    and the one Linear that fits is the head, with the tables named as its evidence."""
    model = nn.ModuleDict({"a": nn.Embedding(VOCAB, D), "b": nn.Embedding(VOCAB, D),
                           "proj": nn.Linear(D, VOCAB)})
    route = route_objects_of(model)["proj.weight"]
    assert axes(route) == ("embedding", (1,), (0,))  # vocab axis 0: fan-out
    assert route.evidence == "head: shape of the tables 'a.weight', 'b.weight'"
    # ...and an override says otherwise
    route = route_objects_of(model, {"proj.weight": "dense"})["proj.weight"]
    assert axes(route) == ("dense", (1,), (0,)) and route.evidence.startswith("override")


def test_a_head_marker_breaks_a_tie_between_square_linears():
    model = nn.ModuleDict({"embed": nn.Embedding(D, D), "fc": nn.Linear(D, D),
                           "lm_head": nn.Linear(D, D, bias=False)})
    routes = route_objects_of(model)
    assert routes["fc.weight"].kind == "dense"
    assert routes["lm_head.weight"].kind == "embedding"
    assert routes["lm_head.weight"].evidence.endswith("+ name")


def test_an_ambiguous_head_is_refused_and_both_advices_work():
    model = nn.ModuleDict({"embed": nn.Embedding(D, D), "a": nn.Linear(D, D),
                           "b": nn.Linear(D, D)})
    with pytest.raises(RoutingError) as info:
        route_params(model)
    message = str(info.value)
    assert "a.weight, b.weight" in message and "(16, 16)" in message, message
    name_the_head, all_dense = advised(message)
    routes = route_objects_of(model, name_the_head)
    assert axes(routes["b.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["a.weight"]) == ("dense", (1,), (0,))  # the head is named: a is dense
    opt = make_optimizer("sage-hybrid", model, route_overrides=name_the_head)
    model["b"].weight.grad = torch.randn(D, D)
    opt.step()
    assert opt.state[model["b"].weight]["scale_avg"].shape == (D,)  # reduced over vocab axis 0
    assert {n: r.kind for n, r in route_objects_of(model, all_dense).items()
            if n.endswith("weight")} == {"embed.weight": "embedding", "a.weight": "dense",
                                         "b.weight": "dense"}


def test_tied_head_registered_first_says_tied_to():
    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(D, VOCAB, bias=False)
            self.embed = nn.Embedding(VOCAB, D)
            self.embed.weight = self.lm_head.weight

    routes = route_objects_of(HeadFirst())
    assert list(routes) == ["lm_head.weight"]
    assert axes(routes["lm_head.weight"]) == ("embedding", (1,), (0,))
    assert routes["lm_head.weight"].evidence == "tied to embed.weight"


def test_known_module_layouts():
    model = nn.ModuleDict({
        "bag": nn.EmbeddingBag(VOCAB, D), "c1": nn.Conv1d(4, 6, 5), "c3": nn.Conv3d(2, 3, 2),
        "mha": nn.MultiheadAttention(D, 2),
    })
    routes = route_objects_of(model)
    assert axes(routes["bag.weight"]) == ("embedding", (1,), (0,))
    assert routes["bag.weight"].evidence == "module nn.EmbeddingBag"
    assert axes(routes["c1.weight"]) == ("dense", (1, 2), (0,))
    assert axes(routes["c3.weight"]) == ("dense", (1, 2, 3, 4), (0,))
    assert axes(routes["mha.in_proj_weight"]) == ("dense", (1,), (0,))
    assert axes(routes["mha.out_proj.weight"]) == ("dense", (1,), (0,))
    assert routes["mha.in_proj_bias"].kind == "vector"


# ---------------------------------------------------------------------------
# Errors and the math of their advice
# ---------------------------------------------------------------------------


class XW(nn.Module):
    """A custom matrix used as x @ W, W (in, out) = (8, 12)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 12, dtype=torch.float64))

    def forward(self, x):
        return x @ self.w


def test_custom_matrix_error_names_it_and_its_x_at_w_advice_is_the_linear_math():
    model = XW()
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model)
    message = str(info.value)
    assert "'w' of shape (8, 12)" in message and "layout is unknown" in message, message
    headline = message.split("\n")[0]  # the list of known layouts closes once
    assert headline.count("(") == headline.count(")"), headline
    advice = advice_for(message, "used as x @ W")
    assert advice == {"w": Route("dense", fan_in=0, fan_out=1)}
    x = torch.randn(5, 8, dtype=torch.float64)
    before, grads = step(model, advice, lambda: model(x).square().sum())
    # the oracle on nn.Linear's (out, in) = W.T: fan-in axis 1, fan-out axis 0
    expected = sinkgd_step(before["w"].T, grads["w"].T).T
    np.testing.assert_allclose(model.w.detach().numpy(), expected, rtol=0, atol=1e-12)
    # the F.linear advice is the transposed reading
    assert advice_for(message, "F.linear") == {"w": Route("dense", fan_in=1, fan_out=0)}


def test_stacked_matrix_advice_is_one_matrix_per_layer():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(3, 6, 4, dtype=torch.float64))  # (L, out, in)

    model = Stack()
    with pytest.raises(RoutingError) as info:
        route_params(model)
    advice = advice_for(str(info.value), "a stack of (out, in) matrices")
    assert axes(route_objects_of(model, advice)["w"]) == ("dense", (2,), (1,))
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    before, grads = step(model, advice, lambda: (x @ model.w.transpose(1, 2)).square().sum())
    for layer in range(3):
        expected = sinkgd_step(before["w"][layer], grads["w"][layer])
        np.testing.assert_allclose(model.w[layer].detach().numpy(), expected, rtol=0,
                                   atol=1e-12)


def test_conv_transpose_advice_reads_channels_and_taps_as_fan_in():
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 2, bias=False)).double()
    with pytest.raises(RoutingError) as info:
        route_params(model)
    message = str(info.value)
    assert "'0.weight' of shape (3, 4, 2, 2)" in message and "ConvTranspose2d" in message
    advice = advised(message)[0]
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    before, grads = step(model, advice, lambda: model(x).square().sum())
    merged = lambda t: t.permute(1, 0, 2, 3).reshape(4, 12)  # noqa: E731 - (out, in·kh·kw)
    expected = sinkgd_step(merged(before["0.weight"]), merged(grads["0.weight"]))
    np.testing.assert_allclose(merged(model[0].weight.detach()).numpy(), expected, rtol=0,
                               atol=1e-12)


def test_kind_only_override_takes_the_module_layout():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = nn.ModuleDict({"c_attn": conv1d(12, 8), "fc": nn.Linear(D, 4),
                           "conv": nn.Conv2d(3, 5, 3), "norm": nn.LayerNorm(D)})
    routes = route_objects_of(model, {"c_attn.weight": "embedding", "fc.weight": "embedding",
                               "conv.weight": "embedding", "norm.weight": "vector"})
    assert axes(routes["c_attn.weight"]) == ("embedding", (0,), (1,))  # (in, out): vocab = out
    assert axes(routes["fc.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["conv.weight"]) == ("embedding", (1, 2, 3), (0,))
    assert all(routes[n].evidence.startswith("override") for n in routes if not n.endswith("bias"))
    with pytest.raises(RoutingError, match="'norm.weight' of shape \\(16,\\).*route it 'vector'"
                       ) as info:
        route_params(model, {"norm.weight": "dense"})
    assert route_objects_of(model, advised(str(info.value))[0])["norm.weight"].kind == "vector"


def test_kind_only_override_of_an_unknown_layout_asks_for_axes_and_the_example_works():
    model = XW()
    with pytest.raises(RoutingError) as info:
        route_params(model, {"w": "dense"})
    message = str(info.value)
    assert "routed 'dense' by an override" in message and "(8, 12)" in message
    assert "Route('dense', fan_in=0, fan_out=1)" in message
    advice = advice_for(message, "used as x @ W")
    assert axes(route_objects_of(model, advice)["w"]) == ("dense", (0,), (1,))
    # a kind that needs no axes
    assert route_objects_of(model, {"w": "vector"})["w"].kind == "vector"


def test_kind_plus_axes_overrides_in_every_form():
    model = XW()
    for value in (Route("dense", fan_in=0, fan_out=1), ("dense", {"fan_in": 0, "fan_out": 1})):
        opt = make_optimizer("sage-hybrid", model, route_overrides={"w": value})
        dense = next(g for g in opt.param_groups if g["kind"] == "dense")
        assert (dense["fan_in_dim"], dense["fan_out_dim"]) == (0, 1)
    with pytest.raises(RoutingError, match="'w' of shape \\(8, 12\\): fan_in axis 2"):
        route_params(model, {"w": Route("dense", fan_in=2, fan_out=0)})
    with pytest.raises(RoutingError, match="per parameter.*route_overrides=") as info:
        make_optimizer("sage-hybrid", model, fan_in_dim=0, fan_out_dim=1)
    assert "Route('dense', fan_in=0, fan_out=1)" in str(info.value)


def test_a_glob_that_matches_nothing_names_the_nearest_parameters():
    model = nn.ModuleDict({"fc1": nn.Linear(4, 4), "fc2": nn.Linear(4, 4)})
    with pytest.raises(RoutingError, match="'fc3.weight' \\(nearest: ") as info:
        make_optimizer("sage-hybrid", model, route_overrides={"fc3.weight": "dense"})
    assert "fc1.weight" in str(info.value) and "fc2.weight" in str(info.value)


def test_overrides_reach_a_tied_parameter_through_any_of_its_names():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, D)
            self.lm_head = nn.Linear(D, VOCAB, bias=False)
            self.lm_head.weight = self.embed.weight

    route = route_objects_of(Tied(), {"lm_head.weight": "dense"})["embed.weight"]
    assert axes(route) == ("dense", (1,), (0,))
    with pytest.raises(RoutingError, match="'embed.weight' of shape \\(32, 16\\) is tied") as info:
        route_params(Tied(), {"lm_head.weight": "dense", "embed.weight": "embedding"})
    route = route_objects_of(Tied(), advised(str(info.value))[0])["embed.weight"]
    assert axes(route) == ("embedding", (1,), (0,))


def test_tied_modules_with_conflicting_layouts_are_refused():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = nn.ModuleDict({"a": nn.Linear(D, D), "b": conv1d(D, D)})
    model["b"].weight = model["a"].weight
    with pytest.raises(RoutingError) as info:
        route_params(model)
    message = str(info.value)
    assert "'a.weight' of shape (16, 16)" in message and "b.weight" in message, message
    advice = advised(message)[0]
    assert axes(route_objects_of(model, advice)["a.weight"]) == ("dense", (1,), (0,))


def test_an_api_embedding_of_unknown_layout_asks_for_axes():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(VOCAB, D))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = Table()
            self.fc = nn.Linear(D, D)

        def get_input_embeddings(self):
            return self.table

    model = Model()
    with pytest.raises(RoutingError) as info:
        route_params(model)
    advice = advice_for(str(info.value), "a table of 32 rows of 16 features")
    assert axes(route_objects_of(model, advice)["table.weight"]) == ("embedding", (1,), (0,))


def test_every_unplaceable_parameter_is_listed_at_once():
    model = nn.ModuleDict({"a": XW(), "b": XW()})
    with pytest.raises(RoutingError, match="cannot place 2 parameters") as info:
        route_params(model)
    assert "'a.w'" in str(info.value) and "'b.w'" in str(info.value)


# ---------------------------------------------------------------------------
# Sparse embeddings
# ---------------------------------------------------------------------------


def test_sparse_embedding_is_refused_at_construction_and_the_fix_works():
    model = nn.ModuleDict({"embed": nn.EmbeddingBag(VOCAB, D, sparse=True), "fc": nn.Linear(D, 4)})
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model)
    message = str(info.value)
    assert "'embed.weight' of shape (32, 16)" in message and "sparse=False" in message
    fix = re.search(r"set (model\.get_submodule\('embed'\)\.sparse = False)", message).group(1)
    exec(fix, {"model": model})  # noqa: S102 - the message's own fix
    opt = make_optimizer("sage-hybrid", model)
    model["fc"](model["embed"](torch.tensor([[1, 2], [3, 4]]))).sum().backward()
    opt.step()
    assert opt.state[model["embed"].weight]["scale_avg"].shape == (D,)


def test_sparse_gradients_in_hand_built_groups_fail_clearly_at_step():
    embed = nn.Embedding(VOCAB, D, sparse=True)
    opt = sage_torch.SAGE([("embed.weight", embed.weight)])
    embed(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(RuntimeError, match="embed.weight of shape \\(32, 16\\) \\(param group 0, "
                                           "rule 'sage'\\).*sparse=False"):
        opt.step()


def test_param_groups_are_per_layout_and_vector_groups_have_no_axes():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    groups = param_groups(model, "sage-hybrid")
    assert [(g["kind"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"]) for g in groups] == [
        ("dense", (1, 2, 3), 0, ["0.weight"]), ("dense", 1, 0, ["2.weight"]),
        ("vector", None, None, ["0.bias", "2.bias"])]
    x = torch.randn(2, 3, 3, 3)
    opt = make_optimizer("sage-pure", model)
    F.mse_loss(model(x), torch.zeros(2, 2)).backward()
    opt.step()
    assert opt.state[model[0].weight]["scale_avg"].shape == (3, 3, 3)  # averaged over Cout


# ---------------------------------------------------------------------------
# Torch conventions: schedulers, add_param_group
# ---------------------------------------------------------------------------


def small_float():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, D), nn.Linear(D, D), nn.LayerNorm(D))


def train(model, opt, sched=None, steps=4):
    x = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad()
        (model(x) @ model[0].weight.T).logsumexp(-1).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_one_cycle_lr_on_a_momentum_free_group_fails_with_our_message_changing_nothing():
    model = small_float()
    opt = make_optimizer("sage-hybrid", model)
    betas = [g.get("betas") for g in opt.param_groups]
    with pytest.raises(sage_torch.MomentumError,
                       match=r"param group 1 \(kind 'dense', rule 'sinkgd': 1.weight\) has no "
                             r"momentum.*cycle_momentum=False"):
        torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    assert [g.get("betas") for g in opt.param_groups] == betas  # nothing was cycled
    with pytest.raises(sage_torch.MomentumError, match="rule 'sinkgd'"):
        torch.optim.lr_scheduler.CyclicLR(opt, base_lr=1e-3, max_lr=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20,
                                                cycle_momentum=False)
    lrs = [[g["lr"] for g in opt.param_groups]]
    for _ in range(3):
        train(model, opt, sched, steps=1)
        lrs.append([g["lr"] for g in opt.param_groups])
    assert all(len(set(step)) == 1 for step in lrs)  # every group scheduled alike
    assert lrs[0][0] < lrs[1][0] < lrs[2][0] < lrs[3][0] <= 1e-2  # warming up
    assert [g.get("betas") for g in opt.param_groups] == betas


@pytest.mark.parametrize("name", ["sage-pure", "lion", "adamw"])
def test_one_cycle_lr_cycles_beta1_where_every_rule_has_momentum(name):
    model = small_float()
    opt = make_optimizer(name, model)
    b2 = [g["betas"][1] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8,
                                                pct_start=0.5)
    assert all(g["betas"][0] == 0.95 for g in opt.param_groups)  # max_momentum at the start
    train(model, opt, sched, steps=3)
    assert all(g["betas"][0] == pytest.approx(0.85) for g in opt.param_groups)  # at the peak
    assert [g["betas"][1] for g in opt.param_groups] == b2


def test_add_param_group_by_kind_or_rule_with_or_without_names():
    model = small_float()
    opt = make_optimizer("sage-hybrid", model, lr=3e-3)
    extra = nn.Linear(D, 4)
    n = len(opt.param_groups)
    opt.add_param_group({"params": [extra.weight], "kind": "dense"})  # no names
    g = opt.param_groups[-1]
    assert (g["rule"], g["normalization"], g["alpha"], g["lr"]) == ("sinkgd", "unit", 10.0, 3e-3)
    assert g["param_names"] == [f"param_groups[{n}].params[0]"] and "betas" not in g
    opt.add_param_group({"params": [("extra.bias", extra.bias)], "kind": "vector"})
    g = opt.param_groups[-1]
    assert (g["rule"], g["betas"], g["fan_out_dim"], g["param_names"]) == (
        "sage", (0.9, 0.99), None, ["extra.bias"])
    tail = nn.Linear(4, 2)
    opt.add_param_group({"params": tail.parameters(), "rule": "adamw", "lr": 1e-3})
    g = opt.param_groups[-1]
    adamw = RULE_DEFAULTS["adamw"]
    assert (g["rule"], g["betas"], g["lr"]) == ("adamw", (adamw["b1"], adamw["b2"]), 1e-3)
    with pytest.raises(ValueError, match="kind 'matrix'"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "kind": "matrix"})
    x = torch.randint(0, VOCAB, (3, 5))
    before = [p.detach().clone() for p in (extra.weight, extra.bias, tail.weight)]
    tail(extra(model(x))).square().mean().backward()
    opt.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, (extra.weight, extra.bias,
                                                                tail.weight), strict=True))
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    assert saved["param_groups"][n]["param_names"] == [f"param_groups[{n}].params[0]"]


def test_named_groups_added_to_an_unnamed_optimizer_name_the_others():
    a, b = nn.Parameter(torch.zeros(3, 2)), nn.Parameter(torch.zeros(4, 2))
    opt = sage_torch.SAGE([a])
    opt.add_param_group({"params": [("b", b)]})
    assert [g["param_names"] for g in opt.param_groups] == [["param_groups[0].params[0]"], ["b"]]
    a.grad, b.grad = torch.ones(3, 2), torch.ones(4, 2)
    opt.step()


# -------------------- torch_routing --------------------
# sage_torch's router, param groups, the eight configurations and their routing tables.

H = 48  # H != V: the router takes a Linear with out_features == V for a head


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class LM(nn.Module):
    """Embedding, two blocks (LayerNorm + two Linear), RMSNorm, a tied or untied head."""

    def __init__(self, tied=True):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


def kinds_of(groups):
    return {n: g["kind"] for g in groups for n in g["param_names"]}


# ---------------------------------------------------------------------------
# Routing
# ---------------------------------------------------------------------------


def test_tied_head_is_one_parameter_with_one_state():
    torch.manual_seed(0)
    model = LM(tied=True)
    assert model.lm_head.weight is model.embed.weight
    groups = param_groups(model, "sage-hybrid")
    kinds = kinds_of(groups)
    assert "lm_head.weight" not in kinds
    assert kinds["embed.weight"] == "embedding"
    params = [p for g in groups for p in g["params"]]
    assert len(params) == len({id(p) for p in params}) == len(list(model.parameters()))
    opt = make_optimizer("sage-hybrid", model)
    x = torch.randint(0, VOCAB, (4, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    assert len(opt.state) == len(params)
    st = opt.state[model.lm_head.weight]
    assert st is opt.state[model.embed.weight]
    assert st["exp_avg"].shape == (VOCAB, D) and st["scale_avg"].shape == (D,)  # O(d): over V


def test_untied_head_is_a_vocab_matrix():
    torch.manual_seed(0)
    model = LM(tied=False)
    kinds = kinds_of(param_groups(model, "sage-hybrid"))
    assert kinds["lm_head.weight"] == "embedding" and kinds["embed.weight"] == "embedding"
    opt = make_optimizer("sage-hybrid", model)
    x = torch.randint(0, VOCAB, (4, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    assert opt.state[model.lm_head.weight]["scale_avg"].shape == (D,)  # reduced over V, dim 0
    assert opt.state[model.lm_head.weight] is not opt.state[model.embed.weight]


def test_untied_head_without_marker_or_embedding_is_found_by_vocab_size():
    model = nn.ModuleDict({"tok": nn.Embedding(VOCAB, D), "out": nn.Linear(D, VOCAB, bias=False)})
    kinds = kinds_of(param_groups(model, "sage-hybrid"))
    assert kinds == {"tok.weight": "embedding", "out.weight": "embedding"}


def test_dense_and_vector_kinds():
    model = LM(tied=False)
    groups = param_groups(model, "sage-hybrid")
    kinds = kinds_of(groups)
    for i in (0, 1):
        assert kinds[f"blocks.{i}.fc1.weight"] == "dense"
        assert kinds[f"blocks.{i}.fc2.weight"] == "dense"
        assert kinds[f"blocks.{i}.fc1.bias"] == "vector"
        assert kinds[f"blocks.{i}.fc2.bias"] == "vector"
        assert kinds[f"blocks.{i}.norm.weight"] == "vector"  # LayerNorm
        assert kinds[f"blocks.{i}.norm.bias"] == "vector"
    assert kinds["norm.weight"] == "vector"  # RMSNorm
    assert len(kinds) == len(list(model.parameters()))
    by_kind = {g["kind"]: g for g in groups}
    assert [g["kind"] for g in groups] == ["embedding", "dense", "vector"]
    assert by_kind["embedding"]["rule"] == "sage"
    assert by_kind["dense"]["rule"] == "sinkgd"
    assert by_kind["dense"]["normalization"] == "unit" and by_kind["dense"]["alpha"] == 10.0
    assert by_kind["vector"]["rule"] == "sage"
    assert all(g["lr"] == 2e-3 for g in groups)
    assert all(g["lr"] == 0.5 for g in param_groups(model, "sage-hybrid", lr=0.5))


def test_overrides_by_glob():
    model = LM(tied=True)
    kinds = kinds_of(param_groups(model, "sage-hybrid",
                                  route_overrides={"blocks.1.*": "vector"}))
    assert kinds["blocks.0.fc1.weight"] == "dense"
    assert all(kinds[n] == "vector" for n in kinds if n.startswith("blocks.1."))
    assert kinds["embed.weight"] == "embedding"
    opt = make_optimizer("sage-hybrid", model, route_overrides={"blocks.*.fc2.weight": "vector"})
    vector = next(g for g in opt.param_groups if g["kind"] == "vector")
    assert {"blocks.0.fc2.weight", "blocks.1.fc2.weight"} <= set(vector["param_names"])
    with pytest.raises(ValueError, match="kind must be one of"):
        param_groups(model, "sage-hybrid", route_overrides={"blocks.*": "matrix"})


def test_conv_transpose_raises_naming_parameter_size_and_override():
    model = nn.Sequential(nn.ConvTranspose2d(3, 4, 3), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model)
    message = str(info.value)
    assert "0.weight" in message and "(3, 4, 3, 3)" in message, message
    assert "Route('dense', fan_in=(0, 2, 3), fan_out=1)" in message, message
    assert isinstance(info.value, ValueError)
    # ...and the advised override places it: input channels and taps as the fan-in
    groups = param_groups(model, "adamw",
                          route_overrides={"0.weight": sage_torch.Route("dense", fan_in=(0, 2, 3),
                                                                        fan_out=1)})
    assert kinds_of(groups)["0.weight"] == "dense"


def test_frozen_parameters_are_kept_and_not_stepped():
    """As torch.optim: frozen parameters stay in their group, skipped while grad is None."""
    torch.manual_seed(0)
    model = LM(tied=False)
    model.blocks[0].fc1.weight.requires_grad_(False)
    model.norm.weight.requires_grad_(False)
    kinds = kinds_of(param_groups(model, "adamw"))
    assert kinds["blocks.0.fc1.weight"] == "dense" and kinds["norm.weight"] == "vector"
    assert len(kinds) == len(list(model.parameters()))
    opt = make_optimizer("adamw", model)
    x = torch.randint(0, VOCAB, (4, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    before = model.blocks[0].fc1.weight.detach().clone()
    opt.step()
    assert model.blocks[0].fc1.weight not in opt.state
    assert torch.equal(model.blocks[0].fc1.weight, before)
    # the routing table lists what trains now
    assert "blocks.0.fc1.weight" not in [r.path for r in routing_table("adamw", model).rows]


def test_int_parameter_raises():
    """An integer ``nn.Parameter`` (a buffer registered as a parameter) cannot be trained.

    torch forces ``requires_grad=False`` on it, so the router must not mistake it for a
    frozen float parameter and drop it silently (docs/routing.md: fail loudly).
    """
    model = nn.Linear(4, 4)
    model.positions = nn.Parameter(torch.arange(4), requires_grad=False)
    with pytest.raises(RoutingError) as info:
        param_groups(model, "sage-hybrid")
    assert "positions" in str(info.value) and "(4,)" in str(info.value)


# ---------------------------------------------------------------------------
# The eight configurations: training and exact state bytes
# ---------------------------------------------------------------------------

# docs/configurations.md, by hand: rule per (embedding, dense, vector).
RULES_OF_CONFIG = {
    "adamw": ("adamw", "adamw", "adamw"),
    "lion": ("lion", "lion", "lion"),
    "apollo": ("adamw", "apollo", "adamw"),
    "sinkgd-pure": ("sinkgd(sqrt, alpha=0.05)", "sinkgd(sqrt, alpha=0.05)", "unit_norm"),
    "sinkgd-hybrid": ("adamw", "sinkgd(sqrt, alpha=0.05)", "adamw"),
    "lion-hybrid": ("lion", "sinkgd(unit, alpha=10)", "adamw"),
    "sage-pure": ("sage", "sage", "sage"),
    "sage-hybrid": ("sage", "sinkgd(unit, alpha=10)", "sage"),
}
TOY_LR = {name: 1e-2 for name in RULES_OF_CONFIG} | {"sinkgd-pure": 5e-2}  # loss ratios 0.0-0.21


class Toy(nn.Module):
    """Embedding, two Linear, LayerNorm; the head is tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)
        self.norm = nn.LayerNorm(D)
        nn.init.normal_(self.embed.weight, std=0.2)  # start near log(V), not at a huge loss

    def forward(self, x):
        h = self.embed(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.norm(h) @ self.embed.weight.T


def hand_count(name, model):
    """State bytes from the algorithms (float32): AdamW 2x, Lion 1x, SAGE 1x + reduced, ..."""
    total = 0
    for pname, p in model.named_parameters():
        kind = "embedding" if pname == "embed.weight" else ("dense" if p.dim() == 2 else "vector")
        rule = RULES_OF_CONFIG[name][("embedding", "dense", "vector").index(kind)].split("(")[0]
        n = p.numel()
        if rule == "adamw":
            total += 2 * n * 4
        elif rule == "lion":
            total += n * 4
        elif rule == "sage":  # M, plus S: mean over fan-out dim 0 for matrices, |g| for vectors
            total += n * 4 + (p.shape[1] if p.dim() == 2 else n) * 4
        elif rule == "apollo":  # rank-1 moments along the larger dim, a scalar limiter norm
            total += 2 * 1 * max(p.shape) * 4 + 4
        else:
            assert rule in ("sinkgd", "unit_norm")
    return total


def state_bytes(opt):
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for k, v in st.items()  # step and APOLLO's seed: host bookkeeping
               if k not in ("step", "proj_seed") and isinstance(v, torch.Tensor))


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_config_trains_and_counts_state_bytes(name):
    assert set(CONFIG_NAMES) == set(RULES_OF_CONFIG)
    torch.manual_seed(0)
    model = Toy()
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))
    x = torch.arange(VOCAB).repeat(4)
    y = perm[x]  # next token = a fixed permutation of the current one
    opt = make_optimizer(name, model, lr=TOY_LR[name])
    table = routing_table(name, model)
    assert [r[3] for r in table.rows] == [
        RULES_OF_CONFIG[name][("embedding", "dense", "vector").index(r[2])] for r in table.rows]
    losses = []
    for step in range(60):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step == 0:
            counted = state_bytes(opt)
            assert counted == table.total_bytes - table.shared_bytes, str(table)
            assert counted == hand_count(name, model)
            assert table.shared_bytes == 4 * len(list(model.parameters()))  # float32 steps
    final = F.cross_entropy(model(x), y).item()
    assert final < 0.7 * losses[0], f"{name}: loss {losses[0]:.3f} -> {final:.3f}"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_apollo_projection_is_injected_with_parameter_names():
    torch.manual_seed(0)
    model = Toy()
    seen = set()

    def projection(pname, refresh_index, n, rank):
        seen.add((pname, refresh_index, n, rank))
        return torch.ones(n, rank) / rank**0.5

    opt = make_optimizer("apollo", model, dense_projection=projection, dense_rank=2)
    x = torch.arange(VOCAB)
    F.cross_entropy(model(x), x).backward()
    opt.step()
    assert seen == {("fc1.weight", 0, D, 2), ("fc2.weight", 0, D, 2)}


# ---------------------------------------------------------------------------
# The routing table, against sage_optax's
# ---------------------------------------------------------------------------


def flax_twin(model):
    """The same model as a Flax-layout param dict: kernels (in, out), 'scale', 'embedding'."""
    params = {}
    for pname, p in model.named_parameters():
        module, _, leaf = pname.rpartition(".")
        owner = model.get_submodule(module)
        if isinstance(owner, nn.Embedding):
            leaf, shape = "embedding", tuple(p.shape)
        elif isinstance(owner, nn.Linear) and leaf == "weight":
            leaf, shape = "kernel", tuple(p.shape)[::-1]
        elif leaf == "weight":  # LayerNorm / RMSNorm
            leaf, shape = "scale", tuple(p.shape)
        else:
            shape = tuple(p.shape)
        node = params
        for part in module.split("."):
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, jnp.float32)
    return params


def torch_to_flax_name(model, pname):
    module, _, leaf = pname.rpartition(".")
    owner = model.get_submodule(module)
    if leaf == "weight":
        leaf = {nn.Embedding: "embedding", nn.Linear: "kernel"}.get(type(owner), "scale")
    return f"{module}.{leaf}"


def _sizes(axes: str) -> str:
    """``"1 (16)"`` -> ``"(16)"``: the sizes of an axis column, without the axis indices."""
    return axes if axes == "-" else axes.split(" ", 1)[1]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_routing_table_matches_sage_optax(name):
    model = LM(tied=False)
    ours = routing_table(name, model)
    theirs = sage_optax.routing_table(name, flax_twin(model))
    mapped = {}
    for row in ours.rows:
        path, shape = row.path, row.shape
        flax_shape = shape[::-1] if len(shape) == 2 and not path.startswith("embed.") else shape
        mapped[torch_to_flax_name(model, path)] = (flax_shape, row.kind, row.rule,
                                                   row.state_bytes)
    # kind, rule and bytes: the first fields and the eighth of both row forms
    expected = {r[0]: (tuple(r[1]), r[2], r[3], r[7]) for r in theirs.rows}
    assert mapped == expected
    # each kind's effective step (issue 45): the same in both frameworks
    assert {torch_to_flax_name(model, r.path): r.step for r in ours.rows} == {
        r.path: r.step for r in theirs.rows}
    assert ours.config == theirs.config == name
    assert str(ours).splitlines()[-1].startswith(f"{name}: optimizer state ")
    if all(isinstance(r, sage_torch.RoutingRow) for r in theirs.rows):  # the axes columns
        axes = {torch_to_flax_name(model, r.path): (_sizes(r.fan_in), _sizes(r.fan_out))
                for r in ours.rows}
        assert axes == {r.path: (_sizes(r.fan_in), _sizes(r.fan_out)) for r in theirs.rows}
        assert str(ours).splitlines()[0].split() == str(theirs).splitlines()[0].split()


def test_routing_table_allocates_nothing_and_prints():
    model = LM(tied=True)
    table = routing_table("sage-hybrid", model)
    text = str(table)
    assert text.splitlines()[0].split() == ["path", "shape", "kind", "rule", "step", "fan-in",
                                            "fan-out", "evidence", "state", "bytes"]
    assert [r.path for r in table.rows].count("embed.weight") == 1
    assert "lm_head.weight" not in [r.path for r in table.rows]  # tied: one row
    assert "32x16" in text
    row = table.row("embed.weight")
    assert (row.fan_in, row.fan_out) == ("1 (16)", "0 (32)")  # vocab axis 0 is the fan-out
    assert row.evidence == "module nn.Embedding, tied to lm_head.weight"
    assert table.row("blocks.0.fc1.weight")[4:7] == ("1 (16)", "0 (48)", "module nn.Linear")
    assert table.row("norm.weight")[4:7] == ("-", "-", "shape: 1-D")


# ---------------------------------------------------------------------------
# make_optimizer errors
# ---------------------------------------------------------------------------


def test_unknown_configuration_lists_valid_names():
    with pytest.raises(ValueError) as info:
        make_optimizer("sage-hybird", LM())
    message = str(info.value)
    assert "sage-hybird" in message
    assert all(n in message for n in CONFIG_NAMES), message


def test_unknown_override_names_the_key():
    with pytest.raises(ValueError, match="dampner"):
        make_optimizer("sage-hybrid", LM(), dampner="ema")
    with pytest.raises(ValueError, match="dense_bogus"):
        make_optimizer("sage-hybrid", LM(), dense_bogus=1)


def test_overrides_reach_the_groups():
    opt = make_optimizer("sage-hybrid", LM(), b1=0.891, dense_alpha=5.0, vector="adamw",
                         weight_decay=0.0, foreach=True)
    by_kind = {g["kind"]: g for g in opt.param_groups}
    assert by_kind["embedding"]["betas"] == (0.891, 0.99)
    assert by_kind["dense"]["alpha"] == 5.0
    assert by_kind["vector"]["rule"] == "adamw"
    assert all(g["weight_decay"] == 0.0 and g["foreach"] is True for g in opt.param_groups)
    assert sage_torch.CONFIG_NAMES == CONFIG_NAMES


# -------------------- torch_routing_evidence --------------------
# Issue 28: what ``model.named_parameters()`` alone may decide, and what it must refuse.

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()


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


# -------------------- torch_routing_habits --------------------
# sage_torch's router on models built from the libraries themselves, and torch.optim's habits.

TABLE_ROUTE = ("embedding", (1,), (0,))  # (V, d): vocab axis 0 = fan-out (tables, heads (V, d))
LINEAR = ("dense", (1,), (0,))  # nn.Linear / F.linear (out, in)
VECTOR = ("vector", (), ())


def evidence_of(model, overrides=None) -> dict:
    return {r.name: r.route.evidence for r in route_params(model, overrides)}


# ---------------------------------------------------------------------------
# The oracle: one step of sage-hybrid in the layout the forward code uses
# ---------------------------------------------------------------------------


def _merged(x: np.ndarray, fan_in: tuple, fan_out: tuple):
    """``x`` as ``(batch, OUT, IN)`` matrices, and how to put it back."""
    nd = x.ndim
    fan_in = tuple(a % nd for a in fan_in)
    fan_out = tuple(a % nd for a in fan_out)
    batch = tuple(a for a in range(nd) if a not in fan_in + fan_out)
    perm = batch + fan_out + fan_in
    moved = np.transpose(x, perm)
    out = math.prod(x.shape[a] for a in fan_out)
    inn = math.prod(x.shape[a] for a in fan_in)
    return moved.reshape(-1, out, inn), perm, moved.shape


def reference_step(theta: np.ndarray, g: np.ndarray, truth: tuple) -> np.ndarray:
    """sage-hybrid's step (defaults, lr ``LR``) of one parameter whose true layout is ``truth``:
    SAGE over the vocab axis of a vocabulary matrix, Unit-Norm SinkGD on a dense one (each
    output unit's fan-in first), element-wise SAGE on a vector."""
    kind, fan_in, fan_out = truth
    if kind == "vector":
        return SageRef(theta.shape if theta.ndim <= 1 else (theta.size,),
                       vocab_axis=None).step(theta.reshape(-1) if theta.ndim > 1 else theta,
                                             g.reshape(-1) if g.ndim > 1 else g,
                                             LR).reshape(theta.shape)
    t, perm, moved = _merged(theta, fan_in, fan_out)
    gm, _, _ = _merged(g, fan_in, fan_out)
    new = []
    for b in range(t.shape[0]):
        if kind == "embedding":
            ref = SageRef(t[b].shape, vocab_axis=0)  # rows: the vocab (fan-out) axis
        else:
            ref = SinkGDRef(alpha=10.0, normalization="unit", fan_in_axis=1, fan_out_axis=0)
        new.append(ref.step(t[b], gm[b], LR))
    return np.transpose(np.stack(new).reshape(moved), np.argsort(perm))


def check_step(model: nn.Module, loss_fn, truth: dict, params=None, overrides=None,
               config: str = "sage-hybrid") -> None:
    """One step of ``config`` on ``model`` (float64) against the oracle, parameter by
    parameter, each in the layout ``truth`` gives (globs, first match; default: vector)."""
    opt = make_optimizer(config, model if params is None else params, lr=LR,
                         route_overrides=overrides)
    opt.zero_grad()
    loss_fn(model).backward()
    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
             if p.grad is not None}
    opt.step()
    checked = 0
    for name, p in model.named_parameters():
        if name not in grads or not p.requires_grad:
            continue
        layout = next((v for k, v in truth.items() if fnmatch.fnmatchcase(name, k)), VECTOR)
        expected = reference_step(before[name], grads[name], layout)
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=0, atol=1e-10,
                                   err_msg=f"{name} {tuple(p.shape)} in layout {layout}")
        checked += 1
    assert checked >= 3


def tokens(n: int = 6, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(0))


def lm_loss(model: nn.Module) -> torch.Tensor:
    x = tokens()
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


# ---------------------------------------------------------------------------
# 1. Heads next to tables with ordinary names
# ---------------------------------------------------------------------------

XT = {
    "token_emb.emb.weight": TABLE_ROUTE,
    "pos_emb.emb.weight": TABLE_ROUTE,
    "attn_layers.*.weight": LINEAR,  # to_q/to_k/to_v/to_out and the MLP: nn.Linear
    "to_logits.weight": TABLE_ROUTE,  # logits = F.linear(h, W): W (V, d), vocab axis 0
}


def x_transformer(max_seq_len: int, **kw):
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=max_seq_len,
                                  attn_layers=xt.Decoder(dim=D, depth=1, heads=2), **kw)
    return model.double()


def xt_params(model) -> dict:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_x_transformers_untied_head_is_found_by_the_table_shape():
    model = x_transformer(max_seq_len=12)  # tie_embedding=False: to_logits is its own Linear
    shapes = xt_params(model)
    assert shapes["to_logits.weight"] == shapes["token_emb.emb.weight"] == (V, D)
    assert not hasattr(model, "get_input_embeddings")  # no API: the shapes must say it
    routes = routes_of(model)
    assert routes["to_logits.weight"] == TABLE_ROUTE
    assert evidence_of(model)["to_logits.weight"] == (
        "head: shape of the table 'token_emb.emb.weight'")
    assert all(routes[n] == LINEAR for n in routes
               if n.startswith("attn_layers") and n.endswith(".weight") and len(shapes[n]) == 2)
    check_step(model, lm_loss, XT)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_x_transformers_position_table_colliding_with_the_mlp_is_refused(tied):
    """max_seq_len = 4·dim: the MLP's first weight (4·dim, dim) has the position table's
    shape.  That is never a silent head: the router refuses, and the advice is right."""
    model = x_transformer(max_seq_len=4 * D, tie_embedding=tied)
    mlp = next(n for n, s in xt_params(model).items() if s == (4 * D, D) and "ff" in n)
    with pytest.raises(RoutingError) as info:
        route_params(model)
    err = info.value
    message = str(err)
    assert mlp in message and "pos_emb.emb.weight" in message, message
    expected = {mlp: Route("dense", fan_in=1, fan_out=0)}
    if not tied:
        assert "to_logits.weight" in message
        expected["to_logits.weight"] = Route("embedding", fan_in=1, fan_out=0)
    assert err.overrides == expected
    assert paste_block(err) == err.overrides
    assert routes_of(model, err.overrides)[mlp] == LINEAR
    if tied:
        loss = lm_loss
        truth = {k: v for k, v in XT.items() if k != "to_logits.weight"}
    else:
        loss, truth = lm_loss, XT
    check_step(model, loss, truth, overrides=err.overrides)


class WordPos(nn.Module):
    """Tables named ``word`` and ``pos`` (no token-table marker, no API), an MLP, a head."""

    def __init__(self, positions: int = 12, head: str = "out", hidden: int = 32):
        super().__init__()
        self.word = nn.Embedding(V, D)
        self.pos = nn.Embedding(positions, D)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)
        self.head_name = head
        setattr(self, head, nn.Linear(D, V, bias=False))

    def forward(self, x):
        h = self.word(x) + self.pos(torch.arange(x.shape[1]))
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return getattr(self, self.head_name)(h)


WORD_POS = {"word.weight": TABLE_ROUTE, "pos.weight": TABLE_ROUTE, "up.weight": LINEAR,
            "down.weight": LINEAR, "out.weight": TABLE_ROUTE, "lm_head.weight": TABLE_ROUTE}


def test_word_pos_model_head_is_found_and_named_by_its_table():
    torch.manual_seed(0)
    model = WordPos().double()
    assert routes_of(model)["out.weight"] == TABLE_ROUTE
    assert evidence_of(model)["out.weight"] == "head: shape of the table 'word.weight'"
    check_step(model, lm_loss, WORD_POS)


def test_word_pos_collision_is_refused_and_a_head_name_breaks_the_tie():
    torch.manual_seed(0)
    model = WordPos(positions=32).double()  # up.weight (32, 16) == pos.weight (32, 16)
    with pytest.raises(RoutingError) as info:
        route_params(model)
    assert info.value.overrides == {"up.weight": Route("dense", fan_in=1, fan_out=0),
                                    "out.weight": Route("embedding", fan_in=1, fan_out=0)}
    check_step(model, lm_loss, WORD_POS, overrides=info.value.overrides)
    named = WordPos(positions=32, head="lm_head")
    routes = routes_of(named)
    assert routes["lm_head.weight"] == TABLE_ROUTE and routes["up.weight"] == LINEAR
    assert evidence_of(named)["lm_head.weight"].endswith("+ name")


def test_a_frozen_linear_is_not_a_candidate():
    model = WordPos(positions=32)
    model.up.weight.requires_grad_(False)  # frozen: not trained, so not in doubt
    assert routes_of(model)["out.weight"] == TABLE_ROUTE


class TwoVocabularies(nn.Module):
    """Two tables of different vocabularies and two Linears shaped like them, no head name."""

    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(V, D)
        self.tgt = nn.Embedding(V + 4, D)
        self.to_src = nn.Linear(D, V, bias=False)
        self.to_tgt = nn.Linear(D, V + 4, bias=False)


def test_two_linears_matching_two_tables_are_refused_in_one_error():
    model = TwoVocabularies()
    with pytest.raises(RoutingError) as info:
        route_params(model)
    err = info.value
    message = str(err)
    assert "to_src.weight" in message and "to_tgt.weight" in message, message
    assert "src.weight" in message and "tgt.weight" in message
    assert [p.leaf for p in err.problems] == ["to_src.weight", "to_tgt.weight"]
    assert all(len(p.options) == 2 for p in err.problems)
    assert paste_block(err) == err.overrides
    # each option of each is one of the two readings (head over a table, or a Linear)
    for p in err.problems:
        assert {r.kind for r, _ in p.options} == {"embedding", "dense"}
    # adamw and sage-pure update both readings alike: no refusal there
    for config in ("adamw", "sage-pure"):
        table = routing_table(config, model)
        assert "unsettled, no matter" in table.row("to_src.weight").evidence


def test_an_identified_token_table_keeps_the_old_rule():
    """The token table known (by name): only its shape counts, position tables do not."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(V, D)
            self.pos = nn.Embedding(32, D)
            self.up = nn.Linear(D, 32)  # the position table's shape: not a candidate
            self.proj = nn.Linear(D, V)

    routes = routes_of(Model())
    assert routes["up.weight"] == LINEAR and routes["proj.weight"] == TABLE_ROUTE


# ---------------------------------------------------------------------------
# 2. Advice right for the leaf it names, one error, one paste block
# ---------------------------------------------------------------------------


class Custom(nn.Module):
    """Custom parameters whose true layouts are what the router's first options say:

    * ``pos_emb`` (N, d): a position table, ``pos_emb[:n]`` (name says emb: table first);
    * ``w`` (out, in): ``F.linear(h, w)`` (no evidence: PyTorch's (out, in) first);
    * ``experts`` (E, in, out): ``einsum('bi,eio->beo')`` (stacked (in, out) first);
    * ``unembed_w`` (d, V): logits ``h @ unembed_w`` (an axis of the token table's V rows:
      the reading whose vocab axis is that one first).
    """

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos_emb = nn.Parameter(torch.randn(6, D) * 0.1)
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
        self.experts = nn.Parameter(torch.randn(3, D, D) * 0.2)
        self.unembed_w = nn.Parameter(torch.randn(D, V) * 0.2)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.tok(x) + self.pos_emb[: x.shape[1]]
        h = F.linear(self.norm(h), self.w)
        h = h + torch.einsum("bti,eio->bteo", h, self.experts).mean(2)
        return h @ self.unembed_w


CUSTOM = {"tok.weight": TABLE_ROUTE, "pos_emb": TABLE_ROUTE, "w": LINEAR,
          "experts": ("dense", (1,), (2,)), "unembed_w": ("embedding", (0,), (1,))}


def test_every_unplaceable_parameter_in_one_error_first_options_give_the_math():
    torch.manual_seed(0)
    model = Custom().double()
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model)
    err = info.value
    message = str(err)
    first = message.splitlines()[0]  # the fix first (issue 45), within 200 characters
    assert first.startswith("Fix: paste the route_overrides block") and len(first) <= 200
    assert "cannot place 4 parameters" in first, message
    for name, shape in [("pos_emb", (6, D)), ("w", (D, D)), ("experts", (3, D, D)),
                        ("unembed_w", (D, V))]:
        assert f"{name!r} of shape {shape}" in message
    assert err.overrides == {
        "pos_emb": Route("embedding", fan_in=1, fan_out=0),
        "w": Route("dense", fan_in=1, fan_out=0),
        "experts": Route("dense", fan_in=-2, fan_out=-1),
        "unembed_w": Route("embedding", fan_in=0, fan_out=1),
    }
    assert paste_block(err) == err.overrides
    for p in err.problems:  # every option listed, and 'vector' last
        assert len(p.options) >= 3 and p.options[-1][0] == "vector"
    # the 3-D options include one matrix with axis 0 as fan-in and the rest merged
    experts = next(p for p in err.problems if p.leaf == "experts")
    assert Route("dense", fan_in=0, fan_out=(1, 2)) in [r for r, _ in experts.options]
    assert Route("dense", fan_in=(1, 2), fan_out=0) in [r for r, _ in experts.options]
    assert routes_of(model, err.overrides)["experts"] == ("dense", (1,), (2,))
    check_step(model, lm_loss, CUSTOM, overrides=err.overrides)


def test_kind_override_of_an_unknown_layout_offers_only_that_kind():
    model = Custom()
    with pytest.raises(RoutingError) as info:
        route_params(model, {"w": "embedding", "pos_emb": "vector", "experts": "vector",
                             "unembed_w": "vector"})
    (problem,) = info.value.problems
    assert [r.kind for r, _ in problem.options[:-1]] == ["embedding", "embedding"]
    assert "routed 'embedding' by an override" in str(info.value)


def test_tied_layout_conflict_carries_options():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = nn.ModuleDict({"a": nn.Linear(D, D), "b": conv1d(D, D)})
    model["b"].weight = model["a"].weight
    with pytest.raises(RoutingError) as info:
        route_params(model)
    assert info.value.overrides == {"a.weight": Route("dense", fan_in=1, fan_out=0)}
    assert [r for r, _ in info.value.problems[0].options][:2] == [
        Route("dense", fan_in=1, fan_out=0), Route("dense", fan_in=0, fan_out=1)]
    assert paste_block(info.value) == info.value.overrides


def test_peft_lora_embedding_is_module_evidence():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    model = model.double()
    layer = model.base_model.model.model.embed_tokens
    assert type(layer).__module__ == "peft.tuners.lora.layer"
    with torch.no_grad():  # peft starts A at zero: give B a gradient too
        layer.lora_embedding_A["default"].normal_(0, 0.1)
    prefix = "base_model.model.model.embed_tokens."
    routes = routes_of(model)
    assert routes[prefix + "lora_embedding_A.default"] == ("embedding", (0,), (1,))
    assert routes[prefix + "lora_embedding_B.default"] == ("dense", (1,), (0,))
    evidence = evidence_of(model)[prefix + "lora_embedding_A.default"]
    assert evidence.startswith("module peft lora.Embedding")
    truth = {
        "*lora_embedding_A.default": ("embedding", (0,), (1,)),  # F.embedding(x, A.T)
        "*lora_embedding_B.default": LINEAR,  # after_A @ B.T: B (d, r) = (out, in)
        "*lora_[AB].default.weight": LINEAR,
    }
    check_step(model, lambda m: m(input_ids=tokens(), labels=tokens()).loss, truth)


def test_a_lora_like_table_without_peft_is_refused_with_the_vocab_reading_first():
    class LoraLike(nn.Module):  # peft's names, not peft's class: no module evidence
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(V, D)
            self.lora_embedding_A = nn.ParameterDict({"default": nn.Parameter(torch.zeros(4, V))})

    with pytest.raises(RoutingError) as info:
        route_params(LoraLike())
    assert info.value.overrides == {
        "lora_embedding_A.default": Route("embedding", fan_in=0, fan_out=1)}


XLNET = {
    "transformer.word_embedding.weight": TABLE_ROUTE,
    "*.rel_attn.[qkvr]": ("dense", (0,), (1, 2)),  # einsum('ibh,hnd->ibnd'): h in, (n, d) out
    "*.rel_attn.o": ("dense", (1, 2), (0,)),  # einsum('ibnd,hnd->ibh'): (n, d) in, h out
    # einsum('ibnd,snd->ibns'): per head n (a batch axis), d in, the 2 segments out
    "*.rel_attn.seg_embed": ("embedding", (2,), (0,)),
    "*.ff.layer_?.weight": LINEAR,
}


def test_xlnet_attention_is_module_evidence_and_its_math():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config_cls = getattr(transformers, "XLNetConfig", None)
    if config_cls is None:
        pytest.skip("this transformers has no XLNet")
    torch.manual_seed(0)
    model = transformers.XLNetLMHeadModel(config_cls(vocab_size=V, d_model=D, n_layer=1,
                                                     n_head=2, d_inner=32)).double()
    routes = routes_of(model)
    for name, route in routes.items():
        layout = next((v for k, v in XLNET.items() if fnmatch.fnmatchcase(name, k)), VECTOR)
        assert route == layout, name
    assert evidence_of(model)["transformer.layer.0.rel_attn.r_w_bias"].startswith(
        "module XLNetRelativeAttention")
    types = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    check_step(model, lambda m: m(input_ids=tokens(), token_type_ids=types,
                                  labels=tokens()).loss, XLNET)


def test_a_3d_parameter_of_unknown_module_gets_the_stacked_in_out_reading_first():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, D, 8))  # (L, in, out)

    with pytest.raises(RoutingError) as info:
        route_params(Stack())
    assert info.value.overrides == {"w": Route("dense", fan_in=-2, fan_out=-1)}


def test_a_3d_parameter_of_an_unknown_experts_module_gets_the_out_in_reading_first():
    """Most MoE families read W[e] as F.linear(x, W[e]): (E, out, in) is the first remedy."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, D))  # (E, out, in)

    with pytest.raises(RoutingError) as info:
        route_params(Experts())
    assert info.value.overrides == {"w": Route("dense", fan_in=2, fan_out=1, batch=0)}
    message = str(info.value)
    assert "F.linear(x, W[e]) means (E, out, in)" in message
    assert "x @ W[e] or torch.bmm(x, W) means (E, in, out)" in message
    assert "or Route('dense', fan_in=1, fan_out=2, batch=(0,)) if it is (E, in, out)" in message


# ---------------------------------------------------------------------------
# 3. torch.optim habits
# ---------------------------------------------------------------------------


class Small(nn.Module):
    """Embedding, Linear layers, LayerNorm and an untied head: names that say it all."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, 32)
        self.fc2 = nn.Linear(32, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.lm_head(self.norm(h))


SMALL = {"embed.weight": TABLE_ROUTE, "fc?.weight": LINEAR, "lm_head.weight": TABLE_ROUTE}


def small_double() -> nn.Module:
    torch.manual_seed(0)
    return Small().double()


def test_named_parameters_route_as_the_model():
    model = small_double()
    by_model = routes_of(model)
    assert routes_of(model.named_parameters()) == by_model
    groups = [(g["kind"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"])
              for g in make_optimizer("sage-hybrid", model.named_parameters()).param_groups]
    assert groups == [(g["kind"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"])
                      for g in make_optimizer("sage-hybrid", model).param_groups]
    assert evidence_of(model.named_parameters())["lm_head.weight"] == (  # names only: shape
        "head: shape of the token embedding 'embed.weight' + name")  # and the head's name
    check_step(model, lm_loss, SMALL, params=model.named_parameters())


def test_bare_tensors_place_vectors_and_refuse_matrices_naming_their_index():
    model = small_double()
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model.parameters())
    err = info.value
    message = str(err)
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    matrices = [f"params[{index[n]}]" for n, p in model.named_parameters() if p.dim() == 2]
    assert [p.leaf for p in err.problems] == matrices
    assert f"'params[0]' of shape ({V}, {D})" in message
    assert "a bare tensor" in message and "model.named_parameters()" in message
    assert "route_overrides" in message and paste_block(err) == err.overrides
    # the overrides of the true layouts, by the names the error gave (globs match literally)
    truth = {f"params[{index[n]}]": Route(*(r[0],), fan_in=r[1], fan_out=r[2])
             for n, r in routes_of(model).items() if r[0] != "vector"}
    check_step(model, lm_loss, SMALL, params=model.parameters(), overrides=truth)


@pytest.mark.parametrize("config", ["adamw", "lion"])
def test_element_wise_configs_need_no_layout(config):
    model = small_double()
    opt = make_optimizer(config, model.parameters(), lr=LR)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    if config != "adamw":
        return
    twin = small_double()
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.01)
    for m, o in ((model, opt), (twin, ref)):
        lm_loss(m).backward()
        o.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=n)


def test_layout_dependent_configs_refuse_bare_matrices():
    model = small_double()
    for config in ("sage-pure", "sinkgd-pure", "apollo", "lion-hybrid"):
        with pytest.raises(RoutingError, match="params\\[0\\]"):
            make_optimizer(config, model.parameters())


def test_a_weight_named_only_by_indices_is_refused_where_the_kind_matters():
    seq = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D))
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", seq.named_parameters())
    assert [p.leaf for p in info.value.problems] == ["0.weight", "1.weight"]
    assert "nn.Linear (out, in) or an nn.Embedding table (V, d)" in str(info.value)
    # sage-pure runs SAGE on both kinds, with the same axes: the kind does not matter
    rows = routing_table("sage-pure", seq.named_parameters()).rows
    assert [(r.path, r.fan_in, r.fan_out) for r in rows][:2] == [
        ("0.weight", f"1 ({D})", f"0 ({V})"), ("1.weight", f"1 ({D})", f"0 ({D})")]


def test_param_group_dicts_carry_kinds_axes_and_options():
    model = small_double()
    named = dict(model.named_parameters())
    groups = [
        {"params": [named["embed.weight"], named["lm_head.weight"]], "kind": "embedding"},
        {"params": [("fc1.weight", named["fc1.weight"])], "lr": 3e-3},
        {"params": [named["fc2.weight"]], "kind": "dense", "fan_in_dim": 1, "fan_out_dim": 0},
        {"params": [p for n, p in named.items() if p.dim() == 1], "weight_decay": 0.0},
    ]
    opt = make_optimizer("sage-hybrid", groups, lr=LR)
    got = {(g["kind"], g["lr"], g["weight_decay"], g["fan_in_dim"], g["fan_out_dim"]):
           g["param_names"] for g in opt.param_groups}
    assert got == {
        ("embedding", LR, 0.01, 1, 0): ["param_groups[0].params[0]",
                                        "param_groups[0].params[1]"],
        ("dense", 3e-3, 0.01, 1, 0): ["fc1.weight"],
        ("dense", LR, 0.01, 1, 0): ["param_groups[2].params[0]"],
        ("vector", LR, 0.0, None, None): [f"param_groups[3].params[{i}]" for i in range(4)],
    }
    with pytest.raises(RoutingError, match="no kind; add kind='dense' or kind='embedding'"):
        make_optimizer("sage-hybrid", [{"params": [named["fc2.weight"]], "fan_in_dim": 1,
                                        "fan_out_dim": 0}])
    with pytest.raises(ValueError, match="make_optimizer gives each kind"):
        make_optimizer("sage-hybrid", [{"params": [named["fc2.weight"]], "rule": "adamw"}])


def test_add_param_group_without_kind_routes_by_names_and_shapes():
    model = small_double()
    opt = make_optimizer("sage-hybrid", model, lr=LR)
    extra = nn.Linear(D, 4).double()
    n = len(opt.param_groups)
    opt.add_param_group({"params": [extra.bias]})  # all vectors: the vector kind
    g = opt.param_groups[-1]
    assert (g["kind"], g["rule"], g["fan_out_dim"], g["param_names"]) == (
        "vector", "sage", None, [f"param_groups[{n}].params[0]"])
    with pytest.raises(ValueError, match=(
            rf"param_groups\[{n + 1}\]\.params\[0\] of shape \(4, 16\).*kind=.*"
            r"fan_in_dim=/fan_out_dim=")):
        opt.add_param_group({"params": [extra.weight]})
    with pytest.raises(ValueError, match="mixes kinds.*split it"):
        opt.add_param_group({"params": [(f"extra.{k}", p) for k, p in extra.named_parameters()]})
    assert len(opt.param_groups) == n + 1  # the refused groups left nothing behind
    opt.add_param_group({"params": [extra.weight], "param_names": ["extra.weight"]})
    g = opt.param_groups[-1]
    assert (g["kind"], g["rule"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"]) == (
        "dense", "sinkgd", -1, -2, ["extra.weight"])
    with pytest.raises(ValueError, match="2 param_names for 1 params"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "param_names": ["a", "b"]})
    x = tokens()
    before = extra.weight.detach().clone()
    extra(model(x) @ model.lm_head.weight).square().mean().backward()
    opt.step()
    assert not torch.equal(before, extra.weight)


def test_add_param_group_on_an_element_wise_configuration_takes_bare_matrices():
    opt = make_optimizer("adamw", small_double())
    opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 4, 5))]})
    assert opt.param_groups[-1]["rule"] == "adamw"


def test_params_of_other_forms_fail_like_torch_optim():
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        make_optimizer("adamw", nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="empty parameter list"):
        make_optimizer("adamw", [])
    with pytest.raises(RoutingError, match=re.escape("'params[9]' (nearest: ")):
        make_optimizer("adamw", [nn.Parameter(torch.zeros(3))],
                       route_overrides={"params[9]": "vector"})
