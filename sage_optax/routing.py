"""The JAX parameter router: every leaf gets a kind and its axes, from the strongest evidence.

SAGE and SinkGD are not transpose-invariant, so the kind (``embedding``/``dense``/``vector``)
and the axes this router gives a leaf *are* the math.  Evidence, strongest first (the shared
grammar and markers live in :mod:`sage_optim.routing`; ``docs/routing.md`` has the whole
convention):

1. **an override**: ``{glob: kind}`` (axes inferred where the layout is known, else a
   :class:`RoutingError` asking for them) or ``{glob: Route(kind, fan_in=..., fan_out=...)}``;
   a glob that matches no leaf is an error naming the nearest paths;
2. **the flax module that owns the parameter**, when the model is passed (``model=``, or an
   ``nnx.Module`` in place of the params): ``nnx.Embed`` ``(V, d)``, ``nnx.Linear``
   ``(in, out)``, ``nnx.LinearGeneral`` (its ``in_features``/``out_features`` axes merged),
   ``nnx.Einsum`` (contracted kernel letters are fan-in, kept letters fan-out, letters shared
   with the input and the output batch), ``nnx.Conv`` ``(*taps, Cin, Cout)`` (fan-in =
   input channels and taps, merged); extra leading axes (``nnx.vmap``/``nnx.scan``) are
   batch axes;
3. **names and shapes**, only where unambiguous, in the declared ``layout``: ``"flax"``
   (default: a 2-D ``kernel`` is ``(in, out)``, a 2-D ``embedding`` an ``Embed`` table
   ``(V, d)``) or ``"torch"`` (a 2-D ``weight`` is ``(out, in)``, a token table ``(V, d)``).
   0-D/1-D leaves are vectors.  A kernel, weight, ``scale`` or ``bias`` with more axes may
   be stacked layers, a multi-axis kernel or a convolution: without the model or an
   override it is refused, with both remedies in the message.

A **head** (an untied output projection: kind ``embedding``, vocab axis as fan-out) is a
dense matrix with the shape of *the* token embedding, ``(d, V)`` (``(V, d)`` in the torch
layout), where *the* token embedding is the only table, or the one named like a token
embedding (``wte``, ``tok_embeddings``, ``embed_tokens``...), and ``V`` may also be given as
``vocab_size=``.  Exactly one matrix must fit; among several, a head name (``lm_head``,
``head``, ``output``...) decides, else the router refuses.  A name alone never makes a head
(a ViT ``head`` classifier is dense), and neither does one dimension equal to some table's
length.

:func:`route_params` returns the labels (``optax.partition`` labels), the
:class:`~sage_optax.LeafAxes` every transform takes, and each leaf's
:class:`~sage_optim.routing.ResolvedRoute` (the evidence shown by ``routing_table``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sage_optax import axes as axes_lib
from sage_optim import routing as core
from sage_optim.routing import ResolvedRoute, Route, RoutingError

LAYOUTS: tuple[str, ...] = ("flax", "torch")
"""Declared layouts of a params pytree: Flax ``(in, out)`` kernels or PyTorch ``(out, in)``."""

__all__ = [
    "LAYOUTS",
    "ParamRouting",
    "ResolvedRoute",
    "Route",
    "RoutingError",
    "iter_leaves",
    "label_params",
    "leaf_name_path",
    "module_routes",
    "route_params",
]


class ParamRouting(NamedTuple):
    """What :func:`route_params` returns: pytrees with the structure of the params.

    Attributes:
      labels: ``"embedding"``, ``"dense"`` or ``"vector"`` per leaf (usable directly as
        ``optax.partition`` labels).
      axes: a :class:`~sage_optax.LeafAxes` per leaf, the named axes every transform of
        this package takes.
      routes: a :class:`~sage_optim.routing.ResolvedRoute` per leaf: kind, axis groups,
        and the evidence that placed it.
    """

    labels: Any
    axes: Any
    routes: Any = None


def leaf_name_path(path: tuple[Any, ...]) -> str:
    """Dotted path of a leaf without the trailing ``.value`` of ``nnx.Variable`` leaves."""
    return axes_lib.path_str(path)


def iter_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs of a params pytree, masked leaves skipped."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    return [(leaf_name_path(p), x) for p, x in with_path if not axes_lib.is_masked(x)]


# --------------------------------------------------------------------------- module evidence


def _is_nnx_module(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional for sage_optax
        return False
    return isinstance(x, nnx.Module)


def _einsum_route(einsum_str: str, kernel_ndim: int, what: str) -> Route:
    spec = einsum_str.replace(" ", "")
    if "->" not in spec or spec.count(",") != 1 or "." in spec:
        raise RoutingError(
            f"{what}: cannot read the axes of einsum {einsum_str!r} (one input, one kernel, "
            "no ellipsis); give them with an override Route('dense', fan_in=..., fan_out=...)"
        )
    lhs, out = spec.split("->")
    inp, ker = lhs.split(",")
    extra = kernel_ndim - len(ker)
    fan_in, fan_out, batch = [], [], list(range(extra))
    for i, letter in enumerate(ker):
        axis = extra + i
        if letter in out and letter in inp:
            batch.append(axis)
        elif letter in out:
            fan_out.append(axis)
        elif letter in inp:
            fan_in.append(axis)
        else:
            raise RoutingError(
                f"{what}: kernel letter {letter!r} of einsum {einsum_str!r} is in neither the "
                "input nor the output; give the axes with an override"
            )
    if not fan_in or not fan_out:
        return Route("vector", batch=tuple(batch), evidence=f"module nnx.Einsum {einsum_str!r}")
    return Route(
        "dense", tuple(fan_in), tuple(fan_out), tuple(batch),
        evidence=f"module nnx.Einsum {einsum_str!r}",
    )


def _norm_types() -> tuple[type, ...]:
    from flax import nnx

    return (nnx.LayerNorm, nnx.RMSNorm, nnx.GroupNorm, nnx.BatchNorm)


def _expected_bias_ndim(module: Any) -> int:
    """Dims of a bias of ``module`` before any stacking (``nnx.vmap``/``nnx.scan``)."""
    from flax import nnx

    if isinstance(module, nnx.LinearGeneral):
        return len(module.batch_axis) + len(module.out_features)
    if isinstance(module, nnx.Einsum):
        return len(module.bias_shape or ())
    return 1


def _module_param_routes(module: Any, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Routes (or a RoutingError to raise if used) of the params of one known flax module."""
    from flax import nnx

    norms = _norm_types()
    out: dict[str, Any] = {}
    ev = f"module nnx.{type(module).__name__}"
    for attr, p in params.items():
        full = f"{name}.{attr}" if name else attr
        shape = tuple(p.shape)
        if attr == "bias" or (isinstance(module, norms) and attr == "scale"):
            stacked = max(len(shape) - _expected_bias_ndim(module), 0)
            out[full] = Route("vector", batch=tuple(range(stacked)), evidence=ev)
        elif attr != "kernel" and not isinstance(module, nnx.Embed):
            continue  # not a parameter of known layout: left to the name rules
        elif isinstance(module, nnx.Embed):
            out[full] = Route("embedding", -1, -2, evidence=ev + " (V, d)")
        elif isinstance(module, nnx.LinearGeneral):
            n_in, n_out = len(module.in_features), len(module.out_features)
            fan_in = tuple(range(-n_in - n_out, -n_out))
            out[full] = Route("dense", fan_in, tuple(range(-n_out, 0)), evidence=ev)
        elif isinstance(module, nnx.Linear):
            out[full] = Route("dense", -2, -1, evidence=ev + " (in, out)")
        elif isinstance(module, nnx.Einsum):
            try:
                out[full] = _einsum_route(module.einsum_str, len(shape), full)
            except RoutingError as e:
                out[full] = e
        elif isinstance(module, nnx.ConvTranspose):
            out[full] = RoutingError(
                f"cannot place {full!r} of shape {shape}: an nnx.ConvTranspose kernel has no "
                "layout this router knows; give it, e.g. " + core.override_advice(full, shape)
            )
        elif isinstance(module, nnx.Conv):
            size = module.kernel_size
            taps = len(size) if isinstance(size, tuple | list) else 1
            # (*taps, Cin, Cout): fan-in is the input channels then the taps (the order of a
            # PyTorch Conv weight (Cout, Cin, *taps)), fan-out the output channels.
            fan_in = (-2, *range(-2 - taps, -2))
            out[full] = Route("dense", fan_in, -1, evidence=ev + " (*taps, Cin, Cout)")
    return out


