"""One jitted, donated optimizer update of every configuration vs ``optax.adamw``, in JAX.

For the chosen LLaMA shape (``--model``, default the paper's ``270m``) the script
materialises float32 parameters (``0.02 * normal``, one leaf at a time) and one fixed
gradient tree of the same shapes, then, for every configuration of
:data:`sage_optim.CONFIG_NAMES` and for the baseline
``optax.adamw(1e-4, b1=0.9, b2=0.99, weight_decay=0.01)``, builds::

    step = jax.jit(lambda p, s, g: (optax.apply_updates(p, u), s2)   # u, s2 = tx.update(g, s, p)
                   , donate_argnums=(0, 1))

compiles it ahead of time (``lower().compile()``), prints ``compiled.memory_analysis()`` and
times it.  Timing: ``--warmup`` untimed calls, then ``--repeats`` rounds; in each round every
configuration runs one step (round-robin, baseline included in every round), each call is
``block_until_ready``-ed and the median per configuration is reported with its ratio to the
baseline median over the same rounds.  If all configurations' parameters and states would
not fit in memory together (``--schedule auto``, the estimate is printed), each
configuration is instead interleaved pairwise with the baseline, which then stays alive for
the whole run, and its ratio uses the baseline timings of its own rounds.

Bytes moved per step: the analytic model of :mod:`sage_repro.traffic` (parameters read and
written, gradients and every state leaf read, state written, plus SinkGD's ``2·L + 2`` and
SAGE's one extra pass over each matrix they update).

Memory bandwidth is measured in the same run: a jitted, donated (in-place, like the steps)
``x * 1.0001 + 1`` over a ``--bw-mib`` (512 MiB) float32 array, median of ``--bw-repeats``
calls, counting one read and one write (the same kernel into a fresh buffer is printed too).
Each configuration's ``bytes / median time`` is reported as a fraction of it.

Prints a markdown table and whether the issue's two targets hold for ``sage-hybrid``: its
update no slower than AdamW's (ratio ≤ 1) and its compiled temporary memory no larger than
the largest single parameter.

    python benchmarks/jax_step.py [--model 270m] [--repeats 7] [--configs sage-hybrid lion]
                                  [--breakdown]

``--kernel auto|pallas|jnp|stream|blocked`` chooses how SinkGD computes its scales
(``blocked``: by blocks of rows, no ``K``; ``auto``: jnp, until
``scripts/gpu-check`` has validated the Pallas kernel on this GPU:
``sage_optim.kernels.VALIDATED_ON``); ``--compare-kernels sage-hybrid sinkgd-pure`` times
the named configurations twice, as ``"<name> [pallas]"`` and ``"<name> [jnp]"``: the
figures that decide whether ``auto`` takes the kernel.  ``--compare-range-pass
sinkgd-hybrid`` times the named configurations twice, as ``"<name>"`` and ``"<name> [range
pass]"``, the latter with SinkGD finding each matrix's range scale on the CPU too (the
computation :func:`sage_optax.sinkgd.checked_sinkhorn_scales` falls back to): the A/B of
that pass in one process.  ``--compare-groupings sage-hybrid`` times the named configurations
also as ``"<name> [grouping leaf]"`` and ``"<name> [grouping sequence]"`` (``--groupings``):
SinkGD's CPU grouping (``sage_optax.sinkgd.CPU_GROUPING``) while each is traced.  Both
tags are variants of XLA's CPU path: their entries run ``impl="jnp"`` (not the native
kernel that ``auto`` takes on the CPU).  ``--compare-kernels sage-hybrid --kernels jnp
native`` times the native kernel against XLA's path.

``--temp-only`` compiles each step from the shapes alone (nothing is allocated, nothing
timed) and prints its compiled temporary memory: deterministic, and cheap enough for a
before/after comparison on a busy machine.

``--breakdown`` then times ``sage-hybrid`` on each parameter kind alone (embedding, dense,
vector) against ``optax.adamw`` on the same leaves, to show where its time goes.

``--processes N`` runs the whole measurement in ``N`` fresh processes, one after another,
and prints each configuration's ratio in each and their median.  On a CPU, one process's
ratios can be off by far more than its rounds' spread (seen on this project's 2-core
machines: the same step 1.0x in most processes and 1.4-1.9x in one, with the in-place
bandwidth measured 50 GiB/s in most and 79 in that one, so the memory the process was
given differs), which only a median over processes shows.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

import sage_optax
from sage_optim.presets import resolve_preset
from sage_repro import traffic
from sage_repro.llama_shapes import STACKED_ROUTES, llama_param_shapes
from sage_train.model.shapes import get_model_config

sinkhorn = importlib.import_module("sage_optax.sinkgd")  # the module; sage_optax.sinkgd: the alias

BASELINE = "optax.adamw (baseline)"
GIB = 2.0**30
MIB = 2.0**20


def nbytes(tree: Any) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@functools.partial(jax.jit, static_argnums=(1,))
def _normal_leaf(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(key, shape, jnp.float32) * 0.02


def materialise(shapes: Any, seed: int) -> Any:
    """Random ``0.02 * normal`` leaves in the shapes' dtypes, one at a time (peak = one leaf
    + the tree)."""
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    out = []
    for k, leaf in zip(keys, leaves, strict=True):
        out.append(_normal_leaf(k, tuple(leaf.shape)).astype(leaf.dtype).block_until_ready())
    return jax.tree.unflatten(treedef, out)


def measure_bandwidth(mib: int, repeats: int, donate: bool) -> float:
    """GiB/s of a jitted ``x * 1.0001 + 1`` (one read + one write of ``mib`` MiB).

    ``donate=True`` writes in place (the output reuses the donated input buffer, as the
    optimizer steps do); ``False`` writes a fresh buffer each call, which on this machine
    is dominated by page faults of the new allocation.
    """
    n = mib * 2**20 // 4
    x = jnp.ones((n,), jnp.float32)
    f = jax.jit(lambda x: x * 1.0001 + 1, donate_argnums=(0,) if donate else ())
    f = f.lower(x).compile()
    times = []
    for i in range(repeats + 2):
        t0 = time.perf_counter()
        y = f(x).block_until_ready()
        dt = time.perf_counter() - t0
        if donate:
            x = y
        del y
        if i >= 2:
            times.append(dt)
    del x
    gc.collect()
    return 2 * n * 4 / statistics.median(times) / GIB


ROUTES: dict[str, Any] = {}
"""Route overrides of the tree being measured (the stacked layout declares its layer axis)."""

KERNEL: dict[str, str] = {"default": "auto"}
"""SinkGD's scale computation for entries that do not name one (``--kernel``)."""


