"""``sage-train`` on several processes: JAX's multi-controller runtime, joined and kept in step.

A job of several processes (one per host, or several on one host) is one
``jax.distributed`` job: every process runs the same ``sage-train`` command, JAX joins them
into one set of devices (:func:`join`), the mesh spans them all and GSPMD compiles one
program for it; nothing here replaces JAX's runtime.  What this module adds is what a
trainer needs around it:

* **Launch** (:func:`launch_from`): the job's layout from ``--coordinator``,
  ``--num-processes`` and ``--process-id``, else from ``JAX_COORDINATOR_ADDRESS``,
  ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID``, else from the cluster environment that
  ``jax.distributed.initialize()`` detects itself (SLURM, Open MPI...: ``--distributed``).
  A layout that cannot be completed is one line naming the flags and variables it needs.
* **Agreement**: every process takes the same branch at the same step, or some process
  waits forever on a collective that the others never enter.  Checks that may fail on one
  process only (a lock, a file, the data) run inside :class:`together`: a
  :class:`~sage_train.job.errors.UserError` on any process becomes a :class:`JobError` on every
  process at the same point, naming the process that found it.  Stop signals are agreed
  the same way (:class:`StopPoll`): SIGTERM by JAX's own preemption sync point
  (``multihost_utils.reached_preemption_sync_point``), the others at the trainer's
  scheduled host syncs.
* **Failure**: a process that fails outside such a check (a full disk on the writer, a
  crash) logs its own error and leaves at once (:func:`abandon`, no wait at JAX's
  shutdown barrier); JAX's coordination service then finds it gone within
  ``--heartbeat-timeout`` seconds and terminates every other process with its message
  ("...another task died..."), so that none hangs on a collective.

Single-process runs never touch any of this: every helper is the identity there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, NoReturn

import numpy as np

from sage_train.job.errors import ConfigError, UserError

ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "JAX_PROCESS_ID"

HEARTBEAT_TIMEOUT_S = 30
"""Default ``--heartbeat-timeout``: seconds after which JAX's coordination service takes a
silent process for dead and stops the others (JAX's own default is 100)."""

INIT_TIMEOUT_S = 300
"""Seconds a process waits for the others (and the coordinator) to join the job."""

TEXT_BYTES = 2048
"""Bytes of a message shared between processes (:func:`allgather_text`); longer ones are cut."""

NEEDS = (f"pass --coordinator HOST:PORT --num-processes N --process-id I (or set "
         f"{ENV_COORDINATOR}, {ENV_NUM_PROCESSES}, {ENV_PROCESS_ID}), or run under a "
         "cluster manager JAX detects (SLURM's srun, Open MPI's mpirun)")
"""What a job needs to know, in the words of the one-line error that says it is missing."""


class JobError(UserError):
    """A problem found on some process of a job, raised on every process at the same point.

    Raised by :class:`together`; ``sage-train`` exits with status 2 on every process, all
    together (no process is left waiting for another).
    """


@dataclasses.dataclass(frozen=True)
class Launch:
    """How this process joins a multi-process job (``None`` fields: JAX detects them).

    Attributes:
      coordinator: ``HOST:PORT`` of process 0's coordination service.
      num_processes: processes in the job.
      process_id: this process's index, ``0 <= process_id < num_processes``.
      heartbeat_timeout: seconds after which a silent process is taken for dead (and every
        other process stopped).
    """

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    heartbeat_timeout: int = HEARTBEAT_TIMEOUT_S

    def describe(self) -> str:
        """``process 1 of 2, coordinator 127.0.0.1:1234`` (what is known before joining)."""
        who = ("process ?" if self.process_id is None else f"process {self.process_id}")
        of = "" if self.num_processes is None else f" of {self.num_processes}"
        where = (f", coordinator {self.coordinator}" if self.coordinator else
                 ", layout from the cluster environment")
        return f"{who}{of}{where}"


def _env_int(environ: Mapping[str, str], name: str) -> int | None:
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name} must be an integer, got {text!r}") from None


