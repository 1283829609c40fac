"""Command-line pieces shared by the commands (``sage-train``, ``sage-repro``).

Framework-free, so that a command's parser is built before any framework is imported.
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Callable
from typing import Any

__all__ = ["DefaultsFormatter", "OneLineParser", "checked", "paragraphs", "plain"]

_ROLE = re.compile(r":(?:mod|func|class|data|attr|meth|obj|exc|doc|ref):`~?([^`<]+?)(?: <[^>]*>)?`")


def plain(text: str | None) -> str | None:
    """``text`` without reStructuredText markup, for a terminal.

    ``:mod:`sage_train.run.export``` → ``sage_train.run.export``, double backquotes dropped, and
    ``%%`` (argparse's escape, which it only undoes in option help) → ``%`` where nothing
    in ``text`` is %-formatted.
    """
    if text is None:
        return None
    text = _ROLE.sub(r"\1", text).replace("``", "")
    return text if "%(" in text else text.replace("%%", "%")


_ITEM = re.compile(r"^(?:[-*] |\d+[.)] |[a-z][\w -]*: )")


def paragraphs(text: str) -> list[tuple[str, bool]]:
    """``text`` as ``(block, verbatim)`` pairs: paragraphs to fill, and lines kept as written.

    Paragraphs are separated by blank lines; a line that starts a list item (``- ``,
    ``1. ``) or a labelled paragraph (``output: ...``) starts a new one.  An indented line
    (an example command, a sample of output) is kept as it is, and a blank line stays one.
    """
    out: list[tuple[str, bool]] = []
    current: list[str] = []

    def flush() -> None:
        if current:
            out.append((" ".join(current), False))
            current.clear()

    for line in text.splitlines():
        if not line.strip():
            flush()
            out.append(("", True))
        elif line[0].isspace():
            flush()
            out.append((line, True))
        else:
            if _ITEM.match(line):
                flush()
            current.append(line.strip())
    flush()
    return out


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help (unless the help says it, or there is none).

    The description and epilog are filled once to the terminal's width, paragraph by
    paragraph (:func:`paragraphs`): their source line breaks are not kept, so no line is
    broken twice (at the source's width, then at the terminal's); indented lines stay as
    written.
    """

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "\n".join(
            block if verbatim else textwrap.fill(block, width, initial_indent=indent,
                                                 subsequent_indent=indent,
                                                 break_on_hyphens=False)
            for block, verbatim in paragraphs(text))

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)

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
