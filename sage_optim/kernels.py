"""The one switch of every GPU kernel of both frameworks: the ``SAGE_KERNELS`` variable.

sage-optim has hand-written kernels in both frameworks: :mod:`sage_optax`'s Pallas kernel for
SinkGD's scales (``impl="auto"|"pallas"``) and :mod:`sage_torch`'s Triton kernels
(``fused=True``); the switch also covers :mod:`sage_optax`'s compiled CPU kernel for SinkGD's
scales (``impl="auto"|"native"``, :mod:`sage_optax.sinkgd_native`).  When a kernel fails on
a user's GPU (a driver, a Triton or a jaxlib the project has not run on),
``SAGE_KERNELS=off`` in the environment turns all of them off without a code change: every
update then takes the framework's reference path (jnp, foreach or single-tensor), which
computes the same math.  An explicit request for a kernel (``impl="pallas"``,
``fused=True``) is overridden too, with a one-time warning that says so.

Defaults: a GPU path becomes a default (``impl="auto"``, ``--attention auto``, torch's
choice with neither ``foreach`` nor ``fused``) only once ``scripts/gpu-check`` on that GPU has
shown it correct and faster than the reference path; :data:`VALIDATED_ON` lists, per path,
the GPUs where that has happened, and :func:`validated` is what every ``auto`` asks.  Until
then a path is opt-in: the option that names it runs it.

The variable is read when a kernel is about to be chosen (when an update is traced in JAX,
at every step in PyTorch), not at import: setting it in a running process takes effect for
programs traced and steps run after that.

    SAGE_KERNELS=auto   (or unset, or empty) each option decides, as documented
    SAGE_KERNELS=off    no kernel runs, whatever the options say
"""

from __future__ import annotations

import os
import types
import warnings
from collections.abc import Mapping

ENV_VAR = "SAGE_KERNELS"
"""Name of the environment variable."""

CHOICES: tuple[str, ...] = ("auto", "off")
"""Its valid values (case and surrounding spaces ignored; unset or empty is ``auto``)."""

PATHS: tuple[str, ...] = ("sinkgd-pallas", "sinkgd-stream", "torch-fused", "cudnn-attention")
"""The GPU paths whose default is decided by measurement: SinkGD's Pallas kernel
(:mod:`sage_optax.sinkgd_pallas`, ``impl="pallas"``), sage_torch's Triton kernels
(``fused=True``), and cuDNN's flash attention in ``sage-train`` (``--attention cudnn``)."""

VALIDATED_ON: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    # H100, 2026-11-26: correct (its tests pass) but slower than the jnp path (270M float32:
    # sinkgd-pure 10.1 ms against 8.1, sage-hybrid 7.0 against 6.9).
    "sinkgd-pallas": (),
    # H200, 2026-11-28: SinkGD's scales without K (sage_optax impl="stream") agree with the
    # K path to 3.4e-7; 1.3B stacked bfloat16 sage-hybrid 9.6 ms against 14.8 (temporaries
    # 48.5 MiB against 1,069), 270M per layer within noise of it (7.6 against 7.2 ms,
    # temporaries 44 MiB against 209).
    "sinkgd-stream": ("H200",),
    # H100, 2026-11-26: correct, faster in 6 of 8 configurations in float32 but slower for
    # SinkGD's rule (sinkgd-pure 2.05x foreach's time; bfloat16 lion-hybrid 1.09x,
    # sinkgd-hybrid 1.12x); and sage_torch's default never takes it (torch.optim's rule).
    "torch-fused": (),
    # H100, 2026-11-26: 5.23x XLA's speed at the 270M model's attention (16 x 1024,
    # bfloat16, head dim 64), temporaries 130 MiB against 2,561, errors against a float32
    # reference within 2x of XLA's bfloat16 attention's; 270M trained with it at 16 x 1024
    # and 64 x 1024.
    "cudnn-attention": ("H100",),
})
"""Per path, the GPUs (substrings of the device name, e.g. ``"H100"``) on which
``scripts/gpu-check`` has shown it correct and faster than the reference path, so that
``auto`` takes it there: cuDNN's attention on H100s; SinkGD's Pallas kernel and the torch
Triton kernels nowhere (``benchmarks/RESULTS.md``, "GPU figures, 2026-11-26")."""

_warned: set[str] = set()


def validated(path: str, device_kind: str | None) -> bool:
    """Whether ``auto`` may take GPU ``path`` (:data:`PATHS`) on a device named ``device_kind``.

    False when the kernels are off (``SAGE_KERNELS=off``), when there is no such device
    (``None``), or when ``scripts/gpu-check`` has not shown the path correct and faster on
    that GPU (:data:`VALIDATED_ON`).
    """
    if path not in VALIDATED_ON:
        raise ValueError(f"unknown GPU path {path!r}; one of {PATHS}")
    if device_kind is None or not kernels_enabled():
        return False
    return any(name.lower() in device_kind.lower() for name in VALIDATED_ON[path])


def kernels_enabled() -> bool:
    """Whether ``SAGE_KERNELS`` lets kernels run (``auto``) or turns them all off (``off``).

    Raises:
      ValueError: the variable holds another value (the message names it and the choices).
    """
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower() or "auto"
    if value not in CHOICES:
        raise ValueError(f"environment variable {ENV_VAR} must be one of {CHOICES} (or unset), "
                         f"got {raw!r}")
    return value == "auto"


def warn_overridden(request: str) -> None:
    """Warn once per process that ``SAGE_KERNELS=off`` overrides ``request`` (``fused=True``)."""
    if request in _warned:
        return
    _warned.add(request)
    warnings.warn(f"{ENV_VAR}=off: {request} is ignored and the reference path runs instead "
                  "(same math; unset the variable to use the kernel)", RuntimeWarning,
                  stacklevel=3)
