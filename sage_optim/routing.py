"""What both routers share: the route of one leaf, the override grammar, markers and errors.

SAGE and SinkGD are not transpose-invariant, so the router that labels every parameter
``embedding``/``dense``/``vector`` also decides the math through the axes it gives.  The
JAX router (:mod:`sage_optax.routing`) and the PyTorch router (:mod:`sage_torch.routing`)
read different evidence (pytree paths and flax modules; ``nn.Module`` types and the
transformers API) but speak one language, defined here:

* :class:`Route`: a kind plus *groups* of axes: the fan-in axes, the fan-out axes and the
  batch axes of a leaf.  A matrix with several axes is one matrix: an ``(in, heads,
  head_dim)`` kernel has ``fan_in=(0,)`` and ``fan_out=(1, 2)`` and is an ``in x
  (heads·head_dim)`` matrix; a convolution kernel has its input channels and taps as fan-in
  (``(Cin·kh·kw) x Cout``).  For vocabulary matrices the vocab axis is the fan-out axis.
* the override grammar: ``{glob: kind}``, ``{glob: Route(kind, fan_in=..., fan_out=...)}``
  or ``{glob: (kind, {"fan_in": ..., "fan_out": ...})}``; a glob that matches no parameter
  is an error naming the nearest paths (:func:`match_overrides`);
* :class:`RoutingError`, raised for every leaf that cannot be placed, with a message that
  names the path, the shape and the override that fixes it;
* the name markers that are the weakest evidence (used only where unambiguous).

Nothing here imports a framework.  The project's ``docs/routing.md`` states the conventions.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeAlias

from sage_optim.presets import KINDS

Axes: TypeAlias = "int | tuple[int, ...] | None"
"""One axis, a group of axes, or ``None`` (no such axis: a vector)."""

VECTOR_NAMES: frozenset[str] = frozenset({"scale", "bias", "b", "gamma", "beta"})
"""Leaf names that hold per-feature vectors, also when stacked into a matrix."""

TOKEN_EMBEDDING_MARKERS: tuple[str, ...] = (
    "wte", "tok", "token", "tokens", "tok_emb", "tok_embeddings", "tok_embedding",
    "embed_tokens", "word_embeddings", "token_embedding", "token_embeddings", "embedder",
    "input_embedding",
)
"""Path components that name the *token* embedding among several tables (GPT-2 ``wte``,
Meta LLaMA ``tok_embeddings``, Hugging Face ``embed_tokens``/``word_embeddings``, Gemma
``embedder``).  A component equal to ``embed`` or ``embedding`` counts too."""

HEAD_MARKERS: tuple[str, ...] = (
    "lm_head", "head", "output", "unembed", "embed_out", "decoder")
"""Path components that name an output head (``decoder``: BERT's and RoBERTa's
``predictions.decoder``/``lm_head.decoder``; a decoder *stack*'s matrices lie inside
numbered layers, which a head never does).  A name alone never makes a head: the leaf must
also have the shape of the token embedding, ``(d, V)`` or ``(V, d)``."""

CONV1D_NAMES: frozenset[str] = frozenset({"c_attn", "q_attn", "c_fc", "c_proj"})
"""Module names whose ``weight`` no name can read: transformers' ``Conv1D`` in GPT-2 and its
relatives (OpenAI GPT, ImageGPT, Decision Transformer, CLVP) stores it ``(in, out)``, while
nanoGPT and GPTBigCode give the same names to ``nn.Linear`` weights ``(out, in)``.  Given by
name only, such a weight is refused (:func:`conv1d_reading` orders the remedies)."""

_TAKES_WIDTH: frozenset[str] = frozenset({"c_attn", "q_attn", "c_fc"})
"""The :data:`CONV1D_NAMES` whose input is the model width (``c_proj`` outputs it)."""

TABLE_MODULE_NAMES: frozenset[str] = frozenset({"wpe", "shared", "relative_attention_bias"})
"""Module names whose 2-D ``weight`` is an ``nn.Embedding`` table ``(V, d)`` in every family
that uses them, although no word of the name says embedding: GPT-2's position table ``wpe``,
the token table ``shared`` of T5 and BART (and their relatives), T5's bucket table
``relative_attention_bias`` ``(buckets, heads)``."""

NON_VOCAB_WORDS: frozenset[str] = frozenset({
    "pos", "position", "positions", "positional", "wpe", "type", "types", "segment",
    "segments", "seg", "rel", "relative", "bucket", "buckets",
})
"""Words of a table's name that mark it as positions, token types or segments: a matrix that
fits only such a table is not taken for an output head."""


class RoutingError(ValueError):
    """A parameter the router cannot place, or an override that does not apply.

    The message names the parameter's path and shape and the override that fixes it.  Both
    frameworks raise this one type (``sage_optax.RoutingError is sage_torch.RoutingError``),
    and both raise *one* error for all the parameters they cannot place
    (:meth:`combine`), ending with a ``route_overrides = {...}`` block that can be pasted.

    Attributes:
      leaf: the parameter's name, when the error is about one parameter.
      shape: its shape.
      options: the remedies, most likely first: ``(route, when)`` pairs, where ``route``
        is a :class:`Route` (or a kind) and ``when`` completes "right if ..." ("it is a
        stack of (in, out) matrices", ...).
      problems: the per-parameter errors a combined error holds (itself for one).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """

    def __init__(self, message: str, *, leaf: str | None = None,
                 shape: Sequence[int] | None = None,
                 options: Sequence[tuple[Any, str]] = ()) -> None:
        super().__init__(message)
        self.leaf = leaf
        self.shape = None if shape is None else tuple(int(s) for s in shape)
        self.options: tuple[tuple[Any, str], ...] = tuple(options)
        self.problems: tuple[RoutingError, ...] = (self,) if leaf is not None else ()

    @property
    def overrides(self) -> dict[str, Any]:
        """The suggested ``route_overrides``: the first remedy of every parameter named.

        The same dict the message's paste block prints: one glob per layer role where the
        parameters of several layers take the same remedy (``'blocks_*.attn.query.kernel'``),
        so the overrides do not depend on the layer count; check it against the model's
        forward code before training with it.
        """
        return {pattern: rows[0].options[0][0]
                for pattern, rows in override_patterns(self.problems, self.names).items()}

    #: Every parameter name of the tree the error is about (``None``: unknown); the paste
    #: block's globs are checked against it, so that none reaches a parameter it is not for.
    names: tuple[str, ...] | None = None

    @classmethod
    def combine(cls, errors: Sequence[RoutingError], *, fix: str | None = None,
                names: Sequence[str] | None = None) -> RoutingError:
        """One error for every parameter in ``errors``, with one paste block for all.

        With several refusals, the message's first line is the fix (at most
        :data:`HEADLINE_LIMIT` characters): ``fix`` where the caller knows one (pass the
        model), else the paste block; the details follow, one bullet per layer role (the
        parameters of other layers with the same remedy are counted, not repeated), then the
        ``route_overrides = {...}`` block.  One refusal keeps its own message, which gives
        its remedy first, then the block.

        Args:
          errors: the per-parameter refusals.
          fix: the caller's first remedy, e.g. ``"pass model=model to make_optimizer"``.
          names: every parameter name of the tree, to check the block's globs against.
        """
        errors = list(errors)
        problems = tuple(p for e in errors for p in (e.problems or (e,)))
        known = None if names is None else tuple(names)
        groups = override_patterns(problems, known)
        grouped = {id(rows[0]): (pattern, len(rows) - 1) for pattern, rows in groups.items()}
        in_group = {id(r) for rows in groups.values() for r in rows[1:]}
        details = []
        for e in errors:
            if id(e) in in_group:
                continue
            text = str(e).replace("\n", "\n  ")
            if id(e) in grouped and grouped[id(e)][1]:
                pattern, more = grouped[id(e)]
                text += f" (the same for {more} more parameter{'s' if more > 1 else ''} " \
                        f"matching {pattern!r})"
            details.append(text)
        block = paste_block(problems, known)
        count = f"cannot place {len(errors)} parameter{'s' if len(errors) != 1 else ''}"
        if len(errors) == 1:  # one refusal: its own message says the remedy first
            lines = [str(errors[0])]
        elif block:
            paste = "paste the route_overrides block at the end (err.overrides)"
            headline = f"Fix: {fix}, or {paste}; {count}, details below"
            if not fix or len(headline) > HEADLINE_LIMIT:
                headline = (f"Fix: {paste} into make_optimizer, checked against the model's "
                            f"forward code; {count}, details below")
            lines = [headline, *("* " + d for d in details)]
        else:
            lines = [f"{count}:", *("* " + d for d in details)]
        out = cls("\n".join(lines + ([block] if block else [])))
        out.problems = problems
        out.names = known
        return out


def as_axis_group(value: Any, what: str) -> tuple[int, ...] | None:
    """``value`` (an int, a non-empty tuple of ints, or ``None``) as a tuple of axes.

    Both frameworks parse axis arguments with this (``Route``, ``fan_in_dim=``).

    Raises:
      ValueError: anything else; the message names ``what``.
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    try:
        group = tuple(value)
    except TypeError:
        raise ValueError(f"{what} must be an int or a tuple of ints, got {value!r}") from None
    if not group or not all(isinstance(a, int) and not isinstance(a, bool) for a in group):
        raise ValueError(f"{what} must be an int or a non-empty tuple of ints, got {value!r}")
    return group


