"""``python -m sage_repro.together_check OUT -- SWEEP OPTIONS``: ``--together N`` measured.

The same runs (``sage-repro sweep`` with the options after ``--``, a piece such as
``--piece r-sage-hybrid --plan grid`` or a sweep of its own) trained twice on this machine:
first one after another (``--one-process``, or ``--baseline processes``: a trainer process
per run), in ``OUT/alone``, then ``--together N`` in ``OUT/together``.  Each half compiles
into a compilation cache of its own (``OUT/HALF/xla_cache``; ``--shared-cache`` keeps the
environment's instead), so neither finds the other's programs.  The two halves' wall
times give the measured speedup; every run's losses and test perplexities are compared
between the halves (the same to the last bit, or the largest relative difference).

Writes ``OUT/together-check.json`` and ``OUT/together-check.md`` beside the two sweeps'
folders, prints the summary, and exits 0 when both halves finished every run (1 when a
half failed or was stopped at ``--seconds``, 2 for bad options).  It trains nothing
faster by itself: a default of the sweep changes only after this check on a GPU shows
the speedup (``docs/reproduce.md``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from sage_repro import sweep
from sage_train.job.cli_args import OneLineParser, checked

RESULT = "together-check"
"""The check's files in ``OUT``: ``together-check.json`` and ``together-check.md``."""

_LANES = checked(int, lambda v: v >= 2, "an integer >= 2")
_SECONDS = checked(float, lambda v: math.isfinite(v) and v > 0, "a number > 0")
_MANAGED = ("--out", "--together", "--one-process", "--dry-run")


def build_parser() -> argparse.ArgumentParser:
    """The check's parser (its own options; the sweep's come after ``--``)."""
    p = OneLineParser(prog="python -m sage_repro.together_check",
                      description="Time the same runs one after another and with "
                      "--together N, and compare their numbers.")
    p.add_argument("out", type=pathlib.Path, help="the check's folder (both halves' sweeps)")
    p.add_argument("--together", type=_LANES, default=4, metavar="N",
                   help="trainer processes at once in the second half")
    p.add_argument("--baseline", choices=("one-process", "processes"), default="one-process",
                   help="the first half: one trainer process for every run, or one per run")
    p.add_argument("--seconds", type=_SECONDS, default=None,
                   help="each half's deadline (SIGTERM, then the half is incomplete)")
    p.add_argument("--shared-cache", action="store_true",
                   help="both halves use the environment's compilation cache (tests)")
    return p


