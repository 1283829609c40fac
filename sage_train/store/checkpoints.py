"""Checkpoints that are saved synchronously, verified by checksum and restored with fallback.

Layout: ``run_dir/checkpoints/<step>/``, an orbax ``StandardCheckpointHandler`` checkpoint
(written to a temporary directory and renamed by orbax when complete) plus
``sage_manifest.json``: the size and SHA-256 of every file, the step and the run's
progress (training seconds and tokens), written atomically after the checkpoint is
complete.  So:

* a save that fails raises :class:`~sage_train.job.errors.CheckpointError` at once, in the
  calling thread (orbax's synchronous ``Checkpointer``: no background thread is left
  waiting on a signal that never comes, which is what made a failed asynchronous save hang
  for the orbax timeout of 300 s), and earlier checkpoints are untouched;
* what orbax's own threads print or log while a save fails (a traceback each, some after
  the save failed) goes to ``checkpoints/orbax.log``, not the terminal, which shows the
  one error line;
* a state with a NaN/Inf is never saved (:func:`state_is_finite` is checked first);
* rotation keeps the ``keep`` newest checkpoints with a manifest: one without (not
  verifiable) does not count, so the last verified checkpoint is never deleted while the
  newest is unverified; start-up (:meth:`Checkpoints.prepare`) removes the temporary
  files of a save that was interrupted (orbax's directory, a manifest not yet renamed);
* :meth:`Checkpoints.restore_latest` verifies the newest checkpoint (checksums, then
  orbax's restore, the shapes against the model, finiteness) and falls back to the next
  one when it fails, reporting each unusable checkpoint in one line and moving it aside
  to ``checkpoints/<step>.unusable`` (so it is neither used nor overwritten, and nothing
  is deleted).  A checkpoint without manifest (written before manifests existed, or
  interrupted between orbax's rename and the manifest) is used if it restores, with a
  note that its bytes could not be verified.

In a job of several processes (:mod:`sage_train.job.distributed`) every process calls
:meth:`Checkpoints.save` and :meth:`Checkpoints.restore_latest` at the same step: orbax
writes each process's shards and process 0 finalizes the checkpoint; the run directory
must be one that every process sees (checked by :meth:`Checkpoints.prepare`).  The
checksums of the manifest are computed and verified by all processes together, each
hashing its share of the files (:func:`shared_digests`), so that every process reaches the
same verdict; the manifest records the number of processes and devices that wrote it.  A
checkpoint restores onto any number of processes and devices (orbax reads each array
into the shardings asked for), so a run saved by 2 processes resumes on 1 and back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import pathlib
import shutil
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from sage_train.job import distributed
from sage_train.job.errors import CheckpointError, RunDirError
from sage_train.store.rundir import atomic_write_text

MANIFEST = "sage_manifest.json"
FORMAT = 1
_TMP_MARK = ".orbax-checkpoint-tmp"


@jax.jit
def _all_finite(tree: Any) -> jax.Array:
    leaves = [x for x in jax.tree.leaves(tree)
              if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def state_is_finite(state: Any) -> bool:
    """Whether every floating array of ``state`` (parameters, optimizer state) is finite."""
    return bool(_all_finite(state))


def _files(directory: pathlib.Path) -> list[pathlib.Path]:
    """The files a manifest covers: every file under ``directory`` but the manifest."""
    return [p for p in sorted(directory.rglob("*"))
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(f".{MANIFEST}")]


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_digests(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size", "sha256"}}`` of every file under ``directory``."""
    return {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in _files(directory)}


def shared_digests(directory: pathlib.Path) -> dict[str, dict[str, Any]]:
    """:func:`file_digests`, computed by every process of a job together.

    Process ``i`` of ``n`` hashes files ``i, i + n, ...`` of the sorted listing; the sizes
    and digests are gathered so that every process returns the whole dictionary (alone:
    :func:`file_digests`).  A collective: every process calls it for the same directory.

    Raises:
      JobError: the processes see different files under ``directory`` (it is not shared).
    """
    n = distributed.process_count()
    if n == 1:
        return file_digests(directory)
    files = _files(directory)
    names = [str(p.relative_to(directory)) for p in files]
    listing = hashlib.sha256("\n".join(names).encode()).hexdigest()
    distributed.same_everywhere(f"{len(names)} files, listing {listing[:16]}",
                                f"the listing of {directory}")
    if not names:
        return {}
    me = distributed.process_index()
    sizes = np.zeros(len(names), np.int64)
    sums = np.zeros((len(names), 32), np.uint8)
    for i in range(me, len(names), n):
        sizes[i] = files[i].stat().st_size
        sums[i] = np.frombuffer(bytes.fromhex(_sha256(files[i])), np.uint8)
    all_sizes, all_sums = distributed.allgather(sizes), distributed.allgather(sums)
    return {name: {"size": int(all_sizes[i % n, i]), "sha256": all_sums[i % n, i].tobytes().hex()}
            for i, name in enumerate(names)}


