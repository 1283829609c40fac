"""Kill-and-resume soak: ``python -m sage_train`` killed at random moments, then resumed.

SIGKILL, SIGTERM and SIGINT, four times each in a seeded random order, at seeded random
moments (start-up, JAX's import, compilation, training, checkpoints, the end); every cycle
resumes the same run.  It must end bit-identical to an uninterrupted run (the losses, test
perplexities, learning rates and the ``H_t`` record), SIGTERM must always leave a checkpoint
of the step it reached, and no cycle may crash (no segfault, no traceback).  Runs in the
default test session (about a minute on two cores: the tiny model, a persistent compilation
cache shared with the other tests).
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from sage_train.job.signals import INTERRUPTED, PREEMPTED  # noqa: E402
from sage_train.store import rundir  # noqa: E402
from sage_train.store.checkpoints import Checkpoints  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 120
CYCLES = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT] * 4


def command(corpus, runs):
    return [sys.executable, "-m", "sage_train", "--model", "tiny", "--steps", str(STEPS),
            "--batch-size", "8", "--seq-len", "32", "--checkpoint-every", "15",
            "--eval-every", "30", "--eval-batches", "2", "--log-every", "1",
            "--record-h-every", "2", "--no-progress", "--data", str(corpus),
            "--run-dir", str(runs)]


def environment():
    env = dict(os.environ)
    cache = env.get("SAGE_TEST_JAX_CACHE") or str(
        pathlib.Path(tempfile.gettempdir()) / "sage-test-jax-cache")
    env.update(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5",
               PYTHONUNBUFFERED="1")
    return env


def as_from_a_terminal() -> None:
    """In the child: SIGINT as a terminal's Ctrl-C finds it (the default action).

    A suite started in the background (``cmd &`` in a non-interactive shell, as CI runners
    may) hands its children SIGINT ignored, and sage-train rightly keeps an ignored SIGINT
    ignored; the soak sends SIGINT as a user's Ctrl-C, so its children must not inherit that.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def rows(run):
    return [(r["step"], r["loss"], r["lr"], r.get("test_ppl"))
            for r in rundir.iter_metrics(run)]


def last_step(run, since_ns):
    """The step of the last complete row of ``metrics.jsonl`` written after ``since_ns``.

    0 while the file is older (its rows beyond the resume point are a killed run's, about
    to be superseded).
    """
    path = run / rundir.METRICS
    try:
        if path.stat().st_mtime_ns <= since_ns:
            return 0
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return 0
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return 0


def wait_for_step(proc, run, step, since_ns, timeout=120.0):
    """Return once the run has logged ``step`` (or its process ended, or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        if last_step(run, since_ns) >= step:
            return
        time.sleep(0.01)


def newest(run):
    steps = Checkpoints(run / "checkpoints").steps()
    return steps[0] if steps else 0


@pytest.mark.usefixtures("token_cache")
def test_kill_and_resume_soak_ends_bit_identical(train_corpus, tmp_path):
    env = environment()
    ref = subprocess.run(command(train_corpus, tmp_path / "ref"), cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    runs = tmp_path / "soak"
    run = runs / "tiny-sage-hybrid"
    rng = random.Random(20260101)
    order = list(CYCLES)
    rng.shuffle(order)
    report = []
    for sig in order:
        before = newest(run) if run.exists() else 0
        started = time.time_ns()
        proc = subprocess.Popen(command(train_corpus, runs), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=as_from_a_terminal)
        if rng.random() < 0.35:  # start-up: Python, JAX's import, the data, compilation
            moment = f"{rng.uniform(0.5, 4.0):.2f}s"
            try:
                proc.wait(timeout=float(moment[:-1]))
            except subprocess.TimeoutExpired:
                proc.send_signal(sig)
        else:  # training: a few steps past the resume point (at most STEPS // CYCLES)
            k = rng.randint(1, STEPS // len(CYCLES) - 2)
            moment = f"step {before}+{k}"
            wait_for_step(proc, run, before + k, started)
            proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
        rc = proc.returncode
        report.append((sig.name, moment, rc))
        assert rc != -signal.SIGSEGV and "Traceback" not in err, (report, err[-2000:])
        if sig == signal.SIGKILL:
            assert rc == -signal.SIGKILL, (report, err[-2000:])
            continue
        want = PREEMPTED if sig == signal.SIGTERM else INTERRUPTED
        assert rc == want, (str(report), out[-3000:], err[-2000:])
        last = err.strip().splitlines()[-1]
        assert last.startswith("sage-train: "), (report, err[-2000:])
        if sig == signal.SIGTERM:
            reached = re.search(r"at step (\d+)", last)
            step = int(reached.group(1)) if reached else before
            assert newest(run) == step >= before, (report, last)  # the work is saved
    final = subprocess.run(command(train_corpus, runs), cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, (report, final.stderr[-2000:])
    assert rows(run) == rows(tmp_path / "ref" / "tiny-sage-hybrid"), report
    with np.load(run / "damper_h.npz") as got, \
            np.load(tmp_path / "ref" / "tiny-sage-hybrid" / "damper_h.npz") as want:
        assert list(got["steps"]) == list(want["steps"])
        np.testing.assert_array_equal(got["h"], want["h"])
    assert len(report) == len(CYCLES) >= 10


@pytest.mark.usefixtures("token_cache")
def test_ctrl_c_during_start_up_and_compilation_exits_cleanly(train_corpus, tmp_path):
    """SIGINT while JAX loads, the data is read and the step compiles: status 130, one line,
    never a crash (a KeyboardInterrupt raised inside JAX's compilation used to end in a
    segfault at exit)."""
    env = environment()
    env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "cold-cache")  # a real compilation
    for i, delay in enumerate((1.5, 3.0, 4.5)):
        proc = subprocess.Popen(command(train_corpus, tmp_path / f"runs{i}"), cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, preexec_fn=as_from_a_terminal)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode in (INTERRUPTED, 0), (delay, proc.returncode, err[-2000:])
        if proc.returncode == INTERRUPTED:
            assert err.count("\n") == 1 and "interrupted" in err, (delay, err[-2000:])
