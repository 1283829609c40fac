"""The paper's comparison in pieces that each fit one GPU loan, merged into one table.

A lent GPU comes for minutes at a time, on a fresh machine each time, so the comparison is
cut into **pieces**: named groups of runs under one pinned protocol (:class:`PiecePlan`),
each trained by ``sage-repro sweep --piece NAME`` in one short command, whose
``results.json`` comes back and is committed (``benchmarks/paper/NAME/results.json``).
``sage-repro report --pieces benchmarks/paper`` merges every committed piece into one table
and its plots (:func:`merge`), refusing a piece of another protocol or data, and names the
pieces still to run.

**The data travels.** Every piece trains on the same cut (:mod:`sage_train.data.cut`,
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
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Any

from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_repro import spec as sweep_spec
from sage_repro import sweep_report as report
from sage_train.model.shapes import get_model_config

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
    """One piece: configurations at multiples of their paper rates, with seeds.

    Attributes:
      name: the piece's name (``sage-repro sweep --piece NAME``).
      configs: its configurations.
      seeds: the seeds of every run.
      lr_factor: the one multiple of each configuration's paper rate (without
        ``lr_factors``).
      lr_factors: several multiples, a learning-rate sweep (``()``: ``lr_factor`` alone).
      stage: ``"rates"`` (the rates above), ``"widen"`` (one rate beyond the edge of its one
        configuration's sweep where the best rate sits, none when it sits inside:
        :func:`widened_rate`) or ``"best"`` (its one configuration's best rate over the rate
        and widening pieces: :func:`resolve`). The last two are known only from the pieces
        done before.
    """

    name: str
    configs: tuple[str, ...]
    seeds: tuple[int, ...] = (0,)
    lr_factor: float = 1.0
    lr_factors: tuple[float, ...] = ()
    stage: str = "rates"

    @property
    def factors(self) -> tuple[float, ...]:
        """The multiples of the paper rates this piece trains (a ``"rates"`` piece)."""
        return self.lr_factors or (self.lr_factor,)

    def plan(self, lrs: tuple[float, ...] | None = None) -> sweep_spec.Plan:
        """The :class:`~sage_repro.sweep_spec.Plan` the sweep trains for this piece.

        ``lrs``: the rates of a ``"widen"`` or ``"best"`` piece (:func:`resolve`); a
        ``"rates"`` piece takes its own.
        """
        reference = sweep_spec.PAPER_REFERENCE if sweep_spec.PAPER_REFERENCE in self.configs else (
            "slowest")
        if self.stage != "rates":
            return sweep_spec.Plan(configs=self.configs, seeds=self.seeds, lrs=lrs or (),
                                   reference=reference, piece=self.name)
        return sweep_spec.Plan(configs=self.configs, seeds=self.seeds,
                               lr_factors=self.factors, reference=reference, piece=self.name)

    def specs(self, lrs: tuple[float, ...] | None = None) -> list[sweep_spec.RunSpec]:
        """The piece's runs (a ``"widen"`` or ``"best"`` piece: at ``lrs``)."""
        return self.plan(lrs).grid()

    def planned_runs(self) -> int:
        """How many runs the piece trains (a ``"widen"`` piece: at most)."""
        per = len(self.factors) if self.stage == "rates" else 1
        return len(self.configs) * len(self.seeds) * per

    def describe(self) -> str:
        """``seed 0, 1x the paper rates: sage-hybrid, lion-hybrid, adamw, lion``."""
        seeds = ", ".join(str(s) for s in self.seeds)
        label = f"seed{'s' if len(self.seeds) > 1 else ''} {seeds}"
        if self.stage == "widen":
            return (f"{label}, one rate beyond the edge of the sweep if best there: "
                    f"{self.configs[0]}")
        if self.stage == "best":
            return f"{label} at the best rate of the sweep: {self.configs[0]}"
        factors = "/".join(f"{f:g}" for f in self.factors)
        return f"{label}, {factors}x the paper rates: {', '.join(self.configs)}"


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
      rows: the merged table's rate per configuration: ``"paper"`` its paper rate,
        ``"best"`` its best rate over the rate and widening pieces.
      folder: where the plan's pieces are committed (``benchmarks/paper``): the
        ``"widen"`` and ``"best"`` pieces read the pieces done before there and under
        :data:`DEFAULT_RUNS`.
      pack: the committed pack its cut is made of (``sage-repro cut-data --plan``;
        :mod:`sage_train.data.pack`), or ``None`` (a cut carried from where it was made).
    """

    name: str
    protocol: sweep_spec.Protocol
    pieces: tuple[Piece, ...]
    fingerprint: str | None = None
    reference: str = sweep_spec.PAPER_REFERENCE
    rows: str = "paper"
    folder: str = str(DEFAULT_PIECES)
    pack: str | None = None

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
                "fingerprint": self.fingerprint, "reference": self.reference,
                "rows": self.rows, "folder": self.folder, "pack": self.pack}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PiecePlan:
        """The plan of :meth:`to_json`'s data, every field checked (:func:`check_plan_data`).

        Raises:
          ValueError: the data is not a valid plan (one line naming the field).
        """
        check_plan_data(data)
        pieces = tuple(Piece(str(p["name"]), tuple(p["configs"]), tuple(p["seeds"]),
                             float(p["lr_factor"]), tuple(p.get("lr_factors", ())),
                             str(p.get("stage", "rates"))) for p in data["pieces"])
        return cls(str(data["name"]), sweep_spec.Protocol.from_dict(data["protocol"]), pieces,
                   data.get("fingerprint"), str(data.get("reference", sweep_spec.PAPER_REFERENCE)),
                   str(data.get("rows", "paper")), str(data.get("folder", DEFAULT_PIECES)),
                   data.get("pack"))


_PLAN_KEYS = frozenset({"name", "protocol", "pieces", "fingerprint", "reference", "rows",
                        "folder", "pack"})
_PIECE_KEYS = frozenset({"name", "configs", "seeds", "lr_factor"})
_PIECE_OPTIONAL = frozenset({"lr_factors", "stage"})
STAGES = ("rates", "widen", "best")
"""A piece's stages (:class:`Piece`)."""
_PROTOCOL_REQUIRED = ("model", "data", "steps", "batch_size", "seq_len", "eval_every",
                      "eval_batches", "log_every", "checkpoint_every")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _check_fields(obj: Mapping[str, Any], prefix: str, kind: str, known: Set[str],
                  required: Sequence[str]) -> None:
    """Refuse an unknown field of ``obj``, then a missing one of ``required`` (in its order).

    ``prefix`` leads each field's name in the message (``"protocol."``).
    """
    unknown = sorted(set(obj) - known)
    if unknown:
        raise ValueError(f"{prefix}{unknown[0]} is not a {kind} field (fields: "
                         f"{', '.join(sorted(known))})")
    for key in required:
        if key not in obj:
            raise ValueError(f"{prefix}{key} is missing")


