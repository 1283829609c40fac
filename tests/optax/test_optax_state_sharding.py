"""Reduced optimizer state carries the sharding metadata of its axes (linen and nnx).

SAGE's ``S`` (reduced over the fan-out axis) and APOLLO's rank-``r`` moments and per-matrix
norms have fewer (or other) axes than their parameter.  Where the parameters are boxed
(``nn.Partitioned``/``nn.LogicallyPartitioned``, ``nnx.Variable`` with ``out_sharding``)
the state must be boxed with the names of the axes it kept, so that the standard helpers
(``nn.get_partition_spec``, ``nn.logical_to_mesh_sharding``, ``nnx.get_partition_spec``)
give a valid sharding of the whole state.  The FSDP test runs a small linen LM with
nanodo's recipe (``jax.eval_shape`` of the initial state, shardings derived from its boxes,
``jit(init, out_shardings=...)``) on the 8 CPU devices of ``tests/conftest.py``, with
logical axis names and FSDP over ``embed``, and compares it with a single-device run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import sage_optax

V, D, H = 64, 16, 32
RULES = (("embed", "data"), ("vocab", None), ("mlp", None))  # FSDP over the model width
CONFIGS = ("sage-pure", "apollo")  # the reduced states: SAGE's S, APOLLO's moments and norms
TOKENS = np.random.default_rng(3).integers(0, V, size=(8, 9), dtype=np.int32)


class LinenLM(nn.Module):
    """A nanodo-like LM: every kernel and the table named with logical axes."""

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        def init(f, names):
            return nn.with_logical_partitioning(f, names)

        normal, lecun = nn.initializers.normal(1.0), nn.initializers.lecun_normal()
        x = nn.Embed(V, D, embedding_init=init(normal, ("vocab", "embed")), name="embed")(tokens)
        h = nn.Dense(H, kernel_init=init(lecun, ("embed", "mlp")), name="up")(nn.RMSNorm()(x))
        x = x + nn.Dense(D, kernel_init=init(lecun, ("mlp", "embed")), name="down")(
            jax.nn.gelu(h))
        return nn.Dense(V, kernel_init=init(lecun, ("embed", "vocab")), name="head")(x)


def _train(name: str, mesh: Mesh | None, steps: int = 2):
    model, tx = LinenLM(), sage_optax.make_optimizer(name)

    def init(key):
        params = model.init(key, jnp.asarray(TOKENS[:, :-1]))["params"]
        return params, tx.init(params)

    def step(params, opt_state, tokens):
        def loss_fn(p):
            logits = model.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    key = jax.random.key(0)
    if mesh is None:
        with jax.default_device(jax.devices("cpu")[0]):
            params, opt_state = jax.jit(init)(key)
            run = jax.jit(step)
            losses = []
            for _ in range(steps):
                params, opt_state, loss = run(params, opt_state, jnp.asarray(TOKENS))
                losses.append(float(loss))
        return params, opt_state, losses, None
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init, key)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        params, opt_state = jax.jit(init, out_shardings=shardings)(key)
        replicated = NamedSharding(mesh, P())
        run = jax.jit(step, in_shardings=(*shardings, replicated),
                      out_shardings=(*shardings, replicated))
        losses = []
        for _ in range(steps):
            params, opt_state, loss = run(params, opt_state, jnp.asarray(TOKENS))
            losses.append(float(loss))
    return params, opt_state, losses, shardings


def _find(tree, cls):
    found = []
    jax.tree.map(lambda x: found.append(x) if isinstance(x, cls) else None, tree,
                 is_leaf=lambda x: isinstance(x, cls))
    return found


@pytest.mark.parametrize("name", CONFIGS)
def test_linen_fsdp_logical_rules_match_single_device(name):
    mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
    ref_params, ref_state, ref_losses, _ = _train(name, None)
    params, state, losses, shardings = _train(name, mesh)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state)),
                    strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # The reduced state is sharded by the axes it kept, not replicated: SAGE's S of the
    # (vocab, embed) table keeps 'embed' -> 'data'; APOLLO's moments keep their full axis.
    checked = []

    def check(sharding, subtree):
        for x in jax.tree.leaves(subtree):
            assert x.sharding.is_equivalent_to(sharding, x.ndim), (sharding, x.sharding)
            checked.append(x)

    jax.tree.map(check, shardings[1], state, is_leaf=lambda x: isinstance(x, NamedSharding))
    assert len(checked) == len(jax.tree.leaves(state))
    if name.startswith("sage"):
        sage_states = _find(state, sage_optax.ScaleBySageState)
        s_embed = [st.s["embed"]["embedding"] for st in sage_states
                   if not isinstance(st.s["embed"], optax.MaskedNode)
                   and not isinstance(st.s["embed"]["embedding"], optax.MaskedNode)]
        assert len(s_embed) == 1
        assert s_embed[0].names == ("embed",)  # the vocab axis reduced, its name dropped
        assert s_embed[0].value.sharding.spec == P("data")
    if name == "apollo":
        (st,) = _find(state, sage_optax.ScaleByApolloState)
        up = st.mu["up"]["kernel"]  # (D, H) = (16, 32): the fan-in axis D compressed to rank 1
        assert up.value.shape == (1, H) and up.names == (None, "mlp")
        assert st.norm["up"]["kernel"].names == ()


def test_linen_partitioned_state_names_have_the_state_ranks():
    """Every ``nn.Partitioned`` box of every configuration's state names as many axes as
    its array has (``nn.with_partitioning`` with mesh names, as nanodo's FSDP config)."""

    class MeshNamed(nn.Module):
        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(V, D, embedding_init=nn.with_partitioning(
                nn.initializers.normal(1.0), (None, "data")), name="embed")(tokens)
            x = nn.Dense(H, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), ("data", None)), name="up")(x)
            return nn.Dense(V, kernel_init=nn.with_partitioning(
                nn.initializers.lecun_normal(), ("data", None)), name="head")(x)

    params = jax.eval_shape(lambda: MeshNamed().init(jax.random.key(0), TOKENS)["params"])
    for name in sage_optax.CONFIG_NAMES:
        state = jax.eval_shape(sage_optax.make_optimizer(name).init, params)
        bad = [
            (box.names, box.value.shape) for box in _find(state, nn.Partitioned)
            if hasattr(box.value, "shape") and len(box.names) != len(box.value.shape)
        ]
        assert not bad, f"{name}: boxes naming the wrong number of axes {bad}"
        for spec in jax.tree.leaves(nn.get_partition_spec(state),
                                    is_leaf=lambda x: isinstance(x, P)):
            assert isinstance(spec, P)


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        def init(f, names):
            return nnx.with_partitioning(f, names)

        normal, lecun = nnx.initializers.normal(1.0), nnx.initializers.lecun_normal()
        self.embed = nnx.Embed(V, D, rngs=rngs, embedding_init=init(normal, (None, "data")))
        self.up = nnx.Linear(D, H, rngs=rngs, kernel_init=init(lecun, ("data", None)))
        self.head = nnx.Linear(H, V, rngs=rngs, kernel_init=init(lecun, (None, "data")))


