"""Runs that never lie about their history: NaN stops, recorded settings, the lock, failed
saves, verified checkpoints with fallback, history across restarts, and the CLI's checks.

Every run is the tiny model on a few standard-library modules (one compiled step shared by
the tests of a process); the kill during a save and the second process of the lock test
are real subprocesses.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from train_helpers import config, quiet  # noqa: E402

from sage_train.cli import build_parser, main  # noqa: E402
from sage_train.job.errors import CheckpointError, ConfigError, RunDirError  # noqa: E402
from sage_train.run.train import TrainConfig, run_losses, train  # noqa: E402
from sage_train.store import rundir  # noqa: E402
from sage_train.store.checkpoints import MANIFEST, Checkpoints  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("token_cache")


@pytest.fixture(scope="module")
def full_losses(train_corpus, tmp_path_factory):
    """The losses of an uninterrupted 8-step run (the reference for every resumed one)."""
    return quiet(config(train_corpus, tmp_path_factory.mktemp("full") / "run"))[0].losses


def metric_steps(run_dir):
    return [r["step"] for r in rundir.iter_metrics(run_dir)]


def saved_arrays(path):
    import orbax.checkpoint as ocp

    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as ck:
        import jax

        return [np.asarray(x) for x in jax.tree.leaves(ck.restore(path))]


# ---------------------------------------------------------------------------
# 1. NaN/Inf stops
# ---------------------------------------------------------------------------


def test_nan_stop_never_saves_a_nonfinite_state(train_corpus, tmp_path):
    """lr 1e30: the parameters turn NaN while the loss is still finite. No checkpoint may
    hold them; the message names the newest finite checkpoint; a rerun stops the same way."""
    cfg = config(train_corpus, tmp_path / "nan", optimizer="lion", learning_rate=1e30, clip=0.0,
                 checkpoint_every=1, steps=6)
    result, messages = quiet(cfg)
    assert result.stopped_reason is not None and "NaN/Inf" in result.stopped_reason
    ckpts = Checkpoints(tmp_path / "nan" / "checkpoints")
    steps = ckpts.steps()
    assert steps, "the finite steps before the NaN were checkpointed"
    for step in steps:
        assert all(np.all(np.isfinite(a)) for a in saved_arrays(ckpts.path(step)) if
                   np.issubdtype(a.dtype, np.floating)), step
    assert f"newest finite checkpoint is step {steps[0]}" in result.stopped_reason
    assert str(ckpts.path(steps[0])) in result.stopped_reason
    again, messages = quiet(cfg)
    assert f"resumed {tmp_path / 'nan'} at step {steps[0]}" in messages
    assert again.stopped_reason == result.stopped_reason
    assert Checkpoints(tmp_path / "nan" / "checkpoints").steps() == steps


def test_nan_stop_without_checkpoint_says_so(train_corpus, tmp_path):
    cfg = config(train_corpus, tmp_path / "nan", optimizer="lion", learning_rate=1e30, clip=0.0,
                 checkpoint_every=100, steps=6)
    result, _ = quiet(cfg)
    assert "there is no finite checkpoint: a rerun starts from step 0" in result.stopped_reason
    assert "None" not in result.stopped_reason
    assert Checkpoints(tmp_path / "nan" / "checkpoints").steps() == []


# ---------------------------------------------------------------------------
# 2. recorded settings
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("change", [
    {"learning_rate": 1e-3}, {"steps": 12}, {"batch_size": 4}, {"seq_len": 16},
    {"seed": 1}, {"warmup_frac": 0.2}, {"clip": 0.5}, {"optimizer": "adamw"},
    {"model": "small"}, {"schedule": "linear"}, {"eval_batches": 3},
    {"layers": "scan"}, {"dtype": "bfloat16"}, {"param_dtype": "bfloat16"},
    {"sinkgd_kernel": "pallas"},
])
def test_other_settings_are_refused_before_anything_changes(train_corpus, tmp_path, change):
    run = tmp_path / "run"
    run.mkdir()
    settings = dataclasses.asdict(config(train_corpus, run)) | {"learning_rate": 2e-3,
                                                          "data": str(train_corpus)}
    (run / "config.json").write_text(json.dumps(settings))
    before = (run / "config.json").read_bytes()
    with pytest.raises(RunDirError, match="other settings") as e:
        quiet(config(train_corpus, run, **change))
    (field, value), = change.items()
    assert f"{field} " in str(e.value) and repr(value) in str(e.value)
    assert "--allow-config-change" in str(e.value)
    assert (run / "config.json").read_bytes() == before
    assert sorted(p.name for p in run.iterdir()) == [".lock", "config.json"]


def test_loss_chunk_reaches_the_loss_and_is_recorded(
        train_corpus, tmp_path, monkeypatch, full_losses):
    """--loss-chunk auto with its thresholds lowered to this run's size: the loss is chunked
    (64 tokens of 256), recorded resolved in config.json, the losses are the unchunked
    run's; a rerun with another chunk is refused."""
    from sage_train.model import llama as model_mod
    from sage_train.run import config as train_mod

    monkeypatch.setattr(train_mod, "LOSS_CHUNK_AUTO_BYTES", 1 << 18)
    monkeypatch.setattr(train_mod, "LOSS_CHUNK_TARGET_BYTES", 1 << 18)  # 64 x 1024 x 4 B
    chunks: list[int] = []
    real = model_mod.chunked_cross_entropy

    def spy(x, w, targets, chunk, dtype=None):
        chunks.append(chunk)
        return real(x, w, targets, chunk, dtype)

    monkeypatch.setattr(model_mod, "chunked_cross_entropy", spy)
    run = tmp_path / "run"
    result, _ = quiet(config(train_corpus, run), stop_after=2)
    assert chunks == [64]  # traced once, in the train step
    np.testing.assert_allclose(result.losses, full_losses[:2], rtol=1e-5)
    settings = json.loads((run / "config.json").read_text())
    assert settings["loss_chunk"] == 64
    with pytest.raises(RunDirError, match="loss_chunk 64 -> 0"):
        quiet(config(train_corpus, run, loss_chunk=0))


