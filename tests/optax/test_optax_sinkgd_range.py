"""SinkGD on the CPU without the pass that finds ``max|G|`` (``checked_sinkhorn_scales``).

The CPU path iterates on ``K = G²`` itself and checks every sum against ``RANGE_CHECK``;
where a check fails it runs the range-scaled computation (``sinkhorn_scales``).  So its
``X`` must equal the range-scaled one bit for bit on ordinary gradients, and, where a
square leaves float32's range, still equal it (the fallback ran) and the float64
reference; the witnesses show that the unchecked plain computation is wrong there.
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_np import sinkhorn_ref

import sage_optax
from sage_optax import Route, placement

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

FLAX = Route("dense", -2, -1)  # (in, out), leading axes stacked
CPU = jax.devices("cpu")[0]


@pytest.fixture(autouse=True)
def _jnp_path(monkeypatch):
    """These tests are of XLA's CPU path: ``auto``'s where the native kernel is not built
    (``tests/optax/test_optax_sinkgd_native.py`` tests the kernel)."""
    monkeypatch.setattr(sinkhorn, "CPU_NATIVE", False)


def _matrix(shape=(12, 7), seed=0):
    """Columns spread over e^±3 in size, one exactly-zero row (kept zero by SinkGD)."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[-1]))
    g[..., 2, :] = 0.0
    return g.astype(np.float32)


def _transform_x(grads, normalization="unit", grouping="leaf", axes=FLAX):
    """``X`` of every leaf from ``scale_by_sinkhorn`` on the CPU (the checked path)."""
    grads = jax.device_put(grads, CPU)
    tx = sage_optax.scale_by_sinkhorn(normalization=normalization, axes=axes,
                                      grouping=grouping)
    updates, _ = jax.jit(tx.update)(grads, tx.init(grads))
    return {k: np.asarray(v) for k, v in updates.items()}


def _scaled_x(g, normalization="unit", route=FLAX):
    """The range-scaled computation (``sinkhorn_normalize``, which always finds ``m``)."""
    g = jax.device_put(jnp.asarray(g), CPU)
    return np.asarray(jax.jit(lambda g: sinkhorn.sinkhorn_normalize(
        g, route.resolve(g.shape, "w"), 5, 1e-8, normalization))(g))


def _plain_x(g, normalization="unit"):
    """The witness: the plain computation on ``K = G²`` with no check and no fallback."""
    g = jax.device_put(jnp.asarray(g), CPU)
    axes = FLAX.resolve(g.shape, "w")
    c, r, _ = sinkhorn._iterate(jnp.square(g), None, axes, 5, 1e-8, normalization)
    return np.asarray(sinkhorn.apply_scales(g, axes, c, r))


def _in_range(g, normalization="unit"):
    g = jax.device_put(jnp.asarray(g), CPU)
    axes = FLAX.resolve(g.shape, "w")
    k = sinkhorn._squares([g], None, floor=True)
    return bool(sinkhorn._iterate(k, None, axes, 5, 1e-8, normalization, check=True)[2])


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("scale", [1e-12, 1.0, 1e12])
def test_ordinary_gradients_give_the_range_scaled_x_bit_for_bit(normalization, scale):
    g = _matrix() * np.float32(scale)
    assert _in_range(g, normalization)
    x = _transform_x({"w": g}, normalization)["w"]
    np.testing.assert_array_equal(x, _scaled_x(g, normalization))


@pytest.mark.parametrize("grouping", ["leaf", "stack"])
def test_stacked_leaves_and_stacked_groups(grouping):
    """A leaf with a layer axis, and three same-shape leaves (one batch with ``stack``)."""
    grads = {"layers": _matrix((3, 12, 7), seed=1),
             **{f"w{i}": _matrix(seed=2 + i) * np.float32(10.0 ** (4 * i)) for i in range(3)}}
    xs = _transform_x(grads, grouping=grouping)
    for name, g in grads.items():
        np.testing.assert_array_equal(xs[name], _scaled_x(g), err_msg=name)


