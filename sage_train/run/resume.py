"""Continuing a run: its recorded settings, what carries over, and where it starts.

A rerun reads the run directory's recorded settings (:func:`recorded_settings`), which
:func:`preflight` and :func:`sage_train.run.train.train` check against the new ones; an allowed
change of the saved state's layout (:data:`STRUCTURE_FIELDS`) restores the checkpoint as it
was saved (:func:`abstract_state`) and carries over what fits (:func:`carry_over`).
:func:`start_state` is where the loop starts: the newest checkpoint, or step 0 (from a
Hugging Face checkpoint's weights with ``init_from_hf``).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from sage_train.data import pipeline as data_lib
from sage_train.hf import convert as hf_convert
from sage_train.job.errors import ConfigError, DataError, RunDirError
from sage_train.model.sharding import state_shardings
from sage_train.run.config import TrainConfig
from sage_train.run.resolve import Run
from sage_train.run.steps import build
from sage_train.store import rundir
from sage_train.store.checkpoints import Checkpoints

STRUCTURE_FIELDS: tuple[str, ...] = ("model", "optimizer", "layers", "param_dtype", "clip")
"""Settings that change the layout of the saved state: a change of these (allowed) restores
the checkpoint as it was saved and carries over what fits (:func:`carry_over`)."""


def recorded_settings(run_dir: pathlib.Path, allow_change: bool,
                      log: Callable[[str], None]) -> dict[str, Any] | None:
    """The run's recorded settings, from its files or its newest verified checkpoint.

    ``config.json``, else ``config_history.jsonl``, else the newest checkpoint's manifest;
    ``None`` for a new run.

    Raises:
      RunDirError: the run holds checkpoints but its settings are unknown (and changes are
        not allowed).
    """
    recorded = rundir.read_settings(run_dir)
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
        return settings
    if not allow_change:
        raise RunDirError(
            f"{run_dir} holds checkpoints (steps {', '.join(map(str, steps))}) but no readable "
            f"{rundir.CONFIG} or {rundir.HISTORY}, and no verified checkpoint records its "
            "settings: they are unknown; pass --allow-config-change to continue it under "
            "the settings given now, or use another --run-dir")
    log(f"{run_dir}: the settings of its checkpoints are unknown; continuing under the "
        "settings given now (--allow-config-change)")
    return None


SCHEDULE_FIELDS: tuple[str, ...] = ("schedule", "warmup_frac", "final_lr_frac", "steps",
                                    "tail_from", "tail")
"""Settings whose change reshapes the learning-rate schedule (``--lr`` and ``--optimizer``
change the rate on purpose, and are not among them)."""


def check_carry(run_dir: pathlib.Path, changed: dict[str, Any], ckpts: Checkpoints,
                cfg: TrainConfig | None = None) -> None:
    """Refuse an allowed change that nothing in the checkpoints could carry over to.

    With ``cfg`` (the new settings), also a change of the schedule's shape (``--steps``,
    ``--schedule``, the warmup, the tail...) that would move the learning rate at the step
    the run resumes from: a finished run trained longer continues on a defined schedule
    (``--tail-from``, ``--tail``), never with a silent jump of its rate.
    """
    if "model" in changed and ckpts.steps():
        old, new = changed["model"]
        raise RunDirError(
            f"the checkpoints of {run_dir} hold the {old!r} model, not {new!r}: parameters "
            "cannot carry over to another model size; use another --run-dir for a new run")
    if cfg is None or not ckpts.steps() or "learning_rate" in changed or "optimizer" in changed:
        return
    reshaped = {f: v for f, v in changed.items() if f in SCHEDULE_FIELDS}
    if not reshaped:
        return
    from sage_train.run.steps import lr_schedule

    at = max(ckpts.steps())
    old_cfg = dataclasses.replace(cfg, **{f: old for f, (old, _) in reshaped.items()})
    before, after = float(lr_schedule(old_cfg)(at)), float(lr_schedule(cfg)(at))
    if abs(after - before) <= 1e-6 * max(abs(before), abs(after)):
        return
    old_steps = old_cfg.steps
    if cfg.steps > old_steps and cfg.tail_from is None:
        held = float(lr_schedule(old_cfg)(old_steps))
        ways = (f"to train longer, add --tail-from {old_steps} --tail constant (holds "
                f"{held:.3g}) or --tail rewarm (back to the peak, then decay)")
    else:
        ways = "to train on, keep the schedule's settings, or use another --run-dir"
    raise RunDirError(
        f"{ways}: {rundir.format_differences(reshaped)} would move the learning rate of "
        f"{run_dir} at step {at} from {before:.3g} to {after:.3g} (docs/training.md, "
        "\"Training a finished run longer\")")


def preflight(run: Run, *, allow_config_change: bool = False) -> None:
    """Check ``run``'s run directory as :func:`~sage_train.run.train.train` would, before it trains.

    Its recorded settings (``config.json``, else ``config_history.jsonl``, else the newest
    checkpoint's manifest) against ``run``'s; the lock is the caller's to take
    (``sage-train`` holds the locks of all its runs before it trains any).

    Raises:
      RunDirError: as :func:`~sage_train.run.train.train` would, before it trains.
    """
    if not run.run_dir.is_dir():
        return
    recorded = recorded_settings(run.run_dir, allow_config_change, lambda _: None)
    if recorded is None:
        return
    changed = rundir.check_settings(run.run_dir, recorded, run.settings(), allow_config_change)
    check_carry(run.run_dir, changed, Checkpoints(run.run_dir / "checkpoints"), run.config)


def saved_layout(run: Run, recorded: dict[str, Any] | None, changed: dict[str, Any],
                 vocab_size: int) -> Any:
    """The state as the checkpoints saved it, where an allowed change altered its layout.

    ``None`` where the checkpoints hold the layout of ``run`` (or there are none).
    """
    if recorded is None or not any(f in changed for f in STRUCTURE_FIELDS):
        return None
    old = dataclasses.replace(run.config, **{f: recorded[f] for f in STRUCTURE_FIELDS
                                             if f in changed})
    return abstract_state(old, vocab_size, run.mesh)


def abstract_state(cfg: TrainConfig, vocab_size: int, mesh: Any) -> Any:
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


def check_hf_tokenizer(cfg: TrainConfig, tokens: data_lib.TokenData) -> None:
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


def init_from_hf(run: Run, graphdef: Any, state: Any) -> Any:
    """``state`` with the parameters of ``init_from_hf`` (the optimizer state as it is).

    Raises:
      ConfigError: the checkpoint's weights do not fit the model (each key named).
    """
    cfg = run.config
    model, optimizer = nnx.merge(graphdef, state)
    try:
        hf_convert.from_hf_state_dict(model, hf_convert.load_weights(
            pathlib.Path(cfg.init_from_hf or ".").expanduser()))
    except ValueError as e:
        raise ConfigError(f"--init-from-hf {cfg.init_from_hf}: {e}") from None
    new = nnx.state((model, optimizer))
    return jax.device_put(new, state_shardings(new, run.mesh, cfg.sharding))


@dataclasses.dataclass
class Start:
    """Where a run's loop starts: its step, state, and the progress before it."""

    step: int
    state: Any
    resumed: bool
    elapsed: float  # training seconds before ``step``
    timed_tokens: float  # tokens trained in them


def start_state(run: Run, ckpts: Checkpoints, graphdef: Any, state: Any, saved_as: Any,
                changed: dict[str, Any], restart: bool, log: Callable[[str], None]) -> Start:
    """The state the loop starts from: the newest checkpoint, else ``state``.

    The checkpoint is carried over where ``saved_as`` says it was saved otherwise; a run
    that starts at step 0 with ``init_from_hf`` starts from that checkpoint's weights.

    Raises:
      RunDirError: the checkpoints cannot be restored (unless ``restart``) or carried over.
      ConfigError: ``init_from_hf``'s weights do not fit.
    """
    cfg = run.config
    restored = ckpts.restore_latest(saved_as if saved_as is not None else state,
                                    restart=restart)
    if restored is None:
        if cfg.init_from_hf is not None:
            state = init_from_hf(run, graphdef, state)
            log(f"initial weights from the Hugging Face checkpoint {cfg.init_from_hf}")
        return Start(0, state, False, 0.0, 0.0)
    start = restored.step
    if saved_as is not None:
        keep = "optimizer" not in changed and (
            "clip" not in changed or (changed["clip"][0] > 0) == (cfg.clip > 0))
        state, what = carry_over(restored.state, state, keep)
        log(f"carried over from the checkpoint of step {start} under the changed "
            f"settings: {what}")
    else:
        state = restored.state
    log(f"resumed {run.run_dir} at step {start}")
    progress = restored.progress
    return Start(start, state, True, float(progress.get("elapsed_s", 0.0)),
                 float(progress.get("timed_tokens", 0.0)))
