"""The fused (Triton) path of sage_torch against the single-tensor and foreach paths.

On the CPU the kernels run under Triton's interpreter: ``TRITON_INTERPRET=1`` is set for
each test (and restored after it) by an autouse fixture; :mod:`sage_torch` reads it at
every step and wraps each kernel for the interpreter directly, so the variable does not
leak into other tests.  Shapes are small: the interpreter runs a kernel in NumPy.  Every
case is skipped, with the reason, where the ``triton`` package is not installed.

Also here: the multi-tensor SinkGD's ``group_bytes`` chunking gives bit for bit the
unchunked result, and every kernel variant compiles for an H100.  The other files
``tests/torch/test_torch_fused_*.py``: the default paths and ``SAGE_KERNELS`` (``_paths``),
int64 offsets, the first-use check, bfloat16, and the CUDA cases (skipped without CUDA).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import sage_torch
from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available
from sage_torch.sinkgd import _multi_tensor_sinkgd, _single_tensor_sinkgd
from tests.reference_np import sinkhorn_ref

needs_triton = pytest.mark.skipif(
    not triton_available(),
    reason="the triton package is not installed (pip install triton==3.6.0 on Linux x86-64; "
           "it ships with CUDA builds of torch): the fused kernels cannot run, not even "
           "under Triton's CPU interpreter",
)

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
DTYPES = [torch.float32, torch.float64]


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run the kernels of CPU tensors under Triton's interpreter for this test only."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a − b| / max|b|`` (0 for two zero tensors)."""
    scale = b.abs().max().item() if b.numel() else 0.0
    diff = (a - b).abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff


def run_paths(make: Callable[[list[nn.Parameter], dict], torch.optim.Optimizer],
              params: list[torch.Tensor], grads: list[list[torch.Tensor]],
              paths: tuple[str, ...] = ("single", "foreach", "fused"),
              lr_tensor: bool = False) -> dict[str, list[torch.Tensor]]:
    """Step each path from the same parameters with the same gradients and lr schedule."""
    out = {}
    for path in paths:
        ps = [nn.Parameter(p.clone()) for p in params]
        kw = {"fused": True} if path == "fused" else {"foreach": path == "foreach"}
        if lr_tensor:
            kw["capturable"] = True
        opt = make(ps, kw)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 1.0 / (1.0 + t))
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
            sched.step()
        out[path] = [p.detach() for p in ps]
    return out


def check(out: dict[str, list[torch.Tensor]], dtype: torch.dtype) -> None:
    for path in out:
        for i, (a, b) in enumerate(zip(out[path], out["single"], strict=True)):
            assert torch.isfinite(a).all(), (path, i)
            assert rel(a, b) <= TOL[dtype], (path, i, tuple(a.shape), rel(a, b))


