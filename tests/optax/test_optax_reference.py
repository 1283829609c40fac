"""Every transform against the float64 NumPy transcription of the paper (tests/reference_np.py).

Run in float64 over 60 steps with a warmup + cosine schedule, sparse embedding gradients,
exact zeros, column scales spanning 6 orders of magnitude, spikes, and stacked leaves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_np as ref
from helpers import hard_gradient, mixed_gradient, mixed_params, sparse_embedding_gradient

import sage_optax
from sage_optim import CONFIG_NAMES, get_preset

STEPS = 60
TOL = 1e-10  # float64 agreement (docs/configurations.md)


def schedule(peak: float):
    """Warmup (10%) + cosine to peak/100, evaluated in float64 (optax's own schedules keep
    float32 intermediates, which would blur a 1e-10 comparison)."""
    warmup = STEPS // 10

    def sched(count):
        c = jnp.asarray(count, jnp.float64)
        warm = peak * (0.1 + 0.9 * c / warmup)
        frac = jnp.clip((c - warmup) / (STEPS - warmup), 0.0, 1.0)
        cos = peak / 100 + (peak - peak / 100) * 0.5 * (1 + jnp.cos(jnp.pi * frac))
        return jnp.where(c < warmup, warm, cos)

    return sched


def lr_at(sched, t):
    """The learning rate applied at step t + 1 (the schedule sees the count t)."""
    with jax.enable_x64(True):
        return float(sched(t))


def run_pair(tx, refs, params, grads_fn, peak):
    """Step a JAX transform and a per-leaf reference side by side; return the max gap."""
    sched = schedule(peak)
    with jax.enable_x64(True):
        p = jax.tree.map(jnp.asarray, params)
        state = tx.init(p)
        update = jax.jit(tx.update)
        theta = {k: np.asarray(v) for k, v in params.items()}
        worst = 0.0
        for t in range(STEPS):
            g = grads_fn(t)
            upd, state = update(jax.tree.map(jnp.asarray, g), state, p)
            p = optax.apply_updates(p, upd)
            lr = lr_at(sched, t)
            for k in theta:
                theta[k] = refs[k].step(theta[k], g[k], lr)
                gap = float(np.max(np.abs(np.asarray(p[k]) - theta[k])))
                worst = max(worst, gap)
                assert gap < TOL, f"step {t + 1}, leaf {k}: gap {gap:.3e}"
    return worst


class Stacked:
    """Reference for a stacked (L, ...) leaf: one reference object per layer."""

    def __init__(self, make, n):
        self.refs = [make() for _ in range(n)]

    def step(self, theta, g, lr):
        return np.stack([r.step(theta[i], g[i], lr) for i, r in enumerate(self.refs)])


@pytest.mark.parametrize("damper", sage_optax.DAMPERS)
def test_sage_matches_reference(damper):
    rng = np.random.default_rng(0)
    shapes = {"emb": (30, 8), "stack": (3, 16, 6), "vec": (8,), "scalar": ()}
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    refs = {
        "emb": ref.SageRef(shapes["emb"], vocab_axis=0, damper=damper),
        "stack": Stacked(lambda: ref.SageRef((16, 6), vocab_axis=0, damper=damper), 3),
        "vec": ref.SageRef((8,), damper=damper),
        "scalar": ref.SageRef((), damper=damper),
    }

    def grads(t):
        return {
            "emb": sparse_embedding_gradient(rng, shapes["emb"]),
            "stack": hard_gradient(rng, shapes["stack"], t),
            "vec": hard_gradient(rng, shapes["vec"], t),
            "scalar": np.asarray(rng.standard_normal() if t % 5 else 0.0),
        }

    tx = sage_optax.sage(schedule(2e-3), damper=damper)
    run_pair(tx, refs, params, grads, 2e-3)


def test_sage_fan_out_reduction_of_dense_kernels():
    """sage-pure's dense rule: reduce a Flax kernel (in, out) over its fan-out axis."""
    rng = np.random.default_rng(1)
    params = {"k": rng.standard_normal((10, 7)), "t": rng.standard_normal((7, 10))}
    refs = {"k": ref.SageRef((10, 7), vocab_axis=1), "t": ref.SageRef((7, 10), vocab_axis=0)}
    spec = {"k": sage_optax.Route("dense", -2, -1), "t": sage_optax.Route("dense", -1, -2)}
    tx = sage_optax.sage(schedule(1e-3), axes=spec, b1=0.891, b2=0.95, eps=1e-6)
    for r in refs.values():
        r.b1, r.b2, r.eps = 0.891, 0.95, 1e-6
    run_pair(tx, refs, params, lambda t: {k: hard_gradient(rng, v.shape, t)
                                          for k, v in params.items()}, 1e-3)


