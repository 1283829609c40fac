"""Pretrain a Flax NNX LLaMA with any of the paper's eight optimizer configurations.

One jitted train step with donated buffers over the (model, optimizer) state; data and
fully-sharded-data parallelism over a mesh of every device of the job, on one process or
several (:mod:`sage_train.distributed`: each process feeds its own rows of the same global
batch, process 0 writes the run's files); verified orbax checkpoints that resume
bit-identically, on any number of processes (:mod:`sage_train.checkpoints`); a locked run
directory whose recorded settings, metrics and ``H_t`` history survive restarts
(:mod:`sage_train.rundir`); a start header, a progress bar on a terminal or plain log lines
elsewhere, JSONL metrics (and TensorBoard/W&B scalars where asked for:
:mod:`sage_train.report`), SAGE's damper ``H_t`` of the embedding recorded with bounded
memory, and a loss-curve PNG of the whole run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pathlib
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sage_optax
from sage_optax import placement
from sage_optax.sinkhorn import IMPLS, resolved_impl
from sage_optim import kernels
from sage_optim.presets import CONFIG_NAMES, KINDS, RULE_DEFAULTS, get_preset
from sage_optim.table import format_bytes
from sage_train import data as data_lib
from sage_train import distributed, hf_convert, report, rundir
from sage_train.checkpoints import Checkpoints, state_is_finite
from sage_train.diagnostics import DamperRecorder, embedding_damper
from sage_train.errors import ConfigError, DataError, RunDirError, UserError
from sage_train.model import (
    ATTENTIONS,
    LAYER_MODES,
    REMAT_POLICIES,
    Llama,
    attention_choice,
    cudnn_present,
    cudnn_problem,
    loss_fn,
)
from sage_train.model_shapes import MODELS as MODEL_NAMES
from sage_train.model_shapes import get_model_config, is_model_file
from sage_train.sharding import MODES as SHARDING_MODES
from sage_train.sharding import (
    local_rows,
    make_mesh,
    mesh_platform,
    shard_batch,
    state_shardings,
)
from sage_train.throughput import device_peak_tflops, flops_per_token, mfu


@dataclasses.dataclass
class TrainConfig:
    """Everything a run depends on; saved next to its checkpoints."""

    model: str = "small"
    optimizer: str = "sage-hybrid"
    learning_rate: float | None = None  # None: the configuration's paper value
    schedule: str = "cosine"  # "cosine", "linear" or "constant", after the warmup
    warmup_frac: float = 0.1
    final_lr_frac: float = 0.1
    batch_size: int = 16
    seq_len: int = 128
    steps: int = 300
    seed: int = 0
    clip: float = 1.0  # global-norm gradient clipping; 0 disables it
    eval_every: int = 100
    eval_batches: int = 8
    log_every: int = 10
    data: str | None = None  # None: the embedded standard-library corpus
    token_dtype: str | None = None  # "uint16"/"uint32" for raw .bin token files
    run_dir: str = "runs/default"
    checkpoint_every: int = 100
    sharding: str = "dp"  # "dp", "fsdp" or "none"
    record_h_every: int = 10
    h_max_records: int = 512
    progress: bool = True
    dtype: str = "auto"  # computation: "bfloat16", "float32", or "auto" (bf16 on a GPU)
    param_dtype: str = "float32"  # storage of the parameters (and so of optimizer moments)
    layers: str = "auto"  # "scan" (stacked, nnx.scan), "loop", or "auto" (scan off the CPU)
    remat: str = "none"  # "none", "dots" or "full" (nnx.remat policy of each layer)
    deterministic: bool = False  # reproducible GPU reductions (set before the backend starts)
    peak_tflops: float | None = None  # device peak for MFU (None: from the known devices)
    loss_chunk: int | None = None  # tokens per chunk of the loss; 0: unchunked; None: auto
    attention: str = "auto"  # "auto" (cuDNN's where validated, else XLA's), "cudnn", "xla"
    sinkgd_kernel: str = "auto"  # SinkGD's scales: "auto" (jnp until validated), "pallas", "jnp"
    weight_decay: float | None = None  # decoupled decay of every rule (None: the configuration's)
    b1: float | None = None  # beta1 of every rule that has one (None: the configuration's)
    b2: float | None = None  # beta2 of every rule that has one (None: the configuration's)
    grad_accum: int = 1  # micro-batches per step (of batch_size // grad_accum sequences each)
    tensorboard: bool = False  # TensorBoard event files in the run directory (tensorboardX)
    wandb: str | None = None  # a Weights & Biases project to log the scalars to
    init_from_hf: str | None = None  # a Hugging Face LLaMA checkpoint to start from (step 0)


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    config: TrainConfig
    steps_done: int
    losses: list[float]
    final_test_ppl: float | None
    opt_state_bytes: int
    tokens_per_s: float  # training tokens per second over the whole run (all segments)
    # (compilation, evaluation, checkpointing and the host's logging and H_t records
    # excluded; the last row of metrics.jsonl)
    stopped_reason: str | None = None
    start_step: int = 0  # the step this invocation resumed from (losses follow it)
    mfu: float | None = None  # model FLOPs utilisation at tokens_per_s (None: no known peak)
    interrupted: str | None = None  # the signal that stopped the run early ("SIGTERM"...)


SCHEDULES: tuple[str, ...] = ("cosine", "linear", "constant")


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate per step: linear warmup, then ``cfg.schedule``.

    The warmup covers ``warmup_frac`` of the steps; cosine and linear then decay to
    ``final_lr_frac`` of the peak (the paper: cosine with 10% warmup).
    """
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    peak = cfg.learning_rate if cfg.learning_rate is not None else get_preset(
        cfg.optimizer).learning_rate
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    rest = max(cfg.steps - warmup, 1)
    if cfg.schedule == "cosine":
        after = optax.cosine_decay_schedule(peak, rest, alpha=cfg.final_lr_frac)
    elif cfg.schedule == "linear":
        after = optax.linear_schedule(peak, peak * cfg.final_lr_frac, rest)
    else:
        after = optax.constant_schedule(peak)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])


def make_tx(cfg: TrainConfig, model: Llama | None = None) -> optax.GradientTransformation:
    """Gradient clipping followed by the configuration, under the run's schedule.

    ``model`` is the router's evidence: with scanned layers it is what lets the router read
    a ``(L, in, out)`` kernel as ``L`` stacked matrices (without it such a leaf is refused).
    """
    tx = sage_optax.make_optimizer(cfg.optimizer, lr_schedule(cfg), model=model,
                                   impl=cfg.sinkgd_kernel, weight_decay=cfg.weight_decay,
                                   b1=cfg.b1, b2=cfg.b2)
    return optax.chain(optax.clip_by_global_norm(cfg.clip), tx) if cfg.clip > 0 else tx


DTYPES: tuple[str, ...] = ("auto", "bfloat16", "float32")
"""``--dtype`` choices (``auto``: bfloat16 on a GPU or TPU, float32 on the CPU)."""

PARAM_DTYPES: tuple[str, ...] = ("float32", "bfloat16")


