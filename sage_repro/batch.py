"""``python -m sage_repro.batch JOBS``: several trainer runs in one process, one after another.

``sage-repro sweep --one-process`` starts this once for the runs still to train, instead of
one trainer process per run, so Python and JAX start (and the device is initialized) once,
and the runs of one configuration compile their train and eval steps once: the peak
learning rate is a value of the optimizer state, not of the compiled step, so its rates and
seeds share the step (:func:`sage_train.run.steps.cached_steps`).

``JOBS`` is a JSON list, one object per run: ``argv`` (the ``sage-train`` options), ``log``
and ``err`` (its ``train.log`` and ``train.err``, appended to: the run's file descriptors 1
and 2 point there while it trains) and ``exit`` (a JSON file written when it ends:
``returncode``, ``wall_s``, ``max_rss_bytes``). SIGTERM, SIGUSR1 and SIGINT are caught
before JAX is imported: the running run stops at its next step with a checkpoint (exit 75
or 130) and no further run starts. A run that raises is its traceback in its ``err`` and
exit status 1; the next run starts.

Two figures are the process's, not the run's: the trainer's ``peak_memory_bytes`` (the
device allocator's high-water mark, never reset) and ``max_rss_bytes`` are the highest of
this run and the runs before it in the process. For runs of one model and one
configuration (a piece of the grid) the runs' own peaks are the same to within the
optimizer's state.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import sys
import time
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

from sage_train.job.signals import StopSignals

STOPPED = frozenset({75, 130})
"""Exit statuses after which no further run starts (SIGTERM/SIGUSR1, SIGINT)."""


@contextlib.contextmanager
def redirected(log: pathlib.Path, err: pathlib.Path) -> Iterator[None]:
    """File descriptors 1 and 2 (and ``sys.stdout``/``sys.stderr``) appended to ``log``/``err``."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(log, "ab") as out_f, open(err, "ab") as err_f:
        os.dup2(out_f.fileno(), 1)
        os.dup2(err_f.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def run_jobs(jobs: Sequence[dict[str, Any]], signals: StopSignals) -> int:
    """Train ``jobs`` in turn in this process; the number that ran."""
    from sage_train.cli import main as train

    ran = 0
    for job in jobs:
        if signals.received is not None:
            break
        t0 = time.monotonic()
        with redirected(pathlib.Path(job["log"]), pathlib.Path(job["err"])):
            try:
                rc = train(list(job["argv"]), signals=signals)
            except Exception:  # one run's crash is its own: the next one starts
                traceback.print_exc()
                rc = 1
        usage = resource.getrusage(resource.RUSAGE_SELF)
        pathlib.Path(job["exit"]).write_text(json.dumps({
            "returncode": rc, "wall_s": round(time.monotonic() - t0, 3),
            "max_rss_bytes": usage.ru_maxrss * 1024}) + "\n")
        ran += 1
        if rc in STOPPED:
            break
    return ran


def main(argv: Sequence[str] | None = None) -> int:
    """Train the runs of the jobs file ``argv[0]``; 0, or 2 for a missing or bad file."""
    args = list(sys.argv[1:] if argv is None else argv)
    with StopSignals() as signals:
        try:
            jobs = json.loads(pathlib.Path(args[0]).read_text())
        except (IndexError, OSError, ValueError) as e:
            print(f"sage_repro.batch: error: give a jobs file ({e})", file=sys.stderr)
            return 2
        run_jobs(jobs, signals)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
