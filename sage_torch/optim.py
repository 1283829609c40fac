"""``torch.optim.Optimizer`` classes: SAGE, SinkGD, Lion, APOLLO and the multi-rule optimizer.

Every class is a :class:`RuleOptimizer`: each param group carries the name of its update
rule (``group["rule"]``) and that rule's hyperparameters, so one optimizer can run SAGE on
the embedding and SinkGD on the dense matrices (what :func:`sage_torch.make_optimizer`
returns) while ``torch.optim.lr_scheduler`` and ``state_dict`` work as with any optimizer.
Defaults come from the table shared with :mod:`sage_optax` (:mod:`sage_optim.presets`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from sage_optim.presets import PRESETS, RULE_DEFAULTS
from sage_torch.rules import RULES, ApolloRule, Axes, Projection, Rule

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Tensor]]

_SAGE, _LION, _SINK, _APOLLO = (
    RULE_DEFAULTS["sage"], RULE_DEFAULTS["lion"], RULE_DEFAULTS["sinkgd"], RULE_DEFAULTS["apollo"]
)
_COMMON_DEFAULTS = {"maximize": False, "foreach": None, "fan_in_dim": -1, "fan_out_dim": -2}
_MOMENTUM_KEYS = ("betas", "momentum")


class MomentumError(ValueError):
    """A scheduler asked to cycle the momentum of a group whose rule has none."""


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
                    "betas (sage, lion, adamw, apollo)"
                )
        return True


class RuleOptimizer(torch.optim.Optimizer):
    """An optimizer whose param groups each name their update rule.

    Args:
      params: parameters or param groups; every group must have a ``"rule"`` (one of
        ``"sage"``, ``"sinkgd"``, ``"lion"``, ``"adamw"``, ``"apollo"``, ``"unit_norm"``)
        unless ``defaults`` gives one, and that rule's hyperparameters.
      defaults: default group options (``lr``, ``weight_decay``, ``maximize``,
        ``foreach``, ``fan_in_dim``, ``fan_out_dim`` and rule hyperparameters).
      projection: APOLLO's projection, ``projection(name, refresh_index, n, rank) -> P``,
        to inject a fixed ``P`` (parity with :mod:`sage_optax`); default Gaussian.
      kinds: ``{kind: group options}`` (:func:`sage_torch.make_optimizer` passes its
        configuration's): a group added with ``kind=`` and no ``rule`` gets that kind's rule,
        hyperparameters and learning rate.

    ``fan_in_dim``/``fan_out_dim`` are a dim or a tuple of dims (merged into one matrix axis,
    :class:`sage_torch.rules.MatrixView`); ``fan_out_dim=None`` makes SAGE element-wise.
    Groups without ``param_names`` get generated names (``param_groups[2].params[0]``) when
    other groups have names, so named and unnamed groups mix.  A rule with momentum keeps it
    in ``betas``, the key torch's schedulers read; asking to cycle the momentum of a group
    whose rule has none raises a :class:`MomentumError` naming it.

    Parameter state is created lazily on the first step.  A parameter's ``state`` holds a
    float32 ``"step"`` and the rule's tensors; floating state keeps its own dtype through
    ``state_dict``/``load_state_dict`` (``torch.optim.Optimizer`` would cast it to the
    parameter's dtype, turning SAGE's float32 ``S`` of a bfloat16 parameter into bfloat16).
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any],
                 projection: Projection | None = None,
                 kinds: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._rules: dict[str, Rule] = {
            name: (cls(projection) if cls is ApolloRule else cls()) for name, cls in RULES.items()
        }
        self.kinds: dict[str, dict[str, Any]] = {k: dict(v) for k, v in (kinds or {}).items()}
        merged = _Defaults({**_COMMON_DEFAULTS, **defaults})
        super().__init__(params, merged)
        merged.owner = self

    def __getstate__(self) -> dict[str, Any]:  # noqa: D105
        return {**super().__getstate__(), "kinds": self.kinds}

    def __setstate__(self, state: dict[str, Any]) -> None:  # noqa: D105
        super().__setstate__(state)
        if not isinstance(self.defaults, _Defaults):  # unpickled as a plain dict
            self.defaults = _Defaults(self.defaults)
        self.defaults.owner = self
        self.__dict__.setdefault("kinds", {})

    def _name_group(self, param_group: dict[str, Any]) -> None:
        """Generate ``param_names`` where named and unnamed groups would meet."""
        params = param_group["params"]
        if isinstance(params, Tensor):
            params = param_group["params"] = [params]
        elif not isinstance(params, set):
            params = param_group["params"] = list(params)
        named = "param_names" in param_group or any(isinstance(p, tuple) for p in params)
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

        The group may give ``param_names`` or not, whatever the other groups do (missing
        names are generated).  On an optimizer with :attr:`kinds` (from
        :func:`sage_torch.make_optimizer`), ``kind="dense"`` without a ``rule`` gives the
        group the configuration's rule, hyperparameters and learning rate for that kind
        (keys the group sets win); its matrix axes default to ``nn.Linear``'s ``(out, in)``.
        """
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, but got {type(param_group)}")
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
        rule = group.get("rule")
        if rule not in self._rules:
            self.param_groups.pop()
            raise ValueError(
                f"param group has rule {rule!r}; valid rules: {', '.join(sorted(self._rules))}"
            )
        for key in RULE_DEFAULTS[rule]:
            if key in ("b1", "b2", "projection"):
                continue
            group.setdefault(key, RULE_DEFAULTS[rule][key])
        if rule in ("sage", "lion", "adamw", "apollo"):
            group.setdefault("betas", (RULE_DEFAULTS[rule]["b1"], RULE_DEFAULTS[rule]["b2"]))
        try:
            self._rules[rule].validate(group)
        except ValueError:
            self.param_groups.pop()
            raise

    def rule_of(self, group: dict[str, Any]) -> Rule:
        """The update rule (state layout, checks, step) that runs ``group``."""
        return self._rules[group["rule"]]

    def _names(self, group: dict[str, Any]) -> list[str]:
        names = group.get("param_names")
        if names:
            return list(names)
        index = next(i for i, g in enumerate(self.param_groups) if g is group)
        return [f"param_groups[{index}].params[{i}]" for i in range(len(group["params"]))]

    @torch.no_grad()
    def step(  # type: ignore[override]  # one signature for torch.optim's two overloads
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Perform one optimization step (``closure`` re-evaluates the model, as usual)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            rule = self.rule_of(group)
            params, grads, states, names = [], [], [], []
            for p, name in zip(group["params"], self._names(group), strict=True):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    index = next(i for i, g in enumerate(self.param_groups) if g is group)
                    raise RuntimeError(
                        f"{type(self).__name__} does not support sparse gradients: parameter "
                        f"{name} of shape {tuple(p.shape)} (param group {index}, rule "
                        f"{group['rule']!r}) has one. It comes from an nn.Embedding/"
                        "nn.EmbeddingBag built with sparse=True: build it with sparse=False "
                        "(sage_torch.make_optimizer refuses such a model up front)"
                    )
                if torch.is_complex(p):
                    raise ValueError(f"complex parameter {name} is not supported")
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state.update(rule.init_state(p, group, name))
                state["step"] += 1
                params.append(p)
                grads.append(-p.grad if group["maximize"] else p.grad)
                states.append(state)
                names.append(name)
            if not params:
                continue
            foreach = group["foreach"]
            if foreach is None:
                foreach = all(p.device.type == "cuda" for p in params)
            if foreach and len({(p.device, p.dtype) for p in params}) > 1:
                for key in sorted({(str(p.device), str(p.dtype)) for p in params}):
                    idx = [i for i, p in enumerate(params) if (str(p.device), str(p.dtype)) == key]
                    rule.step([params[i] for i in idx], [grads[i] for i in idx],
                              [states[i] for i in idx], [names[i] for i in idx], group, True)
            else:
                rule.step(params, grads, states, names, group, bool(foreach))
        return loss

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping each floating state tensor's saved dtype."""
        super().load_state_dict(state_dict)
        saved_ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(saved_ids, params, strict=True):
            for key, saved in state_dict["state"].get(pid, {}).items():
                current = self.state[p].get(key)
                if (isinstance(saved, Tensor) and isinstance(current, Tensor)
                        and saved.is_floating_point() and current.dtype != saved.dtype):
                    self.state[p][key] = saved.to(device=current.device, dtype=saved.dtype,
                                                  copy=True)


