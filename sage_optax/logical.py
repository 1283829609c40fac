"""Logical axis names as routing evidence: the sharding names that JAX models give each axis.

MaxText, nanodo-style linen models, T5X and most flax LLM code name every parameter axis for
sharding: linen ``nn.with_partitioning(init, ("embed", "mlp"))`` or
``nn.with_logical_partitioning`` (an ``nn.Partitioned``/``nn.LogicallyPartitioned`` box
around the array), nnx ``nnx.with_partitioning`` or ``kernel_metadata={"out_sharding": ...}``
(the ``out_sharding`` metadata of an ``nnx.Param``; ``sharding``/``sharding_names`` in older
flax), and ``nn.scan``/``nn.vmap``/``nnx.vmap``/``nnx.scan`` insert the name of the axis they
stack (``metadata_params={nn.PARTITION_NAME: "layers"}``).  Those names say which axes are
the fan-in, the fan-out, the vocabulary, the experts or the stacked layers.

:data:`AXIS_ROLES` maps the conventional names to a role (:data:`ROLES`); a user's
``axis_roles={name: role}`` extends or overrides it, as flax's logical axis rules extend the
mesh mapping.  The roles:

* ``"batch"``: independent copies: experts (``exp``), scanned layers (``layers``), pipeline
  stages (``stage``).  Each copy gets its own matrix step.
* ``"embed"``: the model width.  It is the fan-in of a matrix it starts (``("embed",
  "mlp")``, ``("embed", "heads", "kv")``) and the fan-out of one it ends (``("mlp",
  "embed")``, ``("heads", "kv", "embed")``): a flax kernel is ``x @ W``, inputs first.  Every
  other matrix axis is on the other side, merged into one group.
* ``"vocab"``: the rows of a table (tokens, relative-position buckets): the vocab axis
  (fan-out) of an ``embedding`` leaf, for a table ``("vocab", "embed")`` and an untied head
  ``("embed", "vocab")`` alike.
* ``"heads"``: attention's head axes (``heads``, ``kv``, ``head_dim``, ``joined_kv``...):
  one group, on the side ``embed`` is not; without ``embed``, the group after a ``hidden``
  one (``("q_lora", "q_heads", "kv")``) is the fan-out.
* ``"hidden"``: another inner width (``mlp``, LoRA ranks ``q_lora``/``kv_lora``): one group.
* ``"fan_in"``/``"fan_out"``: the side itself, wherever the axis stands.
* ``"feature"``: a vector's feature axis with no matrix role (a norm's ``norm``).
* ``None`` (in ``axis_roles``): the name says nothing (a mesh axis name such as ``"data"``).

A leaf's names decide when they place every axis; where they leave an axis of a matrix
with three or more axes unexplained (an unknown name or ``None``), or contradict each other
(``embed`` twice or in the middle, three groups), the leaf is refused with the reading the
names suggest first.  Names that place nothing (all ``None`` or unknown) leave the leaf to
the other evidence.  See ``docs/routing.md``, "Logical axis names".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from sage_optim import naming
from sage_optim import routing as core
from sage_optim.routing import Route, RoutingError

ROLES: tuple[str, ...] = (
    "batch", "embed", "vocab", "heads", "hidden", "fan_in", "fan_out", "feature")
"""The roles an axis name can have (:mod:`sage_optax.logical`'s docstring defines them)."""

AXIS_ROLES: Mapping[str, str] = {
    # independent copies
    "layers": "batch", "layer": "batch", "stage": "batch", "stages": "batch",
    "exp": "batch", "expert": "batch", "experts": "batch", "num_experts": "batch",
    # the model width
    "embed": "embed", "embed_no_exp": "embed", "emb": "embed", "d_model": "embed",
    # table rows
    "vocab": "vocab", "relpos_buckets": "vocab",
    # attention heads
    "heads": "heads", "q_heads": "heads", "kv_heads": "heads", "kv": "heads",
    "head_dim": "heads", "kv_head_dim": "heads", "joined_kv": "heads", "qkv": "heads",
    # other inner widths
    "mlp": "hidden", "mlp_no_fsdp": "hidden", "q_lora": "hidden", "kv_lora": "hidden",
    "num_activations": "hidden",
    # vector features
    "norm": "feature",
}
"""Conventional logical axis names (MaxText, T5X, nanodo-style flax) and their roles."""

Names = tuple[Any, ...]


def check_axis_roles(axis_roles: Mapping[str, Any] | None) -> dict[str, str | None]:
    """The table with ``axis_roles`` laid over it.

    Raises:
      ValueError: a name that is not a string, or a role not in :data:`ROLES` (nor ``None``).
    """
    table: dict[str, str | None] = dict(AXIS_ROLES)
    if axis_roles is None:
        return table
    if not isinstance(axis_roles, Mapping):
        raise ValueError(f"axis_roles must be a dict {{axis name: role}}, got {axis_roles!r}")
    for name, role in axis_roles.items():
        if not isinstance(name, str):
            raise ValueError(f"axis_roles: axis name {name!r} is not a string")
        if role is not None and role not in ROLES:
            raise ValueError(
                f"axis_roles[{name!r}] = {role!r}: the role must be one of {ROLES} or None")
        table[name] = role
    return table


def _names_of_box(x: Any) -> Names | None:
    """The axis names a flax box holds (``nn.Partitioned``, an ``nnx.Variable``), or None."""
    names = getattr(x, "names", None)
    if names is not None and hasattr(x, "unbox"):  # linen nn.Partitioned/LogicallyPartitioned
        return tuple(names)
    get = getattr(x, "get_metadata", None)
    if get is not None and hasattr(x, "get_value"):
        meta = get()
        for key in ("out_sharding", "sharding_names", "sharding"):
            value = meta.get(key)
            if value:
                return tuple(getattr(value, "spec", value))
    return None


def _is_names(x: Any) -> bool:
    return isinstance(x, tuple) and all(n is None or isinstance(n, str) for n in x)


def _is_names_leaf(x: Any) -> bool:
    return (_names_of_box(x) is not None or _is_names(x)
            or isinstance(x, jax.sharding.PartitionSpec))


def names_of(tree: Any) -> dict[str, Names]:
    """The axis names of every leaf of ``tree`` that has them, keyed by dotted path.

    ``tree`` holds ``nn.Partitioned``/``nn.LogicallyPartitioned`` boxes (linen params as
    ``init`` returns them), ``nnx.Variable`` boxes (``nnx.state(model, nnx.Param)``), the
    ``PartitionSpec`` tree of ``nn.get_partition_spec``, or tuples of names; an
    ``nnx.Module`` is read through its ``nnx.Param`` state.  Leaves without names are left out.
    """
    try:
        from flax import nnx

        if isinstance(tree, nnx.Module):
            tree = nnx.state(tree, nnx.Param)
    except ImportError:  # pragma: no cover - flax is optional
        pass
    from sage_optax import axes as axes_lib

    out: dict[str, Names] = {}
    found, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_names_leaf)
    for path, x in found:
        names = _names_of_box(x)
        if names is None and (_is_names(x) or isinstance(x, jax.sharding.PartitionSpec)):
            names = tuple(x)
        if names and any(n is not None for n in names):
            key = axes_lib.path_str(path)
            out[key] = names
            if key.startswith("params."):  # the variables of a linen module: its params too
                out.setdefault(key.removeprefix("params."), names)
    return out


