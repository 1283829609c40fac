"""``scripts/gpu-check``: every GPU test and figure of the project in one call that ends by itself.

A lent GPU gives a session 15 minutes in all, one to two of them to start the machine, so the
check is one command that ends within ``--budget`` seconds (default 540, start-up included)
and brings back what it measured even when it is cut short.  Its parts run in order of value:

  (a) correctness: the CUDA tests that decide whether the GPU paths compute the right
      numbers, JAX's and torch's suites side by side (they share the GPU, not the timings);
  (b) the update timings at 270M (JAX: sage-hybrid and the hybrids against optax.adamw;
      torch: sage-hybrid foreach and fused against AdamW foreach and fused; JAX 1.3B stacked);
  (c) the trainer at 270M, 16 x 1024 tokens, bfloat16, with its defaults (data-parallel
      sharding on one device) and cuDNN attention (peak memory, tokens/s, MFU, SAGE-Hybrid
      against AdamW);
  (d) the kernel comparisons that decide the defaults (Pallas against jnp SinkGD, fused
      against foreach torch, cuDNN against XLA attention);
  (e) the rest (the other layouts and dtypes, the cold compile time of the train step and
      the update, the rest of the test suite, parity, the op count, the trainer at 64 x 1024
      with full rematerialisation), as long as time is left.

Each part has a share of the budget; time a part leaves unused passes to the parts after it,
and (e) has whatever is left.  A step that runs past its share is interrupted (SIGINT, so
pytest still prints its summary, then SIGTERM and SIGKILL to its process group) and the next
one starts.  After every step the report (``OUT/gpu-check.md``), its figures
(``OUT/gpu-check.json``) and the logs (``OUT/logs.tar.gz``) are rewritten, so a run cut off
from outside still leaves everything measured until then.  Nothing else is written under
``OUT`` (the trainer's run directories and checkpoints stay in a temporary folder).

    scripts/gpu-check [OUT]                      # default OUT: $OUT, else ./gpu-check-out
    scripts/gpu-check --dry-run                  # the plan, each step's share, what is missing
    scripts/gpu-check --budget 470 --only a c    # some parts, another budget
    scripts/gpu-check --smoke OUT                # the same plumbing on a CPU at tiny sizes

It needs nothing installed: the checkout runs in place (``PYTHONPATH``); a step whose package
is missing, or whose framework sees no GPU, says so and is skipped.  This file imports only
the standard library, so that it can report a broken JAX or torch instead of dying with it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BUDGET = 540
"""Seconds from the start of the command to its end, its own start-up included."""
RESERVE = 15
"""Seconds kept back from the budget for the last report, the log archive and the exit."""
MIN_STEP = 20
"""A step with less time left than this (or than half its share) is not started ("not
reached")."""

# The test files of part (a), most decisive first (xdist hands tests out in this order).
# JAX: the compiled Pallas kernel, SinkGD's placement and grouping, cuDNN attention, the
# configurations' updates, the numerics at float32's limits (a GPU flushes subnormals).
# torch: foreach against single-tensor on CUDA, the fused (Triton) path against both in
# float32 and bfloat16, CUDA-graph capture, the device guard.
JAX_CORRECTNESS = (
    "tests/optax/test_optax_sinkgd_pallas.py", "tests/optax/test_optax_placement.py",
    "tests/optax/test_optax_grouping.py", "tests/train/test_train_attention.py",
    "tests/optax/test_optax_configs.py", "tests/parity/test_parity_sage_range.py",
    "tests/parity/test_parity_nonfinite.py",
)
TORCH_CORRECTNESS = (
    "tests/torch/test_torch_fused_cuda.py", "tests/torch/test_torch_multi_tensor.py",
    "tests/torch/test_torch_capturable.py", "tests/torch/test_torch_fused_paths.py",
    "tests/torch/test_torch_fused_selfcheck.py", "tests/torch/test_torch_fused_bf16.py",
)
# Left to CI: the notebooks (jupytext), torch's multi-process tests, the install test (it
# builds wheels) and the trainer's multi-process and soak tests (CPU processes, minutes).
NOT_ON_GPU = (
    "tests/docs/test_docs_notebooks.py", "tests/torch/test_torch_distributed.py",
    "tests/docs/test_docs_install.py",
    "tests/train/test_train_multiprocess.py", "tests/train/test_train_soak.py",
)

# The updates whose compiled temporaries XLA:GPU made larger than the CPU's bounds on
# 2026-11-26 (benchmarks/gpu/2026-11-26-h100.md): their buffer assignments go to the logs.
MEMORY_DIAG = (
    "tests/optax/test_optax_grouping.py::test_stacking_adds_no_copy_of_the_gradients",
    "tests/repro/test_repro_memory.py::test_donated_step_needs_no_more_temporary_memory_than_the_largest_"
    "parameter",
)

JAX_GPU_ENV = {
    "JAX_PLATFORMS": "cuda,cpu",
    # The torch tests share the GPU: JAX must not take 75% of its memory up front.
    "XLA_PYTHON_CLIENT_PREALLOCATE": "false",
    # The 8-device sharding tests build their meshes from CPU devices.
    "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
}


@dataclasses.dataclass(frozen=True)
class Step:
    """One command of the plan.

    Attributes:
      title: the report's heading of the step.
      argv: the command, run from the repository root (``{py}``, ``{work}`` and ``{out}``
        are replaced by the interpreter, the work folder and the output folder).
      share: its share of the part's time, in seconds of the default budget.
      kind: how its output becomes markdown: ``pytest`` (counts and failures from its JUnit
        file), ``bench`` (its tables and lines), ``train`` (the trainer's run table is made
        by a later ``train-table`` step), ``train-table`` (no command: the table).
      needs: Python modules it imports; missing ones skip the step.
      gpu: the framework that must see a GPU (``jax``, ``torch``) or ``None``.
      env: environment variables of the command.
    """

    title: str
    argv: tuple[str, ...]
    share: int
    kind: str = "bench"
    needs: tuple[str, ...] = ()
    gpu: str | None = None
    env: tuple[tuple[str, str], ...] = ()


@dataclasses.dataclass(frozen=True)
class Part:
    """A group of steps with one share of the budget; ``concurrent`` steps run together.

    In turn, each step has the part's time left in proportion to its share among the steps
    still to run; with ``greedy`` it has its share (or what is left) in order of value.
    """

    key: str
    title: str
    steps: tuple[Step, ...]
    concurrent: bool = False
    greedy: bool = False  # steps take their share in turn while time lasts (the last part)

    @property
    def share(self) -> int:
        """Seconds of the default budget: the steps' shares (their largest, if together)."""
        if self.concurrent:
            return max(s.share for s in self.steps)
        return sum(s.share for s in self.steps)


def _env(d: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(d.items())


def _pytest(files: Sequence[str], name: str, workers: int, extra: Sequence[str] = ()
            ) -> tuple[str, ...]:
    return ("{py}", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", "--tb=short",
            *(("-n", str(workers)) if workers > 1 else ()), f"--junitxml={{work}}/{name}.xml",
            *extra, *files)


def rest_of_suite() -> tuple[str, ...]:
    """The test files of the suite that part (a) did not run and that run on a GPU host."""
    done = set(JAX_CORRECTNESS) | set(TORCH_CORRECTNESS) | set(NOT_ON_GPU)
    return tuple(sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("*/test_*.py")
                        if str(p.relative_to(ROOT)) not in done))


def plan(smoke: bool = False) -> list[Part]:
    """The parts of the check in order of value (``smoke``: tiny sizes, for a CPU)."""
    big = "tiny" if smoke else "270m"
    huge = "tiny" if smoke else "1.3b"
    steps = "3" if smoke else "40"
    batch = ("2", "32") if smoke else ("16", "1024")
    reps = ("--repeats", "2", "--warmup", "1") if smoke else ("--repeats", "9", "--warmup", "2")
    jax_env = _env({**JAX_GPU_ENV, "SAGE_TEST_JAX_CACHE": "{work}/jax-test-cache"})
    jax_bench_env = _env({"JAX_PLATFORMS": "cpu" if smoke else "cuda",
                          "JAX_COMPILATION_CACHE_DIR": "{work}/jax-cache"})
    torch_dev = "cpu" if smoke else "cuda"
    jax_gpu = None if smoke else "jax"
    torch_gpu = None if smoke else "torch"
    pick = (lambda files: files[:1]) if smoke else (lambda files: files)
    jax_step = ("{py}", "benchmarks/jax_step.py", "--model", big, *reps, "--schedule",
                "pairwise", "--bw-mib", "64" if smoke else "1024")
    torch_step = ("{py}", "benchmarks/torch_step.py", "--model", big, "--device", torch_dev,
                  "--no-memory", "--bw-mib", "64" if smoke else "1024")
    tokens = "{work}/tokens.npy"

    def train(optimizer: str, batch_size: str, run_dir: str, *extra: str) -> tuple[str, ...]:
        return ("{py}", "-m", "sage_train", "--model", big, "--data", tokens, "--steps", steps,
                "--batch-size", batch_size, "--seq-len", batch[1], "--eval-every", steps,
                "--eval-batches", "2", "--checkpoint-every", steps, "--log-every", "10",
                "--no-progress", "--loss-chunk", "auto",
                "--attention", "xla" if smoke else "cudnn", "--run-dir", run_dir,
                "--optimizer", optimizer, *extra)

    jax_train = ("jax", "flax", "optax", "orbax.checkpoint")
    return [
        Part("env", "the machine and the software", (
            Step("versions, devices, and the project's imports",
                 ("{py}", "scripts/gpu_check.py", "env"), 30, needs=()),
        )),
        Part("a", "(a) correctness: the CUDA tests that decide the GPU paths", (
            Step("JAX on the GPU: compiled Pallas kernel, placement, grouping, cuDNN "
                 "attention, configurations, numerics at float32's limits",
                 _pytest(pick(JAX_CORRECTNESS), "jax-correctness", 1 if smoke else 6), 135,
                 kind="pytest", needs=("jax", "optax", "flax", "pytest", "xdist"),
                 gpu=jax_gpu, env=jax_env),
            Step("torch on CUDA: foreach vs single-tensor vs fused (float32, bfloat16), "
                 "CUDA graphs, device guard",
                 _pytest(pick(TORCH_CORRECTNESS), "torch-correctness", 1 if smoke else 4),
                 135, kind="pytest", needs=("torch", "triton", "pytest", "xdist"),
                 gpu=torch_gpu),
        ), concurrent=True),
        Part("b", "(b) the optimizer update at 270M and 1.3B", (
            Step(f"JAX {big} float32 per-layer: the hybrids against optax.adamw",
                 (*jax_step, "--configs", "sage-hybrid", "lion-hybrid", "sinkgd-hybrid",
                  "sinkgd-pure"), 60, needs=("jax", "optax"), gpu=jax_gpu,
                 env=jax_bench_env),
            Step(f"torch {big} float32: sage-hybrid against torch.optim.AdamW "
                 "(foreach = default, fused = opt-in)",
                 (*torch_step, *reps, "--configs", "sage-hybrid"), 40,
                 needs=("torch",), gpu=torch_gpu),
        )),
        Part("c", f"(c) the trainer at {big}, {batch[0]} x {batch[1]} tokens", (
            Step("token file (random ids of the model's vocabulary)",
                 ("{py}", "scripts/gpu_check.py", "tokens", "--model", big, "--out", tokens),
                 5, needs=("numpy",), gpu=jax_gpu),
            Step(f"sage-train {big} adamw", train("adamw", batch[0], "{work}/train"), 65,
                 kind="train", needs=jax_train, gpu=jax_gpu, env=jax_bench_env),
            Step(f"sage-train {big} sage-hybrid",
                 train("sage-hybrid", batch[0], "{work}/train"), 65,
                 kind="train", needs=jax_train, gpu=jax_gpu, env=jax_bench_env),
            Step("tokens/s, MFU and peak memory",
                 ("{py}", "scripts/gpu_check.py", "train-table", "{work}/train"), 5,
                 gpu=jax_gpu),
        )),
        Part("d", "(d) the kernel comparisons that decide the defaults", (
            Step(f"JAX {big}: SinkGD's Pallas kernel against its jnp path",
                 (*jax_step, "--configs", "sinkgd-pure", "sage-hybrid", "--compare-kernels",
                  "sinkgd-pure", "sage-hybrid"), 40, needs=("jax", "optax"), gpu=jax_gpu,
                 env=jax_bench_env),
            Step("attention: cuDNN against XLA (270M heads, 16 x 1024, bfloat16)",
                 ("{py}", "benchmarks/attention.py", "--repeats", "20",
                  *(("--batch-size", "2", "--seq-len", "64", "--repeats", "2")
                    if smoke else ())), 25, needs=("jax", "flax"), gpu=jax_gpu,
                 env=jax_bench_env),
            Step(f"torch {big} float32: every configuration, fused against foreach",
                 (*torch_step, *(("--repeats", "2") if smoke else ("--repeats", "5")),
                  *(("--configs", "sage-hybrid", "lion") if smoke else ())), 40,
                 needs=("torch",), gpu=torch_gpu),
        )),
        Part("e", "(e) the rest, while time is left", greedy=True, steps=(
            Step("XLA's buffer assignment of the updates whose temporaries exceed the CPU's "
                 "bounds (tests/optax/test_optax_grouping.py, tests/repro/test_repro_memory.py; "
                 "dumped to the logs)",
                 _pytest(MEMORY_DIAG, "memory-diag", 1), 30, kind="pytest",
                 needs=("jax", "optax", "pytest"), gpu=jax_gpu,
                 env=_env({**JAX_GPU_ENV, "XLA_FLAGS": JAX_GPU_ENV["XLA_FLAGS"]
                           + " --xla_dump_to={work}/xla-dump --xla_dump_hlo_as_text"
                           " --xla_dump_hlo_module_re=jit_(step|update_fn)"})),
            Step(f"JAX {huge} bfloat16 stacked: sage-hybrid against optax.adamw",
                 ("{py}", "benchmarks/jax_step.py", "--model", huge, "--dtype", "bfloat16",
                  "--layout", "stacked", *reps, "--schedule", "pairwise", "--bw-mib",
                  "64" if smoke else "1024", "--configs", "sage-hybrid"), 40,
                 needs=("jax", "optax"), gpu=jax_gpu, env=jax_bench_env),
            Step(f"JAX {big}: cold compile of the train step and of the update, sage-hybrid "
                 "against optax.adamw",
                 ("{py}", "benchmarks/compile_time.py", "--model", big, "--repeats", "1",
                  "--batch-size", batch[0], "--seq-len", batch[1]), 60,
                 needs=("jax", "optax", "flax"), gpu=jax_gpu, env=jax_bench_env),
            Step(f"torch {big} bfloat16: the configurations with a fused rule",
                 (*torch_step, "--dtype", "bfloat16", *reps, "--configs", "sage-hybrid",
                  "lion-hybrid", "sinkgd-hybrid"), 40, needs=("torch",), gpu=torch_gpu),
            Step(f"JAX {big} bfloat16 per-layer: sage-hybrid and lion-hybrid against "
                 "optax.adamw",
                 (*jax_step, "--dtype", "bfloat16", "--configs", "sage-hybrid",
                  "lion-hybrid"), 40, needs=("jax", "optax"), gpu=jax_gpu, env=jax_bench_env),
            Step(f"sage-train {big} sage-hybrid, batch 64 x 1024, --remat full",
                 train("sage-hybrid", "4" if smoke else "64", "{work}/train-b64", "--remat",
                       "full", "--sharding", "none"), 60, kind="train", needs=jax_train,
                 gpu=jax_gpu, env=jax_bench_env),
            Step("tokens/s, MFU and peak memory at 64 x 1024",
                 ("{py}", "scripts/gpu_check.py", "train-table", "{work}/train-b64"), 5,
                 gpu=jax_gpu),
            Step("the rest of the test suite with JAX on the GPU and torch on CUDA",
                 _pytest(pick(rest_of_suite()), "rest", 1 if smoke else 8), 240,
                 kind="pytest", needs=("jax", "torch", "pytest", "xdist"),
                 gpu=jax_gpu, env=jax_env),
        )),
    ]


# --------------------------------------------------------------------------------------------
# Running a step


def missing_modules(names: Sequence[str], py: str = sys.executable) -> list[str]:
    """The modules of ``names`` that interpreter ``py`` cannot find (nothing is imported)."""
    if not names:
        return []
    code = ("import importlib.util, json, sys\n"
            "def found(n):\n"
            "    try:\n"
            "        return importlib.util.find_spec(n) is not None\n"
            "    except (ImportError, ValueError):\n"
            "        return False\n"
            "print(json.dumps([n for n in sys.argv[1:] if not found(n)]))\n")
    try:
        proc = subprocess.run([py, "-c", code, *names], capture_output=True, text=True,
                              timeout=60)
        return list(json.loads(proc.stdout))
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError):
        return [f"{py} (the interpreter does not run)"]


