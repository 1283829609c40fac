"""A cut of a corpus (sage_train.data.cut, ``sage-repro cut-data``): whole documents of each
side within the budget, a draw independent of the corpus order, every file checked on load.

The corpus is a small synthetic tree (tests/corpus_helpers.py) read as the ``installed``
corpus; the properties are checked against the corpus's own documents, decoded.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
from corpus_helpers import installed_corpus

from sage_repro import sweep
from sage_train.data import cut
from sage_train.data import pipeline as data
from sage_train.model.shapes import MODELS

VOCAB = MODELS["tiny"].vocab_size


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A 240-document tree as the ``installed`` corpus, its cache in ``tmp_path``."""
    return installed_corpus(tmp_path, monkeypatch, VOCAB)


def docs_of(tokens) -> list[bytes]:
    """The documents of a token stream (runs ending in end-of-text) as bytes, in order."""
    ids = np.asarray(tokens)
    ends = np.flatnonzero(ids == data.EOT_ID) + 1
    return [ids[s:e].tobytes() for s, e in zip(np.r_[0, ends[:-1]], ends, strict=True)]


def test_whole_documents_of_each_side_within_the_budget(installed, tmp_path):
    budget = {"train": len(installed.train) // 3, "test": len(installed.test) // 2}
    manifest = cut.cut_data(installed, tmp_path / "cut", train_tokens=budget["train"],
                            test_tokens=budget["test"])
    loaded = data.load_data(tmp_path / "cut", vocab_size=VOCAB)
    for side in ("train", "test"):
        corpus_docs = docs_of(getattr(installed, side))
        taken = docs_of(getattr(loaded, side))
        assert len(getattr(loaded, side)) == manifest[side]["tokens"] <= budget[side]
        assert len(taken) == manifest[side]["documents"] > 0
        # whole documents of this side only, in the corpus's order
        positions = [corpus_docs.index(d) for d in taken]
        assert positions == sorted(positions) and len(set(positions)) == len(positions)
        # a document left out did not fit: longer than the room the cut left
        room = budget[side] - manifest[side]["tokens"]
        left_out = [d for i, d in enumerate(corpus_docs) if i not in set(positions)]
        assert left_out and all(len(d) // installed.train.itemsize > room for d in left_out)
    other = set(docs_of(installed.test))
    assert not other & set(docs_of(loaded.train))  # no test document in the train side


def test_the_draw_does_not_depend_on_the_corpus_order(installed, tmp_path):
    """The same documents in another order give the same documents (in that order)."""
    docs = docs_of(installed.train)
    shuffled = [docs[i] for i in np.random.default_rng(0).permutation(len(docs))]
    dtype = installed.train.dtype
    moved = data.TokenData(np.frombuffer(b"".join(shuffled), dtype), installed.test, VOCAB,
                           installed.tokenizer, "shuffled", info=dict(installed.info))
    kw = {"train_tokens": len(installed.train) // 4, "test_tokens": 1000}
    a = cut.cut_data(installed, tmp_path / "a", **kw)
    b = cut.cut_data(moved, tmp_path / "b", **kw)
    train_a = docs_of(data.load_data(tmp_path / "a", vocab_size=VOCAB).train)
    train_b = docs_of(data.load_data(tmp_path / "b", vocab_size=VOCAB).train)
    assert sorted(train_a) == sorted(train_b)
    assert train_b == [d for d in shuffled if d in set(train_b)]
    # another token order is other tokens: another fingerprint
    assert a["fingerprint"] != b["fingerprint"]
    assert cut.cut_data(installed, tmp_path / "c", **kw)["fingerprint"] == a["fingerprint"]


def test_the_manifest_and_what_a_run_records(installed, tmp_path):
    manifest = cut.cut_data(installed, tmp_path / "cut", train_tokens=5000, test_tokens=2000)
    on_disk = json.loads((tmp_path / "cut" / cut.MANIFEST).read_text())
    assert on_disk == manifest
    loaded = data.load_data(tmp_path / "cut" / cut.MANIFEST, vocab_size=VOCAB)  # the file too
    for side in ("train", "test"):  # the hashes are those of the tokens themselves
        tokens = np.load(tmp_path / "cut" / f"{side}.npy")
        assert manifest[side]["sha256"] == hashlib.sha256(tokens.tobytes()).hexdigest()
        assert np.array_equal(getattr(loaded, side), tokens)
    assert manifest["source"]["fingerprint"] == installed.info["corpus_fingerprint"]
    assert manifest["dtype"] == "uint16" and manifest["vocab_size"] == VOCAB
    assert loaded.info == {
        "cut_fingerprint": manifest["fingerprint"],
        "cut_tokens": manifest["train"]["tokens"] + manifest["test"]["tokens"],
        "corpus_fingerprint": installed.info["corpus_fingerprint"],
        "corpus_tokens": installed.info["corpus_tokens"]}
    assert loaded.tokenizer.to_str() == installed.tokenizer.to_str()
    assert manifest["fingerprint"][:16] in loaded.source


@pytest.mark.parametrize("where", ["train.npy", "test.npy", "tokenizer.json", "cut.json"])
def test_a_changed_byte_is_one_line_naming_the_file(installed, tmp_path, where):
    folder = tmp_path / "cut"
    cut.cut_data(installed, folder, train_tokens=5000, test_tokens=2000)
    path = folder / where
    raw = bytearray(path.read_bytes())
    if where == "cut.json":  # another tokens' hash, the fingerprint left as it was
        manifest = json.loads(raw)
        manifest["train"]["sha256"] = "0" * 64
        raw = bytearray(json.dumps(manifest).encode())
    else:
        raw[-3] ^= 1  # a token's byte (the arrays' headers come first), or the JSON's end
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError) as e:
        data.load_data(folder, vocab_size=VOCAB)
    message = str(e.value)
    assert "\n" not in message and str(path) in message, message


def test_refusals(installed, tmp_path):
    folder = tmp_path / "cut"
    cut.cut_data(installed, folder, train_tokens=5000, test_tokens=2000)
    with pytest.raises(ValueError, match="vocabulary of 1,024 tokens, the model's is 4,096"):
        data.load_data(folder, vocab_size=MODELS["small"].vocab_size)
    with pytest.raises(ValueError, match="token_dtype only applies"):
        data.load_data(folder, vocab_size=VOCAB, token_dtype="uint16")
    with pytest.raises(ValueError, match="already holds a cut"):
        cut.cut_data(installed, folder, train_tokens=6000, test_tokens=2000)
    with pytest.raises(ValueError, match="--train-tokens 3 holds no document"):
        cut.cut_data(installed, tmp_path / "x", train_tokens=3, test_tokens=2000)
    with pytest.raises(ValueError, match="test_tokens must be an integer >= 1"):
        cut.cut_data(installed, tmp_path / "x", train_tokens=5000, test_tokens=0)
    assert not (tmp_path / "x").exists()
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "notes.txt").write_text("mine\n")
    with pytest.raises(ValueError, match="junk is not empty and holds no cut"):
        cut.cut_data(installed, tmp_path / "junk", train_tokens=5000, test_tokens=2000)


def test_the_command(installed, tmp_path, capsys):
    argv = ["cut-data", "--model", "tiny", "--out", str(tmp_path / "cut"), "--train-tokens",
            "5000", "--test-tokens", "2000"]
    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    manifest = json.loads((tmp_path / "cut" / cut.MANIFEST).read_text())
    assert manifest["fingerprint"] in printed and "train.npy" in printed
    assert manifest["source"]["fingerprint"] == installed.info["corpus_fingerprint"]
    assert sweep.main(argv) == 0  # the same cut again: left as it is
    assert "already holds this cut" in capsys.readouterr().out
    assert sweep.main([*argv[:-1], "3000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds a cut" in err
