"""sage_torch's router: evidence before guesses, overrides that work, errors whose advice works.

Every error the router raises names the parameter, its shape and an override; each test
below applies the advised override (parsed from the message itself) and checks that the
resulting route, or the resulting update, is the one the layout calls for, against an
independent computation (an ``nn.Linear`` twin, or the float64 NumPy oracle).
"""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference_np import SinkGDRef
from torch import nn

import sage_optim.routing
import sage_torch
from sage_optim.presets import RULE_DEFAULTS
from sage_torch import Route, RoutingError, make_optimizer, param_groups, route_params

pytestmark = pytest.mark.usefixtures("torch_one_thread")

V, D = 32, 16


def routes_of(model, overrides=None):
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
    model = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, 8))
    routed = route_params(model)
    assert [type(r).__name__ for r in routed] == ["RoutedParam"] * 3
    assert [(r.name, r.param is p) for r, (_, p) in zip(routed, model.named_parameters(),
                                                         strict=True)] == [
        ("0.weight", True), ("1.weight", True), ("1.bias", True)]
    assert routed[0].route.shape == (V, D) and routed[0].route.evidence == "module nn.Embedding"


class Tables(nn.Module):
    """No model API: a token table, positions and token types, and Linears whose
    out_features equal those tables' lengths (never a reason to be a head)."""

    def __init__(self, positions=D, head=True):
        super().__init__()
        self.tok_emb = nn.Embedding(V, D)
        self.pos = nn.Embedding(positions, D)
        self.types = nn.Embedding(2, D)
        self.q = nn.Linear(D, positions)  # out_features == number of positions
        self.classifier = nn.Linear(positions, 2)  # out_features == token types
        if head:
            self.proj = nn.Linear(D, V, bias=False)  # (V, d): the token table's shape