def sinkgd_case(dtype: torch.dtype, steps: int = 3) -> tuple[list, list]:
    """Odd shapes, a zero matrix, a zero row, huge and tiny magnitudes, stacked matrices."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(37, 50), (1, 7), (5, 3), (6, 9), (4, 5), (4, 5), (3, 4, 5)]
    big, small = (1e30, 1e-30) if dtype == torch.float32 else (1e250, 1e-250)
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = []
    for _ in range(steps):
        gs = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
        gs[2].zero_()  # an all-zero matrix keeps its scales
        gs[3][2].zero_()  # a zero row
        gs[4] *= big
        gs[5] *= small
        grads.append(gs)
    return params, grads


@needs_triton
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinkgd_fused_matches_single_and_foreach(normalization, dtype):
    params, grads = sinkgd_case(dtype)
    out = run_paths(lambda ps, kw: SinkGD(ps, lr=0.05, weight_decay=0.1,
                                          normalization=normalization, **kw), params, grads)
    check(out, dtype)
    assert not torch.equal(out["fused"][0], params[0])  # it stepped


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinkgd_fused_other_layouts(dtype):
    """``(in, out)`` (fan_in_dim=0) and a Conv2d kernel are strided views: no copy."""
    gen = torch.Generator().manual_seed(1)
    for fan_in, fan_out, shape in [(0, 1, (11, 6)), ((1, 2, 3), 0, (4, 3, 2, 2))]:
        params = [torch.randn(shape, generator=gen, dtype=dtype)]
        grads = [[torch.randn(shape, generator=gen, dtype=dtype)] for _ in range(2)]
        out = run_paths(lambda ps, kw, fi=fan_in, fo=fan_out: SinkGD(
            ps, lr=0.05, weight_decay=0.1, fan_in_dim=fi, fan_out_dim=fo, **kw), params, grads)
        check(out, dtype)


@needs_triton
def test_sinkgd_fused_falls_back_where_no_view():
    """A layout that is no strided (B, OUT, IN) view takes the foreach path, no error."""
    gen = torch.Generator().manual_seed(2)
    shape = (3, 4, 5)  # fan_in=(0, 2): dims 0 and 2 cannot be merged without a copy
    params = [torch.randn(shape, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(shape, generator=gen, dtype=torch.float64)]]
    out = run_paths(lambda ps, kw: SinkGD(ps, lr=0.05, fan_in_dim=(0, 2), fan_out_dim=1, **kw),
                    params, grads, paths=("single", "foreach", "fused"))
    assert torch.equal(out["fused"][0], out["foreach"][0])
    check(out, torch.float64)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinkgd_two_launch_batches_same_shape_matrices(monkeypatch, dtype):
    """The two-launch kernels (without the sweep kernel: ``FUSED_SWEEP=False``, or
    deterministic algorithms): same-shape matrices share their Sinkhorn launches, chunked
    by ``group_bytes``.

    Counts the Triton launches of one step (``2·num_iters`` per chunk, one update per
    parameter), so that the batching cannot silently regress, and checks that the
    chunking changes no bit of the result (each batch index is computed alone).
    """
    from collections import Counter

    from sage_torch import fused_check, sinkgd
    from sage_torch import triton_kernels as tk

    monkeypatch.setattr(sinkgd, "FUSED_SWEEP", False)
    assert fused_check.fused_ready(torch.device("cpu"), dtype)  # its launches are not counted
    counts: Counter[str] = Counter()
    launch = tk._launch

    def counting(fn, *args, **kw):
        counts[fn.__name__] += 1
        return launch(fn, *args, **kw)

    monkeypatch.setattr(tk, "_launch", counting)
    gen = torch.Generator().manual_seed(10)
    shapes = [(6, 5)] * 4 + [(3, 6, 5), (4, 7)]  # one (OUT, IN) = (6, 5) group of 7 matrices
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads[1][2].zero_()  # a zero row inside a stack
    grads[2] *= 1e30 if dtype == torch.float32 else 1e250
    iters, item = 3, dtype.itemsize
    # group_bytes -> chunks: all same-shape matrices together; three (6, 5) matrices at
    # most ({0, 1, 2}, {3}, {4}: the stacked parameter is never split); one per parameter
    results = {}
    for group_bytes, chunks in [(1 << 30, 2), (6 * 5 * item * 3, 4), (1, len(shapes))]:
        ps = [nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt = SinkGD(ps, lr=0.05, weight_decay=0.1, num_iters=iters, fused=True,
                     group_bytes=group_bytes)
        counts.clear()
        opt.step()
        assert counts == {"_sinkhorn_half": 2 * iters * chunks,  # rows, then columns
                          "_sinkgd_update": len(shapes)}, (group_bytes, counts)
        results[group_bytes] = [p.detach() for p in ps]
    for a, b in zip(results[1 << 30], results[1], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(results[6 * 5 * item * 3], results[1], strict=True):
        assert torch.equal(a, b)
    ref = [nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    SinkGD(ref, lr=0.05, weight_decay=0.1, num_iters=iters, foreach=False).step()
    for a, b in zip(results[1 << 30], ref, strict=True):
        assert rel(a, b.detach()) <= TOL[dtype]


@needs_triton
def test_sinkgd_two_launch_keeps_one_stack_alive(monkeypatch):
    """A chunk's stacked gradient is freed before the next chunk's is made (meta tensors;
    the two-launch kernels, under deterministic algorithms)."""
    import weakref

    from sage_torch import triton_kernels as tk
    from sage_torch.sinkgd import _fused_sinkgd

    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)

    stacks: list[weakref.ref] = []
    iterations = tk.sinkhorn_iterations

    def watched(g, *args):
        assert all(s() is None for s in stacks), "two stacks alive at once"
        if g._base is None:  # a stack (a chunk of one runs on a view of its gradient)
            stacks.append(weakref.ref(g))
        return iterations(g, *args)

    monkeypatch.setattr(tk, "_launch", lambda *args, **kw: None)
    monkeypatch.setattr(tk, "sinkhorn_iterations", watched)
    shapes = [(64, 32)] * 5 + [(32, 64)] * 3 + [(16, 16)]
    ps = [torch.empty(s, device="meta") for s in shapes]
    _fused_sinkgd(ps, [torch.empty_like(p) for p in ps], axes=[((1,), (0,))] * len(ps),
                  lr=0.1, alpha=10.0, num_iters=2, eps=1e-8, normalization="unit",
                  weight_decay=0.0, group_bytes=64 * 32 * 4 * 2)
    assert len(stacks) == 3  # (64, 32): {0, 1} {2, 3} {4}; (32, 64): {5, 6} {7}; (16, 16)


def _sweep_step(shapes_axes, grads, dtype, **kw):
    """One fused SinkGD step of fresh parameters (zeros) with ``grads``; the updates."""
    ps = [nn.Parameter(torch.zeros(g.shape, dtype=dtype)) for g in grads]
    for p, g in zip(ps, grads, strict=True):
        p.grad = g.to(dtype)
    opt = SinkGD([{"params": [p], "fan_in_dim": fi, "fan_out_dim": fo}
                  for p, (fi, fo) in zip(ps, shapes_axes, strict=True)],
                 lr=1.0, alpha=1.0, weight_decay=0.0, fused=True, **kw)
    opt.step()
    return [-p.detach() for p in ps]


def _oracle(g, fi, fo, normalization):
    """The float64 direct Sinkhorn (tests/reference_np.py) of a 2-D, stacked or grouped leaf."""
    x = g.double().numpy()
    fi = fi if isinstance(fi, tuple) else (fi % x.ndim,)
    fo = fo if isinstance(fo, tuple) else (fo % x.ndim,)
    batch = [d for d in range(x.ndim) if d not in fi + fo]
    perm = batch + list(fo) + list(fi)
    xt = x.transpose(perm)
    lead = xt.shape[:len(batch)]
    m = xt.reshape(-1, math.prod(x.shape[d] for d in fo), math.prod(x.shape[d] for d in fi))
    out = np.stack([sinkhorn_ref(mi, normalization=normalization, fan_in_axis=1,
                                 fan_out_axis=0) for mi in m])
    out = out.reshape(*lead, *[x.shape[d] for d in fo], *[x.shape[d] for d in fi])
    return torch.from_numpy(out.transpose(np.argsort(perm)))


@needs_triton
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sinkgd_sweep_against_the_float64_oracle(normalization, dtype):
    """The sweep kernel's ``X`` against the float64 direct Sinkhorn: torch ``(out, in)``,
    ``(in, out)``, a Conv2d kernel (grouped fan-in), stacked experts ``(E, out, in)``,
    rows of 1e-30 and of 1e30 (each row's own range scale), a zero row and column.

    float32 within 2e-6 of the largest entry, float64 within 1e-12, bfloat16 gradients
    and parameters (float32 arithmetic, ``X`` rounded to bfloat16) within two bfloat16
    units."""
    gen = torch.Generator().manual_seed(21)
    cases = [((37, 50), (1, 0)), ((50, 37), (0, 1)), ((6, 3, 2, 2), ((1, 2, 3), 0)),
             ((4, 9, 20), (2, 1)), ((33, 300), (1, 0))]
    grads = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape, _ in cases]
    # (the oracle squares the matrix itself: 1e150 is as far as float64 squares go)
    big, small = (1e30, 1e-30) if dtype != torch.float64 else (1e150, 1e-150)
    grads[0][3] *= big
    grads[0][5] *= small
    grads[0][7].zero_()
    grads[0][:, 11] = 0.0
    grads[3][1] *= 1e-3
    grads = [g.to(dtype) for g in grads]
    got = _sweep_step([ax for _, ax in cases], grads, dtype, normalization=normalization)
    tol = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2 * 2.0**-8}[dtype]
    for (shape, (fi, fo)), g, x in zip(cases, grads, got, strict=True):
        want = _oracle(g.double(), fi, fo, normalization)
        scale = float(want.abs().max())
        err = float((x.double() - want).abs().max())
        assert err <= tol * scale, (shape, err / scale)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_sinkgd_sweep_groups_change_no_bit(monkeypatch, dtype):
    """``L + 1`` launches per sweep group, whatever the groups, and the same bits.

    Groups: every matrix of a tile class together (one class here: widths 5 and 7 both
    take 16-wide tiles), three ``(6, 5)`` matrices at most, or one matrix each; a stacked
    parameter's matrices may be split between groups.  Each matrix's sums are its own
    programs' (added in program order under the interpreter), so the grouping changes no
    bit; the steps agree with the single-tensor path.
    """
    from collections import Counter

    from sage_torch import fused_check
    from sage_torch import triton_kernels as tk

    assert fused_check.fused_ready(torch.device("cpu"), dtype)  # its launches are not counted
    counts: Counter[str] = Counter()
    launch = tk._launch

    def counting(fn, *args, **kw):
        counts[fn.__name__] += 1
        return launch(fn, *args, **kw)

    monkeypatch.setattr(tk, "_launch", counting)
    gen = torch.Generator().manual_seed(10)
    shapes = [(6, 5)] * 4 + [(3, 6, 5), (4, 7)]  # eight matrices
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads[1][2].zero_()  # a zero row
    grads[2] *= 1e30 if dtype == torch.float32 else 1e250
    iters, item = 3, dtype.itemsize
    results = {}
    for group_bytes, groups in [(1 << 30, 1), (6 * 5 * item * 3, 3), (1, 8)]:
        ps = [nn.Parameter(p.clone()) for p in params]
        for p, g in zip(ps, grads, strict=True):
            p.grad = g.clone()
        opt = SinkGD(ps, lr=0.05, weight_decay=0.1, num_iters=iters, fused=True,
                     group_bytes=group_bytes)
        counts.clear()
        opt.step()
        assert counts == {"_sinkgd_sweep": (iters + 1) * groups}, (group_bytes, counts)
        results[group_bytes] = [p.detach() for p in ps]
    for other in (6 * 5 * item * 3, 1):
        for a, b in zip(results[1 << 30], results[other], strict=True):
            assert torch.equal(a, b)
    ref = [nn.Parameter(p.clone()) for p in params]
    for p, g in zip(ref, grads, strict=True):
        p.grad = g.clone()
    SinkGD(ref, lr=0.05, weight_decay=0.1, num_iters=iters, foreach=False).step()
    for a, b in zip(results[1 << 30], ref, strict=True):
        assert rel(a, b.detach()) <= TOL[dtype]


@needs_triton
def test_sinkgd_sweep_plan_follows_the_tensors(monkeypatch):
    """A step on the same tensors reuses its launches (no table is rebuilt); new gradient
    tensors (other addresses) get new tables, and every step equals the single-tensor one."""
    from sage_torch import triton_kernels as tk

    built = []
    tables = tk.sweep_tables

    def recording(*args, **kw):
        built.append(1)
        return tables(*args, **kw)

    monkeypatch.setattr(tk, "sweep_tables", recording)
    gen = torch.Generator().manual_seed(3)
    shapes = [(9, 6), (9, 6), (5, 30)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(4)]
    fused = [nn.Parameter(p.clone()) for p in start]
    single = [nn.Parameter(p.clone()) for p in start]
    opt_f = SinkGD(fused, lr=0.05, weight_decay=0.1, fused=True)
    opt_s = SinkGD(single, lr=0.05, weight_decay=0.1, foreach=False)
    for p in fused:
        p.grad = torch.zeros_like(p)
    rebuilt = []
    for t, gs in enumerate(grads):
        for p, q, g in zip(fused, single, gs, strict=True):
            if t < 2:
                p.grad.copy_(g)  # the same gradient tensors: the plan of step 0 again
            else:
                p.grad = g.clone()  # new tensors: new tables
            q.grad = g.clone()
        built.clear()
        opt_f.step()
        opt_s.step()
        rebuilt.append(len(built))
        for a, b in zip(fused, single, strict=True):
            assert rel(a.detach(), b.detach()) <= 1e-5
    assert rebuilt[0] > 0 and rebuilt[1] == 0 and rebuilt[2] > 0, rebuilt


@needs_triton
def test_deterministic_algorithms_take_the_two_launch_kernels(monkeypatch):
    """Under ``torch.use_deterministic_algorithms`` the fused path does not run the sweep
    kernel (its atomics may add in any order on a GPU) but the deterministic kernels."""
    from collections import Counter

    from sage_torch import triton_kernels as tk

    counts: Counter[str] = Counter()
    launch = tk._launch
    monkeypatch.setattr(tk, "_launch", lambda fn, *a, **k: (counts.update([fn.__name__]),
                                                            launch(fn, *a, **k)))
    p = nn.Parameter(torch.randn(6, 5))
    p.grad = torch.randn(6, 5)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        SinkGD([p], lr=0.05, num_iters=2, fused=True).step()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert "_sinkgd_sweep" not in counts and counts["_sinkhorn_half"] == 4, counts


@needs_triton
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_sinkgd_fused_against_numpy_reference(normalization):
    """One fused step against tests/reference_np.py (float64, the direct Sinkhorn)."""
    gen = torch.Generator().manual_seed(3)
    p0 = torch.randn(9, 13, generator=gen, dtype=torch.float64)
    g = torch.randn(9, 13, generator=gen, dtype=torch.float64)
    p = nn.Parameter(p0.clone())
    p.grad = g.clone()
    SinkGD([p], lr=0.1, alpha=2.0, weight_decay=0.01, normalization=normalization,
           fused=True).step()
    x = sinkhorn_ref(g.numpy(), 5, 1e-8, normalization, fan_in_axis=1, fan_out_axis=0)
    want = p0.numpy() - 0.1 * (2.0 * x + 0.01 * p0.numpy())
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-6, atol=1e-9)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("betas", [(0.9, 0.99), (0.9, 0.0)])
def test_sage_fused_matches_single_and_foreach(dtype, betas):
    gen = torch.Generator().manual_seed(4)
    shapes = [(37, 50), (1, 7), (7,), (), (6, 5)]
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(3)]
    for gs in grads:
        gs[4][1].zero_()
    out = run_paths(lambda ps, kw: SAGE(ps, lr=1e-2, betas=betas, weight_decay=0.1, **kw),
                    params, grads)
    check(out, dtype)


@needs_triton
def test_sage_fused_dim1_and_elementwise_groups():
    """``fan_out_dim=-1`` (H per row) and ``fan_out_dim=None`` (element-wise) matrices."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.randn(8, 6, generator=gen, dtype=torch.float64)]
    grads = [[torch.randn(8, 6, generator=gen, dtype=torch.float64)] for _ in range(3)]
    for fo in (-1, None):
        out = run_paths(lambda ps, kw, fo=fo: SAGE(ps, lr=1e-2, weight_decay=0.1,
                                                   fan_out_dim=fo, **kw), params, grads)
        check(out, torch.float64)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_lion_fused_matches_single_and_foreach(dtype):
    gen = torch.Generator().manual_seed(6)
    shapes = [(37, 50), (7,), (), (3, 4, 5)]
    params = [torch.randn(s, generator=gen, dtype=dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=dtype) for s in shapes] for _ in range(3)]
    out = run_paths(lambda ps, kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw), params, grads)
    check(out, dtype)


