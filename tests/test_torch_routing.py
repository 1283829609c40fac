"""sage_torch's router, param groups, the eight configurations and their routing tables.

The rule table and the state-size formulas below are written out by hand from docs/
sections 2-4 (not read from :mod:`sage_optim.presets`), so a wrong preset or a wrong state
shape shows up as a disagreement.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import sage_optax
import sage_torch
from sage_optim import CONFIG_NAMES
from sage_torch import RoutingError, make_optimizer, param_groups, routing_table

V, D, H = 32, 16, 48  # H != V: the router takes a Linear with out_features == V for a head


pytestmark = pytest.mark.usefixtures("torch_one_thread")


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
        self.embed = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)
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
    x = torch.randint(0, V, (4, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    assert len(opt.state) == len(params)
    st = opt.state[model.lm_head.weight]
    assert st is opt.state[model.embed.weight]
    assert st["exp_avg"].shape == (V, D) and st["scale_avg"].shape == (D,)  # O(d): over V


def test_untied_head_is_a_vocab_matrix():
    torch.manual_seed(0)
    model = LM(tied=False)
    kinds = kinds_of(param_groups(model, "sage-hybrid"))
    assert kinds["lm_head.weight"] == "embedding" and kinds["embed.weight"] == "embedding"
    opt = make_optimizer("sage-hybrid", model)
    x = torch.randint(0, V, (4, 8))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    assert opt.state[model.lm_head.weight]["scale_avg"].shape == (D,)  # reduced over V, dim 0
    assert opt.state[model.lm_head.weight] is not opt.state[model.embed.weight]


def test_untied_head_without_marker_or_embedding_is_found_by_vocab_size():
    model = nn.ModuleDict({"tok": nn.Embedding(V, D), "out": nn.Linear(D, V, bias=False)})
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
    x = torch.randint(0, V, (4, 8))
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
TABLE = {
    "adamw": ("adamw", "adamw", "adamw"),
    "lion": ("lion", "lion", "lion"),
    "apollo": ("adamw", "apollo", "adamw"),
    "sinkgd-pure": ("sinkgd(sqrt, alpha=0.05)", "sinkgd(sqrt, alpha=0.05)", "unit_norm"),
    "sinkgd-hybrid": ("adamw", "sinkgd(sqrt, alpha=0.05)", "adamw"),
    "lion-hybrid": ("lion", "sinkgd(unit, alpha=10)", "adamw"),
    "sage-pure": ("sage", "sage", "sage"),
    "sage-hybrid": ("sage", "sinkgd(unit, alpha=10)", "sage"),
}
TOY_LR = {name: 1e-2 for name in TABLE} | {"sinkgd-pure": 5e-2}  # loss ratios 0.0-0.21


class Toy(nn.Module):
    """Embedding, two Linear, LayerNorm; the head is tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
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
        rule = TABLE[name][("embedding", "dense", "vector").index(kind)].split("(")[0]
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
    assert set(CONFIG_NAMES) == set(TABLE)
    torch.manual_seed(0)
    model = Toy()
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(1))
    x = torch.arange(V).repeat(4)
    y = perm[x]  # next token = a fixed permutation of the current one
    opt = make_optimizer(name, model, lr=TOY_LR[name])
    table = routing_table(name, model)
    assert [r[3] for r in table.rows] == [
        TABLE[name][("embedding", "dense", "vector").index(r[2])] for r in table.rows]
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
    x = torch.arange(V)
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
    # kind, rule and bytes: the first fields and the last of both row forms
    expected = {r[0]: (tuple(r[1]), r[2], r[3], r[-1]) for r in theirs.rows}
    assert mapped == expected
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
    assert text.splitlines()[0].split() == ["path", "shape", "kind", "rule", "fan-in",
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
