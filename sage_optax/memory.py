"""Exact optimizer-state memory, from a state or its ``jax.eval_shape`` (paper Table 4)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sage_optax import axes as axes_lib
from sage_optax import routing


def leaf_bytes(x: Any) -> int:
    """Bytes of one array or ``jax.ShapeDtypeStruct`` (0 for non-arrays)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        return 0
    return int(np.prod(x.shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize


def state_bytes(opt_state: Any) -> int:
    """Exact number of bytes held by an optimizer state (or its ``jax.eval_shape``).

    Every array leaf counts ``size * itemsize``; empty states, ``MaskedNode`` and Python
    scalars count nothing.  Use ``state_bytes(jax.eval_shape(tx.init, params))`` to count
    without allocating.

    Examples:
      AdamW's two float32 moments of a ``(16, 4)`` table (512 bytes) and its step count:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> params = {"embedding": jnp.ones((16, 4))}
      >>> print(sage_optax.state_bytes(jax.eval_shape(optax.adamw(1e-3).init, params)))
      516

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 4: optimizer-state memory).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (AdamW, the two-state baseline).
    """
    return sum(leaf_bytes(x) for x in jax.tree.leaves(opt_state))


def state_bytes_by_leaf(opt_state: Any, params: Any) -> tuple[dict[str, int], int]:
    """Attribute state bytes to the parameter leaves they belong to.

    Every sub-tree of the state that has the structure of ``params`` (moments, EMAs, also
    with ``optax.MaskedNode`` in place of the leaves another partition owns) is charged
    leaf-by-leaf to the parameter at the same position.  Everything else (step counts,
    injected hyperparameters) is returned as the shared remainder.

    Returns:
      ``({dotted parameter path: bytes}, shared_bytes)``.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Table 4: optimizer-state memory).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (AdamW, the two-state baseline).
    """
    params, opt_state = axes_lib.unbox(params), axes_lib.unbox(opt_state)
    treedef: Any = jax.tree.structure(params, is_leaf=axes_lib.is_masked)
    names = [name for name, _ in routing.iter_leaves(params)]
    per_leaf = dict.fromkeys(names, 0)
    if treedef.num_leaves == 1 and treedef.num_nodes == 1:  # params is a single array
        return {names[0]: state_bytes(opt_state)}, 0
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    order = [routing.leaf_name_path(p) for p, _ in with_path]
    shared = 0

    def visit(node: Any) -> None:
        nonlocal shared
        if axes_lib.is_masked(node):
            return
        try:
            parts = treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            parts = None
        if parts is not None and not hasattr(node, "dtype"):
            for name, part in zip(order, parts, strict=True):
                if name in per_leaf:
                    per_leaf[name] += state_bytes(part)
            return
        children = jax.tree.leaves(node, is_leaf=lambda x: x is not node)
        if len(children) == 1 and children[0] is node:
            shared += leaf_bytes(node)
            return
        for child in children:
            visit(child)

    visit(opt_state)
    return per_leaf, shared
