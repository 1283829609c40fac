"""Route the parameters of any ``nn.Module``: a kind and the axes that decide the math.

This module gathers the facts (``docs/routing.md``, "Evidence, strongest first", states every
rule): an override; the model's API (``get_input_embeddings()``) and tying; module types,
``torch.nn``'s here and other libraries' through :class:`Adapter`; names and shapes, only
where unambiguous.  The decision is :func:`sage_optim.decision.decide`.  :func:`route_params`
raises **one** :class:`~sage_optim.routing.RoutingError` for every parameter it cannot place.
"""


from __future__ import annotations

import dataclasses
import glob
import pathlib
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from sage_optim import decision, naming
from sage_optim import routing as core
from sage_optim.routing import (
    ROUTE_IS,
    VECTOR_OPTION,
    Option,
    ResolvedRoute,
    Route,
    RoutingError,
    advice_lines,
    fmt_shape,
    override_advice,
)
from sage_torch import params as params_lib
from sage_torch.params import Entry

__all__ = [
    "Adapter",
    "RoutedParam",
    "RoutingError",
    "adapters",
    "loaded_class",
    "module_route",
    "register_adapter",
    "route_params",
]

GROUP_ROUTE_KEYS: tuple[str, ...] = ("kind", "fan_in_dim", "fan_out_dim")
"""Keys of a param-group dict that place its members (the other keys are group options)."""


class RoutedParam(NamedTuple):
    """One trainable parameter and its route.

    Attributes:
      name: the parameter's dotted name (the first one, for a tied parameter).
      param: the ``nn.Parameter``.
      route: its :class:`~sage_optim.routing.ResolvedRoute`: kind, fan-in/fan-out/batch
        axis groups checked against its shape, and the evidence that placed it.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """

    name: str
    param: nn.Parameter
    route: ResolvedRoute


@dataclasses.dataclass(frozen=True)
class _Owner:
    """``module.<attr>`` reached through ``path``; ``parent.<slot>`` is ``module``."""

    path: str
    module: nn.Module
    attr: str
    parent: nn.Module | None = None
    slot: str = ""


def _label(module: nn.Module) -> str:
    """``nn.Linear`` for torch's own modules, the class name otherwise (``Conv1D``)."""
    cls = type(module)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_TABLES = (nn.Embedding, nn.EmbeddingBag)

# ---------------------------------------------------------------------------- the adapters

ModuleRoute = Callable[[nn.Module, str, torch.Tensor], Route | None]
"""``(module, attr, param) -> Route | None``: the layout a module type gives ``module.attr``."""


@dataclasses.dataclass(frozen=True)
class Adapter:
    """The evidence that the module types of one library give (``docs/routing.md``).

    The router knows ``torch.nn``'s own module types; an adapter adds another library's
    (``sage_torch/adapters/<library>.py``, loaded when that library is imported, or one
    registered by hand with :func:`register_adapter`).  Every field but ``name`` is
    optional.

    Attributes:
      name: the library (its import name), for the registry and the refusals.
      known: how a refusal lists the layouts it knows (``"mylib MyAttention"``).
      route: ``(module, attr, param) -> Route | None``: the route the type of ``module``
        gives its parameter ``attr`` (``None``: this adapter does not know it).  Asked
        before ``torch.nn``'s types.
      child_route: ``(parent, slot, param) -> Route | None``: the route a container's
        parent gives a parameter of its child ``parent.<slot>`` (a ``ParameterDict``).
      holds_tables: ``module -> bool``: whether the children of ``module`` hold vocabulary
        tables (a refusal then offers the table readings first).
      model_routes: ``(model, names) -> {id(param): Route | RoutingError}``: evidence only
        the whole model gives (a wrapper that holds another module's factors); ``names``
        maps ``id(param)`` to its name.
      refuse: ``(name, param, module, attr, kind) -> RoutingError | None``: a better
        refusal than the generic one for a parameter of unknown layout of ``module``.
    """

    name: str
    known: str = ""
    route: ModuleRoute | None = None
    child_route: Callable[[nn.Module, str, torch.Tensor], Route | None] | None = None
    holds_tables: Callable[[nn.Module], bool] | None = None
    model_routes: Callable[[nn.Module, Mapping[int, str]],
                           dict[int, Route | RoutingError]] | None = None
    refuse: Callable[[str, torch.Tensor, nn.Module, str, str | None],
                     RoutingError | None] | None = None


_REGISTRY = core.AdapterRegistry(Adapter, __package__, pathlib.Path(__file__).with_name("adapters"))
_ADAPTERS = _REGISTRY.registered
register_adapter = _REGISTRY.register
"""Add an :class:`Adapter` to the evidence of every later routing (replaces one of its name)."""
adapters = _REGISTRY.all
"""The registered adapters, after loading ``sage_torch/adapters/<library>.py`` of every library
imported so far (each registers itself)."""


