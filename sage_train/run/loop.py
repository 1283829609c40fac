"""The training loop: a :class:`Trainer` whose evaluation, logging and checkpoints are hooks.

The loop dispatches one jitted step after another and syncs with the host only at the
steps where a periodic action is due (:class:`Evaluate`, :class:`Log`, :class:`Checkpoint`,
each every so many steps, as nanodo's hooks) or the first (compiling) step; each sync
fetches every loss of its interval at once (:func:`fetch`), records the ``H_t`` rows kept
since the last (:class:`RecordH`), and stops the run on a non-finite loss.  The tokens/s
clock (:class:`Clock`) leaves out compilation, evaluation, checkpointing and the host's
logging and ``H_t`` records.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from sage_train.job import distributed
from sage_train.model.sharding import shard_batch
from sage_train.run.config import TrainConfig
from sage_train.run.diagnostics import DamperRecorder
from sage_train.run.resolve import Run
from sage_train.run.steps import evaluate_loss
from sage_train.run.throughput import device_peak_tflops, flops_per_token, mfu
from sage_train.store import report, rundir
from sage_train.store.checkpoints import Checkpoints, state_is_finite

PREEMPT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
"""Signals that stop a run with a checkpoint of the step reached (a cluster's preemption;
SLURM's ``--signal=USR1@...`` warning); ``SIGINT`` (Ctrl-C) stops it without one."""


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    config: TrainConfig
    steps_done: int
    losses: list[float]
    final_test_ppl: float | None
    opt_state_bytes: int
    tokens_per_s: float  # training tokens per second over the whole run (all segments)
    # (compilation, evaluation, checkpointing and the host's logging and H_t records
    # excluded; the last row of metrics.jsonl)
    stopped_reason: str | None = None
    start_step: int = 0  # the step this invocation resumed from (losses follow it)
    mfu: float | None = None  # model FLOPs utilisation at tokens_per_s (None: no known peak)
    interrupted: str | None = None  # the signal that stopped the run early ("SIGTERM"...)


_clock = time.perf_counter
"""The trainer's clock (a module attribute, so a test can stand in a slow checkpoint)."""


def fetch(tree: Any) -> Any:
    """Bring ``tree`` to the host: the trainer's only host sync of a logging interval."""
    return jax.device_get(tree)


def peak_memory_bytes() -> int | None:
    """The device allocator's high-water mark in this process, in bytes.

    The largest ``peak_bytes_in_use`` over the process's local devices (with one device,
    that device's), as XLA's allocator reports it: the bytes of live buffers at their
    peak, not the memory pool it reserved.  It is never reset, so it covers everything
    since the process started: compilation, evaluation, and every earlier run of the same
    process (with several ``--optimizer`` names in one command, a later run's figure
    includes the earlier ones'; one process per run measures each alone).  ``None`` where
    the backend reports no memory statistics (the CPU).
    """
    peaks = [int(stats.get("peak_bytes_in_use", 0))
             for d in jax.local_devices() if (stats := d.memory_stats())]
    return (max(peaks) or None) if peaks else None


class Clock:
    """Training time, the tokens/s clock.

    Wall time from the end of the first (compiling) step, less the host's work
    (evaluation, checkpointing, logging, ``H_t`` records), plus the earlier segments'.

    Read only after a host sync, so that it covers finished device work.
    """

    def __init__(self, prior_elapsed: float, prior_tokens: float, tokens_per_step: int,
                 step: int) -> None:
        self.prior_elapsed, self.prior_tokens = prior_elapsed, prior_tokens
        self.tokens_per_step = tokens_per_step
        self.t0, self.excluded, self.steps = _clock(), 0.0, 0
        self.wall0, self.wall_step0 = time.monotonic(), step  # the ETA's: all included
        self.elapsed = prior_elapsed
        self.tokens = prior_tokens
        self.tps = prior_tokens / prior_elapsed if prior_elapsed > 0 else 0.0

    def start(self, now: float, step: int) -> None:
        """Start timing after ``step`` (the compiling one), synced at ``now``."""
        self.t0, self.excluded, self.steps = now, 0.0, 0
        self.wall0, self.wall_step0 = time.monotonic(), step

    def advance(self, now: float, steps: int) -> None:
        """``steps`` more trained steps, synced at ``now``."""
        self.steps += steps
        self.elapsed = self.prior_elapsed + now - self.t0 - self.excluded
        self.tokens = self.prior_tokens + self.steps * self.tokens_per_step
        self.tps = self.tokens / self.elapsed if self.elapsed > 0 else 0.0

    def off(self, action: Callable[[], Any]) -> Any:
        """``action()``, off the clock."""
        t = _clock()
        try:
            return action()
        finally:
            self.excluded += _clock() - t

    def eta(self, step: int, total: int) -> float | None:
        """Seconds left to ``total`` at the pace since timing started (everything counted)."""
        if step <= self.wall_step0:
            return None
        return (time.monotonic() - self.wall0) / (step - self.wall_step0) * (total - step)


class Hook:
    """A periodic action of the loop, due every ``every`` steps.

    ``every_row``: it runs with every metrics row (whichever hook made it due).
    """

    every_row = False

    def __init__(self, every: int) -> None:
        self.every = every

    def due(self, t: Trainer) -> bool:
        """Whether the action is due after step ``t.done`` (``t.signal``: a stop received)."""
        return t.done % self.every == 0

    def __call__(self, t: Trainer) -> str | None:
        """Act after step ``t.done`` with its metrics row ``t.record``; why the run stops."""
        raise NotImplementedError


class Evaluate(Hook):
    """The test loss, every ``eval_every`` steps and at the run's last step."""

    def due(self, t: Trainer) -> bool:
        """Every ``every`` steps and at ``cfg.steps``."""
        return t.done % self.every == 0 or t.done == t.cfg.steps

    def __call__(self, t: Trainer) -> str | None:
        """Add the test loss and perplexity to the row (off the clock)."""
        cfg, record = t.cfg, t.record
        loss = t.clock.off(lambda: evaluate_loss(t.eval_step, t.state, t.eval_set, t.run.mesh,
                                                 cfg.batch_size))
        t.test_ppl = math.exp(loss)
        record["test_loss"], record["test_ppl"] = loss, t.test_ppl
        return None


class Log(Hook):
    """The metrics row, and the progress bar or log line, with every row.

    Due every ``log_every`` steps; it also writes the rows the other hooks make due.
    """

    every_row = True

    def __call__(self, t: Trainer) -> str | None:
        """Write the row to ``metrics.jsonl`` and the trackers, and show it (process 0)."""
        done, record = t.done, t.record
        if (peak_bytes := peak_memory_bytes()) is not None:
            record["peak_memory_bytes"] = peak_bytes
        if t.primary:
            t.clock.off(lambda: self._write(t, done, record))
        return None

    @staticmethod
    def _write(t: Trainer, done: int, record: dict[str, Any]) -> None:
        rundir.append_line(t.run.run_dir / rundir.METRICS, json.dumps(record), sync=False)
        if t.bar is not None:
            t.bar(done, record["loss"], record["tokens_per_s"])
        else:
            t.log(report.step_line(done, t.cfg.steps, record["loss"], record["lr"],
                                   record["grad_norm"], record["tokens_per_s"],
                                   t.clock.eta(done, t.cfg.steps), record.get("test_loss")))
        if t.trackers is not None:
            t.trackers.write(done, record)


class Checkpoint(Hook):
    """A verified checkpoint; a state that is no longer finite stops the run instead."""

    def due(self, t: Trainer) -> bool:
        """Every ``every`` steps, at this invocation's last step and at a preemption."""
        return t.done % self.every == 0 or t.done == t.end or t.signal is not None

    def __call__(self, t: Trainer) -> str | None:
        """Save the state of step ``t.done`` (off the clock), or say why the run stops."""
        done, t0 = t.done, _clock()
        if not state_is_finite(t.state):
            return (f"the parameters or optimizer state became NaN/Inf at step {done} (the "
                    "loss was still finite): stopping without saving them; " + t.newest())
        t.ckpts.save(done, t.state, {"elapsed_s": t.clock.elapsed,
                                     "timed_tokens": t.clock.tokens})
        t.good = done
        t.clock.excluded += _clock() - t0
        return None


class RecordH:
    """SAGE's ``H_t`` of the embedding (:class:`~sage_train.run.diagnostics.DamperRecorder`).

    A periodic action of its own kind: kept on the device every ``record_h_every`` steps,
    written at each host sync.
    """

    def __init__(self, every: int, recorder: DamperRecorder | None) -> None:
        self.every, self.recorder = every, recorder

    def keeps(self, done: int) -> bool:
        """Whether step ``done``'s ``H_t`` is kept (every ``every`` steps, on process 0)."""
        return self.recorder is not None and done % self.every == 0

    def add(self, rows: list[tuple[int, Any]]) -> None:
        """Add the fetched ``H_t`` rows to the record (each add rewrites ``damper_h.npz``)."""
        if self.recorder is not None:
            for step, h in rows:
                self.recorder.add(step, np.asarray(h))


@dataclasses.dataclass(frozen=True)
class TrainerParts:
    """What a :class:`Trainer` is built from, each part by its name.

    Attributes:
      run: the resolved run (its learning-rate schedule included: :attr:`Run.schedule`).
      ckpts: its checkpoints.
      state: the split ``(model, optimizer)`` state to start from (donated step by step).
      train_step: the jitted train step.
      eval_step: the jitted eval step.
      stream: this process's rows of the training batches from ``start`` on.
      eval_set: this process's rows of the evaluation batches.
      start: the first step this invocation trains.
      end: the step it stops before (below ``cfg.steps`` when cut short).
      hooks: the periodic actions, in the order they act on a metrics row.
      record_h: the ``H_t`` record.
      fixed: the fields every metrics row holds as they are (the optimizer state's bytes,
        the implementations).
      vocab_size: the data's vocabulary (for the MFU's FLOPs per token).
      poll: the stop poll (agreed between the processes of a job).
      log: the run's log.
      prior_elapsed: the training seconds before ``start``.
      prior_tokens: the timed tokens before ``start``.
      trackers: TensorBoard/W&B (``None``: none).
      good: the newest finite checkpoint's step (``None``: none).
    """

    run: Run
    ckpts: Checkpoints
    state: Any
    train_step: Callable[..., Any]
    eval_step: Callable[..., Any]
    stream: Iterator[Any]
    eval_set: list[Any]
    start: int
    end: int
    hooks: list[Hook]
    record_h: RecordH
    fixed: dict[str, Any]
    vocab_size: int
    poll: distributed.StopPoll
    log: Callable[[str], None]
    prior_elapsed: float = 0.0
    prior_tokens: float = 0.0
    trackers: Any = None
    good: int | None = None


class Trainer:
    """The loop of one run from ``parts.start`` to ``parts.end``, with its periodic actions.

    Args:
      parts: what the loop is built from (:class:`TrainerParts`).
    """

    def __init__(self, parts: TrainerParts) -> None:
        run = parts.run
        cfg = self.cfg = run.config
        self.run, self.ckpts, self.state, self.fixed = run, parts.ckpts, parts.state, parts.fixed
        self.train_step, self.eval_step = parts.train_step, parts.eval_step
        self.stream, self.eval_set = parts.stream, parts.eval_set
        self.start, self.end = parts.start, parts.end
        self.hooks, self.record_h = parts.hooks, parts.record_h
        self.poll, self.trackers, self.good = parts.poll, parts.trackers, parts.good
        self.log = log = parts.log
        self.primary = distributed.is_primary()
        self.schedule = run.schedule
        self.bar = _progress(self.start, cfg.steps, cfg.progress) if self.primary else None
        if self.bar is None and self.primary and self.start < self.end:
            log(COMPILING)
        self.flops_token = flops_per_token(run.model_config(parts.vocab_size), cfg.seq_len)
        self.peak = peak_tflops(cfg, run.dtype, log)
        self.clock = Clock(parts.prior_elapsed, parts.prior_tokens,
                           cfg.batch_size * cfg.seq_len, self.start)
        self.losses: list[float] = []
        self.pending: list[tuple[int, Any, Any]] = []  # (step, (loss, grad norm), H_t)
        self.grad_norm = math.nan
        self.test_ppl: float | None = None
        self.done = self.start  # the step just trained
        self.signal: str | None = None  # the stop received after it
        self.record: dict[str, Any] = {}  # its metrics row, as the hooks fill it
        self.stopped: str | None = None
        self.interrupted: str | None = None

    def newest(self) -> str:
        """Where a rerun would resume: the newest finite checkpoint, or nowhere."""
        if self.good is None:
            return "there is no finite checkpoint: a rerun starts from step 0"
        return (f"the newest finite checkpoint is step {self.good} "
                f"({self.ckpts.path(self.good)}), where a rerun resumes")

    def fit(self) -> RunResult:
        """Train from ``start`` to ``end`` (or a stop), acting as the hooks say."""
        for step in range(self.start, self.end):
            if not self.step(step):
                break
        u = mfu(self.clock.tps, self.flops_token, self.peak)
        return RunResult(self.cfg, self.start + len(self.losses), self.losses, self.test_ppl,
                         self.fixed["opt_state_bytes"], self.clock.tps, self.stopped,
                         start_step=self.start, mfu=u, interrupted=self.interrupted)

    def step(self, step: int) -> bool:
        """Train step ``step`` and run what is due after it; ``False``: the run stops."""
        cfg, done, first = self.cfg, step + 1, step == self.start
        inputs, targets = shard_batch(next(self.stream), self.run.mesh, cfg.batch_size)
        self.state, out, h = self.train_step(self.state, inputs, targets)
        self.pending.append((done, out, h if self.record_h.keeps(done) else None))
        # the host syncs of the schedule: the same steps on every process of a job, where
        # the signals one of them received are agreed
        self.done, self.signal = done, None
        scheduled = first or any(hook.due(self) for hook in self.hooks)
        signal = self.signal = self.poll(scheduled)
        if signal is not None and signal not in PREEMPT_SIGNALS:
            self.interrupted = signal  # Ctrl-C: stop now (the newest checkpoint stays)
            return False
        row = any(hook.due(self) for hook in self.hooks)
        if not (row or first):
            return True  # no host sync: the next step is queued behind this one
        if not self.sync(done, first):
            return False
        if row:
            self.record = self.row(step, done)
            for hook in self.hooks:
                if hook.every_row or hook.due(self):
                    if (stopped := hook(self)) is not None:
                        self.stopped = stopped
                        self.log(stopped)
                        return False
        if signal is not None and done < cfg.steps:
            self.interrupted = signal
            self.log(f"{signal}: saved the checkpoint of step {done} "
                     f"({self.ckpts.path(done)}); run the same command again to resume "
                     "from it")
            return False
        return True

    def sync(self, done: int, first: bool) -> bool:
        """The one host sync of a logging interval; ``False`` on a non-finite loss."""
        fetched = fetch([(out, h) for _, out, h in self.pending])
        now = _clock()
        if first:  # compilation: start the clock after the first step
            self.clock.start(now, done)
        kept_h = []
        for (d, _, _), ((value, norm), h_value) in zip(self.pending, fetched, strict=True):
            value = float(value)
            if not math.isfinite(value):
                self.stopped = (f"loss became {value} at step {d}: stopping; "
                                + self.newest())
                break
            self.losses.append(value)
            self.grad_norm = float(norm)
            if h_value is not None:
                kept_h.append((d, h_value))
        steps, self.pending = len(self.pending), []
        if self.stopped is not None:
            self.record_h.add(kept_h)  # the finite steps' H_t
            self.log(self.stopped)
            return False
        self.clock.advance(now, 0 if first else steps)
        # host-side diagnostics and logging are off the tokens/s clock (the device idles
        # while they run: the next step is dispatched after them)
        self.clock.off(lambda: self.record_h.add(kept_h))
        return True

    def row(self, step: int, done: int) -> dict[str, Any]:
        """The metrics row of step ``done`` (the hooks add to it)."""
        tps = self.clock.tps
        record: dict[str, Any] = {"step": done, "loss": self.losses[-1],
                                  "lr": float(self.schedule(step)),
                                  "grad_norm": float(self.grad_norm), "tokens_per_s": tps,
                                  "elapsed_s": self.clock.elapsed, **self.fixed}
        if (u := mfu(tps, self.flops_token, self.peak)) is not None:
            record["mfu"] = u
        return record


def peak_tflops(cfg: TrainConfig, dtype: str, log: Callable[[str], None]) -> float | None:
    """The peak TFLOP/s MFU is measured against, said once in the log."""
    if cfg.peak_tflops is not None:
        log(f"MFU against --peak-tflops {cfg.peak_tflops:g} ({dtype})")
        return cfg.peak_tflops
    kind = jax.local_devices()[0].device_kind
    known = device_peak_tflops(kind, dtype)
    if known is None:
        if jax.default_backend() != "cpu":
            log(f"no known peak rate for {kind!r}: pass --peak-tflops for an MFU")
        return None
    log(f"MFU against {known[0]:g} TFLOP/s, the dense {dtype} peak of {known[1]} ({kind})")
    return known[0]


MIN_BAR_WIDTH = 40
"""The narrowest console a progress bar is drawn on; a narrower one (or one that reports a
width of 0, as some IDE and notebook consoles do) gets plain log lines."""


def terminal_width() -> int:
    """The columns of the progress bar's stream (stderr); 0 where unknown.

    ``COLUMNS`` if set, else the terminal's.
    """
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return int(columns)
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):  # replaced, closed or not a terminal
        return 0


