"""The Hugging Face round trip from the command line: train -> ``sage-train export`` ->
transformers (model and tokenizer, offline) -> ``--init-from-hf``.

The tiny model, a few steps; nothing is ever downloaded (``HF_HUB_OFFLINE=1`` and local
directories only).
"""

from __future__ import annotations

import json
import pathlib
import shutil
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from flax import nnx  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from train_helpers import config, quiet  # noqa: E402

from sage_train.cli import main  # noqa: E402
from sage_train.data import pipeline as data_lib  # noqa: E402
from sage_train.hf import convert as hf_convert  # noqa: E402
from sage_train.job.errors import ConfigError, DataError, RunDirError  # noqa: E402
from sage_train.model.sharding import make_mesh, state_shardings  # noqa: E402
from sage_train.run import steps as train_mod  # noqa: E402
from sage_train.store.checkpoints import Checkpoints  # noqa: E402

pytestmark = pytest.mark.usefixtures("token_cache", "torch_one_thread")

REL_TOL = 1e-5
"""Logits of transformers and of the trainer agree to this fraction of the largest logit:
both are float32 evaluations of the same weights and the same math (RMSNorm, RoPE, GQA,
SwiGLU, tied head), differing only in the order of the sums inside matmuls, softmax and
norms (XLA's against ATen's), ~1e-7 relative per operation over the two layers: the
measured difference is 3e-7 of the largest logit (the bound of tests/train/test_train_model.py),
while a wrong weight (one transposed, another layer's) moves logits by O(1)."""


@pytest.fixture(scope="module")
def exported(train_corpus, tmp_path_factory):
    """A 4-step tiny run and its export: (config, run directory, export directory)."""
    root = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SAGE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "token-cache"))
        cfg = config(train_corpus, root / "run")
        quiet(cfg, stop_after=4)
        out = root / "export"
        assert main(["export", "--hf", str(out), "--run-dir", str(root / "run")]) == 0
    return cfg, root / "run", out


def trainer_model(cfg):
    """The model of the run's newest checkpoint, read as a resume reads it."""
    model, optimizer = train_mod.build(cfg, 1024)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, state_shardings(state, make_mesh(cfg.sharding), cfg.sharding))
    restored = Checkpoints(pathlib.Path(cfg.run_dir) / "checkpoints").read(state)
    assert restored.step == 4
    return nnx.merge(graphdef, restored.state)[0]


def first_batch(cfg):
    tokens = data_lib.load_data(cfg.data, vocab_size=1024)
    return next(data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed))


def test_export_writes_what_transformers_loads_offline(exported, monkeypatch):
    cfg, run, out = exported
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "model.safetensors", "sage_export.json", "tokenizer.json",
        "tokenizer_config.json"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(hf).__name__ == "LlamaForCausalLM" and hf.dtype == torch.float32
    assert hf.config.tie_word_embeddings and hf.config.eos_token_id == data_lib.EOT_ID
    tok = transformers.AutoTokenizer.from_pretrained(out, local_files_only=True)
    ours = Tokenizer.from_file(str(run / "tokenizer.json"))
    text = "def f(x):\n    return {'a': [x, 1.5]}  # ok\n"
    assert tok(text)["input_ids"] == ours.encode(text).ids
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == data_lib.EOT and tok.eos_token_id == data_lib.EOT_ID
    provenance = json.loads((out / "sage_export.json").read_text())
    assert provenance["step"] == 4 and provenance["run_dir"] == str(run)


def test_transformers_logits_equal_the_trainers(exported):
    cfg, _, out = exported
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    inputs, _ = first_batch(cfg)
    with torch.no_grad():
        ref = hf(torch.from_numpy(inputs).long()).logits.numpy()
    with jax.default_matmul_precision("highest"):
        ours = np.asarray(trainer_model(cfg)(inputs))
    assert ours.shape == ref.shape == (cfg.batch_size, cfg.seq_len, 1024)
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert err <= REL_TOL * scale, (err, scale)


