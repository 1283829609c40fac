"""The optimizer state contract, over every configuration and every parameter container.

JAX training code relies on the state of ``tx.init(params)`` being a fixed pytree: a jitted
step compiles once, ``lax.scan`` carries the state, a checkpoint restores into
``jax.eval_shape(tx.init, params)``, ``optax.tree_utils`` finds the hyperparameters.  The
containers are those users train with: plain dicts, ``nnx.State`` (from ``nnx.state`` and
``nnx.split``: ``nnx.Param`` boxes), linen params without and with ``nn.Partitioned`` boxes
(mesh names and logical names), Equinox models (filtered) and lists and tuples.

Each check runs every configuration on one container at once, so the whole matrix stays
within seconds: for every container, the structure, shapes, dtypes and weak types after an
update (what ``jit`` keys its cache on) and the trace of a jitted ``lax.scan`` are checked
abstractly (``jax.eval_shape``, no compile), and a checkpoint round trip; ``nnx.State``,
where the structure used to change, also compiles and runs the jitted scan three times (one
compile) and checkpoints the state it returns.  A failure names the
configurations that broke the contract.
"""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.tree_utils as otu
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx

import sage_optax
from sage_optax.routing import NoLayoutEvidenceWarning

V, D, H = 32, 8, 16

CONFIGS = (*sage_optax.CONFIG_NAMES, "sage_optax.sage", "sage_optax.lion")


def make_tx(name: str, model: object = None) -> optax.GradientTransformation:
    """A configuration by name; the two aliases work on any tree (no router)."""
    if name == "sage_optax.sage":
        return sage_optax.sage(1e-3)
    if name == "sage_optax.lion":
        return sage_optax.lion(1e-3)
    return sage_optax.make_optimizer(name, **({} if model is None else {"model": model}))


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, rngs=rngs)
        self.up = nnx.Linear(D, H, rngs=rngs)
        self.norm = nnx.LayerNorm(H, rngs=rngs)
        self.down = nnx.Linear(H, D, rngs=rngs)


class LinenLM(nn.Module):
    box: str = "none"  # "none", "mesh" (nn.with_partitioning), "logical"

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        def init(f, names):
            if self.box == "mesh":
                return nn.with_partitioning(f, names)
            if self.box == "logical":
                return nn.with_logical_partitioning(f, names)
            return f

        normal, lecun = nn.initializers.normal(1.0), nn.initializers.lecun_normal()
        x = nn.Embed(V, D, embedding_init=init(normal, ("vocab", "embed")), name="embed")(tokens)
        x = nn.Dense(H, kernel_init=init(lecun, ("embed", "mlp")), name="up")(x)
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(D, kernel_init=init(lecun, ("mlp", "embed")), name="down")(x)


class EqxLM(eqx.Module):
    embed: eqx.nn.Embedding
    up: eqx.nn.Linear
    norm: eqx.nn.LayerNorm

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.embed = eqx.nn.Embedding(V, D, key=k1)
        self.up = eqx.nn.Linear(D, H, key=k2)
        self.norm = eqx.nn.LayerNorm(H)


