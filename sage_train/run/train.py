"""Pretrain a Flax NNX LLaMA with any of the paper's eight optimizer configurations.

One jitted train step with donated buffers over the (model, optimizer) state; data and
fully-sharded-data parallelism over a mesh of every device of the job, on one process or
several (:mod:`sage_train.job.distributed`: each process feeds its own rows of the same global
batch, process 0 writes the run's files); verified orbax checkpoints that resume
bit-identically, on any number of processes (:mod:`sage_train.store.checkpoints`); a locked run
directory whose recorded settings, metrics and ``H_t`` history survive restarts
(:mod:`sage_train.store.rundir`); a start header, a progress bar on a terminal or plain log lines
elsewhere, JSONL metrics (and TensorBoard/W&B scalars where asked for:
:mod:`sage_train.store.report`), SAGE's damper ``H_t`` of the embedding recorded with bounded
memory, and a loss-curve PNG of the whole run.

The pieces: the configuration and its checks (:mod:`sage_train.run.config`), the run resolved
once from it (:mod:`sage_train.run.resolve`), the model, optimizer and jitted steps
(:mod:`sage_train.run.steps`), resuming and carrying over (:mod:`sage_train.run.resume`) and the
loop with its periodic actions (:mod:`sage_train.run.loop`); :func:`train` puts them together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
from collections.abc import Callable, Sequence
from typing import Any

import jax
from flax import nnx

import sage_optax
from sage_train.data import pipeline as data_lib
from sage_train.hf import convert as hf_convert
from sage_train.job import distributed
from sage_train.job.errors import DataError, RunDirError, UserError
from sage_train.model.shapes import get_model_config
from sage_train.model.sharding import local_rows, state_shardings
from sage_train.run.config import TrainConfig, check_config, option_flag
from sage_train.run.diagnostics import DamperRecorder
from sage_train.run.loop import (
    Checkpoint,
    Evaluate,
    Hook,
    Log,
    RecordH,
    RunResult,
    Trainer,
    TrainerParts,
    complete,
)
from sage_train.run.resolve import (
    Run,
    agreed_settings,
    check_init_from_hf,
    enable_determinism,
    header,
    resolve,
)
from sage_train.run.resume import (
    check_carry,
    check_hf_tokenizer,
    recorded_settings,
    saved_layout,
    start_state,
)
from sage_train.run.steps import build, cached_steps, holds_no_peak, set_peak
from sage_train.store import report, rundir
from sage_train.store.checkpoints import Checkpoints
from sage_train.store.report import say

__all__ = ["RunResult", "TrainConfig", "run_losses", "save_loss_curve", "say", "train"]


def _quiet(message: str) -> None:
    """The log of a process other than process 0 of a job: nothing (process 0 logs)."""


def train(cfg: TrainConfig | Run, *, stop_after: int | None = None,
          allow_config_change: bool = False, log: Callable[[str], None] = say,
          restart: bool = False, stop: Callable[[], str | None] | None = None,
          locked: bool = False, data_exclude: Sequence[str | os.PathLike[str]] = ()
          ) -> RunResult:
    """Run (or resume) training as ``cfg`` says; ``stop_after`` interrupts a run early.

    ``cfg`` is a configuration, or a run already resolved from one
    (:func:`~sage_train.run.resolve.resolve`: then nothing is checked again).  Resuming from
    ``cfg.run_dir`` continues from its newest intact checkpoint and reproduces the losses of
    an uninterrupted run bit for bit (batches depend only on the step).  The run directory
    is locked while training (:class:`~sage_train.store.rundir.RunLock`); a rerun whose settings
    differ from the recorded ones in anything that changes the math or the data
    (:data:`~sage_train.store.rundir.MATH_FIELDS`) is refused unless ``allow_config_change``,
    which records the change as a new segment of the run and carries over what fits: the
    parameters and optimizer state across ``layers`` (the same numbers, stacked or
    unstacked), the parameters across an optimizer (with a fresh optimizer state); another
    model size is refused.

    A run directory holding checkpoints but no readable settings takes them from the
    newest verified checkpoint's manifest; where none records them it is refused unless
    ``allow_config_change``.  Checkpoints that all fail verification stop the run unless
    ``restart`` (start over from step 0; they are moved aside).

    ``stop`` is polled after every step: a signal name it returns stops the run there:
    ``SIGTERM``/``SIGUSR1`` (:data:`~sage_train.run.loop.PREEMPT_SIGNALS`) after a checkpoint of
    the step reached is saved, others (``SIGINT``) at once; :attr:`RunResult.interrupted`
    names it.  The run directory, and ``data_exclude``, are never read as part of a text
    corpus.  ``locked``: the caller holds the run directory's lock.

    The attention and SinkGD kernel are resolved for the run's mesh
    (:func:`~sage_train.run.resolve.implementations`), logged at its start and recorded in
    ``config.json`` and in every ``metrics.jsonl`` row.  The start is a header of aligned
    ``key: value`` lines (:func:`~sage_train.run.resolve.header`); then, where ``cfg.progress`` is
    off or stderr is no terminal, one plain line per ``metrics.jsonl`` row
    (:func:`sage_train.store.report.step_line`), else a progress bar.  ``init_from_hf``: a run
    that starts from step 0 starts from that Hugging Face checkpoint's weights.

    Raises:
      ConfigError: an invalid setting, or ``attention="cudnn"`` where cuDNN's attention
        cannot run (nothing is touched).
      RunDirError: the run directory is locked, holds another run's settings (or
        checkpoints whose settings are unknown, or that all fail verification), has a
        checkpoint beyond ``cfg.steps``, or cannot be written.
      DataError: the data cannot be used.
      RunFileError: a file of the run (a checkpoint: :class:`CheckpointError`, the metrics,
        the ``H_t`` record, the settings) could not be written; the earlier checkpoints are
        intact.
    """
    config = cfg.config if isinstance(cfg, Run) else cfg
    # in a job: before anything else
    distributed.same_settings(agreed_settings(config), option_flag)
    if isinstance(cfg, Run):
        run = cfg
    else:
        check_config(cfg)
        check_init_from_hf(cfg)
        if cfg.deterministic and not enable_determinism():
            log("--deterministic: JAX had already started its backend, so XLA's "
                "deterministic GPU reductions apply only if XLA_FLAGS held "
                "--xla_gpu_deterministic_ops=true before it did")
        run = resolve(cfg, checked=True)  # refuses what cannot run before anything is written
    made = rundir.make_run_dir(run.run_dir)
    primary = distributed.is_primary()
    if not primary:
        log = _quiet  # process 0 logs the run; the others log their own errors (raised)
    lock: Any = (rundir.RunLock(run.run_dir) if primary and not locked
                 else contextlib.nullcontext())
    try:
        with lock:
            if getattr(lock, "stale", None):
                log(lock.stale)
            opts = _Options(stop_after, allow_config_change, restart, stop,
                            (run.run_dir, *data_exclude))
            return _train_locked(run, opts, log)
    except BaseException:
        rundir.remove_unused(made)  # a refused start leaves nothing behind
        raise


@dataclasses.dataclass(frozen=True)
class _Options:
    stop_after: int | None
    allow_change: bool
    restart: bool
    stop: Callable[[], str | None] | None
    data_exclude: tuple[Any, ...]


def _train_locked(run: Run, opts: _Options, log: Callable[[str], None]) -> RunResult:
    cfg, run_dir = run.config, run.run_dir
    # in a job, the checks run on every process and fail on all of them or on none
    with distributed.together("to check the run"):
        recorded = recorded_settings(run_dir, opts.allow_change, log)
        settings = run.settings()
        changed = rundir.check_settings(run_dir, recorded, settings, opts.allow_change)
        rows = local_rows(run.mesh, cfg.batch_size)  # this process's rows of every batch
        ckpts = Checkpoints(run_dir / "checkpoints", keep=2, log=log)
        check_carry(run_dir, changed, ckpts, cfg)
        ckpts.prepare()
    ckpts.check_shared()
    tokens, eval_set = load_tokens_once(cfg, opts.data_exclude, rows, log)
    with distributed.together("to check the data"):
        settings["data_fingerprint"] = data_lib.fingerprint(tokens)
        settings["data_sha256"] = data_lib.content_hash(tokens)  # every token
        settings.update(tokens.info)  # --data installed: corpus_fingerprint, corpus_tokens
        changed |= _check_data(run_dir, cfg, recorded, settings, opts.allow_change)
        ckpts.settings = settings
        if cfg.init_from_hf is not None:
            check_hf_tokenizer(cfg, tokens)
    model, optimizer = build(cfg, tokens.vocab_size)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, state_shardings(state, run.mesh, cfg.sharding))
    opt_bytes = sage_optax.state_bytes(optimizer.opt_state)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    del model, optimizer
    saved_as = saved_layout(run, recorded, changed, tokens.vocab_size)
    for line in header(run, settings, tokens, n_params, opt_bytes):
        log(line)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(ckpts.close)
        if not opts.restart:
            refuse_checkpoints_without_peak(ckpts)
        start = start_state(run, ckpts, graphdef, state, saved_as, changed, opts.restart, log)
        start.state = set_peak(start.state, run.learning_rate)  # a checkpoint holds its own
        if start.step > cfg.steps:
            raise distributed.everywhere(RunDirError(
                f"steps={cfg.steps} is below the newest checkpoint of {run_dir} (step "
                f"{start.step}); pass --steps {start.step} or more, or use another --run-dir"))
        if start.step == cfg.steps:
            log(f"{run_dir} is complete (step {start.step} of {cfg.steps}): nothing to train")
            return complete(cfg, run_dir, opt_bytes)
        poll = distributed.StopPoll(opts.stop)  # the same stops on every process of a job
        if (signal_name := poll.now()) is not None:
            return RunResult(cfg, start.step, [], None, opt_bytes, 0.0, start_step=start.step,
                             interrupted=signal_name)
        trackers = _open_files(run, settings, changed, start.step, tokens, cleanup)
        if changed:
            log(f"settings changed at step {start.step}: {rundir.format_differences(changed)} "
                f"(recorded in {run_dir / rundir.HISTORY})")
        recorder = (DamperRecorder(run_dir / "damper_h.npz", cfg.record_h_every,
                                   cfg.h_max_records, start_step=start.step, log=log)
                    if run.records_h and distributed.is_primary() else None)
        train_step, eval_step = cached_steps(
            cfg, tokens.vocab_size, graphdef, run.records_h,
            (run.impl.attention, run.impl.sinkgd_kernel, run.loss_chunk), run.mesh)
        stream = data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                                  start_step=start.step, rows=rows)  # this process's rows
        end = (cfg.steps if opts.stop_after is None
               else max(start.step, min(cfg.steps, opts.stop_after)))
        hooks: list[Hook] = [Evaluate(cfg.eval_every), Log(cfg.log_every),
                             Checkpoint(cfg.checkpoint_every)]
        fixed = {"opt_state_bytes": opt_bytes, "attention": run.impl.attention,
                 "sinkgd_kernel": run.impl.sinkgd_kernel}
        return Trainer(TrainerParts(
            run=run, ckpts=ckpts, state=start.state, train_step=train_step,
            eval_step=eval_step, stream=stream, eval_set=eval_set, start=start.step, end=end,
            hooks=hooks, record_h=RecordH(cfg.record_h_every, recorder), fixed=fixed,
            vocab_size=tokens.vocab_size, poll=poll, log=log, prior_elapsed=start.elapsed,
            prior_tokens=start.timed_tokens, trackers=trackers,
            good=start.step if start.resumed else None)).fit()


def refuse_checkpoints_without_peak(ckpts: Checkpoints) -> None:
    """Refuse, in one line, checkpoints without the peak learning rate (:func:`holds_no_peak`).

    Raises:
      RunDirError: there are checkpoints and none names the peak in its tree metadata.
    """
    if holds_no_peak(ckpts):
        raise distributed.everywhere(RunDirError(
            f"the checkpoints of {ckpts.root} were written by a sage-train older than issue 46 "
            "(their optimizer state holds no peak learning rate) and cannot be resumed by this "
            "one: finish the run with the version that wrote it, pass --restart to train it "
            "over from step 0 (the checkpoints are moved aside), or use another --run-dir"))


def _check_data(run_dir: pathlib.Path, cfg: TrainConfig, recorded: dict[str, Any] | None,
                settings: dict[str, Any], allow_change: bool) -> dict[str, Any]:
    """The change of the data's identity since ``recorded``; refused unless allowed.

    ``data_sha256`` covers every token (:func:`~sage_train.data.pipeline.content_hash`); a run
    recorded before it existed is checked by its ``data_fingerprint`` alone.

    Raises:
      RunDirError: the data changed and changes are not allowed: one line naming the file.
    """
    fields: tuple[str, ...] = ("data_fingerprint", "data_sha256")
    if recorded is not None and "data_sha256" not in recorded:
        fields = ("data_fingerprint",)
    diff = rundir.differences(recorded or {}, settings, fields) if recorded else {}
    if diff and not allow_change:
        hashes = ", ".join(f"{k} {a!s:.16} -> {b!s:.16}" for k, (a, b) in diff.items())
        raise RunDirError(
            f"data {cfg.data or 'stdlib'!r} changed since run directory {run_dir} was "
            f"trained on it ({hashes}): restore the data it was trained on, use another "
            "--run-dir for a new run, or "
            f"pass --allow-config-change to continue on this data (recorded in {rundir.HISTORY})")
    return diff


def _open_files(run: Run, settings: dict[str, Any], changed: dict[str, Any], start: int,
                tokens: data_lib.TokenData, cleanup: contextlib.ExitStack) -> Any:
    """Process 0's files of a segment: its record, the metrics, the tokenizer, the trackers.

    Returns the trackers (``None`` where there are none, or on another process).
    """
    cfg, run_dir = run.config, run.run_dir
    if not distributed.is_primary():  # in a job of several processes, one writes
        return None
    rundir.record_segment(run_dir, settings, start, changed)
    rundir.resume_metrics(run_dir, start)
    if tokens.tokenizer is not None:
        _save_tokenizer(run_dir, tokens.tokenizer.to_str())
    if not (cfg.tensorboard or cfg.wandb is not None):
        return None
    return cleanup.enter_context(contextlib.closing(report.Trackers(
        run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb, start_step=start,
        settings=settings, name=run_dir.name)))


def _load_tokens(cfg: TrainConfig, exclude: Sequence[Any] = (), rows: slice | None = None,
                 log: Callable[[str], None] | None = None
                 ) -> tuple[data_lib.TokenData, list[Any]]:
    """The tokens and the evaluation batches; every data problem as a :class:`DataError`.

    Folders in ``exclude`` (the run directories) are never read as part of a text corpus.
    ``rows``: this process's rows of each evaluation batch (default: all).  ``log`` hears
    where a text's tokens come from (the cache, or a tokenizer trained now).
    """
    try:
        tokens = data_lib.load_data(cfg.data, vocab_size=get_model_config(cfg.model).vocab_size,
                                    token_dtype=cfg.token_dtype, exclude=exclude, log=log)
        data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rows=rows)
        eval_set = data_lib.eval_batches(tokens.test, cfg.batch_size, cfg.seq_len,
                                         cfg.eval_batches, rows=rows)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"data {cfg.data or 'stdlib'!r}: {e}") from e
    return tokens, eval_set


def load_tokens_once(cfg: TrainConfig, exclude: Sequence[Any] = (), rows: slice | None = None,
                     log: Callable[[str], None] | None = None
                     ) -> tuple[data_lib.TokenData, list[Any]]:
    """The tokens and evaluation batches for every process of a job, the cache built once.

    Process 0 loads first (training the tokenizer and writing the cache where it is
    missing); the others then load it from the cache (on hosts that share no cache, each
    builds its own, with the same result: the tokenizer's training is deterministic).
    A data problem on any process stops every process (:class:`~distributed.together`),
    and so does data that differs between them (the fingerprints are compared).
    """
    if distributed.process_count() == 1:
        return _load_tokens(cfg, exclude, rows, log)
    loaded: tuple[data_lib.TokenData, list[Any]] | None = None
    problem: UserError | None = None
    for turn in ("primary", "others"):
        if (turn == "primary") == distributed.is_primary():
            try:
                loaded = _load_tokens(cfg, exclude, rows, log)
            except UserError as e:
                problem = e
        if turn == "primary":
            distributed.barrier("sage-train: the token cache is built")
    with distributed.together("to load the data"):
        if problem is not None:
            raise problem
    assert loaded is not None
    distributed.same_everywhere(data_lib.fingerprint(loaded[0]), "the data's fingerprint")
    return loaded


def _save_tokenizer(run_dir: pathlib.Path, text: str) -> None:
    """Keep the run's tokenizer in ``run_dir/tokenizer.json`` (what ``export`` writes out).

    Raises:
      RunFileError: it could not be written (one line naming it).
    """
    path = run_dir / hf_convert.TOKENIZER_FILE
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    rundir.atomic_write_text(path, text)


def run_losses(result: RunResult) -> tuple[list[int], list[float]]:
    """``(steps, losses)`` of the whole run behind ``result``, on its true step numbers.

    From the run's ``metrics.jsonl`` (every segment, each step once); where that holds
    nothing, the losses of this invocation, numbered from its resume step.
    """
    rows = [r for r in rundir.iter_metrics(pathlib.Path(result.config.run_dir))
            if isinstance(r.get("loss"), int | float)]
    if rows:
        return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]
    first = result.start_step + 1
    return list(range(first, first + len(result.losses))), list(result.losses)


def save_loss_curve(results: list[RunResult], path: pathlib.Path) -> None:
    """A PNG of training loss per step, one line per run, each over its whole history.

    Raises:
      RunFileError: the PNG could not be written (one line naming it; no temporary file
        is left behind).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        steps, losses = run_losses(r)
        ax.plot(steps, losses, label=r.config.optimizer)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"LLaMA {results[0].config.model} on "
                 f"{results[0].config.data or 'the standard-library corpus'}")
    ax.legend()
    fig.tight_layout()
    try:
        rundir.atomic_write_bytes(pathlib.Path(path),
                                  lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)
