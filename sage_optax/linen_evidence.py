"""flax linen modules as routing evidence: ``model=sage_optax.linen_model(module, *inputs)``.

A linen module holds no parameters and its submodules exist only while it runs, so its
module types can only be read by running it.  :func:`linen_model` keeps the module and a
sample input; :func:`linen_routes` runs ``module.init`` abstractly (``jax.eval_shape``: no
FLOP, no parameter allocated) under ``nn.intercept_methods`` and reads, for every module
called, its type and attributes:

* ``nn.Dense``: ``kernel`` ``(in, out)``;
* ``nn.DenseGeneral``: ``kernel`` ``(*batch_dims, *axis, *features)``: the input axes
  (``axis``) merged as the fan-in, the ``features`` merged as the fan-out, ``batch_dims``
  batch axes (so nanodo's and ``nn.MultiHeadDotProductAttention``'s ``query``/``key``/
  ``value`` ``(D, H, Dh)`` are one ``D x (H·Dh)`` matrix, their output projection
  ``(H, Dh, D)`` one ``(H·Dh) x D`` matrix);
* ``nn.Einsum``: contracted kernel letters are the fan-in, kept ones the fan-out, letters
  shared with the input and the output batch axes;
* ``nn.Embed``: ``embedding`` ``(V, d)``, a table (also when ``attend`` ties it as the
  head);
* ``nn.Conv``: ``(*taps, Cin, Cout)``, fan-in the input channels then the taps;
  ``nn.ConvTranspose`` is refused (its fan-in is a modelling choice);
* the norm layers (``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm``,
  ``InstanceNorm``) and every ``bias``: vectors.

Lifted transforms (``nn.scan``, ``nn.vmap``, with any ``variable_axes``) insert axes into
a module's parameters: the shape the module sees inside the transform is compared with the
stored one, and the inserted axes are batch axes (one matrix step per layer or expert),
wherever they stand.  Where the sizes cannot say which axes were inserted and the readings
differ, the leaf is refused with them.  Parameters of other modules (``self.param`` in a
custom module) are left to the other evidence: their axis names, then their leaf names.
Mesh axis names (nanodo's ``("data", None, None)``) say nothing about roles; the module
types are the evidence that places real nanodo's attention kernels.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from sage_optax import axes as axes_lib
from sage_optax import module_layouts
from sage_optim import routing as core
from sage_optim.routing import Route, RoutingError

__all__ = ["LinenModel", "linen_model", "linen_routes"]


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A flax linen module with the inputs to run it on: what ``model=`` reads for linen.

    Build it with :func:`linen_model`.

    Attributes:
      module: the (unbound) ``flax.linen.Module``.
      args: positional inputs of ``module.init`` after the PRNG keys (arrays or
        ``jax.ShapeDtypeStruct``).
      kwargs: keyword inputs.
      method: the method ``init`` runs (``None``: ``__call__``), as for ``module.init``.
      rngs: the PRNG keys ``init`` gets (``None``: one key for ``"params"`` and
        ``"dropout"``).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """

    module: Any
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    method: str | Callable[..., Any] | None = None
    rngs: Any = None