@dataclasses.dataclass(frozen=True)
class _Axes:
    """A leaf's names read through the role table."""

    names: Names
    roles: tuple[str | None, ...]  # None: the name places nothing (None, unknown, role None)

    @property
    def said(self) -> str:
        return "axis names (" + ", ".join(repr(n) for n in self.names) + ")"


def _roles(names: Names, table: Mapping[str, str | None]) -> tuple[str | None, ...]:
    return tuple(table.get(n) if isinstance(n, str) else None for n in names)


def route_from_names(name: str, shape: tuple[int, ...], names: Names,
                     table: Mapping[str, str | None], *, torch_order: bool = False,
                     ) -> Route | RoutingError | None:
    """The route that ``names`` (one per axis of ``shape``) give the leaf ``name``.

    ``None`` when the names place nothing (every name ``None``, unknown or of role ``None``)
    or too little for a vector; a :class:`RoutingError` when they leave a matrix axis
    unexplained or contradict each other, with the reading they suggest first.
    ``torch_order``: matrices are ``(out, in)`` (``layout="torch"``), so ``embed`` first is
    the fan-out.
    """
    ndim = len(shape)
    if len(names) != ndim:
        return RoutingError(
            f"parameter {name!r} of shape {shape} has {len(names)} axis names {tuple(names)} "
            f"for {ndim} axes; fix its partitioning annotation", leaf=name, shape=shape,
            options=[("vector", "element-wise rules are wanted")])
    ax = _Axes(tuple(names), _roles(tuple(names), table))
    if all(r is None for r in ax.roles):
        return None
    batch = tuple(i for i, r in enumerate(ax.roles) if r == "batch")
    rest = [i for i in range(ndim) if i not in batch]
    leaf = naming.components(name)[-1]
    if not rest:
        return None
    vector = Route("vector", batch=batch, evidence=ax.said)
    if len(rest) == 1:
        return vector
    if leaf in naming.VECTOR_NAMES or leaf == "offset":
        if any(ax.roles[i] is None for i in rest):
            return None  # an unnamed axis may be a stack: the other evidence decides
        return vector
    if leaf in ("embedding", "embeddings") and len(rest) == 2 and not any(
            ax.roles[i] in ("vocab", "fan_in", "fan_out") for i in rest):
        # a looked-up table (V, d): its width is its fan-in wherever it stands
        width = [i for i in rest if ax.roles[i] == "embed"]
        fan_in = width[0] if width else rest[1]
        fan_out = rest[0] if fan_in == rest[1] else rest[1]
        return Route("embedding", fan_in, fan_out, batch, evidence=ax.said + " (a table)")
    return _matrix(name, shape, ax, batch, rest, torch_order)