def test_allowed_change_is_a_new_segment_and_steps_below_checkpoint_fail(train_corpus, tmp_path):
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=4)
    history = [json.loads(x) for x in (run / rundir.HISTORY).read_text().splitlines()]
    assert len(history) == 1 and history[0]["start_step"] == 0
    first = history[0]["settings"]
    assert first["learning_rate"] == 2e-3 and first["data"] == str(train_corpus)
    assert len(first["data_fingerprint"]) == 16
    same, _ = quiet(config(train_corpus, run, learning_rate=2e-3), stop_after=5)  # = the default
    assert same.steps_done == 5
    result, messages = quiet(config(train_corpus, run, seed=3), allow_config_change=True)
    assert result.steps_done == 8 and result.start_step == 5
    assert any("settings changed at step 5: seed 0 -> 3" in m for m in messages)
    history = [json.loads(x) for x in (run / rundir.HISTORY).read_text().splitlines()]
    assert [h["start_step"] for h in history] == [0, 4, 5]
    assert history[0]["settings"] == first and history[2]["changed"] == {"seed": [0, 3]}
    assert json.loads((run / "config.json").read_text())["seed"] == 3
    config_before = (run / "config.json").read_bytes()
    with pytest.raises(RunDirError, match=r"steps=6 is below the newest checkpoint .*step 8"):
        quiet(config(train_corpus, run, seed=3, steps=6), allow_config_change=True)
    assert (run / "config.json").read_bytes() == config_before
    done, messages = quiet(config(train_corpus, run, seed=3))
    assert done.steps_done == 8 and done.losses == [] and "nothing to train" in messages[-1]


def test_changed_data_under_the_same_path_is_refused(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 1024, 20_000).astype(np.uint16)
    data = tmp_path / "tokens.u16"
    tokens.tofile(data)
    cfg = config(None, tmp_path / "run", data=str(data))
    quiet(cfg, stop_after=2)
    tokens[100] += 1
    tokens.tofile(data)
    with pytest.raises(RunDirError, match="data_fingerprint"):
        quiet(cfg)


