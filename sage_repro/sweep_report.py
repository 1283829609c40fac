"""What a sweep's run directories say: each run's outcome, the table over seeds, the plots.

:mod:`sage_repro.sweep` trains; this module only reads what the trainer and the harness
wrote, so a report can be rebuilt at any time (``sage-repro report``), also while a sweep
is half done.  Nothing here imports JAX; matplotlib is imported only to draw.

**A run's outcome** (:func:`read_run`) comes from the trainer's ``metrics.jsonl`` and the
harness's ``sweep.jsonl`` (one record per invocation of the trainer): *finished* (a row of
the last step with its test perplexity), *diverged* (the trainer stopped on a NaN/Inf: its
reason and step are recorded; or a non-finite loss or perplexity in the metrics),
*unfinished* (stopped part way: a rerun resumes it), *failed* (the trainer exited with an
error that is not a divergence) or *not started*.

**The table** (:func:`summarize`): per configuration and rate, the mean and sample
standard deviation over the finished seeds of the final test perplexity, peak memory,
tokens/s and effective throughput, with a status naming every seed that diverged or did
not finish, so that nothing is averaged silently or dropped.

**Effective throughput** (the paper's Appendix, "Throughput Analysis and Metrics", after
Scetbon et al.)::

    T_eff(O) = N_base / T_O

* ``P*``: the final test perplexity of the baseline (``--reference``; the paper's is
  Lion-Hybrid, "which exhibited the slowest convergence"), the mean over its finished seeds
  (the paper reports means over seeds).
* ``N_base``: the training tokens the baseline needed to reach ``P*``: ``step x tokens per
  step`` at the first evaluation where the baseline's mean test-perplexity curve (over its
  seeds, at the evaluations all of them have) is at most ``P*``; its last evaluation unless
  the curve rose at the end.
* ``T_O``: the wall-clock seconds optimizer ``O`` needed to reach ``P*``: ``k_O`` is the first
  evaluation where O's mean curve is at most ``P*``, and ``T_O,s`` the seconds seed ``s``
  took for its ``k_O`` steps at its measured rate: ``k_O x tokens per step / r_s``, where
  ``r_s`` is the trainer's ``tokens_per_s`` at step ``k_O`` (``metrics.jsonl``: the tokens
  of the timed steps over the training clock ``elapsed_s``).  The clock starts after each
  invocation's first, compiling step and leaves out evaluations, checkpoints and logging,
  so tokens and time are counted over the same steps: the baseline against itself gives
  its own tokens/s, never more.  (Dividing ``N_base``, which counts the first step's
  tokens, by ``elapsed_s``, which leaves out that step's time, read high by ``k/(k-1)``:
  fixed in issue 34.)
* The table gives the mean and standard deviation over seeds of ``N_base / T_O,s``, that is
  ``r_s x N_base / (k_O x tokens per step)``; ``-`` where O never reaches ``P*``.
  Evaluations are discrete, so ``k_O`` is the first evaluation at or below ``P*``
  (resolution: ``--eval-every`` steps).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import pathlib
import re
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sage_optim.table import format_bytes, format_markdown_table
from sage_repro.paper import PAPER_TEST_PPL

SEGMENTS = "sweep.jsonl"
"""The harness's record of a run: one JSON line per invocation of the trainer, in the
directory given to the trainer as ``--run-dir`` (the run's own directory is inside it)."""

STATUSES: tuple[str, ...] = ("finished", "diverged", "unfinished", "failed", "not started")
"""A run's possible outcomes (:attr:`RunRecord.status`)."""

_STEP = re.compile(r"\bat step (\d+)\b")


@dataclasses.dataclass(frozen=True)
class EvalCurve:
    """One run's evaluations: step, test perplexity, training seconds and tokens/s there.

    ``rates`` is the trainer's ``tokens_per_s`` at each evaluation (timed tokens over
    ``seconds``); empty for records written before it was kept, which are then read as one
    untimed (compiling) step.
    """

    steps: tuple[int, ...]
    ppl: tuple[float, ...]
    seconds: tuple[float, ...]
    rates: tuple[float, ...] = ()

    def rate(self, step: int, tokens_per_step: int) -> float:
        """The training tokens/s up to ``step``: tokens and time of the same, timed steps.

        NaN where unknown.
        """
        i = self.steps.index(step)
        if self.rates and math.isfinite(self.rates[i]):
            return self.rates[i]
        seconds = self.seconds[i]
        return (step - 1) * tokens_per_step / seconds if seconds > 0 else math.nan


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """One run as its directory records it.

    Attributes:
      config, lr, seed: what was trained.
      path: the trainer's run directory.
      steps: the planned number of steps.
      status: one of :data:`STATUSES`.
      step_reached: the last step ``metrics.jsonl`` records (0: none).
      evals: the test-perplexity evaluations.
      losses: ``(step, training loss)`` rows.
      tokens_per_s: the trainer's tokens/s over the whole run (its last row).
      opt_state_bytes: the optimizer state's bytes.
      peak_device_bytes: the device allocator's high-water mark (``None`` on the CPU).
      peak_rss_bytes: the trainer process's peak resident set (largest over invocations).
      stop_step: the step the run diverged (or failed) at, where known.
      reason: the trainer's reason for stopping, or the failure's line.
      environment: the hardware and software of the newest invocation.
      dates: the first start and last end of the invocations (ISO 8601).
    """

    config: str
    lr: float
    seed: int
    path: pathlib.Path
    steps: int
    status: str
    step_reached: int = 0
    evals: EvalCurve = EvalCurve((), (), ())
    losses: tuple[tuple[int, float], ...] = ()
    tokens_per_s: float | None = None
    opt_state_bytes: int | None = None
    peak_device_bytes: int | None = None
    peak_rss_bytes: int | None = None
    stop_step: int | None = None
    reason: str = ""
    environment: Mapping[str, Any] | None = None
    dates: tuple[str, str] | None = None

    @property
    def final_ppl(self) -> float | None:
        """The test perplexity of the last step, for a finished run (else ``None``)."""
        return self.evals.ppl[-1] if self.status == "finished" else None

    def describe(self) -> str:
        """The outcome in a few words: ``diverged at step 40``, ``unfinished (step 3/8)``."""
        if self.status == "diverged":
            return "diverged" + (f" at step {self.stop_step}" if self.stop_step else "")
        if self.status == "unfinished":
            return f"unfinished (step {self.step_reached}/{self.steps})"
        if self.status == "failed":
            return f"failed at step {self.step_reached}/{self.steps}: {self.reason}"
        return self.status


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) else None


