"""Kernel choice by placement: a GPU host with arrays on its CPU devices runs the jnp path.

A GPU host is emulated on this CPU-only machine: ``jax.default_backend()`` reports ``"gpu"``
and the process has one device (so ``impl="auto"`` wants the Pallas kernel), while every
array stays on the CPU.  Before the kernel choice followed placement, every jitted update of
a configuration with SinkGD raised ``ValueError: Only interpret mode is supported on CPU
backend`` there.  Now the CUDA branch (the compiled kernel) is traced but only the branch of
the platform the program is compiled for is lowered, so CPU arrays get the CPU's program
(equal to the plain CPU result), and the same traced program lowered for CUDA holds the
Triton kernel.
"""

from __future__ import annotations

import importlib
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_optax import Route, placement, sinkgd_native
from sage_optim import kernels
from sage_optim.presets import CONFIG_NAMES
from tests import helpers

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

TRITON_CALL = "__gpu$xla.gpu.triton"  # a Pallas call lowered for CUDA


@pytest.fixture
def gpu_host(monkeypatch):
    """``jax.default_backend()`` says ``"gpu"`` and the process has one device."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    assert placement.cuda_device_count() == 1


@pytest.fixture
def validated_h100(gpu_host, monkeypatch):
    """The emulated GPU is an H100 on which the Pallas kernel has been validated."""
    monkeypatch.setattr(placement, "cuda_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "sinkgd-pallas": ("H100",)})


def _on_cpu(tree):
    """``tree`` as float32 arrays on a CPU device (also on a real GPU host: gpu-check)."""
    return jax.device_put(jax.tree.map(lambda x: np.asarray(x, np.float32), tree),
                          jax.devices("cpu")[0])


def _params_grads():
    rng = np.random.default_rng(3)
    params = helpers.mixed_params(rng)
    return _on_cpu(params), _on_cpu(helpers.mixed_gradient(rng, params, 1))


def _two_steps(name, params, grads, *, jit=True):
    tx = sage_optax.make_optimizer(name)
    update = jax.jit(tx.update) if jit else tx.update
    state = tx.init(params)
    out = []
    for scale in (1.0, -0.5):
        g = jax.tree.map(lambda x, s=scale: x * s, grads)
        u, state = update(g, state, params)
        params = optax.apply_updates(params, u)
        out.append(u)
    return out


@pytest.mark.parametrize("validated", [False, True])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_configuration_steps_on_cpu_arrays_of_a_gpu_host(name, validated, monkeypatch):
    """All eight configurations, jitted, on CPU arrays: the plain CPU result (1e-6 relative).

    Also where ``auto`` would take the kernel on the GPU (``validated``).
    """
    params, grads = _params_grads()
    want = _two_steps(name, params, grads)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    if validated:
        monkeypatch.setattr(placement, "cuda_device_kind", lambda: "NVIDIA H100 80GB HBM3")
        monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                      "sinkgd-pallas": ("H100",)})
    got = _two_steps(name, params, grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_eager_updates_follow_the_arrays_devices(validated_h100, monkeypatch):
    """Without jit the arrays' own devices decide: no kernel is launched on CPU arrays, and
    the eager update is the jnp path's, where ``auto`` would take the kernel on a GPU."""
    from sage_optax import sinkgd_pallas

    launched = []
    real = sinkgd_pallas.pallas_scales
    monkeypatch.setattr(sinkgd_pallas, "pallas_scales",
                        lambda *a, **k: launched.append(1) or real(*a, **k))
    params, grads = _params_grads()
    got = _two_steps("sinkgd-pure", params, grads, jit=False)
    assert launched == []
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON, "sinkgd-pallas": ()})
    want = _two_steps("sinkgd-pure", params, grads, jit=False)  # the jnp path, eager
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert {d.platform for d in a.devices()} == {"cpu"}


def _lowered(kernel, platform, grouping="auto"):
    grads = {"w": jnp.ones((16, 12)), "t": jnp.ones((3, 8, 4))}
    axes = {"w": Route("dense", 0, 1), "t": Route("dense", -1, -2)}
    tx = sage_optax.scale_by_sinkhorn(axes=axes, impl=kernel, grouping=grouping)
    with helpers.cuda_lowering_target():
        traced = jax.jit(tx.update).trace(grads, optax.EmptyState())
        return traced.lower(lowering_platforms=(platform,)).as_text()


