"""The parameter router of SPEC.md section 5: label every leaf ``embedding``/``dense``/``vector``.

Works on any pytree of arrays keyed by names: plain nested dicts, ``flax.nnx.State`` (whose
leaves sit under a trailing ``.value``), ``flax.linen`` param dicts.  The rules, first match
wins:

1. a user override whose glob pattern matches the dotted path (``"layers.*.attn.*"``);
2. a non-floating leaf cannot be trained: error;
3. 0-D and 1-D leaves are ``vector``;
4. a path with a component containing ``embed`` (``embed``, ``embedder``, ``unembed``),
   ``lm_head`` or ``wte`` names a vocabulary matrix (``embedding``).  Its vocab axis is the
   fan-out axis: an ``embedding``/``weight`` table ``(..., V, d)`` or a ``kernel`` head
   ``(..., d, V)``; otherwise the axis whose size equals ``vocab_size``; otherwise error;
5. a matrix named like a vector (``scale``, ``bias``, ...) is a stack of vectors;
6. every other matrix is ``dense``, in Flax kernel layout ``(..., in, out)``; leading axes
   are stacked layers (batch axes).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sage_optax import axes as axes_lib
from sage_optim.presets import KINDS

VOCAB_MARKERS: tuple[str, ...] = ("embed", "lm_head", "wte")
"""Substrings of a path component that mark a vocabulary matrix."""

VECTOR_NAMES: frozenset[str] = frozenset({"scale", "bias", "b", "gamma", "beta"})
"""Leaf names that hold per-feature vectors even when stacked into a matrix."""

TABLE_NAMES: frozenset[str] = frozenset({"embedding", "weight", "table"})
"""Leaf names of vocab matrices stored as tables ``(V, d)`` (vs ``kernel`` heads ``(d, V)``)."""


class Route(NamedTuple):
    """An explicit routing decision for one leaf: its kind and (optionally) its axes."""

    kind: str
    axes: axes_lib.LeafAxes | None = None


class ParamRouting(NamedTuple):
    """What :func:`label_params` returns: two pytrees with the structure of the params.

    Attributes:
      labels: ``"embedding"``, ``"dense"`` or ``"vector"`` per leaf (usable directly as
        ``optax.partition`` labels).
      axes: a :class:`~sage_optax.LeafAxes` per leaf, the named axes every transform of
        this package takes.
    """

    labels: Any
    axes: Any


def leaf_name_path(path: tuple[Any, ...]) -> str:
    """Dotted path of a leaf without the trailing ``.value`` of ``nnx.Variable`` leaves."""
    return axes_lib.path_str(path)


class RoutingError(ValueError):
    """A leaf the router cannot place; the message names its path and shape."""


def _vocab_axes(name: str, leaf: str, shape: tuple[int, ...], vocab_size: int | None) -> Any:
    ndim = len(shape)
    if leaf in TABLE_NAMES:
        return axes_lib.LeafAxes(fan_in=-1, fan_out=-2)
    if leaf == "kernel":
        return axes_lib.LeafAxes(fan_in=-2, fan_out=-1)
    if vocab_size is not None:
        hits = [a for a in (ndim - 2, ndim - 1) if shape[a] == vocab_size]
        if len(hits) == 1:
            other = ndim - 1 if hits[0] == ndim - 2 else ndim - 2
            return axes_lib.LeafAxes(fan_in=other - ndim, fan_out=hits[0] - ndim)
    raise RoutingError(
        f"cannot place vocabulary matrix {name!r} of shape {shape}: its leaf name {leaf!r} "
        f"says neither table {sorted(TABLE_NAMES)} (V, d) nor 'kernel' (d, V)"
        + ("" if vocab_size is None else f", and no single trailing axis has size {vocab_size}")
        + "; pass vocab_size=..., or overrides={pattern: Route('embedding', LeafAxes(...))}"
    )


def route_leaf(
    name: str, shape: tuple[int, ...], dtype: Any, *, vocab_size: int | None = None
) -> Route:
    """Route one leaf by its dotted path, shape and dtype (rules 2-6 of the module doc)."""
    if not jnp.issubdtype(dtype, jnp.floating):
        raise RoutingError(
            f"cannot place parameter {name!r} of shape {shape}: dtype {jnp.dtype(dtype)} is not "
            "floating point, so no optimizer can train it; filter it out of the params "
            "(e.g. nnx.Optimizer(..., wrt=nnx.Param)) or mask it"
        )
    ndim = len(shape)
    if ndim < 2:
        return Route("vector", axes_lib.LeafAxes.vector())
    parts = name.lower().split(".")
    leaf = parts[-1]
    if any(marker in part for part in parts for marker in VOCAB_MARKERS):
        if leaf in VECTOR_NAMES:
            return Route("vector", axes_lib.LeafAxes.vector(tuple(range(ndim - 1))))
        return Route("embedding", _vocab_axes(name, leaf, shape, vocab_size))
    if leaf in VECTOR_NAMES:
        return Route("vector", axes_lib.LeafAxes.vector(tuple(range(ndim - 1))))
    return Route("dense", axes_lib.LeafAxes(fan_in=-2, fan_out=-1))


def _override(name: str, overrides: Mapping[str, Any]) -> Route | None:
    for pattern, value in overrides.items():
        if fnmatch.fnmatchcase(name, pattern):
            route = Route(value) if isinstance(value, str) else Route(*value)
            if route.kind not in KINDS:
                raise ValueError(
                    f"override {pattern!r} -> {value!r}: kind must be one of {KINDS}"
                )
            return route
    return None


def label_params(
    params: Any,
    overrides: Mapping[str, str | Route | tuple[str, Any]] | None = None,
    *,
    vocab_size: int | None = None,
) -> ParamRouting:
    """Label every parameter leaf ``embedding``, ``dense`` or ``vector`` and give its axes.

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct``), e.g. ``nnx.state(model,
        nnx.Param)`` or a nested dict; ``optax.MaskedNode``/``None`` leaves are kept as-is.
      overrides: ``{glob pattern: kind}`` or ``{glob pattern: Route(kind, LeafAxes)}``,
        matched against dotted paths (``"layers.*.mlp.down_proj.kernel"``); first match wins.
      vocab_size: lets the router find the vocab axis of an oddly named vocab matrix.

    Returns:
      A :class:`ParamRouting` of ``labels`` and ``axes`` pytrees.

    Raises:
      RoutingError: for a leaf it cannot place (non-float dtype, vocab matrix of unknown
        layout); the message names the path and shape and how to override.
    """
    overrides = dict(overrides or {})
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    labels, leaf_axes = [], []
    for path, x in with_path:
        if axes_lib.is_masked(x):
            labels.append(x)
            leaf_axes.append(x)
            continue
        name = leaf_name_path(path)
        shape = tuple(x.shape)
        route = _override(name, overrides)
        if route is None:
            route = route_leaf(name, shape, x.dtype, vocab_size=vocab_size)
        elif route.axes is None:
            default = route_leaf(name, shape, x.dtype, vocab_size=vocab_size)
            if route.kind == default.kind:
                route = default
            elif route.kind == "vector":
                stacked = tuple(range(max(len(shape) - 1, 0)))
                route = Route("vector", axes_lib.LeafAxes.vector(stacked))
            else:
                if len(shape) < 2:
                    raise RoutingError(
                        f"override makes {name!r} of shape {shape} a {route.kind!r} matrix, but "
                        "it has fewer than two dimensions"
                    )
                route = Route(route.kind, axes_lib.LeafAxes(fan_in=-2, fan_out=-1))
        route.axes.resolve(shape, name)  # validate explicit axes against the shape now
        labels.append(route.kind)
        leaf_axes.append(route.axes)
    unflat = jax.tree_util.tree_unflatten
    return ParamRouting(unflat(treedef, labels), unflat(treedef, leaf_axes))


def iter_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs of a params pytree, masked leaves skipped."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    return [(leaf_name_path(p), x) for p, x in with_path if not axes_lib.is_masked(x)]
