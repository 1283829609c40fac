"""The trainer's configuration: :class:`TrainConfig`, what each field must be, and its checks.

Every field of :class:`TrainConfig` carries its command-line option (:class:`Option`: flag,
help, check, choices), from which ``sage-train``'s parser is generated
(:func:`sage_train.cli.build_parser`) and :func:`check_config` checks a configuration made
in Python: a new setting is one field here.  The policies that resolve a field's ``auto``
(:func:`compute_dtype`, :func:`layer_layout`, :func:`loss_chunk_tokens`) live here too; the
rest of the trainer reads them from the resolved run (:class:`sage_train.run.resolve.Run`).
This module reads and writes no file: the checks that read one (a Hugging Face checkpoint's
``config.json``) live in :mod:`sage_train.run.resolve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from sage_optax import SINKGD_IMPLS
from sage_optim.presets import CONFIG_NAMES, KINDS, RULE_DEFAULTS, get_preset
from sage_train.job.errors import ConfigError, require
from sage_train.model.llama import ATTENTIONS, LAYER_MODES, REMAT_POLICIES
from sage_train.model.shapes import MODELS as MODEL_NAMES
from sage_train.model.shapes import LlamaConfig, get_model_config
from sage_train.model.sharding import MODES as SHARDING_MODES

SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")
"""``--schedule`` choices: the decay after the linear warmup."""

TAILS: tuple[str, ...] = ("constant", "rewarm")
"""``--tail`` choices: how the rate continues after ``--tail-from`` (``docs/training.md``,
"Training a finished run longer")."""

DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32")
"""``--dtype`` choices (``auto``: bfloat16 on a GPU or TPU, float32 on the CPU)."""

PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16")
"""``--param-dtype`` choices."""

LAYER_CHOICES: tuple[str, ...] = ("auto", *LAYER_MODES)
"""``--layers`` choices (``auto``: ``scan`` on a GPU or TPU, ``loop`` on the CPU, where the
scanned step measured ~10% slower on the ``small`` demo)."""

MAX_COUNT = 2**31 - 1
"""The largest step count, batch size, sequence length or interval a run accepts."""

SEED_LIMIT = 2**32
"""Seeds are below this: JAX's PRNG keys and NumPy's generators take 32-bit seeds, and a
larger one would wrap around to the initial weights of a smaller one."""

LOSS_CHUNK_AUTO_BYTES = 1 << 30
"""``--loss-chunk auto`` computes the loss unchunked while the float32 logits of a batch
take at most this many bytes (every CPU demo and test size), else in chunks."""

LOSS_CHUNK_TARGET_BYTES = 1 << 29
"""``--loss-chunk auto``: the float32 logits of one chunk take at most this many bytes
(1,024 tokens of a 128,256-token vocabulary: 0.49 GiB)."""


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def _int_in(lo: int, hi: int = MAX_COUNT) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and lo <= v <= hi


def _count(lo: int = 1) -> tuple[Callable[[Any], bool], str]:
    return _int_in(lo), f"an integer in [{lo}, {MAX_COUNT}]"


def _number(ok: Callable[[float], bool], what: str, optional: bool = False
            ) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: (optional and v is None) or (_finite(v) and ok(v))), what


def _text(what: str) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v is None or (isinstance(v, str) and bool(v.strip()))), what


def parse_model(text: str) -> str:
    """An argparse ``type`` for ``--model``: a named size or a shape's file that reads."""
    try:
        get_model_config(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix(f"--model {text}: ")) from None
    return text


def parse_loss_chunk(text: str) -> int | None:
    """``--loss-chunk``: ``auto`` (``None``) or an integer."""
    return None if text.strip().lower() == "auto" else int(text)


FIELD_DEFAULT: Any = type("FieldDefault", (), {"__repr__": lambda _: "FIELD_DEFAULT"})()
""":attr:`Option.cli_default` of an option whose default is its field's."""


