"""The paper's tables and figures, reproduced at the scale this machine allows.

Four parts, each a subcommand (``all`` runs them in order)::

    python benchmarks/paper_tables.py memory
    python benchmarks/paper_tables.py convergence [--model tiny] [--steps 240] [--seeds 0 1 2]
    python benchmarks/paper_tables.py sweep [--configs sage-hybrid lion-hybrid] [--lrs ...]
    python benchmarks/paper_tables.py figures
    python benchmarks/paper_tables.py all --out runs/paper

* ``memory``: the Appendix memory table for 270M / 0.6B / 1.3B, computed exactly from
  ``jax.eval_shape`` (:mod:`sage_repro.memory_report`), next to the paper's figures.
* ``convergence``: the main table (``tab:main_results``) in form: every configuration
  trained by :func:`sage_train.run.train.train` on the embedded standard-library corpus with the
  same token budget and schedule (cosine, 10% warmup), at its paper learning rate, for each
  seed; final test perplexity mean and spread (min–max over seeds), optimizer-state memory,
  raw throughput and the paper's *effective throughput* (Appendix, after Scetbon et al.):
  ``T_eff(O) = N_base / T_O``, where ``N_base`` is the number of training tokens the
  reference baseline (``--reference``, the paper's Lion-Hybrid) needed to reach its own
  final test perplexity and ``T_O`` the training seconds optimizer ``O`` needed to reach that
  perplexity (``-`` if it never does).  Perplexities are means over seeds at each
  evaluation; tokens/s and the effective throughput medians over seeds (robust to a run
  slowed by another job on a shared machine).  The effective throughput is
  :func:`sage_repro.sweep_report.effective_throughput`'s: ``T_O`` is the time of O's steps
  at its measured tokens/s, tokens and time of the same steps (compilation, the first
  step, and evaluation excluded), so the reference against itself gives its own tokens/s.
* ``sweep``: the learning-rate grid of the paper (1e-4 … 2e-3) for SAGE-Hybrid and
  Lion-Hybrid, first seed only, final test perplexity per learning rate.
* ``figures``: PNGs of the test-perplexity curves (mean and min–max band over seeds), the
  H_t heatmap of SAGE-Hybrid's embedding (first steps and later, as the paper's figure) and
  the PCA of H_t (top-3 component trajectories and the PC1–PC2 path).

Each run lives in ``OUT/runs/<config>/lr<lr>/seed<k>`` and is skipped when it already
finished (its ``metrics.jsonl`` reaches the last step), so an interrupted reproduction
resumes where it stopped.  Tables are printed and written to ``OUT/tables.md`` (``all``) or
``OUT/tables-PART.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time
from collections.abc import Sequence

from sage_optim import CONFIG_NAMES, get_preset
from sage_optim.table import format_bytes, format_markdown_table
from sage_repro import sweep_report as report
from sage_repro.paper import PAPER_LR_GRID, PAPER_TEST_PPL
from sage_repro.sweep_report import mean_curve as mean_ppl

DEFAULT_OUT = pathlib.Path("runs/paper")
SAGE_RUN = "sage-hybrid"  # whose embedding damper H_t the figures show


@dataclasses.dataclass(frozen=True)
class Budget:
    """What every run of one reproduction shares (the same token budget for all)."""

    model: str = "tiny"
    steps: int = 240
    batch_size: int = 16
    seq_len: int = 128
    eval_every: int = 20
    eval_batches: int = 4

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step."""
        return self.batch_size * self.seq_len


@dataclasses.dataclass
class Curve:
    """One run's evaluations: step, test perplexity and training seconds at that step."""

    config: str
    lr: float
    seed: int
    steps: list[int]
    ppl: list[float]
    seconds: list[float]
    tokens_per_s: float
    opt_state_bytes: int
    rates: list[float] = dataclasses.field(default_factory=list)  # tokens/s at each eval

    @property
    def final_ppl(self) -> float:
        """Test perplexity at the last evaluation."""
        return self.ppl[-1]


def run_dir(out: pathlib.Path, config: str, lr: float, seed: int) -> pathlib.Path:
    """Where the run of ``config`` at ``lr`` with ``seed`` keeps its files."""
    return out / "runs" / config / f"lr{lr:g}" / f"seed{seed}"


def read_curve(path: pathlib.Path, config: str, lr: float, seed: int) -> Curve | None:
    """The evaluations recorded in ``path/metrics.jsonl`` (``None`` if there are none)."""
    from sage_train.store.figures import read_metrics

    if not (path / "metrics.jsonl").exists():
        return None
    records = read_metrics(path)
    evals = [r for r in records if "test_ppl" in r]
    if not evals:
        return None
    return Curve(
        config, lr, seed,
        steps=[r["step"] for r in evals],
        ppl=[r["test_ppl"] for r in evals],
        seconds=[r["elapsed_s"] for r in evals],
        tokens_per_s=records[-1]["tokens_per_s"],
        opt_state_bytes=records[-1]["opt_state_bytes"],
        rates=[r["tokens_per_s"] for r in evals],
    )