def test_a_change_between_the_sampled_pieces_is_refused(tmp_path):
    """Tokens 4096-6096 of 500,000 lie between the pieces ``data_fingerprint`` samples."""
    tokens = np.random.default_rng(1).integers(0, 1024, 500_000).astype(np.uint16)
    data = tmp_path / "tokens.u16"
    tokens.tofile(data)
    cfg = config(None, tmp_path / "run", data=str(data), steps=4, checkpoint_every=2,
                 eval_every=2)
    quiet(cfg, stop_after=2)
    from sage_train.data import pipeline as data_lib

    before = data_lib.load_data(str(data), vocab_size=1024)
    sampled, full = data_lib.fingerprint(before), data_lib.content_hash(before)
    tokens[4096:6096] = (tokens[4096:6096] + 1) % 1024
    tokens.tofile(data)
    after = data_lib.load_data(str(data), vocab_size=1024)
    assert data_lib.fingerprint(after) == sampled  # the sampled pieces cannot see it
    assert data_lib.content_hash(after) != full
    with pytest.raises(RunDirError, match="data_sha256") as e:
        quiet(cfg)
    assert "tokens.u16" in str(e.value) and "\n" not in str(e.value)
    result, _ = quiet(cfg, allow_config_change=True)
    assert result.start_step == 2


def test_the_content_hash_is_cached_by_size_and_times(tmp_path, monkeypatch):
    from sage_train.data import pipeline as data_lib

    path = tmp_path / "tokens.u16"
    np.arange(5000, dtype=np.uint16).tofile(path)
    first = data_lib.file_sha256(path)
    reads = []
    real_open = open
    monkeypatch.setattr("builtins.open", lambda f, *a, **k: (reads.append(f), real_open(
        f, *a, **k))[1])
    assert data_lib.file_sha256(path) == first and str(path) not in map(str, reads)
    monkeypatch.undo()
    raw = bytearray(path.read_bytes())
    raw[7000] ^= 1
    stat = path.stat()
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # the old mtime, a new ctime
    assert data_lib.file_sha256(path) != first


def test_rotation_keeps_the_last_verified_checkpoint_behind_an_unverified_one(tmp_path):
    import jax.numpy as jnp

    ckpts = Checkpoints(tmp_path / "checkpoints", keep=2, log=lambda m: None)
    ckpts.prepare()
    state = {"w": jnp.arange(4.0)}
    for step in (4, 8):
        ckpts.save(step, state, {})
    (ckpts.path(8) / MANIFEST).unlink()  # resumed from an unverified newest checkpoint
    ckpts.save(12, state, {})
    assert ckpts.steps() == [12, 8, 4]  # 4: the last verified one before 12
    ckpts.save(16, state, {})
    assert ckpts.steps() == [16, 12]
    ckpts.close()


def test_start_up_removes_a_manifest_write_killed_before_its_rename(tmp_path):
    import jax.numpy as jnp

    ckpts = Checkpoints(tmp_path / "checkpoints", keep=2, log=lambda m: None)
    ckpts.prepare()
    ckpts.save(4, {"w": jnp.arange(4.0)}, {})
    ckpts.close()
    stray = ckpts.path(4) / f".{MANIFEST}.tmp-12345"  # SIGKILL between write and rename
    stray.write_text("{")
    messages: list[str] = []
    Checkpoints(tmp_path / "checkpoints", log=messages.append).prepare()
    assert not stray.exists() and (ckpts.path(4) / MANIFEST).exists()
    assert any("interrupted" in m for m in messages)


# ---------------------------------------------------------------------------
# 3. the lock
# ---------------------------------------------------------------------------

HOLD_LOCK = """
import pathlib, sys
from sage_train.store.rundir import RunLock
RunLock(pathlib.Path(sys.argv[1])).acquire()
print("locked", flush=True)
sys.stdin.read()
"""


