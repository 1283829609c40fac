"""Compatibility module: the update rules of :mod:`sage_torch` under their former names.

The rules now live one module per algorithm, as in ``torch.optim``
(:mod:`sage_torch.sage`, :mod:`sage_torch.sinkgd`, :mod:`sage_torch.lion`,
:mod:`sage_torch.adamw`, :mod:`sage_torch.unit_norm`, :mod:`sage_torch.apollo`), the shared
machinery in :mod:`sage_torch.common` and the chunked CPU path in
:mod:`sage_torch.chunked`.  This module re-exports their public names so that
``sage_torch.rules.sinkhorn_normalize`` and friends keep working.
"""

from __future__ import annotations

from sage_torch.adamw import AdamWRule
from sage_torch.apollo import ApolloRule, gaussian_projection
from sage_torch.chunked import CHUNK_NUMEL, FAST_MIN_NUMEL, use_fast_path
from sage_torch.common import Axes, MatrixView, Projection, Rule, axis_group
from sage_torch.lion import LionRule
from sage_torch.sage import SageRule, sage_damper
from sage_torch.sinkgd import SinkGDRule, range_scale, sinkhorn_normalize, sinkhorn_scales
from sage_torch.unit_norm import UnitNormRule

RULES: dict[str, type[Rule]] = {
    r.name: r for r in (SageRule, LionRule, AdamWRule, SinkGDRule, UnitNormRule, ApolloRule)
}
"""Every rule class by name."""

__all__ = [
    "CHUNK_NUMEL", "FAST_MIN_NUMEL", "RULES", "AdamWRule", "ApolloRule", "Axes", "LionRule",
    "MatrixView", "Projection", "Rule", "SageRule", "SinkGDRule", "UnitNormRule", "axis_group",
    "gaussian_projection", "range_scale", "sage_damper", "sinkhorn_normalize",
    "sinkhorn_scales", "use_fast_path",
]
