"""``sage-train`` as a job of several processes, on this machine's CPU.

Two local processes of 4 CPU devices each (``--xla_force_host_platform_device_count``,
gloo collectives, a coordinator on 127.0.0.1) form one 8-device mesh; their ``sage-hybrid``
runs (``--sharding dp`` and ``fsdp``, 20 steps of the tiny model) must give the losses of
one process with 8 devices, to 1e-6 in float32; a checkpoint written by 2 processes resumes
on 1 and one written by 1 resumes on 2 (with FSDP state onto a mesh of another size), with
the losses of the uninterrupted run.  The runs are shared by the assertions (a module
fixture).  A process killed in the middle of a job stops the other within a minute with a
message (a heartbeat timeout of 10 s), and the run resumes afterwards (then stops together
on a SIGTERM to one process, JAX's preemption sync).  Every process is a real ``python -m
sage_train``, with the test session's persistent compilation cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import jax
import numpy as np
import pytest

pytest.importorskip("orbax.checkpoint")

from sage_train.data import pipeline as data_lib  # noqa: E402
from sage_train.job import distributed  # noqa: E402
from sage_train.job.errors import ConfigError  # noqa: E402
from sage_train.job.signals import PREEMPTED  # noqa: E402
from sage_train.store import rundir  # noqa: E402
from sage_train.store.checkpoints import MANIFEST, Checkpoints  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 20
RUN = "tiny-sage-hybrid"
TIMEOUT = 300  # seconds a job may take before the test gives up on it (never reached)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def environment(devices: int, cache_dir: pathlib.Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "PMI_", "JAX_"))}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               JAX_PLATFORMS="cpu", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
               SAGE_CACHE_DIR=str(cache_dir), PYTHONUNBUFFERED="1")
    # the test session's persistent compilation cache (conftest.py): a job that repeats
    # another's programs (a resumed run, the same layout again) loads them instead of
    # compiling them again, about 15 s of each job's 25 s on 2 loaded cores
    cache = jax.config.jax_compilation_cache_dir
    if cache:
        env.update(JAX_COMPILATION_CACHE_DIR=str(cache),
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=str(
                       jax.config.jax_persistent_cache_min_compile_time_secs))
    return env


def command(corpus: Any, runs: pathlib.Path, sharding: str, steps: int = STEPS,
            checkpoint_every: int = 10) -> list[str]:
    return [sys.executable, "-m", "sage_train", "--model", "tiny", "--optimizer", "sage-hybrid",
            "--steps", str(steps), "--batch-size", "8", "--seq-len", "32",
            "--eval-every", "10", "--eval-batches", "1", "--log-every", "1",
            "--checkpoint-every", str(checkpoint_every), "--record-h-every", "5",
            "--no-progress", "--sharding", sharding, "--data", str(corpus),
            "--run-dir", str(runs)]


class Job:
    """The processes of one ``sage-train`` job (1 process: no launch flags at all)."""

    def __init__(self, argv: list[str], processes: int, devices: int,
                 cache_dir: pathlib.Path, logs: pathlib.Path) -> None:
        port = free_port()
        self.coordinator = f"127.0.0.1:{port}"
        env = environment(devices, cache_dir)
        logs.mkdir(parents=True, exist_ok=True)
        self.logs = [logs / f"process-{i}.log" for i in range(processes)]
        self.procs = []
        for i in range(processes):
            launch = ([] if processes == 1 else
                      ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes),
                       "--process-id", str(i)])
            with open(self.logs[i], "w") as log:
                self.procs.append(subprocess.Popen(argv + launch, cwd=ROOT, env=env,
                                                   stdout=log, stderr=subprocess.STDOUT))

    def wait(self, timeout: float = TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        try:
            return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in self.procs]
        finally:
            self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def output(self, i: int) -> str:
        """What process ``i`` printed, without gloo's connection lines."""
        return "\n".join(line for line in self.logs[i].read_text().splitlines()
                         if not line.startswith("[Gloo]") or "sage-train" in line)


