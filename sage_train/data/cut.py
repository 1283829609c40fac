"""A cut: a fixed, fingerprinted token set taken from a corpus, small enough to carry.

The ``installed`` corpus (:mod:`sage_train.data.corpus`) is whatever the machine has installed,
so each machine builds its own, with its own fingerprint. Runs on several machines train on
the same tokens only if the tokens travel: :func:`cut_data` takes whole documents from a
corpus's train and test splits into a folder of a few tens of MiB that can be copied with
a working tree, and ``sage-train --data FOLDER`` (or ``FOLDER/cut.json``) trains on it
(:func:`load_cut`, through :func:`sage_train.data.pipeline.load_data`).

**What is cut.** A document is a run of tokens ending in ``<|endoftext|>`` (the corpus puts
one after every document; tokens after a split's last one, part of a document, are never
taken, and a text that holds the literal ``<|endoftext|>`` counts as two documents). Each
split is cut on its own, so a test document never enters the train side and the train and
test sides of the cut keep the corpus's split. On each side the documents are ranked by the
SHA-256 of their token bytes (a deterministic draw that does not depend on where a document
sits in the corpus, unlike a prefix, which would be the standard library and the packages
starting with ``a``); going down that ranking, a document is taken when it still fits in the
budget (``train_tokens``, ``test_tokens``), so each side holds at most its budget. The taken
documents keep their corpus order.

**The folder.** ``train.npy`` and ``test.npy`` (1-D ``uint16`` arrays, ``uint32`` above
65,536 tokens of vocabulary; memory-mapped when loaded), the corpus's ``tokenizer.json``
where it has one, and the manifest ``cut.json`` (:data:`MANIFEST`): the vocabulary size, the
dtype, per side the tokens, the documents, the budget and the SHA-256 of the token bytes,
the SHA-256 of the tokenizer's JSON, the source (its description, fingerprint and tokens)
and the cut's **fingerprint**: the SHA-256 of :data:`CUT_FORMAT`, the source's fingerprint,
the vocabulary, the dtype and those three hashes, so of the tokens themselves.

**Loading** checks everything: every file is hashed and compared with the manifest (a
changed byte is one line naming the file), the fingerprint is recomputed, and the
vocabulary must be the model's. A run records ``cut_fingerprint``, ``cut_tokens``,
``corpus_fingerprint`` and ``corpus_tokens`` (the source's) in its ``config.json``.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from sage_train.data import token_store as store

__all__ = ["CUT_FORMAT", "MANIFEST", "cut_data", "documents", "is_cut", "load_cut", "pick",
           "source_fingerprint"]

MANIFEST = "cut.json"
"""The manifest's file name: a folder holding it is a cut."""
CUT_FORMAT = 1
"""Part of the fingerprint; bump it whenever the selection or the layout changes."""
_SIDES = ("train", "test")


