"""The Pallas kernel path of SinkGD's scales (sage_optax.sinkgd_pallas) against the jnp path.

On the CPU the kernels run in Pallas's interpreter (``interpret=True``): the same kernel
code, so CI checks its math (masking of non-power-of-two edges, the fused rescale, the
layouts).  The GPU test at the end runs them compiled with Triton (scripts/gpu-check).

Tolerance: the kernel sums each half-iteration's squares in another order than XLA's
reduction (tile by tile), so the two paths differ by float32 rounding, not by math.  One
such sum of ``n`` positive terms differs by a few units of float32 rounding (``u = 2^-24``;
at most ``n·u`` in the worst case), the square root halves that, and the iteration does
not amplify it (each rescale maps a relative error of the sum to half of it in the scale);
``X = c·G·r`` adds two roundings.  ``RTOL = 2^-19`` (32 u, about 1.9e-6) bounds the
observed differences (about 4e-7 for 50-long sums over ``2L = 10`` half-iterations) with
margin, and :func:`test_the_comparison_can_fail` shows it is tight enough to catch one
missing iteration, a wrong ε or a perturbed entry.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_optax import Route, sinkgd_pallas
from tests import helpers
from tests.reference_np import sinkhorn_ref

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

RTOL = 2.0**-19
FLAX, TORCH = Route("dense", -2, -1), Route("dense", -1, -2)  # (in, out), (out, in); batch first


def _scales(g, leaf_axes, kernel, num_iters=5, eps=1e-8, normalization="unit"):
    """``(c, r, X)`` of one leaf by the jnp path or the kernel (interpreted), under jit."""
    axes = leaf_axes.resolve(tuple(g.shape), "g")

    @jax.jit
    def run(g):
        if kernel == "jnp":
            c, r = sinkhorn.sinkhorn_scales(g, axes, num_iters, eps, normalization)
        else:
            c, r = sinkgd_pallas.pallas_scales(
                [g], axes, num_iters, eps, normalization, interpret=True)
        return c, r, sinkhorn.apply_scales(g, axes, c, r)

    return run(g)


def _close(a, b, rtol=RTOL):
    """Elementwise ``|a - b| <= rtol·|b|`` (zeros must match exactly, non-finite in place)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    finite = np.isfinite(b)
    return bool(np.array_equal(finite, np.isfinite(a))
                and np.all(np.abs(a[finite] - b[finite]) <= rtol * np.abs(b[finite])))


