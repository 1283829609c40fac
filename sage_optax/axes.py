"""Named axes of parameter leaves and per-leaf spec plumbing (``docs/routing.md``).

SAGE and SinkGD are not transpose-invariant, so every transform states its rule on named
axes.  :class:`LeafAxes` names them for one leaf:

* ``fan_in``/``fan_out``: the two matrix axes, each one axis or a group of axes that is
  merged into one (a multi-head kernel, a convolution: ``docs/routing.md``).  A dense Flax
  kernel ``(in, out)`` has ``fan_in=-2, fan_out=-1``; a PyTorch ``nn.Linear.weight``
  ``(out, in)`` has ``fan_in=-1, fan_out=-2``.  For vocabulary matrices the vocab axis is
  the *fan-out* axis and the model dimension the fan-in axis, so an ``nnx.Embed`` table
  ``(V, d)`` is ``LeafAxes(fan_in=-1, fan_out=-2)`` and an untied head kernel ``(d, V)`` is
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
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import optax

from sage_optim import routing as routing_core

Path: TypeAlias = tuple[Any, ...]


@dataclasses.dataclass(frozen=True)
class LeafAxes:
    """The named axes of one parameter leaf.

    Each of ``fan_in`` and ``fan_out`` is one axis or a *group* of axes: a matrix with
    several axes is one matrix, its fan-in axes merged and its fan-out axes merged
    (``docs/routing.md``).  An ``nnx.LinearGeneral`` query kernel ``(in, heads, head_dim)``
    is ``LeafAxes(fan_in=0, fan_out=(1, 2))``, an ``nnx.Conv`` kernel ``(kh, kw, Cin, Cout)``
    is ``LeafAxes(fan_in=(2, 0, 1), fan_out=3)`` (input channels, then taps: the order in
    which APOLLO flattens the group, matching a PyTorch ``Conv2d``).

    Attributes:
      fan_in: axis or axes of the fan-in dimension (``None`` for vector leaves).
      fan_out: axis or axes of the fan-out dimension (``None`` for vector leaves); the
        vocab axis of a vocabulary matrix.
      batch: axes handled independently (stacked layers); ``None`` means every axis
        other than ``fan_in``/``fan_out`` (for a vector leaf: none).
    """

    fan_in: int | tuple[int, ...] | None = -2
    fan_out: int | tuple[int, ...] | None = -1
    batch: tuple[int, ...] | None = None

    @classmethod
    def vector(cls, batch: tuple[int, ...] = ()) -> LeafAxes:
        """Axes of a vector leaf; ``batch`` lists leading stacked axes, if any."""
        return cls(fan_in=None, fan_out=None, batch=tuple(batch))

    @property
    def is_matrix(self) -> bool:
        """Whether these axes describe a matrix (both matrix axes are set)."""
        return self.fan_in is not None and self.fan_out is not None

    def as_route(self, kind: str | None = None) -> routing_core.Route:
        """These axes as a shared :class:`sage_optim.routing.Route` of ``kind``."""
        kind = kind or ("dense" if self.is_matrix else "vector")
        return routing_core.Route(kind, self.fan_in, self.fan_out, self.batch)

    def resolve(self, shape: tuple[int, ...], path: str = "<leaf>") -> ResolvedAxes:
        """Check these axes against ``shape`` and return them as non-negative axis groups.

        Raises:
          ValueError: (a :class:`~sage_optim.routing.RoutingError`) an axis out of range or
            listed twice, only one of ``fan_in``/``fan_out`` set, or batch axes that are
            not exactly the other axes.
        """
        if (self.fan_in is None) != (self.fan_out is None):
            raise routing_core.RoutingError(
                f"parameter {path!r}: set both fan_in and fan_out, or neither (vector)"
            )
        if self.is_matrix and len(shape) < 2:
            raise routing_core.RoutingError(
                f"parameter {path!r} of shape {tuple(shape)} has matrix axes but fewer than "
                "two dimensions"
            )
        r = self.as_route().resolve(tuple(shape), path)
        return ResolvedAxes(r.fan_in, r.fan_out, r.batch, r.shape)

    @classmethod
    def from_route(cls, route: routing_core.Route | routing_core.ResolvedRoute) -> LeafAxes:
        """The axes of a shared route (groups of one axis become plain ints)."""

        def simple(group: tuple[int, ...] | None) -> int | tuple[int, ...] | None:
            return group[0] if group is not None and len(group) == 1 else group

        if route.kind == "vector" or not route.fan_in:
            return cls.vector(tuple(route.batch or ()))
        return cls(simple(route.fan_in), simple(route.fan_out), route.batch)


@dataclasses.dataclass(frozen=True)
class ResolvedAxes:
    """:class:`LeafAxes` checked against a shape: non-negative axis groups.

    ``fan_in`` and ``fan_out`` are tuples of axes (empty for a vector leaf).
    """

    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]
    batch: tuple[int, ...]
    shape: tuple[int, ...]

    @property
    def is_matrix(self) -> bool:
        """Whether the leaf is a matrix (per batch index)."""
        return bool(self.fan_in)

    @property
    def feature_axes(self) -> tuple[int, ...]:
        """All axes that are not batch axes (RMS and norms are taken over these)."""
        return tuple(a for a in range(len(self.shape)) if a not in self.batch)

    @property
    def fan_in_size(self) -> int:
        """Size of the merged fan-in axis."""
        return math.prod(self.shape[a] for a in self.fan_in)

    @property
    def fan_out_size(self) -> int:
        """Size of the merged fan-out axis."""
        return math.prod(self.shape[a] for a in self.fan_out)

    @property
    def is_simple(self) -> bool:
        """Whether each matrix axis is a single axis (no merging needed)."""
        return len(self.fan_in) == 1 and len(self.fan_out) == 1

    def matrix_perm(self) -> tuple[int, ...]:
        """The transpose to ``(batch..., fan_in..., fan_out...)``, the canonical matrix layout."""
        return (*self.batch, *self.fan_in, *self.fan_out)

    def to_matrix(self, x: jax.Array) -> jax.Array:
        """``x`` as ``(batch..., fan_in_size, fan_out_size)`` (a plain reshape where possible)."""
        perm = self.matrix_perm()
        if perm != tuple(range(x.ndim)):
            x = jnp.transpose(x, perm)
        batch_shape = tuple(self.shape[a] for a in self.batch)
        return x.reshape(*batch_shape, self.fan_in_size, self.fan_out_size)

    def from_matrix(self, x: jax.Array) -> jax.Array:
        """Undo :meth:`to_matrix`."""
        perm = self.matrix_perm()
        x = x.reshape(tuple(self.shape[a] for a in perm))
        if perm != tuple(range(x.ndim)):
            x = jnp.transpose(x, tuple(perm.index(a) for a in range(x.ndim)))
        return x

    def matrix(self) -> ResolvedAxes:
        """The axes of :meth:`to_matrix`'s result: batch first, then fan-in, then fan-out."""
        nb = len(self.batch)
        shape = (*(self.shape[a] for a in self.batch), self.fan_in_size, self.fan_out_size)
        return ResolvedAxes((nb,), (nb + 1,), tuple(range(nb)), shape)