def test_init_from_hf_first_step_loss_is_the_exported_weights_loss(exported, tmp_path,
                                                                   capsys):
    """A run started from the export: its first loss (before any update, on batch 0) is the
    loss the exported weights give on batch 0, in the trainer and in transformers."""
    cfg, _, out = exported
    run = tmp_path / "init"
    new = config(cfg.data, run, init_from_hf=str(out))
    result, messages = quiet(new, stop_after=1)
    inputs, targets = first_batch(cfg)
    model = trainer_model(cfg)
    want = float(jax.jit(train_mod.loss_fn)(model, inputs, targets))
    # the same float32 forward pass, once inside the train step's value_and_grad: equal
    # (bit for bit on the CPU, measured), up to XLA's freedom to fuse the two differently
    assert result.losses[0] == pytest.approx(want, rel=1e-6, abs=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    with torch.no_grad():
        logits = hf(torch.from_numpy(inputs).long()).logits
        torch_loss = float(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), torch.from_numpy(targets).long().reshape(-1)))
    assert result.losses[0] == pytest.approx(torch_loss, rel=1e-5)
    fresh, _ = quiet(config(cfg.data, tmp_path / "fresh"), stop_after=1)
    assert abs(fresh.losses[0] - result.losses[0]) > 0.01  # the weights did change
    assert f"initial weights from the Hugging Face checkpoint {out}" in messages
    assert any(m.startswith("initial weights: ") and m.endswith(str(out)) for m in messages)
    settings = json.loads((run / "config.json").read_text())
    assert settings["init_from_hf"] == str(out)
    # a resume keeps its own weights; another --init-from-hf is a change of the run
    again, _ = quiet(new, stop_after=2)
    assert again.start_step == 1 and again.steps_done == 2
    other = tmp_path / "other-export"
    shutil.copytree(out, other)
    with pytest.raises(RunDirError, match="init_from_hf"):
        quiet(config(cfg.data, run, init_from_hf=str(other)))


