"""A routing refusal a newcomer can act on (issue 45): the fix in its first line, the
paste block in patterns.

nanodo builds its optimizer without the model: a 6-layer linen decoder's params tree alone is
refused.  The refusal's first line (at most 200 characters) says the fix; its paste block
holds one glob per layer role (not one entry per layer, which tied the optimizer to the
layer count) and, pasted as it is, routes the model as its linen modules do.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from routing_checks import paste_block
from test_optax_routing_nanodo import TOKENS, DoConfig, TransformerDo

import sage_optax
from sage_optax import RoutingError, route_params
from sage_optax.routing import iter_leaves
from sage_optim.routing import HEADLINE_LIMIT

ROLES = ("query", "key", "value", "attn_out_proj")  # the 3-D kernels: refused without model=


def six_layers():
    cfg = dataclasses.replace(DoConfig(), N=6)
    params = jax.eval_shape(TransformerDo(cfg).init, jax.random.key(0), TOKENS)["params"]
    return cfg, params


def routes(routing):
    return {n: (r.kind, r.fan_in, r.fan_out, r.batch) for n, r in iter_leaves(routing.routes)}


def test_a_six_layer_linen_model_is_routed_by_the_pasted_patterns():
    cfg, params = six_layers()
    with pytest.raises(RoutingError) as info:
        sage_optax.make_optimizer("sage-hybrid").init(params)
    err = info.value
    block = paste_block(err)
    assert block == err.overrides
    assert len(block) <= len(ROLES), sorted(block)  # at most one entry per layer role
    assert all("*" in pattern for pattern in block), sorted(block)
    by_module = routes(route_params(params, model=sage_optax.linen_model(TransformerDo(cfg),
                                                                         TOKENS)))
    assert routes(route_params(params, block)) == by_module
    # the same block routes the 2-layer model too: it does not depend on the layer count
    two = jax.eval_shape(TransformerDo(DoConfig()).init, jax.random.key(0), TOKENS)["params"]
    want = routes(route_params(two, model=sage_optax.linen_model(TransformerDo(DoConfig()),
                                                                 TOKENS)))
    assert routes(route_params(two, block)) == want


def test_the_first_line_is_the_fix():
    _, params = six_layers()
    with pytest.raises(RoutingError) as info:
        route_params(params)
    first, _, rest = str(info.value).partition("\n")
    assert len(first) <= HEADLINE_LIMIT == 200, (len(first), first)
    assert first.startswith("Fix: pass model=sage_optax.linen_model(module, *inputs)"), first
    assert "route_overrides block" in first and "24 parameters" in first
    # details after: one bullet per layer role, the other layers counted, not repeated
    bullets = [line for line in rest.splitlines() if line.startswith("* ")]
    assert len(bullets) == len(ROLES), bullets
    assert all("the same for 5 more parameters matching 'blocks_*." in b for b in bullets)
    assert len(str(info.value)) < 8000, len(str(info.value))  # 36,424 before issue 45


def test_a_pattern_that_would_reach_another_parameter_is_not_used():
    """Globs are checked against every parameter of the tree: where ``*`` would also match
    a parameter the router placed, the parameters are listed one by one."""
    from sage_optim.routing import Route, override_patterns

    errors = [RoutingError(f"cannot place 'h.{i}.w'", leaf=f"h.{i}.w", shape=(4, 4),
                           options=[(Route("dense", 0, 1), "it is (in, out)")])
              for i in (0, 1)]
    assert list(override_patterns(errors, ["h.0.w", "h.1.w"])) == ["h.*.w"]
    assert list(override_patterns(errors, ["h.0.w", "h.1.w", "h.2.w"])) == ["h.0.w", "h.1.w"]
    combined = RoutingError.combine(errors, names=["h.0.w", "h.1.w", "h.2.w"])
    assert combined.overrides == {"h.0.w": Route("dense", 0, 1), "h.1.w": Route("dense", 0, 1)}
