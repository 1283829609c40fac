"""The paper's eight configurations for PyTorch: one optimizer, one param group per layout."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from sage_optim import rates
from sage_optim.hyperparams import check_skip_nonfinite
from sage_optim.presets import KINDS, RuleSpec
from sage_optim.routing import ResolvedRoute, Route, RoutingError
from sage_optim.settings import KindSettings, Settings, parse_settings
from sage_optim.table import RoutingRow, RoutingTable
from sage_torch.common import FUSED_RULES, check_group, check_lr
from sage_torch.grouping import ConfiguredOptimizer, accept_equivalent
from sage_torch.nonfinite import SkipNonFinite
from sage_torch.optimizer import RuleOptimizer, viewed
from sage_torch.registry import rule_classes
from sage_torch.routing import GROUP_ROUTE_KEYS, RoutedParam, Routing, routing

OPTION_KEYS: tuple[str, ...] = ("route_overrides", "maximize", "foreach", "fused",
                                 "capturable", "cpu_threads")
"""Keyword options of :func:`make_optimizer` that are not hyperparameters."""


def group_options(rule: RuleSpec | KindSettings) -> dict[str, Any]:
    """A param group's options for ``rule``: its hyperparameters in ``torch.optim`` names.

    Read from the rule's typed hyperparameters (``rule.hp``); a param group is a dict.
    """
    hp = dict(rule.hp)
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


def _kind_options(settings: KindSettings, lr: Any, extra: dict[str, Any]) -> dict[str, Any]:
    """The group options of a kind: its rule, rate (its own, else ``lr``) and hyperparameters."""
    options = {"kind": settings.kind, "lr": settings.rate(lr), **group_options(settings),
               **extra}
    if options.get("fused") and options["rule"] not in FUSED_RULES:
        options["fused"] = None  # fused=True reaches only the rules that have a fused path
    if settings.kind == "vector":
        options.update(fan_in_dim=None, fan_out_dim=None)
    return options


def _member_name(group: Mapping[str, Any], gi: int | None, i: int, x: Any) -> str:
    """How the ``i``-th member of param group ``gi`` is called in messages."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str):
        return x[0]
    names = group.get("param_names")
    if names is not None and i < len(names):
        return str(names[i])
    return f"param_groups[{gi}].params[{i}]" if gi is not None else f"params[{i}]"


def _member_tensor(x: Any) -> Any:
    return x[1] if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) else x


def _dedup_group(group: dict[str, Any], gi: int, grouped: bool,
                 owner: dict[int, tuple[int, str]]) -> None:
    """:func:`_materialized` for param group ``gi`` (in place); ``owner``: the groups so far."""
    members = group.get("params")
    if members is None or isinstance(members, set):
        return  # the router says why
    members = [members] if isinstance(members, torch.Tensor) else list(members)
    names = group.get("param_names")
    names = None if names is None else list(names)
    if names is not None:
        group["param_names"] = names
    keep, dup = [], []
    for i, x in enumerate(members):
        t = _member_tensor(x)
        if not isinstance(t, torch.Tensor):
            keep.append(i)
            continue
        name = _member_name(group, gi if grouped else None, i, x)
        seen = owner.get(id(t))
        if seen is not None and seen[0] != gi:
            raise ValueError(
                f"some parameters appear in more than one parameter group: {name} of "
                f"shape {tuple(t.shape)} is in param group {seen[0]} (as {seen[1]}) and "
                f"in param group {gi}; one parameter, one group (as torch.optim)")
        if seen is not None:
            dup.append(name)
            continue
        owner[id(t)] = (gi, name)
        keep.append(i)
    if dup:
        warnings.warn(
            f"optimizer contains a parameter group with duplicate parameters ({', '.join(dup)}"
            f"{' in param group ' + str(gi) if grouped else ''}); each is kept once",
            UserWarning, stacklevel=5)  # one frame deeper than _materialized's
        if names is not None and len(names) == len(members):
            group["param_names"] = [names[i] for i in keep]
    group["params"] = [members[i] for i in keep]