def test_axis_groups_and_bfloat16():
    """A conv kernel (h, w, in, out) with fan-in (h, w, in), and a bfloat16 gradient."""
    conv = Route("dense", (0, 1, 2), 3)
    g = _matrix((3, 3, 4, 6), seed=5)
    x = _transform_x({"w": g}, axes=conv)["w"]
    np.testing.assert_array_equal(x, _scaled_x(g, route=conv))
    gb = jnp.asarray(_matrix(seed=6), jnp.bfloat16)
    xb = _transform_x({"w": gb})["w"]
    assert xb.dtype == jnp.bfloat16
    np.testing.assert_array_equal(xb, _scaled_x(gb))


def _tiny_row(g):
    g = g * np.float32(1e-6)  # |G| ~ 1e-6, so m ~ 2^-17: the range scale lifts the squares
    g[5] *= np.float32(1e-15)  # ~1e-21: squares below 2^-126 in K = G², not in (G/m)²
    return g


def _tiny_column(g):
    g = g * np.float32(1e-6)
    g[:, 3] *= np.float32(1e-15)
    return g


OUT_OF_RANGE = {  # each: the plain computation's X is wrong, so the fallback must run
    "overflow": lambda g: g * np.float32(1e20),
    "underflow": lambda g: g * np.float32(1e-25),
    "tiny row": _tiny_row,
    "tiny column": _tiny_column,
}


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("case", list(OUT_OF_RANGE))
def test_out_of_range_gradients_take_the_range_scaled_path(case, normalization):
    g = OUT_OF_RANGE[case](_matrix(seed=7))
    assert np.all(np.isfinite(g))
    want = sinkhorn_ref(g.astype(np.float64), normalization=normalization)
    assert not _in_range(g, normalization)
    with np.errstate(all="ignore"):  # the witness: the unchecked result is wrong here
        assert not np.allclose(_plain_x(g, normalization), want, rtol=1e-3, atol=1e-6)
    x = _transform_x({"w": g}, normalization)["w"]
    np.testing.assert_array_equal(x, _scaled_x(g, normalization))
    np.testing.assert_allclose(x, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("case", ["zero rows and columns", "zero matrix"])
def test_exactly_zero_slices_stay_on_the_checked_path(case):
    """Zero rows and columns (an embedding's unseen tokens, an expert without tokens) are
    told from underflowed ones (``K`` floors a non-zero square at the smallest normal
    number), keep their scales and give the range-scaled X without the fallback."""
    g = _matrix(seed=8)
    if case == "zero matrix":
        g[:] = 0.0
    else:
        g[:, 4] = 0.0
        g[7] = 0.0
    assert _in_range(g)
    x = _transform_x({"w": g})["w"]
    np.testing.assert_array_equal(x, _scaled_x(g))
    assert np.all(x[g == 0] == 0)


def test_a_row_of_tiny_values_is_not_taken_for_a_zero_row():
    """Squares below 2^-126 flush to 0: unfloored, this row would sum to exactly 0 like a
    zero row and keep its scale (a silently wrong X); floored, it fails the check."""
    g = _matrix(seed=14) * np.float32(1e-6)
    g[3] = np.float32(1e-21) * np.sign(g[3] + 0.5)
    k_plain = jnp.square(jax.device_put(jnp.asarray(g), CPU))
    assert np.all(np.asarray(k_plain)[3] == 0)
    assert not _in_range(g)
    x = _transform_x({"w": g})["w"]
    np.testing.assert_array_equal(x, _scaled_x(g))
    want = sinkhorn_ref(g.astype(np.float64))
    np.testing.assert_allclose(x, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_gradients_take_the_range_scaled_path(value):
    g = _matrix(seed=8)
    g[1, 1] = value
    assert not _in_range(g)
    x = _transform_x({"w": g})["w"]
    np.testing.assert_array_equal(x, _scaled_x(g))  # NaN where the range-scaled X has NaN


def test_a_mixed_stack_falls_back_as_a_whole():
    """In a stacked group one out-of-range matrix sends the whole batch to the range-scaled
    path; every member still gets exactly its own X."""
    grads = {"a": _matrix(seed=9), "b": _matrix(seed=10) * np.float32(1e20),
             "c": _matrix(seed=11)}
    xs = _transform_x(grads, grouping="stack")
    for name, g in grads.items():
        np.testing.assert_array_equal(xs[name], _scaled_x(g), err_msg=name)


def test_under_vmap_and_scan():
    """``vmap`` turns the fallback's ``lax.cond`` into a select of both branches (and the
    products into batched ones: compared with the range-scaled computation, vmapped too);
    a ``lax.scan`` over steps carries it: the same X either way."""
    gs = jax.device_put(np.stack([_matrix(seed=12), _matrix(seed=13) * np.float32(1e20)]),
                        CPU)
    tx = sage_optax.scale_by_sinkhorn(axes=FLAX)

    def x_of(g):
        return tx.update({"w": g}, tx.init({"w": g}))[0]["w"]

    def scaled(g):
        return sinkhorn.sinkhorn_normalize(g, FLAX.resolve(g.shape, "w"), 5, 1e-8, "unit")

    np.testing.assert_array_equal(jax.jit(jax.vmap(x_of))(gs), jax.jit(jax.vmap(scaled))(gs))
    _, xs = jax.jit(lambda gs: jax.lax.scan(lambda n, g: (n, x_of(g)), 0, gs))(gs)
    for i, g in enumerate(gs):
        np.testing.assert_array_equal(np.asarray(xs[i]), _scaled_x(g))


@pytest.mark.parametrize(("grouping", "traced", "expected"), [
    ("leaf", "checked_sinkhorn_scales", [1, 1, 1]),  # the CPU branch's three leaves
    ("sequence", "sequenced_sinkhorn_scales", [3]),  # its one loop over the three
])
def test_only_the_cpu_branch_skips_the_range_pass(monkeypatch, grouping, traced, expected):
    """The fallback is a ``lax.cond``, whose predicate a GPU must send to the host before
    the step goes on, so the CUDA branch keeps the range pass: on a host that traces both
    branches (an emulated GPU host), the checked path is traced by the CPU branch only."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    assert placement.cuda_device_count() == 1
    calls = []
    checked = getattr(sinkhorn, traced)

    def counting(gs, *args, **kwargs):
        if kwargs.get("checked", True):  # the CUDA branch's sequence runs unchecked
            calls.append(len(gs))
        return checked(gs, *args, **kwargs)

    monkeypatch.setattr(sinkhorn, traced, counting)
    grads = {f"w{i}": jnp.asarray(_matrix(seed=i)) for i in range(3)}
    tx = sage_optax.scale_by_sinkhorn(axes=FLAX, grouping=grouping)
    jax.make_jaxpr(tx.update)(grads, tx.init(grads))
    assert calls == expected  # none from the CUDA branch


def test_eager_updates_compile_the_checked_path_once():
    """Called eagerly (op by op), the loop used to be compiled again at every update, and
    XLA:CPU keeps each compiled kernel mapped: a test file of eager updates ran the process
    into its 65,530-map limit (a segfault).  Fresh transformations of one shape now share
    one compiled program."""
    grads = {"w": jax.device_put(jnp.asarray(_matrix((9, 5), seed=15)), CPU)}
    before = sinkhorn._checked_static._cache_size()
    for _ in range(3):
        tx = sage_optax.scale_by_sinkhorn(axes=FLAX)
        tx.update(grads, tx.init(grads))
    assert sinkhorn._checked_static._cache_size() - before <= 1
