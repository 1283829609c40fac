"""Integration of sage_optax with the JAX/Optax/Flax ecosystem.

Covers, for every configuration of ``sage_optim.CONFIG_NAMES`` (and the ``sage``,
``sinkgd``, ``apollo`` aliases where relevant), on a small mixed params pytree:

1. ``jax.jit``: no retrace on a second step, jitted == eager;
2. ``optax.inject_hyperparams`` (schedules, injected ``num_iters``, routing preserved);
3. ``optax.MultiSteps`` gradient accumulation;
4. ``optax.chain`` with ``clip_by_global_norm``;
5. ``flax.nnx.Optimizer`` training of a tiny model;
6. float32 / bfloat16 params: state dtypes and shapes stable, updates in param dtype;
7. sharding on the 8 host CPU devices of conftest.py (plain pytrees and nnx).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import sage_optax
from sage_optim import CONFIG_NAMES

RTOL, ATOL = 1e-6, 1e-7  # float32 rounding (jit vs eager, sharded vs unsharded)
V, D, H = 64, 16, 32
SHARDED_CONFIGS = ("sage-hybrid", "sage-pure", "apollo", "lion-hybrid")
ALIASES = ("sage", "sinkgd", "apollo-alias")


# --------------------------------------------------------------------------- fixtures


def make_params(dtype=jnp.float32, seed: int = 0) -> dict:
    """Embedding table, two dense kernels, two norm scales and a bias (Flax layouts)."""
    k = jax.random.split(jax.random.key(seed), 4)
    return {
        "embed": {"embedding": jax.random.normal(k[0], (V, D), jnp.float32).astype(dtype)},
        "layers": {
            "0": {
                "mlp": {
                    "up": {
                        "kernel": (0.2 * jax.random.normal(k[1], (D, H))).astype(dtype),
                        "bias": (0.1 * jax.random.normal(k[3], (H,))).astype(dtype),
                    },
                    "down": {"kernel": (0.2 * jax.random.normal(k[2], (H, D))).astype(dtype)},
                },
                "norm": {"scale": jnp.ones((D,), dtype)},
            }
        },
        "final_norm": {"scale": jnp.full((D,), 1.5, dtype)},
    }


def make_grads(params: dict, seed: int, scale: float = 1.0) -> dict:
    """Random gradients like ``params``; the second half of the vocab is absent (zero rows)."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(1000 + seed), len(leaves))
    out = [
        (scale * jax.random.normal(key, x.shape, jnp.float32)).astype(x.dtype)
        for key, x in zip(keys, leaves, strict=True)
    ]
    grads = jax.tree.unflatten(treedef, out)
    if "embed" in grads:
        emb = grads["embed"]["embedding"]
        grads["embed"]["embedding"] = emb.at[V // 2 :].set(0)
    return grads


def dense_only(tree: dict) -> dict:
    """The two dense kernels (what SinkGD / APOLLO accept on their own)."""
    mlp = tree["layers"]["0"]["mlp"]
    return {"up": {"kernel": mlp["up"]["kernel"]}, "down": {"kernel": mlp["down"]["kernel"]}}


def make_case(name: str):
    """``(tx, params_fn)`` for a configuration name or an alias."""
    if name == "sage":
        return sage_optax.sage(1e-3), make_params
    if name == "sinkgd":
        return sage_optax.sinkgd(1e-3), lambda *a, **k: dense_only(make_params(*a, **k))
    if name == "apollo-alias":
        return sage_optax.apollo(1e-3), lambda *a, **k: dense_only(make_params(*a, **k))
    return sage_optax.make_optimizer(name), make_params


@functools.cache
def compiled(name: str):
    """``(tx, params_fn, jitted update, traces)`` shared by the tests of one process.

    Sharing one ``jax.jit`` object per configuration keeps the file fast (one compile per
    configuration and input signature); ``traces`` grows each time ``update`` is traced.
    """
    tx, params_fn = make_case(name)
    traces: list[None] = []

    def update(g, s, p):
        traces.append(None)  # runs at trace time only
        return tx.update(g, s, p)

    return tx, params_fn, jax.jit(update), traces


def assert_trees_close(actual, desired, rtol=RTOL, atol=ATOL, what=""):
    a_leaves, a_def = jax.tree_util.tree_flatten_with_path(actual)
    d_leaves, d_def = jax.tree_util.tree_flatten_with_path(desired)
    assert a_def == d_def, f"{what}: tree structures differ:\n{a_def}\n{d_def}"
    for (path, a), (_, d) in zip(a_leaves, d_leaves, strict=True):
        a, d = np.asarray(a), np.asarray(d)
        assert a.shape == d.shape, (what, jax.tree_util.keystr(path))
        assert a.dtype == d.dtype, (what, jax.tree_util.keystr(path), a.dtype, d.dtype)
        if np.issubdtype(a.dtype, np.floating) or a.dtype == jnp.bfloat16:
            np.testing.assert_allclose(
                a.astype(np.float64),
                d.astype(np.float64),
                rtol=rtol,
                atol=atol,
                err_msg=f"{what}: {jax.tree_util.keystr(path)}",
            )
        else:
            np.testing.assert_array_equal(a, d, err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def shapes_dtypes(tree):
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def find_states(state, cls) -> list:
    """Every sub-state of type ``cls`` (e.g. ``ScaleBySageState``) inside ``state``."""
    is_cls = lambda x: isinstance(x, cls)  # noqa: E731
    return [x for x in jax.tree.leaves(state, is_leaf=is_cls) if is_cls(x)]


def assert_finite_nonzero(updates, what=""):
    leaves = jax.tree.leaves(updates)
    assert leaves, what
    for x in leaves:
        assert bool(jnp.all(jnp.isfinite(x.astype(jnp.float32)))), what
    assert any(bool(jnp.any(x != 0)) for x in leaves), f"{what}: all updates are zero"


# --------------------------------------------------------------------------- 1. jit


@pytest.mark.parametrize("name", CONFIG_NAMES + ALIASES)
def test_jit_no_retrace_and_matches_eager(name):
    tx, params_fn, jitted, traces = compiled(name)
    params = params_fn()
    g1, g2 = make_grads(params, 1), make_grads(params, 2)

    s0 = tx.init(params)
    before = len(traces)
    u1, s1 = jitted(g1, s0, params)
    assert len(traces) - before <= 1
    after_first = len(traces)
    p1 = optax.apply_updates(params, u1)
    u2, s2 = jitted(g2, s1, p1)
    assert len(traces) == after_first, "the second step with new gradients retraced"
    assert jax.tree.map(jax.typeof, s1) == jax.tree.map(jax.typeof, s0)
    assert_finite_nonzero(u2, name)

    e1, es1 = tx.update(g1, s0, params)
    e2, es2 = tx.update(g2, es1, optax.apply_updates(params, e1))
    assert_trees_close(u1, e1, what="step 1 updates")
    assert_trees_close(u2, e2, what="step 2 updates")
    assert_trees_close(s2, es2, what="state after 2 steps")


# --------------------------------------------------------------------------- 2. inject_hyperparams


def _schedule():
    return optax.warmup_cosine_decay_schedule(
        init_value=1e-4, peak_value=2e-3, warmup_steps=2, decay_steps=8, end_value=1e-4
    )


def test_inject_hyperparams_sage_hybrid_matches_make_optimizer():
    schedule = _schedule()
    injected = optax.inject_hyperparams(sage_optax.sage_hybrid)(learning_rate=schedule)
    plain = sage_optax.make_optimizer("sage-hybrid", learning_rate=schedule)
    params = make_params()
    s_inj, s_ref = injected.init(params), plain.init(params)

    # Routing survives the wrapping: the inner state is that of the unwrapped optimizer
    # with a constant learning rate (a schedule adds a step count per partition instead).
    s_const = sage_optax.make_optimizer("sage-hybrid").init(params)
    assert shapes_dtypes(s_inj.inner_state) == shapes_dtypes(s_const)
    assert sage_optax.state_bytes(s_inj.inner_state) == sage_optax.state_bytes(s_const)
    assert sage_optax.state_bytes(s_inj.inner_state) == (
        sage_optax.routing_table("sage-hybrid", params).total_bytes
    )
    # a schedule adds a step count per partition, and the skip of a non-finite rate its
    # step count and count of skipped steps (sage_optax.finite_rate)
    assert sage_optax.state_bytes(s_ref) == sage_optax.state_bytes(s_const) + 5 * 4
    np.testing.assert_allclose(s_inj.hyperparams["learning_rate"], schedule(0), rtol=1e-7)

    step_inj, step_ref = jax.jit(injected.update), jax.jit(plain.update)
    p_inj = p_ref = params
    for t in range(5):
        g = make_grads(params, t)
        u_inj, s_inj = step_inj(g, s_inj, p_inj)
        u_ref, s_ref = step_ref(g, s_ref, p_ref)
        assert_finite_nonzero(u_inj, f"step {t}")
        assert_trees_close(u_inj, u_ref, what=f"updates at step {t}")
        # the learning rate used by this step is readable from the state
        np.testing.assert_allclose(
            s_inj.hyperparams["learning_rate"], schedule(t), rtol=1e-6, err_msg=f"step {t}"
        )
        p_inj = optax.apply_updates(p_inj, u_inj)
        p_ref = optax.apply_updates(p_ref, u_ref)
    assert_trees_close(p_inj, p_ref, what="params after 5 steps")
    sage_inj = find_states(s_inj.inner_state, sage_optax.ScaleBySageState)
    sage_ref = find_states(s_ref, sage_optax.ScaleBySageState)
    assert len(sage_inj) == len(sage_ref) == 2  # embedding and vector partitions
    assert_trees_close(sage_inj, sage_ref, what="SAGE states after 5 steps")
    assert step_inj._cache_size() == 1 and step_ref._cache_size() == 1
    assert sage_optax.state_bytes(s_inj.inner_state) == sage_optax.state_bytes(s_const)


def test_inject_hyperparams_sage():
    """``inject_hyperparams(sage)`` as a user writes it: every numeric argument with a
    default (b1, b2, eps, weight_decay, and formerly the int ``vocab_axis``) becomes an array.
    """
    schedule = _schedule()
    injected = optax.inject_hyperparams(sage_optax.sage)(learning_rate=schedule)
    plain = sage_optax.sage(schedule)
    params = make_params()
    s_inj, s_ref = injected.init(params), plain.init(params)
    assert shapes_dtypes(s_inj.inner_state[0]) == shapes_dtypes(s_ref[0])
    assert "b1" in s_inj.hyperparams and "eps" in s_inj.hyperparams
    step = jax.jit(injected.update)
    for t in range(3):
        g = make_grads(params, t)
        u_inj, s_inj = step(g, s_inj, params)
        u_ref, s_ref = plain.update(g, s_ref, params)
        assert_trees_close(u_inj, u_ref, what=f"updates at step {t}")
    assert step._cache_size() == 1
    assert_trees_close(s_inj.inner_state[0], s_ref[0], what="ScaleBySageState")


def test_inject_hyperparams_sinkgd_traced_num_iters():
    injected = optax.inject_hyperparams(sage_optax.sinkgd)(learning_rate=1e-2, num_iters=5)
    params = dense_only(make_params())
    state = injected.init(params)
    num_iters = state.hyperparams["num_iters"]
    assert isinstance(num_iters, jax.Array) and jnp.issubdtype(num_iters.dtype, jnp.integer)
    step = jax.jit(injected.update)
    g = dense_only(make_grads(make_params(), 0))

    u5, state = step(g, state, params)
    sinkgd5 = sage_optax.sinkgd(1e-2, num_iters=5)
    ref5, _ = sinkgd5.update(g, sinkgd5.init(params), params)
    assert_trees_close(u5, ref5, what="num_iters=5")

    # Changing the injected value changes the computation without recompiling.
    state.hyperparams["num_iters"] = jnp.ones_like(state.hyperparams["num_iters"])
    u1, state = step(g, state, params)
    sinkgd1 = sage_optax.sinkgd(1e-2, num_iters=1)
    ref1, _ = sinkgd1.update(g, sinkgd1.init(params), params)
    assert_trees_close(u1, ref1, what="num_iters=1")
    assert not np.allclose(u1["up"]["kernel"], u5["up"]["kernel"], rtol=1e-3)
    assert step._cache_size() == 1


# --------------------------------------------------------------------------- 3. MultiSteps


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_multisteps_accumulates_mean_gradient(name):
    tx, _, jitted, _ = compiled(name)
    ms = optax.MultiSteps(tx, every_k_schedule=2)
    params = make_params()
    g1, g2 = make_grads(params, 1), make_grads(params, 2)
    step = jax.jit(ms.update)

    state = ms.init(params)
    u1, state = step(g1, state, params)
    for x in jax.tree.leaves(u1):
        np.testing.assert_array_equal(x, np.zeros_like(x))  # no update on a micro-step
    u2, state = step(g2, state, params)
    assert step._cache_size() == 1
    assert int(state.gradient_step) == 1 and int(state.mini_step) == 0

    mean = jax.tree.map(lambda a, b: (a + b) / 2, g1, g2)
    ref_u, ref_s = jitted(mean, tx.init(params), params)
    assert_finite_nonzero(u2, name)
    assert_trees_close(u2, ref_u, rtol=1e-5, what="accumulated update")
    assert_trees_close(state.inner_opt_state, ref_s, rtol=1e-5, what="inner state")


# --------------------------------------------------------------------------- 4. chain + clip


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_chain_clip_by_global_norm_under_jit(name):
    inner, _, inner_step, _ = compiled(name)
    tx = optax.chain(optax.clip_by_global_norm(1.0), inner)
    params = make_params()
    step = jax.jit(tx.update)
    state, ref_state = tx.init(params), inner.init(params)
    p = p_ref = params
    for t in range(2):
        g = make_grads(params, t, scale=10.0)
        norm = optax.tree.norm(g)
        assert float(norm) > 1.0  # the clip is active
        clipped = jax.tree.map(lambda x, n=norm: x * (1.0 / n), g)
        u, state = step(g, state, p)
        ref_u, ref_state = inner_step(clipped, ref_state, p_ref)
        assert_finite_nonzero(u, name)
        assert_trees_close(u, ref_u, rtol=1e-5, what=f"step {t} updates")
        p, p_ref = optax.apply_updates(p, u), optax.apply_updates(p_ref, ref_u)
    assert_trees_close(state[1], ref_state, rtol=1e-5, what="inner state (sees clipped grads)")
    assert step._cache_size() == 1


# --------------------------------------------------------------------------- 5. flax.nnx


class TinyLM(nnx.Module):
    """Tied-embedding toy LM: Embed, RMSNorm, two Linear (an MLP block)."""

    def __init__(self, rngs: nnx.Rngs, sharded: bool = False):
        def init(default, axes):
            return nnx.with_partitioning(default, axes) if sharded else default

        self.embed = nnx.Embed(
            V, D, rngs=rngs, embedding_init=init(nnx.initializers.normal(1.0), ("d", None))
        )
        self.norm = nnx.RMSNorm(D, rngs=rngs)
        self.up = nnx.Linear(
            D, H, rngs=rngs, kernel_init=init(nnx.initializers.lecun_normal(), (None, "d"))
        )
        self.down = nnx.Linear(
            H, D, rngs=rngs, kernel_init=init(nnx.initializers.lecun_normal(), ("d", None))
        )

    def __call__(self, tokens):
        x = self.embed(tokens)
        x = x + self.down(jax.nn.gelu(self.up(self.norm(x))))
        return self.embed.attend(self.norm(x))


def lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def nnx_train_step(model, optimizer, tokens):
    loss, grads = nnx.value_and_grad(lm_loss)(model, tokens)
    optimizer.update(model, grads)  # flax >= 0.11: update(model, grads)
    return loss


# The same step in two nnx.jit functions: the gradient computation then compiles once for
# all configurations (same model graph), only the optimizer step once per configuration.
nnx_loss_and_grads = nnx.jit(nnx.value_and_grad(lm_loss))


@nnx.jit
def nnx_apply_grads(model, optimizer, grads):
    optimizer.update(model, grads)


TOKENS = np.random.default_rng(7).integers(0, V, size=(4, 9), dtype=np.int32)  # no jax at import


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_nnx_optimizer_lowers_loss(name):
    model = TinyLM(nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    expected_bytes = sage_optax.routing_table(name, params).total_bytes
    optimizer = nnx.Optimizer(model, sage_optax.make_optimizer(name), wrt=nnx.Param)
    assert sage_optax.state_bytes(nnx.as_pure(optimizer.opt_state)) == expected_bytes
    losses = []
    for _ in range(20):
        loss, grads = nnx_loss_and_grads(model, TOKENS)
        nnx_apply_grads(model, optimizer, grads)
        losses.append(float(loss))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0], losses
    assert int(optimizer.step.get_value()) == 20
    assert sage_optax.state_bytes(nnx.as_pure(optimizer.opt_state)) == expected_bytes


# --------------------------------------------------------------------------- 6. dtypes


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_state_dtypes_stable_and_updates_in_param_dtype(name, dtype):
    tx, _, step, traces = compiled(name)
    params = make_params(dtype)
    state = jax.jit(tx.init)(params)
    before = shapes_dtypes(state)
    for t in range(3):
        u, state = step(make_grads(params, t), state, params)
        assert shapes_dtypes(u) == shapes_dtypes(params), f"step {t}: updates not in param dtype"
        assert_finite_nonzero(u, f"step {t}")
        params = optax.apply_updates(params, u)
        assert shapes_dtypes(params) == shapes_dtypes(make_params(dtype))
        if t == 0:
            n_traces = len(traces)
    assert shapes_dtypes(state) == before
    assert len(traces) == n_traces, "steps 2-3 retraced (state type drifted, e.g. weak types)"
    # docs/algorithms.md: SAGE's S and APOLLO's moments are float32 whatever the params.
    sage_states = find_states(state, sage_optax.ScaleBySageState)
    apollo_states = find_states(state, sage_optax.ScaleByApolloState)
    assert bool(sage_states) == name.startswith("sage")
    assert bool(apollo_states) == (name == "apollo")
    for st in sage_states:
        for s in jax.tree.leaves(st.s):
            assert s.dtype == jnp.float32
        for m in jax.tree.leaves(st.mu):  # M follows the params (mu_dtype=None)
            assert m.dtype == dtype
    for st in apollo_states:
        for m in jax.tree.leaves((st.mu, st.nu, st.norm)):
            assert m.dtype == jnp.float32


# --------------------------------------------------------------------------- 7. sharding


def _param_specs() -> dict:
    """Embedding sharded over the vocab axis, both kernels over one axis, vectors replicated."""
    return {
        "embed": {"embedding": P("d", None)},
        "layers": {
            "0": {
                "mlp": {
                    "up": {"kernel": P(None, "d"), "bias": P(None)},
                    "down": {"kernel": P("d", None)},
                },
                "norm": {"scale": P(None)},
            }
        },
        # P(None), not P(): what jax gives back for replicated 1-D results, so that the
        # jit cache (keyed on sharding equality, not equivalence) sees the same type.
        "final_norm": {"scale": P(None)},
    }


def _unsharded_run(name: str):
    tx, _, step, _ = compiled(name)
    params = make_params()
    state = tx.init(params)
    out = []
    for t in range(2):
        u, state = step(make_grads(params, t), state, params)
        params = optax.apply_updates(params, u)
        out.append(u)
    return out, state


def cpu_mesh(axis_type):
    """An 8-device mesh of CPU devices, on every machine.

    The host device count flag (tests/conftest.py) gives 8 CPU devices; on a GPU machine
    (``JAX_PLATFORMS=cuda,cpu``) the sharded tests still run, on the CPU.  Their unsharded
    references run on the CPU too (:func:`on_cpu`), so both sides do the same arithmetic.
    """
    return jax.make_mesh((8,), ("d",), axis_types=(axis_type,), devices=jax.devices("cpu")[:8])


def on_cpu():
    """``jax.default_device`` of the first CPU device (where the sharded tests run)."""
    return jax.default_device(jax.devices("cpu")[0])


def _specs_equivalent(a, b) -> bool:
    return a.sharding.is_equivalent_to(b.sharding, a.ndim)


@pytest.mark.parametrize("name", SHARDED_CONFIGS)
def test_sharded_matches_unsharded_and_state_sharding_is_stable(name):
    # Explicit axes (jax.make_mesh's default in jax 0.10): sharding is part of the type,
    # so a state leaf whose sharding changes between init and update forces a recompile.
    mesh = cpu_mesh(AxisType.Explicit)
    with on_cpu():
        ref_updates, ref_state = _unsharded_run(name)
    tx = sage_optax.make_optimizer(name)
    with jax.set_mesh(mesh):
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), _param_specs())
        params = jax.device_put(make_params(), shardings)
        assert params["embed"]["embedding"].sharding.spec == P("d", None)
        state0 = jax.jit(tx.init)(params)
        step = jax.jit(tx.update)
        state = state0
        for t in range(2):
            grads = jax.device_put(make_grads(make_params(), t), shardings)
            u, state = step(grads, state, params)
            if t == 0:
                state1 = state
            for (path, x), ps in zip(
                jax.tree_util.tree_flatten_with_path(u)[0], jax.tree.leaves(params), strict=True
            ):
                assert _specs_equivalent(x, ps), (
                    f"update {jax.tree_util.keystr(path)}: {x.sharding} vs param {ps.sharding}"
                )
            assert_trees_close(u, ref_updates[t], what=f"sharded vs unsharded step {t}")
            params = optax.apply_updates(params, u)
    assert_trees_close(state, ref_state, what="sharded vs unsharded state")

    mismatched = [
        f"{jax.tree_util.keystr(path)}: init {a.sharding.spec} -> update {b.sharding.spec}"
        for (path, a), b in zip(
            jax.tree_util.tree_flatten_with_path(state0)[0], jax.tree.leaves(state1), strict=True
        )
        if not _specs_equivalent(a, b)
    ]
    assert not mismatched, "state sharding changed between init and update:\n" + "\n".join(
        mismatched
    )
    assert step._cache_size() == 1, "the second sharded step recompiled (state type changed)"


