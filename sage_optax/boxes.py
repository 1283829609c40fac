"""Optimizer state in the parameters' metadata boxes, and a state that keeps its structure.

Parameters often come boxed: an ``nnx.State`` holds ``nnx.Param`` variables (with their
metadata, such as ``out_sharding``), and linen parameters built with
``nn.with_partitioning``/``nn.with_logical_partitioning`` hold ``nn.Partitioned`` boxes
that name each axis.  Optax builds a state leaf of the parameter's own shape in the
parameter's box (``jax.tree.map(jnp.zeros_like, params)``), so the box's axis names still
fit.  A *reduced* state leaf (SAGE's ``S`` without the fan-out axes, APOLLO's rank-``r``
moments and per-matrix norms) does not have the parameter's axes: :func:`state_like` puts
it in the parameter's box with each axis naming the parameter axis it comes from, or
``None`` (replicated) where it comes from none, so that ``nn.get_partition_spec``,
``nn.logical_to_mesh_sharding``, ``nn.get_sharding`` and ``nnx.get_partition_spec`` give
a valid sharding of every state leaf.

:func:`keep_structure` rebuilds an updated state tree in the structure of the state it
replaces, so that ``update`` returns the structure ``init`` built whatever boxes the
gradients come in (``jit`` compiles once, ``lax.scan`` carries the state, a checkpoint
restores into ``jax.eval_shape(tx.init, params)``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from sage_optax import axes as axes_lib

AxisSources = tuple[int | None, ...] | None
"""For each axis of a state leaf, the parameter axis it comes from (``None``: none, e.g.
a rank axis); ``None`` for a state leaf with the parameter's own axes."""

SHARDING_METADATA: tuple[str, ...] = ("out_sharding", "optimizer_sharding")
"""Metadata of an ``nnx.Variable`` that names its axes (one entry per axis)."""


def is_linen_box(x: Any) -> bool:
    """Whether ``x`` is a linen ``nn.Partitioned`` box (``AxisMetadata`` with axis ``names``)."""
    return hasattr(x, "names") and hasattr(x, "replace_boxed") and hasattr(x, "unbox")


def is_box(x: Any) -> bool:
    """Whether ``x`` is a metadata box: an ``nnx.Variable`` or a linen ``nn.Partitioned``."""
    return axes_lib.is_box(x) or is_linen_box(x)


def _is_single_box(x: Any) -> bool:
    """A box around exactly one array (or masked leaf): the unit :func:`state_like` reboxes."""
    if not is_box(x):
        return False
    return len(jax.tree.leaves(x, is_leaf=axes_lib.is_masked)) == 1


def _is_unit(x: Any) -> bool:
    return axes_lib.is_masked(x) or _is_single_box(x)


def _select(names: Any, sources: tuple[int | None, ...], ndim: int, where: str) -> tuple[Any, ...]:
    """The names of the axes ``sources`` lists, from a per-axis ``names`` of ``ndim`` axes."""
    names = tuple(names)
    if len(names) > ndim:
        raise ValueError(
            f"parameter {where!r}: its sharding metadata {names} names {len(names)} axes, "
            f"but the parameter has {ndim}"
        )
    names = names + (None,) * (ndim - len(names))  # a short PartitionSpec: trailing None
    return tuple(None if a is None else names[a] for a in sources)


def _reduced_spec(spec: Any, sources: tuple[int | None, ...], ndim: int, where: str) -> Any:
    """An ``nnx`` sharding metadata value restricted to ``sources`` (a sequence: a tuple)."""
    if spec is None:
        return None
    if isinstance(spec, NamedSharding):
        return NamedSharding(spec.mesh, PartitionSpec(*_select(spec.spec, sources, ndim, where)))
    if isinstance(spec, PartitionSpec):
        return PartitionSpec(*_select(spec, sources, ndim, where))
    if isinstance(spec, Sequence) and not isinstance(spec, str):
        return tuple(_select(spec, sources, ndim, where))
    raise ValueError(
        f"parameter {where!r}: cannot read its sharding metadata {spec!r} (expected a tuple "
        "of axis names, a PartitionSpec or a NamedSharding)"
    )


def rebox(box: Any, value: Any, sources: AxisSources, where: str = "<leaf>") -> Any:
    """``value`` in a copy of ``box`` whose axis names follow ``sources``.

    Args:
      box: an ``nnx.Variable`` or linen ``nn.Partitioned`` around one parameter array.
      value: the state leaf to box.
      sources: for each axis of ``value``, the parameter axis it comes from (``None``: a
        new, unnamed axis); ``None`` when ``value`` has the parameter's axes.
      where: the parameter's path, for errors.

    Returns:
      The boxed state leaf; its other metadata is the parameter's.
    """
    if sources is None or axes_lib.is_masked(value):
        return jax.tree.map(lambda _: value, box, is_leaf=axes_lib.is_masked)
    param = jax.tree.leaves(box, is_leaf=axes_lib.is_masked)[0]
    ndim = len(getattr(param, "shape", ()))
    if is_linen_box(box):
        return box.replace(value=value, names=_select(box.names, sources, ndim, where))
    metadata = dict(box.get_metadata())
    for key in SHARDING_METADATA:
        if key in metadata:
            metadata[key] = _reduced_spec(metadata[key], sources, ndim, where)
    return box.from_metadata(value, metadata)


def state_like(params: Any, values: Sequence[Any], sources: Sequence[AxisSources]) -> Any:
    """A state tree with the structure of ``params``, ``values[i]`` for its ``i``-th leaf.

    ``values`` and ``sources`` list the state leaves in the order of
    ``jax.tree.leaves(params, is_leaf=is_masked)``; where that parameter leaf is in a box
    (:func:`is_box`), its state leaf is put in the same box with the axis names that
    ``sources`` selects (:func:`rebox`).

    Args:
      params: the parameters (boxed or not).
      values: one state leaf per parameter leaf (masked leaves pass through).
      sources: for each, :data:`AxisSources`.

    Returns:
      The state tree.
    """
    units, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_unit)
    if len(units) != len(values):
        raise ValueError(
            f"{len(values)} state leaves for {len(units)} parameter leaves (a box holding "
            "several arrays?)"
        )
    out = []
    for (path, unit), value, src in zip(units, values, sources, strict=True):
        if _is_single_box(unit):
            out.append(rebox(unit, value, src, axes_lib.path_str(path)))
        else:
            out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)


def keep_structure(state: Any, new: Any) -> Any:
    """``new``'s leaves in the structure (boxes and their metadata included) of ``state``.

    The state a transform's ``update`` returns must have the structure its ``init`` built,
    whatever boxes the gradients come in: ``new`` (built leaf by leaf from the gradients)
    is rebuilt in ``state``'s structure.  Masked leaves count as leaves on both sides.
    """
    treedef: Any = jax.tree.structure(state, is_leaf=axes_lib.is_masked)
    leaves = jax.tree.leaves(new, is_leaf=axes_lib.is_masked)
    if treedef.num_leaves != len(leaves):
        raise ValueError(
            f"the updated state has {len(leaves)} leaves but the state passed to update has "
            f"{treedef.num_leaves} (was it initialised for other params?)"
        )
    return jax.tree_util.tree_unflatten(treedef, leaves)
