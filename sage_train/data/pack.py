"""A pack: a cut's documents as compressed text with their tokenizer, small enough to commit.

A cut (:mod:`sage_train.data.cut`) taken from the ``installed`` corpus can only be rebuilt on the
machine whose installed files it came from: another machine has other packages, so another
corpus and another fingerprint. A pack travels instead, inside the repository: the chosen
documents' text, ``xz``-compressed, and the byte-level BPE trained on them. Any machine turns
it into the same tokens (:func:`load_pack`, :func:`cut_pack`, ``sage-repro cut-data --data
PACK``): decompressing is exact, every document's text is checked against the pack's hashes,
and the committed tokenizer encodes it (encoding with a fixed tokenizer is deterministic), so
the cut's fingerprint is the one the pack records (:data:`PACK_MANIFEST`'s
``cut_fingerprint``), which :func:`cut_pack` checks.

**What is packed** (:func:`make_pack`). The text of **one source** (:class:`PackSource`): one
folder of files under one licence, which the pack carries beside the text (``LICENSE``, copied
verbatim, and ``NOTICE``, what the text is and where it came from), so the pack may be
redistributed. The only source known by name is ``stdlib`` (:func:`stdlib_source`): the
running CPython's standard library ``.py`` files, its ``test`` package included, under the
PSF License (the standard library's own ``LICENSE.txt``); the exact Python version is in
the manifest. A pack never mixes sources: :func:`make_pack` lists the documents of its one
source itself. From that listing (:func:`sage_train.data.corpus.list_documents`), each side of
the corpus's 8:2 split (a document's side depends on its content alone,
:func:`sage_train.data.corpus.is_test_document`) is drawn on its own: documents ranked by the
SHA-256 of their UTF-8 bytes, each taken when it still fits the side's byte budget, kept in
listing order. The tokenizer is trained on the train side only.

**The folder**: ``train.jsonl.xz`` and ``test.jsonl.xz`` (one JSON string per line, a
document each), ``tokenizer.json``, ``LICENSE`` and ``NOTICE``, and the manifest
``pack.json``: the format, the vocabulary, the source (its name, folder, Python version and
the licence file's origin and SHA-256), per side the documents, the UTF-8 bytes and the
SHA-256 of the decompressed lines, the tokenizer's SHA-256, the pack's **fingerprint** (the
SHA-256 of those, the source's name and the licence's SHA-256) and the fingerprint of the
cut it gives (``cut_fingerprint``, with its token counts).

Run ``python -m sage_train.data.pack --source stdlib --out FOLDER --train-bytes N --test-bytes N
--vocab-size V`` to make one.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import lzma
import os
import platform
import re
import shutil
import sys
import sysconfig
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from sage_train.data import corpus
from sage_train.data import token_store as store

__all__ = ["PACK_FORMAT", "PACK_MANIFEST", "SOURCES", "STDLIB_SKIP_DIRS", "PackSource",
           "cut_pack", "is_pack", "load_pack", "main", "make_pack", "pack_fingerprint",
           "select", "stdlib_source"]

PACK_MANIFEST = "pack.json"
"""The manifest's file name: a folder holding it is a pack."""
PACK_FORMAT = 2
"""Part of the fingerprint; bump it whenever the selection or the layout changes (2: one
source with its licence)."""
_SIDES = ("train", "test")
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "encodings"})
"""Folders of the standard library a ``stdlib`` pack skips: installed packages (not the
standard library's, nor under its licence), bytecode, and the machine-generated codec
tables of ``encodings``. Unlike :data:`sage_train.data.token_store.STDLIB_SKIP_DIRS`, the
``test`` package, ``idlelib`` and ``lib2to3`` are read."""


@dataclasses.dataclass(frozen=True)
class PackSource:
    """The one source of a pack's text: a folder of files under one licence.

    Attributes:
      name: recorded in the manifest and the fingerprint (``"cpython-3.11.7-stdlib"``).
      root: the folder and which of its files are documents.
      licence: the licence file, copied verbatim into the pack as ``LICENSE``.
      notice: the ``NOTICE`` text: what the documents are and under which licence.
      info: more facts the manifest records (the Python version, ...).
    """

    name: str
    root: corpus.Root
    licence: Path
    notice: str
    info: dict[str, str] = dataclasses.field(default_factory=dict)


