"""SinkGD's scales by the native CPU kernel (``impl="native"``, ``sage_optax.sinkgd_native``).

The kernel (C++, compiled on first use, one XLA FFI call per leaf) never forms ``K = G²``:
each pass over ``G`` does a whole Sinkhorn iteration.  Checked against the float64 direct
Sinkhorn (``tests/reference_np.py``) on Flax kernels, torch weights, stacked layers, merged
head axes, odd sizes (an unpaired row, a last short chunk), bfloat16 gradients, and
magnitudes whose squares leave float32 (the range scale); for what the design promises:
the folded products equal the range-scaled ones bit for bit, the result does not depend
on the number of threads, a NaN stays in its matrix, nothing matrix-sized is a compiled
temporary; and for how a user meets it: ``auto`` takes it on the CPU only where it
builds, ``impl="native"`` refuses in one line where it cannot, ``SAGE_KERNELS=off`` and
vmap/scan.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_np import sinkhorn_ref_stack

import sage_optax
from sage_optax import Route, sinkgd_native
from sage_optim.kernels import kernels_enabled

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

CPU = jax.devices("cpu")[0]
FLAX = Route("dense", -2, -1)  # (in, out), leading axes stacked
TORCH = Route("dense", -1, -2)  # (out, in)

needs_kernel = pytest.mark.skipif(
    not sinkgd_native.status().ready,
    reason=f"the native kernel did not build here: {sinkgd_native.status().detail}")


def _update(grads, impl="native", normalization="unit", axes=FLAX, eps=1e-8):
    grads = jax.device_put(grads, CPU)
    tx = sage_optax.scale_by_sinkhorn(normalization=normalization, impl=impl, axes=axes,
                                      eps=eps)
    return jax.jit(tx.update)(grads, tx.init(grads))[0]


def _assert_oracle(got, g, fan_in, fan_out, normalization, rel=2e-6):
    want = sinkhorn_ref_stack(np.asarray(g, np.float64), fan_in, fan_out, normalization)
    err = np.abs(np.asarray(got, np.float64) - want).max()
    assert err <= rel * np.abs(want).max(), err / np.abs(want).max()


def _grads(dtype=jnp.float32):
    rng = np.random.default_rng(51)
    g = {
        "a": rng.standard_normal((40, 24)),
        "b": rng.standard_normal((40, 24)),
        "layers": rng.standard_normal((3, 17, 9)),  # scanned layers; 17 rows: one unpaired
        "wide": rng.standard_normal((6, 300)),
        "tall": rng.standard_normal((2113, 5)),  # 64 chunks of 34 rows, the last short
        "row": rng.standard_normal((1, 7)),
    }
    g["a"] *= 1e25  # squares that overflow float32 (the range scale keeps them in range)
    g["a"][:, 3] = 0.0  # a zero column
    g["b"][7] = 0.0  # a zero row
    g["b"] *= 1e-25  # squares that underflow float32
    g["layers"][1] = 0.0  # a zero matrix of a stack: stays zero
    return {k: jnp.asarray(v, dtype) for k, v in g.items()}


@needs_kernel
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize(("axes", "fan_in", "fan_out"), [(FLAX, 0, 1), (TORCH, 1, 0)])
def test_native_equals_the_float64_oracle(normalization, axes, fan_in, fan_out):
    grads = _grads()
    got = _update(grads, "native", normalization, axes)
    for k, g in grads.items():
        _assert_oracle(got[k], g, fan_in, fan_out, normalization)
    assert not np.asarray(got["layers"][1]).any()
    assert np.all(np.asarray(got["a"])[:, 3] == 0) and np.all(np.asarray(got["b"])[7] == 0)


@needs_kernel
def test_native_agrees_with_the_jnp_path():
    """Another summation order than XLA's: float32 rounding apart, not bit for bit."""
    grads = _grads()
    got, ref = _update(grads, "native"), _update(grads, "jnp")
    for k in grads:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(ref[k]), rtol=2e-5,
                                   atol=1e-6 * float(np.abs(np.asarray(ref[k])).max()),
                                   err_msg=k)


