"""The trainer says when it trains a tokenizer and where it caches the tokens (issue 45):
the first run on a new text trained a BPE silently and never named its cache folder."""

from __future__ import annotations

from sage_train.data import pipeline as data_lib


def test_a_new_text_says_it_trains_a_tokenizer_and_where_it_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line {i} of a small text, word{i % 7}\n" for i in range(3000)))
    said: list[str] = []
    first = data_lib.load_data(text, vocab_size=300, log=said.append)
    assert len(said) == 2, said
    assert said[0].startswith("tokenizer: training a 300-token BPE on ")
    entry = tmp_path / "cache" / "tokens"
    assert str(entry) in said[0] and str(entry) in said[1] and "cached in" in said[1]
    said.clear()
    again = data_lib.load_data(text, vocab_size=300, log=said.append)
    assert len(said) == 1 and said[0].startswith(f"tokens: {text}, read from the cache ")
    assert str(entry) in said[0]
    assert (first.train == again.train).all()
