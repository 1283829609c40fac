"""The JAX parameter router: every leaf gets a kind and its axes, from the strongest evidence.

This module gathers the evidence (``docs/routing.md``, "Evidence, strongest first" and
"Pytree conventions in JAX", states every rule): an override; the flax module that owns the
leaf (:mod:`sage_optax.nnx_evidence`, :mod:`sage_optax.linen_evidence`, or an
:class:`Adapter`); logical axis names (:mod:`sage_optax.logical`); names and shapes, only
where unambiguous.  The decision is :func:`sage_optim.decision.decide`.
"""


from __future__ import annotations

import dataclasses
import pathlib
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from sage_optax import axes as axes_lib
from sage_optax import logical, nnx_evidence
from sage_optax.nnx_evidence import is_nnx_module, is_nnx_state
from sage_optim import decision, naming
from sage_optim import routing as core
from sage_optim.routing import VECTOR_OPTION, ResolvedRoute, Route, RoutingError

PARAM_LAYOUTS: tuple[str, ...] = ("flax", "torch")
"""Declared layouts of a params pytree: Flax ``(in, out)`` kernels or PyTorch ``(out, in)``."""

__all__ = [
    "PARAM_LAYOUTS",
    "Adapter",
    "NoLayoutEvidenceWarning",
    "ParamRouting",
    "ResolvedRoute",
    "Route",
    "RoutingError",
    "iter_leaves",
    "leaf_name_path",
    "adapters",
    "model_adapter",
    "module_routes",
    "register_adapter",
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
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """

    labels: Any
    axes: Any
    routes: Any = None


def leaf_name_path(path: tuple[Any, ...]) -> str:
    """Dotted path of a leaf without the trailing ``.value`` of ``nnx.Variable`` leaves.

    References:
      `JAX, working with pytrees: key paths
      <https://docs.jax.dev/en/latest/working-with-pytrees.html>`_.
    """
    return axes_lib.path_str(path)


def iter_leaves(params: Any) -> list[tuple[str, Any]]:
    """``(dotted path, leaf)`` pairs of a params pytree, masked leaves skipped.

    References:
      `JAX, working with pytrees: key paths
      <https://docs.jax.dev/en/latest/working-with-pytrees.html>`_.
    """
    with_path, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=axes_lib.is_masked)
    return [(leaf_name_path(p), x) for p, x in with_path if not axes_lib.is_masked(x)]


# ---------------------------------------------------------------------------- the adapters


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The evidence a library's models give the router (``docs/routing.md``).

    The router knows flax's own modules (NNX, and linen through
    :func:`sage_optax.linen_model`); an adapter adds another library's models
    (``sage_optax/adapters/<library>.py``, loaded once that library is imported, or one
    registered by hand with :func:`register_adapter`).

    Attributes:
      name: the library (its import name), for the registry.
      owns: ``x -> bool``: whether ``x`` is a model (or a module) of the library.
      routes: ``tree -> {dotted path: Route | RoutingError}``: the routes the module types in
        a model, or in a tree of its parameters that still holds the modules, give.
      params: ``(model, wrt, wrt_name) -> (params, what)``: the leaves of ``model`` to train
        (``wrt`` a filter or ``None`` for the library's default; ``wrt_name`` its name for
        messages) and how they were selected, for :func:`sage_optax.routing_table`.
    """

    name: str
    owns: Callable[[Any], bool]
    routes: Callable[[Any], dict[str, Route | RoutingError]]
    params: Callable[[Any, Any, str | None], tuple[Any, str]] | None = None


_REGISTRY = core.AdapterRegistry(Adapter, __package__, pathlib.Path(__file__).with_name("adapters"))
_ADAPTERS = _REGISTRY.registered
register_adapter = _REGISTRY.register
"""Add an :class:`Adapter` to the evidence of every later routing (replaces one of its name)."""
adapters = _REGISTRY.all
"""The registered adapters, after loading ``sage_optax/adapters/<library>.py`` of every library
imported so far (each registers itself)."""


def model_adapter(x: Any) -> Adapter | None:
    """The adapter that owns the model ``x``, or ``None``."""
    return next((a for a in adapters() if a.owns(x)), None)


def module_routes(model: Any) -> dict[str, Route | RoutingError]:
    """Per-parameter routes read from the modules of ``model``, keyed by dotted path.

    ``model`` is a flax NNX module (:func:`sage_optax.nnx_evidence.nnx_routes`), a model an
    adapter owns (:func:`adapters`: Equinox's, :func:`sage_optax.adapters.equinox.routes`) or
    a linen module with a sample input (:func:`sage_optax.linen_model`,
    :func:`sage_optax.linen_evidence.linen_routes`).  Parameters no module places are left
    to the name rules.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """
    adapter = model_adapter(model)
    if adapter is not None:
        return adapter.routes(model)
    from sage_optax import linen_evidence

    if isinstance(model, linen_evidence.LinenModel):
        return linen_evidence.linen_routes(model)
    if is_nnx_module(model):
        return nnx_evidence.nnx_routes(model)
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


# ------------------------------------------------------------------------------ name rules

FLAX_NAMES: dict[str, str] = {"kernel": "Flax", "w": "Haiku"}
"""Leaf names of ``(in, out)`` matrices (``x @ W``): Flax's ``kernel``, Haiku's ``w``."""

TABLE_NAMES: dict[str, str] = {"embedding": "Flax Embed", "embeddings": "Haiku Embed"}
"""Leaf names of ``(V, d)`` tables: Flax's ``nnx.Embed.embedding``, Haiku's ``embeddings``."""

TORCH_NAMES: tuple[str, ...] = ("weight",)
"""Leaf names of PyTorch-layout matrices ``(out, in)`` (Equinox, converted state dicts)."""

NO_EVIDENCE = "no layout evidence"
"""The evidence of a leaf that says nothing about its layout (element-wise fallback)."""

_NO_MODULES: dict[str, tuple[str, str | None]] = {
    "model": ("The model's modules do not settle it (a module type this router does not "
              "read, e.g. a linen module inside nnx.bridge.ToNNX); give it", None),
    "nnx": ("Pass the model (make_optimizer(..., model=model), route_params(model)) so that "
            "its module types decide, or give it",
            "pass model=model to make_optimizer so that its module types decide"),
    "flax": ("A plain params tree has no module evidence: for a linen model pass "  # or Haiku
             "model=sage_optax.linen_model(module, *inputs) so that its module types "
             "decide, or give it",
             "pass model=sage_optax.linen_model(module, *inputs) to make_optimizer"),
    "plain": ("A plain params tree has no module evidence: give it", None),  # a state dict
}
"""By the module evidence a tree could get: a name-rule refusal's first remedy, and the fix
of the combined refusal's first line (``None``: the paste block)."""


@dataclasses.dataclass(frozen=True)
class _TreeFacts:
    """What the whole tree says about its conventions (for the name rules)."""

    layout: str | None  # the declared layout, or None (the names decide)
    flax: bool  # a Flax/Haiku tree: a model was given, or leaves named kernel/w/embedding
    torch: bool  # a PyTorch-convention tree: leaves named weight, and not a Flax tree
    source: str  # the module evidence it could get: a key of _NO_MODULES
    vocab_size: int | None
    shapes: Mapping[str, tuple[int, ...]]
    conventions: Mapping[str, str | None]
    torch_vocab: int | None  # rows of the token table that PyTorch's names say

    @property
    def remedy(self) -> str:
        """The first remedy of a name-rule refusal."""
        return _NO_MODULES[self.source][0]


def _tree_facts(layout: str | None, have_model: bool, vocab_size: int | None, nnx_tree: bool,
                shapes: Mapping[str, tuple[int, ...]], names: list[str]) -> _TreeFacts:
    leaves = {naming.components(n)[-1] for n in names}
    flax = nnx_tree or bool(leaves & (set(FLAX_NAMES) | set(TABLE_NAMES)))
    torch = not flax and bool(leaves & set(TORCH_NAMES))
    # the token table, against whose width the Conv1D names' shapes are read
    token, conventions = decision.torch_name_facts(list(shapes.items())) if torch else (None, {})
    source = ("model" if have_model else "nnx" if nnx_tree else "flax" if flax else "plain")
    return _TreeFacts(layout, flax, torch, source, vocab_size, shapes, conventions,
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
    """The attention reading its module name says (orders a refusal's remedies)."""
    parts = naming.components(name)
    if len(parts) < 2 or parts[-2] not in ATTENTION_IN | ATTENTION_OUT:
        return None
    leaf, ndim, into = parts[-1], len(shape), parts[-2] in ATTENTION_IN
    if leaf == "kernel" and ndim >= 3:
        bias = _sibling(name, "bias", facts)
        own = shape[-2:] if into else shape[-1:]
        if ndim == 3 and bias is not None and bias == (shape[0], shape[-1]) and bias != own:
            return None  # a bias (L, F): stacked Dense layers, not attention
        return Route("dense", fan_in=-3, fan_out=(-2, -1)) if into else Route(
            "dense", fan_in=(-3, -2), fan_out=-1)
    kernel = _sibling(name, "kernel", facts) if leaf == "bias" and ndim >= 2 and into else None
    if kernel is not None and len(kernel) == ndim + 1 and kernel[-2:] == shape[-2:]:
        return Route("vector", batch=tuple(range(ndim - 2)))
    return None


def _refusal(name: str, shape: tuple[int, ...], message: str,
             options: list[tuple[Any, str]]) -> RoutingError:
    return RoutingError(message, leaf=name, shape=shape, options=options)


def _matrix_options(shape: tuple[int, ...], first: str) -> list[tuple[Any, str]]:
    """Remedies for a matrix of unknown layout; ``first`` is ``"in_out"`` or ``"out_in"``."""
    ndim = len(shape)
    what = ("a stack of (in, out) matrices over the leading axes", "a stack of (out, in) "
            "matrices over the leading axes") if ndim > 2 else (
            "used as x @ W, W (in, out)", "used as F.linear(x, W), W (out, in)")
    in_out, out_in = (Route("dense", -2, -1), f"it is {what[0]}"), (
        Route("dense", -1, -2), f"it is {what[1]}")
    options: list[tuple[Any, str]] = [in_out, out_in] if first == "in_out" else [out_in, in_out]
    rest = tuple(range(1, ndim))
    options += [(Route("embedding", -1, -2), "it is a table of rows (V, d)")] if ndim == 2 else [
        (Route("dense", 0, rest), f"it is one matrix, axis 0 its input, axes {rest} merged as "
         "its output (an (in, heads, head_dim) projection)"),
        (Route("dense", rest, 0), f"it is one matrix, axis 0 its output, axes {rest} merged as "
         "its input (a PyTorch conv (out, in, *taps), a (d, heads, head_dim) output)")]
    return [*options, VECTOR_OPTION]


def _table_options(shape: tuple[int, ...], vocab_size: int | None) -> list[tuple[Any, str]]:
    rows = (Route("embedding", -1, -2), f"it is a table of {shape[-2]} rows (V, d)")
    cols = (Route("embedding", -2, -1), f"it is a (d, V) matrix of {shape[-1]} columns")
    options = [cols, rows] if vocab_size is not None and shape[-1] == vocab_size else [rows, cols]
    return [*options, VECTOR_OPTION]


def _name_route(name: str, shape: tuple[int, ...], facts: _TreeFacts) -> Route | RoutingError:
    """The route that names and shapes alone give (``docs/routing.md``, step 4)."""
    ndim = len(shape)
    parts = naming.components(name)
    leaf = parts[-1]
    if ndim < 2:
        return Route("vector", evidence=f"shape: {ndim}-D")
    if sum(n > 1 for n in shape) <= 1:
        return Route("vector", evidence="shape: one non-unit axis")
    attention = _attention_reading(name, shape, facts)
    if leaf in naming.VECTOR_NAMES or leaf == "offset":
        return _vector_name_refusal(name, shape, leaf, facts.remedy, attention)
    if ndim > 2 and (name == "<root>" or all(part.isdigit() for part in name.split("."))):
        return Route("vector", evidence=NO_EVIDENCE)  # no name: the caller warns (or refuses)
    route = _LAYOUT_RULES[facts.layout](name, shape, facts, attention)
    if route is not None:
        return route
    if ndim == 2 and (leaf in naming.TOKEN_EMBEDDING_MARKERS or leaf in ("embed", "embedding")):
        return Route("embedding", -1, -2, evidence=f"name {leaf!r} (token table (V, d))")
    if any("emb" in part for part in parts):
        return _embedding_name_route(name, shape, facts)
    return _shape_route(name, shape, facts)


def _vector_name_refusal(name: str, shape: tuple[int, ...], leaf: str, remedy: str,
                         attention: Route | None) -> RoutingError:
    """A vector name (``bias``, ``scale``) on two or more axes, refused."""
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
             (stacked, "it is stacked layers' vectors (L, ..., d)")])
    return _refusal(
        name, shape,
        f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with {ndim} axes "
        "may be stacked layers' vectors (L, d) or one multi-axis vector (heads, head_dim). "
        f"{remedy}: " + core.override_advice(name, stacked) + " for stacked layers, "
        + core.override_advice(name, Route("vector")) + " for one vector",
        [(stacked, "it is stacked layers' vectors (L, ..., d)"),
         ("vector", "it is one multi-axis vector")])


