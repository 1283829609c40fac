"""sage_optax.apollo against the float64 NumPy oracle ApolloRef (docs/algorithms.md, APOLLO)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_np import ApolloRef

from sage_optax import Route
from sage_optax.apollo import (
    ScaleByApolloState,
    add_decayed_weights_after_step,
    apollo,
    gaussian_projection,
    scale_by_apollo,
)

GAMMA = 1.01


@pytest.fixture
def x64():
    with jax.enable_x64(True):
        yield


class ApolloRefRecordWhenZero(ApolloRef):
    """ApolloRef with the lead's limiter rule: a recorded norm of 0 means "not recorded".

    ApolloRef limits from t = 2 on against γ·prev, so after an all-zero first gradient
    (prev = 0) it would hold every later update at zero.  sage_optax only records in that
    case; an infinite bound reproduces exactly that without touching the oracle's math.
    """

    def step(self, theta, g, lr):
        if self.prev_norm == 0.0:
            self.prev_norm = math.inf
        return super().step(theta, g, lr)


def table_projection(seen_paths=None, seed=1234, refreshes=16):
    """A path-independent projection fed to both sides: N(0, 1/r) tables drawn by NumPy.

    Indexing a constant table with the traced refresh index is cheap to compile (unlike
    jax.random), and both sides read the very same float64 numbers.
    """
    tables = {}

    def table(n, rank):
        if (n, rank) not in tables:
            rng = np.random.default_rng([seed, n, rank])
            tables[n, rank] = rng.normal(0.0, math.sqrt(1.0 / rank), (refreshes, n, rank))
        return tables[n, rank]

    def projection(path, refresh_index, n, rank):
        if seen_paths is not None:
            seen_paths.add(path)
        return jnp.asarray(table(n, rank), jnp.asarray(0.0).dtype)[refresh_index]

    def ref_projection(refresh_index, n, rank):
        assert refresh_index < refreshes
        return table(n, rank)[refresh_index]

    return projection, ref_projection


def cheap_projection():
    return table_projection()[0]


def run_parity(flax_shape, scale_type, rank, grads_fn, steps=60, gap=7, weight_decay=0.1):
    """Run apollo on a Flax kernel and the reference on its transpose; return max |Δθ|."""
    # Fed an int32 count, optax's linear warmup divides in float32, and jit and eager
    # round that differently (~1e-9 here), so hand it a float64 count: the schedule is
    # then float64 throughout and the transform (jitted) and the reference (eager) get
    # the same learning rates.
    warmup_cosine = optax.warmup_cosine_decay_schedule(0.0, 2e-2, 10, steps, 1e-3)

    def schedule(count):
        return warmup_cosine(jnp.asarray(count, jnp.float64))

    seen = set()
    projection, ref_projection = table_projection(seen)
    opt = apollo(
        schedule,
        rank=rank,
        scale_type=scale_type,
        update_proj_gap=gap,
        weight_decay=weight_decay,
        projection=projection,
    )
    ref = ApolloRefRecordWhenZero(
        flax_shape[::-1],
        rank=rank,
        scale_type=scale_type,
        update_proj_gap=gap,
        weight_decay=weight_decay,
        projection_fn=ref_projection,
    )
    rng = np.random.default_rng(sum(flax_shape) + 10 * rank + len(scale_type))
    theta0 = rng.normal(size=flax_shape)
    params = {"kernel": jnp.asarray(theta0, jnp.float64)}
    state = opt.init(params)

    @jax.jit
    def step(params, state, g):
        updates, state = opt.update({"kernel": g}, state, params)
        return optax.apply_updates(params, updates), state

    theta_ref = theta0.T
    worst = 0.0
    limited = 0
    prev_norm = None
    for t in range(steps):
        g = grads_fn(t, np.asarray(params["kernel"]), rng)
        params, state = step(params, state, jnp.asarray(g, jnp.float64))
        theta_ref = ref.step(theta_ref, g.T, float(schedule(jnp.asarray(t, jnp.int32))))
        diff = float(np.max(np.abs(np.asarray(params["kernel"]) - theta_ref.T)))
        assert diff < 1e-10, f"step {t + 1}: max |θ − θ_ref| = {diff}"
        worst = max(worst, diff)
        norm = float(state[0].norm["kernel"])
        if prev_norm is not None and abs(norm - GAMMA * prev_norm) <= 1e-12 * norm:
            limited += 1
        prev_norm = norm
    assert seen == {"kernel"}
    return worst, limited


def noisy_quadratic(target):
    def grads(t, theta, rng):
        return (theta - target) + 0.5 * rng.normal(size=theta.shape)

    return grads


@pytest.mark.parametrize("flax_shape", [(5, 8), (8, 5)], ids=["fanout>=fanin", "fanout<fanin"])
@pytest.mark.parametrize("scale_type", ["tensor", "channel"])
@pytest.mark.parametrize("rank", [1, 3])
def test_float64_matches_reference(x64, flax_shape, scale_type, rank):
    target = np.random.default_rng(7).normal(size=flax_shape)
    _, limited = run_parity(flax_shape, scale_type, rank, noisy_quadratic(target))
    assert limited > 0, "the norm-growth limiter never acted: the comparison misses it"


def test_float64_square_matrix_compresses_fan_in(x64):
    # fan-out size == fan-in size: the fan-in axis (axis 0 of a Flax kernel) is compressed.
    assert scale_by_apollo(2).init({"w": jnp.zeros((6, 6))}).mu["w"].shape == (2, 6)
    target = np.random.default_rng(8).normal(size=(6, 6))
    run_parity((6, 6), "channel", 2, noisy_quadratic(target), steps=20)


def test_zero_first_gradient_does_not_freeze(x64):
    target = np.random.default_rng(3).normal(size=(6, 9))
    quad = noisy_quadratic(target)

    def grads(t, theta, rng):
        return np.zeros_like(theta) if t == 0 else quad(t, theta, rng)

    for scale_type in ("tensor", "channel"):  # against ApolloRefRecordWhenZero
        run_parity((6, 9), scale_type, 2, grads, steps=12, gap=5, weight_decay=0.0)
    # Not frozen: after the zero step the matrix moves under the gradient.
    opt = scale_by_apollo(2, projection=cheap_projection())
    params = {"w": jnp.zeros((6, 9))}
    state = opt.init(params)
    update = jax.jit(opt.update)
    u1, state = update({"w": jnp.zeros((6, 9))}, state)
    np.testing.assert_array_equal(np.asarray(u1["w"]), 0.0)
    assert float(state.norm["w"]) == 0.0
    u2, state = update({"w": jnp.ones((6, 9))}, state)
    assert float(jnp.linalg.norm(u2["w"])) > 1.0
    assert float(state.norm["w"]) > 0.0


def test_default_projection_is_stable():
    proj = gaussian_projection(0)
    k3 = jnp.asarray(3, jnp.int32)
    n, rank = 2000, 2  # one shape throughout: eager calls compile once
    p = np.asarray(proj("layers.0.kernel", k3, n, rank))
    assert p.shape == (n, rank)
    np.testing.assert_array_equal(
        p, np.asarray(gaussian_projection(0)("layers.0.kernel", k3, n, rank))
    )
    # Under jit XLA may fuse the 1/sqrt(r) scaling differently: equal up to float32 rounding.
    jitted = jax.jit(proj, static_argnums=(0, 2, 3))("layers.0.kernel", k3, n, rank)
    np.testing.assert_allclose(np.asarray(jitted), p, rtol=3e-7, atol=0)
    for other in (
        proj("layers.0.kernel", jnp.asarray(4, jnp.int32), n, rank),  # next refresh
        proj("layers.1.kernel", k3, n, rank),  # another leaf
        gaussian_projection(1)("layers.0.kernel", k3, n, rank),  # another seed
    ):
        assert np.max(np.abs(p - np.asarray(other))) > 0.5
    assert abs(p.var() - 1 / rank) < 0.05  # entries N(0, 1/r)
    assert abs(p.mean()) < 0.05


def test_masked_inside_partition_matches_unmasked():
    # Inside optax.partition "w" is leaf 1 of {"bias", "w"}; alone it is leaf 0. P is keyed
    # on the path, so the updates agree (keyed on the leaf index, they would not).
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(size=(6, 10)), jnp.float32)
    bias = jnp.asarray(rng.normal(size=(10,)), jnp.float32)
    part = optax.partition(
        {"apollo": apollo(1e-2, rank=2, update_proj_gap=2), "other": optax.identity()},
        {"bias": "other", "w": "apollo"},
    )
    alone = apollo(1e-2, rank=2, update_proj_gap=2)
    s_part = part.init({"bias": bias, "w": w})
    s_alone = alone.init({"w": w})
    part_update, alone_update = jax.jit(part.update), jax.jit(alone.update)
    for _ in range(5):
        gw = jnp.asarray(rng.normal(size=(6, 10)), jnp.float32)
        gb = jnp.asarray(rng.normal(size=(10,)), jnp.float32)
        u_part, s_part = part_update({"bias": gb, "w": gw}, s_part, {"bias": bias, "w": w})
        u_alone, s_alone = alone_update({"w": gw}, s_alone, {"w": w})
        # Same P, same arithmetic; rtol only absorbs a possible different XLA fusion of
        # the two programs (another P changes the update at the 1e-2 level).
        np.testing.assert_allclose(
            np.asarray(u_part["w"]), np.asarray(u_alone["w"]), rtol=1e-6, atol=0
        )
        np.testing.assert_array_equal(np.asarray(u_part["bias"]), np.asarray(gb))


def test_stacked_equals_separate_layers(x64):
    # Three stacked leaves: (L, in, out) with fan-out >= fan-in and with fan-out < fan-in,
    # and (in, L, out) with the layer axis in the middle (an explicit Route).
    n_layers = 3
    rng = np.random.default_rng(1)
    dims = {"a": Route("dense", -2, -1), "b": Route("dense", -2, -1),
            "c": Route("dense", fan_in=0, fan_out=2)}
    shapes = {"a": (n_layers, 6, 10), "b": (n_layers, 10, 6), "c": (6, n_layers, 10)}
    layer_axis = {"a": 0, "b": 0, "c": 1}
    stacked = scale_by_apollo(2, update_proj_gap=2, axes=dims, projection=cheap_projection())
    single = scale_by_apollo(2, update_proj_gap=2, projection=cheap_projection())
    s_stacked = stacked.init({k: jnp.zeros(v) for k, v in shapes.items()})
    assert {k: v.shape for k, v in s_stacked.norm.items()} == {k: (n_layers,) for k in shapes}
    assert s_stacked.mu["c"].shape == (2, n_layers, 10)

    def layer(k, x, i):
        return np.take(x, i, axis=layer_axis[k])

    s_layers = [
        single.init({k: jnp.asarray(layer(k, np.zeros(v), i)) for k, v in shapes.items()})
        for i in range(n_layers)
    ]
    stacked_update, single_update = jax.jit(stacked.update), jax.jit(single.update)
    for t in range(6):
        g = {k: rng.normal(size=v) for k, v in shapes.items()}
        if t == 3:
            g["a"][1] *= 10.0  # only layer 1 jumps: per-layer limiter norms must differ
        u_stacked, s_stacked = stacked_update(jax.tree.map(jnp.asarray, g), s_stacked)
        for i in range(n_layers):
            g_i = {k: jnp.asarray(layer(k, x, i)) for k, x in g.items()}
            u_i, s_layers[i] = single_update(g_i, s_layers[i])
            for k in shapes:
                np.testing.assert_allclose(
                    layer(k, np.asarray(u_stacked[k]), i), np.asarray(u_i[k]), rtol=0, atol=1e-12
                )
                np.testing.assert_allclose(
                    float(s_stacked.norm[k][i]), float(s_layers[i].norm[k]), rtol=1e-13
                )


def test_float32_jit_does_not_recompile():
    params = {
        "w": jnp.ones((8, 12), jnp.float32),
        "stack": jnp.ones((2, 12, 4), jnp.float32),
    }
    opt = apollo(
        optax.linear_schedule(1e-3, 1e-4, 10),
        rank=2,
        update_proj_gap=2,
        projection=cheap_projection(),
    )
    state = opt.init(params)
    traces = []

    @jax.jit
    def step(params, state, grads):
        traces.append(1)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(2)
    spec0 = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for _ in range(4):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
        params, state = step(params, state, grads)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == spec0
    assert len(traces) == 1
    assert step._cache_size() == 1
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_bfloat16_state_dtypes_are_stable():
    params = {"w": jnp.ones((8, 12), jnp.bfloat16), "stack": jnp.ones((2, 4, 6), jnp.bfloat16)}
    opt = apollo(1e-3, scale_type="channel", rank=2, projection=cheap_projection())
    state = opt.init(params)
    spec0 = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    apollo_state = state[0]
    assert isinstance(apollo_state, ScaleByApolloState)
    for leaf in jax.tree.leaves((apollo_state.mu, apollo_state.nu, apollo_state.norm)):
        assert leaf.dtype == jnp.float32
    rng = np.random.default_rng(3)
    step = jax.jit(opt.update)
    for _ in range(3):
        grads = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), jnp.bfloat16), params)
        updates, state = step(grads, state, params)
        assert jax.tree.map(lambda x: x.dtype, updates) == jax.tree.map(lambda x: x.dtype, params)
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == spec0
        params = optax.apply_updates(params, updates)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(params))


def test_inject_hyperparams_matches_plain():
    params = {"w": jnp.asarray(np.random.default_rng(4).normal(size=(6, 9)), jnp.float32)}
    kwargs = dict(
        rank=2, scale_type="channel", update_proj_gap=2, seed=5, projection=cheap_projection()
    )
    hyper = dict(
        learning_rate=1e-2,
        b1=0.8,
        b2=0.99,
        eps=1e-6,
        scale=64.0,
        weight_decay=0.1,
        limiter_gamma=1.05,
    )
    plain = apollo(**kwargs, **hyper)
    injected = optax.inject_hyperparams(
        apollo, static_args=("rank", "scale_type", "update_proj_gap", "seed", "projection")
    )(**kwargs, **hyper)
    s_plain, s_inj = plain.init(params), injected.init(params)
    p_plain, p_inj = params, params
    step_inj, step_plain = jax.jit(injected.update), jax.jit(plain.update)
    rng = np.random.default_rng(5)
    for _ in range(5):
        g = {"w": jnp.asarray(rng.normal(size=(6, 9)), jnp.float32)}
        u, s_plain = step_plain(g, s_plain, p_plain)
        p_plain = optax.apply_updates(p_plain, u)
        u, s_inj = step_inj(g, s_inj, p_inj)
        p_inj = optax.apply_updates(p_inj, u)
        np.testing.assert_allclose(
            np.asarray(p_inj["w"]), np.asarray(p_plain["w"]), rtol=1e-5, atol=1e-6
        )


def test_vector_leaf_is_rejected():
    opt = scale_by_apollo()
    with pytest.raises(ValueError, match=r"APOLLO needs a matrix.*'norm\.scale'.*\(16,\)"):
        opt.init({"norm": {"scale": jnp.ones(16)}, "w": jnp.ones((4, 4))})
    with pytest.raises(ValueError, match=r"APOLLO needs a matrix.*'b'"):
        opt.init({"b": jnp.ones(())})
    with pytest.raises(ValueError, match=r"APOLLO needs a matrix.*'w'"):
        scale_by_apollo(axes=Route("vector")).init({"w": jnp.ones((4, 4))})
    # The same check guards update (e.g. a state built for other params).
    state = opt.init({"w": jnp.ones((4, 4))})
    with pytest.raises(ValueError, match=r"APOLLO needs a matrix.*'w'"):
        opt.update({"w": jnp.ones(4)}, state)


def test_bad_hyperparameters_are_rejected():
    with pytest.raises(ValueError, match="learning_rate"):
        apollo(-1e-3)
    with pytest.raises(ValueError, match="rank"):
        apollo(1e-3, rank=0)
    with pytest.raises(ValueError, match="scale_type"):
        apollo(1e-3, scale_type="row")
    with pytest.raises(ValueError, match="update_proj_gap"):
        apollo(1e-3, update_proj_gap=0)
    with pytest.raises(ValueError, match="limiter_gamma"):
        apollo(1e-3, limiter_gamma=0.5)
    with pytest.raises(ValueError, match="weight_decay"):
        apollo(1e-3, weight_decay=-0.1)
    bad = scale_by_apollo(2, projection=lambda path, k, n, r: jnp.ones((n, r + 1)))
    state = bad.init({"w": jnp.ones((4, 6))})
    with pytest.raises(ValueError, match=r"'w'.*projection returned shape \(4, 3\)"):
        bad.update({"w": jnp.ones((4, 6))}, state)


def test_norm_growth_limiter_bounds_growth():
    rng = np.random.default_rng(6)
    base = jnp.asarray(rng.normal(size=(8, 12)), jnp.float32)
    # Gradients near ε: R̃ = M/(√V + ε) then follows the gradient's size, so the 10x jump
    # of the gradient norm at step 5 shows in ‖U‖ (at O(1) gradients APOLLO's tensor scale
    # largely cancels it).
    scales = [1e-7] * 4 + [1e-6] * 6 + [1e-7] * 3

    def norms(gamma):
        opt = scale_by_apollo(1, limiter_gamma=gamma, projection=cheap_projection())
        state = opt.init({"w": base})
        update = jax.jit(opt.update)
        out = []
        for t, c in enumerate(scales, start=1):
            u, state = update({"w": base * c}, state)
            correction = math.sqrt(1 - 0.999**t) / (1 - 0.9**t)
            u_norm = float(jnp.linalg.norm(u["w"])) / correction
            np.testing.assert_allclose(u_norm, float(state.norm["w"]), rtol=1e-5)
            out.append(u_norm)
        return out

    limited = norms(GAMMA)
    for t in range(1, len(limited)):
        assert limited[t] <= GAMMA * limited[t - 1] * (1 + 1e-6), (t, limited)
    assert limited[4] == pytest.approx(GAMMA * limited[3], rel=1e-6)  # it acted at the jump
    free = norms(float("inf"))
    assert free[4] > 2 * free[3]  # without the limiter the jump shows


def test_decay_after_step_with_mask_and_schedule():
    schedule = optax.linear_schedule(0.5, 0.1, 4)
    tx = add_decayed_weights_after_step(0.2, schedule, mask={"a": True, "b": False})
    params = {"a": jnp.asarray([1.0, -2.0]), "b": jnp.asarray([3.0, 4.0])}
    u = {"a": jnp.asarray([0.5, 0.25]), "b": jnp.asarray([1.0, -1.0])}
    state = tx.init(params)
    for t in range(3):
        eta = float(schedule(t))
        delta, state = tx.update(u, state, params)
        new = optax.apply_updates(params, delta)
        expect_a = (np.asarray(params["a"]) - eta * np.asarray(u["a"])) * (1 - eta * 0.2)
        expect_b = np.asarray(params["b"]) - eta * np.asarray(u["b"])
        np.testing.assert_allclose(np.asarray(new["a"]), expect_a, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(new["b"]), expect_b, rtol=1e-6)
        params = new
    with pytest.raises(ValueError, match="needs the params"):
        tx.update(u, state, None)


def test_state_is_tiny_for_rank_one():
    opt = scale_by_apollo(1)
    # Flax kernel (in=64, out=256): fan-out >= fan-in, the fan-in axis is compressed.
    s = opt.init({"w": jnp.zeros((64, 256), jnp.float32)})
    assert s.mu["w"].shape == (1, 256)
    assert s.nu["w"].shape == (1, 256)
    assert s.norm["w"].shape == ()
    assert sum(x.nbytes for x in jax.tree.leaves(s)) == 4 * (2 * 256 + 1) + 4
    # Flax kernel (in=256, out=64): the fan-out axis is compressed.
    s = opt.init({"w": jnp.zeros((256, 64), jnp.float32)})
    assert s.mu["w"].shape == (256, 1)
    # PyTorch layout (out=256, in=64): fan-in is the last axis and is compressed.
    s = scale_by_apollo(1, axes=Route("dense", fan_in=-1, fan_out=-2)).init(
        {"w": jnp.zeros((256, 64), jnp.float32)}
    )
    assert s.mu["w"].shape == (256, 1)
    assert s.nu["w"].shape == (256, 1)
