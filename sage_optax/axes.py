"""Named axes of parameter leaves (SPEC.md section 1) and per-leaf spec plumbing.

SAGE and SinkGD are not transpose-invariant, so every transform states its rule on named
axes.  :class:`LeafAxes` names them for one leaf:

* ``fan_in``/``fan_out``: the two matrix axes.  A dense Flax kernel ``(in, out)`` has
  ``fan_in=-2, fan_out=-1``; a PyTorch ``nn.Linear.weight`` ``(out, in)`` has
  ``fan_in=-1, fan_out=-2``.  For vocabulary matrices the vocab axis is the *fan-out* axis
  and the model dimension the fan-in axis, so an ``nnx.Embed`` table ``(V, d)`` is
  ``LeafAxes(fan_in=-1, fan_out=-2)`` and an untied head kernel ``(d, V)`` is
  ``LeafAxes(fan_in=-2, fan_out=-1)``: SAGE then always reduces over the fan-out axis
  (the vocab axis of embeddings, the output axis of dense matrices in ``sage-pure``) and
  SinkGD always normalises each token's vector first.
* ``batch``: axes treated independently (stacked layers of ``nn.scan``).  ``None`` means
  "every axis that is not a matrix axis".
* A vector leaf (norm scale, bias) has ``fan_in=fan_out=None``.

Transforms accept a spec as one :class:`LeafAxes` for every leaf, a pytree of them with
the structure of the params (``None`` leaves are skipped), or a callable mapping params to
such a pytree, as ``optax.contrib.muon`` does with its dimension numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeAlias

import jax
import optax

Path: TypeAlias = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class LeafAxes:
    """The named axes of one parameter leaf.

    Attributes:
      fan_in: axis of the fan-in dimension (``None`` for vector leaves).
      fan_out: axis of the fan-out dimension (``None`` for vector leaves).
      batch: axes handled independently (stacked layers); ``None`` means every axis
        other than ``fan_in``/``fan_out``.
    """

    fan_in: int | None = -2
    fan_out: int | None = -1
    batch: tuple[int, ...] | None = None

    @classmethod
    def vector(cls, batch: tuple[int, ...] = ()) -> LeafAxes:
        """Axes of a vector leaf; ``batch`` lists leading stacked axes, if any."""
        return cls(fan_in=None, fan_out=None, batch=tuple(batch))

    @property
    def is_matrix(self) -> bool:
        """Whether these axes describe a matrix (both matrix axes are set)."""
        return self.fan_in is not None and self.fan_out is not None

    def resolve(self, shape: tuple[int, ...], path: str = "<leaf>") -> ResolvedAxes:
        """Check these axes against ``shape`` and return them as non-negative ints."""
        ndim = len(shape)

        def norm(axis: int, what: str) -> int:
            if not -ndim <= axis < ndim:
                raise ValueError(
                    f"{what} axis {axis} is out of range for parameter {path!r} of shape "
                    f"{tuple(shape)}"
                )
            return axis % ndim

        if self.fan_in is None or self.fan_out is None:
            if (self.fan_in is None) != (self.fan_out is None):
                raise ValueError(
                    f"parameter {path!r}: set both fan_in and fan_out, or neither (vector)"
                )
            batch = tuple(norm(a, "batch") for a in (self.batch or ()))
            return ResolvedAxes(None, None, batch, tuple(shape))
        fi, fo = norm(self.fan_in, "fan_in"), norm(self.fan_out, "fan_out")
        if fi == fo:
            raise ValueError(
                f"parameter {path!r} of shape {tuple(shape)}: fan_in and fan_out are the "
                f"same axis ({fi})"
            )
        if self.batch is None:
            batch = tuple(a for a in range(ndim) if a not in (fi, fo))
        else:
            batch = tuple(norm(a, "batch") for a in self.batch)
            rest = sorted(set(range(ndim)) - {fi, fo})
            if sorted(batch) != rest:
                raise ValueError(
                    f"parameter {path!r} of shape {tuple(shape)}: batch axes {self.batch} must "
                    f"be exactly the axes other than fan_in={self.fan_in} and "
                    f"fan_out={self.fan_out}"
                )
        return ResolvedAxes(fi, fo, batch, tuple(shape))


@dataclasses.dataclass(frozen=True)
class ResolvedAxes:
    """:class:`LeafAxes` checked against a shape: non-negative axis indices."""

    fan_in: int | None
    fan_out: int | None
    batch: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def is_matrix(self) -> bool:
        """Whether the leaf is a matrix (per batch index)."""
        return self.fan_in is not None

    @property
    def feature_axes(self) -> tuple[int, ...]:
        """All axes that are not batch axes (RMS and norms are taken over these)."""
        return tuple(a for a in range(len(self.shape)) if a not in self.batch)


EMBEDDING_TABLE = LeafAxes(fan_in=-1, fan_out=-2)
"""Axes of an embedding table ``(V, d)`` (``nnx.Embed``, ``nn.Embedding``): vocab is fan-out."""

AxesSpec: TypeAlias = "LeafAxes | None | Any | Callable[[Any], Any]"
"""One :class:`LeafAxes`, a pytree of them (``None`` skips a leaf), or a callable of params."""


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a leaf that a transform must pass through untouched."""
    return x is None or isinstance(x, optax.MaskedNode)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a metadata box around one array (a ``flax.nnx.Variable``)."""
    return hasattr(x, "get_value") and hasattr(x, "get_metadata")


def unbox(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable``-like box replaced by the array it holds.

    State whose shape differs from its parameter's (SAGE's ``S``, APOLLO's moments) is
    built on the unboxed tree: ``nnx.Optimizer`` copies a box's metadata (its sharding
    annotation) onto the state leaf built in it, which is wrong for a reduced shape.
    """
    return jax.tree.map(
        lambda x: x.get_value() if is_box(x) else x,
        tree,
        is_leaf=lambda x: is_box(x) or is_masked(x),
    )


