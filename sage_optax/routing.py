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
   input channels and taps, merged); the axes ``nnx.vmap``/``nnx.scan`` insert are batch
   axes, found from each module's own shape wherever the transform put them; for linen,
   ``model=sage_optax.linen_model(module, *inputs)`` reads ``nn.Dense``,
   ``nn.DenseGeneral``, ``nn.Einsum``, ``nn.Embed``, ``nn.Conv`` and the norm layers the
   same way (:mod:`sage_optax.linen_evidence`), axes inserted by ``nn.scan``/``nn.vmap``
   being batch axes wherever they stand;
3. **logical axis names** (:mod:`sage_optax.logical`): ``nn.Partitioned`` boxes, the
   ``out_sharding`` metadata of ``nnx.Param``, or ``axis_names=``, read through
   :data:`sage_optax.logical.AXIS_ROLES` and ``axis_roles=``: ``("embed", "mlp")`` is
   ``(in, out)``, ``("heads", "kv", "embed")`` ``(heads·head_dim) x out``, ``exp`` and
   ``layers`` batch axes; where a module gives the axes too, both must agree;
4. **names and shapes**, only where unambiguous: by default (``layout=None``) each leaf's
   name says its convention (a 2-D Flax ``kernel`` or Haiku ``w`` is ``(in, out)``, a 2-D
   ``embedding`` an ``Embed`` table ``(V, d)``, a 2-D PyTorch or Equinox ``weight``
   ``(out, in)``); ``layout="flax"`` or ``"torch"`` declares every 2-D matrix of the tree
   ``(in, out)`` or ``(out, in)`` (a token table stays ``(V, d)``).
   0-D/1-D leaves are vectors.  A kernel, weight, ``scale`` or ``bias`` with more axes may
   be stacked layers, a multi-axis kernel or a convolution: without the model or an
   override it is refused, with the remedies in the message, most likely first: the
   attention reading for a kernel (and bias) of a module named ``query``/``key``/``value``
   or ``out`` (linen's ``nn.MultiHeadDotProductAttention``), unless a sibling bias says
   stacked layers.  A PyTorch-named ``weight`` follows ``sage_torch``'s name rules: GPT-2's
   ``Conv1D`` names (``c_attn``, ...) are refused, ``wpe``/``shared``/
   ``relative_attention_bias`` are tables.  ``model=`` reads NNX and Equinox modules and
   :func:`sage_optax.linen_model`; a bare linen module (bound or not) is refused with a
   ``TypeError`` naming ``linen_model``.

A **head** (an untied output projection: kind ``embedding``, vocab axis as fan-out) is a
dense matrix with the shape of *the* token embedding, ``(d, V)`` (``(V, d)`` in the torch
layout), where *the* token embedding is the only table, or the one named like a token
embedding (``wte``, ``tok_embeddings``, ``embed_tokens``...), and ``V`` may also be given as
``vocab_size=``.  Exactly one matrix must fit; among several, a head name (``lm_head``,
``head``, ``output``...) decides, else the router refuses.  A name alone never makes a head
(a ViT ``head`` classifier is dense), and neither does one dimension equal to some table's
length; a matrix inside numbered layers (``layers.0.up.kernel``) is never the head by
shape: it is refused with ``dense`` first; a PyTorch-named ``weight`` (a converted state
dict) needs a head name as well.  This policy is :func:`sage_optim.routing.find_head`,
shared with ``sage_torch``: this module only gathers the tables and matrices it is given.

:func:`route_params` returns the labels (``optax.partition`` labels), the
:class:`~sage_optim.routing.Route` every transform takes, and each leaf's
:class:`~sage_optim.routing.ResolvedRoute` (the evidence shown by ``routing_table``).
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sage_optax import axes as axes_lib
from sage_optax import logical, module_layouts
from sage_optim import routing as core
from sage_optim.routing import ResolvedRoute, Route, RoutingError

PARAM_LAYOUTS: tuple[str, ...] = ("flax", "torch")
"""Declared layouts of a params pytree: Flax ``(in, out)`` kernels or PyTorch ``(out, in)``."""

__all__ = [
    "PARAM_LAYOUTS",
    "NoLayoutEvidenceWarning",
    "ParamRouting",
    "ResolvedRoute",
    "Route",
    "RoutingError",
    "iter_leaves",
    "leaf_name_path",
    "equinox_routes",
    "module_routes",
    "route_params",
]


class ParamRouting(NamedTuple):
    """What :func:`route_params` returns: pytrees with the structure of the params.

    Attributes:
      labels: ``"embedding"``, ``"dense"`` or ``"vector"`` per leaf (usable directly as
        ``optax.partition`` labels).
      axes: a :class:`~sage_optim.routing.Route` per leaf: the router's decision before it
        is checked against the shape (with the negative axes it gives), what every
        transform of this package takes as ``axes``.
      routes: a :class:`~sage_optim.routing.ResolvedRoute` per leaf: kind, axis groups,
        and the evidence that placed it.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
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

    norms = _norm_types()
    out: dict[str, Any] = {}
    ev = f"module nnx.{type(module).__name__}"
    for attr, p in params.items():
        full = f"{name}.{attr}" if name else attr
        shape = tuple(p.shape)
        if attr == "bias" or (isinstance(module, norms) and attr == "scale"):
            stacked = max(len(shape) - _expected_bias_ndim(module), 0)
            if isinstance(module, nnx.LinearGeneral):
                stacked += len(module.batch_axis)  # (*batch, *out): one bias per batch entry
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
                out[full] = module_layouts.einsum_route(module.einsum_str, len(shape), full)
            except RoutingError as e:
                out[full] = e
        elif isinstance(module, nnx.ConvTranspose):
            taps = len(shape) - 2
            conv = Route("dense", (-2, *range(-2 - taps, -2)), -1)
            out[full] = module_layouts.conv_transpose_refusal(
                full, shape, conv, "an nnx.ConvTranspose kernel (*taps, Cin, Cout)",
                "input channels and taps are its fan-in, as for nnx.Conv")
        elif isinstance(module, nnx.Conv):
            size = module.kernel_size
            taps = len(size) if isinstance(size, tuple | list) else 1
            # (*taps, Cin, Cout): fan-in is the input channels then the taps (the order of a
            # PyTorch Conv weight (Cout, Cin, *taps)), fan-out the output channels.
            fan_in = (-2, *range(-2 - taps, -2))
            out[full] = Route("dense", fan_in, -1, evidence=ev + " (*taps, Cin, Cout)")
    return out


def _module_evidence_of_nnx(model: Any) -> dict[str, Route | RoutingError]:
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


def is_equinox_module(x: Any) -> bool:
    """Whether ``x`` is an Equinox module (False unless ``equinox`` is imported)."""
    eqx = sys.modules.get("equinox")  # a tree cannot hold one unless equinox is imported
    return eqx is not None and isinstance(x, eqx.Module)


def _holds_equinox(tree: Any) -> bool:
    if is_equinox_module(tree):
        return True
    return any(is_equinox_module(x) for x in jax.tree.leaves(
        tree, is_leaf=is_equinox_module))


class _EqxTypes(NamedTuple):
    """The ``eqx.nn`` module types whose parameters :func:`equinox_routes` reads."""

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


def equinox_routes(tree: Any) -> dict[str, Route | RoutingError]:
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
        from sage_optax import linen_evidence

        inner = route if route.kind != "vector" else Route(
            "vector", batch=(), evidence=route.evidence)
        placed = linen_evidence.stacked_route(full, inner, mine, shape, "eqx.filter_vmap")
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


def module_routes(model: Any) -> dict[str, Route | RoutingError]:
    """Per-parameter routes read from the modules of ``model``, keyed by dotted path.

    ``model`` is a flax NNX module, an Equinox model (:func:`equinox_routes`) or a linen
    module with a sample input (:func:`sage_optax.linen_model`,
    :func:`sage_optax.linen_evidence.linen_routes`).  For NNX,
    only parameters owned by a module of known layout appear (``nnx.Embed``,
    ``nnx.Linear``, ``nnx.LinearGeneral``, ``nnx.Einsum``, ``nnx.Conv``, the norm layers; a
    ``nnx.ConvTranspose`` kernel maps to the error it raises if used); every other
    parameter is left to the name rules.  The axes ``nnx.vmap``/``nnx.scan`` insert are
    batch axes, wherever they stand (``nnx.StateAxes({nnx.Param: 1})``): each module's own
    shape (``in_features``, ``out_features``...) says which axes are its.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """
    if is_equinox_module(model):
        return equinox_routes(model)
    from sage_optax import linen_evidence

    if isinstance(model, linen_evidence.LinenModel):
        return linen_evidence.linen_routes(model)
    if not is_nnx_module(model):
        linen = sys.modules.get("flax.linen")
        if linen is not None and isinstance(model, linen.Module):
            raise TypeError(
                "model= got a flax linen module, whose submodules exist only while it runs "
                "(bound or not); pass it with a sample input, "
                "model=sage_optax.linen_model(module, *inputs) (jax.ShapeDtypeStruct inputs "
                "will do), so that its module types decide, or give the multi-axis leaves "
                "their axes in route_overrides")
        raise TypeError(
            f"model= takes a flax NNX module, an Equinox model or "
            f"sage_optax.linen_model(module, *inputs), got a {type(model).__name__}")
    return _module_evidence_of_nnx(model)


# ------------------------------------------------------------------------------ name rules

FLAX_NAMES: dict[str, str] = {"kernel": "Flax", "w": "Haiku"}
"""Leaf names of ``(in, out)`` matrices (``x @ W``): Flax's ``kernel``, Haiku's ``w``."""

TABLE_NAMES: dict[str, str] = {"embedding": "Flax Embed", "embeddings": "Haiku Embed"}
"""Leaf names of ``(V, d)`` tables: Flax's ``nnx.Embed.embedding``, Haiku's ``embeddings``."""

TORCH_NAMES: tuple[str, ...] = ("weight",)
"""Leaf names of PyTorch-layout matrices ``(out, in)`` (Equinox, converted state dicts)."""

NO_EVIDENCE = "no layout evidence"
"""The evidence of a leaf that says nothing about its layout (element-wise fallback)."""



@dataclasses.dataclass(frozen=True)
class _TreeFacts:
    """What the whole tree says about its conventions (for the name rules)."""

    layout: str | None  # the declared layout, or None (the names decide)
    flax: bool  # a Flax/Haiku tree: a model was given, or leaves named kernel/w/embedding
    torch: bool  # a PyTorch-convention tree: leaves named weight, and not a Flax tree
    have_model: bool  # module evidence was given (model= / an nnx.Module / Equinox)
    vocab_size: int | None
    nnx_tree: bool = False  # an nnx.State: model= would read its modules
    shapes: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    conv1d: str | None = None  # what the GPT-2 Conv1D names' shapes say (core.conv1d_reading)
    torch_vocab: int | None = None  # rows of the token table that PyTorch's names say


def _tree_facts(names: list[str], layout: str | None, have_model: bool,
                vocab_size: int | None, nnx_tree: bool,
                shapes: Mapping[str, tuple[int, ...]] | None = None) -> _TreeFacts:
    leaves = {core.components(n)[-1] for n in names}
    flax = nnx_tree or bool(leaves & (set(FLAX_NAMES) | set(TABLE_NAMES)))
    torch = not flax and bool(leaves & set(TORCH_NAMES))
    shapes = dict(shapes or {})
    conv1d = token = None
    if torch:  # the token table, against whose width the Conv1D names' shapes are read
        token = core.pick_token_table([
            core.TableFact(n, s[0], s[1]) for n, s in shapes.items()
            if len(s) == 2 and core.torch_name_reading(n) == "table"])
        conv1d = core.conv1d_reading(
            [(n, s) for n, s in shapes.items() if len(s) == 2 and core.names_conv1d(n)],
            token.width if token is not None else None)
    return _TreeFacts(layout, flax, torch, have_model, vocab_size, nnx_tree, shapes, conv1d,
                      token.rows if token is not None else None)


ATTENTION_IN: frozenset[str] = frozenset({"query", "key", "value"})
"""Module names of attention's input projections (linen ``nn.MultiHeadDotProductAttention``,
``nnx.MultiHeadAttention``): a ``DenseGeneral`` kernel ``(in, heads, head_dim)``."""

ATTENTION_OUT: frozenset[str] = frozenset({"out", "attn_out_proj", "out_proj", "o_proj"})
"""Module names of attention's output projection: a kernel ``(heads, head_dim, out)``
(linen's ``out``, nanodo's ``attn_out_proj``, the common ``out_proj``/``o_proj``)."""


def _sibling(name: str, leaf: str, facts: _TreeFacts) -> tuple[int, ...] | None:
    """The shape of the leaf ``leaf`` of the same module as ``name``, if the tree has it."""
    module = name.rpartition(".")[0]
    return facts.shapes.get(f"{module}.{leaf}" if module else leaf)


def _attention_reading(name: str, shape: tuple[int, ...], facts: _TreeFacts) -> Route | None:
    """The attention reading of a multi-axis ``kernel``/``bias`` that its module name says.

    A ``kernel`` of a ``query``/``key``/``value`` module is ``(..., in, heads, head_dim)``
    (fan-in ``-3``, fan-out ``(-2, -1)``, as ``nnx.LinearGeneral`` reads it), one of an
    ``out`` module ``(..., heads, head_dim, out)``; the ``bias`` of ``query``/``key``/
    ``value`` is one ``(heads, head_dim)`` vector per leading index.  ``None`` when the name
    says no such module, or a sibling says otherwise: a 3-D kernel whose bias is ``(L, F)``
    = its first and last axes is stacked ``Dense`` layers, not attention.  This orders the
    remedies of a refusal; it never places a leaf.
    """
    parts = core.components(name)
    if len(parts) < 2 or parts[-2] not in ATTENTION_IN | ATTENTION_OUT:
        return None
    leaf, ndim = parts[-1], len(shape)
    if leaf == "kernel" and ndim >= 3:
        bias = _sibling(name, "bias", facts)
        own = shape[-2:] if parts[-2] in ATTENTION_IN else shape[-1:]
        if ndim == 3 and bias is not None and bias == (shape[0], shape[-1]) and bias != own:
            return None
        if parts[-2] in ATTENTION_IN:
            return Route("dense", fan_in=-3, fan_out=(-2, -1))
        return Route("dense", fan_in=(-3, -2), fan_out=-1)
    if leaf == "bias" and ndim >= 2 and parts[-2] in ATTENTION_IN:
        kernel = _sibling(name, "kernel", facts)
        if kernel is not None and len(kernel) == ndim + 1 and kernel[-2:] == shape[-2:]:
            return Route("vector", batch=tuple(range(ndim - 2)))
    return None


def _unnamed(name: str) -> bool:
    """Whether a path has no name at all: only positions in lists and tuples (or the root)."""
    return name == "<root>" or all(part.isdigit() for part in name.split("."))


def _refusal(name: str, shape: tuple[int, ...], message: str,
             options: list[tuple[Any, str]]) -> RoutingError:
    return RoutingError(message, leaf=name, shape=shape, options=options)


def _matrix_options(shape: tuple[int, ...], first: str) -> list[tuple[Any, str]]:
    """Remedies for a matrix of unknown layout; ``first`` is ``"in_out"`` or ``"out_in"``."""
    ndim = len(shape)
    in_out = (Route("dense", -2, -1), "it is used as x @ W, W (in, out)")
    out_in = (Route("dense", -1, -2), "it is used as F.linear(x, W), W (out, in)")
    if ndim > 2:
        in_out = (in_out[0], "it is a stack of (in, out) matrices over the leading axes")
        out_in = (out_in[0], "it is a stack of (out, in) matrices over the leading axes")
    options: list[tuple[Any, str]] = [in_out, out_in] if first == "in_out" else [out_in, in_out]
    if ndim == 2:
        options.append((Route("embedding", -1, -2), "it is a table of rows (V, d)"))
    else:
        rest = tuple(range(1, ndim))
        options.append((Route("dense", 0, rest),
                        f"it is one matrix, axis 0 its input, axes {rest} merged as its output "
                        "(an (in, heads, head_dim) projection)"))
        options.append((Route("dense", rest, 0),
                        f"it is one matrix, axis 0 its output, axes {rest} merged as its input "
                        "(a PyTorch conv (out, in, *taps), a (d, heads, head_dim) output)"))
    options.append(("vector", "element-wise rules are wanted"))
    return options


def _table_options(shape: tuple[int, ...], vocab_size: int | None) -> list[tuple[Any, str]]:
    rows = (Route("embedding", -1, -2), f"it is a table of {shape[-2]} rows (V, d)")
    cols = (Route("embedding", -2, -1), f"it is a (d, V) matrix of {shape[-1]} columns")
    options = [cols, rows] if vocab_size is not None and shape[-1] == vocab_size else [rows, cols]
    return [*options, ("vector", "element-wise rules are wanted")]


def _name_route(name: str, shape: tuple[int, ...], facts: _TreeFacts) -> Route | RoutingError:
    """The route that names and shapes alone give (rules of the module docstring)."""
    ndim = len(shape)
    parts = core.components(name)
    leaf = parts[-1]
    if ndim < 2:
        return Route("vector", evidence=f"shape: {ndim}-D")
    if sum(n > 1 for n in shape) <= 1:
        return Route("vector", evidence="shape: one non-unit axis")
    remedy = _remedy(facts)
    attention = _attention_reading(name, shape, facts)
    if leaf in core.VECTOR_NAMES or leaf == "offset":
        return _vector_name_refusal(name, shape, leaf, remedy, attention)
    if _unnamed(name) and ndim > 2:
        return Route("vector", evidence=NO_EVIDENCE)  # the caller warns (or refuses: strict)
    if facts.layout is None:
        route = _default_layout_route(name, shape, facts, remedy, attention)
    elif facts.layout == "flax":
        route = _flax_layout_route(name, shape, remedy, attention)
    else:
        route = _torch_layout_route(name, shape, remedy)
    if route is not None:
        return route
    if ndim == 2 and (leaf in core.TOKEN_EMBEDDING_MARKERS or leaf in ("embed", "embedding")):
        return Route("embedding", -1, -2, evidence=f"name {leaf!r} (token table (V, d))")
    if any("emb" in part for part in parts):
        return _embedding_name_route(name, shape, facts)
    return _shape_route(name, shape, facts)


def _remedy(facts: _TreeFacts) -> str:
    """The first remedy of a name-rule refusal: the module evidence this tree could get."""
    if facts.have_model:
        return ("The model's modules do not settle it (a module type this router does not "
                "read, e.g. a linen module inside nnx.bridge.ToNNX); give it")
    if facts.nnx_tree:
        return ("Pass the model (make_optimizer(..., model=model), route_params(model)) so "
                "that its module types decide, or give it")
    if facts.flax:  # a linen (or Haiku) tree: the linen module and an input decide
        return ("A plain params tree has no module evidence: for a linen model pass "
                "model=sage_optax.linen_model(module, *inputs) so that its module types "
                "decide, or give it")
    return "A plain params tree has no module evidence: give it"  # a state dict: no model


def _vector_name_refusal(name: str, shape: tuple[int, ...], leaf: str, remedy: str,
                         attention: Route | None) -> RoutingError:
    """The refusal of a vector name (``bias``, ``scale``...) on a leaf of two or more axes.

    Stacked layers' vectors or one multi-axis vector; the attention bias first where the
    module's name and its kernel's shape say one (:func:`_attention_reading`).
    """
    ndim = len(shape)
    stacked = Route("vector", batch=tuple(range(ndim - 1)))
    if attention is not None:
        per_head = "one (heads, head_dim) attention bias" + (
            " per leading index" if ndim > 2 else "")
        return _refusal(
            name, shape,
            f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with {ndim} "
            "axes may be stacked layers' vectors (L, d) or, as its module's name and its "
            f"kernel's shape say, {per_head}. {remedy}: "
            + core.override_advice(name, attention) + " for the attention bias, "
            + core.override_advice(name, stacked) + " for stacked layers",
            [(attention, f"it is {per_head} (DenseGeneral, nn.MultiHeadDotProductAttention)"),
             (stacked, "it is stacked layers' vectors (L, ..., d)")],
        )
    return _refusal(
        name, shape,
        f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with {ndim} axes "
        "may be stacked layers' vectors (L, d) or one multi-axis vector (heads, head_dim). "
        f"{remedy}: " + core.override_advice(name, stacked) + " for stacked layers, "
        + core.override_advice(name, Route("vector")) + " for one vector",
        [(stacked, "it is stacked layers' vectors (L, ..., d)"),
         ("vector", "it is one multi-axis vector")],
    )


def _default_layout_route(name: str, shape: tuple[int, ...], facts: _TreeFacts, remedy: str,
                          attention: Route | None) -> Route | RoutingError | None:
    """What a conventional leaf name says when no layout is declared (each name its own).

    A 2-D ``embedding``/``embeddings`` is a ``(V, d)`` table, a 2-D ``kernel``/``w`` an
    ``(in, out)`` matrix, a 2-D ``weight`` what PyTorch's names say
    (:func:`_torch_weight_route`); any of them with more axes is refused.  ``None`` for
    other names.
    """
    leaf, ndim = core.components(name)[-1], len(shape)
    if leaf in TABLE_NAMES and ndim == 2:
        return Route("embedding", -1, -2, evidence=f"name {leaf!r} ({TABLE_NAMES[leaf]} "
                     "(V, d))")
    if leaf in FLAX_NAMES and ndim == 2 and not core.names_table(name):
        return Route("dense", -2, -1, evidence=f"name {leaf!r} ({FLAX_NAMES[leaf]} (in, out))")
    if leaf in TORCH_NAMES and ndim == 2:
        return _torch_weight_route(name, shape, facts, remedy)
    if leaf in (*FLAX_NAMES, *TABLE_NAMES, *TORCH_NAMES) and ndim > 2:
        return _convention_refusal(name, shape, leaf, remedy, attention)
    return None


def _torch_weight_route(name: str, shape: tuple[int, ...], facts: _TreeFacts,
                        remedy: str) -> Route | RoutingError:
    """A 2-D ``weight`` with no declared layout: PyTorch's ``(out, in)``, as its name says.

    Refused in a Flax/Haiku tree (whose matrices are ``(in, out)``), for GPT-2's ``Conv1D``
    names and for the names :data:`sage_optim.routing.TORCH_WEIGHT_WHY` lists; a table name
    makes a ``(V, d)`` table.
    """
    reading = core.torch_name_reading(name)
    if facts.flax:
        return _refusal(
            name, shape,
            f"cannot tell the layout of {name!r} of shape {shape}: 'weight' is PyTorch's "
            "name for an (out, in) matrix, but this is a Flax/Haiku tree, whose "
            f"matrices are (in, out). {remedy}: "
            + core.override_advice(name, Route("dense", -2, -1))
            + " if the module computes x @ weight, or "
            + core.override_advice(name, Route("dense", -1, -2))
            + " for weight @ x",
            [(Route("dense", -2, -1), "the module computes x @ weight (in, out)"),
             (Route("dense", -1, -2), "the module computes weight @ x (out, in)"),
             (Route("embedding", -1, -2), "it is a table (V, d)"),
             ("vector", "element-wise rules are wanted")],
        )
    if reading == "table":
        return Route("embedding", -1, -2,
                     evidence="name (PyTorch/Equinox table (V, d))")
    if reading == "conv1d":  # GPT-2's Conv1D (in, out) or nanoGPT's Linear
        return core.conv1d_refusal(
            name, shape, facts.conv1d,
            "Route the model in PyTorch with sage_torch (its modules decide), or "
            "give it in route_overrides")
    if reading in core.TORCH_WEIGHT_WHY:
        options = core.torch_weight_options(shape, None, facts.torch_vocab)
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: "
            f"{core.TORCH_WEIGHT_WHY[reading]}; give it: "
            + "; ".join(f"{core.override_advice(name, r)} if {w}"
                        for r, w in options),
            options,
        )
    return Route("dense", -1, -2, evidence="name 'weight' (PyTorch/Equinox (out, in))")


def _flax_layout_route(name: str, shape: tuple[int, ...], remedy: str,
                       attention: Route | None) -> Route | RoutingError | None:
    """What a conventional leaf name says under ``layout="flax"``: matrices ``(in, out)``.

    A 2-D ``embedding``/``embeddings`` is a table, a 2-D ``kernel``/``w``/``weight`` an
    ``(in, out)`` matrix; any of them with other axes is refused.  ``None`` for other names.
    """
    leaf, ndim = core.components(name)[-1], len(shape)
    if leaf in ("embedding", "embeddings") and ndim == 2:
        return Route("embedding", -1, -2, evidence="name 'embedding' (Flax Embed (V, d))")
    if leaf in ("kernel", "w", "weight") and ndim == 2:
        return Route("dense", -2, -1, evidence=f"name {leaf!r}, layout flax (in, out)")
    if leaf in ("kernel", "w", "weight", "embedding", "embeddings"):
        return _convention_refusal(name, shape, "kernel", remedy, attention)
    return None


def _torch_layout_route(name: str, shape: tuple[int, ...],
                        remedy: str) -> Route | RoutingError | None:
    """What a ``weight`` says under ``layout="torch"``: ``(out, in)``, or a table by its name.

    A 2-D ``weight`` named like a table is ``(V, d)``, any other 2-D one ``(out, in)``; one
    with more axes is refused.  ``None`` for other names.
    """
    leaf, ndim = core.components(name)[-1], len(shape)
    if leaf != "weight":
        return None
    if ndim == 2 and (core.names_token_embedding(name) or core.names_table(name)
                      or core.names_table_module(name)):
        return Route("embedding", -1, -2, evidence="name (token table (V, d))")
    if ndim == 2:
        return Route("dense", -1, -2, evidence="name 'weight' (torch (out, in))")
    return _convention_refusal(name, shape, "weight", remedy)


def _embedding_name_route(name: str, shape: tuple[int, ...],
                          facts: _TreeFacts) -> Route | RoutingError:
    """A leaf whose path names an embedding: ``vocab_size`` on one axis makes it a table.

    Refused, with the table readings (2-D) or the matrix ones first, where ``vocab_size``
    is unknown or matches neither or both of the last two axes.
    """
    ndim = len(shape)
    hits = [a for a in (-2, -1) if shape[a] == facts.vocab_size]
    if len(hits) == 1:
        return Route("embedding", -3 - hits[0], hits[0],
                     evidence=f"name + vocab_size={facts.vocab_size} on axis "
                              f"{ndim + hits[0]}")
    if facts.vocab_size is None:  # vocab_size= places a token table only: advised last
        token = ("; if it is the token table (its rows the vocabulary), vocab_size=V places "
                 "it too")
    else:
        token = (f"; vocab_size={facts.vocab_size} matches "
                 + ("both axes" if len(hits) == 2 else "neither axis")
                 + " (it places the token table, not a table of positions or types)")
    return _refusal(
        name, shape,
        f"cannot place {name!r} of shape {shape}: its name says an embedding but not "
        "which axis indexes the table; give it, e.g. "
        + core.override_advice(name, Route("embedding", -1, -2))
        + f" for a table of rows (rows, d), or 'vector' for element-wise rules{token}",
        _table_options(shape, facts.vocab_size) if ndim == 2
        else _matrix_options(shape, "in_out"),
    )


def _shape_route(name: str, shape: tuple[int, ...], facts: _TreeFacts) -> Route | RoutingError:
    """A matrix whose name says nothing: the declared layout, else the tree's convention.

    More than two axes are refused (stacked layers, a multi-axis kernel or a convolution),
    with the tree's convention first; a 2-D matrix follows ``layout=``, is refused in a
    PyTorch-named tree, and is JAX's ``x @ W`` ``(in, out)`` otherwise.
    """
    ndim, layout = len(shape), facts.layout
    torch_like = layout == "torch" or (layout is None and facts.torch)
    if ndim > 2:
        first = "out_in" if torch_like else "in_out"
        return _refusal(
            name, shape,
            f"cannot tell the layout of {name!r} of shape {shape}: a matrix with {ndim} axes "
            "may be stacked layers, a multi-axis kernel or a convolution; give its axes, e.g. "
            + core.override_advice(name, _matrix_options(shape, first)[0][0])
            + " for stacked layers, or Route('dense', fan_in=(...), fan_out=(...)) for one "
            "matrix with merged axes",
            _matrix_options(shape, first),
        )
    if layout == "torch":
        return Route("dense", -1, -2, evidence="layout torch: (out, in)")
    if layout == "flax":
        return Route("dense", -2, -1, evidence="layout flax: (in, out)")
    if facts.torch:
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: this tree follows PyTorch's names "
            "('weight' (out, in)), and this matrix's name says nothing of its layout; give it",
            _matrix_options(shape, "out_in"),
        )
    return Route("dense", -2, -1, evidence="JAX convention x @ W (in, out)")


def _convention_refusal(name: str, shape: tuple[int, ...], leaf: str,
                        remedy: str, attention: Route | None = None) -> RoutingError:
    """A conventional matrix name (kernel, w, weight, embedding) with more than two axes.

    ``attention``: the attention reading that the module's name says
    (:func:`_attention_reading`), offered first.
    """
    ndim = len(shape)
    if leaf == "weight":  # PyTorch/Equinox: (out, in, *taps) convolutions, or stacks
        conv = Route("dense", tuple(range(1, ndim)), 0)
        stack = Route("dense", -1, -2)
        options: list[tuple[Any, str]] = [
            (stack, "it is a stack of (out, in) matrices over the leading axes"),
            (conv, "it is a convolution (out, in, *taps)")]
        if ndim >= 4:
            options.reverse()
        options += [(Route("dense", -2, -1), "it is a stack of (in, out) matrices"),
                    ("vector", "element-wise rules are wanted")]
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: a PyTorch-layout 'weight' with {ndim} "
            f"dims may be a convolution (out, in, *taps) or stacked layers. {remedy}: "
            + core.override_advice(name, conv) + " for a convolution, "
            + core.override_advice(name, stack) + " for stacked layers",
            options,
        )
    stack = Route("dense", -2, -1)
    conv = Route("dense", (-2, *range(-ndim, -2)), -1)
    flax_options: list[tuple[Any, str]] = [
        (stack, "it is stacked layers (L, ..., in, out) (nnx.vmap, nnx.scan)")]
    if ndim == 3:
        flax_options += [
            (Route("dense", 0, (1, 2)), "it is one (in, heads, head_dim) kernel"),
            (Route("dense", (0, 1), 2), "it is one (heads, head_dim, out) kernel")]
    flax_options += [(conv, "it is a convolution (*taps, Cin, Cout)"),
                     ("vector", "element-wise rules are wanted")]
    said = ""
    if attention is not None:  # the module's name says which: that reading first
        same = [o for o in flax_options if isinstance(o[0], Route)
                and o[0].resolve(shape, name) == attention.resolve(shape, name)]
        flax_options = [o for o in flax_options if o not in same]
        what = ("an attention input projection (in, heads, head_dim)"
                if attention.fan_in == (-3,) else
                "an attention output projection (heads, head_dim, out)")
        first = same[0][0] if same else attention
        flax_options.insert(0, (first, f"it is {what}, as its module's name says "
                                       "(DenseGeneral, nn.MultiHeadDotProductAttention)"
                                + (" per leading index" if ndim > 3 else "")))
        said = (f" Its module's name says {what}: "
                + core.override_advice(name, first) + ".")
    return _refusal(
        name, shape,
        f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with "
        f"{ndim} axes may be stacked layers (L, ..., in, out), a multi-axis kernel "
        "(nnx.LinearGeneral, nnx.MultiHeadAttention, nnx.Einsum) or a convolution "
        f"(*taps, Cin, Cout).{said} {remedy}: "
        + core.override_advice(name, stack) + " for stacked layers, "
        + core.override_advice(name, conv) + " for a convolution",
        flax_options,
    )


# ------------------------------------------------------------------------------- the router


@dataclasses.dataclass
class _Leaf:
    name: str
    shape: tuple[int, ...]
    route: Route | RoutingError


def _override_refusal(e: core.Evidence, override: Route) -> RoutingError:
    """An override that gives a kind but no axes, for a leaf whose axes nothing gives."""
    options = [(Route(override.kind, r.fan_in, r.fan_out, r.batch), when)
               for r, when in _matrix_options(e.shape, "in_out")
               if isinstance(r, Route) and r.kind != "vector"]
    return _refusal(
        e.name, e.shape,
        f"override makes {e.name!r} of shape {e.shape} {override.kind!r}, but its axes are not "
        f"known; give them: {core.override_advice(e.name)}",
        options,
    )


class NoLayoutEvidenceWarning(UserWarning):
    """Leaves with no layout evidence got the configuration's element-wise rule.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """


def _fallback(leaves: list[_Leaf], strict: bool, warn: bool) -> None:
    """Warn about (or, ``strict``, refuse) the leaves that got the element-wise fallback."""
    plain = [x for x in leaves if isinstance(x.route, Route) and x.route.evidence == NO_EVIDENCE]
    if not plain:
        return
    if strict:
        for x in plain:
            x.route = _refusal(
                x.name, x.shape,
                f"cannot place {x.name!r} of shape {x.shape}: it has no name (only a position in "
                "a list or tuple), no module and no override, so nothing says which axes are "
                "its fan-in and fan-out (strict=True refuses the element-wise fallback)",
                _matrix_options(x.shape, "in_out"),
            )
        return
    if warn:
        listed = ", ".join(f"{x.name!r} {x.shape}" for x in plain)
        block = core.paste_block(
            [_refusal(x.name, x.shape, "", _matrix_options(x.shape, "in_out")) for x in plain])
        warnings.warn(
            f"{len(plain)} parameter(s) with no layout evidence (no name, only a position in a "
            f"list or tuple; no module; no override) get the configuration's element-wise "
            f"('vector') rule: {listed}. For a matrix rule give their axes (strict=True "
            "refuses instead).\n" + block,
            NoLayoutEvidenceWarning,
            stacklevel=4,
        )