def _materialized(params: Any) -> Any:
    """``params`` with every iterator turned into a list, duplicates checked as torch does.

    A parameter in two param groups raises a ``ValueError`` naming it and both groups (as
    ``torch.optim``, which refuses it); one listed twice in a group is kept once, with
    ``torch.optim``'s warning (naming it).  An ``nn.Module`` is returned as is.
    """
    if isinstance(params, nn.Module | torch.Tensor | Mapping) or params is None:
        return params
    items = list(params)
    grouped = bool(items) and all(isinstance(x, dict) for x in items)
    groups = [dict(g) for g in items] if grouped else [{"params": items}]
    owner: dict[int, tuple[int, str]] = {}
    for gi, group in enumerate(groups):
        _dedup_group(group, gi, grouped, owner)
    return groups if grouped else groups[0]["params"]


def _group_overrides(groups: Sequence[Mapping[str, Any]],
                     names: Mapping[int, str]) -> dict[str, Any]:
    """Param groups' ``kind``/``fan_in_dim``/``fan_out_dim`` as overrides of their members.

    By exact name, for ``make_optimizer(..., model=)``.
    """
    out: dict[str, Any] = {}
    for gi, group in enumerate(groups):
        kind = group.get("kind")
        axes = (group.get("fan_in_dim"), group.get("fan_out_dim"))
        if kind is None:
            if axes != (None, None):
                raise ValueError(f"param group {gi} gives fan_in_dim/fan_out_dim but no kind; "
                                 "add kind='dense' or kind='embedding'")
            continue
        for x in group["params"]:
            name = names.get(id(_member_tensor(x)))
            if name is not None:
                out[name] = (Route(kind, fan_in=axes[0], fan_out=axes[1])
                             if axes != (None, None) and kind != "vector" else kind)
    return out