class SAGE(RuleOptimizer):
    """SAGE, Sign-Adaptive GradiEnt (paper Algorithm 1; ``docs/algorithms.md``).

    ``θ ← θ − η·(C ⊙ H + w·θ)`` with ``C = sign(b1·M + (1−b1)·g)`` and the damper
    ``H = min(σ/(Ŝ+ε), γ/(s+ε), 1)``; ``s`` is the mean of ``|g|`` over the fan-out dim
    (dim 0 of ``nn.Embedding.weight`` ``(V, d)``: the vocab axis) for matrices and ``|g|``
    for vectors.  State: ``exp_avg`` (``M``) and ``scale_avg`` (``S``, float32 or wider).

    Args:
      params: parameters or param groups.
      lr: learning rate (paper: 2e-3 with cosine and 10% warmup).
      betas: ``(b1, b2)``; ``b1=0.891`` reproduces the authors' public code.
      eps: ε of the dampers.
      weight_decay: decoupled decay ``w``.
      damper: ``"both"`` (default), ``"ema"``, ``"instant"`` or ``"none"`` (Lion).
      mu_dtype: dtype of ``M`` (default: the parameter's).
      fan_out_dim: dim (or tuple of dims) ``s`` averages over for matrices; ``None``:
        element-wise for every shape.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path (default: on CUDA).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["sage-hybrid"].learning_rate,
                 betas: tuple[float, float] = (_SAGE["b1"], _SAGE["b2"]),
                 eps: float = _SAGE["eps"], weight_decay: float = _SAGE["weight_decay"], *,
                 damper: str = _SAGE["damper"], mu_dtype: torch.dtype | None = None,
                 fan_out_dim: Axes | None = -2, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        super().__init__(params, {
            "rule": "sage", "lr": lr, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay, "damper": damper, "mu_dtype": mu_dtype,
            "fan_out_dim": fan_out_dim, "maximize": maximize, "foreach": foreach,
        })


class SinkGD(RuleOptimizer):
    """SinkGD (``docs/algorithms.md``): ``θ ← θ − η·(α·X + w·θ)``.

    ``X`` is the Sinkhorn-normalised gradient (fan-in norms, then fan-out norms,
    ``num_iters`` times).  Stateless.

    ``normalization="unit"`` is the SAGE paper's Unit-Norm SinkGD (α = 10); ``"sqrt"`` is
    Scetbon et al.'s SR-Sinkhorn (α = 0.05).  Parameters with fewer than two dims are
    rejected with an error naming their size.

    Args:
      params: parameters or param groups.
      lr: learning rate.
      alpha: update scale α.
      num_iters: Sinkhorn iterations.
      weight_decay: decoupled decay ``w`` (multiplied by ``lr``, not ``lr·α``).
      normalization: ``"unit"`` or ``"sqrt"``.
      eps: ε added to every norm.
      fan_in_dim: dim of the fan-in axis (``-1`` for ``nn.Linear.weight`` ``(out, in)``),
        or a tuple of dims merged into one (``(1, 2, 3)`` for a ``Conv2d`` weight).
      fan_out_dim: dim (or tuple of dims) of the fan-out axis.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path for the element-wise parts.
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["sage-hybrid"].learning_rate,
                 alpha: float = _SINK["alpha"], num_iters: int = _SINK["num_iters"],
                 weight_decay: float = _SINK["weight_decay"],
                 normalization: str = _SINK["normalization"], *, eps: float = _SINK["eps"],
                 fan_in_dim: Axes = -1, fan_out_dim: Axes = -2, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        super().__init__(params, {
            "rule": "sinkgd", "lr": lr, "alpha": alpha, "num_iters": num_iters,
            "weight_decay": weight_decay, "normalization": normalization, "eps": eps,
            "fan_in_dim": fan_in_dim, "fan_out_dim": fan_out_dim, "maximize": maximize,
            "foreach": foreach,
        })