RANGE_PASS = "range pass"
"""The tag of an entry whose SinkGD finds each matrix's range scale on the CPU too."""


GROUPING = "grouping "
"""The tag of an entry whose SinkGD groups its matrices on the CPU another way
(``"sage-hybrid [grouping leaf]"``: ``sage_optax.sinkgd.CPU_GROUPING`` while it is traced)."""


def split_entry(entry: str) -> tuple[str, str]:
    """``(configuration, kernel)`` of a table entry: ``"sinkgd-pure [jnp]"``, ``"sinkgd-hybrid
    [range pass]"``, ``"sage-hybrid [grouping leaf]"`` or a plain name.  A range-pass or
    grouping entry is a variant of XLA's CPU path: its kernel is ``"jnp"``."""
    if entry.endswith("]") and " [" in entry:
        name, kernel = entry[:-1].split(" [")
        if kernel == RANGE_PASS or kernel.startswith(GROUPING):
            return name, "jnp"
        return name, kernel.split(" ")[0]
    return entry, KERNEL["default"]


def grouping_of(entry: str) -> str | None:
    """The CPU grouping a ``"<name> [grouping G]"`` entry is traced with (else ``None``)."""
    tag = f" [{GROUPING}"
    return entry[:-1].split(tag)[1] if entry.endswith("]") and tag in entry else None


