"""SinkGD's ``grouping="sequence"`` (the CPU's ``auto``): the leaves of one shape, dtype and
axes run one after another in one compiled loop, each with exactly its own iteration.

Checked against the float64 oracle (``tests/reference_np.py``), against the per-leaf
program, and for what the grouping is for: one loop body per group (the compiled program
does not grow with the number of same-shape leaves) and no copy of the gradients.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_np import sinkhorn_ref, sinkhorn_ref_stack

import sage_optax

sinkgd_mod = importlib.import_module("sage_optax.sinkgd")  # the module (the attribute: the alias)


@pytest.fixture(autouse=True)
def _jnp_path(monkeypatch):
    """These tests are of XLA's CPU path: ``auto``'s where the native kernel is not built
    (``tests/optax/test_optax_sinkgd_native.py`` tests the kernel)."""
    monkeypatch.setattr(sinkgd_mod, "CPU_NATIVE", False)

CPU = jax.devices("cpu")[0]
FLAX = sage_optax.Route("dense", -2, -1)


def _matrix(seed, shape=(12, 9)):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _x(grads, grouping, normalization="unit", axes=FLAX, jit=True):
    tx = sage_optax.scale_by_sinkhorn(normalization=normalization, axes=axes,
                                      grouping=grouping)
    grads = jax.device_put(jax.tree.map(jnp.asarray, grads), CPU)
    update = jax.jit(tx.update) if jit else tx.update
    out, _ = update(grads, optax.EmptyState())
    return {k: np.asarray(v) for k, v in out.items()}


def _group_with_every_range():
    """Six leaves of one shape: in range, overflowing, underflowing, a tiny row, zero, and
    a NaN, so the loop takes the checked path and its fallback in turn."""
    g = {f"w{i}": _matrix(seed=i) for i in range(6)}
    g["w1"] = g["w1"] * np.float32(1e20)
    g["w2"] = g["w2"] * np.float32(1e-25)
    g["w3"] = g["w3"] * np.float32(1e-6)
    g["w3"][4] *= np.float32(1e-15)
    g["w4"][:] = 0.0
    g["w5"][2, 3] = np.nan
    g["other"] = _matrix(seed=9, shape=(9, 12))  # a second group
    return g


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_a_sequence_equals_the_float64_oracle_and_the_per_leaf_program(normalization):
    grads = _group_with_every_range()
    seq = _x(grads, "sequence", normalization)
    leaf = _x(grads, "leaf", normalization)
    for path, g in grads.items():
        if path == "w5":  # a NaN gives NaNs, exactly where the per-leaf program has them
            np.testing.assert_array_equal(np.isnan(seq[path]), np.isnan(leaf[path]))
            assert np.isnan(seq[path]).any()
            continue
        want = sinkhorn_ref(g.astype(np.float64), normalization=normalization)
        np.testing.assert_allclose(seq[path], want, rtol=2e-5, atol=2e-6, err_msg=path)
        np.testing.assert_allclose(seq[path], leaf[path], rtol=1e-6, atol=0, err_msg=path)
    for path in ("w0", "other"):  # in range: the checked path's operations, bit for bit
        np.testing.assert_array_equal(seq[path], leaf[path], err_msg=path)
    assert np.all(seq["w4"] == 0)


def test_a_nan_in_one_leaf_leaves_the_others_alone():
    grads = {f"w{i}": _matrix(seed=20 + i) for i in range(4)}
    clean = _x(grads, "sequence")
    grads["w1"] = grads["w1"].copy()
    grads["w1"][0, 0] = np.nan
    dirty = _x(grads, "sequence")
    assert np.isnan(dirty["w1"]).any()
    for path in ("w0", "w2", "w3"):
        np.testing.assert_array_equal(dirty[path], clean[path], err_msg=path)


def test_stacked_layers_axis_groups_and_torch_layouts():
    """Leaves with batch axes (nnx.scan), merged axes (multi-head) and PyTorch's (out, in)
    each get their own matrices' iteration inside a sequence."""
    rng = np.random.default_rng(3)
    grads = {
        "a": rng.standard_normal((3, 8, 6)).astype(np.float32),
        "b": rng.standard_normal((3, 8, 6)).astype(np.float32),
        "q": rng.standard_normal((8, 2, 3)).astype(np.float32),
        "k": rng.standard_normal((8, 2, 3)).astype(np.float32),
        "t0": rng.standard_normal((5, 7)).astype(np.float32),
        "t1": rng.standard_normal((5, 7)).astype(np.float32),
    }
    stacked, heads, torch = FLAX, sage_optax.Route("dense", 0, (1, 2)), sage_optax.Route(
        "dense", 1, 0)
    axes = {"a": stacked, "b": stacked, "q": heads, "k": heads, "t0": torch, "t1": torch}
    seq = _x(grads, "sequence", axes=axes)
    for path in ("a", "b"):
        want = sinkhorn_ref_stack(grads[path], fan_in_axis=0, fan_out_axis=1)
        np.testing.assert_allclose(seq[path], want, rtol=2e-5, atol=2e-6, err_msg=path)
    for path in ("q", "k"):
        want = sinkhorn_ref(grads[path].reshape(8, 6).astype(np.float64)).reshape(8, 2, 3)
        np.testing.assert_allclose(seq[path], want, rtol=2e-5, atol=2e-6, err_msg=path)
    for path in ("t0", "t1"):
        want = sinkhorn_ref(grads[path].astype(np.float64), fan_in_axis=1, fan_out_axis=0)
        np.testing.assert_allclose(seq[path], want, rtol=2e-5, atol=2e-6, err_msg=path)


