"""The multi-rule ``torch.optim.Optimizer``: :class:`RuleOptimizer` (the base of every class).

Every class is a :class:`RuleOptimizer`: each param group carries the name of its update
rule (``group["rule"]``) and that rule's hyperparameters, so one optimizer can run SAGE on
the embedding and SinkGD on the dense matrices (what :func:`sage_torch.make_optimizer`
returns) while ``torch.optim.lr_scheduler`` and ``state_dict`` work as with any optimizer.
Defaults come from the table shared with :mod:`sage_optax` (:mod:`sage_optim.presets`).
As ``torch.optim.Optimizer``, this base knows no algorithm: it imports no algorithm module
and finds the rules in :mod:`sage_torch.registry`, where each algorithm module registers
its own.
"""

from __future__ import annotations

import itertools
import math
import numbers
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from sage_optim.kernels import kernels_enabled, warn_overridden
from sage_optim.presets import RULE_DEFAULTS
from sage_torch import fused_check, registry
from sage_torch.common import FUSED_RULES, Projection, UpdateRule, fused_unsupported

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]


_COMMON_DEFAULTS = {"maximize": False, "foreach": None, "fused": None, "capturable": False,
                    "fan_in_dim": -1, "fan_out_dim": -2}
_MOMENTUM_KEYS = ("betas", "momentum")


def _names_of(groups: Any) -> list[list[str]] | None:
    """Every group's ``param_names`` (``None`` unless every group has a full, unique list)."""
    if not isinstance(groups, list | tuple) or not groups:
        return None
    names = []
    for g in groups:
        if not isinstance(g, Mapping):
            return None
        n = g.get("param_names")
        if not isinstance(n, list | tuple) or len(n) != len(g.get("params", ())):
            return None
        names.append([str(x) for x in n])
    flat = [x for n in names for x in n]
    return names if len(set(flat)) == len(flat) else None


_PLACEHOLDER = re.compile(r"(param_groups\[\d+\]\.)?params\[\d+\]")


def _placeholders(names: list[list[str]]) -> bool:
    """Whether every name is a placeholder generated for a bare tensor.

    ``param_groups[0].params[1]`` or ``params[1]``: the names of an optimizer built from
    ``parameters()``, not ``named_parameters()``.
    """
    return all(_PLACEHOLDER.fullmatch(n) for group in names for n in group)


