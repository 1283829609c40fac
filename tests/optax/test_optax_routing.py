"""The router (docs/routing.md) on Flax NNX states, dicts, stacked layers and overrides."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import sage_optax
from sage_optax import Route
from sage_optax import route_params as label_params
from sage_repro.llama_shapes import llama_param_shapes
from sage_train.model.shapes import get_model_config


class Tiny(nnx.Module):
    def __init__(self, rngs, tied=True):
        self.embed = nnx.Embed(32, 8, rngs=rngs)
        self.proj = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.RMSNorm(8, rngs=rngs)
        if not tied:
            self.lm_head = nnx.Linear(8, 32, use_bias=False, rngs=rngs)


def leaves(routing):
    flat = {}
    for path, label in jax.tree_util.tree_flatten_with_path(routing.labels)[0]:
        flat[sage_optax.routing.leaf_name_path(path)] = label
    return flat


@pytest.mark.parametrize("tied", [True, False])
def test_nnx_state(tied):
    state = nnx.state(Tiny(nnx.Rngs(0), tied), nnx.Param)
    r = label_params(state)
    labels = leaves(r)
    assert labels["embed.embedding"] == "embedding"
    assert labels["proj.kernel"] == "dense"
    assert labels["proj.bias"] == "vector"
    assert labels["norm.scale"] == "vector"
    if not tied:
        assert labels["lm_head.kernel"] == "embedding"  # an untied head is a vocab matrix
    axes = {sage_optax.routing.leaf_name_path(p): a
            for p, a in jax.tree_util.tree_flatten_with_path(r.axes)[0]}
    assert axes["embed.embedding"] == Route("embedding", fan_in=-1, fan_out=-2)  # (V, d)
    assert axes["proj.kernel"] == Route("dense", fan_in=-2, fan_out=-1)
    if not tied:
        assert axes["lm_head.kernel"] == Route("embedding", fan_in=-2, fan_out=-1)  # (d, V)


def test_nnx_optimizer_routes_like_label_params():
    model = Tiny(nnx.Rngs(0), tied=False)
    opt = nnx.Optimizer(model, sage_optax.make_optimizer("sage-hybrid"), wrt=nnx.Param)
    table = sage_optax.routing_table("sage-hybrid", nnx.state(model, nnx.Param))
    assert sage_optax.state_bytes(opt.opt_state) == table.total_bytes
    assert table.row("lm_head.kernel").state_bytes == (32 * 8 + 8) * 4  # M (d, V) + S: O(d)


def test_stacked_layers_are_batch_axes_once_declared():
    params = {"layers": {"mlp": {"kernel": jnp.ones((3, 8, 16))},
                         "norm": {"scale": jnp.ones((3, 8))}}}
    with pytest.raises(sage_optax.RoutingError, match="stacked layers"):
        label_params(params)  # (3, 8, 16) may be stacked, multi-axis or a convolution
    r = label_params(params, {"layers.mlp.kernel": Route("dense", fan_in=-2, fan_out=-1),
                              "layers.norm.scale": Route("vector", batch=0)})
    assert r.labels["layers"]["mlp"]["kernel"] == "dense"
    assert r.labels["layers"]["norm"]["scale"] == "vector"
    assert r.axes["layers"]["norm"]["scale"] == Route("vector", batch=(0,))
    resolved = r.axes["layers"]["mlp"]["kernel"].resolve((3, 8, 16))
    assert resolved.batch == (0,) and (resolved.fan_in, resolved.fan_out) == ((1,), (2,))


def test_overrides_by_glob():
    params = {"blocks": {"0": {"attn": {"kernel": jnp.ones((4, 4))}},
                         "1": {"attn": {"kernel": jnp.ones((4, 4))}}},
              "head": {"w": jnp.ones((4, 50))}}
    r = label_params(params, {"blocks.1.*": "vector",
                              "head.w": Route("embedding", fan_in=-2, fan_out=-1)})
    assert r.labels["blocks"]["0"]["attn"]["kernel"] == "dense"
    assert r.labels["blocks"]["1"]["attn"]["kernel"] == "vector"
    assert r.labels["head"]["w"] == "embedding"
    with pytest.raises(ValueError, match="kind must be one of"):  # RoutingError
        label_params(params, {"head.w": "matrix"})


def test_vocab_size_finds_the_vocab_axis():
    params = {"unembed": {"w": jnp.ones((16, 100))}}
    r = label_params(params, vocab_size=100)
    assert r.axes["unembed"]["w"] == Route("embedding", fan_in=-2, fan_out=-1)


def test_masked_nodes_pass_through():
    import optax
    params = {"a": jnp.ones((3, 4)), "b": optax.MaskedNode()}
    r = label_params(params)
    assert r.labels["a"] == "dense" and isinstance(r.labels["b"], optax.MaskedNode)


def test_llama_shapes_route_as_the_paper_says():
    params = llama_param_shapes(get_model_config("tiny"))
    table = sage_optax.routing_table("sage-hybrid", params)
    kinds = {r[0]: r[2] for r in table.rows}
    assert kinds["embed.embedding"] == "embedding"
    assert kinds["layers.0.attn.q_proj.kernel"] == "dense"
    assert kinds["layers.1.mlp.down_proj.kernel"] == "dense"
    assert kinds["layers.0.attn_norm.scale"] == "vector"
    assert kinds["final_norm.scale"] == "vector"