def _first(field: str, *args: Any) -> Any:
    """The first answer that is not ``None`` of the adapters' ``field`` (``None`` if none)."""
    return next((r for a in adapters() if (f := getattr(a, field)) is not None
                 and (r := f(*args)) is not None), None)


def loaded_class(module_name: str, cls_name: str) -> type | None:
    """``module_name.cls_name`` if that module is imported, else ``None`` (no import)."""
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls if isinstance(cls, type) else None


def module_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The route that the layout of ``module`` gives its parameter ``attr``, or ``None``.

    ``None`` when the module type has no known layout for that parameter (a custom module,
    a ``ConvTranspose``, a bias).  The evidence is ``"module <type>"``.  The adapters
    (:func:`adapters`) are asked first, then ``torch.nn``'s own types.
    """
    return _first("route", module, attr, param) or _torch_nn_route(module, attr, param)


def _torch_nn_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The layout of a ``torch.nn`` module's parameter, or ``None``."""
    if param.dim() < 2 or (attr != "weight" and not (
            isinstance(module, nn.MultiheadAttention) and attr in _MHA_WEIGHTS)):
        return None
    evidence = f"module {_label(module)}"
    if isinstance(module, _TABLES):
        return Route("embedding", fan_in=1, fan_out=0, evidence=evidence)
    if isinstance(module, nn.Linear | nn.MultiheadAttention):
        return Route("dense", fan_in=1, fan_out=0, evidence=evidence)
    if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and not module.transposed:
        return Route("dense", fan_in=tuple(range(1, param.dim())), fan_out=0, evidence=evidence)
    return None


def _owner_route(owner: _Owner, param: torch.Tensor) -> Route | None:
    """:func:`module_route`, or the layout a container's parent gives (an adapter's)."""
    route = module_route(owner.module, owner.attr, param)
    if route is not None or owner.parent is None:
        return route
    return _first("child_route", owner.parent, owner.slot, param)


def _owners(model: nn.Module) -> dict[int, list[_Owner]]:
    """Every registration of every parameter, in module order."""
    owners: dict[int, list[_Owner]] = {}
    modules = dict(model.named_modules(remove_duplicate=False))
    for mname, module in model.named_modules(remove_duplicate=False):
        parent_path, _, slot = mname.rpartition(".")
        parent = modules.get(parent_path) if mname else None
        for attr, p in module._parameters.items():  # noqa: SLF001 - the registrations
            if p is None:
                continue
            path = f"{mname}.{attr}" if mname else attr
            regs = owners.setdefault(id(p), [])
            if all(o.path != path for o in regs):
                regs.append(_Owner(path, module, attr, parent, slot))
    return owners


def _api_tables(model: nn.Module, params: Mapping[int, str]) -> tuple[bool, Any, Any, Any]:
    """``(has get_output_embeddings, input weight, output weight, output module)``."""
    # the outermost module with the API: a wrapper (DistributedDataParallel) holds the model
    api = next((m for _, m in model.named_modules()
                if callable(getattr(m, "get_input_embeddings", None))), model)
    found: list[tuple[bool, Any, Any]] = []
    for method in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(api, method, None)
        try:
            module = fn() if callable(fn) else None
        except (NotImplementedError, AttributeError, TypeError):
            fn = module = None
        weight = getattr(module, "weight", None) if isinstance(module, nn.Module) else None
        ok = isinstance(weight, nn.Parameter) and id(weight) in params and weight.dim() == 2
        found.append((callable(fn), weight if ok else None, module))
    (_, api_in, _), (has_out, api_out, out_module) = found
    return has_out, api_in, api_out, out_module if api_out is not None else None


# ------------------------------------------------------------------------------ the advice

def _names_embedding(name: str) -> bool:
    """Whether a component of ``name`` (the leaf too) says embedding (``pos_emb``, ``wte``)."""
    return any(naming.says_embedding(part) for part in naming.components(name))


