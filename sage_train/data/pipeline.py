"""Data pipeline of the LLaMA trainer: corpora, a local byte-level BPE, splits and batches.

Everything here works offline; nothing is ever downloaded.

Sources accepted by :func:`load_data`:

* ``None`` or ``"stdlib"`` -- the embedded default: the Python standard library's own ``.py``
  files (:func:`stdlib_corpus`), present on every machine with Python.
* ``"installed"`` -- the offline ~100M-token corpus of every text the machine has (standard
  library, installed packages' sources and documentation, system documentation), split 8:2
  *by document* and cached once (:mod:`sage_train.data.corpus`).
* a text file or a folder of text files (:func:`read_text_source`).
* a cut (:mod:`sage_train.data.cut`): a folder holding ``cut.json`` (or that file), a fixed,
  fingerprinted token set taken from a corpus with its own train and test sides, every file
  checked against its manifest when loaded.
* a pre-tokenized token file prepared elsewhere: ``.u16`` / ``.u32`` (raw little-endian
  uint16 / uint32), ``.bin`` (raw, dtype given by ``token_dtype``) or ``.npy`` (1-D uint16 /
  uint32 array). These are memory-mapped, never read into memory.

Text is tokenized with a byte-level BPE trained locally with the ``tokenizers`` package
(:func:`train_tokenizer`). The tokenizer and the token arrays are cached under
:func:`cache_dir`, keyed by a hash of the text content, the vocabulary size, the
``tokenizers`` version and :data:`FORMAT_VERSION`, so only the first call trains anything.

The split is fixed: the documents, in their deterministic order and each followed by
``<|endoftext|>``, form one token stream; its first 80% (``n * 4 // 5`` tokens) is the train
split and the rest the test split. The cut is at a token, not a document, boundary, so a
single-file source still gets a test split. Pre-tokenized files are split the same way.
The ``installed`` corpus is split by document (see :mod:`sage_train.data.corpus`), and a cut
keeps the sides it was cut from.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from sage_train.data.token_store import (  # noqa: F401 - the data API
    EOT,
    EOT_ID,
    FORMAT_VERSION,
    INTEGRITY,
    MIN_VOCAB_SIZE,
    RUN_MARK,
    STDLIB_SKIP_DIRS,
    TokenData,
    cache_dir,
    check_text_vocab,
    dtype_for_vocab,
    pieces,
    publish_entry,
    train_tokenizer,
    verify_entry,
)

__all__ = [
    "EOT",
    "EOT_ID",
    "FORMAT_VERSION",
    "MIN_VOCAB_SIZE",
    "RUN_MARK",
    "STDLIB_MAX_BYTES",
    "TokenData",
    "batches",
    "cache_dir",
    "content_hash",
    "eval_batches",
    "fingerprint",
    "load_data",
    "read_text_source",
    "stdlib_corpus",
    "train_tokenizer",
]

STDLIB_MAX_BYTES = 8_000_000
"""Default size cap (UTF-8 bytes) of the embedded standard-library corpus."""


PRETOKENIZED_SUFFIXES = frozenset({".bin", ".u16", ".u32", ".npy"})
"""File extensions that :func:`load_data` treats as pre-tokenized token files."""

_TOKEN_DTYPES: dict[str, np.dtype] = {"uint16": np.dtype(np.uint16), "uint32": np.dtype(np.uint32)}
_SUFFIX_DTYPES: dict[str, np.dtype] = {".u16": np.dtype(np.uint16), ".u32": np.dtype(np.uint32)}
# Never read when scanning a folder for text (binary by construction).
_BINARY_SUFFIXES = frozenset(
    {".bin", ".u16", ".u32", ".npy", ".npz", ".pyc", ".pyo", ".so", ".dll", ".dylib", ".o",
     ".a", ".exe", ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".pdf", ".gz",
     ".bz2", ".xz", ".zst", ".zip", ".tar", ".whl", ".pt", ".pth", ".ckpt", ".safetensors",
     ".msgpack", ".parquet", ".arrow", ".pkl", ".pickle", ".mp3", ".wav", ".mp4"}
)
_ENCODE_BATCH = 256  # pieces per encode_batch call (bounds peak memory)
_MIN_TOKENS = 10


def _stdlib_paths(root: Path) -> list[str]:
    """The relative POSIX paths of the ``.py`` files under ``root``, skipped folders left out."""
    rel_paths: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        for name in filenames:
            if name.endswith(".py"):
                rel_paths.append((Path(dirpath) / name).relative_to(root).as_posix())
    return rel_paths


def stdlib_corpus(max_bytes: int = STDLIB_MAX_BYTES) -> list[str]:
    """Return the text of the Python standard library's own ``.py`` files.

    Files are taken from ``sysconfig.get_paths()["stdlib"]`` in sorted order of their relative
    POSIX path (so the result is deterministic), skipping the directories in
    :data:`STDLIB_SKIP_DIRS` (``site-packages``, ``test``/``tests``, ``idlelib``,
    ``lib2to3``, the generated ``encodings`` tables, ...), files that are not valid UTF-8
    and blank files. Files are added until their total UTF-8 size reaches ``max_bytes``: the
    file that would overflow is cut after its last complete line that fits, and ends the
    corpus (so the corpus is at most ``max_bytes`` bytes).

    The corpus varies slightly between Python versions (and builds), which is why the token
    cache key of :func:`load_data` includes the Python version and a content hash.

    Args:
        max_bytes: size cap in bytes; must be positive.

    Returns:
        One string per file (each file is one document).
    """
    if max_bytes <= 0:
        raise ValueError(f"max_bytes must be positive, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"Python standard library not found at {root}")
    docs: list[str] = []
    total = 0
    for rel in sorted(_stdlib_paths(root)):
        try:
            data = (root / rel).read_bytes()
            text = data.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if not text.strip():
            continue
        if total + len(data) > max_bytes:  # the last file is cut at a line boundary
            cut = data.rfind(b"\n", 0, max_bytes - total)
            if cut > 0 and data[: cut + 1].strip():
                docs.append(data[: cut + 1].decode("utf-8"))
            break
        docs.append(text)
        total += len(data)
    if not docs:
        raise ValueError(f"no standard-library file fits in max_bytes={max_bytes}")
    return docs


def _read_utf8(path: Path) -> str | None:
    """Return the file's text if it is strict UTF-8 without NUL bytes, else ``None``."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def read_text_source(
    path: str | os.PathLike[str], exclude: Sequence[str | os.PathLike[str]] = ()
) -> list[str]:
    """Read a text file or a folder of text files as a list of documents.

    A file must be UTF-8 text and becomes one document. A folder is scanned recursively in
    sorted order of relative path; every regular file that decodes as strict UTF-8 and
    contains no NUL byte becomes one document (so ``.txt .md .rst .py .json .jsonl .csv
    .html ...`` and extension-less text files are all used, JSON lines as raw text). Names
    starting with ``.``, ``__pycache__`` folders, blank files and well-known binary
    extensions (``.npy .bin .pyc .png .gz .zip ...``) are skipped without being read.

    Folders in ``exclude`` (a training run's own directory, say) are skipped with all they
    hold, and so is every folder holding a run's ``.lock`` file: a run never reads its own
    (or another run's) logs as data.

    Args:
        path: a text file or a folder.
        exclude: folders never read (where they lie inside ``path``).

    Returns:
        The documents, in deterministic order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: ``path`` holds no (non-blank) UTF-8 text.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"text source {str(p)!r} does not exist")
    if p.is_file():
        text = _read_utf8(p)
        if text is None:
            raise ValueError(f"text source {str(p)!r} is not UTF-8 text")
        if not text.strip():
            raise ValueError(f"text source {str(p)!r} is empty")
        return [text]
    files: list[tuple[str, Path]] = []
    skip = {os.path.realpath(x) for x in exclude}
    for dirpath, dirnames, filenames in os.walk(p):
        if os.path.realpath(dirpath) in skip or RUN_MARK in filenames:
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            f = Path(dirpath) / name
            if name.startswith(".") or f.suffix.lower() in _BINARY_SUFFIXES or not f.is_file():
                continue
            files.append((f.relative_to(p).as_posix(), f))
    docs = [t for _, f in sorted(files) if (t := _read_utf8(f)) is not None and t.strip()]
    if not docs:
        raise ValueError(f"text source folder {str(p)!r} holds no UTF-8 text files")
    return docs


def _encode_documents(tok: Tokenizer, docs: Sequence[str], dtype: np.dtype) -> np.ndarray:
    """Encode documents into one stream, each document followed by :data:`EOT_ID`."""
    chunks: list[str] = []
    last: list[bool] = []  # piece is the last one of its document
    for doc in docs:
        ps = list(pieces(doc))
        chunks.extend(ps)
        last.extend([False] * (len(ps) - 1) + [True])
    eot = np.array([EOT_ID], dtype=dtype)
    parts: list[np.ndarray] = []
    for b in range(0, len(chunks), _ENCODE_BATCH):
        encs = tok.encode_batch_fast(chunks[b : b + _ENCODE_BATCH], add_special_tokens=False)
        for enc, is_last in zip(encs, last[b : b + _ENCODE_BATCH], strict=True):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            if is_last:
                parts.append(eot)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _split(tokens: np.ndarray, source: str) -> tuple[np.ndarray, np.ndarray]:
    n = len(tokens)
    if n < _MIN_TOKENS:
        raise ValueError(f"{source}: only {n} tokens, need at least {_MIN_TOKENS}")
    cut = n * 4 // 5
    return tokens[:cut], tokens[cut:]


def _content_hash(docs: Sequence[str]) -> str:
    h = hashlib.sha256()
    for d in docs:
        b = d.encode("utf-8")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


def _load_cached(d: Path, vocab_size: int) -> tuple[Tokenizer, np.ndarray, np.ndarray] | None:
    """The token cache entry ``d`` (``None``: missing, or damaged and to be rebuilt).

    Damaged: a file that does not load, an array or tokenizer whose checksum is not the
    one recorded when it was published (:func:`verify_entry`), or a tokenizer whose
    vocabulary is not ``vocab_size``.
    """
    if not d.is_dir():
        return None
    if (problem := verify_entry(d, vocab_size)) is not None:
        warnings.warn(f"token cache entry {d} is damaged ({problem}): it is rebuilt",
                      stacklevel=3)
        return None
    try:
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        train = np.load(d / "train.npy", mmap_mode="r")
        test = np.load(d / "test.npy", mmap_mode="r")
    except Exception:  # missing or corrupt entry: rebuild it
        return None
    if tok.get_vocab_size() != vocab_size:
        return None
    return tok, train, test


def _check_ids(entry: Path, train: np.ndarray, test: np.ndarray, vocab_size: int) -> None:
    """Refuse a cache entry holding a token id ``>= vocab_size`` (a damaged or foreign file)."""
    for name, part in (("train.npy", train), ("test.npy", test)):
        if len(part) and (top := int(part.max())) >= vocab_size:
            raise ValueError(
                f"token cache file {str(entry / name)!r} holds token id {top} >= "
                f"vocab_size={vocab_size}; delete {str(entry)!r} to rebuild it"
            )


def _tokenize_cached(
    docs: Sequence[str], vocab_size: int, source: str, key_extra: dict[str, str],
    log: Callable[[str], None] | None = None,
) -> TokenData:
    """Train/encode text (or load both from the cache) and split it 8:2.

    ``log`` is told where the tokens come from: the cache entry read, or that a tokenizer
    is being trained (a minute or more for a large text) and where its tokens are cached.

    The cache entry is written to a temporary folder that is renamed into place when
    complete, so processes that build the same entry at once (the processes of a job on
    hosts without a shared cache, or several runs) never see a partial one: the first
    rename wins and the others use it.  A damaged entry (one that no longer loads) is
    replaced the same way.
    """
    check_text_vocab(vocab_size)
    vocab_size = int(vocab_size)
    key_fields = {
        "format": FORMAT_VERSION,
        "content": _content_hash(docs),
        "vocab_size": vocab_size,
        "tokenizers": tokenizers.__version__,
        **key_extra,
    }
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:32]
    root = cache_dir() / "tokens"
    entry = root / key
    say = log or (lambda _: None)
    if (cached := _load_cached(entry, vocab_size)) is not None:
        tok, train, test = cached
        _check_ids(entry, train, test, vocab_size)
        say(f"tokens: {source}, read from the cache {entry}")
        return TokenData(train, test, vocab_size, tok, source)

    size = sum(len(d) for d in docs)
    say(f"tokenizer: training a {vocab_size:,}-token BPE on {source} ({len(docs):,} "
        f"documents, {size / 2**20:.1f} MiB of text; once: the tokens are cached in {entry})")
    tok = train_tokenizer(docs, vocab_size)
    tokens = _encode_documents(tok, docs, dtype_for_vocab(vocab_size))
    train, test = _split(tokens, source)
    meta = {**key_fields, "source": source, "documents": len(docs),
            "train_tokens": len(train), "test_tokens": len(test)}
    files: dict[str, str | np.ndarray] = {
        "tokenizer.json": tok.to_str(), "train.npy": train, "test.npy": test,
        "meta.json": json.dumps(meta, indent=1)}
    if (error := publish_entry(entry, files, vocab_size=vocab_size,
                               damaged=lambda: verify_entry(entry, vocab_size) is not None)):
        warnings.warn(f"could not write token cache under {root}: {error}", stacklevel=3)
        return TokenData(train, test, vocab_size, tok, source)
    if (cached := _load_cached(entry, vocab_size)) is not None:
        tok, train, test = cached
    say(f"tokens: {source}, {len(train):,} train and {len(test):,} test, cached in {entry}")
    return TokenData(train, test, vocab_size, tok, source)


def _map_npy(path: Path, want: np.dtype | None) -> np.ndarray:
    """Memory-map the ``.npy`` token file ``path`` (a 1-D uint16/uint32 array, ``want``)."""
    if path.stat().st_size == 0:
        raise ValueError(f"token file {str(path)!r} is empty (0 bytes)")
    try:
        arr: np.ndarray = np.load(path, mmap_mode="r")
    except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
        raise ValueError(f"cannot memory-map token file {str(path)!r}: {e}") from e
    if arr.ndim != 1 or arr.dtype not in _TOKEN_DTYPES.values():
        raise ValueError(
            f"token file {str(path)!r} must hold a 1-D uint16/uint32 array, "
            f"got {arr.ndim}-D {arr.dtype}"
        )
    if want is not None and arr.dtype != want:
        raise ValueError(f"token file {str(path)!r} is {arr.dtype}, not {want}")
    return arr


def _map_raw(path: Path, suffix: str, want: np.dtype | None) -> np.ndarray:
    """Memory-map the raw token file ``path``: its dtype by ``suffix``, else ``want``."""
    dtype = _SUFFIX_DTYPES.get(suffix)
    if dtype is not None and want is not None and dtype != want:
        raise ValueError(f"token file {str(path)!r} is {dtype} by its extension, not {want}")
    dtype = dtype or want
    if dtype is None:
        raise ValueError(
            f"raw token file {str(path)!r} carries no dtype: pass --token-dtype uint16 or "
            "uint32 to sage-train (token_dtype= to load_data; nanoGPT-style .bin files "
            "are uint16) or rename it to .u16/.u32"
        )
    size = path.stat().st_size
    if size == 0 or size % dtype.itemsize:
        raise ValueError(
            f"token file {str(path)!r} has {size} bytes, not a positive multiple of "
            f"{dtype.itemsize} ({dtype})"
        )
    return np.memmap(path, dtype=dtype, mode="r")


def _load_pretokenized(path: Path, vocab_size: int, token_dtype: str | None) -> TokenData:
    """Memory-map a ``.bin``/``.u16``/``.u32``/``.npy`` token file and split it 8:2."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int | np.integer):
        raise TypeError(f"vocab_size must be an int, got {type(vocab_size).__name__}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    want: np.dtype | None = None
    if token_dtype is not None:
        if str(token_dtype) not in _TOKEN_DTYPES:
            raise ValueError(f"token_dtype must be 'uint16' or 'uint32', got {token_dtype!r}")
        want = _TOKEN_DTYPES[str(token_dtype)]
    suffix = path.suffix.lower()
    arr = _map_npy(path, want) if suffix == ".npy" else _map_raw(path, suffix, want)
    if len(arr) and (top := int(arr.max())) >= vocab_size:
        raise ValueError(
            f"token file {str(path)!r} holds token id {top} >= vocab_size={vocab_size}"
        )
    train, test = _split(arr, f"token file {str(path)!r}")
    return TokenData(train, test, int(vocab_size), None, str(path))


def _text_only(token_dtype: str | None) -> None:
    """Refuse ``token_dtype`` for a source that is not a pre-tokenized token file."""
    if token_dtype is not None:
        raise ValueError("token_dtype only applies to pre-tokenized token files")


def load_data(
    source: str | os.PathLike[str] | None = None,
    *,
    vocab_size: int,
    token_dtype: str | None = None,
    max_bytes: int = STDLIB_MAX_BYTES,
    exclude: Sequence[str | os.PathLike[str]] = (),
    log: Callable[[str], None] | None = None,
) -> TokenData:
    """Load a corpus as tokens with the fixed 8:2 train/test split (see the module docstring).

    Args:
        source: ``None`` or ``"stdlib"`` for the embedded standard-library corpus (use
            ``"./stdlib"`` for a path of that name); ``"installed"`` for the offline corpus
            of :mod:`sage_train.data.corpus` (split by document; ``"./installed"`` for a path);
            a cut's folder or its ``cut.json`` (:func:`sage_train.data.cut.load_cut`: its own
            train and test sides, every file checked);
            a ``.bin``/``.u16``/``.u32``/``.npy`` file of pre-tokenized ids
            (memory-mapped); any other file or folder is text (:func:`read_text_source`).
        vocab_size: model vocabulary size. For text it is the exact size of the BPE trained
            on the *whole* text of the source (train and test; simpler, and the tokenizer
            only sees merge statistics) and must be ``>= MIN_VOCAB_SIZE``. For token files
            every id must be ``< vocab_size`` (checked exactly with a max over the file).
        token_dtype: ``"uint16"`` or ``"uint32"``; required for ``.bin``, otherwise
            optional and checked against the extension / ``.npy`` header.
        max_bytes: size cap of the ``"stdlib"`` corpus (ignored for other sources).
        exclude: folders a text folder's documents are never read from
            (:func:`read_text_source`).
        log: told, for a text source, where its tokens come from: the cache entry read,
            or that a tokenizer is being trained and where its tokens are cached.

    Returns:
        The :class:`TokenData`. Text sources are cached under :func:`cache_dir` (tokenizer
        JSON + ``.npy`` token arrays, loaded memory-mapped), so later calls skip training.

    Raises:
        FileNotFoundError: the source path does not exist.
        ValueError: bad vocabulary size, dtype, token ids or empty source.
    """
    if source is None or (isinstance(source, str) and source == "stdlib"):
        _text_only(token_dtype)
        check_text_vocab(vocab_size)
        docs = stdlib_corpus(max_bytes)
        py = f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}"
        return _tokenize_cached(docs, vocab_size, f"stdlib ({py})", {"python": py}, log)
    if isinstance(source, str) and source == "installed":
        _text_only(token_dtype)
        from sage_train.data import corpus  # imports this module: loaded when first used

        return corpus.load_installed(vocab_size)
    if not str(source).strip():
        raise ValueError("the data source is empty: give 'stdlib', 'installed', a text file or "
                         "folder, or a .bin/.u16/.u32/.npy token file")
    path = Path(source).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"data source {str(source)!r} does not exist (expected 'stdlib', 'installed', a "
            "text file or folder, or a .bin/.u16/.u32/.npy token file)"
        )
    from sage_train.data import cut  # imports this module: loaded when first used

    if cut.is_cut(path):
        _text_only(token_dtype)
        return cut.load_cut(path, int(vocab_size))
    if path.is_file() and path.suffix.lower() in PRETOKENIZED_SUFFIXES:
        return _load_pretokenized(path, vocab_size, token_dtype)
    _text_only(token_dtype)
    check_text_vocab(vocab_size)
    return _tokenize_cached(read_text_source(path, exclude), vocab_size, str(path), {}, log)


