"""Command-line pieces shared by the commands (``sage-train``, ``sage-repro``).

Framework-free, so that a command's parser is built before any framework is imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

__all__ = ["OneLineParser", "checked"]


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (usage is in ``--help``), status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print ``message`` as one line and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], what: str
            ) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)``, refused unless ``ok`` of it.

    Both a value ``convert`` cannot read and one ``ok`` refuses give the same message,
    ``must be {what}, got '{text}'``, which the parser prints as one line.
    """
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return value

    return parse
