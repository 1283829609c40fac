"""Command-line pieces shared by the commands (``sage-train``, ``sage-repro``).

Framework-free, so that a command's parser is built before any framework is imported.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["DefaultsFormatter", "OneLineParser", "checked", "plain"]

_ROLE = re.compile(r":(?:mod|func|class|data|attr|meth|obj|exc|doc|ref):`~?([^`<]+?)(?: <[^>]*>)?`")


def plain(text: str | None) -> str | None:
    """``text`` without reStructuredText markup, for a terminal.

    ``:mod:`sage_train.export``` → ``sage_train.export``, double backquotes dropped, and
    ``%%`` (argparse's escape, which it only undoes in option help) → ``%`` where nothing
    in ``text`` is %-formatted.
    """
    if text is None:
        return None
    text = _ROLE.sub(r"\1", text).replace("``", "")
    return text if "%(" in text else text.replace("%%", "%")


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (unless the help says it, or there is none).

    The description and epilog keep their line breaks; a line longer than the terminal is
    wrapped.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(textwrap.fill(line, width, initial_indent=indent,
                                        subsequent_indent=indent) if line.strip() else ""
                         for line in text.splitlines())

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, argparse._StoreTrueAction | argparse._HelpAction)):
            return text
        return f"{text} (default: %(default)s)"


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (usage is in ``--help``), status 2.

    Its description and epilog are shown as plain text (:func:`plain`): a command's help
    may come from a docstring.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for key in ("description", "epilog"):
            if key in kwargs:
                kwargs[key] = plain(kwargs[key])
        super().__init__(*args, **kwargs)

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