def run_job(corpus: Any, root: pathlib.Path, name: str, processes: int, devices: int,
            sharding: str, cache_dir: pathlib.Path, runs: pathlib.Path | None = None
            ) -> dict[str, Any]:
    runs = runs if runs is not None else root / name
    job = Job(command(corpus, runs, sharding), processes, devices, cache_dir,
              root / f"{name}-logs")
    codes = job.wait()
    outputs = [job.output(i) for i in range(processes)]
    assert codes == [0] * processes, (name, codes, outputs[0][-3000:])
    return {"runs": str(runs), "run": str(runs / RUN), "outputs": outputs,
            "rows": list(rundir.iter_metrics(runs / RUN)), "coordinator": job.coordinator}


def losses(rows: list[dict[str, Any]], key: str = "loss") -> dict[int, float]:
    return {int(r["step"]): float(r[key]) for r in rows if key in r}


def resume_copy(src: pathlib.Path, dst: pathlib.Path, step: int,
                damaged: int | None = None) -> pathlib.Path:
    """A copy of the run directory ``src`` with its checkpoint of ``step`` only.

    ``damaged``: keep that checkpoint too, one byte of its largest file flipped.
    """
    shutil.copytree(src, dst / RUN)
    for s in Checkpoints(dst / RUN / "checkpoints").steps():
        if s not in (step, damaged):
            shutil.rmtree(dst / RUN / "checkpoints" / str(s))
    if damaged is not None:
        files = [p for p in (dst / RUN / "checkpoints" / str(damaged)).rglob("*") if p.is_file()]
        big = max(files, key=lambda p: p.stat().st_size)
        data = bytearray(big.read_bytes())
        data[len(data) // 2] ^= 0xFF
        big.write_bytes(bytes(data))
    return dst


def run_jobs(corpus: Any, root: pathlib.Path, cache: pathlib.Path) -> dict[str, Any]:
    """The runs: 2 x 4 and 1 x 8 devices (dp, fsdp), then two resumed across process counts."""
    out = {}
    for sharding in ("dp", "fsdp"):
        out[f"2x4-{sharding}"] = run_job(corpus, root, f"2x4-{sharding}", 2, 4, sharding, cache)
        out[f"1x8-{sharding}"] = run_job(corpus, root, f"1x8-{sharding}", 1, 8, sharding, cache)
    # 2 processes -> 1 (same mesh), then 1 process -> 2 on a mesh of 4 devices (FSDP state
    # resharded onto another mesh size)
    out["2to1"] = run_job(corpus, root, "2to1", 1, 8, "fsdp", cache, resume_copy(
        pathlib.Path(out["2x4-fsdp"]["run"]), root / "2to1", 10))
    # (its checkpoint of step 20 damaged: the two processes verify it together and both
    # fall back to step 10)
    out["1to2"] = run_job(corpus, root, "1to2", 2, 2, "fsdp", cache, resume_copy(
        pathlib.Path(out["1x8-fsdp"]["run"]), root / "1to2", 10, damaged=20))
    return out


def relative(got: float, want: float) -> float:
    """``|got - want| / |want|``: the losses' 1e-6 is relative, as float32 is.

    At a loss of about 6 one float32 ulp is 4.8e-7, so an absolute 1e-6 would allow two ulps
    and fail on a CPU whose XLA code orders a sum differently; 1e-6 relative is about 12
    ulps, while feeding every process the same rows moves the loss by 0.31.
    """
    return abs(got - want) / abs(want)


@pytest.fixture(scope="module")
def jobs(train_corpus, tmp_path_factory, worker_id):
    """:func:`run_jobs`, once per test session (the xdist workers share them: the jobs use
    both cores, and two sets at once would only slow each other)."""
    cache = tmp_path_factory.getbasetemp() / "token-cache"
    if worker_id == "master":
        return run_jobs(train_corpus, tmp_path_factory.mktemp("multiprocess"), cache)
    shared = tmp_path_factory.getbasetemp().parent / "sage-multiprocess"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "jobs.json"
        if not done.exists():
            done.write_text(json.dumps(run_jobs(train_corpus, shared, cache)))
        return json.loads(done.read_text())


@pytest.mark.parametrize("sharding", ["dp", "fsdp"])
def test_two_processes_train_as_one_with_eight_devices(jobs, sharding):
    two, one = jobs[f"2x4-{sharding}"], jobs[f"1x8-{sharding}"]
    a, b = losses(two["rows"]), losses(one["rows"])
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    worst = max(relative(a[s], b[s]) for s in a)
    ga, gb = losses(two["rows"], "grad_norm"), losses(one["rows"], "grad_norm")
    assert worst <= 1e-6, (worst, {  # which step drifted first, and whether the gradient did
        s: (f"loss {relative(a[s], b[s]):.1e}", f"grad_norm {relative(ga[s], gb[s]):.1e}")
        for s in sorted(a) if s in ga and s in gb})
    ta, tb = losses(two["rows"], "test_loss"), losses(one["rows"], "test_loss")
    assert sorted(ta) == [10, 20] and max(relative(ta[s], tb[s]) for s in ta) <= 1e-6
    # one writer: process 0 logs the run and writes its files, each row once
    head, other = two["outputs"]
    assert "joined the job as process 0 of 2 (2 processes of 4 devices)" in head
    assert "devices:         8 cpu (sharding " + sharding + "; 2 processes of 4 devices)" in head
    assert "step 20/20" in head and "loss curve:" in head
    said = [f"sage-train: joining the job as process 1 of 2, coordinator {two['coordinator']} "
            "(waiting up to 300 s for every process)",
            "sage-train: joined the job as process 1 of 2 (2 processes of 4 devices); process 0 "
            "writes the run's files and log, this one only its errors; a process that dies "
            "stops the others within 30 s (--heartbeat-timeout)"]
    # (gloo's own lines, written in pieces to the same file, may break into ours)
    assert all(line in other for line in said) and other.count("sage-train") == 2, other
    runs, run = pathlib.Path(two["runs"]), pathlib.Path(two["run"])
    assert (runs / "tiny-loss.png").is_file()
    assert len(np.load(run / "damper_h.npz")["steps"]) == STEPS // 5
    history = (run / rundir.HISTORY).read_text().splitlines()
    assert len(history) == 1
    manifest = json.loads((run / "checkpoints" / "20" / MANIFEST).read_text())
    assert (manifest["processes"], manifest["devices"]) == (2, 8)
    assert any("ocdbt.process_1" in f for f in manifest["files"])  # both processes wrote


@pytest.mark.parametrize("sharding", ["dp", "fsdp"])
def test_the_optimizer_state_across_processes_matches_one_process(jobs, sharding):
    """The final parameters and sage_optax state of 2 x 4 devices are those of 1 x 8.

    SAGE's mean over the vocabulary, SinkGD's norms and the gradient's global norm reduce
    across the two processes (under FSDP over shards that live on both).
    """
    from sage_train.model.shapes import get_model_config
    from sage_train.model.sharding import make_mesh
    from sage_train.run.resume import abstract_state as _abstract_state
    from sage_train.run.train import TrainConfig

    cfg = TrainConfig(model="tiny", optimizer="sage-hybrid", steps=STEPS, sharding=sharding)
    like = _abstract_state(cfg, get_model_config("tiny").vocab_size, make_mesh(sharding))
    two, one = (Checkpoints(pathlib.Path(jobs[f"{n}-{sharding}"]["run"]) / "checkpoints"
                            ).read(like, STEPS) for n in ("2x4", "1x8"))
    assert two.verified and one.verified
    pairs = list(zip(jax.tree_util.tree_flatten_with_path(two.state)[0],
                     jax.tree.leaves(one.state), strict=True))
    opt = [path for (path, _), _ in pairs if jax.tree_util.keystr(path).startswith("[1]")]
    assert any("embedding" in jax.tree_util.keystr(p) for p in opt)  # SAGE's state is there
    for (path, a), b in pairs:
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6,
                                   err_msg=jax.tree_util.keystr(path))


