"""``optax.inject_hyperparams(sage_optax.sage_hybrid)(learning_rate=..., model=m)`` works.

optax calls every callable argument not in ``static_args`` with the step count, as a
schedule; an ``nnx.Module`` given as ``model=`` was called (``IndexError: Too many
indices`` for an LM, a ``dot_general`` ``TypeError`` for the README's ``nnx.Linear``).
Binding ``sage_hybrid``'s signature now keeps ``model`` (and a callable ``mask``) static,
so the injected optimizer's state is the uninjected one's (``inner_state``), leaf for leaf,
and so is its update; naming them in ``static_args`` (the README's form) is the same.
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import sage_optax


class LM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(64, 16, rngs=rngs)
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.head = nnx.Linear(32, 64, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.head(self.up(self.embed(tokens)))


def _model(kind: str) -> nnx.Module:
    return LM(nnx.Rngs(0)) if kind == "lm" else nnx.Linear(16, 32, rngs=nnx.Rngs(0))


def _mask(params: Any) -> Any:
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _same(a: Any, b: Any, rtol: float = 0.0) -> None:
    """Same tree; same values (to ``rtol``: injected hyperparameters are float32 arrays)."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=0)


@pytest.mark.parametrize("static_args", [(), ("mask", "model")])
@pytest.mark.parametrize("kind", ["lm", "nnx.Linear"])
def test_injected_model_gives_the_uninjected_state_and_update(
        kind: str, static_args: tuple[str, ...]) -> None:
    model = _model(kind)
    params = nnx.state(model, nnx.Param)
    grads = jax.tree.map(lambda x: jnp.cos(3 * x), params)
    tx = optax.inject_hyperparams(sage_optax.sage_hybrid, static_args=static_args)(
        learning_rate=1e-3, model=model, mask=_mask)
    ref = sage_optax.sage_hybrid(learning_rate=1e-3, model=model, mask=_mask)
    state, ref_state = tx.init(params), ref.init(params)
    _same(state.inner_state, ref_state)
    for _ in range(2):
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = ref.update(grads, ref_state, params)
        _same(updates, ref_updates, rtol=2e-6)
        _same(state.inner_state, ref_state, rtol=2e-6)


def test_signature_is_unchanged() -> None:
    """The signature that binds statically is ``sage_hybrid``'s own, parameter for parameter."""
    sig = inspect.signature(sage_optax.sage_hybrid)
    assert isinstance(sig, inspect.Signature)
    assert list(sig.parameters) == list(
        inspect.signature(sage_optax.sage_hybrid.__wrapped__ if hasattr(
            sage_optax.sage_hybrid, "__wrapped__") else sage_optax.sage_hybrid,
            follow_wrapped=False).parameters)
    assert {"model", "mask", "learning_rate", "static"} - set(sig.parameters) == {"static"}
    bound = sig.bind(learning_rate=1.0, model=_model("nnx.Linear"))
    assert not callable(bound.arguments["model"])  # what keeps inject_hyperparams off it