def test_one_traced_program_lowers_the_kernel_for_cuda_only(gpu_host):
    """The jitted update holds both branches; CUDA gets the Triton kernel, the CPU none."""
    assert _lowered("pallas", "cuda").count(TRITON_CALL) == 4  # 2 a half-iteration pair, 2 shapes
    assert TRITON_CALL not in _lowered("pallas", "cpu")  # interpreted there
    assert TRITON_CALL not in _lowered("jnp", "cuda")


def test_auto_takes_the_kernel_only_where_validated(gpu_host, monkeypatch):
    """``auto`` is the jnp path until scripts/gpu-check has validated the kernel on that GPU."""
    # correct on an H100 but slower there (benchmarks/gpu/2026-11-26-h100.md): nowhere yet
    assert kernels.VALIDATED_ON["sinkgd-pallas"] == ()
    assert TRITON_CALL not in _lowered("auto", "cuda")
    monkeypatch.setattr(placement, "cuda_device_kind", lambda: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "sinkgd-pallas": ("H200",)})
    assert TRITON_CALL not in _lowered("auto", "cuda")  # validated on another GPU only
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "sinkgd-pallas": ("H100",)})
    assert _lowered("auto", "cuda").count(TRITON_CALL) == 4
    assert TRITON_CALL not in _lowered("auto", "cpu")


def test_auto_keeps_the_jnp_path_on_several_gpus(validated_h100, monkeypatch):
    """Sharded over several GPUs the Pallas call would gather the gradient: jnp there."""
    monkeypatch.setattr(jax, "device_count", lambda backend=None: 8)
    assert TRITON_CALL not in _lowered("auto", "cuda")
    assert _lowered("pallas", "cuda").count(TRITON_CALL) == 4  # forced


def test_environment_switch_turns_every_kernel_off(validated_h100, monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "off")
    assert TRITON_CALL not in _lowered("auto", "cuda")
    kernels._warned.clear()
    with pytest.warns(RuntimeWarning, match='SAGE_KERNELS=off: impl="pallas" is ignored'):
        assert TRITON_CALL not in _lowered("pallas", "cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        _lowered("pallas", "cuda")
    monkeypatch.setenv(kernels.ENV_VAR, " AUTO ")
    assert _lowered("auto", "cuda").count(TRITON_CALL) == 4


def test_environment_switch_gives_the_jnp_numbers(monkeypatch):
    """``impl="pallas"`` (interpreted on the CPU) with the switch off: the jnp path, exactly."""
    rng = np.random.default_rng(5)
    g = _on_cpu({"w": rng.standard_normal((20, 12))})
    want, _ = jax.jit(sage_optax.scale_by_sinkhorn(impl="jnp").update)(g, optax.EmptyState())
    kernel, _ = jax.jit(sage_optax.scale_by_sinkhorn(impl="pallas").update)(
        g, optax.EmptyState())
    assert not np.array_equal(kernel["w"], want["w"])  # another summation order
    monkeypatch.setenv(kernels.ENV_VAR, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        got, _ = jax.jit(sage_optax.scale_by_sinkhorn(impl="pallas").update)(
            g, optax.EmptyState())
    np.testing.assert_array_equal(got["w"], want["w"])


def test_environment_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(kernels.ENV_VAR, "of")
    with pytest.raises(ValueError, match=r"environment variable SAGE_KERNELS must be one of "
                       r"\('auto', 'off'\) \(or unset\), got 'of'"):
        kernels.kernels_enabled()
    monkeypatch.setenv(kernels.ENV_VAR, "")
    assert kernels.kernels_enabled()


def test_resolved_impl(monkeypatch):
    h100 = "NVIDIA H100 80GB HBM3"
    assert sinkhorn.resolved_impl("auto", "cuda", 1, h100) == "jnp"  # not validated yet
    assert sinkhorn.resolved_impl("pallas", "cuda", 1, h100) == "pallas"
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "sinkgd-pallas": ("H100",)})
    assert sinkhorn.resolved_impl("auto", "cuda", 1, h100) == "pallas"
    assert sinkhorn.resolved_impl("auto", "cuda", 1, None) == "jnp"
    assert sinkhorn.resolved_impl("auto", "cuda", 2, h100) == "jnp"
    native = sinkhorn.CPU_NATIVE and sinkgd_native.status().ready
    assert sinkhorn.resolved_impl("auto", "cpu", 1, h100) == ("jnp+native" if native
                                                               else "jnp")
    assert sinkhorn.resolved_impl("auto", "cpu", 8) == "jnp"  # one device only
    assert sinkhorn.resolved_impl("native", "cpu", 1) == "native"
    assert sinkhorn.resolved_impl("native", "cpu", 8) == "native"
    assert sinkhorn.resolved_impl("native", "cuda", 1, h100) == "jnp"  # a CPU kernel
    monkeypatch.setattr(sinkhorn, "CPU_NATIVE", False)
    assert sinkhorn.resolved_impl("auto", "cpu", 1, h100) == "jnp"
    assert sinkhorn.resolved_impl("pallas", "cpu", 8) == "pallas"
    assert sinkhorn.resolved_impl("jnp", "cuda", 1, h100) == "jnp"
    monkeypatch.setenv(kernels.ENV_VAR, "off")
    assert sinkhorn.resolved_impl("pallas", "cuda", 1, h100) == "jnp"
    assert sinkhorn.resolved_impl("native", "cpu", 1) == "jnp"
    with pytest.raises(ValueError, match="impl must be one of"):
        sinkhorn.resolved_impl("triton", "cuda", 1)
    with pytest.raises(ValueError, match="unknown GPU path 'pallas'"):
        kernels.validated("pallas", h100)


