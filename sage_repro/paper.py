"""Figures printed in the paper, transcribed once so reports and tests compare against them."""

from __future__ import annotations

import types
from collections.abc import Mapping

# Appendix table ``tab:memory_full``: (optimizer-state GiB, total GiB) per model and configuration.
# The paper writes "GB"; the figures are GiB of float32 states (AdamW on 270M is exactly
# 2 x 274,492,416 x 4 bytes = 2.045 GiB).
PAPER_MEMORY_GIB: Mapping[str, Mapping[str, tuple[float, float]]] = types.MappingProxyType(
    {
        "270m": {
            "adamw": (2.045, 4.091),
            "apollo": (1.208, 3.254),
            "lion": (1.023, 3.067),
            "sinkgd-hybrid": (0.979, 3.023),
            "sinkgd-pure": (0.0, 2.046),
            "sage-pure": (1.023, 3.069),
            "lion-hybrid": (0.489, 2.535),
            "sage-hybrid": (0.489, 2.535),
        },
        "0.6b": {
            "adamw": (4.421, 8.843),
            "apollo": (2.102, 6.524),
            "lion": (2.211, 6.631),
            "sinkgd-hybrid": (1.468, 5.890),
            "sinkgd-pure": (0.0, 4.422),
            "sage-pure": (2.212, 6.634),
            "lion-hybrid": (0.734, 5.156),
            "sage-hybrid": (0.734, 5.156),
        },
        "1.3b": {
            "adamw": (9.833, 19.67),
            "apollo": (3.648, 13.48),
            "lion": (4.916, 14.75),
            "sinkgd-hybrid": (1.958, 11.79),
            "sinkgd-pure": (0.0, 9.832),
            "sage-pure": (4.92, 14.75),
            "lion-hybrid": (0.979, 10.81),
            "sage-hybrid": (0.979, 10.81),
        },
    }
)

# Main results table ``tab:main_results``: final test perplexity (mean of 3 seeds, The Pile
# subset, 130k-token batches) per model and configuration.
PAPER_TEST_PPL: Mapping[str, Mapping[str, float]] = types.MappingProxyType(
    {
        "270m": {"adamw": 37.35, "apollo": 52.83, "lion": 30.24, "sinkgd-hybrid": 34.30,
                 "sinkgd-pure": 192.7, "sage-pure": 116.0, "lion-hybrid": 32.10,
                 "sage-hybrid": 29.95},
        "0.6b": {"adamw": 31.74, "apollo": 44.84, "lion": 26.58, "sinkgd-hybrid": 32.85,
                 "sinkgd-pure": 117.8, "sage-pure": 179.0, "lion-hybrid": 28.73,
                 "sage-hybrid": 26.71},
        "1.3b": {"adamw": 27.81, "apollo": 39.54, "lion": 28.37, "sinkgd-hybrid": 28.71,
                 "sinkgd-pure": 98.84, "sage-pure": 216.0, "lion-hybrid": 28.40,
                 "sage-hybrid": 24.33},
    }
)
"""The paper's final test perplexities (``tab:main_results``), for side-by-side reports."""

PAPER_LR_GRID: tuple[float, ...] = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3)
"""The learning-rate grid of the paper's SAGE / Lion-Hybrid search (Appendix)."""