def _default_layout_route(name: str, shape: tuple[int, ...], facts: _TreeFacts,
                          attention: Route | None) -> Route | RoutingError | None:
    """What a conventional leaf name says with no declared layout (``docs/routing.md``)."""
    leaf, ndim = naming.components(name)[-1], len(shape)
    if leaf in TABLE_NAMES and ndim == 2:
        return Route("embedding", -1, -2, evidence=f"name {leaf!r} ({TABLE_NAMES[leaf]} "
                     "(V, d))")
    if leaf in FLAX_NAMES and ndim == 2 and not naming.names_table(name):
        return Route("dense", -2, -1, evidence=f"name {leaf!r} ({FLAX_NAMES[leaf]} (in, out))")
    if leaf in TORCH_NAMES and ndim == 2:
        return _torch_weight_route(name, shape, facts)
    if leaf in (*FLAX_NAMES, *TABLE_NAMES, *TORCH_NAMES) and ndim > 2:
        return _convention_refusal(name, shape, leaf, facts.remedy, attention)
    return None


def _torch_weight_route(name: str, shape: tuple[int, ...],
                        facts: _TreeFacts) -> Route | RoutingError:
    """A 2-D ``weight`` with no declared layout: ``(out, in)``, or refused."""
    reading = naming.torch_name_reading(name)
    if facts.flax:
        return _refusal(
            name, shape,
            f"cannot tell the layout of {name!r} of shape {shape}: 'weight' is PyTorch's "
            "name for an (out, in) matrix, but this is a Flax/Haiku tree, whose "
            f"matrices are (in, out). {facts.remedy}: "
            + core.override_advice(name, Route("dense", -2, -1))
            + " if the module computes x @ weight, or "
            + core.override_advice(name, Route("dense", -1, -2)) + " for weight @ x",
            [(Route("dense", -2, -1), "the module computes x @ weight (in, out)"),
             (Route("dense", -1, -2), "the module computes weight @ x (out, in)"),
             (Route("embedding", -1, -2), "it is a table (V, d)"), VECTOR_OPTION])
    refusal = naming.convention_refusal(  # GPT-2's Conv1D (in, out) or nanoGPT's Linear
        name, shape, facts.conventions,
        "Route the model in PyTorch with sage_torch (its modules decide), or "
        "give it in route_overrides")
    if refusal is not None:
        return refusal
    if reading == "table":
        return Route("embedding", -1, -2, evidence="name (PyTorch/Equinox table (V, d))")
    if reading in naming.TORCH_WEIGHT_WHY:
        options = naming.torch_weight_options(shape, None, facts.torch_vocab)
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: {naming.TORCH_WEIGHT_WHY[reading]}; "
            "give it: " + "; ".join(f"{core.override_advice(name, r)} if {w}"
                                    for r, w in options), options)
    return Route("dense", -1, -2, evidence="name 'weight' (PyTorch/Equinox (out, in))")