def stream_bytes(entry: str) -> int | None:
    """The batch size of a ``"<name> [stream N MiB]"`` entry, in bytes (else ``None``)."""
    if not entry.endswith(" MiB]") or " [stream " not in entry:
        return None
    return int(float(entry.split(" [stream ")[1].split(" ")[0]) * MIB)


def _swap_of(entry: str) -> tuple[str, Any] | None:
    """The attribute of ``sage_optax.sinkgd`` that ``entry``'s tag sets, and its value."""
    grouping = grouping_of(entry)
    if grouping is not None:
        return "CPU_GROUPING", grouping
    batch = stream_bytes(entry)
    if batch is not None:
        return "STREAM_GROUP_BYTES", batch
    if entry.endswith(f" [{RANGE_PASS}]"):
        return "checked_sinkhorn_scales", sinkhorn.range_scaled_scales
    return None


@contextlib.contextmanager
def traced_as(entry: str) -> Any:
    """Trace ``entry``'s step in this context: for a ``[range pass]`` entry, SinkGD's CPU path
    is the range-scaled computation (what ``checked_sinkhorn_scales`` falls back to); for a
    ``[grouping G]`` entry, SinkGD's ``grouping="auto"`` is ``G`` on the CPU; for a
    ``[stream N MiB]`` entry, the streamed batches are at most N MiB."""
    swap = _swap_of(entry)
    if swap is None:
        yield
        return
    name, value = swap
    default = getattr(sinkhorn, name)
    setattr(sinkhorn, name, value)
    try:
        yield
    finally:
        setattr(sinkhorn, name, default)


def labels_of(shapes: Any) -> dict[str, str]:
    """``{path: kind}`` as the router labels the measured tree."""
    routed = sage_optax.route_params(shapes, ROUTES or None)
    return dict(sage_optax.routing.iter_leaves(routed.labels))


def make_tx(entry: str) -> optax.GradientTransformation:
    if entry == BASELINE:
        return optax.adamw(1e-4, b1=0.9, b2=0.99, weight_decay=0.01)
    name, kernel = split_entry(entry)
    return sage_optax.make_optimizer(name, route_overrides=ROUTES or None, impl=kernel)


def bytes_moved(name: str, shapes: Any, state_shapes: Any) -> int:
    """The analytic byte count of :mod:`sage_repro.traffic`."""
    leaves = []
    if name != BASELINE:
        preset = resolve_preset(split_entry(name)[0], {})
        labels = labels_of(shapes)
        for path, leaf in sage_optax.routing.iter_leaves(shapes):
            rule = preset.rule(labels[path])
            leaves.append((rule.name, rule.hyperparams, len(leaf.shape), nbytes(leaf)))
    arrays = [x for x in jax.tree.leaves(state_shapes)  # without the integer step counters
              if len(x.shape) or not jnp.issubdtype(x.dtype, jnp.integer)]
    return traffic.step_bytes(nbytes(shapes), nbytes(arrays), leaves)


class Runner:
    """One configuration: its compiled step, live params/state and timings."""

    def __init__(self, name: str, shapes: Any, grads: Any, seed: int):
        self.name = name
        tx = make_tx(name)
        state_shapes = jax.eval_shape(tx.init, shapes)
        self.state_bytes = nbytes(state_shapes)
        self.bytes = bytes_moved(name, shapes, state_shapes)
        self.params = materialise(shapes, seed)
        self.state = jax.jit(tx.init)(self.params)

        def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
            u, s2 = tx.update(g, s, p)
            return optax.apply_updates(p, u), s2

        with traced_as(name):
            self.compiled = jax.jit(step, donate_argnums=(0, 1)).lower(
                self.params, self.state, grads).compile()
        self.memory = self.compiled.memory_analysis()
        self.grads = grads
        self.times: list[float] = []

    def run(self, record: bool) -> float:
        t0 = time.perf_counter()
        self.params, self.state = self.compiled(self.params, self.state, self.grads)
        jax.block_until_ready((self.params, self.state))
        dt = time.perf_counter() - t0
        if record:
            self.times.append(dt)
        return dt

    def memory_line(self) -> str:
        ma = self.memory
        if ma is None:
            return f"{self.name}: memory_analysis() unavailable"
        fields = [a for a in dir(ma) if a.endswith("_in_bytes")]
        return f"{self.name}: " + ", ".join(
            f"{a.removesuffix('_in_bytes')}={getattr(ma, a) / MIB:.1f} MiB" for a in fields
        )

    @property
    def temp_bytes(self) -> float:
        return float("nan") if self.memory is None else self.memory.temp_size_in_bytes

    def free(self) -> None:
        del self.params, self.state, self.compiled
        gc.collect()