def read_segments(group: pathlib.Path) -> list[dict[str, Any]]:
    """The harness's records of a run (``group/sweep.jsonl``), damaged lines skipped."""
    try:
        lines = (group / SEGMENTS).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def read_run(config: str, lr: float, seed: int, group: pathlib.Path, run_dir: pathlib.Path,
             steps: int) -> RunRecord:
    """The outcome and measurements of one run (see the module docstring).

    Args:
      config: the run's configuration.
      lr: its peak learning rate.
      seed: its seed.
      group: the directory the harness gave the trainer as ``--run-dir`` (its
        :data:`SEGMENTS` record is there).
      run_dir: the trainer's run directory.
      steps: the planned number of steps.
    """
    from sage_train.store.rundir import iter_metrics

    rows = list(iter_metrics(run_dir)) if run_dir.is_dir() else []
    segments = read_segments(group)
    base = RunRecord(config, lr, seed, run_dir, steps, "not started")
    evals = [r for r in rows if "test_ppl" in r]
    losses = tuple((int(r["step"]), float(r["loss"])) for r in rows
                   if _number(r.get("loss")) is not None)
    peaks = [int(r["peak_memory_bytes"]) for r in rows
             if _number(r.get("peak_memory_bytes")) is not None]
    rss = [int(s["max_rss_bytes"]) for s in segments
           if _number(s.get("max_rss_bytes")) is not None]
    last = rows[-1] if rows else {}
    record = dataclasses.replace(
        base,
        step_reached=int(last.get("step", 0)),
        evals=EvalCurve(tuple(int(r["step"]) for r in evals),
                        tuple(float(r["test_ppl"]) for r in evals),
                        tuple(float(r.get("elapsed_s", math.nan)) for r in evals),
                        tuple(float(r.get("tokens_per_s", math.nan)) for r in evals)),
        losses=losses,
        tokens_per_s=_number(last.get("tokens_per_s")),
        opt_state_bytes=int(last["opt_state_bytes"]) if _number(
            last.get("opt_state_bytes")) is not None else None,
        peak_device_bytes=max(peaks) if peaks else None,
        peak_rss_bytes=max(rss) if rss else None,
        environment=next((s["environment"] for s in reversed(segments)
                          if isinstance(s.get("environment"), dict)), None),
        dates=(str(segments[0].get("started")), str(segments[-1].get("ended")))
        if segments else None,
    )
    for r in rows:  # a non-finite loss or perplexity that was recorded
        for key in ("loss", "test_ppl"):
            value = _number(r.get(key))
            if value is not None and not math.isfinite(value):
                return dataclasses.replace(record, status="diverged", stop_step=int(r["step"]),
                                           reason=f"{key} {value} at step {r['step']}")
    outcome = segments[-1] if segments else {}
    finished = bool(evals) and record.step_reached >= steps and evals[-1]["step"] >= steps
    if outcome.get("outcome") == "diverged" and not finished:
        return dataclasses.replace(record, status="diverged", stop_step=outcome.get("step"),
                                   reason=str(outcome.get("reason", "")))
    if finished:
        return dataclasses.replace(record, status="finished")
    if outcome.get("outcome") == "failed":
        return dataclasses.replace(record, status="failed", stop_step=outcome.get("step"),
                                   reason=str(outcome.get("reason", "")))
    if rows or segments:
        return dataclasses.replace(record, status="unfinished")
    return record


def stop_reason(config: str, stderr: str) -> tuple[str, int | None] | None:
    """The reason ``sage-train`` gave for stopping ``config`` early, and its step.

    ``sage-train`` ends a run stopped on a NaN/Inf (its loss, or its parameters or
    optimizer state) with a line ``CONFIG: REASON`` on stderr and exit status 1; ``None``
    where ``stderr`` holds no such line (another error).
    """
    lines = [ln[len(config) + 2:] for ln in stderr.splitlines() if ln.startswith(f"{config}: ")]
    if not lines:
        return None
    match = _STEP.search(lines[-1])
    return lines[-1].strip(), int(match.group(1)) if match else None


# ---------------------------------------------------------------------------
# effective throughput
# ---------------------------------------------------------------------------


def mean_curve(curves: Sequence[EvalCurve]) -> tuple[list[int], list[float]]:
    """The steps every curve evaluated, and the mean test perplexity there."""
    if not curves:
        return [], []
    common = sorted(set.intersection(*(set(c.steps) for c in curves)))
    return common, [statistics.fmean(c.ppl[c.steps.index(s)] for c in curves) for s in common]


def first_reaching(ppl: Sequence[float], target: float, values: Sequence[Any]) -> Any:
    """``values`` at the first evaluation whose perplexity is at most ``target`` (or ``None``)."""
    for p, v in zip(ppl, values, strict=True):
        if p <= target:
            return v
    return None