def linen_model(module: Any, *args: Any, method: str | Callable[..., Any] | None = None,
                rngs: Any = None, **kwargs: Any) -> LinenModel:
    """A linen module and a sample input, for ``model=`` of the router and ``make_optimizer``.

    ``sage_optax.make_optimizer("sage-hybrid", model=sage_optax.linen_model(module, tokens))``
    routes every parameter of a known linen module type (``nn.Dense``, ``nn.DenseGeneral``,
    ``nn.Einsum``, ``nn.Embed``, ``nn.Conv``, the norm layers) by its type and attributes,
    as an nnx model's modules are read.  The module is run once, abstractly
    (``jax.eval_shape(module.init, rngs, *args, method=method, **kwargs)``): the inputs may
    be ``jax.ShapeDtypeStruct`` s, and their values do not matter, only that every
    submodule is called.

    Args:
      module: a ``flax.linen.Module``, unbound or bound (``module.bind(variables)``: its
        unbound clone is run).
      *args: the inputs, as for ``module.init(rngs, *args)``.
      method: the method to run (``None``: ``__call__``).
      rngs: the PRNG keys for ``init`` (``None``: ``jax.random.key(0)`` for ``"params"``
        and ``"dropout"``).
      **kwargs: keyword inputs (``train=False``...).

    Returns:
      A :class:`LinenModel` to pass as ``model=``.

    Raises:
      TypeError: ``module`` is not a linen module.

    Examples:
      >>> import jax, jax.numpy as jnp, sage_optax
      >>> from flax import linen as nn
      >>> layer = nn.DenseGeneral((2, 4), use_bias=False)
      >>> x = jax.ShapeDtypeStruct((1, 8), jnp.float32)
      >>> params = jax.eval_shape(layer.init, jax.random.key(0), x)["params"]
      >>> routes = sage_optax.route_params(
      ...     params, model=sage_optax.linen_model(layer, x)).routes
      >>> routes["kernel"].fan_in, routes["kernel"].fan_out
      ((0,), (1, 2))

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """
    from flax import linen as nn

    if not isinstance(module, nn.Module):
        raise TypeError(
            f"linen_model takes a flax.linen.Module, got a {type(module).__name__} (an nnx "
            "module or an Equinox model is passed as model= itself)")
    if module.scope is not None:  # bound: run its unbound clone
        module = module.clone(parent=None)
    return LinenModel(module, tuple(args), dict(kwargs), method, rngs)


def _norm_types(nn: Any) -> tuple[type, ...]:
    names = ("LayerNorm", "RMSNorm", "GroupNorm", "BatchNorm", "InstanceNorm")
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


def _group(x: Any) -> int:
    """How many axes an int-or-sequence attribute (``axis``, ``features``) names."""
    return len(tuple(x)) if isinstance(x, tuple | list) else 1


def _own_routes(module: Any, attr: str, shape: tuple[int, ...], einsum_str: str | None,
                ) -> Route | RoutingError | None:
    """The route of ``module``'s parameter ``attr`` of (unstacked) ``shape``, or None."""
    from flax import linen as nn

    ev = f"module nn.{type(module).__name__}"
    ndim = len(shape)
    if isinstance(module, _norm_types(nn)) and attr in ("scale", "bias"):
        return Route("vector", batch=(), evidence=ev)
    if isinstance(module, nn.DenseGeneral):
        return _dense_general_route(module, attr, ndim, ev)
    if attr == "bias":  # (out,), or an Einsum's output letters: one vector, as in nnx
        return (Route("vector", batch=(), evidence=ev)
                if ndim <= 1 or isinstance(module, nn.Einsum) else None)
    if isinstance(module, nn.Embed) and attr == "embedding" and ndim == 2:
        return Route("embedding", 1, 0, evidence=ev + " (V, d)")
    if attr != "kernel":
        return None
    return _kernel_route(module, shape, einsum_str, ev)


def _dense_general_route(module: Any, attr: str, ndim: int, ev: str) -> Route | None:
    """The route of an ``nn.DenseGeneral`` parameter: ``(*batch_dims, *axis, *features)``."""
    n_b = _group(module.batch_dims) if module.batch_dims != () else 0
    n_in, n_out = _group(module.axis), _group(module.features)
    if attr == "bias":
        return Route("vector", batch=tuple(range(n_b)), evidence=ev)
    if attr != "kernel" or ndim != n_b + n_in + n_out:
        return None
    return Route("dense", tuple(range(n_b, n_b + n_in)), tuple(range(n_b + n_in, ndim)),
                 tuple(range(n_b)), evidence=ev + " (*batch_dims, *axis, *features)")


def _kernel_route(module: Any, shape: tuple[int, ...], einsum_str: str | None,
                  ev: str) -> Route | RoutingError | None:
    """The route of a ``kernel`` of ``nn.Dense``, ``nn.Einsum`` or ``nn.Conv``, or None."""
    from flax import linen as nn

    ndim = len(shape)
    if isinstance(module, nn.Dense) and ndim == 2:
        return Route("dense", 0, 1, evidence=ev + " (in, out)")
    if isinstance(module, nn.Einsum) and einsum_str:
        try:
            route = module_layouts.einsum_route(einsum_str, ndim, "kernel")
        except RoutingError as e:
            return e
        return dataclasses.replace(route, evidence=f"{ev} {einsum_str!r}")
    if isinstance(module, nn.ConvTranspose) and ndim >= 2:
        taps = ndim - 2
        return module_layouts.conv_transpose_refusal(
            "kernel", shape, Route("dense", (-2, *range(-2 - taps, -2)), -1),
            "an nn.ConvTranspose kernel (*taps, Cin, Cout)",
            "input channels and taps are its fan-in, as for nn.Conv")
    if isinstance(module, nn.Conv) and ndim >= 2:
        taps = ndim - 2
        fan_in = (ndim - 2, *range(taps))
        return Route("dense", fan_in, ndim - 1, (), evidence=ev + " (*taps, Cin, Cout)")
    return None


