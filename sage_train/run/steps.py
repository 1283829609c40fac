"""The model, its optimizer and the jitted steps of a run.

:func:`build` makes the model and its optimizer (clipping, then the configuration under the
run's learning-rate schedule, its peak a value of the optimizer state: :func:`make_tx`);
:func:`make_steps` the jitted train step (state donated, ``grad_accum`` micro-batches:
:func:`loss_and_grads`) and eval step, which :func:`cached_steps` shares between the runs
of a process that compile the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import sage_optax
from sage_train.model.llama import Llama, loss_fn
from sage_train.model.shapes import get_model_config
from sage_train.model.sharding import shard_batch
from sage_train.run.config import (
    SCHEDULES,
    STEP_FIELDS,
    TrainConfig,
    compute_dtype,
    layer_layout,
    loss_chunk_tokens,
    peak_learning_rate,
)
from sage_train.run.diagnostics import embedding_damper

if TYPE_CHECKING:
    from sage_train.store.checkpoints import Checkpoints


def _decay(cfg: TrainConfig, peak: float, steps: int) -> optax.Schedule:
    """``cfg.schedule``'s decay from ``peak`` over ``steps`` steps."""
    if cfg.schedule == "cosine":
        return optax.cosine_decay_schedule(peak, steps, alpha=cfg.final_lr_frac)
    if cfg.schedule == "linear":
        return optax.linear_schedule(peak, peak * cfg.final_lr_frac, steps)
    return optax.constant_schedule(peak)