def check_coordinator(address: str) -> str:
    """``address`` if it is ``HOST:PORT`` with a port in 1..65535.

    Raises:
      ConfigError: it is not (one line, with an example).
    """
    host, sep, port = address.strip().rpartition(":")
    if not (sep and host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"--coordinator must be HOST:PORT (e.g. 10.0.0.1:1234, the address "
                          f"of process 0), got {address!r}")
    return address.strip()


def launch_from(distributed: bool = False, coordinator: str | None = None,
                num_processes: int | None = None, process_id: int | None = None,
                heartbeat_timeout: int = HEARTBEAT_TIMEOUT_S,
                environ: Mapping[str, str] | None = None) -> Launch | None:
    """The job this process belongs to, or ``None`` for a single-process run.

    A flag given wins over its environment variable (``JAX_COORDINATOR_ADDRESS``,
    ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID``); any of them, or ``distributed``
    (``--distributed``: whatever the cluster environment says), makes a job.

    Raises:
      ConfigError: a value that cannot be right (a port-less coordinator, a process id
        outside ``[0, num_processes)``, a variable that is not an integer...).
    """
    env = os.environ if environ is None else environ
    coordinator = coordinator if coordinator is not None else (
        env.get(ENV_COORDINATOR) or None)
    if num_processes is None:
        num_processes = _env_int(env, ENV_NUM_PROCESSES)
    if process_id is None:
        process_id = _env_int(env, ENV_PROCESS_ID)
    if not distributed and coordinator is None and num_processes is None and process_id is None:
        return None
    if coordinator is not None:
        coordinator = check_coordinator(coordinator)
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num-processes must be >= 1, got {num_processes}")
    if process_id is not None and process_id < 0:
        raise ConfigError(f"--process-id must be >= 0, got {process_id}")
    if None not in (num_processes, process_id) and process_id >= num_processes:  # type: ignore[operator]
        raise ConfigError(f"--process-id must be below --num-processes ({num_processes}), "
                          f"got {process_id}")
    if isinstance(heartbeat_timeout, bool) or not 1 <= heartbeat_timeout <= 86_400:
        raise ConfigError(f"--heartbeat-timeout must be an integer in [1, 86400] seconds, got "
                          f"{heartbeat_timeout!r}")
    return Launch(coordinator, num_processes, process_id, heartbeat_timeout)


def join(launch: Launch) -> None:
    """Join the job (``jax.distributed.initialize``), before anything starts a JAX backend.

    The heartbeat timeout is ``launch.heartbeat_timeout``: a process that dies is noticed
    by the others within that time.  The shutdown barrier keeps JAX's timeout (300 s): at
    the end of a run the others wait there while process 0 writes the loss curve and the
    table; a process that fails alone never waits there (:func:`abandon`).

    Raises:
      ConfigError: the layout is incomplete (the flags and variables it needs named), or
        the job could not be joined (the coordinator unreachable within
        :data:`INIT_TIMEOUT_S`...): one line.
    """
    import jax

    if None not in (launch.coordinator, launch.num_processes, launch.process_id) and (
            launch.num_processes or 0) > 1:
        rendezvous(launch)  # duplicate ids and a busy port: one line, before JAX's service
    elif launch.process_id == 0 and launch.coordinator is not None:
        check_port_free(launch.coordinator)
    try:
        jax.distributed.initialize(
            coordinator_address=launch.coordinator, num_processes=launch.num_processes,
            process_id=launch.process_id, initialization_timeout=INIT_TIMEOUT_S,
            heartbeat_timeout_seconds=launch.heartbeat_timeout)
    except (ValueError, TypeError) as e:
        text = str(e)
        if "must be defined" in text or "should be defined" in text:
            raise ConfigError(f"the job's layout is incomplete (JAX: {text.rstrip('.')}): "
                              f"{NEEDS}") from None
        raise ConfigError(f"cannot join the job as {launch.describe()}: {_first_line(e)}"
                          ) from None
    except RuntimeError as e:  # the runtime's errors (unreachable coordinator, timeout...)
        raise ConfigError(f"cannot join the job as {launch.describe()} within "
                          f"{INIT_TIMEOUT_S} s: {_first_line(e)}") from None


