"""A run directory that never lies about its history: lock, recorded settings, metrics.

* :class:`RunLock`: one process at a time per run directory (``.lock``: an exclusive
  ``flock``, released on exit and by the kernel when a process dies, plus the holder's pid,
  host and command line so that a refusal names it and a stale lock is recognised).
* Settings: the first run records its settings in ``config.json``; every rerun is checked
  against them (:data:`MATH_FIELDS`: anything that changes the math or the data order), and
  each segment of the run (each invocation that trains) is appended to
  ``config_history.jsonl`` with what changed, so the settings that produced every step are
  kept.
* Metrics: on a resume, rows of ``metrics.jsonl`` after the resume point (and damaged lines)
  move to ``metrics_superseded.jsonl``; ``metrics.jsonl`` then holds each step once.

Nothing here imports JAX: the lock is usable by any process.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import pathlib
import shutil
import socket
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, BinaryIO

from sage_train.job.errors import RunDirError, write_error

MATH_FIELDS: tuple[str, ...] = (
    "model", "optimizer", "learning_rate", "schedule", "warmup_frac", "final_lr_frac", "steps",
    "tail_from", "tail",  # the schedule's tail after a finished run's old --steps
    "batch_size", "seq_len", "seed", "clip", "data", "token_dtype", "eval_batches",
    "dtype", "param_dtype", "layers",  # the arithmetic, and the layout of the checkpoints
    "loss_chunk",  # the loss's summation order (float32 rounding of the gradients)
    "attention", "sinkgd_kernel",  # cuDNN/XLA, Pallas/jnp: the same math, other rounding
    "weight_decay", "b1", "b2",  # the optimizer's hyperparameters
    "grad_accum",  # micro-batches: the same batch and update, other rounding
    "init_from_hf",  # the initial weights
)
"""Settings that change the math, the data order or the evaluation of a run: a rerun with
other values is refused unless the change is allowed (and then recorded)."""

CONFIG = "config.json"
HISTORY = "config_history.jsonl"
METRICS = "metrics.jsonl"
SUPERSEDED = "metrics_superseded.jsonl"
LOCK = ".lock"


def atomic_write_bytes(path: pathlib.Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` atomically with ``write(file)``: a complete old or new file, never a mix.

    The bytes go to a temporary file beside ``path`` that replaces it when complete.

    Raises:
      RunFileError: the write failed (a full disk, a read-only directory...): one line
        naming ``path``; the temporary file is removed and ``path`` is as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise write_error(path, e) from e


def atomic_write_text(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically (:func:`atomic_write_bytes`).

    Raises:
      RunFileError: the write failed; one line naming ``path``, no temporary file left.
    """
    atomic_write_bytes(path, lambda f: f.write(text.encode()))


def append_line(path: pathlib.Path, line: str, *, sync: bool = True) -> None:
    """Append one line to ``path`` and flush it (to the disk too where ``sync``).

    Raises:
      RunFileError: the write failed; one line naming ``path``.
    """
    try:
        with open(path, "a") as f:
            f.write(line.rstrip("\n") + "\n")
            f.flush()
            if sync:
                os.fsync(f.fileno())
    except OSError as e:
        raise write_error(path, e) from e


def make_run_dir(run_dir: pathlib.Path) -> pathlib.Path | None:
    """Create ``run_dir`` and its missing parents; the topmost folder created (``None``: none).

    What it returns is what :func:`remove_unused` takes away again when the start is
    refused, so that a refused start leaves nothing behind.

    Raises:
      RunDirError: the folder cannot be created (one line naming it).
    """
    run_dir = pathlib.Path(run_dir)
    top = None
    for folder in (run_dir, *run_dir.absolute().parents):
        if folder.exists():
            break
        top = folder
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run directory {run_dir}: {e.strerror}") from e
    return top


def remove_unused(made: pathlib.Path | None) -> None:
    """Remove ``made`` (from :func:`make_run_dir`) where no run wrote anything into it.

    Nothing written: it holds folders and empty ``.lock`` files only (a refused start,
    or a stop before the first file of the run was written).  Anything else keeps it.
    """
    if made is None or not made.is_dir():
        return
    for dirpath, _, filenames in os.walk(made):
        for name in filenames:
            path = pathlib.Path(dirpath) / name
            with contextlib.suppress(OSError):
                if name != LOCK or path.stat().st_size:
                    return
    shutil.rmtree(made, ignore_errors=True)