def gpu_problem(framework: str | None, py: str) -> str | None:
    """Why ``framework`` sees no GPU in ``py`` (``None``: it does, or none is needed)."""
    if framework is None:
        return None
    code = {
        "jax": "import jax; assert jax.default_backend() == 'gpu', jax.default_backend()",
        "torch": "import torch; assert torch.cuda.is_available(), 'no CUDA device'",
    }[framework]
    env = {**os.environ, "JAX_PLATFORMS": ""} if framework == "jax" else None
    try:
        proc = subprocess.run([py, "-c", code], capture_output=True, text=True, timeout=120,
                              env=env)
    except subprocess.TimeoutExpired:
        return f"{framework} did not start within 120 s"
    except OSError as e:
        return f"the interpreter {py!r} does not run ({e})"
    if proc.returncode == 0:
        return None
    last = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return f"{framework} sees no GPU ({last})"


def _fill(s: str, ctx: dict[str, str]) -> str:
    for key, value in ctx.items():
        s = s.replace("{" + key + "}", value)
    return s


@dataclasses.dataclass
class Outcome:
    """What one step did: exit status, seconds, its markdown and whether it was cut."""

    part: str
    title: str
    command: str
    status: str  # "ok", "failed", "timed out", "skipped", "not reached"
    seconds: float = 0.0
    rc: int | None = None
    why: str = ""
    markdown: str = ""
    figures: dict = dataclasses.field(default_factory=dict)