def interleave(runners: list[Runner], warmup: int, repeats: int) -> None:
    for _ in range(warmup):
        for r in runners:
            r.run(record=False)
    for _ in range(repeats):
        for r in runners:
            r.run(record=True)


def mem_available() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def kind_subtree(shapes: dict[str, Any], kind: str) -> dict[str, Any]:
    """The nested dict of the leaves the router labels ``kind`` (embedding/dense/vector)."""
    labels = labels_of(shapes)
    out: dict[str, Any] = {}
    for path, leaf in sage_optax.routing.iter_leaves(shapes):
        if labels[path] != kind:
            continue
        *parents, last = path.split(".")
        node = out
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaf
    return out


def breakdown(name: str, shapes: dict[str, Any], args: argparse.Namespace, bw: float) -> None:
    """Time ``name``'s update restricted to each parameter kind against AdamW on the same leaves.

    Each kind's leaves form their own tree; the configuration and the baseline are built and
    interleaved on it exactly as in the main table, so the table says where the time goes.
    """
    preset = resolve_preset(name, {})
    print(f"\nwhere the time of {name} goes: each parameter kind alone, interleaved with "
          f"optax.adamw on the same leaves ({args.repeats} rounds)\n")
    print("| kind | rule | leaves | MiB | ms/step | adamw ms/step | vs adamw | bytes moved (GiB) "
          "| achieved GiB/s | fraction of bandwidth |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for kind in ("embedding", "dense", "vector"):
        sub = kind_subtree(shapes, kind)
        if not sub:
            continue
        grads = materialise(sub, seed=1)
        runners = [Runner(BASELINE, sub, grads, seed=0), Runner(name, sub, grads, seed=0)]
        interleave(runners, args.warmup, args.repeats)
        base, ours = (statistics.median(r.times) for r in runners)
        gibs = runners[1].bytes / ours / GIB
        print(f"| {kind} | {preset.rule(kind).name} | {len(jax.tree.leaves(sub))} "
              f"| {nbytes(sub) / MIB:.1f} | {ours * 1e3:.1f} | {base * 1e3:.1f} "
              f"| {ours / base:.2f}x | {runners[1].bytes / GIB:.2f} | {gibs:.2f} "
              f"| {gibs / bw:.2f} |", flush=True)
        for r in runners:
            r.free()


def compiled_temp_bytes(entry: str, shapes: Any) -> tuple[int, float, float]:
    """Temporary bytes of ``entry``'s donated step, compiled from the shapes alone, and the
    seconds its trace and lowering, then its compilation, took (cold, unless
    ``JAX_COMPILATION_CACHE_DIR`` holds it)."""
    tx = make_tx(entry)

    def step(p: Any, s: Any, g: Any) -> tuple[Any, Any]:
        u, s2 = tx.update(g, s, p)
        return optax.apply_updates(p, u), s2

    state = jax.eval_shape(tx.init, shapes)
    with traced_as(entry):
        t0 = time.perf_counter()
        lowered = jax.jit(step, donate_argnums=(0, 1)).lower(shapes, state, shapes)
        t1 = time.perf_counter()
        compiled = lowered.compile()
        t2 = time.perf_counter()
    memory = compiled.memory_analysis()
    return (-1 if memory is None else int(memory.temp_size_in_bytes)), t1 - t0, t2 - t1


def print_temps(entries: list[str], shapes: Any, largest: int) -> None:
    """``--temp-only``: each step's compiled temporary memory and its cold compile time.

    The first entry is the baseline; its trace-and-compile seconds are the ratios' base
    (one process, one compile each: a figure to compare within a run, as every timing).
    """
    print()
    print("| configuration | temp (MiB) | temp / largest param | trace + lower (s) | "
          "compile (s) | trace + compile vs baseline |")
    print("|---|---:|---:|---:|---:|---:|")
    base = None
    for entry in entries:
        temp, lower_s, compile_s = compiled_temp_bytes(entry, shapes)
        base = lower_s + compile_s if base is None else base
        print(f"| {entry} | {temp / MIB:.1f} | {temp / largest:.2f} | {lower_s:.2f} | "
              f"{compile_s:.2f} | {(lower_s + compile_s) / base:.2f}x |", flush=True)


def across_processes(argv: list[str], processes: int) -> None:
    """Run this script ``processes`` times in fresh processes; print each one's table rows and
    every configuration's ratio per process and median over them."""
    child = []
    skip = False
    for a in argv:  # the same arguments without --processes
        if skip:
            skip = False
        elif a == "--processes":
            skip = True
        elif not a.startswith("--processes="):
            child.append(a)
    runs: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(processes):
            out = os.path.join(tmp, f"{i}.json")
            done = subprocess.run([sys.executable, __file__, *child, "--json", out],
                                  capture_output=True, text=True)
            if done.returncode != 0:
                sys.exit(f"process {i + 1} of {processes} failed (exit {done.returncode}):\n"
                         f"{done.stdout[-2000:]}{done.stderr[-2000:]}")
            print(f"process {i + 1} of {processes}:")
            print("\n".join(line for line in done.stdout.splitlines()
                            if line.startswith(("measured bandwidth", "| "))), flush=True)
            with open(out) as f:
                runs.append(json.load(f))
    print()
    print(f"{processes} processes, each configuration's ratio to the baseline in each, and the "
          "median over them:")
    print()
    print("| configuration | ratio per process | median ratio | median ms/step |")
    print("|---|---|---:|---:|")
    for n in runs[0]:
        ratios = [run[n]["ratio"] for run in runs]
        ms = statistics.median(run[n]["ms"] for run in runs)
        print(f"| {n} | {', '.join(f'{x:.2f}' for x in ratios)} "
              f"| {statistics.median(ratios):.2f}x | {ms:.1f} |")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="270m", help="a sage_optim model name (default 270m)")
    ap.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds (default 2)")
    ap.add_argument(
        "--configs", nargs="+", default=list(sage_optax.CONFIG_NAMES),
        help="configurations to time (default: all eight)",
    )
    ap.add_argument(
        "--schedule", choices=("auto", "all", "pairwise"), default="auto",
        help="interleave all configurations at once, or each pairwise with the baseline "
        "(auto: all if the estimate fits comfortably in available memory)",
    )
    ap.add_argument(
        "--breakdown", action="store_true",
        help="also time sage-hybrid on each parameter kind alone against adamw",
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="parameter and gradient dtype (default float32)")
    ap.add_argument("--layout", choices=("per-layer", "stacked"), default="per-layer",
                    help="one leaf per layer, or layers stacked on a leading axis as an "
                    "nnx.scan model holds them (default per-layer)")
    ap.add_argument("--kernel", choices=sinkhorn.IMPLS, default="auto",
                    help="SinkGD's scale computation (auto: the Pallas kernel only on a GPU "
                    "where scripts/gpu-check validated it, else jnp)")
    ap.add_argument("--compare-kernels", nargs="*", default=[], metavar="CONFIG",
                    help="time these configurations with both SinkGD kernels, pallas and jnp")
    ap.add_argument("--kernels", nargs="+", default=["pallas", "jnp"], metavar="IMPL",
                    help="the computations --compare-kernels times: pallas, jnp, stream, "
                         "blocked, or 'stream N MiB' (streamed batches of at most N MiB; "
                         "default pallas jnp)")
    ap.add_argument("--compare-range-pass", nargs="*", default=[], metavar="CONFIG",
                    help="time these configurations also with SinkGD's range pass on the CPU")
    ap.add_argument("--compare-groupings", nargs="*", default=[], metavar="CONFIG",
                    help="time these configurations also with each of --groupings as SinkGD's "
                    "grouping on the CPU")
    ap.add_argument("--groupings", nargs="+", default=["leaf", "sequence"],
                    choices=("leaf", "stack", "sequence"), metavar="GROUPING",
                    help="the CPU groupings --compare-groupings times (default leaf sequence)")
    ap.add_argument("--temp-only", action="store_true",
                    help="only compile each step from the shapes (nothing allocated) and print "
                    "its compiled temporary memory: deterministic, no timing")
    ap.add_argument("--bw-mib", type=int, default=512, help="bandwidth array size (MiB)")
    ap.add_argument("--bw-repeats", type=int, default=10)
    ap.add_argument("--processes", type=int, default=1,
                    help="repeat the measurement in this many fresh processes and report the "
                    "median ratio (default 1)")
    ap.add_argument("--json", help=argparse.SUPPRESS)  # a child's results, for --processes
    args = ap.parse_args(argv)
    if args.processes < 1:
        ap.error(f"--processes must be at least 1, got {args.processes}")
    return args


