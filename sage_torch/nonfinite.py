"""Skipping steps with NaN/Inf gradients: ``sage_torch.make_optimizer(..., skip_nonfinite=N)``.

The same option, with the same meaning, as :func:`sage_optax.make_optimizer`'s (which wraps
``optax.apply_if_finite(tx, max_consecutive_errors=N)``):

* a step whose gradients are not all finite is skipped: parameters and optimizer state
  (the step counts included) are left untouched, so the run continues exactly as if that
  step had never happened;
* at most ``N`` consecutive non-finite steps are skipped; the next one in the same run of
  non-finite steps (the ``(N + 1)``-th in a row) and any after it are applied, so that a
  persistent failure surfaces as non-finite parameters instead of a silently frozen model;
* a finite step resets the run; ``N = 0`` (the default) disables the check.

Deciding whether to skip needs the gradients' finiteness on the host: one synchronisation
per device per step (JAX decides on the device, inside the compiled step).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from sage_optim.hyperparams import check_skip_nonfinite
from sage_torch.common import Projection
from sage_torch.grouping import ConfiguredOptimizer
from sage_torch.optimizer import ParamsT

__all__ = ["SkipNonFinite", "all_finite", "check_skip_nonfinite"]


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether every element of every tensor is finite (one host sync per device)."""
    flags: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        flag = torch.isfinite(t).all()
        if hasattr(flag, "full_tensor"):  # a DTensor (FSDP2): reduce across the ranks
            flag = flag.full_tensor()
        flags.setdefault(flag.device, []).append(flag)
    return all(bool(torch.stack(fs).all()) for fs in flags.values())


class SkipNonFinite(ConfiguredOptimizer):
    """A configuration's optimizer that skips steps with non-finite gradients.

    What :func:`sage_torch.make_optimizer` returns with ``skip_nonfinite > 0``: a
    :class:`~sage_torch.grouping.ConfiguredOptimizer` whose step is skipped as below.

    See the module docstring for the exact rule.  ``nonfinite_count`` is the length of
    the current run of non-finite steps and ``total_nonfinite`` their number since the
    start; both are saved in ``state_dict`` (key ``"nonfinite"``) and restored by
    ``load_state_dict``, as JAX keeps them in ``optax.ApplyIfFiniteState``.

    Args:
      params: parameters or param groups, as :class:`~sage_torch.RuleOptimizer`.
      defaults: default group options.
      projection: APOLLO's projection.
      kinds: the configuration's kinds (:class:`~sage_torch.RuleOptimizer`).
      skip_nonfinite: ``N``, the number of consecutive non-finite steps to skip.
      cpu_threads: threads of the chunked CPU path (default 1: none started).
      model: the model the optimizer is built from (routes groups added later).
    """

    def __init__(self, params: ParamsT, defaults: dict[str, Any],
                 projection: Projection | None = None,
                 kinds: Mapping[str, Mapping[str, Any]] | None = None, *,
                 skip_nonfinite: int, cpu_threads: int = 1,
                 model: torch.nn.Module | None = None) -> None:
        self.skip_nonfinite = check_skip_nonfinite(skip_nonfinite)
        self.nonfinite_count = 0
        self.total_nonfinite = 0
        super().__init__(params, defaults, projection=projection, kinds=kinds,
                         cpu_threads=cpu_threads, model=model)

    @torch.no_grad()
    def step(  # type: ignore[override]  # as RuleOptimizer.step
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """One step, or none if the gradients are not all finite (see the class docstring)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        if all_finite(grads):
            self.nonfinite_count = 0
        else:
            self.nonfinite_count += 1
            self.total_nonfinite += 1
            if self.nonfinite_count <= self.skip_nonfinite:
                return loss
        self._update()  # not super().step(): the step hooks run once, around this step
        return loss

    def __getstate__(self) -> dict[str, Any]:
        """As :meth:`RuleOptimizer.__getstate__`, plus ``skip_nonfinite`` and the counters."""
        return {**super().__getstate__(), "skip_nonfinite": self.skip_nonfinite,
                "nonfinite_count": self.nonfinite_count,
                "total_nonfinite": self.total_nonfinite}

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state dict plus the non-finite counters."""
        state = super().state_dict()
        state["nonfinite"] = {"count": self.nonfinite_count, "total": self.total_nonfinite}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict (the counters too, when it has them)."""
        counters = state_dict.get("nonfinite", {"count": 0, "total": 0})
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "nonfinite"})
        self.nonfinite_count = int(counters["count"])
        self.total_nonfinite = int(counters["total"])