@needs_triton
@pytest.mark.parametrize("cls", [SAGE, Lion, SinkGD])
def test_fused_capturable_tensor_lr(cls):
    """capturable=True: the lr is a tensor the kernels read on the device."""
    gen = torch.Generator().manual_seed(7)
    shapes = [(5, 8), (3, 3)]
    params = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
    grads = [[torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
             for _ in range(3)]
    out = {}
    for path in ("single", "fused"):
        ps = [nn.Parameter(p.clone()) for p in params]
        lr = torch.tensor(0.01, dtype=torch.float64)
        kw = {"fused": True} if path == "fused" else {"foreach": False}
        opt = cls(ps, lr=lr, weight_decay=0.1, capturable=True, **kw)
        for k, gs in enumerate(grads):
            lr.fill_(0.01 / (1 + k))  # a schedule written into the tensor in place
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        out[path] = [p.detach() for p in ps]
    check(out, torch.float64)


@needs_triton
def test_make_optimizer_fused_runs_the_rules_that_have_it():
    """fused=True reaches the SinkGD groups and AdamW's (``torch._fused_adamw_``)."""
    torch.manual_seed(8)
    model = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5)).double()
    ref = nn.Sequential(nn.Embedding(11, 6), nn.Linear(6, 5), nn.LayerNorm(5)).double()
    ref.load_state_dict(model.state_dict())
    opt = sage_torch.make_optimizer("sinkgd-hybrid", model, lr=1e-2, fused=True)
    assert {g["rule"]: g["fused"] for g in opt.param_groups}["sinkgd"] is True
    assert all(g["fused"] is True for g in opt.param_groups if g["rule"] == "adamw")
    opt_ref = sage_torch.make_optimizer("sinkgd-hybrid", ref, lr=1e-2, foreach=False)
    for _ in range(2):
        for m in (model, ref):
            for p in m.parameters():
                p.grad = torch.ones_like(p) * 0.1 + p.detach() * 0.01
        opt.step()
        opt_ref.step()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert rel(a.detach(), b.detach()) <= 1e-10


