"""Named axes of parameter leaves and per-leaf spec plumbing (``docs/routing.md``).

SAGE and SinkGD are not transpose-invariant, so every transform states its rule on named
axes, given per leaf as a :class:`~sage_optim.routing.Route` (the router's own decision
type: there is no second one):

* ``fan_in``/``fan_out``: the two matrix axes, each one axis or a group of axes that is
  merged into one (a multi-head kernel, a convolution: ``docs/routing.md``).  A dense Flax
  kernel ``(in, out)`` is ``Route("dense", fan_in=-2, fan_out=-1)``; a PyTorch
  ``nn.Linear.weight`` ``(out, in)`` is ``Route("dense", fan_in=-1, fan_out=-2)``.  For
  vocabulary matrices the vocab axis is the *fan-out* axis and the model dimension the
  fan-in axis, so an ``nnx.Embed`` table ``(V, d)`` is ``Route("embedding", fan_in=-1,
  fan_out=-2)`` (:data:`EMBEDDING_TABLE`) and an untied head kernel ``(d, V)`` is
  ``Route("embedding", fan_in=-2, fan_out=-1)``: SAGE then always reduces over the fan-out
  axis (the vocab axis of embeddings, the output axis of dense matrices in ``sage-pure``)
  and SinkGD always normalises each token's vector first.
* ``batch``: axes treated independently (stacked layers of ``nn.scan``).  ``None`` means
  "every axis that is not a matrix axis".
* A vector leaf (norm scale, bias) is ``Route("vector")`` (``batch=`` its stacked axes).

A transform reads only the axes, never the kind.  Transforms accept a spec as one route
for every leaf, a pytree of them with the structure of the params (``None`` leaves are
skipped; :class:`~sage_optim.routing.ResolvedRoute` leaves, what
:func:`~sage_optax.route_params` returns, are checked against each leaf's shape), or a
callable mapping params to such a pytree, as ``optax.contrib.muon`` does with its
dimension numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import optax

from sage_optim.routing import ResolvedRoute, Route, RoutingError

Path: TypeAlias = tuple[Any, ...]

KERNEL = Route("dense", fan_in=-2, fan_out=-1)
"""Axes of a Flax kernel ``(in, out)`` (leading axes stacked): the matrix transforms' default."""

EMBEDDING_TABLE = Route("embedding", fan_in=-1, fan_out=-2)
"""Axes of an embedding table ``(V, d)`` (``nnx.Embed``, ``nn.Embedding``): vocab is fan-out."""

AxesSpec: TypeAlias = "Route | ResolvedRoute | None | Any | Callable[[Any], Any]"
"""One route, a pytree of them (``None`` skips a leaf), or a callable of the params."""


def is_axes(spec: Any) -> bool:
    """Whether ``spec`` gives one leaf's axes (a :class:`Route` or a :class:`ResolvedRoute`)."""
    return isinstance(spec, Route | ResolvedRoute)


def resolve_axes(spec: Route | ResolvedRoute, shape: tuple[int, ...], path: str,
                 what: str = "axes") -> ResolvedRoute:
    """``spec`` resolved against ``shape`` (raises a ``RoutingError`` naming ``path``)."""
    if not is_axes(spec):
        raise TypeError(f"parameter {path!r}: {what} must be a Route or None, got {spec!r}")
    refuse_view(spec, path)
    return spec.resolve(tuple(shape), path)


def refuse_view(route: Route | ResolvedRoute, path: str) -> None:
    """Raise a one-line ``RoutingError`` naming ``path`` if ``route`` has a ``view``.

    A view (``Route(..., view=shape)``, what ``sage_torch`` applies to weights its models
    reshape in their forward, DBRX's experts) is not applied by ``sage_optax``: reshape the
    leaf in the model instead (a JAX array's reshape is free under ``jit``) and route it.
    """
    view = getattr(route, "view", None)
    if view is not None:
        raise RoutingError(
            f"parameter {path!r}: Route(view={view}) is not supported by sage_optax (only "
            "sage_torch applies views); store the leaf with that shape and route its axes")


def to_matrix(axes: ResolvedRoute, x: jax.Array) -> jax.Array:
    """``x`` as ``(batch..., fan_in_size, fan_out_size)`` (a plain reshape where possible)."""
    perm = axes.matrix_perm()
    if perm != tuple(range(x.ndim)):
        x = jnp.transpose(x, perm)
    batch_shape = tuple(axes.shape[a] for a in axes.batch)
    return x.reshape(*batch_shape, axes.fan_in_size, axes.fan_out_size)


