"""``sage-repro sweep``: the paper's comparison as configurations x seeds x learning rates.

Every run is one invocation of the trainer (``python -m sage_train``) in its own run
directory, ``OUT/runs/CONFIG/lrLR-seedSEED/MODEL-CONFIG``, under the paper's protocol
(Section "Experimental Setup"): a cosine schedule after a 10% linear warmup, each
configuration's β=(0.9, 0.99) and weight decay 0.01, an 8:2 train/test split, sequences of
512 tokens (or the model's longest, if shorter) and about 130k tokens per step
(256 x 512 = 131,072).  The model, data, length, batch, seeds, rates and configurations are
options.

* **Resumable.** Running the same command again skips every finished run (and every run
  that diverged: its outcome is a result) without starting the trainer, and resumes every
  unfinished one from its newest checkpoint (the trainer's own resume, bit-identical).
  ``OUT/sweep.json`` records the protocol; a rerun under another one is refused.
* **Learning-rate sweep.** With several rates (``--lrs``, or ``--lr-factors`` times each
  configuration's paper rate) every configuration is trained at each; its best rate is the
  one with the lowest mean final test perplexity among the rates at which every seed
  finished (a rate at which a seed diverged is never best).
* **Seeds at the best rate.** ``--best-seeds`` then trains these seeds at each
  configuration's best rate (``--top K``: only the K best configurations).
* **Report.** ``OUT/results.md`` and ``OUT/results.json``: per configuration, the mean and
  standard deviation over seeds of the final test perplexity, peak memory, tokens/s and the
  paper's effective throughput, beside the paper's 270M perplexity, with the tokens,
  parameters, hardware, software and date; ``OUT/loss_vs_tokens.png`` (and
  ``OUT/lr_sweep.png``).  :mod:`sage_repro.sweep_report` holds the definitions.

Why a process per run rather than :func:`sage_train.cli.main` in this process: the device
allocator's peak (the trainer's ``peak_memory_bytes``) is a high-water mark of the whole
process that is never reset, so only one process per run measures each run's peak alone
(and on the CPU the process's peak resident set, read from ``wait4``, is the only memory
figure there is); a run that crashes or runs out of memory takes only itself down; and a
GPU's memory is returned between runs.  The cost, starting Python and JAX and compiling the
step once per run, is seconds against the minutes of a run at the paper's scale.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import pathlib
import platform
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from sage_optim.presets import CONFIG_NAMES
from sage_repro import sweep_report as report
from sage_repro.paper import PAPER_LR_GRID
from sage_repro.spec import (
    DEFAULT_CUT,
    DEFAULT_OUT,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    PAPER_REFERENCE,
    PAPER_SEQ_LEN,
    PAPER_TOKENS_PER_STEP,
    STATE,
    Plan,
    Protocol,
    RunSpec,
    SweepError,
    managed_option,
    protocol_diff,
)
from sage_train.job.cli_args import DefaultsFormatter, OneLineParser, checked
from sage_train.job.signals import StopSignals
from sage_train.model.shapes import MODELS, get_model_config

if TYPE_CHECKING:
    from sage_repro.pieces import PiecePlan


def read_state(out: pathlib.Path) -> tuple[Protocol, Plan] | None:
    """The protocol and plan recorded in ``OUT/sweep.json`` (``None``: no sweep there).

    Raises:
      SweepError: the file is damaged.
    """
    path = out / STATE
    try:
        data = json.loads(path.read_text())
        problem = state_problem(data)
        if problem is None:
            protocol = Protocol.from_dict(data["protocol"])
            p = data["plan"]
            plan = Plan(configs=tuple(p["configs"]), seeds=tuple(p["seeds"]),
                        lrs=None if p["lrs"] is None else tuple(p["lrs"]),
                        lr_factors=tuple(p["lr_factors"]), best_seeds=tuple(p["best_seeds"]),
                        top=p["top"], reference=str(p["reference"]), piece=p.get("piece"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        problem = str(e)
    if problem is not None:
        raise SweepError(f"{path} is damaged ({problem}); move it away to start the record "
                         "anew")
    return protocol, plan


def _is_int(x: Any, low: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= low


def _is_number(x: Any) -> bool:
    return (isinstance(x, int | float) and not isinstance(x, bool)
            and math.isfinite(float(x)))


def _list_of(ok: Callable[[Any], bool], *, empty: bool = False) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, list) and (empty or bool(x)) and all(ok(v) for v in x)


def _maybe(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda x: x is None or ok(x)


_COUNT_FIELD = (lambda x: _is_int(x, 1), "an integer >= 1")
_FRACTION = (lambda x: _is_number(x) and 0 <= x <= 1, "a number in [0, 1]")
_STATE_FIELDS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "protocol": {
        "model": (lambda x: x in MODELS, f"one of {', '.join(MODELS)}"),
        "data": (_maybe(lambda x: isinstance(x, str)), "null or a string"),
        "steps": _COUNT_FIELD, "batch_size": _COUNT_FIELD, "seq_len": _COUNT_FIELD,
        "eval_every": _COUNT_FIELD, "eval_batches": _COUNT_FIELD, "log_every": _COUNT_FIELD,
        "checkpoint_every": _COUNT_FIELD,
        "schedule": (lambda x: isinstance(x, str), "a string"),
        "warmup_frac": _FRACTION, "final_lr_frac": _FRACTION,
        "clip": (_is_number, "a number"),
        "b1": (_maybe(_is_number), "null or a number"),
        "b2": (_maybe(_is_number), "null or a number"),
        "weight_decay": (_maybe(_is_number), "null or a number"),
        "trainer_args": (_list_of(lambda x: isinstance(x, str), empty=True),
                         "a list of strings"),
    },
    "plan": {
        "configs": (_list_of(lambda x: x in CONFIG_NAMES),
                    "a non-empty list of configuration names"),
        "seeds": (_list_of(lambda x: _is_int(x, 0)), "a non-empty list of integers >= 0"),
        "lrs": (_maybe(_list_of(lambda x: _is_number(x) and x > 0)),
                "null or a non-empty list of numbers > 0"),
        "lr_factors": (_list_of(lambda x: _is_number(x) and x > 0),
                       "a non-empty list of numbers > 0"),
        "best_seeds": (_list_of(lambda x: _is_int(x, 0), empty=True),
                       "a list of integers >= 0"),
        "top": (_maybe(lambda x: _is_int(x, 1)), "null or an integer >= 1"),
        "reference": (lambda x: isinstance(x, str), "a configuration name or 'slowest'"),
        "piece": (_maybe(lambda x: isinstance(x, str)), "null or a string"),
    },
}
_OPTIONAL_FIELDS = frozenset({"plan.piece", "protocol.schedule", "protocol.warmup_frac",
                              "protocol.final_lr_frac", "protocol.clip", "protocol.b1",
                              "protocol.b2", "protocol.weight_decay", "protocol.trainer_args"})


def state_problem(data: Any) -> str | None:
    """The first field of a ``sweep.json`` record that is missing or invalid (``None``: none).

    As ``plan.seeds must be a non-empty list of integers >= 0, got []``.
    """
    if not isinstance(data, dict):
        return f"it holds {type(data).__name__}, not an object"
    for section, fields in _STATE_FIELDS.items():
        part = data.get(section)
        if not isinstance(part, dict):
            return f"{section} must be an object, got {part!r}"
        for name, (ok, what) in fields.items():
            key = f"{section}.{name}"
            if name not in part:
                if key in _OPTIONAL_FIELDS:
                    continue
                return f"{key} is missing"
            if not ok(part[name]):
                return f"{key} must be {what}, got {json.dumps(part[name])}"
    return None


def write_state(out: pathlib.Path, protocol: Protocol, plan: Plan) -> None:
    """Record ``protocol`` and ``plan`` in ``OUT/sweep.json`` (atomically).

    Raises:
      SweepError: ``OUT`` holds a sweep of another protocol (every difference named).
    """
    from sage_train.store.rundir import atomic_write_text

    recorded = read_state(out)
    if recorded is not None:
        diff = protocol_diff(dataclasses.asdict(recorded[0]), dataclasses.asdict(protocol))
        if diff:
            raise SweepError(f"{out / STATE} records a sweep under other settings: "
                             f"{', '.join(diff)}; pass the same ones to continue it, or use "
                             "another --out")
    atomic_write_text(out / STATE, json.dumps(
        {"protocol": dataclasses.asdict(protocol), "plan": dataclasses.asdict(plan),
         "updated": _now()}, indent=2))




def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------------------
# what the run directories say
# ---------------------------------------------------------------------------


def read(out: pathlib.Path, protocol: Protocol, spec: RunSpec) -> report.RunRecord:
    """The record of ``spec``'s run (:func:`sage_repro.sweep_report.read_run`)."""
    return report.read_run(spec.config, spec.lr, spec.seed, spec.group(out),
                           spec.run_dir(out, protocol.model), protocol.steps)


