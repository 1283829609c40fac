"""``route_params`` runs once per parameter tree, not once per kind and per trace (issue 28).

``optax.partition`` asks for the labels of the full tree and then hands each kind's transform
the tree with the other kinds' leaves masked; each used to route its subtree again (four
routings per trace for ``sage-hybrid``).  The kinds now look their axes up in the full
tree's routing, which must be the same axes a fresh routing of the full tree gives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_optax import routing
from sage_optim import CONFIG_NAMES

V, D, F = 32, 8, 16


def params():
    return {"embed": {"embedding": jnp.ones((V, D)) * 0.1},
            "mlp": {"kernel": jnp.linspace(-1, 1, D * F).reshape(D, F)},
            "norm": {"scale": jnp.ones((D,))},
            "head": {"kernel": jnp.linspace(-1, 1, D * V).reshape(D, V)}}


@pytest.fixture
def calls(monkeypatch):
    count = []
    real = routing.route_params

    def counted(*args, **kw):
        count.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(routing, "route_params", counted)
    return count


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_one_routing_for_init_and_every_jitted_update(name, calls):
    tx = sage_optax.make_optimizer(name)
    p = params()
    state = tx.init(p)
    step = jax.jit(tx.update)
    g = jax.tree.map(jnp.ones_like, p)
    for _ in range(2):
        _, state = step(g, state, p)
    jax.jit(tx.update).lower(g, state, p)  # a second trace of the same tree
    assert len(calls) == 1


def test_a_new_tree_is_routed_once_more(calls):
    tx = sage_optax.make_optimizer("sage-hybrid")
    tx.init(params())
    other = {**params(), "extra": {"kernel": jnp.ones((D, D))}}
    tx.init(other)
    tx.init(other)
    assert len(calls) == 2


@pytest.mark.parametrize("name", ["sage-hybrid", "sinkgd-hybrid", "apollo", "sage-pure"])
def test_the_looked_up_axes_are_those_of_routing_the_full_tree(name):
    """The updates equal those of a transform given the full tree's routed axes directly."""
    p = params()
    g = jax.tree.map(lambda x: jnp.sin(3.0 * x) + 0.1, p)
    tx = sage_optax.make_optimizer(name)
    got, _ = tx.update(g, tx.init(p), p)
    routed = sage_optax.route_params(p, warn=False)
    preset = sage_optax.configs.resolve_preset(name, {}, sage_optax.configs.OPTION_KEYS)
    want_tx = optax.partition(
        {k: sage_optax.configs.build_rule(preset.rule(k), preset.learning_rate, routed.axes)
         for k in ("embedding", "dense", "vector")}, routed.labels)
    want, _ = want_tx.update(g, want_tx.init(p), p)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