def compute_dtype(cfg: TrainConfig) -> str:
    """The computation dtype of ``cfg``, ``auto`` resolved for the default backend."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


LAYER_CHOICES: tuple[str, ...] = ("auto", *LAYER_MODES)
"""``--layers`` choices (``auto``: ``scan`` on a GPU or TPU, ``loop`` on the CPU, where the
scanned step measured ~10% slower on the ``small`` demo)."""


def layer_layout(cfg: TrainConfig) -> str:
    """The layout of the decoder layers of ``cfg``, ``auto`` resolved for the backend."""
    if cfg.layers != "auto":
        return cfg.layers
    return "loop" if jax.default_backend() == "cpu" else "scan"


LOSS_CHUNK_AUTO_BYTES = 1 << 30
"""``--loss-chunk auto`` computes the loss unchunked while the float32 logits of a batch
take at most this many bytes (every CPU demo and test size), else in chunks."""

LOSS_CHUNK_TARGET_BYTES = 1 << 29
"""``--loss-chunk auto``: the float32 logits of one chunk take at most this many bytes
(1,024 tokens of a 128,256-token vocabulary: 0.49 GiB)."""


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
    preset = get_preset(cfg.optimizer)
    return any(preset.rule(kind).name == "sinkgd" for kind in KINDS)


@dataclasses.dataclass(frozen=True)
class Implementations:
    """What a run computes with on its mesh's devices: recorded, printed, in every metrics row.

    ``attention`` is ``"cudnn"`` or ``"xla"`` (:func:`~sage_train.model.attention_choice`);
    ``sinkgd_kernel`` is ``"pallas"`` or ``"jnp"``
    (:func:`~sage_optax.sinkhorn.resolved_impl`, ``SAGE_KERNELS`` included), ``None`` for a
    configuration without SinkGD.  The ``*_why`` fields say why, for the log.
    """

    platform: str
    devices: int
    attention: str
    attention_why: str
    sinkgd_kernel: str | None
    sinkgd_kernel_why: str


def implementations(cfg: TrainConfig, mesh: Any = None) -> Implementations:
    """The attention and SinkGD kernel ``cfg`` computes with on ``mesh``'s devices.

    The platform is that of the devices of the run's mesh (default: ``make_mesh(cfg.sharding)``),
    as :mod:`sage_optax.placement` names it, not JAX's default backend; the model and the
    optimizer choose by the same rules (:func:`~sage_train.model.attention_choice`,
    :func:`~sage_optax.sinkhorn.resolved_impl`) where their arrays are.

    Raises:
      ConfigError: ``--attention cudnn`` where cuDNN's attention cannot run (the reason
        named), or an invalid ``SAGE_KERNELS``.
    """
    mesh = mesh if mesh is not None else make_mesh(cfg.sharding)
    platform, n = mesh_platform(mesh), int(mesh.devices.size)
    local = mesh.local_devices or list(mesh.devices.flat)
    kind = str(local[0].device_kind) if platform in ("cuda", "gpu") else None
    model_cfg = get_model_config(cfg.model)
    dtype = jnp.dtype(compute_dtype(cfg))
    cudnn = platform in ("cuda", "gpu") and cudnn_present()
    problem = cudnn_problem(platform, dtype, model_cfg.head_dim, cudnn=cudnn)
    if cfg.attention == "cudnn" and problem is not None:
        raise ConfigError(f"--attention cudnn cannot run here: {problem}; use --attention auto "
                          "(cuDNN's where it can run, else XLA's) or xla")
    try:
        attention, attention_why = attention_choice(cfg.attention, platform, dtype,
                                                    model_cfg.head_dim, cudnn=cudnn,
                                                    device_kind=kind)
    except ValueError as e:  # an invalid SAGE_KERNELS (the message names it)
        raise ConfigError(str(e)) from None
    if not uses_sinkgd(cfg):
        return Implementations(platform, n, attention, attention_why, None,
                               f"{cfg.optimizer} runs no SinkGD")
    try:
        # the update decides with the process's CUDA devices (it cannot see the mesh when
        # traced): a --sharding none run on a host with several GPUs keeps the jnp path
        count = placement.cuda_device_count() if platform in ("cuda", "gpu") else n
        kernel = resolved_impl(cfg.sinkgd_kernel, platform, count, kind)
        enabled = kernels.kernels_enabled()
    except ValueError as e:  # an invalid SAGE_KERNELS (the message names it)
        raise ConfigError(str(e)) from None
    why = f"{cfg.sinkgd_kernel}: {count} {platform} device{'' if count == 1 else 's'}"
    if kind is not None:
        why += f" ({kind})"
    if not enabled:
        why += f", {kernels.ENV_VAR}=off"
    elif kernel == "pallas" and platform not in ("cuda", "gpu"):
        why += ", in Pallas's interpreter"
    return Implementations(platform, n, attention, attention_why, kernel, why)


def build_model(cfg: TrainConfig, vocab_size: int) -> Llama:
    """The model of ``cfg`` (vocabulary from the data)."""
    model_cfg = dataclasses.replace(get_model_config(cfg.model), vocab_size=vocab_size)
    return Llama(model_cfg, rngs=nnx.Rngs(cfg.seed), dtype=jnp.dtype(compute_dtype(cfg)),
                 param_dtype=jnp.dtype(cfg.param_dtype), layers=layer_layout(cfg),  # type: ignore
                 remat=cfg.remat, loss_chunk=loss_chunk_tokens(cfg),  # type: ignore[arg-type]
                 attention=cfg.attention)  # type: ignore[arg-type]


def build(cfg: TrainConfig, vocab_size: int) -> tuple[Llama, nnx.Optimizer]:
    """The model (vocabulary from the data) and its optimizer (routed with the model)."""
    model = build_model(cfg, vocab_size)
    return model, nnx.Optimizer(model, make_tx(cfg, model), wrt=nnx.Param)


def enable_determinism() -> bool:
    """Ask XLA for deterministic GPU reductions (``--xla_gpu_deterministic_ops=true``).

    Takes effect only when set before JAX starts a backend: returns whether it will (it
    is added to ``XLA_FLAGS`` in any case).  CPU results are deterministic already.
    """
    flag = "--xla_gpu_deterministic_ops=true"
    flags = os.environ.get("XLA_FLAGS", "")
    if flag not in flags.split():
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()
    from jax._src import xla_bridge

    return not xla_bridge.backends_are_initialized()


STEP_FIELDS: tuple[str, ...] = (
    "model", "optimizer", "learning_rate", "schedule", "warmup_frac", "final_lr_frac", "steps",
    "clip", "sharding", "dtype", "param_dtype", "layers", "remat", "loss_chunk", "attention",
    "sinkgd_kernel", "weight_decay", "b1", "b2", "grad_accum",
)
"""The :class:`TrainConfig` fields the compiled step depends on (the seed, data order and
logging do not): runs that agree on these share one compiled step in a process."""

_STEP_CACHE: dict[tuple[Any, ...], tuple[Callable[..., Any], Callable[..., Any]]] = {}


def cached_steps(cfg: TrainConfig, vocab_size: int, graphdef: Any, record_h: bool,
                 resolved: tuple[Any, ...] = (), mesh: Any = None
                 ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """:func:`make_steps` for ``graphdef``, shared by every run with the same step fields.

    Two builds of the same model and optimizer give graph definitions that compare unequal
    (the optimizer holds fresh closures), so the cache is keyed on the configuration instead:
    several seeds, a resumed run or the same configuration again compile once per process.
    ``resolved`` joins the key: what the step was traced with beyond ``cfg`` (the
    implementations, which ``SAGE_KERNELS`` can change), and ``mesh``.
    """
    key = (tuple(getattr(cfg, f) for f in STEP_FIELDS), loss_chunk_tokens(cfg), vocab_size,
           record_h, tuple(resolved), mesh)
    if key not in _STEP_CACHE:
        if len(_STEP_CACHE) >= 8:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = make_steps(graphdef, record_h, cfg.grad_accum, mesh)
    return _STEP_CACHE[key]


def loss_and_grads(model: Llama, inputs: jax.Array, targets: jax.Array,
                   grad_accum: int = 1) -> tuple[jax.Array, Any]:
    """The mean loss of a batch and its gradient, over ``grad_accum`` micro-batches.

    With ``grad_accum`` ``K > 1`` the ``B`` sequences are split into ``K`` micro-batches of
    ``B / K`` (micro-batch ``k``: sequences ``k, k + K, ...``, so that a batch sharded over
    its rows stays sharded), whose losses and gradients a ``jax.lax.scan`` averages
    (gradients summed in float32): the loss and gradient of the whole batch, up to the
    order of the sums, with the activations of one micro-batch alive at a time.
    """
    if grad_accum == 1:
        return nnx.value_and_grad(loss_fn)(model, inputs, targets)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def micro_loss(p: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return loss_fn(nnx.merge(graphdef, p, rest), x, y)

    def body(carry: tuple[jax.Array, Any], batch: tuple[jax.Array, jax.Array]
             ) -> tuple[tuple[jax.Array, Any], None]:
        total, acc = carry
        loss, g = jax.value_and_grad(micro_loss)(params, *batch)
        return (total + loss, jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)), None

    def micro(a: jax.Array) -> jax.Array:
        return a.reshape(a.shape[0] // grad_accum, grad_accum, *a.shape[1:]).swapaxes(0, 1)

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (total, acc), _ = jax.lax.scan(body, (jnp.zeros((), jnp.float32), zeros),
                                   (micro(inputs), micro(targets)))
    grads = jax.tree.map(lambda a, p: (a / grad_accum).astype(p.dtype), acc, params)
    return total / grad_accum, grads


def make_steps(graphdef: Any, record_h: bool, grad_accum: int = 1, mesh: Any = None
               ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted train step (state donated) and eval step over the split state.

    The train step returns the new state, ``(loss, gradient norm)`` (the global norm of
    the gradient before clipping) and SAGE's ``H_t`` of the embedding (``None`` unless
    ``record_h``); it accumulates ``grad_accum`` micro-batches (:func:`loss_and_grads`).
    With a ``mesh``, what the host reads (the loss, the norm, ``H_t``) is replicated on
    its devices, so that process 0 of a job of several reads it from its own devices.
    """
    replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())

    def host_side(x: Any) -> Any:
        return x if replicated is None else jax.lax.with_sharding_constraint(x, replicated)

    def train_step(state: Any, inputs: jax.Array, targets: jax.Array) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = loss_and_grads(model, inputs, targets, grad_accum)
        optimizer.update(model, grads)
        h = embedding_damper(optimizer, grads) if record_h else None
        return (nnx.state((model, optimizer)), host_side((loss, optax.tree.norm(grads))),
                host_side(h))

    def eval_step(state: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        model, _ = nnx.merge(graphdef, state)
        return host_side(loss_fn(model, inputs, targets))

    return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)


