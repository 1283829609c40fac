"""The peft adapter: the layouts of peft's LoRA layers that no ``torch.nn`` type says.

* LoRA's ``Embedding`` holds its factors in ``nn.ParameterDict`` children:
  ``lora_embedding_A`` ``(r, V)`` is read as ``F.embedding(x, A.T)`` (a table whose vocab
  axis is 1, fan-in 0), ``lora_embedding_B`` ``(d, r)`` as ``after_A @ B.T`` (dense
  ``(out, in)``).
* ``ParamWrapper`` (``target_parameters`` LoRA on an ``(E, ., .)`` fused-experts tensor)
  stores the factors of all experts in two ``nn.Linear`` weights, ``lora_A`` ``(E·r, in)``
  (expert-major rows) and ``lora_B`` ``(out, r·E)`` (expert-minor columns), which peft
  reshapes per expert rather than calls: each gets a per-expert route with the view peft
  takes (:func:`factor_route`), or, when its shape does not split, a refusal.

peft is never imported here: its classes are looked up in ``sys.modules``, and
:mod:`sage_torch.routing` loads this adapter once peft is imported.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from sage_optim.routing import VECTOR_OPTION, Option, Route, RoutingError, advice_lines, fmt_shape
from sage_torch.routing import (
    Adapter,
    loaded_class,
    register_adapter,
)

__all__ = ["ADAPTER", "FACTORS", "child_route", "factor_route", "holds_tables", "model_routes"]

_LAYER = "peft.tuners.lora.layer"

FACTORS = {
    "lora_A": "peft's A (E·r, in) read per expert as A.reshape(E, r, in)[e]",
    "lora_B": "peft's B (out, r·E) read per expert as B.reshape(out, r, E)[:, :, e]",
}
"""How peft's ``ParamWrapper`` (``target_parameters`` LoRA on an ``(E, ., .)`` experts
tensor) reads its two factors, from ``peft/tuners/lora/layer.py`` (0.18-0.21)
``ParamWrapper.get_delta_weight``: ``weight_A.reshape(num_experts, -1, in)`` and
``weight_B.reshape(out, -1, num_experts)``, ``delta[e] = B[:, :, e] @ A[e]`` (``in``/``out``
the expert's true fan-in and fan-out, whatever the tensor's layout)."""


def factor_route(which: str, param: torch.Tensor, experts: int, target: str) -> Route | None:
    """The per-expert route of a LoRA factor of peft's ``ParamWrapper``, or ``None``.

    ``which`` is ``"lora_A"`` or ``"lora_B"``, ``experts`` the wrapper's ``num_experts``,
    ``target`` the wrapped tensor for the evidence (``Qwen3MoeExperts.gate_up_proj``).  A
    (:data:`FACTORS`): ``(E·r, in)`` viewed ``(E, r, in)``, each expert's ``(r, in)`` read
    as ``F.linear`` (fan-in 2, fan-out 1, batch 0); B: ``(out, r·E)`` viewed
    ``(out, r, E)``, each expert's ``(out, r)`` (fan-in 1, fan-out 0, batch 2).  ``None`` when
    the shape does not split into ``experts`` factors.
    """
    if param.dim() != 2 or experts < 1:
        return None
    rows, cols = (int(n) for n in param.shape)
    evidence = f"module peft ParamWrapper of {target}: {FACTORS.get(which, '')}"
    if which == "lora_A" and rows % experts == 0:
        return Route("dense", fan_in=2, fan_out=1, batch=0,
                     view=(experts, rows // experts, cols), evidence=evidence)
    if which == "lora_B" and cols % experts == 0:
        return Route("dense", fan_in=1, fan_out=0, batch=2,
                     view=(rows, cols // experts, experts), evidence=evidence)
    return None


def holds_tables(module: nn.Module) -> bool:
    """Whether ``module`` is LoRA's ``Embedding`` (its children hold tables)."""
    cls = loaded_class(_LAYER, "Embedding")
    return cls is not None and isinstance(module, cls)


