"""Learning rates per kind: each kind's effective step, and the notice for a rate far off.

A rule's step is the learning rate times the rule's own scale: SinkGD multiplies its
normalised gradient by ``alpha`` (0.05 in ``sinkgd-pure``/``sinkgd-hybrid``, 10 in
``lion-hybrid``/``sage-hybrid``), APOLLO by ``sqrt(scale)``; the other rules by 1.  So one
learning rate gives the kinds of a configuration very different steps, and a program's
AdamW-style rate (say 1.6e-3) gives ``sinkgd-hybrid``'s dense matrices a step of 8e-5
instead of the preset's 1e-3 (2e-2 x 0.05).  Both frameworks print each kind's effective
step in their routing table (:func:`describe_step`), take a per-kind rate as one keyword
(``dense_learning_rate=``: :func:`pop_kind_learning_rates`), and note once a rate whose
step is more than :data:`NOTICE_FACTOR` times off the configuration's own
(:func:`notice_far_rates`).

Nothing here imports a framework.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping
from typing import Any, Protocol

from sage_optim.hyperparams import ApolloHyperparams, RuleHyperparams, SinkGDHyperparams
from sage_optim.presets import KINDS, Preset, get_preset

__all__ = [
    "KIND_LEARNING_RATE_KEYS",
    "NOTICE_FACTOR",
    "LearningRateNotice",
    "TypedRule",
    "describe_step",
    "far_rate_message",
    "notice_far_rates",
    "pop_kind_learning_rates",
    "step_scale",
]

KIND_LEARNING_RATE_KEYS: tuple[str, ...] = tuple(f"{kind}_learning_rate" for kind in KINDS)
"""The per-kind learning-rate keywords: ``embedding_learning_rate=``,
``dense_learning_rate=``, ``vector_learning_rate=``."""

NOTICE_FACTOR = 10.0
"""A kind's effective step more than this factor above or below its preset's gets a notice."""


class LearningRateNotice(UserWarning):
    """A learning rate whose effective step for some kind is far from the configuration's.

    Issued once per configuration and rates in a process; silence it with
    ``warnings.filterwarnings("ignore", category=LearningRateNotice)``.
    """


def pop_kind_learning_rates(overrides: dict[str, Any]) -> dict[str, Any]:
    """Consume the ``<kind>_learning_rate`` keywords of ``overrides``: ``{kind: rate}``.

    A kind's rate (a float, or a schedule where the framework takes one) replaces the
    ``learning_rate`` for that kind only.
    """
    return {key.removesuffix("_learning_rate"): overrides.pop(key)
            for key in KIND_LEARNING_RATE_KEYS if key in overrides}


class TypedRule(Protocol):
    """A rule with typed hyperparameters.

    A :class:`~sage_optim.presets.RuleSpec` or a kind's :class:`~sage_optim.settings.KindSettings`.
    """

    @property
    def hp(self) -> RuleHyperparams:
        """The rule's hyperparameters, typed."""
        ...


def step_scale(rule: TypedRule) -> float:
    """The factor between a rule's learning rate and its step.

    SinkGD's ``alpha``, APOLLO's ``sqrt(scale)``, 1 for the others.
    """
    hp = rule.hp
    if isinstance(hp, SinkGDHyperparams):
        return float(hp.alpha)
    if isinstance(hp, ApolloHyperparams):
        return math.sqrt(float(hp.scale))
    return 1.0


def _number(rate: Any) -> float | None:
    """``rate`` as a float, or ``None`` for a schedule or a traced value."""
    if isinstance(rate, numbers.Real) and not isinstance(rate, bool):
        return float(rate)
    return None


def describe_step(rule: TypedRule, rate: Any) -> str:
    """A kind's effective step for a routing table: ``"0.02 (2e-3 x 10)"`` or ``"0.002"``.

    A schedule is shown as ``"schedule x 10"``.
    """
    scale = step_scale(rule)
    value = _number(rate)
    if value is None:
        return "schedule" if scale == 1 else f"schedule x {scale:.3g}"
    if scale == 1:
        return f"{value:.3g}"
    return f"{value * scale:.3g} ({value:.3g} x {scale:.3g})"


def far_rate_message(name: str, preset: Preset, rates: Mapping[str, Any]) -> str | None:
    """The notice for ``rates`` (``{kind: rate}``), or ``None`` if every step is usual.

    ``preset`` is configuration ``name`` as resolved (overrides applied); a kind's step is
    usual within :data:`NOTICE_FACTOR` of the configuration's own.

    A kind whose rule was swapped (``vector="adamw"``) has no usual step and is not judged;
    a schedule is not judged either.
    """
    usual = get_preset(name)
    far = []
    for kind in KINDS:
        value = _number(rates.get(kind))
        rule, own = preset.rule(kind), usual.rule(kind)
        if value is None or value <= 0 or rule.name != own.name:
            continue
        step = value * step_scale(rule)
        expected = usual.learning_rate * step_scale(own)
        if not step > 0 or not expected > 0:  # a scale of 0 (refused by the rule's checks)
            continue
        ratio = step / expected
        if ratio > NOTICE_FACTOR * (1 + 1e-9) or ratio < 1 / (NOTICE_FACTOR * (1 + 1e-9)):
            how = f"{ratio:.3g}x above" if ratio > 1 else f"{1 / ratio:.3g}x below"
            scale = step_scale(rule)
            times = f" ({value:.3g} x {scale:.3g})" if scale != 1 else ""
            own_times = (f" ({usual.learning_rate:.3g} x {step_scale(own):.3g})"
                         if step_scale(own) != 1 else "")
            far.append(f"{kind} ({rule.describe()}) steps at {step:.3g}{times}, {how} the "
                       f"preset's {expected:.3g}{own_times}")
    if not far:
        return None
    far.sort(key=lambda part: "(adamw)" in part or "(lion)" in part or "(sage)" in part)
    kinds = [part.split(" ", 1)[0] for part in far]
    return (f"{name}: start from the preset's rate {usual.learning_rate:g} (leave the "
            f"learning rate out), or give a kind its own, e.g. {kinds[0]}_learning_rate="
            f"{usual.learning_rate:g}. With the rates given, " + "; ".join(far) + ".")


_NOTED: set[tuple[str, tuple[tuple[str, float], ...]]] = set()


def notice_far_rates(name: str, preset: Preset, rates: Mapping[str, Any],
                     per_kind: bool = False, stacklevel: int = 3) -> None:
    """Warn once per configuration and rates when :func:`far_rate_message` has a notice.

    The warning is a :class:`LearningRateNotice`.

    ``per_kind``: some kind was given its own rate (``<kind>_learning_rate=``): the caller
    has chosen rates per kind, and no notice is given.  ``stacklevel``: as
    :func:`warnings.warn`'s, counted from this function's caller's caller (the user's line).
    """
    if per_kind:
        return
    message = far_rate_message(name, preset, rates)
    if message is None:
        return
    key = (name, tuple((k, float(v)) for k, v in sorted(rates.items())
                       if _number(v) is not None))
    if key in _NOTED:
        return
    _NOTED.add(key)
    warnings.warn(message, LearningRateNotice, stacklevel=stacklevel)