def evaluate_loss(eval_step: Callable[..., Any], state: Any, batches: list[Any], mesh: Any,
                  mode: str, batch_size: int | None = None) -> float:
    """Test loss: the mean loss over the fixed evaluation windows.

    ``batches`` hold this process's rows of global batches of ``batch_size`` rows (default:
    all rows, as with one process).
    """
    return float(np.mean([float(eval_step(state, *shard_batch(b, mesh, mode, batch_size)))
                          for b in batches]))


def evaluate(eval_step: Callable[..., Any], state: Any, batches: list[Any], mesh: Any,
             mode: str, batch_size: int | None = None) -> float:
    """Test perplexity: exp of the mean loss over the fixed evaluation windows."""
    return float(math.exp(evaluate_loss(eval_step, state, batches, mesh, mode, batch_size)))


def peak_memory_bytes() -> int | None:
    """The device allocator's high-water mark in this process, in bytes.

    The largest ``peak_bytes_in_use`` over the process's local devices (with one device,
    that device's), as XLA's allocator reports it: the bytes of live buffers at their
    peak, not the memory pool it reserved.  It is never reset, so it covers everything
    since the process started: compilation, evaluation, and every earlier run of the same
    process (with several ``--optimizer`` names in one command, a later run's figure
    includes the earlier ones'; one process per run measures each alone).  ``None`` where
    the backend reports no memory statistics (the CPU).
    """
    peaks = [int(stats.get("peak_bytes_in_use", 0))
             for d in jax.local_devices() if (stats := d.memory_stats())]
    return (max(peaks) or None) if peaks else None


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


MAX_COUNT = 2**31 - 1
"""The largest step count, batch size, sequence length or interval a run accepts."""

SEED_LIMIT = 2**32
"""Seeds are below this: JAX's PRNG keys and NumPy's generators take 32-bit seeds, and a
larger one would wrap around to the initial weights of a smaller one."""


def _int_in(lo: int, hi: int = MAX_COUNT) -> Callable[[Any], bool]:
    return lambda v: _is_int(v) and lo <= v <= hi


SETTING_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "learning_rate": (lambda v: v is None or (_finite(v) and v > 0), "a number > 0"),
    "warmup_frac": (lambda v: _finite(v) and 0 <= v < 1, "a number in [0, 1)"),
    "final_lr_frac": (lambda v: _finite(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "batch_size": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "seq_len": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "steps": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "seed": (_int_in(0, SEED_LIMIT - 1), f"an integer in [0, {SEED_LIMIT - 1}] (2^32 - 1)"),
    "clip": (lambda v: _finite(v) and v >= 0, "a number >= 0 (0 turns clipping off)"),
    "eval_every": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "eval_batches": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "log_every": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "checkpoint_every": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "record_h_every": (_int_in(1), f"an integer in [1, {MAX_COUNT}]"),
    "h_max_records": (_int_in(2), f"an integer in [2, {MAX_COUNT}]"),
    "peak_tflops": (lambda v: v is None or (_finite(v) and v > 0), "a number > 0"),
    "loss_chunk": (lambda v: v is None or _int_in(0)(v),
                   f"an integer >= 0 (0: unchunked; at most {MAX_COUNT}) or auto"),
    "data": (lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
             "'stdlib', a text file or folder, or a token file (not empty)"),
    "weight_decay": (lambda v: v is None or (_finite(v) and v >= 0), "a number >= 0"),
    "b1": (lambda v: v is None or (_finite(v) and 0 <= v < 1), "a number in [0, 1)"),
    "b2": (lambda v: v is None or (_finite(v) and 0 <= v < 1), "a number in [0, 1)"),
    "grad_accum": (_int_in(1), f"an integer in [1, {MAX_COUNT}] that divides the batch size"),
    "wandb": (lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
              "a W&B project name (not empty)"),
    "init_from_hf": (lambda v: v is None or (isinstance(v, str) and bool(v.strip())),
                     "a Hugging Face checkpoint directory (not empty)"),
}
"""What each :class:`TrainConfig` field that takes a number (and ``data``) must be
(checked by :func:`check_config` and by the ``sage-train`` options)."""


def check_config(cfg: TrainConfig) -> None:
    """Refuse invalid settings before anything is read or written.

    Raises:
      ConfigError: the first invalid field, named with what it must be.
    """
    for name, (ok, what) in SETTING_CHECKS.items():
        value = getattr(cfg, name)
        if not ok(value):
            raise ConfigError(f"{name} must be {what}, got {value!r}")
    try:
        model = get_model_config(cfg.model)  # a named size, or a file of a LLaMA shape
    except ValueError as e:
        raise ConfigError(f"model must be one of {tuple(MODEL_NAMES)} or a LLaMA shape's file: "
                          f"{e}") from None
    choices = {"optimizer": CONFIG_NAMES, "schedule": SCHEDULES,
               "sharding": SHARDING_MODES, "token_dtype": (None, "uint16", "uint32"),
               "dtype": DTYPES, "param_dtype": PARAM_DTYPES, "layers": LAYER_CHOICES,
               "remat": tuple(REMAT_POLICIES), "attention": ATTENTIONS,
               "sinkgd_kernel": IMPLS}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ConfigError(f"{name} must be one of {allowed}, got {getattr(cfg, name)!r}")
    context = model.max_position_embeddings
    if cfg.seq_len > context:
        raise ConfigError(f"seq_len (--seq-len) {cfg.seq_len} is longer than the {model.name} "
                          f"model's context of {context} positions: use --seq-len {context} "
                          f"or less, or a model with a longer context")
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(f"grad_accum (--grad-accum) {cfg.grad_accum} does not divide "
                          f"batch_size (--batch-size) {cfg.batch_size}: each step's batch is "
                          f"split into {cfg.grad_accum} micro-batches of equal size")
    for hp in ("b1", "b2"):
        if getattr(cfg, hp) is not None and not _rules_with(cfg.optimizer, hp):
            raise ConfigError(f"{hp} (--{hp}): no rule of {cfg.optimizer} has a {hp} "
                              f"(its rules: {', '.join(_rule_names(cfg.optimizer))})")
    if cfg.tensorboard:
        report.require("tensorboardX", "--tensorboard")
    if cfg.wandb is not None:
        report.require("wandb", "--wandb")


def _rule_names(optimizer: str) -> list[str]:
    preset = get_preset(optimizer)
    return sorted({preset.rule(kind).name for kind in KINDS})


def _rules_with(optimizer: str, hp: str) -> list[Any]:
    """The values of hyperparameter ``hp`` of the rules of ``optimizer`` that have one."""
    preset = get_preset(optimizer)
    return [preset.rule(k).hyperparams[hp] for k in KINDS
            if hp in RULE_DEFAULTS[preset.rule(k).name]]


def default_hyperparameter(optimizer: str, hp: str) -> float | None:
    """The value of ``hp`` every rule of ``optimizer`` that has it shares (None: they differ)."""
    values = set(_rules_with(optimizer, hp))
    return values.pop() if len(values) == 1 else None


def settings_of(cfg: TrainConfig, impl: Implementations) -> dict[str, Any]:
    """The settings recorded for a run (so that equal settings compare equal).

    ``cfg`` with the peak learning rate resolved, the data source (and ``init_from_hf``) as
    an absolute path, every ``auto`` resolved: the attention and SinkGD kernel as ``impl``
    says (the kernel ``None`` for a configuration without SinkGD), and ``weight_decay``,
    ``b1``, ``b2`` left unset resolved to the configuration's value where its rules share
    one.
    """
    settings = dataclasses.asdict(cfg)
    if cfg.learning_rate is None:
        settings["learning_rate"] = get_preset(cfg.optimizer).learning_rate
    settings["data"] = rundir.normalize_data(cfg.data)
    settings["dtype"] = compute_dtype(cfg)
    settings["layers"] = layer_layout(cfg)
    settings["loss_chunk"] = loss_chunk_tokens(cfg)
    settings["attention"] = impl.attention
    settings["sinkgd_kernel"] = impl.sinkgd_kernel
    for hp in ("weight_decay", "b1", "b2"):
        if settings[hp] is None:  # the configuration's value, where its rules share one
            settings[hp] = default_hyperparameter(cfg.optimizer, hp)
    if cfg.init_from_hf is not None:
        settings["init_from_hf"] = str(pathlib.Path(cfg.init_from_hf).expanduser().absolute())
    if is_model_file(cfg.model):  # a shape's file: where it is, and the shape it held
        settings["model"] = str(pathlib.Path(cfg.model).expanduser().absolute())
        settings["model_shape"] = dataclasses.asdict(get_model_config(cfg.model))
    return settings


def _normalized(recorded: dict[str, Any] | None) -> dict[str, Any] | None:
    """Recorded settings in the form :func:`settings_of` writes.

    The ``config.json`` of an older version holds ``learning_rate: null`` and the data
    path as given.
    """
    if recorded is None:
        return None
    recorded = dict(recorded)
    if recorded.get("learning_rate") is None and recorded.get("optimizer") in CONFIG_NAMES:
        recorded["learning_rate"] = get_preset(recorded["optimizer"]).learning_rate
    for hp in ("weight_decay", "b1", "b2"):  # None: the configuration's, as settings_of says
        if hp in recorded and recorded[hp] is None and recorded.get("optimizer") in CONFIG_NAMES:
            recorded[hp] = default_hyperparameter(recorded["optimizer"], hp)
    if "data" in recorded:
        recorded["data"] = rundir.normalize_data(recorded["data"])
    return recorded


def data_fingerprint(tokens: data_lib.TokenData) -> str:
    """A short hash of the token stream, equal for the same data and read in O(1).

    Covers the lengths, dtype, vocabulary and up to 64 evenly spaced 4,096-token pieces of
    each split.
    """
    h = hashlib.sha256(f"vocab={tokens.vocab_size};".encode())
    for part in (tokens.train, tokens.test):
        n, piece = len(part), 4096
        h.update(f"{n}:{part.dtype};".encode())
        for i in np.unique(np.linspace(0, max(n - piece, 0), 64).astype(np.int64)):
            h.update(np.ascontiguousarray(part[i:i + piece]).tobytes())
    return h.hexdigest()[:16]


def _load_tokens(cfg: TrainConfig, exclude: Sequence[Any] = (), rows: slice | None = None
                 ) -> tuple[data_lib.TokenData, list[Any]]:
    """The tokens and the evaluation batches; every data problem as a :class:`DataError`.

    Folders in ``exclude`` (the run directories) are never read as part of a text corpus.
    ``rows``: this process's rows of each evaluation batch (default: all).
    """
    try:
        tokens = data_lib.load_data(cfg.data, vocab_size=get_model_config(cfg.model).vocab_size,
                                    token_dtype=cfg.token_dtype, exclude=exclude)
        data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed, rows=rows)
        eval_set = data_lib.eval_batches(tokens.test, cfg.batch_size, cfg.seq_len,
                                         cfg.eval_batches, rows=rows)
    except (OSError, ValueError, TypeError) as e:
        raise DataError(f"data {cfg.data or 'stdlib'!r}: {e}") from e
    return tokens, eval_set


