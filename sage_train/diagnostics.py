"""SAGE's damper ``H_t`` of the embedding: computed in the train step, recorded with bounded memory.

The paper draws ``H_t`` as a heatmap over the first steps and later ones, and projects its
trajectory on principal components; :class:`DamperRecorder` keeps what those figures need.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import sage_optax
from sage_optax import axes as axes_lib


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
    opt_state = axes_lib.unbox(getattr(optimizer, "opt_state", optimizer))
    grads = axes_lib.unbox(grads)
    g = dict(sage_optax.routing.iter_leaves(grads))[path]
    for state in _sage_states(opt_state):
        leaves = dict(sage_optax.routing.iter_leaves(state.s))
        if path in leaves:
            t = state.count.astype(jnp.float32)
            s_hat = leaves[path] / (1 - b2**t)
            s_t = jnp.mean(jnp.abs(g.astype(jnp.float32)), axis=-2)
            return sage_optax.sage_damper(s_t, s_hat, (0,), eps)
    raise ValueError(f"no SAGE state trains {path!r}; is the embedding routed to SAGE?")


class DamperRecorder:
    """Keep ``H_t`` every ``every`` steps in at most ``max_records`` rows.

    When full, the interval doubles and the rows off the new interval are dropped, so
    memory stays bounded and the record still spans the whole run at a uniform interval.
    """

    def __init__(self, path: pathlib.Path, every: int, max_records: int) -> None:
        self.path, self.every, self.max_records = path, max(1, every), max(2, max_records)
        self.steps: list[int] = []
        self.rows: list[np.ndarray] = []
        if path.exists():  # resuming: continue the record
            saved = np.load(path)
            self.steps, self.rows = list(saved["steps"]), list(saved["h"])
            self.every = int(saved["every"])

    def add(self, step: int, h: np.ndarray) -> None:
        """Record ``H`` at ``step`` if it falls on the current interval."""
        if step % self.every:
            return
        self.steps.append(step)
        self.rows.append(np.asarray(h, np.float32))
        if len(self.rows) > self.max_records:
            self.every *= 2
            keep = [i for i, s in enumerate(self.steps) if s % self.every == 0]
            self.steps = [self.steps[i] for i in keep]
            self.rows = [self.rows[i] for i in keep]

    def save(self) -> None:
        """Write ``steps`` and ``h`` (records x d) to the ``.npz`` file."""
        if self.rows:
            np.savez(self.path, steps=np.asarray(self.steps), h=np.stack(self.rows),
                     every=self.every)