def _assert_same(g, leaf_axes, **kw):
    """Kernel and jnp path give the same c, r and X within RTOL; returns X."""
    want = _scales(g, leaf_axes, "jnp", **kw)
    got = _scales(g, leaf_axes, "pallas", **kw)
    for name, x, y in zip("crX", got, want, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert _close(x, y), (name, np.max(np.abs(np.asarray(x) - y) / np.abs(y)))
    return got[2]


def _matrix(shape, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.float32)


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize(("shape", "leaf_axes", "fan_in_axis"), [
    ((37, 50), FLAX, 0), ((37, 50), TORCH, 1), ((1, 7), FLAX, 0), ((130, 3), TORCH, 1),
])
def test_kernel_matches_jnp_and_the_float64_reference(shape, leaf_axes, fan_in_axis,
                                                      normalization):
    """Both layouts, non-power-of-two edges (masked tiles), both normalisations."""
    g = _matrix(shape)
    x = _assert_same(g, leaf_axes, normalization=normalization)
    want = sinkhorn_ref(np.asarray(g), 5, 1e-8, normalization, fan_in_axis, 1 - fan_in_axis)
    np.testing.assert_allclose(x, want, rtol=4 * RTOL, atol=0)


def test_stacked_leaves_and_batches_match():
    """A leaf with stacked layers (B, R, C), and a group of leaves stacked by the kernel."""
    g = _matrix((3, 20, 9), seed=1) * jnp.asarray([1e-3, 1.0, 1e3])[:, None, None]
    _assert_same(g, FLAX, normalization="sqrt")
    gs = [_matrix((9, 20), seed=s) for s in (2, 3)]
    axes = TORCH.resolve((9, 20), "g")
    c, r = jax.jit(lambda gs: sinkgd_pallas.pallas_scales(
        gs, axes, 5, 1e-8, "unit", interpret=True))(gs)
    c0, r0 = sinkhorn.stacked_sinkhorn_scales(gs, axes, 5, 1e-8, "unit")
    assert c.shape == c0.shape == (2, 20) and r.shape == r0.shape == (2, 9)
    assert _close(c, c0) and _close(r, r0)


def test_zero_matrix_zero_row_and_column():
    """An all-zero matrix stays zero; an all-zero row or column keeps its scale (and X = 0)."""
    x = _assert_same(jnp.zeros((5, 6), jnp.float32), FLAX)
    assert not np.any(np.asarray(x))
    g = _matrix((17, 11), seed=4).at[3, :].set(0).at[:, 7].set(0)
    x = _assert_same(g, FLAX)
    assert not np.any(np.asarray(x)[3]) and not np.any(np.asarray(x)[:, 7])


@pytest.mark.parametrize("scale", [1e30, 1e-30])
def test_huge_and_tiny_magnitudes(scale):
    """The range scaling m: squares of 1e30 would overflow float32, of 1e-30 underflow.

    At 1e-30 ε = 1e-8 dominates every norm and the scales' squares (about 1e-45) are
    subnormal in float32 on both paths, which then agree with each other but not with the
    float64 reference; at 1e30 all three agree.
    """
    g = _matrix((12, 10), seed=5, scale=scale)
    x = _assert_same(g, FLAX)
    if scale > 1:
        want = sinkhorn_ref(np.asarray(g), 5, 1e-8, "unit", 0, 1)
        np.testing.assert_allclose(x, want, rtol=4 * RTOL, atol=0)


def test_non_finite_entry_and_bfloat16():
    g = _matrix((6, 9), seed=6).at[2, 4].set(jnp.inf)
    _assert_same(g, FLAX)  # the same entries are non-finite, the rest agree
    _assert_same(_matrix((24, 10), seed=7).astype(jnp.bfloat16), TORCH)


def test_the_comparison_can_fail():
    """One iteration fewer, another ε or one entry changed by 1e-5: all outside RTOL."""
    g = _matrix((16, 24), seed=8)
    want = _scales(g, FLAX, "jnp")
    for kw, gg in [({"num_iters": 4}, g), ({"eps": 1e-3}, g), ({}, g.at[5, 5].multiply(1.00001))]:
        got = _scales(gg, FLAX, "pallas", **kw)
        assert not _close(got[2], want[2]), kw


def test_matrix_view_and_support():
    res = Route("dense", -2, -1).resolve((4, 3, 5), "w")
    assert sinkgd_pallas.matrix_view(res) == (4, 3, 5, True)
    assert sinkgd_pallas.matrix_view(Route("dense", -1, -2).resolve((4, 3, 5), "w")) == (
        4, 3, 5, False)
    assert sinkgd_pallas.matrix_view(Route("dense", 0, (1, 2)).resolve((4, 3, 5), "w")) == (
        1, 4, 15, True)
    odd = Route("dense", 0, 2).resolve((4, 3, 5), "w")  # batch axis between the groups
    assert sinkgd_pallas.matrix_view(odd) is None
    assert not sinkgd_pallas.supports(jnp.zeros((4, 3, 5)), odd)
    empty = Route("dense", -2, -1).resolve((0, 5), "w")
    assert not sinkgd_pallas.supports(jnp.zeros((0, 5)), empty)
    assert sinkgd_pallas.supports(jnp.zeros((4, 3, 5), jnp.bfloat16), res)
    with jax.enable_x64(True):
        assert not sinkgd_pallas.supports(jnp.zeros((4, 3, 5), jnp.float64), res)


def test_float64_leaves_use_the_jnp_path():
    """x64: the kernel is float32 arithmetic, so float64 leaves keep the jnp path exactly."""
    with jax.enable_x64(True):
        g = {"w": jnp.asarray(np.random.default_rng(12).standard_normal((9, 5)), jnp.float64)}
        out = {k: jax.jit(sage_optax.scale_by_sinkhorn(impl=k).update)(g, optax.EmptyState())[0]
               for k in ("jnp", "pallas")}
        assert out["pallas"]["w"].dtype == jnp.float64
        assert np.array_equal(out["pallas"]["w"], out["jnp"]["w"])


def _tree():
    rng = np.random.default_rng(9)
    return {
        "a": jnp.asarray(rng.standard_normal((20, 12)), jnp.float32),
        "b": jnp.asarray(rng.standard_normal((20, 12)) * 1e4, jnp.float32),  # groups with a
        "t": jnp.asarray(rng.standard_normal((2, 12, 20)), jnp.float32),  # torch, stacked
        "odd": jnp.asarray(rng.standard_normal((4, 3, 5)), jnp.float32),  # jnp fallback
        "skip": jnp.ones((3,), jnp.float32),
    }


@pytest.mark.parametrize("grouping", ["leaf", "stack"])
def test_scale_by_sinkhorn_kernel_choice(grouping):
    grads = _tree()
    axes = {"a": FLAX, "b": FLAX, "t": TORCH, "odd": Route("dense", 0, 2), "skip": None}
    out = {}
    for kernel in ("jnp", "pallas"):
        tx = sage_optax.scale_by_sinkhorn(
            num_iters=3, axes=axes, grouping=grouping, impl=kernel)
        out[kernel], _ = jax.jit(tx.update)(grads, tx.init(grads))
    for path in grads:
        assert _close(out["pallas"][path], out["jnp"][path]), path
    assert np.array_equal(out["pallas"]["odd"], out["jnp"]["odd"])  # the same jnp code


def test_make_optimizer_with_the_kernel():
    rng = np.random.default_rng(10)
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), helpers.mixed_params(rng))
    grads = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                         helpers.mixed_gradient(rng, params, 1))
    out = {}
    for kernel in ("jnp", "pallas"):
        tx = sage_optax.make_optimizer("sinkgd-pure", impl=kernel, num_iters=2)
        out[kernel], _ = jax.jit(tx.update)(grads, tx.init(params), params)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(out["pallas"]),
                            jax.tree.leaves(out["jnp"]), strict=True):
        # the decay term adds a rounding: compare with the parameter's scale as well
        np.testing.assert_allclose(x, y, rtol=RTOL, atol=RTOL * 1e-2 * float(
            np.max(np.abs(y))), err_msg=jax.tree_util.keystr(path))


