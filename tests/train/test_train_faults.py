"""Faults a run meets in the wild, each handled in one line without losing work.

Lost settings files, checkpoints that all fail verification, allowed changes that carry the
progress over (``--layers``, ``--optimizer``) or are refused (``--model``), bad data and
inputs, preemption (SIGTERM/SIGUSR1) and Ctrl-C, a full disk or a read-only run directory
during any write, a loss curve that cannot be written, and several ``--optimizer`` runs
checked before any trains.  Every run is the tiny model on a few standard-library modules.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import pathlib

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from train_helpers import config, quiet  # noqa: E402

from sage_train.cli import build_parser, main  # noqa: E402
from sage_train.data import pipeline as data_lib  # noqa: E402
from sage_train.job.errors import ConfigError, DataError, RunDirError, RunFileError  # noqa: E402
from sage_train.job.signals import INTERRUPTED, PREEMPTED, StopSignals  # noqa: E402
from sage_train.run.train import TrainConfig, check_config, train  # noqa: E402
from sage_train.store import rundir  # noqa: E402
from sage_train.store.checkpoints import MANIFEST, Checkpoints  # noqa: E402

pytestmark = pytest.mark.usefixtures("token_cache")


@pytest.fixture(scope="module")
def full_losses(train_corpus, tmp_path_factory):
    """The losses of an uninterrupted 8-step run (the reference for every resumed one)."""
    return quiet(config(train_corpus, tmp_path_factory.mktemp("full") / "run"))[0].losses


def cli_base(corpus, runs, steps=8):
    return ["--model", "tiny", "--steps", str(steps), "--batch-size", "8", "--seq-len", "32",
            "--eval-every", "4", "--eval-batches", "2", "--checkpoint-every", "4",
            "--log-every", "1", "--record-h-every", "2", "--no-progress",
            "--data", str(corpus), "--run-dir", str(runs)]


def one_line(err):
    return err.count("\n") == 1 and "Traceback" not in err


def leftovers(run):
    return sorted(p.name for p in pathlib.Path(run).rglob("*") if ".tmp" in p.name)


# ---------------------------------------------------------------------------
# never start over silently
# ---------------------------------------------------------------------------


def test_lost_settings_are_read_from_the_checkpoint_and_other_ones_refused(
        train_corpus, tmp_path, full_losses):
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=4)
    (run / rundir.CONFIG).unlink()
    (run / rundir.HISTORY).unlink()
    for change in ({"learning_rate": 1e-3}, {"batch_size": 4}, {"steps": 12}):
        with pytest.raises(RunDirError, match="other settings"):
            quiet(config(train_corpus, run, **change))
    assert Checkpoints(run / "checkpoints").steps() == [4]
    result, messages = quiet(config(train_corpus, run))
    assert any("manifest of its checkpoint of step 4" in m for m in messages)
    assert result.start_step == 4 and result.losses == full_losses[4:]


def test_unknown_settings_are_refused_unless_the_change_is_allowed(train_corpus, tmp_path):
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=4)
    (run / rundir.CONFIG).unlink()
    (run / rundir.HISTORY).unlink()
    manifest = run / "checkpoints" / "4" / MANIFEST
    data = json.loads(manifest.read_text())
    del data["settings"]  # a checkpoint of a version that did not record them
    manifest.write_text(json.dumps(data))
    with pytest.raises(RunDirError, match="settings are unknown|they are unknown") as e:
        quiet(config(train_corpus, run, learning_rate=1e-3))
    assert "\n" not in str(e.value) and "--allow-config-change" in str(e.value)
    result, _ = quiet(config(train_corpus, run, learning_rate=1e-3), allow_config_change=True)
    assert result.start_step == 4


def corrupt_all(run):
    for step in Checkpoints(run / "checkpoints").steps():
        biggest = max((p for p in (run / "checkpoints" / str(step)).rglob("*")
                       if p.is_file() and p.name != MANIFEST), key=lambda p: p.stat().st_size)
        raw = bytearray(biggest.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        biggest.write_bytes(bytes(raw))


def test_checkpoints_that_all_fail_are_refused_unless_restart(train_corpus, tmp_path, capsys,
                                                             full_losses):
    runs = tmp_path / "runs"
    args = cli_base(train_corpus, runs, steps=12)
    assert main([*cli_base(train_corpus, runs)]) == 0
    run = runs / "tiny-sage-hybrid"
    corrupt_all(run)
    capsys.readouterr()
    assert main(args + ["--allow-config-change", "--tail-from", "8"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "step 8" in err and "step 4" in err and "--restart" in err
    assert Checkpoints(run / "checkpoints").steps() == [8, 4]  # nothing moved or lost
    assert "--restart" in build_parser().format_help()
    result, messages = quiet(config(train_corpus, run), restart=True)
    assert result.start_step == 0 and result.losses == full_losses
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "4", "4.unusable", "8", "8.unusable"]


# ---------------------------------------------------------------------------
# changes that keep the progress
# ---------------------------------------------------------------------------


def test_loop_to_scan_continues_from_the_same_parameters(train_corpus, tmp_path, full_losses):
    run = tmp_path / "run"
    quiet(config(train_corpus, run, layers="loop"), stop_after=4)
    result, messages = quiet(config(train_corpus, run, layers="scan"), allow_config_change=True)
    assert result.start_step == 4
    assert any("the parameters and the optimizer state" in m for m in messages)
    # the loss of step 5 is that of the parameters after step 4: the same numbers
    np.testing.assert_allclose(result.losses, full_losses[4:], rtol=2e-4)
    assert not any(p.name.endswith("unusable") for p in (run / "checkpoints").iterdir())
    back, _ = quiet(config(train_corpus, run, layers="loop", steps=10, tail_from=8),
                    allow_config_change=True)
    assert back.start_step == 8 and len(back.losses) == 2


def test_another_optimizer_keeps_the_parameters_with_a_fresh_state(train_corpus, tmp_path,
                                                                    full_losses):
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=4)
    result, messages = quiet(config(train_corpus, run, optimizer="adamw"),
                             allow_config_change=True)
    assert result.start_step == 4
    assert any("the optimizer state starts fresh" in m for m in messages)
    np.testing.assert_allclose(result.losses[0], full_losses[4], rtol=1e-5)


def test_another_model_size_is_refused_with_the_reason(train_corpus, tmp_path):
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=4)
    with pytest.raises(RunDirError, match="another model size") as e:
        quiet(config(train_corpus, run, model="small"), allow_config_change=True)
    assert "\n" not in str(e.value)
    assert Checkpoints(run / "checkpoints").steps() == [4]


# ---------------------------------------------------------------------------
# data and inputs
# ---------------------------------------------------------------------------


def test_empty_data_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--data", "", "--run-dir", str(tmp_path / "runs")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert one_line(err) and "argument --data" in err
    with pytest.raises(ConfigError, match="data must be"):
        check_config(TrainConfig(data=" "))
    with pytest.raises(ValueError, match="empty"):
        data_lib.load_data("", vocab_size=512)


@pytest.mark.parametrize("make", ["missing", "empty.npy", "empty.u16", "empty.txt"])
def test_a_refused_start_is_one_line_and_leaves_nothing_behind(tmp_path, capsys, make):
    data = tmp_path / ("gone.u16" if make == "missing" else make)
    if make != "missing":
        data.write_bytes(b"")
    runs = tmp_path / "out" / "runs"
    assert main(cli_base(data, runs)) == 2
    err = capsys.readouterr().err
    assert one_line(err) and str(data) in err
    assert not (tmp_path / "out").exists()  # no run directory, .lock or checkpoints/
    with pytest.raises(DataError):  # the library's train() too
        train(config(data, tmp_path / "lib" / "run"))
    assert not (tmp_path / "lib").exists()


def test_the_run_dir_is_never_part_of_the_corpus(train_corpus, tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    for p in train_corpus.iterdir():
        (work / p.name).write_text(p.read_text())
    monkeypatch.chdir(work)
    args = [*cli_base(".", "runs")]
    assert main(args) == 0
    capsys.readouterr()
    assert main(args) == 0  # the same command: the run is complete, its logs no data
    assert "is complete" in capsys.readouterr().out
    assert main([*args[:3], "12", *args[4:]] + ["--allow-config-change", "--tail-from", "8"]) == 0
    out = capsys.readouterr()
    assert "data_fingerprint" not in out.out + out.err
    docs = data_lib.read_text_source(work)
    assert len(docs) == len(list(train_corpus.iterdir()))


def test_a_token_cache_with_ids_beyond_the_vocabulary_is_named(train_corpus, tmp_path,
                                                               monkeypatch):
    from sage_train.model.shapes import get_model_config

    monkeypatch.setenv("SAGE_CACHE_DIR", str(tmp_path / "cache"))  # a cache of its own
    cfg = config(train_corpus, tmp_path / "run")
    vocab = get_model_config("tiny").vocab_size
    data_lib.load_data(cfg.data, vocab_size=vocab)
    [entry] = list((data_lib.cache_dir() / "tokens").iterdir())
    good = np.load(entry / "train.npy")
    bad = good.copy()
    bad[5] = vocab + 188
    np.save(entry / "train.npy", bad)
    # issue 33: the file no longer has its recorded checksum: the entry is rebuilt
    with pytest.warns(UserWarning, match="train.npy does not have the checksum"):
        rebuilt = data_lib.load_data(cfg.data, vocab_size=vocab)
    np.testing.assert_array_equal(rebuilt.train, good)
    # an entry published with such ids (its checksums agree): refused, naming the file
    np.save(entry / "train.npy", bad)
    import hashlib
    import json

    record = json.loads((entry / data_lib.INTEGRITY).read_text())
    record["files"]["train.npy"] = {
        "bytes": (entry / "train.npy").stat().st_size,
        "sha256": hashlib.sha256((entry / "train.npy").read_bytes()).hexdigest()}
    (entry / data_lib.INTEGRITY).write_text(json.dumps(record))
    with pytest.raises(DataError) as e:
        quiet(cfg)
    msg = str(e.value)
    assert "\n" not in msg and str(entry / "train.npy") in msg
    assert str(vocab + 188) in msg and f"vocab_size={vocab}" in msg


@pytest.mark.parametrize("args,option", [
    (["--seed", "4294967296"], "--seed"), (["--seed", "100000000000000000000"], "--seed"),
    (["--steps", "100000000000000000000"], "--steps"),
    (["--batch-size", "100000000000000000000"], "--batch-size"),
    (["--seq-len", "4294967296"], "--seq-len"),
    (["--eval-every", "100000000000000000000"], "--eval-every"),
    (["--checkpoint-every", "100000000000000000000"], "--checkpoint-every"),
    (["--h-max-records", "100000000000000000000"], "--h-max-records"),
    (["--loss-chunk", "100000000000000000000"], "--loss-chunk"),
])
def test_out_of_range_integers_are_one_line(tmp_path, capsys, args, option):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--run-dir", str(tmp_path / "runs"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert one_line(err) and f"argument {option}" in err
    assert not (tmp_path / "runs").exists()


def test_seed_beyond_32_bits_is_refused_not_wrapped():
    with pytest.raises(ConfigError, match="seed must be"):
        check_config(TrainConfig(seed=2**32))
    check_config(TrainConfig(seed=2**32 - 1))


# ---------------------------------------------------------------------------
# preemption and Ctrl-C
# ---------------------------------------------------------------------------


def after(n, name):
    """A ``stop`` callback that requests ``name`` from its ``n``-th poll on."""
    calls = []

    def stop():
        calls.append(1)
        return name if len(calls) >= n else None

    return stop


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_preemption_saves_the_step_reached_and_resumes_identically(
        train_corpus, tmp_path, full_losses, name):
    run = tmp_path / "run"
    cfg = config(train_corpus, run)
    result, messages = quiet(cfg, stop=after(7, name))  # the first poll is before step 1
    assert result.interrupted == name and result.steps_done == 6
    assert Checkpoints(run / "checkpoints").steps()[0] == 6  # newer than the periodic 4
    assert any(f"{name}: saved the checkpoint of step 6" in m for m in messages)
    again, _ = quiet(cfg)
    assert again.start_step == 6 and again.losses == full_losses[6:]
    assert [r["loss"] for r in rundir.iter_metrics(run)] == full_losses


def test_sigint_stops_between_steps_without_a_checkpoint(train_corpus, tmp_path, full_losses):
    run = tmp_path / "run"
    cfg = config(train_corpus, run)
    result, _ = quiet(cfg, stop=after(7, "SIGINT"))
    assert result.interrupted == "SIGINT"
    assert Checkpoints(run / "checkpoints").steps() == [4]
    again, _ = quiet(cfg)
    assert again.start_step == 4 and again.losses == full_losses[4:]


def test_stop_signals_are_flags_and_exit_codes_documented():
    import signal

    with StopSignals() as signals:
        assert signals() is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals() == "SIGTERM"
        os.kill(os.getpid(), signal.SIGUSR1)
        assert signals() == "SIGTERM"  # the first one counts
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    text = build_parser().format_help()
    assert f"{PREEMPTED} preempted" in text and f"{INTERRUPTED} interrupted" in text


# ---------------------------------------------------------------------------
# every file error is one line
# ---------------------------------------------------------------------------


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))  # a checkpoint file is larger
from sage_train.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_full_disk_during_a_checkpoint_is_one_line_and_the_last_one_resumes(tmp_path, capsys):
    """Orbax's threads print tracebacks when their writes fail: they go to orbax.log."""
    import subprocess
    import sys

    data = tmp_path / "tokens.u16"
    np.random.default_rng(0).integers(0, 1024, 200_000).astype(np.uint16).tofile(data)
    runs = tmp_path / "runs"
    assert main(cli_base(data, runs, steps=4)) == 0
    ckpts = runs / "tiny-sage-hybrid" / "checkpoints"
    assert Checkpoints(ckpts).steps() == [4]
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", FULL_DISK, *cli_base(data, runs), "--allow-config-change",
         "--tail-from", "4", "--tail", "constant"],
        capture_output=True, text=True, timeout=600, cwd=root,
        env={**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr  # one line: nothing from orbax's threads
    assert proc.stderr.startswith("sage-train: error: could not save the checkpoint of step 8")
    assert "orbax.log" in proc.stderr and "Traceback" in (ckpts / "orbax.log").read_text()
    assert Checkpoints(ckpts).steps() == [4] and not leftovers(ckpts)
    capsys.readouterr()
    assert main(cli_base(data, runs) + ["--allow-config-change", "--tail-from", "4",
                                        "--tail", "constant"]) == 0  # step 4 resumes
    assert "resum" in capsys.readouterr().out


def test_a_full_disk_while_h_t_is_written_is_one_line(train_corpus, tmp_path, monkeypatch,
                                                     capsys):
    from sage_train.run import diagnostics

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(diagnostics.np, "savez", full)
    runs = tmp_path / "runs"
    assert main(cli_base(train_corpus, runs)) == 1
    err = capsys.readouterr().err
    assert one_line(err) and "damper_h.npz" in err and "No space left on device" in err
    assert leftovers(runs) == []


@pytest.mark.parametrize("target", ["metrics.jsonl", "config.json", "config_history.jsonl",
                                    "sage_manifest.json"])
def test_a_read_only_run_dir_mid_run_is_one_line(train_corpus, tmp_path, monkeypatch, capsys,
                                                 target):
    runs = tmp_path / "runs"
    run = runs / "tiny-sage-hybrid"
    real_open = builtins.open
    real_replace = os.replace
    state = {"on": target in ("config.json", "config_history.jsonl")}

    def denied(path):
        name = pathlib.Path(os.fspath(path)).name
        return state["on"] and target in name

    def guarded_open(file, mode="r", *a, **k):
        if isinstance(file, str | os.PathLike) and any(c in mode for c in "wax") \
                and denied(file):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real_open(file, mode, *a, **k)

    def guarded_replace(src, dst, *a, **k):
        if denied(dst):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(dst))
        return real_replace(src, dst, *a, **k)

    save = Checkpoints.save

    def turn_read_only(self, step, st, progress):
        out = save(self, step, st, progress)
        state["on"] = True
        return out

    monkeypatch.setattr(builtins, "open", guarded_open)
    monkeypatch.setattr(os, "replace", guarded_replace)
    monkeypatch.setattr(Checkpoints, "save", turn_read_only)
    assert main(cli_base(train_corpus, runs)) in (1, 2)
    err = capsys.readouterr().err
    assert one_line(err), err
    assert target in err
    monkeypatch.undo()
    assert leftovers(run) == []
    if target == "sage_manifest.json":  # the failed save left no checkpoint behind
        assert Checkpoints(run / "checkpoints").steps() == [4]


