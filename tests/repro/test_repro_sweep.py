"""sage-repro sweep: the harness end to end on the CPU, its resume, and its report checked
against hand-computed cases (synthetic metrics in fake run directories)."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import pytest

from sage_repro import sweep
from sage_repro import sweep_report as report

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def session_compilation_cache(monkeypatch):
    """The sweeps' trainers share the test session's compilation cache (conftest.py), as
    ``JAX_COMPILATION_CACHE_DIR`` given to a sweep is (:func:`sweep.child_environment`):
    the tests' runs repeat each other's programs (the tiny model's steps), which each
    sweep's own cache in ``OUT`` would compile again."""
    import jax

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

# ---------------------------------------------------------------------------------------------
# fake run directories

# 4 sequences of 25 tokens: 100 tokens per step; 30 steps, evaluated every 10
PROTOCOL = sweep.Protocol(model="tiny", data=None, steps=30, batch_size=4, seq_len=25,
                          eval_every=10, eval_batches=1, log_every=10, checkpoint_every=10)


def fake_run(out, config, lr, seed, ppl, seconds, *, protocol=PROTOCOL, tokens_per_s=1000.0,
             peak=None, diverged=None, steps=(10, 20, 30)):
    """Write the metrics of a run whose evaluations at ``steps`` gave ``ppl`` after
    ``seconds`` of training; ``diverged=(step, reason)`` records a divergence after them."""
    spec = sweep.RunSpec(config, lr, seed)
    run_dir = spec.run_dir(out, protocol.model)
    run_dir.mkdir(parents=True)
    rows = []
    for step, p, t in zip(steps, ppl, seconds, strict=True):
        # tokens_per_s=None: as the trainer counts, the tokens of the steps after the first
        # (compiling) one over the clock, which starts after it
        rate = ((step - 1) * protocol.tokens_per_step / t if tokens_per_s is None
                else tokens_per_s)
        row = {"step": step, "loss": math.log(p) + 0.1, "tokens_per_s": rate,
               "elapsed_s": t, "opt_state_bytes": 4096, "test_loss": math.log(p),
               "test_ppl": p}
        if peak is not None:
            row["peak_memory_bytes"] = peak
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    segment = {"started": "2026-01-01T00:00:00+00:00", "ended": "2026-01-01T00:01:00+00:00",
               "outcome": "finished", "max_rss_bytes": 2**30,
               "environment": {"platform": "gpu", "device_kind": "NVIDIA H100 80GB HBM3",
                               "device_count": 1, "cpu": "Some CPU", "cpu_count": 16,
                               "versions": {"jax": "0.10.2"}}}
    if diverged is not None:
        segment.update(outcome="diverged", step=diverged[0], reason=diverged[1])
    (spec.group(out) / report.SEGMENTS).write_text(json.dumps(segment) + "\n")
    return run_dir


@pytest.fixture
def hand_computed(tmp_path):
    """The effective-throughput case worked out by hand in test_effective_throughput_by_hand."""
    lr = 0.002
    fake_run(tmp_path, "lion-hybrid", lr, 0, [41, 31, 29], [1.0, 2.0, 3.0], peak=2**30,
             tokens_per_s=1000.0)
    fake_run(tmp_path, "lion-hybrid", lr, 1, [39, 29, 31], [1.5, 2.5, 3.5], peak=3 * 2**30,
             tokens_per_s=1200.0)
    fake_run(tmp_path, "sage-hybrid", lr, 0, [44, 36, 27], [1.0, 2.0, 2.5], peak=2**30)
    fake_run(tmp_path, "sage-hybrid", lr, 1, [46, 34, 29], [1.0, 2.0, 3.5], peak=2**30,
             tokens_per_s=800.0)
    fake_run(tmp_path, "adamw", 1e-4, 0, [50, 40, 35], [1, 2, 3], peak=2**30)
    fake_run(tmp_path, "adamw", 1e-4, 1, [50, 40, 35], [1, 2, 3], peak=2**30)
    fake_run(tmp_path, "lion", 1e-4, 0, [45, 33, 28], [1.0, 2.0, 4.0], peak=2**30)
    fake_run(tmp_path, "lion", 1e-4, 1, [45], [1.0], steps=(10,),
             diverged=(17, "loss became nan at step 17: stopping"))
    fake_run(tmp_path, "apollo", 1e-4, 0, [60, 50], [1.0, 2.0], steps=(10, 20))
    plan = sweep.Plan(configs=("lion-hybrid", "sage-hybrid", "adamw", "lion", "apollo"),
                      seeds=(0, 1))
    return tmp_path, plan


def markdown_row(table, config):
    (row,) = [line for line in table.splitlines() if line.startswith(f"| {config} |")]
    return [cell.strip() for cell in row.strip("|").split("|")]


def test_effective_throughput_by_hand(hand_computed):
    """P* = mean of lion-hybrid's final perplexities (29, 31) = 30; its mean curve (40, 30,
    30) first reaches 30 at step 20: N_base = 20 x 100 = 2000 tokens.  sage-hybrid's mean
    curve (45, 35, 28) first reaches 30 at step 30 (k_O), where its seeds ran at 1000 and
    800 tokens/s: its 30 steps (3000 tokens) took 3.0 and 3.75 s, so 2000/3 = 666.67 and
    2000/3.75 = 533.33 tokens/s, mean 600, sd 133.33 / sqrt(2) = 94.28.  The baseline
    against itself: its own tokens/s at step 20 (1000 and 1200), never more."""
    out, plan = hand_computed
    summary = sweep.summarize(out, PROTOCOL, plan)
    assert summary.target == report.Target("lion-hybrid", 0.002, 30.0, 20, 2000)
    sage = summary.effective["sage-hybrid"]
    assert sage.step == 30
    assert sage.values == pytest.approx((2000 / 3.0, 2000 / 3.75))
    assert summary.effective["lion-hybrid"].values == pytest.approx((1000.0, 1200.0))
    assert summary.effective["adamw"].step is None  # 35 > 30: never reaches P*
    # lion: only the finished seed counts (45, 33, 28): step 30 at 1000 tokens/s
    assert summary.effective["lion"].values == pytest.approx((2000 / 3.0,))

    table = report.main_table(summary)
    assert markdown_row(table, "sage-hybrid") == [
        "sage-hybrid", "0.002", "2/2", "28.00 ± 1.41", "29.95", "1.00 GiB ± 0.00 GiB",
        "4.00 KiB", "900 ± 141", "600 ± 94", "2/2 seeds finished"]
    assert markdown_row(table, "lion-hybrid") == [
        "lion-hybrid", "0.002", "2/2", "30.00 ± 1.41", "32.1", "2.00 GiB ± 1.41 GiB",
        "4.00 KiB", "1,100 ± 141", "1,100 ± 141", "2/2 seeds finished"]
    assert markdown_row(table, "adamw")[8] == "never reaches 30.00"
    assert "peak memory (device)" in table.splitlines()[0]

    data = report.to_json(summary)
    (sage_row,) = [r for r in data["rows"] if r["config"] == "sage-hybrid"]
    assert sage_row["effective_tokens_per_s"]["mean"] == pytest.approx(600.0)
    assert sage_row["effective_tokens_per_s"]["sd"] == pytest.approx(
        (2000 / 3 - 2000 / 3.75) / math.sqrt(2))
    assert sage_row["test_ppl"] == {"mean": 28.0, "sd": pytest.approx(math.sqrt(2)), "n": 2}
    assert data["target"] == {"config": "lion-hybrid", "lr": 0.002, "ppl": 30.0, "step": 20,
                              "tokens": 2000}
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN or Infinity


def test_the_baseline_against_itself_gives_its_own_tokens_per_s(tmp_path):
    """Tokens and time over the same steps (issue 34): the trainer's clock starts after the
    first, compiling step, so its tokens/s counts the steps after it; the baseline's
    effective throughput against itself must be that figure, not N_base (which counts the
    first step's tokens) over the clock (which leaves out that step's time): 3000/2.9 s =
    1,034 against 2900/2.9 s = 1,000 tokens/s.  The same for a run resumed once (two
    compiling steps off the clock), and for records without tokens_per_s per evaluation."""
    fake_run(tmp_path, "lion-hybrid", 0.002, 0, [40, 35, 30], [0.9, 1.9, 2.9],
             tokens_per_s=None)
    fake_run(tmp_path, "lion-hybrid", 0.002, 1, [40, 35, 30], [0.9, 1.9, 2.8],
             tokens_per_s=None)
    plan = sweep.Plan(configs=("lion-hybrid",), seeds=(0, 1))
    summary = sweep.summarize(tmp_path, PROTOCOL, plan)
    (row,) = summary.rows
    raw = [r.tokens_per_s for r in row.finished]
    assert raw == pytest.approx([1000.0, 2900 / 2.8])
    assert summary.effective["lion-hybrid"].values == pytest.approx(raw)
    cells = markdown_row(report.main_table(summary), "lion-hybrid")
    assert cells[7] == cells[8]  # tokens/s and effective tokens/s read the same
    # a record without per-evaluation tokens/s: one compiling step assumed off the clock
    run = row.finished[0]
    bare = dataclasses.replace(run.evals, rates=())
    assert bare.rate(30, 100) == pytest.approx(1000.0)
    # resumed at step 10: steps 1 and 11 compiled, 28 timed steps in 2.8 s
    resumed = report.EvalCurve((10, 20, 30), (40.0, 35.0, 30.0), (0.9, 1.8, 2.8),
                               (1000.0, 1000.0, 1000.0))
    target = report.Target("lion-hybrid", 0.002, 30.0, 30, 3000)
    assert report.effective_throughput([resumed], target).values == pytest.approx((1000.0,))
    # round trip through the merged report's JSON keeps the rates
    again = report.run_from_json(json.loads(json.dumps(report.run_to_json(run))))
    assert again.evals == run.evals


def test_diverged_and_unfinished_are_shown_not_dropped(hand_computed):
    out, plan = hand_computed
    summary = sweep.summarize(out, PROTOCOL, plan)
    table = report.main_table(summary)
    lion = markdown_row(table, "lion")
    assert lion[2] == "1/2" and lion[3] == "28.00"  # the finished seed alone, and said so
    assert lion[9] == "1/2 seeds finished; seed 1 diverged at step 17"
    apollo = markdown_row(table, "apollo")
    assert apollo[3] == "unfinished"
    assert apollo[9] == ("0/2 seeds finished; seed 0 unfinished (step 20/30); "
                         "seed 1 not started")
    assert [row.config for row in summary.rows] == list(plan.configs)  # every one is there
    header = "\n".join(report.setup_lines(summary))
    for fact in ("301,536 parameters", "30 steps x 100 tokens", "= 3,000 training tokens",
                 "1 x NVIDIA H100 80GB HBM3 (gpu)", "jax 0.10.2",
                 "runs trained from 2026-01-01T00:00:00+00:00"):
        assert fact in header


def test_report_files_and_plots(hand_computed):
    out, plan = hand_computed
    sweep.write_state(out, PROTOCOL, plan)
    sweep.write_report(out, PROTOCOL, plan)
    markdown = (out / "results.md").read_text()
    assert "| sage-hybrid | 0.002 | 2/2 | 28.00 ± 1.41 |" in markdown
    assert "P* = 30.00" in markdown and "N_base = 2,000 tokens" in markdown
    assert json.loads((out / "results.json").read_text())["best_lr"]["sage-hybrid"] == 0.002
    assert (out / "loss_vs_tokens.png").read_bytes()[:8] == PNG
    assert not (out / "lr_sweep.png").exists()  # one rate per configuration: no sweep plot
    assert sweep.main(["report", "--out", str(out), "--reference", "slowest"]) == 0
    # slowest: the highest mean final perplexity among finished rows is adamw's 35
    assert "against adamw (lr 0.0001): P* = 35.00" in (out / "results.md").read_text()


def test_lr_sweep_best_rate_and_second_stage(tmp_path):
    """sage-hybrid: 2e-3 gives the lowest perplexity (20) but a seed diverged there, so it is
    never best: 1e-3 (mean 41) is.  lion: no rate at which every seed finished."""
    fake_run(tmp_path, "sage-hybrid", 0.001, 0, [60, 50, 40], [1, 2, 3])
    fake_run(tmp_path, "sage-hybrid", 0.001, 1, [60, 50, 42], [1, 2, 3])
    fake_run(tmp_path, "sage-hybrid", 0.002, 0, [40, 30, 20], [1, 2, 3])
    fake_run(tmp_path, "sage-hybrid", 0.002, 1, [40], [1], steps=(10,),
             diverged=(12, "loss became inf at step 12: stopping"))
    fake_run(tmp_path, "lion", 0.001, 0, [80], [1], steps=(10,), diverged=(5, "x at step 5"))
    fake_run(tmp_path, "lion", 0.001, 1, [80], [1], steps=(10,), diverged=(6, "x at step 6"))
    fake_run(tmp_path, "lion", 0.002, 0, [70, 60], [1, 2], steps=(10, 20))
    plan = sweep.Plan(configs=("sage-hybrid", "lion"), seeds=(0, 1), lrs=(0.001, 0.002),
                      best_seeds=(0, 1, 2), top=1)
    cells = sweep.sweep_cells(tmp_path, PROTOCOL, plan)
    assert report.best_rates(cells) == {"sage-hybrid": 0.001, "lion": None}
    specs, chosen = sweep.second_stage(plan, cells)
    assert chosen == ["sage-hybrid"]
    assert specs == [sweep.RunSpec("sage-hybrid", 0.001, 2)]

    summary = sweep.summarize(tmp_path, PROTOCOL, plan)
    table = report.lr_table(summary)
    assert markdown_row(table, "0.001") == ["0.001", "41.00 ± 1.41", "diverged at step 5"]
    assert markdown_row(table, "0.002") == ["0.002", "20.00", "unfinished"]
    assert markdown_row(table, "best") == ["best", "**0.001** (edge of the grid)",
                                           "none finished"]
    main = report.main_table(summary)
    sage = markdown_row(main, "sage-hybrid")
    assert sage[1:3] == ["0.001", "2/3"]  # seed 2 of --best-seeds is still to run
    assert sage[9] == "2/3 seeds finished; seed 2 not started"
    lion = markdown_row(main, "lion")
    assert lion[1] == "-" and lion[9] == (
        "no rate at which every seed finished (0.001: diverged at step 5; 0.002: unfinished)")
    sweep.write_report(tmp_path, PROTOCOL, plan)
    assert (tmp_path / "lr_sweep.png").read_bytes()[:8] == PNG
    assert "## Learning-rate sweep" in (tmp_path / "results.md").read_text()


def test_rates_from_factors_and_the_trainer_options():
    plan = sweep.Plan(configs=("sage-hybrid", "adamw"), seeds=(0,), lr_factors=(0.5, 1, 2))
    assert plan.rates("sage-hybrid") == (0.001, 0.002, 0.004)
    assert plan.rates("adamw") == (5e-5, 1e-4, 2e-4)
    protocol = sweep.Protocol(model="tiny", data="some/dir", steps=8, batch_size=2, seq_len=16,
                              eval_every=4, eval_batches=1, log_every=1, checkpoint_every=4,
                              b1=0.9, weight_decay=0.0, trainer_args=("--sharding", "none"))
    argv = protocol.trainer_argv(sweep.RunSpec("sinkgd-pure", 0.02, 3), pathlib.Path("g"))
    assert argv[argv.index("--lr") + 1] == "0.02" and argv[argv.index("--seed") + 1] == "3"
    assert "--b1" not in argv  # no rule of sinkgd-pure has a b1: sage-train would refuse it
    assert argv[argv.index("--weight-decay") + 1] == "0.0"
    assert argv[-2:] == ["--sharding", "none"]
    argv = protocol.trainer_argv(sweep.RunSpec("adamw", 1e-4, 0), pathlib.Path("g"))
    assert argv[argv.index("--b1") + 1] == "0.9"
    from sage_train.cli import parse_args

    args = parse_args(argv)  # the trainer accepts every option the sweep gives it
    assert (args.lr, args.steps, args.run_dir, args.data) == (1e-4, 8, "g", "some/dir")


def test_the_paper_protocol_is_the_default(tmp_path, capsys):
    assert sweep.main(["sweep", "--out", str(tmp_path), "--model", "60m", "--tokens",
                       "100000000", "--dry-run"]) == 0
    out = capsys.readouterr().out
    # 100M tokens at 256 x 512 = 131,072 tokens per step: 762 steps
    assert "24 runs" in out and "762 steps x 131,072 tokens" in out
    args = sweep.build_parser().parse_args(["sweep", "--model", "tiny", "--steps", "10"])
    protocol, plan = sweep.protocol_and_plan(args, [])
    assert (protocol.seq_len, protocol.batch_size) == (256, 512)  # tiny: 256 positions
    assert (protocol.schedule, protocol.warmup_frac) == ("cosine", 0.1)
    assert plan.seeds == (0, 1, 2) and plan.reference == "lion-hybrid"
    assert len(plan.configs) == 8


@pytest.mark.parametrize(("args", "message"), [
    (["--configs", "sage-hybrid", "nope"], "argument --configs: invalid choice: 'nope'"),
    (["--lrs"], "argument --lrs: expected at least one argument"),
    (["--lrs", "0"], "argument --lrs: must be a number > 0, got '0'"),
    (["--lrs", "1e-3", "--lr-factors", "1"], "argument --lr-factors: not allowed with"),
    (["--seeds", "-1"], "argument --seeds: must be an integer >= 0, got '-1'"),
    (["--top", "2"], "--top chooses the configurations that get --best-seeds"),
    (["--seq-len", "512"], "--seq-len 512 is longer than the tiny model's 256 positions"),
    (["--tokens-per-step", "1000"], "--tokens-per-step 1000 is not a multiple of"),
    (["--reference", "adamw", "--configs", "lion"], "--reference adamw is not among --configs"),
    (["--", "--steps", "9"], "--steps after -- is set by sage-repro sweep itself"),
])
def test_bad_options_are_one_line_naming_the_option(tmp_path, capsys, args, message):
    argv = ["sweep", "--out", str(tmp_path), "--model", "tiny", "--steps", "4", *args]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / sweep.STATE).exists()  # nothing written