EMBEDDING_TABLE = LeafAxes(fan_in=-1, fan_out=-2)
"""Axes of an embedding table ``(V, d)`` (``nnx.Embed``, ``nn.Embedding``): vocab is fan-out."""

AxesSpec: TypeAlias = "LeafAxes | None | Any | Callable[[Any], Any]"
"""One :class:`LeafAxes`, a pytree of them (``None`` skips a leaf), or a callable of params."""


def wide(dtype: Any) -> Any:
    """Arithmetic dtype of every transform: float32, or wider if ``dtype`` is (float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def is_masked(x: Any) -> bool:
    """Whether ``x`` is a leaf that a transform must pass through untouched."""
    return x is None or isinstance(x, optax.MaskedNode)


def is_box(x: Any) -> bool:
    """Whether ``x`` is a metadata box around one array (a ``flax.nnx.Variable``)."""
    return hasattr(x, "get_value") and hasattr(x, "get_metadata")


def unbox(tree: Any) -> Any:
    """``tree`` with every ``nnx.Variable``-like box replaced by the array it holds.

    For code that needs only the arrays (state bytes, diagnostics); a reduced state is
    boxed with its own axis names instead (:func:`sage_optax.boxes.state_like`).
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
    with_path, structure = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)
    treedef: Any = structure
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


def map_leaves_with_state(
    fn: Callable[..., tuple[Any, ...]], tree: Any, spec: Any, states: Mapping[str, Any]
) -> tuple[Any, ...]:
    """Map ``fn(path, spec, leaf, *state_leaves) -> (out, *new_state_leaves)`` over ``tree``.

    The per-leaf map of the stateful transforms: ``states`` maps a description (for
    errors: ``"the SAGE momentum state"``) to a state tree with one leaf per leaf of
    ``tree``, matched by path (boxed ``nnx.Variable`` leaves on one side only match too).
    Masked leaves pass through with their state.  Returns the output tree and each new
    state tree, all with ``tree``'s structure.
    """
    treedef, leaves = flatten_with_spec(tree, resolve_spec(spec, tree))
    flat_states = [flatten_like(treedef, st, what) for what, st in states.items()]
    columns: list[list[Any]] = [[] for _ in range(1 + len(flat_states))]
    for i, (path, leaf_spec, x) in enumerate(leaves):
        olds = [flat[i] for flat in flat_states]
        outs = (x, *olds) if is_masked(x) else fn(path, leaf_spec, x, *olds)
        for column, value in zip(columns, outs, strict=True):
            column.append(value)
    return tuple(jax.tree_util.tree_unflatten(treedef, column) for column in columns)


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
