"""The numeric helpers both frameworks use, defined once.

Both :mod:`sage_optax` and :mod:`sage_torch` keep their reductions finite for every finite
gradient by scaling with powers of two (exact: a power of two changes the exponent only).
The scalar definitions here are the specification: :func:`mean_scale` is used by both
frameworks as it is; :func:`pow2_floor` and :func:`pow2_sqrt_floor` are the definitions
that each framework's one array version (``sage_optax.numerics``,
``sage_torch.common``) computes element-wise, which ``tests/core/test_core_numerics.py`` checks.

The convention is the floor, ``m ≤ a < 2m``: the largest power of two not above ``a``.
It exists for every finite ``a > 0`` (the ceiling ``a < m ≤ 2a`` overflows to infinity for
``a > 2^127`` in float32), and it keeps ``|x|/m < 2``, so squares stay below 4 and a mean
of squares in range.  ``m`` is capped to ``[tiny, 1/tiny]`` (``tiny``: the dtype's smallest
normal number) so that ``1/m`` and ``eps/m`` are finite normal numbers: XLA:CPU divides by
multiplying with the reciprocal and flushes subnormals to zero.
"""

from __future__ import annotations

import math


def mean_scale(n: int) -> float:
    """``2^-k``, the least power of two with ``n · 2^-k ≤ 1``: the scale of a safe mean.

    ``mean(|g|·c) / c`` with ``c = mean_scale(n)`` over ``n`` entries: no partial sum
    exceeds ``max|g|``, so the mean of any finite gradient is finite (a plain sum of ``V``
    entries overflows float32 once ``|g|`` reaches about ``3.4e38 / V``).  Scaling by a
    power of two is exact, so the result is bit for bit the plain mean's, unless an entry
    falls below the smallest normal number times ``1/c`` (about ``2e-33`` for ``V = 128k``).
    SAGE's ``s_t`` in both frameworks.
    """
    return 1.0 if n <= 1 else 2.0 ** -(int(n) - 1).bit_length()


def pow2_floor(a: float, tiny: float) -> float:
    """The power of two ``m ≤ a < 2m``, within ``[tiny, 1/tiny]``; 1 where ``a`` is 0 or not finite.

    Args:
      a: a value ``≥ 0`` (a maximum of absolute values).
      tiny: the smallest normal number of the dtype (``numpy.finfo(dtype).tiny``).
    """
    if not (a > 0 and math.isfinite(a)):
        return 1.0
    mantissa, e = math.frexp(a)  # a = mantissa · 2^e, mantissa in [0.5, 1)
    return min(max(math.ldexp(1.0, e - 1), tiny), 1 / tiny)


def pow2_sqrt_floor(m: float) -> float:
    """For a power of two ``m = 2^k``, the power of two ``2^⌊k/2⌋`` (exact).

    ``X = c·(G/m)·r`` is returned as ``(c/2^⌊k/2⌋)·G·(r/2^⌈k/2⌉)``: both scales and every
    partial product stay in range for any finite ``G`` (SinkGD's scales).
    """
    _, e = math.frexp(m)  # m = 0.5 · 2^e, so k = e − 1
    return math.ldexp(1.0, (e - 1) // 2)