@needs_triton
def test_fused_errors_name_the_problem(monkeypatch):
    p = nn.Parameter(torch.randn(3, 4))
    with pytest.raises(ValueError, match="fused=True and foreach=True"):
        SinkGD([p], fused=True, foreach=True)
    with pytest.raises(ValueError, match="unit_norm rule .* has no fused path"):
        sage_torch.RuleOptimizer([{"params": [p], "rule": "unit_norm"}],
                                 {"lr": 1e-3, "fused": True})
    with pytest.raises(ValueError, match=r"float32, float64 and bfloat16 .* torch.float16"):
        Lion([nn.Parameter(torch.randn(3, dtype=torch.float16))], fused=True)
    with pytest.raises(ValueError, match="fused must be True, False or None"):
        SAGE([p], fused="yes")  # type: ignore[arg-type]
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="needs CUDA tensors, but parameter .* is on cpu"):
        SAGE([p], fused=True)


def test_fused_is_not_the_cpu_default(monkeypatch):
    """Without fused/foreach the CPU takes the single-tensor path (fused only on request;
    the CUDA default is foreach: tests/torch/test_torch_fused_paths.py)."""
    monkeypatch.delenv("TRITON_INTERPRET")
    opt = SinkGD([nn.Parameter(torch.randn(3, 4))])
    rule = opt.rule_of(opt.param_groups[0])
    assert opt._paths(opt.param_groups[0], rule, opt.param_groups[0]["params"],
                      ["w"]) == (False, False)


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_multi_tensor_sinkgd_chunks_are_bitwise_unchunked(normalization):
    """group_bytes splits the stacked K without changing a bit of the result."""
    gen = torch.Generator().manual_seed(9)
    shapes = [(6, 7)] * 5 + [(2, 6, 7), (3, 4), (3, 4), (9, 2)]
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    axes = [((p.dim() - 1,), (p.dim() - 2,)) for p in params]
    kw = {"lr": 0.1, "alpha": 10.0, "num_iters": 5, "eps": 1e-8,
          "normalization": normalization, "weight_decay": 0.1}
    whole = [p.clone() for p in params]
    _multi_tensor_sinkgd(whole, grads, axes=axes, **kw)
    itemsize = 4
    for limit in (1, 6 * 7 * itemsize * 2, 6 * 7 * itemsize * 3 + 1):
        chunked = [p.clone() for p in params]
        _multi_tensor_sinkgd(chunked, grads, axes=axes, group_bytes=limit, **kw)
        for a, b in zip(chunked, whole, strict=True):
            assert torch.equal(a, b), limit
    ref = [p.clone() for p in params]
    _single_tensor_sinkgd(ref, grads, axes=axes, **kw)
    for a, b in zip(whole, ref, strict=True):
        assert rel(a, b) <= 1e-5


