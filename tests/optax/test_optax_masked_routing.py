"""Routing decided on the whole model: placeholders never change another leaf's route.

Wrapping the optimizer in ``optax.masked``, ``optax.multi_transform`` (``optax.partition``)
with an ``optax.set_to_zero`` part hands it the params with ``optax.MaskedNode``
placeholders.  The untied head is found by the token table's shape, so a masked table used
to turn the head from SAGE into SinkGD, silently.  Now the routes come from the whole model
(``params=`` or ``model=`` at construction), or the optimizer refuses in one line.

Each case compares, in float64, the update of every trained leaf with the update the
unwrapped optimizer gives on the whole tree (the independent reference: no placeholder
anywhere), for a masked embedding, head and dense matrix, on plain dicts, linen params and
``nnx.state`` (and ``nnx.Optimizer``), in the wrapped forms the README uses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import sage_optax
from sage_optax.routing import RoutingError

V, D, H = 24, 6, 10
MASKED = {"embedding": "tok.embedding", "head": "lm_head.kernel", "dense": "up.kernel"}


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


class NnxLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, param_dtype=jnp.float64, rngs=rngs)
        self.up = nnx.Linear(D, H, param_dtype=jnp.float64, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, param_dtype=jnp.float64, rngs=rngs)


class LinenLM(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = nn.Embed(V, D, param_dtype=jnp.float64, name="tok")(tokens)
        x = nn.Dense(H, param_dtype=jnp.float64, name="up")(x)
        return nn.Dense(V, use_bias=False, param_dtype=jnp.float64, name="lm_head")(x[..., :D])


def _rnd(shape: tuple[int, ...], seed: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float64)


def container(kind: str) -> tuple[Any, Any]:
    """``(params, model)`` of one container, with the model for ``model=`` (or None)."""
    if kind == "dict":
        return {"tok": {"embedding": _rnd((V, D), 0)},
                "up": {"kernel": _rnd((D, H), 1), "bias": _rnd((H,), 2)},
                "lm_head": {"kernel": _rnd((D, V), 3)}}, None
    if kind == "linen":
        return LinenLM().init(jax.random.key(0), jnp.zeros((1, 3), jnp.int32))["params"], None
    model = NnxLM(nnx.Rngs(0))
    return nnx.state(model, nnx.Param), model


def _path(path: tuple[Any, ...]) -> str:
    return sage_optax.axes.path_str(path)


def _labels(params: Any, masked: str, train: Any, frozen: Any) -> Any:
    return jax.tree_util.tree_map_with_path(
        lambda p, _: frozen if _path(p) == masked else train, params)


def wrapped(form: str, masked: str, **whole: Any) -> optax.GradientTransformation:
    """The configuration in one of the README's wrapped forms, ``masked`` not trained."""
    tx = sage_optax.make_optimizer("sage-hybrid", **whole)
    if form == "masked":
        return optax.masked(tx, lambda p: _labels(p, masked, True, False))
    if form == "chain-masked":  # the README's clipping chain, inside optax.masked
        return optax.masked(optax.chain(optax.clip_by_global_norm(1e9), tx),
                            lambda p: _labels(p, masked, True, False))
    if form == "multi_transform":
        return optax.multi_transform({"train": tx, "freeze": optax.set_to_zero()},
                                     lambda p: _labels(p, masked, "train", "freeze"))
    assert form == "partition"
    return optax.partition({"train": tx, "freeze": optax.set_to_zero()},
                           lambda p: _labels(p, masked, "train", "freeze"))


def _flat(tree: Any) -> dict[str, np.ndarray]:
    return {n: np.asarray(x) for n, x in sage_optax.routing.iter_leaves(tree)}


def _reference(params: Any, model: Any) -> dict[str, np.ndarray]:
    """Two steps of the unwrapped optimizer on the whole tree: every leaf's update."""
    tx = sage_optax.make_optimizer("sage-hybrid", **({} if model is None else {"model": model}))
    state = tx.init(params)
    for step in range(2):
        grads = jax.tree.map(lambda x, s=step: jnp.cos(x * (3 + s)), params)
        updates, state = tx.update(grads, state, params)
    return _flat(updates)


@pytest.mark.parametrize("form", ["masked", "chain-masked", "multi_transform", "partition"])
@pytest.mark.parametrize("which", sorted(MASKED))
@pytest.mark.parametrize("kind", ["dict", "linen", "nnx"])
def test_wrapped_update_equals_the_whole_models(kind: str, which: str, form: str) -> None:
    params, model = container(kind)
    whole = {"params": params} if model is None else {"model": model}
    if kind == "linen" and form == "partition":  # linen's module evidence as the whole model
        whole = {"model": sage_optax.linen_model(LinenLM(), jnp.zeros((1, 3), jnp.int32))}
    masked = MASKED[which]
    want = _reference(params, model)
    tx = wrapped(form, masked, **whole)
    state = tx.init(params)
    for step in range(2):
        grads = jax.tree.map(lambda x, s=step: jnp.cos(x * (3 + s)), params)
        updates, state = tx.update(grads, state, params)
    got = _flat(updates)
    for name, u in got.items():
        if name == masked:  # not trained: passed through (masked) or zeroed (set_to_zero)
            expect = 0.0 if form in ("multi_transform", "partition") else np.cos(
                np.asarray(_flat(params)[name]) * 4)
            np.testing.assert_allclose(u, expect, rtol=1e-12, atol=0)
        else:
            np.testing.assert_allclose(u, want[name], rtol=1e-12, atol=0, err_msg=name)


