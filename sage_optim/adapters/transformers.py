"""GPT-2's ``Conv1D`` names: a name convention that names alone cannot read.

transformers' ``Conv1D`` (GPT-2 and its relatives) stores its ``weight`` ``(in, out)``,
while nanoGPT and GPTBigCode give the same module names to ``nn.Linear`` weights
``(out, in)``: both routers refuse such a weight given by name only, ordering the remedies
by what the shapes of the model's weights say (:func:`conv1d_reading`).  Registered as a
:class:`sage_optim.naming.NameConvention`; the module type itself is read by
``sage_torch/adapters/transformers.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sage_optim.naming import NAME_CONVENTIONS, NameConvention, components
from sage_optim.routing import VECTOR_OPTION, Route, RoutingError, override_advice

CONV1D_NAMES: frozenset[str] = frozenset({"c_attn", "q_attn", "c_fc", "c_proj"})
"""Module names whose ``weight`` no name can read: transformers' ``Conv1D`` in GPT-2 and its
relatives (OpenAI GPT, ImageGPT, Decision Transformer, CLVP) stores it ``(in, out)``, while
nanoGPT and GPTBigCode give the same names to ``nn.Linear`` weights ``(out, in)``.  Given by
name only, such a weight is refused (:func:`conv1d_reading` orders the remedies)."""

_TAKES_WIDTH: frozenset[str] = frozenset({"c_attn", "q_attn", "c_fc"})
"""The :data:`CONV1D_NAMES` whose input is the model width (``c_proj`` outputs it)."""


def names_conv1d(name: str) -> bool:
    """Whether ``name`` is the ``weight`` of a :data:`CONV1D_NAMES` module (``attn.c_attn``)."""
    parts = components(name)
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in CONV1D_NAMES


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
        leaf=name, shape=shape, options=[*options, VECTOR_OPTION])


CONVENTION = NAME_CONVENTIONS.register(NameConvention(
    "conv1d", flags=names_conv1d, reading=conv1d_reading, refusal=conv1d_refusal))
"""The GPT-2 ``Conv1D`` convention, registered with :data:`sage_optim.naming.NAME_CONVENTIONS`."""