def _rnd(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _layers() -> list[dict[str, jax.Array]]:
    return [{"embedding": _rnd((V, D), 0)}, {"kernel": _rnd((D, H), 1), "bias": _rnd((H,), 2)}]


def container(kind: str) -> tuple[object, object]:
    """``(params, model)``: the parameters in one container, and the module (or None)."""
    tokens = jnp.zeros((1, 4), jnp.int32)
    if kind == "dict":
        return {"embed": {"embedding": _rnd((V, D), 0)},
                "up": {"kernel": _rnd((D, H), 1), "bias": _rnd((H,), 2)},
                "norm": {"scale": _rnd((H,), 3)}}, None
    if kind == "nnx.state":
        model = NnxLM(nnx.Rngs(0))
        return nnx.state(model, nnx.Param), model
    if kind == "nnx.split":
        model = NnxLM(nnx.Rngs(0))
        return nnx.split(model, nnx.Param)[1], model
    if kind.startswith("linen"):
        box = {"linen": "none", "linen-partitioned": "mesh", "linen-logical": "logical"}[kind]
        return LinenLM(box).init(jax.random.key(0), tokens)["params"], None
    if kind == "equinox":
        model = EqxLM(jax.random.key(0))
        return eqx.filter(model, eqx.is_inexact_array), model
    if kind == "list":
        return _layers(), None
    if kind == "tuple":
        return tuple(_layers()), None
    raise AssertionError(kind)


CONTAINERS = ("dict", "nnx.state", "nnx.split", "linen", "linen-partitioned", "linen-logical",
              "equinox", "list", "tuple")


def grads_like(params: object, t: int) -> object:
    """Gradients of the params' structure (boxes included), different at every step."""
    return jax.tree.map(lambda x: jnp.cos(x * (1.0 + t)) * 0.1, params)


def txs_of(kind: str) -> tuple[object, dict[str, optax.GradientTransformation]]:
    params, model = container(kind)
    with warnings.catch_warnings():  # the bare arrays of lists/tuples have no layout evidence
        warnings.simplefilter("ignore", NoLayoutEvidenceWarning)
        return params, {name: make_tx(name, model) for name in CONFIGS}


def step_all(txs: dict[str, optax.GradientTransformation]):
    """One step of every configuration, each on its own params and state."""

    def step(carry: dict[str, tuple[object, object]], t: jax.Array) -> tuple[dict, None]:
        out = {}
        for name, tx in txs.items():
            p, s = carry[name]
            u, s = tx.update(grads_like(p, t), s, p)
            out[name] = (optax.apply_updates(p, u), s)
        return out, None

    return step


def _avals(tree: object) -> list[tuple]:
    return [(x.shape, x.dtype, getattr(x, "weak_type", False)) for x in jax.tree.leaves(tree)]


def _scan_run(txs: dict[str, optax.GradientTransformation]):
    """``carry, t0 -> carry`` after a ``lax.scan`` over two steps of every configuration."""
    step = step_all(txs)

    def run(carry: dict, t0: jax.Array) -> dict:
        return jax.lax.scan(step, carry, t0 + jnp.arange(2))[0]

    return run


@pytest.mark.parametrize("kind", CONTAINERS)
def test_update_keeps_init_structure_and_scan_traces(kind):
    """``structure(init) == structure(update)`` (and the same shapes, dtypes and weak types:
    the key of jit's cache) for every configuration; a jitted ``lax.scan`` over two steps
    traces (it needs exactly that of its carry).  Abstract (``jax.eval_shape``): no compile."""
    params, txs = txs_of(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoLayoutEvidenceWarning)
        carry = {name: (params, jax.eval_shape(tx.init, params)) for name, tx in txs.items()}
        after = jax.eval_shape(lambda c: step_all(txs)(c, jnp.asarray(0))[0], carry)
        bad = [name for name in txs
               if jax.tree.structure(carry[name]) != jax.tree.structure(after[name])
               or _avals(carry[name]) != _avals(after[name])]
        assert not bad, f"{kind}: the state changes after the first update for {bad}"
        scanned = jax.eval_shape(jax.jit(_scan_run(txs)), carry, jnp.asarray(0))
    assert jax.tree.structure(scanned) == jax.tree.structure(carry)


# Where the structure used to change (nnx.Param boxes; linen's nn.Partitioned boxes run
# compiled, sharded over 8 devices, in tests/optax/test_optax_state_sharding.py).
COMPILED = ("nnx.state",)


@pytest.mark.parametrize("kind", COMPILED)
def test_jit_compiles_once_scan_runs_and_checkpoint_restores(kind, tmp_path):
    """A jitted ``lax.scan`` of two steps of every configuration, called three times,
    compiles once; the state it returns, saved with orbax, restores into
    ``jax.eval_shape(tx.init, params)`` with equal leaves."""
    params, txs = txs_of(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoLayoutEvidenceWarning)
        carry = {name: (params, tx.init(params)) for name, tx in txs.items()}
        run = jax.jit(_scan_run(txs))
        for t in range(3):
            carry = run(carry, jnp.asarray(2 * t))
        target = {name: jax.eval_shape(tx.init, params) for name, tx in txs.items()}
    assert run._cache_size() == 1
    for name in txs:  # the steps did something, and stayed finite
        new_p = carry[name][0]
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new_p)), name
        moved = [not bool(jnp.array_equal(a, b))
                 for a, b in zip(jax.tree.leaves(new_p), jax.tree.leaves(params), strict=True)]
        assert any(moved), f"{name}: no parameter moved"
    _check_checkpoint({name: s for name, (_, s) in carry.items()}, target, tmp_path)


def _check_checkpoint(states: dict, target: dict, tmp_path) -> None:
    assert jax.tree.structure(states) == jax.tree.structure(target)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", states)
        ckpt.wait_until_finished()
        restored = ckpt.restore(tmp_path / "state", target)
    assert jax.tree.structure(restored) == jax.tree.structure(states)
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(states), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("kind", [k for k in CONTAINERS if k not in COMPILED])
def test_checkpoint_restores_into_eval_shape_of_init(kind, tmp_path):
    """The other containers: a state (init's leaves, changed, in init's structure: the
    structure every update keeps, above) restores into ``eval_shape(tx.init, params)``."""
    params, txs = txs_of(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NoLayoutEvidenceWarning)
        states = {name: jax.tree.map(lambda x: x + 1, tx.init(params)) for name, tx in txs.items()}
        target = {name: jax.eval_shape(tx.init, params) for name, tx in txs.items()}
    _check_checkpoint(states, target, tmp_path)