class Runner:
    """Runs the plan against a deadline and keeps the report files current."""

    def __init__(self, out: Path, work: Path, budget: float, py: str, start: float,
                 header: list[str]) -> None:
        self.out, self.work, self.py = out, work, py
        self.start, self.deadline = start, start + budget - RESERVE
        self.budget = budget
        self.header = header
        self.outcomes: list[Outcome] = []
        self.ctx = {"py": py, "work": str(work), "out": str(out)}
        self._gpu_checked: dict[str, str | None] = {}
        self._found: dict[str, bool] = {}  # module -> whether the interpreter has it

    # -- files ----------------------------------------------------------------------------
    def write(self, final: bool = False) -> None:
        """Rewrite the report, its figures and the log archive (atomically, each)."""
        lines = list(self.header)
        part = None
        for o in self.outcomes:
            if o.part != part:
                part = o.part
                lines += ["", f"## {part}", ""]
            lines += [f"### {o.title}", "", f"`{o.command}`" if o.command else "", ""]
            cut = f" ({o.why})" if o.why else ""
            lines.append(f"_{o.status}{cut}; {o.seconds:.0f} s_")
            if o.markdown:
                lines += ["", o.markdown.rstrip()]
            lines.append("")
        counts = {s: sum(o.status == s for o in self.outcomes)
                  for s in ("ok", "failed", "timed out", "skipped", "not reached")}
        elapsed = time.monotonic() - self.start
        lines += ["", "## Summary", "",
                  ", ".join(f"{n} {s}" for s, n in counts.items()) +
                  f"; {elapsed:.0f} s of the {self.budget:.0f} s budget"
                  + ("" if final else " (still running)"), ""]
        lines += ["| part | step | status | seconds |", "|---|---|---|---:|"]
        lines += [f"| {o.part.split(':')[0]} | {o.title} | {o.status} | {o.seconds:.0f} |"
                  for o in self.outcomes]
        _atomic_write(self.out / "gpu-check.md", "\n".join(lines) + "\n")
        doc = {"budget_s": self.budget, "elapsed_s": round(elapsed, 1), "final": final,
               "counts": counts, "steps": [dataclasses.asdict(o) for o in self.outcomes]}
        _atomic_write(self.out / "gpu-check.json", json.dumps(doc, indent=1) + "\n")
        tmp = self.out / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for p in sorted(self.work.glob("*.log")) + sorted(self.work.glob("*.xml")):
                tar.add(p, arcname=p.name)
            for p in sorted(self.work.glob("train*/**/metrics.jsonl")):
                tar.add(p, arcname=str(p.relative_to(self.work)))
            for p in sorted(self.work.glob("train*/**/config.json")):
                tar.add(p, arcname=str(p.relative_to(self.work)))
            for p in sorted(self.work.glob("xla-dump/*")):  # memory-diag: the assignments
                if p.name.endswith(("buffer-assignment.txt", "memory-usage-report.txt")) \
                        and p.stat().st_size < 4 * 2**20:
                    tar.add(p, arcname=str(p.relative_to(self.work)))
        os.replace(tmp, self.out / "logs.tar.gz")

    # -- steps ----------------------------------------------------------------------------
    def _skip_reason(self, step: Step) -> str | None:
        if unknown := [n for n in step.needs if n not in self._found]:
            missing = set(missing_modules(unknown, self.py))
            if broken := [m for m in missing if m.endswith("does not run)")]:
                return broken[0]
            self._found.update({n: n not in missing for n in unknown})
        if miss := [n for n in step.needs if not self._found[n]]:
            return f"not installed: {', '.join(miss)}"
        if step.gpu is not None:
            if step.gpu not in self._gpu_checked:
                self._gpu_checked[step.gpu] = gpu_problem(step.gpu, self.py)
            return self._gpu_checked[step.gpu]
        return None

    def _launch(self, step: Step, log: Path) -> subprocess.Popen:
        argv = [_fill(a, self.ctx) for a in step.argv]
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": str(ROOT) + (os.pathsep + os.environ["PYTHONPATH"]
                                          if os.environ.get("PYTHONPATH") else "")}
        env.update({k: _fill(v, self.ctx) for k, v in step.env})
        with open(log, "w") as f:
            f.write(f"$ {shlex.join(argv)}\n")
        return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "a"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def run_part(self, part: Part, deadline: float) -> None:
        """Run ``part``'s steps (together or in turn) within ``deadline``."""
        label = f"{part.key}: {part.title}"
        if part.concurrent:
            self._run_together(label, part.steps, deadline, first=True)
            return
        for i, step in enumerate(part.steps):
            rest = sum(s.share for s in part.steps[i:])
            now = time.monotonic()
            left = min(deadline, self.deadline) - now
            limit = (min(step.share, left) if part.greedy
                     else left * step.share / rest if rest else 0)
            self._run_together(label, (step,), now + limit, first=i == 0)

    def _start_all(self, label: str, steps: Sequence[Step], deadline: float, first: bool
                   ) -> list[tuple[Step, Outcome, subprocess.Popen, Path, float]]:
        """Start each of ``steps`` that runs here and fits before ``deadline`` (an outcome each).

        Returns the started ones: ``(step, outcome, process, log, start time)``.
        """
        running: list[tuple[Step, Outcome, subprocess.Popen, Path, float]] = []
        for step in steps:
            command = shlex.join([_fill(a, self.ctx) for a in step.argv])
            o = Outcome(label, step.title, command, "skipped")
            self.outcomes.append(o)
            if (why := self._skip_reason(step)) is not None:
                o.why = why
                continue
            if deadline - time.monotonic() < (1 if first else min(MIN_STEP, step.share / 2)):
                o.status, o.why = "not reached", "the budget is spent"
                continue
            log = self.work / f"{len(self.outcomes):02d}-{_slug(step.title)}.log"
            running.append((step, o, self._launch(step, log), log, time.monotonic()))
            o.status = "running"
        return running

    def _run_together(self, label: str, steps: Sequence[Step], deadline: float,
                      first: bool = False) -> None:
        """Run ``steps`` together until ``deadline``.

        ``first``: the part's first step(s), always started while the whole budget lasts:
        with at least :data:`MIN_STEP` seconds (or what is left of the budget), even where
        the time before (the script's own start-up, an earlier part) used up the part's
        share.
        """
        if first:
            deadline = max(deadline, time.monotonic() + MIN_STEP)
        deadline = min(deadline, self.deadline)
        running = self._start_all(label, steps, deadline, first)
        self.write()
        finished: dict[int, tuple[int, float]] = {}  # index in running -> (rc, end)
        while len(finished) < len(running) and time.monotonic() < deadline:
            for i, (_, _, proc, _, _) in enumerate(running):
                if i not in finished and (rc := proc.poll()) is not None:
                    finished[i] = (rc, time.monotonic())
            time.sleep(0.2)
        for i, (step, o, proc, log, t0) in enumerate(running):
            cut = i not in finished
            rc, end = finished[i] if not cut else (_stop(proc), time.monotonic())
            _kill_group(proc)
            o.seconds, o.rc = end - t0, rc
            o.status = "timed out" if cut else ("ok" if rc == 0 else "failed")
            if cut:
                o.why = f"stopped after {o.seconds:.0f} s, its share of the budget"
            elif rc != 0:
                o.why = f"exit {rc}"
            o.markdown, o.figures = render(step, log, self.work)
            self.write()