def _check_protocol(protocol: Any) -> None:
    """Refuse a protocol field of the wrong type or range, as ``sage-train`` would."""
    from sage_train.run.config import SETTING_CHECKS, options  # the trainer's own checks

    if not isinstance(protocol, Mapping):
        raise ValueError(f"protocol must be an object, got {type(protocol).__name__}")
    fields = {f.name for f in dataclasses.fields(sweep_spec.Protocol)}
    _check_fields(protocol, "protocol.", "protocol", fields, _PROTOCOL_REQUIRED)
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
    _check_fields(piece, f"{where}.", "piece", _PIECE_KEYS | _PIECE_OPTIONAL, sorted(_PIECE_KEYS))
    name = piece["name"]
    if not isinstance(name, str) or not name.strip() or "/" in name:
        raise ValueError(f"{where}.name must be a non-empty name (no '/'), got {name!r}")
    _check_configs(where, name, piece["configs"])
    _check_seeds_and_rates(where, name, piece)
    _check_stage(where, name, piece)
    return name


def _check_configs(where: str, name: str, configs: Any) -> None:
    """Refuse a piece's ``configs`` that is not a non-empty list of distinct configurations."""
    if not isinstance(configs, list | tuple) or not configs:
        raise ValueError(f"{where}.configs (piece {name}) must be a non-empty list of "
                         f"configurations, got {configs!r}")
    for c in configs:
        if c not in CONFIG_NAMES:
            raise ValueError(f"{where}.configs (piece {name}): unknown configuration {c!r} "
                             f"(the configurations: {', '.join(CONFIG_NAMES)})")
    if len(set(configs)) != len(configs):
        raise ValueError(f"{where}.configs (piece {name}) names a configuration twice")