def _by_names(state_dict: dict[str, Any], groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``state_dict`` with its groups and parameters in the order of ``groups``, by name.

    Where both sides record real ``param_names`` in every group, each parameter of
    ``groups`` is matched to the saved parameter of its name (and each group to the saved
    group holding its parameters); elsewhere ``state_dict`` is returned as it is (matched
    by position, as ``torch.optim`` matches): where one side has no names, or only the
    placeholders given to bare tensors (an optimizer built from ``parameters()`` loading
    one built from ``named_parameters()``, or the other way).  Saved placeholders do not
    replace this optimizer's own names.

    Raises:
      ValueError: the names cannot be matched one to one (a name on one side only, or a
        group whose parameters were saved in several groups), naming the first.
    """
    saved_groups = state_dict.get("param_groups")
    mine, theirs = _names_of(groups), _names_of(saved_groups)
    if theirs is not None and _placeholders(theirs) and (mine is None or not _placeholders(
            mine)):
        # Saved by an optimizer built from bare tensors: by position, as torch.optim, and
        # this optimizer keeps its own names (torch.optim would take the placeholders).
        assert isinstance(saved_groups, list | tuple)
        return {**state_dict, "param_groups": [
            {k: v for k, v in g.items() if k != "param_names"} for g in saved_groups]}
    if mine is None or theirs is None or _placeholders(mine) or mine == theirs or len(
            mine) != len(theirs) or sorted(map(len, mine)) != sorted(map(len, theirs)):
        return state_dict  # by position (other counts: check_state_dict names them)
    assert isinstance(saved_groups, list | tuple)
    where = {name: (gi, i) for gi, names in enumerate(theirs) for i, name in enumerate(names)}
    ours = {name for names in mine for name in names}
    for names in mine:
        for name in names:
            if name not in where:
                raise ValueError(f"state dict does not fit: parameter {name!r} of this "
                                 "optimizer is not in the state dict's param_names (it cannot "
                                 "be matched by name; to match by position, delete "
                                 "'param_names' from the state dict's param_groups)")
    extra = [name for name in where if name not in ours]
    if extra:
        raise ValueError(f"state dict does not fit: parameter {extra[0]!r} of the state dict "
                         "is not in this optimizer's param_names (it cannot be matched by "
                         "name; to match by position, delete 'param_names' from the state "
                         "dict's param_groups)")
    out_groups = []
    used: dict[int, int] = {}
    for index, names in enumerate(mine):
        homes = {where[name][0] for name in names}
        if len(homes) > 1 or (homes and next(iter(homes)) in used):
            raise ValueError(f"state dict does not fit: the parameters of param group {index} "
                             f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
                             "are not one param group of the state dict")
        if not homes:  # an empty group: the saved group at its position
            out_groups.append(saved_groups[index])
            continue
        home = homes.pop()
        used[home] = index
        saved = saved_groups[home]
        out_groups.append({**saved, "params": [saved["params"][where[n][1]] for n in names],
                           "param_names": list(names)})
    return {**state_dict, "param_groups": out_groups}


def _tensor_steps(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every ``step`` that is a Python number as a float32 tensor.

    A shallow copy (the caller's dict is left as it is); anything else, a ``step`` of
    another type included, is kept for :meth:`RuleOptimizer.check_state_dict` to judge.
    """
    saved = state_dict.get("state")
    if not isinstance(saved, Mapping):
        return dict(state_dict)
    state: dict[Any, Any] = {}
    for pid, st in saved.items():
        step = st.get("step") if isinstance(st, Mapping) else None
        if isinstance(step, numbers.Real) and not isinstance(step, bool):
            st = {**st, "step": torch.tensor(float(step), dtype=torch.float32)}
        state[pid] = st
    return {**state_dict, "state": state}


_OWN_KEYS = frozenset({"params", "param_names", "rule"})
"""Group keys a saved group must bring itself: what it holds and which rule it is for."""


def _with_missing_options(state_dict: dict[str, Any],
                          groups: list[dict[str, Any]]) -> dict[str, Any]:
    """``state_dict`` with each saved group's missing options taken from ``groups``.

    A checkpoint written before an option existed (``maximize``, ``foreach``,
    ``capturable``, ...) lacks it; ``torch.optim`` fills such flags in when it loads one
    (its ``__setstate__``), where the step would otherwise end in a ``KeyError``.  Each
    option a saved group lacks is taken from this optimizer's group at the same position,
    the group :meth:`RuleOptimizer.check_state_dict` validates it as.  ``params``,
    ``param_names`` and ``rule`` are never filled in (a group without a ``rule`` is
    refused).  A shallow copy; a state dict whose groups do not pair up is returned as it
    is, for the check to refuse.
    """
    saved = state_dict.get("param_groups")
    if (not isinstance(saved, list | tuple) or len(saved) != len(groups)
            or not all(isinstance(g, Mapping) for g in saved)):
        return state_dict
    filled = [{**{k: v for k, v in group.items() if k not in _OWN_KEYS}, **g}
              for group, g in zip(groups, saved, strict=True)]
    return {**state_dict, "param_groups": filled}


def _with_rule_defaults(group: dict[str, Any], rule: str) -> dict[str, Any]:
    """``group`` with every hyperparameter of ``rule`` it lacks set to the rule's default.

    In place, and returned; a rule with momentum keeps it in ``betas``.
    """
    for key in RULE_DEFAULTS[rule]:
        if key in ("b1", "b2", "projection"):
            continue
        group.setdefault(key, RULE_DEFAULTS[rule][key])
    if "b1" in RULE_DEFAULTS[rule]:  # a rule with momentum keeps it in betas
        group.setdefault("betas", (RULE_DEFAULTS[rule]["b1"], RULE_DEFAULTS[rule]["b2"]))
    return group


def _drop_duplicates(group: dict[str, Any]) -> None:
    """Keep each parameter of ``group`` once (``torch.optim`` has warned of the duplicate).

    ``torch.optim`` keeps both and steps the parameter twice; here the second is dropped.
    """
    params = group["params"]
    if len({id(p) for p in params}) == len(params):
        return
    first: dict[int, int] = {}
    for i, p in enumerate(params):
        first.setdefault(id(p), i)
    keep = sorted(first.values())
    group["params"] = [params[i] for i in keep]
    if len(group.get("param_names") or []) == len(params):
        group["param_names"] = [group["param_names"][i] for i in keep]


def viewed(p: Tensor, group: Mapping[str, Any], name: str = "") -> Tensor:
    """``p`` as its group's ``view`` shape (a view sharing its storage), else ``p`` itself.

    A param group's ``view`` (set by :func:`sage_torch.make_optimizer` from a route's
    ``view``, e.g. DBRX's flattened experts ``(E·n, d)`` as ``(E, n, d)``) is the shape the
    rule sees the parameter, its gradient and its state in; the axes
    (``fan_in_dim``/``fan_out_dim``) count in it.

    Raises:
      ValueError: a ``view`` that is not a shape, has another number of elements than the
        parameter, or a parameter that cannot be viewed (not contiguous), naming it.
    """
    view = group.get("view")
    if view is None:
        return p
    if (not isinstance(view, tuple | list) or not view
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in view)):
        raise ValueError(f"param group option view must be a tuple of positive ints (a "
                         f"shape), got {view!r}")
    view = tuple(view)
    if tuple(p.shape) == view:
        return p
    if p.numel() != math.prod(view):
        raise ValueError(f"parameter {name or '<unnamed>'} of shape {tuple(p.shape)} cannot be "
                         f"viewed as {view} (its param group's view): {p.numel()} elements, "
                         f"not {math.prod(view)}")
    try:
        return p.view(view)
    except RuntimeError:
        raise ValueError(f"parameter {name or '<unnamed>'} of shape {tuple(p.shape)} cannot be "
                         f"viewed as {view} (its param group's view) without a copy: make it "
                         "contiguous") from None


def _real(t: Any) -> Any:
    return torch.view_as_real(t) if isinstance(t, Tensor) and t.is_complex() else t


def _device_parts(params: list[Tensor], batched: bool) -> list[list[int]]:
    """The indices of ``params``, one part per (device, dtype) when ``batched``.

    Foreach and fused kernels take one device and dtype; otherwise all are one part.
    """
    parts = [list(range(len(params)))]
    if batched and len({(p.device, p.dtype) for p in params}) > 1:
        keys = sorted({(str(p.device), str(p.dtype)) for p in params})
        parts = [[i for i, p in enumerate(params) if (str(p.device), str(p.dtype)) == k]
                 for k in keys]
    return parts


def _as_real(params: list[Tensor], grads: list[Tensor], states: list[dict[str, Any]]
             ) -> tuple[list[Tensor], list[Tensor], list[dict[str, Any]]]:
    """Complex parameters, gradients and state as ``torch.view_as_real`` views.

    What ``torch.optim.Adam``/``AdamW`` do with complex parameters: the element-wise rules
    then treat the real and imaginary parts as two real numbers; the views share storage,
    so the step writes the complex tensors.
    """
    return ([_real(p) for p in params], [_real(g) for g in grads],
            [{k: _real(v) for k, v in st.items()} for st in states])


