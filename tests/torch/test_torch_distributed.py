"""sage_torch under distributed training: FSDP2 (DTensor parameters) and DDP, gloo, 2 ranks.

One job (tests/torch_dist_worker.py, run in a subprocess with a timeout) spawns two CPU
ranks joined by a gloo process group on 127.0.0.1 (OS-assigned port) and trains a small
language model (embedding (V=45, d=16), two nn.Linear (16->33->16), a LayerNorm, untied or
tied head) for 10 steps with ``sage_torch.make_optimizer``:

* FSDP2 (``fully_shard``) shards every parameter on dim 0, which is the vocab (fan-out) dim
  of the embedding and the head, so SAGE's mean over the vocab, its RMS over the whole
  ``S``, SinkGD's fan-out norms, the unit-norm of vectors and APOLLO's projection and norms
  must all reduce across the ranks.  The odd sizes make the shards uneven (23 + 22 rows).
  The final parameters (``full_tensor()``) must equal a single-process run on the
  concatenated batches: float64 to 1e-10, float32 to 1e-5.
* Negative controls: the same rules applied to each rank's local shard as plain tensors
  (no cross-rank reductions) must NOT match, which shows the comparison can fail.
* DDP needs nothing special: every rank steps the same averaged gradient, so the replicas
  stay bit-identical and equal the single-process run.

The job runs once per session (xdist workers share it through a lock file) and takes
about 15 s of wall time on 2 idle CPUs (up to ~60 s on a heavily loaded machine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

WORKER = Path(__file__).resolve().parents[1] / "torch_dist_worker.py"
JOB_TIMEOUT = 300  # seconds; the ranks' own collectives time out after 60 s
TOL = {"float64": 1e-10, "float32": 1e-5}
MIN_MOVED = 1e-4  # every parameter moves at least this much: the comparison is not vacuous
NAIVE_MIN_DIFF = 1e-3


def _unavailable() -> str | None:
    import torch.distributed as dist

    if not dist.is_available():
        return "torch.distributed is not available in this torch build"
    if not dist.is_gloo_available():
        return "the gloo backend of torch.distributed is not available"
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import DTensor  # noqa: F401
    except ImportError as e:
        return f"FSDP2 (torch.distributed.fsdp.fully_shard) is not available: {e}"
    return None


def _run_job(out_dir: Path) -> dict:
    """Run the worker once; a failure (or timeout) is recorded and reported by every test."""
    report, failure = out_dir / "report.json", out_dir / "failure.txt"
    if report.exists() or failure.exists():
        return _load(report, failure)
    env = {k: v for k, v in os.environ.items() if k != "SAGE_DIST_T0"}
    env.setdefault("OMP_NUM_THREADS", "1")
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(report)], cwd=WORKER.parent.parent, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its own process group: a timeout kills the ranks too
    )
    try:
        output, _ = proc.communicate(timeout=JOB_TIMEOUT)
        status = f"failed (exit {proc.returncode})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        status = f"timed out after {JOB_TIMEOUT} s"
    (out_dir / "job.log").write_text(output)
    if proc.returncode != 0 or not report.exists():
        failure.write_text(f"distributed job {status}:\n{output}")
    return _load(report, failure)


def _load(report: Path, failure: Path) -> dict:
    if failure.exists():
        pytest.fail(failure.read_text()[-8000:], pytrace=False)
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    reason = _unavailable()
    if reason:
        print(f"skipping distributed tests: {reason}")
        pytest.skip(reason)
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # shared by the xdist workers of this session
    out_dir = base / "torch_distributed"
    out_dir.mkdir(exist_ok=True)
    try:
        import fcntl
    except ImportError:  # no POSIX locks: each worker runs its own job
        return _run_job(out_dir)
    with open(out_dir / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return _run_job(out_dir)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _table(cases: dict) -> str:
    rows = [f"{'case':58s} {'max |Δθ|':>10s} {'min moved':>10s}"]
    for name, c in cases.items():
        rows.append(f"{name:58s} {c['max_diff']:10.3e} {min(c['moved'].values()):10.3e}")
    return "\n".join(rows)


def _check_matches(cases: dict) -> None:
    assert cases, "no cases ran"
    print("\n" + _table(cases))
    bad = []
    for name, c in cases.items():
        tol = TOL[c["dtype"]]
        if not c["max_diff"] <= tol:
            worst = max(c["diffs"], key=c["diffs"].get)
            bad.append(f"{name}: max |Δθ| = {c['max_diff']:.3e} > {tol:g} (worst: {worst})")
        lazy = [n for n, m in c["moved"].items() if not m >= MIN_MOVED]
        if lazy:
            bad.append(f"{name}: parameters barely moved, comparison vacuous: {lazy}")
    assert not bad, "\n".join(bad) + "\n" + _table(cases)


def test_fsdp2_sharded_run_equals_single_process(job):
    """FSDP2 on gloo, 2 ranks: sage-hybrid/-pure, lion-hybrid, sinkgd-pure, apollo."""
    cases = {n: c for n, c in job["cases"].items() if c["wrap"] == "fsdp" and not c["naive"]}
    configs = {c["config"] for c in cases.values()}
    assert configs == {"sage-hybrid", "sage-pure", "lion-hybrid", "sinkgd-pure", "apollo"}
    assert {(c["dtype"], c["foreach"]) for c in cases.values()} >= {
        ("float64", False), ("float64", True), ("float32", True), ("float32", False)}
    assert any(c["tied"] for c in cases.values())
    _check_matches(cases)


def test_fsdp2_per_shard_reductions_would_be_caught(job):
    """Negative control: SAGE / SinkGD on local shards alone (no all-reduce) differ."""
    cases = {n: c for n, c in job["cases"].items() if c["naive"]}
    assert {c["config"] for c in cases.values()} == {"sage-hybrid", "sinkgd-pure"}
    print("\n" + _table(cases))
    for name, c in cases.items():
        assert c["max_diff"] > NAIVE_MIN_DIFF, f"{name}: {c['max_diff']:.3e}"
        # the vocab matrices are where the per-shard statistics go wrong
        assert c["diffs"]["embed.weight"] > NAIVE_MIN_DIFF, name


def test_ddp_equals_single_process(job):
    """DDP on gloo, 2 ranks, sage-hybrid: nothing special; replicas stay bit-identical."""
    cases = {n: c for n, c in job["cases"].items() if c["wrap"] == "ddp"}
    assert {c["config"] for c in cases.values()} == {"sage-hybrid"}
    _check_matches(cases)
    for name, c in cases.items():
        assert c["replica_diff"] == 0.0, f"{name}: replicas differ by {c['replica_diff']:.3e}"
