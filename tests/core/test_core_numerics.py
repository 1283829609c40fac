"""The power-of-two range helpers: one definition (sage_optim.numerics), one array version per
framework, each checked against the definition element-wise at the edges (issue 32).

Before, torch had two copies with opposite conventions (``m ≤ a < 2m`` for SinkGD,
``a < m ≤ 2a`` for SAGE's RMS values) and JAX two copies of the floor; an exact power of
two, 0, the largest float and the non-finite values tell the conventions apart."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from sage_optim import numerics


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


def edges(dtype: type) -> np.ndarray:
    fi = np.finfo(dtype)
    values = [0.0, float(fi.smallest_subnormal), float(fi.tiny) / 3, float(fi.tiny), 0.75, 1.0,
              1.5, 2.0, 3.0, 2.0**20, 2.0**20 * 1.999, float(fi.max) / 2, float(fi.max),
              math.inf, math.nan, 1 / float(fi.tiny), 2 / float(fi.tiny)]
    rng = np.random.default_rng(0)
    values += list(10.0 ** rng.uniform(-40 if dtype == np.float32 else -300,
                                       38 if dtype == np.float32 else 300, 64))
    with np.errstate(over="ignore"):
        return np.array(values, dtype=dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_framework_computes_the_one_definition(dtype, x64):
    x = edges(dtype)
    tiny = float(np.finfo(dtype).tiny)
    want = np.array([numerics.pow2_floor(float(v), tiny) for v in x], dtype=dtype)
    got_torch = sage_torch_pow2(x)
    got_jax = np.asarray(sage_optax_pow2(x))
    np.testing.assert_array_equal(got_torch, want)
    # XLA:CPU flushes subnormal inputs to zero (a subnormal maximum reads as 0, so m = 1);
    # every normal, zero and non-finite value gives the definition's m
    normal = ~((x > 0) & (x < tiny))
    np.testing.assert_array_equal(got_jax[normal], want[normal])
    m = want
    want_half = np.array([numerics.pow2_sqrt_floor(float(v)) for v in m], dtype=dtype)
    from sage_optax.numerics import pow2_sqrt_floor as jax_half
    from sage_torch.common import pow2_sqrt_floor as torch_half

    np.testing.assert_array_equal(torch_half(torch.from_numpy(m)).numpy(), want_half)
    np.testing.assert_array_equal(np.asarray(jax_half(jnp.asarray(m))), want_half)


def sage_torch_pow2(x: np.ndarray) -> np.ndarray:
    from sage_torch.common import pow2_floor

    return pow2_floor(torch.from_numpy(x)).numpy()


def sage_optax_pow2(x: np.ndarray) -> np.ndarray:
    from sage_optax.numerics import pow2_floor

    return np.asarray(pow2_floor(jnp.asarray(x)))


def test_the_definition_is_the_floor_and_finite():
    """``m ≤ a < 2m`` (a power of two maps to itself), within ``[tiny, 1/tiny]``."""
    tiny = float(np.finfo(np.float32).tiny)
    for a in (1.0, 2.0**-100, 2.0**100, 3.0, 0.3):
        m = numerics.pow2_floor(a, tiny)
        assert m <= a < 2 * m and math.frexp(m)[0] == 0.5
    assert numerics.pow2_floor(float(np.finfo(np.float32).max), tiny) == 1 / tiny
    assert numerics.pow2_floor(0.0, tiny) == numerics.pow2_floor(math.nan, tiny) == 1.0
    assert numerics.pow2_floor(1e-45, tiny) == tiny
    for k in range(-126, 127):
        assert numerics.pow2_sqrt_floor(2.0**k) == 2.0 ** (k // 2)


def test_every_user_takes_the_one_version_of_its_framework():
    """No second copy: SAGE's RMS and SinkGD's range scale share one function per framework,
    and the Pallas kernel takes it from sage_optax.numerics (no sinkhorn <-> sinkhorn_pallas
    cycle)."""
    import importlib

    jax_sage, jax_sinkhorn, jax_numerics, torch_common, torch_sage, torch_sinkgd = (
        importlib.import_module(m) for m in (
            "sage_optax.sage", "sage_optax.sinkgd", "sage_optax.numerics", "sage_torch.common",
            "sage_torch.sage", "sage_torch.sinkgd"))
    assert torch_sage.pow2_floor is torch_sinkgd.pow2_floor is torch_common.pow2_floor
    assert jax_sage.pow2_floor is jax_numerics.pow2_floor
    assert jax_sinkhorn.range_scale is jax_numerics.range_scale
    assert not hasattr(torch_sage, "_pow2_scale") and not hasattr(jax_sage, "_pow2_floor")
    assert jax_sage.mean_scale is torch_sage.mean_scale is numerics.mean_scale


def test_sage_damper_agrees_across_frameworks_at_the_edge_of_float32():
    """σ/γ scaled by the same ``m`` in both frameworks: at the largest float32 values too."""
    from sage_optax.sage import sage_damper as jax_damper
    from sage_torch.sage import sage_damper as torch_damper

    fmax = float(np.finfo(np.float32).max)
    s = np.array([fmax, fmax / 2, 1.0, 2.0**127, 0.0], np.float32)
    s_hat = np.array([2.0**127, fmax, 3.0, 1e-30, 2.0], np.float32)
    want = np.asarray(jax_damper(jnp.asarray(s), jnp.asarray(s_hat), 1e-8))
    got = torch_damper(torch.from_numpy(s), torch.from_numpy(s_hat), 1e-8).numpy()
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got, want, rtol=3e-7, atol=0)  # XLA's mean/sqrt: 1 ulp
