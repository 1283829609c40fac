"""Small synthetic corpora for the tests of the ``installed`` corpus and of its cuts."""

from __future__ import annotations

import pathlib
import sysconfig


def _lines() -> list[str]:
    """Lines of a few standard-library modules: realistic text to cut documents from."""
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    lines: list[str] = []
    for name in ("textwrap.py", "argparse.py"):
        lines.extend((stdlib / name).read_text().splitlines(keepends=True))
    return lines


def make_tree(root: pathlib.Path, n: int, first: int = 0) -> dict[str, str]:
    """``n`` distinct documents of 12 lines under ``root`` (nested folders); {relpath: text}."""
    lines = _lines()
    docs = {}
    for i in range(first, first + n):
        text = f"# document {i}\n" + "".join(lines[(7 * i) % (len(lines) - 12):][:12])
        rel = f"pkg{i % 3}/sub{i % 2}/mod_{i:04d}.py"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        docs[rel] = text
    return docs
