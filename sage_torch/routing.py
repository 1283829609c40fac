"""Route the parameters of any ``nn.Module``: a kind and the axes that decide the math.

SAGE and SinkGD are not transpose-invariant, so the router decides the math through the
axes it gives every parameter (:class:`sage_optim.routing.Route`: a kind plus a fan-in and a
fan-out axis *group*; a multi-axis matrix is one matrix).  It uses the strongest evidence
available, in this order (``docs/routing.md``):

1. **an override** (``route_overrides={glob: ...}``): a kind (``"dense"``) takes its axes from
   the layout of the module that owns the parameter (step 3), or, where that is unknown, is
   refused with a request for axes; a :class:`~sage_optim.routing.Route` with axes (or
   ``(kind, {"fan_in": ..., "fan_out": ...})``) is used as given.  A glob that matches no
   parameter is an error naming the nearest names; a glob equal to a parameter's name
   matches that name literally (``"params[3]"``).
2. **the model's own API**: the weight of ``model.get_input_embeddings()`` is the token
   embedding and that of ``model.get_output_embeddings()`` the output head (transformers
   models), and a parameter registered in two modules is *tied* (one ``Parameter``: one
   state), an embedding if either module is one.
3. **module types with a known layout**: ``nn.Linear`` ``(out, in)`` (dense, fan-in 1, fan-out
   0); ``nn.Embedding``/``nn.EmbeddingBag`` ``(V, d)`` (embedding, vocab axis 0 = fan-out;
   position and token-type tables too); transformers' ``Conv1D`` ``(in, out)`` (dense, fan-in
   0, fan-out 1); ``nn.Conv1d/2d/3d`` ``(out, in/groups, *k)`` (dense, fan-in ``(1, 2, ...)``:
   input channels and taps merged, one ``(Cin·k) x Cout`` matrix); ``nn.MultiheadAttention``'s
   ``in_proj_weight`` ``(3E, E)`` (dense, as a Linear); transformers'
   ``XLNetRelativeAttention`` (``q``/``k``/``v``/``r`` ``(d_model, heads, d_head)`` read by
   ``einsum('ibh,hnd->ibnd')``: fan-in 0, fan-out ``(1, 2)``; ``o`` read by
   ``einsum('ibnd,hnd->ibh')``: fan-in ``(1, 2)``, fan-out 0; the per-head biases
   ``r_*_bias`` are vectors; ``seg_embed`` ``(2, heads, d_head)``, read by
   ``einsum('ibnd,snd->ibns')``, is a table of 2 segments per head: embedding, vocab axis 0,
   fan-in 2, heads a batch axis); peft's LoRA ``Embedding`` (``lora_embedding_A`` ``(r, V)``
   read as ``F.embedding(x, A.T)``: a table whose vocab axis is 1, fan-in 0;
   ``lora_embedding_B`` ``(d, r)`` read as ``after_A @ B.T``: dense ``(out, in)``);
   transformers' mixture-of-experts modules (:mod:`sage_torch.moe`: fused experts
   ``(E, out, in)`` or ``(E, in, out)`` by class, the expert axis a batch axis; routers
   ``(E, d)`` dense ``(out, in)``; DBRX's flattened experts ``(E·n, d)`` with the view
   ``(E, n, d)``; peft's LoRA factors of fused experts (``ParamWrapper``) per expert, with
   the views peft reshapes them by: ``lora_A`` ``(E·r, in)`` as ``(E, r, in)``, ``lora_B``
   ``(out, r·E)`` as ``(out, r, E)``; a route's ``view`` is applied by the optimizer).
   peft and transformers are never imported: their classes are looked up in ``sys.modules``.
4. **shapes and names, last and only where unambiguous**: 0-D/1-D parameters (and tensors
   with a single non-unit axis, such as a ``(1, 1, d)`` class token) are vectors.  The
   output head by shape: when *the* token table is known (the model API's, the only
   ``nn.Embedding``/``nn.EmbeddingBag``, or the one whose name marks it, ``wte``,
   ``embed_tokens``, ...), an ``nn.Linear`` whose weight has its shape ``(V, d)`` is the head
   when the model has no ``get_output_embeddings()`` and no other Linear fits.  When it is
   not known, **every** table is a candidate: an ``nn.Linear`` weight with the exact shape of
   some table is a head candidate for that table.  Exactly one candidate, fitting a table
   whose name does not mark it as a position, token-type or segment table (``pos``,
   ``position``, ``wpe``, ``type``, ``segment``, ...), is the head, and its evidence names
   the table (``shape: (V, d) of table token_emb.emb.weight``).  Several candidates (or one
   fitting only a position table: an MLP weight of ``max_seq_len`` rows looks like one) are
   refused, unless exactly one has a head name (``lm_head``, ``head``, ``output``, ...),
   which breaks the tie.  A candidate inside numbered layers (``layers.0.mlp.up.weight``:
   an MLP whose width equals the vocabulary) is a layer's matrix: never the head by shape,
   and the first remedy of its refusal is ``dense``.  Frozen Linears are never candidates.
   A head is never found because one dimension equals some table's length; a classifier
   whose label count equals the vocabulary has the table's shape and gets the head's rule
   (the routing table shows why).  The token table and the head are chosen by the policy
   shared with ``sage_optax`` (:func:`sage_optim.routing.pick_token_table`,
   :func:`sage_optim.routing.find_head`); this module gathers the facts.

Everything else (a ``ConvTranspose``, a custom ``nn.Parameter`` matrix, conflicting
evidence) is refused: :func:`route_params` raises **one**
:class:`~sage_optim.routing.RoutingError` for all the parameters it cannot place, each with
its options most likely first (``err.overrides`` holds the first of each) and a
``route_overrides = {...}`` block to paste after checking it against the model's forward
code.  Sparse embeddings are refused (no rule takes sparse gradients).

Without the model: :func:`route_params` (and so :func:`sage_torch.make_optimizer`) also takes
what ``torch.optim`` takes as ``params``.  Bare tensors (``model.parameters()``) are named
``params[i]``; their shape is the only evidence, so vectors are placed and matrices refused.
``(name, tensor)`` pairs (``model.named_parameters()``) are placed by PyTorch's names: a 2-D
``weight`` is ``(out, in)`` (dense, fan-in 1, fan-out 0), and a table ``(V, d)`` (vocab axis
0) where its name marks one (a component with a word that starts with ``emb`` or holds
``embed``, a token-table marker, or a module name that is a table in every family using it:
GPT-2's ``wpe``, T5's and BART's ``shared``, T5's ``relative_attention_bias``).  Names never
guess against a known convention: the ``weight`` of a GPT-2 ``Conv1D`` name (``c_attn``,
``q_attn``, ``c_fc``, ``c_proj``) is ``(in, out)`` in GPT-2 and its relatives and ``(out,
in)`` in nanoGPT and GPTBigCode (``nn.Linear``), so it is refused; its first remedy is the
reading that the shapes of the model's weights of these names say against the token
table's width (:func:`sage_optim.routing.conv1d_reading`), and the message says to pass the
model itself.  The head by shape is as above, but by names alone it also needs a head name:
a single ``(V, d)`` weight without one (``to_logits``) could be an ``nn.Linear`` of the same
shape, and is refused with both readings.  A ``weight`` whose name has no word besides its
indices (``0.weight`` of an ``nn.Sequential``) could be a Linear or an Embedding, and is
refused, as is any other matrix.  Param-group dicts carry
``params`` (tensors or pairs), optionally ``param_names``, ``kind``, ``fan_in_dim``/
``fan_out_dim`` (a group's kind and axes place its members) and other group options.
PyTorch matrices are ``(out, in)``: SAGE reduces over the fan-out axis (the vocab axis of
tables and heads), SinkGD normalises each output unit's fan-in first.
"""