def from_matrix(axes: ResolvedRoute, x: jax.Array) -> jax.Array:
    """Undo :func:`to_matrix`."""
    perm = axes.matrix_perm()
    x = x.reshape(tuple(axes.shape[a] for a in perm))
    if perm != tuple(range(x.ndim)):
        x = jnp.transpose(x, tuple(perm.index(a) for a in range(x.ndim)))
    return x


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

    References:
      `Flax NNX, Variables <https://flax.readthedocs.io/en/latest/api_reference/flax.nnx/variables.html>`_.
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


def resolve_spec(spec: Any, tree: Any) -> Any:
    """Turn a user spec into a pytree aligned with ``tree``.

    Returns a tree with the structure of ``tree`` in which every leaf position holds the
    spec for that leaf (a route, or an ``int``/``None`` where the caller allows it).
    """
    if callable(spec) and not is_axes(spec):
        spec = spec(tree)
    if hasattr(spec, "dtype") and hasattr(spec, "shape"):
        raise TypeError(
            f"an axis spec must be an int, None, a Route, a pytree of them or a callable, got "
            f"an array ({spec!r}); under optax.inject_hyperparams pass axis arguments in "
            "static_args so they are not turned into arrays"
        )
    if spec is None or is_axes(spec) or isinstance(spec, int):
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
            "(a Route), a pytree with the params' structure, or a callable of the params. "
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


def stacked_route(axes: ResolvedRoute, n: int) -> ResolvedRoute:
    """``axes`` of a leaf, for a stack of ``n`` such leaves along a new leading batch axis."""

    def shift(group: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(a + 1 for a in group)

    return ResolvedRoute(axes.kind, shift(axes.fan_in), shift(axes.fan_out),
                         (0, *shift(axes.batch)), (n, *axes.shape), axes.evidence)


def matrix_view(axes: ResolvedRoute) -> tuple[int, int, int, bool] | None:
    """``(B, R, C, rows_are_fan_in)`` if the leaf reshapes freely to ``(B, R, C)``, else None.

    The batch axes must lead, followed by one axis group (the rows) and then the other (the
    columns), each group contiguous; ``rows_are_fan_in`` says which group is the fan-in one
    (``True`` for a Flax kernel ``(in, out)``, ``False`` for a torch weight ``(out, in)``).
    """
    nb, ni, no = len(axes.batch), len(axes.fan_in), len(axes.fan_out)
    if not ni or not no or sorted(axes.batch) != list(range(nb)):
        return None

    def contiguous(group: tuple[int, ...], start: int) -> bool:
        return sorted(group) == list(range(start, start + len(group)))

    b = math.prod(axes.shape[a] for a in axes.batch)
    if contiguous(axes.fan_in, nb) and contiguous(axes.fan_out, nb + ni):
        return b, axes.fan_in_size, axes.fan_out_size, True
    if contiguous(axes.fan_out, nb) and contiguous(axes.fan_in, nb + no):
        return b, axes.fan_out_size, axes.fan_in_size, False
    return None


def scale_shapes(axes: ResolvedRoute) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes of a leaf's SinkGD scales ``(c, r)``.

    ``c``: the leaf's shape without its fan-out axes; ``r``: without its fan-in axes.
    """
    c = tuple(n for a, n in enumerate(axes.shape) if a not in axes.fan_out)
    r = tuple(n for a, n in enumerate(axes.shape) if a not in axes.fan_in)
    return c, r


def kernel_takes(g: Any, axes: ResolvedRoute, dtypes: tuple[Any, ...]) -> bool:
    """Whether a SinkGD kernel (Pallas, native) can take leaf ``g``.

    It needs a non-empty free :func:`matrix_view`, a dtype among ``dtypes``, and no sharding
    over an explicit-axes mesh (the kernel would need the leaf whole on each device; XLA's
    path partitions).
    """
    view = matrix_view(axes)
    if view is None or min(view[:3]) == 0:
        return False
    if not any(jnp.dtype(g.dtype) == jnp.dtype(d) for d in dtypes):
        return False
    return isinstance(g, jax.ShapeDtypeStruct) or sharding_of(g) is None


def sharding_of(x: jax.Array) -> Any:
    """``x``'s sharding when the mesh has explicit axes (a dot needs it there), else None."""
    sharding = jax.typeof(x).sharding
    explicit = jax.sharding.AxisType.Explicit
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and explicit in mesh.axis_types:
        return sharding
    return None