def test_auto_uses_the_kernel_on_one_validated_gpu_only(monkeypatch):
    """``auto``: the kernel on a single GPU where it is validated; jnp on several devices."""
    from sage_optax.sinkgd import use_kernel
    from sage_optim import kernels

    h100 = "NVIDIA H100 80GB HBM3"
    assert not use_kernel("auto", "cuda", 1, h100)  # validated nowhere yet
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "sinkgd-pallas": ("H100",)})
    assert use_kernel("auto", "gpu", 1, h100) and use_kernel("auto", "cuda", 1, h100)
    assert not use_kernel("auto", "cuda", 8, h100)
    assert not use_kernel("auto", "cpu", 1, h100)
    assert not use_kernel("auto", "tpu", 1, h100)
    assert use_kernel("pallas", "gpu", 8) and use_kernel("pallas", "cpu", 1)
    assert not use_kernel("jnp", "gpu", 1, h100)


def test_auto_is_jnp_on_cpu_arrays(monkeypatch):
    """On CPU arrays ``auto`` runs the jnp path, on any host (placement, not the backend),
    where the native CPU kernel is off (``test_optax_sinkgd_native.py`` tests it on).

    Without a CUDA device in the process the program is the very one of ``impl="jnp"``
    (the kernel's branch is not even traced); on a GPU host it is traced but not lowered
    for the CPU (``tests/optax/test_optax_placement.py``), and the result is the jnp path's,
    exactly.
    """
    from sage_optax import placement

    monkeypatch.setattr(sinkhorn, "CPU_NATIVE", False)
    cpu = jax.devices("cpu")[0]
    grads = jax.device_put(_tree(), cpu)
    axes = {"a": FLAX, "b": FLAX, "t": TORCH, "odd": Route("dense", 0, 2), "skip": None}
    texts, outs = {}, {}
    for kernel in ("auto", "jnp", "pallas"):
        tx = sage_optax.scale_by_sinkhorn(axes=axes, impl=kernel)
        texts[kernel] = jax.jit(tx.update).trace(grads, optax.EmptyState()).lower(
            lowering_platforms=("cpu",)).as_text()
        outs[kernel], _ = jax.jit(tx.update)(grads, optax.EmptyState())
    assert "__gpu$xla.gpu.triton" not in texts["auto"]
    if placement.cuda_device_count() == 0:
        assert texts["auto"] == texts["jnp"]
    assert texts["pallas"] != texts["jnp"]
    for path in grads:
        np.testing.assert_array_equal(outs["auto"][path], outs["jnp"][path], err_msg=path)