def test_a_checkpoint_moves_between_process_counts(jobs):
    for name, ref, said in (
            ("2to1", "2x4-fsdp", "written by 2 processes with 8 devices: restored onto 1 "
                                 "process with 8 devices"),
            ("1to2", "1x8-fsdp", "written by 1 process with 8 devices: restored onto 2 "
                                 "processes with 4 devices")):
        resumed, full = losses(jobs[name]["rows"]), losses(jobs[ref]["rows"])
        head = jobs[name]["outputs"][0]
        assert said in head and "at step 10" in head, head[-2000:]
        assert sorted(resumed) == list(range(1, STEPS + 1))
        worst = max(relative(resumed[s], full[s]) for s in range(11, STEPS + 1))
        assert worst <= 1e-6, (name, worst)
        assert "unverified" not in head
    # the 2-process job found the damaged checkpoint of step 20 (each process hashing its
    # share of the files), set it aside and resumed from step 10
    head, other = jobs["1to2"]["outputs"]
    assert "checkpoint of step 20 is unusable (file " in head, head[-3000:]
    assert "does not match its SHA-256 checksum); moved to " in head
    assert "falling back to the previous one" in head and "sage-train: error" not in other
    run = pathlib.Path(jobs["1to2"]["run"])
    assert (run / "checkpoints" / "20.unusable").is_dir()
    # and wrote its own checkpoint of step 20, as 2 processes of 2 devices
    manifest = json.loads((run / "checkpoints" / "20" / MANIFEST).read_text())
    assert (manifest["processes"], manifest["devices"]) == (2, 4)