def exit_status(argv):
    try:
        return sweep.main(argv)
    except SystemExit as e:  # argparse's own errors
        return e.code


def test_a_missing_length_and_another_protocol_are_refused(tmp_path, capsys):
    assert sweep.main(["sweep", "--out", str(tmp_path), "--model", "tiny"]) == 2
    assert "give --steps N or --tokens N" in capsys.readouterr().err
    plan = sweep.Plan(configs=("sage-hybrid",), seeds=(0,))
    sweep.write_state(tmp_path, PROTOCOL, plan)
    assert sweep.main(["sweep", "--out", str(tmp_path), "--model", "tiny", "--steps", "31",
                       "--batch-size", "4", "--seq-len", "25", "--eval-every", "10",
                       "--eval-batches", "1", "--configs", "sage-hybrid", "--seeds", "0"]) == 2
    err = capsys.readouterr().err
    assert "records a sweep under other settings: --steps 30 -> 31" in err
    assert err.count("\n") == 1
    assert sweep.main(["report", "--out", str(tmp_path / "none")]) == 2
    assert "holds no sweep" in capsys.readouterr().err


def test_stop_reason_of_the_trainer():
    err = ("noise\nadamw: loss became nan at step 4: stopping; the newest finite checkpoint is "
           "step 2 (/x/checkpoints/2), where a rerun resumes\n")
    reason, step = report.stop_reason("adamw", err)
    assert step == 4 and reason.startswith("loss became nan at step 4")
    assert report.stop_reason("adamw", "sage-train: error: cannot write x\n") is None
    assert report.stop_reason("lion", err) is None


