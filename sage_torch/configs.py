"""The paper's eight configurations for PyTorch: one optimizer, one param group per kind."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sage_optim.presets import KINDS, Rule, resolve_preset
from sage_optim.table import RoutingTable
from sage_torch.nonfinite import SkipNonFinite, check_skip_nonfinite
from sage_torch.optim import RuleOptimizer
from sage_torch.routing import route_parameters, state_nbytes

OPTION_KEYS: tuple[str, ...] = ("route_overrides", "maximize", "foreach")
"""Keyword options of :func:`make_optimizer` that are not hyperparameters."""


def group_options(rule: Rule) -> dict[str, Any]:
    """A param group's options for ``rule``: its hyperparameters in ``torch.optim`` names."""
    hp = dict(rule.hyperparams)
    hp.pop("projection", None)  # lives on the optimizer, not in (serialised) groups
    if "b1" in hp:
        hp["betas"] = (hp.pop("b1"), hp.pop("b2"))
    return {"rule": rule.name, **hp}


def param_groups(model: nn.Module, name: str, lr: float | None = None,
                 **overrides: Any) -> list[dict[str, Any]]:
    """Route ``model``'s parameters into the param groups of configuration ``name``.

    Returns one group per non-empty kind (``embedding``, ``dense``, ``vector``), each with
    ``params``, ``param_names``, ``kind``, ``rule``, ``lr`` and the rule's hyperparameters.
    ``overrides`` are those of :func:`make_optimizer`.
    """
    overrides = dict(overrides)
    preset = resolve_preset(name, overrides, OPTION_KEYS)
    routes = route_parameters(model, overrides.pop("route_overrides", None))
    extra = {k: overrides.pop(k) for k in ("maximize", "foreach") if k in overrides}
    groups = []
    for kind in KINDS:
        members = [(n, p) for n, p, k in routes if k == kind]
        if not members:
            continue
        groups.append({
            "params": [p for _, p in members],
            "param_names": [n for n, _ in members],
            "kind": kind,
            "lr": preset.learning_rate if lr is None else lr,
            **group_options(preset.rule(kind)),
            **extra,
        })
    return groups


def make_optimizer(name: str, model: nn.Module, lr: float | None = None,
                   **overrides: Any) -> RuleOptimizer:
    """Build one of the paper's eight configurations for ``model`` as one optimizer.

    Args:
      name: ``adamw``, ``lion``, ``apollo``, ``sinkgd-pure``, ``sinkgd-hybrid``,
        ``lion-hybrid``, ``sage-pure`` or ``sage-hybrid`` (same table and defaults as
        :func:`sage_optax.make_optimizer`).
      model: the ``nn.Module`` whose parameters to train.
      lr: learning rate of every group (default: the configuration's paper value).
        Schedulers from ``torch.optim.lr_scheduler`` scale every group's ``lr``.
      **overrides: as :func:`sage_optax.make_optimizer`: ``vector="adamw"``,
        ``dense_alpha=5.0``, ``b1=0.891``, ``route_overrides={glob: kind}``, plus
        ``maximize``, ``foreach``, ``dense_projection=`` (APOLLO's injected projection)
        and ``skip_nonfinite=N``: skip a step whose gradients are not all finite (params
        and state untouched), at most ``N`` in a row, as the JAX option
        (:mod:`sage_torch.nonfinite`).

    Returns:
      A :class:`~sage_torch.RuleOptimizer` whose groups carry their rule
      (a :class:`~sage_torch.nonfinite.SkipNonFinite` when ``skip_nonfinite > 0``).
    """
    overrides = dict(overrides)
    projection = None
    for key in [k for k in overrides if k.endswith("projection")]:
        projection = overrides.pop(key)
    skip = check_skip_nonfinite(overrides.pop("skip_nonfinite", 0))
    groups = param_groups(model, name, lr, **overrides)
    if skip:
        return SkipNonFinite(groups, {"lr": 0.0}, projection=projection, skip_nonfinite=skip)
    return RuleOptimizer(groups, {"lr": 0.0}, projection=projection)


def routing_table(name: str, model: nn.Module, **overrides: Any) -> RoutingTable:
    """Route ``model`` as configuration ``name`` would and count each parameter's state bytes.

    The state is created on the ``meta`` device, so nothing is allocated.  Same form as
    :func:`sage_optax.routing_table`; the shared row counts the float32 ``step`` tensors.
    """
    overrides = {k: v for k, v in overrides.items()
                 if not k.endswith("projection") and k != "skip_nonfinite"}
    preset = resolve_preset(name, dict(overrides), OPTION_KEYS)
    groups = param_groups(model, name, **overrides)
    opt = RuleOptimizer([{**g, "params": [torch.empty_like(p, device="meta")
                                          for p in g["params"]]} for g in groups], {"lr": 0.0})
    rows, shared = [], 0
    for group in opt.param_groups:
        rule = opt.rule_of(group)
        described = preset.rule(group["kind"]).describe()
        for p, pname in zip(group["params"], group["param_names"], strict=True):
            state = rule.init_state(p, group, pname)
            rows.append((pname, tuple(p.shape), group["kind"], described, state_nbytes(state)))
            shared += 4  # the float32 step counter
    return RoutingTable(name, tuple(rows), shared)
