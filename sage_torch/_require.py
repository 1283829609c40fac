"""Imported first by :mod:`sage_torch`: without PyTorch, one line naming the extra."""

from sage_optim.extras import require_for_import

require_for_import("sage_torch", "torch")
