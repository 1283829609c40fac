"""Route the parameters of any ``nn.Module`` into the param groups of a configuration.

SPEC.md section 5 for PyTorch, first match wins:

1. a user override whose glob pattern matches the parameter name (``"layers.*.mlp.*"``);
2. a non-floating parameter cannot be placed: error;
3. a parameter that does not require grad is left out (frozen);
4. the weight of an ``nn.Embedding`` — and so a head tied to it, which is the same
   ``Parameter`` and gets one state — is ``embedding``;
5. 0-D and 1-D parameters (biases, norm weights) are ``vector``;
6. an untied output head, an ``nn.Linear`` whose ``out_features`` is the vocabulary size
   of an ``nn.Embedding`` in the model (or whose name has ``lm_head``/``embed``), is
   ``embedding``: a vocabulary matrix ``(V, d)``;
7. every other ``nn.Linear`` weight is ``dense``;
8. anything else (a convolution, a custom matrix) cannot be placed: error, naming it.

PyTorch matrices are ``(out, in)``: fan-out dim 0 (the vocab dim of ``(V, d)`` tables and
heads), fan-in dim 1.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from sage_optim.presets import KINDS

VOCAB_MARKERS: tuple[str, ...] = ("embed", "lm_head", "wte")


class RoutingError(ValueError):
    """A parameter the router cannot place; the message names it and its size."""


def _override(name: str, overrides: Mapping[str, str]) -> str | None:
    for pattern, kind in overrides.items():
        if fnmatch.fnmatchcase(name, pattern):
            if kind not in KINDS:
                raise ValueError(f"override {pattern!r} -> {kind!r}: kind must be one of {KINDS}")
            return kind
    return None


def route_parameters(
    model: nn.Module, overrides: Mapping[str, str] | None = None
) -> list[tuple[str, nn.Parameter, str]]:
    """``(name, parameter, kind)`` for every trainable parameter of ``model``, in order.

    Args:
      model: any ``nn.Module``.
      overrides: ``{glob pattern: kind}`` matched against parameter names.

    Raises:
      RoutingError: for a parameter it cannot place (non-float, or a matrix that is not
        in an ``nn.Embedding``/``nn.Linear``); the message names it and how to override.
    """
    overrides = dict(overrides or {})
    modules = dict(model.named_modules())
    embeddings = [m for m in modules.values() if isinstance(m, nn.Embedding)]
    embedding_ids = {id(m.weight) for m in embeddings}
    vocab_sizes = {m.num_embeddings for m in embeddings}
    routes = []
    for name, p in model.named_parameters():  # de-duplicated: a tied head appears once
        if not p.is_floating_point():
            raise RoutingError(
                f"cannot place parameter {name!r} of size {tuple(p.shape)}: dtype {p.dtype} is "
                "not floating point, so no optimizer can train it; register it as a buffer"
            )
        if not p.requires_grad:
            continue
        kind = _override(name, overrides)
        if kind is None:
            kind = _default_kind(name, p, modules, embedding_ids, vocab_sizes)
        if kind != "vector" and p.dim() < 2:
            raise RoutingError(
                f"cannot route parameter {name!r} of size {tuple(p.shape)} as {kind!r}: it has "
                "fewer than two dims"
            )
        routes.append((name, p, kind))
    return routes


def _default_kind(name: str, p: torch.Tensor, modules: dict[str, nn.Module],
                  embedding_ids: set[int], vocab_sizes: set[int]) -> str:
    if id(p) in embedding_ids:
        return "embedding"
    if p.dim() < 2:
        return "vector"
    owner = modules.get(name.rpartition(".")[0])
    lowered = name.lower()
    if isinstance(owner, nn.Linear):
        if owner.out_features in vocab_sizes or any(m in lowered for m in VOCAB_MARKERS):
            return "embedding"
        return "dense"
    if any(m in lowered for m in VOCAB_MARKERS) and p.dim() == 2:
        return "embedding"
    raise RoutingError(
        f"cannot place parameter {name!r} of size {tuple(p.shape)} in module "
        f"{type(owner).__name__}: only nn.Embedding and nn.Linear matrices are known; pass "
        f"route_overrides={{{name!r}: 'dense'}} (or another kind) to place it"
    )


def state_nbytes(state: Mapping[str, Any]) -> int:
    """Bytes of the tensors in one parameter's state, without its ``step`` counter."""
    return sum(v.numel() * v.element_size() for k, v in state.items()
               if isinstance(v, torch.Tensor) and k != "step")
