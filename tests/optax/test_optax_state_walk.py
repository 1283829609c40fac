"""The optimizer state walks like ``optax.adamw``'s: arrays only, and stale state refused.

flax's ``examples/gemma`` trainer logs the optimizer's shardings before step 0 by walking
``nnx.to_flat_state(nnx.state(optimizer))`` and reading each entry's ``shape``, ``dtype``,
``out_sharding`` and ``param[...].sharding``; every configuration's state held
``optax.MaskedNode`` placeholders inside ``nnx`` variables there, and the walk died.  Here
the same walk runs over every configuration next to ``optax.adamw`` (the reference), on a
model whose parameters carry sharding annotations, then the state goes through
``jax.tree.leaves``, ``nnx.get_partition_spec`` + ``jax.device_put`` and an orbax round
trip.

A state that ``init`` built for other params (a matrix that became a vector, a transposed
matrix) is refused by ``update`` in one line naming the parameter and the two shapes, from
the check that runs before the arithmetic, for every configuration whose state holds
something for that parameter; a state with nothing for it is indistinguishable from a fresh
one, and the update is the fresh one's.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import sage_optax

V, D, H = 16, 4, 8


class ShardedLM(nnx.Module):
    """Token table, a dense layer, a norm and an untied head, each annotated for a mesh."""

    def __init__(self, rngs: nnx.Rngs):
        part = nnx.with_partitioning
        normal, lecun = nnx.initializers.normal(1.0), nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(V, D, rngs=rngs, embedding_init=part(normal, ("data", None)))
        self.up = nnx.Linear(D, H, rngs=rngs, kernel_init=part(lecun, (None, "data")))
        self.norm = nnx.LayerNorm(H, rngs=rngs)
        self.head = nnx.Linear(D, V, use_bias=False, rngs=rngs,
                               kernel_init=part(lecun, (None, "data")))


def _pure(tree: Any) -> Any:
    return (getattr(nnx, "as_pure", None) or nnx.pure)(tree)


def _optimizers() -> tuple[Any, dict[str, tuple[nnx.Module, nnx.Optimizer]]]:
    mesh = jax.make_mesh((2,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu")[:2])
    out = {}
    with jax.set_mesh(mesh):
        for name in ("optax.adamw", *sage_optax.CONFIG_NAMES):
            model = ShardedLM(nnx.Rngs(0))
            tx = optax.adamw(1e-3) if name == "optax.adamw" else sage_optax.make_optimizer(
                name, model=model)
            out[name] = model, nnx.Optimizer(model, tx, wrt=nnx.Param)
    return mesh, out


def _gemma_walk(optimizer: nnx.Optimizer) -> list[tuple[Any, ...]]:
    """What examples/gemma's train.py reads of every entry of the optimizer's state."""
    seen = []
    for key, param in nnx.to_flat_state(nnx.state(optimizer)):
        names = param.out_sharding if hasattr(param, "out_sharding") else "no sharding"
        x = param[...]
        info = x.sharding.devices_indices_map(tuple(x.shape))
        seen.append((key, tuple(param.shape), param.dtype, names, len(info)))
    return seen


def test_every_configuration_walks_like_adamw() -> None:
    mesh, optimizers = _optimizers()
    for name, (model, optimizer) in optimizers.items():
        grads = jax.tree.map(jnp.ones_like, nnx.state(model, nnx.Param))
        with jax.set_mesh(mesh):
            optimizer.update(model, grads)  # the walk after a step too
        seen = _gemma_walk(optimizer)
        assert seen, name
        state = nnx.state(optimizer)
        leaves = jax.tree.leaves(state)
        assert all(hasattr(x, "shape") and hasattr(x, "dtype") and hasattr(x, "sharding")
                   for x in leaves), name
        placeholders = [
            k for k, v in nnx.to_flat_state(state) if isinstance(v.get_value(), optax.MaskedNode)]
        assert not placeholders, (name, placeholders)
        # sharding annotations: the specs nnx gives fit every leaf, and device_put takes them
        specs = nnx.get_partition_spec(state)
        shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs,
                                 is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
        placed = jax.device_put(_pure(state), _pure(shardings))
        assert len(jax.tree.leaves(placed)) == len(leaves), name


def test_every_configuration_round_trips_through_orbax(tmp_path: Any) -> None:
    _, optimizers = _optimizers()
    states = {name: _pure(nnx.state(o)) for name, (_, o) in optimizers.items()}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", states)
    with ocp.StandardCheckpointer() as ckpt:
        restored = ckpt.restore(tmp_path / "state", jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), states))
    for name in states:
        assert jax.tree.structure(restored[name]) == jax.tree.structure(states[name]), name
        for a, b in zip(jax.tree.leaves(restored[name]), jax.tree.leaves(states[name]),
                        strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------ stale state


def _tree(kernel: tuple[int, ...]) -> dict[str, Any]:
    rnd = np.random.default_rng(0)
    return {"embed": {"embedding": jnp.asarray(rnd.normal(size=(32, 8)), jnp.float32)},
            "mlp": {"kernel": jnp.asarray(rnd.normal(size=kernel), jnp.float32),
                    "bias": jnp.asarray(rnd.normal(size=(16,)), jnp.float32)}}


STATEFUL_KERNEL = {"adamw", "lion", "apollo", "sage-pure"}  # the dense rule keeps state


@pytest.mark.parametrize("change", ["matrix->vector", "transposed"])
@pytest.mark.parametrize("name", sage_optax.CONFIG_NAMES)
def test_stale_state_is_refused_in_update(name: str, change: str) -> None:
    old = _tree((8, 16))
    new = _tree((16,) if change == "matrix->vector" else (16, 8))
    tx = sage_optax.make_optimizer(name)
    stale = tx.init(old)
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), new)
    fresh = tx.init(new)
    same = jax.tree.structure(fresh) == jax.tree.structure(stale) and all(
        a.shape == b.shape for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(stale),
                                           strict=True))
    if same:  # nothing of the state is the old kernel's: the update is the fresh state's
        assert name not in STATEFUL_KERNEL and (change == "transposed" or name == "sinkgd-pure")
        got, _ = tx.update(grads, stale, new)
        want, _ = tx.update(grads, fresh, new)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        return
    for update in (tx.update, jax.jit(tx.update)):
        with pytest.raises(ValueError) as err:
            update(grads, stale, new)
        message = str(err.value)
        assert "\n" not in message, message
        assert "initialised for other params" in message and "'mlp.kernel'" in message
        assert f"has shape {new['mlp']['kernel'].shape} now" in message, message
        assert "re-run tx.init(params)" in message
        # refused by the check that runs before the arithmetic, not inside a rule
        assert err.traceback[-1].path.name == "state_tree.py", err.traceback[-1]
    # the advice: re-run tx.init(params)
    updates, _ = tx.update(grads, tx.init(new), new)
    assert all(bool(jnp.isfinite(u).all()) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", ["sage-hybrid", "apollo"])
def test_stale_state_names_the_two_shapes(name: str) -> None:
    """A kernel that grew: the state's shape and the one the params need, both named."""
    tx = sage_optax.make_optimizer(name, dense="sage")
    stale = tx.init(_tree((8, 16)))
    new = _tree((8, 24))
    with pytest.raises(ValueError, match=r"parameter 'mlp.kernel' has shape \(8, 24\) now; its "
                                         r"state leaf '.*mlp.kernel' has shape \(\d+, 16\) "
                                         r"where these params need shape \(\d+, 24\)"):
        tx.update(jax.tree.map(jnp.ones_like, new), stale, new)