class Lion(RuleOptimizer):
    """Lion (Chen et al. 2023): ``θ ← θ − η·(sign(b1·m + (1−b1)·g) + w·θ)``, as ``optax.lion``.

    Args:
      params: parameters or param groups.
      lr: learning rate.
      betas: ``(b1, b2)``.
      weight_decay: decoupled decay.
      maximize: ascend instead of descend.
      foreach: use the ``torch._foreach_*`` path.
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["lion"].learning_rate,
                 betas: tuple[float, float] = (_LION["b1"], _LION["b2"]),
                 weight_decay: float = _LION["weight_decay"], *, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        super().__init__(params, {
            "rule": "lion", "lr": lr, "betas": tuple(betas), "weight_decay": weight_decay,
            "maximize": maximize, "foreach": foreach,
        })


class APOLLO(RuleOptimizer):
    """APOLLO (Zhu et al. 2024) as ``docs/algorithms.md`` states it; defaults are APOLLO-Mini.

    A rank-``r`` random projection of the smaller axis carries AdamW moments whose ratio
    scales the raw gradient (``"tensor"``: one factor; ``"channel"``: one per channel),
    times ``√scale``, through a norm-growth limiter (γ); the projection is regenerated every
    ``update_proj_gap`` steps from ``seed`` (or taken from ``projection``) and not stored;
    decay is applied after the step.

    Args:
      params: parameters or param groups (matrices only).
      lr: learning rate.
      rank: projection rank ``r``.
      scale_type: ``"tensor"`` or ``"channel"``.
      scale: gradient scale (its square root multiplies the update).
      update_proj_gap: steps between projection refreshes ``T``.
      betas: Adam ``(b1, b2)`` on the projected gradient.
      eps: Adam ε.
      weight_decay: decoupled decay, applied after the step.
      limiter_gamma: norm-growth limit γ.
      seed: seed of the default projection.
      projection: ``projection(name, refresh_index, n, rank) -> P`` to inject ``P``.
      fan_in_dim: dim (or tuple of dims, merged in that order) of the fan-in axis.
      fan_out_dim: dim (or tuple of dims, merged in that order) of the fan-out axis.
      maximize: ascend instead of descend.
      foreach: accepted for API symmetry (APOLLO steps matrix by matrix).
    """

    def __init__(self, params: ParamsT, lr: float = PRESETS["apollo"].learning_rate,
                 rank: int = _APOLLO["rank"], scale_type: str = _APOLLO["scale_type"],
                 scale: float = _APOLLO["scale"],
                 update_proj_gap: int = _APOLLO["update_proj_gap"],
                 betas: tuple[float, float] = (_APOLLO["b1"], _APOLLO["b2"]),
                 eps: float = _APOLLO["eps"], weight_decay: float = _APOLLO["weight_decay"],
                 limiter_gamma: float = _APOLLO["limiter_gamma"], seed: int = _APOLLO["seed"],
                 *, projection: Projection | None = None, fan_in_dim: Axes = -1,
                 fan_out_dim: Axes = -2, maximize: bool = False,
                 foreach: bool | None = None) -> None:
        super().__init__(params, {
            "rule": "apollo", "lr": lr, "rank": rank, "scale_type": scale_type, "scale": scale,
            "update_proj_gap": update_proj_gap, "betas": tuple(betas), "eps": eps,
            "weight_decay": weight_decay, "limiter_gamma": limiter_gamma, "seed": seed,
            "fan_in_dim": fan_in_dim, "fan_out_dim": fan_out_dim, "maximize": maximize,
            "foreach": foreach,
        }, projection=projection)
