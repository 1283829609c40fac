"""``python -m sage_repro``: the same as the ``sage-repro`` command.

A checkout runs in place without an install: ``PYTHONPATH=$PWD python3 -m sage_repro ...``.
"""

from sage_repro.commands import repro

raise SystemExit(repro())