@needs_kernel
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_merged_head_axes_and_bfloat16(normalization):
    """An attention projection ``(d, heads, head_dim)`` is one ``d x (heads·head_dim)``
    matrix; bfloat16 gradients are read as they are and computed in float32."""
    rng = np.random.default_rng(52)
    g = rng.standard_normal((16, 4, 8)).astype(np.float32)
    route = Route("dense", (0,), (1, 2))
    got = _update({"q": jnp.asarray(g)}, axes=route, normalization=normalization)["q"]
    _assert_oracle(np.asarray(got).reshape(16, 32), g.reshape(16, 32), 0, 1, normalization)
    bf = jnp.asarray(g, jnp.bfloat16)
    got = _update({"q": bf}, axes=route, normalization=normalization)["q"]
    assert got.dtype == jnp.bfloat16
    want = np.asarray(bf.astype(jnp.float32)).reshape(16, 32)
    _assert_oracle(np.asarray(got.astype(jnp.float32)).reshape(16, 32), want, 0, 1,
                   normalization, rel=1e-2)  # the output is rounded to bfloat16


@needs_kernel
@pytest.mark.parametrize("axes", [FLAX, TORCH])
def test_folded_products_are_the_range_scaled_ones_bit_for_bit(axes):
    """Where every square is a normal number the kernel squares ``G`` and scales the
    weights by ``1/m²`` instead of squaring ``G/m``; scaled by ``2^80`` the same matrix's
    entries square beyond float32, so the kernel squares ``G/m``.  With ``ε = 0`` (the only
    term not scaled with ``G``) ``X`` is invariant under a power-of-two scale, so the two
    must agree exactly (with ``ε = 1e-8`` they differ by ~1e-7: the witness that ``ε``
    is where it belongs)."""
    rng = np.random.default_rng(53)
    g = (rng.standard_normal((33, 20)) * 0.01).astype(np.float32)
    small = _update({"w": jnp.asarray(g)}, axes=axes, eps=0.0)["w"]
    large = _update({"w": jnp.asarray(g * np.float32(2.0**80))}, axes=axes, eps=0.0)["w"]
    np.testing.assert_array_equal(np.asarray(small), np.asarray(large))


@needs_kernel
def test_a_nan_stays_in_its_matrix():
    rng = np.random.default_rng(54)
    bad = rng.standard_normal((12, 8)).astype(np.float32)
    bad[2, 3] = np.nan
    good = rng.standard_normal((12, 8)).astype(np.float32)
    stack = np.stack([bad, good])
    got = _update({"a": jnp.asarray(bad), "b": jnp.asarray(good), "s": jnp.asarray(stack)})
    assert np.isnan(np.asarray(got["a"])).any()
    _assert_oracle(got["b"], good, 0, 1, "unit")
    assert np.isnan(np.asarray(got["s"][0])).any()
    _assert_oracle(got["s"][1], good, 0, 1, "unit")


_THREADS_SCRIPT = """
import os, sys, numpy as np, jax, jax.numpy as jnp
import sage_optax
g = np.random.default_rng(55).standard_normal((2113, 67)).astype(np.float32)
tx = sage_optax.scale_by_sinkhorn(impl="native")
x = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": g}))[0]["w"]
np.save(sys.argv[1], np.asarray(x))
"""


@needs_kernel
def test_the_result_does_not_depend_on_the_number_of_threads(tmp_path):
    """The chunks' column sums are added in chunk order: one thread (XLA's pool turned
    off) and the default give the same bits."""
    outs = []
    for i, flags in enumerate(["", "--xla_cpu_multi_thread_eigen=false"]):
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        path = tmp_path / f"x{i}.npy"
        subprocess.run([sys.executable, "-c", _THREADS_SCRIPT, str(path)], env=env,
                       check=True, timeout=300)
        outs.append(np.load(path))
    np.testing.assert_array_equal(outs[0], outs[1])


