"""The optimizer :func:`sage_torch.make_optimizer` returns: param groups are its kinds.

:class:`~sage_torch.RuleOptimizer`, like ``torch.optim.Optimizer``, knows no algorithm and
no routing; :class:`ConfiguredOptimizer` adds what a configuration's kinds need when a
group is added later (``add_param_group``) without ``kind`` or ``rule``: its parameters are
routed (:mod:`sage_torch.routing`) by the module given with them or found in the model the
optimizer was built from, else by their names and shapes, and the group takes its kind's
rule and axes.  :func:`update_key` says which readings of a parameter give the same update
under a configuration (so a reading nothing settles can be left unsettled).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import torch
from torch import Tensor

from sage_optim.routing import ResolvedRoute, Route, RoutingError
from sage_torch import registry
from sage_torch.common import Projection
from sage_torch.optimizer import ParamsT, RuleOptimizer
from sage_torch.routing import Routing, route_group, routing


def update_key(kinds: Mapping[str, Mapping[str, Any]]) -> Callable[[ResolvedRoute], Hashable]:
    """``key(route)``: what update a route gets from a configuration's kind options.

    Its kind's rule and options (learning rate and hyperparameters), plus its axes where the
    rule reads them.  Two routes with one key get the same update: under ``adamw`` every
    route of a matrix, under ``sage-pure`` a table and a dense matrix with the same axes.
    Whether a rule reads the axes is its :attr:`~sage_torch.common.UpdateRule.layout_free`.
    """
    rules = registry.rule_classes()

    def key(route: ResolvedRoute) -> Hashable:
        options = kinds[route.kind]
        hp = tuple(sorted((k, repr(v)) for k, v in options.items()
                          if k not in ("kind", "fan_in_dim", "fan_out_dim")))
        rule = rules.get(options.get("rule", ""))
        if rule is not None and rule.layout_free:
            return hp
        return hp, route.fan_in, route.fan_out, route.batch, route.view

    return key


def accept_equivalent(result: Routing, kinds: Mapping[str, Mapping[str, Any]],
                      why: str) -> None:
    """Place each parameter ``result`` refused whose readings all give the same update.

    A parameter whose matrix options (its remedies but ``'vector'``) all have one
    :func:`update_key` under ``kinds`` gets the first, with the evidence ``why``.  An error
    whose parameters are all placed is dropped.
    """
    key = update_key(kinds)
    by_name = {n: p for n, p, _ in result.order}
    kept: list[RoutingError] = []
    for err in result.errors:
        problems = err.problems or (err,)
        left = []
        for prob in problems:
            route = None
            if prob.leaf is not None and prob.leaf in by_name:
                route = _same_update(prob, prob.leaf, by_name[prob.leaf], key, why)
            if route is None or prob.leaf is None:
                left.append(prob)
            else:
                result.routes[id(by_name[prob.leaf])] = route
        if len(left) == len(problems):
            kept.append(err)
        else:
            kept.extend(left)
    result.errors = kept


def _same_update(prob: RoutingError, name: str, p: Tensor,
                 key: Callable[[ResolvedRoute], Hashable], why: str) -> ResolvedRoute | None:
    candidates = [r for r, _ in prob.options
                  if isinstance(r, Route) and r.kind != "vector" and r.has_axes]
    if not candidates:
        return None
    try:
        resolved = [r.resolve(p.shape, name) for r in candidates]
    except RoutingError:
        return None
    if len({key(r) for r in resolved}) != 1:
        return None
    return dataclasses.replace(resolved[0], evidence=why)



def _negative(route: ResolvedRoute) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A route's axes counted from the end (``(-1,), (-2,)``: every ``(..., out, in)``)."""
    ndim = len(route.shape)
    return tuple(a - ndim for a in route.fan_in), tuple(a - ndim for a in route.fan_out)