def is_terminal() -> bool:
    """Whether a progress bar can be drawn on stderr (else log lines).

    A terminal at least :data:`MIN_BAR_WIDTH` columns wide.
    """
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
    return tty and terminal_width() >= MIN_BAR_WIDTH


COMPILING = ("compiling the training step with XLA (the first step waits for it; minutes "
             "for a large model on a CPU)")
"""The line a run logs before its first step, where there is no progress bar."""

COMPILING_BAR = "compiling (XLA)"
"""The progress bar's description until the first step is done."""


def _progress(start: int, total: int, enabled: bool
              ) -> Callable[[int, float, float], None] | None:
    """A progress bar where ``enabled`` and on a terminal; ``None``: plain log lines instead."""
    if not (enabled and is_terminal()):
        return None
    bar = report.progress_bar(total=total, initial=start, unit="step", dynamic_ncols=True,
                              desc=COMPILING_BAR)
    if isinstance(bar, report.NoBar):
        return None  # no tqdm: plain log lines

    def update(step: int, loss: float, tps: float) -> None:
        if bar.desc:
            bar.set_description_str("")  # compiled
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        if step >= total:
            bar.close()

    return update


def complete(cfg: TrainConfig, run_dir: pathlib.Path, opt_bytes: int) -> RunResult:
    """The result of a run that has nothing left to train, from its metrics."""
    rows = list(rundir.iter_metrics(run_dir))
    ppl = next((r["test_ppl"] for r in reversed(rows) if "test_ppl" in r), None)
    tps = float(rows[-1].get("tokens_per_s", 0.0)) if rows else 0.0
    return RunResult(cfg, cfg.steps, [], ppl, opt_bytes, tps, start_step=cfg.steps)