@needs_kernel
def test_no_matrix_sized_temporary():
    """The kernel forms no ``K``: the compiled update of 16 leaves of 1 MiB holds less than
    a quarter of one leaf as temporaries (the jnp path: a leaf's ``K`` and more)."""
    tree = {f"l{i}": jax.ShapeDtypeStruct((512, 512), jnp.float32) for i in range(16)}
    leaf = 512 * 512 * 4

    def temp(impl):
        tx = sage_optax.scale_by_sinkhorn(impl=impl)
        compiled = jax.jit(tx.update, donate_argnums=0).lower(tree, optax.EmptyState())
        return compiled.compile().memory_analysis().temp_size_in_bytes

    assert temp("native") < leaf / 4 < leaf <= temp("jnp")


@needs_kernel
def test_under_vmap_and_scan():
    gs = jax.device_put(np.stack([_grads()["wide"], _grads()["wide"][::-1] * 3]), CPU)
    tx = sage_optax.scale_by_sinkhorn(impl="native")

    def x_of(g):
        return tx.update({"w": g}, tx.init({"w": g}))[0]["w"]

    batched = jax.jit(jax.vmap(x_of))(gs)
    _, scanned = jax.jit(lambda gs: jax.lax.scan(lambda n, g: (n, x_of(g)), 0, gs))(gs)
    for i, g in enumerate(gs):
        _assert_oracle(batched[i], g, 0, 1, "unit")
        np.testing.assert_array_equal(np.asarray(scanned[i]), np.asarray(batched[i]))


def _lowered(impl, grads):
    tx = sage_optax.scale_by_sinkhorn(impl=impl)
    return jax.jit(tx.update).lower(grads, optax.EmptyState()).as_text()


def _one_cpu_device(monkeypatch):
    """This process as one with a single CPU device (the tests run with eight)."""
    count = jax.device_count
    monkeypatch.setattr(jax, "device_count",
                        lambda backend=None: 1 if backend == "cpu" else count(backend))


def _calls(impl, shapes):
    """How many leaves of ``shapes`` the update lowered from them computes by the kernel."""
    tree = {f"l{i}": jax.ShapeDtypeStruct(s, jnp.float32) for i, s in enumerate(shapes)}
    return _lowered(impl, tree).count(f'@{sinkgd_native.TARGET}(')


@needs_kernel
def test_auto_takes_the_kernel_for_large_leaves_on_one_cpu_device(monkeypatch):
    """From :data:`CPU_NATIVE_BYTES` of float32 on (16 MiB: a leaf whose ``K`` would not stay
    in this project's CPU's cache), in a process of one CPU device; ``"native"`` for all."""
    at, below = (1024, 4096), (1024, 4095)  # 16 MiB and just under
    assert 4 * 1024 * 4096 == sinkhorn.CPU_NATIVE_BYTES
    if jax.device_count("cpu") > 1:  # several devices: auto keeps XLA's path
        assert _calls("auto", [at]) == 0
    _one_cpu_device(monkeypatch)
    assert _calls("auto", [at, below, (8, 4)]) == 1
    assert _calls("auto", [(2, 1024, 2048)]) == 1  # a stack: its K is the whole leaf's
    assert _calls("native", [at, below, (8, 4)]) == 3
    assert _calls("jnp", [at]) == 0
    assert sinkhorn.resolved_impl("auto", "cpu", 1) == "jnp+native"


@needs_kernel
def test_sage_kernels_off_turns_the_kernel_off(monkeypatch):
    grads = jax.device_put({"w": jnp.ones((8, 4))}, CPU)
    assert sinkgd_native.TARGET in _lowered("native", grads)
    monkeypatch.setenv("SAGE_KERNELS", "off")
    assert not kernels_enabled()
    assert sinkgd_native.TARGET not in _lowered("auto", grads)
    with pytest.warns(RuntimeWarning, match='impl="native" is ignored'):
        assert sinkgd_native.TARGET not in _lowered("native", grads)