def load_tokens_once(cfg: TrainConfig, exclude: Sequence[Any] = (), rows: slice | None = None
                     ) -> tuple[data_lib.TokenData, list[Any]]:
    """:func:`_load_tokens` for every process of a job, the token cache built once.

    Process 0 loads first (training the tokenizer and writing the cache where it is
    missing); the others then load it from the cache (on hosts that share no cache, each
    builds its own, with the same result: the tokenizer's training is deterministic).
    A data problem on any process stops every process (:class:`~distributed.together`),
    and so does data that differs between them (the fingerprints are compared).
    """
    if distributed.process_count() == 1:
        return _load_tokens(cfg, exclude, rows)
    loaded: tuple[data_lib.TokenData, list[Any]] | None = None
    problem: UserError | None = None
    for turn in ("primary", "others"):
        if (turn == "primary") == distributed.is_primary():
            try:
                loaded = _load_tokens(cfg, exclude, rows)
            except UserError as e:
                problem = e
        if turn == "primary":
            distributed.barrier("sage-train: the token cache is built")
    with distributed.together("to load the data"):
        if problem is not None:
            raise problem
    assert loaded is not None
    distributed.same_everywhere(data_fingerprint(loaded[0]), "the data's fingerprint")
    return loaded


PREEMPT_SIGNALS: tuple[str, ...] = ("SIGTERM", "SIGUSR1")
"""Signals that stop a run with a checkpoint of the step reached (a cluster's preemption;
SLURM's ``--signal=USR1@...`` warning); ``SIGINT`` (Ctrl-C) stops it without one."""

STRUCTURE_FIELDS: tuple[str, ...] = ("model", "optimizer", "layers", "param_dtype", "clip")
"""Settings that change the layout of the saved state: a change of these (allowed) restores
the checkpoint as it was saved and carries over what fits (:func:`carry_over`)."""


def preflight(cfg: TrainConfig, *, allow_config_change: bool = False) -> None:
    """Check ``cfg``'s run directory as :func:`train` would, before anything is trained.

    Its recorded settings (``config.json``, else ``config_history.jsonl``, else the newest
    checkpoint's manifest) against ``cfg``; the lock is the caller's to take
    (``sage-train`` holds the locks of all its runs before it trains any).

    Raises:
      ConfigError, RunDirError: as :func:`train` would, before it trains.
    """
    check_config(cfg)
    check_init_from_hf(cfg)
    run_dir = pathlib.Path(cfg.run_dir).absolute()
    if not run_dir.is_dir():
        return
    recorded = _recorded_settings(cfg, run_dir, allow_config_change, lambda s: None)
    if recorded is None:
        return
    cfg = _legacy(cfg, recorded)
    settings = settings_of(cfg, implementations(cfg))
    changed = rundir.check_settings(run_dir, recorded, settings, allow_config_change)
    _check_carry(run_dir, changed, Checkpoints(run_dir / "checkpoints"))


def say(message: str) -> None:
    """Print one line of the log at once (``flush``: a job's log file shows it as it happens)."""
    print(message, flush=True)


def check_init_from_hf(cfg: TrainConfig) -> None:
    """Refuse an ``init_from_hf`` checkpoint that is not of ``cfg.model``'s architecture.

    Reads its ``config.json`` only (:func:`~sage_train.hf_convert.config_mismatches`).

    Raises:
      ConfigError: the directory holds no readable ``config.json``, or one whose fields
        differ from the model's (each named, in one line).
    """
    if cfg.init_from_hf is None:
        return
    report.require("safetensors", "--init-from-hf")
    try:
        hf = hf_convert.read_config(pathlib.Path(cfg.init_from_hf).expanduser())
    except ValueError as e:
        raise ConfigError(f"--init-from-hf: {e}") from None
    wrong = hf_convert.config_mismatches(hf, get_model_config(cfg.model))
    if wrong:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf} does not hold the {cfg.model} "
                          f"model's architecture: {', '.join(wrong)}; pass the --model it "
                          "was trained as")


