"""The one registry of :mod:`sage_optax`'s update rules, read by :func:`~sage_optax.make_optimizer`.

As :mod:`sage_torch.registry` holds the PyTorch rules, this module holds, per rule name of
:data:`sage_optim.presets.RULE_DEFAULTS`, the function that builds its Optax
transformation; the module of each rule registers its own with :func:`register` when it is
imported (:mod:`sage_optax.sage`, :mod:`~sage_optax.sinkgd` for ``sinkgd``,
:mod:`~sage_optax.lion`, :mod:`~sage_optax.adamw`, :mod:`~sage_optax.unit_norm`,
:mod:`~sage_optax.apollo`).  :mod:`sage_optax.configs` builds every configuration from it
and knows no rule by name.  A rule named ``foo`` whose module is ``sage_optax/foo.py`` is
found without any other edit: :func:`builder` imports ``sage_optax.foo`` the first time
the rule is asked for (``CONTRIBUTING.md``, "Adding an update rule").
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

import optax

from sage_optim.presets import RULE_DEFAULTS


@dataclasses.dataclass(frozen=True)
class RuleContext:
    """What a configuration passes every rule's builder besides its hyperparameters.

    Attributes:
      axes: per-leaf :class:`~sage_optax.Route` (a pytree, or a callable of the params).
      mask: the weight-decay mask (pytree of bools or callable), as ``optax.adamw``.
      impl: SinkGD's implementation of its scales (:data:`sage_optax.sinkgd.IMPLS`).
    """

    axes: Any = None
    mask: Any = None
    impl: str = "auto"


RuleBuilder = Callable[[optax.ScalarOrSchedule, Any, RuleContext], optax.GradientTransformation]
"""``build(learning_rate, hp, context)``: one rule's Optax transformation.

``hp`` is the rule's typed hyperparameters (its class of
:data:`sage_optim.hyperparams.RULE_HYPERPARAMS`, e.g. ``SageHyperparams``; a
:class:`~sage_optim.hyperparams.TableHyperparams` for a rule with a table row alone), which the
builder reads by name (``hp.weight_decay``) and passes on as named arguments."""

_BUILDERS: dict[str, RuleBuilder] = {}


def register(name: str) -> Callable[[RuleBuilder], RuleBuilder]:
    """Decorator: register the builder of rule ``name`` (a key of ``RULE_DEFAULTS``).

    Raises:
      ValueError: another builder is registered under ``name``.
    """

    def decorate(build: RuleBuilder) -> RuleBuilder:
        known = _BUILDERS.get(name)
        if known is not None and known is not build:
            raise ValueError(f"two builders of rule {name!r}: {known.__module__}."
                             f"{known.__qualname__} and {build.__module__}.{build.__qualname__}")
        _BUILDERS[name] = build
        return build

    return decorate


def builder(name: str) -> RuleBuilder:
    """The builder of rule ``name``, importing ``sage_optax.<name>`` if none is registered yet.

    Raises:
      ValueError: ``name`` is no rule of ``RULE_DEFAULTS``, or no module registered it.
    """
    if name not in RULE_DEFAULTS:
        raise ValueError(f"unknown rule {name!r}; valid rules: {sorted(RULE_DEFAULTS)}")
    if name not in _BUILDERS:
        try:
            importlib.import_module(f"sage_optax.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"sage_optax.{name}":
                raise
    if name not in _BUILDERS:
        raise ValueError(f"rule {name!r} has no sage_optax implementation: its module "
                         f"(sage_optax/{name}.py) registers one with "
                         f"@sage_optax.registry.register({name!r})")
    return _BUILDERS[name]


def rule_builders() -> Mapping[str, RuleBuilder]:
    """Every registered builder by name (read-only), in the order of registration."""
    return MappingProxyType(_BUILDERS)
