"""Console scripts of :mod:`sage_repro` that need a framework's extra.

``sage-parity`` checks for its extras before :mod:`sage_repro.parity` imports PyTorch, and
``sage-repro`` for the ``[train]`` extra its runs (the trainer) and figures (matplotlib)
need, so a missing one is one line naming it (exit status 1), not a traceback
(:func:`sage_optim.extras.require`); a closed output pipe ends them quietly
(:func:`sage_optim.console.console_script`).
"""

from __future__ import annotations

from sage_optim.console import console_script
from sage_optim.extras import require


@console_script
def parity() -> int:
    """``sage-parity``: :func:`sage_repro.parity.main` once JAX and PyTorch are there."""
    require("sage-parity", "jax", "torch")
    from sage_repro.parity import main

    return main()


@console_script
def repro() -> int:
    """``sage-repro``: :func:`sage_repro.sweep.main` once the ``[train]`` extra is there."""
    require("sage-repro", "train")
    from sage_repro.sweep import main

    return main()
