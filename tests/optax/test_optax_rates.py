"""sage_optax: the effective step per kind in the routing table, ``<kind>_learning_rate=``,
and the notice for an AdamW-style rate (issue 45)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sage_optax
from sage_optim import rates

PARAMS = {"tok": {"embedding": jnp.linspace(-1, 1, 50 * 16).reshape(50, 16)},
          "mlp": {"kernel": jnp.linspace(-1, 1, 16 * 24).reshape(16, 24)},
          "norm": {"scale": jnp.ones(16)}}
GRADS = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                     PARAMS)


def update(name, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rates.LearningRateNotice)
        tx = sage_optax.make_optimizer(name, *args, weight_decay=0.0, **kw)
    return tx.update(GRADS, tx.init(PARAMS), PARAMS)[0]


def test_the_table_shows_each_kinds_effective_step():
    steps = {r.kind: r.step for r in sage_optax.routing_table("sinkgd-hybrid", PARAMS).rows}
    assert steps == {"dense": "0.001 (0.02 x 0.05)", "embedding": "0.02", "vector": "0.02"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", rates.LearningRateNotice)
        table = sage_optax.routing_table("sinkgd-hybrid", PARAMS, learning_rate=1.6e-3)
    assert table.row("mlp.kernel").step == "8e-05 (0.0016 x 0.05)"
    assert "step" in str(table).splitlines()[0].split()


def test_a_kinds_rate_is_one_keyword():
    mixed = update("sinkgd-hybrid", 1.6e-3, dense_learning_rate=2e-2)
    preset = update("sinkgd-hybrid", 2e-2)
    program = update("sinkgd-hybrid", 1.6e-3)
    np.testing.assert_array_equal(mixed["mlp"]["kernel"], preset["mlp"]["kernel"])
    np.testing.assert_array_equal(mixed["tok"]["embedding"], program["tok"]["embedding"])
    assert not np.allclose(preset["mlp"]["kernel"], program["mlp"]["kernel"])
    table = sage_optax.routing_table("sinkgd-hybrid", PARAMS, learning_rate=1.6e-3,
                                     dense_learning_rate=2e-2)
    assert table.row("mlp.kernel").step == "0.001 (0.02 x 0.05)"
    assert table.row("tok.embedding").step == "0.0016"


def test_an_adamw_style_rate_gets_a_notice_naming_the_presets_rate():
    rates._NOTED.clear()
    with pytest.warns(rates.LearningRateNotice, match=r"preset's rate 0\.02") as seen:
        sage_optax.make_optimizer("sinkgd-hybrid", 1.6e-3)
    assert "dense (sinkgd(sqrt, alpha=0.05)) steps at 8e-05" in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sage_optax.make_optimizer("sinkgd-hybrid", 1.6e-3)  # once
        sage_optax.make_optimizer("sinkgd-hybrid")  # the preset's own rate
        sage_optax.make_optimizer("sage-hybrid", 1.6e-3)  # within its range