from __future__ import annotations

import dataclasses
import glob
import sys
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from sage_optim import routing as core
from sage_optim.routing import (
    ResolvedRoute,
    Route,
    RoutingError,
    components,
    conv1d_reading,
    conv1d_refusal,
    match_overrides,
    names_conv1d,
    names_token_embedding,
    override_advice,
)
from sage_torch import moe

__all__ = [
    "RoutedParam",
    "RoutingError",
    "module_route",
    "route_params",
    "state_nbytes",
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
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """

    name: str
    param: nn.Parameter
    route: ResolvedRoute


@dataclasses.dataclass(frozen=True)
class _Owner:
    """One registration of a parameter: ``module.<attr>`` reached through ``path``.

    ``parent`` is the module holding ``module`` (as its child ``slot``), for containers
    such as peft's ``lora_embedding_A`` ``nn.ParameterDict``.
    """

    path: str
    module: nn.Module
    attr: str
    parent: nn.Module | None = None
    slot: str = ""


def _label(module: nn.Module) -> str:
    """``nn.Linear`` for torch's own modules, the class name otherwise (``Conv1D``)."""
    cls = type(module)
    return f"nn.{cls.__name__}" if cls.__module__.startswith("torch.nn") else cls.__name__


def _class_from(module_name: str, cls_name: str) -> type | None:
    """``module_name.cls_name`` if that module is imported, else ``None`` (no import)."""
    cls = getattr(sys.modules.get(module_name), cls_name, None)
    return cls if isinstance(cls, type) else None


def _is_conv1d_transformers(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``Conv1D`` (weight ``(in, out)``).

    Without importing transformers: a model cannot hold one unless it has been imported.
    """
    cls = _class_from("transformers.pytorch_utils", "Conv1D")
    return cls is not None and isinstance(module, cls)


def _is_xlnet_attention(module: nn.Module) -> bool:
    """Whether ``module`` is transformers' ``XLNetRelativeAttention`` (without importing it)."""
    cls = _class_from("transformers.models.xlnet.modeling_xlnet", "XLNetRelativeAttention")
    return cls is not None and isinstance(module, cls)


def _is_peft_lora_embedding(module: nn.Module | None) -> bool:
    """Whether ``module`` is peft's LoRA ``Embedding`` layer (without importing peft)."""
    cls = _class_from("peft.tuners.lora.layer", "Embedding")
    return module is not None and cls is not None and isinstance(module, cls)


def _peft_expert_factors(model: nn.Module) -> dict[int, tuple[Route | None, str]]:
    """The LoRA factors that peft's ``ParamWrapper`` holds for fused experts, by ``id``.

    ``target_parameters`` LoRA on an ``(E, ., .)`` experts tensor stores the factors of all
    experts in two ``nn.Linear`` weights, ``lora_A`` ``(E·r, in)`` (expert-major rows) and
    ``lora_B`` ``(out, r·E)`` (expert-minor columns), which peft reshapes per expert rather
    than calls: each gets the per-expert route of :func:`sage_torch.moe.peft_factor_route`
    (a view), or ``None`` with a description for the refusal when its shape does not split.
    """
    cls = _class_from("peft.tuners.lora.layer", "ParamWrapper")
    if cls is None:
        return {}
    found: dict[int, tuple[Route | None, str]] = {}
    for module in model.modules():
        experts = getattr(module, "num_experts", 1)
        if not isinstance(module, cls) or not isinstance(experts, int) or experts <= 1:
            continue
        get_base = getattr(module, "get_base_layer", None)
        base = type(get_base()).__name__ if callable(get_base) else "experts"
        target = f"{base}.{getattr(module, 'parameter_name', '?')}"
        for which, layout in (("lora_A", "(E·r, in), the rows of each expert together"),
                              ("lora_B", "(out, r·E), the columns of each expert strided")):
            for linear in getattr(module, which, {}).values():
                weight = getattr(linear, "weight", None)
                if isinstance(weight, nn.Parameter):
                    found[id(weight)] = (
                        moe.peft_factor_route(which, weight, experts, target),
                        f"peft LoRA's {which} of the {experts} experts of {target} "
                        f"(ParamWrapper): {layout}")
    return found


_MHA_WEIGHTS = ("in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight")
_XLNET = "module XLNetRelativeAttention"


def _xlnet_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The layout of an ``XLNetRelativeAttention`` parameter, from its forward's einsums."""
    heads, d_head, d_model = (getattr(module, k, None) for k in ("n_head", "d_head", "d_model"))
    shape = tuple(param.shape)
    if attr in ("q", "k", "v", "r") and shape == (d_model, heads, d_head):
        return Route("dense", fan_in=0, fan_out=(1, 2),
                     evidence=f"{_XLNET}: einsum('ibh,hnd->ibnd')")
    if attr == "o" and shape == (d_model, heads, d_head):
        return Route("dense", fan_in=(1, 2), fan_out=0,
                     evidence=f"{_XLNET}: einsum('ibnd,hnd->ibh')")
    if attr in ("r_r_bias", "r_s_bias", "r_w_bias") and shape == (heads, d_head):
        return Route("vector", evidence=f"{_XLNET}: a bias added to each head")
    if attr == "seg_embed" and len(shape) == 3 and shape[1:] == (heads, d_head):
        return Route("embedding", fan_in=2, fan_out=0,
                     evidence=f"{_XLNET}: segment table, einsum('ibnd,snd->ibns')")
    return None


def module_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The route that the layout of ``module`` gives its parameter ``attr``, or ``None``.

    ``None`` when the module type has no known layout for that parameter (a custom module,
    a ``ConvTranspose``, a bias).  The evidence is ``"module <type>"``.  transformers'
    mixture-of-experts modules are read from :mod:`sage_torch.moe` (fused experts
    ``(E, out, in)`` or ``(E, in, out)`` with the expert axis a batch axis, routers ``(E, d)``).
    """
    expert = moe.moe_route(module, attr, param)
    if expert is not None:
        return expert
    if _is_xlnet_attention(module):
        return _xlnet_route(module, attr, param)
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


def _owner_route(owner: _Owner, param: torch.Tensor) -> Route | None:
    """:func:`module_route`, or the layout a known container's parent gives (peft LoRA)."""
    route = module_route(owner.module, owner.attr, param)
    if route is not None or not _is_peft_lora_embedding(owner.parent):
        return route
    layer = owner.parent
    vocab, width = getattr(layer, "in_features", None), getattr(layer, "out_features", None)
    shape = tuple(param.shape)
    if owner.slot == "lora_embedding_A" and param.dim() == 2 and shape[1] == vocab:
        return Route("embedding", fan_in=0, fan_out=1,
                     evidence="module peft lora.Embedding: A (r, V) read as "
                              "F.embedding(x, A.T)")
    if owner.slot == "lora_embedding_B" and param.dim() == 2 and shape[0] == width:
        return Route("dense", fan_in=1, fan_out=0,
                     evidence="module peft lora.Embedding: B (d, r) read as x @ B.T")
    return None


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


# ------------------------------------------------------------------------------ the advice

Option = tuple[Any, str]
"""``(route, when)``: a remedy and when it is right ("it is a stack of (in, out) ...")."""

_VECTOR_OPTION: Option = ("vector", "element-wise rules are wanted")


def _names_embedding(name: str) -> bool:
    """Whether a component of ``name`` (the leaf too) says embedding (``pos_emb``, ``wte``)."""
    return names_token_embedding(name) or any(
        core.says_embedding(part) for part in components(name))


def _options(shape: Sequence[int], *, kind: str | None = None, table_first: bool = False,
             vocab: int | None = None, torch_weight: bool = False) -> list[Option]:
    """The remedies for a matrix whose layout is unknown, most likely first.

    ``kind``: only routes of that kind (an override gave it).  ``table_first``: the name or
    the module says embedding.  ``vocab``: the token table's row count; the reading whose
    vocab axis has that size comes first.  ``torch_weight``: PyTorch named it ``weight``.
    """
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
        if torch_weight and len(shape) >= 4:
            options = [out_first, stack_oi, stack_io, in_first]
        elif torch_weight:
            options = [stack_oi, out_first, stack_io, in_first]
        else:
            options = [stack_io, stack_oi, in_first, out_first]
        if table_first:
            options.insert(0, (Route("embedding", fan_in=-1, fan_out=-2),
                               "it is a stack of (V, d) tables over the leading axes"))
    if kind is not None:  # the readings of that kind first, then the others' axes
        ordered = [o for o in options if o[0].kind == kind]
        ordered += [o for o in options if o[0].kind != kind]
        options, seen = [], set()
        for route, when in ordered:
            if (route.fan_in, route.fan_out) not in seen:
                seen.add((route.fan_in, route.fan_out))
                options.append((dataclasses.replace(route, kind=kind), when))
    return [*options, _VECTOR_OPTION]


def _advice_lines(name: str, options: Sequence[Option]) -> str:
    """``  - <when>: route_overrides={name: route}`` per option, for the message."""
    lines = []
    for route, when in options:
        text = when.removeprefix("it is ") if route != "vector" else "element-wise rules only"
        lines.append(f"  - {text}: " + (override_advice(name, route)
                                         if isinstance(route, Route)
                                         else f"route_overrides={{{name!r}: {route!r}}}"))
    return "\n".join(lines)


def _known_layouts() -> str:
    return ("known: nn.Linear, nn.Embedding, nn.EmbeddingBag, transformers Conv1D and "
            "XLNetRelativeAttention, peft LoRA Embedding, nn.Conv1d/2d/3d, the experts and "
            "routers of transformers' mixture-of-experts models)")


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
                   _VECTOR_OPTION]
        why = ("a transposed convolution's weight is (in, out/groups, *taps), and which "
               "axes are its fan-in is a modelling choice; to read input channels and taps as "
               "the fan-in, as for nn.Conv: " + override_advice(name, conv))
        return RoutingError(f"cannot place parameter {name!r} of shape {_fmt_shape(shape)} "
                            f"{where}: {why}", leaf=name, shape=shape, options=options)
    flattened = moe.flattened_layout(module, owners[0].attr) if module is not None else None
    if flattened is not None and p.dim() == 2:
        return _flattened_experts(name, p, module, flattened)
    if module is not None and moe.says_experts(module) and p.dim() == 3 and kind in (
            None, "dense"):
        return _unknown_experts(name, p, module)
    embeddingish = _names_embedding(name) or any(
        isinstance(o.module, nn.Embedding | nn.EmbeddingBag)
        or _is_peft_lora_embedding(o.parent) for o in owners)
    options = _options(shape, kind=kind, table_first=embeddingish, vocab=vocab)
    what = f"routed {kind!r} by an override, but its" if kind else "its"
    return RoutingError(
        f"cannot place parameter {name!r} of shape {_fmt_shape(shape)} {where}: {what} "
        f"layout is unknown ({_known_layouts()}). Say which axes are fan-in and fan-out, "
        f"e.g. if it is\n{_advice_lines(name, options)}\n"
        "(Route is sage_optim.routing.Route, also sage_torch.Route)",
        leaf=name, shape=shape, options=options,
    )


def _flattened_experts(name: str, p: torch.Tensor, module: nn.Module | None,
                       layout: str) -> RoutingError:
    """The refusal of experts stored as one 2-D ``(E·n, d)`` weight (DBRX)."""
    shape = tuple(int(s) for s in p.shape)
    as_read = Route("dense", fan_in=1, fan_out=0) if layout == moe.OUT_IN else Route(
        "dense", fan_in=0, fan_out=1)
    other = Route("dense", fan_in=as_read.fan_out, fan_out=as_read.fan_in)
    reads = "F.linear(x, W[e]), each expert (out, in)" if layout == moe.OUT_IN else (
        "x @ W[e], each expert (in, out)")
    options: list[Option] = [
        (as_read, f"one matrix over all experts is acceptable, read as the forward reads each "
                  f"expert ({reads}; SinkGD's and SAGE's normalisations then mix the experts)"),
        (other, "it is the transposed reading (not what the forward does)"),
        _VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {_fmt_shape(shape)} in module "
        f"{_label(module) if module is not None else '?'}: it holds every expert's matrix "
        f"stacked along axis 0 and its forward views it per expert ({reads}), so no route "
        "gives each expert its own normalisation. E.g. if\n"
        f"{_advice_lines(name, options)}\n"
        "(Route is sage_optim.routing.Route, also sage_torch.Route)",
        leaf=name, shape=shape, options=options,
    )


def _unknown_experts(name: str, p: torch.Tensor, module: nn.Module) -> RoutingError:
    """The error for a 3-D tensor of an experts module that :mod:`sage_torch.moe` lacks."""
    shape = tuple(int(s) for s in p.shape)
    oi = Route("dense", fan_in=2, fan_out=1, batch=0)
    io = Route("dense", fan_in=1, fan_out=2, batch=0)
    options: list[Option] = [
        (oi, "it is (E, out, in), one matrix per expert read as F.linear(x, W[e]) (most "
             "families: Mixtral, Qwen-MoE, DeepSeek)"),
        (io, "it is (E, in, out), read as x @ W[e] or torch.bmm(x, W) (GPT-OSS, Llama-4)"),
        _VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {_fmt_shape(shape)} in module "
        f"{_label(module)}: an experts module whose layout is unknown (not in sage_torch.moe."
        "EXPERTS). To tell, look at its forward: F.linear(x, W[e]) means (E, out, in) (the "
        "first remedy), x @ W[e] or torch.bmm(x, W) means (E, in, out); the expert axis is a "
        f"batch axis either way. E.g. if it is\n{_advice_lines(name, options)}\n"
        "(Route is sage_optim.routing.Route, also sage_torch.Route)",
        leaf=name, shape=shape, options=options,
    )


# ------------------------------------------------------------------------------- the heads


def _pick_token(tables: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
    """*The* token table among ``(name, weight)`` tables (the shared policy picks it)."""
    picked = core.pick_token_table(
        [core.TableFact(n, int(t.shape[0]), int(t.shape[1])) for n, t in tables])
    return next((t for t in tables if picked is not None and t[0] == picked.name), None)


# ------------------------------------------------------------------------ the module router


def _literal_overrides(names: Sequence[str],
                       overrides: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``overrides`` with each glob that equals a parameter's name made literal.

    ``"params[3]"`` then matches the parameter ``params[3]`` (as a glob, ``[3]`` would be a
    character class); every other glob is kept as written.
    """
    if not overrides:
        return None
    known = set(names)
    return {glob.escape(k) if k in known and glob.escape(k) != k else k: v
            for k, v in overrides.items()}


def _match(names: Sequence[str], overrides: Mapping[str, Any] | None) -> dict[str, Route]:
    """:func:`~sage_optim.routing.match_overrides` with literal names (see above)."""
    return match_overrides(names, _literal_overrides(names, overrides))


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
        for pname, route in _match(all_names, overrides).items():
            p = by_name[pname]
            seen = self.overrides.get(id(p))
            if seen is not None and seen[1] != route:
                canonical = self.param_names[id(p)]
                options = [(_as_option(seen[1]), f"{seen[0]}'s override is the right one"),
                           (_as_option(route), f"{pname}'s override is the right one")]
                raise RoutingError(
                    f"parameter {canonical!r} of shape {_fmt_shape(p.shape)} is tied "
                    f"({seen[0]} is {pname}: one parameter, one route), and the overrides "
                    f"route its names differently: {seen[1]} and {route}; give one, e.g. "
                    + override_advice(canonical, seen[1]),
                    leaf=canonical, shape=p.shape, options=options,
                )
            self.overrides[id(p)] = (pname, route)
        api = _api_owner(model)
        has_in, in_module = _api_module(api, "get_input_embeddings")
        has_out, out_module = _api_module(api, "get_output_embeddings")
        self.api_in = _api_weight(in_module, self.param_names) if has_in else None
        self.api_out = _api_weight(out_module, self.param_names) if has_out else None
        self.out_module = out_module if self.api_out is not None else None
        self.tables = self._tables()
        self.expert_factors = _peft_expert_factors(model)
        self.token = self._token_embedding()
        # the head by shape only when the model has no API saying which one it is
        self.find_heads = not has_out
        self.linears = {id(w) for _, w in self._linears()}

    # -- evidence ----------------------------------------------------------------------

    def _tables(self) -> list[tuple[str, torch.Tensor]]:
        """Every ``nn.Embedding``/``nn.EmbeddingBag`` weight, once, under its first name."""
        tables = [(o.path, o.module.weight) for regs in self.owners.values() for o in regs
                  if isinstance(o.module, nn.Embedding | nn.EmbeddingBag)
                  and o.attr == "weight"]
        unique = {id(w): (self.param_names.get(id(w), path), w) for path, w in tables}
        return list(unique.values())

    def _linears(self) -> list[tuple[str, torch.Tensor]]:
        """The ``nn.Linear`` weights (the head candidates), in model order."""
        out: list[tuple[str, torch.Tensor]] = []
        for p_id, regs in self.owners.items():
            if p_id not in self.param_names:
                continue
            linear = [o for o in regs if isinstance(o.module, nn.Linear) and o.attr == "weight"]
            if linear:
                out.append((self.param_names[p_id], self.named_params[p_id]))
        return out

    def _token_embedding(self) -> tuple[str, torch.Tensor] | None:
        """*The* token embedding: the model API's, the only table, or the one so named."""
        if self.api_in is not None:
            return self.param_names[id(self.api_in)], self.api_in
        return _pick_token(self.tables)

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
            r = _owner_route(o, p)
            if r is not None:
                routes.append((o, r))
        if len({(r.kind == "vector", r.fan_in, r.fan_out, r.view) for _, r in routes}) > 1:
            listed = "; ".join(f"{o.path} ({r.evidence}: fan_in={r.fan_in}, "
                               f"fan_out={r.fan_out})" for o, r in routes)
            options = [(Route(r.kind, r.fan_in, r.fan_out),
                        f"{o.path} reads it as its {r.evidence} says") for o, r in routes]
            raise RoutingError(
                f"parameter {name!r} of shape {_fmt_shape(p.shape)} is tied between modules "
                f"that read it with different layouts: {listed}; say which is right, e.g. "
                + override_advice(name, routes[0][1]),
                leaf=name, shape=p.shape, options=[*options, _VECTOR_OPTION],
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
            if not routes or routes[0][1].kind == "vector":
                return None  # an API module of unknown layout: asked for below
            evidence = api + (f", {tied}" if tied else "")
            return Route("embedding", routes[0][1].fan_in, routes[0][1].fan_out,
                         evidence=evidence)
        if not routes:
            return None
        embedding = [(o, r) for o, r in routes if r.kind == "embedding"]
        own = next((r for o, r in routes if o.path == name), None)
        kind = "embedding" if embedding else routes[0][1].kind
        if embedding and all(o.path != name for o, _ in embedding):
            evidence = f"tied to {embedding[0][0].path}"  # a table through another name
        elif own is not None:
            evidence = own.evidence + (f", {tied}" if tied else "")
        else:  # reached through another registration: say through which
            source = (embedding or routes)[0][0].path
            evidence = f"tied to {source}"
        first = routes[0][1]
        return Route(kind, first.fan_in, first.fan_out, evidence=evidence, view=first.view)

    @property
    def vocab(self) -> int | None:
        """The token table's row count, when the token table is known."""
        return int(self.token[1].shape[0]) if self.token is not None else None

    # -- one parameter -----------------------------------------------------------------

    def evidence(self, name: str, p: torch.Tensor) -> core.Evidence:
        """What the model says of one trainable parameter (its route, or why it cannot)."""
        regs = self.owners.get(id(p), [])
        shape = tuple(int(n) for n in p.shape)
        for o in regs:
            if isinstance(o.module, nn.Embedding | nn.EmbeddingBag) and o.module.sparse:
                return core.Evidence(name, shape, RoutingError(
                    f"parameter {name!r} of shape {_fmt_shape(p.shape)} belongs to "
                    f"{_label(o.module)}(sparse=True) at {o.path.rpartition('.')[0]!r}: it "
                    "gets sparse gradients, which no sage_torch rule takes (SAGE reduces over "
                    "the vocab axis, the others are dense). Build it with sparse=False, or "
                    f"set model.get_submodule({o.path.rpartition('.')[0]!r}).sparse = False",
                    leaf=name, shape=p.shape,
                ), final=True)
        if id(p) in self.expert_factors:  # per expert; else refused (a kind takes Linear's)
            factor, what = self.expert_factors[id(p)]
            return core.Evidence(
                name, tuple(int(n) for n in p.shape),
                factor if factor is not None else _merged_expert_factors(name, p, what),
                layout=self._layout(name, p))
        try:
            route: Route | RoutingError = self._default(name, p, regs)
        except RoutingError as err:
            route = err
        return core.Evidence(
            name, shape, route, api_token=p is self.api_in,
            head_candidate=id(p) in self.linears and p.requires_grad and p.dim() == 2)

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

    def decide(self, records: Sequence[core.Evidence]) -> dict[str, Route | RoutingError]:
        """The shared decision (:func:`sage_optim.routing.decide`) on this model's evidence."""
        params = {n: q for n, q in self.named}
        overrides = {self.param_names[pid]: r for pid, (_, r) in self.overrides.items()}

        def refuse(e: core.Evidence, override: Route) -> RoutingError:
            q = params[e.name]
            if q.dim() < 2:
                return _too_few_dims(e.name, q, override.kind)
            return _unknown_layout(e.name, q, self.owners.get(id(q), []), override.kind,
                                   self.vocab)

        return core.decide(records, overrides, refuse_override=refuse,
                           find_heads=self.find_heads,
                           head_remedy="The model has no get_output_embeddings(). Name")


def _as_option(route: Route) -> Any:
    """A parsed override as the value to paste: the kind alone when it gives no axes."""
    return route.kind if not route.has_axes and route.batch is None else route


def _merged_expert_factors(name: str, p: torch.Tensor, what: str) -> RoutingError:
    """The refusal of peft's LoRA factors of fused experts (no per-expert route exists).

    Its remedy is the kind ``"dense"`` (axes from the ``nn.Linear`` that holds it), not a
    :class:`Route`: the refusal stands even where every matrix reading gives one update.
    """
    shape = tuple(int(s) for s in p.shape)
    options: list[Option] = [
        ("dense", "one (out, in) matrix over all experts' factors is acceptable (as nn.Linear "
                  "reads it; SinkGD's and SAGE's normalisations then mix the experts)"),
        _VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {_fmt_shape(shape)}: it is {what}. peft "
        "reshapes it per expert, so its expert axis is merged with the rank axis and no "
        "route gives each expert's factor its own normalisation. To train it as one (out, in) "
        f"matrix, as nn.Linear reads it: route_overrides={{{name!r}: 'dense'}}; or, if "
        f"it is\n{_advice_lines(name, options)}",
        leaf=name, shape=shape, options=options,
    )


def _too_few_dims(name: str, p: torch.Tensor, kind: str) -> RoutingError:
    return RoutingError(
        f"parameter {name!r} of shape {_fmt_shape(p.shape)} is routed {kind!r} by an "
        f"override, but it has fewer than two dimensions; route it 'vector': "
        f"route_overrides={{{name!r}: 'vector'}}",
        leaf=name, shape=p.shape, options=[("vector", "it is a vector: element-wise rules")],
    )


# --------------------------------------------------------------- without the model: names


@dataclasses.dataclass
class _Entry:
    """One parameter given without its model: its name, tensor and param group."""

    name: str
    param: torch.Tensor
    group: int | None = None
    bare: bool = False  # no name given: ``params[i]``


def _is_pair(x: Any) -> bool:
    return (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)
            and isinstance(x[1], torch.Tensor))


def _group_members(group: Mapping[str, Any], index: int | None,
                   prefix: str) -> list[_Entry]:
    """The members of one param group (tensors or ``(name, tensor)`` pairs) as entries."""
    params = group["params"]
    if isinstance(params, torch.Tensor):
        params = [params]
    elif isinstance(params, set):
        raise TypeError("optimizer parameters need to be organized in ordered collections, "
                        "but the ordering of tensors in sets will change between runs; use a "
                        "list")
    params = list(params)
    names = group.get("param_names")
    if names is not None and len(list(names)) != len(params):
        raise ValueError(f"param group {index}: {len(list(names))} param_names for "
                         f"{len(params)} params")
    out = []
    for i, x in enumerate(params):
        if _is_pair(x):
            out.append(_Entry(x[0], x[1], index))
        elif isinstance(x, torch.Tensor):
            if names is not None:
                out.append(_Entry(str(list(names)[i]), x, index))
            else:
                out.append(_Entry(f"{prefix}params[{i}]", x, index, bare=True))
        else:
            raise TypeError(f"optimizer can only optimize Tensors, but {prefix}params[{i}] "
                            f"is a {type(x).__name__}")
    if any(_is_pair(x) for x in params) and not all(_is_pair(x) for x in params):
        raise ValueError("all optimizer params should be with/without names; some param names "
                         f"are missing (param group {index})" if index is not None else
                         "all optimizer params should be with/without names; some param "
                         "names are missing")
    return out


def _entries(params: Any) -> tuple[list[_Entry], list[dict[str, Any]]]:
    """What ``torch.optim`` accepts as ``params``, as entries and the groups' options."""
    if isinstance(params, torch.Tensor):
        raise TypeError("params argument given to the optimizer should be an iterable of "
                        "Tensors or dicts (or the nn.Module), but got a "
                        f"{torch.typename(params)}")
    if isinstance(params, Mapping):
        raise TypeError("params must be an nn.Module, an iterable of tensors, of (name, "
                        "tensor) pairs or of param-group dicts; got a mapping (for a state "
                        "dict, pass list(state_dict.items()) or the model)")
    items = list(params)
    if not items:
        raise ValueError("optimizer got an empty parameter list")
    if not all(isinstance(x, dict) for x in items):
        if any(isinstance(x, dict) for x in items):
            raise TypeError("params mixes param-group dicts with tensors; give groups only")
        return _group_members({"params": items}, None, ""), []
    entries, options = [], []
    for gi, group in enumerate(items):
        if "params" not in group:
            raise ValueError(f"param group {gi} has no 'params'")
        if "rule" in group:
            raise ValueError(
                f"param group {gi} sets rule={group['rule']!r}: make_optimizer gives each "
                "kind its configuration's rule; give kind= (and fan_in_dim=/fan_out_dim=) "
                "instead, or add the group afterwards with opt.add_param_group")
        entries += _group_members(group, gi, f"param_groups[{gi}].")
        options.append({k: v for k, v in group.items() if k not in ("params", "param_names")})
    return entries, options


def _name_evidence(name: str, p: torch.Tensor) -> Route | None:
    """The route PyTorch's names give a matrix (``weight`` (out, in), tables (V, d)), or None.

    The reading is :func:`sage_optim.routing.torch_name_reading`, shared with
    ``sage_optax``'s converted state dicts; ``None`` where the names cannot say (a GPT-2
    ``Conv1D`` name, embedding and projection in one name, indices only): refused.
    """
    if p.dim() != 2:
        return None
    reading = core.torch_name_reading(name)
    if reading == "table":
        return Route("embedding", fan_in=1, fan_out=0, evidence="name: table (V, d)")
    if reading == "linear":
        return Route("dense", fan_in=1, fan_out=0, evidence="name 'weight': torch (out, in)")
    return None


class _NameRouter:
    """Parameters given without their model: names (if any) and shapes are the evidence."""

    def __init__(self, entries: Sequence[_Entry], overrides: Mapping[str, Any] | None,
                 groups: Sequence[Mapping[str, Any]] = ()) -> None:
        self.groups = groups
        seen: dict[int, _Entry] = {}
        for e in entries:
            seen.setdefault(id(e.param), e)
        self.entries = list(seen.values())
        self.names = {e.name: e for e in self.entries}
        all_names = {e.name: e for e in reversed(entries)}
        self.overrides: dict[int, Route] = {}
        for pname, route in _match([e.name for e in entries], overrides).items():
            p = all_names[pname].param
            canonical = seen[id(p)].name
            before = self.overrides.get(id(p))
            if before is not None and before != route:
                raise RoutingError(
                    f"parameter {canonical!r} of shape {_fmt_shape(p.shape)} is given under "
                    f"several names (one tensor, one route), and the overrides route them "
                    f"differently: {before} and {route}; give one, e.g. "
                    + override_advice(canonical, before),
                    leaf=canonical, shape=p.shape,
                    options=[(_as_option(before), "the first override is the right one"),
                             (_as_option(route), "the second override is the right one")])
            self.overrides[id(p)] = route
        layouts = {id(e.param): _name_evidence(e.name, e.param) for e in self.entries}
        self.layouts = layouts
        tables = [(e.name, e.param) for e in self.entries
                  if (r := layouts[id(e.param)]) is not None and r.kind == "embedding"]
        self.linears = {id(e.param) for e in self.entries
                        if (r := layouts[id(e.param)]) is not None and r.kind == "dense"
                        and components(e.name)[-1] == "weight"}
        token = self.token = _pick_token(tables)
        self.conv1d = conv1d_reading(
            [(e.name, tuple(e.param.shape)) for e in self.entries
             if not e.bare and e.param.dim() == 2 and names_conv1d(e.name)],
            int(token[1].shape[1]) if token is not None else None)

    @property
    def vocab(self) -> int | None:
        return int(self.token[1].shape[0]) if self.token is not None else None

    def _refuse(self, e: _Entry, kind: str | None,
                axes: tuple[Any, Any] | None = None) -> RoutingError:
        p = e.param
        shape = tuple(int(s) for s in p.shape)
        if axes is not None:  # the group gives the axes, not the kind
            options: list[Option] = [
                (Route("dense", fan_in=axes[0], fan_out=axes[1]),
                 "it is a dense matrix (a projection), not a vocabulary"),
                (Route("embedding", fan_in=axes[0], fan_out=axes[1]),
                 "it is a vocabulary matrix (a token table or an output head)")]
            return RoutingError(
                f"cannot place parameter {e.name!r} of shape {_fmt_shape(shape)}: its param "
                f"group gives fan_in_dim={axes[0]!r}, fan_out_dim={axes[1]!r} but no kind; add "
                "kind='dense' or kind='embedding' to the group, or route it, e.g. if it is\n"
                + _advice_lines(e.name, options),
                leaf=e.name, shape=shape, options=options)
        parts = components(e.name)
        if not e.bare and p.dim() == 2 and names_conv1d(e.name):
            return self._refuse_conv1d(e, kind)
        options = _options(shape, kind=kind, table_first=_names_embedding(e.name),
                           vocab=self.vocab, torch_weight=parts[-1] == "weight" and not e.bare)
        if parts[-1] == "weight" and p.dim() == 2 and not e.bare:  # (out, in) or (V, d)
            options = core.torch_weight_options(shape, kind, self.vocab)
        if e.bare:
            why = ("a bare tensor (no name, no module), so nothing says which axes are its "
                   "fan-in and fan-out, nor whether it is a vocabulary matrix")
        elif parts[-1] == "weight" and p.dim() == 2:
            why = core.TORCH_WEIGHT_WHY.get(core.torch_name_reading(e.name) or "",
                                            core.TORCH_WEIGHT_WHY["unnamed"])
        else:
            why = (f"its name does not say its layout (PyTorch's names: a 2-D 'weight' is "
                   f"(out, in), a 2-D 'weight' under an 'emb' name a table (V, d)); a "
                   f"{p.dim()}-D parameter may be stacked layers, a multi-axis projection or "
                   "a convolution" if p.dim() > 2 else
                   "its name does not say its layout (PyTorch's names: a 2-D 'weight' is "
                   "(out, in), a 2-D 'weight' under an 'emb' name a table (V, d))")
        what = f"routed {kind!r}, but " if kind else ""
        names = " or model.named_parameters()" if e.bare else ""
        return RoutingError(
            f"cannot place parameter {e.name!r} of shape {_fmt_shape(shape)}: {what}{why}. "
            f"Pass the model itself (make_optimizer(name, model): its module types decide){names}, "
            "or route it in route_overrides (per parameter), "
            f"e.g. if it is\n{_advice_lines(e.name, options)}\n"
            "(Route is sage_optim.routing.Route, also sage_torch.Route)",
            leaf=e.name, shape=shape, options=options)

    def _refuse_conv1d(self, e: _Entry, kind: str | None) -> RoutingError:
        """The refusal of a weight with a GPT-2 ``Conv1D`` name (both readings)."""
        return conv1d_refusal(
            e.name, e.param.shape, self.conv1d,
            "Pass the model itself (make_optimizer(name, model): its modules decide), or "
            "route it in route_overrides (Route is sage_optim.routing.Route, also "
            "sage_torch.Route)", kind)

    def evidence(self, e: _Entry) -> core.Evidence:
        """What the names, shapes and param group say of one entry (or why they cannot)."""
        p = e.param
        group = self.groups[e.group] if e.group is not None else {}
        try:
            route: Route | RoutingError = self._default(e, group)
        except RoutingError as err:
            route = err
        except ValueError as err:  # a group that contradicts its members: unless overridden
            if id(p) not in self.overrides:
                raise
            route = RoutingError(str(err))
        return core.Evidence(
            e.name, tuple(int(n) for n in p.shape), route, by_names=True,
            given_kind=group.get("kind"),
            head_candidate=id(p) in self.linears and p.requires_grad and p.dim() == 2)

    def _default(self, e: _Entry, group: Mapping[str, Any]) -> Route:
        """The route of the names, shapes and group, before overrides and the head."""
        name, p = e.name, e.param
        layout = self.layouts[id(p)]
        kind = group.get("kind")
        fan_in, fan_out = group.get("fan_in_dim"), group.get("fan_out_dim")
        if (fan_in is None) != (fan_out is None):
            raise ValueError(f"param group {e.group} gives only one of fan_in_dim "
                             f"({fan_in!r}) and fan_out_dim ({fan_out!r}); give both")
        if kind is not None:
            if kind == "vector":
                return Route("vector", evidence="param group kind")
            if p.dim() < 2:
                raise ValueError(f"parameter {name!r} of shape {_fmt_shape(p.shape)} is in a "
                                 f"param group of kind {kind!r}, but has fewer than two dims; "
                                 "put it in a 'vector' group")
            if fan_in is not None:
                return Route(kind, fan_in, fan_out, evidence="param group kind and axes")
            if layout is not None:
                return Route(kind, layout.fan_in, layout.fan_out,
                             evidence=f"param group kind, axes {layout.evidence}")
            if not e.bare and p.dim() == 2 and names_conv1d(name):
                raise self._refuse_conv1d(e, kind)
            return Route(kind, -1, -2, evidence="param group kind, torch's default axes "
                         "(out, in)")
        if p.dim() <= 1:
            return Route("vector", evidence=f"shape: {p.dim()}-D")
        if fan_in is not None:
            if layout is not None:
                return Route(layout.kind, fan_in, fan_out,
                             evidence=f"param group axes, kind {layout.evidence}")
            raise self._refuse(e, None, (fan_in, fan_out))
        if layout is not None:
            return layout
        if sum(n != 1 for n in p.shape) <= 1:
            return Route("vector", evidence="shape: one non-unit axis")
        raise self._refuse(e, None)

    def decide(self, records: Sequence[core.Evidence]) -> dict[str, Route | RoutingError]:
        """The shared decision (:func:`sage_optim.routing.decide`) on these names."""
        overrides = {e.name: self.overrides[id(e.param)] for e in self.entries
                     if id(e.param) in self.overrides}

        def refuse(ev: core.Evidence, override: Route) -> RoutingError:
            e = self.names[ev.name]
            if e.param.dim() < 2:
                return _too_few_dims(e.name, e.param, override.kind)
            return self._refuse(e, override.kind)

        return core.decide(
            records, overrides, refuse_override=refuse,
            head_remedy="Pass the model itself (make_optimizer(name, model): its modules and "
                        "get_output_embeddings() decide), or name")


# ------------------------------------------------------------------------------- routing


@dataclasses.dataclass
class Routing:
    """The routes of every trainable parameter, and the errors of those not placed.

    What :func:`route_params` computes before it raises; :func:`sage_torch.make_optimizer`
    first lets :meth:`accept_equivalent` place the parameters whose every reading gets the
    same update under its configuration.

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

    def accept_equivalent(self, key: Callable[[ResolvedRoute], Hashable], why: str) -> None:
        """Place each refused parameter whose readings all give the same update.

        ``key(route)`` says what update a route gets (its rule and hyperparameters, and its
        axes where the rule reads them); a parameter whose matrix options (its remedies but
        ``'vector'``) all have one key gets the first, with the evidence ``why``.  An error
        whose parameters are all placed is dropped.
        """
        by_name = {n: (n, p) for n, p, _ in self.order}
        kept: list[RoutingError] = []
        for err in self.errors:
            problems = err.problems or (err,)
            left = []
            for prob in problems:
                route = None
                if prob.leaf is not None and prob.leaf in by_name:
                    name, p = by_name[prob.leaf]
                    route = _same_update(prob, name, p, key, why)
                if route is None or prob.leaf is None:
                    left.append(prob)
                else:
                    self.routes[id(by_name[prob.leaf][1])] = route
            if len(left) == len(problems):
                kept.append(err)
            else:
                kept.extend(left)
        self.errors = kept


def _same_update(prob: RoutingError, name: str, p: torch.Tensor,
                 key: Callable[[ResolvedRoute], Hashable], why: str) -> ResolvedRoute | None:
    candidates = [r for r, _ in prob.options
                  if isinstance(r, Route) and r.kind != "vector" and r.has_axes]
    if not candidates:
        return None
    try:
        resolved = [r.resolve(p.shape, name) for r in candidates]
    except RoutingError:
        return None
    if len({key(r) for r in resolved}) != 1:
        return None
    return dataclasses.replace(resolved[0], evidence=why)


def _collect(named: Sequence[tuple[str, torch.Tensor, int | None]],
             evidence: Callable[[str, torch.Tensor], core.Evidence],
             decide: Callable[[list[core.Evidence]], dict[str, Route | RoutingError]],
             skip_frozen: bool = True) -> tuple[list[tuple[str, torch.Tensor, int | None]],
                                                dict[int, ResolvedRoute], list[RoutingError]]:
    """Route every (trainable) parameter of ``named``, collecting the errors.

    The evidence of every parameter, frozen ones too (a frozen token table still says which
    matrix is the head), goes into one decision; only the trainable ones (all, unless
    ``skip_frozen``) are placed or refused.
    """
    order = []
    records = []
    for name, p, group in named:
        if not (p.is_floating_point() or p.is_complex()):  # complex: the rules judge
            raise RoutingError(
                f"cannot place parameter {name!r} of shape {_fmt_shape(p.shape)}: dtype "
                f"{p.dtype} is neither floating point nor complex, so no optimizer can train "
                "it; register it as a buffer"
            )
        records.append(evidence(name, p))
        if not skip_frozen or p.requires_grad:
            order.append((name, p, group))
    decided = decide(records)
    routes: dict[int, ResolvedRoute] = {}
    errors: list[RoutingError] = []
    seen_errors: set[int] = set()
    for name, p, _ in order:
        route = decided[name]
        if isinstance(route, Route):
            try:
                routes[id(p)] = route.resolve(p.shape, name)
                continue
            except RoutingError as err:
                route = err
        if id(route) not in seen_errors:  # an ambiguous head: one error, several params
            seen_errors.add(id(route))
            errors.append(route)
    return order, routes, errors


def route_group(members: Sequence[tuple[str, torch.Tensor, bool]],
                group: Mapping[str, Any]) -> Routing:
    """Route the members of one param group added to an optimizer, frozen ones too.

    ``members`` are ``(name, tensor, bare)``: ``bare`` when the name was generated
    (``param_groups[3].params[0]``), so that only the shape is evidence.  ``group``'s
    ``kind``/``fan_in_dim``/``fan_out_dim`` place them as in :func:`route_params`.
    """
    router = _NameRouter([_Entry(n, p, 0, bare) for n, p, bare in members], None, [group])
    order, routes, errors = _collect(
        [(e.name, e.param, e.group) for e in router.entries],
        lambda name, p: router.evidence(router.names[name]), router.decide, skip_frozen=False)
    return Routing(order, routes, errors, [dict(group)])


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
        router = _Router(params, overrides)
        order, routes, errors = _collect([(n, p, None) for n, p in router.named],
                                         router.evidence, router.decide,
                                         skip_frozen=not frozen)
        return Routing(order, routes, errors)
    entries, groups = _entries(params)
    names = _NameRouter(entries, overrides, groups)
    order, routes, errors = _collect(
        [(e.name, e.param, e.group) for e in names.entries],
        lambda name, p: names.evidence(names.names[name]), names.decide,
        skip_frozen=not frozen)
    return Routing(order, routes, errors, groups or None,
                   fix="pass the model itself, make_optimizer(name, model), so its module "
                   "types decide")


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
        members named ``param_groups[g].params[i]`` when unnamed).  The module docstring
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
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (the embedding layer dilemma: vocabulary matrices need their own rule).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (SinkGD's norms run along the fan-in and
      fan-out axes).
    """
    return routing(model, overrides).placed()


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in one parameter's state, without its ``step`` counter."""
    return sum(v.numel() * v.element_size() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")