def _check_seeds_and_rates(where: str, name: str, piece: Mapping[str, Any]) -> None:
    """Refuse a piece's seeds, ``lr_factor`` or ``lr_factors`` of the wrong type or range."""
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
    factors = piece.get("lr_factors", [])
    if (not isinstance(factors, list | tuple) or not all(_is_number(f) and f > 0 for f in factors)
            or len(set(factors)) != len(factors)):
        raise ValueError(f"{where}.lr_factors (piece {name}) must be a list of distinct finite "
                         f"numbers > 0, got {factors!r}")


def _check_stage(where: str, name: str, piece: Mapping[str, Any]) -> None:
    """Refuse an unknown ``stage``, or a widening/best piece of more than one configuration."""
    stage = piece.get("stage", "rates")
    if stage not in STAGES:
        raise ValueError(f"{where}.stage (piece {name}) must be one of {', '.join(STAGES)}, got "
                         f"{stage!r}")
    if stage != "rates" and len(piece["configs"]) != 1:
        raise ValueError(f"{where}.configs (piece {name}): a {stage!r} piece has one "
                         f"configuration, got {len(piece['configs'])}")


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
    _check_fields(data, "", "plan", _PLAN_KEYS, ("name", "protocol", "pieces"))
    if not isinstance(data["name"], str) or not data["name"].strip():
        raise ValueError(f"name must be a non-empty string, got {data['name']!r}")
    _check_protocol(data["protocol"])
    _check_pieces(data["pieces"])
    _check_plan_options(data)


def _check_pieces(pieces: Any) -> None:
    """Refuse ``pieces`` that is not a non-empty list of valid pieces with names of their own."""
    if not isinstance(pieces, list) or not pieces:
        raise ValueError(f"pieces must be a non-empty list, got {pieces!r}")
    seen: dict[str, int] = {}
    for i, piece in enumerate(pieces):
        name = _check_piece(i, piece)
        if name in seen:
            raise ValueError(f"pieces[{i}].name {name!r} is the name of pieces[{seen[name]}] "
                             "too: every piece needs a name of its own")
        seen[name] = i


def _check_plan_options(data: Mapping[str, Any]) -> None:
    """Refuse a plan's optional field (fingerprint, reference, rows, folder, pack) that is wrong."""
    fingerprint = data.get("fingerprint")
    if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
        raise ValueError(f"fingerprint must be a cut's fingerprint (a string) or null, got "
                         f"{fingerprint!r}")
    reference = data.get("reference", sweep_spec.PAPER_REFERENCE)
    if reference not in (*CONFIG_NAMES, "slowest"):
        raise ValueError(f"reference must be a configuration or 'slowest', got {reference!r}")
    if data.get("rows", "paper") not in ("paper", "best"):
        raise ValueError(f"rows must be 'paper' or 'best', got {data['rows']!r}")
    folder = data.get("folder", str(DEFAULT_PIECES))
    if not isinstance(folder, str) or not folder.strip():
        raise ValueError(f"folder must be a path (a string), got {folder!r}")
    packed = data.get("pack")
    if packed is not None and (not isinstance(packed, str) or not packed.strip()):
        raise ValueError(f"pack must be a path (a string) or null, got {packed!r}")


def load_plan(path: pathlib.Path | None) -> PiecePlan:
    """The plan in the JSON file ``path`` (``--plan``), or :data:`PAPER_PLAN`.

    Raises:
      SweepError: the file cannot be read or holds no plan (one line naming it).
    """
    if path is None:
        return PAPER_PLAN
    if str(path) in PLANS and not path.exists():
        return PLANS[str(path)]
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
"""The paper's comparison on one H100 in pieces of about four minutes (module docstring).

Its cut (``data/paper-cut``, the fingerprint above) was taken from the ``installed`` corpus
of the machine that ran its pieces on 2026-11-28: that machine's standard library, installed
packages and system documentation. Only that machine rebuilds it (``sage-repro cut-data``
elsewhere gives another fingerprint, which the sweep refuses), so another host needs that
folder carried to it. It is kept as it is, not moved onto a pack: the fingerprint is what
its committed results (``benchmarks/paper-150step/``) were trained on, and its ``20m``
model's 32,768-token vocabulary would need a pack of its own; :data:`GRID_PLAN` is the
plan any machine can rebuild."""

