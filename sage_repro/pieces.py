"""The paper's comparison in pieces that each fit one GPU loan, merged into one table.

A lent GPU comes for minutes at a time, on a fresh machine each time, so the comparison is
cut into **pieces**: named groups of runs under one pinned protocol (:class:`PiecePlan`),
each trained by ``sage-repro sweep --piece NAME`` in one short command, whose
``results.json`` comes back and is committed (``benchmarks/paper/NAME/results.json``).
``sage-repro report --pieces benchmarks/paper`` merges every committed piece into one table
and its plots (:func:`merge`), refusing a piece of another protocol or data, and names the
pieces still to run.

**The data travels.** Every piece trains on the same cut (:mod:`sage_train.cut`,
``sage-repro cut-data``), carried to the GPU machine with the working tree; the plan pins
the cut's fingerprint, so a piece on another cut is refused before it trains and again when
merged.

**The paper plan** (:data:`PAPER_PLAN`): the ``20m`` model (the 270M's proportions at a
quarter of its width), 150 steps of 256 x 512 tokens (19,660,800 tokens, one pass over a
20M-token cut), the paper's schedule and hyperparameters, test perplexity every 15 steps on
4 batches, with ``--remat dots`` (XLA:CPU's compile-time plan of this step in bfloat16,
``benchmarks/train_memory_plan.py``: 75.4 GiB with the GPU default ``--remat none``, too
close to an H100's 80 GB; 21.2 GiB with ``dots``, which recomputes, the same math). A piece
is four configurations at one rate with one seed: first the eight configurations at their
paper rates with seed 0 (``p1``, ``p2``), then seeds 1 and 2 at the paper rates (``p3`` to
``p6``), then half and twice the paper rates with seed 0 (``p7`` to ``p10``). The merged
table gives each configuration at its paper rate, mean ± sd over the seeds done; the rate
pieces give the learning-rate table (and flag a configuration whose best rate is not its
paper rate).

**Why four runs a piece.** On an H100 a run of the ``20m`` model costs about 10-25 s of
training (6·N·D = 2.1e15 FLOP at 100-200 TFLOP/s) but about 30-60 s of process start,
compilation and checkpoints, so eight runs would need 6-11 minutes and a piece must finish
within about 8 (what comes back from an unfinished piece is what finished). Four runs need
3-6 minutes; ``scripts/paper-piece`` runs a further piece in the same command when the time
left allows (:func:`estimate` gives the planned time of each piece).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_repro import spec as sweep_spec
from sage_repro import sweep_report as report
from sage_train.model_shapes import get_model_config

DEFAULT_PIECES = pathlib.Path("benchmarks/paper")
"""Where the pieces' ``results.json`` are committed (``NAME/results.json``) and merged."""
DEFAULT_RUNS = pathlib.Path("runs/pieces")
"""Where ``sage-repro sweep --piece NAME`` trains (``NAME/``) unless ``--out`` says."""
RUN_OVERHEAD_S = 45.0
"""The assumed seconds of a run outside its steps and evaluations on a GPU: the trainer
process's start (about 10 s), compiling the train and evaluation steps (20-40 s) and its
checkpoint (``--assume-overhead``)."""
PIECE_OVERHEAD_S = 15.0
"""The assumed seconds of a piece outside its runs: the harness's device probe (a child
process that starts JAX) and its report with plots."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """One piece: configurations at a multiple of their paper rates, with seeds."""

    name: str
    configs: tuple[str, ...]
    seeds: tuple[int, ...] = (0,)
    lr_factor: float = 1.0

    def plan(self) -> sweep_spec.Plan:
        """The :class:`~sage_repro.sweep_spec.Plan` the sweep trains for this piece."""
        reference = sweep_spec.PAPER_REFERENCE if sweep_spec.PAPER_REFERENCE in self.configs else (
            "slowest")
        return sweep_spec.Plan(configs=self.configs, seeds=self.seeds,
                          lr_factors=(self.lr_factor,), reference=reference, piece=self.name)

    def specs(self) -> list[sweep_spec.RunSpec]:
        """The piece's runs."""
        return self.plan().grid()

    def describe(self) -> str:
        """``seed 0, 1x the paper rates: sage-hybrid, lion-hybrid, adamw, lion``."""
        seeds = ", ".join(str(s) for s in self.seeds)
        return (f"seed{'s' if len(self.seeds) > 1 else ''} {seeds}, {self.lr_factor:g}x the "
                f"paper rates: {', '.join(self.configs)}")


