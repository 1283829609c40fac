"""``OptimizerInfo`` entries for every sage_torch optimizer, for PyTorch's own optimizer tests.

PyTorch tests its optimizers with one test class, ``TestOptimRenewed`` (pytorch's
``test/test_optim.py``), run over a table of ``OptimizerInfo`` entries
(``torch.testing._internal.common_optimizers.optim_db``): each names an optimizer class, the
keyword sets to build it with (``optim_inputs_func``), the implementations it has
(``foreach``, ``fused``) and the inputs it must refuse (``optim_error_inputs_func``).  This
module builds that table for sage_torch (:func:`optim_infos`), and
``scripts/torch-optim-contract`` runs pytorch's test class over it.

The entries:

* the classes ``SAGE``, ``Lion``, ``SinkGD`` and ``APOLLO``, and the AdamW and unit-norm
  rules as ``RuleOptimizer`` (``adamw_rule``, ``unit_norm_rule``), each with its own
  hyperparameters; SinkGD and APOLLO take matrices only, so their keyword sets send vectors
  to ``fallback="adamw"``, as a user of the class does;
* every ``make_optimizer`` configuration (``sage_hybrid``, ``sinkgd_pure``, ...).  The tests
  hand the optimizer bare tensors, whose layout nothing tells (``make_optimizer`` refuses a
  matrix it cannot place, on purpose); each entry places a bare matrix as ``nn.Linear``
  reads it, ``(out, in)``, through the ``route_overrides`` a user pastes from that refusal
  (:func:`linear_overrides`).

Importing this module needs ``torch.testing._internal``, which needs ``expecttest``
(``pip install expecttest``); nothing of the project depends on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch.testing._internal.common_optimizers import (
    ErrorOptimizerInput,
    OptimizerInfo,
    OptimizerInput,
    get_error_inputs_for_all_optims,
)

import sage_torch
from sage_optim.presets import CONFIG_NAMES
from sage_optim.routing import Route
from sage_torch import APOLLO, SAGE, Lion, RuleOptimizer, SinkGD

MATRIX_FALLBACK: dict[str, Any] = {"fallback": "adamw"}
"""What the matrices-only classes (SinkGD, APOLLO) get in every keyword set: vectors to AdamW."""


def adamw_rule(params: Any, lr: Any = 1e-3, **kwargs: Any) -> RuleOptimizer:
    """sage_torch's AdamW (``optax.adamw``'s twin) as an optimizer class: one rule, any tensor."""
    return RuleOptimizer(params, {"rule": "adamw", "lr": lr, **kwargs})


def unit_norm_rule(params: Any, lr: Any = 1e-3, **kwargs: Any) -> RuleOptimizer:
    """sage_torch's unit-norm step as an optimizer class (``RuleOptimizer``, rule ``unit_norm``)."""
    return RuleOptimizer(params, {"rule": "unit_norm", "lr": lr, **kwargs})


def _is_matrix(p: torch.Tensor) -> bool:
    """More than one axis longer than 1: what sage_torch's routing cannot place by shape."""
    return sum(1 for n in p.shape if n > 1) >= 2


def _linear_route(p: torch.Tensor) -> Route:
    """``(out, in, *k)`` as ``nn.Linear`` (and ``nn.Conv*d``) read it: fan-out 0, the rest in."""
    fan_in = 1 if p.dim() == 2 else tuple(range(1, p.dim()))
    return Route("dense", fan_in=fan_in, fan_out=0)