def sweep_cells(out: pathlib.Path, protocol: Protocol, plan: Plan
                ) -> dict[tuple[str, float], tuple[report.RunRecord, ...]]:
    """Every ``(configuration, rate)`` of the first stage and its runs (the sweep's seeds)."""
    return {(c, lr): tuple(read(out, protocol, RunSpec(c, lr, s)) for s in plan.seeds)
            for c in plan.configs for lr in plan.rates(c)}


def chosen_rates(plan: Plan, cells: dict[tuple[str, float], tuple[report.RunRecord, ...]]
                 ) -> dict[str, float | None]:
    """Each configuration's rate for the main table: its only rate, or its best."""
    best = report.best_rates(cells)
    return {c: (plan.rates(c)[0] if len(plan.rates(c)) == 1 else best.get(c))
            for c in plan.configs}


def ranked(plan: Plan, cells: dict[tuple[str, float], tuple[report.RunRecord, ...]],
           rates: dict[str, float | None]) -> list[str]:
    """The configurations with a usable rate, best mean final perplexity first."""
    def score(config: str) -> float:
        runs = cells[(config, rates[config])]  # type: ignore[index]
        return sum(r.final_ppl or 0.0 for r in runs) / len(runs)

    usable = [c for c in plan.configs if rates[c] is not None
              and all(r.status == "finished" for r in cells[(c, rates[c])])]  # type: ignore
    return sorted(usable, key=score)


def second_stage(plan: Plan, cells: dict[tuple[str, float], tuple[report.RunRecord, ...]]
                 ) -> tuple[list[RunSpec], list[str]]:
    """The runs of ``--best-seeds`` and the configurations that get them."""
    if not plan.best_seeds:
        return [], []
    rates = chosen_rates(plan, cells)
    chosen = ranked(plan, cells, rates)[:plan.top]
    specs = [RunSpec(c, rates[c], s) for s in plan.best_seeds for c in chosen  # type: ignore
             if s not in plan.seeds]
    return specs, chosen


def summarize(out: pathlib.Path, protocol: Protocol, plan: Plan) -> report.Summary:
    """The report of the sweep in ``out`` as its run directories stand."""
    cells = sweep_cells(out, protocol, plan)
    rates = chosen_rates(plan, cells)
    _, chosen = second_stage(plan, cells)
    eligible = ranked(plan, cells, rates)
    rows = []
    for config in plan.configs:
        lr = rates[config]
        if lr is None:
            runs = tuple(r for (c, _), rs in cells.items() if c == config for r in rs)
            parts = [f"{rate:g}: " + report.Row(config, rate, cells[(config, rate)]).ppl_cell()
                     for rate in plan.rates(config)]
            rows.append(report.Row(config, None, runs,
                                   note="no rate at which every seed finished (" +
                                   "; ".join(parts) + ")"))
            continue
        seeds = list(plan.seeds)
        remark = ""
        if plan.best_seeds:
            if config in chosen:
                seeds += [s for s in plan.best_seeds if s not in seeds]
            elif config in eligible:
                remark = f"not in the top {plan.top}: no --best-seeds"
            else:
                remark = "no --best-seeds: a seed at this rate did not finish"
        runs = tuple(read(out, protocol, RunSpec(config, lr, s)) for s in seeds)
        rows.append(report.Row(config, lr, runs, remark=remark))
    reference = plan.reference
    if reference != "slowest" and reference not in plan.configs:
        reference = "slowest"
    setup = protocol.setup()
    setup["data_tokens"] = _data_tokens(out, plan)
    setup["data_fingerprints"] = data_fingerprints(out, protocol, plan)
    if plan.piece is not None:
        setup["piece"] = plan.piece
    return report.summarize(rows, cells, reference, setup)


_DATA_LINE = re.compile(r"^data:\s+.*: ([\d,]+ train and [\d,]+ test tokens)$", re.M)


def _data_tokens(out: pathlib.Path, plan: Plan) -> str | None:
    """The size of the data's splits, from the header of a trainer's log (where one ran)."""
    for spec in plan.grid():
        with contextlib.suppress(OSError):
            with open(spec.group(out) / "train.log", "rb") as f:
                head = f.read(1 << 16).decode(errors="replace")  # the header is at the top
            match = _DATA_LINE.search(head)
            if match:
                return match.group(1)
    return None


FINGERPRINTS = ("cut_fingerprint", "corpus_fingerprint", "data_fingerprint")
"""The keys of a run's ``config.json`` that name its data, the most telling first: a cut's
fingerprint, else the corpus's, else the trainer's own hash of the token arrays."""


def data_fingerprints(out: pathlib.Path, protocol: Protocol, plan: Plan) -> list[str]:
    """The fingerprints of the data the first stage's runs trained on (``config.json``).

    One where all trained on the same data; none before a run started.
    """
    found = set()
    for spec in plan.grid():
        with contextlib.suppress(OSError, ValueError):
            settings = json.loads((spec.run_dir(out, protocol.model) / "config.json")
                                  .read_text())
            key = next((k for k in FINGERPRINTS if settings.get(k)), None)
            if key is not None:
                found.add(str(settings[key]))
    return sorted(found)


def write_report(out: pathlib.Path, protocol: Protocol, plan: Plan) -> report.Summary:
    """Write ``results.md``, ``results.json`` and the figures into ``out``; return the summary."""
    from sage_train.store.rundir import atomic_write_text

    summary = summarize(out, protocol, plan)
    figures = report.write_figures(summary, out)
    atomic_write_text(out / "results.md", report.to_markdown(summary, figures))
    atomic_write_text(out / "results.json",
                      json.dumps(report.to_json(summary, figures), indent=2) + "\n")
    return summary


# ---------------------------------------------------------------------------
# running the trainer
# ---------------------------------------------------------------------------


