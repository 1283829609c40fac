"""torch.optim's contract, checked over every sage_torch optimizer: one table, the same checks.

In the spirit of PyTorch's own ``OptimizerInfo`` table
(``torch/testing/_internal/common_optimizers.py``) and the ``TestOptimRenewed`` checks it
drives (pytorch's ``test/test_optim.py``; that module needs ``expecttest``, not a
dependency here, so the checks are written out with ``torch.testing.assert_close`` and
``torch.optim``'s own optimizers as references): :data:`ENTRIES` lists every class (with a
few hyperparameter sets each), every ``make_optimizer`` configuration and a
``skip_nonfinite`` variant, each with ``foreach`` on and off, and every check below runs
on every entry (CPU, float64, tiny tensors).

Where sage_torch differs from ``torch.optim`` on purpose, the entry records it
(:data:`DIFFERENCES`, stated in docs/pytorch.md) and a check asserts the
difference holds, so that it stays deliberate.

pytorch's class itself runs over sage_torch with ``scripts/torch-optim-contract`` (given a
pytorch checkout's test file); the last tests here check that script and its entries
(``scripts/torch_optim_infos.py``) where ``expecttest`` is installed.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import math
import os
import pathlib
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing import assert_close

import sage_torch
from sage_optim import hyperparams
from sage_optim.presets import CONFIG_NAMES, PRESETS, RULE_DEFAULTS
from sage_torch import APOLLO, SAGE, Lion, RuleOptimizer, SinkGD, registry

pytestmark = pytest.mark.usefixtures("torch_one_thread")

ROOT = pathlib.Path(__file__).resolve().parents[2]
LR = 1e-2
FOREACH_TOL = 1e-12  # float64: the two paths differ by the order of a few sums at most

DIFFERENCES: dict[str, str] = {
    "groups": "one param group per kind and layout",
    "evidence": "a matrix needs evidence of its layout",
    "matrices": "take matrices only",
    "complex": "refuse complex parameters",
    "dtype": "keeps its saved dtype",
    "names": "groups of bare tensors and of named ones mix",
}
"""How sage_torch deliberately differs from ``torch.optim``, as docs/pytorch.md
words it (each phrase appears there): ``groups``: ``make_optimizer`` (and
``add_param_group`` with a module) makes one param group per kind and layout, not one per
group given; ``evidence``: ``make_optimizer`` refuses a bare matrix nothing places;
``matrices``: SinkGD and APOLLO take matrices only (``fallback=`` for the rest);
``complex``: SAGE, SinkGD and APOLLO refuse complex parameters; ``dtype``: floating state
keeps its saved dtype on load (``torch.optim`` casts it to the parameter's); ``names``: a
param group of bare tensors may join named groups, and the other way (``torch.optim``
refuses it), the bare ones named by their place, ``param_groups[g].params[i]``."""


class Net(nn.Module):
    """A token table (tied head), a Linear with bias, a norm and a Linear without bias."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.emb = nn.Embedding(12, 6)
        self.fc = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Linear(8, 6, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.double()


@dataclasses.dataclass(frozen=True)
class Entry:
    """One optimizer configuration of the table.

    ``build(params, **extra)`` makes the optimizer for ``params``: an ``nn.Module`` for
    the configurations, what ``torch.optim`` takes (tensors, pairs, groups) for the
    classes.  ``rules``: the rules it runs on :class:`Net`; ``differs``: the keys of
    :data:`DIFFERENCES` that hold for it.
    """

    id: str
    build: Callable[..., torch.optim.Optimizer]
    config: str | None  # the make_optimizer configuration, or None for a class
    rules: tuple[str, ...]
    foreach: bool
    differs: tuple[str, ...] = ()

    def make(self, model: nn.Module, how: str = "model", **extra: Any) -> torch.optim.Optimizer:
        """The optimizer for ``model``'s parameters, given as ``how`` says.

        ``model``: the module (configurations) or ``model.parameters()`` (classes);
        ``named``: ``model.named_parameters()``; ``bare``: ``model.parameters()`` (with
        ``model=`` for the configurations).
        """
        if self.config is None:
            params: Any = (model.named_parameters() if how == "named" else model.parameters())
            return self.build(params, foreach=self.foreach, **extra)
        if how == "named":
            return self.build(model.named_parameters(), foreach=self.foreach, **extra)
        if how == "bare":
            return self.build(model.parameters(), model=model, foreach=self.foreach, **extra)
        return self.build(model, foreach=self.foreach, **extra)


def _class_entries() -> list[Entry]:
    out = []
    specs: list[tuple[str, Callable[..., torch.optim.Optimizer], tuple[str, ...], bool,
                      tuple[str, ...]]] = []
    for hp_id, hp in (("defaults", {}), ("wd0.1-b0.8", {"weight_decay": 0.1,
                                                       "betas": (0.8, 0.95)})):
        specs.append((f"SAGE-{hp_id}", lambda ps, hp=hp, **kw: SAGE(ps, lr=LR, **hp, **kw),
                      ("sage",), bool(hp), ("complex",)))
        specs.append((f"Lion-{hp_id}", lambda ps, hp=hp, **kw: Lion(ps, lr=LR, **hp, **kw),
                      ("lion",), bool(hp), ()))
        specs.append((f"adamw-{hp_id}", lambda ps, hp=hp, **kw: RuleOptimizer(
            ps, {"rule": "adamw", "lr": LR, **hp, **kw}), ("adamw",), bool(hp), ()))
    for hp_id, hp in (("defaults", {}), ("sqrt-wd0.1", {"normalization": "sqrt", "alpha": 0.05,
                                                         "weight_decay": 0.1})):
        specs.append((f"SinkGD-{hp_id}", lambda ps, hp=hp, **kw: SinkGD(
            ps, lr=LR, **{"fallback": "adamw", **hp, **kw}), ("sinkgd", "adamw"), bool(hp),
            ("matrices", "complex")))
    for hp_id, hp in (("defaults", {}), ("channel-wd0.1", {"scale_type": "channel", "rank": 3,
                                                            "weight_decay": 0.1})):
        base = {"rank": 2, **hp}
        specs.append((f"APOLLO-{hp_id}", lambda ps, hp=base, **kw: APOLLO(
            ps, lr=LR, update_proj_gap=2, **{"fallback": "adamw", **hp, **kw}),
            ("apollo", "adamw"),
            bool(hp), ("matrices", "complex")))
    for hp_id, hp in (("defaults", {}), ("wd0.1", {"weight_decay": 0.1})):
        specs.append((f"unit_norm-{hp_id}", lambda ps, hp=hp, **kw: RuleOptimizer(
            ps, {"rule": "unit_norm", "lr": LR, **hp, **kw}), ("unit_norm",), bool(hp), ()))
    for sid, build, rules, _, differs in specs:
        for fe in (False, True):
            out.append(Entry(f"{sid}-{'foreach' if fe else 'single'}", build, None, rules,
                             fe, ("dtype", "names", *differs)))
    return out


def _config_entries() -> list[Entry]:
    out = []
    for name in CONFIG_NAMES:
        preset = PRESETS[name]
        rules = tuple(dict.fromkeys(preset.rule(k).name for k in ("embedding", "dense",
                                                                   "vector")))
        extra = {"dense_update_proj_gap": 2, "dense_rank": 2} if name == "apollo" else {}
        for fe in (False, True):
            out.append(Entry(
                f"{name}-{'foreach' if fe else 'single'}",
                lambda ps, name=name, extra=extra, **kw: sage_torch.make_optimizer(
                    name, ps, lr=LR, **extra, **kw),
                name, rules, fe, ("dtype", "groups", "evidence", "names")))
    for fe in (False, True):
        out.append(Entry(f"sage-hybrid-skip_nonfinite-{'foreach' if fe else 'single'}",
                         lambda ps, **kw: sage_torch.make_optimizer(
                             "sage-hybrid", ps, lr=LR, skip_nonfinite=2, **kw),
                         "sage-hybrid", ("sage", "sinkgd"), fe,
                         ("dtype", "groups", "evidence", "names")))
    return out


ENTRIES: list[Entry] = _class_entries() + _config_entries()
IDS = [e.id for e in ENTRIES]
FOREACH = [e for e in ENTRIES if e.foreach]


def _grads(model: nn.Module, seed: int, scale: float = 1.0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [scale * torch.randn(p.shape, generator=gen, dtype=p.dtype)
            for p in model.parameters()]


def _step(opt: torch.optim.Optimizer, model: nn.Module, seed: int, scale: float = 1.0,
          only_trainable: bool = False) -> None:
    for p, g in zip(model.parameters(), _grads(model, seed, scale), strict=True):
        p.grad = g if p.requires_grad or not only_trainable else None
    opt.step()


def _same(a: nn.Module, b: nn.Module, tol: float = 0.0) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        if tol:
            assert_close(p, q, rtol=0, atol=tol, msg=lambda m, n=n: f"{n}: {m}")
        else:
            assert torch.equal(p, q), f"{n}: max |diff| {float((p - q).abs().max()):.3e}"


def _through_bytes(state_dict: dict[str, Any]) -> dict[str, Any]:
    buf = io.BytesIO()
    torch.save(state_dict, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


# ---------------------------------------------------------------------------
# the checks, every entry
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("entry", FOREACH, ids=[e.id.removesuffix("-foreach") for e in FOREACH])
def test_foreach_matches_single_tensor(entry):
    single_entry = dataclasses.replace(entry, foreach=False)
    a, b = Net(), Net()
    opt_a, opt_b = entry.make(a), single_entry.make(b)
    for t in range(5):
        _step(opt_a, a, t)
        _step(opt_b, b, t)
    _same(a, b, FOREACH_TOL)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_state_dict_round_trip_named_and_unnamed(entry):
    """Saved from one form of ``params``, loaded (weights_only) into another: exact resume."""
    forms = ["model", "named"] if entry.config is None else ["model", "named", "bare"]
    for src, dst in zip(forms, forms[1:] + forms[:1], strict=True):
        model = Net()
        opt = entry.make(model, src)
        for t in range(3):
            _step(opt, model, t)
        saved = _through_bytes(opt.state_dict())
        twin = copy.deepcopy(model)
        resumed = entry.make(twin, dst)
        resumed.load_state_dict(saved)
        for t in range(3, 6):
            _step(opt, model, t)
            _step(resumed, twin, t)
        _same(model, twin)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_hooks_are_called(entry):
    model = Net()
    opt = entry.make(model)
    seen: list[str] = []
    before = [p.detach().clone() for p in model.parameters()]

    def post(o, args, kwargs):
        seen.append("post")
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))

    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append("pre"))
    opt.register_step_post_hook(post)
    opt.register_state_dict_pre_hook(lambda o: seen.append("sd-pre"))
    opt.register_state_dict_post_hook(lambda o, sd: seen.append("sd-post"))
    opt.register_load_state_dict_pre_hook(lambda o, sd: seen.append("load-pre"))
    opt.register_load_state_dict_post_hook(lambda o: seen.append("load-post"))
    _step(opt, model, 0)
    opt.load_state_dict(opt.state_dict())
    assert seen == ["pre", "post", "sd-pre", "sd-post", "load-pre", "load-post"], seen


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_zero_gradients(entry):
    """A zero gradient moves nothing but the decay: ``θ ← θ·(1 − η·w)``."""
    for wd in (0.0, 0.1):
        model = Net()
        before = copy.deepcopy(model)
        opt = entry.make(model)
        for group in opt.param_groups:
            group["weight_decay"] = wd
        for _ in range(2):
            _step(opt, model, 0, scale=0.0)
        if wd == 0.0:
            _same(model, before)
        else:
            for p, q in zip(model.parameters(), before.parameters(), strict=True):
                assert_close(p, q * (1 - LR * wd) ** 2, rtol=1e-14, atol=0)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_tensor_learning_rate(entry):
    a, b = Net(), Net()
    opt_a, opt_b = entry.make(a), entry.make(b)
    for group in opt_b.param_groups:
        group["lr"] = torch.tensor(group["lr"], dtype=torch.float64)
    for t in range(3):
        _step(opt_a, a, t)
        _step(opt_b, b, t)
    _same(a, b)


def _noncontiguous(model: nn.Module) -> nn.Module:
    """``model`` with every parameter replaced by a non-contiguous tensor of equal values."""
    for module in model.modules():
        for name, p in list(module._parameters.items()):  # noqa: SLF001
            if p is None:
                continue
            if p.dim() >= 2:
                data = p.detach().transpose(0, 1).contiguous().transpose(0, 1)
            else:
                data = torch.zeros(2 * p.numel(), dtype=p.dtype)[::2].view(p.shape)
                data.copy_(p.detach())
            assert not data.is_contiguous() or p.numel() <= 1
            setattr(module, name, nn.Parameter(data))
    return model


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_noncontiguous_parameters(entry):
    plain, strided = Net(), _noncontiguous(Net())
    opt_a, opt_b = entry.make(plain), entry.make(strided)
    for t in range(3):
        _step(opt_a, plain, t)
        _step(opt_b, strided, t)
    _same(plain, strided, FOREACH_TOL)
    assert any(not p.is_contiguous() for p in strided.parameters())


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_maximize(entry):
    up, down = Net(), Net()
    opt_up, opt_down = entry.make(up, maximize=True), entry.make(down)
    for t in range(3):
        _step(opt_up, up, t)
        _step(opt_down, down, t, scale=-1.0)
    _same(up, down)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_schedulers_including_reduce_lr_on_plateau(entry):
    model = Net()
    opt = entry.make(model)
    base = [g["lr"] for g in opt.param_groups]
    zero = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.0)
    before = copy.deepcopy(model)
    _step(opt, model, 0)  # lr 0: the scheduled rate is the one used, so nothing moves
    _same(model, before)
    zero.step()
    for group, lr in zip(opt.param_groups, base, strict=True):
        group["lr"] = lr
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=0)
    for t in range(3):
        _step(opt, model, t)
        plateau.step(1.0)  # no improvement after the first epoch: halve every group's rate
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([b * 0.25 for b in base])
    steps = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _step(opt, model, 3)
    steps.step()
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([b * 0.125 for b in base])


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_deepcopy_steps_as_the_original(entry):
    model = Net()
    opt = entry.make(model)
    for t in range(2):
        _step(opt, model, t)
    twin_opt = copy.deepcopy(opt)
    twin_params = [p for g in twin_opt.param_groups for p in g["params"]]
    params = [p for g in opt.param_groups for p in g["params"]]
    for t in range(2, 4):
        gen = torch.Generator().manual_seed(t)
        for p, q in zip(params, twin_params, strict=True):
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            q.grad = p.grad.clone()
        opt.step()
        twin_opt.step()
    for p, q in zip(params, twin_params, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_frozen_then_unfrozen(entry):
    """Frozen at build time (a matrix and a vector): kept, untouched, trained once unfrozen."""
    model = Net()
    model.fc.weight.requires_grad_(False)
    model.norm.weight.requires_grad_(False)
    opt = entry.make(model)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert {id(p) for p in model.parameters()} <= held
    frozen = [model.fc.weight, model.norm.weight]
    before = [p.detach().clone() for p in frozen]
    for t in range(2):
        _step(opt, model, t, only_trainable=True)
    for p, b in zip(frozen, before, strict=True):
        assert torch.equal(p, b) and p not in opt.state
    model.requires_grad_(True)
    for t in range(2, 4):
        _step(opt, model, t, only_trainable=True)
    for p, b in zip(frozen, before, strict=True):
        assert not torch.equal(p, b) and opt.state[p]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.foreach],
                         ids=[e.id for e in ENTRIES if not e.foreach])