def stdlib_source() -> PackSource:
    """The running CPython's standard library ``.py`` files, under the PSF License.

    Every ``.py`` file under ``sysconfig``'s ``stdlib`` folder, its ``test`` package
    included, but for :data:`STDLIB_SKIP_DIRS`; the licence is that folder's own
    ``LICENSE.txt`` (the PSF License and the licences of the software CPython includes),
    whose PSF notice of copyright the ``NOTICE`` repeats.

    Raises:
      ValueError: not CPython, or the standard library or its ``LICENSE.txt`` (with the
        PSF notice of copyright) missing.
    """
    if platform.python_implementation() != "CPython":
        raise ValueError(f"--source stdlib needs CPython, this is "
                         f"{platform.python_implementation()}")
    folder = Path(sysconfig.get_paths()["stdlib"])
    licence = folder / "LICENSE.txt"
    if not folder.is_dir() or not licence.is_file():
        raise ValueError(f"--source stdlib: no standard library with its LICENSE.txt at "
                         f"{folder}")
    version = platform.python_version()
    found = re.search(r'i\.e\., "(Copyright \(c\) 2001.*?All Rights Reserved)"',
                      licence.read_text(errors="replace"), re.S)
    if found is None:
        raise ValueError(f"--source stdlib: {licence} holds no PSF notice of copyright")
    copyright_line = " ".join(found.group(1).split())
    notice = (
        f"The text in train.jsonl.xz and test.jsonl.xz is the source code of the Python\n"
        f"standard library of CPython {version}: .py files of its Lib folder (installed at\n"
        f"{folder}), its test package included, but for the folders\n"
        f"{', '.join(sorted(STDLIB_SKIP_DIRS))}; each file one document, unchanged.\n\n"
        f"PSF's notice of copyright, as LICENSE states it:\n{copyright_line}\n\n"
        "It is distributed under the PSF License Agreement and the licences of the software\n"
        "CPython includes, reproduced in LICENSE: a verbatim copy of the LICENSE.txt that\n"
        f"CPython {version} installs ({licence}).\n\n"
        "tokenizer.json (a byte-level BPE trained on train.jsonl.xz) and pack.json were made\n"
        "from that text by sage_train.data.pack.\n")
    return PackSource(f"cpython-{version}-stdlib",
                      corpus.Root("stdlib", folder, python_only=True,
                                  skip_dirs=STDLIB_SKIP_DIRS),
                      licence, notice, {"python": version, "implementation": "CPython"})


SOURCES: dict[str, Callable[[], PackSource]] = {"stdlib": stdlib_source}
"""The sources ``--source`` names."""


class _NoBar:
    """A stand-in for a progress bar (:func:`sage_train.data.corpus` counts bytes on one)."""

    def update(self, n: int = 1) -> None:
        """Ignore progress."""