@dataclasses.dataclass(frozen=True)
class Target:
    """The baseline of the effective throughput: ``P*`` and ``N_base`` (module docstring)."""

    config: str
    lr: float
    ppl: float
    step: int
    tokens: int

    @property
    def tokens_per_step(self) -> int:
        """The training tokens of one step (``N_base`` over its step)."""
        return self.tokens // self.step


def baseline_target(config: str, lr: float, curves: Sequence[EvalCurve],
                    tokens_per_step: int) -> Target | None:
    """``P*`` (the mean final perplexity of ``curves``) and ``N_base`` (tokens to reach it)."""
    steps, ppl = mean_curve(curves)
    if not steps:
        return None
    target = statistics.fmean(c.ppl[-1] for c in curves)
    step = first_reaching(ppl, target, steps)
    if step is None:  # the seeds' last evaluations differ: the mean curve never gets there
        return None
    return Target(config, lr, target, step, step * tokens_per_step)


@dataclasses.dataclass(frozen=True)
class Effective:
    """``N_base / T_O,s`` per seed, and the evaluation step ``k_O`` where O reaches ``P*``."""

    step: int | None
    values: tuple[float, ...]


def effective_throughput(curves: Sequence[EvalCurve], target: Target) -> Effective:
    """Each seed's ``N_base / T_O,s`` (the module docstring's definition).

    ``curves`` are the finished seeds of one optimizer at one rate.  ``step`` is ``None``
    (and ``values`` empty) where their mean curve never reaches ``target.ppl``; a seed with
    no timed step by then (reached before the clock started) gives no value.

    ``T_O,s`` is the seconds of all ``k_O`` steps at the seed's own measured rate, so that
    tokens and time cover the same steps: the baseline against itself gives its own
    tokens/s at ``k_O``.
    """
    steps, ppl = mean_curve(curves)
    step = first_reaching(ppl, target.ppl, steps)
    if step is None:
        return Effective(None, ())
    per_step = target.tokens_per_step
    rates = [c.rate(step, per_step) for c in curves]
    return Effective(step, tuple(target.tokens * r / (step * per_step) for r in rates
                                 if math.isfinite(r) and r > 0))


# ---------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------


def mean_sd(values: Sequence[float]) -> tuple[float | None, float | None]:
    """The mean and the sample standard deviation (``n - 1``; ``None`` below two values)."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration at one rate: its seeds' runs and what they add up to."""

    config: str
    lr: float | None
    runs: tuple[RunRecord, ...]
    note: str = ""  # replaces the status (e.g. "no rate at which every seed finished")
    remark: str = ""  # added to the status (e.g. "not in the top 4: sweep seeds only")

    @property
    def finished(self) -> tuple[RunRecord, ...]:
        """The runs that finished."""
        return tuple(r for r in self.runs if r.status == "finished")

    def status(self) -> str:
        """``3/3 seeds finished``, or every seed that did not, named with its outcome."""
        n, done = len(self.runs), len(self.finished)
        parts = [f"{done}/{n} seeds finished"] if n else ["no runs"]
        for status in STATUSES[1:]:
            runs = [r for r in self.runs if r.status == status]
            if runs:
                parts.append("; ".join(f"seed {r.seed} {r.describe()}" for r in runs))
        if self.note:
            parts = [self.note]
        return "; ".join(parts + ([self.remark] if self.remark else []))

    def ppl_cell(self) -> str:
        """Mean ± sd of the final test perplexity, or why there is none."""
        values = [r.final_ppl for r in self.finished if r.final_ppl is not None]
        if values:
            return _pm(values, lambda x: f"{x:.2f}")
        diverged = [r for r in self.runs if r.status == "diverged"]
        if diverged:
            first = min((r.stop_step for r in diverged if r.stop_step), default=None)
            return "diverged" + (f" at step {first}" if first else "")
        if any(r.status == "unfinished" for r in self.runs):
            return "unfinished"
        if any(r.status == "failed" for r in self.runs):
            return "failed"
        return "not run"


def _pm(values: Sequence[float], fmt: Any) -> str:
    mean, sd = mean_sd(values)
    if mean is None:
        return "-"
    return fmt(mean) if sd is None else f"{fmt(mean)} ± {fmt(sd)}"


def _bytes_pm(values: Sequence[int]) -> str:
    mean, sd = mean_sd([float(v) for v in values])
    if mean is None:
        return "-"
    text = format_bytes(int(mean))
    if sd is None:
        return text
    unit = text.split()[-1]
    scale = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}[unit]
    return f"{text} ± {sd / scale:.2f} {unit}"


def peak_memory(run: RunRecord) -> tuple[int | None, str]:
    """The run's peak memory and its source: the device's, else the host process's."""
    if run.peak_device_bytes is not None:
        return run.peak_device_bytes, "device"
    return run.peak_rss_bytes, "host RSS"


def best_rates(cells: Mapping[tuple[str, float], Sequence[RunRecord]]
               ) -> dict[str, float | None]:
    """Each configuration's best rate: the lowest mean final test perplexity.

    Only a rate whose every seed finished is eligible: a rate at which a seed diverged (or
    did not finish) is never best.  ``None`` for a configuration with no eligible rate.
    """
    best: dict[str, tuple[float, float] | None] = {}
    for (config, lr), runs in cells.items():
        best.setdefault(config, None)
        if not runs or any(r.status != "finished" for r in runs):
            continue
        ppl = statistics.fmean(r.final_ppl or math.inf for r in runs)
        current = best[config]
        if math.isfinite(ppl) and (current is None or ppl < current[0]):
            best[config] = (ppl, lr)
    return {c: (None if b is None else b[1]) for c, b in best.items()}