def _flax_layout_route(name: str, shape: tuple[int, ...], facts: _TreeFacts,
                       attention: Route | None) -> Route | RoutingError | None:
    """What a conventional leaf name says under ``layout="flax"`` (``docs/routing.md``)."""
    leaf, ndim = naming.components(name)[-1], len(shape)
    if leaf in ("embedding", "embeddings") and ndim == 2:
        return Route("embedding", -1, -2, evidence="name 'embedding' (Flax Embed (V, d))")
    if leaf in ("kernel", "w", "weight") and ndim == 2:
        return Route("dense", -2, -1, evidence=f"name {leaf!r}, layout flax (in, out)")
    if leaf in ("kernel", "w", "weight", "embedding", "embeddings"):
        return _convention_refusal(name, shape, "kernel", facts.remedy, attention)
    return None


def _torch_layout_route(name: str, shape: tuple[int, ...], facts: _TreeFacts,
                        attention: Route | None) -> Route | RoutingError | None:
    """What a ``weight`` says under ``layout="torch"`` (``docs/routing.md``)."""
    if naming.components(name)[-1] != "weight":
        return None
    if len(shape) > 2:
        return _convention_refusal(name, shape, "weight", facts.remedy)
    if (naming.names_token_embedding(name) or naming.names_table(name)
            or naming.names_table_module(name)):
        return Route("embedding", -1, -2, evidence="name (token table (V, d))")
    return Route("dense", -1, -2, evidence="name 'weight' (torch (out, in))")