def test_a_fully_frozen_model_builds(entry):
    model = Net().requires_grad_(False)
    opt = entry.make(model)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    opt.step()  # no gradient: nothing to do


def _tensors(model: nn.Module, entry: Entry) -> list[torch.Tensor]:
    """Parameters ``entry`` takes as bare tensors: all of them for a class; the vectors for
    a configuration (a bare matrix needs evidence of its layout, :data:`DIFFERENCES`)."""
    params = list(model.parameters())
    return params if entry.config is None else [p for p in params if p.dim() == 1]


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_state_dict_loads_by_position_between_named_and_bare_tensors(entry):
    """issue 42: built from bare tensors on one side and from (name, tensor) pairs on the
    other (either way), a state dict loads by position, as torch.optim's does, and the
    resumed optimizer steps as the original."""
    for src, dst in (("bare", "named"), ("named", "bare")):
        model = Net()
        tensors = _tensors(model, entry)

        def make(how: str, tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
            given = ([(f"w{i}", t) for i, t in enumerate(tensors)] if how == "named"
                     else list(tensors))
            return entry.build(given, foreach=entry.foreach)

        opt = make(src, tensors)
        for t in range(3):
            _step(opt, model, t)
        twin = copy.deepcopy(model)
        resumed = make(dst, _tensors(twin, entry))
        saved = _through_bytes(opt.state_dict())
        # real names win over none or the placeholders of bare tensors (torch.optim takes
        # the saved names; placeholders never replace real ones)
        names = [g.get("param_names") for g in (saved if src == "named" else resumed.state_dict())[
            "param_groups"]]
        resumed.load_state_dict(saved)
        assert [g.get("param_names") for g in resumed.param_groups] == names
        for t in range(3, 6):
            _step(opt, model, t)
            _step(resumed, twin, t)
        _same(model, twin)


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_state_dict_without_newer_options_loads(entry):
    """A checkpoint whose groups lack the flags added later (``maximize``, ``foreach``,
    ``capturable``, ``fused``, ``differentiable``) loads and resumes exactly, those options
    taken from the loading optimizer, as torch.optim fills them in (pytorch's
    ``test_can_load_older_state_dict``; issue 42: it ended in ``KeyError: 'maximize'``)."""
    model = Net()
    opt = entry.make(model)
    for t in range(3):
        _step(opt, model, t)
    saved = copy.deepcopy(opt.state_dict())
    flags = ("maximize", "foreach", "capturable", "fused", "differentiable")
    assert any(f in g for g in saved["param_groups"] for f in flags)
    for group in saved["param_groups"]:
        for flag in flags:
            group.pop(flag, None)
    twin = copy.deepcopy(model)
    resumed = entry.make(twin)
    resumed.load_state_dict(saved)
    for mine, theirs in zip(resumed.param_groups, opt.param_groups, strict=True):
        assert {f: mine.get(f) for f in flags} == {f: theirs.get(f) for f in flags}
    for t in range(3, 6):
        _step(opt, model, t)
        _step(resumed, twin, t)
    _same(model, twin)


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.foreach],
                         ids=[e.id for e in ENTRIES if not e.foreach])