@dataclasses.dataclass
class _Seen:
    module: Any
    shapes: dict[str, tuple[int, ...]]
    einsum_str: str | None


def _run(model: LinenModel) -> tuple[dict[tuple[str, ...], _Seen], dict[str, tuple[int, ...]],
                                     Any]:
    """The known modules ``model`` calls, the stored shape of every parameter, the params.

    Modules are keyed by path, with their own parameters' shapes as they see them (inside a
    lifted transform: one copy); stored shapes by dotted path under ``params``; the params
    are ``init``'s, abstract (``jax.ShapeDtypeStruct``, boxes kept).
    """
    from flax import linen as nn

    known = (nn.Dense, nn.DenseGeneral, nn.Einsum, nn.Embed, nn.Conv, nn.ConvTranspose,
             *_norm_types(nn))
    seen: dict[tuple[str, ...], _Seen] = {}

    def interceptor(next_fun: Any, args: Any, kwargs: Any, context: Any) -> Any:
        out = next_fun(*args, **kwargs)
        module: Any = context.module
        if not issubclass(type(module), known) or module.scope is None:
            return out
        own = module.variables.get("params", {})
        shapes = {k: tuple(int(n) for n in nn.unbox(v).shape) for k, v in own.items()
                  if hasattr(nn.unbox(v), "shape")}
        einsum_str = getattr(module, "einsum_str", None)
        if isinstance(module, nn.Einsum) and context.method_name == "__call__":
            einsum_str = kwargs.get("einsum_str") or (args[1] if len(args) > 1 else None
                                                      ) or einsum_str
        path = tuple(str(p) for p in module.path)
        entry = seen.setdefault(path, _Seen(module, {}, einsum_str))
        entry.shapes.update(shapes)
        entry.einsum_str = entry.einsum_str or einsum_str
        return out

    rngs = model.rngs
    if rngs is None:
        key = jax.random.key(0)
        rngs = {"params": key, "dropout": key}
    extra = {} if model.method is None else {"method": model.method}
    # arrays and ShapeDtypeStructs are traced; anything else (train=False) stays static
    leaves, treedef = jax.tree.flatten((model.args, dict(model.kwargs)))
    traced = [i for i, x in enumerate(leaves)
              if isinstance(x, jax.ShapeDtypeStruct) or hasattr(x, "__jax_array__")
              or isinstance(x, jax.Array | np.ndarray)]

    def init(*arrays: Any) -> Any:
        filled = list(leaves)
        for i, x in zip(traced, arrays, strict=True):
            filled[i] = x
        args, kwargs = jax.tree.unflatten(treedef, filled)
        return model.module.init(rngs, *args, **extra, **kwargs)

    try:
        with nn.intercept_methods(interceptor):
            variables = jax.eval_shape(init, *[leaves[i] for i in traced])
    except Exception as e:  # the user's module on the user's inputs: say which, keep the cause
        shapes = ", ".join(
            f"{type(x).__name__}{tuple(x.shape)}" if hasattr(x, "shape") else repr(x)
            for x in leaves)
        raise ValueError(
            f"linen_model: {type(model.module).__name__}.init on the sample inputs ({shapes}) "
            f"failed with {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}; "
            "give the inputs the module's __call__ takes (jax.ShapeDtypeStruct will do)"
        ) from e
    stored: dict[str, tuple[int, ...]] = {}
    leaves, _ = jax.tree_util.tree_flatten_with_path(nn.unbox(variables.get("params", {})))
    for path, x in leaves:
        stored[axes_lib.path_str(path)] = tuple(int(n) for n in x.shape)
    return seen, stored, variables.get("params", {})