def test_group_bytes_option_is_checked():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="group_bytes must be None or a positive int"):
            SinkGD([nn.Parameter(torch.randn(3, 4))], group_bytes=bad)
    assert math.isfinite(SinkGD([nn.Parameter(torch.randn(3, 4))],
                                group_bytes=1).param_groups[0]["group_bytes"])


def test_group_bytes_default_scales_with_the_largest_parameter():
    """Default: 128 MiB fused; foreach, the larger of that and 2 x the largest parameter."""
    from sage_optim.hyperparams import SINKHORN_GROUP_BYTES
    from sage_torch.sinkgd import FOREACH_ROUND_PARAMS

    emb = nn.Parameter(torch.zeros(2, 3))  # only its size matters here
    opt = SinkGD([nn.Parameter(torch.randn(3, 4))])
    opt.add_param_group({"params": [emb]})
    rule, group = opt.rule_of(opt.param_groups[0]), opt.param_groups[0]
    assert group["group_bytes"] is None
    rule.largest_param_bytes = 2**30
    assert rule.group_bytes(group, fused=False) == FOREACH_ROUND_PARAMS * 2**30
    assert rule.group_bytes(group, fused=True) == SINKHORN_GROUP_BYTES
    rule.largest_param_bytes = 1
    assert rule.group_bytes(group, fused=False) == SINKHORN_GROUP_BYTES
    group["group_bytes"] = 77
    assert rule.group_bytes(group, fused=False) == rule.group_bytes(group, fused=True) == 77
    # the optimizer sets the size over all its groups before each step
    for p in opt.param_groups[0]["params"] + [emb]:
        p.grad = torch.ones_like(p)
    big = nn.Parameter(torch.randn(40, 50))
    opt.add_param_group({"params": [big]})
    big.grad = torch.ones_like(big)
    opt.step()
    assert rule.largest_param_bytes == big.numel() * big.element_size()