def test_state_dict_of_another_parameter_count_is_one_line(entry):
    model = Net()
    tensors = _tensors(model, entry)
    opt = entry.build([(f"w{i}", t) for i, t in enumerate(tensors)])
    _step(opt, model, 0)
    fewer = entry.build(tensors[:-1])
    with pytest.raises(ValueError) as info:
        fewer.load_state_dict(opt.state_dict())
    assert "\n" not in str(info.value) and "parameters" in str(info.value), str(info.value)
    assert not fewer.state  # nothing loaded


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.foreach],
                         ids=[e.id for e in ENTRIES if not e.foreach])
def test_all_parameters_frozen_steps_as_a_no_op(entry):
    """issue 42: as torch.optim (its ``test_step_is_noop_when_params_have_no_grad``): bare
    tensors none of which requires a gradient build an optimizer whose step changes
    nothing; for a configuration too, where nothing places the frozen matrices."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 3, generator=gen, dtype=torch.float64),
               torch.randn(3, generator=gen, dtype=torch.float64)]
    before = [t.clone() for t in tensors]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the configurations warn of the left-out matrix
        opt = entry.build(tensors)
    for _ in range(2):
        opt.step()
    assert all(torch.equal(t, b) for t, b in zip(tensors, before, strict=True))
    assert not opt.state
    matrices = [torch.randn(4, 3, generator=gen) for _ in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        only = entry.build(matrices)  # configurations: every one left out, not refused
    only.step()
    opt.load_state_dict(opt.state_dict())


def _duplicate_groups(entry: Entry, a: torch.Tensor) -> list[dict[str, Any]]:
    if entry.config is None:
        return [{"params": [a]}, {"params": [a], "lr": 0.5}]
    return [{"params": [("fc.weight", a)]}, {"params": [("fc.weight", a)], "lr": 0.5}]


@pytest.mark.parametrize("entry", [e for e in ENTRIES if not e.foreach],
                         ids=[e.id for e in ENTRIES if not e.foreach])
def test_duplicate_parameters(entry):
    """As torch.optim: across groups a ValueError, within a group a warning (kept once)."""
    a = nn.Parameter(torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="more than one parameter group"):
        entry.build(_duplicate_groups(entry, a))
    one = ([{"params": [a, a]}] if entry.config is None
           else [{"params": [("fc.weight", a), ("fc.weight", a)]}])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        opt = entry.build(one)
    assert sum(len(g["params"]) for g in opt.param_groups) == 1


# ---------------------------------------------------------------------------
# complex parameters
# ---------------------------------------------------------------------------


def _complex_params(seed: int = 5) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen, dtype=torch.complex128))
            for s in [(4, 3), (5,)]]


def _complex_form(entry: Entry, params: list[torch.Tensor]) -> Any:
    return (params if entry.config is None
            else [("fc.weight", params[0]), ("norm.weight", params[1])])


def _train_complex(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> None:
    for t in range(4):
        gen = torch.Generator().manual_seed(10 + t)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()


@pytest.mark.parametrize("entry", ENTRIES, ids=IDS)
def test_complex_parameters(entry):
    """Trained as ``torch.view_as_real`` pairs where the rules allow it, else refused."""
    params = _complex_params()
    rules = _rules_for_complex(entry)
    if not all(registry.rule_classes()[r].complex_ok for r in rules):
        with pytest.raises(ValueError, match="is complex"):
            entry.build(_complex_form(entry, params), foreach=entry.foreach)
        return
    opt = entry.build(_complex_form(entry, params), foreach=entry.foreach)
    # the reference: the same groups, on real views of copies
    real = [nn.Parameter(torch.view_as_real(p.detach().clone())) for p in params]
    by_id = {id(p): r for p, r in zip(params, real, strict=True)}
    ref = RuleOptimizer([{**g, "params": [by_id[id(p)] for p in g["params"]]}
                         for g in opt.param_groups], {"lr": LR})
    _train_complex(opt, params)
    for t in range(4):
        gen = torch.Generator().manual_seed(10 + t)
        for p in params:
            by_id[id(p)].grad = torch.view_as_real(
                torch.randn(p.shape, generator=gen, dtype=p.dtype))
        ref.step()
    for p, r, start in zip(params, real, _complex_params(), strict=True):
        assert torch.equal(torch.view_as_real(p), r)
        assert not torch.equal(p, start)


def _rules_for_complex(entry: Entry) -> tuple[str, ...]:
    """The rules that get the complex matrix and vector of :func:`_complex_params`."""
    if entry.config is None:  # SinkGD and APOLLO hand them to their fallback (adamw)
        return entry.rules[-1:]
    preset = PRESETS[entry.config]
    return (preset.rule("dense").name, preset.rule("vector").name)


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_complex_adamw_matches_torch_adamw(foreach, wd):
    """The AdamW rule on complex parameters is torch.optim.AdamW's (its view_as_real)."""
    ours, theirs = _complex_params(), _complex_params()
    opt = RuleOptimizer(ours, {"rule": "adamw", "lr": LR, "betas": (0.9, 0.99), "eps": 1e-8,
                               "weight_decay": wd, "foreach": foreach})
    ref = torch.optim.AdamW(theirs, lr=LR, betas=(0.9, 0.99), eps=1e-8, weight_decay=wd,
                            foreach=foreach)
    _train_complex(opt, ours)
    _train_complex(ref, theirs)
    for p, q in zip(ours, theirs, strict=True):
        assert_close(p, q, rtol=0, atol=1e-13)
        assert_close(opt.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"], rtol=1e-13,
                     atol=0)