def check_port_free(coordinator: str) -> None:
    """Refuse to start the job's coordination service on a port already in use here.

    Process 0 starts the service on ``coordinator``'s port; a port another program (or
    another process 0) listens on would make JAX's service fail natively (a crash, or a
    job joined to the wrong service).  Checked by binding the port (no ``SO_REUSEPORT``),
    released at once.

    Raises:
      ConfigError: the port is in use (one line naming it).
    """
    import errno
    import socket

    port = int(coordinator.rpartition(":")[2])
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue  # no IPv6 here
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise ConfigError(
                        f"--coordinator {coordinator}: port {port} is already in use on this "
                        "host (another program, or another process 0 of a job): choose a "
                        "free port for process 0 to serve the job on") from None
                if family == socket.AF_INET6:
                    continue  # IPv6 without this address: the IPv4 check stands
                raise ConfigError(f"--coordinator {coordinator}: cannot serve the job on port "
                                  f"{port} here: {e.strerror}") from None


_HELLO = "sage-train-job"
"""The first word of a process's line to process 0 in :func:`rendezvous`."""


def _read_line(conn: Any, deadline: float) -> str | None:
    """One line from ``conn`` before ``deadline`` (``None``: closed, silent or not text)."""
    import time

    data = b""
    while b"\n" not in data and len(data) < 4096:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(min(left, 1.0))
        try:
            chunk = conn.recv(4096)
        except TimeoutError:
            continue
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    try:
        return data.split(b"\n", 1)[0].decode()
    except UnicodeDecodeError:
        return None


def rendezvous(launch: Launch, timeout: float = INIT_TIMEOUT_S) -> None:
    """Meet every process of the job on the coordinator's port before JAX's service starts.

    Process 0 listens on the port (refused in one line if it is in use: another program,
    or another process 0) and hears each other process's ``--process-id`` and
    ``--num-processes``; it answers all of them at once, ``ok``, or the problem (two
    processes with one id, another number of processes), which every process then raises.
    The others connect (retrying until ``timeout``), say who they are and wait for the
    answer.  JAX's own start would crash natively on these (a duplicate id aborts, a busy
    port can segfault).

    Raises:
      ConfigError: on every process: duplicate ids, another ``--num-processes``, a busy
        port, or processes missing after ``timeout`` seconds (one line).
    """
    import time

    assert launch.coordinator is not None and launch.num_processes is not None
    host, _, port_text = launch.coordinator.rpartition(":")
    port, me = int(port_text), launch.process_id
    deadline = time.monotonic() + timeout
    hello = f"{_HELLO} {me} {launch.num_processes}\n".encode()
    if me == 0:
        _serve(launch, port, hello, deadline, timeout)
    else:
        _reach(launch, host, port, hello, deadline, timeout)


def _listen(launch: Launch, port: int, hello: bytes) -> Any:
    """Process 0's listening socket on ``port``, or the one-line refusal of a busy port."""
    import errno
    import socket
    import time

    try:
        return socket.create_server(("", port))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            raise ConfigError(f"--coordinator {launch.coordinator}: cannot serve the job "
                              f"on port {port} here: {e.strerror}") from None
    # another process 0 of this job may be serving it: tell it, hear its answer
    answer = None
    with contextlib.suppress(OSError):
        with socket.create_connection(("127.0.0.1", port), timeout=3) as conn:
            conn.sendall(hello)
            answer = _read_line(conn, time.monotonic() + 3)
    if answer is not None and answer.startswith("error "):
        raise ConfigError(answer[len("error "):]) from None
    raise ConfigError(
        f"--coordinator {launch.coordinator}: port {port} is already in use on this "
        "host (another program, or another process 0 of a job): choose a free port "
        "for process 0 to serve the job on") from None