# ---------------------------------------------------------------------------------------------
# the real thing: the trainer in child processes

TINY = ["--model", "tiny", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
        "--eval-every", "2", "--eval-batches", "1", "--checkpoint-every", "4"]


def segments(out, config, lr, seed):
    return report.read_segments(sweep.RunSpec(config, lr, seed).group(out))


def test_end_to_end_resume_and_rerun(tmp_path, capsys):
    """2 configurations x 2 seeds x 4 steps of the tiny model.  One run was cut short at step
    2 beforehand: the sweep resumes it from its checkpoint; a second invocation trains
    nothing."""
    out = tmp_path / "sweep"
    argv = ["sweep", "--out", str(out), *TINY, "--configs", "sage-hybrid", "lion-hybrid",
            "--seeds", "0", "1", "--", "--sharding", "none"]
    args = sweep.build_parser().parse_args(argv[:argv.index("--")])
    protocol, _ = sweep.protocol_and_plan(args, ["--sharding", "none"])
    cut = sweep.RunSpec("sage-hybrid", 0.002, 1)
    from sage_train.cli import configs, parse_args
    from sage_train.run.train import train

    (cfg,) = configs(parse_args(protocol.trainer_argv(cut, cut.group(out))))
    assert train(cfg, stop_after=2, log=lambda _: None).steps_done == 2

    assert sweep.main(argv) == 0
    printed = capsys.readouterr().out
    assert "runs: 3 started, 1 resumed, 0 skipped" in printed
    for config in ("sage-hybrid", "lion-hybrid"):
        for seed in (0, 1):
            record = sweep.read(out, protocol, sweep.RunSpec(config, 0.002, seed))
            assert record.status == "finished" and record.step_reached == 4
            assert record.peak_rss_bytes > 0
    (resumed,) = segments(out, "sage-hybrid", 0.002, 1)
    assert (resumed["action"], resumed["start_step"], resumed["outcome"]) == (
        "resumed", 2, "finished")
    assert "at step 2" in (cut.group(out) / "train.log").read_text()  # the trainer resumed
    rows = [json.loads(x) for x in
            (cut.run_dir(out, "tiny") / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]

    markdown = (out / "results.md").read_text()
    for config in ("sage-hybrid", "lion-hybrid"):
        row = markdown_row(markdown, config)
        assert row[2] == "2/2" and " ± " in row[3] and row[9] == "2/2 seeds finished"
    assert "effective throughput: N_base / T_O against lion-hybrid" in markdown
    assert "no accelerator" in markdown and "128 training tokens" in markdown
    assert (out / "loss_vs_tokens.png").read_bytes()[:8] == PNG
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()
              and p.parent.name != "checkpoints" and p.suffix != ".png"
              and p.name not in ("results.md", "results.json", "sweep.json")}

    assert sweep.main(argv) == 0  # again: nothing to train
    assert "runs: 0 started, 0 resumed, 4 skipped" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