def linear_overrides(params: Any) -> tuple[Any, dict[str, Route]]:
    """``params`` (as ``torch.optim`` takes them) and a ``route_overrides`` for its matrices.

    Every matrix is placed as ``nn.Linear`` reads it (:func:`_linear_route`), under the name
    sage_torch's routing gives it: its own name (``named_parameters()``), ``params[i]`` (bare
    tensors) or ``param_groups[g].params[i]`` (bare tensors in param groups).  An iterator
    is read once and returned as a list.
    """
    if isinstance(params, torch.Tensor) or params is None:
        return params, {}
    items = list(params)
    overrides: dict[str, Route] = {}

    def place(members: list[Any], prefix: str) -> None:
        for i, member in enumerate(members):
            name, p = member if isinstance(member, tuple) else (f"{prefix}[{i}]", member)
            if isinstance(p, torch.Tensor) and _is_matrix(p):
                overrides[name] = _linear_route(p)

    if items and all(isinstance(g, dict) for g in items):
        groups = []
        for g, group in enumerate(items):
            members = group.get("params", [])
            members = [members] if isinstance(members, torch.Tensor) else list(members)
            place(members, f"param_groups[{g}].params")
            groups.append({**group, "params": members})
        return groups, overrides
    place(items, "params")
    return items, overrides


def config_optimizer(name: str) -> Callable[..., torch.optim.Optimizer]:
    """``make_optimizer(name, params, ...)`` as an optimizer class, bare matrices placed.

    The returned callable is named after the configuration (``sage-hybrid`` ->
    ``sage_hybrid``), which names the tests.
    """

    def build(params: Any, lr: Any = None, **kwargs: Any) -> torch.optim.Optimizer:
        params, overrides = linear_overrides(params)
        extra: dict[str, Any] = {"route_overrides": overrides} if overrides else {}
        return sage_torch.make_optimizer(name, params, lr=lr, **extra, **kwargs)

    build.__name__ = build.__qualname__ = name.replace("-", "_")
    build.__doc__ = f"``sage_torch.make_optimizer({name!r}, params, ...)``, bare matrices placed."
    return build


def _input(desc: str, kwargs: dict[str, Any]) -> OptimizerInput:
    """An ``OptimizerInput`` without params (the tests bring their own), as torch's are."""
    return OptimizerInput(params=cast(Any, None), kwargs=kwargs, desc=desc)


def _inputs(*specs: tuple[str, dict[str, Any]], base: dict[str, Any] | None = None,
            tensor_lr: float | None = 1e-3) -> Callable[..., list[OptimizerInput]]:
    """An ``optim_inputs_func``: the keyword sets ``specs`` (plus ``base``), fresh each call.

    ``tensor_lr``: add a keyword set with that learning rate as a 0-D tensor (made anew at
    every call: the tests' schedulers write into it).
    """

    def func(device: Any = None, dtype: Any = None) -> list[OptimizerInput]:
        out = [_input(desc, {**(base or {}), **kw}) for desc, kw in specs]
        if tensor_lr is not None:
            out.append(_input("Tensor lr", {**(base or {}), "lr": torch.tensor(tensor_lr)}))
        return out

    return func


OUR_WORDING: dict[str, str] = {
    "Tensor lr must be 1-element": r"lr must be a scalar, got a tensor of shape \(2,\)",
}
"""Where sage_torch words a refusal of torch's error inputs its own way: torch's regex -> ours.

The same input and exception type; the message names the parameter in the project's words
(``"lr must be a scalar, ..."``, as every hyperparameter message: ``"<name> must be ..."``).
"""

ACCEPTED: dict[str, str] = {
    "all optimizer param groups should be with/without names.":
        "sage_torch lets a group of bare tensors join named groups (and the other way): the "
        "bare ones are named by their place, param_groups[g].params[i], so that "
        "make_optimizer's named groups take add_param_group(model.parameters())",
}
"""torch's error inputs (by ``desc``) that sage_torch accepts on purpose, and why.

Left out of :func:`_errors`' inputs, so that ``test_errors`` checks every other refusal;
docs/pytorch.md lists each with the other deliberate differences.
"""