def train(cfg: TrainConfig, *, stop_after: int | None = None,
          allow_config_change: bool = False, log: Callable[[str], None] = say,
          restart: bool = False, stop: Callable[[], str | None] | None = None,
          locked: bool = False, data_exclude: Sequence[str | os.PathLike[str]] = ()
          ) -> RunResult:
    """Run (or resume) training as ``cfg`` says; ``stop_after`` interrupts a run early.

    Resuming from ``cfg.run_dir`` continues from its newest intact checkpoint and
    reproduces the losses of an uninterrupted run bit for bit (batches depend only on the
    step).  The run directory is locked while training (:class:`~sage_train.rundir.RunLock`);
    a rerun whose settings differ from the recorded ones in anything that changes the
    math or the data (:data:`~sage_train.rundir.MATH_FIELDS`) is refused unless
    ``allow_config_change``, which records the change as a new segment of the run and
    carries over what fits: the parameters and optimizer state across ``layers`` (the same
    numbers, stacked or unstacked), the parameters across an optimizer (with a fresh
    optimizer state); another model size is refused.

    A run directory holding checkpoints but no readable settings takes them from the
    newest verified checkpoint's manifest; where none records them it is refused unless
    ``allow_config_change``.  Checkpoints that all fail verification stop the run unless
    ``restart`` (start over from step 0; they are moved aside).

    ``stop`` is polled after every step: a signal name it returns stops the run there:
    ``SIGTERM``/``SIGUSR1`` (:data:`PREEMPT_SIGNALS`) after a checkpoint of the step reached
    is saved, others (``SIGINT``) at once; :attr:`RunResult.interrupted` names it.  The run
    directory, and ``data_exclude``, are never read as part of a text corpus.  ``locked``:
    the caller holds the run directory's lock.

    The attention and SinkGD kernel are resolved for the run's mesh (:func:`implementations`),
    logged at its start and recorded in ``config.json`` and in every ``metrics.jsonl`` row.
    The start is a header of aligned ``key: value`` lines (:func:`header`); then, where
    ``cfg.progress`` is off or stderr is no terminal, one plain line per ``metrics.jsonl`` row
    (:func:`sage_train.report.step_line`), else a progress bar.  ``init_from_hf``: a run that
    starts from step 0 starts from that Hugging Face checkpoint's weights.

    Raises:
      ConfigError: an invalid setting, or ``attention="cudnn"`` where cuDNN's attention
        cannot run (nothing is touched).
      RunDirError: the run directory is locked, holds another run's settings (or
        checkpoints whose settings are unknown, or that all fail verification), has a
        checkpoint beyond ``cfg.steps``, or cannot be written.
      DataError: the data cannot be used.
      RunFileError: a file of the run (a checkpoint: :class:`CheckpointError`, the metrics,
        the ``H_t`` record, the settings) could not be written; the earlier checkpoints are
        intact.
    """
    distributed.same_settings(agreed_settings(cfg))  # in a job: before anything else
    check_config(cfg)
    implementations(cfg)  # refuses what cannot run before anything is written
    check_init_from_hf(cfg)
    run_dir = pathlib.Path(cfg.run_dir).absolute()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"cannot create the run directory {run_dir}: {e.strerror}") from e
    primary = distributed.is_primary()
    if not primary:
        log = _quiet  # process 0 logs the run; the others log their own errors (raised)
    lock: Any = rundir.RunLock(run_dir) if primary and not locked else contextlib.nullcontext()
    with lock:
        if getattr(lock, "stale", None):
            log(lock.stale)
        opts = _Options(stop_after, allow_config_change, restart, stop,
                        (run_dir, *data_exclude))
        return _train_locked(cfg, run_dir, opts, log)


def _quiet(message: str) -> None:
    """The log of a process other than process 0 of a job: nothing (process 0 logs)."""