def module_routes(model: Any) -> dict[str, Route | RoutingError]:
    """Per-parameter routes read from the flax NNX modules of ``model``, keyed by dotted path.

    Only parameters owned by a module of known layout appear (``nnx.Embed``, ``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``, the norm layers; a
    ``nnx.ConvTranspose`` kernel maps to the error it raises if used); every other parameter
    is left to the name rules.  A module's extra leading axes (``nnx.vmap``, ``nnx.scan``)
    are batch axes.
    """
    from flax import nnx

    if not isinstance(model, nnx.Module):
        raise TypeError(
            f"model= takes a flax NNX module, got {type(model).__name__}; for a linen model "
            "or another pytree, give the axes of multi-axis leaves with route_overrides"
        )
    known = (nnx.Embed, nnx.Linear, nnx.LinearGeneral, nnx.Einsum, nnx.Conv, nnx.ConvTranspose,
             *_norm_types())
    out: dict[str, Route | RoutingError] = {}
    for path, node in nnx.iter_graph(model):
        if not isinstance(node, known):
            continue
        name = ".".join(str(k) for k in path)
        params = {
            attr: value for attr, value in vars(node).items()
            if isinstance(value, nnx.Param) and hasattr(value, "shape")
        }
        out.update(_module_param_routes(node, name, params))
    return out