@pytest.mark.parametrize("kind", ["dict", "linen"])
def test_routing_table_of_masked_tree_keeps_the_head(kind: str) -> None:
    """The issue's case: the untied head stays SAGE with the token table masked."""
    params, _ = container(kind)
    full = sage_optax.routing_table("sage-hybrid", params)
    masked = jax.tree_util.tree_map_with_path(
        lambda p, x: optax.MaskedNode() if _path(p) == MASKED["embedding"] else x, params)
    table = sage_optax.routing_table("sage-hybrid", masked, params=params)
    assert table.row("lm_head.kernel").rule == "sage"
    for row in table.rows:
        assert row == full.row(row.path)


@pytest.mark.parametrize("form", ["masked", "multi_transform"])
@pytest.mark.parametrize("kind", ["dict", "linen"])
def test_placeholders_without_the_whole_model_are_refused(kind: str, form: str) -> None:
    """One line naming ``params=``; following that advice gives the whole model's routes."""
    params, _ = container(kind)
    tx = wrapped(form, MASKED["embedding"])
    with pytest.raises(RoutingError) as err:
        tx.init(params)
    message = str(err.value)
    assert "\n" not in message and "make_optimizer(name, params=params)" in message
    assert "'tok.embedding'" in message
    table = sage_optax.routing_table(
        "sage-hybrid", jax.tree_util.tree_map_with_path(
            lambda p, x: optax.MaskedNode() if _path(p) == MASKED["embedding"] else x, params),
        params=params)
    assert table.row("lm_head.kernel").kind == "embedding"


def test_a_tree_that_is_not_the_whole_models_is_refused() -> None:
    params, _ = container("dict")
    other = dict(params, up={"kernel": _rnd((D, H + 1), 5), "bias": _rnd((H + 1,), 6)})
    tx = wrapped("masked", MASKED["embedding"], params=params)
    with pytest.raises(RoutingError, match=r"'up.bias' of shape \(11,\).* has shape "
                                           r"\(10,\) there"):
        tx.init(other)
    # the advice: the params this optimizer trains as params=
    state = wrapped("masked", MASKED["embedding"], params=other).init(other)
    assert jax.tree.leaves(state)


def test_the_first_whole_tree_routed_decides() -> None:
    """Without ``params=``, a tree without placeholders routed first is the whole model."""
    params, _ = container("dict")
    tx = sage_optax.make_optimizer("sage-hybrid")
    tx.init(params)  # the whole tree, routed
    masked = jax.tree_util.tree_map_with_path(
        lambda p, x: optax.MaskedNode() if _path(p) == MASKED["embedding"] else x, params)
    state = tx.init(masked)
    head = [st for st in jax.tree.leaves(state, is_leaf=lambda x: isinstance(
        x, sage_optax.ScaleBySageState)) if isinstance(st, sage_optax.ScaleBySageState)]
    assert any(not isinstance(st.mu["lm_head"], optax.MaskedNode) for st in head)


def test_nnx_optimizer_with_masked_embedding_matches() -> None:
    """``nnx.Optimizer`` (the README's form) over ``optax.masked``: the head keeps SAGE."""
    ref_model, model = NnxLM(nnx.Rngs(0)), NnxLM(nnx.Rngs(0))
    ref = nnx.Optimizer(ref_model, sage_optax.make_optimizer("sage-hybrid", model=ref_model),
                        wrt=nnx.Param)
    opt = nnx.Optimizer(model, optax.masked(
        sage_optax.make_optimizer("sage-hybrid", model=model),
        lambda p: _labels(p, MASKED["embedding"], True, False)), wrt=nnx.Param)
    for m, o in ((ref_model, ref), (model, opt)):
        grads = jax.tree.map(lambda x: jnp.cos(3 * x), nnx.state(m, nnx.Param))
        o.update(m, grads)
    np.testing.assert_allclose(np.asarray(model.lm_head.kernel[...]),
                               np.asarray(ref_model.lm_head.kernel[...]), rtol=1e-12, atol=0)
    np.testing.assert_allclose(np.asarray(model.up.kernel[...]),
                               np.asarray(ref_model.up.kernel[...]), rtol=1e-12, atol=0)