@pytest.mark.parametrize("cls", [SAGE, SinkGD, APOLLO])
def test_complex_with_a_fallback_trains(cls):
    params = _complex_params()
    opt = cls(params, lr=LR, fallback="adamw")
    assert [g["rule"] for g in opt.param_groups] == ["adamw"]
    _train_complex(opt, params)


# ---------------------------------------------------------------------------
# every hyperparameter of every rule, from the shared table
# ---------------------------------------------------------------------------


def _bad_values(name: str, rule: str) -> list[Any]:
    """Values the shared table refuses for ``name`` (below, above, not an integer, NaN)."""
    if name in hyperparams.CHOICES:
        return ["bogus"]
    valid = hyperparams.range_of(name, rule)
    assert valid is not None, f"{rule}.{name} has no range in sage_optim.hyperparams"
    bad: list[Any] = [valid.low - 1 if valid.low_inclusive else valid.low]
    if math.isfinite(valid.high):
        bad.append(valid.high + 0.5 if valid.high_inclusive else valid.high)
    if valid.integer:
        bad += [valid.low + 0.5, True]
    else:
        bad.append(math.nan)
    return bad


CLASS_OF = {"sage": SAGE, "sinkgd": SinkGD, "lion": Lion, "apollo": APOLLO}
HYPERPARAMETERS = [(rule, name) for rule in RULE_DEFAULTS
                   for name in ("lr", *RULE_DEFAULTS[rule]) if name != "projection"]


