"""The paper's eight configurations for PyTorch: one optimizer, one param group per layout."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from sage_optim.hyperparams import check_skip_nonfinite
from sage_optim.presets import KINDS, Preset, Rule, resolve_preset
from sage_optim.routing import ResolvedRoute, RoutingError
from sage_optim.table import RoutingRow, RoutingTable
from sage_torch.common import FUSED_RULES
from sage_torch.nonfinite import SkipNonFinite
from sage_torch.optimizer import RuleOptimizer, update_key
from sage_torch.routing import GROUP_ROUTE_KEYS, RoutedParam, routing, state_nbytes

OPTION_KEYS: tuple[str, ...] = ("route_overrides", "maximize", "foreach", "fused",
                                 "capturable", "cpu_threads")
"""Keyword options of :func:`make_optimizer` that are not hyperparameters."""


def group_options(rule: Rule) -> dict[str, Any]:
    """A param group's options for ``rule``: its hyperparameters in ``torch.optim`` names."""
    hp = dict(rule.hyperparams)
    hp.pop("projection", None)  # lives on the optimizer, not in (serialised) groups
    if "b1" in hp:
        hp["betas"] = (hp.pop("b1"), hp.pop("b2"))
    return {"rule": rule.name, **hp}


def _axes_option(group: tuple[int, ...]) -> int | tuple[int, ...]:
    """A group's ``fan_in_dim``/``fan_out_dim``: an int for one dim, else the tuple."""
    return group[0] if len(group) == 1 else group


def layout_options(route: ResolvedRoute) -> dict[str, Any]:
    """The ``fan_in_dim``/``fan_out_dim`` group options of a route (``None`` for vectors)."""
    if not route.is_matrix:
        return {"fan_in_dim": None, "fan_out_dim": None}
    return {"fan_in_dim": _axes_option(route.fan_in),
            "fan_out_dim": _axes_option(route.fan_out)}


def _kind_options(preset: Preset, kind: str, lr: float | None,
                  extra: dict[str, Any]) -> dict[str, Any]:
    options = {"kind": kind, "lr": preset.learning_rate if lr is None else lr,
               **group_options(preset.rule(kind)), **extra}
    if options.get("fused") and options["rule"] not in FUSED_RULES:
        options["fused"] = None  # fused=True reaches only the rules that have a fused path
    if kind == "vector":
        options.update(fan_in_dim=None, fan_out_dim=None)
    return options


def _plan(model: nn.Module | Iterable[Any], name: str, lr: float | None,
          overrides: dict[str, Any]) -> tuple[list[dict[str, Any]], list[RoutedParam],
                                              dict[str, dict[str, Any]], Preset]:
    """Route ``model`` and group it: ``(groups, routed, kind options, preset)``.

    A parameter the router cannot place is placed anyway when every reading of it gets the
    same update under this configuration (``adamw`` and ``lion`` read no axes; ``sage-pure``
    gives a table and a dense matrix with the same axes the same SAGE step), and refused
    otherwise.
    """
    overrides = dict(overrides)
    axes = sorted(k for k in overrides if k.endswith(("fan_in_dim", "fan_out_dim",
                                                      "fan_in", "fan_out")))
    if axes:
        raise RoutingError(
            f"{', '.join(axes)}: the axes are per parameter, not per configuration; give them "
            "per glob, e.g. route_overrides={'*.c_attn.weight': Route('dense', fan_in=0, "
            "fan_out=1)} (Route is sage_torch.Route)"
        )
    preset = resolve_preset(name, overrides, OPTION_KEYS)
    extra: dict[str, Any] = {
        k: overrides.pop(k) for k in ("maximize", "foreach", "fused", "capturable")
        if k in overrides
    }
    kinds = {kind: _kind_options(preset, kind, lr, extra) for kind in KINDS}
    result = routing(model, overrides.pop("route_overrides", None))
    if result.errors:
        result.accept_equivalent(
            update_key(kinds), f"unsettled, no matter: {name} gives every reading the same update")
    routed = result.placed()
    group_of = {id(p): g for _, p, g in result.order}
    layouts: dict[tuple[str, Any, Any, int | None], list[RoutedParam]] = {}
    for kind in KINDS:  # groups in kind order, then in order of first appearance
        for r in routed:
            if r.route.kind == kind:
                layout = layout_options(r.route)
                key = (kind, layout["fan_in_dim"], layout["fan_out_dim"], group_of[id(r.param)])
                layouts.setdefault(key, []).append(r)
    groups = []
    for (kind, fan_in, fan_out, index), members in layouts.items():
        given = {} if index is None or result.groups is None else {
            k: v for k, v in result.groups[index].items() if k not in GROUP_ROUTE_KEYS}
        groups.append({
            "params": [r.param for r in members],
            "param_names": [r.name for r in members],
            **kinds[kind],
            **given,
            "fan_in_dim": fan_in,
            "fan_out_dim": fan_out,
        })
    return groups, routed, kinds, preset