_PROBE = """\
import json, jax
d = jax.devices()
print(json.dumps({"platform": d[0].platform, "device_kind": d[0].device_kind,
                  "device_count": len(d)}))
"""


def environment() -> dict[str, Any]:
    """The hardware and software the runs use, for the report.

    The devices are asked in a short child process (importing JAX here would start a
    backend in the harness, which on a GPU takes memory from the runs).
    """
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                              env=env, timeout=300, check=False)
        found = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {}
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        found = {}
    versions = {"python": platform.python_version()}
    for dist in ("sage-optim", "jax", "jaxlib", "flax", "optax", "numpy"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    return {**found, "cpu": _cpu_model(), "cpu_count": os.cpu_count(), "versions": versions}


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or None


COMPILE_CACHE = "xla_cache"
"""JAX's persistent compilation cache of a sweep's runs, in ``OUT`` (unless the environment
names one: ``JAX_COMPILATION_CACHE_DIR``)."""


def child_environment(out: pathlib.Path) -> dict[str, str]:
    """The trainer's environment: this one, with JAX's persistent compilation cache in ``out``.

    A configuration's runs at every rate and seed (and resumed runs) compile the same step
    (the peak rate is a value of the optimizer state), which the cache then compiles once per
    sweep.  Compilation is outside every figure of the
    report (the trainer's clock starts after the first step), so the cache changes no
    result, only the sweep's wall time.  A ``JAX_COMPILATION_CACHE_DIR`` already set is kept.
    """
    env = dict(os.environ)
    if "JAX_COMPILATION_CACHE_DIR" not in env:
        env["JAX_COMPILATION_CACHE_DIR"] = str((out / COMPILE_CACHE).absolute())
        env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    return env


class Signals(StopSignals):
    """The harness's signals while it runs the trainer (:class:`StopSignals`).

    SIGTERM and SIGUSR1 (a preemption) are also passed on to the running trainer, which
    saves a checkpoint of the step reached and exits with status 75; the sweep then stops.
    SIGINT (Ctrl-C, which the terminal sends to the trainer too) stops the sweep once the
    trainer has stopped; a second one exits at once (the same SIGTERM or SIGUSR1 a second
    time too, after passing it on).  Calling the object names the first signal received.
    ``children``: the trainer processes running at once (``--together``), each passed them
    as ``child`` is.
    """

    def __init__(self) -> None:
        super().__init__()
        self.child: int | None = None
        self.children: list[int] = []

    def _handle(self, signum: int, frame: Any) -> None:
        if signum != signal.SIGINT:  # first: a second one exits
            for pid in [*([] if self.child is None else [self.child]), *self.children]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)
        super()._handle(signum, frame)


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What one invocation of the trainer did for a run."""

    action: str  # "skipped", "started" or "resumed"
    outcome: str  # "finished", "diverged", "failed", "stopped" (a signal), or as skipped
    detail: str = ""
    returncode: int | None = None


def run_one(out: pathlib.Path, protocol: Protocol, spec: RunSpec, signals: Signals,
            env: Callable[[], dict[str, Any]]) -> Outcome:
    """Train (or resume) one run in a child process, unless it finished or diverged.

    The trainer's output goes to ``train.log`` and ``train.err`` beside the run directory;
    the invocation is recorded in ``sweep.jsonl`` (its outcome, the child's peak resident
    set, the hardware and software).

    Raises:
      SweepError: the trainer refused the run (exit status 2: its one-line reason).
    """
    before = read(out, protocol, spec)
    if before.status in ("finished", "diverged"):
        check_reusable(out, protocol, spec)
        return Outcome("skipped", before.status, before.describe())
    if set_aside_final_checkpoint(out, protocol, spec):  # its last metrics rows are gone
        before = read(out, protocol, spec)
    group = spec.group(out)
    group.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "sage_train", *protocol.trainer_argv(spec, group)]
    info = env()
    if signals() is not None:  # arrived while the devices were asked: start nothing
        return Outcome("skipped", "stopped", f"not started: {signals()}")
    log, err = group / "train.log", group / "train.err"
    offset = err.stat().st_size if err.exists() else 0
    started, t0 = _now(), time.monotonic()
    with open(log, "ab") as out_f, open(err, "ab") as err_f:
        out_f.write(f"# sage-repro sweep, {started}: {shlex.join(cmd)}\n".encode())
        out_f.flush()
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env=child_environment(out))
        signals.child = proc.pid
        if (name := signals()) in ("SIGTERM", "SIGUSR1"):  # arrived as it started
            os.kill(proc.pid, getattr(signal, str(name)))
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            signals.child = None
    rc = proc.returncode = os.waitstatus_to_exitcode(status)
    return conclude(out, protocol, spec, before, cmd, info, rc, err, offset, started,
                    time.monotonic() - t0, usage.ru_maxrss * 1024)


def conclude(out: pathlib.Path, protocol: Protocol, spec: RunSpec, before: report.RunRecord,
             cmd: Sequence[str], info: dict[str, Any], rc: int, err: pathlib.Path,
             offset: int, started: str, wall_s: float, max_rss_bytes: int,
             together: int | None = None) -> Outcome:
    """A trained run's outcome, from its exit status and stderr, recorded in ``sweep.jsonl``.

    ``together``: the trainer processes that shared the device with it (``--together``;
    recorded as ``together``, also in its environment, which the report describes: its
    tokens/s is its share of the device).

    Raises:
      SweepError: the trainer refused the run (exit status 2: its one-line reason).
    """
    group = spec.group(out)
    action = "resumed" if before.step_reached else "started"
    stderr = err.read_bytes()[offset:].decode(errors="replace")
    after = read(out, protocol, spec)
    last_line = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
    step: int | None = None
    if rc == 0 and after.status == "finished":
        outcome, detail = "finished", ""
    elif rc == 0:
        outcome, detail = "failed", (f"the trainer ended at step {after.step_reached} of "
                                     f"{protocol.steps} without the final evaluation in "
                                     f"{spec.run_dir(out, protocol.model) / 'metrics.jsonl'}")
        step = after.step_reached
    elif rc == 1 and (stop := report.stop_reason(spec.config, stderr)) is not None:
        outcome, (detail, step) = "diverged", stop
    elif rc in (EXIT_PREEMPTED, EXIT_INTERRUPTED) or rc < 0:
        outcome, detail = "stopped", last_line or f"exit status {rc}"
    else:
        outcome, detail = "failed", last_line or f"exit status {rc}"
        step = after.step_reached
    record = {"started": started, "ended": _now(), "action": action,
              "start_step": before.step_reached, "end_step": after.step_reached,
              "returncode": rc, "outcome": outcome, "reason": detail, "step": step,
              "wall_s": round(wall_s, 3),
              "max_rss_bytes": max_rss_bytes,  # Linux reports KiB: times 1024
              "environment": info if together is None else {**info, "together": together},
              "argv": list(cmd[1:])}
    if together is not None:
        record["together"] = together
    from sage_train.store.rundir import append_line

    append_line(group / report.SEGMENTS, json.dumps(record))
    if rc == 2:
        raise SweepError(f"the trainer refused {spec.label()}: {last_line} (log: {err})")
    return Outcome(action, outcome, detail, rc)


_DERIVED_SETTINGS = frozenset({"dtype", "layers", "loss_chunk", "attention", "sinkgd_kernel"})
"""Recorded settings resolved on the devices (``auto``): not compared by the harness."""


def expected_settings(out: pathlib.Path, protocol: Protocol, spec: RunSpec) -> dict[str, Any]:
    """The settings ``sage-train`` records for ``spec`` under ``protocol``.

    Those it can know without the devices, in the form of the run's ``config.json``.

    Raises:
      SweepError: the options after ``--`` are refused by ``sage-train``.
    """
    import io

    from sage_train.cli import configs, parse_args
    from sage_train.run.config import default_hyperparameter

    argv = protocol.trainer_argv(spec, spec.group(out))
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            (cfg,) = configs(parse_args(argv))
    except SystemExit:
        raise SweepError(err.getvalue().strip().splitlines()[-1] if err.getvalue().strip()
                         else f"sage-train refuses {shlex.join(protocol.trainer_args)}"
                         ) from None
    settings = dataclasses.asdict(cfg)
    for hp in ("weight_decay", "b1", "b2"):
        if settings[hp] is None:
            settings[hp] = default_hyperparameter(cfg.optimizer, hp)
    if cfg.init_from_hf is not None:
        settings["init_from_hf"] = str(pathlib.Path(cfg.init_from_hf).expanduser().absolute())
    return settings


def check_reusable(out: pathlib.Path, protocol: Protocol, spec: RunSpec) -> None:
    """Refuse to reuse ``spec``'s finished (or diverged) run trained under other settings.

    Its recorded settings (``config.json``) must be the ones this sweep would train it with.

    Compared: every setting that changes the math, the data or the evaluation
    (:data:`sage_train.store.rundir.MATH_FIELDS` and ``eval_every``), except those resolved on the
    devices (the kernels, the compute dtype and the layer layout).

    Raises:
      SweepError: the run was trained otherwise (every difference named), or its settings
        are not recorded.
    """
    from sage_train.job.errors import RunDirError
    from sage_train.store import rundir

    run_dir = spec.run_dir(out, protocol.model)
    try:
        recorded = rundir.read_settings(run_dir)
    except RunDirError as e:
        raise SweepError(str(e)) from None
    if recorded is None:
        raise SweepError(f"{spec.label()}: {run_dir} holds a run whose settings are not "
                         f"recorded ({rundir.CONFIG}); move it away to train it again")
    fields = tuple(f for f in (*rundir.MATH_FIELDS, "eval_every")
                   if f not in _DERIVED_SETTINGS)
    diff = rundir.differences(recorded, expected_settings(out, protocol, spec), fields)
    if diff:
        raise SweepError(f"{spec.label()}: {run_dir} was trained under other settings than "
                         f"this sweep's ({rundir.format_differences(diff)}); move it away to "
                         "train it again, or give the settings it was trained with")


def set_aside_final_checkpoint(out: pathlib.Path, protocol: Protocol, spec: RunSpec) -> bool:
    """Let an unfinished run whose newest checkpoint is its last step be trained again.

    Such a run lost the last rows of its ``metrics.jsonl`` (the final evaluation): the
    trainer, resuming at its last step, would have nothing to train and the rows would never
    come back.  Its checkpoint of ``protocol.steps`` is renamed ``STEP.superseded`` (kept,
    never read), so the trainer resumes from the one before (or
    from step 0) and recomputes the rows, bit-identical.  Returns whether one was set aside.
    """
    root = spec.run_dir(out, protocol.model) / "checkpoints"
    if not root.is_dir():
        return False
    moved = False
    for path in sorted(root.iterdir()):
        if path.name == str(protocol.steps) and path.is_dir():
            dest = root / f"{path.name}.superseded"
            n = 1
            while dest.exists():
                n += 1
                dest = root / f"{path.name}.superseded-{n}"
            os.replace(path, dest)
            moved = True
    return moved


def _say_outcome(where: str, result: Outcome, record: report.RunRecord,
                 say: Callable[[str], None]) -> None:
    if result.action == "skipped":
        say(f"{where}: {result.detail}, skipped")
    elif result.outcome == "finished":
        say(f"{where}: finished, test ppl {record.final_ppl:.2f}, "
            f"{record.tokens_per_s or 0:,.0f} tokens/s")
    else:
        say(f"{where}: {result.outcome}: {result.detail}")


BATCH_JOBS = "batch-jobs.json"
"""``--one-process``: the jobs file of :mod:`sage_repro.batch`, in the sweep's folder
(``--together N``: ``batch-jobs-K.json`` for the trainer process ``K`` of ``N``)."""

TOGETHER_MEMORY = 0.9
"""``--together N``: the share of the device's memory the ``N`` trainer processes may take in
all (each ``TOGETHER_MEMORY / N``: ``XLA_PYTHON_CLIENT_MEM_FRACTION``, unless set)."""


def together_environment(out: pathlib.Path, lanes: int) -> dict[str, str]:
    """The environment of each of ``lanes`` trainer processes sharing one device.

    :func:`child_environment` (one persistent compilation cache for all of them), with
    JAX's preallocation off and each process's share of the device's memory capped at
    ``TOGETHER_MEMORY / lanes`` (``XLA_PYTHON_CLIENT_PREALLOCATE``,
    ``XLA_PYTHON_CLIENT_MEM_FRACTION``; values already set are kept).  One process
    (``lanes == 1``) keeps JAX's defaults.
    """
    env = child_environment(out)
    if lanes > 1:
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{TOGETHER_MEMORY / lanes:.3f}")
    return env


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], signals: Signals) -> list[int]:
    """The exit statuses of ``procs``, each passed the signals the sweep receives meanwhile."""
    signals.children = [proc.pid for proc in procs]
    if (name := signals()) in ("SIGTERM", "SIGUSR1"):  # arrived as they started
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, getattr(signal, str(name)))
    try:
        return [os.waitstatus_to_exitcode(os.wait4(proc.pid, 0)[1]) for proc in procs]
    finally:
        signals.children = []


def run_batch(out: pathlib.Path, protocol: Protocol, specs: Sequence[RunSpec],
              signals: Signals, env: Callable[[], dict[str, Any]],
              say: Callable[[str], None], together: int = 1) -> list[Outcome]:
    """Run ``specs`` in one trainer process (:mod:`sage_repro.batch`), or in ``together``.

    The same outcomes and records as :func:`run_all` run by run, except that the peak
    memory and resident set of a run are its process's so far.  With ``together`` ``N >
    1`` the runs still to train are dealt to ``N`` trainer processes in turn (run ``i`` to
    process ``i mod N``), which run at once on the device (:func:`together_environment`),
    each its runs one after another; each run's math is the same as alone (its own process,
    program and data order), its tokens/s is its share of the device.
    """
    outcomes, pending = _batch_pending(out, protocol, specs, say)
    if not pending:
        return outcomes
    info = env()
    if signals() is not None:
        return [*outcomes, *(Outcome("skipped", "stopped", f"not started: {signals()}")
                             for _ in pending)]
    lanes = max(1, min(together, len(pending)))
    started = _now()
    jobs: list[list[dict[str, Any]]] = [[] for _ in range(lanes)]
    for i, (where, spec, before, group, err, _) in enumerate(pending):
        argv = protocol.trainer_argv(spec, group)
        how = ("--one-process" if lanes == 1 else
               f"--together {together}, process {i % lanes + 1} of {lanes}")
        with open(group / "train.log", "ab") as f:
            f.write(f"# sage-repro sweep {how}, {started}: {shlex.join(argv)}\n".encode())
        doing = "resuming" if before.step_reached else "training"
        say(f"{where}: {doing} in the sweep's one trainer process (log: {group / 'train.log'})"
            if lanes == 1 else
            f"{where}: {doing} in trainer process {i % lanes + 1} of {lanes} at once "
            f"(log: {group / 'train.log'})")
        jobs[i % lanes].append({"argv": argv, "log": str(group / "train.log"),
                                "err": str(err), "exit": str(group / "batch-exit.json")})
    from sage_train.store.rundir import atomic_write_text

    names = ([(BATCH_JOBS, "batch.log")] if lanes == 1 else
             [(f"batch-jobs-{k + 1}.json", f"batch-{k + 1}.log") for k in range(lanes)])
    child_env = together_environment(out, lanes)
    with contextlib.ExitStack() as stack:
        procs = []
        for lane, (jobs_name, log_name) in zip(jobs, names, strict=True):
            atomic_write_text(out / jobs_name, json.dumps(lane, indent=1) + "\n")
            log_f = stack.enter_context(open(out / log_name, "ab"))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "sage_repro.batch", str(out / jobs_name)],
                stdout=log_f, stderr=subprocess.STDOUT, env=child_env))
        codes = _wait_all(procs, signals)
    for i, (where, spec, before, group, err, offset) in enumerate(pending):
        job = jobs[i % lanes][i // lanes]
        try:
            ended = json.loads((group / "batch-exit.json").read_text())
        except (OSError, ValueError):
            result = _batch_not_run(out / names[i % lanes][1], signals, codes[i % lanes])
        else:
            argv = [sys.executable, *job["argv"]]
            result = conclude(out, protocol, spec, before, argv, info,
                              int(ended["returncode"]), err, offset, started,
                              float(ended["wall_s"]), int(ended["max_rss_bytes"]),
                              together=lanes if lanes > 1 else None)
        outcomes.append(result)
        _say_outcome(where, result, read(out, protocol, spec), say)
    return outcomes


def _batch_not_run(log: pathlib.Path, signals: Signals, rc: int) -> Outcome:
    """The outcome of a batch run that its trainer process (its log ``log``) never reached."""
    detail = (f"not started: {signals()}" if signals() is not None else
              f"not run: the trainer process ended with status {rc} before it "
              f"(log: {log})")
    return Outcome("skipped", "stopped" if signals() is not None else "failed", detail, rc)


_Pending = tuple[str, RunSpec, report.RunRecord, pathlib.Path, pathlib.Path, int]


def _batch_pending(out: pathlib.Path, protocol: Protocol, specs: Sequence[RunSpec],
                   say: Callable[[str], None]) -> tuple[list[Outcome], list[_Pending]]:
    """The outcomes of the runs already done (skipped), and the runs still to do.

    Each run to do is ``(where, spec, before, group, err, err offset)``, its folder made.
    """
    outcomes: list[Outcome] = []
    pending: list[_Pending] = []
    for i, spec in enumerate(specs, 1):
        where = f"[{i}/{len(specs)}] {spec.label()}"
        before = read(out, protocol, spec)
        if before.status in ("finished", "diverged"):
            check_reusable(out, protocol, spec)
            result = Outcome("skipped", before.status, before.describe())
            outcomes.append(result)
            _say_outcome(where, result, before, say)
            continue
        if set_aside_final_checkpoint(out, protocol, spec):
            before = read(out, protocol, spec)
        group = spec.group(out)
        group.mkdir(parents=True, exist_ok=True)
        err = group / "train.err"
        (group / "batch-exit.json").unlink(missing_ok=True)
        pending.append((where, spec, before, group, err,
                        err.stat().st_size if err.exists() else 0))
    return outcomes, pending


def run_all(out: pathlib.Path, protocol: Protocol, specs: Sequence[RunSpec], signals: Signals,
            env: Callable[[], dict[str, Any]], say: Callable[[str], None],
            one_process: bool = False, together: int = 1) -> list[Outcome]:
    """Run ``specs`` in order, one line each; stop at the first signal.

    ``one_process``: all in one trainer process (:func:`run_batch`); ``together`` ``N >
    1``: in ``N`` trainer processes at once on the device, each its share in turn.
    """
    if one_process or together > 1:
        return run_batch(out, protocol, specs, signals, env, say, together)
    outcomes = []
    for i, spec in enumerate(specs, 1):
        if signals.received is not None:
            break
        where = f"[{i}/{len(specs)}] {spec.label()}"
        before = read(out, protocol, spec)
        if before.status not in ("finished", "diverged"):
            doing = (f"resuming at step {before.step_reached}" if before.step_reached else
                     "training")
            say(f"{where}: {doing} (log: {spec.group(out) / 'train.log'})")
        result = run_one(out, protocol, spec, signals, env)
        outcomes.append(result)
        _say_outcome(where, result, read(out, protocol, spec), say)
        if result.outcome == "stopped":
            break
    return outcomes


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------


_COUNT = checked(int, lambda v: v >= 1, "an integer >= 1")
_SEED = checked(int, lambda v: v >= 0, "an integer >= 0")
_RATE = checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")
_BELOW_ONE = checked(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_FINITE = checked(float, lambda v: math.isfinite(v) and v >= 0, "a number >= 0")


def build_parser() -> argparse.ArgumentParser:
    """The ``sage-repro`` parser (subcommands ``sweep``, ``report`` and ``cut-data``)."""
    p = OneLineParser(prog="sage-repro", description="The SAGE paper's comparison, reproduced: "
                "configurations x seeds x learning rates (see docs/reproduce.md).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    s = sub.add_parser("sweep", help="train the sweep (resumable) and write its report",
                       description="The paper's comparison as configurations x seeds x "
                       "learning rates, each run resumable in its own run directory, under "
                       "the paper's protocol (cosine schedule, 10%% warmup, 8:2 split, "
                       "sequences of 512, 130k tokens per step); then OUT/results.md and "
                       ".json and the figures.",
                       formatter_class=DefaultsFormatter,
                       epilog="Options after -- go to every sage-train run (for example "
                       "-- --sharding none --remat dots). Exit status: 0 done (diverged runs "
                       "are results), 1 a run failed, 2 invalid options or a refused run, "
                       "75 preempted (SIGTERM/SIGUSR1: the running trainer saved a "
                       "checkpoint), 130 interrupted; rerun the same command to resume.")
    s.add_argument("--out", type=pathlib.Path, default=None,
                   help=f"the sweep's directory: runs, results.md, results.json, figures "
                   f"(default: {DEFAULT_OUT}; with --piece NAME: runs/pieces/NAME)")
    s.add_argument("--one-process", action="store_true",
                   help="train the runs in one trainer process, one after another (Python "
                   "and JAX start once; a run's peak memory is then the process's so far)")
    s.add_argument("--together", type=_COUNT, default=1, metavar="N",
                   help="train the runs in N trainer processes at once on the device, each "
                   "its share one after another (each capped at 0.9/N of the device's "
                   "memory; a run's tokens/s is then its share); not measured faster yet: "
                   "see docs/reproduce.md")
    s.add_argument("--piece", default=None, metavar="NAME",
                   help="train one piece of the plan of pieces (--plan; default: the paper's "
                   "on the 20m model and the cut data/paper-cut), which sets every option of "
                   "the protocol and the runs; with --dry-run, 'all' lists every piece")
    s.add_argument("--plan", type=pathlib.Path, default=None, metavar="NAME|FILE",
                   help="with --piece: a plan of pieces ('paper', 'grid' or a JSON file) "
                   "instead of the paper's")
    s.add_argument("--model", default="small", choices=list(MODELS), metavar="NAME",
                   help=f"LLaMA size: {', '.join(MODELS)}")
    s.add_argument("--data", default=None,
                   help="sage-train --data (a text folder or file, a token file, or a corpus "
                   "name such as installed); default: the trainer's, the standard library")
    s.add_argument("--configs", nargs="+", default=list(CONFIG_NAMES), choices=CONFIG_NAMES,
                   metavar="NAME", help="configurations: " + ", ".join(CONFIG_NAMES))
    s.add_argument("--seeds", nargs="+", type=_SEED, default=[0, 1, 2],
                   help="seeds of every configuration at every rate")
    rates = s.add_mutually_exclusive_group()
    rates.add_argument("--lrs", nargs="+", type=_RATE,
                       help="peak learning rates of every configuration (the paper's grid: "
                       f"{' '.join(f'{x:g}' for x in PAPER_LR_GRID)}); default: each "
                       "configuration's paper rate")
    rates.add_argument("--lr-factors", nargs="+", type=_RATE,
                       help="peak learning rates as multiples of each configuration's paper "
                       "rate (0.5 1 2: a short sweep around it)")
    s.add_argument("--best-seeds", nargs="+", type=_SEED, default=None,
                   help="then train these seeds at each configuration's best rate")
    s.add_argument("--top", type=_COUNT, default=None,
                   help="with --best-seeds: only the TOP configurations of lowest perplexity")
    s.add_argument("--reference", default=None, choices=[*CONFIG_NAMES, "slowest"],
                   metavar="NAME", help="the effective throughput's baseline (default: the paper's "
                   f"{PAPER_REFERENCE} where it is swept, else slowest: the highest mean "
                   "final perplexity)")
    length = s.add_mutually_exclusive_group()
    length.add_argument("--steps", type=_COUNT,
                        help="optimizer steps of every run")
    length.add_argument("--tokens", type=_COUNT,
                        help="training tokens of every run (rounded down to whole steps)")
    batch = s.add_mutually_exclusive_group()
    batch.add_argument("--tokens-per-step", type=_COUNT, metavar="N",
                       default=PAPER_TOKENS_PER_STEP,
                       help="tokens per step, a multiple of --seq-len (the paper: 130k)")
    batch.add_argument("--batch-size", type=_COUNT, metavar="N",
                       help="sequences per step (instead of --tokens-per-step)")
    s.add_argument("--seq-len", type=_COUNT, default=None,
                   help=f"tokens per sequence (default: {PAPER_SEQ_LEN}, or the model's "
                   "longest if shorter)")
    s.add_argument("--warmup-frac", type=_BELOW_ONE, default=0.1,
                   help="fraction of the steps in linear warmup")
    s.add_argument("--final-lr-frac", type=_BELOW_ONE, default=0.1,
                   help="the cosine's final rate as a fraction of the peak")
    s.add_argument("--clip", type=_FINITE, default=1.0,
                   help="global-norm gradient clipping (0: off)")
    for hp, paper, kind in (("b1", "0.9", _BELOW_ONE), ("b2", "0.99", _BELOW_ONE),
                            ("weight-decay", "0.01", _FINITE)):
        s.add_argument(f"--{hp}", type=kind, default=None,
                       help=f"every rule's {hp} (default: each configuration's, the "
                       f"paper's {paper})")
    s.add_argument("--eval-every", type=_COUNT, default=None,
                   help="steps between test evaluations (default: steps/40): the "
                   "resolution of the effective throughput")
    s.add_argument("--eval-batches", type=_COUNT, default=4,
                   help="batches of the fixed test windows per evaluation")
    s.add_argument("--log-every", type=_COUNT, default=None,
                   help="steps between training-loss rows (default: steps/200)")
    s.add_argument("--checkpoint-every", type=_COUNT,
                   default=None, help="steps between checkpoints (default: steps/10)")
    s.add_argument("--dry-run", action="store_true",
                   help="print the runs and their 6·N·D FLOPs, train nothing")
    s.add_argument("--assume-tflops", type=_RATE, default=None,
                   help="with --dry-run: the time at this many achieved TFLOP/s")
    s.add_argument("--assume-overhead", type=_FINITE, default=None, metavar="SECONDS",
                   help="with --dry-run --piece: seconds a run spends outside its steps "
                   "(start-up, compilation, checkpoints; default 45)")
    s.add_argument("--assume-together", type=_RATE, default=None, metavar="SPEEDUP",
                   help="with --dry-run --piece --assume-tflops: pieces run SPEEDUP times "
                   "faster (--together; an assumption, not a measurement)")
    c = sub.add_parser("cut-data", help="cut a fixed, fingerprinted token set from a corpus, "
                       "to train on the same tokens on every machine",
                       formatter_class=DefaultsFormatter,
                       description="Whole documents of the corpus's train and test splits, "
                       "drawn by their hash, within the token budgets, into a folder that "
                       "sage-train --data takes (see sage_train.data.cut and docs/reproduce.md).")
    c.add_argument("--out", type=pathlib.Path, default=None,
                   help=f"the cut's folder (it must not exist, be empty, or hold the same cut; "
                   f"default: {DEFAULT_CUT}, with --plan the plan's)")
    c.add_argument("--data", default=None,
                   help="the corpus to cut (sage-train --data), or a pack (sage_train.data.pack: "
                   "cut whole; default: installed, with --plan the plan's pack)")
    c.add_argument("--model", default=None, choices=list(MODELS), metavar="NAME",
                   help=f"the model whose vocabulary the corpus is tokenized with "
                   f"({', '.join(MODELS)}; default: 20m, with --plan the plan's)")
    c.add_argument("--plan", type=pathlib.Path, default=None, metavar="NAME|FILE",
                   help="cut the data of this plan of pieces ('grid': its committed pack) and "
                   "check the cut's fingerprint against the plan's")
    c.add_argument("--train-tokens", type=_COUNT, default=20_000_000,
                   help="at most this many tokens of the train split")
    c.add_argument("--test-tokens", type=_COUNT, default=2_000_000,
                   help="at most this many tokens of the test split")
    r = sub.add_parser("report", help="write the report of a sweep from its run directories",
                       formatter_class=DefaultsFormatter,
                       description="Rebuild OUT/results.md, results.json and the figures "
                       "from what the runs recorded (also while a sweep is half done).")
    where = r.add_mutually_exclusive_group()
    where.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT,
                       help="the sweep's directory")
    where.add_argument("--pieces", type=pathlib.Path, default=None, metavar="DIR",
                       help="merge every piece's results.json under DIR (benchmarks/paper) "
                       "into DIR/results.md, results.json and the figures")
    r.add_argument("--plan", type=pathlib.Path, default=None, metavar="NAME|FILE",
                   help="with --pieces: a plan of pieces ('paper', 'grid' or a JSON file) "
                   "instead of the paper's")
    r.add_argument("--reference", default=None, choices=[*CONFIG_NAMES, "slowest"],
                   metavar="NAME",
                   help="the effective throughput's baseline (default: as the sweep said)")
    return p


def _batch_size(args: argparse.Namespace, seq_len: int) -> int:
    """The sequences per step: ``--batch-size``, or ``--tokens-per-step`` over ``seq_len``."""
    if args.batch_size is not None:
        return args.batch_size
    if args.tokens_per_step % seq_len:
        raise SweepError(f"--tokens-per-step {args.tokens_per_step} is not a multiple of the "
                         f"sequence length {seq_len} (--seq-len)")
    return args.tokens_per_step // seq_len


def _steps(args: argparse.Namespace, tokens_per_step: int) -> int:
    """The steps of each run: ``--steps``, or ``--tokens`` over ``tokens_per_step``."""
    if args.steps is not None:
        return args.steps
    if args.tokens is not None:
        if args.tokens < tokens_per_step:
            raise SweepError(f"--tokens {args.tokens:,} is less than one step of "
                             f"{tokens_per_step:,} tokens")
        return args.tokens // tokens_per_step
    raise SweepError("the length of each run is missing: give --steps N or --tokens N")


def _check_trainer_args(trainer_args: Sequence[str]) -> None:
    """Refuse a trainer option after ``--`` that the sweep sets itself."""
    for flag in trainer_args:
        managed = managed_option(flag)
        if managed is not None:
            name = flag.split("=", 1)[0]
            spelled = "" if name == managed else f" (a spelling of {managed})"
            raise SweepError(f"{name} after --{spelled} is set by sage-repro sweep itself: use "
                             f"its own {managed if managed != '--lr' else '--lrs'} option")


def protocol_and_plan(args: argparse.Namespace, trainer_args: Sequence[str]
                      ) -> tuple[Protocol, Plan]:
    """The :class:`Protocol` and :class:`Plan` of ``sage-repro sweep``'s options.

    Raises:
      SweepError: inconsistent options (each message names the option).
    """
    model = get_model_config(args.model)
    seq_len = args.seq_len or min(PAPER_SEQ_LEN, model.max_position_embeddings)
    if seq_len > model.max_position_embeddings:
        raise SweepError(f"--seq-len {seq_len} is longer than the {args.model} model's "
                         f"{model.max_position_embeddings} positions")
    batch = _batch_size(args, seq_len)
    steps = _steps(args, batch * seq_len)
    if args.top is not None and args.best_seeds is None:
        raise SweepError("--top chooses the configurations that get --best-seeds: give "
                         "--best-seeds too")
    _check_trainer_args(trainer_args)
    eval_every = args.eval_every or max(1, steps // 40)
    protocol = Protocol(
        model=args.model, data=args.data, steps=steps, batch_size=batch, seq_len=seq_len,
        eval_every=eval_every, eval_batches=args.eval_batches,
        log_every=args.log_every or max(1, steps // 200),
        checkpoint_every=args.checkpoint_every or max(1, steps // 10),
        warmup_frac=args.warmup_frac, final_lr_frac=args.final_lr_frac, clip=args.clip,
        b1=args.b1, b2=args.b2, weight_decay=args.weight_decay,
        trainer_args=tuple(trainer_args))
    configs = tuple(dict.fromkeys(args.configs))
    reference = args.reference or (PAPER_REFERENCE if PAPER_REFERENCE in configs else "slowest")
    if reference not in (*configs, "slowest"):
        raise SweepError(f"--reference {reference} is not among --configs")
    plan = Plan(configs=configs, seeds=tuple(dict.fromkeys(args.seeds)),
                lrs=None if args.lrs is None else tuple(args.lrs),
                lr_factors=tuple(args.lr_factors or (1.0,)),
                best_seeds=tuple(dict.fromkeys(args.best_seeds or ())), top=args.top,
                reference=reference)
    return protocol, plan


def dry_run(protocol: Protocol, plan: Plan, assume_tflops: float | None,
            say: Callable[[str], None]) -> None:
    """Print the runs of ``plan`` and their FLOPs (6·N·D), training nothing."""
    grid = plan.grid()
    n = get_model_config(protocol.model).param_count()
    tokens = protocol.steps * protocol.tokens_per_step
    flops = 6 * n * tokens
    later = len([s for s in plan.best_seeds if s not in plan.seeds]) * min(
        len(plan.configs), plan.top or len(plan.configs))
    say(f"{len(grid)} runs of {protocol.model} ({n:,} parameters), each {protocol.steps:,} "
        f"steps x {protocol.tokens_per_step:,} tokens = {tokens:,} tokens, "
        f"6·N·D = {flops:.3g} FLOP")
    for spec in grid:
        say(f"  {spec.label()}")
    if later:
        say(f"then up to {later} runs of --best-seeds at the best rates")
    total = flops * (len(grid) + later)
    line = f"in all {len(grid) + later} runs, {total:.3g} FLOP"
    if assume_tflops is not None:
        line += (f": {total / (assume_tflops * 1e12) / 60:.1f} minutes at "
                 f"{assume_tflops:g} TFLOP/s")
    say(line)


def _split_trainer_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """``sage-repro``: run a sweep or rebuild its report; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    own, trainer_args = _split_trainer_args(argv)
    args = build_parser().parse_args(own)
    prog = f"sage-repro {args.command}"
    if trainer_args and args.command != "sweep":
        print(f"{prog}: error: options after -- are for sweep only", file=sys.stderr)
        return 2
    try:
        if args.command == "report":
            return _report(args)
        if args.command == "cut-data":
            return _cut_data(args)
        return _sweep(args, trainer_args)
    except SweepError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


