"""The paper's comparison in pieces (sage_repro.pieces): a two-piece plan trained end to end
on the tiny model and a synthetic cut, merged, and the refusals of a piece of other data or
another protocol; the paper plan's properties and its dry run, checked by hand."""

from __future__ import annotations

import json
import math
import os
import pathlib
import shutil
import statistics
import subprocess
import sys

import jax
import pytest
from corpus_helpers import installed_corpus

from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_repro import pieces, sweep
from sage_repro import sweep_report as report
from sage_train.data import cut
from sage_train.model.shapes import MODELS

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = pathlib.Path(__file__).resolve().parents[2]


def tiny_plan(data, fingerprint) -> pieces.PiecePlan:
    """Three pieces of one run each: sage-hybrid seeds 0 and 1, then twice its rate."""
    protocol = sweep.Protocol(model="tiny", data=str(data), steps=4, batch_size=2, seq_len=16,
                              eval_every=2, eval_batches=1, log_every=1, checkpoint_every=4,
                              trainer_args=("--sharding", "none"))
    return pieces.PiecePlan("tiny-test", protocol, (
        pieces.Piece("a", ("sage-hybrid",), (0,)), pieces.Piece("b", ("sage-hybrid",), (1,)),
        pieces.Piece("c", ("sage-hybrid",), (0,), 2.0)), fingerprint=fingerprint)


def final_ppl(run_dir) -> float:
    """The last test perplexity a run's metrics.jsonl records."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["test_ppl"] for r in rows if "test_ppl" in r][-1]


def test_two_pieces_end_to_end_and_merged(tmp_path, monkeypatch, capsys):
    installed = installed_corpus(tmp_path, monkeypatch, MODELS["tiny"].vocab_size)
    manifest = cut.cut_data(installed, tmp_path / "cut", train_tokens=4000, test_tokens=1000)
    plan = tiny_plan(tmp_path / "cut", manifest["fingerprint"])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    assert pieces.load_plan(plan_file) == plan
    # the trainers share the test session's compilation cache (conftest.py)
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    committed = tmp_path / "benchmarks"
    # piece a by the harness in this process, piece b by the GPU machine's command
    out = tmp_path / "runs" / "a"
    argv = ["sweep", "--piece", "a", "--plan", str(plan_file), "--out", str(out)]
    assert sweep.main(argv) == 0
    (committed / "a").mkdir(parents=True)
    shutil.copy(out / "results.json", committed / "a" / "results.json")
    env = {**os.environ, "PYTHON": sys.executable, "PAPER_PIECE_PLAN": str(plan_file),
           "PAPER_PIECE_RUNS": str(tmp_path / "runs")}
    proc = subprocess.run([str(ROOT / "scripts" / "paper-piece"), "b", str(tmp_path / "OUT")],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "paper-piece: b exit 0" in proc.stdout
    assert sorted(str(p.relative_to(tmp_path / "OUT")) for p in (tmp_path / "OUT").rglob("*")
                  if p.is_file()) == ["b/results.json", "b/results.md", "paper-piece.log"]
    shutil.copytree(tmp_path / "OUT" / "b", committed / "b")
    for name in ("a", "b"):
        out = tmp_path / "runs" / name
        settings = json.loads(next(out.rglob("config.json")).read_text())
        assert settings["cut_fingerprint"] == manifest["fingerprint"]  # the trainer's record
        setup = json.loads((out / "results.json").read_text())["setup"]
        assert setup["piece"] == name and setup["data_fingerprints"] == [manifest["fingerprint"]]
    capsys.readouterr()

    assert sweep.main(["report", "--pieces", str(committed), "--plan", str(plan_file)]) == 0
    merged = json.loads((committed / "results.json").read_text())
    (row,) = merged["rows"]
    ppl = [final_ppl(next((tmp_path / "runs" / n).rglob("metrics.jsonl")).parent)
           for n in ("a", "b")]
    assert row["test_ppl"]["mean"] == pytest.approx(statistics.fmean(ppl))
    assert row["test_ppl"]["sd"] == pytest.approx(statistics.stdev(ppl))
    assert [r["seed"] for r in row["runs"]] == [0, 1] and row["lr"] == 0.002
    markdown = (committed / "results.md").read_text()
    assert "2 of 3 pieces done" in markdown
    assert "- c (seed 0, 2x the paper rates: sage-hybrid): not run yet: " \
           "`scripts/paper-piece c OUT_DIR`" in markdown
    assert f"data fingerprint `{manifest['fingerprint']}`" in markdown
    assert [p["state"] for p in merged["pieces"]] == ["done", "done", "missing"]
    # the rate piece is missing: its cell is there, not started; the 1x cell has seed 0 only
    cells = {(c["config"], c["lr"]): c["runs"] for c in merged["lr_sweep"]}
    assert [r["status"] for r in cells[("sage-hybrid", 0.004)]] == ["not started"]
    assert [r["seed"] for r in cells[("sage-hybrid", 0.002)]] == [0]
    assert (committed / "loss_vs_tokens.png").read_bytes()[:8] == PNG
    assert "- a (seed 0" in capsys.readouterr().out

    # refusals, each one line naming the piece's file and what differs
    piece_a = committed / "a" / "results.json"
    original = piece_a.read_text()
    for edit, message in (
            (lambda d: d["setup"].update(data_fingerprints=["0" * 64]),
             "was trained on data of fingerprint 0000000000000000, not "),
            (lambda d: d["setup"].update(steps=5), "another protocol than the plan tiny-test: "
             "--steps 4 -> 5"),
            (lambda d: d["setup"].update(piece="z"), "is piece z, which the plan tiny-test")):
        data = json.loads(original)
        edit(data)
        piece_a.write_text(json.dumps(data))
        assert sweep.main(["report", "--pieces", str(committed), "--plan", str(plan_file)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and str(piece_a) in err and message in err, err
    piece_a.write_text(original)
    shutil.copytree(committed / "a", committed / "again")
    assert sweep.main(["report", "--pieces", str(committed), "--plan", str(plan_file)]) == 2
    assert "piece a is there twice" in capsys.readouterr().err


def _write_piece(folder, plan, name="a", runs=None):
    """A piece's results.json as the sweep writes it, from run records made by hand."""
    run = report.RunRecord(
        "sage-hybrid", 0.002, 0, pathlib.Path("/runs/a"), 4, "finished", step_reached=4,
        evals=report.EvalCurve((2, 4), (1100.0, 1024.0), (1.0, 2.0), (100.0, 110.0)),
        losses=((1, 7.0), (2, 6.9), (3, 6.95), (4, 6.93)), tokens_per_s=105.0,
        opt_state_bytes=4096, peak_rss_bytes=2**30)
    runs = runs or (run,)
    setup = {**plan.protocol.setup(), "piece": name, "data_fingerprints": [plan.fingerprint],
             "data_tokens": None}
    summary = report.summarize([report.Row("sage-hybrid", 0.002, runs)],
                               {("sage-hybrid", 0.002): runs}, "slowest", setup)
    path = folder / name / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(summary), indent=2))
    return path