@pytest.mark.parametrize("name", ["sage-hybrid", "sage-pure", "apollo"])
def test_nnx_state_sharding_metadata_fits_every_state_leaf(name):
    """``nnx.get_partition_spec`` of the state (of ``nnx.state(model, nnx.Param)``) has at
    most one entry per axis of each leaf, and ``nnx.Optimizer`` shards SAGE's ``S`` by the
    axis it kept (``out_sharding`` of the table ``(None, 'data')`` -> ``('data',)``)."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu")[:8])
    with jax.set_mesh(mesh):
        model = NnxLM(nnx.Rngs(0))
        params = nnx.state(model, nnx.Param)
        tx = sage_optax.make_optimizer(name, model=model)
        state = jax.eval_shape(tx.init, params)
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    bad, checked = [], 0
    for var in _find(state, nnx.Variable):
        if hasattr(var.get_value(), "shape"):
            spec = nnx.get_partition_spec(var).get_value()
            checked += 1
            if len(spec) > len(var.get_value().shape):
                bad.append((var.get_value().shape, spec))
    # Every array but the step counts is in a box.
    assert checked == len([x for x in jax.tree.leaves(state) if x.dtype != jnp.int32])
    assert not bad, bad
    if name.startswith("sage"):
        sage_states = _find(optimizer.opt_state, sage_optax.ScaleBySageState)
        (s,) = [st.s["embed"]["embedding"] for st in sage_states
                if not isinstance(st.s["embed"]["embedding"], optax.MaskedNode)]
        assert s.get_value().shape == (D,)
        assert s.get_metadata()["out_sharding"] == ("data",)
        assert s.get_value().sharding.spec == P("data")


def test_rebox_reads_every_form_of_nnx_sharding_metadata():
    """``out_sharding`` as a tuple, a short ``PartitionSpec`` (trailing axes replicated) or
    a ``NamedSharding``: the reduced state gets the names of the axes it keeps; metadata it
    cannot read, or naming more axes than the parameter has, is a one-line error."""
    from sage_optax import boxes

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices("cpu")[:8])
    value = jnp.zeros((D,))
    cases = [(("vocab", "embed"), (1,), ("embed",)),
             (P("vocab"), (1,), P(None)),
             (P("vocab"), (0,), P("vocab")),
             (NamedSharding(mesh, P(None, "data")), (1,), NamedSharding(mesh, P("data"))),
             (("vocab", "embed"), (None, 1), (None, "embed"))]
    for spec, sources, expected in cases:
        box = nnx.Param(jnp.zeros((V, D)), out_sharding=spec, eager_sharding=False)
        got = boxes.rebox(box, value, sources, "embed.embedding").get_metadata()["out_sharding"]
        assert got == expected, (spec, sources, got)
    for bad, match in [("data", "cannot read its sharding metadata"),
                       (("a", "b", "c"), "names 3 axes, but the parameter has 2")]:
        box = nnx.Param(jnp.zeros((V, D)), out_sharding=bad, eager_sharding=False)
        with pytest.raises(ValueError, match=match):
            boxes.rebox(box, value, (1,), "embed.embedding")