@pytest.mark.parametrize("b2", [0.0, 0.5])
@pytest.mark.parametrize("injected", [False, True])
def test_sage_direction_from_new_momentum_edge_cases(b2, injected):
    """The sign is read from M_t (sign(b1 M_t + (b2-b1) g)); b2 = 0 cannot recover M_{t-1}
    from M_t and must take the direct form, also when b2 is a traced hyperparameter."""
    rng = np.random.default_rng(11)
    params = {"e": rng.standard_normal((9, 5)), "v": rng.standard_normal(5)}
    refs = {"e": ref.SageRef((9, 5)), "v": ref.SageRef((5,))}
    for r in refs.values():
        r.b2 = b2
    make = optax.inject_hyperparams(sage_optax.sage) if injected else sage_optax.sage
    tx = make(schedule(2e-3), b2=b2)
    run_pair(tx, refs, params, lambda t: {k: hard_gradient(rng, v.shape, t)
                                          for k, v in params.items()}, 2e-3)


@pytest.mark.parametrize("normalization,alpha", [("unit", 10.0), ("sqrt", 0.05)])
def test_sinkgd_matches_reference(normalization, alpha):
    rng = np.random.default_rng(2)
    shapes = {"wide": (6, 20), "tall": (20, 6), "stack": (2, 9, 5)}
    params = {k: rng.standard_normal(s) for k, s in shapes.items()}
    refs = {
        "wide": ref.SinkGDRef(alpha=alpha, normalization=normalization),
        "tall": ref.SinkGDRef(alpha=alpha, normalization=normalization),
        "stack": Stacked(lambda: ref.SinkGDRef(alpha=alpha, normalization=normalization), 2),
    }
    tx = sage_optax.sinkgd(schedule(2e-2), alpha=alpha, normalization=normalization)
    run_pair(tx, refs, params, lambda t: {k: hard_gradient(rng, s, t)
                                          for k, s in shapes.items()}, 2e-2)


def test_sinkgd_torch_layout_axes():
    """Route("dense", fan_in=-1, fan_out=-2) is PyTorch's (out, in): rows first, then columns."""
    rng = np.random.default_rng(3)
    params = {"w": rng.standard_normal((7, 11))}
    refs = {"w": ref.SinkGDRef(alpha=10.0, fan_in_axis=1, fan_out_axis=0)}
    tx = sage_optax.sinkgd(schedule(1e-2), axes=sage_optax.Route("dense", fan_in=-1, fan_out=-2))
    run_pair(tx, refs, params, lambda t: {"w": hard_gradient(rng, (7, 11), t)}, 1e-2)


def test_unit_norm_matches_reference():
    rng = np.random.default_rng(4)
    params = {"v": rng.standard_normal(9), "s": np.asarray(0.5)}
    refs = {"v": ref.UnitNormRef(), "s": ref.UnitNormRef()}
    tx = sage_optax.unit_norm_descent(schedule(2e-2))
    run_pair(tx, refs, params, lambda t: {"v": hard_gradient(rng, (9,), t),
                                          "s": np.asarray(rng.standard_normal())}, 2e-2)


def test_adamw_and_lion_match_reference():
    """The baselines as the presets build them (b2=0.99 for AdamW, as the paper)."""
    rng = np.random.default_rng(5)
    for name, make in [("adamw", lambda s: ref.AdamWRef(s, b2=0.99)),
                       ("lion", lambda s: ref.LionRef(s))]:
        params = {"w": rng.standard_normal((8, 5)), "b": rng.standard_normal(5)}
        refs = {k: make(v.shape) for k, v in params.items()}
        hp = get_preset(name).embedding.hyperparams
        tx = (optax.adamw(schedule(1e-3), hp["b1"], hp["b2"], hp["eps"],
                          weight_decay=hp["weight_decay"]) if name == "adamw"
              else optax.lion(schedule(1e-3), hp["b1"], hp["b2"],
                              weight_decay=hp["weight_decay"]))
        shapes = {k: v.shape for k, v in params.items()}
        run_pair(tx, refs, params, lambda t, shapes=shapes: {
            k: hard_gradient(rng, s, t) for k, s in shapes.items()}, 1e-3)


# --- the eight configurations on a mixed model, leaf by leaf -------------------------------

