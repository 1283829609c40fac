"""The one decision of both routers: overrides over the gathered evidence, then the head.

Each framework gathers :class:`Evidence` per parameter; :func:`decide` applies the
overrides and finds the output head by the shape of the token table (:func:`find_head`):
the same evidence gives the same decision in either framework.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from sage_optim.naming import (
    TOKEN_EMBEDDING_MARKERS,
    components,
    convention_readings,
    in_numbered_layers,
    names_head,
    names_non_vocab_table,
    names_token_embedding,
    torch_name_reading,
)
from sage_optim.routing import Route, RoutingError


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
        return _sizes(self.shape, self.route)

    def reading(self, kind: str) -> Route:
        """The axes of this matrix under ``kind`` (the remedies of a refusal)."""
        return Route(kind, self.route.fan_in, self.route.fan_out, self.route.batch)


def _sizes(shape: tuple[int, ...], route: Route) -> tuple[int, int] | None:
    """``(fan-in size, fan-out size)`` of a 2-D ``route`` of one axis each, else ``None``."""
    if len(shape) != 2 or len(route.fan_in or ()) != 1 or len(route.fan_out or ()) != 1:
        return None
    return shape[route.fan_in[0]], shape[route.fan_out[0]]


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


def torch_name_facts(weights: Sequence[tuple[str, Sequence[int]]]
                     ) -> tuple[TableFact | None, dict[str, str | None]]:
    """What a tree of PyTorch names says: *the* token table, and each convention's reading.

    The tables are the 2-D parameters :func:`~sage_optim.naming.torch_name_reading` calls
    one; the conventions' readings (:func:`~sage_optim.naming.convention_readings`) are made
    against the token table's width.  Both gatherers read names without a model so.
    """
    token = pick_token_table([TableFact(n, int(s[0]), int(s[1])) for n, s in weights
                              if len(s) == 2 and torch_name_reading(n) == "table"])
    return token, convention_readings(weights, token.width if token is not None else None)


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
    matrix whose fan-out is ``vocab_size``); ``docs/routing.md`` ("Heads") states which
    candidate is the head and when all are refused by one error, whose advice starts with
    ``remedy`` ("Pass the model itself (...), or name").
    """
    decision = HeadDecision()
    fits = _head_fits(matrices, _head_targets(tables, token, vocab_size), token)
    if not fits or any(m.head_override for m, _, _ in fits):
        return decision
    vocabularies = [f for f in fits if f[2] and not in_numbered_layers(f[0].name)]
    named = [f for f in vocabularies if names_head(f[0].name)]
    one = len(fits) == 1 and vocabularies and (named or not fits[0][0].by_names)
    if one or (len(fits) > 1 and len(named) == 1):
        m, sources, _ = fits[0] if one else named[0]
        decision.found[m.name] = f"head: shape of {_sources(sources)}{' + name' if named else ''}"
        return decision
    error = _head_refusal(fits, vocabularies[-1][0] if vocabularies else None, token, remedy)
    decision.refused.update({m.name: error for m, _, _ in fits})
    return decision


_Target = tuple[tuple[int | None, int], str, TableFact | None]
"""``((fan-in size or None, fan-out size), source, table)``: what a head's shape may match."""

_Fit = tuple[MatrixFact, list[str], bool]
"""``(matrix, the sources it fits, vocabulary-like)``: a head candidate."""


def _head_targets(tables: Sequence[TableFact], token: TableFact | None,
                  vocab_size: int | None) -> list[_Target]:
    """The shapes a head may have: the token table's, else every table's, else ``vocab_size``."""
    if token is not None:
        return [((token.width, token.rows), f"the token embedding {token.name!r}", token)]
    if not tables and vocab_size is not None:
        return [((None, vocab_size), f"vocab_size={vocab_size}", None)]
    return [((t.width, t.rows), repr(t.name), t) for t in tables]


def _head_fits(matrices: Sequence[MatrixFact], targets: list[_Target],
               token: TableFact | None) -> list[_Fit]:
    """The matrices with a head's shape, the sources they fit, and whether vocabulary-like."""
    fits: list[_Fit] = []
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
    return fits


def _head_refusal(fits: list[_Fit], likely: MatrixFact | None, token: TableFact | None,
                  remedy: str) -> RoutingError:
    """One error for every candidate; ``likely`` (the likeliest head) gets ``embedding`` first."""
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
    known = (f"the token embedding is {token.name!r}" if token is not None else
             "the token table is not known (several tables, none the model's input "
             "embeddings or named as the token table, such as 'wte' or 'embed_tokens')")
    head_name = likely.name if likely is not None else fits[-1][0].name
    error = RoutingError(
        f"cannot tell the output head: {_head_why(fits)} [{listed}]; {known}. {remedy} the "
        f"head, e.g. route_overrides={{{head_name!r}: 'embedding'}}, or route them all as "
        "dense: route_overrides={" + ", ".join(f"{m.name!r}: 'dense'" for m, _, _ in fits)
        + "}. The block below takes " + ("the likeliest head" if likely is not None else
                                          "none for the head (each lies inside numbered layers)"))
    error.problems = tuple(problems)
    return error


def _head_why(fits: list[_Fit]) -> str:
    """Why the candidates cannot be told apart (the refusal's reason)."""
    first = fits[0]
    if len(fits) > 1:
        return (f"{len(fits)} matrices have the shape of a vocabulary table "
                f"({', '.join(m.name for m, _, _ in fits)})")
    if not first[2]:
        return ("a matrix has the shape of a table whose name says positions, token types or "
                "segments: most likely a layer whose size equals that table's length")
    if in_numbered_layers(first[0].name):
        return ("the only matrix with the shape of a table lies inside numbered layers: most "
                "likely a layer's matrix whose size equals the vocabulary (the head may be "
                "tied to the table)")
    return ("the only matrix with the shape of a table has no head name (lm_head, head, "
            "output, ...), and names alone do not tell a head from another matrix of the "
            "same shape")


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
    placed = {e.name for e in evidence if e.name in overrides or e.given_kind is not None}
    tables = [TableFact(e.name, sizes[1], sizes[0], api=e.api_token) for e in evidence
              if e.name not in placed and isinstance(r := out[e.name], Route)
              and r.kind == "embedding" and (sizes := _sizes(e.shape, r)) is not None]
    matrices = []
    for e in evidence:
        named_head = (overrides[e.name].kind if e.name in overrides else e.given_kind
                      ) == "embedding"
        if (e.head_candidate and isinstance(e.route, Route) and e.route.kind == "dense"
                and len(e.shape) == 2 and (named_head or e.name not in placed)):
            matrices.append(MatrixFact(e.name, e.shape, e.route, by_names=e.by_names,
                                       head_override=named_head))
    decision = find_head(matrices, tables, pick_token_table(tables), vocab_size=vocab_size,
                         remedy=head_remedy)
    out.update(decision.refused)
    for name, found in decision.found.items():
        r = out[name]
        assert isinstance(r, Route)
        out[name] = dataclasses.replace(r, kind="embedding", evidence=found)
    return out
