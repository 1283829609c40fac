"""Pretrain a Flax NNX LLaMA with any of the paper's eight optimizer configurations.

One jitted train step with donated buffers over the (model, optimizer) state; data and
fully-sharded-data parallelism over ``jax.make_mesh`` on every local device; orbax
checkpoints that resume bit-identically; a progress bar, JSONL metrics, SAGE's damper
``H_t`` of the embedding recorded with bounded memory, and a loss-curve PNG.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import sage_optax
from sage_optim.models import get_model_config
from sage_optim.presets import get_preset
from sage_train import data as data_lib
from sage_train.diagnostics import DamperRecorder, embedding_damper
from sage_train.model import Llama, loss_fn
from sage_train.sharding import make_mesh, shard_batch, state_shardings


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
    run_dir: str = "runs/default"
    checkpoint_every: int = 100
    sharding: str = "dp"  # "dp", "fsdp" or "none"
    record_h_every: int = 10
    h_max_records: int = 512
    progress: bool = True


@dataclasses.dataclass
class RunResult:
    """What a finished (or stopped) run reports."""

    config: TrainConfig
    steps_done: int
    losses: list[float]
    final_test_ppl: float | None
    opt_state_bytes: int
    tokens_per_s: float
    stopped_reason: str | None = None


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


def make_tx(cfg: TrainConfig) -> optax.GradientTransformation:
    """Gradient clipping followed by the configuration, under the run's schedule."""
    tx = sage_optax.make_optimizer(cfg.optimizer, lr_schedule(cfg))
    return optax.chain(optax.clip_by_global_norm(cfg.clip), tx) if cfg.clip > 0 else tx


def build(cfg: TrainConfig, vocab_size: int) -> tuple[Llama, nnx.Optimizer]:
    """The model (vocabulary from the data) and its optimizer."""
    model_cfg = dataclasses.replace(get_model_config(cfg.model), vocab_size=vocab_size)
    model = Llama(model_cfg, rngs=nnx.Rngs(cfg.seed))
    return model, nnx.Optimizer(model, make_tx(cfg), wrt=nnx.Param)


STEP_FIELDS: tuple[str, ...] = (
    "model", "optimizer", "learning_rate", "schedule", "warmup_frac", "final_lr_frac", "steps",
    "clip", "sharding",
)
"""The :class:`TrainConfig` fields the compiled step depends on (the seed, data order and
logging do not): runs that agree on these share one compiled step in a process."""

_STEP_CACHE: dict[tuple[Any, ...], tuple[Callable[..., Any], Callable[..., Any]]] = {}


def cached_steps(cfg: TrainConfig, vocab_size: int, graphdef: Any, record_h: bool
                 ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """:func:`make_steps` for ``graphdef``, shared by every run with the same step fields.

    Two builds of the same model and optimizer give graph definitions that compare unequal
    (the optimizer holds fresh closures), so the cache is keyed on the configuration instead:
    several seeds, a resumed run or the same configuration again compile once per process.
    """
    key = (*(getattr(cfg, f) for f in STEP_FIELDS), vocab_size, record_h)
    if key not in _STEP_CACHE:
        if len(_STEP_CACHE) >= 8:
            _STEP_CACHE.pop(next(iter(_STEP_CACHE)))
        _STEP_CACHE[key] = make_steps(graphdef, record_h)
    return _STEP_CACHE[key]


def make_steps(graphdef: Any, record_h: bool) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The jitted train step (state donated) and eval step over the split state."""

    def train_step(state: Any, inputs: jax.Array, targets: jax.Array) -> Any:
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
        optimizer.update(model, grads)
        h = embedding_damper(optimizer, grads) if record_h else None
        return nnx.state((model, optimizer)), loss, h

    def eval_step(state: Any, inputs: jax.Array, targets: jax.Array) -> jax.Array:
        model, _ = nnx.merge(graphdef, state)
        return loss_fn(model, inputs, targets)

    return jax.jit(train_step, donate_argnums=0), jax.jit(eval_step)


def evaluate(eval_step: Callable[..., Any], state: Any, batches: list[Any], mesh: Any,
             mode: str) -> float:
    """Test perplexity: exp of the mean loss over the fixed evaluation windows."""
    losses = [float(eval_step(state, *shard_batch(b, mesh, mode))) for b in batches]
    return float(math.exp(np.mean(losses)))


def peak_memory_bytes() -> int | None:
    """Peak device memory, where the backend reports it (GPUs/TPUs; not the CPU)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("peak_bytes_in_use", 0)) or None