def param_groups(model: nn.Module | Iterable[Any], name: str, lr: float | None = None,
                 **overrides: Any) -> list[dict[str, Any]]:
    """Route ``model``'s parameters into the param groups of configuration ``name``.

    ``model`` is the ``nn.Module`` or what ``torch.optim`` takes as ``params``, as for
    :func:`make_optimizer`.

    Returns one group per kind (``embedding``, ``dense``, ``vector``) and layout, each with
    ``params``, ``param_names``, ``kind``, ``rule``, ``lr``, the rule's hyperparameters
    (``betas`` where the rule has momentum) and the matrix axes ``fan_in_dim``/``fan_out_dim``
    (a dim or a tuple of dims; ``None`` for vectors): an ``nn.Linear`` ``(out, in)`` is
    ``(1, 0)``, a transformers ``Conv1D`` ``(in, out)`` is ``(0, 1)``, a ``Conv2d``
    ``((1, 2, 3), 0)``.  ``overrides`` are those of :func:`make_optimizer`.
    """
    return _plan(model, name, lr, overrides)[0]


def make_optimizer(name: str, model: nn.Module | Iterable[Any], lr: float | None = None,
                   **overrides: Any) -> RuleOptimizer:
    """Build one of the paper's eight configurations for ``model`` as one optimizer.

    Args:
      name: ``adamw``, ``lion``, ``apollo``, ``sinkgd-pure``, ``sinkgd-hybrid``,
        ``lion-hybrid``, ``sage-pure`` or ``sage-hybrid`` (same table and defaults as
        :func:`sage_optax.make_optimizer`).
      model: the ``nn.Module`` whose parameters to train (:func:`sage_torch.route_params`
        places them: module types, the model API, shapes), or what ``torch.optim`` takes
        as ``params``, with less evidence: ``model.named_parameters()`` (PyTorch's names:
        a 2-D ``weight`` is ``(out, in)``, one under an ``emb`` name or a known table name
        (``wpe``, ``shared``) a table ``(V, d)``; a GPT-2 ``Conv1D`` name (``c_attn``,
        ``c_fc``, ``c_proj``) is refused, as nanoGPT gives the same names to ``(out, in)``
        weights: pass the model; a head is never taken by shape inside numbered layers),
        ``model.parameters()`` (bare tensors, named ``params[i]`` in errors and
        ``route_overrides``: only vectors are placed by shape), or param-group dicts
        (``params``, optional ``param_names``, ``kind``, ``fan_in_dim``/``fan_out_dim``
        placing its members, and group options such as ``lr`` or ``weight_decay`` that
        override the configuration's and every keyword below: the most specific value wins,
        a group's own option, then ``<kind>_<hp>``, then ``<hp>``, then the preset).  A
        parameter nothing places is refused unless every reading of it gets the same update
        under this configuration (``adamw`` and ``lion`` read no axes; ``sage-pure``
        updates a table and a Linear with the same axes alike).  Frozen parameters are left
        out.
      lr: learning rate of every group (default: the configuration's paper value).
        Schedulers from ``torch.optim.lr_scheduler`` scale every group's ``lr``.
      **overrides: as :func:`sage_optax.make_optimizer`: ``vector="adamw"``,
        ``dense_alpha=5.0``, ``b1=0.891``, ``route_overrides={glob: kind | Route(kind,
        fan_in=..., fan_out=...) | (kind, {"fan_in": ..., "fan_out": ...})}``, plus
        ``maximize``, ``foreach``, ``fused=True`` (opt-in: the Triton kernels of the
        rules that have them, SAGE, Lion and SinkGD, not yet measured on a GPU; the other
        groups keep their default path, foreach on CUDA; :data:`sage_torch.common.FUSED_DOC`),
        ``capturable`` (step counts on the device, a tensor
        ``lr`` never read back: CUDA graphs; not with APOLLO), ``cpu_threads=N`` (spread
        the chunked CPU path over ``N`` threads, :mod:`sage_torch.chunked`; default 1: no
        thread is started),
        ``dense_projection=`` (APOLLO's injected projection)
        and ``skip_nonfinite=N``: skip a step whose gradients are not all finite (params
        and state untouched), at most ``N`` in a row, as the JAX option
        (:mod:`sage_torch.nonfinite`; ``N`` an integer in ``[0, 2**31 - 1]``, the range
        of JAX's ``int32`` counter, in both frameworks).

    Returns:
      A :class:`~sage_torch.RuleOptimizer` whose groups carry their rule and axes (a
      :class:`~sage_torch.nonfinite.SkipNonFinite` when ``skip_nonfinite > 0``); a group
      added later with ``kind=`` gets this configuration's rule for that kind.

    Raises:
      RoutingError: a parameter the router cannot place (the message gives the override).
    """
    overrides = dict(overrides)
    projection = None
    for key in [k for k in overrides if k.endswith("projection")]:
        projection = overrides.pop(key)
    skip = check_skip_nonfinite(overrides.pop("skip_nonfinite", 0))
    cpu_threads = overrides.pop("cpu_threads", 1)
    groups, _, kinds, _ = _plan(model, name, lr, overrides)
    if skip:
        return SkipNonFinite(groups, {"lr": 0.0}, projection=projection, kinds=kinds,
                             skip_nonfinite=skip, cpu_threads=cpu_threads)
    return RuleOptimizer(groups, {"lr": 0.0}, projection=projection, kinds=kinds,
                         cpu_threads=cpu_threads)


