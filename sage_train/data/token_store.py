"""The token store the trainer's data sources share: tokenizer, token dtype, cache entries.

Below :mod:`sage_train.data.pipeline` (the sources and batches), :mod:`sage_train.data.corpus` (the
``installed`` corpus) and :mod:`sage_train.data.cut` (cuts of it), which all read and write
their tokens through it: the byte-level BPE (:func:`train_tokenizer`), the special token
:data:`EOT`, :class:`TokenData`, and the cache entries written whole or not at all and
checked on every load (:func:`publish_entry`, :func:`verify_entry`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
"""Special token appended after every document; always id :data:`EOT_ID`."""


EOT_ID = 0
"""Token id of :data:`EOT`."""


MIN_VOCAB_SIZE = 257
"""Smallest vocabulary for text sources: 256 byte tokens plus :data:`EOT`."""


RUN_MARK = ".lock"
"""The file every ``sage-train`` run directory holds: a folder with it is never read as text."""


FORMAT_VERSION = 1
"""Part of the cache key; bump it whenever tokenization or the cache layout changes."""


STDLIB_SKIP_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idlelib",
        "lib2to3",
        "encodings",  # machine-generated codec tables, not representative code
        "__pycache__",
    }
)
"""Directory names skipped (at any depth) by :func:`stdlib_corpus`."""


PIECE_CHARS = 1 << 18  # long documents are cut (at newlines) into pieces for parallel BPE


@dataclass(frozen=True, eq=False)
class TokenData:
    """A tokenized corpus with its fixed 8:2 train/test split.

    Attributes:
        train: 1-D integer token array (often an ``np.memmap``): first 80% of the stream.
        test: 1-D integer token array (often an ``np.memmap``): the remaining 20%.
        vocab_size: size of the model vocabulary; every token id is ``< vocab_size``.
        tokenizer: the byte-level BPE for text sources, ``None`` for pre-tokenized files.
        source: human-readable description of where the tokens came from.
        info: figures of the source that a run records in its ``config.json`` (the
            ``installed`` corpus: ``corpus_fingerprint`` and ``corpus_tokens``); empty for
            the other sources.
    """

    train: np.ndarray
    test: np.ndarray
    vocab_size: int
    tokenizer: Tokenizer | None = field(repr=False)
    source: str
    info: Mapping[str, str | int] = field(default_factory=dict)

    def __repr__(self) -> str:
        return (
            f"TokenData(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"train={len(self.train)} tokens, test={len(self.test)} tokens, "
            f"dtype={self.train.dtype}, tokenizer={'yes' if self.tokenizer else 'no'})"
        )


def cache_dir() -> Path:
    """Directory of the tokenizer/token cache: ``$SAGE_CACHE_DIR`` or ``~/.cache/sage-optim``."""
    env = os.environ.get("SAGE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sage-optim"


def pieces(text: str) -> Iterator[str]:
    """Cut a long text into pieces of about ``PIECE_CHARS`` characters at newlines."""
    start, n = 0, len(text)
    while start < n:
        end = start + PIECE_CHARS
        if end < n:
            nl = text.rfind("\n", start, end)
            if nl > start:
                end = nl + 1
        yield text[start:end]
        start = end


def check_text_vocab(vocab_size: int) -> None:
    """Refuse a vocabulary that a byte-level BPE cannot have (one line naming it)."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for a byte-level BPE: it needs at least "
            f"{MIN_VOCAB_SIZE} (256 byte tokens + {EOT})"
        )


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer on ``texts`` with exactly ``vocab_size`` tokens.

    GPT-2 style: ``tokenizers``' ``ByteLevel`` pre-tokenizer (no prefix space), decoder and
    post-processor, ``BpeTrainer`` seeded with the full 256-symbol byte-level alphabet (so any
    text can be encoded and ``decode(encode(s)) == s``), ``min_frequency=2`` and the special
    token :data:`EOT` at id 0. If the text is too small to learn ``vocab_size - 257`` merges,
    the vocabulary is topped up with never-produced special tokens ``<|reserved_i|>`` so that
    ``get_vocab_size() == vocab_size`` always. Training is deterministic for the same input.

    Args:
        texts: the training documents.
        vocab_size: the exact vocabulary size, ``>= MIN_VOCAB_SIZE``.

    Returns:
        The trained tokenizer.
    """
    check_text_vocab(vocab_size)
    vocab_size = int(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((p for t in texts for p in pieces(t)), trainer=trainer)
    missing = vocab_size - tok.get_vocab_size()
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size() != vocab_size or tok.token_to_id(EOT) != EOT_ID:
        raise RuntimeError("byte-level BPE training produced an unexpected vocabulary")
    return tok


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The narrowest unsigned dtype that holds every token id of ``vocab_size``."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


INTEGRITY = "checksums.json"
"""The file of a cache entry (token cache, ``installed`` corpus) that records the SHA-256
and size of every other file, and the tokenizer's vocabulary size, when it is published."""


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def verify_entry(entry: Path, vocab_size: int | None = None) -> str | None:
    """Why the cache ``entry`` cannot be used (``None``: it is as it was published).

    Every file :data:`INTEGRITY` names must have its recorded size and SHA-256 (a full
    read: 0.43 s for the 224 MB of a 112M-token ``uint16`` corpus, measured on a shared
    2-core machine), and the recorded vocabulary size must be
    ``vocab_size`` (where given).  An entry without the record (written by an older
    version) counts as damaged: it is rebuilt once.
    """
    try:
        record = json.loads((entry / INTEGRITY).read_text())
        files = record["files"]
        recorded_vocab = record.get("vocab_size")
    except FileNotFoundError:
        return f"no {INTEGRITY}: written by an older version or cut short"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"{INTEGRITY} cannot be read: {e}"
    if vocab_size is not None and recorded_vocab != vocab_size:
        return f"its tokenizer has {recorded_vocab} tokens, not vocab_size={vocab_size}"
    for name, want in sorted(files.items()):
        path = entry / name
        try:
            size = path.stat().st_size
            if size != want["bytes"]:
                return f"{name} has {size} bytes, {want['bytes']} were written"
            if _sha256(path) != want["sha256"]:
                return f"{name} does not have the checksum it was written with"
        except OSError as e:
            return f"{name} cannot be read: {e.strerror or e}"
        except (KeyError, TypeError):
            return f"{INTEGRITY} is damaged"
    return None