def as_view(value: Any) -> tuple[int, ...]:
    """``value`` (a non-empty sequence of positive ints) as a :class:`Route`'s ``view``.

    Raises:
      RoutingError: anything else, naming it.
    """
    try:
        view = tuple(value)
    except TypeError:
        raise RoutingError(f"a route's view must be a tuple of positive ints (a shape), got "
                           f"{value!r}") from None
    if not view or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                           for n in view):
        raise RoutingError(f"a route's view must be a tuple of positive ints (a shape), got "
                           f"{value!r}")
    return view


@dataclasses.dataclass(frozen=True)
class Route:
    """The kind of one leaf and its axis groups: the routing decision, and the math.

    Attributes:
      kind: ``"embedding"``, ``"dense"`` or ``"vector"``.
      fan_in: the fan-in axis or axes (merged into one matrix axis, in this order).
        ``None`` for a vector, or when the axes are to be inferred (an override that gives
        only the kind).
      fan_out: the fan-out axis or axes; for an embedding or a head, the vocab axis.
      batch: axes treated independently (stacked layers).  ``None`` means every axis that
        is neither fan-in nor fan-out (for a vector: none).
      evidence: what placed the leaf (``"override"``, ``"module nn.Linear"``, ...), shown by
        the routing tables.
      view: ``None`` (the default), or the shape the leaf is viewed as before the math, a
        row-major reshape with as many elements (``p.view(view)``): the axes then count in
        the view.  For weights whose forward reshapes them: DBRX stores its experts as one
        ``(E·n, d)`` weight and reads ``w.view(E, n, d)[e]``, so
        ``Route("dense", fan_in=2, fan_out=1, batch=0, view=(E, n, d))`` treats each
        expert's ``(n, d)`` matrix by itself.  ``sage_torch`` applies it (the state has the
        view's shape); ``sage_optax`` refuses it, naming the leaf.

    ``Route("dense", fan_in=0, fan_out=1)`` is GPT-2's ``Conv1D`` ``(in, out)``;
    ``Route("dense", fan_in=(1, 2, 3), fan_out=0)`` a ``Conv2d`` weight ``(out, in, kh, kw)``.
    Axes may be negative.  Integers are stored as one-axis groups.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """

    kind: str
    fan_in: Any = None
    fan_out: Any = None
    batch: Any = None
    evidence: str = dataclasses.field(default="override", compare=False)
    view: Any = None

    def __post_init__(self) -> None:
        if self.view is not None:
            object.__setattr__(self, "view", as_view(self.view))
        if self.kind not in KINDS:
            raise RoutingError(f"route kind must be one of {KINDS}, got {self.kind!r}")
        object.__setattr__(self, "fan_in", as_axis_group(self.fan_in, "fan_in"))
        object.__setattr__(self, "fan_out", as_axis_group(self.fan_out, "fan_out"))
        if self.batch is not None and self.batch != ():
            object.__setattr__(self, "batch", as_axis_group(self.batch, "batch"))
        elif self.batch == ():
            object.__setattr__(self, "batch", ())
        if (self.fan_in is None) != (self.fan_out is None):
            raise RoutingError(
                f"a route sets both fan_in and fan_out or neither, got fan_in={self.fan_in}, "
                f"fan_out={self.fan_out}"
            )
        if self.kind == "vector" and self.fan_in is not None:
            raise RoutingError("a 'vector' route has no fan_in/fan_out axes (only batch axes)")

    @property
    def has_axes(self) -> bool:
        """Whether the matrix axes are given (always true for a complete matrix route)."""
        return self.fan_in is not None

    def resolve(self, shape: Sequence[int], name: str = "<leaf>") -> ResolvedRoute:
        """Check the axes against ``shape`` and return them as non-negative axis groups.

        Raises:
          RoutingError: an axis out of range, an axis in two groups, a matrix route without
            axes, or batch axes that are not exactly the remaining axes.
        """
        leaf_shape = tuple(int(s) for s in shape)
        shape = leaf_shape
        if self.view is not None:
            if math.prod(self.view) != math.prod(shape):
                raise RoutingError(
                    f"parameter {name!r} of shape {shape}: its route views it as {self.view}, "
                    f"which has {math.prod(self.view)} elements, not {math.prod(shape)}")
            shape = self.view
        ndim = len(shape)

        def norm(group: tuple[int, ...] | None, what: str) -> tuple[int, ...]:
            out = []
            for a in group or ():
                if not -ndim <= a < ndim:
                    raise RoutingError(
                        f"parameter {name!r} of shape {shape}: {what} axis {a} is out of range"
                    )
                out.append(a % ndim)
            return tuple(out)

        if self.kind != "vector" and not self.has_axes:
            raise RoutingError(
                f"parameter {name!r} of shape {shape} is routed {self.kind!r} without axes; "
                f"give them, e.g. Route({self.kind!r}, fan_in=..., fan_out=...)"
            )
        if self.kind != "vector" and ndim < 2:
            raise RoutingError(
                f"parameter {name!r} of shape {shape} is routed {self.kind!r}, but it has fewer "
                "than two dimensions; route it 'vector'"
            )
        fan_in, fan_out = norm(self.fan_in, "fan_in"), norm(self.fan_out, "fan_out")
        taken = fan_in + fan_out
        if len(set(taken)) != len(taken):
            raise RoutingError(
                f"parameter {name!r} of shape {shape}: an axis is listed twice in "
                f"fan_in={self.fan_in}, fan_out={self.fan_out}"
            )
        rest = tuple(a for a in range(ndim) if a not in taken)
        if self.batch is None:
            batch = rest if self.kind != "vector" else ()
        else:
            batch = norm(self.batch, "batch")
            if self.kind != "vector" and sorted(batch) != list(rest):
                raise RoutingError(
                    f"parameter {name!r} of shape {shape}: batch axes {self.batch} must be "
                    f"exactly the axes other than fan_in={self.fan_in} and fan_out={self.fan_out}"
                )
        return ResolvedRoute(self.kind, fan_in, fan_out, batch, leaf_shape, self.evidence,
                             view=self.view)


