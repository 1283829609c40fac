"""Issue 46's grid (sage_repro.pieces.GRID_PLAN) and its data (sage_train.data.pack).

The whole grid's plumbing on the tiny model (a rate piece, its widening piece and its
best-rate seeds piece, each resolved from the pieces before it, merged at the best rate);
the edge rule and the best-rate selection on hand-made results; a pack cut in a fresh
process with the fingerprint it records; the committed pack against the grid plan (one
source, CPython's standard library, with its licence); the grid's protocol and its dry run
checked by hand.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import math
import os
import pathlib
import platform
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig

import jax
import pytest
from corpus_helpers import make_tree

from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_repro import pieces, sweep
from sage_repro import sweep_report as report
from sage_train.data import corpus, pack
from sage_train.model.shapes import MODELS, get_model_config

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _pack(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict]:
    """A pack of a 240-document tree for the tiny model."""
    make_tree(tmp_path / "tree", 240)
    (tmp_path / "LICENSE.txt").write_text("the tree's licence\n")
    source = pack.PackSource("tree", corpus.Root("pkgs", tmp_path / "tree"),
                             tmp_path / "LICENSE.txt", "the tree, under its licence\n")
    folder = tmp_path / "pack"
    return folder, pack.make_pack(source, folder, train_bytes=40_000, test_bytes=8_000,
                                  vocab_size=MODELS["tiny"].vocab_size)


def _cut_in_fresh_process(argv: list[str], cwd: pathlib.Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sage_repro", "cut-data", *argv], cwd=cwd,
                          capture_output=True, text=True, env=env, timeout=300, check=False)


def test_a_pack_is_cut_in_a_fresh_process_with_its_recorded_fingerprint(tmp_path):
    folder, manifest = _pack(tmp_path)
    assert sorted(p.name for p in folder.iterdir()) == [
        "LICENSE", "NOTICE", "pack.json", "test.jsonl.xz", "tokenizer.json", "train.jsonl.xz"]
    # the source's licence travels verbatim, named in the manifest and the fingerprint
    assert (folder / "LICENSE").read_text() == "the tree's licence\n"
    assert (folder / "NOTICE").read_text() == "the tree, under its licence\n"
    assert manifest["source"]["name"] == "tree"
    assert manifest["source"]["licence"]["sha256"] == pack._sha256(b"the tree's licence\n")
    other = {**manifest, "source": {**manifest["source"], "name": "another"}}
    assert pack.pack_fingerprint(other) != manifest["fingerprint"]
    old = tmp_path / "old"  # a pack of the first format (no source): one line, remake it
    shutil.copytree(folder, old)
    (old / "pack.json").write_text(json.dumps({**manifest, "format": 1}))
    with pytest.raises(ValueError, match="format 1, this sage_train reads format 2 only"):
        pack.load_pack(old, MODELS["tiny"].vocab_size)
    # the draw keeps each side's budget and the corpus's split
    for side in ("train", "test"):
        texts = [json.loads(x) for x in lzma.decompress(
            (folder / f"{side}.jsonl.xz").read_bytes()).decode().splitlines()]
        assert len(texts) == manifest[side]["documents"] > 0
        assert sum(len(t.encode()) for t in texts) == manifest[side]["bytes"] <= (
            manifest[side]["budget"])
        assert all(corpus.is_test_document(pack._sha256(t.encode())) == (side == "test")
                   for t in texts)
    proc = _cut_in_fresh_process(["--data", str(folder), "--out", str(tmp_path / "cut"),
                                  "--model", "tiny"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    printed = re.search(r"^fingerprint\s+(\w+)$", proc.stdout, re.M)
    assert printed is not None and printed.group(1) == manifest["cut"]["fingerprint"]
    made = json.loads((tmp_path / "cut" / "cut.json").read_text())
    assert made["fingerprint"] == manifest["cut"]["fingerprint"]
    assert made["source"]["fingerprint"] == manifest["fingerprint"]
    # a pack whose text changed is one line naming the file
    damaged = tmp_path / "damaged"
    shutil.copytree(folder, damaged)
    texts = lzma.decompress((damaged / "test.jsonl.xz").read_bytes()).replace(b"a", b"b", 1)
    (damaged / "test.jsonl.xz").write_bytes(lzma.compress(texts))
    proc = _cut_in_fresh_process(["--data", str(damaged), "--out", str(tmp_path / "c2"),
                                  "--model", "tiny"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "test.jsonl.xz" in proc.stderr and "does not match pack.json" in proc.stderr
    assert not (tmp_path / "c2").exists()


def test_the_committed_pack_is_the_grid_plans_data():
    plan = pieces.GRID_PLAN
    folder = ROOT / plan.pack
    manifest = json.loads((folder / "pack.json").read_text())
    assert manifest["cut"]["fingerprint"] == plan.fingerprint
    assert pack.pack_fingerprint(manifest) == manifest["fingerprint"]
    assert manifest["vocab_size"] == get_model_config(plan.protocol.model).vocab_size
    texts = {}
    for side in ("train", "test"):  # the text arrives whole (its tokens: the slow CPU check)
        payload = lzma.decompress((folder / manifest[side]["file"]).read_bytes())
        assert pack._sha256(payload) == manifest[side]["sha256"]
        texts[side] = [json.loads(line) for line in payload.decode().splitlines()]
    # one source, CPython's standard library, and its licence beside it: the PSF License
    source = manifest["source"]
    python = source["python"]
    assert source["name"] == f"cpython-{python}-stdlib" and source["implementation"] == "CPython"
    licence = (folder / "LICENSE").read_bytes()
    assert pack._sha256(licence) == source["licence"]["sha256"]
    assert b"PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2" in licence
    assert f"CPython {python}" in (folder / "NOTICE").read_text()
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 8 << 20
    if platform.python_implementation() == "CPython" and platform.python_version() == python:
        # this interpreter is the one the text came from: every document is one of its
        # standard library's .py files, read here independently of sage_train
        stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
        assert (stdlib / "LICENSE.txt").read_bytes() == licence
        hashes = set()
        for path in stdlib.rglob("*.py"):
            if not {"site-packages", "dist-packages"} & set(path.relative_to(stdlib).parts):
                with contextlib.suppress(UnicodeDecodeError, OSError):
                    hashes.add(pack._sha256(path.read_bytes().decode().encode()))
        assert all(pack._sha256(t.encode()) in hashes for side in texts for t in texts[side])


def test_a_pack_takes_one_named_source(tmp_path, capsys):
    source = pack.stdlib_source()
    assert source.root.path == pathlib.Path(sysconfig.get_paths()["stdlib"])
    assert source.root.python_only and "site-packages" in source.root.skip_dirs
    assert "test" not in source.root.skip_dirs  # its test package is read
    assert source.licence == source.root.path / "LICENSE.txt"
    assert source.name == f"cpython-{platform.python_version()}-stdlib"
    assert sorted(pack.SOURCES) == ["stdlib"]
    with pytest.raises(SystemExit):  # no other source, no mix of sources
        pack.main(["--source", "installed", "--out", str(tmp_path / "p"), "--train-bytes",
                   "1", "--test-bytes", "1", "--vocab-size", "1024"])
    assert "invalid choice: 'installed'" in capsys.readouterr().err
    assert pack.main(["--source", "stdlib", "--out", str(tmp_path / "p"), "--train-bytes",
                      "0", "--test-bytes", "1", "--vocab-size", "1024"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--train-bytes must be an integer >= 1" in err


def test_the_grid_protocol_by_hand():
    plan = pieces.GRID_PLAN
    p = plan.protocol
    n = get_model_config(p.model).param_count()  # embeddings counted (tied: once)
    tokens = p.steps * p.tokens_per_step
    assert tokens / n >= 10
    train = json.loads((ROOT / plan.pack / "pack.json").read_text())["cut"]["train_tokens"]
    # each token seen at most ~4 times (3.8: the whole standard library's train side at a
    # 1,024-token vocabulary, docs/reproduce.md), and the model's vocabulary is the pack's
    assert tokens / train <= 4
    assert get_model_config(p.model).vocab_size == json.loads(
        (ROOT / plan.pack / "pack.json").read_text())["vocab_size"]
    assert (p.batch_size, p.seq_len, p.schedule, p.warmup_frac) == (256, 512, "cosine", 0.1)
    assert (p.b1, p.b2, p.weight_decay) == (None, None, None)  # each configuration's (paper's)
    rates = {pc.configs[0]: pc.specs() for pc in plan.pieces if pc.stage == "rates"}
    assert sorted(rates) == sorted(CONFIG_NAMES)
    for config, specs in rates.items():
        lrs = sorted(s.lr for s in specs)
        paper = get_preset(config).learning_rate
        assert len(lrs) >= 4 and lrs[-1] / lrs[0] >= 30 - 1e-9
        assert lrs[0] < paper < lrs[-1]  # around the paper rate, not at an edge
        assert {s.seed for s in specs} == {0}
    for stage, seeds in (("widen", (0,)), ("best", (1, 2))):
        assert sorted(pc.configs[0] for pc in plan.pieces if pc.stage == stage) == sorted(
            CONFIG_NAMES)
        assert all(pc.seeds == seeds for pc in plan.pieces if pc.stage == stage)


def test_the_grid_dry_run_by_hand(capsys):
    argv = ["sweep", "--piece", "all", "--plan", "grid", "--dry-run", "--assume-tflops", "80",
            "--assume-overhead", "18"]
    assert sweep.main(argv) == 0
    out = capsys.readouterr().out
    p = pieces.GRID_PLAN.protocol
    n = get_model_config(p.model).param_count()
    evaluations = -(-p.steps // p.eval_every)
    per_run = 18 + (6 * n * p.steps * 131072 + 2 * n * evaluations * 4 * 131072) / 80e12
    runs = 8 * 5 + 8 * 1 + 8 * 2  # rates, at most one widening rate, two seeds at the best
    total = 24 * pieces.PIECE_OVERHEAD_S + runs * per_run
    assert f"in all {total / 60:.1f} min of GPU time, in " in out
    assert "  w-adamw: at most 1 run, seed 0, one rate beyond" in out and " 1 runs" not in out
    calls = [line.split(": ", 1)[1].split() for line in out.splitlines()
             if line.startswith("  call ")]
    assert len(calls) <= 6
    order = [name for call in calls for name in call]
    assert sorted(order) == sorted(pc.name for pc in pieces.GRID_PLAN.pieces)
    assert pieces.piece_command(pieces.GRID_PLAN) == "PAPER_PIECE_PLAN=grid scripts/paper-piece"
    assert pieces.piece_command(pieces.PAPER_PLAN) == "scripts/paper-piece"
    for config in CONFIG_NAMES:  # the sweep, then its widening, then its seeds
        assert order.index(f"r-{config}") < order.index(f"w-{config}") < order.index(
            f"s-{config}")


@pytest.mark.parametrize(("rates", "best", "side", "wider"), [
    ((1e-3, 3e-3, 1e-2), 3e-3, None, None),
    ((1e-3, 3e-3, 1e-2), 1e-2, "high", 0.0333333),
    ((1e-3, 3e-3, 1e-2), 1e-3, "low", 0.000333333),
    ((3e-5, 1e-4, 3e-4, 1e-3, 3e-3), 3e-3, "high", 0.009),
    ((1e-3, 1e-2), 1e-2, None, None),  # two rates have no inside
    ((1e-3, 3e-3, 1e-2), None, None, None),
])
def test_the_edge_rule(rates, best, side, wider):
    assert pieces.edge(rates, best) == side
    assert pieces.widened_rate(rates, best) == wider


def _write(folder: pathlib.Path, plan: pieces.PiecePlan, name: str,
           finals: dict[tuple[float, int], float | None]) -> None:
    """Piece ``name``'s results.json from made-up runs: ``{(lr, seed): final ppl}``
    (``None``: diverged)."""
    config = plan.piece(name).configs[0]
    runs = []
    for (lr, seed), ppl in finals.items():
        if ppl is None:
            runs.append(report.RunRecord(config, lr, seed, pathlib.Path("-"), 4, "diverged",
                                         step_reached=2, losses=((1, 7.0), (2, math.inf))))
            continue
        runs.append(report.RunRecord(
            config, lr, seed, pathlib.Path("-"), 4, "finished", step_reached=4,
            evals=report.EvalCurve((2, 4), (2 * ppl, ppl), (1.0, 2.0), (100.0, 110.0)),
            losses=((1, 7.0), (2, 6.9), (3, 6.95), (4, 6.93)), tokens_per_s=100.0,
            opt_state_bytes=64, peak_rss_bytes=2**20))
    cells = {(config, r.lr): (r,) for r in runs}
    setup = {**plan.protocol.setup(), "piece": name, "data_fingerprints": [plan.fingerprint],
             "data_tokens": None}
    summary = report.summarize([report.Row(config, runs[0].lr, (runs[0],))], cells, "slowest",
                               setup)
    path = folder / name / "results.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report.to_json(summary)))


def _small_plan(folder: pathlib.Path, data: str = "cut", fingerprint: str = "f" * 64
                ) -> pieces.PiecePlan:
    protocol = sweep.Protocol(model="tiny", data=data, steps=4, batch_size=2, seq_len=16,
                              eval_every=2, eval_batches=1, log_every=1, checkpoint_every=4,
                              trainer_args=("--sharding", "none"))
    return pieces.PiecePlan("grid-test", protocol, (
        pieces.Piece("r", ("sage-hybrid",), (0,), lr_factors=(0.5, 1.0, 2.0)),
        pieces.Piece("w", ("sage-hybrid",), (0,), stage="widen"),
        pieces.Piece("s", ("sage-hybrid",), (1,), stage="best")),
        fingerprint=fingerprint, rows="best", folder=str(folder))


def test_best_rate_selection_widening_and_the_merge_on_made_up_pieces(tmp_path):
    folder = tmp_path / "benchmarks"
    plan = _small_plan(folder)
    assert pieces.PiecePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    r, w, s = plan.pieces
    with pytest.raises(sweep.SweepError, match="needs sage-hybrid's learning-rate sweep first"):
        pieces.resolve(plan, w, [folder])
    # the lowest rate diverged (never best); the best of the rest, 0.004, is at the top edge
    _write(folder, plan, "r", {(0.001, 0): None, (0.002, 0): 300.0, (0.004, 0): 200.0})
    assert pieces.resolve(plan, w, [folder]) == (0.008,)
    with pytest.raises(sweep.SweepError, match="at an edge of its sweep; widen it first: piece w"):
        pieces.resolve(plan, s, [folder])
    summary, progress = pieces.merge(folder, plan)
    (row,) = summary.rows
    assert row.lr == 0.004 and "best rate at the high edge of the sweep: widen it (piece w)" in (
        row.remark)
    assert [p["state"] for p in progress] == ["done", "missing", "missing"]
    # widened, and better still: at the new edge, with no further widening piece
    edge_case = tmp_path / "edge"
    shutil.copytree(folder, edge_case)
    _write(edge_case, plan, "w", {(0.008, 0): 150.0})
    (row,) = pieces.merge(edge_case, plan)[0].rows
    assert row.lr == 0.008 and row.remark.startswith(
        "best rate still at the high edge after widening: widen further")
    # widened: 0.008 is worse, so 0.004 is inside the sweep now; the seeds go there
    _write(folder, plan, "w", {(0.008, 0): 250.0})
    assert pieces.resolve(plan, s, [folder]) == (0.004,)
    _write(folder, plan, "s", {(0.004, 1): 220.0})
    summary, progress = pieces.merge(folder, plan)
    (row,) = summary.rows
    assert (row.lr, [x.seed for x in row.runs]) == (0.004, [0, 1])
    # evaluations at steps 2 and 4 of ppl 2p and p: at step 3.6 the loss is log(p) +
    # 0.2 log 2, so the last 10% lowered it by 0.2 log 2 / (log p + 0.2 log 2)
    drops = [0.2 * math.log(2) / (math.log(p) + 0.2 * math.log(2)) for p in (200.0, 220.0)]
    assert row.remark == (f"last 10% of steps lowered the test loss by {100 * max(drops):.1f}%"
                          " at most: PAST the early transient (< 3%)")
    assert statistics.fmean(x.final_ppl for x in row.runs) == 210.0
    assert sorted(lr for (_, lr) in summary.cells) == [0.001, 0.002, 0.004, 0.008]
    assert [p["state"] for p in progress] == ["done", "done", "done"]
    # seeds trained at a rate that is not the best any more are named, not averaged in
    _write(folder, plan, "s", {(0.002, 1): 220.0})
    (row,) = pieces.merge(folder, plan)[0].rows
    assert [x.status for x in row.runs] == ["finished", "not started"]
    assert "seeds of piece s ran at 0.002, not the best rate" in row.remark
    # a best rate inside the first sweep: the widening piece is not needed
    other = tmp_path / "other"
    _write(other, plan, "r", {(0.001, 0): 300.0, (0.002, 0): 200.0, (0.004, 0): 250.0})
    assert pieces.resolve(plan, w, [other]) == ()
    _, progress = pieces.merge(other, plan)
    assert [p["state"] for p in progress] == ["done", "not needed", "missing"]
    lines = pieces.progress_lines(progress, pieces.COMMAND)
    assert "- w (seed 0, one rate beyond the edge of the sweep if best there: sage-hybrid): " \
           "not needed (the best rate is inside the sweep)" in lines


def test_the_late_drop_by_hand():
    curve = report.EvalCurve((50, 80, 100), (math.exp(4.0), math.exp(3.0), math.exp(2.9)),
                             (1.0, 2.0, 3.0))
    run = report.RunRecord("adamw", 1e-3, 0, pathlib.Path("-"), 100, "finished",
                           step_reached=100, evals=curve)
    # step 90: halfway from 3.0 (step 80) to 2.9 (step 100): 2.95, then 2.9 at the end
    assert pieces.late_drop(run, 100) == pytest.approx(0.05 / 2.95)
    assert pieces.late_drop(run, 200) is None  # it did not reach the last step
    diverged = report.RunRecord("adamw", 1e-3, 0, pathlib.Path("-"), 100, "diverged",
                                step_reached=100, evals=curve)
    assert pieces.late_drop(diverged, 100) is None


def test_the_whole_grid_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    folder, manifest = _pack(tmp_path)
    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "benchmarks"
    plan = _small_plan(committed, data="cut", fingerprint=manifest["cut"]["fingerprint"])
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps({**plan.to_json(), "pack": str(folder)}))
    assert sweep.main(["cut-data", "--plan", str(plan_file)]) == 0
    assert "plan         grid-test: the same fingerprint" in capsys.readouterr().out
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", jax.config.jax_compilation_cache_dir)
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # the GPU machine's command: the three pieces in turn, each later one reading the ones
    # before it under runs/pieces; the rate piece's three runs in one trainer process
    for name, more in (("r", ["--one-process"]), ("w", []), ("s", [])):
        assert sweep.main(["sweep", "--piece", name, "--plan", str(plan_file), *more]) == 0
    runs = pathlib.Path("runs/pieces")
    r_runs = json.loads((runs / "r" / "results.json").read_text())
    finals = {run["lr"]: run["final_test_ppl"] for cell in r_runs["lr_sweep"]
              for run in cell["runs"]}
    assert sorted(finals) == [0.001, 0.002, 0.004]
    # the third run of that process is the run trained in a process of its own, bit for bit
    argv = ["sweep", "--model", "tiny", "--configs", "sage-hybrid", "--lrs", "0.004",
            "--seeds", "0", "--steps", "4", "--batch-size", "2", "--seq-len", "16",
            "--eval-every", "2", "--eval-batches", "1", "--log-every", "1",
            "--checkpoint-every", "4", "--data", "cut", "--out", "ref", "--", "--sharding",
            "none"]
    assert sweep.main(argv) == 0
    alone = json.loads(pathlib.Path("ref/results.json").read_text())["rows"][0]["runs"][0]
    batched = next(run for cell in r_runs["lr_sweep"] for run in cell["runs"]
                   if run["lr"] == 0.004)
    assert alone["evals"]["ppl"] == batched["evals"]["ppl"]  # the timings differ, not the math
    assert alone["losses"] == batched["losses"]
    first_best = min(finals, key=finals.__getitem__)
    wider = pieces.widened_rate(list(finals), first_best)
    if wider is None:
        assert not (runs / "w").exists()
    else:
        w_runs = json.loads((runs / "w" / "results.json").read_text())
        finals.update({run["lr"]: run["final_test_ppl"] for cell in w_runs["lr_sweep"]
                       for run in cell["runs"]})
        assert sorted(finals) == sorted([0.001, 0.002, 0.004, wider])
    best = min(finals, key=finals.__getitem__)
    s_runs = json.loads((runs / "s" / "results.json").read_text())
    assert [(run["lr"], run["seed"]) for run in s_runs["rows"][0]["runs"]] == [(best, 1)]
    # two or three pieces merged, as committed
    for name in ("r", "w", "s"):
        if (runs / name).exists():
            (committed / name).mkdir(parents=True)
            shutil.copy(runs / name / "results.json", committed / name / "results.json")
    capsys.readouterr()
    assert sweep.main(["report", "--pieces", str(committed), "--plan", str(plan_file)]) == 0
    merged = json.loads((committed / "results.json").read_text())
    (row,) = merged["rows"]
    assert row["lr"] == best and [r["seed"] for r in row["runs"]] == [0, 1]
    seed1 = s_runs["rows"][0]["runs"][0]["final_test_ppl"]
    assert row["test_ppl"]["mean"] == pytest.approx(statistics.fmean([finals[best], seed1]))
    assert merged["setup"]["data_fingerprints"] == [manifest["cut"]["fingerprint"]]
    assert [p["state"] for p in merged["pieces"]] == [
        "done", "not needed" if wider is None else "done", "done"]
    for figure in ("loss_vs_tokens.png", "lr_sweep.png"):  # the loss and learning-rate curves
        assert (committed / figure).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
