"""The properties docs/algorithms.md states for SAGE and SinkGD."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import hard_gradient, sparse_embedding_gradient
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import sage_optax
from sage_optax import Route

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_subnormal=False, width=32)


def run_sage(tx, grads, params):
    state = tx.init(params)
    outs = []
    for g in grads:
        u, state = tx.update(g, state, params)
        outs.append(u)
    return outs, state


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, st.sampled_from([(1, 1), (3, 5), (9, 2), (7, 7)]),
                  elements=finite),
       hnp.arrays(np.float32, (5,), elements=finite))
def test_h_is_bounded_by_one(g, v):
    """||H||_inf <= 1, hence |update| <= 1 element-wise, for any gradient (Lemma 2)."""
    tx = sage_optax.scale_by_sage()
    params = {"m": jnp.zeros(g.shape), "v": jnp.zeros(5)}
    outs, _ = run_sage(tx, [{"m": g, "v": v}, {"m": -2 * g, "v": v * 0.5}], params)
    for u in outs:
        for leaf in jax.tree.leaves(u):
            assert np.all(np.abs(np.asarray(leaf)) <= 1.0)


def test_damper_leaves_quiet_dimensions_at_one():
    """Dimensions quieter than the RMS in both the EMA and the instant signal get H = 1."""
    s = jnp.array([1.0, 1.0, 1.0, 10.0])
    h = np.asarray(sage_optax.sage_damper(s, s, 1e-8, rms_axes=(0,)))
    rms = np.sqrt(np.mean(np.square([1.0, 1.0, 1.0, 10.0])))
    np.testing.assert_array_equal(h[:3], 1.0)
    np.testing.assert_allclose(h[3], rms / (10.0 + 1e-8), rtol=1e-6)


def test_h_forced_to_one_is_exactly_lion():
    """damper='none' makes SAGE optax.lion, bit for bit on these gradients (docs/algorithms.md;
    the sign is read from M_t, identical here since no argument is a tie within rounding)."""
    rng = np.random.default_rng(0)
    params = {"e": jnp.asarray(rng.standard_normal((12, 6)), jnp.float32),
              "b": jnp.asarray(rng.standard_normal(6), jnp.float32)}
    sched = optax.cosine_decay_schedule(1e-3, 30)
    ours = sage_optax.sage(sched, b1=0.9, b2=0.99, weight_decay=0.1, damper="none")
    lion = optax.lion(sched, b1=0.9, b2=0.99, weight_decay=0.1)
    s1, s2 = ours.init(params), lion.init(params)
    p1 = p2 = params
    for t in range(30):
        g = {k: jnp.asarray(hard_gradient(rng, v.shape, t), jnp.float32) for k, v in params.items()}
        u1, s1 = jax.jit(ours.update)(g, s1, p1)
        u2, s2 = jax.jit(lion.update)(g, s2, p2)
        p1, p2 = optax.apply_updates(p1, u1), optax.apply_updates(p2, u2)
        for k in params:
            np.testing.assert_array_equal(np.asarray(p1[k]), np.asarray(p2[k]))
    np.testing.assert_array_equal(np.asarray(s1[0].mu["e"]), np.asarray(s2[0].mu["e"]))


def test_damping_changes_the_step():
    """The default damper really damps (the Lion equivalence above is not vacuous)."""
    g = {"e": jnp.asarray(sparse_embedding_gradient(np.random.default_rng(1), (20, 8)))}
    u_sage, _ = run_sage(sage_optax.scale_by_sage(), [g], {"e": jnp.zeros((20, 8))})
    u_lion, _ = run_sage(sage_optax.scale_by_sage(damper="none"), [g], {"e": jnp.zeros((20, 8))})
    assert np.any(np.abs(np.asarray(u_sage[0]["e"])) < np.abs(np.asarray(u_lion[0]["e"])))


@pytest.mark.parametrize("c", [8.0, 1 / 1024, 2.0**20])
def test_scale_invariance(c):
    """Scaling every gradient by c > 0 leaves H, hence the update, unchanged (eps = 0;
    c is a power of two so the scaled arithmetic is exact)."""
    rng = np.random.default_rng(2)
    grads = [{"e": jnp.asarray(hard_gradient(rng, (16, 5), t) + 1e-3, jnp.float32),
              "v": jnp.asarray(rng.standard_normal(5) + 3.0, jnp.float32)} for t in range(8)]
    params = jax.tree.map(jnp.zeros_like, grads[0])
    tx = sage_optax.scale_by_sage(eps=0.0)
    a, _ = run_sage(tx, grads, params)
    b, _ = run_sage(tx, [jax.tree.map(lambda x: x * c, g) for g in grads], params)
    for ua, ub in zip(a, b, strict=True):
        for k in ua:
            np.testing.assert_array_equal(np.asarray(ua[k]), np.asarray(ub[k]))


def test_zero_gradient_gives_zero_step():
    """An all-zero gradient moves θ only by weight decay, whatever the momentum holds."""
    rng = np.random.default_rng(3)
    params = {"e": jnp.asarray(rng.standard_normal((10, 4)), jnp.float32),
              "v": jnp.asarray(rng.standard_normal(4), jnp.float32)}
    lr, wd = 1e-2, 0.1
    tx = sage_optax.sage(lr, weight_decay=wd)
    state = tx.init(params)
    for t in range(5):
        g = {k: jnp.asarray(hard_gradient(rng, v.shape, t), jnp.float32) for k, v in params.items()}
        _, state = tx.update(g, state, params)
    zeros = jax.tree.map(jnp.zeros_like, params)
    u, _ = tx.update(zeros, state, params)
    for k in params:
        np.testing.assert_allclose(np.asarray(u[k]), -lr * wd * np.asarray(params[k]), rtol=1e-6)
    raw, _ = sage_optax.scale_by_sage().update(zeros, sage_optax.scale_by_sage().init(params))
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(raw))


def test_sage_is_odd():
    """SAGE(−g) = −SAGE(g) from the same state: the rule has no preferred sign."""
    rng = np.random.default_rng(4)
    grads = [jnp.asarray(hard_gradient(rng, (9, 6), t), jnp.float32) for t in range(6)]
    tx = sage_optax.scale_by_sage()
    a, _ = run_sage(tx, grads, jnp.zeros((9, 6)))
    b, _ = run_sage(tx, [-g for g in grads], jnp.zeros((9, 6)))
    for ua, ub in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(ua), -np.asarray(ub))


FLAX_KERNEL = Route("dense", -2, -1)


def sinkhorn(g, normalization="unit", num_iters=5, axes=FLAX_KERNEL):
    tx = sage_optax.scale_by_sinkhorn(num_iters, normalization=normalization, axes=axes)
    return np.asarray(tx.update(jnp.asarray(g), tx.init(jnp.asarray(g)))[0])


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("shape", [(6, 15), (15, 6), (8, 8)])
def test_sinkhorn_fan_out_norms(normalization, shape):
    """The last half-step fixes the fan-out norms: 1 (unit) or sqrt(fan-out size) (sqrt)."""
    g = hard_gradient(np.random.default_rng(5), shape, 1).astype(np.float32)
    g[g == 0] = 1e-3  # no all-zero slice
    x = sinkhorn(g, normalization)
    target = 1.0 if normalization == "unit" else np.sqrt(shape[1])
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), target, rtol=1e-5)


def test_sinkhorn_converges_to_both_marginals():
    """Many iterations on a square matrix give unit norms along both axes."""
    g = np.abs(np.random.default_rng(6).standard_normal((10, 10))).astype(np.float32) + 0.1
    x = sinkhorn(g, num_iters=200)
    np.testing.assert_allclose(np.linalg.norm(x, axis=0), 1.0, rtol=1e-4)
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, rtol=1e-4)


def test_sinkhorn_fixed_point_and_scale_invariance():
    """An orthogonal matrix already has unit norms both ways: it is a fixed point, and so
    is every positive multiple of it (up to eps)."""
    q, _ = np.linalg.qr(np.random.default_rng(7).standard_normal((12, 12)))
    q = q.astype(np.float32)
    np.testing.assert_allclose(sinkhorn(q), q, atol=1e-6)
    np.testing.assert_allclose(sinkhorn(1e3 * q), q, atol=1e-6)


def test_sinkhorn_is_odd_and_keeps_zero_slices():
    g = hard_gradient(np.random.default_rng(8), (7, 9), 2).astype(np.float32)
    g[3] = 0.0
    g[:, 5] = 0.0
    x = sinkhorn(g)
    np.testing.assert_array_equal(sinkhorn(-g), -x)
    assert np.all(x[3] == 0) and np.all(x[:, 5] == 0)
    assert np.all(np.isfinite(x))
    assert np.all(np.isfinite(sinkhorn(np.zeros((4, 5), np.float32))))


def test_sinkhorn_stacked_equals_per_layer():
    g = hard_gradient(np.random.default_rng(9), (3, 6, 10), 0).astype(np.float32)
    stacked = sinkhorn(g)
    for i in range(3):
        np.testing.assert_allclose(stacked[i], sinkhorn(g[i]), rtol=1e-6, atol=1e-7)