@dataclasses.dataclass(frozen=True)
class ResolvedRoute:
    """A :class:`Route` checked against a shape: non-negative axis groups.

    What every transform works with: ``fan_in`` and ``fan_out`` are tuples of axes (empty
    for a vector), ``batch`` the axes treated independently (stacked layers).  A transform
    given a :class:`Route` resolves it against each leaf's shape; one given a
    ``ResolvedRoute`` (what :func:`sage_optax.route_params` returns) checks the shape.
    ``shape`` is the leaf's; with a ``view`` (:class:`Route`) the axes count in the view
    (:attr:`axes_shape`).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """

    kind: str
    fan_in: tuple[int, ...]
    fan_out: tuple[int, ...]
    batch: tuple[int, ...]
    shape: tuple[int, ...]
    evidence: str = dataclasses.field(default="override", compare=False)
    view: tuple[int, ...] | None = None

    @property
    def axes_shape(self) -> tuple[int, ...]:
        """The shape the axes count in: the ``view`` if any, else the leaf's ``shape``."""
        return self.shape if self.view is None else self.view

    @property
    def is_matrix(self) -> bool:
        """Whether the leaf is a matrix (per batch index)."""
        return bool(self.fan_in)

    @property
    def feature_axes(self) -> tuple[int, ...]:
        """All axes that are not batch axes (RMS and norms are taken over these)."""
        return tuple(a for a in range(len(self.axes_shape)) if a not in self.batch)

    @property
    def fan_in_size(self) -> int:
        """Size of the merged fan-in axis."""
        return math.prod(self.axes_shape[a] for a in self.fan_in)

    @property
    def fan_out_size(self) -> int:
        """Size of the merged fan-out axis."""
        return math.prod(self.axes_shape[a] for a in self.fan_out)

    @property
    def is_simple(self) -> bool:
        """Whether each matrix axis is a single axis (no merging needed)."""
        return len(self.fan_in) == 1 and len(self.fan_out) == 1

    def matrix_perm(self) -> tuple[int, ...]:
        """The transpose to ``(batch..., fan_in..., fan_out...)``, the canonical layout."""
        return (*self.batch, *self.fan_in, *self.fan_out)

    def matrix(self) -> ResolvedRoute:
        """The route of the merged matrix view: batch first, then fan-in, then fan-out."""
        nb = len(self.batch)
        shape = (*(self.axes_shape[a] for a in self.batch), self.fan_in_size, self.fan_out_size)
        return ResolvedRoute(self.kind, (nb,), (nb + 1,), tuple(range(nb)), shape,
                             self.evidence)

    def resolve(self, shape: Sequence[int], name: str = "<leaf>") -> ResolvedRoute:
        """Itself, after checking that ``shape`` is the shape it was resolved for.

        Raises:
          RoutingError: another shape (the route of another leaf).
        """
        if tuple(int(s) for s in shape) != self.shape:
            raise RoutingError(
                f"parameter {name!r} of shape {tuple(shape)} is given the route of a leaf of "
                f"shape {self.shape}")
        return self

    def describe_fan_in(self) -> str:
        """The fan-in axes with their sizes, as the routing tables print them."""
        return format_axes(self.fan_in, self.axes_shape)

    def describe_fan_out(self) -> str:
        """The fan-out axes with their sizes, as the routing tables print them."""
        return format_axes(self.fan_out, self.axes_shape)


