"""The paper's eight optimizer configurations (the paper's Table 2), as data.

This is the one table both frameworks build from.  A *configuration* assigns an update
*rule* to each of the three parameter *kinds* produced by the router (``docs/routing.md``):

* ``embedding``: token embeddings and (untied) output heads, the vocabulary matrices;
* ``dense``: every other matrix (attention and MLP projections);
* ``vector``: 1-D and 0-D parameters (norm scales, biases).

Every rule has default hyperparameters (:data:`RULE_DEFAULTS`); a configuration may
override some of them for one kind (``sinkgd-hybrid`` runs SinkGD with the ``sqrt``
normalisation and ``alpha=0.05``).  The paper keeps ``b1=0.9, b2=0.99, weight_decay=0.01``
for all optimizers (Section "Experimental Setup"), which is why AdamW's ``b2`` is 0.99 here.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from sage_optim.hyperparams import RULE_HYPERPARAMS, RuleHyperparams, typed

KINDS: tuple[str, ...] = ("embedding", "dense", "vector")
"""The three parameter kinds, in the order tables print them."""

_RULE_TABLE: dict[str, Mapping[str, Any]] = {
    name: types.MappingProxyType(cls.defaults()) for name, cls in RULE_HYPERPARAMS.items()
}
"""Each rule's row: the defaults of its typed hyperparameters
(:data:`sage_optim.hyperparams.RULE_HYPERPARAMS`: AdamW, Lion, SAGE, SinkGD, APOLLO-Mini and
``unit_norm``, each class saying what its rule is)."""

RULE_DEFAULTS: Mapping[str, Mapping[str, Any]] = types.MappingProxyType(_RULE_TABLE)
"""Default hyperparameters of every rule (the learning rate is set per configuration).

The table of rules: a rule is a row here, its module in each framework (which registers it:
:mod:`sage_optax.registry`, :mod:`sage_torch.registry`), the ranges of any new
hyperparameter (:data:`sage_optim.hyperparams.RANGES`) and its float64 oracle
(``tests/reference_np.py``): ``CONTRIBUTING.md``, "Adding an update rule"."""


@dataclasses.dataclass(frozen=True)
class RuleSpec:
    """An update rule and the hyperparameters a configuration sets for it."""

    name: str
    overrides: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in RULE_DEFAULTS:
            raise ValueError(
                f"unknown rule {self.name!r}; valid rules: {', '.join(sorted(RULE_DEFAULTS))}"
            )
        unknown = set(self.overrides) - set(RULE_DEFAULTS[self.name])
        if unknown:
            raise ValueError(
                f"rule {self.name!r} has no hyperparameter(s) {sorted(unknown)}; "
                f"it takes {sorted(RULE_DEFAULTS[self.name])}"
            )
        object.__setattr__(self, "overrides", types.MappingProxyType(dict(self.overrides)))

    @property
    def hyperparams(self) -> dict[str, Any]:
        """The full hyperparameter dict: the rule's defaults updated by the overrides."""
        return {**RULE_DEFAULTS[self.name], **self.overrides}

    @property
    def hp(self) -> RuleHyperparams:
        """The full hyperparameters, typed (:data:`sage_optim.hyperparams.RULE_HYPERPARAMS`)."""
        return typed(self.name, self.hyperparams)

    def with_overrides(self, **overrides: Any) -> RuleSpec:
        """A copy of this rule with more hyperparameters overridden."""
        return RuleSpec(self.name, {**self.overrides, **overrides})

    def describe(self) -> str:
        """A short human-readable name, e.g. ``sinkgd(sqrt, alpha=0.05)``."""
        if self.name == "sinkgd":
            hp = self.hyperparams
            return f"sinkgd({hp['normalization']}, alpha={hp['alpha']:g})"
        return self.name