def pick_reference(rows: Sequence[Row], wanted: str) -> Row | None:
    """The baseline row: ``wanted``'s, or with ``"slowest"`` the highest mean final perplexity.

    Only rows with a finished seed count; ``None`` where there is none (or ``wanted`` has
    none).
    """
    candidates = [r for r in rows if r.finished and r.lr is not None]
    if wanted != "slowest":
        return next((r for r in candidates if r.config == wanted), None)
    return max(candidates, default=None,
               key=lambda r: statistics.fmean(x.final_ppl or math.inf for x in r.finished))


@dataclasses.dataclass(frozen=True)
class Summary:
    """The report of a sweep, built by :func:`summarize`.

    Attributes:
      rows: the main table, one row per configuration (at its best or only rate).
      cells: every ``(configuration, rate)`` of the learning-rate sweep and its runs
        (the sweep seeds only).
      best: each configuration's best rate (:func:`best_rates`), ``None`` where none.
      target: ``P*`` and ``N_base`` of the effective throughput (``None``: no baseline).
      reference: the baseline asked for (a configuration or ``"slowest"``).
      effective: each row's effective throughput, by configuration.
      setup: what every run shares (the protocol, tokens, parameters...).
    """

    rows: tuple[Row, ...]
    cells: Mapping[tuple[str, float], tuple[RunRecord, ...]]
    best: Mapping[str, float | None]
    target: Target | None
    reference: str
    effective: Mapping[str, Effective]
    setup: Mapping[str, Any]


def summarize(rows: Sequence[Row], cells: Mapping[tuple[str, float], Sequence[RunRecord]],
              reference: str, setup: Mapping[str, Any]) -> Summary:
    """The effective throughput of every row against ``reference``, with the rows and cells.

    ``setup`` must hold ``tokens_per_step``.
    """
    ref = pick_reference(rows, reference)
    target = None if ref is None or ref.lr is None else baseline_target(
        ref.config, ref.lr, [r.evals for r in ref.finished], int(setup["tokens_per_step"]))
    effective = {}
    if target is not None:
        effective = {row.config: effective_throughput([r.evals for r in row.finished], target)
                     for row in rows if row.finished}
    best = best_rates(cells)
    return Summary(tuple(rows), {k: tuple(v) for k, v in cells.items()}, best, target,
                   reference, effective, dict(setup))


def _effective_cell(summary: Summary, row: Row) -> str:
    if summary.target is None:
        return "-"
    eff = summary.effective.get(row.config)
    if eff is None or eff.step is None:
        return f"never reaches {summary.target.ppl:.2f}" if row.finished else "-"
    text = _pm(eff.values, lambda x: f"{x:,.0f}")
    if len(eff.values) < len(row.finished):
        text += f" ({len(eff.values)}/{len(row.finished)} seeds)"
    return text


def main_table(summary: Summary) -> str:
    """The results table (markdown): one row per configuration."""
    rows = []
    sources = {peak_memory(r)[1] for row in summary.rows for r in row.finished
               if peak_memory(r)[0] is not None}
    for row in summary.rows:
        finished = row.finished
        peaks = [p for p, _ in map(peak_memory, finished) if p is not None]
        state = next((r.opt_state_bytes for r in row.runs if r.opt_state_bytes is not None),
                     None)
        paper = PAPER_TEST_PPL["270m"].get(row.config)
        memory = _bytes_pm(peaks)
        if len(sources) > 1 and peaks:
            memory += f" ({peak_memory(finished[0])[1]})"
        rows.append([
            row.config,
            "-" if row.lr is None else f"{row.lr:g}",
            f"{len(finished)}/{len(row.runs)}",
            row.ppl_cell(),
            "-" if paper is None else f"{paper:g}",
            memory,
            "-" if state is None else format_bytes(state),
            _pm([r.tokens_per_s for r in finished if r.tokens_per_s is not None],
                lambda x: f"{x:,.0f}"),
            _effective_cell(summary, row),
            row.status(),
        ])
    memory_head = "peak memory" + (f" ({sources.pop()})" if len(sources) == 1 else "")
    headers = ["configuration", "lr", "seeds finished", "test ppl (mean ± sd)",
               "paper 270M ppl", memory_head, "optimizer state", "tokens/s (mean ± sd)",
               "effective tokens/s (mean ± sd)", "status"]
    return format_markdown_table(headers, rows)


def lr_table(summary: Summary) -> str:
    """Final test perplexity per rate (rows) and configuration (columns), and the best rate."""
    configs = list(dict.fromkeys(c for c, _ in summary.cells))
    rates = sorted({lr for _, lr in summary.cells})
    rows = []
    for lr in rates:
        line: list[Any] = [f"{lr:g}"]
        for config in configs:
            runs = summary.cells.get((config, lr))
            line.append("" if runs is None else Row(config, lr, runs).ppl_cell())
        rows.append(line)
    rows.append(["best", *(_best_cell(summary, c) for c in configs)])
    return format_markdown_table(["lr", *configs], rows)


def sweeps_rates(cells: Mapping[tuple[str, float], Any]) -> bool:
    """Whether some configuration of ``cells`` was trained at more than one rate."""
    configs = [c for c, _ in cells]
    return len(configs) > len(set(configs))


def _best_cell(summary: Summary, config: str) -> str:
    lr = summary.best.get(config)
    if lr is None:
        return "none finished"
    rates = sorted(r for c, r in summary.cells if c == config)
    edge = len(rates) > 1 and lr in (rates[0], rates[-1])
    return f"**{lr:g}**" + (" (edge of the grid)" if edge else "")