def routing_table(name: str, model: nn.Module | Iterable[Any],
                  **overrides: Any) -> RoutingTable:
    """Route ``model`` as configuration ``name`` would and count each parameter's state bytes.

    ``model`` is what :func:`make_optimizer` takes: the ``nn.Module`` or ``params``.

    One :class:`~sage_optim.table.RoutingRow` per trainable parameter, in model order: its
    kind, rule, fan-in and fan-out axes with sizes, the evidence that placed it and its state
    bytes.  The state is created on the ``meta`` device, so nothing is allocated.  Same form
    as :func:`sage_optax.routing_table`; the shared row counts the float32 ``step`` tensors.
    """
    overrides = {k: v for k, v in overrides.items()
                 if not k.endswith("projection") and k not in ("skip_nonfinite", "cpu_threads")}
    groups, routed, _, preset = _plan(model, name, None, overrides)
    opt = RuleOptimizer([{**g, "params": [torch.empty_like(p, device="meta")
                                          for p in g["params"]]} for g in groups], {"lr": 0.0})
    nbytes: dict[str, int] = {}
    for group in opt.param_groups:
        rule = opt.rule_of(group)
        for p, pname in zip(group["params"], group["param_names"], strict=True):
            nbytes[pname] = state_nbytes(rule.init_state(p, group, pname))
    rows = []
    for r in routed:
        route = r.route
        rows.append(RoutingRow(
            path=r.name, shape=tuple(r.param.shape), kind=route.kind,
            rule=preset.rule(route.kind).describe(), fan_in=route.describe_fan_in(),
            fan_out=route.describe_fan_out(), evidence=route.evidence,
            state_bytes=nbytes[r.name],
        ))
    return RoutingTable(name, tuple(rows), 4 * len(rows))  # a float32 step counter each