def train_one(out: pathlib.Path, budget: Budget, config: str, lr: float, seed: int,
              record_h: bool = False) -> Curve:
    """Train one configuration (or reuse a finished run) and return its curve."""
    from sage_train.run.train import TrainConfig, train

    path = run_dir(out, config, lr, seed)
    curve = read_curve(path, config, lr, seed)
    if curve is not None and curve.steps[-1] == budget.steps:
        return curve
    if path.exists():  # an unfinished run: start it again from scratch (timings stay clean)
        import shutil

        shutil.rmtree(path)
    cfg = TrainConfig(
        model=budget.model, optimizer=config, learning_rate=lr, steps=budget.steps,
        batch_size=budget.batch_size, seq_len=budget.seq_len, seed=seed,
        eval_every=budget.eval_every, eval_batches=budget.eval_batches, log_every=budget.steps,
        run_dir=str(path), checkpoint_every=budget.steps, sharding="none",
        record_h_every=1 if record_h else budget.steps + 1, progress=False,
    )
    t = time.perf_counter()
    result = train(cfg)
    if result.stopped_reason:
        print(f"  {config} lr={lr:g} seed={seed}: {result.stopped_reason}", file=sys.stderr)
    curve = read_curve(path, config, lr, seed)
    if curve is None:
        raise RuntimeError(f"{config} lr={lr:g} seed={seed} recorded no evaluation in {path}")
    print(f"  {config:<14} lr={lr:<7g} seed={seed}  test ppl {curve.final_ppl:9.2f}  "
          f"{curve.tokens_per_s:8.0f} tokens/s  ({time.perf_counter() - t:.0f} s)", flush=True)
    return curve


def mean_curve(curves: Sequence[Curve]) -> tuple[list[int], list[float], list[float]]:
    """Steps evaluated by every seed, with the mean perplexity and the median seconds there.

    Seconds are a median, not a mean: on a shared machine one run slowed by another job
    should not move the figure (perplexities do not depend on the machine's load)."""
    common, ppl = mean_ppl(curves)
    sec = [statistics.median(c.seconds[c.steps.index(s)] for c in curves) for s in common]
    return common, ppl, sec


def effective_throughput(reference: Sequence[Curve], curves: Sequence[Curve],
                         tokens_per_step: int) -> float | None:
    """The paper's ``T_eff = N_base / T_O`` (tokens per second; see the module docstring).

    The arithmetic is :func:`sage_repro.sweep_report.effective_throughput`'s (tokens and
    time of the same steps); this returns the median over the seeds of ``curves``.
    ``None`` if ``curves`` never reach the reference's final mean perplexity.
    """
    def evals(c: Curve) -> report.EvalCurve:
        return report.EvalCurve(tuple(c.steps), tuple(c.ppl), tuple(c.seconds),
                                tuple(c.rates))

    target = report.baseline_target(reference[0].config, reference[0].lr,
                                    [evals(c) for c in reference], tokens_per_step)
    if target is None:
        return None
    eff = report.effective_throughput([evals(c) for c in curves], target)
    return statistics.median(eff.values) if eff.values else None


