"""The multi-tensor (``foreach=True``) paths batch same-shape parameters: same updates.

``_multi_tensor_sage`` stacks the parameters of one shape and axes to reduce ``s``, ``Ŝ``
and the damper once; ``_multi_tensor_sinkgd`` runs the Sinkhorn iterations of every
same-shape matrix as one ``torch.bmm`` per shape.  Checked here against the single-tensor
path (float64 ≤ 1e-12 relative, and bit for bit in float32 where the kernels are the same)
and against the float64 NumPy reference, with several parameters per shape, grouped axes
(``Conv2d``), stacked layers and the Flax layout; plus: no host sync (the step completes
on the ``meta`` device) and the chunked CPU path starts no thread by default.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch
from reference_np import SageRef, SinkGDRef
from torch import nn

from sage_torch import SAGE, RuleOptimizer, SinkGD

pytestmark = pytest.mark.usefixtures("torch_one_thread")

TOL = 1e-12
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="needs a CUDA device (scripts/gpu-check runs it there)")
DEVICES = ["cpu", pytest.param("cuda", marks=CUDA)]
# several matrices per shape, a vector group, a scalar
SAGE_SHAPES = [(12, 8), (12, 8), (12, 8), (8, 12), (8, 12), (7,), (7,), (7,), ()]
SINK_SHAPES = [(12, 8), (12, 8), (12, 8), (8, 12), (8, 12), (5, 3)]


def _params(rng: np.random.Generator, shapes, dtype=torch.float64,
            device="cpu") -> list[nn.Parameter]:
    return [nn.Parameter(torch.tensor(rng.standard_normal(s) * 0.5, dtype=dtype, device=device))
            for s in shapes]


def _run_pair(build, shapes, steps=10, dtype=torch.float64, seed=3, device="cpu"):
    """Step a single-tensor and a foreach optimizer on the same gradients; return both."""
    rng = np.random.default_rng(seed)
    single = _params(rng, shapes, dtype, device)
    multi = [nn.Parameter(p.detach().clone()) for p in single]
    opt_s, opt_m = build(single, False), build(multi, True)
    for t in range(steps):
        for p, q in zip(single, multi, strict=True):
            g = torch.tensor(rng.standard_normal(p.shape) * np.exp(t % 3), dtype=dtype,
                             device=device)
            if t == 4 and p.dim() == 2:
                g[1] = 0.0  # an all-zero slice
            p.grad, q.grad = g, g.clone()
        opt_s.step()
        opt_m.step()
    return single, multi, opt_s, opt_m


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-300)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("damper", ["both", "ema", "instant", "none"])
def test_multi_tensor_sage_matches_single_float64(damper, device):
    def build(ps, fe):
        return RuleOptimizer([
            {"params": [p for p in ps if p.dim() == 2], "rule": "sage"},
            {"params": [p for p in ps if p.dim() < 2], "rule": "sage", "fan_out_dim": None},
        ], {"lr": 1e-2, "weight_decay": 0.1, "damper": damper, "foreach": fe})

    single, multi, opt_s, opt_m = _run_pair(build, SAGE_SHAPES, device=device)
    for p, q in zip(single, multi, strict=True):
        assert _rel(q, p) <= TOL
        for key, value in opt_s.state[p].items():
            assert _rel(opt_m.state[q][key], value) <= TOL, key


def test_multi_tensor_sage_matches_reference():
    rng = np.random.default_rng(5)
    ps = _params(rng, [(12, 8), (12, 8), (12, 8)])
    start = [p.detach().numpy().copy() for p in ps]
    opt = SAGE(ps, lr=1e-2, weight_decay=0.1, foreach=True)
    refs = [SageRef((12, 8), weight_decay=0.1, vocab_axis=0) for _ in ps]
    thetas = list(start)
    for _ in range(6):
        gs = [rng.standard_normal((12, 8)) for _ in ps]
        for p, g in zip(ps, gs, strict=True):
            p.grad = torch.tensor(g)
        opt.step()
        thetas = [ref.step(th, g, 1e-2) for ref, th, g in zip(refs, thetas, gs, strict=True)]
    for p, th in zip(ps, thetas, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), th, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_multi_tensor_sinkgd_matches_single_float64(normalization, device):
    alpha = 10.0 if normalization == "unit" else 0.05

    def build(ps, fe):
        return SinkGD(ps, lr=1e-2, alpha=alpha, normalization=normalization,
                      weight_decay=0.1, foreach=fe)

    single, multi, _, _ = _run_pair(build, SINK_SHAPES, device=device)
    for p, q in zip(single, multi, strict=True):
        assert _rel(q, p) <= TOL


def test_multi_tensor_sinkgd_is_bitwise_single_in_float32():
    """Same kernels (one bmm per matrix slice), same element-wise operations: equal."""
    def build(ps, fe):
        return SinkGD(ps, lr=1e-2, weight_decay=0.1, foreach=fe)

    single, multi, _, _ = _run_pair(build, SINK_SHAPES, dtype=torch.float32)
    for p, q in zip(single, multi, strict=True):
        assert torch.equal(p, q), float((p - q).abs().max())


def test_multi_tensor_sinkgd_grouped_stacked_and_flax_layouts_float64():
    """Conv2d kernels (grouped fan-in), stacked layers (a batch dim) and (in, out) matrices."""
    def build(ps, fe):
        conv, stacked, flax = ps[:2], ps[2:4], ps[4:]
        return RuleOptimizer([
            {"params": conv, "fan_in_dim": (1, 2, 3), "fan_out_dim": 0},
            {"params": stacked, "fan_in_dim": 2, "fan_out_dim": 1},
            {"params": flax, "fan_in_dim": 0, "fan_out_dim": 1},
        ], {"rule": "sinkgd", "lr": 1e-2, "weight_decay": 0.1, "foreach": fe})

    shapes = [(6, 4, 3, 3), (6, 4, 3, 3), (3, 6, 36), (2, 6, 36), (36, 6), (8, 5)]
    single, multi, _, _ = _run_pair(build, shapes)
    for p, q in zip(single, multi, strict=True):
        assert _rel(q, p) <= TOL, tuple(p.shape)


def test_multi_tensor_sinkgd_matches_reference():
    rng = np.random.default_rng(6)
    ps = _params(rng, [(12, 8), (12, 8), (8, 12)])
    opt = SinkGD(ps, lr=1e-2, weight_decay=0.1, foreach=True)
    ref = SinkGDRef(weight_decay=0.1, fan_in_axis=1, fan_out_axis=0)
    thetas = [p.detach().numpy().copy() for p in ps]
    for _ in range(4):
        gs = [rng.standard_normal(p.shape) for p in ps]
        for p, g in zip(ps, gs, strict=True):
            p.grad = torch.tensor(g)
        opt.step()
        thetas = [ref.step(th, g, 1e-2) for th, g in zip(thetas, gs, strict=True)]
    for p, th in zip(ps, thetas, strict=True):
        np.testing.assert_allclose(p.detach().numpy(), th, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scale_type", ["tensor", "channel"])
def test_multi_tensor_apollo_matches_single_float64(scale_type, device):
    """Same-shape matrices batched (one bmm with stacked projections), a stacked tensor,
    and a Conv2d kernel (grouped axes: the single-tensor path inside foreach)."""
    def projection(name, k, n, rank):
        gen = torch.Generator().manual_seed(zlib.crc32(f"{name}:{k}".encode()))
        return torch.randn(n, rank, generator=gen, dtype=torch.float64)

    def build(ps, fe):
        return RuleOptimizer([
            {"params": ps[:4]},
            {"params": ps[4:5], "fan_in_dim": 2, "fan_out_dim": 1},
            {"params": ps[5:], "fan_in_dim": (1, 2, 3), "fan_out_dim": 0},
        ], {"rule": "apollo", "lr": 1e-2, "weight_decay": 0.1, "rank": 2,
            "update_proj_gap": 3, "scale_type": scale_type, "foreach": fe},
            projection=projection)

    shapes = [(12, 8), (12, 8), (12, 8), (8, 12), (3, 12, 8), (6, 4, 3, 3)]
    single, multi, opt_s, opt_m = _run_pair(build, shapes, device=device)
    for p, q in zip(single, multi, strict=True):
        assert _rel(q, p) <= TOL, tuple(p.shape)
        for key, value in opt_s.state[p].items():
            assert _rel(opt_m.state[q][key], value) <= TOL, key


@pytest.mark.parametrize("name", ["sage-hybrid", "sinkgd-pure", "lion-hybrid", "adamw",
                                  "lion", "sage-pure", "sinkgd-hybrid", "apollo"])
def test_foreach_step_completes_on_meta_without_host_sync(name):
    """On ``meta`` any host read of a device value raises: the foreach step has none."""
    import sage_torch

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(32, 8), nn.Linear(8, 16), nn.Linear(16, 8),
                              nn.Linear(8, 16), nn.LayerNorm(8))
    for p in model.parameters():
        p.grad = torch.empty_like(p)
    opt = sage_torch.make_optimizer(name, model, foreach=True)
    opt.step()
    opt.step()
    assert all(p.device.type == "meta" for p in model.parameters())


def test_chunked_path_starts_no_thread_and_keeps_the_thread_count(monkeypatch):
    """Default ``cpu_threads=1``: no helper thread, ``torch.set_num_threads`` never called."""
    from sage_torch import chunked

    def refuse(*args, **kwargs):
        raise AssertionError("the default step touched the threads")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    monkeypatch.setattr(chunked, "_pool", refuse)
    ps = [nn.Parameter(torch.randn(512, 256)) for _ in range(2)]
    assert chunked.use_fast_path(ps[0], ps[0].detach())
    for opt in (SAGE([ps[0]], foreach=False), SinkGD([ps[1]], foreach=False)):
        for p in ps:
            p.grad = torch.randn_like(p)
        opt.step()


def test_cpu_threads_is_checked():
    with pytest.raises(ValueError, match="cpu_threads"):
        SAGE([nn.Parameter(torch.zeros(3))], cpu_threads=0)