def test_a_diverged_run_is_a_result_and_is_not_retrained(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = ["sweep", "--out", str(out), *TINY, "--steps", "6", "--configs", "adamw",
            "--seeds", "0", "--lrs", "1e30", "--", "--sharding", "none"]
    assert sweep.main(argv) == 0
    (segment,) = segments(out, "adamw", 1e30, 0)
    assert segment["outcome"] == "diverged" and segment["returncode"] == 1
    assert segment["reason"].startswith("loss became nan at step ")
    step = segment["step"]
    row = markdown_row((out / "results.md").read_text(), "adamw")
    assert row[2:4] == ["0/1", f"diverged at step {step}"]
    assert row[9] == f"0/1 seeds finished; seed 0 diverged at step {step}"
    capsys.readouterr()
    assert sweep.main(argv) == 0
    assert "runs: 0 started, 0 resumed, 1 skipped" in capsys.readouterr().out
    assert len(segments(out, "adamw", 1e30, 0)) == 1


def test_a_preemption_reaches_the_running_trainer():
    """SIGTERM to the harness is passed on to its child, which saves and exits with 75."""
    import os
    import signal
    import subprocess
    import sys

    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75))\n"
         "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    signals = sweep.Signals()
    with signals:
        signals.child = child.pid
        os.kill(os.getpid(), signal.SIGTERM)
        assert child.wait(timeout=30) == 75
    assert signals() == "SIGTERM"