GRID_DATA = "data/grid-cut"
"""Where ``sage-repro cut-data --data benchmarks/paper-grid/pack`` puts the grid's cut."""
GRID_PACK = "benchmarks/paper-grid/pack"
"""The grid's data, committed: compressed text and its tokenizer (:mod:`sage_train.data.pack`),
CPython 3.11.7's standard library under the PSF License (its ``LICENSE`` and ``NOTICE``)."""
LOW_LADDER = (0.3, 1.0, 3.0, 10.0, 30.0)
"""The rate factors of a configuration whose paper rate (1e-4) was chosen for 6.6B-token
runs: mostly upward (2x the paper rate already beat 1x in the 150-step pieces)."""
MID_LADDER = (0.1, 0.3, 1.0, 3.0, 10.0)
"""The rate factors of the others: a decade each side of the paper rate."""
GRID_FIRST = ("sage-hybrid", "lion-hybrid", "sinkgd-hybrid", "adamw")
"""The configurations whose sweeps run first (the issue's minimum on a GPU)."""
GRID_ORDER = (*GRID_FIRST, "lion", "apollo", "sage-pure", "sinkgd-pure")


def _ladder(config: str) -> tuple[float, ...]:
    return LOW_LADDER if get_preset(config).learning_rate < 1e-3 else MID_LADDER


GRID_PLAN = PiecePlan(
    name="grid-small-v1k",
    protocol=sweep_spec.Protocol(model="small-v1k", data=GRID_DATA, steps=256, batch_size=256,
                                 seq_len=sweep_spec.PAPER_SEQ_LEN, eval_every=32,
                                 eval_batches=4, log_every=16, checkpoint_every=256),
    pieces=(*(Piece(f"r-{c}", (c,), (0,), lr_factors=_ladder(c)) for c in GRID_ORDER),
            *(Piece(f"w-{c}", (c,), (0,), stage="widen") for c in GRID_ORDER),
            *(Piece(f"s-{c}", (c,), (1, 2), stage="best") for c in GRID_ORDER)),
    fingerprint="f84e42639ca63a9baf5c9dba292b62af44e21ddb01d3a984ac73a36a76ea497a",
    rows="best",
    folder="benchmarks/paper-grid",
    pack=GRID_PACK,
)
"""The paper's question at a scale that can answer it (``docs/reproduce.md``): the
``small-v1k`` model (``small`` on a 1,024-token vocabulary: 3.2M parameters, 8% in its
embedding) for 256 steps of 256 x 512 tokens (33.6M tokens, 10.4 per parameter, 3.8 passes
over the 8.92M-token train side of the committed pack, the whole standard library's), each
configuration swept over 5 rates (``r-CONFIG``), widened by one rate where the best sits at
an edge (``w-CONFIG``), then seeds 1 and 2 at its best rate (``s-CONFIG``)."""

PLANS: Mapping[str, PiecePlan] = {"paper": PAPER_PLAN, "grid": GRID_PLAN}
"""The plans ``--plan`` knows by name (a file of that name wins)."""



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


def piece_setup(plan: PiecePlan, name: str, trainer_args: Sequence[str],
                folders: Sequence[pathlib.Path] | None = None
                ) -> tuple[sweep_spec.Protocol, sweep_spec.Plan]:
    """The protocol and sweep plan of piece ``name`` (options after ``--`` added).

    A ``"widen"`` or ``"best"`` piece's rate comes from the pieces done before, found under
    ``folders`` (default: the plan's ``folder`` and :data:`DEFAULT_RUNS`; :func:`resolve`).

    Raises:
      SweepError: an option after ``--`` that the plan sets, or a rate not known yet.
    """
    for flag in trainer_args:
        if flag.split("=", 1)[0] in sweep_spec.MANAGED:
            raise sweep_spec.SweepError(f"{flag.split('=', 1)[0]} after -- is set by the plan of "
                                   "pieces itself")
    protocol = dataclasses.replace(plan.protocol, trainer_args=(
        *plan.protocol.trainer_args, *trainer_args))
    piece = plan.piece(name)
    if piece.stage == "rates":
        return protocol, piece.plan()
    return protocol, piece.plan(resolve(plan, piece, default_folders(plan)
                                        if folders is None else folders))


