"""``sage-repro sweep --together N``: several trainer processes at once on one device.

Runs trained together (three runs dealt to two processes: the first process trains two
in turn) give the same losses and test perplexities, to the last bit, as each run trained
in a process of its own; each trainer process gets its share of the device's memory; a
SIGTERM reaches every process; the option and the dry run's assumed speedup are refused in
one line where they do nothing; the GPU's measurement (:mod:`sage_repro.together_check`)
runs on the tiny model and compares by hand.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import signal
import subprocess
import sys

import pytest

from sage_repro import sweep, together_check

ROOT = pathlib.Path(__file__).resolve().parents[2]

TINY = ["--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
        "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
        "--checkpoint-every", "4", "--configs", "sage-hybrid", "--seeds", "0",
        "--lrs", "0.001", "0.002", "0.004"]


@pytest.fixture(autouse=True)
def session_compilation_cache(monkeypatch):
    """The trainers share the test session's compilation cache (conftest.py)."""
    import jax

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")


def _runs(out):
    """``{lr: (losses, eval ppls)}`` of a sweep's results.json."""
    data = json.loads((out / "results.json").read_text())
    return {run["lr"]: (run["losses"], run["evals"]["ppl"])
            for cell in data["lr_sweep"] for run in cell["runs"]}


def test_runs_together_equal_runs_alone_to_the_last_bit(tmp_path, capsys):
    """The GPU's measurement (sage_repro.together_check) on the tiny model: three runs each in
    a trainer process of its own, then the same three with --together 2."""
    check = tmp_path / "check"
    assert together_check.main([str(check), "--together", "2", "--baseline", "processes",
                                "--shared-cache", "--", *TINY, "--", "--sharding", "none"]) == 0
    printed = capsys.readouterr().out
    assert "training in trainer process 1 of 2 at once" in printed
    assert "training in trainer process 2 of 2 at once" in printed
    assert "runs: 3 started, 0 resumed, 0 skipped" in printed
    alone, together = check / "alone", check / "together"
    assert not (alone / "batch-jobs-1.json").exists()  # one process per run there
    # the first process trained the first and third runs, the second the second
    lanes = [json.loads((together / f"batch-jobs-{k}.json").read_text()) for k in (1, 2)]
    assert [len(jobs) for jobs in lanes] == [2, 1]
    assert ["lr0.002" in job["log"] for job in lanes[1]] == [True]
    a, t = _runs(alone), _runs(together)
    assert sorted(a) == sorted(t) == [0.001, 0.002, 0.004]
    for lr in a:
        assert len(a[lr][0]) == 4 and len(a[lr][1]) == 2
        assert t[lr] == a[lr], lr  # bit for bit: floats in JSON keep every bit
    # each run records the processes it shared the device with
    for seg in together.rglob("sweep.jsonl"):
        (record,) = [json.loads(x) for x in seg.read_text().splitlines()]
        assert record["together"] == 2 and record["outcome"] == "finished"
    # the report says the runs shared the device (their tokens/s is a share)
    assert "shared by 2 trainer processes at once" in (together / "results.md").read_text()
    assert "shared by" not in (alone / "results.md").read_text()
    result = json.loads((check / "together-check.json").read_text())
    assert [r["identical"] for r in result["runs"]] == [True] * 3
    assert result["speedup"] > 0 and result["alone"]["runs"] == result["together"]["runs"] == 3
    assert "bit-identical: 3" in (check / "together-check.md").read_text()
    capsys.readouterr()
    assert sweep.main(["sweep", "--out", str(together), "--together", "2", *TINY,
                       "--", "--sharding", "none"]) == 0  # again: nothing to train
    assert "runs: 0 started, 0 resumed, 3 skipped" in capsys.readouterr().out


def test_the_check_compares_by_hand():
    run = {"evals": {"ppl": [10.0, 8.0]}, "losses": [[1, 3.0], [2, 2.0]]}
    off = {"evals": {"ppl": [10.0, 8.004]}, "losses": [[1, 3.0], [2, 2.0]]}
    short = {"evals": {"ppl": [10.0]}, "losses": [[1, 3.0], [2, 2.0]]}
    rows = together_check.compare({"a": run, "b": run, "c": run},
                                  {"a": run, "b": off, "c": short, "d": run})
    assert [r["run"] for r in rows] == ["a", "b", "c"]  # only runs of both halves
    assert [r["identical"] for r in rows] == [True, False, False]
    assert rows[0]["max_rel_diff"] == 0.0
    assert rows[1]["max_rel_diff"] == pytest.approx(0.004 / 8.004)
    assert rows[2]["max_rel_diff"] == math.inf


