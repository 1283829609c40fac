"""One ``sage-train`` run resolved once: :class:`Run` and :func:`resolve`.

:func:`resolve` checks a :class:`~sage_train.run.config.TrainConfig`
(:func:`~sage_train.run.config.check_config`, :func:`check_init_from_hf`, the checks that read
files), builds the run's device mesh and decides what the run computes
with (:func:`implementations`); the frozen :class:`Run` it returns (preset, model shape,
implementations, mesh, data source, every ``auto`` resolved) is what the rest of the trainer
reads, so that no check or decision runs twice.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sage_optax import placement, resolved_sinkgd_impl
from sage_optim import kernels
from sage_optim.presets import Preset, get_preset
from sage_optim.table import format_bytes
from sage_train.data import pipeline as data_lib
from sage_train.hf import convert as hf_convert
from sage_train.job import distributed
from sage_train.job.errors import ConfigError, require
from sage_train.model.llama import attention_choice, cudnn_present, cudnn_problem
from sage_train.model.shapes import LlamaConfig, get_model_config, is_model_file
from sage_train.model.sharding import make_mesh, mesh_platform
from sage_train.run.config import (
    TrainConfig,
    check_config,
    compute_dtype,
    default_hyperparameter,
    layer_layout,
    loss_chunk_tokens,
    option_flag,
    peak_learning_rate,
    rules_with,
    uses_sinkgd,
)
from sage_train.run.steps import describe_schedule, lr_schedule
from sage_train.store import report, rundir


@dataclasses.dataclass(frozen=True)
class Implementations:
    """What a run computes with on its mesh's devices: recorded, printed, in every metrics row.

    ``attention`` is ``"cudnn"`` or ``"xla"`` (:func:`~sage_train.model.llama.attention_choice`);
    ``sinkgd_kernel`` is ``"pallas"`` or ``"jnp"``
    (:func:`~sage_optax.resolved_sinkgd_impl`, ``SAGE_KERNELS`` included), ``None`` for a
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
    optimizer choose by the same rules (:func:`~sage_train.model.llama.attention_choice`,
    :func:`~sage_optax.resolved_sinkgd_impl`) where their arrays are.

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
        # the update decides with the process's CUDA (CPU) devices (it cannot see the mesh
        # when traced): a --sharding none run on a host with several GPUs keeps the jnp path,
        # and so does one in a process of several CPU devices (the native kernel's rule)
        count = (placement.cuda_device_count() if platform in ("cuda", "gpu")
                 else jax.device_count("cpu") if platform == "cpu" else n)
        kernel = resolved_sinkgd_impl(cfg.sinkgd_kernel, platform, count, kind)
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


