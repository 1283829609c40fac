"""Name evidence, the weakest: what parameter names say, in both frameworks.

Both gatherers (:mod:`sage_optax.routing`, :mod:`sage_torch.routing`) read names with these
rules: the markers of vectors, token tables and heads, what PyTorch's names say of a 2-D
``weight`` (:func:`torch_name_reading`), and the name conventions of other libraries'
models that names alone cannot read (:class:`NameConvention`, registered by
``sage_optim/adapters/<library>.py``).  Names are used only where unambiguous.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sage_optim.routing import VECTOR_OPTION, AdapterRegistry, Route, RoutingError

VECTOR_NAMES: frozenset[str] = frozenset({"scale", "bias", "b", "gamma", "beta"})
"""Leaf names that hold per-feature vectors, also when stacked into a matrix."""

TOKEN_EMBEDDING_MARKERS: tuple[str, ...] = (
    "wte", "tok", "token", "tokens", "tok_emb", "tok_embeddings", "tok_embedding",
    "embed_tokens", "word_embeddings", "token_embedding", "token_embeddings", "embedder",
    "input_embedding",
)
"""Path components that name the *token* embedding among several tables (``embed`` and
``embedding`` count too; ``docs/routing.md``, "Heads")."""

HEAD_MARKERS: tuple[str, ...] = (
    "lm_head", "head", "output", "unembed", "embed_out", "decoder")
"""Path components that name an output head (BERT's ``predictions.decoder``; a decoder
*stack* lies inside numbered layers); a name alone never makes a head (``docs/routing.md``,
"Heads")."""

TABLE_MODULE_NAMES: frozenset[str] = frozenset({"wpe", "shared", "relative_attention_bias"})
"""Module names whose 2-D ``weight`` is an ``nn.Embedding`` table ``(V, d)`` in every family
that uses them (GPT-2's ``wpe``, T5's and BART's ``shared``, T5's bucket table)."""

NON_VOCAB_WORDS: frozenset[str] = frozenset({
    "pos", "position", "positions", "positional", "wpe", "type", "types", "segment",
    "segments", "seg", "rel", "relative", "bucket", "buckets",
})
"""Words of a table's name that mark it as positions, token types or segments: a matrix that
fits only such a table is not taken for an output head."""


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
    return any("position" in part or any(w in NON_VOCAB_WORDS for w in re.split(r"[^a-z]+", part))
               for part in components(name)[:-1])


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

    ``"table"`` (an ``nn.Embedding`` ``(V, d)``), ``"linear"`` (an ``nn.Linear`` ``weight``
    ``(out, in)``), or why the names cannot say: ``"convention"`` (a registered
    :class:`NameConvention`), ``"ambiguous"`` (embedding and projection in one component),
    ``"unnamed"`` (no word besides indices).  ``None``: not a PyTorch name.
    ``docs/routing.md`` ("Evidence, strongest first") states the rules.
    """
    parts = components(name)
    leaf = parts[-1]
    if leaf in TOKEN_EMBEDDING_MARKERS or leaf in ("embed", "embedding"):
        return "table"
    if leaf != "weight":
        return None
    if name_convention(name) is not None:
        return "convention"
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

    An ``nn.Linear`` first, unless its rows are the token table's ``vocab``; ``kind`` (an
    override's or a group's) keeps that first reading only.
    """
    linear = (Route(kind or "dense", fan_in=1, fan_out=0), "it is an nn.Linear weight (out, in)")
    table = (Route(kind or "embedding", fan_in=1, fan_out=0),
             "it is an nn.Embedding table (V, d) or an output head")
    options = [table, linear] if vocab is not None and int(shape[0]) == vocab else [
        linear, table]
    return [*options[:1 if kind else 2], VECTOR_OPTION]


def names_table_module(name: str) -> bool:
    """Whether ``name`` is the ``weight`` of a :data:`TABLE_MODULE_NAMES` module (a table)."""
    parts = components(name)
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in TABLE_MODULE_NAMES


@dataclasses.dataclass(frozen=True)
class NameConvention:
    """Another library's parameter names that names alone cannot read (``docs/routing.md``).

    A name-convention module in ``sage_optim/adapters`` registers one (loaded with the first
    routing by names, in both frameworks: a converted state dict keeps its names without
    the library); :func:`torch_name_reading` then refuses the weights it flags.

    Attributes:
      name: the convention, for the registry.
      flags: ``name -> bool``: whether the parameter ``name`` follows the convention.
      reading: ``([(name, shape)], width) -> str | None``: what the shapes of a model's
        flagged 2-D weights say of their layout against the token table's width ``d``
        (orders the remedies; never places a weight).
      refusal: ``(name, shape, reading, remedy, kind) -> RoutingError``: the refusal of a
        flagged weight; ``remedy`` the framework's advice, ``kind`` an override's kind.
    """

    name: str
    flags: Callable[[str], bool]
    reading: Callable[[Sequence[tuple[str, Sequence[int]]], int | None], str | None]
    refusal: Callable[[str, Sequence[int], str | None, str, str | None], RoutingError]


def name_convention(name: str) -> NameConvention | None:
    """The registered :class:`NameConvention` that flags ``name``, or ``None``."""
    return next((c for c in NAME_CONVENTIONS.all() if c.flags(name)), None)


def convention_readings(weights: Sequence[tuple[str, Sequence[int]]],
                        width: int | None) -> dict[str, str | None]:
    """``{convention: reading}``: what each convention's 2-D weights among ``weights`` say."""
    return {c.name: c.reading([(n, s) for n, s in weights if len(s) == 2 and c.flags(n)],
                              width) for c in NAME_CONVENTIONS.all()}


def convention_refusal(name: str, shape: Sequence[int], readings: Mapping[str, str | None],
                       remedy: str, kind: str | None = None) -> RoutingError | None:
    """The refusal of a 2-D weight a convention flags (:func:`convention_readings`), or None."""
    found = name_convention(name) if len(shape) == 2 else None
    return None if found is None else found.refusal(name, shape, readings.get(found.name),
                                                    remedy, kind)


NAME_CONVENTIONS = AdapterRegistry(NameConvention, __package__,
                                   pathlib.Path(__file__).with_name("adapters"), eager=True)
"""The name conventions of other libraries' models (``sage_optim/adapters/<library>.py``)."""