def _every_run(d):
    return [r for section in ("rows", "lr_sweep") for entry in d[section] for r in entry["runs"]]


def _set_ppl(value):
    def edit(d):
        for r in _every_run(d):
            r["evals"]["ppl"] = [value] * len(r["evals"]["ppl"])
    return edit


def _set(**fields):
    def edit(d):
        for r in _every_run(d):
            r.update(fields)
    return edit


def _consistent(d):
    """Every derived field edited to agree with a made-up perplexity: the digest tells."""
    for r in _every_run(d):
        r["evals"]["ppl"][-1] = r["final_test_ppl"] = 5.0
    for row in d["rows"]:
        row["test_ppl"]["mean"] = 5.0
    for cell in d["lr_sweep"]:
        cell["cell"] = "5.00"


@pytest.mark.parametrize(("edit", "message"), [
    (_set_ppl(5.0), "rows[0].runs[0].final_test_ppl (sage-hybrid lr 0.002 seed 0) is 1024.0, "
     "but the run's record gives 5.0"),
    (_set_ppl(-3.0), "rows[0].runs[0] (sage-hybrid lr 0.002 seed 0): evals.ppl holds -3.0"),
    (_set(step_reached=1), "status 'finished' at step 1 of 4 (step_reached)"),
    (_set(status="great"), "status 'great' is none of finished, diverged"),
    (lambda d: d["rows"][0]["test_ppl"].update(mean=5.0),
     "rows[0].test_ppl (sage-hybrid) is {'mean': 5.0"),
    (lambda d: d["lr_sweep"][0]["runs"][0].update(tokens_per_s=1.0),
     "lr_sweep[0].runs[0] (sage-hybrid lr 0.002 seed 0) differs from the same run in "
     "rows[0].runs[0]"),
    (_consistent, "digest does not match the runs' records"),
    (lambda d: d.pop("digest"), "digest is missing"),
])
def test_an_edited_piece_is_refused_when_merged(tmp_path, capsys, edit, message):
    plan = tiny_plan(tmp_path / "cut", "e" * 64)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan.to_json()))
    path = _write_piece(tmp_path / "pieces", plan)
    argv = ["report", "--pieces", str(tmp_path / "pieces"), "--plan", str(plan_file)]
    assert sweep.main(argv) == 0  # as written: merged
    merged = json.loads((tmp_path / "pieces" / "results.json").read_text())
    assert merged["rows"][0]["test_ppl"]["mean"] == 1024.0
    assert merged["digest"] == report.records_digest(merged)
    capsys.readouterr()
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"sage-repro report: error: {path}: ")
    assert message in err, err