def _with_model(params: Any, model: nn.Module, overrides: Mapping[str, Any] | None) -> Routing:
    """Route what ``torch.optim`` takes (tensors, pairs, HF-style groups) by ``model``'s evidence.

    Every member is named and placed as when the model itself is given (its module types,
    its API, its names), and each group keeps its options (``weight_decay``, ``lr``, ...);
    a member that is not a parameter of ``model`` raises a ``ValueError`` naming it.
    Parameters of the model in no group are not trained (as with ``torch.optim``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model= must be an nn.Module, got {type(model).__name__}")
    items = list(params)
    grouped = bool(items) and all(isinstance(x, dict) for x in items)
    groups = items if grouped else [{"params": items}]
    if not any(g.get("params") for g in groups):
        raise ValueError("optimizer got an empty parameter list")
    names = {id(p): n for n, p in model.named_parameters()}
    for gi, group in enumerate(groups):
        if "rule" in group:
            raise ValueError(
                f"param group {gi} sets rule={group['rule']!r}: make_optimizer gives each "
                "kind its configuration's rule; give kind= instead, or add the group "
                "afterwards with opt.add_param_group")
        for i, x in enumerate(group["params"]):
            t = _member_tensor(x)
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"optimizer can only optimize Tensors, but "
                                f"{_member_name(group, gi, i, x)} is a {type(t).__name__}")
            if id(t) not in names:
                raise ValueError(
                    f"{_member_name(group, gi if grouped else None, i, x)} of shape "
                    f"{tuple(t.shape)} is not a parameter of the model given as model= "
                    f"({type(model).__name__}); pass the model that holds it")
    merged = {**_group_overrides(groups, names), **dict(overrides or {})}
    full = routing(model, merged, frozen=True)
    order = [(names[id(_member_tensor(x))], _member_tensor(x), gi if grouped else None)
             for gi, group in enumerate(groups) for x in group["params"]]
    wanted = {n for n, _, _ in order}
    errors = [e for e in full.errors
              if any(pr.leaf is None or pr.leaf in wanted for pr in (e.problems or (e,)))]
    options = [{k: v for k, v in g.items() if k not in ("params", "param_names")}
               for g in groups] if grouped else None
    return Routing(order, {id(p): full.routes[id(p)] for _, p, _ in order
                           if id(p) in full.routes}, errors, options)


def _leave_out_frozen(result: Routing) -> None:
    """Leave out the frozen parameters the router cannot place, with a warning naming them.

    Frozen parameters are routed (no gradient needed) and kept, so that they train once
    unfrozen; one that nothing places would otherwise make the whole model refused for a
    parameter that is not being trained.
    """
    frozen = {n for n, p, _ in result.order if not p.requires_grad}
    if not frozen or not result.errors:
        return
    kept, dropped = [], []
    for err in result.errors:
        leaves = [pr.leaf for pr in (err.problems or (err,))]
        if leaves and all(leaf in frozen for leaf in leaves):
            dropped += [str(leaf) for leaf in leaves]
        else:
            kept.append(err)
    if dropped:
        result.errors = kept
        result.order = [o for o in result.order if o[0] not in set(dropped)]
        warnings.warn(
            f"frozen parameters left out of the optimizer, as nothing places them: "
            f"{', '.join(dropped)}; they will not train if unfrozen. Route them in "
            "route_overrides to keep them", UserWarning, stacklevel=4)


def _kind_groups(routed: list[RoutedParam], result: Routing,
                 kinds: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The param groups of ``routed``: one per kind, layout, given group and view.

    In kind order, then in order of first appearance; each with its kind's options, the
    given group's own options (``result.groups``) and its axes.
    """
    group_of = {id(p): g for _, p, g in result.order}
    layouts: dict[tuple[str, Any, Any, int | None, Any], list[RoutedParam]] = {}
    for kind in KINDS:  # groups in kind order, then in order of first appearance
        for r in routed:
            if r.route.kind == kind:
                layout = layout_options(r.route)
                key = (kind, layout["fan_in_dim"], layout["fan_out_dim"], group_of[id(r.param)],
                       r.route.view)
                layouts.setdefault(key, []).append(r)
    groups = []
    for (kind, fan_in, fan_out, index, view), members in layouts.items():
        given = {} if index is None or result.groups is None else {
            k: v for k, v in result.groups[index].items() if k not in GROUP_ROUTE_KEYS}
        groups.append({
            "params": [r.param for r in members],
            "param_names": [r.name for r in members],
            **kinds[kind],
            **given,
            "fan_in_dim": fan_in,
            "fan_out_dim": fan_out,
            **({"view": view} if view is not None else {}),
        })
    return groups


def _plan(params: nn.Module | Iterable[Any] | None, name: str, lr: float | None,
          overrides: dict[str, Any], model: nn.Module | None = None,
          frozen: bool = True, notice: bool = True
          ) -> tuple[list[dict[str, Any]], list[RoutedParam], dict[str, dict[str, Any]], Settings]:
    """Route ``params`` and group it: ``(groups, routed, kind options, settings)``.

    A parameter the router cannot place is placed anyway when every reading of it gets the
    same update under this configuration (``adamw`` and ``lion`` read no axes; ``sage-pure``
    gives a table and a dense matrix with the same axes the same SAGE step), and refused
    otherwise.  ``frozen``: route the frozen parameters too (kept, to train once unfrozen).
    ``notice``: note once a learning rate far from the configuration's
    (:func:`sage_optim.rates.notice_far_rates`).  ``<kind>_learning_rate=`` sets one kind's
    ``lr``.
    """
    overrides = dict(overrides)
    settings, kinds = _kind_plan(name, lr, overrides, notice)
    if params is None and model is None:
        raise TypeError("make_optimizer needs the model or its params (tensors, (name, "
                        "tensor) pairs or param groups, with model= for their evidence)")
    if params is None:
        params = model
    elif isinstance(params, nn.Module) and model is not None and params is not model:
        raise ValueError("make_optimizer got two models: pass the nn.Module once, or its "
                         "params (or param groups) with model=")
    params = _materialized(params)
    route_overrides = overrides.pop("route_overrides", None)
    if model is not None and not isinstance(params, nn.Module):
        result = _with_model(params, model, route_overrides)
    else:
        result = routing(params, route_overrides, frozen=frozen)
    if result.errors:
        accept_equivalent(
            result, kinds, f"unsettled, no matter: {name} gives every reading the same update")
    had_params = bool(result.order)
    _leave_out_frozen(result)
    routed = result.placed()
    groups = _kind_groups(routed, result, kinds)
    if not groups and had_params:
        # Every parameter frozen and left out: as torch.optim, an optimizer whose step is a
        # no-op (one empty group), not "empty parameter list".
        groups.append({"params": [], "param_names": [], **kinds["vector"],
                       "fan_in_dim": None, "fan_out_dim": None})
    return groups, routed, kinds, settings


