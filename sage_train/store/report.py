"""What ``sage-train`` says while it trains, beyond ``metrics.jsonl``.

* The start header: a few aligned ``key: value`` lines (:func:`header_lines`).
* One plain, greppable line per ``--log-every`` steps where there is no progress bar
  (:func:`step_line`, :data:`STEP_LINE`):
  ``step 40/300  loss 5.4321  lr 1.20e-03  gnorm 0.873  tok/s 12,345  eta 0:01:23``.
* Scalars for TensorBoard (``--tensorboard``: event files in the run directory, written
  with ``tensorboardX``) and Weights & Biases (``--wandb PROJECT``), under the tags of
  :data:`SCALAR_TAGS` (:class:`Trackers`).  Both packages are optional and imported only
  when asked for; :func:`~sage_train.job.errors.require` names the one that is missing in one line.

Nothing here imports JAX.
"""

from __future__ import annotations

import math
import os
import pathlib
import re
import secrets
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from sage_train.job.errors import ConfigError, RunFileError, require
from sage_train.store.rundir import atomic_write_text

STEP_LINE = re.compile(
    r"^step (?P<step>\d+)/(?P<steps>\d+)  loss (?P<loss>\S+)  lr (?P<lr>\S+)"
    r"  gnorm (?P<gnorm>\S+)  tok/s (?P<tok_s>[\d,]+)  eta (?P<eta>\S+)"
    r"(?:  eval_loss (?P<eval_loss>\S+)  ppl (?P<ppl>\S+))?$")
"""The form of every :func:`step_line` (``grep '^step '`` finds them in a log)."""

SCALAR_TAGS: Mapping[str, str] = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "test_loss": "eval/loss",
    "test_ppl": "eval/ppl",
    "tokens_per_s": "perf/tokens_per_s",
    "mfu": "perf/mfu",
    "peak_memory_bytes": "perf/peak_memory_bytes",
}
"""The ``metrics.jsonl`` fields sent to TensorBoard and W&B, and their tags there."""

WANDB_ID = "wandb_run_id"
"""The run directory's file holding its W&B run id (a rerun continues the same W&B run)."""

class NoBar:
    """A progress bar that shows nothing: :func:`progress_bar`'s where tqdm is missing."""

    def update(self, n: float = 1) -> None:
        """Count ``n`` more (nothing shown)."""

    def set_postfix(self, **kwargs: Any) -> None:
        """Set the bar's figures (nothing shown)."""

    def close(self) -> None:
        """Close the bar (nothing to close)."""

    def __enter__(self) -> NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def progress_bar(**kwargs: Any) -> Any:
    """A ``tqdm.auto`` progress bar with ``kwargs``, or a :class:`NoBar` without tqdm.

    tqdm is optional (:data:`sage_optim.extras.ON_DEMAND`): without it a run prints plain
    log lines and the ``installed`` corpus is built without bars.
    """
    try:
        from tqdm.auto import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return NoBar()
    return tqdm(**kwargs)


def say(message: str) -> None:
    """Print one line of the log at once (``flush``: a job's log file shows it as it happens)."""
    print(message, flush=True)


def header_lines(title: str, rows: Sequence[tuple[str, str]]) -> list[str]:
    """``title`` and one ``key: value`` line per row, the values aligned."""
    width = max((len(k) for k, _ in rows), default=0) + 2
    return [title, *(f"{k + ':':<{width}}{v}" for k, v in rows)]