# ------------------------------------------------------------------------------ name rules


_PASS_MODEL = (
    "Pass the flax NNX model (make_optimizer(..., model=model), route_params(model)) so "
    "that its module types decide,"
)


def _name_route(
    name: str, shape: tuple[int, ...], layout: str, vocab_size: int | None
) -> Route | RoutingError:
    """The route that names and shapes alone give (rules of the module docstring)."""
    ndim = len(shape)
    parts = core.components(name)
    leaf = parts[-1]
    if ndim < 2:
        return Route("vector", evidence=f"shape: {ndim}-D")
    if sum(n > 1 for n in shape) <= 1:
        return Route("vector", evidence="shape: one non-unit axis")
    if leaf in core.VECTOR_NAMES:
        return RoutingError(
            f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with {ndim} axes "
            "may be stacked layers' vectors (L, d) or one multi-axis vector (heads, head_dim). "
            f"{_PASS_MODEL} or give it: "
            + core.override_advice(name, shape, Route("vector", batch=tuple(range(ndim - 1))))
            + " for stacked layers, " + core.override_advice(name, shape, Route("vector"))
            + " for one vector"
        )
    if layout == "flax":
        if leaf == "embedding" and ndim == 2:
            return Route("embedding", -1, -2, evidence="name 'embedding' (Flax Embed (V, d))")
        if leaf == "kernel" and ndim == 2:
            return Route("dense", -2, -1, evidence="name 'kernel' (Flax (in, out))")
        if leaf in ("kernel", "embedding"):
            conv = Route("dense", (-2, *range(-ndim, -2)), -1)
            return RoutingError(
                f"cannot tell the layout of {name!r} of shape {shape}: a Flax {leaf!r} with "
                f"{ndim} axes may be stacked layers (L, ..., in, out), a multi-axis kernel "
                "(nnx.LinearGeneral, nnx.MultiHeadAttention, nnx.Einsum) or a convolution "
                f"(*taps, Cin, Cout). {_PASS_MODEL} or give its axes: "
                + core.override_advice(name, shape, Route("dense", -2, -1))
                + " for stacked layers, " + core.override_advice(name, shape, conv)
                + " for a convolution"
            )
    else:
        if leaf == "weight" and core.names_token_embedding(name) and ndim == 2:
            return Route("embedding", -1, -2, evidence="name (token table (V, d))")
        if leaf == "weight" and ndim == 2:
            return Route("dense", -1, -2, evidence="name 'weight' (torch (out, in))")
        if leaf == "weight":
            return RoutingError(
                f"cannot place {name!r} of shape {shape}: a torch-layout 'weight' with "
                f"{ndim} dims may be a convolution (out, in, *taps) or stacked layers; give its "
                "axes, e.g. " + core.override_advice(
                    name, shape, Route("dense", tuple(range(1, ndim)), 0))
                + " for a convolution"
            )
    if ndim == 2 and (leaf in core.TOKEN_EMBEDDING_MARKERS or leaf in ("embed", "embedding")):
        return Route("embedding", -1, -2, evidence=f"name {leaf!r} (token table (V, d))")
    if any("emb" in part for part in parts):
        hits = [a for a in (-2, -1) if shape[a] == vocab_size]
        if len(hits) == 1:
            return Route("embedding", -3 - hits[0], hits[0],
                         evidence=f"name + vocab_size={vocab_size} on axis {ndim + hits[0]}")
        return RoutingError(
            f"cannot place {name!r} of shape {shape}: its name says an embedding but not "
            "which axis indexes the table; pass vocab_size=..., or give it, e.g. "
            + core.override_advice(name, shape, Route("embedding", -1, -2))
            + " for a table (rows, d), or 'vector' for element-wise rules"
        )
    if ndim > 2:
        return RoutingError(
            f"cannot tell the layout of {name!r} of shape {shape}: a matrix with {ndim} axes "
            "may be stacked layers, a multi-axis kernel or a convolution; give its axes, e.g. "
            + core.override_advice(name, shape, Route("dense", -2, -1) if layout == "flax"
                                   else Route("dense", -1, -2))
            + " for stacked layers, or Route('dense', fan_in=(...), fan_out=(...)) for one "
            "matrix with merged axes"
        )
    if layout == "torch":
        return Route("dense", -1, -2, evidence="layout torch: (out, in)")
    return Route("dense", -2, -1, evidence="layout flax: (in, out)")