def path_str(path: Path) -> str:
    """A dotted, human-readable form of a pytree key path (``layers.0.attn.q.kernel``).

    The trailing ``.value`` of an ``nnx.Variable`` leaf is dropped, so boxed and unboxed
    trees give the same names.
    """
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(str(k.name))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return ".".join(parts) if parts else "<root>"


def resolve_spec(spec: Any, tree: Any, leaf_type: type = LeafAxes) -> Any:
    """Turn a user spec into a pytree aligned with ``tree``.

    Returns a tree with the structure of ``tree`` in which every leaf position holds the
    spec for that leaf (a ``leaf_type`` instance or an ``int``/``None`` where the caller
    allows it).
    """
    if callable(spec) and not isinstance(spec, leaf_type):
        spec = spec(tree)
    if hasattr(spec, "dtype") and hasattr(spec, "shape"):
        raise TypeError(
            f"an axis spec must be an int, None, LeafAxes, a pytree of them or a callable, got "
            f"an array ({spec!r}); under optax.inject_hyperparams pass axis arguments in "
            "static_args so they are not turned into arrays"
        )
    if spec is None or isinstance(spec, leaf_type | int):
        return jax.tree.map(lambda _: spec, tree, is_leaf=is_masked)
    return spec


def flatten_with_spec(tree: Any, spec_tree: Any) -> tuple[Any, list[tuple[str, Any, Any]]]:
    """Flatten ``tree`` into ``(path, spec, leaf)`` triples and return its treedef too.

    ``spec_tree`` comes from :func:`resolve_spec`.  Masked leaves (``optax.MaskedNode``,
    ``None``) are kept as leaves so the caller can pass them through unchanged; the treedef
    therefore also flattens state trees built with :func:`flatten_like`.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)
    try:
        specs = treedef.flatten_up_to(spec_tree)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "the axis spec does not match the parameter tree: pass one spec for every leaf "
            "(a LeafAxes), a pytree with the params' structure, or a callable of the params. "
            f"Details: {e}"
        ) from None
    return treedef, [(path_str(p), s, x) for (p, x), s in zip(with_path, specs, strict=True)]


def map_leaves(fn: Callable[[str, Any, Any], Any], tree: Any, spec: Any) -> Any:
    """``fn(path, spec, leaf)`` on every unmasked leaf of ``tree`` (masked ones pass through).

    ``spec`` is a user spec (see :func:`resolve_spec`); the stateless transforms use this.
    """
    treedef, leaves = flatten_with_spec(tree, resolve_spec(spec, tree))
    out = [x if is_masked(x) else fn(path, s, x) for path, s, x in leaves]
    return jax.tree_util.tree_unflatten(treedef, out)


def flatten_like(treedef: Any, tree: Any, what: str, reference: str = "the updates") -> list[Any]:
    """Flatten ``tree`` (e.g. a state moment) with the structure of ``reference``.

    Raises a ``ValueError`` naming ``what`` and the first differing path, instead of JAX's
    structure error, when the trees do not match (for example gradients of another model).
    """
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError):
        pass
    # The same leaves, boxed on one side only (nnx.Variable vs plain arrays), also match.
    ref = jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
    ref_paths = [path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
    got = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)[0]
    if [path_str(p) for p, _ in got] == ref_paths:
        return [x for _, x in got]
    raise ValueError(tree_mismatch_message(treedef, tree, what, reference))


def tree_mismatch_message(treedef: Any, tree: Any, what: str, reference: str) -> str:
    """Describe how ``tree`` differs from the structure ``treedef`` (paths on both sides)."""
    ref_paths = {
        path_str(p)
        for p, _ in jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(treedef, [0] * treedef.num_leaves)
        )[0]
    }
    got_paths = {
        path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)[0]
    }
    missing = sorted(ref_paths - got_paths)[:5]
    extra = sorted(got_paths - ref_paths)[:5]
    detail = []
    if missing:
        detail.append(f"paths in {reference} but not in {what}: {missing}")
    if extra:
        detail.append(f"paths in {what} but not in {reference}: {extra}")
    if not detail:
        detail.append(f"same paths, different container types ({treedef})")
    return f"{what} does not have the structure of {reference}; " + "; ".join(detail)


def check_same_shapes(
    names: list[str], expected: list[Any], got: list[Any], what: str, reference: str
) -> None:
    """Raise a ``ValueError`` naming the first leaf whose shape differs between two trees."""
    for name, e, g in zip(names, expected, got, strict=True):
        if is_masked(e) or is_masked(g):
            continue
        if tuple(e.shape) != tuple(g.shape):
            raise ValueError(
                f"parameter {name!r}: {what} has shape {tuple(g.shape)} but {reference} has "
                f"shape {tuple(e.shape)}"
            )