def setup_lines(summary: Summary) -> list[str]:
    """The report's header: tokens, parameters, protocol, hardware, software, date."""
    s = summary.setup
    runs = [r for row in summary.rows for r in row.runs] + [
        r for runs in summary.cells.values() for r in runs]
    dates = sorted(d for r in runs if r.dates for d in r.dates if d and d != "None")
    envs = {json.dumps(_hardware(r.environment), sort_keys=True): r.environment
            for r in runs if r.environment}
    hardware = "; ".join(describe_hardware(e) for e in envs.values()) or "unknown (no run yet)"
    software = "; ".join(sorted({_describe_software(e) for e in envs.values()})) or "unknown"
    lines = [
        f"generated {_now()}" + (f"; runs trained from {dates[0]} to {dates[-1]}"
                                 if dates else ""),
        f"model `{s['model']}`: {s['parameters']:,} parameters; data `{s['data'] or 'stdlib'}`"
        + (f": {s['data_tokens']}" if s.get("data_tokens") else "")
        + (f"; data fingerprint {', '.join(f'`{p}`' for p in s['data_fingerprints'])}"
           if s.get("data_fingerprints") else ""),
        f"each run: {s['steps']:,} steps x {s['tokens_per_step']:,} tokens ({s['batch_size']} "
        f"sequences of {s['seq_len']}) = {s['steps'] * s['tokens_per_step']:,} training "
        f"tokens; {s['schedule']} schedule, {s['warmup_frac']:.0%} warmup, final rate "
        f"{s['final_lr_frac']:g} x peak; clipping {s['clip']:g}; " + _hyperparameters(s)
        + f"; test perplexity every {s['eval_every']} steps on {s['eval_batches']} "
        f"batch{'' if s['eval_batches'] == 1 else 'es'} of the held-out test documents "
        "(the corpus's 8:2 split by document; a cut's test side is drawn from that 20%)",
        f"hardware: {hardware}" + (" (more than one: timings are not comparable across them)"
                                   if len(envs) > 1 else ""),
        f"software: {software}",
    ]
    if s.get("trainer_args"):
        lines.append("trainer options added to every run: `" + " ".join(s["trainer_args"]) + "`")
    t = summary.target
    if t is not None:
        lines.append(f"effective throughput: N_base / T_O against {t.config} (lr {t.lr:g}): "
                     f"P* = {t.ppl:.2f}, its mean final test perplexity, reached after N_base "
                     f"= {t.tokens:,} tokens (step {t.step}); T_O: the seconds of O's steps "
                     f"until it reaches P*, at its own measured tokens/s (tokens and time of "
                     f"the same steps, compilation excluded)")
    else:
        lines.append(f"effective throughput: no finished run of the baseline "
                     f"({summary.reference}) yet")
    return lines


def _hyperparameters(setup: Mapping[str, Any]) -> str:
    given = {k: setup.get(k) for k in ("b1", "b2", "weight_decay")}
    if all(v is None for v in given.values()):
        return ("each configuration's b1, b2 and weight decay (the paper's 0.9, 0.99 and "
                "0.01)")
    return ", ".join(f"{k} {v:g}" if v is not None else f"{k} the configuration's"
                     for k, v in given.items())


def _hardware(env: Mapping[str, Any] | None) -> dict[str, Any]:
    env = env or {}
    return {k: env.get(k) for k in ("platform", "device_kind", "device_count", "cpu",
                                     "cpu_count", "together")}


def describe_hardware(env: Mapping[str, Any] | None) -> str:
    """The hardware of a run's environment in words (``1 x NVIDIA H100 (gpu); host ...``).

    A run trained beside others (``sage-repro sweep --together N``) says so: its tokens/s is
    its share of the devices.
    """
    h = _hardware(env)
    if h["together"]:
        return (describe_hardware({**h, "together": None}) + f", shared by {h['together']} "
                "trainer processes at once (--together: a run's tokens/s is its share)")
    cpu = f"{h['cpu'] or 'CPU'} ({h['cpu_count']} cores)"
    if h["platform"] is None:
        return f"{cpu}; devices unknown (JAX could not be asked)"
    if h["platform"] == "cpu":
        return f"{cpu}, no accelerator"
    return f"{h['device_count']} x {h['device_kind']} ({h['platform']}); host {cpu}"