def format_axes(group: Sequence[int], shape: Sequence[int]) -> str:
    """``"1 (768)"`` for one axis, ``"0,1,2 (3x3x64=576)"`` for a merged group, ``"-"`` if none."""
    if not group:
        return "-"
    sizes = [int(shape[a]) for a in group]
    axes = ",".join(str(a) for a in group)
    if len(sizes) == 1:
        return f"{axes} ({sizes[0]})"
    total = 1
    for s in sizes:
        total *= s
    return f"{axes} ({'x'.join(map(str, sizes))}={total})"


def parse_override(pattern: str, value: Any) -> Route:
    """Turn one override value into a :class:`Route` (``evidence="override"``).

    Accepted: a kind (``"dense"``), a :class:`Route`, ``(kind,)``, ``(kind, {"fan_in": ...,
    "fan_out": ..., "batch": ...})``.
    """
    if isinstance(value, Route):
        return dataclasses.replace(value, evidence="override")
    if isinstance(value, str):
        value = (value,)
    if isinstance(value, tuple) and value and isinstance(value[0], str):
        kind, *rest = value
        if kind not in KINDS:
            raise RoutingError(f"override {pattern!r} -> {value!r}: kind must be one of {KINDS}")
        if not rest:
            return Route(kind)
        if len(rest) == 1 and isinstance(rest[0], Mapping):
            unknown = set(rest[0]) - {"fan_in", "fan_out", "batch"}
            if unknown:
                raise RoutingError(
                    f"override {pattern!r}: unknown axis key(s) {sorted(unknown)}; use fan_in, "
                    "fan_out and batch"
                )
            return Route(kind, **rest[0])
    raise RoutingError(
        f"override {pattern!r} -> {value!r}: give a kind {KINDS}, a Route(kind, fan_in=..., "
        "fan_out=...) or (kind, {'fan_in': ..., 'fan_out': ...})"
    )


def match_overrides(
    names: Sequence[str], overrides: Mapping[str, Any] | None
) -> dict[str, Route]:
    """The override route of every name that a glob matches (first matching glob wins).

    Raises:
      RoutingError: a glob that matches no name (the message lists the nearest names), or
        an override value that is not a valid route.
    """
    if not overrides:
        return {}
    parsed = {pattern: parse_override(pattern, value) for pattern, value in overrides.items()}
    out: dict[str, Route] = {}
    used: set[str] = set()
    for name in names:
        for pattern, route in parsed.items():
            if fnmatch.fnmatchcase(name, pattern):
                out[name] = route
                used.add(pattern)
                break
    unused = [p for p in parsed if p not in used]
    if unused:
        hints = []
        for pattern in unused:
            near = difflib.get_close_matches(pattern, list(names), n=3, cutoff=0.4)
            hints.append(f"{pattern!r} (nearest: {', '.join(near) if near else 'none'})")
        raise RoutingError(
            "route override(s) match no parameter: " + "; ".join(hints)
            + ". Patterns are fnmatch globs over dotted names, e.g. 'layers.*.attn.q_proj.weight'"
        )
    return out


def components(name: str) -> list[str]:
    """The lower-cased dotted components of a parameter name."""
    return name.lower().split(".")


def names_token_embedding(name: str) -> bool:
    """Whether a component of ``name`` names the token embedding (see the markers)."""
    return any(
        part in TOKEN_EMBEDDING_MARKERS or part in ("embed", "embedding")
        for part in components(name)[:-1]
    )


def names_head(name: str) -> bool:
    """Whether a component of ``name`` (other than the leaf) names an output head."""
    return any(part in HEAD_MARKERS for part in components(name)[:-1])


def override_advice(name: str, route: Route | None = None) -> str:
    """The override that places ``name`` as ``route`` (or a template), for error messages."""
    if route is None:
        return (
            f"route_overrides={{{name!r}: Route('dense', fan_in=..., fan_out=...)}} "
            "(or 'embedding' for a vocabulary matrix, 'vector' for element-wise rules)"
        )
    return f"route_overrides={{{name!r}: {route_literal(route)}}}"


def route_literal(route: Any) -> str:
    """``route`` as Python source: ``'vector'`` or ``Route('dense', fan_in=0, fan_out=1)``."""
    if isinstance(route, str):
        return repr(route)
    if route.kind == "vector" and not route.batch:
        return "'vector'"
    args = [repr(route.kind)]
    for key in ("fan_in", "fan_out"):
        group = getattr(route, key)
        if group is not None:
            args.append(f"{key}={group[0] if len(group) == 1 else group}")
    if route.batch:
        args.append(f"batch={route.batch}")
    if getattr(route, "view", None) is not None:
        args.append(f"view={route.view}")
    return f"Route({', '.join(args)})"


HEADLINE_LIMIT = 200
"""The most characters of a routing refusal's first line, which says the fix."""

_DIGITS = re.compile(r"\d+")