def _options(shape: Sequence[int], *, kind: str | None = None, table_first: bool = False,
             vocab: int | None = None, torch_weight: bool = False) -> list[Option]:
    """The remedies for a matrix of unknown layout, most likely first (``kind``: only it)."""
    shape = tuple(int(s) for s in shape)
    big = [a for a, n in enumerate(shape) if n != 1]
    if len(big) == 2 or len(shape) == 2:
        i, j = big if len(big) == 2 else (0, 1)
        rows, cols = shape[i], shape[j]
        table = (Route("embedding", fan_in=j, fan_out=i),
                 f"it is a table of {rows} rows of {cols} features (like nn.Embedding, a "
                 "position table, an output head (V, d))")
        table_t = (Route("embedding", fan_in=i, fan_out=j),
                   f"it is a ({rows}, {cols}) = (d, V) matrix, vocab axis {j} (a table read "
                   "as F.embedding(x, W.T), a head used as x @ W)")
        linear = (Route("dense", fan_in=j, fan_out=i),
                  f"it is used as F.linear(x, W), W (out, in) = ({rows}, {cols})")
        x_at_w = (Route("dense", fan_in=i, fan_out=j),
                  f"it is used as x @ W, W (in, out) = ({rows}, {cols})")
        options = [table, table_t, linear, x_at_w] if table_first else [
            linear, x_at_w, table, table_t]
        if vocab is not None and (rows == vocab) != (cols == vocab):
            first = table if rows == vocab else table_t
            options = [first, *(o for o in options if o is not first)]
    else:
        rest = tuple(range(1, len(shape)))
        stack_io = (Route("dense", fan_in=-2, fan_out=-1),
                    "it is a stack of (in, out) matrices over the leading axes (x @ W per "
                    "layer or expert)")
        stack_oi = (Route("dense", fan_in=-1, fan_out=-2),
                    "it is a stack of (out, in) matrices over the leading axes")
        in_first = (Route("dense", fan_in=0, fan_out=rest),
                    f"it is one matrix, axis 0 its input and axes {rest} merged as its output "
                    "(an (in, heads, head_dim) projection, einsum 'ibh,hnd->ibnd')")
        out_first = (Route("dense", fan_in=rest, fan_out=0),
                     f"it is one matrix, axis 0 its output and axes {rest} merged as its "
                     "input (a conv weight (out, in, *taps), einsum 'ibnd,hnd->ibh')")
        options = ([out_first, stack_oi] if len(shape) >= 4 else [stack_oi, out_first]) + [
            stack_io, in_first] if torch_weight else [stack_io, stack_oi, in_first, out_first]
        if table_first:
            options.insert(0, (Route("embedding", fan_in=-1, fan_out=-2),
                               "it is a stack of (V, d) tables over the leading axes"))
    if kind is not None:  # the readings of that kind first, then the others' axes (once)
        seen: dict[Any, Option] = {}
        for route, when in sorted(options, key=lambda o: o[0].kind != kind):
            seen.setdefault((route.fan_in, route.fan_out),
                            (dataclasses.replace(route, kind=kind), when))
        options = list(seen.values())
    return [*options, VECTOR_OPTION]


def _unknown_layout(name: str, p: torch.Tensor, owners: list[_Owner], kind: str | None,
                    vocab: int | None = None) -> RoutingError:
    """The error for a matrix of unknown layout, with its options most likely first."""
    shape = tuple(int(s) for s in p.shape)
    module = owners[0].module if owners else None
    where = f"in module {_label(module)}" if module is not None else "(no owning module)"
    if isinstance(module, nn.ConvTranspose1d | nn.ConvTranspose2d | nn.ConvTranspose3d):
        taps = tuple(range(2, p.dim()))
        conv = Route(kind or "dense", fan_in=(0, *taps), fan_out=1)
        options = [(conv, "input channels and taps are its fan-in, as nn.Conv reads its weight"),
                   (Route(kind or "dense", fan_in=0, fan_out=(1, *taps)),
                    "output channels and taps are its fan-out"),
                   VECTOR_OPTION]
        why = ("a transposed convolution's weight is (in, out/groups, *taps), and which "
               "axes are its fan-in is a modelling choice; to read input channels and taps as "
               "the fan-in, as for nn.Conv: " + override_advice(name, conv))
        return RoutingError(f"cannot place parameter {name!r} of shape {fmt_shape(shape)} "
                            f"{where}: {why}", leaf=name, shape=shape, options=options)
    if (module is not None and "expert" in type(module).__name__.lower()  # MixtralExperts
            and p.dim() == 3 and kind in (None, "dense")):
        return _unknown_experts(name, p, module)
    refusal = _first("refuse", name, p, module, owners[0].attr, kind) if owners else None
    if refusal is not None:
        return refusal
    embeddingish = _names_embedding(name) or any(
        isinstance(o.module, _TABLES) or o.parent is not None and any(
            a.holds_tables(o.parent) for a in adapters() if a.holds_tables) for o in owners)
    options = _options(shape, kind=kind, table_first=embeddingish, vocab=vocab)
    what = f"routed {kind!r} by an override, but its" if kind else "its"
    known = ", ".join(a.known for a in adapters() if a.known)
    return RoutingError(
        f"cannot place parameter {name!r} of shape {fmt_shape(shape)} {where}: {what} "
        "layout is unknown (known: nn.Linear, nn.Embedding, nn.EmbeddingBag, nn.Conv1d/2d/3d"
        f"{', ' + known if known else ''}). Say which axes are fan-in and fan-out, e.g. if it "
        f"is\n{advice_lines(name, options)}\n{ROUTE_IS}",
        leaf=name, shape=shape, options=options,
    )


