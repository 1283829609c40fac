"""SAGE's damper ``H_t`` of the embedding: computed in the train step, recorded with bounded memory.

The paper draws ``H_t`` as a heatmap over the first steps and later ones, and projects its
trajectory on principal components; :class:`DamperRecorder` keeps what those figures need.
"""

from __future__ import annotations

import os
import pathlib
import zipfile
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sage_optax
from sage_train.store.rundir import atomic_write_bytes


def _sage_states(opt_state: Any) -> list[sage_optax.ScaleBySageState]:
    return [x for x in jax.tree.leaves(
        opt_state, is_leaf=lambda x: isinstance(x, sage_optax.ScaleBySageState))
        if isinstance(x, sage_optax.ScaleBySageState)]


def embedding_damper(optimizer: Any, grads: Any, path: str = "embed.embedding",
                     b2: float = 0.99, eps: float = 1e-8) -> jax.Array:
    """``H_t`` of the SAGE state that trains ``path`` (an ``(V, d)`` table), shape ``(d,)``.

    Recomputed after the update from the new ``S_t`` and step count and from ``s_t`` of
    the gradient, exactly as :func:`sage_optax.scale_by_sage` formed it (with clipping in
    front, ``s_t`` is computed from the unclipped gradient, which changes nothing: ``H`` is
    invariant to the gradient's scale up to ε).
    """
    opt_state = sage_optax.unbox(getattr(optimizer, "opt_state", optimizer))
    grads = sage_optax.unbox(grads)
    g = dict(sage_optax.iter_leaves(grads))[path]
    for state in _sage_states(opt_state):
        leaves = dict(sage_optax.iter_leaves(state.s))
        if path in leaves:
            t = state.count.astype(jnp.float32)
            s_hat = leaves[path] / (1 - b2**t)
            s_t = jnp.mean(jnp.abs(g.astype(jnp.float32)), axis=-2)
            return sage_optax.sage_damper(s_t, s_hat, eps, rms_axes=(0,))
    raise ValueError(f"no SAGE state trains {path!r}; is the embedding routed to SAGE?")


class DamperRecorder:
    """Keep ``H_t`` every ``every`` steps in at most ``max_records`` rows, saved as made.

    When full, the interval doubles and the rows off the new interval are dropped, so
    memory stays bounded and the record still spans the whole run at a uniform interval.

    With ``autosave`` every recorded row rewrites the ``.npz`` file atomically (a complete
    old or new file, never a torn one), so a killed run keeps its ``H_t`` up to the kill.
    Resuming at ``start_step`` continues the saved record without its rows after that step
    (they are recorded again); a damaged file is reported through ``log`` in one line, moved
    aside to ``<name>.damaged.npz`` and the record starts anew: it never blocks a resume.
    """

    def __init__(self, path: pathlib.Path, every: int, max_records: int, *,
                 start_step: int | None = None, autosave: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.path, self.every, self.max_records = path, max(1, every), max(2, max_records)
        self.autosave = autosave
        self.steps: list[int] = []
        self.rows: list[np.ndarray] = []
        if path.exists():  # resuming: continue the record
            try:
                with np.load(path) as saved:
                    steps, rows = [int(s) for s in saved["steps"]], list(saved["h"])
                    every = int(saved["every"])
                if len(steps) != len(rows):
                    raise ValueError("steps and h differ in length")
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile) as e:
                dest = _free_name(path.with_name(path.stem + ".damaged.npz"))
                os.replace(path, dest)
                log(f"H_t record {path} is damaged ({type(e).__name__}); moved to {dest}, "
                    "recording anew")
            else:
                keep = [i for i, s in enumerate(steps)
                        if start_step is None or s <= start_step]
                self.steps = [steps[i] for i in keep]
                self.rows = [rows[i] for i in keep]
                self.every = every

    def add(self, step: int, h: np.ndarray) -> None:
        """Record ``H`` at ``step`` if it falls on the current interval (and save it)."""
        if step % self.every:
            return
        self.steps.append(step)
        self.rows.append(np.asarray(h, np.float32))
        if len(self.rows) > self.max_records:
            self.every *= 2
            keep = [i for i, s in enumerate(self.steps) if s % self.every == 0]
            self.steps = [self.steps[i] for i in keep]
            self.rows = [self.rows[i] for i in keep]
        if self.autosave:
            self.save()

    def save(self) -> None:
        """Write ``steps`` and ``h`` (records x d) to the ``.npz`` file, atomically.

        Raises:
          RunFileError: the file could not be written (a full disk, a read-only run
            directory): one line naming it; no temporary file is left behind.
        """
        if not self.rows:
            return
        steps, h, every = np.asarray(self.steps), np.stack(self.rows), self.every
        atomic_write_bytes(self.path, lambda f: np.savez(f, steps=steps, h=h, every=every))


def _free_name(path: pathlib.Path) -> pathlib.Path:
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate
