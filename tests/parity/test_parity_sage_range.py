"""SAGE near float32's limit: every finite gradient gives a finite update, in both frameworks.

A plain ``mean(|g|)`` over a vocab axis of ``V`` entries overflows float32 once ``|g|`` passes
about ``3.4e38 / V`` (``1e34`` at ``V = 32000``), and ``σ = sqrt(mean(Ŝ²))`` once ``Ŝ`` passes
about ``1.8e19``; the first gave ``inf / inf = NaN`` updates, the second ``σ = inf`` and so a
damper stuck at 1.  Here gradients up to ``3e38`` with ``V = 32000`` (float32 and bfloat16)
are stepped through ``sage_optax`` and every ``sage_torch`` path (single-tensor, the chunked
CPU path, foreach, and the fused Triton kernels under the interpreter) and compared with the
float64 reference (tests/reference_np.py), in which nothing overflows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import reference_np as ref
import torch

import sage_optax
from sage_torch import SAGE, chunked
from sage_torch.common import triton_available

V = 32000
STEPS = 3
F32_TOL = 1e-5  # float32 agreement (SPEC section 7; tests/torch/test_torch_fused.py)
BF16_TOL = 2.0**-8  # one bfloat16 unit at |u| <= 1: the update is rounded to bfloat16
COLUMN_SCALES = (3e38, 1e38, 1e30, 1e20, 1.0, 0.0)  # the last: an all-zero column

# name: (shape, vocab axis of the reference, torch fan_out_dim)
CASES = {
    "embedding": ((V, len(COLUMN_SCALES)), 0, -2),  # nn.Embedding (V, d): reduce over rows
    "head-rows": ((len(COLUMN_SCALES), V), 1, -1),  # the vocab axis last: reduce over columns
    "vector": ((V,), None, -2),  # element-wise s = |g|: σ, γ over 32000 huge entries
}


def gradients(shape: tuple[int, ...], vocab_axis: int | None) -> list[np.ndarray]:
    """``STEPS`` float32 gradients with entries up to 3e38 and exact zeros.

    Every step keeps the first step's signs (magnitudes change), so that the sign of the
    momentum is never a near tie that bfloat16 rounding could flip.
    """
    rng = np.random.default_rng(0)
    if vocab_axis is None:
        scale = np.where(np.arange(shape[0]) % 3 == 0, 3e38, 10.0 ** rng.uniform(-3, 38, shape))
    else:
        scale = np.expand_dims(np.asarray(COLUMN_SCALES), vocab_axis)
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0) * (rng.random(shape) > 0.3)
    return [(sign * scale * rng.uniform(0.3, 1.0, shape)).astype(np.float32)
            for _ in range(STEPS)]


def reference_updates(shape: tuple[int, ...], vocab_axis: int | None,
                      grads: list[np.ndarray]) -> list[np.ndarray]:
    """The float64 SAGE updates ``C·H`` (weight decay 0, lr 1, θ reset to 0 each step)."""
    r = ref.SageRef(shape, weight_decay=0.0, vocab_axis=vocab_axis)
    zero = np.zeros(shape)
    return [-r.step(zero, g.astype(np.float64), 1.0) for g in grads]


def as_dtype(grads: list[np.ndarray], dtype: str) -> list[np.ndarray]:
    """The gradients rounded to ``dtype`` (bfloat16: all of them stay finite, < 3.39e38)."""
    if dtype == "float32":
        return grads
    out = [g.astype(ml_dtypes.bfloat16) for g in grads]
    assert all(np.isfinite(g.astype(np.float64)).all() for g in out)
    return out


def check(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    assert np.isfinite(got).all(), f"{np.count_nonzero(~np.isfinite(got))} non-finite entries"
    tol = F32_TOL if dtype == "float32" else BF16_TOL
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sage_optax_huge_gradients_match_reference(case, dtype):
    shape, vocab_axis, _ = CASES[case]
    grads = as_dtype(gradients(shape, vocab_axis), dtype)
    want = reference_updates(shape, vocab_axis, [g.astype(np.float64) for g in grads])
    axes = (sage_optax.Route("dense", fan_in=-2, fan_out=-1) if vocab_axis == 1
            else sage_optax.EMBEDDING_TABLE)
    tx = sage_optax.scale_by_sage(axes=axes)
    params = jnp.zeros(shape, jnp.dtype(dtype))
    state = tx.init(params)
    update = jax.jit(tx.update)
    for g, w in zip(grads, want, strict=True):
        u, state = update(jnp.asarray(g), state)
        assert u.dtype == jnp.dtype(dtype)
        check(np.asarray(u.astype(jnp.float32), np.float64), w, dtype)


PATHS = ("single", "chunked", "foreach", "fused")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sage_torch_huge_gradients_match_reference(case, dtype, path, monkeypatch):
    shape, vocab_axis, fan_out_dim = CASES[case]
    if path == "fused":
        if not triton_available():
            pytest.skip("the triton package is not installed")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    if path == "chunked" and dtype == "bfloat16":
        pytest.skip("the chunked CPU path takes float32/float64 parameters only")
    # "single" must not take the chunked path, which "chunked" must take.
    monkeypatch.setattr(chunked, "FAST_MIN_NUMEL", 1 if path == "chunked" else 2**62)
    grads = as_dtype(gradients(shape, vocab_axis), dtype)
    want = reference_updates(shape, vocab_axis, [g.astype(np.float64) for g in grads])
    tdtype = getattr(torch, dtype)
    p = torch.nn.Parameter(torch.zeros(shape, dtype=tdtype))
    kw = {"fused": True} if path == "fused" else {"foreach": path == "foreach"}
    opt = SAGE([p], lr=1.0, weight_decay=0.0, fan_out_dim=fan_out_dim, **kw)
    for g, w in zip(grads, want, strict=True):
        with torch.no_grad():
            p.zero_()
        p.grad = torch.from_numpy(g.astype(np.float32)).to(tdtype)
        opt.step()
        check(-p.detach().double().numpy(), w, dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 1000, 32000, 32768, 32769])
def test_mean_scale_keeps_every_partial_sum_in_range(n):
    """``n · mean_scale(n) ≤ 1`` with a power of two, the largest such (one definition, both
    frameworks use it: sage_optim.numerics)."""
    import importlib

    from sage_optim.numerics import mean_scale

    jax_sage, torch_sage = map(importlib.import_module, ("sage_optax.sage", "sage_torch.sage"))
    assert jax_sage.mean_scale is mean_scale is torch_sage.mean_scale
    c = mean_scale(n)
    assert n * c <= 1 and (n == 1 or n * c * 2 > 1)
    assert np.frexp(c)[0] == 0.5  # a power of two: scaling by it is exact


def test_ordinary_gradients_unchanged_by_range_scaling():
    """Where nothing overflows, the scaled mean and RMS are the plain ones, bit for bit."""
    from sage_optax.sage import rms as jax_rms
    from sage_torch.sage import _mean_abs, sage_damper

    rng = np.random.default_rng(1)
    g = torch.from_numpy((rng.standard_normal((V, 7)) * 10.0 ** rng.uniform(-6, 6, 7))
                         .astype(np.float32))
    assert torch.equal(_mean_abs(g, 0), g.abs().mean(dim=0))
    s, s_hat = g.abs().mean(dim=0), g[:9].abs().mean(dim=0)
    plain = torch.minimum((s_hat.square().mean().sqrt() / (s_hat + 1e-8)).clamp_max(1),
                          s.square().mean().sqrt() / (s + 1e-8))
    assert torch.equal(sage_damper(s, s_hat, 1e-8), plain)
    j = jnp.asarray(g.numpy())
    np.testing.assert_array_equal(np.asarray(jax_rms(j, (0,))),
                                  np.asarray(jnp.sqrt(jnp.mean(jnp.square(j), 0, keepdims=True))))


@pytest.mark.parametrize("kernel", ["jnp", "pallas"])
def test_sinkgd_at_the_float32_limit_matches_the_reference(kernel):
    """SinkGD's range scale stays a normal power of two (XLA:CPU flushed 1/2^127 to zero)."""
    import optax

    rng = np.random.default_rng(4)
    g = rng.standard_normal((20, 12))
    for top in (3e18, 1.7e38, 3e38):
        g32 = (g * (top / np.abs(g).max())).astype(np.float32)
        tx = sage_optax.scale_by_sinkhorn(impl=kernel)
        out, _ = jax.jit(tx.update)({"w": jnp.asarray(g32)}, optax.EmptyState())
        want = ref.sinkhorn_ref(g32.astype(np.float64))
        np.testing.assert_allclose(np.asarray(out["w"], np.float64), want, rtol=1e-5,
                                   atol=1e-6 * np.abs(want).max(), err_msg=f"max |g| {top}")