def test_a_loss_curve_that_cannot_be_written_is_a_warning(train_corpus, tmp_path, monkeypatch,
                                                         capsys):
    from matplotlib.figure import Figure

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", full)
    runs = tmp_path / "runs"
    assert main(cli_base(train_corpus, runs)) == 0
    err = capsys.readouterr().err
    assert one_line(err) and "warning" in err and "tiny-loss.png" in err
    assert leftovers(runs) == [] and not (runs / "tiny-loss.png").exists()


def test_every_run_dir_is_checked_before_any_trains(train_corpus, tmp_path, capsys):
    runs = tmp_path / "runs"
    base = cli_base(train_corpus, runs)
    (runs / "tiny-adamw").mkdir(parents=True)
    with rundir.RunLock(runs / "tiny-adamw"):
        assert main([*base, "--optimizer", "sage-hybrid", "adamw"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "tiny-adamw" in err and "in use" in err
    assert not (runs / "tiny-sage-hybrid" / rundir.METRICS).exists()
    assert Checkpoints(runs / "tiny-sage-hybrid" / "checkpoints").steps() == []
    # recorded settings of the second run that differ: refused before the first trains
    assert main([*base, "--optimizer", "adamw"]) == 0
    capsys.readouterr()
    assert main([*base, "--optimizer", "sage-hybrid", "adamw", "--lr", "0.01"]) == 2
    err = capsys.readouterr().err
    assert one_line(err) and "tiny-adamw" in err and "other settings" in err
    assert not (runs / "tiny-sage-hybrid" / rundir.METRICS).exists()


def test_a_write_error_names_the_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "config.json"
    target.write_text("old")

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(RunFileError, match=r"cannot write .*config.json: No space left") as e:
        rundir.atomic_write_text(target, "new")
    assert "\n" not in str(e.value)
    assert target.read_text() == "old" and leftovers(tmp_path) == []