# ---------------------------------------------------------------------------
# a dead process
# ---------------------------------------------------------------------------


def wait_for_row(run: pathlib.Path, step: int, job: Job, since_ns: int,
                 timeout: float = TIMEOUT) -> int:
    """The newest step of ``metrics.jsonl`` once it reaches ``step`` (rows after ``since_ns``)."""
    deadline = time.monotonic() + timeout
    path = run / rundir.METRICS
    while time.monotonic() < deadline and all(p.poll() is None for p in job.procs):
        try:
            if path.stat().st_mtime_ns > since_ns:
                rows = list(rundir.iter_metrics(run))
                if rows and rows[-1]["step"] >= step:
                    return int(rows[-1]["step"])
        except FileNotFoundError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"the job never reached step {step}: "
                         f"{[p.poll() for p in job.procs]}, {job.output(0)[-2000:]}")


@pytest.mark.usefixtures("token_cache")
def test_a_killed_process_stops_the_job_and_the_run_resumes(train_corpus, tmp_path,
                                                            tmp_path_factory):
    cache = tmp_path_factory.getbasetemp() / "token-cache"
    runs = tmp_path / "runs"
    # (a heartbeat timeout of 10 s, not the default 30: the job must stop all the same, a
    # third as long after the kill; without the coordination service's heartbeats it would
    # wait for JAX's own 100 s and fail the 60 s below)
    argv = [*command(train_corpus, runs, "dp", steps=1000, checkpoint_every=4),
            "--heartbeat-timeout", "10"]
    job = Job(argv, 2, 2, cache, tmp_path / "killed")
    try:
        wait_for_row(runs / RUN, 6, job, 0)
        job.procs[1].kill()  # SIGKILL: no last word from it
        killed = time.monotonic()
        code = job.procs[0].wait(timeout=TIMEOUT)
        latency = time.monotonic() - killed
    finally:
        job.kill()
    out = job.output(0)
    assert code != 0, out[-2000:]
    assert latency < 60, latency
    assert "another task died" in out and "stopped sending heartbeats" in out, out[-3000:]
    print(f"process 0 ended {latency:.1f} s after process 1 was killed (exit {code})")

    # the same command resumes from the newest checkpoint; a SIGTERM to one process then
    # stops both at the same step with a checkpoint of it (JAX's preemption sync point)
    newest = Checkpoints(runs / RUN / "checkpoints").steps()[0]
    assert newest >= 4
    job = Job(argv, 2, 2, cache, tmp_path / "resumed")
    try:
        since = time.time_ns()
        wait_for_row(runs / RUN, newest + 2, job, since)
        job.procs[1].send_signal(signal.SIGTERM)
        codes = job.wait()
    finally:
        job.kill()
    head = job.output(0)
    assert f"resumed {runs / RUN} at step {newest}" in head, head[-3000:]
    assert codes == [PREEMPTED, PREEMPTED], (codes, head[-3000:], job.output(1)[-2000:])
    stops = [next(line for line in job.output(i).splitlines() if "stopped by SIGTERM" in line)
             for i in range(2)]
    step = int(stops[0].split(" at step ")[1].split()[0])
    assert f"process 1 of 2: stopped by SIGTERM at step {step} " in stops[1]
    assert Checkpoints(runs / RUN / "checkpoints").steps()[0] == step
    rows = list(rundir.iter_metrics(runs / RUN))
    assert [r["step"] for r in rows] == list(range(1, step + 1))  # each step once


