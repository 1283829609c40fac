"""Route the parameters of any ``nn.Module``: a kind and the axes that decide the math.

SAGE and SinkGD are not transpose-invariant, so the router decides the math through the
axes it gives every parameter (:class:`sage_optim.routing.Route`: a kind plus a fan-in and a
fan-out axis *group*; a multi-axis matrix is one matrix).  It uses the strongest evidence
available, in this order (``docs/routing.md``):

1. **an override** (``route_overrides={glob: ...}``): a kind (``"dense"``) takes its axes from
   the layout of the module that owns the parameter (step 3), or, where that is unknown, is
   refused with a request for axes; a :class:`~sage_optim.routing.Route` with axes (or
   ``(kind, {"fan_in": ..., "fan_out": ...})``) is used as given.  A glob that matches no
   parameter is an error naming the nearest names.
2. **the model's own API**: the weight of ``model.get_input_embeddings()`` is the token
   embedding and that of ``model.get_output_embeddings()`` the output head (transformers
   models), and a parameter registered in two modules is *tied* (one ``Parameter``: one
   state), an embedding if either module is one.
3. **module types with a known layout**: ``nn.Linear`` ``(out, in)`` (dense, fan-in 1, fan-out
   0); ``nn.Embedding``/``nn.EmbeddingBag`` ``(V, d)`` (embedding, vocab axis 0 = fan-out;
   position and token-type tables too); transformers' ``Conv1D`` ``(in, out)`` (dense, fan-in
   0, fan-out 1); ``nn.Conv1d/2d/3d`` ``(out, in/groups, *k)`` (dense, fan-in ``(1, 2, ...)``:
   input channels and taps merged, one ``(Cin·k) x Cout`` matrix); ``nn.MultiheadAttention``'s
   ``in_proj_weight`` ``(3E, E)`` (dense, as a Linear).
4. **shapes and names, last and only where unambiguous**: 0-D/1-D parameters (and tensors
   with a single non-unit axis, such as a ``(1, 1, d)`` class token) are vectors; an
   ``nn.Linear`` whose weight is ``(V, d)`` of *the* token embedding is the output head when
   the model has no API that says otherwise and no other Linear fits (a head-marker name
   such as ``lm_head`` breaks a tie).  A head is never found because one dimension equals
   some table's length.

Everything else (a ``ConvTranspose``, a custom ``nn.Parameter`` matrix, conflicting
evidence) raises :class:`~sage_optim.routing.RoutingError` naming the parameter, its shape
and the override that fixes it.  Sparse embeddings are refused (no rule takes sparse
gradients).  PyTorch matrices are ``(out, in)``: SAGE reduces over the fan-out axis (the
vocab axis of tables and heads), SinkGD normalises each output unit's fan-in first.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from sage_optim.routing import (
    ResolvedRoute,
    Route,
    RoutingError,
    match_overrides,
    names_head,
    names_token_embedding,
    override_advice,
)

__all__ = [
    "RoutedParam",
    "RoutingError",
    "module_route",
    "route_parameters",
    "route_params",
    "state_nbytes",
]


class RoutedParam(NamedTuple):
    """One trainable parameter and its route.

    Attributes:
      name: the parameter's dotted name (the first one, for a tied parameter).
      param: the ``nn.Parameter``.
      route: its :class:`~sage_optim.routing.ResolvedRoute`: kind, fan-in/fan-out/batch
        axis groups checked against its shape, and the evidence that placed it.
    """

    name: str
    param: nn.Parameter
    route: ResolvedRoute


@dataclasses.dataclass(frozen=True)
class _Owner:
    """One registration of a parameter: ``module.<attr>`` reached through ``path``."""

    path: str
    module: nn.Module
    attr: str


def _label(module: nn.Module) -> str:
    """``nn.Linear`` for torch's own modules, the class name otherwise (``Conv1D``)."""
    cls = type(module)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def _is_conv1d_transformers(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (weight ``(in, out)``).

    Without importing transformers: a model cannot hold one unless it has been imported.
    """
    utils = sys.modules.get("transformers.pytorch_utils")
    cls = getattr(utils, "Conv1D", None)
    return cls is not None and isinstance(module, cls)


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")


def module_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The route that the layout of ``module`` gives its parameter ``attr``, or ``None``.

    ``None`` when the module type has no known layout for that parameter (a custom module,
    a ``ConvTranspose``, a bias).  The evidence is ``"module <type>"``.
    """
    if attr != "weight" and not (isinstance(module, nn.MultiheadAttention)
                                 and attr in _MHA_WEIGHTS):
        return None
    if param.dim() < 2:
        return None
    evidence = f"module {_label(module)}"
    if isinstance(module, nn.Embedding | nn.EmbeddingBag):
        return Route("embedding", fan_in=1, fan_out=0, evidence=evidence)
    if isinstance(module, nn.Linear | nn.MultiheadAttention):
        return Route("dense", fan_in=1, fan_out=0, evidence=evidence)
    if _is_conv1d_transformers(module):
        return Route("dense", fan_in=0, fan_out=1, evidence=evidence)
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and not module.transposed:
        return Route("dense", fan_in=tuple(range(1, param.dim())), fan_out=0, evidence=evidence)
    return None


def _owners(model: nn.Module) -> dict[int, list[_Owner]]:
    """Every registration of every parameter, in module order."""
    owners: dict[int, list[_Owner]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():  # noqa: SLF001 - the registrations
            if p is None:
                continue
            path = f"{mname}.{attr}" if mname else attr
            regs = owners.setdefault(id(p), [])
            if all(o.path != path for o in regs):
                regs.append(_Owner(path, module, attr))
    return owners


def _api_owner(model: nn.Module) -> nn.Module:
    """The outermost module with the embeddings API.

    ``model`` itself, or the transformers model inside a wrapper (``DistributedDataParallel``,
    a training module).
    """
    for _, module in model.named_modules():
        if callable(getattr(module, "get_input_embeddings", None)):
            return module
    return model


def _api_module(model: nn.Module, method: str) -> tuple[bool, nn.Module | None]:
    """``(has_api, module)`` for ``model.get_input_embeddings``/``get_output_embeddings``.

    ``has_api`` is false when the method is missing or raises ``NotImplementedError``;
    ``module`` is ``None`` when the model says it has none (``None``, or no weight).
    """
    fn = getattr(model, method, None)
    if not callable(fn):
        return False, None
    try:
        module = fn()
    except (NotImplementedError, AttributeError, TypeError):
        return False, None
    if not isinstance(module, nn.Module):
        return True, None
    return True, module


def _api_weight(module: nn.Module | None, params: dict[int, str]) -> nn.Parameter | None:
    weight = getattr(module, "weight", None) if module is not None else None
    if isinstance(weight, nn.Parameter) and id(weight) in params and weight.dim() == 2:
        return weight
    return None


def _fmt_shape(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def _layout_examples(name: str, shape: Sequence[int], kind: str | None) -> list[str]:
    """Concrete overrides for a matrix parameter whose layout the router does not know."""
    shape = tuple(int(s) for s in shape)
    big = [a for a, n in enumerate(shape) if n != 1]
    out = []
    if len(big) == 2 or len(shape) == 2:
        i, j = big if len(big) == 2 else (0, 1)
        rows, cols = shape[i], shape[j]
        if kind in (None, "embedding"):
            out.append(f"a table of {rows} rows of {cols} features (like nn.Embedding, a "
                       f"position table, an output head (V, d)): "
                       + override_advice(name, shape, Route("embedding", fan_in=j, fan_out=i)))
        if kind in (None, "dense"):
            out.append(f"used as F.linear(x, W), W (out, in) = ({rows}, {cols}): "
                       + override_advice(name, shape, Route("dense", fan_in=j, fan_out=i)))
            out.append(f"used as x @ W, W (in, out) = ({rows}, {cols}): "
                       + override_advice(name, shape, Route("dense", fan_in=i, fan_out=j)))
        if kind == "embedding":
            out.append(f"a ({rows}, {cols}) = (d, V) matrix, vocab axis {j}: "
                       + override_advice(name, shape, Route("embedding", fan_in=i, fan_out=j)))
    else:
        k = kind or "dense"
        rest = tuple(range(1, len(shape)))
        out.append("one matrix, fan-out axis 0 and the others merged as fan-in (a conv "
                   "weight (out, in, *taps)): "
                   + override_advice(name, shape, Route(k, fan_in=rest, fan_out=0)))
        out.append("a stack of (out, in) matrices over the leading axes: "
                   + override_advice(name, shape, Route(k, fan_in=-1, fan_out=-2)))
    out.append(f"element-wise rules only: route_overrides={{{name!r}: 'vector'}}")
    return out


def _unknown_layout(name: str, p: torch.Tensor, owners: list[_Owner],
                    kind: str | None) -> RoutingError:
    module = owners[0].module if owners else None
    where = f"in module {_label(module)}" if module is not None else "(no owning module)"
    if isinstance(module, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        rest = (0, *range(2, p.dim()))
        why = ("a transposed convolution's weight is (in, out/groups, *taps), and which "
               "axes are its fan-in is a modelling choice; to read input channels and taps as "
               "the fan-in, as for nn.Conv: "
               + override_advice(name, p.shape, Route(kind or "dense", fan_in=rest,
                                                      fan_out=1)))
        return RoutingError(f"cannot place parameter {name!r} of shape {_fmt_shape(p.shape)} "
                            f"{where}: {why}")
    what = f"routed {kind!r} by an override, but its" if kind else "its"
    lines = "\n  - ".join(_layout_examples(name, p.shape, kind))
    return RoutingError(
        f"cannot place parameter {name!r} of shape {_fmt_shape(p.shape)} {where}: {what} "
        f"layout is unknown (known: nn.Linear, nn.Embedding, nn.EmbeddingBag, transformers "
        f"Conv1D, nn.Conv1d/2d/3d). Say which axes are fan-in and fan-out, e.g. if it is\n  - "
        f"{lines}\n(Route is sage_optim.routing.Route, also sage_torch.Route)"
    )


class _Router:
    """The evidence of one model, gathered once; :meth:`route` places one parameter."""

    def __init__(self, model: nn.Module, overrides: Mapping[str, Any] | None) -> None:
        self.model = model
        self.owners = _owners(model)
        self.named = list(model.named_parameters())
        self.param_names = {id(p): n for n, p in self.named}
        self.named_params = {id(p): p for _, p in self.named}
        all_names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self.overrides: dict[int, tuple[str, Route]] = {}
        for pname, route in match_overrides(all_names, overrides).items():
            p = by_name[pname]
            seen = self.overrides.get(id(p))
            if seen is not None and seen[1] != route:
                canonical = self.param_names[id(p)]
                raise RoutingError(
                    f"parameter {canonical!r} of shape {_fmt_shape(p.shape)} is tied "
                    f"({seen[0]} is {pname}: one parameter, one route), and the overrides "
                    f"route its names differently: {seen[1]} and {route}; give one, e.g. "
                    + override_advice(canonical, p.shape, seen[1])
                )
            self.overrides[id(p)] = (pname, route)
        api = _api_owner(model)
        has_in, in_module = _api_module(api, "get_input_embeddings")
        has_out, out_module = _api_module(api, "get_output_embeddings")
        self.api_in = _api_weight(in_module, self.param_names) if has_in else None
        self.api_out = _api_weight(out_module, self.param_names) if has_out else None
        self.out_module = out_module if self.api_out is not None else None
        self.token = self._token_embedding()
        # the head by shape only when the model has no API saying which one it is
        self.heads = {} if has_out else self._heads_by_shape()

    # -- evidence ----------------------------------------------------------------------

    def _token_embedding(self) -> tuple[str, torch.Tensor] | None:
        """*The* token embedding: the model API's, the only table, or the one so named."""
        if self.api_in is not None:
            return self.param_names[id(self.api_in)], self.api_in
        tables = [(o.path, o.module.weight) for regs in self.owners.values() for o in regs
                  if isinstance(o.module, nn.Embedding | nn.EmbeddingBag)
                  and o.attr == "weight"]
        unique = {id(w): (self.param_names.get(id(w), path), w) for path, w in tables}
        if len(unique) == 1:
            return next(iter(unique.values()))
        named = [v for v in unique.values() if names_token_embedding(v[0])]
        return named[0] if len(named) == 1 else None

    def _heads_by_shape(self) -> dict[int, str]:
        """``{id(weight): evidence}`` of the untied output head found by shape, if unique."""
        if self.token is None:
            return {}
        tname, table = self.token
        fits = []
        for p_id, regs in self.owners.items():
            if p_id == id(table) or p_id not in self.param_names:
                continue
            if not self.named_params[p_id].requires_grad:
                continue  # frozen: not trained, so not in doubt
            linear = [o for o in regs if isinstance(o.module, nn.Linear) and o.attr == "weight"]
            weight = linear[0].module.weight if linear else None
            if isinstance(weight, torch.Tensor) and tuple(weight.shape) == tuple(table.shape):
                fits.append((self.param_names[p_id], p_id))
        if any(self.overrides[pid][1].kind == "embedding" for _, pid in fits
               if pid in self.overrides):
            return {}  # the user named the head
        fits = [(n, pid) for n, pid in fits if pid not in self.overrides]
        shape = _fmt_shape(table.shape)
        evidence = f"shape: {shape} of token embedding {tname}"
        if len(fits) == 1:
            return {fits[0][1]: evidence}
        named = [(n, pid) for n, pid in fits if names_head(n)]
        if len(fits) > 1 and len(named) == 1:
            return {named[0][1]: f"{evidence} + name"}
        if len(fits) > 1:
            listed = ", ".join(n for n, _ in fits)
            raise RoutingError(
                f"cannot tell the output head: {len(fits)} nn.Linear weights have the shape "
                f"{shape} of the token embedding {tname!r} ({listed}) and the model has no "
                f"get_output_embeddings(). Name the head, e.g. "
                f"route_overrides={{{fits[-1][0]!r}: 'embedding'}} (its vocab axis 0 is the "
                f"fan-out axis), or route them all as dense: "
                + "route_overrides={" + ", ".join(f"{n!r}: 'dense'" for n, _ in fits) + "}"
            )
        return {}

    def _layout(self, name: str, p: torch.Tensor) -> Route | None:
        """The route from the model API, tying and module types (no override, no shape)."""
        regs = self.owners.get(id(p), [])
        api = None
        if self.api_in is not None and p is self.api_in:
            api = "model API: input embeddings"
        elif self.api_out is not None and p is self.api_out:
            api = "model API: output embeddings"
        routes = []
        for o in regs:
            r = module_route(o.module, o.attr, p)
            if r is not None:
                routes.append((o, r))
        if len({(r.fan_in, r.fan_out) for _, r in routes}) > 1:
            listed = "; ".join(f"{o.path} ({r.evidence}: fan_in={r.fan_in}, "
                               f"fan_out={r.fan_out})" for o, r in routes)
            raise RoutingError(
                f"parameter {name!r} of shape {_fmt_shape(p.shape)} is tied between modules "
                f"that read it with different layouts: {listed}; say which is right, e.g. "
                + override_advice(name, p.shape, routes[0][1])
            )
        aliases = [o.path for o in regs if o.path != name]
        # the output head first (a T5 table has four names): the alias that matters
        aliases.sort(key=lambda a: not any(o.path == a and o.module is self.out_module
                                            for o in regs))
        tied = ""
        if aliases:
            more = f" (+{len(aliases) - 2} more)" if len(aliases) > 2 else ""
            tied = f"tied to {', '.join(aliases[:2])}{more}"
        if api is not None:
            if not routes:
                return None  # an API module of unknown layout: asked for below
            evidence = api + (f", {tied}" if tied else "")
            return Route("embedding", routes[0][1].fan_in, routes[0][1].fan_out,
                         evidence=evidence)
        if not routes:
            return None
        embedding = [(o, r) for o, r in routes if r.kind == "embedding"]
        own = next((r for o, r in routes if o.path == name), None)
        kind = "embedding" if embedding else routes[0][1].kind
        if id(p) in self.heads:
            kind, evidence = "embedding", self.heads[id(p)]
        elif embedding and all(o.path != name for o, _ in embedding):
            evidence = f"tied to {embedding[0][0].path}"  # a table through another name
        elif own is not None:
            evidence = own.evidence + (f", {tied}" if tied else "")
        else:  # reached through another registration: say through which
            source = (embedding or routes)[0][0].path
            evidence = f"tied to {source}"
        first = routes[0][1]
        return Route(kind, first.fan_in, first.fan_out, evidence=evidence)

    # -- one parameter -----------------------------------------------------------------

    def route(self, name: str, p: torch.Tensor) -> ResolvedRoute:
        """The route of one trainable parameter (raises :class:`RoutingError`)."""
        regs = self.owners.get(id(p), [])
        for o in regs:
            if isinstance(o.module, nn.Embedding | nn.EmbeddingBag) and o.module.sparse:
                raise RoutingError(
                    f"parameter {name!r} of shape {_fmt_shape(p.shape)} belongs to "
                    f"{_label(o.module)}(sparse=True) at {o.path.rpartition('.')[0]!r}: it "
                    "gets sparse gradients, which no sage_torch rule takes (SAGE reduces over "
                    "the vocab axis, the others are dense). Build it with sparse=False, or "
                    f"set model.get_submodule({o.path.rpartition('.')[0]!r}).sparse = False"
                )
        override = self.overrides.get(id(p))
        if override is not None:
            _, route = override
            if route.kind == "vector" or route.has_axes:
                return route.resolve(p.shape, name)
            if p.dim() < 2:
                raise RoutingError(
                    f"parameter {name!r} of shape {_fmt_shape(p.shape)} is routed "
                    f"{route.kind!r} by an override, but it has fewer than two dimensions; "
                    f"route it 'vector': route_overrides={{{name!r}: 'vector'}}"
                )
            layout = self._layout(name, p)
            if layout is None:
                raise _unknown_layout(name, p, regs, route.kind)
            return Route(route.kind, layout.fan_in, layout.fan_out,
                         evidence="override").resolve(p.shape, name)
        if p.dim() <= 1:
            return Route("vector", evidence=f"shape: {p.dim()}-D").resolve(p.shape, name)
        layout = self._layout(name, p)
        if layout is not None:
            return layout.resolve(p.shape, name)
        if p is self.api_in or p is self.api_out:  # the API's module has no known layout
            raise _unknown_layout(name, p, regs, "embedding")
        if sum(n != 1 for n in p.shape) <= 1:
            return Route("vector", evidence="shape: one non-unit axis").resolve(p.shape, name)
        raise _unknown_layout(name, p, regs, None)


def route_params(model: nn.Module,
                 overrides: Mapping[str, Any] | None = None) -> list[RoutedParam]:
    """The route of every trainable parameter of ``model``, in ``named_parameters`` order.

    A tied parameter (one ``Parameter`` registered in two modules, e.g. a head tied to the
    embedding) appears once, under its first name; frozen parameters are left out.

    Args:
      model: any ``nn.Module`` (transformers models are recognised through their API).
      overrides: ``{glob: kind}``, ``{glob: Route(kind, fan_in=..., fan_out=...)}`` or
        ``{glob: (kind, {"fan_in": ..., "fan_out": ...})}``, matched against every name of
        every parameter (first matching glob wins).

    Raises:
      RoutingError: a parameter that cannot be placed (non-float, unknown layout, sparse
        embedding, an ambiguous head, conflicting evidence) or an override that matches
        nothing; each message names the parameter, its shape and the override that fixes
        it.  Every unplaceable parameter is listed at once.
    """
    router = _Router(model, overrides)
    routed, errors = [], []
    for name, p in router.named:
        if not p.is_floating_point():
            raise RoutingError(
                f"cannot place parameter {name!r} of shape {_fmt_shape(p.shape)}: dtype "
                f"{p.dtype} is not floating point, so no optimizer can train it; register it "
                "as a buffer"
            )
        if not p.requires_grad:
            continue
        try:
            routed.append(RoutedParam(name, p, router.route(name, p)))
        except RoutingError as err:
            errors.append(str(err))
    if len(errors) == 1:
        raise RoutingError(errors[0])
    if errors:
        raise RoutingError(f"cannot place {len(errors)} parameters:\n* "
                           + "\n* ".join(errors))
    return routed


def route_parameters(
    model: nn.Module, overrides: Mapping[str, Any] | None = None
) -> list[tuple[str, nn.Parameter, str]]:
    """Deprecated: ``(name, parameter, kind)`` triples; use :func:`route_params`.

    The kinds are those of :func:`route_params` (which also gives the axes and evidence).
    """
    warnings.warn(
        "sage_torch.route_parameters is deprecated; use sage_torch.route_params, which "
        "returns RoutedParam(name, param, route) with the axes and the evidence",
        DeprecationWarning,
        stacklevel=2,
    )
    return [(r.name, r.param, r.route.kind) for r in route_params(model, overrides)]


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in one parameter's state, without its ``step`` counter."""
    return sum(v.numel() * v.element_size() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")
