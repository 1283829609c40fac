"""sage_torch optimizers as objects: ``load_state_dict`` checks what it loads, and
``torch.save``/``torch.load`` of the whole optimizer and ``copy.deepcopy`` give an optimizer
whose next step is bit for bit the original's, for every configuration.
"""

from __future__ import annotations

import copy
import io
import itertools

import pytest
import torch
from torch import nn

import sage_torch
from sage_optim.presets import CONFIG_NAMES

pytestmark = pytest.mark.usefixtures("torch_one_thread")


class TinyLM(nn.Module):
    """An embedding, two dense matrices, a norm and a bias: three groups in every config."""

    def __init__(self, vocab: int = 16, width: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width, bias=False)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.out(torch.relu(self.fc(self.embed(x)))))
        return h @ self.embed.weight.T


def set_grads(params: list[torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)


def all_params(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for g in opt.param_groups for p in g["params"]]


def stepped(name: str, model: nn.Module | None = None, steps: int = 2,
            **kw: object) -> torch.optim.Optimizer:
    opt = sage_torch.make_optimizer(name, model or TinyLM(), lr=1e-2, **kw)
    for t in range(steps):
        set_grads(all_params(opt), t)
        opt.step()
    return opt


def one_line_error(excinfo: pytest.ExceptionInfo[ValueError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# ---------------------------------------------------------------------------
# load_state_dict: the saved state must fit this optimizer
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(("saved", "target"), list(itertools.permutations(CONFIG_NAMES, 2)))
def test_state_dict_of_another_configuration_is_refused(saved, target):
    """All 56 ordered pairs: the saved rules never replace this optimizer's."""
    sd = stepped(saved).state_dict()
    opt = sage_torch.make_optimizer(target, TinyLM(), lr=1e-2)
    rules = [g["rule"] for g in opt.param_groups]
    with pytest.raises(ValueError, match=r"param group \d+ .*rule") as excinfo:
        opt.load_state_dict(sd)
    msg = one_line_error(excinfo)
    index = next(i for i, (g, s) in enumerate(zip(opt.param_groups, sd["param_groups"],
                                                  strict=True)) if g["rule"] != s["rule"])
    assert f"param group {index} " in msg
    assert repr(sd["param_groups"][index]["rule"]) in msg and repr(rules[index]) in msg
    assert [g["rule"] for g in opt.param_groups] == rules  # nothing was changed
    assert not opt.state


def test_state_dict_of_a_torch_optimizer_is_refused():
    model = TinyLM()
    torch_opt = torch.optim.AdamW(model.parameters())
    set_grads(list(model.parameters()), 0)
    torch_opt.step()
    opt = sage_torch.make_optimizer("adamw", TinyLM())
    sd = torch_opt.state_dict()
    sd["param_groups"] = [dict(sd["param_groups"][0], params=[i]) for i in range(3)]
    with pytest.raises(ValueError, match="param group 0 .* rule None in the state dict"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("name", [n for n in CONFIG_NAMES if n != "sinkgd-pure"])
def test_state_dict_with_wrong_shapes_is_refused(name):
    """A checkpoint of a model with another vocabulary or width: refused, naming the
    parameter, the state key and both shapes (not a size error at the next step).
    (``sinkgd-pure`` keeps no tensor of the parameters' shapes: only step counts.)"""
    sd = stepped(name, TinyLM(vocab=20, width=4)).state_dict()
    opt = sage_torch.make_optimizer(name, TinyLM(vocab=16, width=4), lr=1e-2)
    with pytest.raises(ValueError, match=r"parameter embed\.weight of param group \d+ "
                       r"\(kind 'embedding', rule '[a-z_]+'\): state '\w+' has shape \(20,"
                       ) as excinfo:
        opt.load_state_dict(sd)
    one_line_error(excinfo)
    assert not opt.state


@pytest.mark.parametrize("name", ["sage-hybrid", "adamw", "apollo", "lion"])
def test_state_dict_with_missing_or_extra_keys_is_refused(name):
    opt = stepped(name)
    sd = opt.state_dict()
    pid = sd["param_groups"][0]["params"][0]
    key = sorted(k for k in sd["state"][pid] if k != "step")[0]
    missing = copy.deepcopy(sd)
    del missing["state"][pid][key]
    fresh = sage_torch.make_optimizer(name, TinyLM(), lr=1e-2)
    with pytest.raises(ValueError, match=rf"parameter embed\.weight .* \(missing \['{key}'\]\)"
                       ) as excinfo:
        fresh.load_state_dict(missing)
    one_line_error(excinfo)
    extra = copy.deepcopy(sd)
    extra["state"][pid]["bogus"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"\(unexpected \['bogus'\]\)"):
        fresh.load_state_dict(extra)
    no_step = copy.deepcopy(sd)
    del no_step["state"][pid]["step"]
    with pytest.raises(ValueError, match=r"\(missing \['step'\]\)"):
        fresh.load_state_dict(no_step)
    assert not fresh.state


def test_state_dict_with_wrong_dtype_family_or_type_is_refused():
    sd = stepped("sage-hybrid").state_dict()
    pid = sd["param_groups"][0]["params"][0]
    bad = copy.deepcopy(sd)
    bad["state"][pid]["scale_avg"] = bad["state"][pid]["scale_avg"].to(torch.int64)
    opt = sage_torch.make_optimizer("sage-hybrid", TinyLM())
    with pytest.raises(ValueError, match=r"state 'scale_avg' is torch.int64, .* floating"):
        opt.load_state_dict(bad)
    bad = copy.deepcopy(sd)
    bad["state"][pid]["exp_avg"] = bad["state"][pid]["exp_avg"].tolist()
    with pytest.raises(ValueError, match=r"state 'exp_avg' is a list, not a tensor"):
        opt.load_state_dict(bad)


def test_group_and_parameter_counts_are_named():
    sd = stepped("sage-hybrid").state_dict()
    opt = sage_torch.make_optimizer("sage-hybrid", TinyLM())
    fewer = dict(sd, param_groups=sd["param_groups"][:2])
    with pytest.raises(ValueError, match=r"^state dict has 2 param groups, this optimizer "
                       r"has 3$"):
        opt.load_state_dict(fewer)
    groups = copy.deepcopy(sd["param_groups"])
    groups[1]["params"] = groups[1]["params"][:1]
    with pytest.raises(ValueError, match=r"param group 1 \(kind 'dense', rule 'sinkgd'\) has 1 "
                       r"parameters in the state dict but 2 in this optimizer"):
        opt.load_state_dict(dict(sd, param_groups=groups))


def test_invalid_saved_hyperparameter_is_refused():
    sd = stepped("sage-hybrid").state_dict()
    sd["param_groups"][0]["betas"] = (0.9, 1.5)
    opt = sage_torch.make_optimizer("sage-hybrid", TinyLM())
    with pytest.raises(ValueError, match=r"param group 0 .*: betas\[1\] \(b2\) must be in"):
        opt.load_state_dict(sd)


def test_partial_state_loads_and_is_checked_per_parameter():
    """Parameters without gradients have no state: that loads (and steps as the original);
    a parameter with state is still checked."""
    model = TinyLM()
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=1e-2)
    set_grads(all_params(opt), 0)
    model.norm.weight.grad = model.norm.bias.grad = None
    opt.step()
    sd = copy.deepcopy(opt.state_dict())  # as a checkpoint: no tensor shared with opt
    assert len(sd["state"]) == len(all_params(opt)) - 2
    copy_model = copy.deepcopy(model)
    fresh = sage_torch.make_optimizer("sage-hybrid", copy_model, lr=1e-2)
    fresh.load_state_dict(sd)
    for o in (opt, fresh):
        set_grads(all_params(o), 1)
        o.step()
    for a, b in zip(model.parameters(), copy_model.parameters(), strict=True):
        assert torch.equal(a, b)
    bad = copy.deepcopy(sd)
    pid = sd["param_groups"][0]["params"][0]
    bad["state"][pid]["scale_avg"] = torch.zeros(5)
    with pytest.raises(ValueError, match=r"state 'scale_avg' has shape \(5,\), this "
                       r"optimizer expects \(4,\)"):
        sage_torch.make_optimizer("sage-hybrid", TinyLM()).load_state_dict(bad)


def test_bfloat16_state_dtypes_kept_and_shapes_checked():
    """A bfloat16 model's float32 ``S`` loads as float32 (the dtype-keeping rule), and a
    shape mismatch is refused there too."""
    model = TinyLM().to(torch.bfloat16)
    opt = stepped("sage-pure", model)
    sd = opt.state_dict()
    fresh = sage_torch.make_optimizer("sage-pure", TinyLM().to(torch.bfloat16))
    fresh.load_state_dict(sd)
    p = fresh.param_groups[0]["params"][0]
    assert fresh.state[p]["scale_avg"].dtype == torch.float32
    assert fresh.state[p]["exp_avg"].dtype == torch.bfloat16
    bad = copy.deepcopy(sd)
    pid = sd["param_groups"][0]["params"][0]
    bad["state"][pid]["exp_avg"] = torch.zeros(3, 4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"state 'exp_avg' has shape \(3, 4\)"):
        sage_torch.make_optimizer("sage-pure", TinyLM().to(torch.bfloat16)).load_state_dict(bad)


# ---------------------------------------------------------------------------
# torch.save / torch.load of the whole optimizer, copy.deepcopy
# ---------------------------------------------------------------------------


def saved_and_loaded(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    buf = io.BytesIO()
    torch.save(opt, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_copied_optimizer_steps_as_the_original(name, foreach, how):
    opt = stepped(name, foreach=foreach)
    twin = copy.deepcopy(opt) if how == "deepcopy" else saved_and_loaded(opt)
    assert type(twin) is type(opt)
    mine, theirs = all_params(opt), all_params(twin)
    assert all(a is not b for a, b in zip(mine, theirs, strict=True))
    for params in (mine, theirs):
        set_grads(params, 7)
    opt.step()
    twin.step()
    for a, b in zip(mine, theirs, strict=True):
        assert torch.equal(a, b)
        assert opt.state[a].keys() == twin.state[b].keys()
        for key in opt.state[a]:
            assert torch.equal(opt.state[a][key], twin.state[b][key]), key
    assert [g["rule"] for g in opt.param_groups] == [g["rule"] for g in twin.param_groups]
    twin.add_param_group({"params": [nn.Parameter(torch.ones(3))], "kind": "vector"})
    assert twin.param_groups[-1]["rule"] == opt.kinds["vector"]["rule"]


@pytest.mark.parametrize("how", ["deepcopy", "torch.save"])
def test_copied_skip_nonfinite_keeps_its_counters(how):
    opt = stepped("sage-hybrid", skip_nonfinite=3, cpu_threads=2)
    for p in all_params(opt):
        p.grad = torch.full_like(p, float("nan"))
    opt.step()
    twin = copy.deepcopy(opt) if how == "deepcopy" else saved_and_loaded(opt)
    assert (twin.skip_nonfinite, twin.nonfinite_count, twin.total_nonfinite) == (3, 1, 1)
    assert all(r.cpu_threads == 2 for r in twin._rules.values())
    for p in all_params(twin):
        p.grad = torch.full_like(p, float("nan"))
    before = [p.clone() for p in all_params(twin)]
    twin.step()  # the second non-finite step in a row: skipped
    assert twin.nonfinite_count == 2
    assert all(torch.equal(a, b) for a, b in zip(all_params(twin), before, strict=True))


def test_copied_apollo_keeps_an_injected_projection():
    def projection(name: str, k: int, n: int, r: int) -> torch.Tensor:
        return torch.ones(n, r) / r

    model = TinyLM()
    opt = sage_torch.make_optimizer("apollo", model, dense_projection=projection)
    twin = copy.deepcopy(opt)
    assert twin.rule_of(twin.param_groups[1]).projection is projection


# issue 33: same-shape parameters listed in another order keep their own moments
def test_load_state_dict_matches_parameters_by_their_names():
    torch.manual_seed(0)
    a, b, c = (nn.Parameter(torch.randn(4, 3)) for _ in range(3))
    opt = sage_torch.Lion([{"params": [("a", a), ("b", b)]}, {"params": [("c", c)],
                                                                "lr": 1e-3}], lr=1e-2)
    for p, scale in ((a, 1.0), (b, 10.0), (c, 100.0)):
        p.grad = scale * torch.randn(4, 3)
    opt.step()
    saved = opt.state_dict()
    # the same parameters, listed in another order, their groups swapped too
    again = sage_torch.Lion([{"params": [("c", c)], "lr": 1e-3},
                             {"params": [("b", b), ("a", a)]}], lr=1e-2)
    again.load_state_dict(saved)
    for p in (a, b, c):
        assert torch.equal(again.state[p]["exp_avg"], opt.state[p]["exp_avg"])
    assert [g["lr"] for g in again.param_groups] == [1e-3, 1e-2]
    assert again.param_groups[1]["param_names"] == ["b", "a"]
    # names that cannot be mapped one to one are refused, naming the first
    renamed = sage_torch.Lion([{"params": [("a", a), ("z", b)]}, {"params": [("c", c)],
                                                                   "lr": 1e-3}], lr=1e-2)
    with pytest.raises(ValueError, match=r"parameter 'z' of this optimizer is not in the "
                                         r"state dict's param_names"):
        renamed.load_state_dict(saved)
    split = sage_torch.Lion([{"params": [("a", a), ("c", c)]}, {"params": [("b", b)]}],
                            lr=1e-2)
    with pytest.raises(ValueError, match="the parameters of param group 0 .* are not one "
                                         "param group of the state dict"):
        split.load_state_dict(saved)
    assert not renamed.state and not split.state  # nothing loaded