@dataclasses.dataclass(frozen=True)
class _MatrixLeaf:
    """What the matrix reading of one leaf works from."""

    name: str
    shape: tuple[int, ...]
    ax: _Axes
    batch: tuple[int, ...]
    rest: list[int]  # the non-batch axes, in array order
    order: list[int]  # ``rest`` in x @ W order: inputs first
    side: dict[int, str]  # the axes whose role is a side: "in" (fan_in) or "out" (fan_out)

    def axes_of(self, role: str) -> list[int]:
        """The non-batch axes whose name has the role ``role``."""
        return [i for i in self.rest if self.ax.roles[i] == role]

    def placed(self) -> list[int]:
        """The non-batch axes that a role or a side places, in array order."""
        return [i for i in self.rest if self.ax.roles[i] is not None or i in self.side]

    def has_unplaced_axis(self) -> bool:
        """Whether an axis of a matrix with three or more axes has no role."""
        return len(self.rest) > 2 and any(self.ax.roles[i] is None for i in self.rest)


def _matrix(name: str, shape: tuple[int, ...], ax: _Axes, batch: tuple[int, ...],
            rest: list[int], torch_order: bool) -> Route | RoutingError | None:
    """The matrix route of ``rest`` (the non-batch axes), or why the names cannot give it."""
    side = {i: "in" if ax.roles[i] == "fan_in" else "out" for i in rest
            if ax.roles[i] in ("fan_in", "fan_out")}
    m = _MatrixLeaf(name, shape, ax, batch, rest, rest[::-1] if torch_order else rest, side)
    vocab, embed = m.axes_of("vocab"), m.axes_of("embed")
    if (len(vocab) > 1 or len(embed) > 1) and len(rest) == 2:
        return None  # ("embed", "embed"): a square width matrix; the leaf name decides
    if len(vocab) > 1 or (vocab and embed and len(embed) > 1):
        return _refuse(m, "two axes name the vocabulary or the width", None)
    if vocab:
        return _vocab_route(m, vocab)
    if len(embed) > 1:
        return _refuse(m, "'embed' names two axes", None)
    guess = _embed_sides(m, embed[0]) if embed else _group_sides(m)
    if guess is None or isinstance(guess, RoutingError):
        return guess
    return _dense_route(m, guess)