def route_params(
    params: Any,
    overrides: Mapping[str, Any] | None = None,
    *,
    vocab_size: int | None = None,
    layout: str | None = None,
    model: Any | None = None,
    module_evidence: Mapping[str, Route | RoutingError] | None = None,
    strict: bool = False,
    warn: bool = True,
    axis_names: Any | None = None,
    axis_roles: Mapping[str, Any] | None = None,
) -> ParamRouting:
    """Give every parameter leaf its kind and axes, from the strongest evidence.

    Args:
      params: a pytree of arrays (or ``jax.ShapeDtypeStruct``), e.g. ``nnx.state(model,
        nnx.Param)``, linen ``variables["params"]``, a Haiku params dict, an Equinox model
        (``eqx.filter(model, eqx.is_inexact_array)``) or a converted PyTorch state dict; or
        an ``nnx.Module`` (its ``nnx.Param`` state is routed, with the module evidence).
        ``optax.MaskedNode`` and ``None`` leaves are kept as they are.
      overrides: ``{glob: kind}``, ``{glob: Route(kind, fan_in=..., fan_out=...)}`` or
        ``{glob: (kind, {"fan_in": ..., "fan_out": ...})}``, matched against dotted paths
        (``"layers.*.mlp.down_proj.kernel"``); first match wins; a glob that matches nothing
        is an error.
      vocab_size: the vocabulary size, for heads when the tree has no token table, and
        for the vocab axis of a matrix an override calls ``embedding``.
      layout: ``None`` (default: each leaf's name says its convention: Flax's ``kernel``
        and Haiku's ``w`` are ``(in, out)``, ``embedding``/``embeddings`` ``(V, d)`` tables,
        PyTorch's and Equinox's ``weight`` ``(out, in)``), or ``"flax"``/``"torch"`` to
        declare every matrix of the tree ``(in, out)``/``(out, in)``.
      model: the ``nnx.Module`` or Equinox model the params come from: its module types
        are evidence.
      module_evidence: precomputed :func:`module_routes` (what ``make_optimizer`` passes).
      strict: refuse leaves with no layout evidence (no name, no module, no override)
        instead of giving them the element-wise rule with a warning.
      warn: emit the :class:`NoLayoutEvidenceWarning` of such leaves.
      axis_names: the logical axis names of leaves whose params come unboxed: a tree with
        the params' paths holding ``nn.Partitioned`` or ``nnx.Variable`` boxes,
        ``nn.get_partition_spec(variables)``'s ``PartitionSpec`` s or tuples of names, or
        ``{dotted path: names}``.  Boxes in ``params`` and the ``nnx.Param`` metadata of
        ``model`` are read without it (:mod:`sage_optax.logical`).
      axis_roles: ``{axis name: role}`` laid over :data:`sage_optax.logical.AXIS_ROLES`
        (roles: :data:`sage_optax.logical.ROLES`, or ``None`` for a name that says
        nothing), e.g. ``{"my_in": "fan_in", "my_experts": "batch"}``.

    Names, where they place a leaf, win over its leaf name and lose to ``overrides``; where
    a module also gives the leaf's axes, the two must agree or the leaf is refused.

    Returns:
      A :class:`ParamRouting` of ``labels``, ``axes`` and ``routes`` pytrees.

    Raises:
      RoutingError: one error for every leaf it cannot place (non-float dtype, unknown
        layout, ambiguous head, an override that does not apply), naming each path and
        shape, and ending with a ``route_overrides = {...}`` block to paste and check.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """
    if layout == "auto":
        layout = None
    if layout is not None and layout not in PARAM_LAYOUTS:
        raise ValueError(f"layout must be one of {PARAM_LAYOUTS} or None, got {layout!r}")
    roles = logical.check_axis_roles(axis_roles)
    nnx_tree = False
    if is_nnx_module(params):
        from flax import nnx

        model, params = params, nnx.state(params, nnx.Param)
    evidence = dict(module_evidence or {})
    if model is not None:
        evidence.update(module_routes(model))
    if _holds_equinox(params):
        evidence.update(equinox_routes(params))
    names = logical.names_of(model) if model is not None and is_nnx_module(model) else {}
    names.update(logical.names_of(params))
    given = logical.names_of(axis_names) if axis_names is not None else {}
    names.update(given)
    nnx_tree = _is_nnx_state(params) or (model is not None and is_nnx_module(model))
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    named = [(leaf_name_path(p), x) for p, x in with_path]
    logical.check_matched(given, [n for n, _ in named])
    # Globs are matched against every path, masked ones too: optax.partition routes each
    # kind's subtree with the other kinds' leaves masked.
    override_of = core.match_overrides([n for n, _ in named], overrides)
    for name, override in override_of.items():
        axes_lib.refuse_view(override, name)
    shapes = {n: tuple(int(s) for s in x.shape) for n, x in named
              if not axes_lib.is_masked(x) and hasattr(x, "shape")}
    facts = _tree_facts([n for n, _ in named], layout, bool(evidence) or model is not None,
                        vocab_size, nnx_tree, shapes)
    records: list[core.Evidence] = []
    for name, x in named:
        if axes_lib.is_masked(x):
            continue
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise RoutingError(
                f"parameter {name!r} is a {type(x).__name__}, not an array; route only the "
                "arrays to train (eqx.filter(model, eqx.is_inexact_array), "
                "nnx.state(model, nnx.Param))"
            )
        shape = tuple(int(s) for s in x.shape)
        floating = jnp.issubdtype(x.dtype, jnp.floating)
        head_candidate = True
        if not floating:
            route: Route | RoutingError = RoutingError(
                f"cannot place parameter {name!r} of shape {shape}: dtype {jnp.dtype(x.dtype)} "
                "is not floating point, so no optimizer can train it; filter it out of the "
                "params (e.g. nnx.Optimizer(..., wrt=nnx.Param), eqx.filter(model, "
                "eqx.is_inexact_array)) or mask it"
            )
        else:
            route, head_candidate = _gathered(name, shape, evidence, names, roles, facts)
        records.append(core.Evidence(
            name, shape, route, head_candidate=head_candidate, final=not floating,
            by_names=name not in evidence and core.components(name)[-1] in TORCH_NAMES))
    decided = core.decide(records, override_of, refuse_override=_override_refusal,
                          vocab_size=vocab_size)
    leaves = [_Leaf(e.name, e.shape, decided[e.name]) for e in records]
    _fallback(leaves, strict, warn)
    errors = list({id(x.route): x.route for x in leaves
                   if isinstance(x.route, RoutingError)}.values())  # a head error: once
    if errors:
        raise RoutingError.combine(errors)
    resolved: dict[str, tuple[Route, ResolvedRoute]] = {}
    for x in leaves:
        assert isinstance(x.route, Route)
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
        leaf_axes.append(route)
        routes.append(r)
    unflat = jax.tree_util.tree_unflatten
    return ParamRouting(unflat(treedef, labels), unflat(treedef, leaf_axes),
                        unflat(treedef, routes))