def test_each_process_gets_its_share_of_the_memory(tmp_path, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    env = sweep.together_environment(tmp_path, 4)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.225"  # 0.9 / 4
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    one = sweep.together_environment(tmp_path, 1)
    assert "XLA_PYTHON_CLIENT_MEM_FRACTION" not in one
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in one
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.1")  # the caller's wins
    assert sweep.together_environment(tmp_path, 4)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.1"


def test_a_preemption_reaches_every_process_at_once():
    code = ("import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    children = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                 text=True) for _ in range(2)]
    for child in children:
        assert child.stdout.readline() == "ready\n"
    signals = sweep.Signals()
    with signals:
        signals.children = [child.pid for child in children]
        os.kill(os.getpid(), signal.SIGTERM)
        assert [child.wait(timeout=30) for child in children] == [75, 75]
    assert signals() == "SIGTERM"
    for child in children:
        child.stdout.close()


def _status(argv, main=sweep.main):
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


@pytest.mark.parametrize(("args", "message"), [
    (["--together", "0", *TINY], "argument --together: must be an integer >= 1, got '0'"),
    (["--together", "2", "--dry-run", *TINY], "--together trains runs at once; the dry run"),
    (["--assume-together", "2", *TINY], "--assume-together goes with --piece"),
    (["--piece", "all", "--plan", "grid", "--dry-run", "--assume-together", "2"],
     "--assume-together goes with --dry-run --assume-tflops"),
    (["--piece", "r-adamw", "--plan", "grid", "--assume-together", "2"],
     "--assume-together goes with --dry-run --assume-tflops"),
    (["--piece", "all", "--plan", "grid", "--dry-run", "--assume-tflops", "80",
      "--assume-together", "0"], "argument --assume-together: must be a number > 0, got '0'"),
])
def test_refusals_are_one_line(tmp_path, capsys, args, message):
    assert _status(["sweep", "--out", str(tmp_path / "out"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists()


def test_the_dry_run_says_the_speedup_is_assumed(capsys):
    base = ["sweep", "--piece", "all", "--plan", "grid", "--dry-run", "--assume-tflops", "80",
            "--assume-overhead", "18"]
    assert sweep.main(base) == 0
    plain = capsys.readouterr().out
    assert sweep.main([*base, "--assume-together", "2"]) == 0
    faster = capsys.readouterr().out
    assert "ASSUMED" not in plain
    assert "ASSUMED, not measured: --together runs each piece 2x faster" in faster

    def minutes(text):
        return float(text.split("in all ")[1].split(" min")[0])

    assert minutes(faster) == pytest.approx(minutes(plain) / 2, abs=0.1)


@pytest.mark.parametrize(("args", "message"), [
    (["--together", "1", "--", "--model", "tiny"], "argument --together: must be an integer >= 2"),
    ([], "give the sweep's options after --"),
    (["--", "--together", "3"], "--together after -- is set by the check itself"),
    (["--", "--out=x"], "--out after -- is set by the check itself"),
])
def test_the_checks_refusals_are_one_line(tmp_path, capsys, args, message):
    assert _status([str(tmp_path / "check"), *args], together_check.main) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "check").exists()


def test_paper_piece_passes_paper_piece_together_on(tmp_path):
    """``PAPER_PIECE_TOGETHER=N scripts/paper-piece``: the sweep gets ``--together N`` (here
    a refused 0, which the sweep names in one line before it trains anything)."""
    env = {**os.environ, "PYTHON": sys.executable, "PAPER_PIECE_TOGETHER": "0",
           "PAPER_PIECE_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([str(ROOT / "scripts" / "paper-piece"), "p1", str(tmp_path / "OUT")],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "argument --together: must be an integer >= 1, got '0'" in proc.stdout
    assert "paper-piece: p1 exit 2" in proc.stdout
    assert not (tmp_path / "runs").exists()
