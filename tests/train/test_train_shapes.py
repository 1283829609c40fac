"""The trainer beyond its named sizes (issue 34): ``--model`` takes any LLaMA shape (a JSON
file, or a Hugging Face checkpoint's ``config.json``), ``--init-from-hf`` starts from a
transformers LLaMA of any shape, and ``sage-train sample`` continues a prompt from a run."""

from __future__ import annotations

import json

import numpy as np
import pytest

from sage_train.model.shapes import LlamaConfig, get_model_config, load_model_file

SHAPE = {"name": "odd", "vocab_size": 512, "hidden_size": 48, "intermediate_size": 80,
         "num_layers": 1, "num_heads": 3, "num_kv_heads": 1, "max_position_embeddings": 64}


def test_a_json_file_is_a_model(tmp_path):
    path = tmp_path / "shape.json"
    path.write_text(json.dumps(SHAPE))
    assert get_model_config(str(path)) == LlamaConfig(
        "odd", 512, 48, 80, 1, 3, 1, max_position_embeddings=64, tie_embeddings=False)
    # a Hugging Face config.json, in its directory: its names and its defaults
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 300, "hidden_size": 40, "intermediate_size": 72,
        "num_hidden_layers": 2, "num_attention_heads": 5, "head_dim": 8}))
    hf = get_model_config(str(tmp_path / "hf"))
    assert (hf.name, hf.num_layers, hf.num_heads, hf.num_kv_heads, hf.head_dim) == (
        "hf", 2, 5, 5, 8)
    assert hf.max_position_embeddings == 2048 and hf.tie_embeddings is False


@pytest.mark.parametrize(("change", "words"), [
    ({"num_heads": 5}, "not divisible by num_heads=5"),
    ({"hidden_size": 0}, "hidden_size must be an integer >= 1, got 0"),
    ({"vocab_size": None}, "has no vocab_size"),
    ({"model_type": "gpt2"}, "'gpt2' model's config, not a LLaMA's"),
    ({"head_dim": 10}, "head_dim 10 x 3 heads is not hidden_size 48"),
])
def test_a_bad_model_file_is_one_line(tmp_path, change, words):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({k: v for k, v in (SHAPE | change).items() if v is not None}))
    with pytest.raises(ValueError) as e:
        load_model_file(str(path))
    assert "\n" not in str(e.value) and words in str(e.value) and str(path) in str(e.value)


def test_the_trainer_takes_the_shape(tmp_path):
    pytest.importorskip("flax")
    from sage_train.cli import parse_args
    from sage_train.job.errors import ConfigError
    from sage_train.run.train import TrainConfig, check_config

    path = tmp_path / "shape.json"
    path.write_text(json.dumps(SHAPE))
    check_config(TrainConfig(model=str(path), seq_len=64))
    with pytest.raises(ConfigError, match="longer than the odd model's context of 64"):
        check_config(TrainConfig(model=str(path), seq_len=128))
    args = parse_args(["--model", str(path)])
    assert args.model == str(path)
    with pytest.raises(SystemExit):
        parse_args(["--model", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit):  # --init-from-hf without --model: its config.json
        parse_args(["--init-from-hf", str(tmp_path)])
    assert parse_args([]).model == "small"


@pytest.mark.usefixtures("token_cache", "torch_one_thread")
def test_init_from_any_transformers_llama_then_sample(train_corpus, tmp_path, capsys):
    """A transformers LLaMA of no named shape (5 heads of 8, one KV head, untied head):
    ``--init-from-hf`` without ``--model`` takes its shape, and the first loss (batch 0,
    before any update) is the one transformers computes with those weights.  Then
    ``sage-train sample`` continues a prompt: greedy, its tokens are those of a plain
    loop over growing sequences (no fixed window, no jit)."""
    pytest.importorskip("orbax.checkpoint")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import jax.numpy as jnp
    from flax import nnx
    from tokenizers import Tokenizer

    from sage_train.cli import main
    from sage_train.data import pipeline as data_lib
    from sage_train.run import export

    torch.manual_seed(0)
    hf_dir = tmp_path / "llama"
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=40, intermediate_size=72, num_hidden_layers=2,
        num_attention_heads=5, num_key_value_heads=1, max_position_embeddings=128,
        tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    runs = tmp_path / "runs"
    assert main(["--init-from-hf", str(hf_dir), "--steps", "1", "--batch-size", "8",
                 "--seq-len", "32", "--eval-batches", "1", "--data", str(train_corpus),
                 "--run-dir", str(runs), "--no-progress"]) == 0
    run = runs / "llama-sage-hybrid"
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    tokens = data_lib.load_data(str(train_corpus), vocab_size=512)
    inputs, targets = next(data_lib.batches(tokens.train, 8, 32, seed=0))
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        logits = hf(torch.from_numpy(inputs).long()).logits
        want = float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, 512), torch.from_numpy(targets).long().reshape(-1)))
    assert first["loss"] == pytest.approx(want, rel=1e-5)

    capsys.readouterr()
    assert main(["sample", "--run-dir", str(run), "--prompt", "def parse(self",
                 "--tokens", "5", "--temperature", "0"]) == 0
    text = capsys.readouterr().out.rstrip("\n")
    tokenizer = Tokenizer.from_file(str(run / "tokenizer.json"))
    prompt = tokenizer.encode("def parse(self").ids
    model, step = export._read_model(run, export.run_settings(run), None, lambda _: None)
    assert step == 1
    new = export.generate(model, prompt, 5, temperature=0, stop=data_lib.EOT_ID)
    assert text == "def parse(self" + tokenizer.decode(
        new[:-1] if new[-1] == data_lib.EOT_ID else new)
    # greedy: each token is the likeliest after what precedes it; one causal forward pass
    # over the whole sequence (no window, no padding) gives every prefix's logits
    ids = prompt + new
    logits = np.asarray(nnx.jit(lambda m, x: m(x))(model, jnp.asarray([ids[:-1]])))[0]
    assert [int(np.argmax(logits[i - 1])) for i in range(len(prompt), len(ids))] == new
    # sampled: a temperature draws other tokens, the same for the same seed
    hot = export.generate(model, prompt, 5, temperature=5.0, seed=1)
    assert hot == export.generate(model, prompt, 5, temperature=5.0, seed=1) != new
    # refusals: one line each
    assert main(["sample", "--run-dir", str(run), "--prompt", "x", "--tokens", "500"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "context of 128 positions" in err
    assert main(["sample", "--run-dir", str(runs), "--prompt", "x"]) == 2
    assert "holds no run" in capsys.readouterr().err
