"""scripts/gpu-check: the plan fits its budget, steps are cut at their deadline and the report
says so, skipped steps say why, and the figures come from the steps' own output.

The GPU itself runs the plan (``scripts/gpu-check OUT``); here the runner is checked with
small commands of known behaviour, and the plan against the files it names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
gc = importlib.util.module_from_spec(_spec)
sys.modules["gpu_check"] = gc  # dataclasses resolve their module by name
_spec.loader.exec_module(gc)


def runner(tmp_path: Path, budget: float = 600) -> gc.Runner:
    out, work = tmp_path / "out", tmp_path / "work"
    out.mkdir()
    work.mkdir()
    return gc.Runner(out, work, budget, sys.executable, time.monotonic(), ["# test"])


def py(code: str) -> tuple[str, ...]:
    return ("{py}", "-c", code)


SLEEPS = py("import time; time.sleep(120)")


def run_part(tmp_path: Path, seconds: float, *steps: gc.Step, **part: bool) -> gc.Runner:
    """A runner that has run ``steps`` as one part with ``seconds`` for it."""
    r = runner(tmp_path)
    r.run_part(gc.Part("x", "test part", steps, **part), time.monotonic() + seconds)
    return r


def test_plan_order_and_budget():
    parts = gc.plan()
    assert [p.key for p in parts] == ["env", "a", "b", "c", "d", "e"]
    # Every part before the last fits the default budget at its own share; the last has the
    # rest, so the check ends by itself within the budget.
    secs = gc.part_seconds(parts, gc.DEFAULT_BUDGET)
    assert secs[:-1] == [p.share for p in parts[:-1]]
    assert sum(secs) == pytest.approx(gc.DEFAULT_BUDGET - gc.RESERVE)
    assert secs[-1] >= 0
    # A smaller budget scales the parts down and still adds up to it.
    assert sum(gc.part_seconds(parts, 470)) == pytest.approx(470 - gc.RESERVE)


def test_plan_names_files_that_exist():
    for smoke in (False, True):
        for part in gc.plan(smoke):
            for step in part.steps:
                for arg in step.argv:
                    if arg.startswith(("tests/", "benchmarks/", "scripts/")):
                        path, _, test = arg.partition("::")
                        assert (ROOT / path).exists(), arg
                        assert not test or f"def {test}(" in (ROOT / path).read_text(), arg


def test_every_test_file_runs_somewhere_on_the_gpu_host():
    files = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*.py")}
    placed = set(gc.JAX_CORRECTNESS) | set(gc.TORCH_CORRECTNESS) | set(gc.rest_of_suite())
    assert files - placed == set(gc.NOT_ON_GPU)
    assert set(gc.NOT_ON_GPU) <= files
    # The files whose cases only run on a GPU are in part (a), not left to the end.
    for name in ("optax/test_optax_sinkgd_pallas.py", "optax/test_optax_placement.py",
                 "train/test_train_attention.py"):
        assert f"tests/{name}" in gc.JAX_CORRECTNESS
    for name in ("test_torch_fused_cuda.py", "test_torch_capturable.py",
                 "test_torch_multi_tensor.py"):
        assert f"tests/torch/{name}" in gc.TORCH_CORRECTNESS


def test_dry_run_prints_the_plan():
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check"), "--dry-run"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable})
    assert proc.returncode == 0, proc.stderr
    for key in ("| env |", "| a |", "| b |", "| c |", "| d |", "| e |"):
        assert key in proc.stdout
    assert "benchmarks/jax_step.py --model 270m" in proc.stdout


def test_dry_run_refuses_a_broken_interpreter(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run",
                           "--python", str(tmp_path / "no-python")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "does not run" in proc.stdout


def test_bad_options_are_one_line_errors():
    for args, word in ((["--only", "z"], "--only"), (["--budget", "5"], "--budget")):
        proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2
        assert word in proc.stderr.strip().splitlines()[-1]


def test_a_step_past_its_deadline_is_cut_and_the_next_is_not_started(tmp_path):
    # 5 s: the first has its 4 s, the second not half its 30
    r = run_part(tmp_path, 5, gc.Step("sleeps", SLEEPS, 4),
                 gc.Step("prints", py("print('late')"), 30), greedy=True)
    cut, late = r.outcomes
    assert cut.status == "timed out" and "its share" in cut.why
    assert late.status == "not reached"
    r.write(final=True)
    report = (r.out / "gpu-check.md").read_text()
    assert "timed out" in report and "not reached" in report
    doc = json.loads((r.out / "gpu-check.json").read_text())
    assert doc["counts"]["timed out"] == 1 and doc["counts"]["not reached"] == 1


def test_a_part_whose_share_is_spent_still_starts_its_first_step(tmp_path):
    """A part given a share is started even when the time before it used the share up (the
    script's start-up once starved ``--only env a --budget 165``'s env part): its first
    step runs with MIN_STEP seconds; the next is not reached."""
    r = run_part(tmp_path, 0, gc.Step("prints", py("print('ran')"), 10),
                 gc.Step("second", py("print('late')"), 30))
    first, second = r.outcomes
    assert first.status == "ok", (first.status, first.why)
    assert second.status == "not reached"
    (tmp_path / "together").mkdir()
    r = run_part(tmp_path / "together", -1, gc.Step("a", py("print(1)"), 5),
                 gc.Step("b", py("print(2)"), 5), concurrent=True)
    assert [o.status for o in r.outcomes] == ["ok", "ok"]


def test_steps_together_have_their_own_times_and_status(tmp_path):
    r = run_part(tmp_path, 4, gc.Step("fails at once", py("raise SystemExit(3)"), 6),
                 gc.Step("sleeps", SLEEPS, 6), concurrent=True)
    failed, cut = r.outcomes
    assert failed.status == "failed" and failed.rc == 3 and failed.why == "exit 3"
    assert cut.status == "timed out"
    assert failed.seconds < cut.seconds


def test_in_turn_a_step_has_its_share_of_what_is_left(tmp_path):
    # 32 s for the part: the first step has an eighth of it (4 s), and is cut there, so the
    # second still runs (the margin, about 28 s against the 7 s it needs to start, absorbs
    # a loaded machine's slow stop and report writing).
    r = run_part(tmp_path, 32, gc.Step("first", SLEEPS, 2),
                 gc.Step("second", py("print('second ran')"), 14))
    first, second = r.outcomes
    assert first.status == "timed out"
    assert second.status == "ok" and "second ran" in second.markdown


def test_skipped_steps_say_why(tmp_path):
    r = runner(tmp_path)
    steps = [gc.Step("needs a module", py("pass"), 10, needs=("no_such_module_xyz",))]
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        steps.append(gc.Step("needs CUDA", py("pass"), 10, gpu="torch"))
    r.run_part(gc.Part("x", "skips", tuple(steps)), time.monotonic() + 60)
    assert r.outcomes[0].status == "skipped"
    assert r.outcomes[0].why == "not installed: no_such_module_xyz"
    if not cuda:
        assert r.outcomes[1].status == "skipped"
        assert "sees no GPU" in r.outcomes[1].why


def test_pytest_counts_come_from_its_junit_file(tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text(
        "import pytest\n"
        "def test_a(): pass\n"
        "def test_b(): pass\n"
        "def test_c(): assert 1 == 2, 'one is not two'\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_d(): pass\n")
    r = runner(tmp_path)
    step = gc.Step("sample", gc._pytest([str(tests)], "sample", 1), 60, kind="pytest")
    r.run_part(gc.Part("x", "pytest", (step,)), time.monotonic() + 120)
    (o,) = r.outcomes
    assert o.status == "failed"
    assert o.figures == {"tests": 4, "failures": 1, "errors": 0, "skipped": 1, "passed": 2}
    assert "test_c" in o.markdown and "one is not two" in o.markdown


def test_train_table_from_metrics(tmp_path, capsys):
    for opt, tps in (("adamw", 1000.0), ("sage-hybrid", 950.0)):
        run = tmp_path / f"270m-{opt}"
        run.mkdir()
        (run / "config.json").write_text(json.dumps(
            {"optimizer": opt, "batch_size": 16, "seq_len": 1024, "dtype": "bfloat16"}))
        rows = [{"step": 10, "loss": 9.0, "tokens_per_s": 10.0},  # an earlier row
                {"step": 40, "loss": 7.5, "tokens_per_s": tps, "mfu": tps / 2500,
                 "peak_memory_bytes": 3 * 2**30}]
        (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in rows))
    assert gc.cmd_train_table(str(tmp_path)) == 0
    out = capsys.readouterr().out
    assert "SAGE-Hybrid / AdamW tokens/s: 0.950" in out
    assert "| sage-hybrid | 16x1024 | bfloat16 |" in out
    assert "40.0%" in out and "3.00" in out  # MFU 1000/2500 and 3 GiB of adamw's row


def test_train_table_without_runs_fails(tmp_path, capsys):
    assert gc.cmd_train_table(str(tmp_path)) == 1
    assert "no run" in capsys.readouterr().out


def test_source_fingerprint_names_the_code(tmp_path):
    """Equal code, equal fingerprint wherever it lies; one changed byte, another."""
    for d in gc.SOURCE_DIRS:
        (tmp_path / d).mkdir()
    (tmp_path / "sage_optax" / "a.py").write_text("x = 1\n")
    (tmp_path / "scripts" / "gpu-check").write_text("#!/bin/sh\n")
    (tmp_path / "README.md").write_text("not code\n")
    first = gc.source_fingerprint(tmp_path)
    (tmp_path / "README.md").write_text("changed, still not code\n")
    assert gc.source_fingerprint(tmp_path) == first
    (tmp_path / "sage_optax" / "a.py").write_text("x = 2\n")
    assert gc.source_fingerprint(tmp_path) != first