def is_pack(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a pack: a folder holding :data:`PACK_MANIFEST`, or that file."""
    p = Path(path).expanduser()
    return (p.is_dir() and (p / PACK_MANIFEST).is_file()) or (
        p.name == PACK_MANIFEST and p.is_file())


def select(docs: Sequence[corpus.Document], budget: int) -> list[corpus.Document]:
    """The documents a side of at most ``budget`` UTF-8 bytes takes, in listing order.

    Ranked by their SHA-256 (ties: listing order), each taken when it still fits.
    """
    ranked = sorted(range(len(docs)), key=lambda i: (docs[i].sha256, i))
    taken, room = [], budget
    for i in ranked:
        if docs[i].nbytes <= room:
            taken.append(i)
            room -= docs[i].nbytes
    return [docs[i] for i in sorted(taken)]


def _lines(texts: Sequence[str]) -> bytes:
    """The side's payload: one JSON string per document, a newline after each."""
    return "".join(json.dumps(t, ensure_ascii=False) + "\n" for t in texts).encode()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_fingerprint(manifest: dict[str, Any]) -> str:
    """The pack's fingerprint from its manifest's hashes (module docstring)."""
    parts = [f"format={PACK_FORMAT}", f"vocab_size={manifest['vocab_size']}",
             f"source={manifest['source']['name']}",
             f"licence={manifest['source']['licence']['sha256']}",
             *(f"{side}={manifest[side]['sha256']}" for side in _SIDES),
             f"tokenizer={manifest['tokenizer']['sha256']}"]
    return _sha256(";".join(parts).encode())


def _encode(tok: Tokenizer, texts: Sequence[str], vocab_size: int) -> np.ndarray:
    """One token stream of ``texts``, each followed by ``<|endoftext|>``."""
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    docs = [corpus.Document("pack", str(i), "", len(t.encode()), t) for i, t in enumerate(texts)]
    return corpus._encode(tok, docs, dtype, _NoBar())


def make_pack(source: PackSource, out: str | os.PathLike[str], *, train_bytes: int,
              test_bytes: int, vocab_size: int) -> dict[str, Any]:
    """Pack at most ``train_bytes`` and ``test_bytes`` of ``source`` into the new folder ``out``.

    Args:
      source: the one source of the text (:func:`stdlib_source`); its documents are listed
        here (:func:`sage_train.data.corpus.list_documents`), each knows its side.
      out: the pack's folder; it must not exist or be empty.
      train_bytes: the train side's budget in UTF-8 bytes, >= 1.
      test_bytes: the test side's budget, >= 1.
      vocab_size: the tokenizer's vocabulary (the model's).

    Returns:
      The manifest (what ``pack.json`` holds).

    Raises:
      ValueError: a budget below 1 or that holds no document, ``out`` is not empty, or
        the source's licence file cannot be read.
    """
    budgets = {"train": train_bytes, "test": test_bytes}
    for side, budget in budgets.items():
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"--{side}-bytes must be an integer >= 1, got {budget!r}")
    store.check_text_vocab(vocab_size)
    out = Path(out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {out} is not an empty folder: remove it or give another --out")
    try:
        licence = source.licence.read_bytes()
    except OSError as e:
        raise ValueError(f"the licence {str(source.licence)!r} of the source {source.name} "
                         f"cannot be read ({e.strerror or e})") from None
    docs = corpus.list_documents([source.root], progress=False).documents
    texts: dict[str, list[str]] = {}
    for side in _SIDES:
        taken = select([d for d in docs if d.test == (side == "test")], budgets[side])
        if not taken:
            raise ValueError(f"--{side}-bytes {budgets[side]:,} holds no document of the "
                             f"{side} split")
        texts[side] = [d.text for d in taken]
    tok = store.train_tokenizer(texts["train"], vocab_size)
    tokenizer = tok.to_str()
    payloads = {side: _lines(texts[side]) for side in _SIDES}
    manifest: dict[str, Any] = {
        "format": PACK_FORMAT, "vocab_size": int(vocab_size),
        "source": {"name": source.name, "folder": str(source.root.path), **source.info,
                   "licence": {"file": "LICENSE", "from": str(source.licence),
                               "sha256": _sha256(licence)},
                   "notice": "NOTICE"},
        **{side: {"file": f"{side}.jsonl.xz", "documents": len(texts[side]),
                  "bytes": sum(len(t.encode()) for t in texts[side]),
                  "budget": budgets[side], "sha256": _sha256(payloads[side])}
           for side in _SIDES},
        "tokenizer": {"file": "tokenizer.json", "sha256": _sha256(tokenizer.encode()),
                      "tokenizers": _tokenizers_version()},
    }
    manifest["fingerprint"] = pack_fingerprint(manifest)
    files: dict[str, str] = {"tokenizer.json": tokenizer, "NOTICE": source.notice}
    out.mkdir(parents=True, exist_ok=True)
    (out / "LICENSE").write_bytes(licence)
    for side in _SIDES:
        (out / manifest[side]["file"]).write_bytes(
            lzma.compress(payloads[side], preset=9 | lzma.PRESET_EXTREME))
    for name, text in files.items():
        (out / name).write_text(text)
    tokens = _tokens(out, manifest)
    manifest["cut"] = _cut_summary(tokens, manifest)
    (out / PACK_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _tokenizers_version() -> str:
    import tokenizers

    return str(tokenizers.__version__)


def _read_manifest(folder: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((folder / PACK_MANIFEST).read_text())
        if manifest.get("format") != PACK_FORMAT:
            raise ValueError(f"format {manifest.get('format')!r}, this sage_train reads "
                             f"format {PACK_FORMAT} only: make it again with python -m "
                             "sage_train.data.pack")
        if pack_fingerprint(manifest) != manifest["fingerprint"]:
            raise ValueError("it does not match its own fingerprint")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"pack {str(folder)!r} cannot be read ({e}): check out its folder "
                         "again") from None
    return dict(manifest)


def _texts(folder: Path, manifest: dict[str, Any], side: str) -> list[str]:
    """The side's documents, decompressed and checked against the manifest."""
    path = folder / manifest[side]["file"]
    try:
        payload = lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as e:
        raise ValueError(f"pack file {str(path)!r} cannot be read ({e}): check it out again"
                         ) from None
    if _sha256(payload) != manifest[side]["sha256"]:
        raise ValueError(f"pack file {str(path)!r} does not match {PACK_MANIFEST} (its text "
                         "changed): check it out again")
    return [json.loads(line) for line in payload.decode().splitlines()]


def _tokens(folder: Path, manifest: dict[str, Any]) -> store.TokenData:
    tok_path = folder / manifest["tokenizer"]["file"]
    try:
        tok_text = tok_path.read_text()
    except OSError as e:
        raise ValueError(f"pack file {str(tok_path)!r} cannot be read ({e.strerror or e})"
                         ) from None
    if _sha256(tok_text.encode()) != manifest["tokenizer"]["sha256"]:
        raise ValueError(f"pack file {str(tok_path)!r} does not match {PACK_MANIFEST} (it "
                         "changed): check it out again")
    tok = Tokenizer.from_str(tok_text)
    vocab = int(manifest["vocab_size"])
    sides = {side: _encode(tok, _texts(folder, manifest, side), vocab) for side in _SIDES}
    docs = manifest["train"]["documents"] + manifest["test"]["documents"]
    description = (f"pack {folder} ({docs:,} documents, fingerprint "
                   f"{manifest['fingerprint'][:16]})")
    info: dict[str, str | int] = {"corpus_fingerprint": str(manifest["fingerprint"]),
                                  "corpus_tokens": len(sides["train"]) + len(sides["test"])}
    return store.TokenData(sides["train"], sides["test"], vocab, tok, description, info=info)


def _cut_summary(tokens: store.TokenData, manifest: dict[str, Any]) -> dict[str, Any]:
    """The cut the pack gives (:func:`cut_pack`): its fingerprint and token counts."""
    import tempfile

    from sage_train.data import cut

    with tempfile.TemporaryDirectory() as tmp:
        made = cut.cut_data(tokens, Path(tmp) / "cut", train_tokens=len(tokens.train),
                            test_tokens=len(tokens.test))
    return {"fingerprint": made["fingerprint"], "train_tokens": made["train"]["tokens"],
            "test_tokens": made["test"]["tokens"]}


def load_pack(path: str | os.PathLike[str], vocab_size: int) -> store.TokenData:
    """The pack in folder ``path`` (or its ``pack.json``), tokenized, every file checked.

    Raises:
      ValueError: a damaged or changed file (named), or another vocabulary size.
    """
    p = Path(path).expanduser()
    folder = p.parent if p.name == PACK_MANIFEST else p
    manifest = _read_manifest(folder)
    if int(manifest["vocab_size"]) != vocab_size:
        raise ValueError(f"pack {str(folder)!r} has a vocabulary of "
                         f"{manifest['vocab_size']:,} tokens, the model's is {vocab_size:,}: "
                         "give --model the pack's model")
    return _tokens(folder, manifest)


def cut_pack(path: str | os.PathLike[str], out: str | os.PathLike[str], vocab_size: int
             ) -> dict[str, Any]:
    """Cut the whole pack ``path`` into the folder ``out``: the cut the pack records.

    Returns:
      The cut's manifest (:func:`sage_train.data.cut.cut_data`).

    Raises:
      ValueError: a damaged pack, another vocabulary, ``out`` holding something else, or
        tokens whose fingerprint is not the pack's ``cut_fingerprint`` (another tokenizer
        library that encodes differently: the line names both versions).
      OSError: ``out`` cannot be written.
    """
    from sage_train.data import cut

    p = Path(path).expanduser()
    folder = p.parent if p.name == PACK_MANIFEST else p
    tokens = load_pack(folder, vocab_size)
    manifest = _read_manifest(folder)
    expected = (manifest.get("cut") or {}).get("fingerprint")
    out = Path(out).expanduser()
    fresh = not out.exists() or (out.is_dir() and not any(out.iterdir()))
    made = cut.cut_data(tokens, out, train_tokens=len(tokens.train),
                        test_tokens=len(tokens.test))
    if expected is not None and made["fingerprint"] != expected:
        if fresh:
            shutil.rmtree(out, ignore_errors=True)
        raise ValueError(
            f"pack {str(folder)!r} gives the cut {made['fingerprint'][:16]} here, not its "
            f"recorded {expected[:16]}: tokenizers {_tokenizers_version()} encodes its text "
            f"differently from tokenizers {manifest['tokenizer']['tokenizers']}, which made "
            "it; install that version")
    return made


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sage_train.data.pack``: make a pack of one named source; 2 on bad input."""
    parser = argparse.ArgumentParser(
        prog="python -m sage_train.data.pack",
        description="Pack one source's text (xz) with a BPE trained on it, to commit.")
    parser.add_argument("--source", required=True, choices=sorted(SOURCES),
                        help="the one source of the text (stdlib: this CPython's standard "
                        "library .py files, PSF License)")
    parser.add_argument("--out", required=True, help="the new pack's folder (empty or absent)")
    parser.add_argument("--train-bytes", type=int, required=True,
                        help="the train side's budget in UTF-8 bytes")
    parser.add_argument("--test-bytes", type=int, required=True,
                        help="the test side's budget in UTF-8 bytes")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help="the tokenizer's vocabulary (the model's)")
    args = parser.parse_args(argv)
    try:
        manifest = make_pack(SOURCES[args.source](), args.out, train_bytes=args.train_bytes,
                             test_bytes=args.test_bytes, vocab_size=args.vocab_size)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