def _say(line: str) -> None:
    print(line, flush=True)


def _cut_data(args: argparse.Namespace) -> int:
    from sage_repro import pieces
    from sage_train.data import cut, pack
    from sage_train.data import pipeline as data

    plan = None if args.plan is None else pieces.load_plan(args.plan)
    _cut_defaults(args, plan)
    before = None
    if cut.is_cut(args.out):
        with contextlib.suppress(OSError, ValueError, KeyError):
            before = json.loads((args.out / cut.MANIFEST).read_text())["fingerprint"]
    vocab = get_model_config(args.model).vocab_size
    if plan is not None and plan.fingerprint is not None and before == plan.fingerprint:
        _say(f"--out {args.out} already holds the cut of the plan {plan.name} (fingerprint "
             f"{before}); the trainer checks every file of it")
        return 0
    try:
        if args.data != "installed" and pack.is_pack(args.data):
            manifest = pack.cut_pack(args.data, args.out, vocab)
        else:
            tokens = data.load_data(args.data, vocab_size=vocab)
            manifest = cut.cut_data(tokens, args.out, train_tokens=args.train_tokens,
                                    test_tokens=args.test_tokens)
    except (OSError, ValueError) as e:
        raise SweepError(str(e)) from None
    if plan is not None and plan.fingerprint is not None:
        if manifest["fingerprint"] != plan.fingerprint:
            raise SweepError(f"the cut in {args.out} has the fingerprint "
                             f"{manifest['fingerprint'][:16]}, not the plan {plan.name}'s "
                             f"{plan.fingerprint[:16]}")
    if before == manifest["fingerprint"]:
        _say(f"--out {args.out} already holds this cut")
    _say_cut(args.out, manifest)
    if plan is not None and plan.fingerprint is not None:
        _say(f"plan         {plan.name}: the same fingerprint, its pieces train on this cut")
    return 0