def _kind_plan(name: str, lr: float | None, overrides: dict[str, Any], notice: bool
               ) -> tuple[Settings, dict[str, dict[str, Any]]]:
    """Parse the settings once (:func:`sage_optim.settings.parse_settings`): each kind's options.

    Consumes the hyperparameters and ``maximize``/``foreach``/``fused``/``capturable`` of
    ``overrides``, leaving the router's.
    """
    axes = sorted(k for k in overrides if k.endswith(("fan_in_dim", "fan_out_dim",
                                                      "fan_in", "fan_out")))
    if axes:
        raise RoutingError(
            f"{', '.join(axes)}: the axes are per parameter, not per configuration; give them "
            "per glob, e.g. route_overrides={'*.c_attn.weight': Route('dense', fan_in=0, "
            "fan_out=1)} (Route is sage_torch.Route)"
        )
    settings = parse_settings(name, lr, overrides, OPTION_KEYS)
    extra: dict[str, Any] = {
        k: overrides.pop(k) for k in ("maximize", "foreach", "fused", "capturable")
        if k in overrides
    }
    if lr is not None:
        check_lr(lr)  # before params, as torch.optim checks lr first
    kinds = {k.kind: _kind_options(k, settings.learning_rate, extra) for k in settings.kinds}
    for options in kinds.values():  # every hyperparameter before params, as torch.optim
        check_group(options, options["rule"], rule_classes()[options["rule"]].checked)
    if notice:
        rates.notice_far_rates(name, settings.preset, {k: o["lr"] for k, o in kinds.items()},
                               per_kind=bool(settings.own_rates), stacklevel=5)
    return settings, kinds


def param_groups(params: nn.Module | Iterable[Any] | None, name: str, lr: float | None = None,
                 *, model: nn.Module | None = None, **overrides: Any) -> list[dict[str, Any]]:
    """Route ``params``' parameters into the param groups of configuration ``name``.

    ``params`` is the ``nn.Module`` or what ``torch.optim`` takes as ``params``, and
    ``model`` the module that holds them, as for :func:`make_optimizer`.

    Returns one group per kind (``embedding``, ``dense``, ``vector``) and layout, each with
    ``params``, ``param_names``, ``kind``, ``rule``, ``lr``, the rule's hyperparameters
    (``betas`` where the rule has momentum) and the matrix axes ``fan_in_dim``/``fan_out_dim``
    (a dim or a tuple of dims; ``None`` for vectors): an ``nn.Linear`` ``(out, in)`` is
    ``(1, 0)``, a transformers ``Conv1D`` ``(in, out)`` is ``(0, 1)``, a ``Conv2d``
    ``((1, 2, 3), 0)``; a group whose route has a view (DBRX's flattened experts, peft's
    LoRA factors of fused experts) also has ``view``, the shape its axes count in.
    ``overrides`` are those of :func:`make_optimizer`.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 2: the rule of each kind).
    """
    return _plan(params, name, lr, overrides, model)[0]