def _kwargs(rule: str, name: str, bad: Any) -> tuple[dict[str, Any], str]:
    """Keyword arguments that set ``name`` to ``bad``, and how torch spells it."""
    if name in ("b1", "b2"):
        betas = [RULE_DEFAULTS[rule]["b1"], RULE_DEFAULTS[rule]["b2"]]
        betas[name == "b2"] = bad
        return {"betas": tuple(betas)}, f"betas[{int(name == 'b2')}] ({name})"
    return {name: bad}, name


@pytest.mark.parametrize(("rule", "name"), HYPERPARAMETERS,
                         ids=[f"{r}.{n}" for r, n in HYPERPARAMETERS])
def test_every_bad_hyperparameter_is_refused(rule, name):
    """The table × every class, RuleOptimizer and make_optimizer: one message, naming it."""
    assert set(RULE_DEFAULTS[rule]) - {"projection"} <= set(hyperparams.RANGES) | set(
        hyperparams.CHOICES), "every hyperparameter has a range or choices in the table"
    matrix = [nn.Parameter(torch.zeros(4, 3))]
    configs = [c for c in CONFIG_NAMES
               if any(PRESETS[c].rule(k).name == rule for k in ("embedding", "dense", "vector"))]
    for bad in _bad_values(name, rule):
        kwargs, label = _kwargs(rule, name, bad)
        message = hyperparams.problem(name, bad, rule, label)
        assert message is not None, (rule, name, bad)
        builders: list[Callable[[], Any]] = [
            lambda kw=kwargs: RuleOptimizer(matrix, {"rule": rule, "lr": LR, **kw})]
        if rule in CLASS_OF:
            builders.append(lambda kw=kwargs: CLASS_OF[rule](matrix, **{"lr": LR, **kw}))
        for config in configs[:1]:
            kind = next(k for k in ("dense", "embedding", "vector")
                        if PRESETS[config].rule(k).name == rule)
            option = {"lr": bad} if name == "lr" else {f"{kind}_{name}": bad}
            builders.append(lambda c=config, o=option: sage_torch.make_optimizer(c, Net(), **o))
        for build in builders:
            with pytest.raises(ValueError) as info:
                build()
            assert label in str(info.value) or name in str(info.value), (rule, name, bad,
                                                                         str(info.value))
        with pytest.raises(ValueError) as info:
            builders[0]()
        assert str(info.value) == message


@pytest.mark.parametrize("cls", [SAGE, SinkGD, Lion, APOLLO, "RuleOptimizer",
                                 "make_optimizer"])
def test_arguments_are_checked_in_torch_order(cls):
    """issue 42: lr before params (torch.optim.AdamW(None, lr=-1) names lr), then eps, then
    betas, as torch/optim/adamw.py orders its checks."""
    def build(params: Any, **kw: Any) -> Any:
        if cls == "RuleOptimizer":
            return RuleOptimizer(params, {"rule": "adamw", **kw})
        if cls == "make_optimizer":
            return sage_torch.make_optimizer("sage-hybrid", params, **kw)
        return cls(params, **kw)

    with pytest.raises(ValueError, match="Invalid learning rate"):
        torch.optim.AdamW(None, lr=-1.0)  # type: ignore[arg-type]
    for params in (None, [], torch.zeros(3)):
        with pytest.raises(ValueError, match=r"^lr must be >= 0, got -1.0$"):
            build(params, lr=-1.0)
    # pytorch's TestOptimRenewed.test_errors (issue 42): a tensor lr of two elements and a
    # negative weight_decay are named with params=None, as torch.optim.AdamW names them
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        torch.optim.AdamW(None, lr=torch.tensor([1e-3, 1e-3]))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^lr must be a scalar, got a tensor of shape \(2,\)$"):
        build(None, lr=torch.tensor([1e-3, 1e-3]))
    with pytest.raises(ValueError, match=r"^lr must be >= 0, got -1.0$"):
        build(None, lr=torch.tensor(-1.0))
    with pytest.raises(ValueError, match=r"^weight_decay must be >= 0, got -1"):
        build(None, lr=LR, weight_decay=-1.0)
    if cls in (SAGE, APOLLO, "RuleOptimizer"):
        with pytest.raises(ValueError, match="Invalid epsilon"):
            torch.optim.AdamW([torch.zeros(3)], lr=LR, eps=-1.0, betas=(2.0, 0.9))
        with pytest.raises(ValueError, match=r"^eps must be"):
            build([torch.zeros(4, 3)], lr=LR, eps=-1.0, betas=(2.0, 0.9))