def abstract_params(model: LinenModel) -> Any:
    """The params ``model``'s module ``init`` builds on its inputs, abstract.

    ``jax.ShapeDtypeStruct`` leaves, boxes kept: the whole tree against which
    ``make_optimizer(..., model=model)`` routes a tree with ``optax.MaskedNode`` placeholders.
    """
    return _run(model)[2]


def _placed(route: Route, inner: tuple[int, ...], at: tuple[int, ...], ndim: int) -> Route:
    """``route`` (on the ``inner`` shape) moved to the stored shape.

    Inner axis ``i`` stands at ``at[i]``; the other (inserted) axes are batch axes.
    """
    r = route.resolve(inner)
    inserted = tuple(a for a in range(ndim) if a not in at)
    batch = tuple(sorted(inserted + tuple(at[i] for i in r.batch)))
    if route.kind == "vector":
        return Route("vector", batch=batch, evidence=route.evidence)
    return Route(route.kind, tuple(at[i] for i in r.fan_in), tuple(at[i] for i in r.fan_out),
                 batch, evidence=route.evidence)


def stacked_route(name: str, route: Route, inner: tuple[int, ...], outer: tuple[int, ...],
                  transform: str = "nn.scan/nn.vmap") -> Route | RoutingError | None:
    """``route`` (of the ``inner`` shape) of a parameter a lifted transform stacked to ``outer``.

    The axes of ``outer`` that are not ``inner``'s (matched by size, in order) are batch
    axes.  ``None`` when ``inner`` does not fit in ``outer``; a :class:`RoutingError` when
    several placements fit and give different routes (each is a remedy, the leading
    placement first).
    """
    if inner == outer:
        return _placed(route, inner, tuple(range(len(inner))), len(outer))
    fits = [c for c in itertools.combinations(range(len(outer)), len(inner))
            if all(outer[a] == inner[i] for i, a in enumerate(c))]
    if not fits:
        return None
    # the leading placement (nn.scan/nn.vmap's default variable_axes 0) first
    fits.sort(key=lambda c: tuple(-a for a in c))
    readings = list(dict.fromkeys(_placed(route, inner, c, len(outer)) for c in fits))
    if len(readings) == 1:
        r = readings[0]
        return dataclasses.replace(r, evidence=f"{route.evidence}, stacked by {transform} "
                                   "(inserted axes are batch)")
    options: list[tuple[Any, str]] = [
        (dataclasses.replace(r, evidence="override"),
         f"the transform stacked axes {r.batch} (variable_axes)") for r in readings]
    return RoutingError(
        f"cannot place {name!r} of shape {outer}: its {route.evidence} is {inner} inside a "
        f"lifted transform ({transform}), and the sizes do not say which axes the "
        "transform inserted; give it, e.g. " + core.override_advice(name, options[0][0]),
        leaf=name, shape=outer, options=options)


def linen_routes(model: LinenModel) -> dict[str, Route | RoutingError]:
    """Per-parameter routes read from the linen modules ``model`` runs, by dotted path.

    Keys are paths under ``variables["params"]`` (``"blocks_0.CausalAttn_0.query.kernel"``),
    and the same prefixed with ``"params."`` (for a whole variables tree).  Parameters of
    modules of unknown type, or that the sample run never called, are absent: the other
    evidence places them.

    Raises:
      TypeError: ``model`` is not a :class:`LinenModel`.
      ValueError: the module fails on the sample inputs (the message names them; the
        module's own error is its cause).
    """
    if not isinstance(model, LinenModel):
        raise TypeError(f"linen_routes takes a LinenModel (linen_model(...)), got "
                        f"{type(model).__name__}")
    seen, stored, _ = _run(model)
    out: dict[str, Route | RoutingError] = {}
    for path, entry in seen.items():
        for attr, inner in entry.shapes.items():
            name = ".".join((*path, attr))
            outer = stored.get(name)
            if outer is None:
                continue
            own = _own_routes(entry.module, attr, inner, entry.einsum_str)
            if own is None:
                continue
            if isinstance(own, RoutingError):
                out[name] = RoutingError(str(own).replace(repr(attr), repr(name), 1),
                                         leaf=name, shape=outer, options=own.options)
                continue
            route = stacked_route(name, own, inner, outer)
            if route is not None:
                out[name] = route
    out.update({f"params.{k}": v for k, v in list(out.items())})
    return out