def test_bfloat16_gradients_accumulate_in_float32():
    grads = {f"w{i}": jnp.asarray(_matrix(seed=30 + i), jnp.bfloat16) for i in range(3)}
    seq = _x(grads, "sequence")
    for path, g in grads.items():
        assert seq[path].dtype == jnp.bfloat16
        want = sinkhorn_ref(np.asarray(g, np.float64))
        np.testing.assert_allclose(np.asarray(seq[path], np.float32), want, rtol=1e-2,
                                   atol=1e-3, err_msg=path)


def test_the_range_scaled_sequence_equals_the_range_scaled_leaves():
    """Without the checks (a multi-process job's CPU path) the loop runs the range pass."""
    gs = [jnp.asarray(_matrix(seed=40 + i)) * s for i, s in enumerate([1.0, 1e20, 1e-25])]
    route = FLAX.resolve(gs[0].shape, "w")
    c, r = jax.jit(lambda gs: sinkgd_mod.sequenced_sinkhorn_scales(
        gs, route, checked=False))(gs)
    for k, g in enumerate(gs):
        c1, r1 = sinkgd_mod.range_scaled_scales([g], route)
        np.testing.assert_allclose(c[k], c1, rtol=1e-6, atol=0)
        np.testing.assert_allclose(r[k], r1, rtol=1e-6, atol=0)


def test_eager_and_jitted_updates_agree():
    grads = {f"w{i}": _matrix(seed=50 + i) for i in range(3)}
    eager = _x(grads, "sequence", jit=False)
    jitted = _x(grads, "sequence")
    for path in grads:
        np.testing.assert_allclose(eager[path], jitted[path], rtol=1e-6, atol=0)


def test_eager_updates_compile_the_sequence_once():
    """Called eagerly, a new loop would be traced and compiled at every update (and
    XLA:CPU keeps every compiled kernel mapped); fresh transformations of one shape share
    one compiled program."""
    grads = {f"w{i}": _matrix(seed=70 + i, shape=(7, 11)) for i in range(3)}
    grads = jax.device_put(jax.tree.map(jnp.asarray, grads), CPU)
    before = sinkgd_mod._sequenced_static._cache_size()
    for _ in range(3):
        tx = sage_optax.scale_by_sinkhorn(axes=FLAX, grouping="sequence")
        tx.update(grads, optax.EmptyState())
    assert sinkgd_mod._sequenced_static._cache_size() - before <= 1


def _compiled(n, grouping, shape=(32, 48)):
    tree = {f"l{i}": jax.ShapeDtypeStruct(shape, jnp.float32) for i in range(n)}
    tx = sage_optax.scale_by_sinkhorn(grouping=grouping)
    return jax.jit(tx.update).lower(tree, optax.EmptyState()).compile().as_text()


def test_the_loop_body_is_compiled_once_per_group():
    """What makes the sequence compile fast: 16 same-shape leaves compile to the matrix
    products of one (the per-leaf program has 8 times those of 2 leaves)."""
    def products(text):
        return text.count(" dot(")

    assert products(_compiled(16, "sequence")) == products(_compiled(2, "sequence")) > 0
    assert products(_compiled(16, "leaf")) == 8 * products(_compiled(2, "leaf"))


def test_a_sequence_makes_no_copy_of_the_gradients():
    """Its compiled temporary: the one leaf's ``K`` (and the range fallback's copy of that
    leaf), not the group's 16 leaves."""
    tree = {f"l{i}": jax.ShapeDtypeStruct((256, 256), jnp.float32) for i in range(16)}
    leaf_bytes = 256 * 256 * 4
    tx = sage_optax.scale_by_sinkhorn(grouping="sequence")
    compiled = jax.jit(tx.update, donate_argnums=0).lower(tree, optax.EmptyState()).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 2.25 * leaf_bytes, f"compiled temporary {temp / 2**20:.2f} MiB"


def test_auto_is_a_sequence_on_cpu_arrays_and_a_stack_elsewhere():
    assert sinkgd_mod.resolved_grouping("auto", "cpu") == sinkgd_mod.CPU_GROUPING == "sequence"
    assert sinkgd_mod.resolved_grouping("auto", "cuda") == "stack"
    assert sinkgd_mod.resolved_grouping("leaf", "cpu") == "leaf"
    with pytest.raises(ValueError, match="grouping"):
        sinkgd_mod.resolved_grouping("batch", "cpu")


@pytest.mark.parametrize("grouping", ["sequence", "stack"])
def test_same_shape_leaves_sharded_differently_on_an_explicit_mesh(grouping):
    """On a mesh with explicit axes a leaf's sharding is part of its type: leaves of one
    shape sharded differently are other groups (a `switch` or a stack of them is a type
    error), leaves sharded alike one group; every update keeps its leaf's sharding."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices("cpu")[:8])
    specs = {"a": P("d", None), "b": P(None, "d"), "c": P("d", None), "d": P()}
    grads = {k: _matrix(seed=60 + i, shape=(16, 8)) for i, k in enumerate(specs)}
    leaf = _x(grads, "leaf")
    with jax.set_mesh(mesh):
        sharded = {k: jax.device_put(jnp.asarray(v), NamedSharding(mesh, specs[k]))
                   for k, v in grads.items()}
        tx = sage_optax.scale_by_sinkhorn(axes=FLAX, grouping=grouping)
        out, _ = jax.jit(tx.update)(sharded, optax.EmptyState())
    for path, spec in specs.items():
        assert out[path].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2), path
        np.testing.assert_allclose(np.asarray(out[path]), leaf[path], rtol=1e-6, atol=0,
                                   err_msg=path)