def test_make_optimizer_checks_each_kind_before_params():
    """A kind's hyperparameter (``dense_alpha``) is checked before params, too (issue 42)."""
    with pytest.raises(ValueError, match=r"^alpha must be >= 0, got -1"):
        sage_torch.make_optimizer("sage-hybrid", None, dense_alpha=-1.0)


@pytest.mark.parametrize("cls", [SAGE, "make_optimizer"])
def test_params_with_and_without_names_are_refused_in_torch_words(cls):
    """pytorch's TestOptimRenewed.test_errors matches torch's message (issue 42)."""
    def build(params: Any) -> Any:
        if cls == "make_optimizer":
            return sage_torch.make_optimizer("sage-hybrid", params)
        return cls(params)

    w, b = nn.Parameter(torch.zeros(1, 1)), nn.Parameter(torch.zeros(1, 1))
    regex = "all optimizer params should be with/without names. Some param names are missing"
    with pytest.raises(ValueError, match=regex):
        torch.optim.AdamW([("weight", w), b])
    with pytest.raises(ValueError, match=regex):
        build([("weight", w), b])


def test_sinkgd_negative_alpha_is_refused():
    with pytest.raises(ValueError, match=r"alpha must be >= 0, got -1"):
        SinkGD([nn.Parameter(torch.zeros(4, 3))], alpha=-1)


# ---------------------------------------------------------------------------
# APOLLO's seed, numeric steps, fallback, groups with model=, add_param_group
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("foreach", [False, True])
def test_apollo_resumes_across_named_and_unnamed_params(foreach):
    """The default projection does not depend on names (it was crc32(name): a drift)."""
    model = Net()
    matrices = [(n, p) for n, p in model.named_parameters() if p.dim() == 2]
    opt = APOLLO([p for _, p in matrices], lr=LR, rank=2, update_proj_gap=2, foreach=foreach)
    for t in range(3):
        _step(opt, model, t, only_trainable=True)
    twin = copy.deepcopy(model)
    resumed = APOLLO([(n, p) for n, p in twin.named_parameters() if p.dim() == 2], lr=LR,
                     rank=2, update_proj_gap=2, foreach=foreach)
    resumed.load_state_dict(_through_bytes(opt.state_dict()))
    for t in range(3, 7):  # two projection refreshes
        _step(opt, model, t)
        _step(resumed, twin, t)
    _same(model, twin)


def test_apollo_projection_seed_is_in_the_state_and_restored():
    model = Net()
    opt = APOLLO(model.parameters(), lr=LR, rank=2, update_proj_gap=1, fallback="adamw")
    for t in range(2):
        _step(opt, model, t)
    saved = opt.state_dict()
    seeds = [saved["state"][i].get("proj_seed") for i in sorted(saved["state"])]
    apollo_ids = [i for i, p in enumerate(opt.param_groups[0]["params"])]
    assert all(isinstance(seeds[i], torch.Tensor) and seeds[i].dtype == torch.int64
               for i in apollo_ids)
    assert len({int(seeds[i]) for i in apollo_ids}) == len(apollo_ids)  # one per matrix
    # a changed seed changes the next projection: the loaded seed is the one used
    changed = copy.deepcopy(saved)
    changed["state"][0]["proj_seed"] = changed["state"][0]["proj_seed"] + 7
    runs = []
    for sd in (saved, changed):
        twin = copy.deepcopy(model)
        resumed = APOLLO(twin.named_parameters(), lr=LR, rank=2, update_proj_gap=1,
                         fallback="adamw")
        resumed.load_state_dict(sd)
        assert resumed.state[twin.emb.weight]["proj_seed"].dtype == torch.int64
        _step(resumed, twin, 5)
        runs.append(twin.emb.weight.detach().clone())
    assert not torch.equal(runs[0], runs[1])


def test_numeric_step_is_converted_on_load_and_other_checks_stay():
    model = Net()
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    for t in range(2):
        _step(opt, model, t)
    saved = copy.deepcopy(opt.state_dict())  # state_dict() shares the state's dicts
    for st in saved["state"].values():
        st["step"] = 2  # an int, as some tools write it
    twin = copy.deepcopy(model)
    resumed = sage_torch.make_optimizer("sage-hybrid", twin, lr=LR)
    resumed.load_state_dict(saved)
    assert isinstance(saved["state"][0]["step"], int)  # the caller's dict is left alone
    assert all(st["step"].dtype == torch.float32 and float(st["step"]) == 2
               for st in resumed.state.values())
    _step(opt, model, 2)
    _step(resumed, twin, 2)
    _same(model, twin)
    saved["state"][0]["step"] = "2"
    with pytest.raises(ValueError, match="'step' is a str, not a tensor"):
        resumed.load_state_dict(saved)
    saved["state"][0]["step"] = 2
    saved["state"][0]["exp_avg"] = saved["state"][0]["exp_avg"][:1]
    with pytest.raises(ValueError, match="shape"):
        resumed.load_state_dict(saved)