# Expected axes of each leaf of helpers.mixed_params, written out by hand (not from the router):
# (kind, fan_in axis, fan_out axis) in the leaf's own 2-D layout.
EXPECTED_ROUTES = {
    ("embed", "embedding"): ("embedding", 1, 0),
    ("lm_head", "kernel"): ("embedding", 0, 1),
    ("layers", "0", "mlp", "up", "kernel"): ("dense", 0, 1),
    ("layers", "0", "mlp", "down", "kernel"): ("dense", 0, 1),
    ("layers", "0", "mlp", "bias"): ("vector", None, None),
    ("layers", "0", "norm", "scale"): ("vector", None, None),
    ("final_norm", "scale"): ("vector", None, None),
}


def projection_table(k_max=8, n_max=64, rank=1):
    rng = np.random.default_rng(42)
    return rng.standard_normal((k_max, n_max, rank)) / np.sqrt(rank)


class TransposedRef:
    """Run a PyTorch-layout (out, in) reference on a Flax-layout (in, out) kernel."""

    def __init__(self, inner):
        self.inner = inner

    def step(self, theta, g, lr):
        return self.inner.step(theta.T, g.T, lr).T


def reference_for(rule, kind, fan_in, fan_out, shape, table):
    hp = dict(rule.hyperparams)
    wd = hp["weight_decay"]
    if rule.name == "adamw":
        return ref.AdamWRef(shape, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=wd)
    if rule.name == "lion":
        return ref.LionRef(shape, b1=hp["b1"], b2=hp["b2"], weight_decay=wd)
    if rule.name == "sage":
        return ref.SageRef(shape, b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=wd,
                           vocab_axis=fan_out, damper=hp["damper"])
    if rule.name == "sinkgd":
        return ref.SinkGDRef(alpha=hp["alpha"], num_iters=hp["num_iters"], eps=hp["eps"],
                             weight_decay=wd, normalization=hp["normalization"],
                             fan_in_axis=fan_in, fan_out_axis=fan_out)
    if rule.name == "unit_norm":
        return ref.UnitNormRef(eps=hp["eps"], weight_decay=wd)
    if rule.name == "apollo":
        assert (fan_in, fan_out) == (0, 1)
        return TransposedRef(ref.ApolloRef(
            shape[::-1], rank=hp["rank"], scale_type=hp["scale_type"], scale=hp["scale"],
            b1=hp["b1"], b2=hp["b2"], eps=hp["eps"], weight_decay=wd,
            limiter_gamma=hp["limiter_gamma"], update_proj_gap=hp["update_proj_gap"],
            projection_fn=lambda k, n, r: table[k % len(table), :n, :r]))
    raise AssertionError(rule.name)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_configuration_matches_reference(name):
    rng = np.random.default_rng(6)
    nested = mixed_params(rng)
    flat_paths = list(EXPECTED_ROUTES)

    def get(tree, path):
        for k in path:
            tree = tree[k]
        return tree

    def nest(flat):
        out = {}
        for path, v in flat.items():
            d = out
            for k in path[:-1]:
                d = d.setdefault(k, {})
            d[path[-1]] = v
        return out

    preset = get_preset(name)
    table = projection_table()
    refs = {}
    for path, (kind, fi, fo) in EXPECTED_ROUTES.items():
        shape = get(nested, path).shape
        refs[path] = reference_for(preset.rule(kind), kind, fi, fo, shape, table)

    def projection(path, refresh_index, n, rank):
        return jnp.asarray(table)[refresh_index % len(table), :n, :rank]

    extra = {"dense_update_proj_gap": 7, "dense_projection": projection} if name == "apollo" else {}
    for r in refs.values():
        inner = getattr(r, "inner", None)
        if inner is not None:
            inner.update_proj_gap = 7
    peak = preset.learning_rate
    tx = sage_optax.make_optimizer(name, schedule(peak), **extra)
    sched = schedule(peak)
    with jax.enable_x64(True):
        p = jax.tree.map(jnp.asarray, nested)
        state = tx.init(p)
        update = jax.jit(tx.update)
        theta = {path: get(nested, path) for path in flat_paths}
        for t in range(STEPS):
            g_nested = mixed_gradient(rng, nested, t)
            upd, state = update(jax.tree.map(jnp.asarray, g_nested), state, p)
            p = optax.apply_updates(p, upd)
            for path in flat_paths:
                theta[path] = refs[path].step(theta[path], get(g_nested, path), lr_at(sched, t))
                gap = float(np.max(np.abs(np.asarray(get(p, path)) - theta[path])))
                assert gap < TOL, f"{name} step {t + 1} {'.'.join(path)}: gap {gap:.3e}"
    assert nest(theta).keys() == nested.keys()
