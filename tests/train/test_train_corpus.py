"""Tests of sage_train.data.corpus (the offline ``installed`` corpus) and the mid-size models.

Every build here reads small trees made in a temporary folder (the roots are injectable); the
real machine's listing is read once, a few files per root, and never tokenized.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os

import numpy as np
import pytest
from corpus_helpers import make_tree

from sage_train.data import corpus, token_store
from sage_train.data import pipeline as data
from sage_train.model.shapes import MODELS

VOCAB = 300


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _decode_stream(tok, tokens: np.ndarray) -> list[str]:
    """The documents of a token stream: the pieces between end-of-text tokens, decoded."""
    ids = np.asarray(tokens).tolist()
    assert ids and ids[-1] == data.EOT_ID
    docs, cur = [], []
    for t in ids:
        if t == data.EOT_ID:
            docs.append(tok.decode(cur, skip_special_tokens=False))
            cur = []
        else:
            cur.append(t)
    return docs


@pytest.fixture
def tree(tmp_path) -> tuple[list[corpus.Root], dict[str, str]]:
    root = tmp_path / "tree"
    docs = make_tree(root, 200)
    return [corpus.Root("pkgs", root)], docs


# ---------------------------------------------------------------- determinism


def test_two_builds_agree_whatever_the_listing_order(tree, tmp_path, monkeypatch):
    roots, _ = tree
    a = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    real_walk = os.walk

    def reversed_walk(top, *args, **kwargs):  # the file system lists in reverse order
        for dirpath, dirnames, filenames in real_walk(top, *args, **kwargs):
            dirnames.reverse()
            filenames.reverse()
            yield dirpath, dirnames, filenames

    monkeypatch.setattr(os, "walk", reversed_walk)
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "other-cache"))  # built anew
    b = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    assert b.path != a.path and b.path.parent.parent == tmp_path / "other-cache"
    assert a.fingerprint == b.fingerprint
    assert np.array_equal(a.train, b.train) and np.array_equal(a.test, b.test)
    assert a.tokenizer.to_str() == b.tokenizer.to_str()
    assert (a.path / "documents.tsv").read_text() == (b.path / "documents.tsv").read_text()
    # the stream follows the sorted relative paths, not the listing order
    paths = [line.split("\t")[3] for line in (a.path / "documents.tsv").read_text().splitlines()]
    assert paths == sorted(paths)


def test_cache_is_memory_mapped_and_reused(tree, monkeypatch):
    roots, _ = tree
    a = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    assert isinstance(a.train, np.memmap) and a.train.dtype == np.uint16
    assert a.meta["train_tokens"] == len(a.train) and a.meta["test_tokens"] == len(a.test)

    def no_training(*args, **kwargs):
        raise AssertionError("the cached corpus was trained again")

    monkeypatch.setattr(token_store, "train_tokenizer", no_training)
    b = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    assert b.path == a.path and np.array_equal(a.train, b.train)


def test_fingerprint_follows_contents_and_settings(tree):
    roots, docs = tree
    listing = corpus.list_documents(roots)
    fp = corpus.fingerprint(listing.documents, vocab_size=VOCAB)
    assert fp == corpus.fingerprint(list(listing.documents), vocab_size=VOCAB)
    assert corpus.fingerprint(listing.documents, vocab_size=VOCAB + 1) != fp
    assert corpus.fingerprint(listing.documents, vocab_size=VOCAB, tokenizer_bytes=10) != fp
    rel = sorted(docs)[5]
    (roots[0].path / rel).write_text(docs[rel] + "# one more line\n")
    changed = corpus.list_documents(roots)
    assert corpus.fingerprint(changed.documents, vocab_size=VOCAB) != fp


# ---------------------------------------------------------------- dedup


def test_identical_files_are_one_document_and_the_first_wins(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    (a / "z").mkdir(parents=True)
    b.mkdir()
    same = "def same():\n    return 'identical content'\n"
    (a / "z" / "copy.py").write_text(same)
    (a / "b_copy.py").write_text(same)
    (a / "other.py").write_text("print('another document')\n")
    with gzip.open(b / "README.gz", "wb") as f:  # the same text, gzipped, in a later root
        f.write(same.encode())
    listing = corpus.list_documents([corpus.Root("a", a), corpus.Root("b", b, gzip=True)])
    assert [(d.root, d.path) for d in listing.documents] == [("a", "b_copy.py"),
                                                             ("a", "other.py")]
    assert listing.skipped["duplicate"] == 2 and listing.files == 4
    assert listing.documents[0].sha256 == _sha(same)
    assert listing.nbytes == len(same) + len("print('another document')\n")


# ---------------------------------------------------------------- split


def test_split_by_document_without_overlap(tree):
    roots, docs = tree
    c = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    train = _decode_stream(c.tokenizer, c.train)
    test = _decode_stream(c.tokenizer, c.test)
    # every document is on exactly one side, whole, and on the side its hash says
    assert sorted(train + test) == sorted(docs.values())
    assert not set(train) & set(test)
    assert all(int(_sha(t)[:8], 16) % 5 == 0 for t in test)
    assert all(int(_sha(t)[:8], 16) % 5 != 0 for t in train)
    # in listing (sorted path) order on each side
    order = [docs[p] for p in sorted(docs)]
    assert train == [t for t in order if t in set(train)]
    # about 8:2 by documents (200 documents: 40 +- 11 at two standard deviations)
    assert 0.14 <= len(test) / len(docs) <= 0.26
    assert c.meta["train_documents"] == len(train) and c.meta["test_documents"] == len(test)
    assert c.meta["train_bytes"] + c.meta["test_bytes"] == sum(
        len(t.encode()) for t in docs.values())


def test_adding_documents_moves_no_other(tree):
    roots, docs = tree
    before = {d.sha256: d.test for d in corpus.list_documents(roots).documents}
    make_tree(roots[0].path, 50, first=200)
    after = {d.sha256: d.test for d in corpus.list_documents(roots).documents}
    assert len(after) == len(before) + 50
    assert all(after[s] == side for s, side in before.items())


def test_tokenizer_sees_train_documents_only(tree, monkeypatch):
    roots, _ = tree
    seen: list[str] = []
    real = data.train_tokenizer

    def spy(texts, vocab_size):
        seen.extend(texts)
        return real(texts, vocab_size)

    monkeypatch.setattr(token_store, "train_tokenizer", spy)
    listing = corpus.list_documents(roots)
    corpus.build_corpus(roots, vocab_size=VOCAB, tokenizer_bytes=3_000, progress=False)
    train = {d.text: d.sha256 for d in listing.documents if not d.test}
    assert seen and all(t in train for t in seen)
    # the deterministic sample: the smallest hashes, until 3,000 bytes are reached
    hashes = sorted(train[t] for t in seen)
    assert hashes == sorted(train.values())[:len(seen)]
    assert sum(len(t.encode()) for t in seen[:-1]) < 3_000 <= sum(len(t.encode()) for t in seen)


# ---------------------------------------------------------------- refusals


def test_binary_unreadable_and_other_files_are_refused(tmp_path):
    pkg, doc = tmp_path / "pkg", tmp_path / "doc"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / ".hidden").mkdir()
    (pkg / "run").mkdir()
    doc.mkdir()
    good = {"good.py": "x = 1\n", "notes.md": "# Notes\n", "LICENSE": "Free software.\n"}
    for name, text in good.items():
        (pkg / name).write_text(text)
    (pkg / "nul.py").write_bytes(b"x = 1\x00\n")  # binary
    (pkg / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8
    (pkg / "blank.rst").write_text("  \n\n")
    (pkg / "big.py").write_text("y = 2\n" * 200)  # 1,200 bytes > the cap below
    (pkg / "lib.so").write_bytes(b"\x7fELF")  # not read by its suffix
    (pkg / "data.json").write_text("{}")  # not read by its suffix
    (pkg / "__pycache__" / "m.py").write_text("cached = 1\n")
    (pkg / ".hidden" / "h.py").write_text("hidden = 1\n")
    (pkg / ".secret.py").write_text("hidden = 2\n")
    (pkg / "run" / data.RUN_MARK).write_text("")  # a sage-train run folder: never data
    (pkg / "run" / "log.txt").write_text("a run's log\n")
    (pkg / "link.py").symlink_to(pkg / "good.py")
    (doc / "changelog.gz").write_bytes(b"this is not gzip data")  # unreadable
    with gzip.open(doc / "NEWS.gz", "wb") as f:
        f.write(b"news, gzipped\n")
    listing = corpus.list_documents(
        [corpus.Root("pkg", pkg), corpus.Root("doc", doc, gzip=True)], max_file_bytes=1_000)
    got = {(d.root, d.path): d.text for d in listing.documents}
    assert got == {**{("pkg", k): v for k, v in good.items()},
                   ("doc", "NEWS.gz"): "news, gzipped\n"}
    assert listing.skipped == {"too large": 1, "binary": 1, "not utf-8": 1, "unreadable": 1,
                               "blank": 1, "duplicate": 0}
    assert listing.files == len(got) + 5


@pytest.mark.parametrize("make", ["empty", "binary only"])
def test_no_documents_is_one_clear_line(tmp_path, make):
    root = tmp_path / "r"
    root.mkdir()
    if make == "binary only":
        (root / "x.py").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="no documents found under r=") as e:
        corpus.build_corpus([corpus.Root("r", root)], vocab_size=VOCAB, progress=False)
    assert "\n" not in str(e.value) and str(root) in str(e.value)


def test_bad_input_is_refused(tmp_path, tree):
    roots, _ = tree
    with pytest.raises(FileNotFoundError, match="corpus root 'gone'.*is not a folder"):
        corpus.list_documents([corpus.Root("gone", tmp_path / "gone")])
    with pytest.raises(ValueError, match="distinct names"):
        corpus.list_documents([roots[0], roots[0]])
    with pytest.raises(ValueError, match="max_file_bytes"):
        corpus.list_documents(roots, max_file_bytes=0)
    with pytest.raises(ValueError, match="max_files"):
        corpus.list_documents(roots, max_files=0)
    with pytest.raises(ValueError, match="vocab_size=100"):
        corpus.build_corpus(roots, vocab_size=100)
    with pytest.raises(ValueError, match="tokenizer_bytes"):
        corpus.build_corpus(roots, vocab_size=VOCAB, tokenizer_bytes=0)
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.py").write_text("a = 1\n")
    with pytest.raises(ValueError, match="split; it needs more documents"):
        corpus.build_corpus([corpus.Root("one", one)], vocab_size=VOCAB)


# ---------------------------------------------------------------- wiring


def test_load_data_installed(tree, monkeypatch):
    roots, docs = tree
    monkeypatch.setattr(corpus, "default_roots", lambda: tuple(roots))
    tokens = data.load_data("installed", vocab_size=VOCAB)
    c = corpus.build_corpus(roots, vocab_size=VOCAB)
    assert tokens.source.startswith(f"installed ({len(docs)} documents, ")
    assert tokens.info == {"corpus_fingerprint": c.fingerprint,
                           "corpus_tokens": len(c.train) + len(c.test)}
    assert np.array_equal(tokens.train, c.train) and np.array_equal(tokens.test, c.test)
    with pytest.raises(ValueError, match="token_dtype"):
        data.load_data("installed", vocab_size=VOCAB, token_dtype="uint16")
    assert data.load_data("stdlib", vocab_size=VOCAB, max_bytes=20_000).info == {}


def test_a_run_records_the_corpus(tree, monkeypatch, tmp_path):
    pytest.importorskip("flax")
    from train_helpers import config, quiet

    roots, _ = tree
    monkeypatch.setattr(corpus, "default_roots", lambda: tuple(roots))
    _, messages = quiet(config("installed", tmp_path / "run", steps=2, eval_every=2,
                               checkpoint_every=2))
    c = corpus.build_corpus(roots, vocab_size=MODELS["tiny"].vocab_size)
    settings = json.loads((tmp_path / "run" / "config.json").read_text())
    assert settings["data"] == "installed"
    assert settings["corpus_fingerprint"] == c.fingerprint
    assert settings["corpus_tokens"] == len(c.train) + len(c.test)
    assert any(c.fingerprint[:16] in m for m in messages)


def test_real_listing_a_few_files_per_root():
    roots = corpus.default_roots()
    assert roots[0].name == "stdlib" and roots[0].python_only
    assert any(r.name == "packages" for r in roots)
    listing = corpus.list_documents(roots, max_files=40, progress=False)
    assert listing.files <= 40 * len(roots)
    assert {d.root for d in listing.documents} >= {"stdlib", "packages"}
    assert len({d.sha256 for d in listing.documents}) == len(listing.documents)
    for r in roots:
        mine = [d.path for d in listing.documents if d.root == r.name]
        assert mine == sorted(mine)
    assert all(d.text.strip() and d.nbytes <= corpus.MAX_FILE_BYTES for d in listing.documents)
    assert all(d.path.endswith(".py") for d in listing.documents if d.root == "stdlib")


# ---------------------------------------------------------------- mid-size models


def _hand_count(vocab: int, d: int, f: int, layers: int, heads: int, kv: int) -> int:
    """LLaMA parameters by hand: tied embedding, q/k/v/o, gate/up/down, two norms a layer."""
    hd = d // heads
    q, k, v, o = d * heads * hd, d * kv * hd, d * kv * hd, heads * hd * d
    mlp = d * f + d * f + f * d
    return vocab * d + layers * (q + k + v + o + mlp + 2 * d) + d


@pytest.mark.parametrize(("name", "params"), [("20m", 17_554_176), ("60m", 66_591_744)])
def test_mid_models_param_counts_and_proportions(name, params):
    m = MODELS[name]
    assert m.param_count() == params == _hand_count(
        m.vocab_size, m.hidden_size, m.intermediate_size, m.num_layers, m.num_heads,
        m.num_kv_heads)
    paper = MODELS["270m"]
    assert m.head_dim == paper.head_dim == 64
    assert m.intermediate_size / m.hidden_size == paper.intermediate_size / paper.hidden_size
    assert m.tie_embeddings and m.vocab_size == 32768  # ids fit the uint16 token cache
    assert abs(m.embedding_fraction() - 0.48) < 0.03  # the 270M's share
    assert m.num_heads // m.num_kv_heads == min(8, m.num_heads)


def test_mid_models_flax_parameters_match_the_count():
    pytest.importorskip("flax")
    import jax

    from sage_optax.routing import iter_leaves
    from sage_train.model.llama import abstract_params

    for name in ("20m", "60m"):
        leaves = [x for _, x in iter_leaves(abstract_params(MODELS[name]))]
        assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
        assert sum(x.size for x in leaves) == MODELS[name].param_count()


def test_a_damaged_corpus_cache_is_rebuilt_never_used(tree, monkeypatch):
    """Issue 33: zeroed tokens in the cache's train.npy loaded silently, fingerprint unchanged."""
    roots, _ = tree
    a = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    want = np.array(a.train)
    assert data.verify_entry(a.path, VOCAB) is None
    arr = np.load(a.path / "train.npy", mmap_mode="r+")
    arr[:500] = 0
    arr.flush()
    del arr, a
    with pytest.warns(UserWarning, match=r"corpus cache entry .* is damaged \(train.npy does "
                                         r"not have the checksum"):
        b = corpus.build_corpus(roots, vocab_size=VOCAB, progress=False)
    np.testing.assert_array_equal(b.train, want)
    assert data.verify_entry(b.path, VOCAB) is None