def _hello_problem(line: str, n: int, clients: Mapping[int, Any]
                   ) -> tuple[int | None, str | None]:
    """``(process id, problem)`` of a process's hello (``(None, None)``: no process's)."""
    words = line.split()
    if len(words) != 3 or words[0] != _HELLO or not (
            words[1].isdigit() and words[2].isdigit()):
        return None, None  # not a process of a job (a port scan...)
    pid, count = int(words[1]), int(words[2])
    if count != n:
        return pid, (f"the processes of the job were given other settings: "
                     f"--num-processes is {n} on process 0 but {count} on process {pid}")
    if pid >= n:
        return pid, f"--process-id {pid} is not below --num-processes {n}"
    if pid == 0 or pid in clients:
        return pid, (f"two processes of the job were given --process-id {pid}: "
                     f"give each of the {n} processes its own id in [0, {n})")
    return pid, None


def _serve(launch: Launch, port: int, hello: bytes, deadline: float, timeout: float) -> None:
    """Process 0: hear every other process, then answer them all at once."""
    import time

    n = launch.num_processes or 1
    server = _listen(launch, port, hello)
    clients: dict[int, Any] = {}
    others: list[Any] = []  # connections to answer with the problem
    problem = None
    with server:
        server.settimeout(1.0)
        while len(clients) < n - 1 and problem is None:
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, n)) - set(clients))
                problem = (f"cannot join the job as {launch.describe()} within "
                           f"{int(timeout)} s: process{'es' if len(missing) > 1 else ''} "
                           f"{', '.join(map(str, missing))} did not reach process 0")
                break
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            pid, problem = _hello_problem(_read_line(conn, time.monotonic() + 10) or "", n,
                                          clients)
            if pid is None:
                conn.close()
            elif problem is not None:
                others.append(conn)
            else:
                clients[pid] = conn
        reply = "ok\n" if problem is None else f"error {problem}\n"
        for conn in [*clients.values(), *others]:
            with contextlib.suppress(OSError):
                conn.sendall(reply.encode())
            conn.close()
    if problem is not None:
        raise ConfigError(problem)


def _reach(launch: Launch, host: str, port: int, hello: bytes, deadline: float,
           timeout: float) -> None:
    """A process other than 0: reach process 0, say who it is, hear the answer."""
    import socket
    import time

    while True:
        try:
            conn = socket.create_connection((host, port), timeout=5)
        except OSError:
            if time.monotonic() > deadline:
                raise ConfigError(f"cannot join the job as {launch.describe()} within "
                                  f"{int(timeout)} s: process 0 is not serving it") from None
            time.sleep(0.2)
            continue
        with conn:
            conn.sendall(hello)
            answer = _read_line(conn, deadline)
        if answer is None or not answer.startswith(("ok", "error ")):
            return  # not a rendezvous (an older process 0): JAX's own start decides
        if answer.startswith("error "):
            raise ConfigError(answer[len("error "):])
        return


def _first_line(e: BaseException, limit: int = 240) -> str:
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return text if len(text) <= limit else text[: limit - 1] + "…"


# ---------------------------------------------------------------------------
# who am I
# ---------------------------------------------------------------------------


def joined() -> bool:
    """Whether this process is one of a job of several processes."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def process_index() -> int:
    """The index of this process in the job (0 alone)."""
    import jax

    return int(jax.process_index())


def process_count() -> int:
    """The number of processes of the job (1 alone)."""
    import jax

    return int(jax.process_count())


def is_primary() -> bool:
    """Whether this process writes the run's files (process 0)."""
    return process_index() == 0


def where() -> str:
    """``"process 1 of 2: "`` in a job of several processes, else ``""`` (a log prefix)."""
    if not joined():
        return ""
    return f"process {process_index()} of {process_count()}: "


