"""The ``installed`` corpus: every text this machine already has, tokenized once and cached.

``sage-train --data installed`` trains on it; nothing is downloaded. The documents are

* the Python standard library's ``.py`` files, chosen as
  :func:`sage_train.data.pipeline.stdlib_corpus` chooses them (the same skipped folders),
  without its size cap;
* the sources and documentation of every installed package: the running interpreter's
  ``site-packages`` folders (:func:`default_roots`), files with a source or documentation
  suffix (:data:`TEXT_SUFFIXES`: ``.py .pyi .pyx .md .rst .txt .c .h .cpp .cu .toml
  .yaml ...``) or a documentation name (:data:`DOC_NAMES`: ``README``, ``LICENSE``,
  ``METADATA``, ``changelog``, ...);
* the system documentation: ``/usr/share/doc`` and ``/usr/share/info``, gzipped files read
  through ``gzip``. Manual pages are not read: they are ``roff`` markup, not prose.

Each file is one document if it is strict UTF-8 without a NUL byte, not blank and at most
``max_file_bytes`` bytes (:data:`MAX_FILE_BYTES`, 1 MiB, after decompression; bigger files
are generated tables, logs and data). Hidden files and folders, ``__pycache__``, symbolic
links and the folders of ``sage-train`` runs are never read. Every other file is skipped and
counted by reason (:attr:`Listing.skipped`).

Determinism: the roots are read in a fixed order and each root's files in sorted order of
their relative POSIX path, whatever order the file system lists them in; a document whose
content (SHA-256 of its UTF-8 bytes) was already seen is a duplicate and dropped, so the
first occurrence in that order wins.

The split is 8:2 by document, as the paper's: a document is in the test split when the
first 8 hex digits of its SHA-256, read as an integer, are divisible by 5
(:func:`is_test_document`). A document's side depends on its content alone, so installing
a package adds documents to both sides without moving any other. The train documents, in
listing order and each followed by ``<|endoftext|>``, are the train token stream; the test
documents likewise the test stream.

The byte-level BPE (:func:`sage_train.data.pipeline.train_tokenizer`) is trained on a deterministic
sample of the *train* documents only (those with the smallest content hashes, up to
``tokenizer_bytes``, :data:`TOKENIZER_BYTES`, 100 MB). On a 2-core machine a 32768-token
BPE took 34 s on 100 MB and 142 s on all ~320 MB of train text, and compressed held-out
text to 3.56 and 3.57 bytes per token: the whole text buys little. The fingerprint
(:func:`fingerprint`) is a hash of the documents' contents in stream order, their sides and
the tokenizer settings; it names the cache entry under ``cache_dir() / "corpus"``
(tokenizer JSON, ``train.npy`` and ``test.npy`` token arrays, loaded memory-mapped,
``meta.json`` with the figures and ``documents.tsv`` with every document's side, hash, size
and path).

Run ``python -m sage_train.data.corpus`` to build it and print its figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import hashlib
import json
import os
import platform
import site
import sys
import sysconfig
import time
import warnings
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from sage_train.data import token_store as store
from sage_train.store.report import progress_bar

__all__ = [
    "CORPUS_FORMAT",
    "DOC_NAMES",
    "MAX_FILE_BYTES",
    "SOURCE",
    "TEXT_SUFFIXES",
    "TOKENIZER_BYTES",
    "Corpus",
    "Document",
    "Listing",
    "Root",
    "build_corpus",
    "default_roots",
    "fingerprint",
    "is_test_document",
    "list_documents",
    "load_installed",
    "main",
]

SOURCE = "installed"
"""The name of this corpus as a data source (``sage-train --data installed``)."""
MAX_FILE_BYTES = 1 << 20
"""Default cap (UTF-8 bytes, after decompression) of one document; bigger files are skipped."""
TOKENIZER_BYTES = 100_000_000
"""Default size (UTF-8 bytes) of the train-document sample the BPE is trained on (100 MB)."""
CORPUS_FORMAT = 1
"""Part of the fingerprint; bump it whenever the selection, split or cache layout changes."""

TEXT_SUFFIXES = frozenset(
    {".py", ".pyi", ".pyx", ".pxd", ".pxi",  # Python, Cython
     ".md", ".markdown", ".rst", ".txt", ".adoc", ".texi",  # documentation
     ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp", ".hh", ".cu", ".cuh", ".inc",  # C, C++, CUDA
     ".toml", ".cfg", ".ini", ".yaml", ".yml",  # configuration
     ".sh", ".info"}
)
"""Suffixes (lower-cased; ``.gz`` stripped first where a root reads gzip) of files read."""
DOC_NAMES = frozenset(
    {"README", "NEWS", "CHANGES", "CHANGELOG", "HISTORY", "AUTHORS", "CONTRIBUTORS",
     "LICENSE", "LICENCE", "COPYING", "COPYRIGHT", "NOTICE", "METADATA", "TODO", "THANKS",
     "INSTALL", "BUGS", "FAQ", "USAGE"}
)
"""File names (upper-cased, up to the first ``.``) read whatever their suffix
(``README.Debian``, ``changelog.Debian.gz``, ``copyright``, a wheel's ``METADATA``)."""
_SKIP_DIRS = frozenset({"__pycache__"})
_TEST_MODULUS = 5  # one document in 5 is a test document
_ENCODE_BATCH_BYTES = 4 << 20  # text per encode_batch call


@dataclasses.dataclass(frozen=True)
class Root:
    """A folder the corpus reads, with the rule for which of its files are documents.

    Attributes:
        name: label of the root in the listing (``"stdlib"``, ``"packages"``, ``"doc"``).
        path: the folder.
        python_only: read only ``.py`` files (the standard library, as
            :func:`sage_train.data.pipeline.stdlib_corpus`) instead of :data:`TEXT_SUFFIXES` and
            :data:`DOC_NAMES`.
        skip_dirs: folder names skipped at any depth (hidden folders always are).
        gzip: read ``*.gz`` files (whose name without ``.gz`` qualifies) through ``gzip``.
    """

    name: str
    path: Path
    python_only: bool = False
    skip_dirs: frozenset[str] = _SKIP_DIRS
    gzip: bool = False

    def wants(self, name: str) -> bool:
        """Whether a file called ``name`` in this root is read as a document."""
        if name.startswith("."):
            return False
        if name.lower().endswith(".gz"):
            if not self.gzip:
                return False
            name = name[:-3]
        suffix = os.path.splitext(name)[1].lower()
        if self.python_only:
            return suffix == ".py"
        return suffix in TEXT_SUFFIXES or name.split(".")[0].upper() in DOC_NAMES


@dataclasses.dataclass(frozen=True)
class Document:
    """One document of the corpus.

    Attributes:
        root: name of the :class:`Root` it was read from.
        path: its path relative to the root (POSIX).
        sha256: hex SHA-256 of its UTF-8 bytes (after decompression).
        nbytes: its size in UTF-8 bytes.
        text: its text.
    """

    root: str
    path: str
    sha256: str
    nbytes: int
    text: str = dataclasses.field(repr=False)

    @property
    def test(self) -> bool:
        """Whether the document is in the test split (:func:`is_test_document`)."""
        return is_test_document(self.sha256)


@dataclasses.dataclass(frozen=True)
class Listing:
    """The documents found under some roots, deduplicated, in listing order.

    Attributes:
        documents: the documents, in root order and then sorted relative path.
        files: files that qualified by name (read or skipped).
        skipped: files not used, by reason (``"too large"``, ``"binary"``,
            ``"not utf-8"``, ``"unreadable"``, ``"blank"``, ``"duplicate"``).
        roots: the roots read, ``{name: path}``.
    """

    documents: list[Document]
    files: int
    skipped: dict[str, int]
    roots: dict[str, str]

    @property
    def nbytes(self) -> int:
        """Total UTF-8 bytes of the documents."""
        return sum(d.nbytes for d in self.documents)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """The tokenized ``installed`` corpus (a cache entry).

    Attributes:
        train: 1-D token array (memory-mapped): the train documents, each followed by
            :data:`~sage_train.data.pipeline.EOT_ID`.
        test: 1-D token array (memory-mapped): the test documents, likewise.
        tokenizer: the byte-level BPE.
        vocab_size: the tokenizer's exact vocabulary size.
        fingerprint: hex hash of the documents, their sides and the tokenizer settings.
        meta: the figures of ``meta.json``: documents, bytes and tokens per side, skipped
            files by reason, the roots, the build time in seconds, ...
        path: the cache entry.
    """

    train: np.ndarray
    test: np.ndarray
    tokenizer: Tokenizer = dataclasses.field(repr=False)
    vocab_size: int
    fingerprint: str
    meta: dict[str, Any] = dataclasses.field(repr=False)
    path: Path

    @property
    def tokens(self) -> int:
        """Tokens of both splits (``<|endoftext|>`` tokens included)."""
        return len(self.train) + len(self.test)

    def token_data(self) -> store.TokenData:
        """The corpus as the trainer's :class:`~sage_train.data.pipeline.TokenData`.

        Its ``info`` holds ``corpus_fingerprint`` and ``corpus_tokens``, which a run records
        in its ``config.json``.
        """
        docs = self.meta["train_documents"] + self.meta["test_documents"]
        source = (f"{SOURCE} ({docs:,} documents, {self.tokens:,} tokens, fingerprint "
                  f"{self.fingerprint[:16]})")
        info: dict[str, str | int] = {"corpus_fingerprint": self.fingerprint,
                                      "corpus_tokens": self.tokens}
        return store.TokenData(self.train, self.test, self.vocab_size, self.tokenizer,
                                  source, info=info)


def default_roots() -> tuple[Root, ...]:
    """The roots of the ``installed`` corpus on this machine, in reading order.

    The standard library (``.py`` files, :data:`sage_train.data.pipeline.STDLIB_SKIP_DIRS` skipped),
    every ``site-packages`` folder of the running interpreter (``sysconfig``'s ``purelib`` and
    ``platlib``, ``site.getsitepackages()`` and the user site when enabled; each folder once),
    then ``/usr/share/doc`` and ``/usr/share/info`` where they exist (gzip read).

    Raises:
        FileNotFoundError: the standard library is not where ``sysconfig`` says.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if not stdlib.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {stdlib}")
    roots = [Root("stdlib", stdlib, python_only=True, skip_dirs=store.STDLIB_SKIP_DIRS)]
    paths = sysconfig.get_paths()
    candidates = [paths["purelib"], paths["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        candidates.append(site.getusersitepackages())
    seen: set[str] = set()
    for c in candidates:
        real = os.path.realpath(c)
        if real in seen or not os.path.isdir(real):
            continue
        seen.add(real)
        name = "packages" if len(seen) == 1 else f"packages{len(seen)}"
        roots.append(Root(name, Path(c)))
    for name, folder in (("doc", "/usr/share/doc"), ("info", "/usr/share/info")):
        if os.path.isdir(folder):
            roots.append(Root(name, Path(folder), gzip=True))
    return tuple(roots)


def is_test_document(sha256: str) -> bool:
    """Whether the document with this hex SHA-256 is in the test split.

    True for one document in five: ``int(sha256[:8], 16) % 5 == 0``.
    """
    return int(sha256[:8], 16) % _TEST_MODULUS == 0


def _files(root: Root) -> list[tuple[str, Path]]:
    """``(relative POSIX path, path)`` of the files of ``root`` read by name, sorted."""
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root.path):
        if store.RUN_MARK in filenames:  # a sage-train run: never data
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in root.skip_dirs]
        for name in filenames:
            if root.wants(name):
                f = Path(dirpath) / name
                if not f.is_symlink() and f.is_file():
                    found.append((f.relative_to(root.path).as_posix(), f))
    found.sort()
    return found


def _read(root: Root, path: Path, max_file_bytes: int) -> bytes | str:
    """The file's bytes (decompressed where ``root.gzip``), or the reason it is skipped."""
    try:
        if root.gzip and path.name.lower().endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(max_file_bytes + 1)
        else:
            if path.stat().st_size > max_file_bytes:
                return "too large"
            data = path.read_bytes()
    except (OSError, EOFError, zlib.error):
        return "unreadable"
    if len(data) > max_file_bytes:
        return "too large"
    if b"\x00" in data:
        return "binary"
    return data


def _progress(progress: bool | None) -> bool:
    return sys.stderr.isatty() if progress is None else bool(progress)


def _check_limits(max_file_bytes: int, max_files: int | None) -> None:
    """Raise ValueError on a bad ``max_file_bytes``/``max_files`` of :func:`list_documents`."""
    if isinstance(max_file_bytes, bool) or not isinstance(max_file_bytes, int) or (
            max_file_bytes < 1):
        raise ValueError(f"max_file_bytes must be a positive int, got {max_file_bytes!r}")
    if max_files is not None and (isinstance(max_files, bool) or not isinstance(
            max_files, int) or max_files < 1):
        raise ValueError(f"max_files must be a positive int or None, got {max_files!r}")


def _check_roots(roots: Sequence[Root]) -> None:
    """Raise on two roots sharing a name (ValueError) or a root that is not a folder."""
    names = [r.name for r in roots]
    if len(set(names)) != len(names):
        raise ValueError(f"corpus roots must have distinct names, got {names}")
    for r in roots:
        if not Path(r.path).is_dir():
            raise FileNotFoundError(f"corpus root {r.name!r}: {str(r.path)!r} is not a folder")


def _document(root: Root, rel: str, path: Path, max_file_bytes: int,
              seen: set[str]) -> Document | str:
    """The file as a :class:`Document`, or the reason it is skipped (``seen``: hashes read)."""
    data = _read(root, path, max_file_bytes)
    if isinstance(data, str):
        return data
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "not utf-8"
    if not text.strip():
        return "blank"
    sha = hashlib.sha256(data).hexdigest()
    if sha in seen:
        return "duplicate"
    return Document(root.name, rel, sha, len(data), text)


def list_documents(
    roots: Sequence[Root] | None = None,
    *,
    max_file_bytes: int = MAX_FILE_BYTES,
    max_files: int | None = None,
    progress: bool | None = None,
) -> Listing:
    """Read the documents under ``roots``, deduplicated, in listing order.

    Args:
        roots: the folders to read, in order (``None``: :func:`default_roots`).
        max_file_bytes: a file larger than this (after decompression) is skipped; positive.
        max_files: read only the first this many qualifying files of each root, in sorted
            order (``None``: all), for a quick look at a large listing.
        progress: a ``tqdm`` bar over the files read (``None``: when stderr is a terminal).

    Returns:
        The :class:`Listing`.

    Raises:
        FileNotFoundError: a root is not a folder.
        ValueError: bad ``max_file_bytes``/``max_files``, two roots share a name, or the
            roots hold no document.
    """
    _check_limits(max_file_bytes, max_files)
    roots = default_roots() if roots is None else tuple(roots)
    _check_roots(roots)
    listed = [(r, rel, f) for r in roots for rel, f in _files(r)[:max_files]]
    skipped = dict.fromkeys(("too large", "binary", "not utf-8", "unreadable", "blank",
                             "duplicate"), 0)
    seen: set[str] = set()
    docs: list[Document] = []
    bar = progress_bar(total=len(listed), desc="reading", unit="file",
                       disable=not _progress(progress))
    for r, rel, f in listed:
        bar.update()
        doc = _document(r, rel, f, max_file_bytes, seen)
        if isinstance(doc, str):
            skipped[doc] += 1
            continue
        seen.add(doc.sha256)
        docs.append(doc)
    bar.close()
    if not docs:
        where = ", ".join(f"{r.name}={str(r.path)!r}" for r in roots) or "no roots"
        raise ValueError(f"installed corpus: no documents found under {where} "
                         f"({len(listed)} files by name, skipped {_fmt_skipped(skipped)})")
    return Listing(docs, len(listed), skipped, {r.name: str(r.path) for r in roots})


def _fmt_skipped(skipped: dict[str, int]) -> str:
    return ", ".join(f"{n} {why}" for why, n in skipped.items() if n) or "none"


def _settings(vocab_size: int, tokenizer_bytes: int) -> dict[str, Any]:
    return {"format": CORPUS_FORMAT, "data_format": store.FORMAT_VERSION,
            "vocab_size": int(vocab_size), "tokenizer_bytes": int(tokenizer_bytes),
            "tokenizers": tokenizers.__version__}


def fingerprint(documents: Sequence[Document], *, vocab_size: int,
                tokenizer_bytes: int = TOKENIZER_BYTES) -> str:
    """The corpus fingerprint: a hex SHA-256 of the tokenizer settings and the documents.

    Covers :data:`CORPUS_FORMAT`, the data format, ``vocab_size``, ``tokenizer_bytes`` and
    the ``tokenizers`` version, then every document's side and content hash in stream order
    (train documents, then test documents, each in listing order). Paths are not covered: the
    same files under another prefix give the same corpus.
    """
    h = hashlib.sha256(json.dumps(_settings(vocab_size, tokenizer_bytes),
                                  sort_keys=True).encode())
    for side in (False, True):
        for d in documents:
            if d.test == side:
                h.update(f"{'test' if side else 'train'}:{d.sha256}\n".encode())
    return h.hexdigest()


def _tokenizer_sample(train_docs: Sequence[Document], tokenizer_bytes: int) -> list[str]:
    """The train documents with the smallest hashes, up to ``tokenizer_bytes`` bytes."""
    sample: list[str] = []
    total = 0
    for d in sorted(train_docs, key=lambda d: d.sha256):
        if total >= tokenizer_bytes:
            break
        sample.append(d.text)
        total += d.nbytes
    return sample


def _batches(docs: Sequence[Document]) -> Iterator[tuple[list[str], list[bool], int]]:
    """Pieces of the documents in batches: ``(pieces, last piece of its document?, bytes)``."""
    pieces: list[str] = []
    last: list[bool] = []
    nbytes = 0
    for d in docs:
        ps = list(store.pieces(d.text))
        pieces.extend(ps)
        last.extend([False] * (len(ps) - 1) + [True])
        nbytes += d.nbytes
        if nbytes >= _ENCODE_BATCH_BYTES:
            yield pieces, last, nbytes
            pieces, last, nbytes = [], [], 0
    if pieces:
        yield pieces, last, nbytes


def _encode(tok: Tokenizer, docs: Sequence[Document], dtype: np.dtype, bar: Any) -> np.ndarray:
    """One token stream of ``docs``, each followed by ``EOT_ID``; ``bar`` counts bytes."""
    eot = np.array([store.EOT_ID], dtype=dtype)
    parts: list[np.ndarray] = []
    for pieces, last, nbytes in _batches(docs):
        for enc, is_last in zip(tok.encode_batch_fast(pieces, add_special_tokens=False), last,
                                strict=True):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            if is_last:
                parts.append(eot)
        bar.update(nbytes)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _load_entry(entry: Path, vocab_size: int) -> Corpus | None:
    """The cache entry, memory-mapped (``None``: missing or damaged, to be rebuilt).

    Damaged: a file that does not load, or whose checksum is not the one recorded when it
    was published (:func:`sage_train.data.pipeline.verify_entry`), or a tokenizer of another
    vocabulary size.
    """
    if not entry.is_dir():
        return None
    if (problem := store.verify_entry(entry, vocab_size)) is not None:
        warnings.warn(f"corpus cache entry {entry} is damaged ({problem}): it is rebuilt",
                      stacklevel=3)
        return None
    try:
        meta = json.loads((entry / "meta.json").read_text())
        tok = Tokenizer.from_file(str(entry / "tokenizer.json"))
        train = np.load(entry / "train.npy", mmap_mode="r")
        test = np.load(entry / "test.npy", mmap_mode="r")
    except Exception:  # missing or corrupt: rebuild
        return None
    if (train.ndim != 1 or test.ndim != 1 or len(train) != meta.get("train_tokens")
            or len(test) != meta.get("test_tokens")
            or tok.get_vocab_size() != vocab_size):
        return None
    for name, part in (("train.npy", train), ("test.npy", test)):
        if len(part) and (top := int(part.max())) >= vocab_size:
            raise ValueError(f"corpus cache file {str(entry / name)!r} holds token id {top} "
                             f">= vocab_size={vocab_size}; delete {str(entry)!r} to rebuild it")
    return Corpus(train, test, tok, vocab_size, meta["fingerprint"], meta, entry)


def build_corpus(
    roots: Sequence[Root] | None = None,
    *,
    vocab_size: int,
    max_file_bytes: int = MAX_FILE_BYTES,
    tokenizer_bytes: int = TOKENIZER_BYTES,
    progress: bool | None = None,
) -> Corpus:
    """Build the corpus of ``roots`` (or load it from the cache) and return it.

    The documents are always read and hashed (:func:`list_documents`), so a changed file is
    never missed; the tokenizer is trained and the text encoded only when no cache entry has
    the corpus's :func:`fingerprint`. The entry is written to a temporary folder renamed into
    place when complete, so processes that build it at once never see a partial one.

    Args:
        roots: the folders to read (``None``: :func:`default_roots`, the ``installed`` corpus).
        vocab_size: exact vocabulary size of the BPE, ``>= MIN_VOCAB_SIZE``.
        max_file_bytes: size cap of one document (:func:`list_documents`).
        tokenizer_bytes: size of the train-document sample the BPE is trained on; positive.
        progress: ``tqdm`` bars while reading and encoding (``None``: when stderr is a
            terminal).

    Returns:
        The :class:`Corpus`, its token arrays memory-mapped from the cache (in memory if the
        cache cannot be written, with a warning).

    Raises:
        FileNotFoundError: a root is not a folder.
        ValueError: bad settings, no documents, or a side with no document.
    """
    store.check_text_vocab(vocab_size)
    vocab_size = int(vocab_size)
    if isinstance(tokenizer_bytes, bool) or not isinstance(tokenizer_bytes, int) or (
            tokenizer_bytes < 1):
        raise ValueError(f"tokenizer_bytes must be a positive int, got {tokenizer_bytes!r}")
    start = time.perf_counter()
    listing = list_documents(roots, max_file_bytes=max_file_bytes, progress=progress)
    fp = fingerprint(listing.documents, vocab_size=vocab_size, tokenizer_bytes=tokenizer_bytes)
    root = store.cache_dir() / "corpus"
    entry = root / fp[:32]
    if (cached := _load_entry(entry, vocab_size)) is not None:
        return cached

    train_docs = [d for d in listing.documents if not d.test]
    test_docs = [d for d in listing.documents if d.test]
    if not train_docs or not test_docs:
        raise ValueError(
            f"installed corpus: {len(listing.documents)} document(s) give an empty "
            f"{'train' if not train_docs else 'test'} split; it needs more documents")
    t0 = time.perf_counter()
    tok = store.train_tokenizer(_tokenizer_sample(train_docs, tokenizer_bytes), vocab_size)
    tokenizer_seconds = time.perf_counter() - t0
    dtype = store.dtype_for_vocab(vocab_size)
    with progress_bar(total=listing.nbytes, desc="tokenizing", unit="B", unit_scale=True,
                      disable=not _progress(progress)) as bar:
        train = _encode(tok, train_docs, dtype, bar)
        test = _encode(tok, test_docs, dtype, bar)
    meta = {
        "fingerprint": fp, **_settings(vocab_size, tokenizer_bytes),
        "max_file_bytes": max_file_bytes, "roots": listing.roots, "files": listing.files,
        "skipped": listing.skipped,
        "train_documents": len(train_docs), "test_documents": len(test_docs),
        "train_bytes": sum(d.nbytes for d in train_docs),
        "test_bytes": sum(d.nbytes for d in test_docs),
        "train_tokens": len(train), "test_tokens": len(test),
        "tokenizer_seconds": round(tokenizer_seconds, 1),
        "build_seconds": round(time.perf_counter() - start, 1),
        "built": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "machine": platform.machine(),
    }
    documents = "".join(
        f"{'test' if d.test else 'train'}\t{d.sha256}\t{d.nbytes}\t{d.root}/{d.path}\n"
        for d in listing.documents)
    files: dict[str, str | np.ndarray] = {
        "tokenizer.json": tok.to_str(), "train.npy": train, "test.npy": test,
        "documents.tsv": documents, "meta.json": json.dumps(meta, indent=1)}
    # an existing entry is damaged here: it did not load above
    if (error := store.publish_entry(entry, files, damaged=lambda: True,
                                        vocab_size=vocab_size)):
        warnings.warn(f"could not write the corpus cache under {root}: {error}", stacklevel=2)
        return Corpus(train, test, tok, vocab_size, fp, meta, entry)
    return _load_entry(entry, vocab_size) or Corpus(train, test, tok, vocab_size, fp, meta,
                                                    entry)


def load_installed(vocab_size: int, *, progress: bool | None = None) -> store.TokenData:
    """The ``installed`` corpus as :class:`~sage_train.data.pipeline.TokenData`, built once.

    Args:
        vocab_size: exact vocabulary size of the BPE.
        progress: ``tqdm`` bars (``None``: when stderr is a terminal).
    """
    return build_corpus(vocab_size=vocab_size, progress=progress).token_data()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sage_train.data.corpus``: build (or load) the corpus and print its figures."""
    from sage_train.model.shapes import get_model_config

    p = argparse.ArgumentParser(
        prog="python -m sage_train.data.corpus",
        description="Build the offline 'installed' corpus (sage-train --data installed) "
        "and print its figures.")
    p.add_argument("--model", default="60m",
                   help="the model whose vocabulary size the tokenizer gets (default 60m)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the vocabulary size (default: the --model's)")
    args = p.parse_args(argv)
    try:
        vocab = args.vocab_size or get_model_config(args.model).vocab_size
        start = time.perf_counter()
        c = build_corpus(vocab_size=vocab)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = c.meta
    docs = m["train_documents"] + m["test_documents"]
    print(f"corpus       {c.path}")
    print(f"fingerprint  {c.fingerprint[:16]}")
    print(f"documents    {docs:,} ({m['train_documents']:,} train, {m['test_documents']:,} "
          f"test) of {m['files']:,} files; skipped {_fmt_skipped(m['skipped'])}")
    print(f"bytes        {m['train_bytes'] + m['test_bytes']:,} ({m['train_bytes']:,} train, "
          f"{m['test_bytes']:,} test)")
    print(f"tokens       {c.tokens:,} ({len(c.train):,} train, {len(c.test):,} test), vocab "
          f"{c.vocab_size:,}")
    print(f"built in     {m['build_seconds']:.0f} s (tokenizer {m['tokenizer_seconds']:.0f} s, "
          f"{m['tokenizer_bytes']:,} bytes sample); loaded in "
          f"{time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
