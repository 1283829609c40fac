"""flax NNX modules as routing evidence: the layout each module type gives its parameters.

:func:`nnx_routes` reads the modules of an ``nnx.Module`` for :mod:`sage_optax.routing`, as
:mod:`sage_optax.linen_evidence` reads linen's; ``docs/routing.md`` states the layouts.
"""

from __future__ import annotations

from typing import Any

import jax

from sage_optax import module_layouts
from sage_optim.routing import Route, RoutingError


def is_nnx_module(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Module`` (False without Flax installed)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional for sage_optax
        return False
    return isinstance(x, nnx.Module)


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

    out: dict[str, Any] = {}
    ev = f"module nnx.{type(module).__name__}"
    for attr, p in params.items():
        full = f"{name}.{attr}" if name else attr
        shape = tuple(p.shape)
        if attr == "bias" or (isinstance(module, _norm_types()) and attr == "scale"):
            stacked = max(len(shape) - _expected_bias_ndim(module), 0)
            if isinstance(module, nnx.LinearGeneral):
                stacked += len(module.batch_axis)  # (*batch, *out): one bias per batch entry
            out[full] = Route("vector", batch=tuple(range(stacked)), evidence=ev)
        elif attr == "kernel" or isinstance(module, nnx.Embed):
            route = _nnx_matrix_route(module, full, shape, ev)
            if route is not None:
                out[full] = route
        # any other parameter has no known layout: left to the name rules
    return out


def _nnx_matrix_route(module: Any, full: str, shape: tuple[int, ...],
                      ev: str) -> Route | RoutingError | None:
    """The route an nnx module type gives its kernel (or table), or ``None``."""
    from flax import nnx

    if isinstance(module, nnx.Embed):
        return Route("embedding", -1, -2, evidence=ev + " (V, d)")
    if isinstance(module, nnx.LinearGeneral):
        n_in, n_out = len(module.in_features), len(module.out_features)
        fan_in = tuple(range(-n_in - n_out, -n_out))
        return Route("dense", fan_in, tuple(range(-n_out, 0)), evidence=ev)
    if isinstance(module, nnx.Linear):
        return Route("dense", -2, -1, evidence=ev + " (in, out)")
    if isinstance(module, nnx.Einsum):
        try:
            return module_layouts.einsum_route(module.einsum_str, len(shape), full)
        except RoutingError as e:
            return e
    if isinstance(module, nnx.ConvTranspose):
        taps = len(shape) - 2
        conv = Route("dense", (-2, *range(-2 - taps, -2)), -1)
        return module_layouts.conv_transpose_refusal(
            full, shape, conv, "an nnx.ConvTranspose kernel (*taps, Cin, Cout)",
            "input channels and taps are its fan-in, as for nnx.Conv")
    if isinstance(module, nnx.Conv):
        size = module.kernel_size
        taps = len(size) if isinstance(size, tuple | list) else 1
        # (*taps, Cin, Cout): fan-in is the input channels then the taps (the order of a
        # PyTorch Conv weight (Cout, Cin, *taps)), fan-out the output channels.
        fan_in = (-2, *range(-2 - taps, -2))
        return Route("dense", fan_in, -1, evidence=ev + " (*taps, Cin, Cout)")
    return None


def nnx_routes(model: Any) -> dict[str, Route | RoutingError]:
    """The routes the module types of an ``nnx.Module`` give its parameters, by dotted path.

    Only parameters owned by a module of known layout appear (``nnx.Embed``, ``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``, the norm layers; a
    ``nnx.ConvTranspose`` kernel maps to the error it raises if used).  The axes
    ``nnx.vmap``/``nnx.scan`` insert are batch axes, wherever they stand
    (``nnx.StateAxes({nnx.Param: 1})``): each module's own shape (``in_features``,
    ``out_features``...) says which axes are its.
    """
    from flax import nnx

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
        out.update(_nnx_stacked(node, name, params))
    return out


def _nnx_own_shape(module: Any, attr: str) -> tuple[int, ...] | None:
    """The shape ``module`` gives its parameter ``attr`` before any stacking, or None."""
    from flax import nnx

    def ints(x: Any) -> tuple[int, ...]:
        return tuple(int(n) for n in (x if isinstance(x, tuple | list) else (x,)))

    if isinstance(module, _norm_types()) and attr in ("scale", "bias"):
        return ints(getattr(module, "num_features", ()))
    if isinstance(module, nnx.Embed) and attr == "embedding":
        return (int(module.num_embeddings), int(module.features))
    if isinstance(module, nnx.LinearGeneral):
        batch = ints(tuple(module.batch_axis.values()))
        out_f = ints(module.out_features)
        return ((*batch, *ints(module.in_features), *out_f) if attr == "kernel" else
                (*batch, *out_f) if attr == "bias" else None)
    if isinstance(module, nnx.Linear):
        return ((int(module.in_features), int(module.out_features)) if attr == "kernel" else
                (int(module.out_features),) if attr == "bias" else None)
    if isinstance(module, nnx.Einsum):
        own = getattr(module, f"{attr}_shape", None) if attr in ("kernel", "bias") else None
        return ints(own) if own is not None else None
    if isinstance(module, nnx.Conv) and attr in ("kernel", "bias"):
        own = getattr(module, "kernel_shape", None)
        if own is None:
            return None
        return ints(own) if attr == "kernel" else (int(module.out_features),)
    return None


def _nnx_stacked(module: Any, name: str, params: dict[str, Any]) -> dict[str, Any]:
    """Routes of ``module``'s parameters that ``nnx.vmap``/``nnx.scan`` stacked off axis 0.

    The module's attributes give each parameter's own shape; the axes the transform
    inserted (``nnx.StateAxes({nnx.Param: 1})`` puts them anywhere) are batch axes, found
    as in :func:`sage_optax.linen_evidence.stacked_route`.  Parameters stacked on leading
    axes only, or of unknown own shape, keep the routes :func:`_module_param_routes` gives.
    """
    from sage_optax import linen_evidence

    out: dict[str, Any] = {}
    for attr, p in params.items():
        shape, own = tuple(int(n) for n in p.shape), _nnx_own_shape(module, attr)
        if own is None or len(own) >= len(shape) or shape[len(shape) - len(own):] == own:
            continue
        full = f"{name}.{attr}" if name else attr
        inner = _module_param_routes(module, name, {attr: jax.ShapeDtypeStruct(own, p.dtype)})
        route = inner.get(full)
        if isinstance(route, Route):
            placed = linen_evidence.stacked_route(full, route, own, shape, "nnx.vmap/nnx.scan")
            if placed is not None:
                out[full] = placed
    return out


def is_nnx_state(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.State`` (False without Flax installed)."""
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional for sage_optax
        return False
    return isinstance(x, nnx.State)