def test_a_second_process_is_refused_and_a_stale_lock_taken_over(train_corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], cwd=ROOT,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=f"in use by process {holder.pid} on "):
            quiet(config(train_corpus, run))
        assert not (run / "config.json").exists()
    finally:
        holder.kill()  # SIGKILL: no chance to release; the kernel drops the flock
        holder.wait()
    result, messages = quiet(config(train_corpus, run, steps=8), stop_after=1)
    assert result.steps_done == 1
    assert any(f"stale lock of process {holder.pid}" in m and "no longer running" in m
               for m in messages)
    lock = rundir.RunLock(run).acquire()  # released by the run: free, and not stale
    assert lock.stale is None
    lock.release()


# ---------------------------------------------------------------------------
# 4. failing saves
# ---------------------------------------------------------------------------


def test_checkpoints_that_is_a_file_is_refused_and_history_kept(train_corpus, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 7.0}\n')
    with pytest.raises(RunDirError, match="checkpoints exists and is not a directory"):
        quiet(config(train_corpus, run))
    assert (run / "metrics.jsonl").read_text() == '{"step": 1, "loss": 7.0}\n'
    assert (run / "checkpoints").read_text() == "not a directory"


def test_a_failed_save_raises_at_once_and_keeps_history(train_corpus, tmp_path, monkeypatch,
                                                         full_losses):
    """The checkpoints directory is replaced by a file during the run: the save of step 8
    fails (a real orbax failure), the error names it, no thread is left behind, and the
    rerun resumes from step 4 with the same losses."""
    run = tmp_path / "run"
    save = Checkpoints.save

    def sabotaged(self, step, state, progress):
        if step == 8:
            os.replace(self.root, run / "moved")
            self.root.write_text("in the way")
        return save(self, step, state, progress)

    monkeypatch.setattr(Checkpoints, "save", sabotaged)
    threads = set(threading.enumerate())
    with pytest.raises(CheckpointError, match=r"could not save the checkpoint of step 8 to "
                       r".*Not a directory") as e:
        quiet(config(train_corpus, run))
    assert "\n" not in str(e.value)
    # Nothing is left waiting in the background: every thread started by the run ends by
    # itself.  (orbax closes its event loop with ``executor.shutdown(wait=False)``, so an idle
    # ``asyncio_N`` worker may still be exiting when the error arrives: it is joined, not
    # excused; a thread waiting on a signal that never comes would not end.)
    for thread in set(threading.enumerate()) - threads:
        thread.join(timeout=30)
    assert not [t.name for t in set(threading.enumerate()) - threads if t.is_alive()]
    monkeypatch.undo()
    assert metric_steps(run) == list(range(1, 9))
    (run / "checkpoints").unlink()
    os.replace(run / "moved", run / "checkpoints")
    result, messages = quiet(config(train_corpus, run))
    assert f"resumed {run} at step 4" in messages
    assert result.losses == full_losses[4:]
    assert metric_steps(run) == list(range(1, 9))


# ---------------------------------------------------------------------------
# 5. verified restore with fallback; 6. history across restarts (kill during a save)
# ---------------------------------------------------------------------------

KILLED_WRITER = """
import json, os, pathlib, sys
import jax
jax.config.update("jax_compilation_cache_dir", sys.argv[3])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
from orbax.checkpoint._src.path import async_path
from sage_train.run.train import TrainConfig, train

rename = async_path.rename

async def killed_before_rename(src, dst):
    if pathlib.Path(dst).name == sys.argv[2]:
        os._exit(9)  # killed with the checkpoint written but not yet committed
    return await rename(src, dst)

async_path.rename = killed_before_rename
train(TrainConfig(**json.loads(sys.argv[1])), log=lambda s: None)
"""