def test_concrete_platform():
    """Where JAX runs an eager computation: committed arrays decide, else the default device
    (``jax.default_device`` too), on any host."""
    cpu = jax.devices("cpu")[0]
    x = jax.device_put(jnp.ones(3), cpu)  # committed to a CPU device
    assert x.committed
    assert placement.concrete_platform((x, np.ones(2), 1.0)) == "cpu"
    assert placement.concrete_platform(()) == placement._device_platform(jax.devices()[0])
    with jax.default_device(cpu):
        assert placement.concrete_platform(()) == "cpu"
        assert placement.concrete_platform((np.ones(2), 2.0)) == "cpu"
    with jax.default_device("cpu"):  # a platform name works as well
        assert placement.default_device() == cpu
    seen = []
    jax.jit(lambda y: seen.append(placement.concrete_platform((y,))) or y)(x)
    assert seen == [None]  # traced: decided at lowering


@pytest.mark.parametrize("emulated", [False, True], ids=["this-host", "emulated-gpu-host"])
def test_the_cuda_branch_is_traced_only_where_a_cuda_device_is(emulated, monkeypatch):
    """On a machine without CUDA the CUDA branch is not even traced; where the process has a
    CUDA device it is, and the CPU program still runs the CPU branch."""
    if emulated:
        monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
        monkeypatch.setattr(jax, "device_count", lambda backend=None: 1)
    calls = []

    def cuda(x):
        calls.append("cuda")
        return x

    x = jax.device_put(jnp.ones(2), jax.devices("cpu")[0])
    y = jax.jit(lambda x: placement.by_platform((x,), cpu=lambda y: y + 1, cuda=cuda))(x)
    assert calls == (["cuda"] if placement.cuda_device_count() > 0 else [])
    np.testing.assert_array_equal(y, [2.0, 2.0])


def test_inject_hyperparams_traces_the_gpu_branch(gpu_host):
    """``optax.inject_hyperparams(sinkgd)`` on a GPU host: its arguments become arrays, and
    the GPU branch (stacked groups), traced there, needs none of them concrete."""
    rng = np.random.default_rng(5)
    params = _on_cpu({f"l{i}": rng.standard_normal((8, 6)) for i in range(3)})
    grads = _on_cpu({f"l{i}": rng.standard_normal((8, 6)) for i in range(3)})
    injected = optax.inject_hyperparams(sage_optax.sinkgd)(learning_rate=1e-2, num_iters=3)
    got, _ = jax.jit(injected.update)(grads, injected.init(params), params)
    plain = sage_optax.sinkgd(1e-2, num_iters=3)
    want, _ = jax.jit(plain.update)(grads, plain.init(params), params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=0)


def test_group_bytes_is_a_layout_option_not_a_hyperparameter():
    """An injected (array) ``group_bytes`` is refused at init in one line with the remedy,
    which works."""
    params = {"w": jnp.zeros((8, 6))}
    with pytest.raises(TypeError, match=r"group_bytes is a memory layout option.*"
                                        r"static_args=\('group_bytes',\)"):
        optax.inject_hyperparams(sage_optax.sinkgd)(learning_rate=1e-2,
                                                    group_bytes=2**20).init(params)
    tx = optax.inject_hyperparams(sage_optax.sinkgd, static_args=("group_bytes",))(
        learning_rate=1e-2, group_bytes=2**20)
    u, _ = jax.jit(tx.update)({"w": jnp.ones((8, 6))}, tx.init(params), params)
    assert u["w"].shape == (8, 6)
    with pytest.raises(ValueError, match="group_bytes must be a positive integer"):
        sage_optax.scale_by_sinkhorn(group_bytes=0)