@dataclasses.dataclass(frozen=True)
class Run:
    """A :class:`~sage_train.run.config.TrainConfig` checked and resolved, once per run.

    Attributes:
      config: the configuration as given.
      preset: its optimizer configuration (:func:`~sage_optim.presets.get_preset`).
      model: the model's shape (the vocabulary is the data's: :meth:`model_config`).
      impl: the attention and SinkGD kernel on the mesh's devices.
      mesh: the device mesh of ``config.sharding``.
      dtype: the computation dtype (``auto`` resolved).
      layers: the layout of the decoder layers (``auto`` resolved).
      loss_chunk: tokens per chunk of the loss (0: unchunked; ``auto`` resolved).
      run_dir: the run directory, absolute.
      learning_rate: the peak learning rate (``--lr``, else the configuration's:
        :func:`~sage_train.run.config.peak_learning_rate`).
      schedule: the learning rate per step (:func:`~sage_train.run.steps.lr_schedule`), built
        once: the optimizer, the loop's metrics and the header read this one.
    """

    config: TrainConfig
    preset: Preset
    model: LlamaConfig
    impl: Implementations
    mesh: Any
    dtype: str
    layers: str
    loss_chunk: int
    run_dir: pathlib.Path
    learning_rate: float
    schedule: Callable[[Any], Any]

    @property
    def records_h(self) -> bool:
        """Whether the run records SAGE's damper ``H_t`` of the embedding."""
        return self.preset.embedding.name == "sage"

    def model_config(self, vocab_size: int) -> LlamaConfig:
        """The model's configuration with the data's vocabulary."""
        return dataclasses.replace(self.model, vocab_size=vocab_size)

    def settings(self) -> dict[str, Any]:
        """The settings recorded for the run (so that equal settings compare equal).

        The configuration with the peak learning rate resolved, the data source (and
        ``init_from_hf``) as an absolute path, every ``auto`` resolved: the attention and
        SinkGD kernel as :attr:`impl` says (the kernel ``None`` for a configuration without
        SinkGD), and ``weight_decay``, ``b1``, ``b2`` left unset resolved to the
        configuration's value where its rules share one.
        """
        cfg = self.config
        settings = dataclasses.asdict(cfg)
        settings["learning_rate"] = self.learning_rate
        settings["data"] = rundir.normalize_data(cfg.data)
        settings["dtype"] = self.dtype
        settings["layers"] = self.layers
        settings["loss_chunk"] = self.loss_chunk
        settings["attention"] = self.impl.attention
        settings["sinkgd_kernel"] = self.impl.sinkgd_kernel
        for hp in ("weight_decay", "b1", "b2"):
            if settings[hp] is None:  # the configuration's value, where its rules share one
                settings[hp] = default_hyperparameter(cfg.optimizer, hp)
        if cfg.init_from_hf is not None:
            settings["init_from_hf"] = str(pathlib.Path(cfg.init_from_hf).expanduser().absolute())
        if is_model_file(cfg.model):  # a shape's file: where it is, and the shape it held
            settings["model"] = str(pathlib.Path(cfg.model).expanduser().absolute())
            settings["model_shape"] = dataclasses.asdict(self.model)
        return settings


def resolve(cfg: TrainConfig, *, checked: bool = False) -> Run:
    """``cfg`` checked and resolved into a :class:`Run` (this starts JAX's backend).

    ``checked``: :func:`check_config` and :func:`check_init_from_hf` already passed (the
    command line checks every configuration before it joins a job).

    Raises:
      ConfigError: an invalid setting, or ``attention="cudnn"`` where cuDNN's attention
        cannot run.
    """
    if not checked:
        check_config(cfg)
        check_init_from_hf(cfg)
    mesh = make_mesh(cfg.sharding)
    return Run(config=cfg, preset=get_preset(cfg.optimizer), model=get_model_config(cfg.model),
               impl=implementations(cfg, mesh), mesh=mesh, dtype=compute_dtype(cfg),
               layers=layer_layout(cfg), loss_chunk=loss_chunk_tokens(cfg),
               run_dir=pathlib.Path(cfg.run_dir).absolute(),
               learning_rate=peak_learning_rate(cfg), schedule=lr_schedule(cfg))


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


