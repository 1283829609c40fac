"""Hyperparameter choices and ranges, written once for both frameworks.

:mod:`sage_optax` (whose checks skip traced values) and :mod:`sage_torch` (whose checks run on
every param group) validate every hyperparameter against these tables, so a bad value gets
the same message in both: ``"b2 must be in [0, 1), got 1.5"``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Mapping
from typing import Any

DAMPERS: tuple[str, ...] = ("both", "ema", "instant", "none")
"""SAGE's damper variants: the paper's default ``both`` (EMA and instantaneous), ``ema``
(Algorithm 1 alone), ``instant`` (the Appendix circuit breaker alone), ``none`` (H = 1, Lion)."""

NORMALIZATIONS: tuple[str, ...] = ("unit", "sqrt")
"""SinkGD's target norms: ``unit`` (the SAGE paper's Unit-Norm SinkGD) or ``sqrt`` (Scetbon et
al.'s SR-Sinkhorn)."""

SINKHORN_GROUP_BYTES: int = 128 * 2**20
"""Default size limit of one stacked group of same-shape matrices in the batched Sinkhorn
iterations (``group_bytes`` of :func:`sage_optax.scale_by_sinkhorn` and of the fused
SinkGD of :mod:`sage_torch`, and the least default of its multi-tensor path, which scales
with the model): the bytes of its ``K = (G/m)²``, about those of its copy of the
gradients."""

SCALE_TYPES: tuple[str, ...] = ("tensor", "channel")
"""APOLLO's gradient scaling: one factor per matrix, or one per uncompressed channel."""

CHOICES: Mapping[str, tuple[str, ...]] = types.MappingProxyType(
    {"damper": DAMPERS, "normalization": NORMALIZATIONS, "scale_type": SCALE_TYPES}
)
"""The string hyperparameters and their valid values."""


@dataclasses.dataclass(frozen=True)
class Range:
    """The valid values of a numeric hyperparameter."""

    low: float
    high: float = math.inf
    low_inclusive: bool = True
    high_inclusive: bool = False
    integer: bool = False

    def contains(self, value: Any) -> bool:
        """Whether ``value`` (a real number) lies in the range."""
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        v = float(value)
        if self.integer and not (math.isfinite(v) and v == int(v)):
            return False
        lo = v >= self.low if self.low_inclusive else v > self.low
        hi = v <= self.high if self.high_inclusive else v < self.high
        return bool(lo and hi)

    def describe(self) -> str:
        """``"in [0, 1)"``, ``"> 0"``, ``"an integer >= 1"``."""
        if self.integer:
            return f"an integer >= {self.low:g}"
        if math.isinf(self.high):
            return f"{'>=' if self.low_inclusive else '>'} {self.low:g}"
        lb, hb = "[" if self.low_inclusive else "(", "]" if self.high_inclusive else ")"
        return f"in {lb}{self.low:g}, {self.high:g}{hb}"


RANGES: Mapping[str, Range] = types.MappingProxyType(
    {
        "learning_rate": Range(0.0),
        "lr": Range(0.0),
        "weight_decay": Range(0.0),
        "eps": Range(0.0),
        "b1": Range(0.0, 1.0, high_inclusive=True),
        "b2": Range(0.0, 1.0),
        "alpha": Range(0.0),
        "num_iters": Range(1, integer=True),
        "rank": Range(1, integer=True),
        "update_proj_gap": Range(1, integer=True),
        "scale": Range(0.0, low_inclusive=False),
        "limiter_gamma": Range(1.0, high_inclusive=True),  # inf: no limiter
        "seed": Range(0, integer=True),
    }
)
"""The valid range of every numeric hyperparameter (see :data:`RULE_RANGES` for exceptions)."""

RULE_RANGES: Mapping[tuple[str, str], Range] = types.MappingProxyType(
    {
        # Adam's bias correction 1 - b1^t vanishes at b1 = 1.
        ("adamw", "b1"): Range(0.0, 1.0),
        ("apollo", "b1"): Range(0.0, 1.0),
    }
)
"""Ranges that differ for one rule: ``(rule, name) -> Range``."""


SKIP_NONFINITE_MAX: int = 2**31 - 1
"""The largest ``skip_nonfinite``: :func:`optax.apply_if_finite` counts the consecutive
non-finite steps in an ``int32``, so both frameworks refuse larger values."""


def check_skip_nonfinite(value: Any) -> int:
    """``value`` as a count of non-finite steps to skip, or a ``ValueError`` naming it.

    An integer (Python or NumPy) in ``[0, SKIP_NONFINITE_MAX]``; booleans, fractions and
    negative numbers are refused (``True`` is not "skip one", ``2.7`` and ``-1`` have no
    meaning), and so are counts an ``int32`` cannot hold (:data:`SKIP_NONFINITE_MAX`).
    """
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not 0 <= int(value) <= SKIP_NONFINITE_MAX):
        raise ValueError(
            f"skip_nonfinite must be an integer in [0, {SKIP_NONFINITE_MAX}] (the number of "
            f"consecutive non-finite steps to skip, counted in an int32; 0 disables "
            f"skipping), got {value!r}"
        )
    return int(value)


def range_of(name: str, rule: str | None = None) -> Range | None:
    """The valid range of hyperparameter ``name`` (of ``rule``, where it differs)."""
    return RULE_RANGES.get((rule or "", name)) or RANGES.get(name)


def problem(
    name: str, value: Any, rule: str | None = None, label: str | None = None
) -> str | None:
    """The message for an invalid ``value`` of ``name``, or ``None`` if it is valid/unknown.

    Strings are checked against :data:`CHOICES`, numbers against :func:`range_of`.
    ``label`` is how the caller's API spells the parameter (``"betas[0] (b1)"`` in PyTorch);
    default ``name``.
    """
    label = label or name
    if name in CHOICES:
        if value not in CHOICES[name]:
            return f"{label} must be one of {CHOICES[name]}, got {value!r}"
        return None
    valid = range_of(name, rule)
    if valid is None or valid.contains(value):
        return None
    return f"{label} must be {valid.describe()}, got {value!r}"


def check(name: str, value: Any, rule: str | None = None, label: str | None = None) -> None:
    """Raise a ``ValueError`` naming the parameter if ``value`` is invalid (:func:`problem`)."""
    message = problem(name, value, rule, label)
    if message is not None:
        raise ValueError(message)