def _spread(values: Sequence[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}" if len(values) > 1 else "-"


def convergence_table(runs: dict[str, list[Curve]], budget: Budget, reference: str) -> str:
    """The main table: one row per configuration (markdown)."""
    rows = []
    for config, curves in runs.items():
        finals = [c.final_ppl for c in curves]
        eff = effective_throughput(runs[reference], curves, budget.tokens_per_step) \
            if reference in runs else None
        paper = PAPER_TEST_PPL["270m"].get(config)
        rows.append([
            config,
            f"{curves[0].lr:g}",
            round(statistics.fmean(finals), 2),
            _spread(finals),
            format_bytes(curves[0].opt_state_bytes),
            round(statistics.median(c.tokens_per_s for c in curves)),
            "-" if eff is None else f"{eff:,.0f}",
            "-" if paper is None else f"{paper:g}",
        ])
    headers = ["configuration", "lr", "test ppl (mean)", "min–max over seeds",
               "optimizer state", "tokens/s", f"effective tokens/s (vs {reference})",
               "paper 270M ppl"]
    return format_markdown_table(headers, rows)


def sweep_table(sweep: dict[str, dict[float, Curve]]) -> str:
    """Final test perplexity per learning rate (rows) and configuration (columns)."""
    lrs = sorted({lr for per in sweep.values() for lr in per})
    rows = [[f"{lr:g}", *(round(sweep[c][lr].final_ppl, 2) if lr in sweep[c] else "-"
                          for c in sweep)] for lr in lrs]
    return format_markdown_table(["lr", *sweep], rows)


def run_convergence(out: pathlib.Path, budget: Budget, configs: Sequence[str],
                    seeds: Sequence[int]) -> dict[str, list[Curve]]:
    """Train every configuration at its paper learning rate for every seed."""
    runs: dict[str, list[Curve]] = {}
    for seed in seeds:  # seeds outermost: a partial reproduction still covers every config
        for config in configs:
            lr = get_preset(config).learning_rate
            curve = train_one(out, budget, config, lr, seed,
                              record_h=config == SAGE_RUN and seed == seeds[0])
            runs.setdefault(config, []).append(curve)
    return runs


def run_sweep(out: pathlib.Path, budget: Budget, configs: Sequence[str], lrs: Sequence[float],
              seed: int) -> dict[str, dict[float, Curve]]:
    """Train each configuration at each learning rate (one seed)."""
    return {c: {lr: train_one(out, budget, c, lr, seed) for lr in lrs} for c in configs}


def make_figures(out: pathlib.Path, runs: dict[str, list[Curve]], budget: Budget,
                 seed: int) -> list[pathlib.Path]:
    """The perplexity curves, H_t heatmap and H_t PCA as PNGs in ``out``."""
    from sage_train.store import figures

    curves = {c: [list(zip([s * budget.tokens_per_step for s in cv.steps], cv.ppl,
                           strict=True)) for cv in cs] for c, cs in runs.items()}
    seeds = len(next(iter(runs.values())))
    paths = [figures.plot_perplexity_curves(
        curves, out / "perplexity.png", xlabel="training tokens",
        title=f"LLaMA {budget.model}, paper learning rates: mean and min–max over {seeds} seeds")]
    sage_lr = get_preset(SAGE_RUN).learning_rate
    steps, h = figures.load_damper(run_dir(out, SAGE_RUN, sage_lr, seed))
    paths.append(figures.plot_damper_heatmap(steps, h, out / "damper_heatmap.png"))
    paths.append(figures.plot_damper_pca(steps, h, out / "damper_pca.png"))
    return paths


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (see the module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("memory", "convergence", "sweep", "figures", "all"))
    ap.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                    help=f"runs, tables and figures go here (default {DEFAULT_OUT})")
    ap.add_argument("--model", default=Budget.model)
    ap.add_argument("--steps", type=int, default=Budget.steps)
    ap.add_argument("--batch-size", type=int, default=Budget.batch_size)
    ap.add_argument("--seq-len", type=int, default=Budget.seq_len)
    ap.add_argument("--eval-every", type=int, default=Budget.eval_every)
    ap.add_argument("--eval-batches", type=int, default=Budget.eval_batches)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES), choices=CONFIG_NAMES)
    ap.add_argument("--reference", default="lion-hybrid", choices=CONFIG_NAMES,
                    help="the baseline whose final perplexity defines effective throughput")
    ap.add_argument("--sweep-configs", nargs="+", default=["sage-hybrid", "lion-hybrid"],
                    choices=CONFIG_NAMES)
    ap.add_argument("--lrs", type=float, nargs="+", default=list(PAPER_LR_GRID))
    args = ap.parse_args(argv)
    budget = Budget(args.model, args.steps, args.batch_size, args.seq_len, args.eval_every,
                    args.eval_batches)
    args.out.mkdir(parents=True, exist_ok=True)
    sections: list[str] = []

    def emit(title: str, body: str) -> None:
        print(f"\n## {title}\n\n{body}\n", flush=True)
        sections.append(f"## {title}\n\n{body}\n")

    if args.part in ("memory", "all"):
        from sage_repro.memory_report import format_memory_table

        emit("Optimizer-state memory at the paper's scales (exact, GiB)",
             "```\n" + format_memory_table() + "\n```")
    setup = (f"LLaMA `{budget.model}`, {budget.steps} steps of {budget.batch_size}×"
             f"{budget.seq_len} tokens ({budget.steps * budget.tokens_per_step:,} tokens), "
             f"cosine schedule with 10% warmup, test perplexity every {budget.eval_every} "
             f"steps on {budget.eval_batches} held-out batches")
    runs: dict[str, list[Curve]] = {}
    if args.part in ("convergence", "figures", "all"):
        print(f"convergence: {setup}; seeds {args.seeds}", flush=True)
        runs = run_convergence(args.out, budget, args.configs, args.seeds)
        if args.part != "figures":
            emit(f"Convergence ({setup}; seeds {', '.join(map(str, args.seeds))})",
                 convergence_table(runs, budget, args.reference))
    if args.part in ("sweep", "all"):
        print(f"sweep: {setup}; seed {args.seeds[0]}", flush=True)
        sweep = run_sweep(args.out, budget, args.sweep_configs, args.lrs, args.seeds[0])
        emit(f"Learning-rate sweep ({setup}; seed {args.seeds[0]}; final test perplexity)",
             sweep_table(sweep))
    if args.part in ("figures", "all"):
        if SAGE_RUN not in runs:
            ap.error(f"the figures need the {SAGE_RUN} runs: include it in --configs")
        paths = make_figures(args.out, runs, budget, args.seeds[0])
        emit("Figures", "\n".join(f"- `{p}`" for p in paths))
    tables = args.out / ("tables.md" if args.part == "all" else f"tables-{args.part}.md")
    tables.write_text("\n".join(sections))
    print(f"tables written to {tables}")


if __name__ == "__main__":
    main()
