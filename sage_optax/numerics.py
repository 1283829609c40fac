"""The power-of-two range helpers of :mod:`sage_optax`, once (:mod:`sage_optim.numerics`).

Array versions of the definitions in :mod:`sage_optim.numerics` (the floor convention
``m ≤ a < 2m``, capped to ``[tiny, 1/tiny]``), used by SAGE's RMS values
(:func:`sage_optax.sage.rms`), SinkGD's range scale (:func:`range_scale`) and the Pallas
kernel (:mod:`sage_optax.sinkgd_pallas`), which imports them from here and not from
:mod:`sage_optax.sinkgd`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sage_optim.routing import ResolvedRoute


def norm_target(normalization: str, size: int) -> float:
    """SinkGD's norm target ``t`` of an axis group of ``size`` entries, as a Python float.

    ``1`` for ``"unit"``; for ``"sqrt"``, ``sqrt(size)`` rounded to float32 (as the jnp path
    computes it).
    """
    return 1.0 if normalization == "unit" else float(np.sqrt(np.float32(size)))


def pow2_floor(amax: jax.Array) -> jax.Array:
    """Element-wise :func:`sage_optim.numerics.pow2_floor` (``tiny`` of ``amax``'s dtype).

    The power of two ``m ≤ amax < 2m``; 1 where ``amax`` is 0 or not finite; within
    ``[tiny, 1/tiny]``, so ``1/m`` stays a finite normal number.
    """
    mantissa, _ = jnp.frexp(amax)  # amax = mantissa · 2^e, mantissa in [0.5, 1)
    ok = (amax > 0) & jnp.isfinite(amax)
    # amax / (2·mantissa) is exactly 2^(e-1) (a correctly rounded division, exact result)
    m = jnp.where(ok, amax / jnp.where(ok, 2 * mantissa, 1), 1)
    tiny = jnp.finfo(amax.dtype).tiny
    return jnp.clip(m, tiny, 1 / tiny).astype(amax.dtype)


def pow2_sqrt_floor(m: jax.Array) -> jax.Array:
    """Element-wise :func:`sage_optim.numerics.pow2_sqrt_floor`: ``2^⌊k/2⌋`` of ``m = 2^k``."""
    _, e = jnp.frexp(m)  # m = 0.5 · 2^e, so k = e − 1
    # sqrt of an even power of two is exact; for odd k take sqrt(m / 2) = 2^((k − 1) / 2)
    return jnp.where(e % 2 == 0, jnp.sqrt(m / 2), jnp.sqrt(m))


def range_scale(g: jax.Array, axes: ResolvedRoute) -> jax.Array:
    """``m``: a power of two with ``m ≤ max|G| < 2m`` per batch index (1 for an all-zero one).

    Shaped like ``g`` with size-1 fan-in and fan-out axes, in ``g``'s dtype; within
    ``[tiny, 1/tiny]`` (:func:`pow2_floor`): any power of two gives SinkGD the same ``X``, so
    the cap changes nothing but keeps ``1/m`` and ``eps/m`` finite and normal.  A matrix
    with a non-finite entry gets ``m = 1`` (its result is non-finite anyway).  Zero-size
    matrices give 1.
    """
    amax = jnp.max(jnp.abs(g), axis=(*axes.fan_in, *axes.fan_out), keepdims=True, initial=0.0)
    return pow2_floor(amax)