@contextlib.contextmanager
def _environ(changes: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _half(out: pathlib.Path, argv: Sequence[str], trainer: Sequence[str],
          seconds: float | None, shared_cache: bool) -> dict[str, Any]:
    """Run one half's sweep in this process; its exit status and wall seconds."""
    env = {} if shared_cache else {"JAX_COMPILATION_CACHE_DIR": str((out / "xla_cache").absolute()),
                                   "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
    timer = None
    if seconds is not None:  # the sweep stops its trainers as at a preemption
        timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
        timer.daemon = True
    t0 = time.monotonic()
    # a SIGTERM after the sweep's own handlers are gone (its report) ends nothing
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    with _environ(env):
        if timer is not None:
            timer.start()
        try:
            rc = sweep.main([*argv, "--out", str(out), *(["--", *trainer] if trainer else [])])
        finally:
            if timer is not None:
                timer.cancel()
            signal.signal(signal.SIGTERM, previous)
    return {"returncode": rc, "wall_s": round(time.monotonic() - t0, 3)}


def _runs(out: pathlib.Path) -> dict[str, dict[str, Any]]:
    """Every run of a half's ``results.json``: ``{label: run}``."""
    try:
        data = json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return {}
    found: dict[str, dict[str, Any]] = {}
    for cell in [*data.get("lr_sweep", []), *data.get("rows", [])]:
        for run in cell.get("runs", []):
            found[f"{run['config']} lr {run['lr']:g} seed {run['seed']}"] = run
    return found


def _relative(a: Sequence[float | None], b: Sequence[float | None]) -> float:
    """The largest relative difference of two series (inf: lengths or a missing value differ)."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x == y:
            continue
        if x is None or y is None:
            return math.inf
        worst = max(worst, abs(x - y) / max(abs(x), abs(y), 1e-30))
    return worst


def compare(alone: Mapping[str, Mapping[str, Any]], together: Mapping[str, Mapping[str, Any]]
            ) -> list[dict[str, Any]]:
    """Per run of both halves: bit-identical or not, the largest relative difference."""
    rows = []
    for label in sorted(set(alone) & set(together)):
        a, t = alone[label], together[label]
        ppl_a, ppl_t = a["evals"]["ppl"], t["evals"]["ppl"]
        loss_a, loss_t = ([loss for _, loss in r["losses"]] for r in (a, t))
        steps_same = [s for s, _ in a["losses"]] == [s for s, _ in t["losses"]]
        rows.append({"run": label, "identical": a["losses"] == t["losses"] and ppl_a == ppl_t,
                     "max_rel_diff": max(_relative(loss_a, loss_t) if steps_same else math.inf,
                                         _relative(ppl_a, ppl_t)),
                     "final_test_ppl": [a.get("final_test_ppl"), t.get("final_test_ppl")],
                     "tokens_per_s": [a.get("tokens_per_s"), t.get("tokens_per_s")]})
    return rows


def _device() -> str:
    try:
        found = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                "--format=csv,noheader"], capture_output=True, text=True,
                               timeout=30, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        found = ""
    return found or "no nvidia-smi (CPU)"


def to_markdown(result: Mapping[str, Any]) -> str:
    """The check's report in markdown."""
    a, t = result["alone"], result["together"]
    lines = [f"# --together {result['lanes']} against {result['baseline']}", "",
             f"{result['date']}; device: {result['device']}; sweep options: "
             f"`{' '.join(result['sweep_argv'])}`", "",
             "| half | exit | wall s | runs |", "|---|---:|---:|---:|",
             f"| {result['baseline']} | {a['returncode']} | {a['wall_s']:.1f} | {a['runs']} |",
             f"| --together {result['lanes']} | {t['returncode']} | {t['wall_s']:.1f} | "
             f"{t['runs']} |", ""]
    if result["speedup"] is None:
        lines.append("No speedup measured: a half did not finish every run.")
    else:
        lines.append(f"Measured speedup: **{result['speedup']:.2f}x** (wall time, the same "
                     f"{a['runs']} runs, each half compiling into its own cache).")
    same = sum(r["identical"] for r in result["runs"])
    worst = max((r["max_rel_diff"] for r in result["runs"]), default=0.0)
    lines += ["", f"Runs compared: {len(result['runs'])}; bit-identical: {same}; largest "
              f"relative difference of a loss or test perplexity: {worst:.3g}.", "",
              "| run | identical | final test ppl (alone / together) | tokens/s (alone / "
              "together) |", "|---|---|---:|---:|"]
    for r in result["runs"]:
        ppl = " / ".join("-" if x is None else f"{x:.3f}" for x in r["final_test_ppl"])
        tps = " / ".join("-" if x is None else f"{x:,.0f}" for x in r["tokens_per_s"])
        lines.append(f"| {r['run']} | {'yes' if r['identical'] else 'no'} | {ppl} | {tps} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 when both halves finished every run."""
    args_in = list(sys.argv[1:] if argv is None else argv)
    own, rest = (args_in[:args_in.index("--")], args_in[args_in.index("--") + 1:]) \
        if "--" in args_in else (args_in, [])
    args = build_parser().parse_args(own)
    sweep_argv, trainer = (rest[:rest.index("--")], rest[rest.index("--") + 1:]) \
        if "--" in rest else (rest, [])
    prog = "sage_repro.together_check"
    if not sweep_argv:
        print(f"{prog}: error: give the sweep's options after -- (for example -- --piece "
              "r-sage-hybrid --plan grid)", file=sys.stderr)
        return 2
    for flag in sweep_argv:
        if flag.split("=", 1)[0] in _MANAGED:
            print(f"{prog}: error: {flag.split('=', 1)[0]} after -- is set by the check itself",
                  file=sys.stderr)
            return 2
    base = ["sweep", *sweep_argv]
    first = ["--one-process"] if args.baseline == "one-process" else []
    halves = {}
    for name, more in (("alone", first), ("together", ["--together", str(args.together)])):
        print(f"{prog}: {name}: sage-repro {' '.join([*base, *more])}", flush=True)
        halves[name] = _half(args.out / name, [*base, *more], trainer, args.seconds,
                             args.shared_cache)
        halves[name]["runs"] = len(_runs(args.out / name))
        if halves[name]["returncode"] == 2:
            return 2  # refused: the sweep said why in one line
    runs = compare(_runs(args.out / "alone"), _runs(args.out / "together"))
    done = all(h["returncode"] == 0 for h in halves.values())
    result = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
              "device": _device(), "lanes": args.together, "baseline": args.baseline,
              "sweep_argv": [*sweep_argv, *(["--", *trainer] if trainer else [])],
              "alone": halves["alone"], "together": halves["together"],
              "speedup": (round(halves["alone"]["wall_s"] / halves["together"]["wall_s"], 3)
                          if done else None),
              "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{RESULT}.json").write_text(json.dumps(result, indent=1) + "\n")
    text = to_markdown(result)
    (args.out / f"{RESULT}.md").write_text(text)
    print(text, end="")
    return 0 if done else 1


if __name__ == "__main__":
    raise SystemExit(main())