_LAYOUT_RULES = {None: _default_layout_route, "flax": _flax_layout_route,
                 "torch": _torch_layout_route}
"""What a conventional leaf name says, by the declared layout (``None``: the names decide)."""


def _embedding_name_route(name: str, shape: tuple[int, ...],
                          facts: _TreeFacts) -> Route | RoutingError:
    """A leaf whose path names an embedding: ``vocab_size`` on one axis decides."""
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
        else _matrix_options(shape, "in_out"))


def _shape_route(name: str, shape: tuple[int, ...], facts: _TreeFacts) -> Route | RoutingError:
    """A matrix whose name says nothing: the declared layout, else the tree's convention."""
    ndim, layout = len(shape), facts.layout
    if ndim > 2:
        options = _matrix_options(shape, "out_in" if layout == "torch" or (
            layout is None and facts.torch) else "in_out")
        return _refusal(
            name, shape,
            f"cannot tell the layout of {name!r} of shape {shape}: a matrix with {ndim} axes "
            "may be stacked layers, a multi-axis kernel or a convolution; give its axes, e.g. "
            + core.override_advice(name, options[0][0])
            + " for stacked layers, or Route('dense', fan_in=(...), fan_out=(...)) for one "
            "matrix with merged axes", options)
    if layout == "torch":
        return Route("dense", -1, -2, evidence="layout torch: (out, in)")
    if layout == "flax":
        return Route("dense", -2, -1, evidence="layout flax: (in, out)")
    if facts.torch:
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: this tree follows PyTorch's names "
            "('weight' (out, in)), and this matrix's name says nothing of its layout; give it",
            _matrix_options(shape, "out_in"))
    return Route("dense", -2, -1, evidence="JAX convention x @ W (in, out)")


