"""The trainer: resumes bit-identically, stops on NaN, shards, records H_t, runs from the CLI."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

import reference_np as ref  # noqa: E402
from train_helpers import config  # noqa: E402

import sage_optax  # noqa: E402
from sage_train.cli import main  # noqa: E402
from sage_train.run.diagnostics import DamperRecorder, embedding_damper  # noqa: E402
from sage_train.run.train import TrainConfig, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("token_cache")


def test_resume_is_bit_identical(train_corpus, tmp_path):
    """Bit-identical on a GPU too: --deterministic asks XLA for deterministic reductions."""
    full = train(config(train_corpus, tmp_path / "full", deterministic=True), log=lambda s: None)
    cfg = config(train_corpus, tmp_path / "split", deterministic=True)
    first = train(cfg, stop_after=5, log=lambda s: None)
    assert first.steps_done == 5 and first.losses == full.losses[:5]
    second = train(cfg, log=lambda s: None)
    assert second.steps_done == 8
    assert second.losses == full.losses[5:]  # exact float equality, step by step
    metrics = (tmp_path / "split" / "metrics.jsonl").read_text()
    lines = [json.loads(x) for x in metrics.splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 9))
    assert {"loss", "lr", "tokens_per_s", "opt_state_bytes"} <= set(lines[-1])
    assert "test_ppl" in lines[3] and np.isfinite(lines[-1]["test_ppl"])
    h = np.load(tmp_path / "split" / "damper_h.npz")
    assert list(h["steps"]) == [2, 4, 6, 8] and h["h"].shape == (4, 96)


def test_runs_of_one_configuration_share_one_compiled_step(train_corpus, tmp_path):
    """Seeds share the compiled step (the cache is keyed on the step's config fields), and a
    shared step trains exactly as a freshly built one; another learning rate shares it too,
    another clipping threshold does not."""
    from sage_train.run import steps as train_mod

    train_mod._STEP_CACHE.clear()
    train(config(train_corpus, tmp_path / "s0", steps=3, seed=0), log=lambda s: None)
    shared = train(config(train_corpus, tmp_path / "s1", steps=3, seed=1), log=lambda s: None)
    assert len(train_mod._STEP_CACHE) == 1
    (train_step, _), = train_mod._STEP_CACHE.values()
    assert train_step._cache_size() == 1  # compiled once for both seeds
    train_mod._STEP_CACHE.clear()
    fresh = train(config(train_corpus, tmp_path / "s1b", steps=3, seed=1), log=lambda s: None)
    assert shared.losses == fresh.losses
    train(config(train_corpus, tmp_path / "lr", steps=3, learning_rate=1e-3), log=lambda s: None)
    assert len(train_mod._STEP_CACHE) == 1  # the rate is a value of the state (issue 46)
    train(config(train_corpus, tmp_path / "cl", steps=3, clip=0.5), log=lambda s: None)
    assert len(train_mod._STEP_CACHE) == 2


def test_sharded_runs_agree_with_single_device(train_corpus, tmp_path, monkeypatch):
    # The 8 host devices of tests/conftest.py, also on a GPU machine (JAX_PLATFORMS=cuda,cpu).
    from sage_train.model import sharding

    cpus = jax.devices("cpu")
    assert len(cpus) == 8
    monkeypatch.setattr(sharding, "mesh_devices", lambda: cpus)
    runs = {mode: train(config(train_corpus, tmp_path / mode, sharding=mode, steps=4),
                        log=lambda s: None)
            for mode in ("none", "dp", "fsdp")}
    for mode in ("dp", "fsdp"):
        np.testing.assert_allclose(runs[mode].losses, runs["none"].losses, rtol=2e-5)


def test_embedding_damper_matches_reference():
    """The H_t the trainer records is SAGE's own (checked against the float64 oracle)."""
    rng = np.random.default_rng(0)
    params = {"embed": {"embedding": jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)},
              "norm": {"scale": jnp.ones(6)}}
    tx = sage_optax.make_optimizer("sage-hybrid", 1e-3)
    state = tx.init(params)
    oracle = ref.SageRef((20, 6), vocab_axis=0, weight_decay=0.01)
    theta = np.asarray(params["embed"]["embedding"], np.float64)
    for _ in range(4):
        g = {"embed": {"embedding": jnp.asarray(rng.standard_normal((20, 6)), jnp.float32)},
             "norm": {"scale": jnp.asarray(rng.standard_normal(6), jnp.float32)}}
        _, state = tx.update(g, state, params)
        theta = oracle.step(theta, np.asarray(g["embed"]["embedding"]), 1e-3)
        h = embedding_damper(state, g)
        np.testing.assert_allclose(np.asarray(h), oracle.last_H, rtol=1e-5)


