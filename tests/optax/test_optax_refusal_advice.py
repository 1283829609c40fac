"""A refusal's first advice works on the case that produced it.

An Equinox GPT's bare ``(128, 64)`` positional table (a ``jax.Array`` field named
``pos_embed``) is refused: its name says an embedding, nothing says which axis indexes it.
The message used to advise ``vocab_size=...`` first, and ``vocab_size=1024`` (the
vocabulary) returned the identical error: ``vocab_size`` places the *token* table, not a
table of positions.  The first advice is now the override, pasted from the message here and
checked to give the table reading (rows = fan-out, SAGE's reduced axis), with and without
``vocab_size``; ``vocab_size`` is offered only as a later option, and a given one that fits
neither axis is said to.
"""

from __future__ import annotations

import re
from typing import Any

import equinox as eqx
import jax
import pytest

import sage_optax
from sage_optax import Route
from sage_optax.routing import RoutingError


class GPT(eqx.Module):
    wte: eqx.nn.Embedding
    pos_embed: jax.Array
    fc: eqx.nn.Linear
    head: eqx.nn.Linear

    def __init__(self, key: jax.Array):
        k = jax.random.split(key, 4)
        self.wte = eqx.nn.Embedding(1024, 64, key=k[0])
        self.pos_embed = jax.random.normal(k[1], (128, 64))
        self.fc = eqx.nn.Linear(64, 256, key=k[2])
        self.head = eqx.nn.Linear(64, 1024, use_bias=False, key=k[3])


def _first_advice(message: str) -> dict[str, Any]:
    """The first ``route_overrides={...}`` the message's first line gives, evaluated."""
    first = message.splitlines()[0]
    match = re.search(r"route_overrides=(\{.*?\})", first)
    assert match, first
    return eval(match.group(1), {"Route": Route})  # noqa: S307 - our own message


@pytest.mark.parametrize("vocab_size", [None, 1024])
def test_first_advice_places_the_positional_table(vocab_size: int | None) -> None:
    model = GPT(jax.random.key(0))
    extra = {} if vocab_size is None else {"vocab_size": vocab_size}
    with pytest.raises(RoutingError) as err:
        sage_optax.routing_table("sage-hybrid", model, **extra)
    message = str(err.value)
    first = message.splitlines()[0]
    assert "'pos_embed' of shape (128, 64)" in first
    # vocab_size is not the first advice, and never offered once it was given in vain
    assert 0 < first.index("route_overrides=") < first.index("vocab_size")
    if vocab_size is not None:
        assert "vocab_size=1024 matches neither axis" in first
        assert "vocab_size=V" not in first
    overrides = _first_advice(message)
    table = sage_optax.routing_table("sage-hybrid", model, route_overrides=overrides, **extra)
    row = table.row("pos_embed")
    assert (row.kind, row.rule, row.fan_in, row.fan_out) == ("embedding", "sage", "1 (64)",
                                                            "0 (128)")
    # the rest of the model is routed as before: the untied head by the table's shape
    assert table.row("head.weight").kind == "embedding"
    assert table.row("wte.weight").fan_out == "0 (1024)"


def test_vocab_size_still_places_a_token_table_named_like_an_embedding() -> None:
    """Where the table *is* the token table, the later advice (vocab_size=V) works."""
    params = {"tok_emb_table": jax.ShapeDtypeStruct((64, 1024), "float32")}
    with pytest.raises(RoutingError, match="vocab_size=V places it too"):
        sage_optax.routing_table("sage-hybrid", params)
    row = sage_optax.routing_table("sage-hybrid", params, vocab_size=1024).row("tok_emb_table")
    assert (row.kind, row.fan_out) == ("embedding", "1 (1024)")