def unit_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The shape of :func:`lr_schedule`, for a peak of 1: what the compiled step holds.

    The peak learning rate is no constant of the compiled step: the optimizer's state holds
    it (:func:`make_tx`) and multiplies this schedule by it, so that the runs of one
    configuration at several rates share one compilation.
    """
    return _shape(cfg, 1.0)


def _shape(cfg: TrainConfig, peak: float) -> optax.Schedule:
    """Linear warmup to ``peak``, then ``cfg.schedule``; then the tail (:func:`lr_schedule`)."""
    if cfg.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if cfg.tail_from is not None and cfg.tail_from < cfg.steps:
        at = cfg.tail_from
        base = _shape(dataclasses.replace(cfg, steps=at, tail_from=None, tail=None), peak)
        with jax.ensure_compile_time_eval():  # a number, also when built inside a trace
            start = float(base(at))
        if (cfg.tail or "constant") == "constant":
            tail = optax.constant_schedule(start)
        else:
            added = cfg.steps - at
            warm = max(1, int(cfg.warmup_frac * added))

            def climb(count: Any) -> Any:  # exactly ``start`` at the tail's first step
                frac = jnp.minimum(jnp.asarray(count, jnp.float32), warm) / warm
                return jnp.asarray(start, jnp.float32) + (peak - start) * frac

            tail = optax.join_schedules([climb, _decay(cfg, peak, max(added - warm, 1))],
                                        [warm])
        return optax.join_schedules([base, tail], [at])
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    rest = max(cfg.steps - warmup, 1)
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup),
                                 _decay(cfg, peak, rest)], [warmup])


def scaled(unit: optax.Schedule, peak: Any) -> optax.Schedule:
    """``peak`` (a number or a traced float32 scalar) times the unit-peak schedule ``unit``.

    The one product both the optimizer (its state's peak) and the log (the run's peak) use:
    the rate logged at a step is the rate the step applied, to the last bit.
    """
    def schedule(count: Any) -> Any:
        return jnp.asarray(peak, jnp.float32) * unit(count)

    return schedule


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
    """The learning rate per step: linear warmup, then ``cfg.schedule``; then the tail.

    The warmup covers ``warmup_frac`` of the steps; cosine and linear then decay to
    ``final_lr_frac`` of the peak (the paper: cosine with 10% warmup).  With
    ``cfg.tail_from`` (a finished run trained longer), the steps before it follow the
    schedule of ``steps=tail_from``, exactly as the run was trained, and the steps from it
    the tail, which starts at the rate that schedule reached (no jump): ``constant`` holds
    it, ``rewarm`` climbs from it back to the peak over ``warmup_frac`` of the added steps,
    then decays as ``cfg.schedule`` to ``final_lr_frac`` of the peak at ``cfg.steps``.

    It is the run's peak (:func:`~sage_train.run.config.peak_learning_rate`) times
    :func:`unit_schedule`, the product the optimizer computes (:func:`make_tx`).
    """
    return scaled(unit_schedule(cfg), peak_learning_rate(cfg))


def describe_schedule(cfg: TrainConfig, schedule: optax.Schedule | None = None) -> str:
    """The schedule in words, as the run's header prints it (the tail's rates included).

    ``schedule`` is ``cfg``'s (:func:`lr_schedule`), where the caller holds it already.
    """
    warmup = max(1, int(cfg.warmup_frac * cfg.steps))
    decay = ("constant" if cfg.schedule == "constant" else
             f"{cfg.schedule} decay to {cfg.final_lr_frac:g} x the peak at step {cfg.steps}")
    if cfg.tail_from is None or cfg.tail_from >= cfg.steps:
        return f"{warmup} warmup step{'' if warmup == 1 else 's'}, then {decay}"
    at = cfg.tail_from
    base = describe_schedule(dataclasses.replace(cfg, steps=at, tail_from=None, tail=None))
    lr = schedule if schedule is not None else lr_schedule(cfg)
    start = float(lr(at))
    if (cfg.tail or "constant") == "constant":
        tail = f"constant {start:.3g} to step {cfg.steps}"
    else:
        added = cfg.steps - at
        warm = max(1, int(cfg.warmup_frac * added))
        peak = peak_learning_rate(cfg)
        tail = f"rewarm from {start:.3g} to the peak {peak:.3g} by step {at + warm}, then {decay}"
    return f"{base}; from step {at} (--tail-from): {tail}"


PEAK = "peak_learning_rate"
"""The key of the run's peak learning rate in the optimizer state's ``hyperparams``."""


def make_tx(cfg: TrainConfig, model: Llama | None = None) -> optax.GradientTransformation:
    """Gradient clipping followed by the configuration, under the run's schedule.

    The schedule is the peak times :func:`unit_schedule`; the peak is a float32 scalar of
    the optimizer state (``optax.inject_hyperparams``: ``hyperparams[PEAK]``), not a
    constant of the compiled step, so that runs of one configuration at several rates
    (and seeds) share one compiled step (:func:`cached_steps`; :func:`set_peak` gives a
    state another peak).  Every kind takes the one schedule (the trainer sets no
    ``<kind>_learning_rate``), so all kinds scale with the peak together.

    ``model`` is the router's evidence: with scanned layers it is what lets the router read
    a ``(L, in, out)`` kernel as ``L`` stacked matrices (without it such a leaf is refused).
    """
    unit = unit_schedule(cfg)

    def at_peak(peak_learning_rate: Any) -> optax.GradientTransformation:
        tx = sage_optax.make_optimizer(cfg.optimizer, scaled(unit, peak_learning_rate),
                                       model=model, impl=cfg.sinkgd_kernel,
                                       weight_decay=cfg.weight_decay, b1=cfg.b1, b2=cfg.b2)
        return optax.chain(optax.clip_by_global_norm(cfg.clip), tx) if cfg.clip > 0 else tx

    return optax.inject_hyperparams(at_peak, hyperparam_dtype=jnp.float32)(
        peak_learning_rate=peak_learning_rate(cfg))


def _is_peak(path: tuple[Any, ...]) -> bool:
    return any(getattr(k, "key", None) == PEAK for k in path)


def peak_leaves(state: Any) -> list[Any]:
    """The peak learning rates held by ``state`` (a run's split state or an optimizer's)."""
    return [leaf for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
            if _is_peak(path)]


def set_peak(state: Any, peak: float) -> Any:
    """``state`` with its optimizer's peak learning rate set to ``peak`` (sharding kept).

    A restored checkpoint holds the peak it was saved with; the run trains at its own
    (``--lr`` may change on resume).

    Raises:
      ValueError: ``state`` holds no peak (an optimizer not built by :func:`make_tx`).
    """
    found = []

    def put(path: tuple[Any, ...], leaf: Any) -> Any:
        if not _is_peak(path):
            return leaf
        found.append(path)
        value = jnp.asarray(peak, jnp.float32)
        sharding = getattr(leaf, "sharding", None)
        return value if sharding is None else jax.device_put(value, sharding)

    new = jax.tree_util.tree_map_with_path(put, state)
    if not found:
        raise ValueError("the state holds no peak learning rate (not built by make_tx)")
    return new


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


_STEP_CACHE: dict[tuple[Any, ...], tuple[Callable[..., Any], Callable[..., Any]]] = {}


def cached_steps(cfg: TrainConfig, vocab_size: int, graphdef: Any, record_h: bool,
                 resolved: tuple[Any, ...] = (), mesh: Any = None
                 ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """:func:`make_steps` for ``graphdef``, shared by every run with the same step fields.

    Two builds of the same model and optimizer give graph definitions that compare unequal
    (the optimizer holds fresh closures), so the cache is keyed on the configuration instead:
    several seeds and rates (the peak is a value of the state: :func:`make_tx`), a resumed
    run or the same configuration again compile once per process.
    ``resolved`` joins the key: what the step was traced with beyond ``cfg`` (the
    implementations, which ``SAGE_KERNELS`` can change, and the resolved loss chunk), and
    ``mesh``.
    """
    key = (tuple(getattr(cfg, f) for f in STEP_FIELDS), vocab_size, record_h, tuple(resolved),
           mesh)
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
    graphdef, params, rest = cast(tuple[Any, Any, Any], nnx.split(model, nnx.Param, ...))

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
                  batch_size: int | None = None) -> float:
    """Test loss: the mean loss over the fixed evaluation windows.

    ``batches`` hold this process's rows of global batches of ``batch_size`` rows (default:
    all rows, as with one process).
    """
    return float(np.mean([float(eval_step(state, *shard_batch(b, mesh, batch_size)))
                          for b in batches]))


def holds_no_peak(ckpts: Checkpoints) -> bool:
    """Whether ``ckpts`` has checkpoints and none holds the peak learning rate.

    The peak is a value of the optimizer state since issue 46 (``hyperparams[PEAK]``:
    :func:`make_tx`); a checkpoint written before has another state layout, which orbax would
    refuse with a tree-structure message instead of the one line its callers give
    (:func:`sage_train.run.train.refuse_checkpoints_without_peak`, ``sage-train export``).
    A checkpoint whose metadata cannot be read counts as holding it: the restore names its
    problem.
    """
    steps = ckpts.steps()
    found = []
    for step in steps:
        try:
            found.append(PEAK in (ckpts.path(step) / "_METADATA").read_text())
        except OSError:
            found.append(True)
    return bool(steps) and not any(found)