def override_patterns(problems: Sequence[RoutingError], names: Sequence[str] | None = None
                      ) -> dict[str, list[RoutingError]]:
    """The refused parameters with a remedy, grouped under one glob per layer role.

    Parameters whose names differ only in their numbers (``blocks_0.attn.query.kernel``,
    ``blocks_5.attn.query.kernel``) and whose first remedy is the same share one glob, with
    ``*`` where their numbers differ (``blocks_*.attn.query.kernel``).  A glob that would
    also match a parameter outside its group (of ``names``, every parameter of the tree)
    is not used: its parameters are listed one by one.  In the order of ``problems``.
    """
    rows = [p for p in problems if p.leaf is not None and p.options]
    by_role: dict[tuple[Any, ...], list[RoutingError]] = {}
    for p in rows:
        leaf = str(p.leaf)
        key = (tuple(_DIGITS.split(leaf)), route_literal(p.options[0][0]))
        by_role.setdefault(key, []).append(p)
    out: dict[str, list[RoutingError]] = {}
    for (parts, _), members in by_role.items():
        numbers = [_DIGITS.findall(str(m.leaf)) for m in members]
        pattern = parts[0]
        for i, part in enumerate(parts[1:]):
            values = {n[i] for n in numbers}
            pattern += (values.pop() if len(values) == 1 else "*") + part
        leaves = {str(m.leaf) for m in members}
        stray = names is not None and any(
            fnmatch.fnmatchcase(n, pattern) and n not in leaves for n in names)
        if len(members) == 1 or stray or any(c in pattern for c in "?["):
            for m in members:
                out[str(m.leaf)] = [m]
        else:
            out[pattern] = members
    return out


def paste_block(problems: Sequence[RoutingError], names: Sequence[str] | None = None) -> str:
    """The ``route_overrides = {...}`` block of a routing error (``""`` if nothing to paste).

    One line per layer role (:func:`override_patterns`): its first remedy, and as a comment
    when that remedy is right and what the others are.  It is Python: ``Route`` is
    ``sage_optim.routing.Route`` (also ``sage_optax.Route`` and ``sage_torch.Route``).
    """
    groups = override_patterns(problems, names)
    if not groups:
        return ""
    lines = ["Paste and check against the model's forward code (first remedy of each; "
             "the others are in the comments):", "route_overrides = {"]
    for pattern, members in groups.items():
        (first, when), *rest = members[0].options
        note = f"if {when}" + "".join(f"; or {route_literal(r)} if {w}" for r, w in rest)
        lines.append(f"    {pattern!r}: {route_literal(first)},  # {note}")
    lines.append("}")
    return "\n".join(lines)


def in_numbered_layers(name: str) -> bool:
    """Whether ``name`` lies inside numbered layers (``h.0.mlp.c_proj.weight``).

    A matrix repeated per layer is a layer's matrix: never *the* output head by shape.  A
    numbered module followed by a named one counts; a numbered module itself does not
    (``1.weight`` of an ``nn.Sequential`` may be its last Linear, the head).
    """
    parts = components(name)[:-1]
    return any(part.isdigit() and any(not later.isdigit() for later in parts[i + 1:])
               for i, part in enumerate(parts))


def names_non_vocab_table(name: str) -> bool:
    """Whether ``name`` marks a table as positions, token types or segments (not a vocabulary)."""
    for part in components(name)[:-1]:
        if "position" in part or any(w in NON_VOCAB_WORDS for w in re.split(r"[^a-z]+", part)):
            return True
    return False


PROJECTION_WORDS: frozenset[str] = frozenset({
    "proj", "project", "projection", "linear", "fc", "dense", "out", "head", "to"})
"""Words of a name component that say projection: with an embedding word in the same
component (ELECTRA's ``embeddings_project``, ``embed_proj``) the name says both."""


def says_embedding(part: str) -> bool:
    """Whether a name component says embedding (``pos_emb``, ``wordembed``, ``wte``).

    Haiku's ``unembed`` (the output head) does not.
    """
    words = [w for w in re.split(r"[^a-z]+", part.lower()) if w and not w.startswith("unemb")]
    return part.lower() in TOKEN_EMBEDDING_MARKERS or any(
        w.startswith("emb") or "embed" in w for w in words)


def names_table(name: str) -> bool | None:
    """Whether the modules of ``name`` name a table.

    ``True``; ``None`` if the component that says embedding also says projection
    (``embeddings_project``); ``False`` if none says embedding.
    """
    for part in components(name)[:-1]:
        if says_embedding(part):
            words = set(re.split(r"[^a-z]+", part))
            return None if words & PROJECTION_WORDS else True
    return False


def torch_name_reading(name: str) -> str | None:
    """What PyTorch's names say of a 2-D parameter, in both frameworks.

    ``"table"`` (an ``nn.Embedding`` ``(V, d)``: a module or leaf name that says embedding,
    or a :data:`TABLE_MODULE_NAMES` module), ``"linear"`` (an ``nn.Linear`` ``weight``
    ``(out, in)``; where a component says both embedding and projection, a head name
    (GPT-NeoX's ``embed_out``) reads as a linear, which the head policy may make the head),
    or why the names cannot say: ``"conv1d"`` (:data:`CONV1D_NAMES`),
    ``"ambiguous"`` (embedding and projection in one component), ``"unnamed"`` (no word
    besides indices: ``0.weight`` of an ``nn.Sequential``).  ``None``: not a PyTorch name.
    """
    parts = components(name)
    leaf = parts[-1]
    if leaf in TOKEN_EMBEDDING_MARKERS or leaf in ("embed", "embedding"):
        return "table"
    if leaf != "weight":
        return None
    if names_conv1d(name):
        return "conv1d"
    if names_table_module(name):
        return "table"
    if all(part.isdigit() for part in parts[:-1]):
        return "unnamed"
    table = names_table(name)
    if table is None:  # GPT-NeoX's head embed_out: a head name settles it
        return "linear" if names_head(name) else "ambiguous"
    return "table" if table else "linear"


TORCH_WEIGHT_WHY: dict[str, str] = {
    "unnamed": "its name has no word besides its indices, so it could be an nn.Linear "
               "(out, in) or an nn.Embedding table (V, d), which get different rules",
    "ambiguous": "its name says both an embedding and a projection (ELECTRA's "
                 "embeddings_project is an nn.Linear), so it could be an nn.Linear (out, in) "
                 "or an nn.Embedding table (V, d), which get different rules",
}
"""Why names refuse a 2-D PyTorch ``weight`` (:func:`torch_name_reading`'s refusals)."""