def agreed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that every process of a job must share.

    Every field that ``config.json`` records, as given (the data and run directory as
    absolute paths), but ``progress`` (a terminal is each process's own).
    """
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "progress"}
    out["data"] = rundir.normalize_data(cfg.data)
    out["run_dir"] = str(pathlib.Path(cfg.run_dir).absolute())
    return out


@dataclasses.dataclass(frozen=True)
class _Options:
    stop_after: int | None
    allow_change: bool
    restart: bool
    stop: Callable[[], str | None] | None
    data_exclude: tuple[Any, ...]


def _legacy(cfg: TrainConfig, recorded: dict[str, Any]) -> TrainConfig:
    """``cfg`` adjusted to continue a run recorded by an older version as it was."""
    if "layers" not in recorded:
        # a run of a version before scanned layers and mixed precision: its checkpoints
        # hold one module per layer, computed in float32; continue it as it was
        cfg = dataclasses.replace(cfg, layers="loop", dtype="float32")
    if "loss_chunk" not in recorded and cfg.loss_chunk is None:
        # a run of a version before the chunked loss computed it unchunked: continue so
        # (unless --loss-chunk says otherwise)
        cfg = dataclasses.replace(cfg, loss_chunk=0)
    if "attention" not in recorded and cfg.attention == "auto":
        # a run of a version before --attention computed XLA's attention (on a GPU too):
        # continue so (unless --attention says otherwise)
        cfg = dataclasses.replace(cfg, attention="xla")
    return cfg


def _recorded_settings(cfg: TrainConfig, run_dir: pathlib.Path, allow_change: bool,
                       log: Callable[[str], None]) -> dict[str, Any] | None:
    """The run's recorded settings, from its files or its newest verified checkpoint.

    Raises:
      RunDirError: the run holds checkpoints but its settings are unknown (and changes are
        not allowed).
    """
    recorded = _normalized(rundir.read_settings(run_dir))
    if recorded is not None:
        return recorded
    ckpts = Checkpoints(run_dir / "checkpoints", log=log)
    steps = ckpts.steps()
    if not steps:
        return None
    found = ckpts.recorded_settings()
    if found is not None:
        step, settings = found
        log(f"{run_dir} holds no readable {rundir.CONFIG} or {rundir.HISTORY}: its settings "
            f"are read from the manifest of its checkpoint of step {step}")
        return _normalized(settings)
    if not allow_change:
        raise RunDirError(
            f"{run_dir} holds checkpoints (steps {', '.join(map(str, steps))}) but no readable "
            f"{rundir.CONFIG} or {rundir.HISTORY}, and no verified checkpoint records its "
            "settings: they are unknown; pass --allow-config-change to continue it under "
            "the settings given now, or use another --run-dir")
    log(f"{run_dir}: the settings of its checkpoints are unknown; continuing under the "
        "settings given now (--allow-config-change)")
    return None


def _check_carry(run_dir: pathlib.Path, changed: dict[str, Any], ckpts: Checkpoints) -> None:
    """Refuse an allowed change that nothing in the checkpoints could carry over to."""
    if "model" in changed and ckpts.steps():
        old, new = changed["model"]
        raise RunDirError(
            f"the checkpoints of {run_dir} hold the {old!r} model, not {new!r}: parameters "
            "cannot carry over to another model size; use another --run-dir for a new run")


def _train_locked(cfg: TrainConfig, run_dir: pathlib.Path, opts: _Options,
                  log: Callable[[str], None]) -> RunResult:
    # in a job, the checks run on every process and fail on all of them or on none
    with distributed.together("to check the run"):
        recorded = _recorded_settings(cfg, run_dir, opts.allow_change, log)
        if recorded is not None:
            cfg = _legacy(cfg, recorded)
        if cfg.deterministic and not enable_determinism():
            log("--deterministic: JAX had already started its backend, so XLA's "
                "deterministic GPU reductions apply only if XLA_FLAGS held "
                "--xla_gpu_deterministic_ops=true before it did")
        mesh = make_mesh(cfg.sharding)
        impl = implementations(cfg, mesh)
        settings = settings_of(cfg, impl)
        changed = rundir.check_settings(run_dir, recorded, settings, opts.allow_change)
        rows = local_rows(mesh, cfg.batch_size)  # this process's rows of every batch
        ckpts = Checkpoints(run_dir / "checkpoints", keep=2, log=log)
        _check_carry(run_dir, changed, ckpts)
        ckpts.prepare()
    ckpts.check_shared()
    tokens, eval_set = load_tokens_once(cfg, opts.data_exclude, rows)
    with distributed.together("to check the data"):
        settings["data_fingerprint"] = data_fingerprint(tokens)
        settings.update(tokens.info)  # --data installed: corpus_fingerprint, corpus_tokens
        changed |= rundir.check_settings(run_dir, recorded, settings, opts.allow_change,
                                         ("data_fingerprint",))
        ckpts.settings = settings
        if cfg.init_from_hf is not None:
            _check_hf_tokenizer(cfg, tokens)
    model, optimizer = build(cfg, tokens.vocab_size)
    graphdef, state = nnx.split((model, optimizer))
    state = jax.device_put(state, state_shardings(state, mesh, cfg.sharding))
    opt_bytes = sage_optax.state_bytes(optimizer.opt_state)
    n_params = sum(int(x.size) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    del model, optimizer
    saved_as = None  # how the checkpoints were saved, where that differs from ``state``
    if recorded is not None and any(f in changed for f in STRUCTURE_FIELDS):
        old = dataclasses.replace(cfg, **{f: recorded[f] for f in STRUCTURE_FIELDS
                                          if f in changed})
        saved_as = _abstract_state(old, tokens.vocab_size, mesh)
    for line in header(cfg, run_dir, settings, impl, tokens, n_params, opt_bytes):
        log(line)
    init = (None if cfg.init_from_hf is None else
            lambda fresh: _init_from_hf(cfg, graphdef, fresh, mesh))  # only at step 0
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(ckpts.close)
        return _run(cfg, run_dir, ckpts, settings, changed, tokens, eval_set, graphdef, state,
                    mesh, opt_bytes, opts, saved_as, log, init, cleanup, rows)


def header(cfg: TrainConfig, run_dir: pathlib.Path, settings: dict[str, Any],
           impl: Implementations, tokens: data_lib.TokenData, n_params: int,
           opt_bytes: int) -> list[str]:
    """The start of a run's log: what it trains, with what, on what, as ``key: value`` lines.

    Every value is the one the run uses (the learning rate and hyperparameters resolved from
    the configuration, every ``auto`` resolved).
    """
    m = get_model_config(cfg.model)
    lr = settings["learning_rate"]
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    decay = ("constant" if cfg.schedule == "constant" else
             f"{cfg.schedule} decay to {cfg.final_lr_frac:g} x the peak at step {cfg.steps}")
    hps = ", ".join(f"{name} {settings[hp]:g}" if settings[hp] is not None else
                    f"{name} per rule" for hp, name in
                    (("b1", "b1"), ("b2", "b2"), ("weight_decay", "weight decay"))
                    if _rules_with(cfg.optimizer, hp))
    micro = cfg.batch_size // cfg.grad_accum
    batch = (f"{cfg.batch_size} x {cfg.seq_len}" if cfg.grad_accum == 1 else
             f"{cfg.batch_size} x {cfg.seq_len}, accumulated over {cfg.grad_accum} "
             f"micro-batches of {micro}")
    chunk = settings["loss_chunk"]
    outputs = [f"metrics.jsonl every {cfg.log_every} steps",
               f"test loss every {cfg.eval_every}", f"checkpoint every {cfg.checkpoint_every}"]
    if cfg.tensorboard:
        outputs.append("TensorBoard")
    if cfg.wandb is not None:
        outputs.append(f"W&B project {cfg.wandb}")
    rows = [
        ("run", str(run_dir)),
        ("model", f"{cfg.model}, {n_params:,} parameters ({m.num_layers} layers, hidden "
                  f"{m.hidden_size}, {m.num_heads} heads, {m.num_kv_heads} kv heads, vocab "
                  f"{tokens.vocab_size:,}, {'tied' if m.tie_embeddings else 'untied'} "
                  "embeddings)"),
        ("initial weights", settings.get("init_from_hf") or f"seed {cfg.seed}"),
        ("optimizer", f"{cfg.optimizer}, state {format_bytes(opt_bytes)}"
                      + (f" ({hps})" if hps else "")),
        ("learning rate", f"{lr:.3g} peak ("
                          + ("--lr" if cfg.learning_rate is not None else
                             f"{cfg.optimizer}'s default") + ")"),
        ("schedule", f"{warmup} warmup step{'' if warmup == 1 else 's'}, then {decay}"),
        ("clipping", f"global norm {cfg.clip:g}" if cfg.clip > 0 else "off"),
        ("tokens per step", f"{cfg.batch_size * cfg.seq_len:,} ({batch})"),
        ("dtype", f"{settings['dtype']} compute, {cfg.param_dtype} parameters"),
        ("layers", f"{settings['layers']} (remat {cfg.remat}; loss "
                   + (f"in chunks of {chunk} tokens)" if chunk else "unchunked)")),
        ("attention", f"{impl.attention} ({impl.attention_why})"),
        ("sinkgd kernel", f"{impl.sinkgd_kernel or '-'} ({impl.sinkgd_kernel_why})"),
        ("devices", f"{impl.devices} {impl.platform} (sharding {cfg.sharding}"
                    + (f"; {distributed.describe_job()})" if distributed.joined() else ")")),
        ("data", f"{tokens.source}: {len(tokens.train):,} train and {len(tokens.test):,} test "
                 "tokens"),
        ("length", f"{cfg.steps:,} steps ({cfg.steps * cfg.batch_size * cfg.seq_len:,} "
                   "tokens)"),
        ("outputs", ", ".join(outputs)),
    ]
    return report.header_lines(f"training {cfg.model} with {cfg.optimizer}", rows)


def _check_hf_tokenizer(cfg: TrainConfig, tokens: data_lib.TokenData) -> None:
    """Refuse ``init_from_hf`` weights whose tokenizer is not the one of the run's data.

    Raises:
      DataError: both have a tokenizer, with other vocabularies (one line).
    """
    path = pathlib.Path(cfg.init_from_hf or ".").expanduser() / hf_convert.TOKENIZER_FILE
    if tokens.tokenizer is None or not path.is_file():
        return
    from tokenizers import Tokenizer

    try:
        theirs = Tokenizer.from_file(str(path)).get_vocab()
    except Exception as e:  # noqa: BLE001 - any unreadable tokenizer is one line
        raise DataError(f"--init-from-hf: cannot read {path}: {e}") from None
    if theirs != tokens.tokenizer.get_vocab():
        raise DataError(
            f"--init-from-hf {cfg.init_from_hf}: its tokenizer is not the one of the data "
            f"{tokens.source!r} (the weights' token ids would stand for other tokens); train "
            "on the data it was trained on")


def _init_from_hf(cfg: TrainConfig, graphdef: Any, state: Any, mesh: Any) -> Any:
    """``state`` with the parameters of ``cfg.init_from_hf`` (the optimizer state as it is).

    Raises:
      ConfigError: the checkpoint's weights do not fit the model (each key named).
    """
    model, optimizer = nnx.merge(graphdef, state)
    try:
        hf_convert.from_hf_state_dict(model, hf_convert.load_weights(
            pathlib.Path(cfg.init_from_hf or ".").expanduser()))
    except ValueError as e:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf}: {e}") from None
    new = nnx.state((model, optimizer))
    return jax.device_put(new, state_shardings(new, mesh, cfg.sharding))


def _abstract_state(cfg: TrainConfig, vocab_size: int, mesh: Any) -> Any:
    """The state of ``cfg``'s model and optimizer as shapes with their shardings."""
    pair = nnx.eval_shape(lambda: build(cfg, vocab_size))
    abstract = nnx.state(pair)
    shardings = state_shardings(abstract, mesh, cfg.sharding)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract, shardings)