def header(run: Run, settings: dict[str, Any], tokens: data_lib.TokenData, n_params: int,
           opt_bytes: int) -> list[str]:
    """The start of a run's log: what it trains, with what, on what, as ``key: value`` lines.

    Every value is the one the run uses (the learning rate and hyperparameters resolved from
    the configuration, every ``auto`` resolved).
    """
    cfg, m, impl = run.config, run.model, run.impl
    hps = ", ".join(f"{name} {settings[hp]:g}" if settings[hp] is not None else
                    f"{name} per rule" for hp, name in
                    (("b1", "b1"), ("b2", "b2"), ("weight_decay", "weight decay"))
                    if rules_with(cfg.optimizer, hp))
    batch = (f"{cfg.batch_size} x {cfg.seq_len}" if cfg.grad_accum == 1 else
             f"{cfg.batch_size} x {cfg.seq_len}, accumulated over {cfg.grad_accum} "
             f"micro-batches of {cfg.batch_size // cfg.grad_accum}")
    outputs = [f"metrics.jsonl every {cfg.log_every} steps",
               f"test loss every {cfg.eval_every}", f"checkpoint every {cfg.checkpoint_every}"]
    outputs += ["TensorBoard"] if cfg.tensorboard else []
    outputs += [f"W&B project {cfg.wandb}"] if cfg.wandb is not None else []
    job = f"; {distributed.describe_job()})" if distributed.joined() else ")"
    rows = [
        ("run", str(run.run_dir)),
        ("model", f"{cfg.model}, {n_params:,} parameters ({m.num_layers} layers, hidden "
                  f"{m.hidden_size}, {m.num_heads} heads, {m.num_kv_heads} kv heads, vocab "
                  f"{tokens.vocab_size:,}, {'tied' if m.tie_embeddings else 'untied'} "
                  "embeddings)"),
        ("initial weights", settings.get("init_from_hf") or f"seed {cfg.seed}"),
        ("optimizer", f"{cfg.optimizer}, state {format_bytes(opt_bytes)}"
                      + (f" ({hps})" if hps else "")),
        ("learning rate", f"{settings['learning_rate']:.3g} peak ("
                          + (option_flag("learning_rate") if cfg.learning_rate is not None else
                             f"{cfg.optimizer}'s default") + ")"),
        ("schedule", describe_schedule(cfg, run.schedule)),
        ("clipping", f"global norm {cfg.clip:g}" if cfg.clip > 0 else "off"),
        ("tokens per step", f"{cfg.batch_size * cfg.seq_len:,} ({batch})"),
        ("dtype", f"{run.dtype} compute, {cfg.param_dtype} parameters"),
        ("layers", f"{run.layers} (remat {cfg.remat}; loss "
                   + (f"in chunks of {run.loss_chunk} tokens)" if run.loss_chunk
                      else "unchunked)")),
        ("attention", f"{impl.attention} ({impl.attention_why})"),
        ("sinkgd kernel", f"{impl.sinkgd_kernel or '-'} ({impl.sinkgd_kernel_why})"),
        ("devices", f"{impl.devices} {impl.platform} (sharding {cfg.sharding}{job}"),
        ("data", f"{tokens.source}: {len(tokens.train):,} train and {len(tokens.test):,} test "
                 "tokens"),
        ("length", f"{cfg.steps:,} steps ({cfg.steps * cfg.batch_size * cfg.seq_len:,} "
                   "tokens)"),
        ("outputs", ", ".join(outputs)),
    ]
    return report.header_lines(f"training {cfg.model} with {cfg.optimizer}", rows)


def check_init_from_hf(cfg: TrainConfig) -> None:
    """Refuse an ``init_from_hf`` checkpoint that is not of ``cfg.model``'s architecture.

    Reads its ``config.json`` only (:func:`~sage_train.hf.convert.config_mismatches`).

    Raises:
      ConfigError: the directory holds no readable ``config.json``, or one whose fields
        differ from the model's (each named, in one line).
    """
    if cfg.init_from_hf is None:
        return
    require("safetensors", "--init-from-hf")
    try:
        hf = hf_convert.read_config(pathlib.Path(cfg.init_from_hf).expanduser())
    except ValueError as e:
        raise ConfigError(f"--init-from-hf: {e}") from None
    wrong = hf_convert.config_mismatches(hf, get_model_config(cfg.model))
    if wrong:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf} does not hold the {cfg.model} "
                          f"model's architecture: {', '.join(wrong)}; pass the --model it "
                          "was trained as")


def agreed_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings of ``cfg`` that every process of a job must share.

    Every field that ``config.json`` records, as given (the data and run directory as
    absolute paths), but ``progress`` (a terminal is each process's own).
    """
    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k != "progress"}
    out["data"] = rundir.normalize_data(cfg.data)
    out["run_dir"] = str(pathlib.Path(cfg.run_dir).absolute())
    return out