def _cut_defaults(args: argparse.Namespace, plan: PiecePlan | None) -> None:
    """Fill ``cut-data``'s unset ``--data``, ``--out``, ``--model`` from ``plan``, then defaults."""
    if plan is not None:
        if plan.pack is None and args.data is None:
            raise SweepError(f"--plan {args.plan}: the plan {plan.name} has no committed pack; "
                             "give --data")
        args.data = args.data or plan.pack
        args.out = args.out or pathlib.Path(plan.protocol.data or DEFAULT_CUT)
        args.model = args.model or plan.protocol.model
    args.data = args.data or "installed"
    args.out = args.out or DEFAULT_CUT
    args.model = args.model or "20m"


def _say_cut(out: pathlib.Path, manifest: dict[str, Any]) -> None:
    """Print the cut in ``out``: its files, fingerprint, sides and source."""
    files = sorted(p for p in out.iterdir() if p.is_file())
    size = sum(p.stat().st_size for p in files)
    _say(f"cut          {out}: {', '.join(p.name for p in files)} ({size / 2**20:.1f} MiB)")
    _say(f"fingerprint  {manifest['fingerprint']}")
    for side in ("train", "test"):
        part = manifest[side]
        _say(f"{side:<12} {part['tokens']:,} tokens, {part['documents']:,} documents (budget "
             f"{part['budget']:,}) of {manifest['source'][side + '_tokens']:,}")
    _say(f"source       {manifest['source']['description']}, fingerprint "
         f"{manifest['source']['fingerprint']}")


