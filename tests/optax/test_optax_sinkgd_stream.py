"""SinkGD's scales without ``K`` (``impl="stream"``, ``streamed_sinkhorn_scales``).

Every half-iteration reads ``G/m`` and squares it inside the reduction that weights it,
so no ``G²`` is written; the iterations are unrolled.  Checked against the float64 direct
Sinkhorn (``tests/reference_np.py``) on the layouts the router gives (Flax kernels,
stacked layers, grouped axes, torch ``(out, in)``), magnitudes far outside float32's
squares, zero rows, columns and matrices, and bfloat16 gradients; against the ``K``
path within float32 rounding; and for what it saves: no matrix temporary, no loop.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_np import sinkhorn_ref_stack

import sage_optax
from sage_optax import Route
from sage_optim import kernels

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

CPU = jax.devices("cpu")[0]


def _update(grads, impl, normalization="unit", grouping="leaf", axes=None):
    grads = jax.device_put(grads, CPU)
    kw = {} if axes is None else {"axes": axes}
    tx = sage_optax.scale_by_sinkhorn(normalization=normalization, impl=impl,
                                      grouping=grouping, **kw)
    return jax.jit(tx.update)(grads, tx.init(grads))[0]


def _oracle(g, fan_in, fan_out, normalization):
    return sinkhorn_ref_stack(g, fan_in, fan_out, normalization)


def _grads(dtype=jnp.float32):
    rng = np.random.default_rng(4)
    g = {
        "a": rng.standard_normal((40, 24)),
        "b": rng.standard_normal((40, 24)),  # same shape: stacked with "a" by "stack"
        "layers": rng.standard_normal((3, 17, 9)),  # scanned layers: 3 matrices
        "wide": rng.standard_normal((6, 300)),
    }
    g["a"] *= 1e25  # squares that overflow float32 (the range scale m keeps them in range)
    g["a"][:, 3] = 0.0  # a zero column
    g["b"][7] = 0.0  # a zero row
    g["b"] *= 1e-25  # a matrix whose squares underflow float32
    g["layers"][1] = 0.0  # a zero matrix of a stack: stays zero
    return {k: jnp.asarray(v, dtype) for k, v in g.items()}


@pytest.mark.parametrize("grouping", ["leaf", "stack"])
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_stream_equals_the_float64_oracle(normalization, grouping):
    grads = _grads()
    got = _update(grads, "stream", normalization, grouping)
    for k, g in grads.items():
        want = _oracle(g, 0, 1, normalization)  # a Flax kernel (in, out)
        scale = np.abs(want).max()
        err = np.abs(np.asarray(got[k], np.float64) - want).max()
        assert err <= 2e-6 * scale, (k, err / scale)
    assert not np.asarray(got["layers"][1]).any()


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_stream_in_torch_layout_and_grouped_axes(normalization):
    """``(out, in)`` by a Route, and a conv kernel ``(kh, kw, in, out)`` (grouped fan-in)."""
    rng = np.random.default_rng(5)
    torch_like = jnp.asarray(rng.standard_normal((20, 30)), jnp.float32)
    conv = jnp.asarray(rng.standard_normal((3, 3, 4, 8)), jnp.float32)
    got = _update({"t": torch_like}, "stream", normalization, axes=Route("dense", -1, -2))
    want = _oracle(torch_like, 1, 0, normalization)
    assert np.abs(np.asarray(got["t"]) - want).max() <= 2e-6 * np.abs(want).max()
    got = _update({"c": conv}, "stream", normalization,
                  axes=Route("dense", (0, 1, 2), 3))
    want = _oracle(np.asarray(conv).reshape(36, 8), 0, 1, normalization).reshape(conv.shape)
    assert np.abs(np.asarray(got["c"]) - want).max() <= 2e-6 * np.abs(want).max()


def test_stream_bfloat16_gradients():
    """bfloat16 in, float32 arithmetic, ``X`` rounded to bfloat16 (two units of it)."""
    grads = {k: v for k, v in _grads(jnp.bfloat16).items() if k != "b"}
    got = _update(grads, "stream")
    for k, g in grads.items():
        want = _oracle(np.asarray(g, np.float64), 0, 1, "unit")
        assert got[k].dtype == jnp.bfloat16
        err = np.abs(np.asarray(got[k], np.float64) - want).max()
        assert err <= 2 * 2.0**-8 * np.abs(want).max(), k


@pytest.mark.parametrize("grouping", ["leaf", "stack"])
def test_stream_agrees_with_the_k_path(grouping):
    """The same math as the ``K`` path (``impl="jnp"``): within float32 rounding."""
    grads = {k: v for k, v in _grads().items() if k in ("layers", "wide")}
    for normalization in ("unit", "sqrt"):
        a = _update(grads, "stream", normalization, grouping)
        b = _update(grads, "jnp", normalization, grouping)
        for k in grads:
            scale = float(jnp.max(jnp.abs(b[k])))
            assert float(jnp.max(jnp.abs(a[k] - b[k]))) <= 1e-6 * scale, k


def test_stream_writes_no_matrix_and_runs_no_loop():
    """Compiled for one 512 x 512 leaf, the streamed computation's temporaries are vectors
    (``G/m`` and its squares are formed inside the reductions, never written: well under
    the matrix's 1 MiB), and its jaxpr has no ``while`` (the iterations unrolled: a GPU
    reads a loop's predicate on the host)."""
    g = {"w": jnp.ones((512, 512), jnp.float32)}
    tx = sage_optax.scale_by_sinkhorn(impl="stream", grouping="leaf")
    compiled = jax.jit(tx.update).lower(g, tx.init(g)).compile()
    assert compiled.memory_analysis().temp_size_in_bytes < 512 * 512 * 4 / 4
    tx = sage_optax.scale_by_sinkhorn(impl="stream")
    jaxpr = str(jax.make_jaxpr(tx.update)(g, tx.init(g)))
    assert "while" not in jaxpr and jaxpr.count("reduce_sum") >= 10  # 2L reductions


def test_stream_is_auto_only_on_the_gpus_it_was_measured_on(monkeypatch):
    """``auto`` takes it on one CUDA device of a validated kind; never on the CPU, on
    several devices, on another GPU, or with ``SAGE_KERNELS=off``; ``stream`` anywhere."""
    assert kernels.VALIDATED_ON["sinkgd-stream"] == ("H200",)
    assert sinkhorn.use_stream("auto", "cuda", 1, "NVIDIA H200")
    assert sinkhorn.resolved_impl("auto", "cuda", 1, "NVIDIA H200") == "stream"
    assert not sinkhorn.use_stream("auto", "cuda", 1, "NVIDIA H100 80GB HBM3")
    assert not sinkhorn.use_stream("auto", "cuda", 2, "NVIDIA H200")
    assert not sinkhorn.use_stream("auto", "cpu", 1)
    assert sinkhorn.use_stream("stream", "cpu", 1)
    assert not sinkhorn.use_stream("jnp", "cuda", 1, "NVIDIA H200")
    assert sinkhorn.resolved_impl("pallas", "cuda", 1, "NVIDIA H200") == "pallas"
    monkeypatch.setenv("SAGE_KERNELS", "off")
    assert not sinkhorn.use_stream("auto", "cuda", 1, "NVIDIA H200")
