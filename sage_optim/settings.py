"""A configuration's settings, parsed once at the API edge into typed values.

``make_optimizer("sage-hybrid", vector_weight_decay=0.0, ...)`` (in both frameworks) takes
its hyperparameters as keywords, some of them strings built from a kind and a name
(``<kind>_<hp>``).  :func:`parse_settings` reads them once, into a frozen :class:`Settings`:
per kind (``embedding``, ``dense``, ``vector``) a :class:`KindSettings` with the rule's name,
its typed hyperparameters (:data:`sage_optim.hyperparams.RULE_HYPERPARAMS`, fields such as
``weight_decay``) and the kind's own learning rate.  Everything downstream reads those
fields by name: each rule's builder (``hp.weight_decay``), each framework's routing table,
the PyTorch param groups.  A preset alias (:func:`sage_optax.sage_hybrid`) builds a
:class:`Settings` from its named arguments directly.

Nothing here imports a framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from sage_optim import rates
from sage_optim.hyperparams import RuleHyperparams
from sage_optim.presets import KINDS, Preset, RuleSpec, get_preset, resolve_preset

__all__ = ["KindSettings", "Settings", "parse_settings", "settings_of"]


@dataclasses.dataclass(frozen=True)
class KindSettings:
    """One kind's rule, its typed hyperparameters and its own learning rate.

    Attributes:
      kind: ``embedding``, ``dense`` or ``vector``.
      name: the rule's name (a key of :data:`sage_optim.presets.RULE_DEFAULTS`).
      hp: the rule's hyperparameters, every one of them, typed.
      learning_rate: the kind's own rate (``<kind>_learning_rate=``: a float, or a schedule
        where the framework takes one); ``None``: the configuration's.
    """

    kind: str
    name: str
    hp: RuleHyperparams
    learning_rate: Any = None

    @property
    def spec(self) -> RuleSpec:
        """The kind's rule as a :class:`~sage_optim.presets.RuleSpec` (for its description)."""
        return RuleSpec(self.name, dict(self.hp))

    def describe(self) -> str:
        """The rule's short name, e.g. ``sinkgd(unit, alpha=10)`` (:meth:`RuleSpec.describe`)."""
        return self.spec.describe()

    def rate(self, default: Any) -> Any:
        """The kind's learning rate: its own, else ``default`` (the configuration's)."""
        return default if self.learning_rate is None else self.learning_rate


@dataclasses.dataclass(frozen=True)
class Settings:
    """A configuration's settings: its name, its learning rate and each kind's settings.

    Attributes:
      name: the configuration (a key of :data:`sage_optim.presets.PRESETS`).
      learning_rate: the rate every kind without its own takes: the one given, else the
        configuration's paper value.
      embedding: the ``embedding`` kind's settings.
      dense: the ``dense`` kind's settings.
      vector: the ``vector`` kind's settings.
    """

    name: str
    learning_rate: Any
    embedding: KindSettings
    dense: KindSettings
    vector: KindSettings

    def kind(self, kind: str) -> KindSettings:
        """The settings of ``kind`` (one of :data:`~sage_optim.presets.KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"unknown parameter kind {kind!r}; valid kinds: {KINDS}")
        settings: KindSettings = getattr(self, kind)
        return settings

    @property
    def kinds(self) -> tuple[KindSettings, ...]:
        """Every kind's settings, in :data:`~sage_optim.presets.KINDS` order."""
        return (self.embedding, self.dense, self.vector)

    @property
    def own_rates(self) -> dict[str, Any]:
        """The kinds given their own learning rate: ``{kind: rate}``."""
        return {k.kind: k.learning_rate for k in self.kinds if k.learning_rate is not None}

    @property
    def preset(self) -> Preset:
        """The configuration as resolved: each kind's rule with these hyperparameters.

        Its ``learning_rate`` is the configuration's own (the paper's).
        """
        base = get_preset(self.name)
        return dataclasses.replace(base, embedding=self.embedding.spec, dense=self.dense.spec,
                                   vector=self.vector.spec)


def settings_of(preset: Preset, learning_rate: Any = None,
                own_rates: Mapping[str, Any] | None = None) -> Settings:
    """The settings of a resolved ``preset``, with ``learning_rate`` (``None``: the preset's).

    ``own_rates``: ``{kind: rate}``, the kinds given their own learning rate.
    """
    own = dict(own_rates or {})
    kinds = {kind: KindSettings(kind, preset.rule(kind).name, preset.rule(kind).hp,
                                own.get(kind)) for kind in KINDS}
    rate = preset.learning_rate if learning_rate is None else learning_rate
    return Settings(preset.name, rate, kinds["embedding"], kinds["dense"], kinds["vector"])


def parse_settings(name: str, learning_rate: Any, overrides: dict[str, Any],
                   option_keys: tuple[str, ...] = ()) -> Settings:
    """Parse a ``make_optimizer`` call's keywords once into typed :class:`Settings`.

    Consumes from ``overrides`` (in place) the ``<kind>_learning_rate`` keywords
    (:func:`sage_optim.rates.pop_kind_learning_rates`) and every rule swap and
    hyperparameter (:func:`sage_optim.presets.resolve_preset`, whose precedence and
    messages these are), leaving only the framework's own ``option_keys``.

    Raises:
      ValueError: unknown configuration, rule or hyperparameter (one line naming it).
    """
    own_rates = rates.pop_kind_learning_rates(overrides)
    return settings_of(resolve_preset(name, overrides, option_keys), learning_rate, own_rates)