def _report(args: argparse.Namespace) -> int:
    if args.pieces is not None:
        from sage_repro import pieces

        piece_plan = pieces.load_plan(args.plan)
        if args.reference is not None:
            piece_plan = dataclasses.replace(piece_plan, reference=args.reference)
        if not args.pieces.is_dir():
            raise SweepError(f"--pieces {args.pieces} is not a folder")
        _say(pieces.write_merged(args.pieces, piece_plan)[1])
        _say(report.files_line(args.pieces))
        return 0
    if args.plan is not None:
        raise SweepError("--plan goes with --pieces")
    state = read_state(args.out)
    if state is None:
        raise SweepError(f"--out {args.out} holds no sweep ({STATE} is missing)")
    protocol, plan = state
    if args.reference is not None:
        if args.reference not in (*plan.configs, "slowest"):
            raise SweepError(f"--reference {args.reference} is not among the sweep's "
                             f"configurations ({', '.join(plan.configs)})")
        plan = dataclasses.replace(plan, reference=args.reference)
    _say(report.to_markdown(write_report(args.out, protocol, plan)))
    _say(report.files_line(args.out))
    return 0


def _sweep(args: argparse.Namespace, trainer_args: list[str]) -> int:
    if args.piece is not None:
        return _piece(args, trainer_args)
    for name in ("plan", "assume_overhead", "assume_together"):
        if getattr(args, name) is not None:
            raise SweepError(f"--{name.replace('_', '-')} goes with --piece")
    _check_together(args)
    protocol, plan = protocol_and_plan(args, trainer_args)
    if args.dry_run:
        dry_run(protocol, plan, args.assume_tflops, _say)
        return 0
    return _train(args.out or DEFAULT_OUT, protocol, plan, args.one_process, args.together)


