"""The Equinox adapter: the layouts of ``eqx.nn``'s module types.

Equinox follows PyTorch's layouts: ``eqx.nn.Linear`` ``weight`` ``(out, in)``,
``eqx.nn.Embedding`` ``(V, d)``, ``eqx.nn.Conv*`` ``(Cout, Cin, *taps)`` (fan-in: input
channels and taps), ``eqx.nn.GRUCell``/``LSTMCell`` ``weight_ih``/``weight_hh`` ``(out, in)``;
biases and norm weights are vectors; axes ``eqx.filter_vmap`` stacked are batch axes.
:mod:`sage_optax.routing` loads this adapter once equinox is imported; equinox is never
imported here (its module is looked up in ``sys.modules``).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax

from sage_optax import axes as axes_lib
from sage_optax import module_layouts
from sage_optax.linen_evidence import stacked_route
from sage_optax.routing import Adapter, register_adapter
from sage_optim.routing import Route, RoutingError

__all__ = ["ADAPTER", "owns", "params", "routes"]


def owns(x: Any) -> bool:
    """Whether ``x`` is an Equinox module (False unless ``equinox`` is imported)."""
    eqx = sys.modules.get("equinox")  # a tree cannot hold one unless equinox is imported
    return eqx is not None and isinstance(x, eqx.Module)


class _EqxTypes(NamedTuple):
    """The ``eqx.nn`` module types whose parameters :func:`routes` reads."""

    matrices: tuple[type, ...]  # weight, weight_ih, weight_hh (out, in)
    norms: tuple[type, ...]
    convs: tuple[type, ...]
    convts: tuple[type, ...]
    embeddings: tuple[type, ...]
    prelus: tuple[type, ...]

    @classmethod
    def of(cls, nn: Any) -> _EqxTypes:
        """The types of the installed ``eqx.nn`` (a type it lacks is left out)."""

        def types(*names: str) -> tuple[type, ...]:
            return tuple(getattr(nn, n) for n in names if hasattr(nn, n))

        return cls(types("Linear", "GRUCell", "LSTMCell"),
                   types("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm"),
                   types("Conv"), types("ConvTranspose"), types("Embedding"), types("PReLU"))

    @property
    def known(self) -> tuple[type, ...]:
        """Every type read, in the order ``isinstance`` tries them."""
        return (*self.matrices, *self.norms, *self.convs, *self.convts, *self.embeddings,
                *self.prelus)


def routes(tree: Any) -> dict[str, Route | RoutingError]:
    """Per-parameter routes read from the Equinox modules in ``tree``, keyed by dotted path.

    ``tree`` is an Equinox model, filtered (``eqx.filter(model, eqx.is_inexact_array)``) or
    not.  Equinox follows PyTorch's layouts: ``eqx.nn.Linear`` ``weight`` ``(out, in)``,
    ``eqx.nn.Embedding`` ``(V, d)``, ``eqx.nn.Conv*`` ``(Cout, Cin, *taps)`` (fan-in: input
    channels and taps), ``eqx.nn.GRUCell``/``LSTMCell`` ``weight_ih``/``weight_hh``
    ``(out, in)``; biases and norm weights are vectors.  Leading axes beyond a module's own
    (``eqx.filter_vmap``-stacked layers) are batch axes, wherever ``out_axes`` put them for
    ``Linear``, ``Embedding``, ``LayerNorm`` and ``RMSNorm`` (their own shape says which
    axes are theirs).  An ``eqx.nn.ConvTranspose`` weight
    maps to the error it raises if used; other modules are left to the name rules.
    """
    eqx = sys.modules.get("equinox")
    if eqx is None:
        return {}
    kinds = _EqxTypes.of(eqx.nn)
    known = kinds.known
    out: dict[str, Route | RoutingError] = {}
    found, _ = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, known))
    node: Any
    for path, node in found:
        if not isinstance(node, known):
            continue
        base = axes_lib.path_str(path) if path else ""
        for attr, value in vars(node).items():
            shape = getattr(value, "shape", None)
            if shape is None or not hasattr(value, "dtype"):
                continue
            full = f"{base}.{attr}" if base else attr
            shape = tuple(int(n) for n in shape)
            route = _eqx_param_route(node, attr, full, shape, kinds)
            if route is not None:
                out[full] = _eqx_unstacked(node, attr, full, shape, route)
    return out


def _eqx_param_route(node: Any, attr: str, full: str, shape: tuple[int, ...],
                     kinds: _EqxTypes) -> Route | RoutingError | None:
    """The route the type of the Equinox module ``node`` gives its array ``attr``.

    Biases, norm and PReLU parameters are vectors (batch: the axes before the module's own);
    matrices, tables and convolutions get their PyTorch layout; a ``ConvTranspose`` weight
    the error it raises if used.  ``None`` for a leaf the type says nothing of (a 0-D/1-D
    non-vector).
    """
    ndim = len(shape)
    ev = f"module eqx.nn.{type(node).__name__}"
    if isinstance(node, kinds.norms + kinds.prelus) or attr.startswith("bias"):
        own = 1  # a bias (out,), a norm's (d,) or its own multi-axis shape
        norm_shape = getattr(node, "shape", None)
        if isinstance(node, kinds.norms) and isinstance(norm_shape, tuple):
            own = max(len(norm_shape), 1)
        if isinstance(node, kinds.convs + kinds.convts):
            own = 1 + _spatial(node)  # (Cout, 1, ..., 1)
        return Route("vector", batch=tuple(range(max(ndim - own, 0))), evidence=ev)
    if ndim < 2:
        return None
    if isinstance(node, kinds.convts):
        taps = _spatial(node)
        conv = Route("dense", tuple(range(-taps - 1, 0)), -taps - 2)
        return module_layouts.conv_transpose_refusal(
            full, shape, conv, "an eqx.nn.ConvTranspose weight",
            "axis 1 and the taps are its fan-in, as for eqx.nn.Conv")
    if isinstance(node, kinds.embeddings):
        return Route("embedding", -1, -2, evidence=ev + " (V, d)")
    if isinstance(node, kinds.convs):
        taps = _spatial(node)
        return Route("dense", tuple(range(-taps - 1, 0)), -taps - 2,
                     evidence=ev + " (Cout, Cin, *taps)")
    if isinstance(node, kinds.matrices):
        return Route("dense", -1, -2, evidence=ev + " (out, in)")
    return None


def _eqx_unstacked(node: Any, attr: str, full: str, shape: tuple[int, ...],
                   route: Route | RoutingError) -> Route | RoutingError:
    """``route`` with the axes ``eqx.filter_vmap`` stacked off axis 0 made batch axes.

    Where the module's own shape (:func:`_eqx_own_shape`) is not the trailing axes of
    ``shape`` (``out_axes=1``), :func:`sage_optax.linen_evidence.stacked_route` finds it;
    else ``route`` is kept.
    """
    ndim = len(shape)
    mine = _eqx_own_shape(node, attr)
    if (isinstance(route, Route) and mine is not None and len(mine) < ndim
            and shape[ndim - len(mine):] != mine):  # stacked off axis 0 (out_axes=1)
        inner = route if route.kind != "vector" else Route(
            "vector", batch=(), evidence=route.evidence)
        placed = stacked_route(full, inner, mine, shape, "eqx.filter_vmap")
        if placed is not None:
            return placed
    return route


def _eqx_own_shape(node: Any, attr: str) -> tuple[int, ...] | None:
    """The shape an Equinox module gives its array ``attr`` before any stacking, or None."""
    nn = sys.modules["equinox"].nn

    def dim(n: Any) -> int:
        return 1 if n == "scalar" else int(n)  # eqx.nn.Linear stores "scalar" as size 1

    if hasattr(nn, "Linear") and isinstance(node, nn.Linear):
        out_f = dim(node.out_features)
        return ((out_f, dim(node.in_features)) if attr == "weight" else
                (out_f,) if attr == "bias" else None)
    if hasattr(nn, "Embedding") and isinstance(node, nn.Embedding) and attr == "weight":
        return (int(node.num_embeddings), int(node.embedding_size))
    norms = tuple(getattr(nn, n) for n in ("LayerNorm", "RMSNorm") if hasattr(nn, n))
    if isinstance(node, norms) and attr in ("weight", "bias"):
        shape = node.shape
        return tuple(int(n) for n in (shape if isinstance(shape, tuple) else (shape,)))
    return None


def _spatial(conv: Any) -> int:
    """The number of spatial axes (taps) of an Equinox convolution."""
    return int(conv.num_spatial_dims)


def params(model: Any, wrt: Any, wrt_name: str | None) -> tuple[Any, str]:
    """The leaves of ``model`` to train: ``eqx.filter(model, wrt)`` (default: inexact arrays)."""
    eqx = sys.modules["equinox"]
    what = "eqx.filter(model, " + ("eqx.is_inexact_array" if wrt is None else str(wrt_name)) + ")"
    return eqx.filter(model, eqx.is_inexact_array if wrt is None else wrt), what


ADAPTER = register_adapter(Adapter("equinox", owns=owns, routes=routes, params=params))
"""The Equinox adapter, registered with :func:`sage_optax.routing.register_adapter`."""