@dataclasses.dataclass(frozen=True)
class Preset:
    """One of the paper's optimizer configurations: a rule per parameter kind."""

    name: str
    learning_rate: float
    embedding: RuleSpec
    dense: RuleSpec
    vector: RuleSpec

    def rule(self, kind: str) -> RuleSpec:
        """The rule used for parameters of ``kind`` (one of :data:`KINDS`)."""
        if kind not in KINDS:
            raise ValueError(f"unknown parameter kind {kind!r}; valid kinds: {KINDS}")
        return getattr(self, kind)

    def with_rule(self, kind: str, rule: RuleSpec) -> Preset:
        """A copy with ``kind`` routed to ``rule`` instead."""
        self.rule(kind)
        changes: dict[str, Any] = {kind: rule}
        return dataclasses.replace(self, **changes)


_SINKGD_SQRT = RuleSpec("sinkgd", {"normalization": "sqrt", "alpha": 0.05})
_SINKGD_UNIT = RuleSpec("sinkgd", {"normalization": "unit", "alpha": 10.0})

PRESETS: Mapping[str, Preset] = types.MappingProxyType(
    {
        p.name: p
        for p in (
            # AdamW on every parameter (the 2-state baseline).
            Preset("adamw", 1e-4, RuleSpec("adamw"), RuleSpec("adamw"), RuleSpec("adamw")),
            # Lion on every parameter (1 state).
            Preset("lion", 1e-4, RuleSpec("lion"), RuleSpec("lion"), RuleSpec("lion")),
            # APOLLO-Mini on attention and MLP matrices, AdamW on the rest.
            Preset("apollo", 1e-4, RuleSpec("adamw"), RuleSpec("apollo"), RuleSpec("adamw")),
            # Stateless: SinkGD on every matrix, g/||g|| on vectors (ablation).
            Preset("sinkgd-pure", 2e-2, _SINKGD_SQRT, _SINKGD_SQRT, RuleSpec("unit_norm")),
            # Scetbon et al.'s hybrid: SinkGD on dense matrices, AdamW on the rest.
            Preset("sinkgd-hybrid", 2e-2, RuleSpec("adamw"), _SINKGD_SQRT, RuleSpec("adamw")),
            # Lion on embeddings, Unit-Norm SinkGD on dense, AdamW on vectors.
            Preset("lion-hybrid", 2e-3, RuleSpec("lion"), _SINKGD_UNIT, RuleSpec("adamw")),
            # SAGE on every parameter (dense matrices reduce over fan-out).
            Preset("sage-pure", 2e-3, RuleSpec("sage"), RuleSpec("sage"), RuleSpec("sage")),
            # The paper's method: SAGE on embeddings and vectors, SinkGD (unit) on dense.
            Preset("sage-hybrid", 2e-3, RuleSpec("sage"), _SINKGD_UNIT, RuleSpec("sage")),
        )
    }
)
"""The eight configurations of the paper's Table 2 (``docs/configurations.md``), by name.

Default learning rates follow the paper's setup: 2e-3 for SAGE-based configurations and for
Lion-Hybrid ("the same learning rates used for SAGE"), 1e-4 for AdamW, Lion and APOLLO, and
Scetbon et al.'s global 2e-2 for the SinkGD-based ones (with ``alpha=0.05`` on matrices).
"""

CONFIG_NAMES: tuple[str, ...] = tuple(PRESETS)
"""All configuration names, in the paper's table order."""


