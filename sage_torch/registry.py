"""The one registry of :mod:`sage_torch`'s update rules, read by the base optimizer.

As ``torch.optim.Optimizer`` knows no algorithm, :class:`~sage_torch.RuleOptimizer`
(:mod:`sage_torch.optimizer`) imports no algorithm module. Each algorithm module
(:mod:`sage_torch.sage`, :mod:`~sage_torch.sinkgd`, :mod:`~sage_torch.lion`,
:mod:`~sage_torch.adamw`, :mod:`~sage_torch.unit_norm`, :mod:`~sage_torch.apollo`) registers its
:class:`~sage_torch.common.UpdateRule` class here with :func:`register` when it is imported, and
``sage_torch/__init__.py`` imports them all, so the registry is complete once ``sage_torch`` (or any
module of it) is imported; a rule ``foo`` of ``RULE_DEFAULTS`` not registered yet is looked for in
``sage_torch/foo.py`` (:func:`make_rules` imports it), so a new rule needs no edit outside its
module (``CONTRIBUTING.md``, "Adding an update rule"). Imports go one way
(``tests/core/test_core_layering.py`` checks that they form no cycle):
:mod:`~sage_torch.common` (the
:class:`~sage_torch.common.UpdateRule` interface) ← this module ← :mod:`~sage_torch.fused_check` ←
:mod:`~sage_torch.optimizer` (the base) ← the algorithm modules (their rules register here, their
optimizer classes subclass the base) ← :mod:`~sage_torch.configs` ← ``sage_torch``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypeVar

from sage_optim.presets import RULE_DEFAULTS
from sage_torch.common import FUSED_RULES, Projection, UpdateRule

R = TypeVar("R", bound=type[UpdateRule])

_RULES: dict[str, type[UpdateRule]] = {}


def register(cls: R) -> R:
    """Class decorator: register the rule class ``cls`` under its :attr:`~UpdateRule.name`.

    Raises:
      ValueError: ``cls`` has no name, or another class is registered under it.
    """
    if not cls.name:
        raise ValueError(f"rule class {cls.__qualname__} has no name")
    known = _RULES.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"two rule classes named {cls.name!r}: {known.__module__}."
                         f"{known.__qualname__} and {cls.__module__}.{cls.__qualname__}")
    _RULES[cls.name] = cls
    return cls


def rule_classes() -> Mapping[str, type[UpdateRule]]:
    """Every registered rule class by name (read-only), in the order of registration."""
    return MappingProxyType(_RULES)


def make_rules(projection: Projection | None = None) -> dict[str, UpdateRule]:
    """One fresh instance of every rule, by name (APOLLO's with ``projection``).

    Each optimizer gets its own (rules hold caches: constants of the fused kernels,
    SinkGD's stacking layouts, APOLLO's projection).
    """
    for name in RULE_DEFAULTS:
        if name not in _RULES:  # a rule's module named after it registers it on import
            try:
                importlib.import_module(f"sage_torch.{name}")
            except ModuleNotFoundError as e:
                if e.name != f"sage_torch.{name}":
                    raise
    rules = {name: cls.create(projection) for name, cls in _RULES.items()}
    assert set(rules) == set(RULE_DEFAULTS), "every shared rule has a PyTorch implementation"
    assert {n for n, r in rules.items() if r.has_fused} == set(FUSED_RULES), \
        "FUSED_RULES lists the rules with a fused path"
    return rules