def _flat(tree: Any) -> dict[tuple[Any, ...], Any]:
    """``{key path: leaf}`` with plain keys (names and layer indices)."""
    def plain(k: Any) -> Any:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                return getattr(k, attr)
        return str(k)

    return {tuple(plain(k) for k in path): x
            for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _find(old: dict[tuple[Any, ...], Any], path: tuple[Any, ...]) -> Any:
    """The leaf of ``old`` for ``path``, across the ``loop``/``scan`` layouts of the layers.

    ``("layers", 3, ...)`` of one module per layer is row 3 of the stacked ``("layers", ...)``,
    and the stacked leaf is the per-layer leaves stacked; ``None`` where there is none.
    """
    if path in old:
        return old[path]
    if "layers" not in path:
        return None
    j = path.index("layers") + 1
    if j < len(path) and isinstance(path[j], int) and not isinstance(path[j], bool):
        stacked = old.get(path[:j] + path[j + 1:])  # looped target, scanned source
        return None if stacked is None or stacked.ndim == 0 else stacked[path[j]]
    rows: list[Any] = []
    while (row := old.get((*path[:j], len(rows), *path[j:]))) is not None:
        rows.append(row)
    return jnp.stack(rows) if rows else None


def carry_over(saved: Any, target: Any, keep_optimizer: bool) -> tuple[Any, str]:
    """``target`` with the leaves of ``saved`` carried over where they fit.

    Both are ``(model, optimizer)`` states; the parameters (``saved[0]``) must all fit
    (across the ``loop``/``scan`` layouts, cast to the target's dtype); the optimizer state
    is carried over where ``keep_optimizer`` and every leaf fits, else ``target``'s (fresh)
    one is kept.

    Returns:
      The state and what was carried over, for the log.

    Raises:
      RunDirError: a parameter of ``target`` has no counterpart of its shape in ``saved``.
    """
    old = _flat(saved)
    leaves, treedef = jax.tree_util.tree_flatten(target)
    paths = list(_flat(target))
    found = [_find(old, p) for p in paths]
    fits = [v is not None and tuple(v.shape) == tuple(t.shape)
            for v, t in zip(found, leaves, strict=True)]
    for p, ok in zip(paths, fits, strict=True):
        if p[0] == 0 and not ok:
            name = ".".join(str(k) for k in p[1:] if k != "value")
            raise RunDirError(f"the checkpoint holds no parameter {name} of the shape the new "
                              "settings need: it cannot carry over; use another --run-dir")
    opt_ok = keep_optimizer and all(ok for p, ok in zip(paths, fits, strict=True) if p[0] != 0)
    out = [jax.device_put(jnp.asarray(v).astype(t.dtype), t.sharding)
           if p[0] == 0 or opt_ok else t
           for p, v, t in zip(paths, found, leaves, strict=True)]
    what = ("the parameters and the optimizer state" if opt_ok else
            "the parameters; the optimizer state starts fresh (its moments, and its "
            "learning-rate schedule with its warmup, start over)")
    return jax.tree_util.tree_unflatten(treedef, out), what


def _run(cfg: TrainConfig, run_dir: pathlib.Path, ckpts: Checkpoints, settings: dict[str, Any],
         changed: dict[str, Any], tokens: data_lib.TokenData, eval_set: list[Any],
         graphdef: Any, state: Any, mesh: Any, opt_bytes: int, opts: _Options,
         saved_as: Any, log: Callable[[str], None], init: Callable[[Any], Any] | None,
         cleanup: contextlib.ExitStack, my_rows: slice | None = None) -> RunResult:
    stop_after = opts.stop_after
    poll = distributed.StopPoll(opts.stop)  # the same stops on every process of a job
    restored = ckpts.restore_latest(saved_as if saved_as is not None else state,
                                    restart=opts.restart)
    start, progress = 0, {}
    if restored is not None:
        start, progress = restored.step, restored.progress
        if saved_as is not None:
            keep = "optimizer" not in changed and (
                "clip" not in changed or (changed["clip"][0] > 0) == (cfg.clip > 0))
            state, what = carry_over(restored.state, state, keep)
            log(f"carried over from the checkpoint of step {start} under the changed "
                f"settings: {what}")
        else:
            state = restored.state
        log(f"resumed {run_dir} at step {start}")
    elif init is not None:
        state = init(state)
        log(f"initial weights from the Hugging Face checkpoint {cfg.init_from_hf}")
    if start > cfg.steps:
        raise distributed.everywhere(RunDirError(
            f"steps={cfg.steps} is below the newest checkpoint of {run_dir} (step {start}); "
            f"pass --steps {start} or more, or use another --run-dir"))
    if start == cfg.steps:
        log(f"{run_dir} is complete (step {start} of {cfg.steps}): nothing to train")
        return _complete(cfg, run_dir, opt_bytes)
    if (signal_name := poll.now()) is not None:
        return RunResult(cfg, start, [], None, opt_bytes, 0.0, start_step=start,
                         interrupted=signal_name)
    primary = distributed.is_primary()  # in a job of several processes, one writes
    rows = []
    trackers = None
    if primary:
        rundir.record_segment(run_dir, settings, start, changed)
        rows = rundir.resume_metrics(run_dir, start)
        if tokens.tokenizer is not None:
            _save_tokenizer(run_dir, tokens.tokenizer.to_str())
        if cfg.tensorboard or cfg.wandb is not None:
            trackers = cleanup.enter_context(contextlib.closing(report.Trackers(
                run_dir, tensorboard=cfg.tensorboard, wandb_project=cfg.wandb,
                start_step=start, settings=settings, name=run_dir.name)))
    if changed:
        log(f"settings changed at step {start}: {rundir.format_differences(changed)} "
            f"(recorded in {run_dir / rundir.HISTORY})")
    prior_elapsed, prior_tokens = _prior_progress(progress, rows, start)

    record_h = _uses_sage_embedding(cfg)
    recorder = DamperRecorder(run_dir / "damper_h.npz", cfg.record_h_every, cfg.h_max_records,
                              start_step=start, log=log) if record_h and primary else None
    train_step, eval_step = cached_steps(cfg, tokens.vocab_size, graphdef, record_h,
                                         (settings["attention"], settings["sinkgd_kernel"]),
                                         mesh)
    sched = lr_schedule(cfg)
    losses: list[float] = []
    stream = data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                              start_step=start, rows=my_rows)  # this process's rows
    end = cfg.steps if stop_after is None else max(start, min(cfg.steps, stop_after))
    bar = _progress(start, cfg.steps, cfg.progress) if primary else None
    if bar is None and primary and start < end:
        log(COMPILING)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    flops_token = flops_per_token(
        dataclasses.replace(get_model_config(cfg.model), vocab_size=tokens.vocab_size),
        cfg.seq_len)
    peak = _peak_tflops(cfg, log)
    # The clock: wall time from the end of the first (compiling) step, less evaluation,
    # checkpointing and the host's logging and H_t records; read only after a host sync, so
    # it covers finished device work.
    t0, excluded, timed_steps, test_ppl, stopped = _clock(), 0.0, 0, None, None
    wall0, wall_step0 = time.monotonic(), start  # the ETA's clock: wall time, all included
    elapsed, tps = prior_elapsed, (prior_tokens / prior_elapsed if prior_elapsed > 0 else 0.0)
    timed_tokens = prior_tokens
    good = start if restored is not None else None  # the newest finite checkpoint
    pending: list[tuple[int, Any, Any]] = []  # (step, (loss, grad norm), H_t) on the device
    interrupted: str | None = None
    for step in range(start, end):
        inputs, targets = shard_batch(next(stream), mesh, cfg.sharding, cfg.batch_size)
        state, loss, h = train_step(state, inputs, targets)  # loss: (loss, grad norm)
        done = step + 1
        keep_h = recorder is not None and done % cfg.record_h_every == 0
        pending.append((done, loss, h if keep_h else None))
        evaluate_now = done % cfg.eval_every == 0 or done == cfg.steps
        # the host syncs of the schedule: the same steps on every process of a job, where
        # the signals one of them received are agreed
        scheduled = (done % cfg.log_every == 0 or evaluate_now or done == end
                     or done % cfg.checkpoint_every == 0 or step == start)
        signal_name = poll(done, scheduled)
        if signal_name is not None and signal_name not in PREEMPT_SIGNALS:
            interrupted = signal_name  # Ctrl-C: stop now (the newest checkpoint stays)
            break
        save = done % cfg.checkpoint_every == 0 or done == end or signal_name is not None
        log_now = done % cfg.log_every == 0 or evaluate_now or save
        if not (log_now or step == start):
            continue  # no host sync: the next step is queued behind this one
        # the one host sync of a logging interval
        fetched = fetch([(loss, h) for _, loss, h in pending])
        now = _clock()
        if step == start:  # compilation: start the clock after the first step
            t0, excluded, timed_steps = now, 0.0, 0
            wall0, wall_step0 = time.monotonic(), done
        else:
            timed_steps += len(pending)
        kept_h = []
        grad_norm = math.nan
        for (d, _, _), ((value, norm), h_value) in zip(pending, fetched, strict=True):
            value = float(value)
            if not math.isfinite(value):
                stopped = (f"loss became {value} at step {d}: stopping; "
                           + _newest(ckpts, good))
                break
            losses.append(value)
            grad_norm = float(norm)
            if h_value is not None:
                kept_h.append((d, h_value))
        pending = []
        if stopped is not None:
            _record_h(recorder, kept_h)  # the finite steps' H_t
            log(stopped)
            break
        loss_value = losses[-1]
        elapsed = prior_elapsed + now - t0 - excluded
        timed_tokens = prior_tokens + timed_steps * tokens_per_step
        tps = timed_tokens / elapsed if elapsed > 0 else 0.0
        # host-side diagnostics and logging are off the tokens/s clock (the device idles
        # while they run: the next step is dispatched after them)
        t_host = _clock()
        _record_h(recorder, kept_h)
        excluded += _clock() - t_host
        if not log_now:
            continue
        record: dict[str, Any] = {"step": done, "loss": loss_value,
                                  "lr": float(sched(step)), "grad_norm": float(grad_norm),
                                  "tokens_per_s": tps,
                                  "elapsed_s": elapsed, "opt_state_bytes": opt_bytes,
                                  "attention": settings["attention"],
                                  "sinkgd_kernel": settings["sinkgd_kernel"]}
        if (u := mfu(tps, flops_token, peak)) is not None:
            record["mfu"] = u
        test_loss = None
        if evaluate_now:
            t_eval = _clock()
            test_loss = evaluate_loss(eval_step, state, eval_set, mesh, cfg.sharding,
                                      cfg.batch_size)
            test_ppl = math.exp(test_loss)
            excluded += _clock() - t_eval
            record["test_loss"], record["test_ppl"] = test_loss, test_ppl
        if (peak_bytes := peak_memory_bytes()) is not None:
            record["peak_memory_bytes"] = peak_bytes
        t_host = _clock()
        if primary:
            rundir.append_line(run_dir / rundir.METRICS, json.dumps(record), sync=False)
            if bar is not None:
                bar(done, loss_value, tps)
            else:
                seconds = time.monotonic() - wall0
                eta = (seconds / (done - wall_step0) * (cfg.steps - done)
                       if done > wall_step0 else None)
                log(report.step_line(done, cfg.steps, loss_value, record["lr"],
                                     record["grad_norm"], tps, eta, test_loss))
            if trackers is not None:
                trackers.write(done, record)
        excluded += _clock() - t_host
        if save:
            t_save = _clock()
            if not state_is_finite(state):
                stopped = (f"the parameters or optimizer state became NaN/Inf at step "
                           f"{done} (the loss was still finite): stopping without saving "
                           "them; " + _newest(ckpts, good))
                log(stopped)
                break
            ckpts.save(done, state, {"elapsed_s": elapsed, "timed_tokens": timed_tokens})
            good = done
            excluded += _clock() - t_save
        if signal_name is not None and done < cfg.steps:
            interrupted = signal_name
            log(f"{signal_name}: saved the checkpoint of step {done} ({ckpts.path(done)}); "
                "run the same command again to resume from it")
            break
    return RunResult(cfg, start + len(losses), losses, test_ppl, opt_bytes, tps, stopped,
                     start_step=start, mfu=mfu(tps, flops_token, peak), interrupted=interrupted)