@dataclasses.dataclass(frozen=True)
class Option:
    """A :class:`TrainConfig` field's command-line option and what its value must be.

    Attributes:
      help: the option's help text (``sage-train --help`` adds the default).
      check: ``(ok, what)``: ``ok(value)`` says whether the value is valid, ``what`` says
        what it must be (both :func:`check_config`'s and the parser's message).
      parse: the text to value conversion of the option (``float``, ``int``...).
      choices: the valid values, where they are a list.
      flag: the option's name, where it is not ``--field-name``; ``None`` with
        ``cli=False``.
      metavar: the option's placeholder in the help.
      cli_default: the option's default, where it is not the field's.
      nargs: argparse's ``nargs`` (``"+"``: one run per value).
      negate: a ``--no-...`` switch that turns a field that defaults to ``True`` off.
      cli: whether the field has an option (``False``: set by ``sage-train`` itself).
      step: whether the compiled train step depends on the field (:data:`STEP_FIELDS`).
    """

    help: str
    check: tuple[Callable[[Any], bool], str] | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[Any, ...] | None = None
    flag: str | None = None
    metavar: str | None = None
    cli_default: Any = FIELD_DEFAULT
    nargs: str | None = None
    negate: bool = False
    cli: bool = True
    step: bool = False


def _setting(default: Any, help: str, **option: Any) -> Any:  # noqa: A002 - argparse's word
    return dataclasses.field(default=default, metadata={"option": Option(help, **option)})