def test_without_a_compiler_auto_keeps_xla_and_native_refuses(monkeypatch):
    """Where the kernel cannot be built, ``auto`` is XLA's path (the same program as
    ``impl="jnp"``) and an explicit ``impl="native"`` says why, in one line."""
    reason = "no C++ compiler found ($CXX, c++, g++ or clang++)"
    monkeypatch.setattr(sinkgd_native, "status", lambda: sinkgd_native.Status(False, reason))
    _one_cpu_device(monkeypatch)
    monkeypatch.setattr(sinkhorn, "CPU_NATIVE_BYTES", 0)  # every leaf would take it
    grads = jax.device_put({"w": jnp.asarray(_grads()["wide"])}, CPU)
    assert _lowered("auto", grads) == _lowered("jnp", grads)
    assert sinkhorn.resolved_impl("auto", "cpu", 1) == "jnp"
    with pytest.raises(RuntimeError) as err:
        _lowered("native", grads)
    assert str(err.value).splitlines()[0] == (
        f"SinkGD's native CPU kernel is not available: {reason}")


def test_a_failed_build_is_reported_not_raised(monkeypatch, tmp_path):
    """A compiler that fails: ``status`` carries its first error line (nothing cached)."""
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake 1.0 && exit 0\n"
                    "echo 'sinkhorn_cpu.cc:1:1: error: broken' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("SAGE_OPTIM_CACHE", str(tmp_path / "cache"))
    status = sinkgd_native._load.__wrapped__()
    assert not status.ready
    assert status.detail == "RuntimeError: " + f"{fake} failed on sinkhorn_cpu.cc: " \
        "sinkhorn_cpu.cc:1:1: error: broken"
    assert not list((tmp_path / "cache").rglob("*.so"))


@needs_kernel
def test_an_explicitly_sharded_leaf_takes_xla(monkeypatch):
    """A leaf sharded over an explicit-axes mesh: the kernel would need it whole on each
    device, so XLA's path (which partitions) computes it."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs several CPU devices")
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Explicit,), devices=devices[:2])
    with jax.set_mesh(mesh):
        g = jax.device_put(jnp.asarray(_grads()["a"] * 1e-25),
                           NamedSharding(mesh, PartitionSpec("x")))
        assert not sinkgd_native.supports(g, FLAX.resolve(g.shape, "w"))
        tx = sage_optax.scale_by_sinkhorn(impl="native")
        got = jax.jit(tx.update)({"w": g}, tx.init({"w": g}))[0]["w"]
    _assert_oracle(got, np.asarray(g), 0, 1, "unit")


@needs_kernel
def test_a_leaf_sharded_by_gspmd_is_gathered_for_the_kernel():
    """On a mesh with automatic axes (GSPMD) the kernel's call sees the whole leaf (XLA
    gathers it): the update is still the leaf's, and keeps the leaf's sharding."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    devices = jax.devices("cpu")
    if len(devices) < 2:
        pytest.skip("needs several CPU devices")
    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=devices[:2])
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    g = _grads()["wide"]
    tx = sage_optax.scale_by_sinkhorn(impl="native")
    lowered = jax.jit(tx.update).lower({"w": jax.device_put(g, sharding)}, None)
    assert sinkgd_native.TARGET in lowered.as_text()
    got = lowered.compile()({"w": jax.device_put(g, sharding)}, None)[0]["w"]
    assert got.sharding.is_equivalent_to(sharding, 2)
    _assert_oracle(got, g, 0, 1, "unit")


@needs_kernel
def test_programs_running_at_once_share_the_helpers_safely():
    """Two Python threads run native updates at the same time: one job has the helper
    threads, the other runs its chunks alone; every result is the same bits as alone."""
    import threading

    rng = np.random.default_rng(56)
    grads = [{"w": jnp.asarray(rng.standard_normal((300, 70)).astype(np.float32))}
             for _ in range(2)]
    tx = sage_optax.scale_by_sinkhorn(impl="native")
    update = jax.jit(tx.update)
    alone = [np.asarray(update(g, optax.EmptyState())[0]["w"]) for g in grads]
    bad = []

    def run(i):
        for _ in range(25):
            got = np.asarray(update(grads[i], optax.EmptyState())[0]["w"])
            if not np.array_equal(got, alone[i]):
                bad.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads) and not bad
