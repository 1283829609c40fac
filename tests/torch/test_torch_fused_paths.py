"""Which path a step takes: ``torch.optim``'s default rule, ``SAGE_KERNELS`` and the devices.

* With neither ``foreach`` nor ``fused`` set, CUDA parameters take foreach, never fused
  (``fused=True`` is opt-in, as in ``torch.optim``): checked on stand-ins for CUDA
  tensors, since :meth:`RuleOptimizer._paths` reads only their device and dtype.
* ``SAGE_KERNELS=off`` turns ``fused=True`` into the reference path (no kernel launched,
  the same numbers, one warning), read at every step; another value raises.
* :func:`sage_torch.triton_kernels._launch` enters ``torch.cuda.device`` for a CUDA
  device that is not the current one (mocked CUDA), and every tensor of a launch is on
  the launch's device when one step holds parameters of several devices and dtypes.

The kernels run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import contextlib
import types
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from sage_optim import kernels
from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available

needs_triton = pytest.mark.skipif(not triton_available(),
                                  reason="the triton package is not installed")

CUDA0 = torch.device("cuda", 0)


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels of CPU tensors under the interpreter; ``SAGE_KERNELS`` unset; fresh warnings."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    monkeypatch.setattr(kernels, "_warned", set())


def fake_cuda(shape: tuple[int, ...], dtype: torch.dtype = torch.float32,
              device: torch.device = CUDA0) -> Any:
    """A stand-in for a CUDA parameter: what ``_paths`` reads of one (device, dtype)."""
    return types.SimpleNamespace(device=device, dtype=dtype, shape=shape)


def paths(opt: torch.optim.Optimizer, params: list[Any]) -> tuple[bool, bool]:
    group = opt.param_groups[0]
    return opt._paths(group, opt.rule_of(group), params, [f"p{i}" for i in range(len(params))])


@pytest.mark.parametrize("cls", [SAGE, Lion, SinkGD])
def test_cuda_default_is_foreach_and_fused_is_opt_in(cls):
    """``torch.optim``'s rule: foreach on CUDA by default, fused only with ``fused=True``."""
    cuda = [fake_cuda((4, 3)), fake_cuda((5, 3), torch.bfloat16)]
    default = cls([nn.Parameter(torch.zeros(4, 3))])
    assert default.param_groups[0]["fused"] is None
    assert paths(default, cuda) == (True, False)  # foreach, not fused
    if triton_available():
        fused = cls([nn.Parameter(torch.zeros(4, 3))], fused=True)
        assert paths(fused, cuda) == (False, True)
    assert paths(cls([nn.Parameter(torch.zeros(4, 3))], foreach=False), cuda) == (False, False)
    assert paths(cls([nn.Parameter(torch.zeros(4, 3))], fused=False), cuda) == (True, False)


def test_default_off_cuda_is_single_tensor():
    """CPU, or CUDA mixed with CPU: single-tensor unless foreach is asked for."""
    opt = SAGE([nn.Parameter(torch.zeros(4, 3))])
    cpu = types.SimpleNamespace(device=torch.device("cpu"), dtype=torch.float32)
    assert paths(opt, [cpu]) == (False, False)
    assert paths(opt, [cpu, fake_cuda((4, 3))]) == (False, False)
    assert paths(SAGE([nn.Parameter(torch.zeros(4, 3))], foreach=True), [cpu]) == (True, False)


@needs_triton
def test_fused_rechecks_what_changed_since_construction():
    """``fused=True`` on a parameter moved off CUDA, or on a rule edited into the group."""
    opt = SAGE([nn.Parameter(torch.zeros(4, 3))], fused=True)
    with pytest.raises(ValueError, match="float32, float64 and bfloat16 .* p0 is torch.float16"):
        paths(opt, [fake_cuda((4, 3), torch.float16)])
    opt.param_groups[0]["rule"] = "unit_norm"
    with pytest.raises(ValueError, match="unit_norm rule has no fused path"):
        paths(opt, [fake_cuda((4, 3))])


# --- SAGE_KERNELS ---------------------------------------------------------------------


def _step_pair(make, shapes, steps):
    """Step ``make(ps, fused=True)`` and ``make(ps)`` (single-tensor on the CPU) alike."""
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(steps)]
    out = {}
    for path in ("fused", "single"):
        ps = [nn.Parameter(p.clone()) for p in start]
        opt = make(ps, {"fused": True} if path == "fused" else {})
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        out[path] = [p.detach() for p in ps]
    return out