def fingerprint(tokens: TokenData) -> str:
    """A short hash of the token stream, equal for the same data and read in O(1).

    Covers the lengths, dtype, vocabulary and up to 64 evenly spaced 4,096-token pieces of
    each split.
    """
    h = hashlib.sha256(f"vocab={tokens.vocab_size};".encode())
    for part in (tokens.train, tokens.test):
        n, piece = len(part), 4096
        h.update(f"{n}:{part.dtype};".encode())
        for i in np.unique(np.linspace(0, max(n - piece, 0), 64).astype(np.int64)):
            h.update(np.ascontiguousarray(part[i:i + piece]).tobytes())
    return h.hexdigest()[:16]


_HASH_CHUNK = 1 << 24  # bytes hashed at a time: memory stays bounded on any corpus


def _stream_sha256(data: np.ndarray) -> str:
    """The SHA-256 of ``data``'s bytes, read ``_HASH_CHUNK`` bytes at a time."""
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)  # chunks copied: bounded
    h = hashlib.sha256()
    for start in range(0, len(raw), _HASH_CHUNK):
        h.update(raw[start:start + _HASH_CHUNK].tobytes())
    return h.hexdigest()


def _file_key(path: Path) -> dict[str, int | str]:
    """What identifies a file's state without reading it: its path, size and times.

    ``ctime`` changes on every write, even one that restores the modification time.
    """
    st = path.stat()
    return {"path": str(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "inode": st.st_ino, "device": st.st_dev}


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of every byte of the file ``path``, cached by its size and times.

    The digest is streamed (memory stays bounded) and kept under :func:`cache_dir`
    (``content/``), keyed by the file's real path, size, modification and change times
    and inode: a file that did not change since it was last hashed is not read again,
    and any write to it (which moves its change time) makes it hashed anew.  A cache
    that cannot be written only costs the next call the read.
    """
    real = Path(os.path.realpath(path))
    key = _file_key(real)
    record = cache_dir() / "content" / (
        hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")
    try:
        cached = json.loads(record.read_text())
        if isinstance(cached, dict) and cached.get("key") == key:
            return str(cached["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if _file_key(real) == key:  # not written to while it was read
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            tmp = record.with_name(f".{record.name}.tmp-{os.getpid()}")
            tmp.write_text(json.dumps({"key": key, "sha256": digest}))
            os.replace(tmp, record)
        except OSError:
            pass
    return digest


def content_hash(tokens: TokenData) -> str:
    """The SHA-256 of every token of both splits (hex): any changed token changes it.

    A split memory-mapped from a file (a token file, a token cache entry, a cut, the
    ``installed`` corpus) is covered by the SHA-256 of its whole file
    (:func:`file_sha256`, cached by size and times, so an unchanged file is read once),
    together with its length and dtype (the split is a fixed part of the file); a split
    held in memory is hashed as it is.  A run records it as ``data_sha256`` and refuses
    to resume on data whose hash differs.  Cost: a full read of the data the first time
    (0.41 s for a 112M-token ``uint16`` file, 224 MB, read from the page cache on a
    shared 2-core machine), then a ``stat`` per file.
    """
    h = hashlib.sha256(f"vocab={tokens.vocab_size};".encode())
    for part in (tokens.train, tokens.test):
        h.update(f"{len(part)}:{part.dtype};".encode())
        filename = getattr(part, "filename", None)
        if isinstance(part, np.memmap) and filename:
            h.update(f"file={file_sha256(filename)};".encode())
        else:
            h.update(f"tokens={_stream_sha256(np.asarray(part))};".encode())
    return h.hexdigest()


def _check_windows(tokens: np.ndarray, batch_size: int, seq_len: int) -> None:
    if np.ndim(tokens) != 1:
        raise ValueError(f"tokens must be a 1-D array, got shape {np.shape(tokens)}")
    if batch_size < 1 or seq_len < 1:
        raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size}, {seq_len}")
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"token array has {len(tokens)} tokens, shorter than seq_len + 1 = {seq_len + 1}"
        )


def _windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    win = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)]).astype(np.int32)
    return np.ascontiguousarray(win[:, :-1]), np.ascontiguousarray(win[:, 1:])


def _check_rows(rows: slice | None, batch_size: int) -> slice:
    """``rows`` as a ``slice(start, stop)`` within ``batch_size`` rows (``None``: all)."""
    if rows is None:
        return slice(0, batch_size)
    start, stop, step = rows.indices(batch_size)
    if step != 1 or stop <= start:
        raise ValueError(f"rows must be a non-empty contiguous slice of the {batch_size} rows "
                         f"of a batch, got {rows}")
    return slice(start, stop)


def batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int, start_step: int = 0,
    rows: slice | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Infinite, deterministic, resumable stream of random training windows.

    Batch ``k`` depends only on ``(seed, k)``: ``np.random.default_rng([seed, k])`` draws
    ``batch_size`` offsets uniformly in ``[0, len(tokens) - seq_len)``. Hence resuming with
    ``start_step=k`` yields exactly the batches an uninterrupted run saw from step ``k`` on.
    Arguments are validated when this function is called, not at the first ``next``.

    ``rows`` picks some rows of every batch: a process of a multi-process job reads (and
    feeds) only its own rows, and the rows of all processes together are the batch one
    process would read alone.

    Args:
        tokens: 1-D token array (e.g. ``TokenData.train``; may be a memmap).
        batch_size: windows per batch (of the whole batch, whatever ``rows``).
        seq_len: tokens per window.
        seed: non-negative integer seed.
        start_step: index of the first batch to yield.
        rows: the rows of each batch to yield (a contiguous slice; ``None``: all).

    Returns:
        An iterator of ``(inputs, targets)``, both int32 of shape ``(rows, seq_len)``
        (``(batch_size, seq_len)`` for all rows), with ``targets[:, t] == inputs[:, t + 1]``
        (targets are inputs shifted by one).
    """
    _check_windows(tokens, batch_size, seq_len)
    if seed < 0 or start_step < 0:
        raise ValueError(f"seed and start_step must be >= 0, got {seed}, {start_step}")
    mine = _check_rows(rows, batch_size)
    high = len(tokens) - seq_len

    def gen() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        step = int(start_step)
        while True:
            starts = np.random.default_rng([int(seed), step]).integers(0, high, size=batch_size)
            yield _windows(tokens, starts[mine], seq_len)
            step += 1

    return gen()


def eval_batches(
    tokens: np.ndarray, batch_size: int, seq_len: int, max_batches: int | None = None,
    rows: slice | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed, deterministic evaluation batches of non-overlapping windows (for perplexity).

    The split is cut into ``(len(tokens) - 1) // seq_len`` windows with stride ``seq_len``
    (the inputs never overlap, so each token is scored as a target at most once). If
    ``max_batches`` full batches need fewer windows, the windows used are spread evenly over
    the whole split. A trailing incomplete batch is dropped so every batch has the same shape.

    Args:
        tokens: 1-D token array (e.g. ``TokenData.test``).
        batch_size: windows per batch.
        seq_len: tokens per window.
        max_batches: at most this many batches (``None``: all full batches).
        rows: the rows of each batch to return (a contiguous slice, as for
            :func:`batches`; ``None``: all).

    Returns:
        A list of ``(inputs, targets)``, int32 of shape ``(batch_size, seq_len)`` (or of
        ``rows`` rows).
    """
    _check_windows(tokens, batch_size, seq_len)
    mine = _check_rows(rows, batch_size)
    n_windows = (len(tokens) - 1) // seq_len
    n_batches = n_windows // batch_size
    if n_batches == 0:
        raise ValueError(
            f"token array has {len(tokens)} tokens: too few for one evaluation batch of "
            f"{batch_size} x {seq_len + 1} tokens"
        )
    if max_batches is not None:
        if max_batches < 1:
            raise ValueError(f"max_batches must be >= 1, got {max_batches}")
        n_batches = min(n_batches, max_batches)
    n_used = n_batches * batch_size
    starts = (np.arange(n_used, dtype=np.int64) * n_windows // n_used) * seq_len
    per_batch = starts.reshape(n_batches, batch_size)[:, mine]
    inputs, targets = _windows(tokens, per_batch.reshape(-1), seq_len)
    k = mine.stop - mine.start
    return [(inputs[i : i + k], targets[i : i + k]) for i in range(0, len(inputs), k)]