def torch_weight_options(shape: Sequence[int], kind: str | None = None,
                         vocab: int | None = None) -> list[tuple[Any, str]]:
    """The remedies of a 2-D PyTorch ``weight`` the names cannot place, in both frameworks.

    An ``nn.Linear`` ``(out, in)`` first, unless its rows are the token table's ``vocab``
    (then a table or a head first); ``kind`` (an override's or a group's) keeps its reading
    only.  ``'vector'`` last.
    """
    linear = (Route(kind or "dense", fan_in=1, fan_out=0), "it is an nn.Linear weight (out, in)")
    table = (Route(kind or "embedding", fan_in=1, fan_out=0),
             "it is an nn.Embedding table (V, d) or an output head")
    options = [table, linear] if vocab is not None and int(shape[0]) == vocab else [
        linear, table]
    return [*options[:1 if kind else 2], ("vector", "element-wise rules are wanted")]


def names_conv1d(name: str) -> bool:
    """Whether ``name`` is the ``weight`` of a :data:`CONV1D_NAMES` module (``attn.c_attn``)."""
    parts = components(name)
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in CONV1D_NAMES


def names_table_module(name: str) -> bool:
    """Whether ``name`` is the ``weight`` of a :data:`TABLE_MODULE_NAMES` module (a table)."""
    parts = components(name)
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in TABLE_MODULE_NAMES


def conv1d_reading(weights: Sequence[tuple[str, Sequence[int]]], width: int | None) -> str | None:
    """What the shapes of a model's :data:`CONV1D_NAMES` weights say of their layout.

    ``weights`` are ``(name, shape)`` of the 2-D weights that :func:`names_conv1d` flags and
    ``width`` the model width (the token table's ``d``).  ``c_attn``, ``q_attn`` and ``c_fc``
    read the width, ``c_proj`` writes it: a ``c_fc`` of shape ``(d, 4d)`` is ``(in, out)``,
    one of ``(4d, d)`` is ``(out, in)``.  Returns ``"in_out"`` (transformers' ``Conv1D``) or
    ``"out_in"`` (``nn.Linear``) when every non-square weight says the same, else ``None``
    (no width, only square weights, or votes both ways).  This orders the remedies of a
    refusal; it never places a weight.
    """
    if width is None:
        return None
    votes = set()
    for name, shape in weights:
        rows, cols = (int(n) for n in shape)
        if rows == cols or width not in (rows, cols):
            continue
        reads_width = components(name)[-2] in _TAKES_WIDTH
        votes.add("in_out" if (rows == width) == reads_width else "out_in")
    return votes.pop() if len(votes) == 1 else None


def conv1d_refusal(name: str, shape: Sequence[int], reading: str | None, remedy: str,
                   kind: str | None = None) -> RoutingError:
    """The refusal of a 2-D ``weight`` with a :data:`CONV1D_NAMES` name, in both frameworks.

    Both readings, the one ``reading`` (:func:`conv1d_reading`) says first (Conv1D's when it
    says nothing: the names' origin), then ``'vector'``.  ``remedy`` is the framework's
    advice before the overrides ("Pass the model itself ..."); ``kind`` an override's kind.
    """
    shape = tuple(int(n) for n in shape)
    conv = (Route(kind or "dense", fan_in=0, fan_out=1),
            "it is transformers' Conv1D weight (in, out) (GPT-2 and its relatives)")
    linear = (Route(kind or "dense", fan_in=1, fan_out=0),
              "it is an nn.Linear weight (out, in) (nanoGPT, GPTBigCode)")
    options: list[tuple[Any, str]] = [linear, conv] if reading == "out_in" else [conv, linear]
    says = {"in_out": "say Conv1D (in, out)", "out_in": "say nn.Linear (out, in)"}.get(
        reading or "", "do not say which (first: Conv1D, the names' origin)")
    what = f"routed {kind!r}, but " if kind else ""
    return RoutingError(
        f"cannot place parameter {name!r} of shape {shape}: {what}its name is a GPT-2 Conv1D "
        f"name ({', '.join(sorted(CONV1D_NAMES))}): transformers' Conv1D stores it (in, out), "
        "but nanoGPT and GPTBigCode give these names to nn.Linear weights (out, in), so names "
        f"alone cannot tell. {remedy}; the shapes of this model's weights with these names, "
        f"against the token table's width, {says}: "
        + "; ".join(f"{override_advice(name, r)} if {w}" for r, w in options),
        leaf=name, shape=shape, options=[*options, ("vector", "element-wise rules are wanted")])



# ------------------------------------------------------------------------ the output head


@dataclasses.dataclass(frozen=True)
class TableFact:
    """A vocabulary-like table as the head policy sees it: its name and ``(rows, width)``.

    Each framework gathers these from its own evidence (module types, names); the policy
    (:func:`pick_token_table`, :func:`find_head`) is the same for both.

    Attributes:
      name: the table's dotted name.
      rows: the size of its vocab axis (``V``).
      width: the size of its other axis (``d``).
      api: the model's own API says it is the token table (``get_input_embeddings()``).
    """

    name: str
    rows: int
    width: int
    api: bool = False

    @property
    def named_token(self) -> bool:
        """Whether its name marks the token table (``wte``, ``embed_tokens``, ...)."""
        return names_token_embedding(self.name) or components(self.name)[-1] in (
            TOKEN_EMBEDDING_MARKERS)


@dataclasses.dataclass(frozen=True)
class MatrixFact:
    """A dense 2-D matrix that may be the output head.

    Attributes:
      name: its dotted name.
      shape: its shape.
      route: its dense reading (axes and the evidence that gives them).
      by_names: its reading comes from names alone (no module says what it is).
      head_override: the user routed it ``embedding`` (there is then no head to find).
    """

    name: str
    shape: tuple[int, ...]
    route: Route
    by_names: bool = False
    head_override: bool = False

    def sizes(self) -> tuple[int, int] | None:
        """``(fan-in size, fan-out size)``, or ``None`` if the reading is not one axis each."""
        if len(self.shape) != 2 or self.route.fan_in is None or self.route.fan_out is None:
            return None
        if len(self.route.fan_in) != 1 or len(self.route.fan_out) != 1:
            return None
        return self.shape[self.route.fan_in[0]], self.shape[self.route.fan_out[0]]

    def reading(self, kind: str) -> Route:
        """The axes of this matrix under ``kind`` (the remedies of a refusal)."""
        return Route(kind, self.route.fan_in, self.route.fan_out, self.route.batch)