def _count_launches(monkeypatch: pytest.MonkeyPatch, launched: list[str]) -> None:
    from sage_torch import triton_kernels as tk

    launch = tk._launch

    def counting(fn, *args, **kw):
        launched.append(fn.__name__)
        return launch(fn, *args, **kw)

    monkeypatch.setattr(tk, "_launch", counting)


MAKERS = {
    "sage": (lambda ps, kw: SAGE(ps, lr=1e-2, weight_decay=0.1, **kw), [(6, 5), (5,)]),
    "lion": (lambda ps, kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw), [(6, 5), (5,)]),
    "sinkgd": (lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw), [(6, 5), (3, 4)]),
}


@needs_triton
@pytest.mark.parametrize("rule", sorted(MAKERS))
def test_sage_kernels_off_runs_the_reference_path(rule, monkeypatch):
    """``SAGE_KERNELS=off``: fused=True launches nothing, equals single-tensor, warns once."""
    from sage_torch import fused_check

    assert fused_check.fused_ready(torch.device("cpu"), torch.float32)  # not counted below
    launched: list[str] = []
    _count_launches(monkeypatch, launched)
    monkeypatch.setenv(kernels.ENV_VAR, " OFF ")
    make, shapes = MAKERS[rule]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = _step_pair(make, shapes, 3)
        _step_pair(make, shapes, 1)  # another optimizer: no second warning
    assert launched == []
    for a, b in zip(out["fused"], out["single"], strict=True):
        assert torch.equal(a, b)
    overridden = [w for w in caught if "SAGE_KERNELS=off" in str(w.message)]
    assert len(overridden) == 1, [str(w.message) for w in caught]
    assert issubclass(overridden[0].category, RuntimeWarning)
    assert "fused=True is ignored" in str(overridden[0].message)


@needs_triton
def test_sage_kernels_is_read_at_every_step(monkeypatch):
    """Set in a running process, the variable takes effect at the next step, both ways."""
    from sage_torch import fused_check

    assert fused_check.fused_ready(torch.device("cpu"), torch.float32)
    launched: list[str] = []
    _count_launches(monkeypatch, launched)
    p = nn.Parameter(torch.randn(6, 5))
    opt = Lion([p], fused=True)
    for value, runs in (("off", False), ("auto", True), ("off", False), ("", True)):
        monkeypatch.setenv(kernels.ENV_VAR, value)
        launched.clear()
        p.grad = torch.randn(6, 5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt.step()
        assert bool(launched) is runs, (value, launched)


@needs_triton
def test_invalid_sage_kernels_is_a_one_line_error(monkeypatch):
    p = nn.Parameter(torch.randn(3, 4))
    p.grad = torch.randn(3, 4)
    opt = SAGE([p], fused=True)
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="SAGE_KERNELS must be one of") as info:
        opt.step()
    assert "\n" not in str(info.value) and "'fast'" in str(info.value)


def test_sage_kernels_leaves_unfused_groups_alone(monkeypatch):
    """A group without fused=True never reads the variable (an invalid value is harmless)."""
    monkeypatch.setenv(kernels.ENV_VAR, "fast")
    p = nn.Parameter(torch.randn(3, 4))
    p.grad = torch.randn(3, 4)
    SAGE([p]).step()


# --- devices -------------------------------------------------------------------------


class _FakeKernel:
    """What ``_kernel(fn, interpret)`` returns, recording the current device of each launch."""

    def __init__(self, state: dict[str, Any], interpret: bool) -> None:
        self.state, self.interpret = state, interpret

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            self.state["launches"].append((self.interpret, self.state["current"], kwargs))
        return run