def make_optimizer(name: str, params: nn.Module | Iterable[Any] | None = None,
                   lr: float | None = None, *, model: nn.Module | None = None,
                   **overrides: Any) -> ConfiguredOptimizer:
    """Build one of the paper's eight configurations for ``model`` as one optimizer.

    Args:
      name: ``adamw``, ``lion``, ``apollo``, ``sinkgd-pure``, ``sinkgd-hybrid``,
        ``lion-hybrid``, ``sage-pure`` or ``sage-hybrid`` (same table and defaults as
        :func:`sage_optax.make_optimizer`).
      params: the ``nn.Module`` whose parameters to train (:func:`sage_torch.route_params`
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
        updates a table and a Linear with the same axes alike).  As in ``torch.optim``, a
        parameter in two groups raises a ``ValueError`` and one listed twice in a group
        warns (kept once).  Frozen parameters (``requires_grad=False``) are routed and kept
        in their group: they are skipped while their ``grad`` is ``None`` and train once
        unfrozen (one that nothing places is left out, with a warning naming it).
      model: the ``nn.Module`` holding the tensors of ``params`` (``make_optimizer(name,
        groups, model=model)``): every tensor, bare or named, is placed by the model's
        evidence (module types, API, names), as if the model had been given, while each
        param group keeps its options, e.g. Hugging Face's ``[{"params": decay,
        "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]``; a tensor that
        is not the model's raises a ``ValueError``.  The optimizer keeps the model
        (:attr:`~sage_torch.grouping.ConfiguredOptimizer.model`) to route groups added later.
      lr: learning rate of every group (default: the configuration's paper value).
        Schedulers from ``torch.optim.lr_scheduler`` scale every group's ``lr``.  A kind's
        own rate is one keyword, ``<kind>_learning_rate=`` (``dense_learning_rate=2e-2``);
        a rate whose effective step (rate x the rule's scale, e.g. SinkGD's ``alpha``) is
        far from the configuration's gets a one-time
        :class:`~sage_optim.rates.LearningRateNotice`.
      **overrides: as :func:`sage_optax.make_optimizer`: ``vector="adamw"``,
        ``dense_alpha=5.0``, ``b1=0.891``, ``route_overrides={glob: kind | Route(kind,
        fan_in=..., fan_out=...) | (kind, {"fan_in": ..., "fan_out": ...})}``, plus
        ``maximize``, ``foreach``, ``fused=True`` (opt-in: the Triton kernels of the
        rules that have them, SAGE, Lion and SinkGD, a default on no GPU yet: on an H100
        they were slower than foreach for SinkGD's rule; the other groups keep their
        default path, foreach on CUDA; :data:`sage_torch.common.FUSED_DOC`),
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
      A :class:`~sage_torch.grouping.ConfiguredOptimizer` (a
      :class:`~sage_torch.RuleOptimizer`) whose groups carry their rule and axes (a
      :class:`~sage_torch.nonfinite.SkipNonFinite` when ``skip_nonfinite > 0``); a group
      added later with ``kind=`` gets this configuration's rule for that kind, one with
      neither ``kind`` nor ``rule`` is routed into the kinds.

    Raises:
      RoutingError: a parameter the router cannot place (the message gives the override).

    Examples:
      SAGE-Hybrid for a model: the router reads the module types (``nn.Embedding``,
      ``nn.Linear``) and makes one param group per kind; the optimizer is a
      ``torch.optim.Optimizer`` for schedulers and ``state_dict``:

      >>> import torch, sage_torch
      >>> model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 8))
      >>> opt = sage_torch.make_optimizer("sage-hybrid", model)  # the paper's lr, 2e-3
      >>> for group in opt.param_groups:
      ...     print(group["kind"], group["rule"], group["param_names"])
      embedding sage ['0.weight']
      dense sinkgd ['1.weight']
      vector sage ['1.bias']
      >>> scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=10)
      >>> model(torch.tensor([[1, 2, 3]])).square().mean().backward()
      >>> opt.step()
      >>> scheduler.step()
      >>> print(sorted(opt.state[model[0].weight]), f"{opt.param_groups[0]['lr']:.6f}")
      ['exp_avg', 'scale_avg', 'step'] 0.001951

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 2: the eight configurations; the hybrid structure).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD and its hybrid with AdamW).

      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023 (Lion).

      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024 (APOLLO).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (AdamW).
    """
    overrides = dict(overrides)
    projection = None
    for key in [k for k in overrides if k.endswith("projection")]:
        projection = overrides.pop(key)
    skip = check_skip_nonfinite(overrides.pop("skip_nonfinite", 0))
    cpu_threads = overrides.pop("cpu_threads", 1)
    groups, _, kinds, _ = _plan(params, name, lr, overrides, model)
    module = params if isinstance(params, nn.Module) else model
    if skip:
        return SkipNonFinite(groups, {"lr": 0.0}, projection=projection, kinds=kinds,
                             skip_nonfinite=skip, cpu_threads=cpu_threads, model=module)
    return ConfiguredOptimizer(groups, {"lr": 0.0}, projection=projection, kinds=kinds,
                               cpu_threads=cpu_threads, model=module)