@functools.cache
def _unsharded_nnx_run(name: str, steps: int):
    model = TinyLM(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, sage_optax.make_optimizer(name), wrt=nnx.Param)
    losses = []
    for _ in range(steps):  # the split step (already compiled by the unsharded test)
        loss, grads = nnx_loss_and_grads(model, TOKENS)
        nnx_apply_grads(model, optimizer, grads)
        losses.append(float(loss))
    return losses, nnx.as_pure(nnx.state(model, nnx.Param))


def _auto_mesh():
    return cpu_mesh(AxisType.Auto)


@pytest.mark.parametrize("name", SHARDED_CONFIGS)
def test_nnx_optimizer_init_on_sharded_params(name):
    """``nnx.Optimizer`` accepts ``with_partitioning`` params; full-size state is sharded.

    ``nnx.Optimizer`` copies each Param's metadata (its sharding names) onto every state
    leaf built from that Param, so a reduced-shape state (SAGE's ``S`` ``(d,)`` of the
    ``(V, d)`` embedding, APOLLO's rank-1 moments and scalar norms) must carry only the
    names of the axes it kept, or ``nnx.Optimizer.__init__`` fails ("P('d', None) ...
    applied to a value of rank 1"); ``tests/optax/test_optax_state_sharding.py`` checks those names.
    """
    with jax.set_mesh(_auto_mesh()):
        model = TinyLM(nnx.Rngs(0), sharded=True)
        optimizer = nnx.Optimizer(model, sage_optax.make_optimizer(name), wrt=nnx.Param)
    param_sharding = {
        tuple(x.shape): x.sharding
        for x in jax.tree.leaves(nnx.as_pure(nnx.state(model, nnx.Param)))
        if x.ndim == 2
    }
    assert len(param_sharding) == 3
    assert not all(s.is_fully_replicated for s in param_sharding.values())
    checked = 0
    for path, x in jax.tree_util.tree_flatten_with_path(nnx.as_pure(optimizer.opt_state))[0]:
        if tuple(x.shape) in param_sharding:  # a moment of the params' own shape
            checked += 1
            assert x.sharding.is_equivalent_to(param_sharding[tuple(x.shape)], x.ndim), (
                f"{jax.tree_util.keystr(path)}: {x.sharding}"
            )
    assert checked > 0
    expected = sage_optax.routing_table(name, nnx.state(model, nnx.Param)).total_bytes
    assert sage_optax.state_bytes(nnx.as_pure(optimizer.opt_state)) == expected