_INTERVAL = "steps between {}, >= 1"


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on; saved next to its checkpoints.

    Each field's metadata holds its :class:`Option` (:func:`options`): ``sage-train``'s
    flag, help and check for it.
    """

    model: str = _setting(
        "small", f"LLaMA size, one of {', '.join(MODEL_NAMES)} (tiny: tests, small: CPU, 20m "
        "and 60m: the paper's proportions for a GPU run on --data installed, 130m, 270m ... "
        "1.3b: the paper's); or any LLaMA shape: a .json file of vocab_size, hidden_size, "
        "intermediate_size, num_layers, num_heads, num_kv_heads (optional: "
        "max_position_embeddings, tie_embeddings, name), or a Hugging Face LLaMA checkpoint "
        "directory (its config.json) (default: small; with --init-from-hf, the checkpoint's "
        "shape)", parse=parse_model, metavar="NAME|FILE", cli_default=None,
        step=True)
    optimizer: str = _setting(
        "sage-hybrid", "one or more of the paper's configurations, trained one after the "
        f"other: {', '.join(CONFIG_NAMES)}", choices=CONFIG_NAMES, nargs="+", metavar="NAME",
        step=True)
    learning_rate: float | None = _setting(
        None, "peak learning rate, > 0 (default: the configuration's paper value)",
        check=_number(lambda v: v > 0, "a number > 0", optional=True), parse=float,
        flag="--lr")  # no step field: the optimizer state holds the peak (steps.make_tx)
    schedule: str = _setting("cosine", "decay after the linear warmup (the paper: cosine)",
                             choices=SCHEDULES,
        step=True)
    warmup_frac: float = _setting(0.1, "fraction of the steps in linear warmup, [0, 1)",
                                  check=_number(lambda v: 0 <= v < 1, "a number in [0, 1)"),
                                  parse=float,
        step=True)
    final_lr_frac: float = _setting(
        0.1, "final learning rate as a fraction of the peak, [0, 1]",
        check=_number(lambda v: 0 <= v <= 1, "a number in [0, 1]"), parse=float,
        step=True)
    tail_from: int | None = _setting(
        None, "train a finished run longer: up to this step the rate follows the schedule "
        "of --steps TAIL_FROM (as the run was trained), after it the --tail; pass the "
        "run's old --steps with a larger --steps and --allow-config-change (default: no "
        "tail)", check=(lambda v: v is None or _int_in(1)(v), f"an integer in [1, {MAX_COUNT}]"),
        parse=int, metavar="STEP", step=True)
    tail: str | None = _setting(
        None, "the rate after --tail-from: constant (the rate reached at --tail-from, held) "
        "or rewarm (from that rate back to the peak over --warmup-frac of the added steps, "
        "then --schedule's decay to --final-lr-frac at --steps) (default: constant with "
        "--tail-from)", choices=(None, *TAILS), step=True)
    batch_size: int = _setting(16, "sequences per step, >= 1", check=_count(), parse=int)
    seq_len: int = _setting(128, "tokens per sequence, >= 1", check=_count(), parse=int)
    steps: int = _setting(300, "total training steps of the run, >= 1 (sets the schedule)",
                          check=_count(), parse=int,
        step=True)
    seed: int = _setting(0, "seed of the initial weights and the batch order, >= 0",
                         check=(_int_in(0, SEED_LIMIT - 1),
                                f"an integer in [0, {SEED_LIMIT - 1}] (2^32 - 1)"), parse=int)
    clip: float = _setting(
        1.0, "global-norm gradient clipping threshold, >= 0 (0: off)",
        check=_number(lambda v: v >= 0, "a number >= 0 (0 turns clipping off)"), parse=float,
        step=True)
    eval_every: int = _setting(
        100, _INTERVAL.format("test-perplexity evaluations") + " (and at the end)",
        check=_count(), parse=int)
    eval_batches: int = _setting(8, "batches of the fixed test windows, >= 1", check=_count(),
                                 parse=int)
    log_every: int = _setting(
        10, "steps between rows of metrics.jsonl and log lines (TensorBoard and W&B scalars "
        "too), >= 1 (evaluations and checkpoints always get one)", check=_count(), parse=int)
    data: str | None = _setting(
        None, "'installed' (the offline ~100M-token corpus of this machine's installed "
        "packages and documentation, split 8:2 by document, built and cached on first use), "
        "a cut of it (a folder holding cut.json, written by sage-repro cut-data: fixed "
        "tokens with their own split, checked), a text file or folder, or a "
        ".u16/.u32/.npy/.bin token file (default: the embedded standard-library corpus)",
        check=_text("'stdlib', a text file or folder, or a token file (not empty)"), parse=str)
    token_dtype: str | None = _setting(
        None, "dtype of a raw .bin token file: required for .bin, checked against the "
        "extension of .u16/.u32/.npy (default: from the extension)",
        choices=(None, "uint16", "uint32"))
    run_dir: str = _setting("runs/default", "runs go to RUN_DIR/MODEL-OPTIMIZER",
                            cli_default="runs")
    checkpoint_every: int = _setting(
        100, "steps between checkpoints, >= 1 (and at the end; the newest two are kept)",
        check=_count(), parse=int)
    sharding: str = _setting(
        "dp", "data parallel (dp), fully sharded (fsdp) or one device (none)",
        choices=SHARDING_MODES,
        step=True)
    record_h_every: int = _setting(
        10, _INTERVAL.format("records of SAGE's embedding damper H_t"), check=_count(),
        parse=int)
    h_max_records: int = _setting(
        512, "most H_t rows kept (the interval doubles when full), >= 2", check=_count(2),
        parse=int)
    progress: bool = _setting(
        True, "no progress bar: plain log lines every --log-every steps, as when stderr is "
        "not a terminal", flag="--no-progress", negate=True)
    dtype: str = _setting(
        "auto", "computation dtype of the matmuls (norm statistics, softmax and the loss are "
        "float32 in any case); auto: bfloat16 on a GPU, float32 on the CPU", choices=DTYPES,
        step=True)
    param_dtype: str = _setting(
        "float32", "storage dtype of the parameters (and of the optimizer moments)",
        choices=PARAM_DTYPES,
        step=True)
    layers: str = _setting(
        "auto", "scan: the decoder layers stacked and run by one nnx.scan (fast to compile, "
        "the layout SAGE groups best); loop: one module per layer; auto: scan on a GPU, loop "
        "on the CPU (where it is faster)", choices=LAYER_CHOICES,
        step=True)
    remat: str = _setting(
        "none", "recompute each layer's activations in the backward pass: none; dots (keep "
        "the weight matmuls' outputs); full (keep only each layer's input)",
        choices=tuple(REMAT_POLICIES),
        step=True)
    deterministic: bool = _setting(
        False, "reproducible GPU runs (XLA's --xla_gpu_deterministic_ops=true; set before JAX "
        "starts; costs some GPU speed)")
    peak_tflops: float | None = _setting(
        None, "the device's peak TFLOP/s for the computation dtype, for the MFU column "
        "(default: from the table of known GPUs; none on the CPU)",
        check=_number(lambda v: v > 0, "a number > 0", optional=True), parse=float)
    loss_chunk: int | None = _setting(
        None, "compute the output layer, log-softmax and loss N tokens at a time, so that "
        "only one chunk's float32 logits (and their gradient) are alive; 0: all at once "
        "(default: auto, unchunked while a batch's logits take at most 1 GiB, else chunks of "
        "at most 0.5 GiB of logits: 1024 tokens of a 128,256-token vocabulary)",
        check=(lambda v: v is None or _int_in(0)(v),
               f"an integer >= 0 (0: unchunked; at most {MAX_COUNT}) or auto"),
        parse=parse_loss_chunk, metavar="N|auto",
        step=True)
    attention: str = _setting(
        "auto", "the attention's implementation: cudnn (cuDNN's fused flash attention: no "
        "T x T scores in memory; a CUDA GPU, bfloat16/float16, head dim a multiple of 8 up "
        "to 128; refused elsewhere), xla (XLA's, float32 scores materialised), auto (cudnn "
        "where it can run and scripts/gpu-check has validated it on this GPU, else xla: "
        "cudnn on H100s today); the choice is printed at the start and recorded in "
        "config.json and metrics.jsonl", choices=ATTENTIONS,
        step=True)
    sinkgd_kernel: str = _setting(
        "auto", "how SinkGD computes its scales (configurations with SinkGD): pallas (the "
        "Pallas kernel; interpreted off a GPU), jnp, stream, blocked, native (the compiled "
        "CPU kernel, for arrays on the CPU), auto (on a GPU the kernel or the streamed "
        "computation where scripts/gpu-check has validated it, else jnp; on one CPU device "
        "jnp and native for leaves of 16 MiB or more, where it builds: recorded as "
        "jnp+native); SAGE_KERNELS=off in the environment forces jnp (and "
        "xla attention); recorded like --attention", choices=SINKGD_IMPLS,
        step=True)
    weight_decay: float | None = _setting(
        None, "decoupled weight decay of every rule, >= 0 (default: the configuration's, "
        "0.01 for each)", check=_number(lambda v: v >= 0, "a number >= 0", optional=True),
        parse=float,
        step=True)
    b1: float | None = _setting(
        None, "beta1 of every rule that has one, in [0, 1) (default: the configuration's, "
        "0.9)", check=_number(lambda v: 0 <= v < 1, "a number in [0, 1)", optional=True),
        parse=float,
        step=True)
    b2: float | None = _setting(
        None, "beta2 of every rule that has one, in [0, 1) (default: the configuration's, "
        "0.99; APOLLO's projected moments 0.999)",
        check=_number(lambda v: 0 <= v < 1, "a number in [0, 1)", optional=True), parse=float,
        step=True)
    grad_accum: int = _setting(
        1, "gradient accumulation: each step's --batch-size sequences run as K micro-batches "
        "of batch-size/K (K must divide it), one update per step: the same update as one "
        "batch, with the activation memory of a micro-batch",
        check=(_int_in(1), f"an integer in [1, {MAX_COUNT}] that divides the batch size"),
        parse=int, metavar="K",
        step=True)
    tensorboard: bool = _setting(
        False, "write TensorBoard event files into each run directory (needs tensorboardX)")
    wandb: str | None = _setting(
        None, "log the scalars to this Weights & Biases project (needs wandb; a resumed run "
        "continues its W&B run) (default: none)",
        check=_text("a W&B project name (not empty)"), parse=str, metavar="PROJECT")
    init_from_hf: str | None = _setting(
        None, "start from the weights of a Hugging Face LlamaForCausalLM checkpoint "
        "(config.json and safetensors, e.g. from sage-train export, or any transformers "
        "LLaMA saved with save_pretrained) of the --model's architecture, which is the "
        "checkpoint's own when --model is not given (refused otherwise, naming the field) "
        "(default: none)",
        check=_text("a Hugging Face checkpoint directory (not empty)"), parse=str,
        metavar="DIR")


def options() -> dict[str, Option]:
    """``{field: its option}`` of every :class:`TrainConfig` field, in field order."""
    return {f.name: f.metadata["option"] for f in dataclasses.fields(TrainConfig)}


SETTING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    name: o.check for name, o in options().items() if o.check is not None}
"""What each :class:`TrainConfig` field that takes a number (and ``data``) must be
(checked by :func:`check_config` and by the ``sage-train`` options)."""

STEP_FIELDS: tuple[str, ...] = tuple(name for name, o in options().items() if o.step)
"""The :class:`TrainConfig` fields the compiled step depends on (the seed, data order,
logging and the peak learning rate, a value of the optimizer state, do not): runs that
agree on these share one compiled step in a process."""


def check_config(cfg: TrainConfig) -> None:
    """Refuse invalid settings before anything is read or written.

    Raises:
      ConfigError: the first invalid field, named with what it must be.
    """
    _check_values(cfg)
    model = _checked_model(cfg)
    _check_choices(cfg)
    _check_context(cfg, model)
    for check in (_check_tail, _check_batch, _check_hyperparameters, _check_extras):
        check(cfg)


def _check_values(cfg: TrainConfig) -> None:
    for name, (ok, what) in SETTING_CHECKS.items():
        value = getattr(cfg, name)
        if not ok(value):
            raise ConfigError(f"{name} must be {what}, got {value!r}")


def _checked_model(cfg: TrainConfig) -> LlamaConfig:
    try:
        return get_model_config(cfg.model)  # a named size, or a file of a LLaMA shape
    except ValueError as e:
        raise ConfigError(f"model must be one of {tuple(MODEL_NAMES)} or a LLaMA shape's file: "
                          f"{e}") from None


def _check_choices(cfg: TrainConfig) -> None:
    for name, option in options().items():
        if option.choices is not None and getattr(cfg, name) not in option.choices:
            raise ConfigError(f"{name} must be one of {option.choices}, "
                              f"got {getattr(cfg, name)!r}")


def _check_context(cfg: TrainConfig, model: LlamaConfig) -> None:
    context = model.max_position_embeddings
    if cfg.seq_len > context:
        raise ConfigError(f"seq_len (--seq-len) {cfg.seq_len} is longer than the {model.name} "
                          f"model's context of {context} positions: use --seq-len {context} "
                          f"or less, or a model with a longer context")


def _check_tail(cfg: TrainConfig) -> None:
    if cfg.tail_from is not None and cfg.tail_from >= cfg.steps:
        raise ConfigError(f"tail_from (--tail-from) {cfg.tail_from} must be below steps "
                          f"(--steps) {cfg.steps}: the tail runs from --tail-from to --steps")
    if cfg.tail is not None and cfg.tail_from is None:
        raise ConfigError(f"tail (--tail) {cfg.tail} needs --tail-from STEP: the step where "
                          "the tail starts (the run's old --steps)")


def _check_batch(cfg: TrainConfig) -> None:
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(f"grad_accum (--grad-accum) {cfg.grad_accum} does not divide "
                          f"batch_size (--batch-size) {cfg.batch_size}: each step's batch is "
                          f"split into {cfg.grad_accum} micro-batches of equal size")


def _check_hyperparameters(cfg: TrainConfig) -> None:
    for hp in ("b1", "b2"):
        if getattr(cfg, hp) is not None and not rules_with(cfg.optimizer, hp):
            raise ConfigError(f"{hp} (--{hp}): no rule of {cfg.optimizer} has a {hp} "
                              f"(its rules: {', '.join(rule_names(cfg.optimizer))})")


def _check_extras(cfg: TrainConfig) -> None:
    if cfg.tensorboard:
        require("tensorboardX", "--tensorboard")
    if cfg.wandb is not None:
        require("wandb", "--wandb")


def rule_names(optimizer: str) -> list[str]:
    """The names of the update rules of ``optimizer``, sorted."""
    preset = get_preset(optimizer)
    return sorted({preset.rule(kind).name for kind in KINDS})


def rules_with(optimizer: str, hp: str) -> list[Any]:
    """The values of hyperparameter ``hp`` of the rules of ``optimizer`` that have one."""
    preset = get_preset(optimizer)
    return [preset.rule(k).hyperparams[hp] for k in KINDS
            if hp in RULE_DEFAULTS[preset.rule(k).name]]


def default_hyperparameter(optimizer: str, hp: str) -> float | None:
    """The value of ``hp`` every rule of ``optimizer`` that has it shares (None: they differ)."""
    values = set(rules_with(optimizer, hp))
    return values.pop() if len(values) == 1 else None


def peak_learning_rate(cfg: TrainConfig) -> float:
    """The run's peak learning rate: ``--lr``, else the configuration's paper value.

    The one place the trainer defaults it: the recorded settings, the header, the schedule
    and the optimizer all read this value (through :class:`sage_train.run.resolve.Run`).
    """
    if cfg.learning_rate is not None:
        return cfg.learning_rate
    return get_preset(cfg.optimizer).learning_rate


def option_flag(name: str) -> str:
    """The command-line option of setting ``name``: ``learning_rate`` -> ``--lr``.

    A :class:`TrainConfig` field's :attr:`Option.flag`, else ``--name-with-dashes`` (also
    for the launch settings that are no field, such as ``restart``).
    """
    option = options().get(name)
    return (option.flag if option is not None and option.flag else None) or (
        "--" + name.replace("_", "-"))


def compute_dtype(cfg: TrainConfig) -> str:
    """The computation dtype of ``cfg``, ``auto`` resolved for the default backend."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def layer_layout(cfg: TrainConfig) -> str:
    """The layout of the decoder layers of ``cfg``, ``auto`` resolved for the backend."""
    if cfg.layers != "auto":
        return cfg.layers
    return "loop" if jax.default_backend() == "cpu" else "scan"