class MomentumError(ValueError):
    """A scheduler asked to cycle the momentum of a group whose rule has none.

    Examples:
      ``OneCycleLR`` cycles ``betas`` by default; SinkGD keeps no momentum:

      >>> import torch, sage_torch
      >>> w = torch.nn.Parameter(torch.zeros(3, 4))
      >>> opt = sage_torch.SinkGD([w])
      >>> try:
      ...     torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.01, total_steps=10)
      ... except sage_torch.MomentumError as e:
      ...     print(str(e)[:55])
      param group 0 (kind '-', rule 'sinkgd') has no momentum
      >>> scheduler = torch.optim.lr_scheduler.OneCycleLR(
      ...     opt, max_lr=0.01, total_steps=10, cycle_momentum=False)
      >>> print(f"{opt.param_groups[0]['lr']:.6f}")
      0.000400

    References:
      Smith and Topin, `Super-Convergence: Very Fast Training of Neural Networks Using Large
      Learning Rates <https://arxiv.org/abs/1708.07120>`_, 2017 (``OneCycleLR``).

      Smith, `Cyclical Learning Rates for Training Neural Networks
      <https://arxiv.org/abs/1506.01186>`_, 2017 (``CyclicLR``).
    """


class _Defaults(dict):
    """``optimizer.defaults`` that answers torch's schedulers for every group.

    ``OneCycleLR``/``CyclicLR`` with ``cycle_momentum=True`` ask ``"betas" in
    optimizer.defaults`` and then rewrite ``group["betas"]`` of every group.  A rule without
    momentum (SinkGD, unit_norm) has no ``betas``; instead of torch's ``KeyError`` half-way
    through the groups (after changing the others' beta1), the question itself raises a
    :class:`MomentumError` naming the group and its rule, before anything is changed.
    """

    owner: Any = None

    def __contains__(self, key: object) -> bool:
        optimizer = self.owner
        if key not in _MOMENTUM_KEYS or optimizer is None or not optimizer.param_groups:
            return super().__contains__(key)
        if key == "momentum":
            return False
        for index, group in enumerate(optimizer.param_groups):
            if "betas" not in group:
                names = list(group.get("param_names") or [])
                shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
                raise MomentumError(
                    f"param group {index} (kind {group.get('kind', '-')!r}, rule "
                    f"{group['rule']!r}{': ' + shown if shown else ''}) has no momentum "
                    f"('betas'): the {group['rule']} rule keeps none, so a scheduler cannot "
                    "cycle it. Pass cycle_momentum=False to OneCycleLR/CyclicLR (the learning "
                    "rate of every group is still scheduled), or give that group a rule with "
                    f"betas ({', '.join(r for r, d in RULE_DEFAULTS.items() if 'b1' in d)})"
                )
        return True


