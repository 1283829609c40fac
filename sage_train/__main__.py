"""``python -m sage_train``: the same as the ``sage-train`` command.

SIGTERM, SIGUSR1 and SIGINT are caught before JAX is imported (a signal that arrives while
it loads stops the run cleanly too): :func:`sage_train.commands.launch`.
"""

from sage_train.commands import launch

raise SystemExit(launch())