SIGNATURES = {
    "_sinkhorn_half": ("g_ptr:p u_ptr:w w_ptr:w m_ptr:w eps_ptr:w eps_stride t_ptr:w N_OUT "
                       "N_RED s_gb s_go s_gr", ("IS_F32", "INT64", "BLOCK_O", "BLOCK_R")),
    "_sinkgd_update": ("p_ptr:p g_ptr:p r_ptr:w c_ptr:w half_ptr:w mh_ptr:w hp_ptr:w lr_ptr:w "
                       "N R C s_pb s_pr s_pc s_gb s_gr s_gc",
                       ("IS_F32", "BF16", "LR_TENSOR", "INT64", "BLOCK")),
    "_sage_update": ("p_ptr:p g_ptr:p m_ptr:p h_ptr:w hp_ptr:w lr_ptr:w N C s_hr s_hc",
                     ("B2_ZERO", "BF16", "LR_TENSOR", "INT64", "BLOCK")),
    "_lion_update": ("p_ptr:p g_ptr:p m_ptr:p hp_ptr:w lr_ptr:w N",
                     ("BF16", "LR_TENSOR", "INT64", "BLOCK")),
    "_sinkgd_sweep": ("base_ptr:p desc_ptr:i64 prog_ptr:i32 r_ptr:w ia_ptr:w c_ptr:w cs_ptr:w "
                      "hp_ptr:w lr_ptr:w it n_c",
                      ("FIRST", "APPLY", "SQRT", "IS_F32", "BF16", "LR_TENSOR", "BLOCK_ROWS",
                       "BLOCK_COLS")),
}
"""Each kernel's arguments (``:p`` a pointer of the parameters' dtype, ``:w`` of the
arithmetic dtype, else an int) and its ``constexpr`` flags, for the compile test."""