def format_duration(seconds: float | None) -> str:
    """``H:MM:SS`` (hours unbounded), or ``-`` where unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return "-"
    s = round(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def step_line(step: int, steps: int, loss: float, lr: float, grad_norm: float,
              tokens_per_s: float, eta_s: float | None, eval_loss: float | None = None) -> str:
    """The plain log line of ``step`` (:data:`STEP_LINE`); evaluations add the test loss."""
    line = (f"step {step}/{steps}  loss {loss:.4f}  lr {lr:.2e}  gnorm {grad_norm:.4g}"
            f"  tok/s {tokens_per_s:,.0f}  eta {format_duration(eta_s)}")
    if eval_loss is not None:
        line += f"  eval_loss {eval_loss:.4f}  ppl {math.exp(eval_loss):.2f}"
    return line


class Trackers:
    """The run's scalars sent to TensorBoard and/or W&B, as each ``metrics.jsonl`` row is.

    Args:
      run_dir: the run directory; TensorBoard's event files go there, so that
        ``tensorboard --logdir RUN_DIR`` lists every run by its directory name.
      tensorboard: write TensorBoard event files (``tensorboardX``).
      wandb_project: a W&B project to log to (``None``: none).  The run's id is kept in
        ``RUN_DIR/wandb_run_id``, so a resumed run continues the same W&B run.
      start_step: the step the run resumes from: TensorBoard hides the events of later
        steps written before (``purge_step``), which the resumed run writes again.
      settings: the run's settings, W&B's ``config``.
      name: the W&B run's display name.

    Raises:
      ConfigError: a package is missing, or ``wandb.init`` failed (one line).
    """

    def __init__(self, run_dir: pathlib.Path, *, tensorboard: bool, wandb_project: str | None,
                 start_step: int, settings: Mapping[str, Any], name: str) -> None:
        self.run_dir = pathlib.Path(run_dir)
        self._tb: Any = None
        self._wandb: Any = None
        if tensorboard:
            require("tensorboardX", "--tensorboard")
            from tensorboardX import SummaryWriter

            # a fresh file per segment (a random suffix: two segments may start within one
            # second); purge_step hides what an earlier segment wrote after the resume point
            self._tb = SummaryWriter(logdir=str(self.run_dir), flush_secs=30,
                                     purge_step=start_step + 1 if start_step else None,
                                     filename_suffix=f".{secrets.token_hex(4)}")
        if wandb_project is not None:
            require("wandb", "--wandb")
            import wandb

            try:
                self._wandb = wandb.init(project=wandb_project, name=name, id=self._wandb_id(),
                                         resume="allow", dir=str(self.run_dir),
                                         config=dict(settings))
            except Exception as e:  # noqa: BLE001 - any failure of W&B is one line
                self.close()
                why = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ConfigError(f"--wandb {wandb_project}: wandb.init failed: {why}") from e

    def _wandb_id(self) -> str:
        path = self.run_dir / WANDB_ID
        try:
            known = path.read_text().strip()
        except OSError:
            known = ""
        if known:
            return known
        run_id = secrets.token_hex(8)
        atomic_write_text(path, run_id + "\n")
        return run_id

    def write(self, step: int, row: Mapping[str, Any]) -> None:
        """Send the :data:`SCALAR_TAGS` fields of a ``metrics.jsonl`` row at ``step``.

        Raises:
          RunFileError: the event file could not be written (one line naming it).
        """
        scalars = {tag: float(row[key]) for key, tag in SCALAR_TAGS.items()
                   if isinstance(row.get(key), int | float) and not isinstance(row[key], bool)}
        if self._tb is not None:
            try:
                for tag, value in scalars.items():
                    self._tb.add_scalar(tag, value, step)
                self._tb.flush()
            except OSError as e:
                raise _tb_error(self.run_dir, e) from e
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the TensorBoard file and finish the W&B run."""
        tb, run, self._tb, self._wandb = self._tb, self._wandb, None, None
        if tb is not None:
            try:
                tb.close()
            except OSError as e:
                raise _tb_error(self.run_dir, e) from e
        if run is not None:
            run.finish()


def _tb_error(run_dir: pathlib.Path, e: OSError) -> RunFileError:
    return RunFileError(f"cannot write TensorBoard events to {run_dir}: "
                        f"{e.strerror or e or type(e).__name__}")


def event_files(run_dir: os.PathLike[str] | str) -> list[pathlib.Path]:
    """The TensorBoard event files of a run directory, oldest first."""
    return sorted(pathlib.Path(run_dir).glob("events.out.tfevents.*"),
                  key=lambda p: (p.stat().st_mtime, p.name))


def read_scalars(run_dir: os.PathLike[str] | str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a run's event files as TensorBoard shows them: ``{tag: [(step, value)]}``.

    Files are read oldest first; a segment's start (``purge_step``) drops the earlier
    records of that step and later, as TensorBoard does.  Needs ``tensorboardX``'s protos
    only (no TensorBoard, no TensorFlow).
    """
    from tensorboardX.proto.event_pb2 import Event, SessionLog

    out: dict[str, list[tuple[int, float]]] = {}
    for path in event_files(run_dir):
        data = path.read_bytes()
        i = 0
        while i + 12 <= len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            record = data[i + 12:i + 12 + n]
            i += 12 + n + 4
            event = Event.FromString(record)
            if event.HasField("session_log") and event.session_log.status == SessionLog.START:
                out = {t: [(s, v) for s, v in rows if s < event.step] for t, rows in out.items()}
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))
    return out