def _refuse(m: _MatrixLeaf, why: str, guess: dict[int, str] | None,
            kind: str = "dense") -> RoutingError:
    """The refusal of ``m`` because ``why``; ``guess`` (sides by axis) is offered first.

    The reading ``guess`` suggests (:func:`_complete`) is the first remedy where it has both
    sides, as a ``kind`` route; then a stack of ``(in, out)`` matrices, then a vector.
    Unknown names are named with the ``axis_roles`` that would explain them.
    """
    roles, rest = m.ax.roles, m.rest
    options: list[tuple[Any, str]] = []
    if guess is not None:
        guess = _complete(guess, [i for i in rest if i not in guess])
        fi = tuple(i for i in rest if guess.get(i) == "in")
        fo = tuple(i for i in rest if guess.get(i) == "out")
        if fi and fo:
            gb = tuple(i for i in range(len(m.shape)) if i not in fi + fo)
            options.append((Route(kind, fi, fo, gb),
                            "the named axes are read as their names say"
                            + (" and the unnamed ones are stacked copies" if
                               set(gb) - set(m.batch) else "")))
    options += [(Route("dense", -2, -1), "it is a stack of (in, out) matrices"),
                ("vector", "element-wise rules are wanted")]
    unknown = sorted({str(m.ax.names[i]) for i in rest if roles[i] is None
                      and m.ax.names[i] is not None})
    hint = (f"; name the role of {', '.join(repr(u) for u in unknown)} with "
            f"axis_roles={{{unknown[0]!r}: 'batch' or 'fan_in' or ...}}" if unknown else "")
    return RoutingError(
        f"cannot place {m.name!r} of shape {m.shape} by its {m.ax.said}: {why}{hint}, or give "
        "it, e.g. " + core.override_advice(m.name, options[0][0]),
        leaf=m.name, shape=m.shape, options=options)


def _vocab_route(m: _MatrixLeaf, vocab: list[int]) -> Route | RoutingError:
    """A table or head with one ``vocab`` axis: the vocab is the fan-out, the rest the width.

    Refused where a side calls the vocab axis the fan-in, where an axis of three or more
    has no role, or where no axis is left for the width.
    """
    if any(m.side.get(i) == "in" for i in vocab):
        return _refuse(m, "a vocab axis is named the fan-in", None, "embedding")
    table = {i: ("out" if i in vocab else m.side.get(i, "in")) for i in m.rest}
    if any(m.ax.roles[i] is None for i in m.rest) and len(m.rest) > 2:
        return _refuse(m, "an axis has no role", table, "embedding")
    fo = tuple(i for i in m.rest if table[i] == "out")
    fi = tuple(i for i in m.rest if table[i] == "in")
    if not fi:
        return _refuse(m, "no axis is left for the width", None, "embedding")
    return Route("embedding", fi, fo, m.batch, evidence=m.ax.said)


def _embed_sides(m: _MatrixLeaf, e: int) -> dict[int, str] | RoutingError:
    """The sides of the placed axes when one axis ``e`` is the width (``embed``).

    The width is the fan-in where it starts the matrix (x @ W order), the fan-out where it
    ends it, its own side where a role gives one; every other placed axis is on the other
    side, and so is the unnamed axis of a two-axis matrix.  Refused when the width stands
    between other named axes.
    """
    known = [i for i in m.order if m.ax.roles[i] is not None or i in m.side]
    if e in m.side:
        own = m.side[e]
    elif e == known[0]:
        own = "in"
    elif e == known[-1]:
        own = "out"
    else:
        return _refuse(m, "the width stands between other named axes", None)
    other = "out" if own == "in" else "in"
    guess = {i: m.side.get(i, own if i == e else other) for i in known}
    if len(m.rest) == 2:
        guess = {i: guess.get(i, other) for i in m.rest}
    return guess


def _role_groups(m: _MatrixLeaf) -> list[str]:
    """The roles of the axes without a side, in x @ W order, each run of a role once."""
    groups: list[str] = []
    for i in m.order:
        r = m.ax.roles[i]
        if i in m.side or r is None:
            continue
        if not groups or groups[-1] != r:
            groups.append(r)
    return groups


def _group_sides(m: _MatrixLeaf) -> dict[int, str] | RoutingError | None:
    """The sides of the placed axes when no axis is the width: the role groups decide.

    Two groups: the first (x @ W order) is the fan-in.  One group opposite a side that the
    roles give, or sides alone, place the axes too.  ``None`` when one group has no side
    (the names do not say which side it is); refused when groups interleave or are three.
    The unnamed axis of a two-axis matrix goes to the side no axis is on.
    """
    groups = _role_groups(m)
    if len(groups) != len(set(groups)):
        return _refuse(m, f"the groups {groups} interleave", None)
    if len(groups) > 2:
        return _refuse(m, f"three groups {groups} cannot be one matrix", None)
    sides = set(m.side.values())
    if len(groups) == 2:
        first = [i for i in m.rest if i not in m.side and m.ax.roles[i] == groups[0]]
        guess = {i: m.side.get(i, "in" if i in first else "out") for i in m.placed()}
    elif len(groups) == 1 and len(sides) == 1:
        other = "out" if sides == {"in"} else "in"
        guess = {i: m.side.get(i, other) for i in m.placed()}
    elif not groups and m.side:
        guess = dict(m.side)
    else:
        return None  # one group, no side: the names do not say which side it is
    unplaced = [i for i in m.rest if i not in guess]
    if unplaced and len(m.rest) == 2:
        both = set(guess.values())
        if len(both) != 1:
            return None
        guess[unplaced[0]] = "out" if both == {"in"} else "in"
    return guess