def test_damper_recorder_is_bounded(tmp_path):
    rec = DamperRecorder(tmp_path / "h.npz", every=1, max_records=8)
    for step in range(1, 101):
        rec.add(step, np.full(3, step, np.float32))
    assert len(rec.rows) <= 8
    steps = np.asarray(rec.steps)
    assert steps[-1] >= 64 and np.all(np.diff(steps) == rec.every)  # spans the run uniformly
    rec.save()
    again = DamperRecorder(tmp_path / "h.npz", every=1, max_records=8)
    assert again.steps == rec.steps and again.every == rec.every


def test_cli_trains_and_saves_a_loss_curve(train_corpus, tmp_path, capsys):
    code = main(["--model", "tiny", "--optimizer", "sage-hybrid", "--steps", "4",
                 "--batch-size", "8", "--seq-len", "32", "--eval-every", "4",
                 "--eval-batches", "2", "--data", str(train_corpus), "--run-dir", str(tmp_path),
                 "--no-progress"])
    assert code == 0
    out = capsys.readouterr().out
    assert "test ppl" in out and "tokens/s" in out and "sage-hybrid" in out
    assert (tmp_path / "tiny-loss.png").stat().st_size > 1000


@pytest.mark.parametrize("schedule,mid,end", [("cosine", 0.55, 0.1), ("linear", 0.55, 0.1),
                                              ("constant", 1.0, 1.0)])
def test_schedules(schedule, mid, end):
    """Linear warmup over 10% of the steps, then the chosen decay to final_lr_frac."""
    from sage_train.run.steps import lr_schedule

    f = lr_schedule(TrainConfig(steps=100, schedule=schedule, learning_rate=2.0))
    assert float(f(0)) == 0.0 and float(f(5)) == pytest.approx(1.0)
    assert float(f(10)) == pytest.approx(2.0)
    assert float(f(55)) == pytest.approx(2.0 * mid, rel=1e-3)
    assert float(f(100)) == pytest.approx(2.0 * end, rel=1e-5)
    with pytest.raises(ValueError, match="schedule"):
        lr_schedule(TrainConfig(schedule="step"))