def check_data(plan: PiecePlan, piece: str) -> None:
    """Refuse to train ``piece`` on a missing cut, or on one of another fingerprint.

    Only the manifest is read here; the trainer checks every file of the cut.

    Raises:
      SweepError: one line naming the cut's folder.
    """
    from sage_train.data.cut import MANIFEST  # numpy-free module constant, imported when used

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
    return PIECE_OVERHEAD_S + piece.planned_runs() * per_run


def dry_run(plan: PiecePlan, names: Sequence[str], tflops: float | None, overhead_s: float,
            say: Callable[[str], None], speedup: float | None = None) -> None:
    """Print the runs of the pieces ``names`` and, with ``tflops``, each one's planned time.

    ``speedup`` (``--assume-together``): each piece's time divided by it, said to be assumed.
    """
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
        if speedup is not None:
            say(f"ASSUMED, not measured: --together runs each piece {speedup:g}x faster "
                "(--assume-together)")
    scale = 1.0 if speedup is None else 1.0 / speedup
    total = 0.0
    for name in names:
        piece = plan.piece(name)
        if piece.stage == "rates":
            runs = ", ".join(f"{s.config} {s.lr:g}" for s in piece.specs())
            what = f"{'/'.join(f'{f:g}' for f in piece.factors)}x paper rates ({runs})"
        else:
            what = ("one rate beyond the sweep's edge, if its best rate is there"
                    if piece.stage == "widen" else "at the best rate of the sweep")
            what += f" ({piece.configs[0]})"
        n = piece.planned_runs()
        line = (f"  {name}: {'at most ' if piece.stage == 'widen' else ''}"
                f"{n} run{'' if n == 1 else 's'}, seed {'/'.join(map(str, piece.seeds))}, "
                f"{what}")
        if tflops is not None:
            seconds = estimate(p, piece, tflops, overhead_s) * scale
            total += seconds
            line += f": {seconds / 60:.1f} min"
        say(line)
    if tflops is not None and len(names) > 1:
        calls = pack_calls([estimate(p, plan.piece(n), tflops, overhead_s) * scale
                            for n in names],
                           [[names.index(d.name) for d in depends(plan, plan.piece(n))
                             if d.name in names] for n in names])
        say(f"in all {total / 60:.1f} min of GPU time, in {len(calls)} GPU calls of at most "
            f"{CALL_S / 60:g} min (scripts/paper-piece's deadline):")
        for i, call in enumerate(calls, 1):
            say(f"  call {i}: {' '.join(names[j] for j in call)}")


CALL_S = 540.0
"""A GPU call's pieces' planned seconds at most: nine minutes (``PAPER_PIECE_SECONDS=480``
and the last piece's report; a lent machine's command stops at 600 s)."""


def depends(plan: PiecePlan, piece: Piece) -> list[Piece]:
    """The pieces whose results ``piece``'s rate comes from (none for a ``"rates"`` piece)."""
    stages = {"rates": (), "widen": ("rates",), "best": ("rates", "widen")}[piece.stage]
    return [p for p in plan.pieces if p.stage in stages and piece.configs[0] in p.configs]


def pack_calls(seconds: Sequence[float], after: Sequence[Sequence[int]] | None = None,
               limit: float = CALL_S) -> list[list[int]]:
    """The pieces (indices) each GPU call runs, in the order given.

    Each piece goes into the first call with room for it (its planned ``seconds`` within
    ``limit``) that comes no earlier than the calls of the pieces it depends on
    (``after[i]``: their indices, placed before it); a piece longer than ``limit`` gets a
    call of its own.
    """
    calls: list[list[int]] = []
    used: list[float] = []
    where: dict[int, int] = {}
    for i, t in enumerate(seconds):
        first = max((where[j] for j in (after[i] if after else ()) if j in where), default=0)
        k = next((k for k in range(first, len(calls)) if used[k] + t <= limit), len(calls))
        if k == len(calls):
            calls.append([])
            used.append(0.0)
        calls[k].append(i)
        used[k] += t
        where[i] = k
    return calls


# ---------------------------------------------------------------------------
# the rate of a widening piece and of a best-rate piece
# ---------------------------------------------------------------------------


