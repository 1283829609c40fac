"""What every console script shares: a closed output pipe ends it quietly.

``sage-memory | head`` closes the pipe after ten lines; the next write (or the flush at
exit) raises :class:`BrokenPipeError`, which Python would print as a traceback.
:func:`console_script` wraps each command's entry point (``sage-train``, ``sage-memory``,
``sage-parity``, ``sage-repro``) once: its output is flushed inside the wrapper, and a
closed pipe ends the command with status 1 and nothing more on the terminal (the recipe
of Python's documentation on ``SIGPIPE``: the rest of the output goes to ``/dev/null``).
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

CLOSED_PIPE_STATUS = 1
"""The exit status of a command whose output pipe was closed before it finished."""


def console_script(main: Callable[P, R]) -> Callable[P, R | int]:
    """``main`` as a console script that survives a closed output pipe (module docstring).

    Returns what ``main`` returns (and lets its ``SystemExit`` through), or
    :data:`CLOSED_PIPE_STATUS` when stdout's pipe was closed.
    """

    @functools.wraps(main)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R | int:
        try:
            try:
                return main(*args, **kwargs)
            finally:
                sys.stdout.flush()  # here, not at exit, where its failure cannot be caught
        except BrokenPipeError:
            _drop_stdout()
            return CLOSED_PIPE_STATUS

    return wrapper


def _drop_stdout() -> None:
    """Point stdout at ``/dev/null``: the interpreter's last flush then has nowhere to fail."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a test's capture
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)
