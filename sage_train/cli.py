"""``sage-train``: pretrain a LLaMA with one or several of the paper's configurations.

``sage-train export --hf DIR --run-dir RUN`` writes a run's checkpoint as a Hugging Face
``LlamaForCausalLM`` directory with its tokenizer (:mod:`sage_train.run.export`).
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
from collections.abc import Callable
from typing import Any

from sage_optim.table import format_bytes, format_table
from sage_train.job.cli_args import DefaultsFormatter, OneLineParser, checked
from sage_train.job.distributed import HEARTBEAT_TIMEOUT_S, JobError, check_coordinator
from sage_train.job.errors import CheckpointError, RunFileError, UserError
from sage_train.job.signals import INTERRUPTED, PREEMPTED, StopSignals
from sage_train.model.shapes import get_model_config
from sage_train.run.config import (
    FIELD_DEFAULT,
    SETTING_CHECKS,
    TrainConfig,
    option_flag,
    options,
)

EPILOG = """\
output: a header of the run's settings as used (learning rate, schedule, tokens per step,
parameters, optimizer-state bytes, kernels, data), then a progress bar on a terminal, or
else (and with --no-progress) one line per --log-every steps:
  step 40/300  loss 5.4321  lr 1.20e-03  gnorm 0.8731  tok/s 12,345  eta 0:01:23
(evaluations add "  eval_loss L  ppl P"). --tensorboard writes TensorBoard event files
into each run directory (tensorboard --logdir RUN_DIR); --wandb PROJECT logs the same
scalars to Weights & Biases.