def edge(rates: Sequence[float], best: float | None) -> str | None:
    """Where ``best`` sits among the ``rates`` swept: ``"low"``, ``"high"`` or ``None``.

    ``None``: inside the sweep (a rate on each side), no best rate, or fewer than 3 rates
    (no inside).
    """
    ordered = sorted(rates)
    if best is None or len(ordered) < 3:
        return None
    if best == ordered[0]:
        return "low"
    if best == ordered[-1]:
        return "high"
    return None


def widened_rate(rates: Sequence[float], best: float | None) -> float | None:
    """The rate one ladder step beyond the edge where ``best`` sits (``None``: inside).

    The step is the ratio of the two rates at that edge, so a ladder of 3x steps goes on
    by 3x: best 1e-3 of (1e-4, 3e-4, 1e-3) gives 3.33e-3.
    """
    side = edge(rates, best)
    ordered = sorted(rates)
    if side is None:
        return None
    if side == "high":
        return sweep_spec.canonical_lr(ordered[-1] * ordered[-1] / ordered[-2])
    return sweep_spec.canonical_lr(ordered[0] * ordered[0] / ordered[1])


def default_folders(plan: PiecePlan) -> list[pathlib.Path]:
    """Where a ``"widen"`` or ``"best"`` piece looks for the pieces done before it."""
    return [pathlib.Path(plan.folder), DEFAULT_RUNS]


def gather(plan: PiecePlan, folders: Sequence[pathlib.Path]) -> list[Found]:
    """The pieces of ``plan`` under ``folders`` (a piece found in several: the first)."""
    found: dict[str, Found] = {}
    for folder in folders:
        if folder.is_dir():
            for f in find_pieces(folder, plan):
                found.setdefault(f.piece.name, f)
    return list(found.values())


def rate_cells(plan: PiecePlan, found: Sequence[Found], config: str,
               stages: tuple[str, ...] = ("rates", "widen")
               ) -> dict[tuple[str, float], tuple[report.RunRecord, ...]]:
    """``config``'s learning-rate cells, from the pieces ``found``.

    Each rate of its ``stages`` pieces with the seeds of its ``"rates"`` pieces (a seed not
    trained shows as not started, and its rate is not eligible,
    :func:`sage_repro.sweep_report.best_rates`).
    """
    seeds = sorted({s for p in plan.pieces if p.stage == "rates" and config in p.configs
                    for s in p.seeds})
    runs = {(r.lr, r.seed): r for f in found if f.piece.stage in stages
            for r in f.runs if r.config == config}
    planned = {s.lr for p in plan.pieces if p.stage == "rates" and config in p.configs
               for s in p.specs() if s.config == config}
    rates = sorted(planned | {lr for lr, _ in runs})
    missing = report.RunRecord(config, 0.0, 0, pathlib.Path("-"), plan.protocol.steps,
                               "not started")
    return {(config, lr): tuple(runs.get((lr, s)) or dataclasses.replace(
        missing, lr=lr, seed=s) for s in seeds) for lr in rates}


def resolve(plan: PiecePlan, piece: Piece, folders: Sequence[pathlib.Path]
            ) -> tuple[float, ...]:
    """The rate of a ``"widen"`` or ``"best"`` piece, from the pieces done under ``folders``.

    ``()`` for a ``"widen"`` piece whose configuration's best rate is inside its sweep
    (nothing to train).

    Raises:
      SweepError: the configuration's rate pieces are not all done, or none of its rates
        finished every seed.
    """
    config = piece.configs[0]
    found = gather(plan, folders)
    cells = rate_cells(plan, found, config,
                       ("rates",) if piece.stage == "widen" else ("rates", "widen"))
    if any(r.status == "not started" for (c, lr), runs in cells.items() for r in runs
           if any(s.lr == lr for p in plan.pieces if p.stage == "rates"
                  for s in p.specs() if s.config == config)):
        todo = [p.name for p in plan.pieces if p.stage == "rates" and config in p.configs]
        raise sweep_spec.SweepError(
            f"--piece {piece.name} needs {config}'s learning-rate sweep first: piece(s) "
            f"{', '.join(todo)} (looked in {', '.join(str(f) for f in folders)})")
    best = report.best_rates(cells).get(config)
    if best is None:
        raise sweep_spec.SweepError(f"--piece {piece.name}: no rate of {config} finished "
                                    "every seed; there is no best rate to train")
    if piece.stage == "best":
        first = rate_cells(plan, found, config, ("rates",))
        wide = [p.name for p in depends(plan, piece) if p.stage == "widen"]
        done = {f.piece.name for f in found}
        if (widened_rate([lr for (_, lr) in first], report.best_rates(first).get(config))
                is not None and wide and not set(wide) & done):
            raise sweep_spec.SweepError(
                f"--piece {piece.name}: {config}'s best rate sits at an edge of its sweep; "
                f"widen it first: piece {wide[0]}")
        return (best,)
    wider = widened_rate([lr for (_, lr) in cells], best)
    return () if wider is None else (wider,)


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
    if piece.stage == "rates":
        planned = {(s.config, s.lr, s.seed) for s in piece.specs()}
    else:  # its rate came from the pieces before it
        planned = {k for k in runs if k[0] == piece.configs[0] and k[2] in piece.seeds}
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
        n = piece.planned_runs() if f is None else len(f.runs) if piece.stage != "rates" else (
            len(piece.specs()))
        state = "missing" if f is None else "done" if done == n else "partial"
        if f is None and piece.stage == "widen" and _resolve_found(plan, piece, found) == ():
            state = "not needed"
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
    if plan.rows == "best":
        return _merge_best(plan, found), _progress(plan, found)
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
    return report.summarize(rows, cells, reference, _setup(plan, found)), _progress(plan, found)