def publish_entry(entry: Path, files: Mapping[str, str | np.ndarray], *,
                  damaged: Callable[[], bool], vocab_size: int | None = None,
                  integrity: bool = True) -> str | None:
    """Write a cache entry whole or not at all; ``None``, or why it could not be written.

    The ``files`` (text, or arrays saved with :func:`numpy.save`) are written into a fresh
    directory beside ``entry`` that is then renamed to ``entry`` (atomic), so a reader sees
    a complete entry or none.  An existing ``entry`` for which ``damaged()`` is true (it did
    not load) is set aside first; when another process renamed its own entry in first, that
    one is kept.  Shared by the token cache and the ``installed`` corpus
    (:mod:`sage_train.data.corpus`); several processes may publish the same entry at once.
    With ``integrity`` the entry holds :data:`INTEGRITY`: the size and SHA-256 of every
    file and ``vocab_size`` (the tokenizer's), which :func:`verify_entry` checks on every
    load.
    """
    root = entry.parent
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=root))
        try:
            for name, content in files.items():
                if isinstance(content, str):
                    (tmp / name).write_text(content)
                else:
                    np.save(tmp / name, content)
            if integrity:
                record = {"files": {name: {"bytes": (tmp / name).stat().st_size,
                                           "sha256": _sha256(tmp / name)} for name in files},
                          "vocab_size": vocab_size}
                (tmp / INTEGRITY).write_text(json.dumps(record, indent=1))
            if entry.is_dir() and damaged():
                aside = root / f".{entry.name}.damaged-{os.getpid()}"
                try:
                    os.rename(entry, aside)
                except OSError:
                    pass  # another process moved it first
                shutil.rmtree(aside, ignore_errors=True)
            try:
                os.rename(tmp, entry)  # atomic; fails if a concurrent process won the race
            except OSError:
                if not entry.is_dir():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        return str(e)
    return None