def get_preset(name: str) -> Preset:
    """The configuration called ``name``; an unknown name lists the valid ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown optimizer configuration {name!r}; valid names: {', '.join(CONFIG_NAMES)}"
        ) from None


def resolve_preset(
    name: str, overrides: dict[str, Any], option_keys: tuple[str, ...] = ()
) -> Preset:
    """Apply a user's overrides to configuration ``name``; both frameworks call this.

    Consumes from ``overrides`` (in place) every key it understands, leaving only the
    framework's own ``option_keys``:

    * ``embedding=``/``dense=``/``vector=``: a rule name or :class:`RuleSpec` to swap in (the
      hyperparameters a :class:`RuleSpec` sets count as that kind's own, as ``<kind>_<hp>``);
    * ``<kind>_<hp>=``: one hyperparameter of one kind's rule (``dense_alpha=5.0``);
    * ``<hp>=``: a hyperparameter for every rule of the configuration that has it
      (``b1=0.891``, ``weight_decay=0.0``).

    The most specific value wins, whatever the order of the keywords: ``<kind>_<hp>`` over
    ``<hp>`` over the configuration's own value, so ``weight_decay=0.1,
    vector_weight_decay=0.0`` decays every kind but the vectors.  Above them all, a
    per-parameter value: a PyTorch param group's own option (``weight_decay``, ``betas``
    in a group given to :func:`sage_torch.make_optimizer`), applied by the framework;
    ``sage_optax`` sets hyperparameters per kind, its per-parameter control is ``mask=``
    (which leaves decay).

    Raises:
      ValueError: unknown configuration, rule or hyperparameter, or one hyperparameter of a
        kind given twice (in a :class:`RuleSpec` and as ``<kind>_<hp>``); the message lists what
        is valid.
    """
    preset, per_kind = _swap_rules(get_preset(name), overrides)
    _kind_values(name, preset, overrides, per_kind)
    preset = _global_values(name, preset, overrides, option_keys)
    for kind in KINDS:  # last: a kind's own values beat the global ones
        if per_kind[kind]:
            preset = preset.with_rule(kind, preset.rule(kind).with_overrides(**per_kind[kind]))
    return preset


def _swap_rules(preset: Preset, overrides: dict[str, Any]
                ) -> tuple[Preset, dict[str, dict[str, Any]]]:
    """Consume ``embedding=``/``dense=``/``vector=``: the preset with those rules swapped in.

    Also each kind's own values so far (``{kind: {hp: value}}``): those of a
    :class:`RuleSpec` given for it.
    """
    per_kind: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
    for kind in KINDS:
        if kind in overrides:
            value = overrides.pop(kind)
            rule = value if isinstance(value, RuleSpec) else RuleSpec(value)
            preset = preset.with_rule(kind, RuleSpec(rule.name))
            per_kind[kind].update(rule.overrides)
    return preset, per_kind


def _kind_values(name: str, preset: Preset, overrides: dict[str, Any],
                 per_kind: dict[str, dict[str, Any]]) -> None:
    """Consume every ``<kind>_<hp>=`` into ``per_kind`` (``{kind: {hp: value}}``)."""
    for key in [k for k in overrides if k.split("_", 1)[0] in KINDS]:
        kind, hp = key.split("_", 1)
        rule = preset.rule(kind)
        if hp not in RULE_DEFAULTS[rule.name]:
            raise ValueError(
                f"{key}: the {kind} rule of {name!r} is {rule.name!r}, which has no "
                f"hyperparameter {hp!r}; it takes {sorted(RULE_DEFAULTS[rule.name])}"
            )
        if hp in per_kind[kind]:
            raise ValueError(
                f"{key}: {hp!r} of the {kind} kind is given twice, as {key}= and in "
                f"{kind}=RuleSpec({rule.name!r}, ...); give it once"
            )
        per_kind[kind][hp] = overrides.pop(key)


def _global_values(name: str, preset: Preset, overrides: dict[str, Any],
                   option_keys: tuple[str, ...]) -> Preset:
    """Consume every ``<hp>=`` but the ``option_keys``: set for every rule that has it."""
    for hp in [k for k in overrides if k not in option_keys]:
        value = overrides.pop(hp)
        kinds = [k for k in KINDS if hp in RULE_DEFAULTS[preset.rule(k).name]]
        if not kinds:
            rules = sorted({preset.rule(k).name for k in KINDS})
            takes = sorted({h for r in rules for h in RULE_DEFAULTS[r]})
            raise ValueError(
                f"unknown override {hp!r} for {name!r} (rules {rules}); valid: {takes}, "
                f"'<kind>_<hyperparameter>' with kind in {KINDS}, {KINDS} to swap a rule, "
                f"and the options {list(option_keys)}"
            )
        for kind in kinds:
            preset = preset.with_rule(kind, preset.rule(kind).with_overrides(**{hp: value}))
    return preset