def verify_files(directory: pathlib.Path,
                 digests: Callable[[pathlib.Path], dict[str, dict[str, Any]]] = file_digests
                 ) -> tuple[str | None, dict[str, Any] | None]:
    """``(problem, manifest)``: ``problem`` is ``None`` when every file matches the manifest.

    A directory without manifest gives ``(None, None)`` (nothing to verify against).
    ``digests`` computes the actual checksums (:func:`shared_digests`: a job's processes
    together).
    """
    path = directory / MANIFEST
    if not path.exists():
        return None, None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"its manifest is damaged ({type(e).__name__})", None
    actual = digests(directory)
    for name, want in files.items():
        got = actual.get(name)
        if got is None:
            return f"file {name} is missing", manifest
        if got["size"] != want["size"]:
            return f"file {name} has {got['size']} bytes, not {want['size']}", manifest
        if got["sha256"] != want["sha256"]:
            return f"file {name} does not match its SHA-256 checksum", manifest
    return None, manifest


NOISE_LOG = "orbax.log"
"""The file in ``checkpoints/`` that takes what orbax's threads print during a save."""


class _ThreadOutput:
    """``sys.stderr`` for the main thread; for every other thread, a file.

    Orbax writes a checkpoint from threads of its own; when a write fails (a full disk)
    each of them prints its traceback, some after the save has already failed in the
    main thread.  With this in place they land in :data:`NOISE_LOG`, and the terminal
    keeps the one error line of the main thread.
    """

    def __init__(self, terminal: Any, path: pathlib.Path) -> None:
        self.terminal, self.path = terminal, path

    def write(self, text: str) -> int:
        """Write ``text`` to the terminal (main thread) or append it to the file."""
        if threading.current_thread() is threading.main_thread():
            return int(self.terminal.write(text))
        with contextlib.suppress(OSError), open(self.path, "a") as f:  # a full disk: lost
            f.write(text)
        return len(text)

    def flush(self) -> None:
        """Flush the terminal's stream."""
        self.terminal.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.terminal, name)


_ORBAX_LOGGERS = ("absl", "asyncio")
"""The loggers of orbax's messages: its own (through absl), and asyncio's about the futures
of its failed writes ("exception was never retrieved", logged when they are collected)."""


class _ToFile(logging.Filter):
    """Send every record of the logger it filters to a file instead of its handlers."""

    def __init__(self, path: pathlib.Path) -> None:
        super().__init__()
        self.path = path

    def filter(self, record: logging.LogRecord) -> bool:
        """``False``, after appending the record (with its traceback) to the file."""
        text = logging.Formatter("%(levelname)s:%(name)s:%(threadName)s: %(message)s")
        with contextlib.suppress(OSError), open(self.path, "a") as f:
            f.write(text.format(record) + "\n")
        return False


@contextlib.contextmanager
def _orbax_threads_to(path: pathlib.Path) -> Iterator[None]:
    """What orbax's threads print, and orbax and asyncio log, goes to ``path``.

    (:class:`_ThreadOutput`, :class:`_ToFile`.)

    On success the terminal is given back at the end; after a failure it is kept for the
    rest of the process, because orbax's threads keep printing after the save failed
    (the last line on the terminal stays the error's).
    """
    stderr, logs = _ThreadOutput(sys.stderr, path), _ToFile(path)
    sys.stderr = stderr
    for name in _ORBAX_LOGGERS:
        logging.getLogger(name).addFilter(logs)
    yield
    if sys.stderr is stderr:
        sys.stderr = stderr.terminal
    for name in _ORBAX_LOGGERS:
        logging.getLogger(name).removeFilter(logs)


