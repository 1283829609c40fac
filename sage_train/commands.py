"""The ``sage-train`` console script: the signals caught first, then the command line.

Imports nothing heavy itself: :func:`launch` catches SIGTERM, SIGUSR1 and SIGINT
(:class:`~sage_train.job.signals.StopSignals`) before :mod:`sage_train.cli` imports JAX.
"""

from __future__ import annotations

from sage_optim.console import console_script
from sage_optim.extras import require
from sage_train.job.signals import StopSignals


@console_script
def launch() -> int:
    """``sage-train`` with the signals caught before JAX is imported.

    The entry point of ``python -m sage_train`` (and the one to give a console script):
    a SIGTERM, SIGUSR1 or SIGINT that arrives while JAX loads stops the run cleanly too.
    Without the ``[train]`` extra it prints one line naming it and exits 1; a closed output
    pipe (``sage-train ... | head``) ends it quietly (:func:`~sage_optim.console.console_script`).
    """
    require("sage-train", "train")
    with StopSignals() as signals:
        from sage_train.cli import main

        return main(signals=signals)