def test_init_from_hf_of_another_architecture_is_refused_naming_the_field(
        exported, tmp_path, capsys):
    cfg, _, out = exported
    base = ["--steps", "2", "--data", str(cfg.data), "--run-dir", str(tmp_path / "runs"),
            "--no-progress"]
    assert main(["--model", "small", "--init-from-hf", str(out), *base]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "does not hold the small model's architecture" in err
    assert "hidden_size 96 (not 256)" in err and "num_hidden_layers 2 (not 4)" in err
    deeper = tmp_path / "deeper"
    shutil.copytree(out, deeper)
    hf = json.loads((deeper / "config.json").read_text())
    (deeper / "config.json").write_text(json.dumps(hf | {"num_hidden_layers": 3}))
    assert main(["--model", "tiny", "--init-from-hf", str(deeper), *base]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "num_hidden_layers 3 (not 2)" in err
    assert "hidden_size" not in err
    assert main(["--model", "tiny", "--init-from-hf", str(tmp_path / "none"), *base]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "config.json does not exist" in err
    assert not (tmp_path / "runs").exists()
    (deeper / "config.json").write_text(json.dumps(hf))
    (deeper / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no model.safetensors"):
        quiet(config(cfg.data, tmp_path / "no-weights", init_from_hf=str(deeper)))


def test_init_from_hf_refuses_weights_of_another_tokenizer(exported, tmp_path):
    """Data whose tokenizer is another one: the weights' token ids would mean other tokens."""
    _, _, out = exported
    other = tmp_path / "other.txt"
    other.write_text("".join(f"line {i}: the quick brown fox {i * i}\n" for i in range(3000)))
    with pytest.raises(DataError, match="its tokenizer is not the one of the data"):
        quiet(config(other, tmp_path / "run", init_from_hf=str(out)))


def test_export_refusals_are_one_line_and_write_nothing(exported, tmp_path, capsys,
                                                         monkeypatch):
    _, run, _ = exported
    target = tmp_path / "out"
    cases = [
        (["--run-dir", str(run.parent)], "holds no run (config.json)"),
        (["--run-dir", str(tmp_path / "missing")], "does not exist"),
        (["--run-dir", str(run), "--step", "3"], "holds no checkpoint of step 3 (steps: 4)"),
    ]
    for args, text in cases:
        assert main(["export", "--hf", str(target), *args]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and text in err, err
    assert main(["export", "--hf", str(run / "hf"), "--run-dir", str(run)]) == 2
    assert "inside a run directory" in capsys.readouterr().err
    assert not target.exists() and not (run / "hf").exists()
    with pytest.raises(SystemExit) as e:
        main(["export", "--run-dir", str(run)])
    assert e.value.code == 2 and "--hf" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed
    assert main(["export", "--hf", str(target), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install transformers" in err
    assert not target.exists()


def test_config_mismatches_reads_transformers_defaults():
    from sage_train.model.shapes import get_model_config

    tiny = get_model_config("tiny")
    fields = hf_convert.hf_config_fields(tiny) | {"model_type": "llama"}
    assert hf_convert.config_mismatches(fields, tiny) == []
    legacy = {k: v for k, v in fields.items() if k not in ("rope_parameters", "head_dim")}
    assert hf_convert.config_mismatches(legacy | {"rope_theta": 10000.0}, tiny) == []
    scaled = fields | {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0}}
    assert hf_convert.config_mismatches(scaled, tiny) == [
        "rope_theta 500000.0 (not 10000.0)", "rope_type 'llama3' (not 'default')"]
    assert hf_convert.config_mismatches({"model_type": "llama"}, tiny)[0] == (
        "vocab_size 32000 (not 1024)")


# ---------------------------------------------------------------------------------------------
# issue 33: exports that never leave a lie behind


def test_an_empty_hf_is_refused_and_the_working_directory_kept(exported, tmp_path, capsys,
                                                               monkeypatch):
    _, run, _ = exported
    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert main(["export", "--hf", "", "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hf is empty" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    assert (tmp_path / "config.json").read_text() == "{}"


def shard(path, arrays):
    import safetensors.numpy

    path.write_bytes(safetensors.numpy.save(arrays, metadata={"format": "pt"}))


def sharded_save(directory, weights):
    """What transformers' sharded save_pretrained leaves: an index and two shards (with
    other values than ``weights``)."""
    keys = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": keys[:len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    for name, part in halves.items():
        shard(directory / name, {k: weights[k] + 1 for k in part})
    (directory / hf_convert.WEIGHTS_INDEX).write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: n for n, part in halves.items() for k in part}}))
    return halves


def test_an_export_replaces_the_weights_and_tokenizer_as_a_whole(exported, tmp_path, capsys,
                                                                  monkeypatch):
    _, run, out = exported
    weights = hf_convert.load_weights(out)
    # a folder that is no export of ours (a sharded save) is refused, untouched
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    sharded_save(foreign, weights)
    before = sorted(p.name for p in foreign.iterdir())
    assert main(["export", "--hf", str(foreign), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "neither empty nor an earlier export" in err, err
    assert sorted(p.name for p in foreign.iterdir()) == before
    # an earlier export with a sharded save on top: the new export leaves no index or shard
    earlier = tmp_path / "earlier"
    shutil.copytree(out, earlier)
    (earlier / "model.safetensors").unlink()
    sharded_save(earlier, weights)
    assert main(["export", "--hf", str(earlier), "--run-dir", str(run)]) == 0
    assert sorted(p.name for p in earlier.iterdir()) == sorted(p.name for p in out.iterdir())
    got = hf_convert.load_weights(earlier)
    assert all(np.array_equal(got[k], weights[k]) for k in weights)
    # a run without a tokenizer exported into an earlier export: no tokenizer left behind
    from sage_train.run import export

    monkeypatch.setattr(export, "_tokenizer_json",
                        lambda *a: (None, "none: the run was trained on token ids"))
    assert main(["export", "--hf", str(earlier), "--run-dir", str(run)]) == 0
    assert sorted(p.name for p in earlier.iterdir()) == [
        "config.json", "model.safetensors", "sage_export.json"]


def test_weights_are_read_in_transformers_order_and_bad_files_named(exported, tmp_path):
    cfg, _, out = exported
    weights = hf_convert.load_weights(out)
    both = tmp_path / "both"
    shutil.copytree(out, both)
    sharded_save(both, weights)  # stale shards beside model.safetensors: transformers
    got = hf_convert.load_weights(both)  # reads model.safetensors
    assert all(np.array_equal(got[k], weights[k]) for k in weights)

    truncated = tmp_path / "truncated"
    shutil.copytree(out, truncated)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ConfigError) as e:
        quiet(config(cfg.data, tmp_path / "run", init_from_hf=str(truncated)))
    assert "cannot read the weight file" in str(e.value) and "model.safetensors" in str(e.value)
    assert "\n" not in str(e.value)

    missing = tmp_path / "missing"
    shutil.copytree(out, missing)
    (missing / "model.safetensors").unlink()
    halves = sharded_save(missing, weights)
    second = missing / sorted(halves)[1]
    second.unlink()
    with pytest.raises(ValueError, match=f"1 of the 2 weight files .* missing: {second}$"):
        hf_convert.load_weights(missing)
    (missing / hf_convert.WEIGHTS_INDEX).write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*model.safetensors.index.json"):
        hf_convert.load_weights(missing)
