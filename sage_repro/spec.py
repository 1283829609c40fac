"""What a sweep trains: its protocol, its runs and its plan, and the refusals it makes.

:class:`Protocol` (the trainer's settings every run shares), :class:`RunSpec` (one run) and
:class:`Plan` (configurations x seeds x learning rates), with the paper's constants; below
:mod:`sage_repro.sweep` (which trains and reports them) and :mod:`sage_repro.pieces` (which
splits a plan into pieces).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Mapping
from typing import Any

from sage_optim.presets import KINDS, RULE_DEFAULTS, get_preset
from sage_train.model.shapes import get_model_config

DEFAULT_OUT = pathlib.Path("runs/sweep")
DEFAULT_CUT = pathlib.Path("data/paper-cut")
"""``sage-repro cut-data``'s folder: inside the checkout (git ignores it), so that it can
travel with a working tree to another machine."""
PAPER_SEQ_LEN = 512
"""The paper's sequence length (Section "Experimental Setup")."""
PAPER_TOKENS_PER_STEP = 256 * 512
"""The paper's "global batch size of 130k tokens": 256 sequences of 512."""
PAPER_REFERENCE = "lion-hybrid"
"""The paper's baseline of the effective throughput (Appendix)."""
STATE = "sweep.json"
"""The sweep's record in ``OUT``: its protocol and its latest plan."""
EXIT_PREEMPTED = 75
EXIT_INTERRUPTED = 130


class SweepError(Exception):
    """A problem with what was asked: printed as one line, exit status 2."""


# ---------------------------------------------------------------------------
# protocol and plan
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Protocol:
    """What every run of a sweep shares (the trainer's options, one value each).

    ``b1``, ``b2``, ``weight_decay``: ``None`` keeps each configuration's own (the paper's
    β=(0.9, 0.99) and 0.01; APOLLO's projected moments keep their β2=0.999).
    ``trainer_args``: further ``sage-train`` options given to every run.
    """

    model: str
    data: str | None
    steps: int
    batch_size: int
    seq_len: int
    eval_every: int
    eval_batches: int
    log_every: int
    checkpoint_every: int
    schedule: str = "cosine"
    warmup_frac: float = 0.1
    final_lr_frac: float = 0.1
    clip: float = 1.0
    b1: float | None = None
    b2: float | None = None
    weight_decay: float | None = None
    trainer_args: tuple[str, ...] = ()

    @property
    def tokens_per_step(self) -> int:
        """Training tokens per optimizer step."""
        return self.batch_size * self.seq_len

    def trainer_argv(self, spec: RunSpec, group: pathlib.Path) -> list[str]:
        """The ``sage-train`` options of one run (its ``--run-dir`` is ``group``)."""
        argv = ["--model", self.model, "--optimizer", spec.config, "--lr", repr(spec.lr),
                "--seed", str(spec.seed), "--steps", str(self.steps),
                "--batch-size", str(self.batch_size), "--seq-len", str(self.seq_len),
                "--schedule", self.schedule, "--warmup-frac", repr(self.warmup_frac),
                "--final-lr-frac", repr(self.final_lr_frac), "--clip", repr(self.clip),
                "--eval-every", str(self.eval_every), "--eval-batches", str(self.eval_batches),
                "--log-every", str(self.log_every),
                "--checkpoint-every", str(self.checkpoint_every),
                "--run-dir", str(group), "--no-progress"]
        if self.data is not None:
            argv += ["--data", self.data]
        for hp in ("b1", "b2", "weight_decay"):
            value = getattr(self, hp)
            if value is not None and (hp == "weight_decay" or has_hyperparameter(spec.config,
                                                                                  hp)):
                argv += [f"--{hp.replace('_', '-')}", repr(value)]
        return argv + list(self.trainer_args)

    def setup(self) -> dict[str, Any]:
        """The protocol with what follows from it, for the report."""
        return {**dataclasses.asdict(self), "trainer_args": list(self.trainer_args),
                "tokens_per_step": self.tokens_per_step,
                "tokens_per_run": self.steps * self.tokens_per_step,
                "parameters": get_model_config(self.model).param_count()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Protocol:
        """The protocol of ``dataclasses.asdict`` or :meth:`setup` data (other keys ignored).

        Raises:
          KeyError, TypeError: a field is missing or of the wrong kind.
        """
        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in fields}
        return cls(**{**values, "trainer_args": tuple(values.get("trainer_args", ()))})