def test_a_piece_on_another_cut_is_refused_before_it_trains(tmp_path, capsys):
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / cut.MANIFEST).write_text(json.dumps({"fingerprint": "f" * 64}))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(tiny_plan(tmp_path / "cut", "e" * 64).to_json()))
    argv = ["sweep", "--piece", "a", "--plan", str(plan_file), "--out", str(tmp_path / "o")]
    assert sweep.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds the cut ffffffffffffffff, but the pieces of " \
        "tiny-test train on eeeeeeeeeeeeeeee" in err
    shutil.rmtree(tmp_path / "cut")
    assert sweep.main(argv) == 2
    assert "which is missing or damaged: make it with sage-repro cut-data" in (
        capsys.readouterr().err)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--piece", "p1", "--steps", "5"], "--piece fixes --steps (the plan's protocol)"),
    (["--piece", "p1", "--configs", "adamw"], "--piece fixes --configs"),
    (["--piece", "p99", "--dry-run"], "--piece p99 is not a piece of the plan paper-20m: p1,"),
    (["--plan", "x.json", "--steps", "5"], "--plan goes with --piece"),
    (["--piece", "p1", "--plan", "nope.json"], "--plan nope.json cannot be read"),
])
def test_bad_piece_options_are_one_line(tmp_path, capsys, args, message):
    assert sweep.main(["sweep", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def _p1_twice(d):
    d["pieces"][1]["name"] = "a"


def _edit(part, **fields):
    def edit(d):
        (d["protocol"] if part == "protocol" else d["pieces"][0]).update(fields)
    return edit


@pytest.mark.parametrize(("edit", "message"), [
    (_p1_twice, "pieces[1].name 'a' is the name of pieces[0] too"),
    (_edit("protocol", model="huge"), "protocol.model: "),
    (_edit("protocol", steps="2"), "protocol.steps must be an integer in [1, "),
    (_edit("protocol", steps=0), "protocol.steps must be an integer in [1, "),
    (_edit("protocol", eval_every=0), "protocol.eval_every must be an integer in [1, "),
    (_edit("protocol", trainer_args="--remat dots"),
     "protocol.trainer_args must be a list of strings"),
    (_edit("protocol", trainer_args=["--steps", "9"]), "protocol.trainer_args sets --steps"),
    (_edit("protocol", schedule="wsd"), "protocol.schedule must be one of cosine, linear"),
    (_edit("protocol", seq_len=4096), "protocol.seq_len 4096 is longer than the tiny model"),
    (_edit("protocol", warmup_frac=1.5), "protocol.warmup_frac must be a number in [0, 1)"),
    (_edit("protocol", stpes=4), "protocol.stpes is not a protocol field"),
    (_edit("piece", lr_factor=-1), "pieces[0].lr_factor (piece a) must be a finite number > 0"),
    (_edit("piece", configs=["sage"]), "pieces[0].configs (piece a): unknown configuration"),
    (_edit("piece", seeds=[0, 0]), "pieces[0].seeds (piece a) must be a non-empty list of "
     "distinct integers"),
    (_edit("piece", seeds="0"), "pieces[0].seeds (piece a) must be"),
])
def test_a_bad_plan_is_refused_before_anything_runs(tmp_path, capsys, edit, message):
    """The dry run too: one line naming the plan file and the field, exit status 2."""
    data = tiny_plan(tmp_path / "cut", "e" * 64).to_json()
    edit(data)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(data))
    for argv in (["sweep", "--piece", "all", "--dry-run"],
                 ["sweep", "--piece", "a", "--out", str(tmp_path / "o")],
                 ["report", "--pieces", str(tmp_path)]):
        assert sweep.main([*argv, "--plan", str(plan_file)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--plan {plan_file}: " in err and message in err, err
    assert not (tmp_path / "o").exists()


def test_the_paper_plan():
    plan = pieces.PAPER_PLAN
    assert plan.protocol.model == "20m" and plan.protocol.data == "data/paper-cut"
    assert (plan.protocol.batch_size, plan.protocol.seq_len) == (256, 512)
    # one pass at most over the 20M train tokens that sage-repro cut-data takes by default
    assert plan.protocol.steps * plan.protocol.tokens_per_step <= 20_000_000
    specs = [s for p in plan.pieces for s in p.specs()]
    assert len(specs) == len(set(specs)) == 40
    assert all(len(p.specs()) <= 4 for p in plan.pieces)
    for config in CONFIG_NAMES:  # seeds 0-2 at the paper rate, seed 0 at half and twice it
        rate = get_preset(config).learning_rate
        got = sorted((round(s.lr / rate, 9), s.seed) for s in specs if s.config == config)
        assert got == [(0.5, 0), (1, 0), (1, 1), (1, 2), (2, 0)]
    first = {s.config for p in plan.pieces[:2] for s in p.specs()}
    assert first == set(CONFIG_NAMES)  # p1 and p2: the eight at their paper rates, seed 0
    assert pieces.PiecePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_the_dry_run_by_hand(capsys):
    """At 100 TFLOP/s and 30 s a run: N = 17,554,176; a run trains 150 x 131,072 tokens
    (6·N·D = 2.0710e15 FLOP) and evaluates 10 x 4 x 131,072 tokens (2·N·D = 1.8407e14):
    22.55 s + 30 s; a piece of 4 runs and 15 s: 225.2 s = 3.8 min."""
    assert sweep.main(["sweep", "--piece", "all", "--dry-run", "--assume-tflops", "100",
                       "--assume-overhead", "30"]) == 0
    out = capsys.readouterr().out
    n, tokens = 17_554_176, 150 * 131_072
    per_run = 30 + (6 * n * tokens + 2 * n * 10 * 4 * 131_072) / 100e12
    assert f"{(15 + 4 * per_run) / 60:.1f}" == "3.8"
    assert "ESTIMATE, not a measurement: 100 TFLOP/s achieved, 30 s a run" in out
    assert out.count(": 3.8 min") == 10 and "in all 37.5 min" in out
    assert "  p1: 4 runs, seed 0, 1x paper rates (sage-hybrid 0.002, lion-hybrid 0.002, " \
           "adamw 0.0001, lion 0.0001)" in out
    assert f"6·N·D = {6 * n * tokens:.3g} FLOP" in out


def test_a_run_survives_json():
    """Every field of a run, NaN included (strict JSON has none: it comes back as NaN)."""
    run = report.RunRecord(
        "lion", 1e-4, 2, pathlib.Path("/x/run"), 30, "diverged", step_reached=20,
        evals=report.EvalCurve((10, 20), (45.0, math.nan), (1.5, 3.0)),
        losses=((10, 3.8), (20, math.inf)), tokens_per_s=1234.5, opt_state_bytes=4096,
        peak_device_bytes=2**30, peak_rss_bytes=2**31, stop_step=17,
        reason="loss became nan at step 17", environment={"platform": "gpu", "cpu_count": 16},
        dates=("2026-01-01T00:00:00+00:00", "2026-01-01T00:01:00+00:00"))
    back = report.run_from_json(json.loads(json.dumps(report.run_to_json(run),
                                                      allow_nan=False)))
    assert math.isnan(back.evals.ppl[1]) and math.isnan(back.losses[1][1])
    same = {"evals": run.evals, "losses": run.losses}
    assert {**vars(back), **same} == {**vars(run), **same}
    assert back.evals.steps == run.evals.steps and back.losses[0] == run.losses[0]
