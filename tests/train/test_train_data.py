"""Tests of sage_train.data.pipeline: embedded corpus, local BPE, cache, token files, batches."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from sage_train.data import pipeline as data

MAX_BYTES = 300_000
VOCAB = 512


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    return data.stdlib_corpus(MAX_BYTES)


@pytest.fixture(scope="module")
def tokenizer(corpus):
    return data.train_tokenizer(corpus, VOCAB)


# ---------------------------------------------------------------- corpus / tokenizer


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "x"))
    assert data.cache_dir() == tmp_path / "x"
    monkeypatch.delenv("SAGE_CACHE_DIR")
    assert data.cache_dir().parts[-2:] == (".cache", "sage-optim")


def test_stdlib_corpus_deterministic_and_nonempty(corpus):
    again = data.stdlib_corpus(MAX_BYTES)
    assert again == corpus
    assert len(corpus) > 3 and all(doc.strip() for doc in corpus)
    size = sum(len(doc.encode("utf-8")) for doc in corpus)
    assert 0.9 * MAX_BYTES < size <= MAX_BYTES
    assert "def " in "".join(corpus)
    smaller = data.stdlib_corpus(MAX_BYTES // 3)
    assert "".join(corpus).startswith("".join(smaller[:-1]))  # same order, a prefix
    with pytest.raises(ValueError, match="max_bytes"):
        data.stdlib_corpus(0)


def test_tokenizer_exact_vocab_and_roundtrip(tokenizer, corpus):
    assert tokenizer.get_vocab_size() == VOCAB
    assert tokenizer.token_to_id(data.EOT) == data.EOT_ID == 0
    samples = [
        "def f(x):\n    return x ** 2  # square\n\n\n\tindented\r\n",
        "plain ASCII text, with punctuation!? ~`^",
        "héllo wörld — naïve café, 日本語のテキスト, emoji 😀🚀, e\u0301 combining, Ω≈ç√∫",
        "   leading and trailing spaces   ",
        "",
    ]
    for s in samples:
        ids = tokenizer.encode(s).ids
        assert all(0 <= i < VOCAB for i in ids)
        assert tokenizer.decode(ids) == s
    # BPE actually compresses: fewer tokens than bytes on code it was trained on.
    assert len(tokenizer.encode(corpus[0]).ids) < 0.6 * len(corpus[0].encode())
    # Deterministic: the same input gives the same tokenizer.
    assert data.train_tokenizer(corpus, VOCAB).to_str() == tokenizer.to_str()


def test_tokenizer_tiny_text_still_exact_vocab():
    tok = data.train_tokenizer(["abc abc abd"], 300)
    assert tok.get_vocab_size() == 300
    assert tok.decode(tok.encode("abc zzz é").ids) == "abc zzz é"


def test_vocab_too_small():
    with pytest.raises(ValueError, match="257"):
        data.train_tokenizer(["some text"], 256)
    with pytest.raises(ValueError, match="vocab_size=100"):
        data.load_data("stdlib", vocab_size=100, max_bytes=MAX_BYTES)


# ---------------------------------------------------------------- load_data: stdlib + cache


def test_load_stdlib_split_and_cache(corpus, monkeypatch):
    td = data.load_data("stdlib", vocab_size=VOCAB, max_bytes=MAX_BYTES)
    n_train, n_test = len(td.train), len(td.test)
    total = n_train + n_test
    assert total > 50_000
    assert abs(n_train / total - 0.8) < 0.005
    assert td.vocab_size == VOCAB and td.tokenizer is not None
    assert td.tokenizer.get_vocab_size() == VOCAB
    stream = np.concatenate([td.train, td.test])
    assert stream.ndim == 1 and np.issubdtype(stream.dtype, np.integer)
    assert int(stream.max()) < VOCAB
    # One <|endoftext|> after each document, the stream ends with one, and it decodes back.
    assert int((stream == data.EOT_ID).sum()) == len(corpus)
    assert stream[-1] == data.EOT_ID
    assert td.tokenizer.decode(stream.tolist()) == "".join(corpus)

    # Second call: served from the cache, no retraining (train_tokenizer would raise).
    def boom(*args, **kwargs):
        raise AssertionError("tokenizer retrained despite cache")

    monkeypatch.setattr(data, "train_tokenizer", boom)
    td2 = data.load_data(None, vocab_size=VOCAB, max_bytes=MAX_BYTES)
    assert isinstance(td2.train, np.memmap) and isinstance(td2.test, np.memmap)
    np.testing.assert_array_equal(td2.train, td.train)
    np.testing.assert_array_equal(td2.test, td.test)
    assert td2.tokenizer.to_str() == td.tokenizer.to_str()
    # The cache is keyed by vocab_size (and content): a new size retrains.
    with pytest.raises(AssertionError, match="retrained"):
        data.load_data("stdlib", vocab_size=VOCAB + 1, max_bytes=MAX_BYTES)
    with pytest.raises(AssertionError, match="retrained"):
        data.load_data("stdlib", vocab_size=VOCAB, max_bytes=MAX_BYTES // 2)


# ---------------------------------------------------------------- load_data: text sources

TEXT = (
    "The quick brown fox jumps over the lazy dog. Ünïcödé façade — 数据 😀\n"
    "Pack my box with five dozen liquor jugs; how vexingly quick daft zebras jump!\n"
) * 40


def test_text_file_source(tmp_path, monkeypatch):
    f = tmp_path / "story.txt"
    f.write_text(TEXT, encoding="utf-8")
    td = data.load_data(f, vocab_size=300)
    assert td.tokenizer is not None and td.tokenizer.get_vocab_size() == 300
    stream = np.concatenate([td.train, td.test])
    assert int(stream.max()) < 300
    assert td.tokenizer.decode(stream.tolist()) == TEXT
    assert len(td.train) == len(stream) * 4 // 5 and len(td.test) > 0

    # Same content → cache hit, even as a str path.
    def boom(*args, **kwargs):
        raise AssertionError("tokenizer retrained despite cache")

    monkeypatch.setattr(data, "train_tokenizer", boom)
    td2 = data.load_data(str(f), vocab_size=300)
    np.testing.assert_array_equal(td2.train, td.train)
    # Changed content → cache miss.
    f.write_text(TEXT + "more", encoding="utf-8")
    with pytest.raises(AssertionError, match="retrained"):
        data.load_data(f, vocab_size=300)


def test_text_folder_source(tmp_path):
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    (root / ".git").mkdir()
    (root / "b.md").write_text("# Title\n\nSome *markdown* text.\n", encoding="utf-8")
    (root / "a.txt").write_text("plain text file é\n", encoding="utf-8")
    (root / "sub" / "c.py").write_text("print('hi')\n", encoding="utf-8")
    (root / "sub" / "README").write_text("no extension, still UTF-8\n", encoding="utf-8")
    (root / "d.jsonl").write_text('{"text": "json line"}\n', encoding="utf-8")
    (root / "latin1.txt").write_bytes("caf\xe9\n".encode("latin-1"))  # not UTF-8
    (root / "blob.dat").write_bytes(b"abc\x00\x01\x02")  # NUL byte: binary
    (root / "tokens.npy").write_bytes(b"ignored")
    (root / ".hidden.txt").write_text("hidden\n", encoding="utf-8")
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n", encoding="utf-8")
    (root / "empty.txt").write_text("", encoding="utf-8")

    docs = data.read_text_source(root)
    assert docs == [
        "plain text file é\n",
        "# Title\n\nSome *markdown* text.\n",
        '{"text": "json line"}\n',
        "no extension, still UTF-8\n",
        "print('hi')\n",
    ]
    td = data.load_data(root, vocab_size=300)
    stream = np.concatenate([td.train, td.test])
    assert int((stream == data.EOT_ID).sum()) == len(docs)
    assert td.tokenizer.decode(stream.tolist()) == "".join(docs)


def test_text_source_errors(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        data.load_data(missing, vocab_size=300)
    with pytest.raises(FileNotFoundError, match="nope"):
        data.read_text_source(missing)
    empty = tmp_path / "empty_dir"
    empty.mkdir()
    (empty / "x.bin").write_bytes(b"\x00\x01")
    with pytest.raises(ValueError, match="empty_dir"):
        data.load_data(empty, vocab_size=300)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\xfa")
    with pytest.raises(ValueError, match="bad.txt"):
        data.read_text_source(bad)


# ---------------------------------------------------------------- pre-tokenized files


def _check_memmapped(td, expected, dtype):
    assert isinstance(td.train, np.memmap) and isinstance(td.test, np.memmap)
    assert td.train.dtype == dtype and td.tokenizer is None
    assert len(td.train) == len(expected) * 4 // 5
    np.testing.assert_array_equal(np.concatenate([td.train, td.test]), expected)


def test_pretokenized_u16_u32_npy_bin(tmp_path):
    rng = np.random.default_rng(0)
    ids16 = rng.integers(0, 1000, size=5000).astype(np.uint16)
    ids32 = rng.integers(0, 100_000, size=5000).astype(np.uint32)

    ids16.tofile(tmp_path / "t.u16")
    _check_memmapped(data.load_data(tmp_path / "t.u16", vocab_size=1000), ids16, np.uint16)

    ids32.tofile(tmp_path / "t.u32")
    td = data.load_data(tmp_path / "t.u32", vocab_size=100_000, token_dtype="uint32")
    _check_memmapped(td, ids32, np.uint32)

    np.save(tmp_path / "t.npy", ids32)
    _check_memmapped(data.load_data(tmp_path / "t.npy", vocab_size=100_000), ids32, np.uint32)

    ids16.tofile(tmp_path / "t.bin")
    td = data.load_data(tmp_path / "t.bin", vocab_size=1000, token_dtype="uint16")
    _check_memmapped(td, ids16, np.uint16)
    with pytest.raises(ValueError, match="token_dtype"):
        data.load_data(tmp_path / "t.bin", vocab_size=1000)


def test_pretokenized_errors(tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    ids.tofile(tmp_path / "ids.u16")
    with pytest.raises(ValueError, match=r"ids\.u16.*99.*vocab_size=99"):
        data.load_data(tmp_path / "ids.u16", vocab_size=99)
    np.save(tmp_path / "ids.npy", ids.astype(np.uint32))
    with pytest.raises(ValueError, match=r"ids\.npy.*99"):
        data.load_data(tmp_path / "ids.npy", vocab_size=50)
    with pytest.raises(ValueError, match="uint16"):  # extension says uint16
        data.load_data(tmp_path / "ids.u16", vocab_size=1000, token_dtype="uint32")
    np.save(tmp_path / "f.npy", np.zeros(100, dtype=np.float32))
    with pytest.raises(ValueError, match="uint16/uint32"):
        data.load_data(tmp_path / "f.npy", vocab_size=1000)
    (tmp_path / "odd.u32").write_bytes(b"\x01\x00\x00\x00\x02\x00")
    with pytest.raises(ValueError, match="odd.u32"):
        data.load_data(tmp_path / "odd.u32", vocab_size=1000)
    with pytest.raises(ValueError, match="token_dtype"):
        data.load_data("stdlib", vocab_size=VOCAB, token_dtype="uint16")


# ---------------------------------------------------------------- batches


def test_batches_deterministic_resumable_shifted():
    tokens = np.arange(10_000, dtype=np.uint16)
    first = [b for _, b in zip(range(10), data.batches(tokens, 4, 16, seed=3), strict=False)]
    again = [b for _, b in zip(range(10), data.batches(tokens, 4, 16, seed=3), strict=False)]
    resumed = [
        b for _, b in zip(range(5), data.batches(tokens, 4, 16, seed=3, start_step=5),
                          strict=False)
    ]
    other = next(data.batches(tokens, 4, 16, seed=4))
    for (x, y), (x2, y2) in zip(first, again, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    for (x, y), (x2, y2) in zip(first[5:], resumed, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    assert not np.array_equal(other[0], first[0][0])
    assert not np.array_equal(first[0][0], first[1][0])  # batches differ between steps
    for x, y in first:
        assert x.shape == y.shape == (4, 16) and x.dtype == y.dtype == np.int32
        np.testing.assert_array_equal(y, x + 1)  # arange tokens: windows are contiguous
        np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
        assert x.min() >= 0 and y.max() < len(tokens)


def test_batches_on_memmap_and_edges(tmp_path):
    tokens = np.arange(17, dtype=np.uint32)
    tokens.tofile(tmp_path / "t.u32")
    mm = np.memmap(tmp_path / "t.u32", dtype=np.uint32, mode="r")
    x, y = next(data.batches(mm, 8, 16, seed=0))  # exactly seq_len + 1 tokens: one window
    np.testing.assert_array_equal(x, np.broadcast_to(np.arange(16), (8, 16)))
    np.testing.assert_array_equal(y, x + 1)
    with pytest.raises(ValueError, match="shorter than seq_len"):
        data.batches(mm, 2, 17, seed=0)  # raised at call time, not at next()
    with pytest.raises(ValueError, match="1-D"):
        data.batches(np.zeros((4, 40), dtype=np.int32), 2, 8, seed=0)


def test_eval_batches():
    tokens = np.arange(1000, dtype=np.uint16)
    evs = data.eval_batches(tokens, 4, 10, max_batches=3)
    assert len(evs) == 3
    starts = np.concatenate([x[:, 0] for x, _ in evs])
    assert np.all(np.diff(starts) >= 10)  # non-overlapping inputs
    assert starts[-1] > 500  # spread over the split, not just its head
    for x, y in evs:
        assert x.shape == y.shape == (4, 10) and x.dtype == np.int32
        np.testing.assert_array_equal(y, x + 1)
    again = data.eval_batches(tokens, 4, 10, max_batches=3)
    for (x, y), (x2, y2) in zip(evs, again, strict=True):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    everything = data.eval_batches(tokens, 4, 10)
    assert len(everything) == (999 // 10) // 4
    seen = np.sort(np.concatenate([x.ravel() for x, _ in everything]))
    assert len(np.unique(seen)) == len(seen)  # no input token scored twice
    with pytest.raises(ValueError, match="too few"):
        data.eval_batches(np.arange(30), 4, 10)
    with pytest.raises(ValueError, match="shorter than seq_len"):
        data.eval_batches(np.arange(5), 1, 10)


# ---------------------------------------------------------------- issue 33: cache integrity


def _entries():
    return sorted(p for p in (data.cache_dir() / "tokens").iterdir() if not p.name.startswith("."))


def test_a_damaged_token_cache_entry_is_rebuilt_never_used(tmp_path, monkeypatch):
    f = tmp_path / "story.txt"
    f.write_text(TEXT, encoding="utf-8")
    td = data.load_data(f, vocab_size=300)
    want_train, want_test = np.array(td.train), np.array(td.test)
    (entry,) = _entries()
    record = json.loads((entry / data.INTEGRITY).read_text())
    assert record["vocab_size"] == 300
    assert set(record["files"]) == {"tokenizer.json", "train.npy", "test.npy", "meta.json"}
    assert data.verify_entry(entry, 300) is None
    trained = []
    real = data.train_tokenizer
    monkeypatch.setattr(data, "train_tokenizer", lambda *a: trained.append(1) or real(*a))
    # zeroed tokens in train.npy, the file's size unchanged: rebuilt, with a warning
    arr = np.load(entry / "train.npy", mmap_mode="r+")
    arr[10:60] = 0
    arr.flush()
    del arr
    assert "train.npy does not have the checksum" in data.verify_entry(entry, 300)
    with pytest.warns(UserWarning, match=r"token cache entry .* is damaged \(train.npy does "
                                         r"not have the checksum it was written with\)"):
        again = data.load_data(f, vocab_size=300)
    assert trained == [1]
    np.testing.assert_array_equal(again.train, want_train)
    np.testing.assert_array_equal(again.test, want_test)
    assert data.verify_entry(entry, 300) is None  # the entry was replaced
    # an entry without its record (cut short, older version): rebuilt once
    (entry / data.INTEGRITY).unlink()
    with pytest.warns(UserWarning, match="no checksums.json"):
        data.load_data(f, vocab_size=300)
    assert trained == [1, 1] and data.verify_entry(entry, 300) is None
    data.load_data(f, vocab_size=300)
    assert trained == [1, 1]  # intact: used as it is


def test_a_cache_entry_of_another_vocabulary_is_not_used(tmp_path, monkeypatch):
    """An entry of a 300-token tokenizer found under the key of a 512-token model (copied,
    or a damaged index): rebuilt, never read with the wrong tokenizer."""
    f = tmp_path / "story.txt"
    f.write_text(TEXT, encoding="utf-8")
    data.load_data(f, vocab_size=300)
    (small,) = _entries()
    shutil.rmtree(small.parent / ".keep", ignore_errors=True)
    shutil.copytree(small, small.parent / ".keep")
    td = data.load_data(f, vocab_size=VOCAB)
    big = next(p for p in _entries() if p != small)
    shutil.rmtree(big)
    shutil.copytree(small.parent / ".keep", big)
    assert "its tokenizer has 300 tokens, not vocab_size=512" in data.verify_entry(big, VOCAB)
    with pytest.warns(UserWarning, match="its tokenizer has 300 tokens"):
        again = data.load_data(f, vocab_size=VOCAB)
    assert again.tokenizer.get_vocab_size() == VOCAB
    np.testing.assert_array_equal(again.train, td.train)