def _convention_refusal(name: str, shape: tuple[int, ...], leaf: str,
                        remedy: str, attention: Route | None = None) -> RoutingError:
    """A conventional matrix name (kernel, w, weight) with more than two axes."""
    ndim = len(shape)
    if leaf == "weight":  # PyTorch/Equinox: (out, in, *taps) convolutions, or stacks
        conv, stack = Route("dense", tuple(range(1, ndim)), 0), Route("dense", -1, -2)
        options: list[tuple[Any, str]] = [
            (stack, "it is a stack of (out, in) matrices over the leading axes"),
            (conv, "it is a convolution (out, in, *taps)")][::-1 if ndim >= 4 else 1]
        return _refusal(
            name, shape,
            f"cannot place {name!r} of shape {shape}: a PyTorch-layout 'weight' with {ndim} "
            f"dims may be a convolution (out, in, *taps) or stacked layers. {remedy}: "
            + core.override_advice(name, conv) + " for a convolution, "
            + core.override_advice(name, stack) + " for stacked layers",
            [*options, (Route("dense", -2, -1), "it is a stack of (in, out) matrices"),
             VECTOR_OPTION])
    stack, conv = Route("dense", -2, -1), Route("dense", (-2, *range(-ndim, -2)), -1)
    options = [(stack, "it is stacked layers (L, ..., in, out) (nnx.vmap, nnx.scan)")] + (
        [(Route("dense", 0, (1, 2)), "it is one (in, heads, head_dim) kernel"),
         (Route("dense", (0, 1), 2), "it is one (heads, head_dim, out) kernel")]
        if ndim == 3 else []) + [(conv, "it is a convolution (*taps, Cin, Cout)"), VECTOR_OPTION]
    said = ""
    if attention is not None:  # the module's name says which: that reading first
        same = [o for o in options if isinstance(o[0], Route)
                and o[0].resolve(shape, name) == attention.resolve(shape, name)]
        what = ("an attention input projection (in, heads, head_dim)"
                if attention.fan_in == (-3,) else
                "an attention output projection (heads, head_dim, out)")
        first = same[0][0] if same else attention
        options = [(first, f"it is {what}, as its module's name says (DenseGeneral, "
                    "nn.MultiHeadDotProductAttention)" + (" per leading index" if ndim > 3
                                                          else "")),
                   *(o for o in options if o not in same)]
        said = f" Its module's name says {what}: " + core.override_advice(name, first) + "."
    return _refusal(
        name, shape,
        f"cannot tell the layout of {name!r} of shape {shape}: a {leaf!r} with "
        f"{ndim} axes may be stacked layers (L, ..., in, out), a multi-axis kernel "
        "(nnx.LinearGeneral, nnx.MultiHeadAttention, nnx.Einsum) or a convolution "
        f"(*taps, Cin, Cout).{said} {remedy}: "
        + core.override_advice(name, stack) + " for stacked layers, "
        + core.override_advice(name, conv) + " for a convolution", options)