# ---------------------------------------------------------------------------
# the parts, without a job
# ---------------------------------------------------------------------------


def test_the_launch_comes_from_flags_then_the_environment():
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "4",
           "JAX_PROCESS_ID": "3"}
    assert distributed.launch_from(environ={}) is None
    assert distributed.launch_from(environ=env) == distributed.Launch("10.0.0.1:1234", 4, 3)
    assert distributed.launch_from(process_id=1, environ=env).process_id == 1
    assert distributed.launch_from(True, environ={}) == distributed.Launch()
    for kw, env2, says in (
            ({"coordinator": "host"}, {}, "--coordinator must be HOST:PORT"),
            ({"num_processes": 2, "process_id": 2}, {}, "--process-id must be below"),
            ({}, {"JAX_NUM_PROCESSES": "two"}, "JAX_NUM_PROCESSES must be an integer"),
            ({"num_processes": 0}, {}, "--num-processes must be >= 1")):
        with pytest.raises(ConfigError, match=says):
            distributed.launch_from(environ=env2, **kw)


def test_distributed_outside_a_cluster_is_one_line_naming_what_it_needs(train_corpus, tmp_path):
    proc = subprocess.run([*command(train_corpus, tmp_path, "dp"), "--distributed"], cwd=ROOT,
                          env=environment(2, tmp_path / "cache"), capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    for needed in ("--coordinator HOST:PORT", "--num-processes N", "--process-id I",
                   "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM"):
        assert needed in proc.stderr


def test_each_process_reads_its_own_rows_of_the_same_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    whole = data_lib.batches(tokens, 8, 16, seed=3, start_step=5)
    halves = [data_lib.batches(tokens, 8, 16, seed=3, start_step=5, rows=slice(i, i + 4))
              for i in (0, 4)]
    for _ in range(3):
        x, y = next(whole)
        parts = [next(h) for h in halves]
        np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), x)
        np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), y)
    full = data_lib.eval_batches(tokens, 8, 16, 3)
    mine = [data_lib.eval_batches(tokens, 8, 16, 3, rows=slice(i, i + 4)) for i in (0, 4)]
    for k, (x, y) in enumerate(full):
        np.testing.assert_array_equal(np.concatenate([m[k][0] for m in mine]), x)
        np.testing.assert_array_equal(np.concatenate([m[k][1] for m in mine]), y)
    with pytest.raises(ValueError, match="contiguous"):
        data_lib.batches(tokens, 8, 16, seed=0, rows=slice(0, 8, 2))