def test_kill_during_a_save_resumes_from_the_last_complete_checkpoint(train_corpus, tmp_path,
                                                                       full_losses):
    run = tmp_path / "run"
    cfg = config(train_corpus, run)
    jax_cache = os.environ.get("SAGE_TEST_JAX_CACHE") or str(
        pathlib.Path(__import__("tempfile").gettempdir()) / "sage-test-jax-cache")
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_WRITER, json.dumps(dataclasses.asdict(cfg)), "8",
         jax_cache], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 9, proc.stderr[-2000:]
    leftovers = [p.name for p in (run / "checkpoints").iterdir()]
    assert "4" in leftovers and "8" not in leftovers
    assert any(".orbax-checkpoint-tmp" in name for name in leftovers)
    assert metric_steps(run) == list(range(1, 9))  # rows 5..8 were written before the kill
    result, messages = quiet(cfg)
    assert result.start_step == 4 and result.losses == full_losses[4:]
    assert any("a checkpoint write that was interrupted" in m for m in messages)
    assert any("stale lock of process" in m for m in messages)
    rows = list(rundir.iter_metrics(run))
    assert [r["step"] for r in rows] == list(range(1, 9))  # each step once
    assert [r["loss"] for r in rows] == full_losses
    superseded = [json.loads(x) for x in (run / rundir.SUPERSEDED).read_text().splitlines()]
    assert [r["step"] for r in superseded] == [5, 6, 7, 8]
    assert {r["superseded_at_step"] for r in superseded} == {4}
    with np.load(run / "damper_h.npz") as h:
        assert list(h["steps"]) == [2, 4, 6, 8]


