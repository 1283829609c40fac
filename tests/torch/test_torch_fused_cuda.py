"""The fused (Triton) path on CUDA: the evidence for (or against) making it a default.

Skipped without a CUDA device; ``scripts/gpu-check`` (part a) runs this file on a
GPU and reports it next to the fused-vs-foreach timings of ``benchmarks/torch_step.py``.

* SAGE, Lion and SinkGD, fused against foreach and single-tensor, float32 (over steps:
  ``≤ 1e-5`` of the largest entry, as the CPU tests) and bfloat16 (step by step from the
  same state: ``θ`` within one bfloat16 unit of the parameter, ``M`` within one unit; the
  arithmetic is that of ``tests/torch/test_torch_fused_bf16.py``, where only orders of sums,
  CUDA's FMA contractions in torch's own ``add`` and the flips of bfloat16 roundings they
  cause can differ).
* ``make_optimizer(name, model, fused=True)`` for sage-hybrid, lion-hybrid and
  sinkgd-hybrid on a small ``nn.Module`` (no transformers), float32 and bfloat16.
* The first-use check passes on CUDA in float32, float64 and bfloat16, and the fused
  kernels run inside a captured CUDA graph after warm-up steps.
* Several devices (two GPUs or more): parameters on ``cuda:0`` and ``cuda:1`` in one
  optimizer, stepped while ``cuda:0`` is current, equal the single-tensor path.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import sage_torch
from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available

if triton_available():  # pragma: no branch
    # Imported here, at collection, before any test sets TRITON_INTERPRET=1: triton builds
    # triton.language's @jit helpers for whichever mode is set at its first import, and
    # these tests compile (the interpreter tests of other files run either way).
    import triton.language  # noqa: F401

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (scripts/gpu-check runs it there)"),
    pytest.mark.skipif(not triton_available(), reason="the triton package is not installed"),
]

BF16 = torch.bfloat16
F32_TOL = 1e-5
PATHS = ("single", "foreach", "fused")


def _kw(path: str) -> dict:
    return {"fused": True} if path == "fused" else {"foreach": path == "foreach"}


def _ulp(x: torch.Tensor) -> torch.Tensor:
    from sage_torch.fused_check import ulp

    return ulp(x)


def _opt(cls: type, **defaults) -> Callable:
    """``cls(params, **defaults, **kw)``, ``kw`` winning (``lr`` and ``capturable``)."""
    return lambda ps, kw: cls(ps, **{**defaults, **kw})


MAKERS: dict[str, tuple[Callable, list[tuple[int, ...]]]] = {
    "sage": (_opt(SAGE, lr=1e-2, weight_decay=0.1), [(64, 48), (48,), (5, 7)]),
    "sage-rows": (_opt(SAGE, lr=1e-2, weight_decay=0.1, fan_out_dim=-1), [(64, 48), (5, 7)]),
    "lion": (_opt(Lion, lr=1e-2, weight_decay=0.1), [(64, 48), (3000,), ()]),
    "sinkgd": (_opt(SinkGD, lr=1e-2, weight_decay=0.1),
               [(64, 48), (64, 48), (300, 17), (3, 5, 4)]),
    "sinkgd-sqrt": (_opt(SinkGD, lr=1e-2, normalization="sqrt", alpha=0.05, weight_decay=0.1),
                    [(64, 48), (17, 300)]),
}


def _data(shapes, steps, dtype, seed=0):
    """Parameters with ``|θ| ≥ 0.5`` (one bfloat16 unit then bounds a flipped rounding of
    the update, see ``tests/torch/test_torch_fused_bf16.py``) and gradients, on ``cuda``."""
    gen = torch.Generator().manual_seed(seed)
    start = []
    for s in shapes:
        sign = torch.randint(0, 2, s, generator=gen) * 2 - 1
        start.append((sign * (0.5 + torch.rand(s, generator=gen))).to("cuda", dtype))
    grads = [[torch.randn(s, generator=gen).to("cuda", dtype) for s in shapes]
             for _ in range(steps)]
    return start, grads


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fused_matches_foreach_and_single_float32(name):
    make, shapes = MAKERS[name]
    start, grads = _data(shapes, 4, torch.float32)
    out = {}
    for path in PATHS:
        ps = [nn.Parameter(p.clone()) for p in start]
        opt = make(ps, _kw(path))
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        out[path] = [p.detach() for p in ps]
    for path in ("foreach", "fused"):
        for a, b in zip(out[path], out["single"], strict=True):
            scale = float(b.abs().max())
            assert float((a - b).abs().max()) <= F32_TOL * scale, (path, tuple(a.shape))
    assert not torch.equal(out["fused"][0], start[0])


def _compare_bf16(opts, refs, ref_opt, opt):
    for a, b in zip(opts, refs, strict=True):
        assert a.dtype == BF16
        assert bool(((a - b).double().abs() <= _ulp(b)).all()), tuple(a.shape)
        for key, value in ref_opt.state[b].items():
            if key != "step" and value.dtype == BF16:
                got = opt.state[a][key]
                assert bool(((got - value).double().abs() <= _ulp(value)).all()), key


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fused_matches_foreach_and_single_bfloat16(name):
    """Step by step from the single path's state: within one bfloat16 unit."""
    make, shapes = MAKERS[name]
    start, grads = _data(shapes, 3, BF16)
    runs = {}
    for path in PATHS:
        ps = [nn.Parameter(p.clone()) for p in start]
        runs[path] = (ps, make(ps, _kw(path)))
    refs, ref_opt = runs["single"]
    for gs in grads:
        for ps, opt in runs.values():
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        for path in ("foreach", "fused"):
            ps, opt = runs[path]
            _compare_bf16(ps, refs, ref_opt, opt)
            with torch.no_grad():  # the next step from the same state
                for a, b in zip(ps, refs, strict=True):
                    a.copy_(b)
                    for key, value in ref_opt.state[b].items():
                        opt.state[a][key].copy_(value)