# ------------------------------------------------------------------------------- the router


@dataclasses.dataclass
class _Leaf:
    name: str
    shape: tuple[int, ...]
    route: Route | RoutingError
    overridden: bool = False


def _token_table(leaves: list[_Leaf]) -> _Leaf | None:
    tables = [
        x for x in leaves
        if isinstance(x.route, Route) and x.route.kind == "embedding" and len(x.shape) == 2
        and not x.overridden
    ]
    if len(tables) == 1:
        return tables[0]
    named = [x for x in tables if core.names_token_embedding(x.name)
             or core.components(x.name)[-1] in core.TOKEN_EMBEDDING_MARKERS]
    return named[0] if len(named) == 1 else None


def _find_head(leaves: list[_Leaf], vocab_size: int | None) -> None:
    """Make the one dense matrix shaped like the token embedding the head (module doc)."""
    table = _token_table(leaves)
    if table is None and vocab_size is None:
        return
    vocab = vocab_size if vocab_size is not None else table.shape[0]  # type: ignore[union-attr]
    width = None if table is None else table.shape[1]
    fits = []
    for x in leaves:
        r = x.route
        if x.overridden or not isinstance(r, Route) or r.kind != "dense" or len(x.shape) != 2:
            continue
        res = r.resolve(x.shape, x.name)
        fi, fo = x.shape[res.fan_in[0]], x.shape[res.fan_out[0]]
        if fo == vocab and (width is None or fi == width):
            fits.append(x)
    if len(fits) > 1:
        named = [x for x in fits if core.names_head(x.name)]
        if len(named) != 1:
            for x in fits:
                x.route = RoutingError(
                    f"cannot tell which of {[f.name for f in fits]} is the output head: each has "
                    f"the shape of the token embedding (fan-in {width}, fan-out {vocab}); route "
                    f"the head with {core.override_advice(x.name, x.shape, _as(x, 'embedding'))}"
                    f" and the others with {core.override_advice(x.name, x.shape, _as(x, 'dense'))}"
                )
            return
        fits = named
    for x in fits:
        r = x.route
        assert isinstance(r, Route)
        source = "vocab_size" if table is None else repr(table.name)
        x.route = dataclasses.replace(
            r, kind="embedding",
            evidence=f"head: shape of the token embedding {source} ({r.evidence})",
        )


def _as(x: _Leaf, kind: str) -> Route:
    assert isinstance(x.route, Route)
    return dataclasses.replace(x.route, kind=kind)


def _apply_override(x: _Leaf, override: Route, vocab_size: int | None) -> Route:
    """The route of an overridden leaf: the override, with axes inferred where it gives none."""
    if override.has_axes or (override.kind == "vector" and override.batch is not None):
        return override
    default = x.route
    if override.kind == "vector":
        batch = default.batch if isinstance(default, Route) and default.kind == "vector" else ()
        return Route("vector", batch=batch, evidence="override")
    if isinstance(default, Route) and default.has_axes:
        return Route(override.kind, default.fan_in, default.fan_out, default.batch,
                     evidence=f"override (axes: {default.evidence})")
    if override.kind == "embedding" and vocab_size is not None and len(x.shape) >= 2:
        hits = [a for a in (-2, -1) if x.shape[a] == vocab_size]
        if len(hits) == 1:
            return Route("embedding", -1 if hits[0] == -2 else -2, hits[0],
                         evidence=f"override (vocab axis: vocab_size={vocab_size})")
    raise RoutingError(
        f"override makes {x.name!r} of shape {x.shape} {override.kind!r}, but its axes are not "
        f"known; give them: {core.override_advice(x.name, x.shape)}"
    )