@dataclasses.dataclass(frozen=True)
class PiecePlan:
    """A comparison in pieces: one protocol, the pieces, and the data they all train on.

    Attributes:
      name: the plan's name (in the reports).
      protocol: what every run of every piece shares; ``protocol.data`` is the cut.
      pieces: the pieces, in the order to run them.
      fingerprint: the cut's fingerprint every piece must train on (``None``: the first
        merged piece's).
      reference: the effective throughput's baseline in the merged table.
    """

    name: str
    protocol: sweep_spec.Protocol
    pieces: tuple[Piece, ...]
    fingerprint: str | None = None
    reference: str = sweep_spec.PAPER_REFERENCE

    def piece(self, name: str) -> Piece:
        """The piece called ``name``.

        Raises:
          SweepError: no such piece (the valid names listed).
        """
        for piece in self.pieces:
            if piece.name == name:
                return piece
        raise sweep_spec.SweepError(f"--piece {name} is not a piece of the plan {self.name}: "
                               f"{', '.join(p.name for p in self.pieces)}")

    def to_json(self) -> dict[str, Any]:
        """The plan as JSON-ready data (what :meth:`from_json` reads)."""
        return {"name": self.name, "protocol": dataclasses.asdict(self.protocol),
                "pieces": [dataclasses.asdict(p) for p in self.pieces],
                "fingerprint": self.fingerprint, "reference": self.reference}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PiecePlan:
        """The plan of :meth:`to_json`'s data, every field checked (:func:`check_plan_data`).

        Raises:
          ValueError: the data is not a valid plan (one line naming the field).
        """
        check_plan_data(data)
        pieces = tuple(Piece(str(p["name"]), tuple(p["configs"]), tuple(p["seeds"]),
                             float(p["lr_factor"])) for p in data["pieces"])
        return cls(str(data["name"]), sweep_spec.Protocol.from_dict(data["protocol"]), pieces,
                   data.get("fingerprint"), str(data.get("reference", sweep_spec.PAPER_REFERENCE)))


_PLAN_KEYS = frozenset({"name", "protocol", "pieces", "fingerprint", "reference"})
_PIECE_KEYS = frozenset({"name", "configs", "seeds", "lr_factor"})
_PROTOCOL_REQUIRED = ("model", "data", "steps", "batch_size", "seq_len", "eval_every",
                      "eval_batches", "log_every", "checkpoint_every")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_protocol(protocol: Any) -> None:
    """Refuse a protocol field of the wrong type or range, as ``sage-train`` would."""
    from sage_train.config import SETTING_CHECKS, options  # the trainer's own checks

    if not isinstance(protocol, Mapping):
        raise ValueError(f"protocol must be an object, got {type(protocol).__name__}")
    fields = {f.name for f in dataclasses.fields(sweep_spec.Protocol)}
    unknown = sorted(set(protocol) - fields)
    if unknown:
        raise ValueError(f"protocol.{unknown[0]} is not a protocol field (fields: "
                         f"{', '.join(sorted(fields))})")
    for key in _PROTOCOL_REQUIRED:
        if key not in protocol:
            raise ValueError(f"protocol.{key} is missing")
    for key, value in protocol.items():
        if key == "data":
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"protocol.data must be a path (a string) or null, got "
                                 f"{value!r}")
        elif key in SETTING_CHECKS and value is not None:
            ok, what = SETTING_CHECKS[key]
            if not ok(value):
                raise ValueError(f"protocol.{key} must be {what}, got {value!r}")
    choices = options()["schedule"].choices or ()
    if protocol.get("schedule", "cosine") not in choices:
        raise ValueError(f"protocol.schedule must be one of {', '.join(choices)}, got "
                         f"{protocol['schedule']!r}")
    _check_model_and_args(protocol)