@pytest.mark.parametrize("kind", ["nnx.state", "linen-partitioned", "equinox"])
def test_tree_utils_get_and_set_hyperparameters(kind):
    """Under ``inject_hyperparams``: ``tree_get``/``tree_set`` of the learning rate and of
    the step count keep the state's structure, and the update (abstractly for every
    configuration, with values for one) keeps it too and uses the new learning rate."""
    params, model = container(kind)
    opts = {} if model is None else {"model": model}
    factory = optax.inject_hyperparams(sage_optax.make_optimizer, static_args="name")
    g = grads_like(params, 0)
    for name in sage_optax.CONFIG_NAMES:
        tx = factory(name=name, learning_rate=0.1, **opts)
        state = tx.init(params)
        assert float(otu.tree_get(state, "learning_rate")) == pytest.approx(0.1)
        set_lr = otu.tree_set(state, learning_rate=jnp.asarray(0.05))
        set_count = otu.tree_set(set_lr, count=jnp.asarray(3, jnp.int32))
        for s in (set_lr, set_count):
            assert jax.tree.structure(s) == jax.tree.structure(state), name
        assert float(otu.tree_get(set_lr, "learning_rate")) == pytest.approx(0.05)
        assert int(set_count.count) == 3, name  # the schedule's step (the outermost count)
        _, new = jax.eval_shape(tx.update, g, set_count, params)
        assert jax.tree.structure(new) == jax.tree.structure(state), name
        if (kind, name) != ("nnx.state", "sage-hybrid"):
            continue
        u, new = jax.jit(tx.update)(g, set_lr, params)
        assert float(otu.tree_get(new, "learning_rate")) == pytest.approx(0.05)
        ref_tx = factory(name=name, learning_rate=0.05, **opts)
        ref_u, _ = jax.jit(ref_tx.update)(g, ref_tx.init(params), params)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(ref_u), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, err_msg=name)


# --------------------------------------------------------------------------- state walkers


class ArrayLeaves(nnx.Module):
    """Parameters held as plain arrays (flax's array-leaves example): no nnx.Param."""

    def __init__(self):
        self.embedding = nnx.data(_rnd((V, D), 0))
        self.kernel = nnx.data(_rnd((D, H), 1))
        self.bias = nnx.data(_rnd((H,), 2))


def test_routing_table_takes_the_wrt_filter_of_nnx_optimizer():
    model = ArrayLeaves()
    table = sage_optax.routing_table("sage-hybrid", model, wrt=jax.Array)
    assert [row.path for row in table.rows] == ["bias", "embedding", "kernel"]
    assert {row.path: row.kind for row in table.rows} == {
        "bias": "vector", "embedding": "embedding", "kernel": "dense"}
    # The state nnx.Optimizer builds with that filter is the one the table counts.
    optimizer = nnx.Optimizer(model, sage_optax.make_optimizer("sage-hybrid"), wrt=jax.Array)
    assert sage_optax.state_bytes(nnx.as_pure(optimizer.opt_state)) == table.total_bytes
    # The params themselves (what nnx.Optimizer selects) give the same rows.
    same = sage_optax.routing_table("sage-hybrid", nnx.state(model, jax.Array))
    assert [r.path for r in same.rows] == [r.path for r in table.rows]


def test_routing_table_never_prints_an_empty_table():
    with pytest.raises(ValueError, match=r"no arrays to route.*wrt=jax\.Array"):
        sage_optax.routing_table("sage-hybrid", ArrayLeaves())
    with pytest.raises(ValueError, match="holds no arrays to route"):
        sage_optax.routing_table("adamw", {})
    with pytest.raises(ValueError, match="wrt= selects the trained leaves"):
        sage_optax.routing_table("adamw", {"w": jnp.ones((2, 2))}, wrt=jax.Array)


def test_state_walkers_see_arrays_only():
    """The README's walk: ``jax.tree.leaves`` of the state skips ``optax.MaskedNode``
    (the leaves of a partition that does not apply); every leaf has a ``.shape``."""
    params, model = container("nnx.state")
    state = make_tx("sage-hybrid", model).init(params)
    masked = jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, optax.MaskedNode))
    assert any(isinstance(x, optax.MaskedNode) for x in masked)
    assert all(hasattr(x, "shape") for x in jax.tree.leaves(state))