def _check_together(args: argparse.Namespace) -> None:
    """Refuse ``--together`` and ``--assume-together`` where they do nothing."""
    if args.dry_run and args.together > 1:
        raise SweepError("--together trains runs at once; the dry run trains nothing (its "
                         "assumed speedup is --assume-together SPEEDUP)")
    if args.assume_together is not None and (not args.dry_run or args.assume_tflops is None):
        raise SweepError("--assume-together goes with --dry-run --assume-tflops")


def _piece(args: argparse.Namespace, trainer_args: list[str]) -> int:
    from sage_repro import pieces

    plan = pieces.load_plan(args.plan)
    pieces.check_pinned(args, vars(build_parser().parse_args(["sweep"])))
    _check_together(args)
    if args.dry_run:
        names = ([p.name for p in plan.pieces] if args.piece == "all" else
                 [plan.piece(args.piece).name])
        overhead = (pieces.RUN_OVERHEAD_S if args.assume_overhead is None else
                    args.assume_overhead)
        pieces.dry_run(plan, names, args.assume_tflops, overhead, _say,
                       speedup=args.assume_together)
        return 0
    protocol, sweep_plan = pieces.piece_setup(plan, args.piece, trainer_args)
    if sweep_plan.lrs == ():
        _say(f"piece {args.piece}: not needed, the best rate of its sweep is inside it")
        return 0
    pieces.check_data(plan, args.piece)
    return _train(args.out or pieces.DEFAULT_RUNS / args.piece, protocol, sweep_plan,
                  args.one_process, args.together)