@pytest.mark.usefixtures("token_cache")
def test_a_batch_the_devices_do_not_divide_is_refused_before_training(train_corpus, tmp_path):
    from train_helpers import config, quiet

    with pytest.raises(ConfigError, match="batch size 12 is not divisible by the 8 devices"):
        quiet(config(train_corpus, tmp_path / "run", batch_size=12))
    assert not (tmp_path / "run" / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# issue 33: one job, one configuration


def launch_pair(corpus: Any, root: pathlib.Path, extra: list[list[str]],
                ids: tuple[int, int] = (0, 1)) -> tuple[list[int], list[str]]:
    """Two processes of one job (one CPU device each, 2 steps of the tiny model), process i
    given ``extra[i]`` too; their exit codes and outputs."""
    port = free_port()
    env = environment(1, root / "cache")
    base = [sys.executable, "-m", "sage_train", "--model", "tiny", "--optimizer", "adamw",
            "--steps", "2", "--batch-size", "2", "--seq-len", "16", "--eval-every", "2",
            "--eval-batches", "1", "--no-progress", "--data", str(corpus),
            "--run-dir", str(root / "runs"), "--heartbeat-timeout", "20"]
    procs = []
    for i, pid in enumerate(ids):
        argv = [*base, *extra[i], "--coordinator", f"127.0.0.1:{port}",
                "--num-processes", "2", "--process-id", str(pid)]
        procs.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [p.returncode for p in procs], outs


@pytest.mark.usefixtures("token_cache")
@pytest.mark.parametrize(("option", "values"), [
    ("--lr", ("0.002", "0.01")),  # once: both exit 0, step-3 loss 7.0257 (right: 6.9358)
    ("--checkpoint-every", ("1", "2")),  # once: both hung, SIGTERM ignored
])
def test_processes_given_other_settings_refuse_together(train_corpus, tmp_path, option,
                                                        values):
    """One option differs on process 1: both processes exit 2 before the first step, each
    with one line naming the option and both values."""
    codes, outs = launch_pair(train_corpus, tmp_path, [[option, v] for v in values])
    assert codes == [2, 2], outs
    for i, out in enumerate(outs):
        errors = [line for line in out.splitlines() if line.startswith("sage-train: error")]
        assert len(errors) == 1, out
        assert (f"process {i} of 2: the processes of the job were given other settings: "
                f"{option} is {values[0]} on process 0 but {values[1]} on process 1"
                in errors[0]), errors
        assert "Traceback" not in out
    assert not (tmp_path / "runs" / "tiny-adamw" / "metrics.jsonl").exists()


def test_a_busy_coordinator_port_is_one_line_before_jax_starts(train_corpus, tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run(
            [sys.executable, "-m", "sage_train", "--model", "tiny", "--steps", "2",
             "--data", str(train_corpus), "--run-dir", str(tmp_path / "runs"),
             "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2",
             "--process-id", "0"], cwd=ROOT, env=environment(1, tmp_path / "cache"),
            capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert f"--coordinator 127.0.0.1:{port}: port {port} is already in use" in proc.stderr


@pytest.mark.usefixtures("token_cache")
def test_two_processes_with_one_id_are_one_line_each(train_corpus, tmp_path):
    """Both given --process-id 0 (once: a native abort): both exit 2 with one line."""
    codes, outs = launch_pair(train_corpus, tmp_path, [[], []], ids=(0, 0))
    assert codes == [2, 2], outs
    for out in outs:
        errors = [line for line in out.splitlines() if line.startswith("sage-train: error")]
        assert errors == ["sage-train: error: two processes of the job were given "
                          "--process-id 0: give each of the 2 processes its own id in [0, 2)"
                          ], out


def test_the_rendezvous_names_a_duplicate_id_to_every_process():
    """Three processes, two of them --process-id 1: all three refuse, before JAX starts."""
    import threading

    coordinator = f"127.0.0.1:{free_port()}"
    errors: dict[int, str] = {}

    def member(index: int, pid: int) -> None:
        try:
            distributed.rendezvous(distributed.Launch(coordinator, 3, pid), timeout=60)
            errors[index] = "joined"
        except ConfigError as e:
            errors[index] = str(e)

    threads = [threading.Thread(target=member, args=(i, pid)) for i, pid in
               enumerate((0, 1, 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    want = ("two processes of the job were given --process-id 1: give each of the 3 "
            "processes its own id in [0, 3)")
    assert errors == {0: want, 1: want, 2: want}
    # and the right layout meets
    coordinator = f"127.0.0.1:{free_port()}"
    errors.clear()
    threads = [threading.Thread(target=member, args=(i, i)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert errors == {0: "joined", 1: "joined", 2: "joined"}


def test_a_second_sigterm_always_ends_the_process():
    """A process stuck where the first SIGTERM is never polled (a collective another
    process never joins: once alive 10 minutes later) ends on the second, status 75."""
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nfrom sage_train.job.signals import StopSignals\n"
         "with StopSignals():\n    print('ready', flush=True)\n    time.sleep(60)"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=1)  # the first is a request, polled between steps
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=30) == PREEMPTED
    assert "SIGTERM again: exiting now" in child.stderr.read()
