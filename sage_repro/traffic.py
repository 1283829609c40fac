"""The analytic memory-traffic model of one optimizer step, shared by both benchmarks.

Bytes moved by one step (each array touched the minimum number of times the
implementation's algorithm needs)::

    bytes = 2·|P| + |G| + 2·|S| + Σ_leaves extra_passes(rule, leaf) · |G_leaf|

``|P|``, ``|G|``: bytes of all parameters / gradients (parameters are read and written,
gradients read once by the fused update); ``|S|``: bytes of every optimizer-state tensor
(each read and written once).  Extra passes over a leaf (:func:`extra_passes`):

* SinkGD: one read of ``G`` and one write of ``K = G²``, then ``2·L`` matrix-vector
  products that each read ``K`` (``L`` = ``num_iters``); ``X = c·G·r`` is fused into the
  update.  ``2·L + 2`` in all.
* SAGE on a matrix: one read of ``G`` for ``s_t = mean|G|`` over the vocabulary axis, which
  must finish before the update can start.  1.
* everything else (AdamW, Lion, SAGE on vectors, the unit-norm step): 0.  APOLLO's random
  projections are not counted, so its achieved bandwidth is understated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def extra_passes(rule: str, hyperparams: Mapping[str, Any], ndim: int) -> int:
    """Passes over a leaf's gradient-sized data beyond the fused update (module docstring)."""
    if rule == "sinkgd":
        return 2 * int(hyperparams["num_iters"]) + 2
    if rule == "sage" and ndim >= 2:
        return 1
    return 0


def step_bytes(param_bytes: int, state_bytes: int,
               leaves: list[tuple[str, Mapping[str, Any], int, int]]) -> int:
    """Bytes one step moves: ``leaves`` holds ``(rule, hyperparams, ndim, leaf bytes)``."""
    extra = sum(extra_passes(rule, hp, ndim) * nbytes for rule, hp, ndim, nbytes in leaves)
    return 3 * param_bytes + 2 * state_bytes + extra