def _unknown_experts(name: str, p: torch.Tensor, module: nn.Module) -> RoutingError:
    """The error for a 3-D tensor of an experts module that no adapter knows."""
    options: list[Option] = [
        (Route("dense", fan_in=2, fan_out=1, batch=0), "it is (E, out, in), one matrix per "
         "expert read as F.linear(x, W[e]) (most families: Mixtral, Qwen-MoE, DeepSeek)"),
        (Route("dense", fan_in=1, fan_out=2, batch=0),
         "it is (E, in, out), read as x @ W[e] or torch.bmm(x, W) (GPT-OSS, Llama-4)"),
        VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {fmt_shape(p.shape)} in module "
        f"{_label(module)}: an experts module whose layout is unknown (not in sage_torch."
        "adapters.transformers.EXPERTS). To tell, look at its forward: F.linear(x, W[e]) "
        "means (E, out, in) (the first remedy), x @ W[e] or torch.bmm(x, W) means (E, in, "
        f"out); the expert axis is a batch axis either way. E.g. if it is\n"
        f"{advice_lines(name, options)}\n{ROUTE_IS}",
        leaf=name, shape=p.shape, options=options,
    )


# ------------------------------------------------------------------------ the module router


def _match(names: Sequence[str], overrides: Mapping[str, Any] | None) -> dict[str, Route]:
    """:func:`~sage_optim.routing.match_overrides`; a glob equal to a name is literal."""
    known = set(names)  # "params[3]" names a parameter: as a glob, [3] is a character class
    return core.match_overrides(names, {
        glob.escape(k) if k in known else k: v for k, v in (overrides or {}).items()})