# ---------------------------------------------------------------------------
# collectives of the host (every process must call them, in the same order)
# ---------------------------------------------------------------------------


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (nothing alone)."""
    if process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather(x: np.ndarray) -> np.ndarray:
    """``x`` of every process, stacked (``[process_count, *x.shape]``).

    ``x`` must have the same shape and dtype on every process.
    """
    x = np.asarray(x)
    if process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def allgather_text(text: str) -> list[str]:
    """``text`` of every process (UTF-8, cut to :data:`TEXT_BYTES` bytes)."""
    raw = text.encode()[:TEXT_BYTES]
    buf = np.zeros(TEXT_BYTES + 4, np.uint8)
    buf[:4] = np.frombuffer(len(raw).to_bytes(4, "little"), np.uint8)
    buf[4:4 + len(raw)] = np.frombuffer(raw, np.uint8)
    out = []
    for row in allgather(buf):
        n = int.from_bytes(row[:4].tobytes(), "little")
        out.append(row[4:4 + n].tobytes().decode(errors="replace"))
    return out


def same_everywhere(value: str, what: str) -> None:
    """Check that ``value`` (a short text: a hash, a listing) is the same on every process.

    Raises:
      JobError: on every process, naming the first one that differs from process 0.
    """
    values = allgather_text(value)
    for i, v in enumerate(values):
        if v != values[0]:
            raise JobError(f"{what} differs between processes: process 0 has {values[0]!r}, "
                           f"process {i} {v!r}")


def _option(key: str) -> str:
    return "--" + key.replace("_", "-")


def same_settings(settings: Mapping[str, object],
                  flag: Callable[[str], str] = _option) -> None:
    """Check that every process of the job was given the same ``settings``.

    A collective (every process calls it, with the same keys in the same order): one
    all-gather of a digest where they agree; where they do not, one of a digest per
    setting and one of the first differing setting's values.

    Raises:
      JobError: on every process, naming the first setting (as its option: ``flag(name)``,
        default ``--name-with-dashes``) that differs and its value on process 0 and on the
        first process that differs.
    """
    if process_count() == 1:
        return
    texts = [json.dumps(v, sort_keys=True, default=str) for v in settings.values()]
    whole = hashlib.sha256("\x00".join([*settings, *texts]).encode()).digest()
    digests = allgather(np.frombuffer(whole, np.uint8))
    if all(np.array_equal(d, digests[0]) for d in digests):
        return
    each = np.stack([np.frombuffer(hashlib.sha256(t.encode()).digest()[:8], np.uint8)
                     for t in texts]) if texts else np.zeros((0, 8), np.uint8)
    gathered = allgather(each)
    for k, key in enumerate(settings):
        differ = [i for i in range(len(gathered))
                  if not np.array_equal(gathered[i][k], gathered[0][k])]
        if differ:
            values = allgather_text(texts[k])
            raise JobError(f"the processes of the job were given other settings: "
                           f"{flag(key)} is {values[0]} on process 0 but "
                           f"{values[differ[0]]} on process {differ[0]}; every process must "
                           "run the same command (only the launch flags differ)")
    raise JobError("the processes of the job were given other settings (of other names): "
                   "every process must run the same command and the same sage-train")


def everywhere(error: UserError) -> UserError:
    """``error`` as raised by every process of the job at the same point (a :class:`JobError`).

    For a check whose inputs every process shares (what a collective returned, the
    run's settings): each process raises it, and the job ends together.  Alone: ``error``.
    """
    if process_count() == 1 or isinstance(error, JobError):
        return error
    job = JobError(str(error))
    job.__cause__ = error
    return job


class together:  # noqa: N801 - used as a statement: ``with together("..."):``
    """A block of checks every process runs, failing on all processes or on none.

    ``with together("checking the run"): ...``: where the block raises a
    :class:`~sage_train.job.errors.UserError` on some process, every process raises a
    :class:`JobError` when it leaves the block (the failing process with its own message,
    the others naming it).  The block must hold no collective (no JAX computation on the
    job's arrays): a process that fails early must not leave the others inside one.  Other
    exceptions pass through (the process then leaves the job: :func:`abandon`).  Alone,
    the block is an ordinary one.
    """

    def __init__(self, what: str) -> None:
        self.what = what

    def __enter__(self) -> together:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        if process_count() == 1:
            return
        if error is not None and not isinstance(error, UserError):
            return  # a crash: this process leaves; the runtime stops the others
        mine = "" if error is None else (str(error) or type(error).__name__)
        texts = allgather_text(mine)
        failed = [(i, t) for i, t in enumerate(texts) if t]
        if not failed:
            return
        if mine:
            raise JobError(mine) from error
        i, text = failed[0]
        raise JobError(f"process {i} of {len(texts)} failed {self.what}: {text}") from error


# ---------------------------------------------------------------------------
# stopping together
# ---------------------------------------------------------------------------

_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")


def agreed_signal(local: str | None) -> str | None:
    """The stop signal of the job: the first of :data:`_SIGNALS` any process received.

    A collective: every process calls it at the same step (alone: ``local``).
    """
    if process_count() == 1:
        return local
    code = _SIGNALS.index(local) + 1 if local in _SIGNALS else 0
    codes = [int(c) for c in allgather(np.asarray(code, np.int32)) if int(c)]
    return _SIGNALS[min(codes) - 1] if codes else None


class StopPoll:
    """The trainer's stop poll, agreed between the processes of a job.

    Alone, ``poll(scheduled)`` is ``stop()`` at every step.  In a job, a SIGTERM to
    any process is JAX's preemption notice, and ``reached_preemption_sync_point``
    (called at every step, as JAX asks) stops every process at the same step; other
    signals caught by ``stop`` (SIGUSR1, SIGINT, a SIGTERM before the job was joined) are
    agreed at the steps where ``scheduled`` is true, which are the same steps on every
    process (the trainer's host syncs).
    """

    _calls = 0  # JAX's sync point ids: one per step of every run of this process, increasing

    def __init__(self, stop: Callable[[], str | None] | None) -> None:
        self.stop = stop
        self.multi = process_count() > 1

    def local(self) -> str | None:
        """The signal this process received (``None``: none)."""
        return self.stop() if self.stop is not None else None

    def now(self) -> str | None:
        """The agreed signal before training starts (a collective in a job)."""
        return agreed_signal(self.local()) if self.multi else self.local()

    def __call__(self, scheduled: bool) -> str | None:
        """The signal that stops the run after this step (``None``: go on)."""
        if not self.multi:
            return self.local()
        from jax.experimental import multihost_utils

        # the id counts the steps of every run of the process (several --optimizer runs
        # restart their step numbers; JAX's ids must only increase, in step on all processes)
        StopPoll._calls += 1
        try:
            preempted = multihost_utils.reached_preemption_sync_point(StopPoll._calls)
        except RuntimeError:  # jax_enable_preemption_service off: SIGTERM reaches ``stop``
            preempted = False
        if preempted:
            return "SIGTERM"
        return agreed_signal(self.local()) if scheduled else None


def abandon(status: int) -> NoReturn:
    """Leave the job at once with ``status`` (the error is already logged).

    No wait at JAX's shutdown barrier, which the other processes (busy in the step, or in
    a collective this process never enters) would not reach: JAX's coordination service
    notices this process gone within the heartbeat timeout and stops them, each with its
    own message.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)


def job_token() -> str:
    """A name shared by the processes of this job (process 0's choice)."""
    mine = hashlib.sha256(f"{os.getpid()}-{os.urandom(8).hex()}".encode()).hexdigest()[:16]
    return allgather_text(mine)[0]


def describe_job() -> str:
    """``2 processes of 4 devices`` (alone: ``1 process of 8 devices``)."""
    import jax

    n, local = process_count(), jax.local_device_count()
    return (f"{n} process{'' if n == 1 else 'es'} of {local} "
            f"device{'' if local == 1 else 's'}")