# ---------------------------------------------------------------------------
# lock
# ---------------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    return True


def _describe(holder: Mapping[str, Any]) -> str:
    cmd = holder.get("command") or "?"
    return (f"process {holder.get('pid')} on {holder.get('host')} ({cmd[:120]}), "
            f"started {holder.get('started')}")


class RunLock:
    """An exclusive lock on a run directory, held from :meth:`acquire` to :meth:`release`.

    ``run_dir/.lock`` is locked with ``fcntl.flock`` (the kernel releases it when the
    process ends, however it ends) and holds the holder's pid, host, command line and
    start time.  A second process is refused with a :class:`RunDirError` naming the
    holder.  A lock file left by a process that no longer runs is stale: it is taken over,
    and :attr:`stale` describes it.  On file systems without ``flock`` the pid alone
    decides (a live process on this host holds the lock).
    """

    def __init__(self, run_dir: pathlib.Path) -> None:
        self.path = pathlib.Path(run_dir) / LOCK
        self.stale: str | None = None
        self._fd: int | None = None

    def _read_holder(self) -> dict[str, Any]:
        try:
            holder = json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}
        return holder if isinstance(holder, dict) else {}

    def acquire(self) -> RunLock:
        """Take the lock or raise :class:`RunDirError` naming the process that holds it."""
        import fcntl

        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"cannot create the lock file {self.path}: {e.strerror}") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RunDirError(
                f"run directory {self.path.parent} is in use by "
                f"{_describe(self._read_holder())}; wait for it to finish or stop it"
            ) from None
        except OSError as e:  # no flock on this file system: the pid decides
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                os.close(fd)
                raise
            holder = self._read_holder()
            if (holder.get("pid") not in (None, os.getpid())
                    and holder.get("host") == socket.gethostname()
                    and _pid_alive(int(holder["pid"]))):
                os.close(fd)
                raise RunDirError(
                    f"run directory {self.path.parent} is in use by {_describe(holder)}; "
                    "wait for it to finish or stop it") from None
        holder = self._read_holder()
        if holder.get("pid") not in (None, os.getpid()):
            alive = holder.get("host") == socket.gethostname() and _pid_alive(int(holder["pid"]))
            self.stale = (f"took over the stale lock of {_describe(holder)}"
                          f"{', which is no longer running' if not alive else ''}")
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "command": " ".join(sys.argv), "started": _now()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(me).encode(), 0)
            os.fsync(fd)
        except OSError as e:
            os.close(fd)
            raise RunDirError(f"cannot write the lock file {self.path}: {e.strerror}") from e
        self._fd = fd
        return self

    def release(self) -> None:
        """Release the lock (the file stays, emptied: deleting it would race a newcomer)."""
        if self._fd is None:
            return
        import fcntl

        try:
            with contextlib.suppress(OSError):  # a read-only or full disk: the flock is what counts
                os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def _now() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


# ---------------------------------------------------------------------------
# settings
# ---------------------------------------------------------------------------


def normalize_data(data: str | None) -> str:
    """``"stdlib"``/``"installed"`` for those corpora, else the absolute path of the source."""
    if data is None or data == "stdlib":
        return "stdlib"
    if data == "installed":
        return data
    return str(pathlib.Path(data).expanduser().absolute())


def read_settings(run_dir: pathlib.Path) -> dict[str, Any] | None:
    """The settings of the run's latest segment (``None`` for a new run).

    From ``config.json``; if that is missing or damaged, from the last line of
    ``config_history.jsonl``.  A run directory whose settings cannot be read at all while
    it holds checkpoints is refused (its settings would be unknown).
    """
    config = run_dir / CONFIG
    try:
        settings = json.loads(config.read_text())
        if isinstance(settings, dict):
            return settings
    except FileNotFoundError:
        pass
    except (OSError, ValueError):
        pass
    for line in reversed(_lines(run_dir / HISTORY)):
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict) and isinstance(record.get("settings"), dict):
                return record["settings"]
    if config.exists():
        raise RunDirError(
            f"{config} is damaged and {run_dir / HISTORY} holds no settings: the settings "
            f"of this run are unknown; move {config} away to start the run's record anew")
    return None


def _lines(path: pathlib.Path) -> list[str]:
    try:
        return [x for x in path.read_text(errors="replace").splitlines() if x.strip()]
    except FileNotFoundError:
        return []


