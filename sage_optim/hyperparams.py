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
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

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


@dataclasses.dataclass(frozen=True)
class RuleHyperparams(Mapping[str, Any]):
    """The typed hyperparameters of one update rule, frozen: one subclass per rule.

    Each field is one hyperparameter, with the rule's default
    (:data:`sage_optim.presets.RULE_DEFAULTS` is read from these classes); a rule's
    builder reads them by name (``hp.weight_decay``).  An instance is also a read-only
    mapping of its fields (``hp["b1"]``, ``dict(hp)``), as a rule's builder may read it.
    """

    rule: ClassVar[str] = ""
    """The rule's name, a key of :data:`sage_optim.presets.RULE_DEFAULTS`."""

    def __getitem__(self, key: str) -> Any:
        if key not in self.names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self.names())

    def names(self) -> tuple[str, ...]:
        """The hyperparameters' names, in the table's order."""
        return tuple(f.name for f in dataclasses.fields(self))

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Every hyperparameter's default, by name, in the table's order."""
        return {f.name: f.default for f in dataclasses.fields(cls)}


@dataclasses.dataclass(frozen=True)
class AdamWHyperparams(RuleHyperparams):
    """Decoupled-decay Adam, as ``optax.adamw`` / ``torch.optim.AdamW``."""

    rule: ClassVar[str] = "adamw"
    b1: Any = 0.9
    b2: Any = 0.99
    eps: Any = 1e-8
    weight_decay: Any = 0.01


@dataclasses.dataclass(frozen=True)
class LionHyperparams(RuleHyperparams):
    """Lion (Chen et al. 2023), hard sign."""

    rule: ClassVar[str] = "lion"
    b1: Any = 0.9
    b2: Any = 0.99
    weight_decay: Any = 0.01


@dataclasses.dataclass(frozen=True)
class SageHyperparams(RuleHyperparams):
    """SAGE, Algorithm 1 + instantaneous damper (``docs/algorithms.md``)."""

    rule: ClassVar[str] = "sage"
    b1: Any = 0.9
    b2: Any = 0.99
    eps: Any = 1e-8
    weight_decay: Any = 0.01
    damper: str = "both"


@dataclasses.dataclass(frozen=True)
class SinkGDHyperparams(RuleHyperparams):
    """SinkGD (``docs/algorithms.md``); ``"unit"`` is the SAGE paper's Unit-Norm SinkGD."""

    rule: ClassVar[str] = "sinkgd"
    alpha: Any = 10.0
    num_iters: int = 5
    eps: Any = 1e-8
    weight_decay: Any = 0.01
    normalization: str = "unit"


@dataclasses.dataclass(frozen=True)
class ApolloHyperparams(RuleHyperparams):
    """APOLLO-Mini as the paper's baseline ran it (``docs/algorithms.md``, APOLLO).

    ``projection``: a callable ``(path, refresh_index, n, rank) -> P`` to inject the
    projection (how the PyTorch twin and the tests feed both frameworks the same ``P``).
    """

    rule: ClassVar[str] = "apollo"
    rank: int = 1
    scale_type: str = "tensor"
    scale: Any = 128.0
    update_proj_gap: int = 200
    b1: Any = 0.9
    b2: Any = 0.999
    eps: Any = 1e-6
    weight_decay: Any = 0.01
    limiter_gamma: Any = 1.01
    seed: int = 0
    projection: Any = None


@dataclasses.dataclass(frozen=True)
class UnitNormHyperparams(RuleHyperparams):
    """The stateless step of ``sinkgd-pure`` on 1-D parameters: ``g / (||g||_2 + eps)``."""

    rule: ClassVar[str] = "unit_norm"
    eps: Any = 1e-8
    weight_decay: Any = 0.01


@dataclasses.dataclass(frozen=True)
class TableHyperparams(RuleHyperparams):
    """The hyperparameters of a rule with a table row but no class here (read as a mapping).

    A rule added by its row of :data:`sage_optim.presets.RULE_DEFAULTS` alone (and its
    modules) gets these: ``hp["b1"]`` and ``hp.b1`` both read ``row``.
    """

    row: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def names(self) -> tuple[str, ...]:
        """The hyperparameters' names, in the row's order."""
        return tuple(self.row)

    def __getitem__(self, key: str) -> Any:
        return self.row[key]

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["row"][key]
        except KeyError:
            raise AttributeError(key) from None


RULE_HYPERPARAMS: Mapping[str, type[RuleHyperparams]] = types.MappingProxyType(
    {cls.rule: cls for cls in (AdamWHyperparams, LionHyperparams, SageHyperparams,
                               SinkGDHyperparams, ApolloHyperparams, UnitNormHyperparams)}
)
"""Every rule's typed hyperparameters, by rule name: one definition for both frameworks."""


def typed(rule: str, values: Mapping[str, Any]) -> RuleHyperparams:
    """``values`` (every hyperparameter of ``rule``, by name) as ``rule``'s typed hyperparameters.

    A rule with no class in :data:`RULE_HYPERPARAMS` gets a :class:`TableHyperparams`.
    """
    cls = RULE_HYPERPARAMS.get(rule)
    if cls is None:
        return TableHyperparams(dict(values))
    return cls(**values)
