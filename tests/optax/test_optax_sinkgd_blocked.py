"""SinkGD's scales by blocks of rows (``impl="blocked"``, ``blocked_sinkhorn_scales``).

Neither ``K = G²`` nor ``X`` is formed: each sweep reads ``G`` in blocks of rows, squares a
block (the only matrix-shaped temporary, at most ``BLOCK_ELEMENTS``), does the row
half-iteration from it and accumulates the column sums.  Checked against the float64
direct Sinkhorn (``tests/reference_np.py``) on Flax kernels, stacked layers, grouped axes
and the torch ``(out, in)`` layout, with magnitudes whose squares leave float32, zero rows,
columns and matrices, bfloat16 gradients, many blocks with and without a tail block; and
for what it saves: its compiled temporaries are a block, not a matrix.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_np import sinkhorn_ref_stack

import sage_optax
from sage_optax import Route

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

CPU = jax.devices("cpu")[0]


def _update(grads, impl="blocked", normalization="unit", grouping="leaf", axes=None):
    grads = jax.device_put(grads, CPU)
    kw = {} if axes is None else {"axes": axes}
    tx = sage_optax.scale_by_sinkhorn(normalization=normalization, impl=impl,
                                      grouping=grouping, **kw)
    return jax.jit(tx.update)(grads, tx.init(grads))[0]


def _oracle(g, fan_in, fan_out, normalization):
    return sinkhorn_ref_stack(g, fan_in, fan_out, normalization)


def _grads(dtype=jnp.float32):
    rng = np.random.default_rng(41)
    g = {
        "a": rng.standard_normal((40, 24)),
        "b": rng.standard_normal((40, 24)),  # same shape: one group with "stack"
        "layers": rng.standard_normal((3, 17, 9)),  # scanned layers: 3 matrices
        "wide": rng.standard_normal((6, 300)),
        "prime": rng.standard_normal((37, 24)),  # 37 rows: a tail block
    }
    g["a"] *= 1e25  # squares that overflow float32 (the range scale keeps them in range)
    g["a"][:, 3] = 0.0  # a zero column
    g["b"][7] = 0.0  # a zero row
    g["b"] *= 1e-25  # squares that underflow float32
    g["layers"][1] = 0.0  # a zero matrix of a stack: stays zero
    return {k: jnp.asarray(v, dtype) for k, v in g.items()}


def _assert_oracle(got, g, fan_in, fan_out, normalization, rel=2e-6):
    want = _oracle(g, fan_in, fan_out, normalization)
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= rel * np.abs(want).max(), err / np.abs(want).max()


@pytest.mark.parametrize("block", [64, None])  # many blocks (and tails), or the default
@pytest.mark.parametrize("grouping", ["leaf", "stack"])
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_blocked_equals_the_float64_oracle(normalization, grouping, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(sinkhorn, "BLOCK_ELEMENTS", block)
    grads = _grads()
    got = _update(grads, "blocked", normalization, grouping)
    for k, g in grads.items():
        _assert_oracle(got[k], g, 0, 1, normalization)  # a Flax kernel (in, out)
    assert not np.asarray(got["layers"][1]).any()
    assert np.all(np.asarray(got["a"])[:, 3] == 0) and np.all(np.asarray(got["b"])[7] == 0)


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_blocked_in_torch_layout_grouped_axes_and_experts(normalization, monkeypatch):
    """``(out, in)`` by a Route (the rows are the fan-out units: ``L`` sweeps, not
    ``L + 1``), a conv kernel ``(kh, kw, in, out)`` (grouped fan-in), MoE experts
    ``(E, in, out)``, and a layout no reshape gives (a batch axis between the groups:
    the ``K`` path)."""
    monkeypatch.setattr(sinkhorn, "BLOCK_ELEMENTS", 100)
    rng = np.random.default_rng(5)
    torch_like = jnp.asarray(rng.standard_normal((20, 30)), jnp.float32)
    got = _update({"t": torch_like}, normalization=normalization, axes=Route("dense", -1, -2))
    _assert_oracle(got["t"], torch_like, 1, 0, normalization)
    conv = jnp.asarray(rng.standard_normal((3, 3, 4, 8)), jnp.float32)
    got = _update({"c": conv}, normalization=normalization, axes=Route("dense", (0, 1, 2), 3))
    want = _oracle(np.asarray(conv).reshape(36, 8), 0, 1, normalization).reshape(conv.shape)
    assert np.abs(np.asarray(got["c"]) - want).max() <= 2e-6 * np.abs(want).max()
    experts = jnp.asarray(rng.standard_normal((4, 12, 10)) * 1e20, jnp.float32)
    got = _update({"e": experts}, normalization=normalization)
    _assert_oracle(got["e"], experts, 0, 1, normalization)
    middle = jnp.asarray(rng.standard_normal((12, 3, 10)), jnp.float32)  # (in, E, out)
    route = Route("dense", 0, 2)
    assert sinkhorn.blocked_layout(middle, route.resolve(middle.shape, "m")) is None
    got = _update({"m": middle}, normalization=normalization, axes=route)
    want = np.moveaxis(_oracle(np.moveaxis(np.asarray(middle), 1, 0), 0, 1, normalization),
                       0, 1)
    assert np.abs(np.asarray(got["m"]) - want).max() <= 2e-6 * np.abs(want).max()


def test_blocked_bfloat16_gradients():
    """bfloat16 in, float32 arithmetic (the blocks widened one at a time), ``X`` rounded to
    bfloat16 (two units of it)."""
    grads = {k: v for k, v in _grads(jnp.bfloat16).items() if k != "b"}
    got = _update(grads)
    for k, g in grads.items():
        want = _oracle(np.asarray(g, np.float64), 0, 1, "unit")
        assert got[k].dtype == jnp.bfloat16
        err = np.abs(np.asarray(got[k], np.float64) - want).max()
        assert err <= 2 * 2.0**-8 * np.abs(want).max(), k


def test_blocked_agrees_with_the_k_path():
    """The same math as the ``K`` path (``impl="jnp"``): within float32 rounding."""
    grads = {k: v for k, v in _grads().items() if k in ("layers", "wide", "prime")}
    for normalization in ("unit", "sqrt"):
        a = _update(grads, "blocked", normalization)
        b = _update(grads, "jnp", normalization)
        for k in grads:
            scale = float(jnp.max(jnp.abs(b[k])))
            assert float(jnp.max(jnp.abs(a[k] - b[k]))) <= 1e-6 * scale, k


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_blocked_temporaries_are_a_block_not_a_matrix(dtype):
    """Compiled for one 1024 x 1024 leaf (4 MiB in float32), a donated SinkGD step's
    temporaries are one block of squares (2^18 float32 = 1 MiB) and vectors; the ``K``
    path's hold ``K`` (4 MiB).  bfloat16: XLA:CPU widens ``G`` to float32 before the loop
    (a copy of ``G``, not ``K``; known, not yet avoided): no more than the ``K`` path."""
    g = {"w": jax.ShapeDtypeStruct((1024, 1024), dtype)}

    def temp(impl):
        tx = sage_optax.sinkgd(1e-3, impl=impl)

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        state = jax.eval_shape(tx.init, g)
        compiled = jax.jit(step, donate_argnums=(0, 1)).lower(g, state, g).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    block = sinkhorn.BLOCK_ELEMENTS * 4
    k_path = temp("jnp")
    assert k_path >= 1024 * 1024 * 4  # K
    if dtype == jnp.float32:
        assert temp("blocked") <= 1.25 * block
    else:
        assert temp("blocked") <= k_path


def test_block_rows():
    """At most the block's elements, at least one row, a divisor of the rows where one is
    at least half the most rows (no tail block)."""
    assert sinkhorn.block_rows(1, 1024, 2816, 2**18) == 64  # 93 most; 64 divides 1024
    assert sinkhorn.block_rows(1, 37, 24, 64) == 2  # 37 is prime: a tail of 1 row
    assert sinkhorn.block_rows(1, 10, 10, 10**6) == 10  # one block
    assert sinkhorn.block_rows(4, 8, 1000, 100) == 1  # rows wider than a block: one row


def test_blocked_is_an_impl_and_not_yet_the_cpu_default():
    """``impl="blocked"`` names itself in a run's record; ``auto`` on the CPU keeps the ``K``
    path while :data:`~sage_optax.sinkgd.CPU_BLOCKED` is off (measured slower here)."""
    assert "blocked" in sinkhorn.IMPLS
    assert sinkhorn.resolved_impl("blocked", "cpu", 1) == "blocked"
    assert not sinkhorn.CPU_BLOCKED
    assert sinkhorn.resolved_impl("auto", "cpu", 1) in ("jnp+native", "jnp")


def test_a_nan_leaf_leaves_the_next_one_alone():
    """Leaves are ordered by a data dependency on the previous leaf's scales; a NaN there
    (a NaN gradient) must not reach the next leaf's numbers."""
    rng = np.random.default_rng(46)
    bad = rng.standard_normal((12, 8)).astype(np.float32)
    bad[2, 3] = np.nan
    good = rng.standard_normal((12, 8)).astype(np.float32)
    got = _update({"a": jnp.asarray(bad), "b": jnp.asarray(good)})
    assert np.isnan(np.asarray(got["a"])).any()
    _assert_oracle(got["b"], good, 0, 1, "unit")