@pytest.mark.parametrize("damage", ["flip", "truncate", "stray"])
def test_damaged_latest_checkpoint_falls_back(train_corpus, tmp_path, damage, full_losses):
    run = tmp_path / "run"
    cfg = config(train_corpus, run)
    quiet(cfg)
    ckpts = Checkpoints(run / "checkpoints")
    assert ckpts.steps() == [8, 4]
    files = [p for p in ckpts.path(8).rglob("*") if p.is_file() and p.name != MANIFEST]
    biggest = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(biggest.read_bytes())
    if damage == "flip":
        for i in range(64):
            data[len(data) // 2 + i] ^= 0xFF
        biggest.write_bytes(bytes(data))
    elif damage == "truncate":
        biggest.write_bytes(bytes(data[: len(data) // 2]))
    else:
        (run / "checkpoints" / "99").mkdir()
    result, messages = quiet(cfg)
    unusable = [m for m in messages if "unusable" in m]
    assert len(unusable) == 1 and "\n" not in unusable[0]
    bad = 99 if damage == "stray" else 8
    assert f"checkpoint of step {bad} is unusable" in unusable[0]
    assert (run / "checkpoints" / f"{bad}.unusable").is_dir()
    assert str(run / "checkpoints" / f"{bad}.unusable") in unusable[0]
    if damage == "stray":
        assert result.start_step == 8 and result.losses == []
    else:
        assert "checksum" in unusable[0] or "bytes" in unusable[0]
        assert result.start_step == 4 and result.losses == full_losses[4:]
        assert ckpts.steps() == [8, 4]


def test_damaged_history_is_repaired_and_continues(train_corpus, tmp_path, full_losses):
    """A metrics line cut short, rows past the checkpoint, a damaged H_t file: the resume
    repairs them; elapsed time, tokens/s and the loss curve continue over the whole run."""
    run = tmp_path / "run"
    cfg = config(train_corpus, run)
    first, _ = quiet(cfg, stop_after=3)
    rows = list(rundir.iter_metrics(run))
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({**rows[-1], "step": 4}) + "\n" + '{"step": 5, "lo')
    (run / "damper_h.npz").write_bytes(b"PK\x03\x04 cut short")
    second, messages = quiet(cfg)
    assert second.start_step == 3 and second.losses == full_losses[3:]
    rows = list(rundir.iter_metrics(run))
    assert [r["step"] for r in rows] == list(range(1, 9))
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 8 and all(json.loads(x) for x in lines)
    superseded = (run / rundir.SUPERSEDED).read_text()
    assert '"damaged_line": "{\\"step\\": 5, \\"lo"' in superseded
    assert any("H_t record" in m and "damaged" in m for m in messages)
    assert (run / "damper_h.damaged.npz").exists()
    with np.load(run / "damper_h.npz") as h:
        assert list(h["steps"]) == [4, 6, 8]
    elapsed = [r["elapsed_s"] for r in rows]
    assert elapsed == sorted(elapsed) and rows[3]["elapsed_s"] >= rows[2]["elapsed_s"] > 0
    assert rows[3]["tokens_per_s"] > 0  # the first step after the resume continues the rate
    steps, losses = run_losses(second)
    assert steps == list(range(1, 9)) and losses == first.losses + second.losses


def test_resume_metrics_keeps_each_step_once(tmp_path):
    lines = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.5}, {"step": 2, "loss": 2.0},
             {"step": 3, "loss": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = rundir.resume_metrics(tmp_path, 2)
    assert rows == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]
    moved = [json.loads(x) for x in (tmp_path / rundir.SUPERSEDED).read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in moved] == [(2, 2.5), (3, 1.0)]
    before = (tmp_path / "metrics.jsonl").read_bytes()
    assert rundir.resume_metrics(tmp_path, 2) == rows  # already clean: nothing rewritten
    assert (tmp_path / "metrics.jsonl").read_bytes() == before


# ---------------------------------------------------------------------------
# 7. the command line
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("args,option", [
    (["--lr", "-1"], "--lr"), (["--lr", "0"], "--lr"), (["--lr", "nan"], "--lr"),
    (["--steps", "0"], "--steps"), (["--steps", "-5"], "--steps"),
    (["--steps", "2.5"], "--steps"), (["--warmup-frac", "2"], "--warmup-frac"),
    (["--warmup-frac", "1"], "--warmup-frac"), (["--final-lr-frac", "-0.1"], "--final-lr-frac"),
    (["--batch-size", "0"], "--batch-size"), (["--seq-len", "0"], "--seq-len"),
    (["--eval-every", "0"], "--eval-every"), (["--eval-batches", "0"], "--eval-batches"),
    (["--checkpoint-every", "0"], "--checkpoint-every"), (["--log-every", "0"], "--log-every"),
    (["--record-h-every", "0"], "--record-h-every"), (["--clip", "-1"], "--clip"),
    (["--seed", "-1"], "--seed"), (["--token-dtype", "int8"], "--token-dtype"),
    (["--loss-chunk", "-1"], "--loss-chunk"), (["--loss-chunk", "1.5"], "--loss-chunk"),
])
def test_cli_refuses_bad_numbers_in_one_line(tmp_path, capsys, args, option):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--run-dir", str(tmp_path / "runs"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_check_config_refuses_what_the_cli_refuses():
    with pytest.raises(ConfigError, match="learning_rate must be a number > 0"):
        train(TrainConfig(learning_rate=-1.0, run_dir="/nonexistent/never-created"))
    with pytest.raises(ConfigError, match="warmup_frac must be"):
        train(TrainConfig(warmup_frac=2.0, run_dir="/nonexistent/never-created"))
    with pytest.raises(ConfigError, match=r"loss_chunk must be an integer >= 0 .*-8"):
        train(TrainConfig(loss_chunk=-8, run_dir="/nonexistent/never-created"))
    assert not pathlib.Path("/nonexistent").exists()


def test_cli_help_shows_a_default_for_every_option():
    parser = build_parser()
    text = parser.format_help()
    for action in parser._actions:
        if "--help" in action.option_strings:
            continue
        assert action.help, action.option_strings
        assert "(default" in parser._get_formatter()._expand_help(action), action.option_strings
    assert "--token-dtype" in text and "--allow-config-change" in text


def test_cli_data_and_run_dir_errors_are_one_line(tmp_path, capsys):
    base = ["--model", "tiny", "--steps", "8", "--batch-size", "8", "--seq-len", "32",
            "--eval-every", "4", "--eval-batches", "2", "--checkpoint-every", "4",
            "--no-progress"]
    runs = tmp_path / "runs"
    assert main([*base, "--data", str(tmp_path / "missing"), "--run-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist" in err and "Traceback" not in err
    tokens = tmp_path / "t.bin"
    np.random.default_rng(0).integers(0, 1024, 20_000).astype(np.uint16).tofile(tokens)
    assert main([*base, "--data", str(tokens), "--run-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--token-dtype uint16" in err
    assert main([*base, "--data", str(tokens), "--token-dtype", "uint16",
                 "--run-dir", str(runs)]) == 0
    capsys.readouterr()
    assert main([*base, "--data", str(tokens), "--token-dtype", "uint16", "--lr", "0.01",
                 "--run-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "learning_rate 0.002 -> 0.01" in err
    assert "--allow-config-change" in err
