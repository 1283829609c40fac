"""The optimizer state as arrays only, and a state initialised for other params refused.

Every configuration of :func:`~sage_optax.make_optimizer` is an ``optax.partition`` over
the three kinds, and ``optax.partition`` hands each kind's rule the params with the other
kinds' leaves replaced by ``optax.MaskedNode`` (an empty pytree node).  Where a parameter
is boxed (an ``nnx.Param`` of ``nnx.state(model, nnx.Param)``, a linen
``nn.Partitioned``), the placeholder sits *inside* the parameter's box, and so does every
state leaf a rule builds from it: ``nnx.Optimizer`` then holds ``OptVariable`` objects whose
value is a ``MaskedNode`` (no ``shape``, ``dtype`` or ``sharding``), which
``nnx.to_flat_state(nnx.state(optimizer))``, sharding code and checkpointers trip on.

:func:`without_boxed_placeholders` wraps a kind's rule so that it only ever sees bare
placeholders (a box holding nothing but a ``MaskedNode`` becomes that ``MaskedNode``): the
state has no box around a placeholder, so every box of it holds an array, and a bare
``MaskedNode`` has no leaves (``jax.tree.leaves``, ``nnx.to_flat_state``, orbax and
``nn.get_partition_spec`` skip it, as for ``optax.adamw``'s state).

:func:`check_state` refuses, in ``update`` and before any arithmetic, a state that
``init`` built for other params (a matrix that became a vector, a changed shape), in one
line naming the parameter and the two shapes.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

from sage_optax import axes as axes_lib
from sage_optax import boxes


def is_boxed_placeholder(x: Any) -> bool:
    """Whether ``x`` is a metadata box that holds only ``optax.MaskedNode`` placeholders."""
    if not boxes.is_box(x):
        return False
    inner = jax.tree.leaves(x, is_leaf=axes_lib.is_masked)
    return bool(inner) and all(isinstance(v, optax.MaskedNode) for v in inner)


def _unit(x: Any) -> bool:
    return axes_lib.is_masked(x) or is_boxed_placeholder(x)


def bare_placeholders(tree: Any) -> Any:
    """``tree`` with every box around a placeholder replaced by a bare ``optax.MaskedNode``."""
    return jax.tree.map(lambda x: optax.MaskedNode() if is_boxed_placeholder(x) else x,
                        tree, is_leaf=_unit)


def _reboxed(new: Any, template: Any) -> Any:
    """``new`` (bare placeholders) with ``template``'s boxed placeholders put back."""
    t_leaves, t_def = jax.tree.flatten(template, is_leaf=_unit)
    n_leaves = jax.tree.leaves(new, is_leaf=axes_lib.is_masked)
    if len(t_leaves) != len(n_leaves):  # pragma: no cover - a rule returns its input's tree
        return new
    out = [t if is_boxed_placeholder(t) else n for t, n in zip(t_leaves, n_leaves, strict=True)]
    return jax.tree_util.tree_unflatten(t_def, out)


def without_boxed_placeholders(
        tx: optax.GradientTransformation) -> optax.GradientTransformationExtraArgs:
    """``tx`` seeing bare placeholders where its input has boxed ones (module docstring).

    ``init`` and ``update`` hand ``tx`` the params (and updates) with every box around a
    placeholder replaced by the bare ``optax.MaskedNode``; the updates ``tx`` returns get
    the caller's boxes back, so the wrapper is invisible to ``optax.partition`` and
    ``optax.masked``.  The state is ``tx``'s own.
    """
    inner = optax.with_extra_args_support(tx)

    def init_fn(params: Any) -> Any:
        return inner.init(bare_placeholders(params))

    def update_fn(updates: Any, state: Any, params: Any = None,
                  **extra: Any) -> tuple[Any, Any]:
        new, state = inner.update(
            bare_placeholders(updates), state,
            None if params is None else bare_placeholders(params), **extra)
        return _reboxed(new, updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _flat(tree: Any) -> dict[str, Any]:
    """``{dotted path: leaf}`` of ``tree``, placeholders as leaves (boxes do not count)."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=axes_lib.is_masked)
    return {axes_lib.path_str(p): x for p, x in with_path}


def _param_of(state_path: str, param_paths: list[str]) -> str | None:
    """The parameter whose state ``state_path`` is (the longest path it ends with)."""
    hits = [p for p in param_paths if state_path == p or state_path.endswith("." + p)]
    return max(hits, key=len) if hits else None


_ABSENT = object()


def _describe(x: Any, masked: str) -> str:
    if x is _ABSENT or x is None:
        return "no leaf"
    if isinstance(x, optax.MaskedNode):
        return f"no leaf ({masked})"
    return f"shape {np.shape(x)}"


def check_state(state: Any, expected: Any, params: Any) -> None:
    """Refuse ``state`` unless it has the structure and shapes of ``expected``.

    Args:
      state: the state given to ``update``.
      expected: ``jax.eval_shape(tx.init, params)`` for the params of this update.
      params: those params (or the updates), to name the parameter of a state leaf.

    Raises:
      ValueError: one line naming the first parameter whose state does not fit, its
        state leaf's shape and the shape the params now need.
    """
    got, want = _flat(state), _flat(expected)
    bad = None
    for path in sorted(set(got) | set(want)):
        g, w = got.get(path, _ABSENT), want.get(path, _ABSENT)
        if g is _ABSENT or w is _ABSENT or axes_lib.is_masked(g) != axes_lib.is_masked(w) or (
                not axes_lib.is_masked(g) and np.shape(g) != np.shape(w)):
            bad = path, g, w
            break
    if bad is None:
        return  # same leaves and shapes (containers may differ: the rules rebuild them)
    path, g, w = bad
    param_paths = [n for n, _ in _flat_params(params)]
    param = _param_of(path, param_paths)
    now = dict(_flat_params(params)).get(param) if param else None
    who = (f"parameter {param!r} has shape {np.shape(now)} now" if now is not None
           else "the params changed")
    raise ValueError(
        f"update: the optimizer state was initialised for other params: {who}; its state "
        f"leaf {path!r} has {_describe(g, 'the parameter had another kind')} where these "
        f"params need {_describe(w, 'the parameter has another kind now')}; re-run "
        "tx.init(params) after changing the model (or restore a state saved for these params)")


def _flat_params(params: Any) -> list[tuple[str, Any]]:
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    return [(axes_lib.path_str(p), x) for p, x in with_path if not axes_lib.is_masked(x)]


__all__ = ["bare_placeholders", "check_state", "is_boxed_placeholder",
           "without_boxed_placeholders"]