def _dense_route(m: _MatrixLeaf, guess: dict[int, str]) -> Route | RoutingError:
    """The dense route the sides ``guess`` give, refused where an axis is left unexplained."""
    if m.has_unplaced_axis():
        return _refuse(m, "an axis has no role (stacked layers without their name?)", guess)
    fi = tuple(i for i in m.rest if guess.get(i) == "in")
    fo = tuple(i for i in m.rest if guess.get(i) == "out")
    if not fi or not fo:
        return _refuse(m, "every axis is on one side", None)
    return Route("dense", fi, fo, m.batch, evidence=m.ax.said)


def _complete(guess: dict[int, str], unplaced: Sequence[int]) -> dict[int, str]:
    """``guess`` completed for the suggested reading.

    Unplaced axes are stacked copies (left out) when both sides have an axis, else they
    fill the empty side (``("embed", None, None)``: one ``(in, heads, head_dim)`` matrix).
    """
    sides = set(guess.values())
    if len(sides) == 2 or not sides:
        return dict(guess)
    other = "out" if sides == {"in"} else "in"
    return {**guess, **{i: other for i in unplaced}}


def agrees(a: Route, b: Route, shape: tuple[int, ...]) -> bool:
    """Whether two routes resolve to the same kind-free axes on ``shape``."""
    try:
        ra, rb = a.resolve(shape), b.resolve(shape)
    except RoutingError:
        return False
    return (ra.fan_in, ra.fan_out, ra.batch) == (rb.fan_in, rb.fan_out, rb.batch)


_KIND_WORDS = {"embedding": "a table or head (embedding)", "dense": "a matrix (dense)",
               "vector": "a vector"}


def kind_conflict(module: Route, names: Route, name: str, shape: tuple[int, ...],
                  vocab: bool) -> RoutingError | None:
    """The refusal of a leaf whose module and axis names give the same axes, other kinds.

    ``None`` where they agree: the same kind, or a matrix module (``Dense``,
    ``DenseGeneral``, ``Linear``...) whose fan-out the names call the vocabulary
    (``vocab``): an untied head, ``embedding`` as every head.  Any other pair (a table
    reading on a matrix module without a ``vocab`` axis, a matrix reading on an ``Embed``)
    is refused with the module's reading first.
    """
    if module.kind == names.kind or (module.kind == "dense" and names.kind == "embedding"
                                     and vocab):
        return None
    return RoutingError(
        f"cannot place {name!r} of shape {shape}: its {module.evidence} makes it "
        f"{_KIND_WORDS[module.kind]} but its {names.evidence} make it "
        f"{_KIND_WORDS[names.kind]}; fix the annotation or give it, e.g. "
        + core.override_advice(name, module),
        leaf=name, shape=shape,
        options=[(dataclasses.replace(module, evidence="override"),
                  "the module's reading is right"),
                 (dataclasses.replace(names, evidence="override"),
                  "the axis names are right")])


def check_matched(given: Mapping[str, Names], paths: Sequence[str]) -> None:
    """Refuse ``axis_names`` (read by :func:`names_of`) with paths that name no parameter.

    A path matches with or without the ``params.`` level of a linen variables tree; in such
    a tree only the ``params`` collection is looked at.

    Raises:
      RoutingError: one line naming every unmatched path and the nearest parameters.
    """
    import difflib

    have = set(paths)
    keys = list(given)
    if any(k.startswith("params.") for k in keys):
        keys = [k for k in keys if k.startswith("params.")]
    missing = [k for k in keys if not ({k, k.removeprefix("params."), f"params.{k}"} & have)]
    if not missing:
        return
    hints = []
    for k in missing[:5]:
        near = difflib.get_close_matches(k.removeprefix("params."), list(have), n=2,
                                         cutoff=0.4)
        hints.append(f"{k!r} (nearest: {', '.join(near) if near else 'none'})")
    more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
    raise RoutingError(
        f"axis_names: {len(missing)} path(s) name no parameter of the tree routed: "
        f"{', '.join(hints)}{more}; give the names of these params (the boxed "
        "variables they come from, or nn.get_partition_spec(variables)), keyed by their paths")