# ------------------------------------------------------------------------------- the router


def _override_refusal(e: decision.Evidence, override: Route) -> RoutingError:
    """An override that gives a kind but no axes, for a leaf whose axes nothing gives."""
    options = [(Route(override.kind, r.fan_in, r.fan_out, r.batch), when)
               for r, when in _matrix_options(e.shape, "in_out")
               if isinstance(r, Route) and r.kind != "vector"]
    return _refusal(
        e.name, e.shape,
        f"override makes {e.name!r} of shape {e.shape} {override.kind!r}, but its axes are not "
        f"known; give them: {core.override_advice(e.name)}", options)


class NoLayoutEvidenceWarning(UserWarning):
    """Leaves with no layout evidence got the configuration's element-wise rule.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """


def _fallback(decided: dict[str, Route | RoutingError], shapes: Mapping[str, tuple[int, ...]],
              strict: bool, warn: bool) -> None:
    """Warn about (or, ``strict``, refuse) the leaves that got the element-wise fallback."""
    plain = [n for n, r in decided.items() if isinstance(r, Route) and r.evidence == NO_EVIDENCE]
    if not plain or not (strict or warn):
        return
    refusals = {n: _refusal(
        n, shapes[n],
        f"cannot place {n!r} of shape {shapes[n]}: it has no name (only a position in "
        "a list or tuple), no module and no override, so nothing says which axes are "
        "its fan-in and fan-out (strict=True refuses the element-wise fallback)",
        _matrix_options(shapes[n], "in_out")) for n in plain}
    if strict:
        decided.update(refusals)
    else:
        listed = ", ".join(f"{n!r} {shapes[n]}" for n in plain)
        warnings.warn(
            f"{len(plain)} parameter(s) with no layout evidence (no name, only a position in a "
            f"list or tuple; no module; no override) get the configuration's element-wise "
            f"('vector') rule: {listed}. For a matrix rule give their axes (strict=True "
            "refuses instead).\n" + core.paste_block(list(refusals.values())),
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
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """
    if layout == "auto":
        layout = None
    if layout is not None and layout not in PARAM_LAYOUTS:
        raise ValueError(f"layout must be one of {PARAM_LAYOUTS} or None, got {layout!r}")
    roles = logical.check_axis_roles(axis_roles)
    if is_nnx_module(params):
        from flax import nnx

        model, params = params, nnx.state(params, nnx.Param)
    evidence = dict(module_evidence or {})  # what the modules say, and an adapter reads
    if model is not None:
        evidence.update(module_routes(model))
    for adapter in adapters():  # a filtered model keeps its modules
        if adapter.owns(params) or any(adapter.owns(x) for x in jax.tree.leaves(
                params, is_leaf=adapter.owns)):
            evidence.update(adapter.routes(params))
    nnx_model = model is not None and is_nnx_module(model)
    names = logical.names_of(model) if nnx_model else {}
    names.update(logical.names_of(params))
    given = logical.names_of(axis_names) if axis_names is not None else {}
    names.update(given)
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
    facts = _tree_facts(layout, bool(evidence) or model is not None, vocab_size,
                        is_nnx_state(params) or nnx_model, shapes, [n for n, _ in named])
    records = [_leaf_evidence(name, x, evidence, names, roles, facts)
               for name, x in named if not axes_lib.is_masked(x)]
    decided = decision.decide(records, override_of, refuse_override=_override_refusal,
                              vocab_size=vocab_size)
    _fallback(decided, shapes, strict, warn)
    errors = list({id(r): r for r in decided.values()
                   if isinstance(r, RoutingError)}.values())  # a head error: once
    if errors:
        raise RoutingError.combine(errors, fix=_NO_MODULES[facts.source][1],
                                   names=[e.name for e in records])
    resolved = {n: (r, r.resolve(shapes[n], n)) for n, r in decided.items()
                if isinstance(r, Route)}
    rows = [(x, x, x) if axes_lib.is_masked(x) else (resolved[n][1].kind, *resolved[n])
            for n, x in named]
    return ParamRouting(*(jax.tree_util.tree_unflatten(treedef, [r[i] for r in rows])
                          for i in range(3)))


def _leaf_evidence(name: str, x: Any, evidence: Mapping[str, Route | RoutingError],
                   names: Mapping[str, logical.Names], roles: Mapping[str, str | None],
                   facts: _TreeFacts) -> decision.Evidence:
    """What is known of one unmasked leaf (a non-array or non-float leaf is refused)."""
    if not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise RoutingError(
            f"parameter {name!r} is a {type(x).__name__}, not an array; route only the "
            "arrays to train (eqx.filter(model, eqx.is_inexact_array), "
            "nnx.state(model, nnx.Param))")
    shape = tuple(int(s) for s in x.shape)
    by_names = name not in evidence and naming.components(name)[-1] in TORCH_NAMES
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return decision.Evidence(name, shape, RoutingError(
            f"cannot place parameter {name!r} of shape {shape}: dtype {jnp.dtype(x.dtype)} "
            "is not floating point, so no optimizer can train it; filter it out of the "
            "params (e.g. nnx.Optimizer(..., wrt=nnx.Param), eqx.filter(model, "
            "eqx.is_inexact_array)) or mask it"), head_candidate=True, final=True,
            by_names=by_names)
    route, head_candidate = _gathered(name, shape, evidence, names, roles, facts)
    return decision.Evidence(name, shape, route, head_candidate=head_candidate,
                             by_names=by_names)


def _gathered(name: str, shape: tuple[int, ...], evidence: Mapping[str, Route | RoutingError],
              names: Mapping[str, logical.Names], roles: Mapping[str, str | None],
              facts: _TreeFacts) -> tuple[Route | RoutingError, bool]:
    """A floating leaf's route (module, axis names, name), and whether it may be the head."""
    by_names = logical.route_from_names(name, shape, names[name], roles, torch_order=(
        facts.layout == "torch")) if name in names else None
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
    if by_names is not None:  # a head only if some axis has no role (else it says vocab)
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