def _setup(plan: PiecePlan, found: Sequence[Found]) -> dict[str, Any]:
    """The merged report's setup: the protocol, the plan, the data of the pieces."""
    return {**plan.protocol.setup(), "plan": plan.name,
            "data_fingerprints": sorted({p for f in found
                                         for p in f.setup.get("data_fingerprints") or []}),
            "data_tokens": next((f.setup["data_tokens"] for f in found
                                 if f.setup.get("data_tokens")), None)}


def _resolve_found(plan: PiecePlan, piece: Piece, found: Sequence[Found]
                   ) -> tuple[float, ...] | None:
    """:func:`resolve` on the pieces ``found`` (``None``: not known yet)."""
    config = piece.configs[0]
    cells = rate_cells(plan, found, config,
                       ("rates",) if piece.stage == "widen" else ("rates", "widen"))
    best = report.best_rates(cells).get(config)
    if best is None or any(r.status == "not started" for runs in cells.values() for r in runs):
        return None
    if piece.stage == "best":
        return (best,)
    wider = widened_rate([lr for (_, lr) in cells], best)
    return () if wider is None else (wider,)


TRANSIENT_LIMIT = 0.03
"""A run is past the early transient when its last 10% of steps lower its test loss (the
log of its test perplexity) by less than this share (:func:`late_drop`)."""


def late_drop(run: report.RunRecord, steps: int) -> float | None:
    """The share by which the last 10% of ``steps`` lowered ``run``'s test loss.

    ``(L(0.9·steps) - L(steps)) / L(0.9·steps)`` with ``L`` the log of the test perplexity,
    linear between the evaluations around ``0.9·steps``; ``None`` for a run that did not
    finish or has no evaluation at or before ``0.9·steps``.
    """
    curve = run.evals
    if run.status != "finished" or curve is None or not curve.steps or curve.steps[-1] != steps:
        return None
    at = 0.9 * steps
    points = list(zip(curve.steps, (math.log(p) for p in curve.ppl), strict=True))
    before = [(s, v) for s, v in points if s <= at]
    after = [(s, v) for s, v in points if s >= at]
    if not before or not after:
        return None
    (s0, v0), (s1, v1) = before[-1], after[0]
    start = v0 if s1 == s0 else v0 + (v1 - v0) * (at - s0) / (s1 - s0)
    return (start - points[-1][1]) / start if start > 0 else None