def train(cfg: TrainConfig, *, stop_after: int | None = None,
          log: Callable[[str], None] = print) -> RunResult:
    """Run (or resume) training as ``cfg`` says; ``stop_after`` interrupts a run early.

    Resuming from ``cfg.run_dir`` continues from its last checkpoint and reproduces the
    losses of an uninterrupted run bit for bit (batches depend only on the step).
    """
    import orbax.checkpoint as ocp

    run_dir = pathlib.Path(cfg.run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    tokens = data_lib.load_data(cfg.data, vocab_size=get_model_config(cfg.model).vocab_size)
    model, optimizer = build(cfg, tokens.vocab_size)
    graphdef, state = nnx.split((model, optimizer))
    mesh = make_mesh(cfg.sharding)
    state = jax.device_put(state, state_shardings(state, mesh, cfg.sharding))
    opt_bytes = sage_optax.state_bytes(optimizer.opt_state)
    del model, optimizer

    manager = ocp.CheckpointManager(
        run_dir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
    )
    start = 0
    if manager.latest_step() is not None:
        start = int(manager.latest_step())
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        log(f"resumed {run_dir} at step {start}")

    record_h = _uses_sage_embedding(cfg)
    recorder = DamperRecorder(run_dir / "damper_h.npz", cfg.record_h_every, cfg.h_max_records)
    train_step, eval_step = cached_steps(cfg, tokens.vocab_size, graphdef, record_h)
    eval_set = data_lib.eval_batches(tokens.test, cfg.batch_size, cfg.seq_len, cfg.eval_batches)
    sched = lr_schedule(cfg)
    metrics_path = run_dir / "metrics.jsonl"
    if start == 0 and metrics_path.exists():
        metrics_path.unlink()
    losses: list[float] = []
    stream = data_lib.batches(tokens.train, cfg.batch_size, cfg.seq_len, seed=cfg.seed,
                              start_step=start)
    end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
    bar = _progress(start, cfg.steps, cfg.progress)
    tokens_per_step = cfg.batch_size * cfg.seq_len
    t0, timed_steps, test_ppl, stopped = time.perf_counter(), 0, None, None
    eval_s = 0.0  # evaluation time, excluded from elapsed_s and tokens/s
    with metrics_path.open("a") as metrics:
        for step in range(start, end):
            inputs, targets = shard_batch(next(stream), mesh, cfg.sharding)
            state, loss, h = train_step(state, inputs, targets)
            loss = float(loss)
            if not math.isfinite(loss):
                stopped = (f"loss became {loss} at step {step + 1}: stopping; the last good "
                           f"checkpoint (step {manager.latest_step()}) is kept in {run_dir}")
                log(stopped)
                break
            losses.append(loss)
            if step == start:  # compilation: start the clock after the first step
                t0, timed_steps, eval_s = time.perf_counter(), 0, 0.0
            else:
                timed_steps += 1
            done = step + 1
            if record_h and done % cfg.record_h_every == 0:
                recorder.add(done, np.asarray(h))
            elapsed = time.perf_counter() - t0 - eval_s
            tps = timed_steps * tokens_per_step / elapsed if timed_steps else 0.0
            record: dict[str, Any] = {"step": done, "loss": loss, "lr": float(sched(step)),
                                      "tokens_per_s": tps, "elapsed_s": elapsed,
                                      "opt_state_bytes": opt_bytes}
            if done % cfg.eval_every == 0 or done == cfg.steps:
                t_eval = time.perf_counter()
                test_ppl = evaluate(eval_step, state, eval_set, mesh, cfg.sharding)
                eval_s += time.perf_counter() - t_eval
                record["test_ppl"] = test_ppl
            if (peak := peak_memory_bytes()) is not None:
                record["peak_memory_bytes"] = peak
            if done % cfg.log_every == 0 or "test_ppl" in record or done == end:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            bar(done, loss, tps)
            if done % cfg.checkpoint_every == 0 or done == end:
                manager.save(done, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()
    manager.close()
    recorder.save()
    elapsed = time.perf_counter() - t0 - eval_s
    tps = timed_steps * tokens_per_step / elapsed if timed_steps and elapsed > 0 else 0.0
    return RunResult(cfg, start + len(losses), losses, test_ppl, opt_bytes, tps, stopped)


def _uses_sage_embedding(cfg: TrainConfig) -> bool:
    return get_preset(cfg.optimizer).embedding.name == "sage"


def _progress(start: int, total: int, enabled: bool) -> Callable[[int, float, float], None]:
    if not enabled:
        return lambda step, loss, tps: None
    from tqdm.auto import tqdm

    bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True)

    def update(step: int, loss: float, tps: float) -> None:
        bar.update(step - bar.n)
        bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}")
        if step >= total:
            bar.close()

    return update


def save_loss_curve(results: list[RunResult], path: pathlib.Path) -> None:
    """A PNG of training loss per step, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        ax.plot(range(1, len(r.losses) + 1), r.losses, label=r.config.optimizer)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title(f"LLaMA {results[0].config.model} on "
                 f"{results[0].config.data or 'the standard-library corpus'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