def test_tokens_per_s_excludes_a_slow_checkpoint(train_corpus, tmp_path, monkeypatch):
    """Each save takes 1000 s on the trainer's clock: neither metrics.jsonl nor the result
    count them, and the two report the same tokens/s (the final table prints the result)."""
    from sage_train.run import loop as train_mod
    from sage_train.store.checkpoints import Checkpoints

    offset = [0.0]
    real_clock, real_save = train_mod._clock, Checkpoints.save
    monkeypatch.setattr(train_mod, "_clock", lambda: real_clock() + offset[0])

    def slow_save(self, *args, **kwargs):
        real_save(self, *args, **kwargs)
        offset[0] += 1000.0

    monkeypatch.setattr(Checkpoints, "save", slow_save)
    result = train(config(train_corpus, tmp_path / "run", checkpoint_every=2, log_every=2),
                   log=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert offset[0] == 4000.0  # four saves happened, after steps 2, 4, 6 and 8
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert rows[-1]["elapsed_s"] < 1000.0  # no save in it
    assert rows[-1]["tokens_per_s"] == result.tokens_per_s > 0
    assert rows[-1]["tokens_per_s"] == pytest.approx(7 * 8 * 32 / rows[-1]["elapsed_s"])


def test_tokens_per_s_excludes_slow_h_t_records(train_corpus, tmp_path, monkeypatch):
    """Recording H_t (a host-side rewrite of damper_h.npz) takes 1000 s a row on the
    trainer's clock: the tokens/s clock does not count it."""
    from sage_train.run import loop as train_mod

    offset = [0.0]
    real_clock, real_add = train_mod._clock, DamperRecorder.add
    monkeypatch.setattr(train_mod, "_clock", lambda: real_clock() + offset[0])

    def slow_add(self, *args, **kwargs):
        real_add(self, *args, **kwargs)
        offset[0] += 1000.0

    monkeypatch.setattr(DamperRecorder, "add", slow_add)
    result = train(config(train_corpus, tmp_path / "run", log_every=2, checkpoint_every=8,
                          eval_every=8), log=lambda s: None)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert offset[0] == 4000.0  # H_t recorded after steps 2, 4, 6 and 8
    assert list(np.load(tmp_path / "run" / "damper_h.npz")["steps"]) == [2, 4, 6, 8]
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert rows[-1]["elapsed_s"] < 1000.0
    assert rows[-1]["tokens_per_s"] == result.tokens_per_s > 0


def test_losses_stay_on_the_device_between_log_rows(train_corpus, tmp_path, monkeypatch):
    """One host fetch per logging interval (plus the first, compiling, step), each bringing
    every loss of its interval: the losses are those of a run that logs every step."""
    from sage_train.run import loop as train_mod

    fetched: list[int] = []
    real_fetch = train_mod.fetch

    def counting_fetch(tree):
        fetched.append(len(tree))
        return real_fetch(tree)

    every_step = train(config(train_corpus, tmp_path / "each"), log=lambda s: None)
    monkeypatch.setattr(train_mod, "fetch", counting_fetch)
    result = train(config(train_corpus, tmp_path / "run", log_every=4, checkpoint_every=8,
                          eval_every=8), log=lambda s: None)
    assert fetched == [1, 3, 4]  # step 1; steps 2-4; steps 5-8
    assert result.losses == every_step.losses
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 8]


def test_nan_stops_within_one_logging_interval(train_corpus, tmp_path):
    """Logging every 4 steps, a run that diverges stops at the first row after the NaN,
    names the first non-finite step, and keeps only finite checkpoints."""
    import math

    cfg = config(train_corpus, tmp_path / "nan", optimizer="lion", learning_rate=1e30, clip=0.0,
                 log_every=4, checkpoint_every=4, eval_every=100, steps=12)
    result = train(cfg, log=lambda s: None)
    assert result.stopped_reason is not None
    assert all(math.isfinite(x) for x in result.losses)
    assert result.steps_done < 12
    if result.stopped_reason.startswith("loss became"):
        assert f"at step {result.steps_done + 1}:" in result.stopped_reason


def test_bfloat16_run_trains_with_float32_state(train_corpus, tmp_path):
    """--dtype bfloat16: the loss is finite and falls; parameters and optimizer state stay
    float32 (checked in the checkpoint)."""
    import orbax.checkpoint as ocp

    result = train(config(train_corpus, tmp_path / "bf16", dtype="bfloat16", steps=8,
                          learning_rate=1e-2, layers="scan"), log=lambda s: None)
    assert result.stopped_reason is None and all(np.isfinite(result.losses))
    assert result.losses[-1] < result.losses[0] - 0.3
    settings = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert settings["dtype"] == "bfloat16" and settings["layers"] == "scan"
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        saved = ck.restore(tmp_path / "bf16" / "checkpoints" / "8")
    floats = {np.asarray(x).dtype for x in jax.tree.leaves(saved)
              if jnp.issubdtype(np.asarray(x).dtype, jnp.floating)}
    assert floats == {np.dtype(np.float32)}


def test_peak_memory_is_the_highest_over_the_local_devices(monkeypatch):
    """peak_memory_bytes: the largest allocator peak over the process's local devices;
    None where no device reports memory statistics (the CPU)."""
    from sage_train.run import loop as train_mod

    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

    devices = [Device({"peak_bytes_in_use": 5, "bytes_in_use": 50}),
               Device({"peak_bytes_in_use": 9}), Device(None)]
    monkeypatch.setattr(jax, "local_devices", lambda: devices)
    assert train_mod.peak_memory_bytes() == 9
    monkeypatch.setattr(jax, "local_devices", lambda: [Device(None), Device({})])
    assert train_mod.peak_memory_bytes() is None