def _errors(base: dict[str, Any] | None = None,
            extra: Iterable[tuple[str, dict[str, Any], str]] = ()
            ) -> Callable[..., list[ErrorOptimizerInput]]:
    """An ``optim_error_inputs_func``: the inputs every sage_torch optimizer must refuse.

    Ours first (``params=None``, so each hyperparameter must be checked before ``params``,
    as ``torch.optim`` does): a negative ``lr`` and ``weight_decay``, plus ``extra``
    (``(desc, kwargs, message regex)``); then torch's inputs for every optimizer, less
    :data:`ACCEPTED`, with :data:`OUR_WORDING`.  ``base`` is added to every keyword set.
    """
    ours = [("negative lr", {"lr": -1.0}, "lr must be >= 0, got -1"),
            ("negative weight_decay", {"weight_decay": -1.0}, "weight_decay must be >= 0"),
            *extra]

    def func(device: Any, dtype: Any) -> list[ErrorOptimizerInput]:
        out = [ErrorOptimizerInput(_input(desc, {**(base or {}), **kw}),
                                   error_type=ValueError, error_regex=regex)
               for desc, kw, regex in ours]
        for err in get_error_inputs_for_all_optims(device, dtype):
            if err.optimizer_error_input.desc in ACCEPTED:
                continue
            kw = err.optimizer_error_input.kwargs
            err.optimizer_error_input.kwargs = {**(base or {}), **kw}
            err.error_regex = OUR_WORDING.get(err.error_regex, err.error_regex)
            out.append(err)
        return out

    return func


_COMMON: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", {}), ("lr", {"lr": 1e-2}), ("weight_decay", {"weight_decay": 0.1}),
    ("maximize, weight_decay", {"maximize": True, "weight_decay": 0.1}))
_BETAS: tuple[str, dict[str, Any]] = ("betas", {"betas": (0.8, 0.95)})
_APOLLO = {**MATRIX_FALLBACK, "rank": 2, "update_proj_gap": 2}


def optim_infos(configs: Iterable[str] = CONFIG_NAMES) -> list[OptimizerInfo]:
    """The ``OptimizerInfo`` table of sage_torch: every class, then each of ``configs``.

    ``fused`` (the Triton kernels of SAGE, Lion and SinkGD) is declared for CUDA only, so on
    the CPU its tests skip; ``differentiable`` is not offered by any sage_torch optimizer.
    """
    def info(cls: Any, **kwargs: Any) -> OptimizerInfo:
        # torch annotates optim_cls as an Optimizer instance; it is the class (a callable)
        return OptimizerInfo(cls, supports_complex=True, **kwargs)

    fused: dict[str, Any] = {"supported_impls": ("foreach", "fused"),
                             "supports_fused_on": ("cuda",)}
    out = [
        info(SAGE, optim_inputs_func=_inputs(
            *_COMMON, _BETAS, ("damper ema", {"damper": "ema"}),
            ("damper instant", {"damper": "instant"}), ("eps", {"eps": 1e-6})),
             optim_error_inputs_func=_errors(extra=[
                 ("b2 = 1", {"betas": (0.9, 1.0)}, r"\(b2\) must be in \[0, 1\)")]),
             **fused),
        info(Lion, optim_inputs_func=_inputs(*_COMMON, _BETAS),
             optim_error_inputs_func=_errors(), **fused),
        info(SinkGD, optim_inputs_func=_inputs(
            *_COMMON, ("sqrt", {"normalization": "sqrt", "alpha": 0.05}),
            ("num_iters", {"num_iters": 2}), base=MATRIX_FALLBACK),
             optim_error_inputs_func=_errors(MATRIX_FALLBACK, extra=[
                 ("negative alpha", {"alpha": -1.0}, "alpha must be >= 0")]),
             **fused),
        info(APOLLO, optim_inputs_func=_inputs(
            *_COMMON, _BETAS, ("channel", {"scale_type": "channel"}), base=_APOLLO),
             optim_error_inputs_func=_errors(_APOLLO, extra=[
                 ("rank 0", {"rank": 0}, "rank must be")]),
             supported_impls=("foreach",)),
        info(adamw_rule, optim_inputs_func=_inputs(*_COMMON, _BETAS, ("eps", {"eps": 1e-6})),
             optim_error_inputs_func=_errors(), supported_impls=("foreach",)),
        info(unit_norm_rule, optim_inputs_func=_inputs(*_COMMON),
             optim_error_inputs_func=_errors(), supported_impls=("foreach",)),
    ]
    for name in configs:
        out.append(info(config_optimizer(name), optim_inputs_func=_inputs(*_COMMON),
                        optim_error_inputs_func=_errors(), supported_impls=("foreach",)))
    return out