def test_nnx_optimizer_sharded_params():
    """nnx.with_partitioning params on an Auto mesh train like unsharded ones.

    Explicit axes cannot be used here: ``nnx.Embed`` gathers with ``jnp.take``, which needs
    an ``out_sharding`` under Explicit sharding.  Under Auto axes XLA chooses the shardings
    inside ``nnx.jit``, so only the numbers (and the shardings at creation) are checked.
    """
    name, steps = "sage-hybrid", 2
    with on_cpu():
        ref_losses, ref_params = _unsharded_nnx_run(name, steps)
    with jax.set_mesh(_auto_mesh()):
        model = TinyLM(nnx.Rngs(0), sharded=True)
        emb = model.embed.embedding.get_value()
        assert emb.sharding.spec == P("d", None)
        optimizer = nnx.Optimizer(model, sage_optax.make_optimizer(name), wrt=nnx.Param)
        mu = optimizer.opt_state.inner_states["embedding"].inner_state[0].mu
        assert _specs_equivalent(mu["embed"]["embedding"].get_value(), emb)
        losses = [float(nnx_train_step(model, optimizer, TOKENS)) for _ in range(steps)]
        params = nnx.as_pure(nnx.state(model, nnx.Param))
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert_trees_close(params, ref_params, what="nnx params after sharded steps")