@pytest.mark.parametrize("cls", [SinkGD, APOLLO])
def test_single_rule_classes_refuse_vectors_without_a_fallback(cls):
    model = Net()
    with pytest.raises(ValueError, match=r"needs a matrix.*fc\.bias.*fallback='adamw'"):
        cls(model.named_parameters())
    opt = cls(model.named_parameters(), fallback={"rule": "lion", "weight_decay": 0.0})
    assert [g["rule"] for g in opt.param_groups] == [{SinkGD: "sinkgd", APOLLO: "apollo"}[cls],
                                                     "lion"]
    assert opt.param_groups[1]["param_names"] == ["fc.bias", "norm.weight", "norm.bias"]
    assert opt.param_groups[1]["weight_decay"] == 0.0
    assert opt.param_groups[1]["betas"] == (RULE_DEFAULTS["lion"]["b1"],
                                            RULE_DEFAULTS["lion"]["b2"])
    with pytest.raises(ValueError, match="fallback must be a rule name"):
        cls(model.parameters(), fallback="sgd")


@pytest.mark.parametrize("cls", [SinkGD, APOLLO])
def test_single_rule_classes_take_trainer_style_groups(cls):
    """``Trainer(optimizer_cls_and_kwargs=(SinkGD, {"fallback": "adamw"}))``: HF's groups."""
    model = Net()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = cls([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
              lr=LR, fallback="adamw")
    assert [(g["rule"], len(g["params"]), g["weight_decay"]) for g in opt.param_groups] == [
        (opt.param_groups[0]["rule"], 3, 0.1), ("adamw", 3, 0.0)]
    assert opt.param_groups[0]["rule"] in ("sinkgd", "apollo")
    _step(opt, model, 0)


def test_hf_style_groups_with_the_model():
    """Bare tensors in HF-style groups: routed by the model, each group keeps its options."""
    model = Net()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    with pytest.raises(sage_torch.RoutingError, match="bare tensor"):
        sage_torch.make_optimizer("sage-hybrid", groups)
    opt = sage_torch.make_optimizer("sage-hybrid", groups, model=model)
    whole = sage_torch.make_optimizer("sage-hybrid", model)
    got = {n: (g["kind"], g["rule"], g["fan_in_dim"], g["fan_out_dim"], g["weight_decay"])
           for g in opt.param_groups for n in g["param_names"]}
    want = {n: (g["kind"], g["rule"], g["fan_in_dim"], g["fan_out_dim"],
                0.1 if n.endswith("weight") and "norm" not in n else 0.0)
            for g in whole.param_groups for n in g["param_names"]}
    assert got == want
    assert opt.model is model
    other = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="not a parameter of the model"):
        sage_torch.make_optimizer("sage-hybrid", [{"params": [other]}], model=model)


def test_add_param_group_routes_by_a_module_or_the_model():
    model = Net()
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    n = len(opt.param_groups)
    new = nn.Linear(6, 5).double()
    opt.add_param_group({"params": new.parameters(), "lr": 1e-3, "module": new})
    added = opt.param_groups[n:]
    assert [(g["kind"], g["rule"], g["param_names"], g["lr"]) for g in added] == [
        ("dense", "sinkgd", ["weight"], 1e-3), ("vector", "sage", ["bias"], 1e-3)]
    assert (added[0]["fan_in_dim"], added[0]["fan_out_dim"]) == (1, 0)
    model.extra = nn.Linear(6, 7).double()  # found in the model the optimizer was built from
    opt.add_param_group({"params": model.extra.parameters()})
    assert [(g["kind"], g["param_names"]) for g in opt.param_groups[n + 2:]] == [
        ("dense", ["extra.weight"]), ("vector", ["extra.bias"])]
    model.extra.weight.grad = torch.ones(7, 6, dtype=torch.float64)
    opt.step()
    assert set(opt.state[model.extra.weight]) == {"step"}  # SinkGD: a step count only
    with pytest.raises(ValueError, match="only an optimizer from sage_torch.make_optimizer"):
        SAGE(Net().parameters()).add_param_group({"params": new.parameters(), "module": new})


# ---------------------------------------------------------------------------
# the deliberate differences
# ---------------------------------------------------------------------------


def test_recorded_differences_hold_and_the_readme_states_them():
    section = " ".join((ROOT / "docs" / "pytorch.md").read_text().split())  # lines joined
    for key, phrase in DIFFERENCES.items():
        assert phrase in section, f"docs/pytorch.md does not say: {phrase!r} ({key})"
    recorded = {d for e in ENTRIES for d in e.differs}
    assert recorded == set(DIFFERENCES)
    model = Net()
    for entry in [e for e in ENTRIES if not e.foreach]:
        if "groups" in entry.differs:  # one group given, one per kind and layout made
            opt = entry.build([{"params": list(model.named_parameters())}])
            assert len(opt.param_groups) > 1, entry.id
        if "evidence" in entry.differs and entry.config not in ("adamw", "lion"):
            with pytest.raises(sage_torch.RoutingError):
                entry.build(list(model.parameters()))
        if "matrices" in entry.differs:
            with pytest.raises(ValueError, match="needs a matrix"):
                entry.build([model.fc.bias], fallback=None)
        if "complex" in entry.differs:
            with pytest.raises(ValueError, match="is complex"):
                entry.build(_complex_params()[:1], fallback=None)
        if "names" in entry.differs:  # torch.optim.AdamW refuses this mix
            bare = nn.Parameter(torch.zeros(3))
            opt = entry.build([{"params": [("w", model.norm.weight)]}, {"params": [bare]}])
            names = [n for g in opt.param_groups for n in g["param_names"]]
            assert "w" in names and any(n.startswith("param_groups[") for n in names), names
            with pytest.raises(ValueError, match="with/without names"):
                torch.optim.AdamW([{"params": [("w", model.norm.weight)]}, {"params": [bare]}])
        if "dtype" in entry.differs and entry.config is None and entry.rules[0] == "sage":
            p = nn.Parameter(torch.randn(4, 3).bfloat16())
            opt = SAGE([p], mu_dtype=torch.float32)
            p.grad = torch.ones_like(p)
            opt.step()
            fresh = SAGE([nn.Parameter(p.detach().clone())], mu_dtype=torch.float32)
            fresh.load_state_dict(opt.state_dict())
            assert next(iter(fresh.state.values()))["exp_avg"].dtype == torch.float32


