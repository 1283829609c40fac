"""Errors of the trainer that a user acts on: printed by ``sage-train`` as one line.

:class:`UserError` and its subclasses mean "nothing was trained; fix the input" (exit
status 2); :class:`RunFileError` (and :class:`CheckpointError`) mean a file of the run
could not be written: the disk is full or the run directory turned read-only (exit
status 1).  Both keep the run directory as it was: no history is lost, and no temporary
file is left behind.
"""

from __future__ import annotations

import importlib
import os


class UserError(Exception):
    """A problem with what the user asked for (settings, data, run directory)."""


class ConfigError(UserError, ValueError):
    """An invalid setting (a negative learning rate, zero steps...)."""


class DataError(UserError, ValueError):
    """The data source cannot be used (missing, wrong format, too small)."""


class RunDirError(UserError):
    """The run directory cannot be used as asked (locked, other settings, bad layout)."""


class RunFileError(RuntimeError):
    """A file of the run could not be written; the earlier checkpoints and history are intact."""


class CheckpointError(RunFileError):
    """A checkpoint could not be written; the earlier checkpoints and history are intact."""


def write_error(path: os.PathLike[str] | str, e: OSError) -> RunFileError:
    """The one-line :class:`RunFileError` of a failed write of ``path``.

    Names the file and the cause (``No space left on device``, ``Permission denied``...).
    """
    why = e.strerror or str(e) or type(e).__name__
    return RunFileError(f"cannot write {os.fspath(path)}: {why}")


INSTALL: dict[str, str] = {
    "tensorboardX": "pip install tensorboardX (the sage-optim[train] extra brings it)",
    "wandb": "pip install wandb",
    "transformers": "pip install transformers",
    "safetensors": "pip install safetensors",
}
"""How to install each optional package a flag needs (:func:`require` names it)."""


def require(module: str, flag: str) -> None:
    """Import ``module`` for ``flag`` or refuse in one line naming how to install it.

    Raises:
      ConfigError: ``module`` cannot be imported.
    """
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{flag} needs the {module} package, which is not installed: "
                          f"{INSTALL.get(module, f'pip install {module}')}") from None