class _Small(nn.Module):
    """An embedding, two projections, a norm and a head: every route of the configurations."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(96, 32)
        self.up = nn.Linear(32, 64, bias=False)
        self.down = nn.Linear(64, 32)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 96, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        x = x + self.down(torch.relu(self.up(x)))
        return self.head(self.norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["sage-hybrid", "lion-hybrid", "sinkgd-hybrid"])
def test_make_optimizer_fused_matches_foreach_and_single(name, dtype):
    """Gradients of a real loss; float32 over steps, bfloat16 step by step.

    The groups of the rules with a fused path are compared with the single-tensor path
    (AdamW's: ``torch._fused_adamw_`` in float32); bfloat16 AdamW groups take the foreach
    path inside the fused optimizer and must equal the foreach optimizer's bit for bit
    (AdamW's own foreach-vs-single rounding in bfloat16 is not this file's subject).
    """
    torch.manual_seed(0)
    base = _Small().to("cuda", dtype)
    tokens = torch.randint(0, 96, (4, 16), device="cuda")
    models = {path: _Small().to("cuda", dtype) for path in PATHS}
    opts = {}
    for path, model in models.items():
        model.load_state_dict(base.state_dict())
        opts[path] = sage_torch.make_optimizer(name, model, lr=1e-2, **_kw(path))
    fused_groups = [g for g in opts["fused"].param_groups if g["fused"]]
    assert fused_groups and all(g["rule"] in ("sage", "lion", "sinkgd", "adamw")
                                for g in fused_groups)
    if dtype == BF16:
        fused_groups = [g for g in fused_groups if g["rule"] != "adamw"]
    fused_ids = {id(p) for g in fused_groups for p in g["params"]}
    has_fused = [id(p) in fused_ids for p in models["fused"].parameters()]
    for _ in range(3):
        before = [p.detach().clone() for p in models["single"].parameters()]
        for model in models.values():
            model.zero_grad()
            model(tokens).float().logsumexp(-1).mean().backward()
        grads = [p.grad.clone() for p in models["single"].parameters()]
        for model in models.values():  # the same gradients for all three paths
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g.clone()
        for opt in opts.values():
            opt.step()
        ref = [p.detach() for p in models["single"].parameters()]
        for a, b, fused in zip(models["fused"].parameters(), models["foreach"].parameters(),
                               has_fused, strict=True):
            if not fused:
                assert torch.equal(a, b)
        for path in ("foreach", "fused"):
            got = [p.detach() for p in models[path].parameters()]
            for a, b, b0, fused in zip(got, ref, before, has_fused, strict=True):
                if not fused:
                    continue
                if dtype == torch.float32:
                    scale = max(float(b.abs().max()), 1e-30)
                    assert float((a - b).abs().max()) <= F32_TOL * scale, path
                else:
                    # one bfloat16 unit of θ, plus two of the step η·d where θ is small (a
                    # flipped rounding of d moves η·d by η·unit(d) ≤ 2·unit(η·d)): these
                    # parameters are not bounded away from zero
                    bound = _ulp(b) + 2 * _ulp((b.double() - b0.double()).to(BF16))
                    assert bool(((a.double() - b.double()).abs() <= bound).all()), path
            if dtype == BF16:
                with torch.no_grad():  # the next step from the same state
                    for a, b in zip(models[path].parameters(), models["single"].parameters(),
                                    strict=True):
                        a.copy_(b)
                        for key, value in opts["single"].state[b].items():
                            opts[path].state[a][key].copy_(value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, BF16])
def test_first_use_check_passes_on_cuda(dtype):
    from sage_torch import fused_check

    assert fused_check.self_check(torch.device("cuda", torch.cuda.current_device()),
                                  dtype) is None


@pytest.mark.parametrize("name", ["sage", "lion", "sinkgd", "sinkgd-sweep"])
def test_fused_step_captured_in_a_cuda_graph(name):
    """capturable=True, fused: warm-up steps (and the check), capture, replay = eager.

    Bit for bit, but for SinkGD's sweep kernel (``sinkgd-sweep``), whose column sums are
    added with atomics in an order that may change from run to run: within float32
    rounding there.  ``sinkgd`` runs under ``torch.use_deterministic_algorithms``, which
    takes the deterministic two-launch kernels.
    """
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(name == "sinkgd", warn_only=True)
    try:
        _captured_equals_eager(name)
    finally:
        torch.use_deterministic_algorithms(deterministic)


def _captured_equals_eager(name):
    make, shapes = MAKERS["sinkgd" if name == "sinkgd-sweep" else name]
    start, grads = _data(shapes, 8, torch.float32, seed=1)
    eager = [nn.Parameter(p.clone()) for p in start]
    cap = [nn.Parameter(p.clone()) for p in start]
    for q in cap:
        q.grad = torch.zeros_like(q)
    lr = torch.tensor(1e-2, device="cuda")
    opt_e = make(eager, {"fused": True, "capturable": True, "lr": lr.clone()})
    opt_c = make(cap, {"fused": True, "capturable": True, "lr": lr})

    def feed(t):
        for p, q, g in zip(eager, cap, grads[t], strict=True):
            p.grad = g.clone()
            q.grad.copy_(g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for t in range(3):
            feed(t)
            opt_e.step()
            opt_c.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_c.step()
    for t in range(3, 8):
        feed(t)
        opt_e.step()
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager, cap, strict=True):
        if name == "sinkgd-sweep":
            assert float((p - q).abs().max()) <= F32_TOL * float(p.abs().max()), p.shape
        else:
            assert torch.equal(p, q), tuple(p.shape)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["sage", "lion", "sinkgd"])
def test_parameters_on_two_devices_in_one_optimizer(name, dtype):
    """cuda:0 and cuda:1 in one fused optimizer (cuda:0 current) = single-tensor, per device."""
    make, shapes = MAKERS[name]
    start, grads = _data(shapes, 2, dtype, seed=2)
    devices = [torch.device("cuda", i % 2) for i in range(len(shapes))]
    start = [p.to(d) for p, d in zip(start, devices, strict=True)]
    out = {}
    for path in ("single", "fused"):
        ps = [nn.Parameter(p.clone()) for p in start]
        opt = make(ps, _kw(path))
        with torch.cuda.device(0):
            for gs in grads:
                for p, g, d in zip(ps, gs, devices, strict=True):
                    p.grad = g.to(d)
                opt.step()
        out[path] = ps
    for a, b, d in zip(out["fused"], out["single"], devices, strict=True):
        assert a.device == b.device == d
        if dtype == torch.float32:
            assert float((a - b).abs().max()) <= F32_TOL * float(b.abs().max())
        else:  # two steps: at most one unit of θ per step
            assert bool(((a - b).double().abs() <= 2 * _ulp(b)).all())
