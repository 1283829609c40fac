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