def _check_model_and_args(protocol: Mapping[str, Any]) -> None:
    """Refuse an unknown model, a sequence beyond its context, ``trainer_args`` not a list."""
    if not isinstance(protocol["model"], str):
        raise ValueError(f"protocol.model must be a model name, got {protocol['model']!r}")
    try:
        model = get_model_config(protocol["model"])
    except ValueError as e:
        raise ValueError(f"protocol.model: {e}") from None
    if protocol["seq_len"] > model.max_position_embeddings:
        raise ValueError(f"protocol.seq_len {protocol['seq_len']} is longer than the "
                         f"{protocol['model']} model's context of "
                         f"{model.max_position_embeddings} positions")
    args = protocol.get("trainer_args", [])
    if not isinstance(args, list | tuple) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"protocol.trainer_args must be a list of strings (one per "
                         f"sage-train argument, [\"--remat\", \"dots\"]), got {args!r}")
    for flag in args:
        if flag.split("=", 1)[0] in sweep_spec.MANAGED:
            raise ValueError(f"protocol.trainer_args sets {flag.split('=', 1)[0]}, which the "
                             "protocol's own fields set")


def _check_piece(i: int, piece: Any) -> str:
    """Refuse a piece of the wrong shape; its name."""
    where = f"pieces[{i}]"
    if not isinstance(piece, Mapping):
        raise ValueError(f"{where} must be an object, got {type(piece).__name__}")
    unknown = sorted(set(piece) - _PIECE_KEYS)
    if unknown:
        raise ValueError(f"{where}.{unknown[0]} is not a piece field (fields: "
                         f"{', '.join(sorted(_PIECE_KEYS))})")
    for key in sorted(_PIECE_KEYS):
        if key not in piece:
            raise ValueError(f"{where}.{key} is missing")
    name = piece["name"]
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ValueError(f"{where}.name must be a non-empty name (no '/'), got {name!r}")
    configs = piece["configs"]
    if not isinstance(configs, list | tuple) or not configs:
        raise ValueError(f"{where}.configs (piece {name}) must be a non-empty list of "
                         f"configurations, got {configs!r}")
    for c in configs:
        if c not in CONFIG_NAMES:
            raise ValueError(f"{where}.configs (piece {name}): unknown configuration {c!r} "
                             f"(the configurations: {', '.join(CONFIG_NAMES)})")
    if len(set(configs)) != len(configs):
        raise ValueError(f"{where}.configs (piece {name}) names a configuration twice")
    seeds = piece["seeds"]
    if (not isinstance(seeds, list | tuple) or not seeds
            or not all(_is_int(x) and 0 <= x < 2**32 for x in seeds)
            or len(set(seeds)) != len(seeds)):
        raise ValueError(f"{where}.seeds (piece {name}) must be a non-empty list of distinct "
                         f"integers in [0, 2^32), got {seeds!r}")
    factor = piece["lr_factor"]
    if not _is_number(factor) or factor <= 0:
        raise ValueError(f"{where}.lr_factor (piece {name}) must be a finite number > 0, got "
                         f"{factor!r}")
    return name