def loss_chunk_tokens(cfg: TrainConfig, vocab_size: int | None = None) -> int:
    """Tokens per chunk of the loss of ``cfg`` (0: unchunked), ``auto`` resolved.

    ``auto`` (``None``): unchunked while the float32 logits of a (micro-)batch fit in
    :data:`LOSS_CHUNK_AUTO_BYTES`; else the fewest chunks that divide the batch's tokens
    with at most :data:`LOSS_CHUNK_TARGET_BYTES` of logits each (or, where no such count
    is near, chunks of that size, the last one padded).  ``vocab_size`` defaults to the
    model's.
    """
    if cfg.loss_chunk is not None:
        return cfg.loss_chunk
    vocab = vocab_size if vocab_size is not None else get_model_config(cfg.model).vocab_size
    tokens = cfg.batch_size // max(cfg.grad_accum, 1) * cfg.seq_len  # one micro-batch's
    if tokens * vocab * 4 <= LOSS_CHUNK_AUTO_BYTES:
        return 0
    most = max(1, LOSS_CHUNK_TARGET_BYTES // (4 * vocab))
    fewest = math.ceil(tokens / most)
    # a chunk that divides the tokens (no padding), unless that means much smaller chunks
    chunks = next((n for n in range(fewest, 2 * fewest + 1) if tokens % n == 0), None)
    return tokens // chunks if chunks is not None else most


def uses_sinkgd(cfg: TrainConfig) -> bool:
    """Whether the configuration of ``cfg`` runs SinkGD on some parameters."""
    return "sinkgd" in rule_names(cfg.optimizer)