def _record_h(recorder: DamperRecorder | None, rows: list[tuple[int, Any]]) -> None:
    """Add the fetched ``H_t`` rows to the record (each add rewrites ``damper_h.npz``)."""
    if recorder is not None:
        for step, h in rows:
            recorder.add(step, np.asarray(h))


_clock = time.perf_counter
"""The trainer's clock (a module attribute, so a test can stand in a slow checkpoint)."""


def fetch(tree: Any) -> Any:
    """Bring ``tree`` to the host: the trainer's only host sync of a logging interval."""
    return jax.device_get(tree)


def _peak_tflops(cfg: TrainConfig, log: Callable[[str], None]) -> float | None:
    """The peak TFLOP/s MFU is measured against, said once in the log."""
    dtype = compute_dtype(cfg)
    if cfg.peak_tflops is not None:
        log(f"MFU against --peak-tflops {cfg.peak_tflops:g} ({dtype})")
        return cfg.peak_tflops
    kind = jax.local_devices()[0].device_kind
    known = device_peak_tflops(kind, dtype)
    if known is None:
        if jax.default_backend() != "cpu":
            log(f"no known peak rate for {kind!r}: pass --peak-tflops for an MFU")
        return None
    log(f"MFU against {known[0]:g} TFLOP/s, the dense {dtype} peak of {known[1]} ({kind})")
    return known[0]


def _complete(cfg: TrainConfig, run_dir: pathlib.Path, opt_bytes: int) -> RunResult:
    """The result of a run that has nothing left to train, from its metrics."""
    rows = list(rundir.iter_metrics(run_dir))
    ppl = next((r["test_ppl"] for r in reversed(rows) if "test_ppl" in r), None)
    tps = float(rows[-1].get("tokens_per_s", 0.0)) if rows else 0.0
    return RunResult(cfg, cfg.steps, [], ppl, opt_bytes, tps, start_step=cfg.steps)


def _prior_progress(progress: dict[str, Any], rows: list[dict[str, Any]], start: int
                    ) -> tuple[float, float]:
    """Training seconds and timed tokens before ``start``.

    From the checkpoint's manifest, else (a checkpoint of an older version) from the
    metrics row of ``start``.
    """
    last = rows[-1] if rows and rows[-1]["step"] == start else {}
    elapsed = float(progress.get("elapsed_s", last.get("elapsed_s", 0.0)))
    tokens = float(progress.get("timed_tokens",
                                last.get("tokens_per_s", 0.0) * last.get("elapsed_s", 0.0)))
    return elapsed, tokens


def _newest(ckpts: Checkpoints, step: int | None) -> str:
    """Where a rerun would resume: the newest finite checkpoint, or nowhere."""
    if step is None:
        return "there is no finite checkpoint: a rerun starts from step 0"
    return (f"the newest finite checkpoint is step {step} ({ckpts.path(step)}), where a rerun "
            "resumes")


def _uses_sage_embedding(cfg: TrainConfig) -> bool:
    return get_preset(cfg.optimizer).embedding.name == "sage"


def _save_tokenizer(run_dir: pathlib.Path, text: str) -> None:
    """Keep the run's tokenizer in ``run_dir/tokenizer.json`` (what ``export`` writes out).

    Raises:
      RunFileError: it could not be written (one line naming it).
    """
    path = run_dir / hf_convert.TOKENIZER_FILE
    with contextlib.suppress(OSError):
        if path.read_text() == text:
            return
    rundir.atomic_write_text(path, text)


MIN_BAR_WIDTH = 40
"""The narrowest console a progress bar is drawn on; a narrower one (or one that reports a
width of 0, as some IDE and notebook consoles do) gets plain log lines."""


def terminal_width() -> int:
    """The columns of the progress bar's stream (stderr); 0 where unknown.

    ``COLUMNS`` if set, else the terminal's.
    """
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit():
        return int(columns)
    try:
        return os.get_terminal_size(sys.stderr.fileno()).columns
    except (AttributeError, ValueError, OSError):  # replaced, closed or not a terminal
        return 0


def is_terminal() -> bool:
    """Whether a progress bar can be drawn on stderr (else log lines).

    A terminal at least :data:`MIN_BAR_WIDTH` columns wide.
    """
    try:
        tty = sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False
    return tty and terminal_width() >= MIN_BAR_WIDTH


COMPILING = ("compiling the training step with XLA (the first step waits for it; minutes "
             "for a large model on a CPU)")
"""The line a run logs before its first step, where there is no progress bar."""

COMPILING_BAR = "compiling (XLA)"
"""The progress bar's description until the first step is done."""


def _progress(start: int, total: int, enabled: bool
              ) -> Callable[[int, float, float], None] | None:
    """A progress bar where ``enabled`` and on a terminal; ``None``: plain log lines instead."""
    if not (enabled and is_terminal()):
        return None
    bar = report.progress_bar(total=total, initial=start, unit="step", dynamic_ncols=True,
                              desc=COMPILING_BAR)
    if isinstance(bar, report.NoBar):
        return None  # no tqdm: plain log lines

    def update(step: int, loss: float, tps: float) -> None:
        if bar.desc:
            bar.set_description_str("")  # compiled
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        if step >= total:
            bar.close()

    return update


def run_losses(result: RunResult) -> tuple[list[int], list[float]]:
    """``(steps, losses)`` of the whole run behind ``result``, on its true step numbers.

    From the run's ``metrics.jsonl`` (every segment, each step once); where that holds
    nothing, the losses of this invocation, numbered from its resume step.
    """
    rows = [r for r in rundir.iter_metrics(pathlib.Path(result.config.run_dir))
            if isinstance(r.get("loss"), int | float)]
    if rows:
        return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]
    first = result.start_step + 1
    return list(range(first, first + len(result.losses))), list(result.losses)


def save_loss_curve(results: list[RunResult], path: pathlib.Path) -> None:
    """A PNG of training loss per step, one line per run, each over its whole history.

    Raises:
      RunFileError: the PNG could not be written (one line naming it; no temporary file
        is left behind).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        steps, losses = run_losses(r)
        ax.plot(steps, losses, label=r.config.optimizer)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"LLaMA {results[0].config.model} on "
                 f"{results[0].config.data or 'the standard-library corpus'}")
    ax.legend()
    fig.tight_layout()
    try:
        rundir.atomic_write_bytes(pathlib.Path(path),
                                  lambda f: fig.savefig(f, format="png", dpi=120))
    finally:
        plt.close(fig)
