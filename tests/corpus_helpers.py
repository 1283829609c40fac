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


def installed_corpus(tmp_path: pathlib.Path, monkeypatch, vocab_size: int):
    """A 240-document tree read as the ``installed`` corpus (its cache in ``tmp_path``)."""
    from sage_train.data import corpus
    from sage_train.data import pipeline as data

    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    root = tmp_path / "tree"
    make_tree(root, 240)
    monkeypatch.setattr(corpus, "default_roots", lambda: (corpus.Root("pkgs", root),))
    return data.load_data("installed", vocab_size=vocab_size)
