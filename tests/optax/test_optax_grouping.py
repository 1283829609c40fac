"""Grouped SinkGD: leaves sharing a shape, a dtype and axes run as one batched computation
(what an accelerator needs: one set of kernels per group instead of per matrix), with the
same numbers as one leaf at a time and no copy of the gradients in the compiled program."""

from __future__ import annotations

import importlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_repro.llama_shapes import llama_param_shapes
from sage_train.model.shapes import get_model_config

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias


def dense_tree(dtype, seed=0):
    """The dense kernels of the tiny LLaMA (per layer: 7 shapes, 2 layers), random values."""
    rng = np.random.default_rng(seed)
    shapes = llama_param_shapes(get_model_config("tiny"))
    return {
        path: jnp.asarray(rng.standard_normal(x.shape) * 10.0 ** rng.uniform(-3, 3), dtype)
        for path, x in sage_optax.routing.iter_leaves(shapes) if path.endswith(".kernel")
    }


@pytest.mark.parametrize(("dtype", "rtol"), [(jnp.float32, 1e-6), (jnp.float64, 1e-12)])
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_stacked_groups_give_the_per_leaf_numbers(dtype, rtol, normalization):
    with jax.enable_x64(dtype == jnp.float64):
        grads = dense_tree(dtype)
        params = jax.tree.map(jnp.zeros_like, grads)
        out = {}
        for grouping in ("leaf", "stack", "sequence"):
            tx = sage_optax.sinkgd(1e-2, normalization=normalization, grouping=grouping)
            updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
            out[grouping] = updates
        for path in grads:
            for grouping in ("stack", "sequence"):
                np.testing.assert_allclose(out[grouping][path], out["leaf"][path], rtol=rtol,
                                           atol=0, err_msg=f"{grouping} {path}")


def test_stacked_layers_and_axis_groups_are_grouped_too():
    """Leaves with batch axes (nnx.scan) and with merged axes (multi-head) group exactly."""
    rng = np.random.default_rng(1)
    grads = {
        "a": jnp.asarray(rng.standard_normal((3, 8, 6)), jnp.float32),  # stacked layers
        "b": jnp.asarray(rng.standard_normal((3, 8, 6)), jnp.float32),
        "q": jnp.asarray(rng.standard_normal((8, 2, 3)), jnp.float32),  # (in, heads, dim)
        "k": jnp.asarray(rng.standard_normal((8, 2, 3)), jnp.float32),
    }
    axes = {"a": sage_optax.Route("dense", -2, -1), "b": sage_optax.Route("dense", -2, -1),
            "q": sage_optax.Route("dense", 0, (1, 2)), "k": sage_optax.Route("dense", 0, (1, 2))}
    leaf, _ = sage_optax.scale_by_sinkhorn(axes=axes, grouping="leaf").update(
        grads, optax.EmptyState())
    stack, _ = sage_optax.scale_by_sinkhorn(axes=axes, grouping="stack").update(
        grads, optax.EmptyState())
    for path in grads:
        np.testing.assert_allclose(stack[path], leaf[path], rtol=1e-6, atol=0, err_msg=path)
    batches = sinkhorn._batches(
        [(i, grads[p], axes[p].resolve(grads[p].shape, p)) for i, p in enumerate(grads)],
        sinkhorn.GROUP_BYTES,
    )
    assert [[i for i, _, _ in b] for b in batches] == [[0, 1], [2, 3]]


def test_groups_are_chunked_by_group_bytes():
    g = jnp.zeros((16, 16), jnp.float32)  # 1 KiB
    axes = sage_optax.Route("dense", -2, -1).resolve((16, 16))
    other = jnp.zeros((16, 8), jnp.float32)
    matrices = [(i, g, axes) for i in range(5)] + [(5, other, sage_optax.Route("dense", -2, -1)
                                                   .resolve((16, 8)))]
    sizes = [len(b) for b in sinkhorn._batches(matrices, 2048)]
    assert sizes == [2, 2, 1, 1]
    assert [len(b) for b in sinkhorn._batches(matrices, 0)] == [1] * 6  # per leaf


def test_stacking_adds_no_copy_of_the_gradients():
    """The compiled temporary of a stacked update is one chunk's K, not the whole tree."""
    rng = np.random.default_rng(2)
    tree = {f"l{i}": jnp.asarray(rng.standard_normal((256, 256)), jnp.float32)
            for i in range(16)}  # 4 MiB of gradients
    chunk = 2**20
    tx = sage_optax.scale_by_sinkhorn(grouping="stack", group_bytes=chunk)
    compiled = jax.jit(tx.update, donate_argnums=0).lower(tree, optax.EmptyState()).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp <= 1.25 * chunk, f"compiled temporary {temp / 2**20:.2f} MiB"


def test_auto_is_a_sequence_on_cpu_arrays():
    """On CPU arrays ``auto`` is the sequence program, on any host (placement decides)."""
    from sage_optax import placement

    grads = jax.device_put(dense_tree(jnp.float32), jax.devices("cpu")[0])
    texts, outs = {}, {}
    for grouping in ("auto", "sequence"):
        tx = sage_optax.scale_by_sinkhorn(grouping=grouping)
        texts[grouping] = jax.jit(tx.update).trace(grads, optax.EmptyState()).lower(
            lowering_platforms=("cpu",)).as_text()
        outs[grouping], _ = jax.jit(tx.update)(grads, optax.EmptyState())
    if placement.cuda_device_count() == 0:  # else the GPU's branch is traced (not lowered)
        assert texts["auto"] == texts["sequence"]
    for a, b in zip(jax.tree.leaves(outs["auto"]), jax.tree.leaves(outs["sequence"]),
                    strict=True):
        np.testing.assert_array_equal(a, b)


def test_grouping_is_validated():
    with pytest.raises(ValueError, match="grouping"):
        sage_optax.scale_by_sinkhorn(grouping="batch")
    with pytest.raises(ValueError, match="group_bytes"):
        sage_optax.sinkgd(1e-2, group_bytes=0)


def test_every_stacked_square_waits_for_the_previous_chunk():
    """The order of the chunks is a data dependency of each leaf's square, taken before the
    stack, so no compiler can form a chunk's K while the previous chunk's is alive (the
    stack itself never exists without it).  Checked on the traced program."""
    xs = [jnp.ones((4, 3)), jnp.ones((4, 3))]

    def squares(a, b, after):
        return sinkhorn._squares([a, b], after)

    jaxpr = jax.make_jaxpr(squares)(*xs, jnp.float32(0)).jaxpr
    after = jaxpr.invars[2]
    depends: dict = {v: {v} for v in jaxpr.invars}
    for eqn in jaxpr.eqns:
        deps = set().union(*(depends.get(v, set()) for v in eqn.invars
                             if not isinstance(v, jax.extend.core.Literal)))
        for out in eqn.outvars:
            depends[out] = deps
    # Every operation that makes a stacked array (2, 4, 3) takes only inputs that wait.
    stacks = [e for e in jaxpr.eqns if any(o.aval.shape == (2, 4, 3) for o in e.outvars)]
    assert stacks, "the two leaves are stacked"
    for eqn in stacks:
        for v in eqn.invars:
            if not isinstance(v, jax.extend.core.Literal):
                assert after in depends[v], f"an input of a stack does not wait: {eqn}"