def report(results: dict[str, tuple[Runner, float]], entries: list[str],
           args: argparse.Namespace, schedule: str, bw: float, largest: int) -> None:
    """Print the table (and write ``--json``) of ``results``: name -> (runner, baseline)."""
    how = (
        "all configurations interleaved round-robin"
        if schedule == "all"
        else "each configuration interleaved pairwise with the baseline"
    )
    print()
    print(
        f"model {args.model}, {how}, median of {args.repeats} timed rounds after "
        f"{args.warmup} warmup; bandwidth {bw:.2f} GiB/s; largest parameter "
        f"{largest / MIB:.1f} MiB"
    )
    print()
    print(
        "| configuration | ms/step | vs adamw | bytes moved (GiB) | achieved GiB/s "
        "| fraction of bandwidth | temp (MiB) | temp / largest param |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    order = [*entries, BASELINE]
    for n in order:
        r, base_med = results[n]
        med = statistics.median(r.times)
        gibs = r.bytes / med / GIB
        print(
            f"| {n} | {med * 1e3:.1f} | {med / base_med:.2f}x | {r.bytes / GIB:.2f} "
            f"| {gibs:.2f} | {gibs / bw:.2f} | {r.temp_bytes / MIB:.1f} "
            f"| {r.temp_bytes / largest:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({n: {"ms": statistics.median(results[n][0].times) * 1e3,
                           "ratio": statistics.median(results[n][0].times) / results[n][1]}
                       for n in order}, f)
    for n in [e for e in entries if split_entry(e)[0] == "sage-hybrid"]:
        r, base_med = results[n]
        ratio = statistics.median(r.times) / base_med
        print()
        print(
            f"target 1 ({n} update no slower than adamw): ratio {ratio:.2f} -> "
            f"{'MET' if ratio <= 1.0 else 'NOT MET'}"
        )
        print(
            f"target 2 ({n} temp memory <= largest parameter): "
            f"{r.temp_bytes / MIB:.1f} MiB vs {largest / MIB:.1f} MiB -> "
            f"{'MET' if r.temp_bytes <= largest else 'NOT MET'}"
        )