def child_route(parent: nn.Module, slot: str, param: torch.Tensor) -> Route | None:
    """The route LoRA's ``Embedding`` gives a factor in its child ``parent.<slot>``."""
    if not holds_tables(parent) or param.dim() != 2:
        return None
    vocab, width = getattr(parent, "in_features", None), getattr(parent, "out_features", None)
    shape = tuple(param.shape)
    if slot == "lora_embedding_A" and shape[1] == vocab:
        return Route("embedding", fan_in=0, fan_out=1,
                     evidence="module peft lora.Embedding: A (r, V) read as "
                              "F.embedding(x, A.T)")
    if slot == "lora_embedding_B" and shape[0] == width:
        return Route("dense", fan_in=1, fan_out=0,
                     evidence="module peft lora.Embedding: B (d, r) read as x @ B.T")
    return None


def _merged_factors(name: str, p: torch.Tensor, what: str) -> RoutingError:
    """The refusal of peft's LoRA factors of fused experts (no per-expert route exists).

    Its remedy is the kind ``"dense"`` (axes from the ``nn.Linear`` that holds it), not a
    :class:`Route`: the refusal stands even where every matrix reading gives one update.
    """
    shape = tuple(int(s) for s in p.shape)
    options: list[Option] = [
        ("dense", "one (out, in) matrix over all experts' factors is acceptable (as nn.Linear "
                  "reads it; SinkGD's and SAGE's normalisations then mix the experts)"),
        VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {fmt_shape(shape)}: it is {what}. peft "
        "reshapes it per expert, so its expert axis is merged with the rank axis and no "
        "route gives each expert's factor its own normalisation. To train it as one (out, in) "
        f"matrix, as nn.Linear reads it: route_overrides={{{name!r}: 'dense'}}; or, if "
        f"it is\n{advice_lines(name, options)}",
        leaf=name, shape=shape, options=options,
    )


_LAYOUTS = (("lora_A", "(E·r, in), the rows of each expert together"),
            ("lora_B", "(out, r·E), the columns of each expert strided"))


def _wrapper_factors(module: nn.Module, experts: int,
                     names: Mapping[int, str]) -> dict[int, Route | RoutingError]:
    """The routes (or refusals) of the factors one ``ParamWrapper`` holds."""
    get_base = getattr(module, "get_base_layer", None)
    base = type(get_base()).__name__ if callable(get_base) else "experts"
    target = f"{base}.{getattr(module, 'parameter_name', '?')}"
    found: dict[int, Route | RoutingError] = {}
    for which, layout in _LAYOUTS:
        for linear in getattr(module, which, {}).values():
            weight = getattr(linear, "weight", None)
            if not isinstance(weight, nn.Parameter):
                continue
            route = factor_route(which, weight, experts, target)
            what = (f"peft LoRA's {which} of the {experts} experts of {target} "
                    f"(ParamWrapper): {layout}")
            found[id(weight)] = route if route is not None else _merged_factors(
                names.get(id(weight), "?"), weight, what)
    return found


def model_routes(model: nn.Module, names: Mapping[int, str]) -> dict[int, Route | RoutingError]:
    """The routes of the LoRA factors that ``ParamWrapper`` holds for fused experts, by ``id``.

    Each factor gets the per-expert route of :func:`factor_route` (a view), or the refusal
    that says why none exists when its shape does not split.
    """
    cls = loaded_class(_LAYER, "ParamWrapper")
    if cls is None:
        return {}
    found: dict[int, Route | RoutingError] = {}
    for module in model.modules():
        experts = getattr(module, "num_experts", 1)
        if isinstance(module, cls) and isinstance(experts, int) and experts > 1:
            found.update(_wrapper_factors(module, experts, names))
    return found


ADAPTER = register_adapter(Adapter(
    "peft", known="peft LoRA Embedding", child_route=child_route, holds_tables=holds_tables,
    model_routes=model_routes))
"""The peft adapter, registered with :func:`sage_torch.routing.register_adapter`."""