def test_heads_come_from_the_token_embedding_never_from_a_table_length():
    routes = routes_of(Tables())
    assert axes(routes["q.weight"]) == ("dense", (1,), (0,))
    assert axes(routes["classifier.weight"]) == ("dense", (1,), (0,))
    assert axes(routes["pos.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["proj.weight"]) == ("embedding", (1,), (0,))  # vocab axis 0: fan-out
    assert routes["proj.weight"].evidence == "head: shape of the token embedding 'tok_emb.weight'"
    routes = routes_of(Tables(head=False))
    assert all(routes[n].kind == "dense" for n in ("q.weight", "classifier.weight"))


def test_without_a_token_embedding_every_table_is_a_candidate():
    """No token table is known (two tables, neither named so): every table's shape counts,
    and the one Linear that fits is the head, with the tables named as its evidence."""
    model = nn.ModuleDict({"a": nn.Embedding(V, D), "b": nn.Embedding(V, D),
                           "proj": nn.Linear(D, V)})
    route = routes_of(model)["proj.weight"]
    assert axes(route) == ("embedding", (1,), (0,))  # vocab axis 0: fan-out
    assert route.evidence == "head: shape of the tables 'a.weight', 'b.weight'"
    # ...and an override says otherwise
    route = routes_of(model, {"proj.weight": "dense"})["proj.weight"]
    assert axes(route) == ("dense", (1,), (0,)) and route.evidence.startswith("override")


def test_a_head_marker_breaks_a_tie_between_square_linears():
    model = nn.ModuleDict({"embed": nn.Embedding(D, D), "fc": nn.Linear(D, D),
                           "lm_head": nn.Linear(D, D, bias=False)})
    routes = routes_of(model)
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
    routes = routes_of(model, name_the_head)
    assert axes(routes["b.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["a.weight"]) == ("dense", (1,), (0,))  # the head is named: a is dense
    opt = make_optimizer("sage-hybrid", model, route_overrides=name_the_head)
    model["b"].weight.grad = torch.randn(D, D)
    opt.step()
    assert opt.state[model["b"].weight]["scale_avg"].shape == (D,)  # reduced over vocab axis 0
    assert {n: r.kind for n, r in routes_of(model, all_dense).items()
            if n.endswith("weight")} == {"embed.weight": "embedding", "a.weight": "dense",
                                         "b.weight": "dense"}


def test_tied_head_registered_first_says_tied_to():
    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(D, V, bias=False)
            self.embed = nn.Embedding(V, D)
            self.embed.weight = self.lm_head.weight

    routes = routes_of(HeadFirst())
    assert list(routes) == ["lm_head.weight"]
    assert axes(routes["lm_head.weight"]) == ("embedding", (1,), (0,))
    assert routes["lm_head.weight"].evidence == "tied to embed.weight"


def test_known_module_layouts():
    model = nn.ModuleDict({
        "bag": nn.EmbeddingBag(V, D), "c1": nn.Conv1d(4, 6, 5), "c3": nn.Conv3d(2, 3, 2),
        "mha": nn.MultiheadAttention(D, 2),
    })
    routes = routes_of(model)
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
    assert axes(routes_of(model, advice)["w"]) == ("dense", (2,), (1,))
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
    routes = routes_of(model, {"c_attn.weight": "embedding", "fc.weight": "embedding",
                               "conv.weight": "embedding", "norm.weight": "vector"})
    assert axes(routes["c_attn.weight"]) == ("embedding", (0,), (1,))  # (in, out): vocab = out
    assert axes(routes["fc.weight"]) == ("embedding", (1,), (0,))
    assert axes(routes["conv.weight"]) == ("embedding", (1, 2, 3), (0,))
    assert all(routes[n].evidence.startswith("override") for n in routes if not n.endswith("bias"))
    with pytest.raises(RoutingError, match="'norm.weight' of shape \\(16,\\).*route it 'vector'"
                       ) as info:
        route_params(model, {"norm.weight": "dense"})
    assert routes_of(model, advised(str(info.value))[0])["norm.weight"].kind == "vector"


def test_kind_only_override_of_an_unknown_layout_asks_for_axes_and_the_example_works():
    model = XW()
    with pytest.raises(RoutingError) as info:
        route_params(model, {"w": "dense"})
    message = str(info.value)
    assert "routed 'dense' by an override" in message and "(8, 12)" in message
    assert "Route('dense', fan_in=0, fan_out=1)" in message
    advice = advice_for(message, "used as x @ W")
    assert axes(routes_of(model, advice)["w"]) == ("dense", (0,), (1,))
    assert routes_of(model, {"w": "vector"})["w"].kind == "vector"  # a kind that needs no axes


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
            self.embed = nn.Embedding(V, D)
            self.lm_head = nn.Linear(D, V, bias=False)
            self.lm_head.weight = self.embed.weight

    route = routes_of(Tied(), {"lm_head.weight": "dense"})["embed.weight"]
    assert axes(route) == ("dense", (1,), (0,))
    with pytest.raises(RoutingError, match="'embed.weight' of shape \\(32, 16\\) is tied") as info:
        route_params(Tied(), {"lm_head.weight": "dense", "embed.weight": "embedding"})
    route = routes_of(Tied(), advised(str(info.value))[0])["embed.weight"]
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
    assert axes(routes_of(model, advice)["a.weight"]) == ("dense", (1,), (0,))


def test_an_api_embedding_of_unknown_layout_asks_for_axes():
    class Table(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(V, D))

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
    assert axes(routes_of(model, advice)["table.weight"]) == ("embedding", (1,), (0,))


def test_every_unplaceable_parameter_is_listed_at_once():
    model = nn.ModuleDict({"a": XW(), "b": XW()})
    with pytest.raises(RoutingError, match="cannot place 2 parameters") as info:
        route_params(model)
    assert "'a.w'" in str(info.value) and "'b.w'" in str(info.value)


# ---------------------------------------------------------------------------
# Sparse embeddings
# ---------------------------------------------------------------------------


def test_sparse_embedding_is_refused_at_construction_and_the_fix_works():
    model = nn.ModuleDict({"embed": nn.EmbeddingBag(V, D, sparse=True), "fc": nn.Linear(D, 4)})
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
    embed = nn.Embedding(V, D, sparse=True)
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


def small():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.LayerNorm(D))


def train(model, opt, sched=None, steps=4):
    x = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(0))
    for _ in range(steps):
        opt.zero_grad()
        (model(x) @ model[0].weight.T).logsumexp(-1).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()


def test_one_cycle_lr_on_a_momentum_free_group_fails_with_our_message_changing_nothing():
    model = small()
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
    model = small()
    opt = make_optimizer(name, model)
    b2 = [g["betas"][1] for g in opt.param_groups]
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=8,
                                                pct_start=0.5)
    assert all(g["betas"][0] == 0.95 for g in opt.param_groups)  # max_momentum at the start
    train(model, opt, sched, steps=3)
    assert all(g["betas"][0] == pytest.approx(0.85) for g in opt.param_groups)  # at the peak
    assert [g["betas"][1] for g in opt.param_groups] == b2


def test_add_param_group_by_kind_or_rule_with_or_without_names():
    model = small()
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
    x = torch.randint(0, V, (3, 5))
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