def _entries(args: argparse.Namespace) -> list[str]:
    """The configurations to time, each kernel and range-pass variant as its own entry."""
    entries = []
    for n in args.configs:
        both = n in args.compare_kernels
        entries += [f"{n} [{k}]" for k in args.kernels] if both else [n]
        if n in args.compare_range_pass:
            entries.append(f"{n} [{RANGE_PASS}]")
        if n in args.compare_groupings:
            entries += [f"{n} [{GROUPING}{g}]" for g in args.groupings]
    return entries


def _run_all(baseline: Runner, entries: list[str], shapes: Any, grads: Any,
             args: argparse.Namespace) -> dict[str, tuple[Runner, float]]:
    """Time every entry at once with the baseline: name -> (runner, baseline median)."""
    results: dict[str, tuple[Runner, float]] = {}
    runners = [baseline]
    for n in entries:
        runners.append(Runner(n, shapes, grads, seed=0))
        print(runners[-1].memory_line())
    interleave(runners, args.warmup, args.repeats)
    base_med = statistics.median(baseline.times)
    for r in runners:
        results[r.name] = (r, base_med)
    return results


def _run_pairwise(baseline: Runner, entries: list[str], shapes: Any, grads: Any,
                  args: argparse.Namespace) -> dict[str, tuple[Runner, float]]:
    """Time each entry alone against the baseline: name -> (runner, baseline median)."""
    results: dict[str, tuple[Runner, float]] = {}
    all_base: list[float] = []
    for n in entries:
        r = Runner(n, shapes, grads, seed=0)
        print(r.memory_line())
        baseline.times = []
        interleave([baseline, r], args.warmup, args.repeats)
        all_base += baseline.times
        results[n] = (r, statistics.median(baseline.times))
        print(
            f"  {n}: {statistics.median(r.times) * 1e3:.1f} ms vs baseline "
            f"{results[n][1] * 1e3:.1f} ms", flush=True,
        )
        r.free()
    baseline.times = all_base
    results[BASELINE] = (baseline, statistics.median(all_base))
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.processes > 1:
        across_processes(sys.argv[1:] if argv is None else argv, args.processes)
        return
    KERNEL["default"] = args.kernel
    entries = _entries(args)

    config = get_model_config(args.model)
    shapes = llama_param_shapes(config, jnp.dtype(args.dtype), stacked=args.layout == "stacked")
    ROUTES.clear()
    if args.layout == "stacked":
        ROUTES.update(STACKED_ROUTES)
    p_bytes = nbytes(shapes)
    largest = max(nbytes(x) for x in jax.tree.leaves(shapes))
    print(f"jax {jax.__version__}, optax {optax.__version__}, devices {jax.devices()}, "
          f"{args.dtype} parameters, {args.layout} layout")
    print(
        f"model {args.model}: {config.param_count():,} params, {p_bytes / GIB:.3f} GiB float32, "
        f"largest leaf {largest / MIB:.1f} MiB"
    )

    if args.temp_only:
        print_temps([BASELINE, *entries], shapes, largest)
        return
    bw = measure_bandwidth(args.bw_mib, args.bw_repeats, donate=True)
    bw_fresh = measure_bandwidth(args.bw_mib, args.bw_repeats, donate=False)
    print(
        f"measured bandwidth (x*1.0001+1 over {args.bw_mib} MiB, read+write): {bw:.2f} GiB/s "
        f"in place (donated, the reference below), {bw_fresh:.2f} GiB/s into a fresh buffer"
    )

    names = [BASELINE, *entries]
    state_total = sum(nbytes(jax.eval_shape(make_tx(n).init, shapes)) for n in names)
    estimate = p_bytes * (len(names) + 1) + state_total  # every config's params + grads
    avail = mem_available()
    schedule = args.schedule
    if schedule == "auto":
        schedule = "all" if 1.25 * estimate + 2 * GIB < avail else "pairwise"
    print(
        f"all-at-once estimate {estimate / GIB:.2f} GiB (params x{len(names)}, grads, states), "
        f"available {avail / GIB:.2f} GiB -> schedule: {schedule}"
    )

    grads = materialise(shapes, seed=1)
    baseline = Runner(BASELINE, shapes, grads, seed=0)
    print(baseline.memory_line())
    if schedule == "all":
        results = _run_all(baseline, entries, shapes, grads, args)
    else:
        results = _run_pairwise(baseline, entries, shapes, grads, args)

    report(results, entries, args, schedule, bw, largest)
    if args.breakdown:
        for r, _ in results.values():
            if hasattr(r, "params"):
                r.free()
        breakdown("sage-hybrid", shapes, args, bw)


if __name__ == "__main__":
    main()