def check_plan_data(data: Any) -> None:
    """Refuse plan data (a ``--plan`` file's JSON) that is not a valid plan of pieces.

    Checked before anything runs, the dry run included: the fields and their types, the
    protocol's values against the trainer's own ranges (``steps`` a positive integer,
    ``eval_every`` >= 1, a known ``model`` and ``schedule``, ``trainer_args`` a list of
    strings), each piece's known configurations, distinct seeds and a positive
    ``lr_factor``, and piece names that are unique.

    Raises:
      ValueError: one line naming the first field that is wrong.
    """
    if not isinstance(data, Mapping):
        raise ValueError(f"a plan is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - _PLAN_KEYS)
    if unknown:
        raise ValueError(f"{unknown[0]} is not a plan field (fields: "
                         f"{', '.join(sorted(_PLAN_KEYS))})")
    for key in ("name", "protocol", "pieces"):
        if key not in data:
            raise ValueError(f"{key} is missing")
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise ValueError(f"name must be a non-empty string, got {data['name']!r}")
    _check_protocol(data["protocol"])
    pieces = data["pieces"]
    if not isinstance(pieces, list) or not pieces:
        raise ValueError(f"pieces must be a non-empty list, got {pieces!r}")
    seen: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        name = _check_piece(i, piece)
        if name in seen:
            raise ValueError(f"pieces[{i}].name {name!r} is the name of pieces[{seen[name]}] "
                             "too: every piece needs a name of its own")
        seen[name] = i
    fingerprint = data.get("fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise ValueError(f"fingerprint must be a cut's fingerprint (a string) or null, got "
                         f"{fingerprint!r}")
    reference = data.get("reference", sweep_spec.PAPER_REFERENCE)
    if reference not in (*CONFIG_NAMES, "slowest"):
        raise ValueError(f"reference must be a configuration or 'slowest', got {reference!r}")


def load_plan(path: pathlib.Path | None) -> PiecePlan:
    """The plan in the JSON file ``path`` (``--plan``), or :data:`PAPER_PLAN`.

    Raises:
      SweepError: the file cannot be read or holds no plan (one line naming it).
    """
    if path is None:
        return PAPER_PLAN
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise sweep_spec.SweepError(f"--plan {path} cannot be read: {e.strerror or e}") from None
    except ValueError as e:
        raise sweep_spec.SweepError(f"--plan {path} is not JSON ({e})") from None
    try:
        return PiecePlan.from_json(data)
    except (ValueError, KeyError, TypeError) as e:
        raise sweep_spec.SweepError(f"--plan {path}: {e}") from None


_HALVES = (("sage-hybrid", "lion-hybrid", "adamw", "lion"),
           ("sinkgd-hybrid", "sinkgd-pure", "sage-pure", "apollo"))

PAPER_PLAN = PiecePlan(
    name="paper-20m",
    protocol=sweep_spec.Protocol(model="20m", data=str(sweep_spec.DEFAULT_CUT), steps=150,
                            batch_size=256, seq_len=sweep_spec.PAPER_SEQ_LEN, eval_every=15,
                            eval_batches=4, log_every=5, checkpoint_every=150,
                            trainer_args=("--remat", "dots")),
    pieces=tuple(
        Piece(f"p{2 * i + j + 1}", half, (seed,), factor)
        for i, (seed, factor) in enumerate(((0, 1.0), (1, 1.0), (2, 1.0), (0, 0.5), (0, 2.0)))
        for j, half in enumerate(_HALVES)),
    fingerprint="efe12fac454651ee4e1025719105ab30181622904483f8f0177934c5fe4c3417",
)
"""The paper's comparison on one H100 in pieces of about four minutes (module docstring)."""


# ---------------------------------------------------------------------------
# the sweep's --piece
# ---------------------------------------------------------------------------

PINNED = ("model", "data", "configs", "seeds", "lrs", "lr_factors", "best_seeds", "top",
          "reference", "steps", "tokens", "tokens_per_step", "batch_size", "seq_len",
          "warmup_frac", "final_lr_frac", "clip", "b1", "b2", "weight_decay", "eval_every",
          "eval_batches", "log_every", "checkpoint_every")
"""``sage-repro sweep`` options a piece sets itself (refused beside ``--piece``)."""


def check_pinned(args: Any, defaults: Mapping[str, Any]) -> None:
    """Refuse an option of :data:`PINNED` given beside ``--piece``.

    Raises:
      SweepError: naming the first such option.
    """
    for dest in PINNED:
        if getattr(args, dest) != defaults[dest]:
            raise sweep_spec.SweepError(f"--piece fixes --{dest.replace('_', '-')} (the plan's "
                                   "protocol): leave it out")


def piece_setup(plan: PiecePlan, name: str, trainer_args: Sequence[str]
                ) -> tuple[sweep_spec.Protocol, sweep_spec.Plan]:
    """The protocol and sweep plan of piece ``name`` (options after ``--`` added)."""
    for flag in trainer_args:
        if flag.split("=", 1)[0] in sweep_spec.MANAGED:
            raise sweep_spec.SweepError(f"{flag.split('=', 1)[0]} after -- is set by the plan of "
                                   "pieces itself")
    protocol = dataclasses.replace(plan.protocol, trainer_args=(
        *plan.protocol.trainer_args, *trainer_args))
    return protocol, plan.piece(name).plan()


def check_data(plan: PiecePlan, piece: str) -> None:
    """Refuse to train ``piece`` on a missing cut, or on one of another fingerprint.

    Only the manifest is read here; the trainer checks every file of the cut.

    Raises:
      SweepError: one line naming the cut's folder.
    """
    from sage_train.cut import MANIFEST  # numpy-free module constant, imported when used

    data = plan.protocol.data
    if data is None or plan.fingerprint is None:
        return
    try:
        found = json.loads((pathlib.Path(data) / MANIFEST).read_text())["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        raise sweep_spec.SweepError(
            f"--piece {piece} trains on the cut {data}, which is missing or damaged: make it "
            f"with sage-repro cut-data --out {data} where the plan's cut was made (the pieces "
            "share its tokens) and carry the folder to this machine") from None
    if found != plan.fingerprint:
        raise sweep_spec.SweepError(
            f"{data} holds the cut {str(found)[:16]}, but the pieces of {plan.name} train on "
            f"{plan.fingerprint[:16]}: carry that cut (or give --plan a plan of this one)")


def run_flops(protocol: sweep_spec.Protocol) -> tuple[float, float]:
    """A run's training FLOPs (6·N·D) and its evaluations' (2·N per token evaluated)."""
    n = get_model_config(protocol.model).param_count()
    evaluations = math.ceil(protocol.steps / protocol.eval_every)
    eval_tokens = evaluations * protocol.eval_batches * protocol.tokens_per_step
    return 6.0 * n * protocol.steps * protocol.tokens_per_step, 2.0 * n * eval_tokens


def estimate(protocol: sweep_spec.Protocol, piece: Piece, tflops: float,
             overhead_s: float = RUN_OVERHEAD_S) -> float:
    """The planned seconds of ``piece`` (an estimate, not a measurement).

    Its runs at ``tflops`` achieved TFLOP/s (:func:`run_flops`), each with ``overhead_s``
    seconds of start-up, compilation and checkpoints, plus :data:`PIECE_OVERHEAD_S`.
    """
    train, evals = run_flops(protocol)
    per_run = overhead_s + (train + evals) / (tflops * 1e12)
    return PIECE_OVERHEAD_S + len(piece.specs()) * per_run


def dry_run(plan: PiecePlan, names: Sequence[str], tflops: float | None, overhead_s: float,
            say: Callable[[str], None]) -> None:
    """Print the runs of the pieces ``names`` and, with ``tflops``, each one's planned time."""
    p = plan.protocol
    n = get_model_config(p.model).param_count()
    train, evals = run_flops(p)
    say(f"plan {plan.name}: {len(plan.pieces)} pieces; model {p.model} ({n:,} parameters) on "
        f"{p.data}" + (f" (cut {plan.fingerprint[:16]})" if plan.fingerprint else "")
        + f"; each run {p.steps:,} steps x {p.tokens_per_step:,} tokens = "
        f"{p.steps * p.tokens_per_step:,} tokens, 6·N·D = {train:.3g} FLOP, evaluations "
        f"{evals:.3g} FLOP")
    if tflops is not None:
        say(f"ESTIMATE, not a measurement: {tflops:g} TFLOP/s achieved, {overhead_s:g} s a run "
            f"for start-up, compilation and checkpoints, {PIECE_OVERHEAD_S:g} s a piece")
    total = 0.0
    for name in names:
        piece = plan.piece(name)
        runs = ", ".join(f"{s.config} {s.lr:g}" for s in piece.specs())
        line = f"  {name}: {len(piece.specs())} runs, seed {'/'.join(map(str, piece.seeds))}"
        line += f", {piece.lr_factor:g}x paper rates ({runs})"
        if tflops is not None:
            seconds = estimate(p, piece, tflops, overhead_s)
            total += seconds
            line += f": {seconds / 60:.1f} min"
        say(line)
    if tflops is not None and len(names) > 1:
        say(f"in all {total / 60:.1f} min")


# ---------------------------------------------------------------------------
# merging the pieces
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Found:
    """A piece's ``results.json``: its file and its runs."""

    piece: Piece
    path: pathlib.Path
    setup: Mapping[str, Any]
    runs: tuple[report.RunRecord, ...]


def read_piece(path: pathlib.Path, plan: PiecePlan, fingerprint: str | None) -> Found:
    """The piece in ``path``, checked against ``plan`` and the data ``fingerprint``.

    Raises:
      SweepError: one line naming ``path`` and what differs.
    """
    try:
        data = json.loads(path.read_text())
        setup = data["setup"]
        name = setup["piece"]
        protocol = sweep_spec.Protocol.from_dict(setup)
        runs = {(r["config"], r["lr"], r["seed"]): report.run_from_json(r)
                for section in (data["rows"], data["lr_sweep"]) for row in section
                for r in row["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise sweep_spec.SweepError(f"{path} is not a piece's results.json ({e})") from None
    try:
        report.verify_results(data)  # its records, their summary and its digest agree
    except (ValueError, KeyError, TypeError) as e:
        raise sweep_spec.SweepError(f"{path}: {e}") from None
    if name is None:
        raise sweep_spec.SweepError(f"{path} is not a piece's results.json (it names no piece)")
    try:
        piece = plan.piece(str(name))
    except sweep_spec.SweepError:
        raise sweep_spec.SweepError(f"{path} is piece {name}, which the plan {plan.name} does not "
                               "have") from None
    diff = sweep_spec.protocol_diff(dataclasses.asdict(plan.protocol), dataclasses.asdict(protocol))
    if diff:
        raise sweep_spec.SweepError(f"{path} was trained under another protocol than the plan "
                               f"{plan.name}: {diff[0]} (the plan's -> the piece's)")
    prints = list(setup.get("data_fingerprints") or [])
    if len(prints) > 1 or (fingerprint is not None and prints and prints[0] != fingerprint):
        raise sweep_spec.SweepError(f"{path} was trained on data of fingerprint "
                               f"{', '.join(p[:16] for p in prints)}, not "
                               f"{(fingerprint or '?')[:16]} (data_fingerprints)")
    planned = {(s.config, s.lr, s.seed) for s in piece.specs()}
    extra = sorted(set(runs) - planned)
    if extra:
        c, lr, seed = extra[0]
        raise sweep_spec.SweepError(f"{path} holds a run the plan's piece {name} has not: {c} lr "
                               f"{lr:g} seed {seed}")
    return Found(piece, path, setup, tuple(runs.values()))


def find_pieces(folder: pathlib.Path, plan: PiecePlan) -> list[Found]:
    """Every piece's ``results.json`` under ``folder`` (not ``folder/results.json``).

    Raises:
      SweepError: a piece that :func:`read_piece` refuses, or one piece found twice.
    """
    found: list[Found] = []
    fingerprint = plan.fingerprint
    for path in sorted(folder.rglob("results.json")):
        if path.parent == folder:
            continue  # the merged report itself
        piece = read_piece(path, plan, fingerprint)
        twin = next((f for f in found if f.piece.name == piece.piece.name), None)
        if twin is not None:
            raise sweep_spec.SweepError(f"piece {piece.piece.name} is there twice: {twin.path} "
                                   f"and {path}; keep one")
        if fingerprint is None and piece.setup.get("data_fingerprints"):
            fingerprint = piece.setup["data_fingerprints"][0]
        found.append(piece)
    return found


def _progress(plan: PiecePlan, found: Sequence[Found]) -> list[dict[str, Any]]:
    """Each piece of the plan: done, partial (its finished or diverged runs) or missing."""
    by_name = {f.piece.name: f for f in found}
    out = []
    for piece in plan.pieces:
        f = by_name.get(piece.name)
        done = 0 if f is None else sum(r.status in ("finished", "diverged") for r in f.runs)
        n = len(piece.specs())
        state = "missing" if f is None else "done" if done == n else "partial"
        out.append({"piece": piece.name, "state": state, "runs_done": done, "runs": n,
                    "what": piece.describe(),
                    "file": None if f is None else str(f.path),
                    "hardware": None if f is None else next(
                        (report.describe_hardware(r.environment) for r in f.runs
                         if r.environment), None)})
    return out


def merge(folder: pathlib.Path, plan: PiecePlan) -> tuple[report.Summary, list[dict[str, Any]]]:
    """The merged table of the pieces under ``folder``, and each piece's progress.

    Each configuration's row is at its paper rate (the pieces' 1x), with every seed the plan
    has there (a seed not yet trained shows as not started); the learning-rate table holds
    every rate of a configuration with the seeds the plan trains at all of its rates.

    Raises:
      SweepError: a piece refused by :func:`find_pieces`.
    """
    found = find_pieces(folder, plan)
    runs = {(r.config, r.lr, r.seed): r for f in found for r in f.runs}
    planned = [s for piece in plan.pieces for s in piece.specs()]
    protocol = plan.protocol

    def record(spec: sweep_spec.RunSpec) -> report.RunRecord:
        return runs.get((spec.config, spec.lr, spec.seed)) or report.RunRecord(
            spec.config, spec.lr, spec.seed, pathlib.Path("-"), protocol.steps, "not started")

    configs = [c for c in CONFIG_NAMES if any(s.config == c for s in planned)]
    cells = {}
    for config in configs:
        mine = [s for s in planned if s.config == config]
        rates = sorted({s.lr for s in mine})
        shared = set.intersection(*({s.seed for s in mine if s.lr == lr} for lr in rates))
        for lr in rates:
            cells[(config, lr)] = tuple(record(sweep_spec.RunSpec(config, lr, seed))
                                        for seed in sorted(shared))
    best = report.best_rates(cells)
    rows = []
    for config in configs:
        lr = sweep_spec.canonical_lr(get_preset(config).learning_rate)
        seeds = sorted({s.seed for s in planned if s.config == config and s.lr == lr})
        remark = ""
        if best.get(config) is not None and best[config] != lr:
            remark = f"best rate of the rate pieces: {best[config]:g}"
        rows.append(report.Row(config, lr, tuple(record(sweep_spec.RunSpec(config, lr, s))
                                                 for s in seeds), remark=remark))
    reference = plan.reference if plan.reference in configs else "slowest"
    setup = {**protocol.setup(), "plan": plan.name,
             "data_fingerprints": sorted({p for f in found
                                          for p in f.setup.get("data_fingerprints") or []}),
             "data_tokens": next((f.setup["data_tokens"] for f in found
                                  if f.setup.get("data_tokens")), None)}
    return report.summarize(rows, cells, reference, setup), _progress(plan, found)


def progress_lines(progress: Sequence[Mapping[str, Any]], command: str) -> list[str]:
    """The pieces merged and those still to run, with the command of each."""
    lines = []
    for p in progress:
        if p["state"] == "done":
            lines.append(f"- {p['piece']} ({p['what']}): done, {p['hardware'] or '?'} "
                         f"(`{p['file']}`)")
        else:
            state = ("not run yet" if p["state"] == "missing" else
                     f"partial, {p['runs_done']}/{p['runs']} runs done: run it again")
            lines.append(f"- {p['piece']} ({p['what']}): {state}: `{command} {p['piece']} "
                         "OUT_DIR`")
    return lines


COMMAND = "scripts/paper-piece"
"""The command that trains a piece on a GPU machine and copies its results out."""


def write_merged(folder: pathlib.Path, plan: PiecePlan) -> tuple[report.Summary, str]:
    """Merge the pieces under ``folder`` into its ``results.md``, ``results.json``, figures.

    Returns the summary and the markdown.
    """
    from sage_train.rundir import atomic_write_text

    summary, progress = merge(folder, plan)
    figures = report.write_figures(summary, folder)
    done = sum(p["state"] == "done" for p in progress)
    parts = [f"# The paper's comparison in pieces: plan {plan.name}", "",
             f"{done} of {len(progress)} pieces done; each piece's own `results.json` is in "
             "its folder. Written by `sage-repro report --pieces` from the pieces alone.", "",
             "## Pieces", "", *progress_lines(progress, COMMAND), "",
             report.to_markdown(summary, figures).replace("# Sweep results", "## Merged table",
                                                          1)]
    markdown = "\n".join(parts)
    atomic_write_text(folder / "results.md", markdown)
    atomic_write_text(folder / "results.json", json.dumps(
        {**report.to_json(summary, figures), "plan": plan.to_json(), "pieces": progress},
        indent=2) + "\n")
    return summary, markdown