MANAGED: frozenset[str] = frozenset({
    "--model", "--optimizer", "--lr", "--seed", "--steps", "--batch-size", "--seq-len",
    "--schedule", "--warmup-frac", "--final-lr-frac", "--clip", "--eval-every",
    "--eval-batches", "--log-every", "--checkpoint-every", "--run-dir", "--data", "--b1",
    "--b2", "--weight-decay",
})
"""``sage-train`` options the sweep sets itself (refused after ``--``)."""

_UNCOMPARED = ("checkpoint_every", "log_every")  # a rerun may change these


def managed_option(flag: str) -> str | None:
    """The managed option (:data:`MANAGED`) that ``flag`` after ``--`` would set, if any.

    Any spelling counts: ``--seed``, ``--seed=7``, an abbreviation (``--see``: a prefix of
    a managed option that is no ``sage-train`` option of its own), or underscores for
    dashes (``--batch_size``).  ``None`` for a value or another option.
    """
    if not flag.startswith("--") or flag == "--":
        return None
    name = flag.split("=", 1)[0].replace("_", "-")
    if name in MANAGED:
        return name
    if len(name) > 2 and name not in _trainer_options():
        prefixed = sorted(m for m in MANAGED if m.startswith(name))
        if prefixed:
            return prefixed[0]
    return None


def _trainer_options() -> frozenset[str]:
    from sage_train.cli import build_parser as trainer_parser

    return frozenset(trainer_parser()._option_string_actions)


def has_hyperparameter(config: str, hp: str) -> bool:
    """Whether some rule of ``config`` takes ``hp`` (``sage-train`` refuses ``--b1`` else)."""
    preset = get_preset(config)
    return any(hp in RULE_DEFAULTS[preset.rule(kind).name] for kind in KINDS)


def canonical_lr(lr: float) -> float:
    """``lr`` rounded to 6 significant digits: one run directory per printed rate."""
    return float(f"{lr:.6g}")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One run: a configuration at a peak learning rate with a seed."""

    config: str
    lr: float
    seed: int

    def group(self, out: pathlib.Path) -> pathlib.Path:
        """The directory given to the trainer as ``--run-dir`` (and the harness's records)."""
        return out / "runs" / self.config / f"lr{self.lr:g}-seed{self.seed}"

    def run_dir(self, out: pathlib.Path, model: str) -> pathlib.Path:
        """The trainer's own run directory."""
        return self.group(out) / f"{model}-{self.config}"

    def label(self) -> str:
        """``sage-hybrid lr 0.002 seed 1``."""
        return f"{self.config} lr {self.lr:g} seed {self.seed}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a sweep trains.

    Attributes:
      configs: the configurations.
      seeds: the seeds of every configuration at every rate (the sweep's seeds).
      lrs: the rates of every configuration, or ``None`` to use ``lr_factors``.
      lr_factors: rates as multiples of each configuration's paper rate.
      best_seeds: seeds then trained at each configuration's best rate (``()``: none).
      top: only the ``top`` best configurations get ``best_seeds`` (``None``: all).
      reference: the effective throughput's baseline, a configuration or ``"slowest"``.
      piece: the name of the piece of a :class:`~sage_repro.pieces.PiecePlan` this sweep
        trains (``None``: not a piece).
    """

    configs: tuple[str, ...]
    seeds: tuple[int, ...]
    lrs: tuple[float, ...] | None = None
    lr_factors: tuple[float, ...] = (1.0,)
    best_seeds: tuple[int, ...] = ()
    top: int | None = None
    reference: str = PAPER_REFERENCE
    piece: str | None = None

    def rates(self, config: str) -> tuple[float, ...]:
        """The rates ``config`` is trained at, in increasing order."""
        if self.lrs is not None:
            rates = self.lrs
        else:
            base = get_preset(config).learning_rate
            rates = tuple(base * f for f in self.lr_factors)
        return tuple(sorted({canonical_lr(lr) for lr in rates}))

    def grid(self) -> list[RunSpec]:
        """The first stage: every configuration at every rate with every seed.

        Seeds are outermost, so that a partial sweep covers every configuration.
        """
        return [RunSpec(c, lr, s) for s in self.seeds for c in self.configs
                for lr in self.rates(c)]


def protocol_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Every compared field in which two protocols (``dataclasses.asdict``) differ.

    Each as ``--steps 30 -> 31``; ``log_every`` and ``checkpoint_every`` are not compared.
    """
    def same(a: Any, b: Any) -> bool:
        return list(a) == list(b) if isinstance(a, list | tuple) else a == b

    return [f"{_option(k)} {old.get(k)!r} -> {new[k]!r}" for k in new
            if k not in _UNCOMPARED and not same(old.get(k), new[k])]


def _option(field: str) -> str:
    return "options after --" if field == "trainer_args" else f"--{field.replace('_', '-')}"
