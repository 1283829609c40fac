"""benchmarks/paper_tables.py: the effective-throughput arithmetic and an end-to-end run."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "paper_tables.py"
spec = importlib.util.spec_from_file_location("paper_tables", PATH)
paper_tables = importlib.util.module_from_spec(spec)
sys.modules["paper_tables"] = paper_tables  # dataclasses look their module up
spec.loader.exec_module(paper_tables)


def curve(config, seed, ppl, seconds, steps=(10, 20, 30), rates=()):
    return paper_tables.Curve(config, 1e-3, seed, list(steps), list(ppl), list(seconds),
                              tokens_per_s=1.0, opt_state_bytes=4, rates=list(rates))


def test_effective_throughput_by_hand():
    """N_base: the reference's mean curve (40, 30, 30) first reaches its final 30 at step 20,
    i.e. 20 x 100 tokens.  The candidate's mean curve (45, 35, 28) first gets to <= 30 at
    step 30, where its seeds ran at 1000 and 600 tokens/s: its 3000 tokens took 3 and 5 s,
    2000/3 and 2000/5 tokens per second, median (of two: the mean) 533.33."""
    ref = [curve("ref", 0, [41, 31, 29], [1, 2, 3], rates=[900, 950, 970]),
           curve("ref", 1, [39, 29, 31], [1, 2, 3], rates=[900, 800, 970])]
    cand = [curve("c", 0, [44, 36, 27], [1.0, 2.0, 2.5], rates=[1000] * 3),
            curve("c", 1, [46, 34, 29], [1.0, 2.0, 3.5], rates=[600] * 3)]
    assert paper_tables.effective_throughput(ref, cand, 100) == pytest.approx(
        (2000 / 3 + 2000 / 5) / 2)
    # The reference against itself: its own tokens/s at step 20 (issue 34), never more.
    assert paper_tables.effective_throughput(ref, ref, 100) == pytest.approx((950 + 800) / 2)


def test_effective_throughput_is_none_when_the_target_is_never_reached():
    ref = [curve("ref", 0, [40, 30, 20], [1, 2, 3])]
    slow = [curve("slow", 0, [50, 40, 21], [1, 2, 3])]
    assert paper_tables.effective_throughput(ref, slow, 100) is None


def test_mean_curve_uses_steps_every_seed_evaluated():
    a = curve("a", 0, [4.0, 2.0, 1.0], [1, 2, 3])
    b = curve("a", 1, [6.0, 4.0], [3, 4], steps=(10, 20))
    c = curve("a", 2, [5.0, 3.0], [100, 100], steps=(10, 20))  # slowed by another job
    steps, ppl, sec = paper_tables.mean_curve([a, b, c])
    assert steps == [10, 20] and ppl == [5.0, 3.0] and sec == [3, 4]


def test_convergence_and_sweep_end_to_end(tmp_path, capsys):
    """A tiny reproduction: two configurations, then a two-point sweep that reuses a run."""
    args = ["--out", str(tmp_path), "--steps", "2", "--eval-every", "1", "--eval-batches", "1",
            "--batch-size", "2", "--seq-len", "16", "--seeds", "0"]
    paper_tables.main(["convergence", *args, "--configs", "sage-hybrid", "lion-hybrid"])
    table = (tmp_path / "tables-convergence.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| sage-hybrid", "| lion-hybrid"]
    assert "29.95" in rows[1]  # the paper's 270M figure beside ours
    # The run directories are reused: the sweep's 2e-3 point is the convergence run.
    done = (tmp_path / "runs/sage-hybrid/lr0.002/seed0/metrics.jsonl").stat().st_mtime
    paper_tables.main(["sweep", *args, "--sweep-configs", "sage-hybrid", "--lrs", "1e-3",
                       "2e-3"])
    assert (tmp_path / "runs/sage-hybrid/lr0.002/seed0/metrics.jsonl").stat().st_mtime == done
    sweep = (tmp_path / "tables-sweep.md").read_text()
    assert "| 0.001 |" in sweep and "| 0.002 |" in sweep
    assert "Learning-rate sweep" in capsys.readouterr().out