def pick_token_table(tables: Sequence[TableFact]) -> TableFact | None:
    """*The* token table among ``tables``, or ``None`` when nothing singles one out.

    The model's API first (:attr:`TableFact.api`), then the only table, then the only one
    whose name marks the token table.  Both routers choose it here.
    """
    api = [t for t in tables if t.api]
    if api:
        return api[0]
    if len(tables) == 1:
        return tables[0]
    named = [t for t in tables if t.named_token]
    return named[0] if len(named) == 1 else None


@dataclasses.dataclass
class HeadDecision:
    """What :func:`find_head` decided: the head (if any) and the refused candidates.

    Attributes:
      found: ``{name: evidence}`` of the matrix made the head (at most one).
      refused: ``{name: error}`` of the candidates that could not be told apart, all
        mapped to one :class:`RoutingError` (its ``problems`` hold one per candidate).
    """

    found: dict[str, str] = dataclasses.field(default_factory=dict)
    refused: dict[str, RoutingError] = dataclasses.field(default_factory=dict)


def find_head(matrices: Sequence[MatrixFact], tables: Sequence[TableFact],
              token: TableFact | None, *, vocab_size: int | None = None,
              remedy: str = "Name") -> HeadDecision:
    """The output head among ``matrices``, by the shape of the token table: one policy.

    A candidate is a matrix whose ``(fan-in, fan-out)`` sizes are ``(d, V)`` of *the*
    token table ``token`` when it is known, else of any table (with no table at all, any
    matrix whose fan-out is ``vocab_size``).  A candidate is *vocabulary-like* unless every
    table it fits is named as positions, token types or segments; inside numbered layers it
    is a layer's matrix.  Then:

    * the user routed a candidate ``embedding``: no head is looked for;
    * one candidate, vocabulary-like, outside numbered layers, and (when only names say
      what it is) with a head name (``lm_head``, ``head``, ``output``...): the head;
    * several, of which exactly one is vocabulary-like with a head name outside numbered
      layers: that one is the head, the others stay dense;
    * anything else: every candidate is refused by one error; the likeliest head (the last
      vocabulary-like candidate outside numbered layers: heads come after the layers) gets
      ``embedding`` first, the others ``dense`` first.

    ``remedy`` starts the error's advice ("Pass the model itself (...), or name"); the head
    is named after it.
    """
    if token is not None:
        targets: list[tuple[tuple[int | None, int], str, TableFact | None]] = [
            ((token.width, token.rows), f"the token embedding {token.name!r}", token)]
    else:
        targets = [((t.width, t.rows), repr(t.name), t) for t in tables]
        if not tables and vocab_size is not None:
            targets = [((None, vocab_size), f"vocab_size={vocab_size}", None)]
    decision = HeadDecision()
    fits: list[tuple[MatrixFact, list[str], bool]] = []  # (matrix, sources, vocabulary-like)
    for m in matrices:
        sizes = m.sizes()
        if sizes is None:
            continue
        hits = [(src, t) for key, src, t in targets
                if key == sizes or (key[0] is None and key[1] == sizes[1])]
        if hits:
            vocab = token is not None or any(t is None or not names_non_vocab_table(t.name)
                                             for _, t in hits)
            fits.append((m, [src for src, _ in hits], vocab))
    if not fits or any(m.head_override for m, _, _ in fits):
        return decision

    def evidence(sources: list[str], named: bool) -> str:
        return f"head: shape of {_sources(sources)}{' + name' if named else ''}"

    vocabularies = [f for f in fits if f[2] and not in_numbered_layers(f[0].name)]
    named = [f for f in vocabularies if names_head(f[0].name)]
    if len(fits) == 1 and vocabularies and (named or not fits[0][0].by_names):
        m, sources, _ = fits[0]
        decision.found[m.name] = evidence(sources, bool(named))
        return decision
    if len(fits) > 1 and len(named) == 1:
        m, sources, _ = named[0]
        decision.found[m.name] = evidence(sources, True)
        return decision
    likely = vocabularies[-1][0] if vocabularies else None
    problems = []
    for m, sources, _ in fits:
        head = (m.reading("embedding"), "it is the output head (logits over the vocabulary)")
        dense = (m.reading("dense"), "it is an ordinary dense matrix, not the head"
                 + (" (it lies inside numbered layers)" if in_numbered_layers(m.name) else ""))
        problems.append(RoutingError(
            f"cannot tell whether {m.name!r} of shape {m.shape} is the output head: it has "
            f"the shape of {_sources(sources)}", leaf=m.name, shape=m.shape,
            options=[head, dense] if m is likely else [dense, head]))
    listed = "; ".join(
        f"{m.name} {m.shape}: the shape of {_sources(sources)}"
        + ("" if vocab else " (a position/type table)")
        + (" (inside numbered layers)" if in_numbered_layers(m.name) else "")
        for m, sources, vocab in fits)
    first = fits[0]
    if len(fits) > 1:
        why = (f"{len(fits)} matrices have the shape of a vocabulary table "
               f"({', '.join(m.name for m, _, _ in fits)})")
    elif not first[2]:
        why = ("a matrix has the shape of a table whose name says positions, token types or "
               "segments: most likely a layer whose size equals that table's length")
    elif in_numbered_layers(first[0].name):
        why = ("the only matrix with the shape of a table lies inside numbered layers: most "
               "likely a layer's matrix whose size equals the vocabulary (the head may be "
               "tied to the table)")
    else:
        why = ("the only matrix with the shape of a table has no head name (lm_head, head, "
               "output, ...), and names alone do not tell a head from another matrix of the "
               "same shape")
    known = (f"the token embedding is {token.name!r}" if token is not None else
             "the token table is not known (several tables, none the model's input "
             "embeddings or named as the token table, such as 'wte' or 'embed_tokens')")
    head_name = likely.name if likely is not None else fits[-1][0].name
    error = RoutingError(
        f"cannot tell the output head: {why} [{listed}]; {known}. {remedy} the head, e.g. "
        f"route_overrides={{{head_name!r}: 'embedding'}}, or route them all as dense: "
        "route_overrides={" + ", ".join(f"{m.name!r}: 'dense'" for m, _, _ in fits)
        + "}. The block below takes " + ("the likeliest head" if likely is not None else
                                          "none for the head (each lies inside numbered layers)"))
    error.problems = tuple(problems)
    for m, _, _ in fits:
        decision.refused[m.name] = error
    return decision