def differences(old: Mapping[str, Any], new: Mapping[str, Any],
                fields: tuple[str, ...] = MATH_FIELDS) -> dict[str, tuple[Any, Any]]:
    """``{field: (old, new)}`` for every field of ``fields`` that changed (absent: ``None``)."""
    out = {}
    for f in fields:
        a, b = old.get(f), new.get(f)
        if f == "data":
            a, b = normalize_data(a), normalize_data(b)
        if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(
                a, bool) and float(a) == float(b):
            continue
        if a != b:
            out[f] = (a, b)
    return out


def format_differences(diff: Mapping[str, tuple[Any, Any]]) -> str:
    """``"learning_rate 0.002 -> 0.01, steps 300 -> 600"``."""
    return ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in diff.items())


def check_settings(run_dir: pathlib.Path, recorded: Mapping[str, Any] | None,
                   current: Mapping[str, Any], allow_change: bool,
                   fields: tuple[str, ...] = MATH_FIELDS) -> dict[str, tuple[Any, Any]]:
    """The changes from ``recorded`` to ``current``; refused unless ``allow_change``.

    Raises:
      RunDirError: some of ``fields`` differ and changes are not allowed; the message lists
        every difference and the two ways out.
    """
    if recorded is None:
        return {}
    diff = differences(recorded, current, fields)
    longer = diff.get("steps")
    if diff and not allow_change and longer is not None and isinstance(longer[0], int) and \
            isinstance(longer[1], int) and longer[1] > longer[0]:
        raise RunDirError(
            f"to train {run_dir} longer, add --allow-config-change --tail-from {longer[0]} "
            "(--tail constant or rewarm: docs/training.md): it was trained with other "
            f"settings: {format_differences(diff)}; or use another --run-dir for a new run")
    if diff and not allow_change:
        raise RunDirError(
            "use another --run-dir for a new run, or pass --allow-config-change to continue "
            f"this one under the new settings (recorded as a new segment in {HISTORY}): "
            f"run directory {run_dir} was trained with other settings: "
            f"{format_differences(diff)}")
    return diff


def record_segment(run_dir: pathlib.Path, settings: Mapping[str, Any], start_step: int,
                   changed: Mapping[str, tuple[Any, Any]]) -> None:
    """Append this segment to ``config_history.jsonl`` and make ``settings`` current."""
    history = run_dir / HISTORY
    segment = len(_lines(history))
    append_line(history, json.dumps({
        "segment": segment, "start_step": start_step, "started": _now(), "pid": os.getpid(),
        "settings": dict(settings), "changed": {k: list(v) for k, v in changed.items()},
    }))
    atomic_write_text(run_dir / CONFIG, json.dumps(dict(settings), indent=2))


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------


def resume_metrics(run_dir: pathlib.Path, start_step: int) -> list[dict[str, Any]]:
    """Make ``metrics.jsonl`` hold the rows of steps ``1..start_step``, each once.

    Rows after ``start_step`` (recorded after the checkpoint the run resumes from, and
    about to be recomputed) and lines that are not JSON objects (a write cut short) move
    to ``metrics_superseded.jsonl``, each marked with the resume point; of duplicated
    steps (older versions wrote them) the last row is kept.  ``metrics.jsonl`` is
    rewritten atomically, only when something changed.

    Returns:
      The kept rows, in step order.
    """
    path = run_dir / METRICS
    try:
        raw = path.read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return []
    kept: dict[int, dict[str, Any]] = {}
    moved: list[dict[str, Any]] = []
    lines = raw.splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step = int(row["step"]) if isinstance(row, dict) else None
        except (ValueError, KeyError, TypeError):
            row, step = None, None
        if step is None:
            moved.append({"damaged_line": line, "line": i + 1})
        elif step > start_step:
            moved.append({**row, "superseded_at_step": start_step})
        else:
            if step in kept:
                moved.append({**kept[step], "superseded_at_step": start_step,
                              "duplicate": True})
            kept[step] = row
    rows = [kept[s] for s in sorted(kept)]
    intact = not moved and raw.endswith("\n") and [json.loads(x) for x in lines if x] == rows
    if not intact:
        for row in moved:
            append_line(run_dir / SUPERSEDED, json.dumps(row))
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def iter_metrics(run_dir: pathlib.Path) -> Iterator[dict[str, Any]]:
    """The readable rows of ``metrics.jsonl`` (damaged lines skipped)."""
    for line in _lines(pathlib.Path(run_dir) / METRICS):
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and "step" in row:
                yield row