@needs_triton
def test_launch_enters_the_device_of_its_tensors(monkeypatch):
    """A CUDA launch off the current device runs under ``torch.cuda.device(device)``."""
    from sage_torch import triton_kernels as tk

    state: dict[str, Any] = {"current": 0, "entered": [], "launches": []}

    @contextlib.contextmanager
    def device(d):
        d = torch.device(d)
        state["entered"].append(d.index)
        before, state["current"] = state["current"], d.index
        try:
            yield
        finally:
            state["current"] = before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["current"])
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(tk, "_kernel", lambda fn, interpret: _FakeKernel(state, interpret))
    tk._launch(tk._lion_update, torch.device("cuda", 1), (1,), BLOCK=8)
    tk._launch(tk._lion_update, torch.device("cuda", 0), (1,), BLOCK=8)
    tk._launch(tk._lion_update, torch.device("cpu"), (1,), BLOCK=8)
    assert state["entered"] == [1]  # only the launch off the current device
    (i1, on1, kw1), (i0, on0, kw0), (icpu, _, kwcpu) = state["launches"]
    assert (i1, on1, i0, on0, icpu) == (False, 1, False, 0, True)
    assert kw1["enable_fp_fusion"] is False and kw0["enable_fp_fusion"] is False
    assert "enable_fp_fusion" not in kwcpu and state["current"] == 0


@needs_triton
@pytest.mark.parametrize("rule", ["sage", "lion", "sinkgd"])
def test_every_launch_tensor_is_on_the_launch_device(rule, monkeypatch):
    """One fused call over ``cpu`` and ``meta`` parameters of two dtypes: hp, lr, scratch
    tensors of each launch are on that launch's device (launches recorded, not run)."""
    from sage_torch import triton_kernels as tk
    from sage_torch.lion import _fused_lion
    from sage_torch.sage import _fused_sage
    from sage_torch.sinkgd import _fused_sinkgd

    seen: list[tuple[torch.device, set[torch.device], set[torch.dtype]]] = []

    def record(fn, device, grid, *args, **meta):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        seen.append((device, {t.device for t in tensors}, {t.dtype for t in tensors}))

    monkeypatch.setattr(tk, "_launch", record)
    ps = [torch.zeros(6, 5, device=d, dtype=dt)
          for d in ("cpu", "meta") for dt in (torch.float32, torch.bfloat16)]
    gs = [torch.ones_like(p) for p in ps]
    ms = [torch.zeros_like(p) for p in ps]
    lr = torch.tensor(0.01)  # a capturable lr on the CPU: copied to the meta launches
    if rule == "sage":
        scales = [torch.zeros(5, device=p.device) for p in ps]
        _fused_sage(ps, gs, ms, scales, [torch.tensor(1.0) for _ in ps], reduce_dims=[0] * 4,
                    rms_dims=[None] * 4, lr=lr, beta1=0.9, beta2=0.99, eps=1e-8,
                    weight_decay=0.1, damper="both")
    elif rule == "lion":
        _fused_lion(ps, gs, ms, lr=lr, beta1=0.9, beta2=0.99, weight_decay=0.1)
    else:
        _fused_sinkgd(ps, gs, axes=[((1,), (0,))] * 4, lr=lr, alpha=10.0, num_iters=2,
                      eps=1e-8, normalization="unit", weight_decay=0.1)
    assert {d.type for d, _, _ in seen} == {"cpu", "meta"}
    for device, devices, dtypes in seen:
        assert devices == {device}, (device, devices)
        # one arithmetic dtype per launch (and the sweep kernel's int64/int32 tables)
        assert torch.float64 not in dtypes
        assert len(dtypes - {torch.bfloat16, torch.int64, torch.int32}) <= 1


@needs_triton
def test_several_dtypes_in_one_fused_group_match_single_tensor():
    """A fused group of float32, float64 and bfloat16 parameters: each steps as alone."""
    from sage_torch import fused_check

    gen = torch.Generator().manual_seed(3)
    dtypes = [torch.float32, torch.float64, torch.bfloat16, torch.float32]
    start = [torch.randn(6, 5, generator=gen).to(dt) for dt in dtypes]
    grads = [torch.randn(6, 5, generator=gen).to(dt) for dt in dtypes]
    for make in (lambda ps, kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw),
                 lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw)):
        out = {}
        for path in ("fused", "single"):
            ps = [nn.Parameter(p.clone()) for p in start]
            for p, g in zip(ps, grads, strict=True):
                p.grad = g.clone()
            make(ps, {"fused": True} if path == "fused" else {"foreach": False}).step()
            out[path] = ps
        for i, (a, b) in enumerate(zip(out["fused"], out["single"], strict=True)):
            assert a.dtype == b.dtype == dtypes[i]
            # the first-use check's bound: reordered sums, and bfloat16 roundings they flip
            assert fused_check.compare(f"p{i}", a.detach(), b.detach(), start[i],
                                       dtypes[i]) is None