def _gathered(name: str, shape: tuple[int, ...], evidence: Mapping[str, Route | RoutingError],
              names: Mapping[str, logical.Names], roles: Mapping[str, str | None],
              facts: _TreeFacts) -> tuple[Route | RoutingError, bool]:
    """A floating leaf's route from its module, its axis names, then its leaf name.

    Also whether it may be the output head by shape: not when its names place every axis
    (they would have said ``vocab``).
    """
    by_names = None
    if name in names:
        by_names = logical.route_from_names(name, shape, names[name], roles,
                                            torch_order=facts.layout == "torch")
    if name in evidence and not (isinstance(evidence[name], RoutingError)
                                 and isinstance(by_names, Route)):
        route = evidence[name]
        if (isinstance(route, Route) and isinstance(by_names, Route)
                and not logical.agrees(route, by_names, shape)):
            r, n = route.resolve(shape, name), by_names.resolve(shape, name)
            return RoutingError(
                f"cannot place {name!r} of shape {shape}: its {route.evidence} gives fan-in "
                f"{r.fan_in}, fan-out {r.fan_out} but its {by_names.evidence} give fan-in "
                f"{n.fan_in}, fan-out {n.fan_out}; fix the annotation or give it, e.g. "
                + core.override_advice(name, route),
                leaf=name, shape=shape,
                options=[(dataclasses.replace(route, evidence="override"),
                          "the module's reading is right"),
                         (dataclasses.replace(by_names, evidence="override"),
                          "the axis names are right")]), True
        if isinstance(route, Route) and isinstance(by_names, Route):  # same axes: the kinds
            vocab = any(isinstance(n, str) and roles.get(n) == "vocab" for n in names[name])
            clash = logical.kind_conflict(route, by_names, name, shape, vocab)
            if clash is not None:
                return clash, True
            if route.kind != by_names.kind:  # a matrix whose fan-out the names call vocab
                return dataclasses.replace(
                    by_names, evidence=f"{route.evidence}, its output {by_names.evidence}"
                    " (a head)"), True
        return route, True
    if by_names is not None:
        placed = all(isinstance(n, str) and roles.get(n) is not None for n in names[name])
        return by_names, not placed
    route = _name_route(name, shape, facts)
    if isinstance(route, RoutingError) and name in names and route.leaf == name:
        said = ", ".join(repr(n) for n in names[name])
        route = RoutingError(
            f"{route} (its axis names ({said}) have no role in sage_optax.logical.AXIS_ROLES; "
            "axis_roles={name: role} gives them one)",
            leaf=route.leaf, shape=route.shape, options=route.options)
    return route, True


def _is_nnx_state(x: Any) -> bool:
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is optional for sage_optax
        return False
    return isinstance(x, nnx.State)
