"""Signals that stop ``sage-train`` between steps: preemption (SIGTERM, SIGUSR1) and Ctrl-C.

Imports nothing heavy (no JAX), so that ``python -m sage_train`` catches them from its
first moment, before JAX is imported (:func:`sage_train.commands.launch`).
"""

from __future__ import annotations

import os
import signal
from typing import Any

PREEMPTED = 75
"""Exit status after SIGTERM or SIGUSR1: the checkpoint of the step reached was saved."""

INTERRUPTED = 130
"""Exit status after SIGINT (Ctrl-C): stopped between steps, no checkpoint saved."""


class StopSignals:
    """SIGTERM, SIGUSR1 and SIGINT caught as a request that the training loop polls.

    Calling the object returns the name of the first signal received (``None`` before).
    Nothing is raised inside JAX or orbax (an interrupted compilation or save is never torn
    down mid-way); a second SIGINT exits at once with status 130, and the same SIGTERM or
    SIGUSR1 a second time with status 75 (``os._exit``: no interpreter teardown racing XLA's
    threads), so a process stuck where the first is never polled (a collective that another
    process of its job never joins) always ends; a SIGTERM after a SIGUSR1 (SLURM's warning,
    then its end) is only noted.  A SIGINT that was ignored (a background job) stays
    ignored.
    """

    _SIGNALS = ("SIGTERM", "SIGUSR1", "SIGINT")

    def __init__(self) -> None:
        self.received: str | None = None
        self._old: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for name in self._SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            try:
                if name == "SIGINT" and signal.getsignal(sig) is signal.SIG_IGN:
                    continue
                self._old[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: nothing is caught
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if self.received is not None and name == "SIGINT":
            os.write(2, b"sage-train: interrupted again: exiting now\n")
            os._exit(INTERRUPTED)
        if self.received == name and name in ("SIGTERM", "SIGUSR1"):
            os.write(2, f"sage-train: {name} again: exiting now (without a checkpoint of "
                     "the step reached)\n".encode())
            os._exit(PREEMPTED)
        if self.received is None:
            self.received = name

    def __call__(self) -> str | None:
        """The first signal received, or ``None``."""
        return self.received
