"""Errors of the trainer that a user acts on: printed by ``sage-train`` as one line.

:class:`UserError` and its subclasses mean "nothing was trained; fix the input" (exit
status 2); :class:`CheckpointError` means a checkpoint could not be written (exit status 1).
Both keep the run directory as it was: no history is lost.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem with what the user asked for (settings, data, run directory)."""


class ConfigError(UserError, ValueError):
    """An invalid setting (a negative learning rate, zero steps...)."""


class DataError(UserError, ValueError):
    """The data source cannot be used (missing, wrong format, too small)."""


class RunDirError(UserError):
    """The run directory cannot be used as asked (locked, other settings, bad layout)."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written; the earlier checkpoints and history are intact."""