class RuleOptimizer(torch.optim.Optimizer):
    """An optimizer whose param groups each name their update rule.

    Args:
      params: parameters or param groups; every group must have a ``"rule"`` (a rule of
        :data:`sage_optim.presets.RULE_DEFAULTS` registered in :mod:`sage_torch.registry`:
        ``"sage"``, ``"sinkgd"``, ``"lion"``, ``"adamw"``, ``"apollo"``, ``"unit_norm"``)
        unless ``defaults`` gives one, and that rule's hyperparameters.
      defaults: default group options (``lr``, ``weight_decay``, ``maximize``,
        ``foreach``, ``fused``, ``capturable``, ``fan_in_dim``, ``fan_out_dim`` and rule
        hyperparameters).  ``foreach``/``fused`` default as in ``torch.optim``: foreach on
        CUDA (and under ``torch.compile``, :meth:`_unfused`), single-tensor elsewhere, the
        fused (Triton) path only with ``fused=True`` (:data:`sage_torch.common.FUSED_DOC`).
      projection: APOLLO's projection, ``projection(name, refresh_index, n, rank) -> P``,
        to inject a fixed ``P`` (parity with :mod:`sage_optax`); default Gaussian.
      cpu_threads: threads of the chunked in-place CPU path (:mod:`sage_torch.chunked`);
        the default 1 starts no thread and leaves ``torch.set_num_threads`` alone.
      kinds: ``{kind: group options}`` (:func:`sage_torch.make_optimizer` passes its
        configuration's): a group added with ``kind=`` and no ``rule`` gets that kind's rule,
        hyperparameters and learning rate.

    Param groups may set ``fallback`` (the classes' ``fallback=`` argument): a rule name
    (``"adamw"``) or a dict of group options with a ``"rule"``; the parameters the group's
    rule cannot treat (a vector under SinkGD or APOLLO, a complex tensor under SAGE, SinkGD
    or APOLLO) then go to a group of their own, appended after it, with that rule, the
    group's ``lr``, ``weight_decay``, ``maximize``, ``foreach`` and ``capturable``, and the
    fallback rule's defaults for its other hyperparameters (a dict's keys win).  Without a
    fallback such a parameter raises a ``ValueError`` naming it and why.  Complex
    parameters are trained by the element-wise rules (``adamw``, ``lion``, ``unit_norm``)
    as ``torch.optim`` trains them: as ``torch.view_as_real`` pairs of reals.

    ``fan_in_dim``/``fan_out_dim`` are a dim or a tuple of dims (merged into one matrix axis,
    :class:`sage_torch.common.MatrixView`); ``fan_out_dim=None`` makes SAGE element-wise.
    A group may set ``view`` (a shape, :func:`viewed`): its rule then sees each parameter
    and gradient as ``p.view(view)`` (DBRX's flattened experts ``(E·n, d)`` as
    ``(E, n, d)``), the axes count in it, and the state has its shape.
    Groups without ``param_names`` get generated names (``param_groups[2].params[0]``) when
    other groups have names, so named and unnamed groups mix.  A rule with momentum keeps it
    in ``betas``, the key torch's schedulers read; asking to cycle the momentum of a group
    whose rule has none raises a :class:`MomentumError` naming it.

    Parameter state is created lazily on the first step, by :meth:`_init_group` (which
    ``torch.compile`` runs outside the graph, as ``torch.optim``'s: a compiled step compiles
    once, as with ``torch.optim.AdamW``).  A parameter's ``state`` holds a
    float32 ``"step"`` and the rule's tensors; floating state keeps its own dtype through
    ``state_dict``/``load_state_dict`` (``torch.optim.Optimizer`` would cast it to the
    parameter's dtype, turning SAGE's float32 ``S`` of a bfloat16 parameter into bfloat16).

    Examples:
      One optimizer, three rules: each group names its rule and sets any of its
      hyperparameters; the others are the rule's defaults:

      >>> import torch, sage_torch
      >>> model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 8))
      >>> opt = sage_torch.RuleOptimizer([
      ...     {"params": [model[0].weight], "rule": "sage"},
      ...     {"params": [model[1].weight], "rule": "sinkgd", "alpha": 5.0},
      ...     {"params": [model[1].bias], "rule": "adamw", "weight_decay": 0.0},
      ... ], {"lr": 1e-3})
      >>> for group in opt.param_groups:
      ...     print(group["rule"], group.get("betas"), group["weight_decay"])
      sage (0.9, 0.99) 0.01
      sinkgd None 0.01
      adamw (0.9, 0.99) 0.0
      >>> model(torch.tensor([[1, 2, 3]])).square().mean().backward()
      >>> opt.step()
      >>> print([sorted(opt.state[p]) for p in model.parameters()])
      [['exp_avg', 'scale_avg', 'step'], ['step'], ['exp_avg', 'exp_avg_sq', 'step']]

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (one rule per parameter kind: the hybrid structure).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (AdamW; the decoupled weight decay of
      every rule).
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any],
                 projection: Projection | None = None,
                 kinds: Mapping[str, Mapping[str, Any]] | None = None, *,
                 cpu_threads: int = 1) -> None:
        if isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1:
            raise ValueError(f"cpu_threads must be a positive int, got {cpu_threads!r}")
        self._projection = projection
        self._cpu_threads = cpu_threads
        self._rules: dict[str, UpdateRule] = self._make_rules()
        self.kinds: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (kinds or {}).items()}
        merged = _Defaults({**_COMMON_DEFAULTS, **defaults})
        rule = merged.get("rule")
        if isinstance(rule, str) and rule in self._rules:
            # The hyperparameters before the params, as torch.optim checks lr (then eps,
            # betas, weight_decay) before it reads params: params=None with lr=-1 names lr.
            self._rules[rule].validate(_with_rule_defaults(dict(merged), rule))
        super().__init__(params, merged)
        merged.owner = self

    def _make_rules(self) -> dict[str, UpdateRule]:
        """A fresh instance of every rule, with this optimizer's projection and threads."""
        rules = registry.make_rules(self._projection)
        for rule in rules.values():
            rule.cpu_threads = self._cpu_threads
        return rules

    def __getstate__(self) -> dict[str, Any]:
        """What pickling (``torch.save(opt)``, ``copy.deepcopy(opt)``) keeps of the optimizer.

        ``torch.optim.Optimizer``'s ``defaults``, ``state`` and ``param_groups``, plus the
        :attr:`kinds`, APOLLO's ``projection`` and ``cpu_threads``; the rule objects (which
        hold caches, not state) are rebuilt by :meth:`__setstate__`.  A ``projection`` that
        pickle cannot store (a lambda, a local function) makes ``torch.save`` fail, while
        ``copy.deepcopy`` keeps the function itself.
        """
        return {**super().__getstate__(), "kinds": self.kinds,
                "_projection": self._projection, "_cpu_threads": self._cpu_threads}

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled or copied optimizer, rebuilding its rules (:meth:`__getstate__`).

        Loading a whole optimizer saved by ``torch.save(opt, path)`` needs
        ``torch.load(path, weights_only=False)`` (it unpickles Python objects, so only load
        files you trust); the portable form is ``opt.state_dict()`` with
        :meth:`load_state_dict`.  The copy's next step is bit for bit the original's.
        """
        super().__setstate__(state)
        if not isinstance(self.defaults, _Defaults):  # unpickled as a plain dict
            self.defaults = _Defaults(self.defaults)
        self.defaults.owner = self
        self.__dict__.setdefault("kinds", {})
        self.__dict__.setdefault("_projection", None)
        self.__dict__.setdefault("_cpu_threads", 1)
        self._rules = self._make_rules()

    def _name_group(self, param_group: dict[str, Any]) -> None:
        """Generate ``param_names`` where named and unnamed groups would meet.

        Names come as in ``torch.optim`` (2.6+): ``(name, tensor)`` pairs in ``params``, or
        a ``param_names`` list as long as ``params``.
        """
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = param_group["params"] = [params]
        elif not isinstance(params, set):
            params = param_group["params"] = list(params)
        pairs = any(isinstance(p, tuple) for p in params)
        if "param_names" in param_group and not pairs:
            names = param_group["param_names"] = list(param_group["param_names"])
            if len(names) != len(params):
                raise ValueError(f"param group has {len(names)} param_names for "
                                 f"{len(params)} params")
        named = "param_names" in param_group or pairs
        if not self.param_groups:
            return
        index = len(self.param_groups)
        if "param_names" in self.param_groups[0] and not named:
            param_group["param_names"] = [f"param_groups[{index}].params[{i}]"
                                          for i in range(len(params))]
        elif named and "param_names" not in self.param_groups[0]:
            for gi, group in enumerate(self.param_groups):
                group["param_names"] = [f"param_groups[{gi}].params[{i}]"
                                        for i in range(len(group["params"]))]

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group and validate its rule and hyperparameters (``ValueError`` names them).

        The group may give ``param_names`` (or ``(name, tensor)`` pairs) or not, whatever the
        other groups do (missing names are generated).  On an optimizer with :attr:`kinds`
        (from :func:`sage_torch.make_optimizer`), ``kind="dense"`` without a ``rule`` gives
        the group the configuration's rule, hyperparameters and learning rate for that kind
        (keys the group sets win); its matrix axes default to ``nn.Linear``'s ``(out, in)``.
        A group with neither ``kind`` nor ``rule`` is left to :meth:`_place_group`: this
        base places none (it knows no routing), the optimizer that
        :func:`sage_torch.make_optimizer` returns routes it
        (:class:`sage_torch.grouping.ConfiguredOptimizer`).
        As ``torch.optim``, a parameter already in another group raises a ``ValueError``;
        one listed twice in the group warns and is kept once.  Parameters the group's rule
        cannot treat go to its ``fallback`` (see the class docstring) or raise.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
        module = param_group.pop("module", None)
        if module is not None and not isinstance(module, torch.nn.Module):
            raise TypeError(f"param group 'module' must be an nn.Module, got "
                            f"{type(module).__name__}")
        if (param_group.get("kind") is None and "rule" not in param_group
                and self._place_group(param_group, module)):
            return
        kind = param_group.get("kind")
        if kind is not None and "rule" not in param_group and self.kinds:
            if kind not in self.kinds:
                raise ValueError(
                    f"param group has kind {kind!r}; this optimizer's kinds: "
                    f"{', '.join(self.kinds)} (or give a rule=)"
                )
            for key, value in self.kinds[kind].items():
                param_group.setdefault(key, value)
        self._name_group(param_group)
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _drop_duplicates(group)
        rule = group.get("rule")
        if rule not in self._rules:
            self.param_groups.pop()
            raise ValueError(
                f"param group has rule {rule!r}; valid rules: {', '.join(sorted(self._rules))}"
            )
        _with_rule_defaults(group, rule)
        try:
            self._rules[rule].validate(group)
            self._check_fused(group)
            moved = self._unsupported(group)
        except ValueError:
            self.param_groups.pop()
            raise
        if moved:
            self._add_fallback(group, moved)

    def _unsupported(self, group: dict[str, Any]) -> list[int]:
        """Indices of ``group``'s parameters its rule cannot treat (to its fallback).

        Raises:
          ValueError: such a parameter and no ``fallback``, naming it, its shape and why,
            or a ``fallback`` that names no rule.  (The fallback's group is then checked
            as any group: a fallback rule that cannot treat it either raises there.)
        """
        rule = self._rules[group["rule"]]
        fallback = group.get("fallback")
        index = len(self.param_groups) - 1
        if fallback is not None:
            name = fallback.get("rule") if isinstance(fallback, Mapping) else fallback
            if not isinstance(name, str) or name not in self._rules:
                raise ValueError(f"fallback must be a rule name or a dict with a 'rule', one "
                                 f"of {', '.join(sorted(self._rules))}; got {fallback!r} "
                                 f"(param group {index})")
        moved = []
        for i, (p, name) in enumerate(zip(group["params"], self._names(group), strict=True)):
            reason = rule.unsupported(viewed(p, group, name), name)
            if reason is None:
                continue
            if fallback is None:
                raise ValueError(
                    f"{reason} (param group {index}). Give the optimizer a fallback rule for "
                    "such parameters (fallback='adamw', as SinkGD(params, fallback='adamw')), "
                    "or put them in a param group of their own with rule='adamw' or 'lion'")
            moved.append(i)
        return moved

    def _add_fallback(self, group: dict[str, Any], moved: list[int]) -> None:
        """Move the parameters ``moved`` of ``group`` (the last) to its fallback's group."""
        fallback = group["fallback"]
        options = dict(fallback) if isinstance(fallback, Mapping) else {"rule": fallback}
        rule = options["rule"]
        names = self._names(group)
        params = [p for i, p in enumerate(group["params"]) if i in set(moved)]
        group["params"] = [p for i, p in enumerate(group["params"]) if i not in set(moved)]
        if "param_names" in group:
            group["param_names"] = [n for i, n in enumerate(names) if i not in set(moved)]
        if not group["params"]:
            self.param_groups.pop()
        defaults: dict[str, Any] = dict(RULE_DEFAULTS[rule])
        for key in ("b1", "b2", "projection"):
            defaults.pop(key, None)
        if "b1" in RULE_DEFAULTS[rule]:
            defaults["betas"] = (RULE_DEFAULTS[rule]["b1"], RULE_DEFAULTS[rule]["b2"])
        new: dict[str, Any] = {
               **{k: v for k, v in group.items() if k not in ("params", "param_names")},
               **defaults,
               **{k: group[k] for k in ("lr", "weight_decay", "maximize", "foreach",
                                        "capturable") if k in group},
               "fused": None, "fallback": None, "fan_in_dim": None, "fan_out_dim": None,
               **options, "params": params}
        if "param_names" in group or self.param_groups and "param_names" in self.param_groups[0]:
            new["param_names"] = [n for i, n in enumerate(names) if i in set(moved)]
        if "kind" in group:
            new["kind"] = group["kind"]
        self.add_param_group(new)

    def _place_group(self, param_group: dict[str, Any], module: torch.nn.Module | None
                     ) -> bool:
        """Place a group added without ``kind`` or ``rule``; ``True`` if it added it itself.

        This base knows no routing: it places nothing, and a group's ``module`` (evidence
        for routing) is refused.  :class:`sage_torch.grouping.ConfiguredOptimizer`, what
        :func:`sage_torch.make_optimizer` returns, routes such a group into its kinds.
        """
        if module is not None:
            raise ValueError(
                "param group gives module=, which routes its parameters by kind: only an "
                "optimizer from sage_torch.make_optimizer routes; give this optimizer's "
                "group fan_in_dim=/fan_out_dim= (or rule=) instead")
        return False

    def _check_fused(self, group: dict[str, Any]) -> None:
        """Check the group's ``fused``/``foreach`` options, as ``torch.optim`` does.

        ``fused=True`` is refused with ``foreach=True``, for a rule without a fused path
        (:data:`~sage_torch.common.FUSED_RULES`) and for a parameter the kernels cannot
        take (not CUDA, not float32/float64/bfloat16, or no ``triton``); the message
        names it.
        """
        fused = group.get("fused")
        if fused is None:
            return
        index = len(self.param_groups) - 1
        if not isinstance(fused, bool):
            raise ValueError(f"fused must be True, False or None, got {fused!r} "
                             f"(param group {index})")
        if fused and group.get("foreach"):
            raise ValueError(f"fused=True and foreach=True cannot both be set (param group "
                             f"{index}, rule {group['rule']!r}): pick one path")
        if fused and not self._rules[group["rule"]].has_fused:
            raise ValueError(
                f"fused=True: the {group['rule']} rule of param group {index} has no fused "
                f"path (rules with one: {', '.join(FUSED_RULES)}); use foreach=True for it"
            )
        if fused:
            for p, name in zip(group["params"], self._names(group), strict=True):
                reason = fused_unsupported(p, name)
                if reason is not None:
                    raise ValueError(f"{reason} (param group {index})")

    def rule_of(self, group: dict[str, Any]) -> UpdateRule:
        """The update rule (state layout, checks, step) that runs ``group``."""
        return self._rules[group["rule"]]

    def _names(self, group: dict[str, Any]) -> list[str]:
        names = group.get("param_names")
        if names:
            return list(names)
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return [f"param_groups[{index}].params[{i}]" for i in range(len(group["params"]))]

    def _init_group(self) -> None:
        """Check every group's gradients and create the state its parameters lack.

        :meth:`step` calls it first, once for all groups (``torch.optim``'s optimizers call
        theirs once per group).  Under ``torch.compile`` Dynamo runs a method of this name
        eagerly instead of tracing it (``torch/_dynamo/variables/optimizer.py``), then
        traces the rest of the step, which only reads the state: the first compiled step
        creates the state outside the graph, so the second reuses the graph instead of
        recompiling for the state that now exists (a traced ``if not state:`` would guard
        on the state being empty).  One call for all groups: Dynamo takes its view of
        ``self.state`` after the first call, and would not see state created by a later one.

        Raises:
          RuntimeError: a sparse gradient (from ``nn.Embedding(sparse=True)``).
          ValueError: a parameter the group's rule cannot treat (a complex one under SAGE).
        """
        position = 0  # the parameter's number in the state dict: no name enters the state
        for index, group in enumerate(self.param_groups):
            rule = self.rule_of(group)
            start, position = position, position + len(group["params"])
            for offset, (p, name) in enumerate(zip(group["params"], self._names(group),
                                                   strict=True)):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients: parameter "
                        f"{name} of shape {tuple(p.shape)} (param group {index}, rule "
                        f"{group['rule']!r}) has one. It comes from an nn.Embedding/"
                        "nn.EmbeddingBag built with sparse=True: build it with sparse=False "
                        "(sage_torch.make_optimizer refuses such a model up front)"
                    )
                seen = viewed(p, group, name)
                reason = rule.unsupported(seen, name)  # a group edited since it was added
                if reason is not None:
                    raise ValueError(f"{reason} (param group {index})")
                state = self.state[p]
                if not state:
                    # on the parameter's device with capturable=True (as torch.optim.Adam)
                    state["step"] = torch.tensor(
                        0.0, dtype=torch.float32,
                        device=p.device if group.get("capturable", False) else None)
                    state.update(rule.init_state(seen, group, name, start + offset))

    @torch.no_grad()
    def step(  # type: ignore[override]  # one signature for torch.optim's two overloads
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Perform one optimization step (``closure`` re-evaluates the model, as usual).

        A group whose ``lr`` is a Python number that is not finite (a schedule such as
        ``LambdaLR`` returned NaN) is refused with a ``ValueError`` before any parameter
        or state changes; ``torch.optim`` would step every parameter to NaN.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _check_lrs(self) -> None:
        """Refuse a step with a non-finite ``lr`` in any param group (one line naming it)."""
        for index, group in enumerate(self.param_groups):
            lr = group["lr"]
            if isinstance(lr, int | float) and not math.isfinite(lr):
                raise ValueError(
                    f"lr is {lr} in param group {index} (set by a learning-rate schedule, or "
                    "by hand, after the optimizer was built): a step with it would make every "
                    "parameter NaN, so none was taken; fix the schedule")

    def _with_grads(self, group: dict[str, Any]) -> tuple[
            list[Tensor], list[Tensor], list[dict[str, Any]], list[str]]:
        """``group``'s parameters that have a gradient: ``(params, grads, states, names)``.

        The gradient negated under ``maximize``; a parameter with a ``view`` and its
        gradient reshaped to it (the rule sees the view, its state too).
        """
        params, grads, states, names = [], [], [], []
        for p, name in zip(group["params"], self._names(group), strict=True):
            if p.grad is not None:
                grad = -p.grad if group["maximize"] else p.grad
                states.append(self.state[p])
                if group.get("view") is not None:  # the rule sees the view (state too)
                    p, grad = viewed(p, group, name), grad.reshape(group["view"])
                params.append(p)
                grads.append(grad)
                names.append(name)
        return params, grads, states, names

    def _update(self) -> None:
        """The step itself, without the closure and the step hooks (run by :meth:`step`).

        A subclass whose ``step`` decides whether to update (``SkipNonFinite``) calls this,
        not ``super().step()``, which would run the step hooks a second time.
        """
        self._check_lrs()  # before anything moves
        sizes = [p.numel() * p.element_size() for group in self.param_groups
                 for p in group["params"]]
        largest = max(sizes) if sizes else 0  # (torch.compile traces no max(default=))
        for rule in self._rules.values():
            rule.largest_param_bytes = largest
        self._init_group()
        for group in self.param_groups:
            rule = self.rule_of(group)
            params, grads, states, names = self._with_grads(group)
            if not params:
                continue
            if any(p.is_complex() for p in params):  # as torch.optim: pairs of reals
                params, grads, states = _as_real(params, grads, states)
            foreach, fused = self._paths(group, rule, params, names)
            steps = [st["step"] for st in states]
            if foreach or fused:
                torch._foreach_add_(steps, 1)
            else:
                for t in steps:
                    t += 1
            for idx in _device_parts(params, foreach or fused):
                sub = [params[i] for i in idx]
                fe, fu = foreach, fused
                if fused and not self._fused_ready(sub[0]):
                    fe, fu = self._unfused(group, sub), False
                rule.step(sub, [grads[i] for i in idx], [states[i] for i in idx],
                          [names[i] for i in idx], group, fe, fused=fu)

    @staticmethod
    def _fused_ready(p: Tensor) -> bool:
        """Whether the fused kernels passed their first-use check on ``p``'s device and dtype.

        :func:`sage_torch.fused_check.fused_ready`: run once per device and dtype in the
        process; a failure warns once, and those steps take the path of ``fused=None``
        (:meth:`_unfused`: foreach on CUDA).
        """
        return fused_check.fused_ready(p.device, p.dtype)

    @staticmethod
    def _unfused(group: dict[str, Any], params: list[Tensor]) -> bool:
        """Whether ``group`` takes foreach where it does not take the fused path.

        Its ``foreach`` when set, else ``torch.optim``'s default: foreach when every
        parameter is a CUDA tensor, single-tensor otherwise; and foreach under
        ``torch.compile``, on any device.  The single-tensor path is the CPU's eager default
        for its speed there (foreach kernels are loops on the CPU) and its memory (the
        chunked path, :mod:`sage_torch.chunked`), neither of which holds in a compiled
        step, while it traces one set of operations per parameter where foreach traces one
        per group (SinkGD: one per matrix shape), which Inductor compiles several times
        faster (``benchmarks/torch_compile.py``).
        """
        foreach = group["foreach"]
        if foreach is None:
            return (torch.compiler.is_compiling()
                    or all(p.device.type == "cuda" for p in params))
        return bool(foreach)

    @staticmethod
    def _paths(group: dict[str, Any], rule: UpdateRule, params: list[Tensor],
               names: list[str]) -> tuple[bool, bool]:
        """``(foreach, fused)`` for this step of ``group``, by ``torch.optim``'s default rule.

        Neither ``foreach`` nor ``fused`` set: foreach when every parameter is a CUDA
        tensor or under ``torch.compile`` (:meth:`_unfused`), else single-tensor; never
        fused, which is opt-in (``fused=True``) as in ``torch.optim``
        (``_default_to_fused_or_foreach``): no GPU has yet shown the kernels correct
        and faster (:data:`sage_optim.kernels.VALIDATED_ON`).  ``fused=True`` is checked
        again (a parameter moved since the optimizer was built, a group edited): a
        parameter the kernels cannot take, or a
        rule without a fused path, raises a ``ValueError`` naming it.  ``SAGE_KERNELS``
        is read here, at every step (:func:`sage_optim.kernels.kernels_enabled`): ``off``
        turns ``fused=True`` into the path ``fused=None`` would take, after a one-time
        warning; another value than ``auto``/``off`` raises a ``ValueError`` naming it.
        The first-use check of the kernels (per device and dtype) is made by
        :meth:`step`.
        """
        if not group.get("fused"):
            return RuleOptimizer._unfused(group, params), False
        if not kernels_enabled():
            warn_overridden("fused=True")
            return RuleOptimizer._unfused(group, params), False
        if not rule.has_fused:
            raise ValueError(f"fused=True: the {rule.name} rule has no fused path (rules with "
                             f"one: {', '.join(FUSED_RULES)}); use foreach=True for it")
        for p, name in zip(params, names, strict=True):
            reason = fused_unsupported(p, name)
            if reason is not None:
                raise ValueError(reason)
        return False, True

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by an optimizer of the same configuration, checked first.

        Before anything is changed, the state dict is checked against this optimizer
        (:meth:`check_state_dict`): the same number of param groups, of parameters per
        group, the same ``rule`` (and ``kind``) per group, and for every parameter with
        state the rule's state keys, each tensor's shape and dtype family; a mismatch raises
        a one-line ``ValueError`` naming the group, the parameter and what differs, so that
        an ``adamw`` checkpoint never turns this optimizer into another.  An empty or partial
        state (parameters that have not stepped yet) loads.  Each floating state tensor
        keeps its saved dtype (a bfloat16 parameter's float32 state stays float32), and an
        integer state tensor its dtype and device (APOLLO's ``proj_seed``).  A
        ``step`` saved as a Python number (old checkpoints, other tools) is turned into a
        float32 tensor first, as ``torch.optim`` accepts it; everything else is checked as is.
        Where both sides record ``param_names`` (in every group), parameters and groups are
        matched by name, not by position (same-shape parameters listed in another order keep
        their own moments); names that cannot be matched one to one are refused, naming the
        first.  Where one side was built from bare tensors (no names, or only the generated
        ``params[i]`` placeholders), parameters are matched by position, as ``torch.optim``
        does, when the group and parameter counts agree (else a one-line ``ValueError``
        naming the counts); this optimizer keeps its own names.  An option a saved
        group lacks (a checkpoint written before the option existed: ``maximize``,
        ``foreach``, ...) is taken from this optimizer's group, as ``torch.optim``
        fills in flags added after a checkpoint was written.
        """
        state_dict = _by_names(_tensor_steps(state_dict), self.param_groups)
        state_dict = _with_missing_options(state_dict, self.param_groups)
        self.check_state_dict(state_dict)
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params, strict=True):
            for key, saved in state_dict["state"].get(pid, {}).items():
                current = self.state[p].get(key)
                if (isinstance(saved, Tensor) and isinstance(current, Tensor)
                        and current.dtype != saved.dtype):
                    # torch.optim casts all state to the parameter's dtype and device; an
                    # integer (APOLLO's projection seed) stays exact and where it was saved
                    device = current.device if saved.is_floating_point() else saved.device
                    self.state[p][key] = saved.to(device=device, dtype=saved.dtype, copy=True)

    def check_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Raise a one-line ``ValueError`` unless ``state_dict`` fits this optimizer.

        It fits when it has as many param groups, each with as many parameters, each group
        with this optimizer's ``rule`` (and ``kind``, where both have one) and valid
        hyperparameters, and every parameter's saved state (if any) has exactly the keys
        its rule keeps (``step`` and the rule's tensors), each with the shape and dtype
        family (floating or not) that the rule would create for it.  The expected state is
        built on the ``meta`` device: nothing is allocated.
        """
        groups, saved_state = state_dict.get("param_groups"), state_dict.get("state")
        if not isinstance(groups, list | tuple) or not isinstance(saved_state, Mapping):
            raise ValueError("state dict must have 'state' (a dict) and 'param_groups' (a "
                             f"list), got keys {sorted(map(str, state_dict))}")
        if len(groups) != len(self.param_groups):
            raise ValueError(f"state dict has {len(groups)} param groups, this optimizer has "
                             f"{len(self.param_groups)}")
        for index, (group, saved) in enumerate(zip(self.param_groups, groups, strict=True)):
            where = f"param group {index} (kind {group.get('kind', '-')!r})"
            if saved.get("rule") != group["rule"]:
                raise ValueError(f"state dict does not fit: {where} has rule "
                                 f"{saved.get('rule')!r} in the state dict but "
                                 f"{group['rule']!r} in this optimizer")
            if "kind" in saved and "kind" in group and saved["kind"] != group["kind"]:
                raise ValueError(f"state dict does not fit: param group {index} has kind "
                                 f"{saved['kind']!r} in the state dict but {group['kind']!r} "
                                 "in this optimizer")
            where = f"{where[:-1]}, rule {group['rule']!r})"
            if len(saved["params"]) != len(group["params"]):
                raise ValueError(f"state dict does not fit: {where} has "
                                 f"{len(saved['params'])} parameters in the state dict but "
                                 f"{len(group['params'])} in this optimizer")
            # The group as it will be after loading: the saved options, these parameters.
            merged = {**group, **{k: v for k, v in saved.items()
                                  if k not in ("params", "param_names")}}
            rule = self.rule_of(group)
            try:
                rule.validate(merged)
            except ValueError as e:
                raise ValueError(f"state dict does not fit: {where}: {e}") from None
            for pid, p, name in zip(saved["params"], group["params"], self._names(group),
                                    strict=True):
                state = saved_state.get(pid)
                if state:
                    self._check_param_state(state, p, merged, rule, f"parameter {name} of "
                                            f"{where}")

    @staticmethod
    def _check_param_state(state: Mapping[str, Any], p: Tensor, group: dict[str, Any],
                           rule: UpdateRule, where: str) -> None:
        """Check one parameter's saved state against what ``rule`` would create for ``p``."""
        try:
            meta = viewed(torch.empty(tuple(p.shape), dtype=p.dtype, device="meta"), group)
        except ValueError as e:
            raise ValueError(f"state dict does not fit: {where}: {e}") from None
        try:
            expected = {"step": torch.empty((), dtype=torch.float32, device="meta"),
                        **rule.init_state(meta, group, where)}
        except ValueError as e:
            raise ValueError(f"state dict does not fit: {where}: {e}") from None
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise ValueError(
                f"state dict does not fit: {where} has state keys {sorted(state)}, the "
                f"{rule.name} rule keeps {sorted(expected)}"
                + (f" (missing {missing})" if missing else "")
                + (f" (unexpected {extra})" if extra else ""))
        for key, want in expected.items():
            got = state[key]
            if not isinstance(got, Tensor):
                raise ValueError(f"state dict does not fit: {where}: state {key!r} is a "
                                 f"{type(got).__name__}, not a tensor")
            if tuple(got.shape) != tuple(want.shape):
                raise ValueError(f"state dict does not fit: {where}: state {key!r} has shape "
                                 f"{tuple(got.shape)}, this optimizer expects "
                                 f"{tuple(want.shape)}")
            if (got.is_floating_point(), got.is_complex()) != (want.is_floating_point(),
                                                               want.is_complex()):
                family = ("complex" if want.is_complex() else "floating"
                          if want.is_floating_point() else "integer or bool")
                raise ValueError(f"state dict does not fit: {where}: state {key!r} is "
                                 f"{got.dtype}, this optimizer expects a {family} tensor "
                                 f"({want.dtype})")