def test_the_table_covers_every_class_and_configuration():
    classes = {e.id.split("-")[0] for e in ENTRIES if e.config is None}
    assert classes == {"SAGE", "SinkGD", "Lion", "APOLLO", "adamw", "unit_norm"}
    assert {e.config for e in ENTRIES if e.config} == set(CONFIG_NAMES)
    assert all(any(e.foreach == fe for e in ENTRIES) for fe in (False, True))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # building every entry warns of nothing
        for entry in ENTRIES:
            entry.make(Net())


# ---------------------------------------------------------------------------
# scripts/torch-optim-contract: pytorch's TestOptimRenewed over our OptimizerInfo entries
# ---------------------------------------------------------------------------

# A stand-in for pytorch's test/test_optim.py (which the project does not ship): the same
# imports and the same decorators, three tests: one every entry passes, one that SAGE fails
# for a recorded difference (complex parameters), one that always fails.
_FAKE_TEST_FILE = '''
import torch
from optim.test_lrscheduler import TestLRScheduler  # noqa: F401
from torch.testing._internal.common_device_type import instantiate_device_type_tests
from torch.testing._internal.common_optimizers import optim_db, optims
from torch.testing._internal.common_utils import TestCase


class TestOptimRenewed(TestCase):
    @optims(optim_db, dtypes=[torch.float32])
    def test_steps(self, device, dtype, optim_info):
        for optim_input in optim_info.optim_inputs_func(device=device):
            p = torch.nn.Parameter(torch.randn(4, 3, device=device, dtype=dtype))
            before = p.detach().clone()
            opt = optim_info.optim_cls([p], **optim_input.kwargs)
            p.grad = torch.ones_like(p)
            opt.step()
            self.assertFalse(torch.equal(before, p.detach()))

    @optims(optim_db, dtypes=[torch.complex64])
    def test_complex(self, device, dtype, optim_info):
        p = torch.randn(4, 3, device=device, dtype=dtype, requires_grad=True)
        optim_info.optim_cls([p], **optim_info.optim_inputs_func(device=device)[0].kwargs)

    @optims(optim_db, dtypes=[torch.float32])
    def test_always_fails(self, device, dtype, optim_info):
        raise AssertionError("no optimizer passes this")


instantiate_device_type_tests(TestOptimRenewed, globals())
'''


def _contract(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess[str]:
    test_file = tmp_path / "test_optim.py"
    test_file.write_text(_FAKE_TEST_FILE)
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(ROOT / "scripts" / "torch-optim-contract"),
                           str(test_file), *args], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


def test_contract_script_runs_the_test_class_over_our_entries(tmp_path):
    pytest.importorskip("expecttest")  # torch.testing._internal imports it
    proc = _contract(tmp_path, "--entries", "SAGE,Lion")
    assert proc.returncode == 1, proc.stdout + proc.stderr  # test_always_fails: unexplained
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.split() and line.split()[0] in ("SAGE", "Lion", "total")}
    assert rows == {"SAGE": ["1", "2", "0"], "Lion": ["2", "1", "0"], "total": ["3", "3", "0"]}
    assert "- test_complex: [complex] ValueError: parameter param_groups[0].params[0]" \
        in proc.stdout
    assert "- test_always_fails: [UNEXPECTED] AssertionError: no optimizer passes this" \
        in proc.stdout
    assert "1 failures are deliberate differences (docs/pytorch.md), 2 are not" in proc.stdout
    proc = _contract(tmp_path, "--entries", "SAGE,sage_hybrid", "-k", "test_complex")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 failures are deliberate differences (docs/pytorch.md), 0 are not" in proc.stdout


def test_contract_script_refuses_bad_options_in_one_line(tmp_path):
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "torch-optim-contract"),
                           str(tmp_path / "missing.py")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable}, timeout=300)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "test_file: no such file" in proc.stderr.strip().splitlines()[-1]
    pytest.importorskip("expecttest")
    proc = _contract(tmp_path, "--entries", "NoSuch")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--entries: 'NoSuch' matches no entry" in proc.stderr.strip().splitlines()[-1]


def test_contract_entries_cover_every_class_and_configuration():
    pytest.importorskip("expecttest")
    import importlib.util as iu
    spec = iu.spec_from_file_location("torch_optim_infos",
                                      ROOT / "scripts" / "torch_optim_infos.py")
    assert spec is not None and spec.loader is not None
    infos = iu.module_from_spec(spec)
    spec.loader.exec_module(infos)
    names = [i.name for i in infos.optim_infos()]
    assert names == ["SAGE", "Lion", "SinkGD", "APOLLO", "adamw_rule", "unit_norm_rule",
                     *(n.replace("-", "_") for n in CONFIG_NAMES)]
    # bare matrices placed as nn.Linear reads them, under the names the routing gives them
    w, b, c = torch.zeros(3, 2), torch.zeros(3), torch.zeros(2, 4, 1, 1)
    _, overrides = infos.linear_overrides(iter([w, b, c]))
    assert {k: (r.kind, r.fan_in, r.fan_out) for k, r in overrides.items()} == {
        "params[0]": ("dense", (1,), (0,)), "params[2]": ("dense", (1, 2, 3), (0,))}
    groups, overrides = infos.linear_overrides([{"params": [b]}, {"params": iter([w])}])
    assert groups[1]["params"] == [w] and set(overrides) == {"param_groups[1].params[0]"}
    _, overrides = infos.linear_overrides([("fc.weight", w), ("fc.bias", b)])
    assert set(overrides) == {"fc.weight"}