def _describe_software(env: Mapping[str, Any] | None) -> str:
    versions = (env or {}).get("versions") or {}
    return ", ".join(f"{k} {v}" for k, v in versions.items())


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def _num(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


def run_to_json(r: RunRecord) -> dict[str, Any]:
    """One run as JSON-ready data, all of it: :func:`run_from_json` rebuilds the record.

    A non-finite value is ``None`` (strict JSON).
    """
    peak, source = peak_memory(r)
    return {"config": r.config, "seed": r.seed, "lr": r.lr, "status": r.status,
            "outcome": r.describe(), "final_test_ppl": _num(r.final_ppl),
            "step_reached": r.step_reached, "steps": r.steps,
            "tokens_per_s": _num(r.tokens_per_s), "peak_memory_bytes": peak,
            "peak_memory_source": source if peak is not None else None,
            "opt_state_bytes": r.opt_state_bytes, "path": str(r.path),
            "peak_device_bytes": r.peak_device_bytes, "peak_rss_bytes": r.peak_rss_bytes,
            "stop_step": r.stop_step, "reason": r.reason, "environment": r.environment,
            "dates": None if r.dates is None else list(r.dates),
            "evals": {"steps": list(r.evals.steps), "ppl": [_num(x) for x in r.evals.ppl],
                      "seconds": [_num(x) for x in r.evals.seconds],
                      "tokens_per_s": [_num(x) for x in r.evals.rates]},
            "losses": [[step, _num(loss)] for step, loss in r.losses]}


def run_from_json(data: Mapping[str, Any]) -> RunRecord:
    """The :class:`RunRecord` of :func:`run_to_json`'s data (``None`` figures read as NaN).

    Raises:
      KeyError, TypeError, ValueError: the data is not a run's.
    """
    def floats(values: Sequence[Any]) -> tuple[float, ...]:
        return tuple(math.nan if v is None else float(v) for v in values)

    evals = data["evals"]
    dates = data.get("dates")
    return RunRecord(
        config=str(data["config"]), lr=float(data["lr"]), seed=int(data["seed"]),
        path=pathlib.Path(data["path"]), steps=int(data["steps"]), status=str(data["status"]),
        step_reached=int(data["step_reached"]),
        evals=EvalCurve(tuple(int(s) for s in evals["steps"]), floats(evals["ppl"]),
                        floats(evals["seconds"]), floats(evals.get("tokens_per_s", ()))),
        losses=tuple((int(s), math.nan if v is None else float(v))
                     for s, v in data["losses"]),
        tokens_per_s=data.get("tokens_per_s"), opt_state_bytes=data.get("opt_state_bytes"),
        peak_device_bytes=data.get("peak_device_bytes"),
        peak_rss_bytes=data.get("peak_rss_bytes"), stop_step=data.get("stop_step"),
        reason=str(data.get("reason", "")), environment=data.get("environment"),
        dates=None if dates is None else (str(dates[0]), str(dates[1])))


def to_json(summary: Summary, figures: Sequence[pathlib.Path] = ()) -> dict[str, Any]:
    """The report as JSON-ready data (``None`` where a value is missing or not finite)."""
    def stats(values: Sequence[float]) -> dict[str, Any]:
        mean, sd = mean_sd(values)
        return {"mean": _num(mean), "sd": _num(sd), "n": len(values)}

    rows = []
    for row in summary.rows:
        eff = summary.effective.get(row.config)
        finished = row.finished
        rows.append({
            "config": row.config, "lr": row.lr, "status": row.status(),
            "test_ppl": stats([r.final_ppl for r in finished if r.final_ppl is not None]),
            "paper_270m_test_ppl": PAPER_TEST_PPL["270m"].get(row.config),
            "peak_memory_bytes": stats([float(p) for p, _ in map(peak_memory, finished)
                                        if p is not None]),
            "tokens_per_s": stats([r.tokens_per_s for r in finished
                                   if r.tokens_per_s is not None]),
            "effective_tokens_per_s": None if eff is None else {
                **stats(eff.values), "step": eff.step, "values": list(eff.values)},
            "runs": [run_to_json(r) for r in row.runs],
        })
    data: dict[str, Any] = {
        "generated": _now(),
        "setup": dict(summary.setup),
        "header": setup_lines(summary),
        "reference": summary.reference,
        "target": None if summary.target is None else dataclasses.asdict(summary.target),
        "rows": rows,
        "lr_sweep": [{"config": c, "lr": lr, "cell": Row(c, lr, runs).ppl_cell(),
                      "runs": [run_to_json(r) for r in runs]}
                     for (c, lr), runs in summary.cells.items()],
        "best_lr": dict(summary.best),
        "figures": [str(p) for p in figures],
    }
    data["digest"] = records_digest(data)
    return data


def _sections(data: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """``(where, entry)`` for every row and cell of a report's data: what holds runs."""
    return [(f"{key}[{i}]", entry) for key in ("rows", "lr_sweep")
            for i, entry in enumerate(data[key])]


def records_digest(data: Mapping[str, Any]) -> str:
    """The SHA-256 of every run record of a report's data (:func:`to_json`), in order.

    ``results.json`` carries it as ``digest``; :func:`verify_results` recomputes it, so a
    record edited by hand no longer matches.
    """
    runs = [entry["runs"] for _, entry in _sections(data)]
    text = json.dumps(runs, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def impossible(run: RunRecord) -> str | None:
    """What a run's record holds that no run can have (``None``: nothing).

    An unknown status, a step reached beyond the planned steps, a "finished" run that
    stopped before its last step or has no final perplexity, a perplexity below 1 (it is
    the exponential of a cross-entropy, which is never negative), and evaluations out of
    order or beyond the step reached.
    """
    if run.status not in STATUSES:
        return f"status {run.status!r} is none of {', '.join(STATUSES)}"
    if not 0 <= run.step_reached <= run.steps:
        return f"step_reached {run.step_reached} is not within the run's {run.steps} steps"
    steps = run.evals.steps
    if list(steps) != sorted(set(steps)) or any(not 1 <= s <= run.steps for s in steps):
        return f"evals.steps {list(steps)} are not increasing steps within 1..{run.steps}"
    if len(run.evals.ppl) != len(steps):
        return f"evals.ppl has {len(run.evals.ppl)} values for {len(steps)} evaluations"
    bad = next((x for x in run.evals.ppl if math.isfinite(x) and x < 1), None)
    if bad is not None:
        return f"evals.ppl holds {bad}: a perplexity is at least 1"
    if run.status == "finished":
        if run.step_reached != run.steps:
            return (f"status 'finished' at step {run.step_reached} of {run.steps} (step_reached): "
                    "a finished run reached its last step")
        if not steps or steps[-1] != run.steps or not math.isfinite(run.evals.ppl[-1]):
            return "status 'finished' without a finite test perplexity at its last step (evals)"
    return None


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=1e-12) or (math.isnan(a) and math.isnan(b))
    return bool(a == b)


def _verified_run(field: str, raw: Any, seen: dict[tuple[Any, ...], tuple[str, Any]]
                  ) -> RunRecord:
    """The run record ``raw`` at ``field``, checked (:func:`verify_results`); noted in ``seen``."""
    try:
        run = run_from_json(raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{field} is not a run's record ({type(e).__name__}: {e})"
                         ) from None
    label = f"{run.config} lr {run.lr:g} seed {run.seed}"
    problem = impossible(run)
    if problem is not None:
        raise ValueError(f"{field} ({label}): {problem}")
    derived = run_to_json(run)
    for name, value in derived.items():
        if not _same(raw.get(name), value):
            raise ValueError(f"{field}.{name} ({label}) is {raw.get(name)!r}, but the "
                             f"run's record gives {value!r}")
    key = (run.config, run.lr, run.seed)
    if key in seen and seen[key][1] != raw:
        raise ValueError(f"{field} ({label}) differs from the same run in "
                         f"{seen[key][0]}")
    seen.setdefault(key, (field, raw))
    return run


def _verify_figures(where: str, entry: Mapping[str, Any], row: Row) -> None:
    """Refuse a row whose ``test_ppl``, ``tokens_per_s`` or memory its runs do not give."""
    finished = row.finished
    figures = {
        "test_ppl": [r.final_ppl for r in finished if r.final_ppl is not None],
        "tokens_per_s": [r.tokens_per_s for r in finished if r.tokens_per_s is not None],
        "peak_memory_bytes": [float(p) for p, _ in map(peak_memory, finished)
                              if p is not None]}
    for name, values in figures.items():
        mean, sd = mean_sd(values)
        want = {"mean": _num(mean), "sd": _num(sd), "n": len(values)}
        got = entry.get(name)
        if not isinstance(got, Mapping) or any(not _same(got.get(k), v)
                                               for k, v in want.items()):
            raise ValueError(f"{where}.{name} ({row.config}) is {got!r}, but its runs give "
                             f"{want!r}")


def verify_results(data: Mapping[str, Any]) -> None:
    """Refuse a report's data (``results.json``) that does not follow from its own runs.

    Every run record is checked for :func:`impossible` values and against what follows
    from it (its ``final_test_ppl``, ``outcome``, ``peak_memory_bytes``...); each row's
    figures (``test_ppl``, ``tokens_per_s``, ``peak_memory_bytes``) and each cell of the
    learning-rate table are recomputed from its runs; a run listed twice must be the same
    record; and the ``digest`` of the records must match (:func:`records_digest`).

    Raises:
      ValueError: one line naming the field (``rows[0].runs[1].status``...) and the problem.
    """
    seen: dict[tuple[Any, ...], tuple[str, Any]] = {}
    for where, entry in _sections(data):
        records = [_verified_run(f"{where}.runs[{i}]", raw, seen)
                   for i, raw in enumerate(entry["runs"])]
        row = Row(str(entry["config"]), entry["lr"], tuple(records))
        if where.startswith("lr_sweep"):
            if entry.get("cell") != row.ppl_cell():
                raise ValueError(f"{where}.cell ({row.config} lr {row.lr}) is "
                                 f"{entry.get('cell')!r}, but its runs give {row.ppl_cell()!r}")
            continue
        _verify_figures(where, entry, row)
    digest = data.get("digest")
    if digest is None:
        raise ValueError("digest is missing (written before results carried one): rewrite "
                         "the file with sage-repro report --out on its runs")
    if digest != records_digest(data):
        raise ValueError("digest does not match the runs' records: a record was changed "
                         "after it was written")


def to_markdown(summary: Summary, figures: Sequence[pathlib.Path] = (), *,
                title: str | None = None, sections: Sequence[str] = ()) -> str:
    """The report as markdown: the setup, the main table, the rate sweep and the figures.

    ``title`` replaces the default title; ``sections`` (markdown lines) come after the setup.
    """
    title = title or (f"Sweep results: LLaMA {summary.setup['model']}, "
                      f"{len(summary.rows)} configurations")
    parts = [f"# {title}", "", *(f"- {line}" for line in setup_lines(summary)), "",
             *sections, *([""] if sections else []),
             "## Final test perplexity, memory and throughput", "", main_table(summary), "",
             "Mean ± sample standard deviation over the seeds that finished; the status names "
             "every seed that diverged or did not finish (never averaged in). Peak memory: the "
             "device allocator's high-water mark on an accelerator; on the CPU, which reports "
             "none, the trainer process's peak resident set, compilation included (a "
             "run whose step came from the compilation cache compiled less). tokens/s: "
             "training steps only "
             "(compilation, evaluation and checkpoints excluded). The paper's column is its "
             "270M model on 6.6B tokens of The Pile: a reference point, not the same "
             "experiment.", ""]
    if sweeps_rates(summary.cells):
        parts += ["## Learning-rate sweep (final test perplexity)", "", lr_table(summary), "",
                  "Best: the rate with the lowest mean final test perplexity among those at "
                  "which every seed finished (a rate at which a seed diverged is never best); "
                  "a best rate at the edge of its grid says that the grid should reach "
                  "further.", ""]
    if figures:
        parts += ["## Figures", "", *(f"- `{p.name}`" for p in figures), ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------


def write_figures(summary: Summary, folder: pathlib.Path) -> list[pathlib.Path]:
    """Draw the report's figures into ``folder``; return the files drawn.

    ``loss_vs_tokens.png`` where a run logged a loss, ``lr_sweep.png`` where rates were swept
    and a run finished.
    """
    figures = []
    if any(r.losses for row in summary.rows for r in row.runs):
        figures.append(plot_loss_vs_tokens(summary, folder / "loss_vs_tokens.png"))
    if sweeps_rates(summary.cells) and any(
            r.final_ppl is not None for runs in summary.cells.values() for r in runs):
        figures.append(plot_lr_sweep(summary, folder / "lr_sweep.png"))
    return figures


def files_line(folder: pathlib.Path) -> str:
    """Where a written report went: ``results.md``, ``results.json`` and each figure (PNG).

    Read from ``folder/results.json``, which lists the figures drawn.
    """
    data = json.loads((folder / "results.json").read_text())
    figures = [str(f) for f in data.get("figures") or []]
    return (f"written: {folder / 'results.md'}, {folder / 'results.json'}; figures: "
            + (", ".join(figures) if figures else "none (no run has logged a loss yet)"))


def _figure(width: float, height: float) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, FigureCanvasAgg(fig)


def _band(points: Sequence[Sequence[tuple[float, float]]]
          ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Mean, min and max at the x values every run has."""
    tables = [dict(p) for p in points]
    xs = sorted(set.intersection(*(set(t) for t in tables))) if tables else []
    ys = [[t[x] for t in tables] for x in xs]
    return xs, [statistics.fmean(y) for y in ys], [min(y) for y in ys], [max(y) for y in ys]


def _plot_row(ax: Any, row: Row, series: Callable[[RunRecord], Sequence[tuple[int, float]]],
              tokens: int, color: str, label: str) -> None:
    """One row's curves on ``ax``: the finished seeds' band, each other seed dashed."""
    finished = row.finished
    if finished:
        xs, mean, lo, hi = _band([[(s * tokens, y) for s, y in series(r)]
                                  for r in finished])
        ax.plot(xs, mean, color=color, label=label)
        if len(finished) > 1:
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, linewidth=0)
    for r in row.runs:
        if r.status == "finished" or not series(r):
            continue
        pts = [(s * tokens, y) for s, y in series(r) if math.isfinite(y)]
        if not pts:
            continue
        ax.plot(*zip(*pts, strict=True), color=color, linewidth=0.8, linestyle="--",
                label=None if finished else label)
        if r.status == "diverged":
            ax.plot([pts[-1][0]], [pts[-1][1]], marker="x", color=color)


def plot_loss_vs_tokens(summary: Summary, path: pathlib.Path) -> pathlib.Path:
    """Training loss and test perplexity against training tokens, one colour per row.

    Each row's finished seeds give the mean line and a min-max band; a seed that diverged
    or did not finish is a thin dashed line of its own (ending in ``x`` where it diverged),
    never part of the band.  ``P*`` of the effective throughput is a dotted line.
    """
    tokens = int(summary.setup["tokens_per_step"])
    fig, _ = _figure(12.0, 4.6)
    loss_ax, ppl_ax = fig.subplots(1, 2)
    for i, row in enumerate(summary.rows):
        color = f"C{i % 10}"
        finished = row.finished
        label = f"{row.config}" + ("" if row.lr is None else f" lr {row.lr:g}")
        label += f" ({len(finished)}/{len(row.runs)} seeds)"
        for ax, series in ((loss_ax, lambda r: r.losses),
                           (ppl_ax, lambda r: list(zip(r.evals.steps, r.evals.ppl,
                                                       strict=True)))):
            _plot_row(ax, row, series, tokens, color, label)
    if summary.target is not None:
        ppl_ax.axhline(summary.target.ppl, color="gray", linestyle=":", linewidth=1,
                       label=f"P* = {summary.target.ppl:.2f} ({summary.target.config})")
    loss_ax.set_ylabel("training loss")
    ppl_ax.set_ylabel("test perplexity")
    ppl_ax.set_yscale("log")
    for ax in (loss_ax, ppl_ax):
        ax.set_xlabel("training tokens")
        ax.grid(True, which="both", alpha=0.3)
    # beside the axes, not over them: inside, it hid the highest curve (AdamW's)
    ppl_ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
                  fontsize="small")
    fig.suptitle(f"LLaMA {summary.setup['model']}: mean over finished seeds, min-max band; "
                 "dashed: diverged (x) or unfinished seeds", fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def plot_lr_sweep(summary: Summary, path: pathlib.Path) -> pathlib.Path:
    """Final test perplexity against the learning rate per configuration (log-log).

    Mean over the rate's finished seeds with a bar of one standard deviation; a rate where
    a seed diverged is an ``x`` at the top of the plot.
    """
    fig, _ = _figure(7.5, 4.6)
    ax = fig.add_subplot()
    configs = list(dict.fromkeys(c for c, _ in summary.cells))
    top = max((r.final_ppl for runs in summary.cells.values() for r in runs
               if r.final_ppl is not None), default=1.0)
    for i, config in enumerate(configs):
        color = f"C{i % 10}"
        rates = sorted(lr for c, lr in summary.cells if c == config)
        xs, ys, errs, bad = [], [], [], []
        for lr in rates:
            runs = summary.cells[(config, lr)]
            values = [r.final_ppl for r in runs if r.final_ppl is not None]
            if any(r.status == "diverged" for r in runs):
                bad.append(lr)
            if values:
                mean, sd = mean_sd(values)
                xs.append(lr)
                ys.append(mean)
                errs.append(sd or 0.0)
        ax.errorbar(xs, ys, yerr=errs, color=color, marker="o", capsize=3, label=config)
        if bad:
            ax.plot(bad, [top * 1.5] * len(bad), color=color, marker="x", linestyle="none")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("peak learning rate")
    ax.set_ylabel("final test perplexity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0,
              fontsize="small")
    ax.set_title("learning-rate sweep: mean ± sd over seeds; x at the top: a seed diverged",
                 fontsize="medium")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