def test_impl_is_validated():
    with pytest.raises(ValueError, match="impl must be one of"):
        sage_optax.scale_by_sinkhorn(impl="triton")
    with pytest.raises(ValueError, match="impl"):
        sage_optax.sinkgd(1e-2, impl="cuda")
    with pytest.raises(ValueError, match="impl"):
        sage_optax.make_optimizer("sage-hybrid", impl="fast")


@pytest.mark.parametrize(("shape", "leaf_axes", "dtype"), [
    ((37, 50), FLAX, jnp.float32), ((3, 130, 7), TORCH, jnp.bfloat16), ((1, 7), FLAX, jnp.float16),
])
def test_kernel_lowers_to_triton_for_cuda(shape, leaf_axes, dtype):
    """Without a GPU: the compiled (not interpreted) kernel lowers to Triton IR for CUDA.

    Pallas's Triton lowering runs here (it refuses non-power-of-two blocks and unsupported
    operations); compiling the Triton IR to a GPU binary needs the GPU test below.
    """
    axes = leaf_axes.resolve(shape, "g")
    run = jax.jit(lambda g: sinkgd_pallas.pallas_scales([g], axes, 5, 1e-8, "sqrt"))
    with helpers.cuda_lowering_target():  # traced and lowered for that GPU
        text = run.trace(jax.ShapeDtypeStruct(shape, dtype)).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("__gpu$xla.gpu.triton") == 2  # one kernel per half-iteration


@pytest.mark.skipif(jax.default_backend() != "gpu",
                    reason="needs JAX on a GPU (scripts/gpu-check runs it there)")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_compiled_kernel_on_the_gpu(dtype):
    """The Triton-compiled kernel (not interpreted) against the jnp path, on the GPU."""
    rng = np.random.default_rng(11)
    grads = {
        "w": jnp.asarray(rng.standard_normal((6, 300, 1000)), dtype),  # stacked, Flax
        "t": jnp.asarray(rng.standard_normal((257, 129)), dtype),  # torch, odd edges
        "z": jnp.zeros((64, 48), dtype).at[:, 0].set(1e30 if dtype == jnp.float32 else 1.0),
    }
    axes = {"w": FLAX, "t": TORCH, "z": FLAX}
    out = {}
    for kernel in ("jnp", "pallas"):  # pallas: compiled on a GPU
        tx = sage_optax.scale_by_sinkhorn(axes=axes, impl=kernel, grouping="stack")
        text = jax.jit(tx.update).lower(grads, optax.EmptyState()).as_text()
        assert ("__gpu$xla.gpu.triton" in text) == (kernel == "pallas")  # the Pallas call
        out[kernel], _ = jax.jit(tx.update)(grads, optax.EmptyState())
    for path in grads:
        a = np.asarray(out["pallas"][path], np.float32)
        b = np.asarray(out["jnp"][path], np.float32)
        # bfloat16 outputs: one rounding of X to 8 bits may differ (2^-8 relative)
        rtol = 1e-5 if dtype == jnp.float32 else 2.0**-7
        np.testing.assert_allclose(a, b, rtol=rtol, atol=0, err_msg=path)