Hugging Face: "sage-train export --hf DIR --run-dir RUN_DIR/MODEL-OPTIMIZER" writes a
run's newest checkpoint (or --step N) with its tokenizer as a LlamaForCausalLM directory
(AutoModelForCausalLM/AutoTokenizer.from_pretrained(DIR) load it offline); --init-from-hf
DIR starts a run from such weights (of the --model's architecture; without --model, the
checkpoint's own). "sage-train sample --run-dir RUN_DIR/MODEL-OPTIMIZER --prompt TEXT"
continues a prompt with a run's checkpoint and tokenizer.

Each configuration trains in RUN_DIR/MODEL-OPTIMIZER (locked while it trains; every run
directory named is locked and checked before any is trained). Running the same command
again resumes from the newest intact checkpoint, with bit-identical losses; a rerun with
other settings (learning rate, steps, batch size, sequence length, seed, data, warmup,
clipping...) is refused unless --allow-config-change is given, which continues the run under
the new settings, carries over what fits (the parameters and optimizer state across
--layers; the parameters across --optimizer, with a fresh optimizer state; never another
--model) and records the change in config_history.jsonl. A run directory whose settings
files are gone takes its settings from its newest verified checkpoint; one whose
checkpoints all fail verification is refused unless --restart. A run directory is never
read as part of the data.

several processes (docs/scaling.md): every process runs the same command with
--coordinator HOST:PORT --num-processes N --process-id I (or JAX_COORDINATOR_ADDRESS,
JAX_NUM_PROCESSES, JAX_PROCESS_ID; or --distributed under SLURM or Open MPI); the mesh spans
the devices of all, each process feeds its own rows of the same batches, process 0 writes
the run's files, the run directory must be shared. A failure on any process stops all of
them (a process that dies: within --heartbeat-timeout, the others ending on SIGABRT with
JAX's message); checkpoints resume on any number of processes.

preemption: SIGTERM or SIGUSR1 (a cluster's preemption; SLURM: --signal=USR1@120) saves a
checkpoint of the step reached, then exits with status 75; SIGINT (Ctrl-C) stops between
steps without one, exit status 130 (a second Ctrl-C exits at once). Run the same command
again to resume.

exit status: 0 trained (or already complete; a loss curve that cannot be written is only
a warning); 1 stopped on a NaN/Inf, or a checkpoint or another file of the run could not
be written (disk full, read-only; the earlier checkpoints are kept); 2 invalid options,
data or run directory (nothing was trained; a run refused after earlier --optimizer runs
trained exits with 1); 75 preempted (SIGTERM/SIGUSR1): a checkpoint
of the step reached was saved; 130 interrupted (SIGINT)."""

_DEFAULTS = TrainConfig()


def _checked(field: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` that converts and checks a value as :func:`check_config` does."""
    ok, what = SETTING_CHECKS[field]
    return checked(convert, ok, what)


def _at_least(lo: int) -> Callable[[str], int]:
    """An integer ``>= lo`` (``ValueError`` otherwise)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < lo:
            raise ValueError(f"must be an integer >= {lo}, got {text!r}")
        return value

    return parse


def _launch_value(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` for a launch flag: its error is one line."""
    def parse(text: str) -> Any:
        try:
            return convert(text)
        except ValueError as e:  # ConfigError is one
            message = str(e)
            if message.startswith("invalid literal"):
                message = f"must be an integer, got {text!r}"
            raise argparse.ArgumentTypeError(message.removeprefix("--coordinator ")) from None

    return parse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: ``small`` with ``sage-hybrid`` on the embedded corpus).

    Every number is checked here, before anything is read or written; an invalid one exits
    with status 2 and a one-line message naming the option.
    """
    args = build_parser().parse_args(argv)
    if args.model is None and args.init_from_hf is None:
        args.model = _DEFAULTS.model
    elif args.model is None:  # the checkpoint's own shape
        config = pathlib.Path(args.init_from_hf).expanduser() / "config.json"
        if not config.is_file():
            build_parser().error(f"argument --init-from-hf: {config} does not exist: not a "
                                 "Hugging Face checkpoint directory")
        args.model = args.init_from_hf
        try:
            get_model_config(args.model)
        except ValueError as e:
            build_parser().error("argument --init-from-hf: " + str(e).removeprefix(
                f"--model {args.model}: "))
    return args


USAGE = """\
%(prog)s [--model NAME] [--optimizer NAME ...] [--steps N] [options]
       %(prog)s export --hf DIR --run-dir RUN_DIR/MODEL-OPTIMIZER [--step N]
       %(prog)s sample --run-dir RUN_DIR/MODEL-OPTIMIZER --prompt TEXT"""
"""``sage-train``'s usage line: training, and its subcommands (``export --help``,
``sample --help``)."""


def model_label(model: str) -> str:
    """The model's name in run directories and file names: a size, or its file's ``name``."""
    return get_model_config(model).name


def build_parser() -> argparse.ArgumentParser:
    """The ``sage-train`` parser: help text and default for every option."""
    p = OneLineParser(prog="sage-train", description=__doc__, epilog=EPILOG,
                      formatter_class=DefaultsFormatter, usage=USAGE, allow_abbrev=False)
    add_config_options(p)
    p.add_argument("--allow-config-change", action="store_true",
                   help="continue a run under settings other than its recorded ones (the "
                   "change is recorded in config_history.jsonl), or whose settings are "
                   "unknown; the parameters and optimizer state carry over across --layers, "
                   "the parameters across --optimizer (fresh optimizer state); another "
                   "--model is refused (default: off)")
    p.add_argument("--restart", action="store_true",
                   help="start over from step 0 where every checkpoint of a run fails "
                   "verification (they are moved aside to checkpoints/STEP.unusable, not "
                   "deleted); without it such a run is refused (default: off)")
    p.add_argument("--distributed", action="store_true",
                   help="join a job of several processes (jax.distributed.initialize()): its "
                   "layout from --coordinator, --num-processes and --process-id, else from "
                   "JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID, else from "
                   "the cluster manager JAX detects (SLURM's srun, Open MPI's mpirun); any of "
                   "those flags or variables implies it (default: off)")
    p.add_argument("--coordinator", type=_launch_value(check_coordinator), default=None,
                   metavar="HOST:PORT", help="the address of process 0's coordination "
                   "service, which every process of the job connects to (default: "
                   "JAX_COORDINATOR_ADDRESS, or the cluster's)")
    p.add_argument("--num-processes", type=_launch_value(_at_least(1)), default=None,
                   metavar="N", help="the number of processes of the job (default: "
                   "JAX_NUM_PROCESSES, or the cluster's)")
    p.add_argument("--process-id", type=_launch_value(_at_least(0)), default=None,
                   metavar="I", help="this process's index in the job, 0 to N-1; process 0 "
                   "writes the run's files (default: JAX_PROCESS_ID, or the cluster's)")
    p.add_argument("--heartbeat-timeout", type=_launch_value(_at_least(1)),
                   default=HEARTBEAT_TIMEOUT_S, metavar="SECONDS",
                   help="in a job, a process silent for this long is taken for dead and "
                   "JAX stops the others (each exits non-zero with its message), so that "
                   "none waits forever on a collective")
    return p


def build_export_parser() -> argparse.ArgumentParser:
    """The ``sage-train export`` parser."""
    p = OneLineParser(prog="sage-train export", formatter_class=DefaultsFormatter,
                      allow_abbrev=False,
                      description="Write a run's checkpoint as a Hugging Face LlamaForCausalLM "
                "directory\n(config.json, model.safetensors) with the run's tokenizer "
                "(tokenizer.json,\ntokenizer_config.json): transformers' "
                "AutoModelForCausalLM.from_pretrained(DIR)\nand "
                "AutoTokenizer.from_pretrained(DIR) load it offline; sage-train\n"
                "--init-from-hf DIR starts a run from it.")
    p.add_argument("--hf", required=True, metavar="DIR", default=argparse.SUPPRESS,
                   help="the directory to write: new, empty, or an earlier export "
                   "(its weights and tokenizer are then replaced as a whole)")
    p.add_argument("--run-dir", required=True, metavar="RUN", default=argparse.SUPPRESS,
                   help="the run's own directory, RUN_DIR/MODEL-OPTIMIZER")
    p.add_argument("--step", type=_checked("steps", int), default=None,
                   help="the checkpoint of this step (default: the newest that verifies)")
    return p


def add_config_options(p: argparse.ArgumentParser) -> None:
    """An option for every :class:`~sage_train.run.config.TrainConfig` field that has one.

    Generated from the fields' :class:`~sage_train.run.config.Option`: the flag, help, default,
    choices and check (a value :func:`~sage_train.run.config.check_config` would refuse is
    refused here, with the same words).
    """
    defaults = TrainConfig()
    for name, o in options().items():
        if not o.cli:
            continue
        flag = option_flag(name)
        default = getattr(defaults, name) if o.cli_default is FIELD_DEFAULT \
            else o.cli_default
        if isinstance(default, bool):
            p.add_argument(flag, action="store_true", help=f"{o.help} (default: off)")
            continue
        kwargs: dict[str, Any] = {"help": o.help, "metavar": o.metavar}
        if o.check is not None:
            kwargs["type"] = checked(o.parse or str, *o.check)
        elif o.parse is not None:
            kwargs["type"] = o.parse
        if o.choices is not None:
            kwargs["choices"] = tuple(c for c in o.choices if c is not None)
        if o.nargs is not None:
            kwargs["nargs"], default = o.nargs, [default]
        p.add_argument(flag, default=default, **kwargs)


def _dest(name: str) -> str:
    o = options()[name]
    return (o.flag or name).lstrip("-").replace("-", "_")


def configs(args: argparse.Namespace) -> list[TrainConfig]:
    """One :class:`TrainConfig` per configuration named on the command line.

    Every field with an option takes its value (a ``--no-...`` switch negated); each
    configuration runs in ``RUN_DIR/MODEL-OPTIMIZER``.
    """
    given = {name: getattr(args, _dest(name)) for name, o in options().items() if o.cli}
    given |= {name: not given[name] for name, o in options().items() if o.negate}
    return [TrainConfig(**given | {
        "optimizer": name,
        "run_dir": str(pathlib.Path(args.run_dir) / f"{model_label(args.model)}-{name}")})
        for name in args.optimizer]


def main(argv: list[str] | None = None, *, signals: StopSignals | None = None) -> int:
    """Train, print a summary table and save the loss-curve PNG.

    Returns 0 on success, 1 when a run stopped on a NaN/Inf or a file of the run could not
    be written, 2 on invalid options, data or run directory (nothing trained), 75 after
    SIGTERM/SIGUSR1 (a checkpoint of the step reached saved), 130 after SIGINT; errors are
    one line on stderr.  ``signals``: SIGTERM/SIGUSR1/SIGINT already caught by the caller
    (``python -m sage_train`` catches them before it imports JAX); by default they are
    caught from here on.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if argv[:1] == ["sample"]:
        return sample_main(argv[1:])
    with StopSignals() if signals is None else contextlib.nullcontext(signals) as signals:
        args = parse_args(argv)
        try:
            return _main(args, signals)
        except UserError as e:
            print(f"sage-train: error: {_where()}{e}", file=sys.stderr)
            return _leave(2, e)
        except RunFileError as e:
            more = "" if isinstance(e, CheckpointError) else (
                "; training stopped (the earlier checkpoints are intact: run the same command "
                "again to resume once it can be written)")
            print(f"sage-train: error: {_where()}{e}{more}", file=sys.stderr)
            return _leave(1, e)
        except KeyboardInterrupt as e:
            print(f"sage-train: {_where()}interrupted; run the same command again to resume "
                  "from the newest checkpoint", file=sys.stderr)
            return _leave(INTERRUPTED, e)
        except Exception as e:
            if not _in_job():
                raise
            import traceback

            traceback.print_exc()
            print(f"sage-train: error: {_where()}{type(e).__name__} (traceback above); "
                  "this process leaves the job, which stops the others", file=sys.stderr)
            return _leave(1, e)


def _in_job() -> bool:
    """Whether this process is one of a job of several (JAX imported and joined)."""
    if "jax" not in sys.modules:
        return False
    from sage_train.job import distributed

    return distributed.joined()


def _where() -> str:
    """``"process 1 of 2: "`` in a job of several processes, else ``""``."""
    if not _in_job():
        return ""
    from sage_train.job import distributed

    return distributed.where()


def _leave(status: int, error: BaseException) -> int:
    """``status``; in a job, a process that failed alone leaves it at once.

    A :class:`~sage_train.job.distributed.JobError` was raised by every process at the same
    point: they all return, and leave the job together.  Any other failure is this
    process's alone: it exits now (:func:`~sage_train.job.distributed.abandon`), and JAX's
    runtime stops the others within the heartbeat timeout.
    """
    if _in_job() and not isinstance(error, JobError):
        from sage_train.job import distributed

        distributed.abandon(status)
    return status


def build_sample_parser() -> argparse.ArgumentParser:
    """The ``sage-train sample`` parser."""
    p = OneLineParser(prog="sage-train sample", formatter_class=DefaultsFormatter,
                      allow_abbrev=False,
                      description="Generate text from a run's checkpoint: the prompt, "
                      "tokenized with the run's tokenizer,\ncontinued token by token by the "
                      "trained model (on one device; the run is only read).")
    p.add_argument("--run-dir", required=True, type=pathlib.Path, metavar="RUN",
                   help="the run's own directory, RUN_DIR/MODEL-OPTIMIZER")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tokens", type=_checked("steps", int), default=64, metavar="N",
                   help="how many tokens to generate (fewer where the text ends)")
    p.add_argument("--temperature", type=checked(float, lambda v: v >= 0, "a number >= 0"),
                   default=0.8, help="sampling temperature; 0: always the likeliest token")
    p.add_argument("--seed", type=_checked("seed", int), default=0,
                   help="the sampling seed")
    p.add_argument("--step", type=_checked("steps", int), default=None,
                   help="the checkpoint's step (default: the newest that verifies)")
    return p