class _Router:
    """The evidence of one model, gathered once; :meth:`evidence` reads one parameter."""

    head_remedy = "The model has no get_output_embeddings(). Name"

    def __init__(self, model: nn.Module, overrides: Mapping[str, Any] | None) -> None:
        self.owners = _owners(model)
        self.named = list(model.named_parameters())
        self.param_names = {id(p): n for n, p in self.named}
        by_name = dict(model.named_parameters(remove_duplicate=False))
        self.overrides = _per_param(
            _match(list(by_name), overrides), by_name, self.param_names,
            lambda a, b: (f"tied ({a} is {b}: one parameter, one route), and the overrides "
                          "route its names", f"{a}'s override is the right one",
                          f"{b}'s override is the right one"))
        has_out, self.api_in, self.api_out, self.out_module = _api_tables(
            model, self.param_names)
        self.model_evidence: dict[int, Route | RoutingError] = {}
        for adapter in adapters():
            if adapter.model_routes is not None:
                self.model_evidence.update(adapter.model_routes(model, self.param_names))
        self.vocab = self._vocab()
        self.find_heads = not has_out  # the head by shape only when the API names none
        self.linears = {pid for pid, regs in self.owners.items() if pid in self.param_names
                        and any(isinstance(o.module, nn.Linear) and o.attr == "weight"
                                for o in regs)}  # the head candidates

    def members(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """``(name, param, None)`` of every parameter, in model order."""
        return [(n, p, None) for n, p in self.named]

    def _vocab(self) -> int | None:
        """The token table's rows: the API's table, else of the ``nn.Embedding`` weights."""
        if self.api_in is not None:
            return int(self.api_in.shape[0])
        tables = {id(w): decision.TableFact(self.param_names.get(id(w), o.path),
                                            int(w.shape[0]), int(w.shape[1]))
                  for regs in self.owners.values() for o in regs
                  if isinstance(o.module, _TABLES)
                  and o.attr == "weight" and (w := o.module.weight) is not None}
        token = decision.pick_token_table(list(tables.values()))
        return token.rows if token is not None else None

    def _layout(self, name: str, p: torch.Tensor) -> Route | None:
        """The route from the model API, tying and module types (no override, no shape)."""
        regs = self.owners.get(id(p), [])
        api = ("model API: input embeddings" if p is self.api_in else
               "model API: output embeddings" if p is self.api_out else None)
        routes = [(o, r) for o in regs if (r := _owner_route(o, p)) is not None]
        _check_tied_layouts(name, p, routes)
        tied = self._tied(name, regs)
        tied = f", {tied}" if tied else ""
        if not routes or (api is not None and routes[0][1].kind == "vector"):
            return None  # an API module of unknown layout: asked for below
        first = routes[0][1]
        if api is not None:
            return Route("embedding", first.fan_in, first.fan_out, evidence=api + tied)
        embedding = [o for o, r in routes if r.kind == "embedding"]
        own = next((r for o, r in routes if o.path == name), None)
        if own is None or (embedding and all(o.path != name for o in embedding)):
            # a table through another name, or reached through another registration
            evidence = f"tied to {(embedding or [o for o, _ in routes])[0].path}"
        else:
            evidence = own.evidence + tied
        return Route("embedding" if embedding else first.kind, first.fan_in, first.fan_out,
                     evidence=evidence, view=first.view)

    def _tied(self, name: str, regs: list[_Owner]) -> str:
        """``tied to a, b (+n more)``: the other names of a tied parameter, or ``""``."""
        # the output head first (a T5 table has four names): the alias that matters
        aliases = sorted((o.path for o in regs if o.path != name), key=lambda a: not any(
            o.path == a and o.module is self.out_module for o in regs))
        more = f" (+{len(aliases) - 2} more)" if len(aliases) > 2 else ""
        return f"tied to {', '.join(aliases[:2])}{more}" if aliases else ""

    def evidence(self, name: str, p: torch.Tensor) -> decision.Evidence:
        """What the model says of one trainable parameter (its route, or why it cannot)."""
        regs = self.owners.get(id(p), [])
        shape = tuple(int(n) for n in p.shape)
        for o in regs:
            if isinstance(o.module, _TABLES) and o.module.sparse:
                where = o.path.rpartition(".")[0]
                return decision.Evidence(name, shape, RoutingError(
                    f"parameter {name!r} of shape {fmt_shape(p.shape)} belongs to "
                    f"{_label(o.module)}(sparse=True) at {where!r}: it gets sparse gradients, "
                    "which no sage_torch rule takes (SAGE reduces over the vocab axis, the "
                    "others are dense). Build it with sparse=False, or set "
                    f"model.get_submodule({where!r}).sparse = False",
                    leaf=name, shape=p.shape), final=True)
        if id(p) in self.model_evidence:  # the model's own evidence (an adapter's)
            return decision.Evidence(name, shape, self.model_evidence[id(p)],
                                     layout=self._layout(name, p))
        try:
            route: Route | RoutingError = self._default(name, p, regs)
        except RoutingError as err:
            route = err
        return decision.Evidence(
            name, shape, route, api_token=p is self.api_in,
            head_candidate=id(p) in self.linears and p.requires_grad and p.dim() == 2)

    def refuse_kind(self, name: str, p: torch.Tensor, kind: str) -> RoutingError:
        """The refusal of a matrix an override gives ``kind`` but no axes."""
        return _unknown_layout(name, p, self.owners.get(id(p), []), kind, self.vocab)

    def _default(self, name: str, p: torch.Tensor, regs: list[_Owner]) -> Route:
        """The route of the model's evidence, before overrides and the head by shape."""
        if p.dim() <= 1:
            return Route("vector", evidence=f"shape: {p.dim()}-D")
        layout = self._layout(name, p)
        if layout is not None:
            return layout
        if p is self.api_in or p is self.api_out:  # the API's module has no known layout
            raise _unknown_layout(name, p, regs, "embedding", self.vocab)
        if sum(n != 1 for n in p.shape) <= 1:
            return Route("vector", evidence="shape: one non-unit axis")
        raise _unknown_layout(name, p, regs, None, self.vocab)


def _check_tied_layouts(name: str, p: torch.Tensor,
                        routes: list[tuple[_Owner, Route]]) -> None:
    """Refuse a parameter tied between modules that read it with different layouts."""
    if len({(r.kind == "vector", r.fan_in, r.fan_out, r.view) for _, r in routes}) <= 1:
        return
    listed = "; ".join(f"{o.path} ({r.evidence}: fan_in={r.fan_in}, "
                       f"fan_out={r.fan_out})" for o, r in routes)
    options = [(Route(r.kind, r.fan_in, r.fan_out),
                f"{o.path} reads it as its {r.evidence} says") for o, r in routes]
    raise RoutingError(
        f"parameter {name!r} of shape {fmt_shape(p.shape)} is tied between modules "
        f"that read it with different layouts: {listed}; say which is right, e.g. "
        + override_advice(name, routes[0][1]),
        leaf=name, shape=p.shape, options=[*options, VECTOR_OPTION],
    )


def _per_param(matched: Mapping[str, Route], tensors: Mapping[str, torch.Tensor],
               canonical: Mapping[int, str], tied: Callable[[str, str], tuple[str, str, str]]
               ) -> dict[int, tuple[str, Route]]:
    """``{id(param): (name, override)}``, refusing a parameter its names route apart."""
    out: dict[int, tuple[str, Route]] = {}
    for pname, route in matched.items():
        p = tensors[pname]
        seen = out.get(id(p))
        if seen is not None and seen[1] != route:
            name = canonical[id(p)]
            how, first, second = tied(seen[0], pname)
            raise RoutingError(
                f"parameter {name!r} of shape {fmt_shape(p.shape)} is {how} differently: "
                f"{seen[1]} and {route}; give one, e.g. " + override_advice(name, seen[1]),
                leaf=name, shape=p.shape,
                options=[(_as_option(seen[1]), first), (_as_option(route), second)])
        out[id(p)] = (pname, route)
    return out


def _as_option(route: Route) -> Any:
    """A parsed override as the value to paste: the kind alone when it gives no axes."""
    return route.kind if not route.has_axes and route.batch is None else route


def _too_few_dims(name: str, p: torch.Tensor, kind: str) -> RoutingError:
    return RoutingError(
        f"parameter {name!r} of shape {fmt_shape(p.shape)} is routed {kind!r} by an "
        f"override, but it has fewer than two dimensions; route it 'vector': "
        f"route_overrides={{{name!r}: 'vector'}}",
        leaf=name, shape=p.shape, options=[("vector", "it is a vector: element-wise rules")],
    )


# --------------------------------------------------------------- without the model: names


def _name_evidence(name: str, p: torch.Tensor) -> Route | None:
    """The route PyTorch's names give a matrix, or ``None`` (refused)."""
    reading = naming.torch_name_reading(name) if p.dim() == 2 else None
    if reading == "table":
        return Route("embedding", fan_in=1, fan_out=0, evidence="name: table (V, d)")
    if reading == "linear":
        return Route("dense", fan_in=1, fan_out=0, evidence="name 'weight': torch (out, in)")
    return None


_NAMES_SAY = ("its name does not say its layout (PyTorch's names: a 2-D 'weight' is (out, in), "
              "a 2-D 'weight' under an 'emb' name a table (V, d))")


class _NameRouter:
    """Parameters given without their model: names (if any) and shapes are the evidence."""

    find_heads = True
    head_remedy = ("Pass the model itself (make_optimizer(name, model): its modules and "
                   "get_output_embeddings() decide), or name")

    def __init__(self, entries: Sequence[Entry], overrides: Mapping[str, Any] | None,
                 groups: Sequence[Mapping[str, Any]] = ()) -> None:
        self.groups = groups
        seen: dict[int, Entry] = {}
        for e in entries:
            seen.setdefault(id(e.param), e)
        self.entries = list(seen.values())
        self.names = {e.name: e for e in self.entries}
        self.overrides = _per_param(
            _match([e.name for e in entries], overrides),
            {e.name: e.param for e in reversed(entries)}, {k: e.name for k, e in seen.items()},
            lambda a, b: ("given under several names (one tensor, one route), and the "
                          "overrides route them", "the first override is the right one",
                          "the second override is the right one"))
        self.layouts = {id(e.param): _name_evidence(e.name, e.param) for e in self.entries}
        self.linears = {id(e.param) for e in self.entries
                        if (r := self.layouts[id(e.param)]) is not None and r.kind == "dense"
                        and naming.components(e.name)[-1] == "weight"}
        token, self.conventions = decision.torch_name_facts(
            [(e.name, tuple(e.param.shape)) for e in self.entries if not e.bare])
        self.vocab = token.rows if token is not None else None

    def members(self) -> list[tuple[str, torch.Tensor, int | None]]:
        """``(name, param, group index)`` of every parameter, once, in the order given."""
        return [(e.name, e.param, e.group) for e in self.entries]

    def _refuse(self, e: Entry, kind: str | None,
                axes: tuple[Any, Any] | None = None) -> RoutingError:
        shape = tuple(int(s) for s in e.param.shape)
        if axes is not None:  # the group gives the axes, not the kind
            options: list[Option] = [
                (Route("dense", fan_in=axes[0], fan_out=axes[1]),
                 "it is a dense matrix (a projection), not a vocabulary"),
                (Route("embedding", fan_in=axes[0], fan_out=axes[1]),
                 "it is a vocabulary matrix (a token table or an output head)")]
            return RoutingError(
                f"cannot place parameter {e.name!r} of shape {fmt_shape(shape)}: its param "
                f"group gives fan_in_dim={axes[0]!r}, fan_out_dim={axes[1]!r} but no kind; add "
                "kind='dense' or kind='embedding' to the group, or route it, e.g. if it is\n"
                + advice_lines(e.name, options),
                leaf=e.name, shape=shape, options=options)
        refusal = self._refuse_convention(e, kind)
        if refusal is not None:
            return refusal
        weight = naming.components(e.name)[-1] == "weight" and not e.bare
        options = _options(shape, kind=kind, table_first=_names_embedding(e.name),
                           vocab=self.vocab, torch_weight=weight)
        if e.bare:
            why = ("a bare tensor (no name, no module), so nothing says which axes are its "
                   "fan-in and fan-out, nor whether it is a vocabulary matrix")
        elif weight and len(shape) == 2:  # (out, in) or (V, d)
            options = naming.torch_weight_options(shape, kind, self.vocab)
            why = naming.TORCH_WEIGHT_WHY.get(naming.torch_name_reading(e.name) or "",
                                            naming.TORCH_WEIGHT_WHY["unnamed"])
        else:
            why = _NAMES_SAY + (f"; a {len(shape)}-D parameter may be stacked layers, a "
                                "multi-axis projection or a convolution" if len(shape) > 2 else "")
        what = f"routed {kind!r}, but " if kind else ""
        names = " or model.named_parameters()" if e.bare else ""
        return RoutingError(
            f"cannot place parameter {e.name!r} of shape {fmt_shape(shape)}: {what}{why}. "
            f"Pass the model itself (make_optimizer(name, model): its module types decide){names}, "
            "or route it in route_overrides (per parameter), "
            f"e.g. if it is\n{advice_lines(e.name, options)}\n{ROUTE_IS}",
            leaf=e.name, shape=shape, options=options)

    def refuse_kind(self, name: str, p: torch.Tensor, kind: str) -> RoutingError:
        """The refusal of a matrix an override gives ``kind`` but no axes."""
        return self._refuse(self.names[name], kind)

    def _refuse_convention(self, e: Entry, kind: str | None) -> RoutingError | None:
        """The refusal of a weight with a GPT-2 ``Conv1D`` name (both readings), or None."""
        return None if e.bare else naming.convention_refusal(
            e.name, e.param.shape, self.conventions,
            "Pass the model itself (make_optimizer(name, model): its modules decide), or "
            f"route it in route_overrides {ROUTE_IS}", kind)

    def evidence(self, name: str, p: torch.Tensor) -> decision.Evidence:
        """What the names, shapes and param group say of one entry (or why they cannot)."""
        e = self.names[name]
        group = self.groups[e.group] if e.group is not None else {}
        try:
            route: Route | RoutingError = self._default(e, group)
        except RoutingError as err:
            route = err
        except ValueError as err:  # a group that contradicts its members: unless overridden
            if id(p) not in self.overrides:
                raise
            route = RoutingError(str(err))
        return decision.Evidence(
            e.name, tuple(int(n) for n in p.shape), route, by_names=True,
            given_kind=group.get("kind"),
            head_candidate=id(p) in self.linears and p.requires_grad and p.dim() == 2)

    def _default(self, e: Entry, group: Mapping[str, Any]) -> Route:
        """The route of the names, shapes and group, before overrides and the head."""
        p, layout, kind = e.param, self.layouts[id(e.param)], group.get("kind")
        fan_in, fan_out = group.get("fan_in_dim"), group.get("fan_out_dim")
        if (fan_in is None) != (fan_out is None):
            raise ValueError(f"param group {e.group} gives only one of fan_in_dim "
                             f"({fan_in!r}) and fan_out_dim ({fan_out!r}); give both")
        if kind is not None:
            return self._group_kind_route(e, kind, fan_in, fan_out, layout)
        if p.dim() <= 1:
            return Route("vector", evidence=f"shape: {p.dim()}-D")
        if fan_in is not None:
            if layout is None:
                raise self._refuse(e, None, (fan_in, fan_out))
            return Route(layout.kind, fan_in, fan_out,
                         evidence=f"param group axes, kind {layout.evidence}")
        if layout is not None:
            return layout
        if sum(n != 1 for n in p.shape) <= 1:
            return Route("vector", evidence="shape: one non-unit axis")
        raise self._refuse(e, None)

    def _group_kind_route(self, e: Entry, kind: str, fan_in: Any, fan_out: Any,
                          layout: Route | None) -> Route:
        """The route of a member of a param group that gives ``kind`` (and maybe axes)."""
        if kind == "vector":
            return Route("vector", evidence="param group kind")
        if e.param.dim() < 2:
            raise ValueError(f"parameter {e.name!r} of shape {fmt_shape(e.param.shape)} is in "
                             f"a param group of kind {kind!r}, but has fewer than two dims; "
                             "put it in a 'vector' group")
        if fan_in is not None:
            return Route(kind, fan_in, fan_out, evidence="param group kind and axes")
        if layout is not None:
            return Route(kind, layout.fan_in, layout.fan_out,
                         evidence=f"param group kind, axes {layout.evidence}")
        refusal = self._refuse_convention(e, kind)
        if refusal is not None:
            raise refusal
        return Route(kind, -1, -2, evidence="param group kind, torch's default axes (out, in)")


# ------------------------------------------------------------------------------- routing


@dataclasses.dataclass
class Routing:
    """The routes of every trainable parameter, and the errors of those not placed.

    What :func:`route_params` computes before it raises; :func:`sage_torch.make_optimizer`
    first lets :func:`sage_torch.grouping.accept_equivalent` place the parameters whose
    every reading gets the same update under its configuration.

    Attributes:
      order: ``(name, param, group index or None)`` of every trainable parameter, in order.
      routes: the placed ones, by ``id(param)``.
      errors: one :class:`RoutingError` per problem (an ambiguous head: one for all its
        candidates).
      groups: the options of the param groups given (``None`` for a model or a flat list).
      fix: the refusal's first remedy where it is not the paste block (tensors or names
        routed without their model: pass the model).
    """

    order: list[tuple[str, torch.Tensor, int | None]]
    routes: dict[int, ResolvedRoute]
    errors: list[RoutingError]
    groups: list[dict[str, Any]] | None = None
    fix: str | None = None

    def placed(self) -> list[RoutedParam]:
        """The routed parameters, in order (raises the combined error if any is not placed)."""
        if self.errors:
            raise RoutingError.combine(self.errors, fix=self.fix,
                                       names=[n for n, _, _ in self.order])
        return [RoutedParam(n, p, self.routes[id(p)])  # type: ignore[arg-type]
                for n, p, _ in self.order]


def _decide(router: _Router | _NameRouter, records: Sequence[decision.Evidence]
            ) -> dict[str, Route | RoutingError]:
    """The shared decision (:func:`sage_optim.decision.decide`) on a gatherer's evidence."""
    params = {n: p for n, p, _ in router.members()}
    overrides = {n: router.overrides[id(p)][1] for n, p in params.items()
                 if id(p) in router.overrides}

    def refuse(e: decision.Evidence, override: Route) -> RoutingError:
        q = params[e.name]
        if q.dim() < 2:
            return _too_few_dims(e.name, q, override.kind)
        return router.refuse_kind(e.name, q, override.kind)

    return decision.decide(records, overrides, refuse_override=refuse,
                           find_heads=router.find_heads, head_remedy=router.head_remedy)


def _collect(router: _Router | _NameRouter, skip_frozen: bool,
             groups: list[dict[str, Any]] | None = None, fix: str | None = None) -> Routing:
    """Route every parameter (frozen ones are evidence), collecting the errors."""
    order, records = [], []
    for name, p, group in router.members():
        if not (p.is_floating_point() or p.is_complex()):  # complex: the rules judge
            raise RoutingError(
                f"cannot place parameter {name!r} of shape {fmt_shape(p.shape)}: dtype "
                f"{p.dtype} is neither floating point nor complex, so no optimizer can train "
                "it; register it as a buffer")
        records.append(router.evidence(name, p))
        if not skip_frozen or p.requires_grad:
            order.append((name, p, group))
    decided = _decide(router, records)
    routes: dict[int, ResolvedRoute] = {}
    errors: dict[int, RoutingError] = {}  # an ambiguous head: one error, several params
    for name, p, _ in order:
        route = decided[name]
        try:
            if isinstance(route, Route):
                routes[id(p)] = route.resolve(p.shape, name)
                continue
        except RoutingError as err:
            route = err
        errors.setdefault(id(route), route)
    return Routing(order, routes, list(errors.values()), groups, fix)


def route_group(members: Sequence[tuple[str, torch.Tensor, bool]],
                group: Mapping[str, Any]) -> Routing:
    """Route the members of one param group added to an optimizer, frozen ones too.

    ``members`` are ``(name, tensor, bare)``: ``bare`` when the name was generated
    (``param_groups[3].params[0]``), so that only the shape is evidence.  ``group``'s
    ``kind``/``fan_in_dim``/``fan_out_dim`` place them as in :func:`route_params`.
    """
    router = _NameRouter([Entry(n, p, 0, bare) for n, p, bare in members], None, [group])
    return _collect(router, False, [dict(group)])


def routing(params: Any, overrides: Mapping[str, Any] | None = None, *,
            frozen: bool = False) -> Routing:
    """Route ``params`` (a model or what ``torch.optim`` takes), collecting every error.

    :func:`route_params` is this and :meth:`Routing.placed`.  ``frozen=True`` routes the
    frozen parameters too (``requires_grad=False``; routing reads no gradient), as
    :func:`sage_torch.make_optimizer` does so that they train once unfrozen.

    Raises:
      RoutingError: a non-floating parameter, an override that matches nothing or that
        conflicts on a tied parameter (at once: these are not per-parameter choices).
      TypeError, ValueError: ``params`` of a form ``torch.optim`` does not take either.
    """
    if isinstance(params, nn.Module):
        return _collect(_Router(params, overrides), not frozen)
    given, groups = params_lib.entries(params)
    return _collect(_NameRouter(given, overrides, groups), not frozen, groups or None,
                    "pass the model itself, make_optimizer(name, model), so its module types "
                    "decide")


def route_params(model: nn.Module | Iterable[Any],
                 overrides: Mapping[str, Any] | None = None) -> list[RoutedParam]:
    """The route of every trainable parameter of ``model``, in ``named_parameters`` order.

    A tied parameter (one ``Parameter`` registered in two modules, e.g. a head tied to the
    embedding) appears once, under its first name; frozen parameters are left out.

    Args:
      model: any ``nn.Module`` (transformers models are recognised through their API), or
        what ``torch.optim`` takes as ``params``: an iterable of tensors (named
        ``params[i]``; only vectors can be placed by shape), of ``(name, tensor)`` pairs
        (``model.named_parameters()``: PyTorch's names are the evidence) or of param-group
        dicts (``params``, optional ``param_names``, ``kind``, ``fan_in_dim``/``fan_out_dim``;
        members named ``param_groups[g].params[i]`` when unnamed).  ``docs/routing.md``
        gives the rules.
      overrides: ``{glob: kind}``, ``{glob: Route(kind, fan_in=..., fan_out=...)}`` or
        ``{glob: (kind, {"fan_in": ..., "fan_out": ...})}``, matched against every name of
        every parameter (first matching glob wins; a glob equal to a name matches it
        literally).

    Raises:
      RoutingError: the parameters that cannot be placed (non-float, unknown layout,
        sparse embedding, an ambiguous head, conflicting evidence) or an override that
        matches nothing: one error listing every parameter it cannot place, each with its
        options most likely first (``err.overrides`` is the first of each), ending with a
        ``route_overrides = {...}`` block to check against the model's forward code and
        paste.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026 (vocabulary matrices need their own rule);
      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along fan-in, fan-out).
    """
    return routing(model, overrides).placed()