def test_the_legends_sit_beside_the_curves(hand_computed, monkeypatch):
    """Issue 34: inside the axes, the legend hid the highest curve (AdamW's)."""
    pytest.importorskip("matplotlib")
    out, plan = hand_computed
    summary = sweep.summarize(out, PROTOCOL, plan)
    drawn = []
    real = report._figure
    monkeypatch.setattr(report, "_figure", lambda w, h: drawn.append(real(w, h)) or drawn[-1])
    report.plot_loss_vs_tokens(summary, out / "loss.png")
    report.plot_lr_sweep(summary, out / "lr.png")
    legends = 0
    for fig, canvas in drawn:
        canvas.draw()
        renderer = canvas.get_renderer()
        for ax in fig.axes:
            legend = ax.get_legend()
            if legend is not None:
                legends += 1
                assert not legend.get_window_extent(renderer).overlaps(
                    ax.get_window_extent(renderer))
    assert legends == 2


# ---------------------------------------------------------------------------------------------
# issue 33: a sweep that only reuses what matches


@pytest.mark.parametrize("flag", ["--see", "--see=7", "--seed=7", "--batch", "--batch_size",
                                  "--checkpoint-e"])
def test_every_spelling_of_a_managed_option_is_refused(tmp_path, capsys, flag):
    argv = ["sweep", "--out", str(tmp_path), "--model", "tiny", "--steps", "4", "--", flag, "7"]
    assert exit_status(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag.split('=')[0]} after --" in err, err
    assert "is set by sage-repro sweep itself" in err
    assert not (tmp_path / sweep.STATE).exists()