def _stop(proc: subprocess.Popen) -> int:
    """Interrupt ``proc``'s process group (SIGINT: pytest prints its summary), then end it."""
    for sig, grace in ((signal.SIGINT, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            rc = proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue
        _kill_group(proc)
        return rc
    return -9


def _kill_group(proc: subprocess.Popen) -> None:
    """End what ``proc`` left running in its process group (xdist workers, say).

    So that no process of one step holds the GPU during the next.
    """
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


SOURCE_DIRS = ("sage_optim", "sage_optax", "sage_torch", "sage_train", "sage_repro", "scripts",
               "benchmarks", "tests")


def source_fingerprint(root: Path = ROOT) -> str:
    """SHA-256 of the project's code (``SOURCE_DIRS``' ``.py`` files and scripts), by content.

    A copy of the working tree carries no trustworthy history (a device machine gets the
    files, not the commits), so the report names the code by this, which
    ``scripts/gpu_check.py fingerprint`` computes in any checkout to compare.
    """
    h = hashlib.sha256()
    for d in SOURCE_DIRS:
        for p in sorted((root / d).rglob("*")):
            if p.is_file() and (p.suffix == ".py" or p.parent.name == "scripts") \
                    and "__pycache__" not in p.parts:
                h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _slug(title: str) -> str:
    keep = "".join(c if c.isalnum() else "-" for c in title.lower())
    return "-".join(filter(None, keep.split("-")))[:40]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------
# Markdown of a step's output


def render(step: Step, log: Path, work: Path) -> tuple[str, dict]:
    """The step's markdown and figures from its log (and JUnit file, for pytest)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    lines = text.splitlines()[1:]  # the first line is the command
    if step.kind == "pytest":
        return render_pytest(step, lines, work)
    if step.kind == "train":
        tail = [ln for ln in lines if "error" in ln.lower() or "Traceback" in ln][-5:]
        return (_blocks(tail or lines[-8:]), {})
    return _blocks(lines[-120:]), {}


def render_pytest(step: Step, lines: list[str], work: Path) -> tuple[str, dict]:
    """Counts and failures of a pytest step from its JUnit file (else its summary lines)."""
    xml = next((a.split("=", 1)[1] for a in step.argv if a.startswith("--junitxml=")), None)
    path = Path(xml.replace("{work}", str(work))) if xml else None
    figures: dict = {}
    failures: list[str] = []
    if path is not None and path.exists():
        try:
            root = ET.parse(path).getroot()
            suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
            for key in ("tests", "failures", "errors", "skipped"):
                figures[key] = sum(int(s.get(key, 0)) for s in suites)
            figures["passed"] = (figures["tests"] - figures["failures"] - figures["errors"]
                                 - figures["skipped"])
            for case in root.iter("testcase"):
                for bad in list(case.findall("failure")) + list(case.findall("error")):
                    msg = (bad.get("message") or "").splitlines()[0][:300] if bad.get(
                        "message") else ""
                    failures.append(f"{case.get('classname')}::{case.get('name')}: {msg}")
        except ET.ParseError:
            pass
    summary = [ln for ln in lines if ln.startswith(("FAILED", "ERROR"))
               or (" passed" in ln or " failed" in ln or " error" in ln) and ln.startswith("=")
               or "KeyboardInterrupt" in ln]
    md = []
    if figures:
        md.append(f"{figures['passed']} passed, {figures['failures']} failed, "
                  f"{figures['errors']} errors, {figures['skipped']} skipped")
    if failures:
        md += ["", *(f"- {f}" for f in failures[:60])]
    md += ["", _blocks(summary[-20:] or lines[-15:])]
    return "\n".join(md), figures


def _blocks(lines: Sequence[str]) -> str:
    """Markdown tables as they are; every other run of lines in a ``text`` block."""
    out: list[str] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.extend(["```text", *text, "```"])
            text.clear()

    for ln in lines:
        if ln.startswith("|"):
            if not out or not out[-1].startswith("|"):
                flush()
                out.append("")
            out.append(ln)
        else:
            if out and out[-1].startswith("|") and not text:
                out.append("")
            if ln.strip() or text:
                text.append(ln)
    flush()
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# Helper commands of the plan (``scripts/gpu_check.py env|tokens|train-table``)


def cmd_env() -> int:
    """Versions, devices and whether the project's packages import (markdown on stdout)."""
    print(f"- python {sys.version.split()[0]} ({sys.executable})")
    versions = []
    for name in ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "flax", "optax",
                 "orbax-checkpoint", "torch", "triton", "transformers", "numpy", "pytest",
                 "pytest-xdist", "hypothesis", "equinox", "tokenizers"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions.append(f"{name} {importlib.metadata.version(name)}")
    print(f"- packages: {', '.join(versions)}")
    with contextlib.suppress(Exception):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "clocks.max.sm", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        print(f"- nvidia-smi: {smi or 'no output'}")
    rc = 0
    try:
        import jax

        print(f"- jax devices: {jax.devices()} (default backend {jax.default_backend()})")
    except Exception as e:  # noqa: BLE001
        print(f"- jax devices: failed ({type(e).__name__}: {e})")
    try:
        import torch

        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            print(f"- torch CUDA {torch.version.cuda}: {p.name}, {p.total_memory / 2**30:.1f} "
                  f"GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
        else:
            print("- torch: no CUDA device")
    except Exception as e:  # noqa: BLE001
        print(f"- torch CUDA: failed ({type(e).__name__}: {e})")
    for name in ("sage_optim", "sage_optax", "sage_torch", "sage_train", "sage_train.model.llama",
                 "sage_repro"):
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001
            print(f"- import {name}: FAILED ({type(e).__name__}: {e})")
            rc = 1
    if rc == 0:
        print("- the project's packages import")
    return rc


def cmd_tokens(model: str, out: str) -> int:
    """Write random token ids of ``model``'s vocabulary to ``out`` (a ``.npy``).

    The trainer's speed does not depend on the text, and random ids need no tokenizer
    training on the GPU host.
    """
    import numpy as np

    from sage_train.model.shapes import get_model_config

    vocab = get_model_config(model).vocab_size
    ids = np.random.default_rng(0).integers(0, vocab, 6_000_000, dtype=np.uint32)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    np.save(out, ids)
    print(f"{len(ids):,} random token ids < {vocab:,} ({model}'s vocabulary) in {out}")
    return 0


def cmd_train_table(run_root: str) -> int:
    """The trainer runs under ``run_root`` as a markdown table (from their metrics.jsonl)."""
    rows, tps = [], {}
    for metrics in sorted(Path(run_root).glob("**/metrics.jsonl")):
        cfg_path = metrics.parent / "config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
        timed = [r for r in records if "tokens_per_s" in r]
        if not timed:
            continue
        r = timed[-1]
        opt = cfg.get("optimizer", metrics.parent.name)
        tps[opt] = r["tokens_per_s"]
        settings = " | ".join(str(cfg.get(k, "-")) for k in
                              ("dtype", "layers", "remat", "loss_chunk", "attention",
                               "sinkgd_kernel"))
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
        peak = (f"{r['peak_memory_bytes'] / 2**30:.2f}"
                if r.get("peak_memory_bytes") is not None else "-")
        rows.append(f"| {opt} | {cfg.get('batch_size', '?')}x{cfg.get('seq_len', '?')} | "
                    f"{settings} | {r.get('step')} | {r.get('loss', float('nan')):.3f} | "
                    f"{r['tokens_per_s']:,.0f} | {mfu} | {peak} |")
    if not rows:
        print(f"no run with timed steps under {run_root}")
        return 1
    print("tokens/s and MFU over the timed steps (compilation, evaluation and checkpoints "
          "excluded); peak memory: the allocator's high-water mark of the run's process\n")
    print("| optimizer | batch | dtype | layers | remat | loss chunk | attention | sinkgd kernel "
          "| steps | last loss | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---|---|---|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    if "adamw" in tps and "sage-hybrid" in tps:
        print(f"\nSAGE-Hybrid / AdamW tokens/s: {tps['sage-hybrid'] / tps['adamw']:.3f} "
              "(target >= 0.98)")
    return 0


# --------------------------------------------------------------------------------------------
# The command


def part_seconds(parts: Sequence[Part], budget: float) -> list[float]:
    """Seconds of each part: its share (seconds of the default budget) scaled to ``budget``.

    The last part has the rest.  Time a part leaves unused passes to the parts after it.
    """
    scale = (budget - RESERVE) / (DEFAULT_BUDGET - RESERVE)
    secs = [p.share * scale for p in parts[:-1]]
    return [*secs, max(0.0, budget - RESERVE - sum(secs))]


def dry_run(parts: list[Part], budget: float, only: set[str] | None, py: str) -> int:
    """Print the plan: each step's share of the budget, its command, what it lacks here."""
    selected = [p for p in parts if only is None or p.key in only]
    missing = set(missing_modules(sorted({n for p in selected for s in p.steps for n in s.needs}),
                                  py))
    if broken := [m for m in missing if m.endswith("does not run)")]:
        print(f"the steps' interpreter: {broken[0]}")
        return 1
    print(f"gpu-check plan: budget {budget:.0f} s ({RESERVE} s kept for the report), parts "
          "in order of value; a part's unused time passes to the next, the last has the rest\n")
    print("| part | seconds | step | step share | runs | missing here |")
    print("|---|---:|---|---:|---|---|")
    for part, secs in zip(selected, part_seconds(selected, budget), strict=True):
        for i, s in enumerate(part.steps):
            miss = ", ".join(m for m in missing if m in s.needs) or "-"
            how = "together" if part.concurrent else "in turn"
            share = (secs if part.concurrent else min(s.share, secs) if part.greedy
                     else secs * s.share / part.share)
            print(f"| {part.key if i == 0 else ''} | {f'{secs:.0f}' if i == 0 else ''} "
                  f"| {s.title} | {share:.0f} | {how}{', GPU: ' + s.gpu if s.gpu else ''} "
                  f"| {miss} |")
    print()
    bad = []
    for part in parts:
        for s in part.steps:
            for a in s.argv:
                path = a.split("::")[0]  # a test's node id names its file
                if path.startswith(("tests/", "benchmarks/", "scripts/")) \
                        and not (ROOT / path).exists():
                    bad.append(path)
            print(f"- {part.key}: `{shlex.join(s.argv)}`")
    if bad:
        print(f"\nmissing files: {', '.join(sorted(set(bad)))}")
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check (see the module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "fingerprint":
        print(source_fingerprint())
        return 0
    if argv and argv[0] in ("env", "tokens", "train-table"):
        sub = argparse.ArgumentParser(prog=f"gpu_check.py {argv[0]}")
        if argv[0] == "tokens":
            sub.add_argument("--model", required=True)
            sub.add_argument("--out", required=True)
            a = sub.parse_args(argv[1:])
            return cmd_tokens(a.model, a.out)
        if argv[0] == "train-table":
            sub.add_argument("run_root")
            return cmd_train_table(sub.parse_args(argv[1:]).run_root)
        sub.parse_args(argv[1:])
        return cmd_env()
    ap = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT") or "gpu-check-out",
                    help="output folder (default: $OUT, else ./gpu-check-out)")
    ap.add_argument("--budget", type=float,
                    default=float(os.environ.get("GPU_CHECK_BUDGET", DEFAULT_BUDGET)),
                    help=f"seconds for the whole check (default {DEFAULT_BUDGET}, or "
                    "$GPU_CHECK_BUDGET)")
    ap.add_argument("--only", nargs="+", metavar="PART",
                    help="run only these parts (env, a, b, c, d, e)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny sizes, no GPU needed: checks the plumbing on a CPU")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the steps")
    args = ap.parse_args(argv)
    start = time.monotonic()
    parts = plan(smoke=args.smoke)
    keys = [p.key for p in parts]
    if args.only and (unknown := set(args.only) - set(keys)):
        ap.error(f"--only: unknown part(s) {sorted(unknown)}; the parts are {keys}")
    if args.budget < 60:
        ap.error(f"--budget must be at least 60 seconds, got {args.budget:g}")
    only = set(args.only) if args.only else None
    if args.dry_run:
        return dry_run(parts, args.budget, only, args.python)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "?"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    header = [
        "# GPU check", "",
        f"- date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC; commit {commit}"
        + (" with uncommitted changes" if dirty else ""),
        f"- code: source fingerprint {source_fingerprint()} (`scripts/gpu_check.py fingerprint` "
        "in a checkout gives its own)",
        f"- command: `scripts/gpu-check {shlex.join(argv)}`",
        f"- budget: {args.budget:.0f} s" + (" (smoke: tiny sizes on any device)" if args.smoke
                                            else ""),
    ]
    runner = Runner(out, work, args.budget, args.python, start, header)
    selected = [p for p in parts if only is None or p.key in only]
    end = start
    for part, share in zip(selected, part_seconds(selected, args.budget), strict=True):
        end += share
        runner.run_part(part, max(end, time.monotonic()))
    runner.write(final=True)
    print((out / "gpu-check.md").read_text())
    bad = [o for o in runner.outcomes if o.status in ("failed", "timed out")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