def _merge_best(plan: PiecePlan, found: Sequence[Found]) -> report.Summary:
    """The merged table at each configuration's best rate (``rows="best"``).

    The learning-rate table: every rate of the ``"rates"`` and ``"widen"`` pieces with the
    seeds of the ``"rates"`` pieces; the best rate is the lowest mean final test perplexity
    among the rates at which every seed finished; a row: the configuration at its best rate
    with every seed trained there (the sweep's and the ``"best"`` piece's), or at its paper
    rate, not started, while its sweep is unfinished.
    """
    configs = [c for c in CONFIG_NAMES if any(c in p.configs for p in plan.pieces)]
    runs = {(r.config, r.lr, r.seed): r for f in found for r in f.runs}
    cells: dict[tuple[str, float], tuple[report.RunRecord, ...]] = {}
    rows = []
    for config in configs:
        mine = rate_cells(plan, found, config)
        cells.update(mine)
        complete = not any(r.status == "not started" for rr in mine.values() for r in rr)
        best = report.best_rates(mine).get(config) if complete else None
        seeds = sorted({s for p in plan.pieces if config in p.configs
                        and p.stage in ("rates", "best") for s in p.seeds})
        lr = best if best is not None else sweep_spec.canonical_lr(
            get_preset(config).learning_rate)
        remark = "" if complete else "learning-rate sweep unfinished: the paper rate shown"
        side = edge([r for (_, r) in mine], best)
        if side is not None:
            wide = next((p.name for p in plan.pieces if p.stage == "widen"
                         and p.configs == (config,)), None)
            widened = any(f.piece.name == wide for f in found)
            remark = (f"best rate still at the {side} edge after widening: widen further "
                      "(a plan with more rates)" if widened else
                      f"best rate at the {side} edge of the sweep: widen it (piece "
                      f"{wide or '-'})")
        seeded = [f for f in found if f.piece.stage == "best" and f.piece.configs == (config,)]
        stale = sorted({r.lr for f in seeded for r in f.runs} - {lr})
        if stale:
            note = (f"seeds of piece {seeded[0].piece.name} ran at "
                    f"{', '.join(f'{x:g}' for x in stale)}, not the best rate: move its "
                    "results away and run it again")
            remark = f"{remark}; {note}" if remark else note
        records = tuple(runs.get((config, lr, s)) or report.RunRecord(
            config, lr, s, pathlib.Path("-"), plan.protocol.steps, "not started")
            for s in seeds)
        drops = [d for d in (late_drop(r, plan.protocol.steps) for r in records)
                 if d is not None]
        if drops:
            late = (f"last 10% of steps lowered the test loss by {100 * max(drops):.1f}% at "
                    f"most: {'PAST' if max(drops) < TRANSIENT_LIMIT else 'NOT past'} the early "
                    f"transient (< {100 * TRANSIENT_LIMIT:g}%)")
            remark = f"{remark}; {late}" if remark else late
        rows.append(report.Row(config, lr, records, remark=remark))
    reference = plan.reference if plan.reference in configs else "slowest"
    return report.summarize(rows, cells, reference, _setup(plan, found))


def progress_lines(progress: Sequence[Mapping[str, Any]], command: str) -> list[str]:
    """The pieces merged and those still to run, with the command of each."""
    lines = []
    for p in progress:
        if p["state"] == "not needed":
            lines.append(f"- {p['piece']} ({p['what']}): not needed (the best rate is inside "
                         "the sweep)")
        elif p["state"] == "done":
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


def piece_command(plan: PiecePlan) -> str:
    """The command that trains a piece of ``plan``.

    A named plan other than the paper's runs with ``PAPER_PIECE_PLAN=NAME``.
    """
    name = next((k for k, v in PLANS.items() if v == plan), None)
    return COMMAND if name in (None, "paper") else f"PAPER_PIECE_PLAN={name} {COMMAND}"


def write_merged(folder: pathlib.Path, plan: PiecePlan) -> tuple[report.Summary, str]:
    """Merge the pieces under ``folder`` into its ``results.md``, ``results.json``, figures.

    Returns the summary and the markdown.
    """
    from sage_train.store.rundir import atomic_write_text

    summary, progress = merge(folder, plan)
    figures = report.write_figures(summary, folder)
    done = sum(p["state"] == "done" for p in progress)
    parts = [f"# The paper's comparison in pieces: plan {plan.name}", "",
             f"{done} of {len(progress)} pieces done; each piece's own `results.json` is in "
             "its folder. Written by `sage-repro report --pieces` from the pieces alone.", "",
             "## Pieces", "", *progress_lines(progress, piece_command(plan)), "",
             report.to_markdown(summary, figures).replace("# Sweep results", "## Merged table",
                                                          1)]
    markdown = "\n".join(parts)
    atomic_write_text(folder / "results.md", markdown)
    atomic_write_text(folder / "results.json", json.dumps(
        {**report.to_json(summary, figures), "plan": plan.to_json(), "pieces": progress},
        indent=2) + "\n")
    return summary, markdown
