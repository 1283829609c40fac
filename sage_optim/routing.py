"""What both routers share: the route of one leaf, the override grammar, errors, adapters.

SAGE and SinkGD are not transpose-invariant, so the axes a router gives each parameter
decide the math.  Both gatherers (:mod:`sage_optax.routing`, :mod:`sage_torch.routing`)
speak the language defined here: :class:`Route`, the override grammar
(:func:`match_overrides`), :class:`RoutingError` and :class:`AdapterRegistry`.  The name
rules are :mod:`sage_optim.naming`, the decision :mod:`sage_optim.decision`;
``docs/routing.md`` states the conventions.  No framework here.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import importlib
import math
import pathlib
import pkgutil
import re
import sys
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Protocol, TypeAlias, TypeVar

from sage_optim.presets import KINDS

Axes: TypeAlias = "int | tuple[int, ...] | None"
"""One axis, a group of axes, or ``None`` (no such axis: a vector)."""

Option: TypeAlias = "tuple[Any, str]"
"""``(route, when)``: a remedy and when it is right ("it is a stack of (in, out) ...")."""

VECTOR_OPTION: tuple[str, str] = ("vector", "element-wise rules are wanted")
"""The last remedy of a refusal: the element-wise rules."""

ROUTE_IS = "(Route is sage_optim.routing.Route, also sage_torch.Route)"
"""The last line of a ``sage_torch`` refusal that lists its remedies."""


class RoutingError(ValueError):
    """A parameter the router cannot place, or an override that does not apply.

    The message names the parameter's path and shape and the override that fixes it.  Both
    frameworks raise this one type, *one* error for all the parameters they cannot place
    (:meth:`combine`; ``docs/routing.md``, "One error for everything the router cannot place").

    Attributes:
      leaf: the parameter's name, when the error is about one parameter.
      shape: its shape.
      options: the remedies, most likely first: ``(route, when)`` pairs, where ``route``
        is a :class:`Route` (or a kind) and ``when`` completes "right if ..." ("it is a
        stack of (in, out) matrices", ...).
      problems: the per-parameter errors a combined error holds (itself for one).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
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
        """The suggested ``route_overrides``: the dict the paste block prints."""
        return {pattern: rows[0].options[0][0]
                for pattern, rows in override_patterns(self.problems, self.names).items()}

    #: Every parameter name of the tree the error is about (``None``: unknown); the paste
    #: block's globs are checked against it, so that none reaches a parameter it is not for.
    names: tuple[str, ...] | None = None

    @classmethod
    def combine(cls, errors: Sequence[RoutingError], *, fix: str | None = None,
                names: Sequence[str] | None = None) -> RoutingError:
        """One error for every parameter in ``errors``, with one paste block for all.

        The first line is the fix (at most :data:`HEADLINE_LIMIT` characters), then one
        bullet per layer role, then the block (``docs/routing.md``, "One error for
        everything the router cannot place"); one refusal keeps its own message.

        Args:
          errors: the per-parameter refusals.
          fix: the caller's first remedy, e.g. ``"pass model=model to make_optimizer"``.
          names: every parameter name of the tree, to check the block's globs against.
        """
        problems = tuple(p for e in errors for p in (e.problems or (e,)))
        known = None if names is None else tuple(names)
        groups = override_patterns(problems, known)
        more = {id(rows[0]): (p, len(rows) - 1) for p, rows in groups.items() if len(rows) > 1}
        repeated = {id(r) for rows in groups.values() for r in rows[1:]}
        details = [str(e).replace("\n", "\n  ") + (
            f" (the same for {more[id(e)][1]} more parameter{'s' if more[id(e)][1] > 1 else ''}"
            f" matching {more[id(e)][0]!r})" if id(e) in more else "")
            for e in errors if id(e) not in repeated]
        block = paste_block(problems, known)
        count = f"cannot place {len(errors)} parameter{'s' if len(errors) != 1 else ''}"
        lines = [f"{count}:", *("* " + d for d in details)]
        if len(errors) == 1:  # one refusal: its own message says the remedy first
            lines = [str(errors[0])]
        elif block:
            paste = "paste the route_overrides block at the end (err.overrides)"
            headline = f"Fix: {fix}, or {paste}; {count}, details below"
            if not fix or len(headline) > HEADLINE_LIMIT:
                headline = (f"Fix: {paste} into make_optimizer, checked against the model's "
                            f"forward code; {count}, details below")
            lines[0] = headline
        out = cls("\n".join(lines + ([block] if block else [])))
        out.problems, out.names = problems, known
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
        view = ()
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
      view: ``None``, or the shape the leaf is viewed as before the math (a row-major
        reshape, ``p.view(view)``): the axes then count in the view.  ``sage_torch``
        applies it, ``sage_optax`` refuses it (``docs/routing.md``, "Mixture-of-experts
        models (PyTorch)").

    Axes may be negative; integers are stored as one-axis groups (``docs/routing.md``,
    "Kinds and axes", lists the common layouts).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
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
        shape = self._viewed(leaf_shape, name)
        self._check_matrix(shape, name)
        fan_in = _norm_axes(self.fan_in, shape, name, "fan_in")
        fan_out = _norm_axes(self.fan_out, shape, name, "fan_out")
        taken = fan_in + fan_out
        where = f"parameter {name!r} of shape {shape}"
        if len(set(taken)) != len(taken):
            raise RoutingError(f"{where}: an axis is listed twice in "
                               f"fan_in={self.fan_in}, fan_out={self.fan_out}")
        rest = tuple(a for a in range(len(shape)) if a not in taken)
        batch = rest if self.kind != "vector" else ()
        if self.batch is not None:
            batch = _norm_axes(self.batch, shape, name, "batch")
            if self.kind != "vector" and sorted(batch) != list(rest):
                raise RoutingError(
                    f"{where}: batch axes {self.batch} must be exactly the axes other than "
                    f"fan_in={self.fan_in} and fan_out={self.fan_out}")
        return ResolvedRoute(self.kind, fan_in, fan_out, batch, leaf_shape, self.evidence,
                             view=self.view)

    def _viewed(self, shape: tuple[int, ...], name: str) -> tuple[int, ...]:
        """``shape``, or the view the route reads it as (checked to hold as many elements)."""
        if self.view is not None and math.prod(self.view) != math.prod(shape):
            raise RoutingError(
                f"parameter {name!r} of shape {shape}: its route views it as {self.view}, "
                f"which has {math.prod(self.view)} elements, not {math.prod(shape)}")
        return shape if self.view is None else tuple(self.view)

    def _check_matrix(self, shape: tuple[int, ...], name: str) -> None:
        """Refuse a matrix route without axes, or on fewer than two dimensions."""
        if self.kind != "vector" and not self.has_axes:
            raise RoutingError(
                f"parameter {name!r} of shape {shape} is routed {self.kind!r} without axes; "
                f"give them, e.g. Route({self.kind!r}, fan_in=..., fan_out=...)")
        if self.kind != "vector" and len(shape) < 2:
            raise RoutingError(
                f"parameter {name!r} of shape {shape} is routed {self.kind!r}, but it has fewer "
                "than two dimensions; route it 'vector'")


def _norm_axes(group: tuple[int, ...] | None, shape: tuple[int, ...], name: str,
               what: str) -> tuple[int, ...]:
    """``group``'s axes made non-negative for ``shape`` (an axis out of range is refused)."""
    ndim = len(shape)
    for a in group or ():
        if not -ndim <= a < ndim:
            raise RoutingError(f"parameter {name!r} of shape {shape}: {what} axis {a} is out "
                               "of range")
    return tuple(a % ndim for a in group or ())


@dataclasses.dataclass(frozen=True)
class ResolvedRoute:
    """A :class:`Route` checked against a shape: non-negative axis groups.

    What every transform works with: ``fan_in``, ``fan_out`` and ``batch`` are tuples of
    axes (empty for a vector), counted in :attr:`axes_shape`; ``shape`` is the leaf's.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
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
    return f"{axes} ({'x'.join(map(str, sizes))}={math.prod(sizes)})"


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
                    "fan_out and batch")
            return Route(kind, **rest[0])
    raise RoutingError(
        f"override {pattern!r} -> {value!r}: give a kind {KINDS}, a Route(kind, fan_in=..., "
        "fan_out=...) or (kind, {'fan_in': ..., 'fan_out': ...})")


def match_overrides(
    names: Sequence[str], overrides: Mapping[str, Any] | None
) -> dict[str, Route]:
    """The override route of every name that a glob matches (first matching glob wins).

    Raises:
      RoutingError: a glob that matches no name (the message lists the nearest names), or
        an override value that is not a valid route.
    """
    parsed = {pattern: parse_override(pattern, value) for pattern, value in
              (overrides or {}).items()}
    out: dict[str, Route] = {}
    used: set[str] = set()
    for name in names:
        pattern = next((p for p in parsed if fnmatch.fnmatchcase(name, p)), None)
        if pattern is not None:
            out[name] = parsed[pattern]
            used.add(pattern)
    hints = [f"{p!r} (nearest: {', '.join(near) or 'none'})" for p in parsed if p not in used
             for near in [difflib.get_close_matches(p, list(names), n=3, cutoff=0.4)]]
    if hints:
        raise RoutingError(
            "route override(s) match no parameter: " + "; ".join(hints)
            + ". Patterns are fnmatch globs over dotted names, e.g. 'layers.*.attn.q_proj.weight'"
        )
    return out


def override_advice(name: str, route: Route | None = None) -> str:
    """The override that places ``name`` as ``route`` (or a template), for error messages."""
    if route is None:
        return (
            f"route_overrides={{{name!r}: Route('dense', fan_in=..., fan_out=...)}} "
            "(or 'embedding' for a vocabulary matrix, 'vector' for element-wise rules)"
        )
    return f"route_overrides={{{name!r}: {route_literal(route)}}}"


def advice_lines(name: str, options: Sequence[Option]) -> str:
    """``  - <when>: route_overrides={name: route}`` per option, for a refusal's message."""
    return "\n".join(
        f"  - {when.removeprefix('it is ') if route != 'vector' else 'element-wise rules only'}"
        f": route_overrides={{{name!r}: {route_literal(route)}}}" for route, when in options)


def fmt_shape(shape: Sequence[int]) -> str:
    """``shape`` as a tuple of ints, as refusals print it: ``(768, 3072)``."""
    return str(tuple(int(s) for s in shape))


def route_literal(route: Any) -> str:
    """``route`` as Python source: ``'vector'`` or ``Route('dense', fan_in=0, fan_out=1)``."""
    if isinstance(route, str):
        return repr(route)
    if route.kind == "vector" and not route.batch:
        return "'vector'"
    args = [repr(route.kind)] + [
        f"{key}={group[0] if len(group) == 1 else group}"
        for key in ("fan_in", "fan_out") if (group := getattr(route, key)) is not None]
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

    Names that differ only in their numbers, with the same first remedy, share a glob with
    ``*`` for the numbers; a glob that would match another of ``names`` is not used.
    """
    by_role: dict[tuple[Any, ...], list[RoutingError]] = {}
    for p in problems:
        if p.leaf is not None and p.options:
            key = (tuple(_DIGITS.split(p.leaf)), route_literal(p.options[0][0]))
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
            out.update({str(m.leaf): [m] for m in members})
        else:
            out[pattern] = members
    return out


def paste_block(problems: Sequence[RoutingError], names: Sequence[str] | None = None) -> str:
    """The ``route_overrides = {...}`` block of a routing error (``""`` if nothing to paste).

    One line per layer role (:func:`override_patterns`): its first remedy, the others and
    when each is right in a comment.
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
    return "\n".join([*lines, "}"])


# ------------------------------------------------------------------------- the adapters

class _Named(Protocol):
    @property
    def name(self) -> str: ...


A = TypeVar("A", bound=_Named)


class AdapterRegistry(Generic[A]):
    """The adapters of one framework's gatherer: ``<package>/adapters/<library>.py``.

    Each adapter module registers itself (:meth:`register`) in ``registered`` (by name);
    :meth:`all` imports those of the libraries imported so far (``eager``: every one).
    """

    def __init__(self, kind: type[A], package: str, directory: pathlib.Path,
                 eager: bool = False) -> None:
        self.kind, self.package, self.directory, self.eager = kind, package, directory, eager
        self.registered: dict[str, A] = {}

    def register(self, adapter: A) -> A:
        """Add ``adapter`` to the evidence of every later routing (replaces one of its name)."""
        if not isinstance(adapter, self.kind):
            raise TypeError(f"register_adapter takes an Adapter, got a {type(adapter).__name__}")
        self.registered[adapter.name] = adapter
        return adapter

    def all(self) -> tuple[A, ...]:
        """The registered adapters, after loading those of the libraries imported so far."""
        for library in self._libraries():
            if (self.eager or library in sys.modules) and library not in self.registered:
                importlib.import_module(f"{self.package}.adapters.{library}")
        return tuple(self.registered.values())

    @functools.cache  # noqa: B019 (one registry per gatherer, alive as long as it)
    def _libraries(self) -> tuple[str, ...]:
        return tuple(info.name for info in pkgutil.iter_modules([str(self.directory)]))