def _finite_rate_params():
    return {"embed": {"embedding": jnp.linspace(-1.0, 1.0, 64).reshape(16, 4)},
            "dense": {"kernel": jnp.linspace(0.5, -0.5, 32).reshape(4, 8)},
            "norm": {"scale": jnp.ones(4)}}


def _run(tx, params, grads, steps, jit):
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    seen = []
    for t in range(steps):
        before = state
        updates, state = update(grads[t], state, params)
        params = optax.apply_updates(params, updates)
        seen.append((before, state, updates))
    return params, state, seen


@pytest.mark.parametrize("jit", [False, True])
def test_a_schedule_that_returns_nan_skips_that_step_only(jit):
    """The step whose scheduled rate is NaN changes nothing and is counted; the others
    take the rates of their own steps, as a run without that step would (a reference
    built from a plain list of those rates)."""
    params = _finite_rate_params()
    grads = [jax.tree.map(lambda x, k=k: jnp.sin(x * (k + 1)), params) for k in range(4)]
    rates = jnp.array([1e-3, 2e-3, jnp.nan, 4e-3])
    tx = sage_optax.make_optimizer("sage-hybrid", lambda t: rates[t])
    got, state, seen = _run(tx, params, grads, 4, jit)
    before, after, updates = seen[2]
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(updates))
    inner = lambda s: jax.tree.leaves(s.inner_state)  # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(inner(before), inner(after), strict=True))
    assert int(state.notfinite_lr_count) == 1 and int(state.steps) == 4
    kept = jnp.array([1e-3, 2e-3, 4e-3])
    ref_tx = sage_optax.make_optimizer("sage-hybrid", lambda t: kept[t])
    want, _, _ = _run(ref_tx, params, [grads[0], grads[1], grads[3]], 3, jit)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert bool(jnp.all(jnp.isfinite(a)))
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_a_nan_rate_right_after_the_first_step_is_skipped_eagerly():
    """After a skipped step the inner optimizer is rebuilt with the schedule shifted by one:
    its builders' check of the first rate must not see the NaN of the step skipped."""
    params = _finite_rate_params()
    tx = sage_optax.make_optimizer("sinkgd-pure", lambda t: jnp.where(t == 1, jnp.nan, 1e-3))
    grads = [jax.tree.map(jnp.ones_like, params)] * 3
    got, state, _ = _run(tx, params, grads, 3, jit=False)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got))
    assert int(state.notfinite_lr_count) == 1


def test_an_injected_nan_rate_is_skipped():
    params = _finite_rate_params()
    tx = optax.inject_hyperparams(sage_optax.make_optimizer, static_args="name")(
        name="sage-hybrid", learning_rate=lambda t: jnp.where(t == 1, jnp.nan, 1e-3))
    grads = [jax.tree.map(jnp.ones_like, params)] * 3
    got, _, seen = _run(tx, params, grads, 3, jit=True)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(got))
    assert all(float(jnp.abs(u).max()) == 0.0 for u in jax.tree.leaves(seen[1][2]))