def routing_table(name: str, params: nn.Module | Iterable[Any] | None = None, *,
                  model: nn.Module | None = None, **overrides: Any) -> RoutingTable:
    """Route ``params`` as configuration ``name`` would and count each parameter's state bytes.

    ``params`` and ``model`` are what :func:`make_optimizer` takes: the ``nn.Module``, or
    ``params`` (tensors, pairs, param groups) with or without the ``model`` holding them.

    One :class:`~sage_optim.table.RoutingRow` per trainable parameter, in model order: its
    kind, rule, fan-in and fan-out axes with sizes, the evidence that placed it and its state
    bytes.  The state is created on the ``meta`` device, so nothing is allocated.  Same form
    as :func:`sage_optax.routing_table`; the shared row counts the float32 ``step`` tensors.

    Examples:
      ``print(table)`` shows every column; here, a few of them:

      >>> import torch, sage_torch
      >>> model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 8))
      >>> table = sage_torch.routing_table("sage-hybrid", model)
      >>> for row in table.rows:
      ...     print(row.path, row.kind, row.rule, row.fan_out, row.evidence, row.state_bytes)
      0.weight embedding sage 0 (16) module nn.Embedding 272
      1.weight dense sinkgd(unit, alpha=10) 0 (8) module nn.Linear 0
      1.bias vector sage - shape: 1-D 64

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma; Table 4, optimizer-state memory).
    """
    overrides = {k: v for k, v in overrides.items()
                 if not k.endswith("projection") and k not in ("skip_nonfinite", "cpu_threads")}
    lr = overrides.pop("lr", None)
    groups, routed, kinds, settings = _plan(params, name, lr, overrides, model, frozen=False,
                                            notice=False)
    opt = RuleOptimizer([{**g, "params": [torch.empty_like(p, device="meta")
                                          for p in g["params"]]} for g in groups], {"lr": 0.0})
    nbytes: dict[str, int] = {}
    for group in opt.param_groups:
        rule = opt.rule_of(group)
        for p, pname in zip(group["params"], group["param_names"], strict=True):
            state = rule.init_state(viewed(p, group, pname), group, pname)
            nbytes[pname] = state_nbytes({k: v for k, v in state.items()
                                          if k not in rule.host_keys})
    rows = []
    for r in routed:
        route = r.route
        rows.append(RoutingRow(
            path=r.name, shape=tuple(r.param.shape), kind=route.kind,
            rule=settings.kind(route.kind).describe(), fan_in=route.describe_fan_in(),
            fan_out=route.describe_fan_out(), evidence=route.evidence,
            state_bytes=nbytes[r.name],
            step=rates.describe_step(settings.kind(route.kind), kinds[route.kind]["lr"]),
        ))
    return RoutingTable(name, tuple(rows), 4 * len(rows))  # a float32 step counter each


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in one parameter's state, without its ``step`` counter."""
    return sum(v.numel() * v.element_size() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")
