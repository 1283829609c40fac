"""Console scripts of :mod:`sage_repro` whose modules import a framework when loaded.

``sage-parity`` checks for its extras before :mod:`sage_repro.parity` imports PyTorch, so a
missing one is one line naming it (exit status 1), not a traceback
(:func:`sage_optim._entry.require`).
"""

from __future__ import annotations

from sage_optim._entry import require


def parity() -> int:
    """``sage-parity``: :func:`sage_repro.parity.main` once JAX and PyTorch are there."""
    require("sage-parity", "jax", "torch")
    from sage_repro.parity import main

    return main()