COMPILED_DTYPES = {"fp32": "fp32", "fp64": "fp64", "bf16": "fp32"}
"""Parameter dtype -> arithmetic dtype of the compiled variants."""


def test_signatures_are_the_kernels():
    """The compile test's table lists every kernel with its exact arguments (it can fail)."""
    import inspect

    if not triton_available():
        pytest.skip("triton is not installed")
    from sage_torch import triton_kernels as tk

    assert sorted(SIGNATURES) == sorted(k.__name__ for k in tk.KERNELS)
    for name, (args, consts) in SIGNATURES.items():
        params = list(inspect.signature(getattr(tk, name)).parameters)
        assert params == [a.split(":")[0] for a in args.split()] + list(consts), name


_COMPILE_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from sage_torch import triton_kernels as tk

signatures, dtypes = json.loads(sys.argv[1]), json.loads(sys.argv[2])
out = {}
for name, (args, consts) in signatures.items():
    for dtype, wide in dtypes.items():
        for int64 in (False, True):
            sig = {}
            for a in args.split():
                arg, _, kind = a.partition(":")
                sig[arg] = {"p": f"*{dtype}", "w": f"*{wide}", "i64": "*i64", "i32": "*i32",
                            "": "i64" if int64 else "i32"}[kind]
            values = {"IS_F32": wide == "fp32", "BF16": dtype == "bf16",
                      "LR_TENSOR": dtype == "bf16", "B2_ZERO": False, "INT64": int64,
                      "BLOCK": 1024, "BLOCK_O": tk.SINKHORN_BLOCKS["rows"][0],
                      "BLOCK_R": tk.SINKHORN_BLOCKS["rows"][1], "SQRT": int64,
                      "BLOCK_ROWS": tk.sweep_blocks(1024)[0],
                      "BLOCK_COLS": tk.sweep_blocks(1024)[1]}
            sig.update(dict.fromkeys(consts, "constexpr"))
            # the sweep kernel's three sweeps: the first, a middle one, the apply sweep
            sweeps = ([(True, False), (False, False), (False, True)]
                      if "FIRST" in consts else [(False, False)])
            key = f"{name}-{dtype}-{'int64' if int64 else 'int32'}"
            try:
                for first, apply in sweeps:
                    values.update(FIRST=first, APPLY=apply)
                    src = ASTSource(fn=JITFunction(getattr(tk, name)), signature=sig,
                                    constexprs={c: values[c] for c in consts})
                    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                              options=dict(tk._COMPILE_OPTIONS))
                    if not compiled.asm["cubin"]:
                        raise RuntimeError("no cubin")
                out[key] = "ok"
            except RuntimeError as e:
                out[key] = ("skip: " if "ptxas" in str(e).lower() else "error: ") \
                    + str(e)[:2000]
            except Exception as e:
                out[key] = f"error: {type(e).__name__}: {str(e)[:2000]}"
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_kernels(tmp_path_factory):
    """Every kernel variant compiled for sm_90 in a fresh process with an empty Triton cache.

    A process of its own, without ``TRITON_INTERPRET``: ``triton.language``'s ``@jit``
    helpers are built for the interpreter or the compiler when ``triton`` is first
    imported, and in a process that imported it with ``TRITON_INTERPRET=1`` (the other
    tests) the compiler cannot lower ``tl.reduce``'s combine function; a warm cache
    would hide a failure by skipping the compilation.
    """
    import json
    import subprocess
    import sys

    if not triton_available():
        pytest.skip("triton is not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(SIGNATURES),
                           json.dumps(COMPILED_DTYPES)],
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_triton
@pytest.mark.parametrize("index", ["int32", "int64"])
@pytest.mark.parametrize("dtype", sorted(COMPILED_DTYPES))
@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_kernels_compile_for_an_h100(compiled_kernels, name, dtype, index):
    """Each kernel variant compiles to a cubin for sm_90 (Triton's bundled ptxas; no GPU).

    float32, float64 and bfloat16 parameters, int32 and int64 offsets (``INT64``, with
    64-bit integer arguments), without FMA contraction, as :func:`_launch` compiles them.
    The interpreter runs the kernels as Python; this checks what only the compiler sees
    (constexpr branches, types, the precise-math builtins, the device functions) for the
    GPU check's H100.
    """
    result = compiled_kernels[f"{name}-{dtype}-{index}"]
    if result.startswith("skip: "):  # no ptxas usable on this machine: the GPU check compiles
        pytest.skip(f"Triton's ptxas cannot run here: {result[6:]}")
    assert result == "ok", result


def test_sage_torch_imports_and_steps_without_triton():
    """With ``triton`` unimportable, sage_torch imports, steps, and fused=True names why."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import importlib.util as u; u.find_spec = lambda name, *a: None\n"
        "import torch, sage_torch\n"
        "p = torch.nn.Parameter(torch.randn(3, 4)); p.grad = torch.randn(3, 4)\n"
        "sage_torch.SinkGD([p]).step()\n"
        "try:\n"
        "    sage_torch.SinkGD([p], fused=True)\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env={**__import__("os").environ, "TRITON_INTERPRET": "1"})
    assert "needs the triton package" in out.stdout, out.stdout + out.stderr