def _sources(sources: list[str]) -> str:
    """``the table 'a'``, ``the tables 'a', 'b'``, or a source as it is."""
    tables = [s for s in sources if s.startswith("'")]
    if not tables:
        return " and ".join(sources)
    return ("the table " if len(tables) == 1 else "the tables ") + ", ".join(tables)


# ------------------------------------------------------------------- the one decision


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What one framework's evidence says of one parameter: the input of :func:`decide`.

    Attributes:
      name: the parameter's dotted name (overrides are matched against it).
      shape: its shape.
      route: the route its modules, the model's API or its name give (before overrides and
        the head), or the :class:`RoutingError` saying why they cannot.
      head_candidate: it may be the output head by shape (a dense 2-D reading the head
        search looks at: any in ``sage_optax``, ``nn.Linear`` weights in ``sage_torch``).
      by_names: only names say what it is (:class:`MatrixFact`).
      api_token: the model's API says it is the token table.
      given_kind: the kind a ``sage_torch`` param group gives it: not looked at by the head
        search, except that ``'embedding'`` on a candidate names the head.
      final: the error in ``route`` stands whatever the overrides say (a sparse embedding,
        a non-floating dtype).
      layout: where ``route`` refuses a parameter whose modules do give axes (peft's LoRA
        factors of fused experts: no per-expert reading), those axes: an override's kind
        takes them.
    """

    name: str
    shape: tuple[int, ...]
    route: Route | RoutingError
    head_candidate: bool = False
    by_names: bool = False
    api_token: bool = False
    given_kind: str | None = None
    final: bool = False
    layout: Route | None = None


def apply_override(e: Evidence, override: Route, vocab_size: int | None = None,
                   ) -> Route | None:
    """The route an override gives ``e``: its axes, else the evidence's; ``None`` if unknown.

    A kind alone takes the axes the evidence gives (a ``'vector'`` keeps its stacked
    axes); an ``'embedding'`` with no axes but ``vocab_size`` on exactly one of the last two
    axes takes that axis as its vocab axis.  ``None``: nothing gives the axes, and the
    framework refuses with its remedies.
    """
    if override.has_axes or (override.kind == "vector" and override.batch is not None):
        return dataclasses.replace(override, evidence="override")
    default = e.route
    if override.kind == "vector":
        batch = default.batch if isinstance(default, Route) and default.kind == "vector" else ()
        return Route("vector", batch=batch, evidence="override")
    if not isinstance(default, Route) and e.layout is not None:
        default = e.layout
    if isinstance(default, Route) and default.has_axes:
        return Route(override.kind, default.fan_in, default.fan_out, default.batch,
                     evidence=f"override (axes: {default.evidence})", view=default.view)
    if override.kind == "embedding" and vocab_size is not None and len(e.shape) >= 2:
        hits = [a for a in (-2, -1) if e.shape[a] == vocab_size]
        if len(hits) == 1:
            return Route("embedding", -1 if hits[0] == -2 else -2, hits[0],
                         evidence=f"override (vocab axis: vocab_size={vocab_size})")
    return None


def decide(evidence: Sequence[Evidence], overrides: Mapping[str, Route], *,
           refuse_override: Callable[[Evidence, Route], RoutingError],
           vocab_size: int | None = None, find_heads: bool = True,
           head_remedy: str = "Name") -> dict[str, Route | RoutingError]:
    """Every parameter's route, or the error that refuses it: one decision for both frameworks.

    Each framework gathers the :class:`Evidence`; this decides.  In order: the overrides
    (:func:`apply_override`; ``refuse_override(e, override)`` when nothing gives an
    override's axes), then the output head by shape (:func:`find_head` over the tables and
    the candidates left, the token table by :func:`pick_token_table`), unless
    ``find_heads`` is false (the model's API names its head).  Pure: the same evidence gives
    the same decision in either framework.

    Returns:
      ``{name: route or error}``; several parameters may share one error (a refused head).
    """
    out: dict[str, Route | RoutingError] = {}
    for e in evidence:
        override = overrides.get(e.name)
        if override is None or e.final:
            out[e.name] = e.route
        else:
            routed = apply_override(e, override, vocab_size)
            out[e.name] = routed if routed is not None else refuse_override(e, override)
    if not find_heads:
        return out
    tables = []
    for e in evidence:
        r = out[e.name]
        if (e.name in overrides or e.given_kind is not None or not isinstance(r, Route)
                or r.kind != "embedding" or len(e.shape) != 2 or r.fan_in is None
                or r.fan_out is None or len(r.fan_in) != 1 or len(r.fan_out) != 1):
            continue
        tables.append(TableFact(e.name, e.shape[r.fan_out[0]], e.shape[r.fan_in[0]],
                                api=e.api_token))
    matrices = []
    for e in evidence:
        named_head = (overrides[e.name].kind if e.name in overrides else e.given_kind
                      ) == "embedding"
        placed = e.name in overrides or e.given_kind is not None
        if (not e.head_candidate or not isinstance(e.route, Route)
                or e.route.kind != "dense" or len(e.shape) != 2 or (placed and not named_head)):
            continue
        matrices.append(MatrixFact(e.name, e.shape, e.route, by_names=e.by_names,
                                   head_override=named_head))
    decision = find_head(matrices, tables, pick_token_table(tables), vocab_size=vocab_size,
                         remedy=head_remedy)
    for name, error in decision.refused.items():
        out[name] = error
    for name, found in decision.found.items():
        r = out[name]
        assert isinstance(r, Route)
        out[name] = dataclasses.replace(r, kind="embedding", evidence=found)
    return out