def _train(out: pathlib.Path, protocol: Protocol, plan: Plan, one_process: bool = False,
           together: int = 1) -> int:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SweepError(f"cannot create --out {out}: {e.strerror}") from e
    write_state(out, protocol, plan)
    env_cache: dict[str, Any] = {}

    def env() -> dict[str, Any]:
        if not env_cache:
            env_cache.update(environment())
        return env_cache

    outcomes: list[Outcome] = []
    signals = Signals()
    with signals:
        grid = plan.grid()
        _say(f"sweep: {len(grid)} runs ({len(plan.configs)} configurations x "
             f"{len(plan.seeds)} seeds x their rates) in {out}")
        outcomes += run_all(out, protocol, grid, signals, env, _say, one_process, together)
        if (plan.best_seeds and signals.received is None
                and not any(o.outcome == "stopped" for o in outcomes)):
            cells = sweep_cells(out, protocol, plan)
            specs, chosen = second_stage(plan, cells)
            rates = chosen_rates(plan, cells)
            _say("best rates: " + ", ".join(
                f"{c} {'-' if rates[c] is None else format(rates[c], 'g')}"
                for c in plan.configs))
            _say(f"--best-seeds: {len(specs)} runs for {', '.join(chosen) or 'no configuration'}")
            outcomes += run_all(out, protocol, specs, signals, env, _say, one_process,
                                together)
    summary = write_report(out, protocol, plan)
    _say(report.to_markdown(summary))
    counts = {k: sum(o.action == k for o in outcomes) for k in ("started", "resumed", "skipped")}
    _say(f"runs: {counts['started']} started, {counts['resumed']} resumed, {counts['skipped']} "
         f"skipped (finished or diverged before)")
    _say(report.files_line(out))
    if signals.received is not None:
        print(f"sage-repro sweep: stopped by {signals.received}; run the same command again to "
              "resume", file=sys.stderr)
        return EXIT_INTERRUPTED if signals.received == "SIGINT" else EXIT_PREEMPTED
    stopped = [o for o in outcomes if o.outcome == "stopped"]
    if stopped:
        print(f"sage-repro sweep: a run was stopped ({stopped[0].detail}); run the same "
              "command again to resume", file=sys.stderr)
        return stopped[0].returncode if stopped[0].returncode in (
            EXIT_PREEMPTED, EXIT_INTERRUPTED) else EXIT_INTERRUPTED
    return 1 if any(o.outcome == "failed" for o in outcomes) else 0