def is_cut(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a cut: a folder holding :data:`MANIFEST`, or that file itself."""
    p = Path(path).expanduser()
    return (p.is_dir() and (p / MANIFEST).is_file()) or (p.name == MANIFEST and p.is_file())


def documents(tokens: np.ndarray) -> list[tuple[int, int]]:
    """The ``(start, end)`` of every document of a token stream.

    Each ``tokens[start:end]`` ends in :data:`~sage_train.data.pipeline.EOT_ID`; tokens after the
    last one are no document.
    """
    ends = np.flatnonzero(np.asarray(tokens) == store.EOT_ID) + 1
    starts = np.concatenate([[0], ends[:-1]])
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def pick(tokens: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """The documents of ``tokens`` a cut of at most ``budget`` tokens takes, in stream order.

    Ranked by the SHA-256 of their token bytes (ties: stream order); each is taken when it
    still fits.
    """
    docs = documents(tokens)
    ranked = sorted(range(len(docs)), key=lambda i: (hashlib.sha256(
        np.ascontiguousarray(tokens[docs[i][0]:docs[i][1]]).tobytes()).digest(), i))
    taken, room = [], budget
    for i in ranked:
        size = docs[i][1] - docs[i][0]
        if size <= room:
            taken.append(i)
            room -= size
    return [docs[i] for i in sorted(taken)]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _fingerprint(manifest: dict[str, Any]) -> str:
    """The cut's fingerprint from its manifest's hashes (module docstring)."""
    parts = [f"format={CUT_FORMAT}", f"source={manifest['source']['fingerprint']}",
             f"vocab_size={manifest['vocab_size']}", f"dtype={manifest['dtype']}",
             *(f"{side}={manifest[side]['sha256']}" for side in _SIDES),
             f"tokenizer={(manifest.get('tokenizer') or {}).get('sha256')}"]
    return _sha256(";".join(parts).encode())


def source_fingerprint(tokens: store.TokenData) -> str:
    """The fingerprint of the data a cut is taken from.

    A cut's own (``cut_fingerprint``), else a corpus's (``corpus_fingerprint``), else the
    SHA-256 of the vocabulary size and both splits' token bytes.
    """
    for key in ("cut_fingerprint", "corpus_fingerprint"):
        if key in tokens.info:
            return str(tokens.info[key])
    h = hashlib.sha256(f"vocab_size={tokens.vocab_size};".encode())
    for part in (tokens.train, tokens.test):
        h.update(f"{len(part)}:{part.dtype};".encode())
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


def cut_data(tokens: store.TokenData, out: str | os.PathLike[str], *, train_tokens: int,
             test_tokens: int) -> dict[str, Any]:
    """Cut at most ``train_tokens`` and ``test_tokens`` from ``tokens`` into the folder ``out``.

    The folder is written whole or not at all (:func:`sage_train.data.pipeline.publish_entry`). A
    folder that already holds this very cut is left as it is.

    Args:
      tokens: the corpus (``load_data("installed", ...)``); each split a stream of documents
        each ending in ``<|endoftext|>``.
      out: the cut's folder; it must not exist, be empty, or hold the same cut.
      train_tokens: the train side's budget, >= 1.
      test_tokens: the test side's budget, >= 1.

    Returns:
      The manifest (what ``cut.json`` holds).

    Raises:
      ValueError: a budget below 1 or below every document of its split, or ``out`` holds
        something else (each message one line naming the option or the folder).
      OSError: ``out`` cannot be written.
    """
    budgets = {"train": train_tokens, "test": test_tokens}
    for side, budget in budgets.items():
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(f"{side}_tokens must be an integer >= 1, got {budget!r}")
    out = Path(out).expanduser()
    arrays = {}
    counts = {}
    for side in _SIDES:
        part = getattr(tokens, side)
        taken = pick(part, budgets[side])
        if not taken:
            shortest = min((e - s for s, e in documents(part)), default=0)
            raise ValueError(
                f"--{side}-tokens {budgets[side]:,} holds no document of the {side} split "
                + (f"(the shortest has {shortest:,} tokens)" if shortest else
                   "(it has no <|endoftext|>-ended document)"))
        arrays[side] = np.concatenate([np.asarray(part[s:e]) for s, e in taken])
        counts[side] = len(taken)
    tokenizer = None if tokens.tokenizer is None else tokens.tokenizer.to_str()
    manifest: dict[str, Any] = {
        "format": CUT_FORMAT, "vocab_size": int(tokens.vocab_size),
        "dtype": str(arrays["train"].dtype),
        **{side: {"file": f"{side}.npy", "tokens": len(arrays[side]),
                  "documents": counts[side], "budget": budgets[side],
                  "sha256": _sha256(arrays[side].tobytes())} for side in _SIDES},
        "tokenizer": None if tokenizer is None else {
            "file": "tokenizer.json", "sha256": _sha256(tokenizer.encode())},
        "source": {"description": tokens.source, "fingerprint": source_fingerprint(tokens),
                   "train_tokens": len(tokens.train), "test_tokens": len(tokens.test)},
    }
    manifest["fingerprint"] = _fingerprint(manifest)
    existing = _existing(out)
    if existing == manifest["fingerprint"]:
        return json.loads((out / MANIFEST).read_text())
    if existing is not None:
        what = ("is not empty and holds no cut" if existing == "?" else
                f"already holds a cut (fingerprint {existing[:16]})")
        raise ValueError(f"--out {out} {what}: remove it or give another --out")
    manifest["created"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    files: dict[str, str | np.ndarray] = {f"{side}.npy": arrays[side] for side in _SIDES}
    if tokenizer is not None:
        files["tokenizer.json"] = tokenizer
    files[MANIFEST] = json.dumps(manifest, indent=1) + "\n"
    if out.exists():
        out.rmdir()  # empty (checked above): publish_entry renames the whole folder into place
    if (error := store.publish_entry(out, files, damaged=lambda: False, integrity=False)):
        raise OSError(f"cannot write the cut --out {out}: {error}")
    return manifest


def _existing(out: Path) -> str | None:
    """What ``out`` holds: ``None`` (nothing), its cut's fingerprint, or ``"?"`` (other)."""
    if not out.exists():
        return None
    if out.is_dir() and not any(out.iterdir()):
        return None
    try:
        return str(json.loads((out / MANIFEST).read_text())["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        return "?"


def load_cut(path: str | os.PathLike[str], vocab_size: int) -> store.TokenData:
    """The cut in folder ``path`` (or its manifest ``path``), every file checked.

    Args:
      path: the cut's folder, or its ``cut.json``.
      vocab_size: the model's vocabulary size: the cut's must be the same.

    Returns:
      The :class:`~sage_train.data.pipeline.TokenData`: the cut's own train and test sides
      (memory-mapped), its tokenizer (or ``None``), and ``info`` with ``cut_fingerprint``,
      ``cut_tokens``, ``corpus_fingerprint`` and ``corpus_tokens`` (the source's).

    Raises:
      ValueError: a damaged or changed file (named), or another vocabulary size.
    """
    p = Path(path).expanduser()
    folder = p.parent if p.name == MANIFEST and p.is_file() else p
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {side: folder / manifest[side]["file"] for side in _SIDES}
        sides = {side: np.load(f, mmap_mode="r") for side, f in files.items()}
        tok_entry = manifest.get("tokenizer")
        tok_file = None if tok_entry is None else folder / tok_entry["file"]
        tok_text = None if tok_file is None else tok_file.read_text()
        fingerprint = str(manifest["fingerprint"])
        recomputed = _fingerprint(manifest)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cut {str(folder)!r} cannot be read ({e}): cut it again "
                         "(sage-repro cut-data)") from None
    if recomputed != fingerprint:
        raise ValueError(f"cut manifest {str(manifest_path)!r} does not match its own "
                         "fingerprint (it changed): copy the cut again")
    if int(manifest["vocab_size"]) != vocab_size:
        raise ValueError(f"cut {str(folder)!r} has a vocabulary of {manifest['vocab_size']:,} "
                         f"tokens, the model's is {vocab_size:,}: use a model of that "
                         "vocabulary or cut the data for this one")
    for side, part in sides.items():
        if (part.ndim != 1 or str(part.dtype) != manifest["dtype"]
                or _sha256(np.ascontiguousarray(part).tobytes()) != manifest[side]["sha256"]):
            raise ValueError(f"cut file {str(files[side])!r} does not match "
                             f"{str(manifest_path)!r} (its tokens changed): copy the cut again")
    if tok_file is not None and tok_text is not None and _sha256(tok_text.encode()) != (
            manifest["tokenizer"]["sha256"]):
        raise ValueError(f"cut file {str(tok_file)!r} does not match {str(manifest_path)!r} "
                         "(it changed): copy the cut again")
    tokenizer = None if tok_text is None else Tokenizer.from_str(tok_text)
    source = manifest["source"]
    description = f"cut {folder} (fingerprint {fingerprint[:16]}) of {source['description']}"
    info: dict[str, str | int] = {
        "cut_fingerprint": fingerprint, "cut_tokens": len(sides["train"]) + len(sides["test"]),
        "corpus_fingerprint": str(source["fingerprint"]),
        "corpus_tokens": int(source["train_tokens"]) + int(source["test_tokens"])}
    return store.TokenData(sides["train"], sides["test"], vocab_size, tokenizer,
                              description, info=info)