def sample_main(argv: list[str]) -> int:
    """``sage-train sample``: 0 when generated, 2 on a bad run directory or prompt."""
    args = build_sample_parser().parse_args(argv)
    try:
        from sage_train.run.export import sample

        text = sample(args.run_dir, args.prompt, tokens=args.tokens,
                      temperature=args.temperature, seed=args.seed, step=args.step)
    except UserError as e:
        print(f"sage-train sample: error: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def export_main(argv: list[str]) -> int:
    """``sage-train export``: 0 when written, 2 on a bad run directory, 1 on a failed write."""
    args = build_export_parser().parse_args(argv)
    try:
        from sage_train.run.export import export_hf

        export_hf(args.run_dir, args.hf, step=args.step)
    except UserError as e:
        print(f"sage-train export: error: {e}", file=sys.stderr)
        return 2
    except RunFileError as e:
        print(f"sage-train export: error: {e}", file=sys.stderr)
        return 1
    return 0


def _stopped_by(name: str, step: int | None) -> int:
    """Say why the command stopped on signal ``name`` (one line) and return its status."""
    where = f" at step {step}" if step is not None else ""
    if name == "SIGINT":
        print(f"sage-train: {_where()}interrupted{where}; run the same command again to "
              "resume from the newest checkpoint", file=sys.stderr)
        return INTERRUPTED
    saved = (" with a checkpoint of the step reached" if step else
             " before it trained a step")
    print(f"sage-train: {_where()}stopped by {name}{where}{saved}; run the same command "
          "again to resume from the newest checkpoint", file=sys.stderr)
    return PREEMPTED


def _main(args: argparse.Namespace, signals: StopSignals) -> int:
    from sage_train.job import distributed
    from sage_train.run.config import check_config
    from sage_train.run.resolve import check_init_from_hf, enable_determinism

    cfgs = configs(args)
    for cfg in cfgs:  # before a job is joined: a refusal is the same on every process
        check_config(cfg)
        check_init_from_hf(cfg)
    if args.deterministic:
        enable_determinism()  # before anything starts a JAX backend
    launch = distributed.launch_from(args.distributed, args.coordinator, args.num_processes,
                                     args.process_id, args.heartbeat_timeout)
    if launch is not None:
        _join(launch)
    if distributed.joined():  # the same settings on every process, before anything else
        from sage_train.run.resolve import agreed_settings

        distributed.same_settings({
            "optimizer": [c.optimizer for c in cfgs],
            **{k: v for k, v in agreed_settings(cfgs[0]).items()
               if k not in ("optimizer", "run_dir")},
            "run_dir": str(pathlib.Path(args.run_dir).absolute()),
            "allow_config_change": args.allow_config_change, "restart": args.restart},
            option_flag)
    made: list[pathlib.Path | None] = []
    try:
        with contextlib.ExitStack() as locks:
            runs = _checked_runs(cfgs, args, locks, made)
            results: list[Any] = []
            for run in runs:
                if signals.received is not None and not distributed.joined():
                    return _stopped_by(signals.received, None)  # (a job: agreed by train)
                status, result = _train_one(run, args, signals, results)
                if result is None:
                    return status
                results.append(result)
    finally:
        from sage_train.store.rundir import remove_unused

        for folder in reversed(made):  # a refused start leaves nothing behind
            remove_unused(folder)
    if not distributed.is_primary():
        return 1 if any(r.stopped_reason for r in results) else 0  # process 0 reports
    return _summary(results, args)


def _join(launch: Any) -> None:
    """Join the job of several processes ``launch`` describes, saying so."""
    from sage_train.job import distributed

    print(f"sage-train: joining the job as {launch.describe()} (waiting up to "
          f"{distributed.INIT_TIMEOUT_S} s for every process)", flush=True)
    distributed.join(launch)  # before anything starts a JAX backend
    if distributed.joined():
        print(f"sage-train: joined the job as {distributed.where().rstrip(': ')} "
              f"({distributed.describe_job()}); "
              + ("this process writes the run's files and log" if distributed.is_primary()
                 else "process 0 writes the run's files and log, this one only its errors")
              + f"; a process that dies stops the others within {launch.heartbeat_timeout} s "
              "(--heartbeat-timeout)", flush=True)


def _checked_runs(cfgs: list[TrainConfig], args: argparse.Namespace,
                  locks: contextlib.ExitStack, made: list[pathlib.Path | None]) -> list[Any]:
    """Every configuration resolved, its run directory locked and checked, before any trains.

    Exit status 2 still means that nothing was trained (in a job: on every process, or on
    none).  ``made`` receives the folders created (:func:`~sage_train.store.rundir.make_run_dir`),
    which a refused start removes again.
    """
    from sage_train.job import distributed
    from sage_train.run.resolve import resolve
    from sage_train.run.resume import preflight
    from sage_train.store.rundir import RunLock, make_run_dir

    with distributed.together("to check the runs"):
        # --attention cudnn where it cannot run: refused before any run directory is made
        runs = [resolve(cfg, checked=True) for cfg in cfgs]
        for run in runs:
            made.append(make_run_dir(run.run_dir))
            if distributed.is_primary():
                lock = locks.enter_context(RunLock(run.run_dir))
                if lock.stale:
                    print(lock.stale, flush=True)
            preflight(run, allow_config_change=args.allow_config_change)
    return runs


def _train_one(run: Any, args: argparse.Namespace, signals: StopSignals,
               results: list[Any]) -> tuple[int, Any]:
    """Train ``run``: ``(0, its result)``, or ``(exit status, None)`` to stop the command.

    The command stops on a signal, or on a refusal after earlier runs trained.
    """
    from sage_train.run.train import train

    try:
        result = train(run, allow_config_change=args.allow_config_change,
                       restart=args.restart, stop=signals, locked=True,
                       data_exclude=[args.run_dir])
    except UserError as e:
        if not results:
            raise
        # refused after earlier runs trained: 2 would say that nothing was
        done = ", ".join(r.config.optimizer for r in results)
        print(f"sage-train: error: {_where()}{e} (trained before it: {done})",
              file=sys.stderr)
        return _leave(1, e), None
    if result.interrupted is not None:
        return _stopped_by(result.interrupted, result.steps_done), None
    return 0, result


def _summary(results: list[Any], args: argparse.Namespace) -> int:
    """Print the summary table and save the loss curve; the exit status."""
    from sage_train.run.train import save_loss_curve

    rows = [(r.config.optimizer, r.steps_done,
             "-" if r.final_test_ppl is None else f"{r.final_test_ppl:.2f}",
             format_bytes(r.opt_state_bytes), f"{r.tokens_per_s:,.0f}",
             "-" if r.mfu is None else f"{100 * r.mfu:.1f}%") for r in results]
    print(format_table(("optimizer", "steps", "test ppl", "optimizer state", "tokens/s", "MFU"),
                       rows))
    print("tokens/s and MFU: training steps only (compilation, evaluation, checkpoints and "
          "the host's logging excluded), as in each run's metrics.jsonl")
    png = pathlib.Path(args.run_dir) / f"{model_label(args.model)}-loss.png"
    try:
        save_loss_curve(results, png)
        print(f"loss curve: {png}")
    except Exception as e:  # noqa: BLE001 - the training is done: a warning, not a failure
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        print(f"sage-train: warning: the loss curve was not saved ({why}); the training "
              "itself succeeded", file=sys.stderr)
    stopped = [r for r in results if r.stopped_reason]
    for r in stopped:
        print(f"{r.config.optimizer}: {r.stopped_reason}", file=sys.stderr)
    return 1 if stopped else 0


if __name__ == "__main__":
    raise SystemExit(main())