@dataclasses.dataclass
class Restored:
    """A verified checkpoint, restored."""

    step: int
    state: Any
    progress: dict[str, Any]
    verified: bool
    written_by: tuple[int, int] | None = None  # (processes, devices), where recorded


def _layout(processes: int, devices: int) -> str:
    return (f"{processes} process{'' if processes == 1 else 'es'} with {devices} "
            f"device{'' if devices == 1 else 's'}")


def _first_line(e: BaseException, limit: int = 160) -> str:
    text = (str(e).strip().splitlines() or [""])[0]
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


class Checkpoints:
    """The checkpoints of one run (see the module docstring).

    Args:
      root: the ``checkpoints`` directory.
      keep: how many of the newest checkpoints to keep (older ones are deleted after each
        successful save; directories that are not checkpoints are never deleted).
      log: where one-line reports go.
    """

    def __init__(self, root: pathlib.Path, keep: int = 2,
                 log: Callable[[str], None] = print) -> None:
        self.root, self.keep, self.log = pathlib.Path(root), max(1, keep), log
        self.settings: dict[str, Any] | None = None  # recorded in every manifest
        self._checkpointer: Any = None

    # -- layout --------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the directory, check it is writable, clear interrupted writes.

        Raises:
          RunDirError: ``checkpoints`` exists and is not a directory, or is not writable.
        """
        if self.root.exists() and not self.root.is_dir():
            raise RunDirError(
                f"{self.root} exists and is not a directory; move it away (the run's "
                "checkpoints live there) and run again")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            probe = self.root / f".write-probe-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise RunDirError(f"cannot write checkpoints to {self.root}: {e.strerror}") from e
        if not distributed.is_primary():
            return
        for tmp in sorted(self.root.glob(f"*{_TMP_MARK}*")):
            shutil.rmtree(tmp, ignore_errors=True)
            self.log(f"removed {tmp.name}, a checkpoint write that was interrupted")
        for tmp in sorted(self.root.glob(f"*/.{MANIFEST}.tmp-*")):  # killed before its rename
            with contextlib.suppress(OSError):
                tmp.unlink()
                self.log(f"removed {tmp.relative_to(self.root)}, a manifest write that was "
                         "interrupted")

    def check_shared(self) -> None:
        """Check that every process of a job sees this directory (nothing alone).

        Process 0 writes a probe file that every other process must see: orbax's
        multi-process checkpoints are one directory that all processes write into and read
        from.  A collective: every process calls it.

        Raises:
          JobError: on every process, where some process cannot see the probe (the run
            directory is not on a file system all processes share).
        """
        if distributed.process_count() == 1:
            return
        probe = self.root / f".shared-probe-{distributed.job_token()}"
        problem = None
        if distributed.is_primary():
            try:
                probe.write_text("sage-train: every process of the job must see this file\n")
            except OSError as e:
                problem = f"cannot write checkpoints to {self.root}: {e.strerror}"
        distributed.barrier("sage-train: shared probe written")
        if not distributed.is_primary() and not probe.exists():
            problem = (f"{self.root} is not shared with process 0 (a file it wrote there "
                       "is not seen here): a job's processes must share the run directory "
                       "(one file system that all hosts mount) for orbax's checkpoints")
        try:
            with distributed.together("to share the run directory"):
                if problem is not None:
                    raise RunDirError(problem)
        finally:
            if distributed.is_primary():
                with contextlib.suppress(OSError):
                    probe.unlink()

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories, newest first."""
        if not self.root.is_dir():
            return []
        return sorted((int(p.name) for p in self.root.iterdir()
                       if p.name.isdigit() and p.is_dir()), reverse=True)

    def path(self, step: int) -> pathlib.Path:
        """The directory of the checkpoint of ``step``."""
        return self.root / str(step)

    def _orbax(self) -> Any:
        if self._checkpointer is None:
            import orbax.checkpoint as ocp

            self._checkpointer = ocp.Checkpointer(ocp.StandardCheckpointHandler())
        return self._checkpointer

    # -- save ----------------------------------------------------------------------------

    def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
        """Save ``state`` as step ``step``, then its manifest, then drop old checkpoints.

        Raises:
          CheckpointError: the save failed (the message names the directory and the
            cause); earlier checkpoints are intact.
        """
        import orbax.checkpoint as ocp

        target = self.path(step)
        primary = distributed.is_primary()
        try:
            if target.exists() and primary:
                dest = self._move_aside(step)
                self.log(f"{target} was in the way of a new checkpoint; moved to {dest}")
            distributed.barrier(f"sage-train: checkpoint {step} can be written")
            with _orbax_threads_to(self.root / NOISE_LOG):
                self._orbax().save(target, args=ocp.args.StandardSave(state))
            files = shared_digests(target)
            if primary:
                manifest = {"format": FORMAT, "step": step, "progress": progress,
                            "processes": jax.process_count(), "devices": jax.device_count(),
                            "files": files}
                if self.settings is not None:
                    manifest["settings"] = self.settings
                atomic_write_text(target / MANIFEST, json.dumps(manifest, indent=1))
        except Exception as e:  # noqa: BLE001 - reported as one line, with the cause chained
            self._discard_partial(step)
            raise CheckpointError(
                f"could not save the checkpoint of step {step} to {target}: {_first_line(e)}"
                f" (orbax's own messages: {self.root / NOISE_LOG})") from e
        if primary:
            self._rotate()

    def _discard_partial(self, step: int) -> None:
        """Remove what a failed save of ``step`` left behind.

        Orbax's temporary directory, and the checkpoint itself where its manifest is missing
        (it was never reported saved).
        """
        if not distributed.is_primary():
            return
        with contextlib.suppress(OSError):
            for tmp in self.root.glob(f"{step}{_TMP_MARK}*"):
                shutil.rmtree(tmp, ignore_errors=True)
            target = self.path(step)
            if target.is_dir() and not (target / MANIFEST).exists():
                shutil.rmtree(target, ignore_errors=True)
            for tmp in target.glob(f".{MANIFEST}.tmp-*"):
                tmp.unlink()

    def _rotate(self) -> None:
        """Delete the checkpoints older than the ``keep`` newest verified ones.

        Verified: with a manifest (its checksums were recorded when it was saved).  A
        checkpoint without one (an older version's, or a save cut short before it) does
        not count towards ``keep``, so the last verified checkpoint is never deleted while
        a newer one is unverified.
        """
        verified = 0
        for s in self.steps():  # newest first
            path = self.path(s)
            if not self._is_checkpoint(path):
                continue
            if verified < self.keep:
                verified += (path / MANIFEST).exists()
                continue
            try:
                shutil.rmtree(path)
            except OSError as e:
                self.log(f"could not delete the old checkpoint {path}: {e.strerror}")

    @staticmethod
    def _is_checkpoint(path: pathlib.Path) -> bool:
        return (path / MANIFEST).exists() or (path / "_CHECKPOINT_METADATA").exists()

    def _move_aside(self, step: int) -> pathlib.Path:
        dest = self.root / f"{step}.unusable"
        n = 1
        while dest.exists():
            n += 1
            dest = self.root / f"{step}.unusable-{n}"
        os.replace(self.path(step), dest)
        return dest

    # -- restore -------------------------------------------------------------------------

    def restore_latest(self, like: Any, *, restart: bool = False) -> Restored | None:
        """The newest usable checkpoint, restored with the shapes and shardings of ``like``.

        ``like`` is the state (or a tree of ``jax.ShapeDtypeStruct`` with shardings) the
        checkpoints were saved from.  Checkpoints newer than the one restored that fail
        verification are reported (one line each) and moved to ``<step>.unusable``.
        ``None`` when there is no checkpoint.

        Raises:
          RunDirError: there are checkpoints but none can be restored (each is named with
            its problem), unless ``restart``: then each is moved aside, reported, and
            ``None`` returned (the run starts over from step 0).
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        failed: list[tuple[int, str]] = []
        found = None
        for step in self.steps():
            problem, restored = self._try_restore(step, abstract)
            if restored is not None:
                found = restored
                break
            failed.append((step, problem or "?"))
        if found is None and failed and not restart:
            named = "; ".join(f"step {s} in {self.path(s)}: {p}" for s, p in failed)
            raise distributed.everywhere(RunDirError(
                f"no checkpoint of {self.root} can be restored ({named}); pass --restart to "
                "start the run over from step 0 (they are then moved aside, not deleted)"))
        if distributed.is_primary():  # one process reports and moves them
            for step, problem in failed:
                dest = self._move_aside(step)
                self.log(f"checkpoint of step {step} is unusable ({problem}); moved to {dest} "
                         "(delete it when done inspecting)"
                         + ("; falling back to the previous one" if found is not None else ""))
        if found is not None and not found.verified:
            self.log(f"checkpoint {self.path(found.step)} has no checksum manifest (written "
                     "by an older sage-train or cut short before it): restored unverified")
        if found is not None and found.written_by is not None:
            now = (jax.process_count(), jax.device_count())
            if found.written_by != now:
                self.log(f"the checkpoint of step {found.step} was written by "
                         f"{_layout(*found.written_by)}: restored onto {_layout(*now)}")
        if found is None and failed:
            self.log("--restart: no checkpoint can be restored; the run starts over from step 0")
        return found

    def read(self, like: Any, step: int | None = None) -> Restored:
        """A verified checkpoint, read without changing anything (``sage-train export``).

        ``step``: that checkpoint; ``None``: the newest one that verifies and restores.
        Nothing is moved aside or reported (a training run may own the directory).

        Raises:
          RunDirError: there is no such checkpoint, or none restores (each is named with
            its problem).
        """
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), like)
        steps = self.steps() if step is None else [step]
        if step is not None and not self.path(step).is_dir():
            have = ", ".join(map(str, self.steps())) or "none"
            raise RunDirError(f"{self.root} holds no checkpoint of step {step} (steps: {have})")
        failed = []
        for s in steps:
            problem, restored = self._try_restore(s, abstract)
            if restored is not None:
                return restored
            failed.append(f"step {s} in {self.path(s)}: {problem}")
        if not failed:
            raise RunDirError(f"{self.root} holds no checkpoint")
        raise RunDirError(f"no checkpoint of {self.root} can be read ({'; '.join(failed)})")

    def recorded_settings(self) -> tuple[int, dict[str, Any]] | None:
        """``(step, settings)`` from the manifest of the newest checkpoint whose files verify.

        ``None`` where there is no such checkpoint, or it was written before manifests
        recorded the settings.
        """
        for step in self.steps():
            problem, manifest = verify_files(self.path(step))
            if problem is None and manifest is not None:
                settings = manifest.get("settings")
                return (step, settings) if isinstance(settings, dict) else None
        return None

    def _try_restore(self, step: int, abstract: Any) -> tuple[str | None, Restored | None]:
        """``(problem, restored)`` of the checkpoint of ``step``: the same on every process.

        The checksums are verified by the processes together (:func:`shared_digests`) and a
        failure of orbax on any process fails the checkpoint on all of them.
        """
        import orbax.checkpoint as ocp

        path = self.path(step)
        problem, manifest = verify_files(path, shared_digests)
        if problem is not None:
            return problem, None
        failure = ""
        try:
            state = self._orbax().restore(path, args=ocp.args.StandardRestore(abstract))
        except Exception as e:  # noqa: BLE001 - any failure means: not this checkpoint
            failure = f"orbax cannot restore it: {_first_line(e)}"
        failures = distributed.allgather_text(failure)
        if any(failures):
            if failure:
                return failure, None
            i = next(i for i, f in enumerate(failures) if f)
            return f"process {i}: {failures[i]}", None
        want = [(x.shape, x.dtype) for x in jax.tree.leaves(abstract)]
        got = [(x.shape, x.dtype) for x in jax.tree.leaves(state)]
        same_tree = cast(Any, jax.tree.structure(abstract)) == jax.tree.structure(state)
        if not same_tree or want != got:
            return "it holds another model or optimizer (shapes differ)", None
        if not state_is_finite(state):
            return "it holds NaN/Inf values", None
        progress = dict(manifest.get("progress", {})) if manifest else {}
        written_by = None
        if manifest and isinstance(manifest.get("processes"), int) and isinstance(
                manifest.get("devices"), int):
            written_by = (manifest["processes"], manifest["devices"])
        return None, Restored(step, state, progress, manifest is not None, written_by)

    def close(self) -> None:
        """Release orbax's resources (no background work is pending: saves are synchronous)."""
        if self._checkpointer is not None:
            self._checkpointer.close()
            self._checkpointer = None