def test_the_trainer_refuses_abbreviations(capsys):
    from sage_train.cli import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--see", "7"])
    assert e.value.code == 2
    assert "unrecognized arguments: --see 7" in capsys.readouterr().err


@pytest.mark.parametrize(("edit", "message"), [
    (("plan", "configs", ["foo"]), 'plan.configs must be a non-empty list of configuration '
                                   'names, got ["foo"]'),
    (("protocol", "steps", "2"), 'protocol.steps must be an integer >= 1, got "2"'),
    (("plan", "seeds", []), "plan.seeds must be a non-empty list of integers >= 0, got []"),
    (("plan", "top", 0), "plan.top must be null or an integer >= 1, got 0"),
    (("protocol", "clip", None), "protocol.clip must be a number, got null"),
    (("plan", "lrs", [1e-3, -1]), "plan.lrs must be null or a non-empty list of numbers > 0"),
    (("protocol", "model", None), "protocol.model must be one of tiny"),
    (("plan", "best_seeds", None), "plan.best_seeds must be a list of integers >= 0"),
])
def test_an_edited_sweep_json_is_one_line_naming_the_field(tmp_path, capsys, edit, message):
    plan = sweep.Plan(configs=("sage-hybrid",), seeds=(0,))
    sweep.write_state(tmp_path, PROTOCOL, plan)
    data = json.loads((tmp_path / sweep.STATE).read_text())
    section, field, value = edit
    data[section][field] = value
    (tmp_path / sweep.STATE).write_text(json.dumps(data))
    assert sweep.main(["report", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "is damaged" in err, err
    del data[section][field]
    (tmp_path / sweep.STATE).write_text(json.dumps(data))
    if f"{section}.{field}" not in sweep._OPTIONAL_FIELDS:
        assert sweep.main(["report", "--out", str(tmp_path)]) == 2
        assert f"{section}.{field} is missing" in capsys.readouterr().err


def test_a_finished_run_is_reused_only_under_its_own_settings(tmp_path, capsys):
    """A run trained with --batch-size 2 --clip 1 is not reported under --batch-size 4
    --clip 0 once sweep.json is moved away; a run whose last metrics row was lost is trained
    again from its previous checkpoint, not failed forever."""
    out = tmp_path / "sweep"
    base = ["sweep", "--out", str(out), "--model", "tiny", "--steps", "2", "--seq-len", "16",
            "--eval-every", "1", "--eval-batches", "1", "--checkpoint-every", "1",
            "--configs", "adamw", "--seeds", "0", "--lrs", "0.001"]
    tail = ["--", "--sharding", "none"]
    assert sweep.main([*base, "--batch-size", "2", "--clip", "1", *tail]) == 0
    spec = sweep.RunSpec("adamw", 0.001, 0)
    run_dir = spec.run_dir(out, "tiny")
    metrics = run_dir / "metrics.jsonl"
    def losses():
        return [(r["step"], r["loss"], r["test_ppl"]) for r in map(
            json.loads, metrics.read_text().splitlines())]

    rows = metrics.read_text().splitlines()
    before = losses()
    assert len(rows) == 2
    assert before[-1][0] == 2

    # the last row lost: the run is trained again from step 1, with the same numbers
    metrics.write_text("".join(r + "\n" for r in rows[:-1]))
    capsys.readouterr()
    assert sweep.main([*base, "--batch-size", "2", "--clip", "1", *tail]) == 0
    assert "runs: 0 started, 1 resumed, 0 skipped" in capsys.readouterr().out
    assert losses() == before
    assert (run_dir / "checkpoints" / "2.superseded").is_dir()
    assert sweep.read(out, sweep.protocol_and_plan(
        sweep.build_parser().parse_args([*base, "--batch-size", "2"]), tail[1:])[0],
        spec).status == "finished"

    # another protocol, sweep.json moved away as its message advises: refused, named
    (out / sweep.STATE).rename(tmp_path / "old.json")
    assert sweep.main([*base, "--batch-size", "4", "--clip", "0", *tail]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "was trained under other settings" in err
    assert "clip 1.0 -> 0.0" in err and "batch_size 2 -> 4" in err
    assert losses() == before  # nothing trained