class ConfiguredOptimizer(RuleOptimizer):
    """A :class:`~sage_torch.RuleOptimizer` whose groups are a configuration's kinds.

    What :func:`sage_torch.make_optimizer` returns.  A group added without ``kind`` or
    ``rule`` is routed into the kinds: parameters of a module given with them
    (``"module": layer``) or found in :attr:`model` are placed by that module's evidence,
    as :func:`sage_torch.make_optimizer` places a model's, and added as one group per kind
    and layout, each with the group's options; other parameters are routed as
    :func:`sage_torch.route_params` routes tensors and ``(name, tensor)`` pairs: vectors
    make a ``'vector'`` group, named matrices take their kind and axes from their names; a
    group that mixes kinds or layouts, or a matrix nothing places, raises a ``ValueError``
    that names it and the keys to add (``kind=``, ``fan_in_dim=``, ``fan_out_dim=``).

    Attributes:
      model: the ``nn.Module`` the optimizer was built from (``None`` for parameters given
        without it, and in a copy or an unpickled optimizer): groups added later are routed
        by its evidence.
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any],
                 projection: Projection | None = None,
                 kinds: Mapping[str, Mapping[str, Any]] | None = None, *,
                 cpu_threads: int = 1, model: torch.nn.Module | None = None) -> None:
        self.model = model
        super().__init__(params, defaults, projection, kinds, cpu_threads=cpu_threads)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        self.__dict__.setdefault("model", None)  # not pickled: a copy routes no new module

    def _place_group(self, param_group: dict[str, Any], module: torch.nn.Module | None
                     ) -> bool:
        if not self.kinds:
            return super()._place_group(param_group, module)
        if self._route_by_module(param_group, module):
            return True
        self._route_group(param_group)
        return False

    def _route_by_module(self, param_group: dict[str, Any],
                         module: torch.nn.Module | None) -> bool:
        """Route a group added without ``kind``/``rule`` by a module's evidence, if one holds it.

        The module is the group's ``module`` or else :attr:`model`; every parameter of the
        group must be one of its parameters (else ``False``: the group is routed by names
        and shapes, :meth:`_route_group`).  Parameters are placed as
        :func:`sage_torch.route_params` places the module's (module types, API, names) and
        named by it; a group whose parameters get several kinds or layouts (an
        ``nn.Linear``'s weight and bias) is added as one group per kind and layout, each with
        the group's options, as :func:`sage_torch.make_optimizer` groups a model.
        """
        module = module if module is not None else self.model
        if module is None:
            return False
        raw = param_group["params"]
        if isinstance(raw, Tensor):
            raw = [raw]
        elif isinstance(raw, set):
            return False  # torch.optim refuses it, saying why
        raw = list(raw)
        tensors = [x[1] if isinstance(x, tuple) and len(x) == 2 else x for x in raw]
        names = {id(p): n for n, p in module.named_parameters()}
        if not tensors or not all(isinstance(t, Tensor) and id(t) in names for t in tensors):
            param_group["params"] = raw
            return False
        result = routing(module, None, frozen=True)
        if result.errors:
            accept_equivalent(result, self.kinds, "unsettled, no matter: every reading "
                              "gets the same update")
        wanted = {names[id(t)] for t in tensors}
        errors = [e for e in result.errors
                  if any(pr.leaf is None or pr.leaf in wanted for pr in (e.problems or (e,)))]
        if errors:
            raise RoutingError.combine(errors)
        given = param_group.get("param_names")
        own = ([x[0] for x in raw] if all(isinstance(x, tuple) for x in raw)
               else list(given) if given is not None else [names[id(t)] for t in tensors])
        buckets: dict[tuple[str, Any, Any, Any], list[int]] = {}
        for i, t in enumerate(tensors):
            route = result.routes[id(t)]
            fan_in = fan_out = None
            if route.kind != "vector" and route.is_matrix:
                fan_in = route.fan_in[0] if len(route.fan_in) == 1 else route.fan_in
                fan_out = route.fan_out[0] if len(route.fan_out) == 1 else route.fan_out
            buckets.setdefault((route.kind, fan_in, fan_out, route.view), []).append(i)
        options = {k: v for k, v in param_group.items() if k not in ("params", "param_names")}
        order = {k: n for n, k in enumerate(self.kinds)}
        for (kind, fan_in, fan_out, view), idx in sorted(
                buckets.items(), key=lambda kv: order.get(kv[0][0], 99)):
            self.add_param_group({**options, "params": [tensors[i] for i in idx],
                                  "param_names": [own[i] for i in idx], "kind": kind,
                                  "fan_in_dim": fan_in, "fan_out_dim": fan_out,
                                  **({"view": view} if view is not None else {})})
        return True

    def _route_group(self, param_group: dict[str, Any]) -> None:
        """Give a group added without ``kind`` or ``rule`` its kind and axes (by routing)."""
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = param_group["params"] = [params]
        elif isinstance(params, set):
            return  # torch.optim refuses it below, saying why
        else:
            params = param_group["params"] = list(params)
        if not params:
            return
        index = len(self.param_groups)
        members = _members(params, param_group.get("param_names"), index)
        if not all(isinstance(p, Tensor) for _, p, _ in members):
            return  # torch.optim says which is not a tensor
        result = route_group(members, {k: param_group[k] for k in ("fan_in_dim", "fan_out_dim")
                                       if k in param_group})
        if result.errors:
            accept_equivalent(result, self.kinds, "unsettled, no matter: every reading "
                              "gets the same update")
        if result.errors:
            raise self._unplaced(result.errors, param_group, index)
        routes = [(name, result.routes[id(p)]) for name, p, _ in result.order]
        kinds = sorted({r.kind for _, r in routes})
        if len(kinds) > 1:
            listed = ", ".join(f"{n} ({r.kind})" for n, r in routes)
            raise ValueError(
                f"param group {index} mixes kinds ({listed}): one group has one rule; split "
                "it into one group per kind, or give kind= to say which rule they all get")
        param_group["kind"] = kinds[0]
        if kinds[0] == "vector" or "fan_in_dim" in param_group:
            return
        fan_in, fan_out = _one_layout(routes, index)
        param_group["fan_in_dim"] = fan_in[0] if len(fan_in) == 1 else fan_in
        param_group["fan_out_dim"] = fan_out[0] if len(fan_out) == 1 else fan_out

    def _unplaced(self, errors: list[RoutingError], param_group: dict[str, Any],
                  index: int) -> ValueError:
        """The error for a group whose members routing cannot place."""
        problems = [p for e in errors for p in (e.problems or (e,))]
        listed = "; ".join(f"{p.leaf} of shape {p.shape}" if p.leaf else str(p)
                           for p in problems)
        if "fan_in_dim" in param_group:
            return ValueError(
                f"param group {index} gives fan_in_dim/fan_out_dim but no kind, and "
                f"nothing says the kind of {listed}: add kind='dense' (a projection) or "
                "kind='embedding' (a token table or an output head) to the group")
        return ValueError(
            f"param group {index} has no kind and nothing places {listed}: add kind= "
            f"({', '.join(repr(k) for k in self.kinds)}) and, for a matrix, "
            "fan_in_dim=/fan_out_dim= to the group (e.g. kind='dense', fan_in_dim=1, "
            "fan_out_dim=0 for an nn.Linear weight (out, in)), or give (name, tensor) "
            "pairs whose names say it ('...weight' is (out, in))")


def _members(params: list[Any], given: Any, index: int) -> list[tuple[str, Any, bool]]:
    """``(name, tensor, bare)`` of a group's members, named as given or by position.

    Names come from the pairs, else ``param_names``, else ``param_groups[index].params[i]``
    (bare: only the shape is evidence).
    """
    members = []
    for i, p in enumerate(params):
        if isinstance(p, tuple) and len(p) == 2:
            members.append((str(p[0]), p[1], False))
        elif given is not None and i < len(list(given)):
            members.append((str(list(given)[i]), p, False))
        else:
            members.append((f"param_groups[{index}].params[{i}]", p, True))
    return members


def _one_layout(routes: list[tuple[str, ResolvedRoute]],
                index: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The one ``(fan_in, fan_out)`` of a group's matrices (a mix of layouts is refused)."""
    layouts = {_negative(r) for _, r in routes}
    if len(layouts) > 1:
        layouts = {(r.fan_in, r.fan_out) for _, r in routes}
    if len(layouts) > 1:
        listed = ", ".join(f"{n} (fan_in={r.fan_in}, fan_out={r.fan_out})"
                           for n, r in routes)
        raise ValueError(
            f"param group {index} mixes matrix layouts ({listed}): a group has one "
            "fan_in_dim/fan_out_dim; split it into one group per layout")
    return layouts.pop()
