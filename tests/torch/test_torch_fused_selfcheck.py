"""The first-use check of the fused kernels (:mod:`sage_torch.fused_check`).

Under Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``): the real kernels pass
in float32, float64 and bfloat16; a kernel made to raise, or to compute wrong numbers
(each of the four in turn), fails it with one ``RuntimeWarning`` naming the device, the
dtype and the error, after which that step and every later fused step on that device and
dtype equal the single-tensor path (the CPU's path without ``fused``), without warning
again.  The check is not run while a CUDA graph is captured (mocked), and runs once.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available

pytestmark = pytest.mark.skipif(not triton_available(),
                                reason="the triton package is not installed")

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.float64, torch.bfloat16]


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    """Interpreter on; no verdict cached yet (restored after the test)."""
    from sage_torch import fused_check

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.delenv("SAGE_KERNELS", raising=False)
    monkeypatch.setattr(fused_check, "_VERDICTS", {})


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_real_kernels_pass(dtype):
    from sage_torch import fused_check

    assert fused_check.self_check(CPU, dtype) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fused_check.fused_ready(CPU, dtype)
    assert fused_check._VERDICTS == {("cpu", dtype): None}


def test_tolerance_comes_from_the_arithmetic():
    """``2·L·n·ε`` of the arithmetic dtype, plus four bfloat16 units for bfloat16."""
    from sage_torch import fused_check

    assert fused_check.tolerance(torch.float32) == 2 * 5 * 64 * 2.0**-23
    assert fused_check.tolerance(torch.float64) == 2 * 5 * 64 * 2.0**-52
    assert fused_check.tolerance(torch.bfloat16) == 2 * 5 * 64 * 2.0**-23 + 4 * 2.0**-7
    x = torch.tensor([1.0, 1.5, 0.75, -3.0, 2.0**-130, 0.0], dtype=torch.bfloat16)
    want = torch.tensor([2.0**-7, 2.0**-7, 2.0**-8, 2.0**-6, 2.0**-133, 2.0**-133],
                        dtype=torch.float64)
    assert torch.equal(fused_check.ulp(x), want)
    assert torch.equal(fused_check.ulp(torch.tensor([1.0], dtype=torch.float64)),
                       torch.tensor([2.0**-52], dtype=torch.float64))


def _raise(*args, **kwargs):
    raise RuntimeError("no kernel image is available for execution on the device\nmore")


def _wrong(name):
    """The launcher ``name``, then one wrong value where it wrote (the sweep kernel: a step
    with the learning rate doubled, its tables reaching the parameters from an anchor)."""
    from sage_torch import triton_kernels as tk

    launcher = getattr(tk, name)
    if name == "sinkgd_sweeps":
        def wrong_sweep(base, desc, progs, n_r, n_c, hp, lr, *args, **kwargs):
            launcher(base, desc, progs, n_r, n_c, hp, lr * 2, *args, **kwargs)

        return wrong_sweep

    def wrong(*args, **kwargs):
        launcher(*args, **kwargs)
        out = args[1] if name == "sinkhorn_iterations" else args[0]  # c, or the parameter
        out.view(-1)[0] += 1.0

    return wrong


def _run(make, shapes, steps, dtype, fused):
    gen = torch.Generator().manual_seed(8)
    start = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(steps)]
    ps = [nn.Parameter(p.clone()) for p in start]
    opt = make(ps, {"fused": True} if fused else {})
    for gs in grads:
        for p, g in zip(ps, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    return [p.detach() for p in ps]


CASES = {  # launcher -> the rule whose check it fails, an optimizer of that rule
    "lion_update": ("lion", lambda ps, kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw)),
    "sage_update": ("sage", lambda ps, kw: SAGE(ps, lr=1e-2, weight_decay=0.1, **kw)),
    "sinkgd_update": ("sinkgd", lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw)),
    "sinkhorn_iterations": ("sinkgd",
                            lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw)),
    "sinkgd_sweeps": ("sinkgd", lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw)),
}
TWO_LAUNCH = ("sinkgd_update", "sinkhorn_iterations")
"""Launchers of SinkGD's two-launch kernels, which the fused path runs only without the
sweep kernel (``sage_torch.sinkgd.FUSED_SWEEP``)."""


@pytest.mark.parametrize("fault", ["raises", "wrong numbers"])
@pytest.mark.parametrize("launcher", sorted(CASES))
def test_a_failing_kernel_warns_once_and_steps_as_single_tensor(launcher, fault, monkeypatch):
    from sage_torch import fused_check
    from sage_torch import triton_kernels as tk

    dtype = torch.float32
    if launcher in TWO_LAUNCH:
        from sage_torch import sinkgd

        monkeypatch.setattr(sinkgd, "FUSED_SWEEP", False)
    monkeypatch.setattr(tk, launcher, _raise if fault == "raises" else _wrong(launcher))
    rule, make = CASES[launcher]
    shapes = [(6, 5), (4, 7)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fused = _run(make, shapes, 3, dtype, fused=True)
        # a later optimizer of another rule, same device and dtype: no check, no warning
        other = _run(CASES["lion_update"][1], shapes, 1, dtype, fused=True)
    assert len(caught) == 1, [str(w.message) for w in caught]
    warning = caught[0]
    assert issubclass(warning.category, RuntimeWarning)
    message = str(warning.message)
    assert "cpu torch.float32" in message and f"({rule}: " in message, message
    if fault == "raises":
        assert "RuntimeError: no kernel image is available" in message and "more" not in message
    else:
        assert "differs from the single-tensor path" in message, message
    assert "path of fused=None instead (foreach on CUDA" in message
    assert fused_check._VERDICTS[("cpu", dtype)] is not None
    single = _run(make, shapes, 3, dtype, fused=False)
    for a, b in zip(fused, single, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(other, _run(CASES["lion_update"][1], shapes, 1, dtype, fused=False),
                    strict=True):
        assert torch.equal(a, b)


def test_a_verdict_is_per_device_and_dtype(monkeypatch):
    """A failure in float32 leaves float64 fused (the check runs again for it)."""
    from sage_torch import fused_check
    from sage_torch import triton_kernels as tk

    launcher = tk.lion_update
    monkeypatch.setattr(tk, "lion_update", _raise)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert not fused_check.fused_ready(CPU, torch.float32)
    monkeypatch.setattr(tk, "lion_update", launcher)
    assert fused_check.fused_ready(CPU, torch.float64)
    assert not fused_check.fused_ready(CPU, torch.float32)


def test_the_check_runs_once(monkeypatch):
    from sage_torch import fused_check

    calls = []
    check = fused_check.self_check
    monkeypatch.setattr(fused_check, "self_check", lambda d, t: calls.append(t) or check(d, t))
    for _ in range(3):
        assert fused_check.fused_ready(CPU, torch.float32)
    assert calls == [torch.float32]


def test_no_check_while_a_cuda_graph_is_captured(monkeypatch):
    """During capture: fused without the check, and nothing cached (mocked capture)."""
    from sage_torch import fused_check

    def refuse(device, dtype):
        raise AssertionError("the check ran during capture")

    monkeypatch.setattr(fused_check, "self_check", refuse)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert fused_check.fused_ready(torch.device("cuda", 0), torch.float32)
    assert fused_check._VERDICTS == {}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(AssertionError, match="ran during capture"):
        fused_check.fused_ready(torch.device("cuda", 0), torch.float32)