def route_params(
    params: Any,
    overrides: Mapping[str, Any] | None = None,
    *,
    vocab_size: int | None = None,
    layout: str = "flax",
    model: Any | None = None,
    module_evidence: Mapping[str, Route | RoutingError] | None = None,
) -> ParamRouting:
    """Give every parameter leaf its kind and axes, from the strongest evidence.

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct``), e.g. ``nnx.state(model,
        nnx.Param)``, linen ``variables["params"]`` or a nested dict; or an ``nnx.Module``
        (its ``nnx.Param`` state is routed, with the module evidence).  ``optax.MaskedNode``
        and ``None`` leaves are kept as they are.
      overrides: ``{glob: kind}``, ``{glob: Route(kind, fan_in=..., fan_out=...)}`` or
        ``{glob: (kind, {"fan_in": ..., "fan_out": ...})}``, matched against dotted paths
        (``"layers.*.mlp.down_proj.kernel"``); first match wins; a glob that matches nothing
        is an error.
      vocab_size: the vocabulary size, for heads when the tree has no token table, and
        for the vocab axis of a matrix an override calls ``embedding``.
      layout: ``"flax"`` (``(in, out)`` kernels) or ``"torch"`` (``(out, in)`` weights, as an
        Equinox model or a converted PyTorch state dict).
      model: the ``nnx.Module`` the params come from: its module types are evidence.
      module_evidence: precomputed :func:`module_routes` (what ``make_optimizer`` passes).

    Returns:
      A :class:`ParamRouting` of ``labels``, ``axes`` and ``routes`` pytrees.

    Raises:
      RoutingError: a leaf it cannot place (non-float dtype, unknown layout, ambiguous
        head), an override that does not apply; the message names the path, the shape and
        the override that fixes it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if _is_nnx_module(params):
        from flax import nnx

        model, params = params, nnx.state(params, nnx.Param)
    evidence = dict(module_evidence or {})
    if model is not None:
        evidence.update(module_routes(model))
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    named = [(leaf_name_path(p), x) for p, x in with_path]
    # Globs are matched against every path, masked ones too: optax.partition routes each
    # kind's subtree with the other kinds' leaves masked.
    override_of = core.match_overrides([n for n, _ in named], overrides)
    leaves: list[_Leaf] = []
    for name, x in named:
        if axes_lib.is_masked(x):
            continue
        shape = tuple(int(s) for s in x.shape)
        if not jnp.issubdtype(x.dtype, jnp.floating):
            route: Route | RoutingError = RoutingError(
                f"cannot place parameter {name!r} of shape {shape}: dtype {jnp.dtype(x.dtype)} "
                "is not floating point, so no optimizer can train it; filter it out of the "
                "params (e.g. nnx.Optimizer(..., wrt=nnx.Param)) or mask it"
            )
        elif name in evidence:
            route = evidence[name]
        else:
            route = _name_route(name, shape, layout, vocab_size)
        leaves.append(_Leaf(name, shape, route))
    _find_head([x for x in leaves if x.name not in override_of], vocab_size)
    for x in leaves:
        if x.name in override_of:
            x.route = _apply_override(x, override_of[x.name], vocab_size)
            x.overridden = True
    resolved: dict[str, tuple[Route, ResolvedRoute]] = {}
    for x in leaves:
        if isinstance(x.route, RoutingError):
            raise x.route
        resolved[x.name] = x.route, x.route.resolve(x.shape, x.name)
    labels, leaf_axes, routes = [], [], []
    for name, x in named:
        if axes_lib.is_masked(x):
            labels.append(x)
            leaf_axes.append(x)
            routes.append(x)
            continue
        route, r = resolved[name]
        labels.append(r.kind)
        leaf_axes.append(axes_lib.LeafAxes.from_route(route))
        routes.append(r)
    unflat = jax.tree_util.tree_unflatten
    return ParamRouting(unflat(treedef, labels), unflat(treedef, leaf_axes),
                        unflat(treedef, routes))


def label_params(
    params: Any,
    overrides: Mapping[str, Any] | None = None,
    *,
    vocab_size: int | None = None,
) -> ParamRouting:
    """Deprecated name of :func:`route_params` (same arguments and result)."""
    warnings.warn(
        "sage_optax.label_params is deprecated; use sage_optax.route_params (same arguments)",
        DeprecationWarning,
        stacklevel=2,
    )
    return route_params(params, overrides, vocab_size=vocab_size)
