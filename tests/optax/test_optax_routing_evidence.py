"""Issue 28, JAX: remedies in the order of the evidence, and no advice that cannot be taken.

A linen ``nn.MultiHeadDotProductAttention`` (google-deepmind/nanodo) has ``query``/``key``/
``value`` kernels ``(D, H, Dh)`` and an ``out`` kernel ``(H, Dh, D)`` in a plain params
dict.  Without a module they are refused; the first remedy (the paste block,
``err.overrides``) was the stacked reading, ``D`` stacked ``H x Dh`` matrices instead of one
``D x (H·Dh)`` matrix: a different optimizer.  The module's name now puts the attention
reading first, unless a sibling says otherwise (a bias ``(L, F)`` of stacked ``Dense``
layers).  Each first remedy is checked by applying it: its routes equal those
``nnx.MultiHeadAttention``'s own modules give (``model=``), and its SinkGD update equals the
update of the same matrix reshaped to 2-D in its true layout.  A linen module is read through
``model=sage_optax.linen_model(module, *inputs)`` (issue 31), which the error for a linen tree
advises; a bare linen module (bound or not) as ``model=`` says so.  A converted GPT-2 state
dict gets the ``Conv1D`` refusal of ``sage_torch``'s names (``test_torch_routing.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen, nnx
from routing_checks import ARCHITECTURES, build

import sage_optax
from sage_optax import Route, RoutingError, route_params

V, D, H, DH = 50, 16, 2, 8


class LinenAttention(linen.Module):
    """nanodo's attention block: linen's own MultiHeadDotProductAttention, an embed, a head."""

    @linen.compact
    def __call__(self, ids):
        x = linen.Embed(V, D, name="tok")(ids)
        x = linen.MultiHeadDotProductAttention(num_heads=H, qkv_features=H * DH, name="attn")(x)
        return linen.Dense(V, name="lm_head")(x)


def linen_params():
    model = LinenAttention()
    variables = model.init(jax.random.key(0), jnp.ones((1, 4), jnp.int32))
    return model, variables


class NnxAttention(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=H, in_features=D, qkv_features=H * DH,
                                           decode=False, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, rngs=rngs)


def resolved(routing) -> dict:
    """``{path: (kind, fan_in, fan_out, batch)}`` of a ``ParamRouting``'s routes."""
    leaves = jax.tree_util.tree_flatten_with_path(
        routing.routes, is_leaf=lambda x: hasattr(x, "fan_in"))[0]
    return {sage_optax.routing.leaf_name_path(p): (r.kind, r.fan_in, r.fan_out, r.batch)
            for p, r in leaves}


def first_remedies(params) -> dict:
    with pytest.raises(RoutingError) as info:
        route_params(params)
    return info.value.overrides, str(info.value)


ATTENTION = {  # the true readings: nnx.LinearGeneral's, written out
    "attn.query.kernel": ("dense", (0,), (1, 2), ()),
    "attn.key.kernel": ("dense", (0,), (1, 2), ()),
    "attn.value.kernel": ("dense", (0,), (1, 2), ()),
    "attn.out.kernel": ("dense", (0, 1), (2,), ()),
    "attn.query.bias": ("vector", (), (), ()),
    "attn.key.bias": ("vector", (), (), ()),
    "attn.value.bias": ("vector", (), (), ()),
}


def test_linen_attention_first_remedies_are_the_attention_readings():
    _, variables = linen_params()
    params = variables["params"]
    overrides, message = first_remedies(params)
    assert set(overrides) == set(ATTENTION)
    got = resolved(route_params(params, overrides))
    assert {k: got[k] for k in ATTENTION} == ATTENTION
    # the same readings as nnx.MultiHeadAttention's own modules give, path for path
    nnx_model = NnxAttention(nnx.Rngs(0))
    by_module = resolved(route_params(nnx.state(nnx_model, nnx.Param), model=nnx_model))
    assert {k: by_module[k] for k in ATTENTION} == ATTENTION
    assert "Its module's name says an attention input projection" in message


def test_linen_attention_first_remedy_update_is_sinkgd_of_the_true_2d_matrix():
    with jax.enable_x64(True):
        _, variables = linen_params()
        params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64), variables["params"])
        rng = np.random.default_rng(0)
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), params)
        overrides, _ = first_remedies(params)

        def update(tree, grad, route_overrides=None):
            tx = sage_optax.make_optimizer("sage-hybrid", 1.0, weight_decay=0.0,
                                           route_overrides=route_overrides)
            return tx.update(grad, tx.init(tree), tree)[0]

        got = update(params, grads, overrides)["attn"]
        q, o = grads["attn"]["query"]["kernel"], grads["attn"]["out"]["kernel"]
        flat = {"q": {"kernel": params["attn"]["query"]["kernel"].reshape(D, H * DH)},
                "o": {"kernel": params["attn"]["out"]["kernel"].reshape(H * DH, D)}}
        want = update(flat, {"q": {"kernel": q.reshape(D, H * DH)},
                             "o": {"kernel": o.reshape(H * DH, D)}})  # 2-D kernels: (in, out)
        np.testing.assert_allclose(got["query"]["kernel"].reshape(D, H * DH),
                                   want["q"]["kernel"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(got["out"]["kernel"].reshape(H * DH, D),
                                   want["o"]["kernel"], rtol=0, atol=1e-12)
        # the old first remedy, D stacked H x Dh matrices, is another optimizer
        stacked = update(params, grads, {**overrides, "attn.query.kernel": Route("dense", -2, -1)})
        assert not np.allclose(stacked["attn"]["query"]["kernel"].reshape(D, H * DH),
                               want["q"]["kernel"], atol=1e-3)


def test_nnx_state_without_the_model_gets_the_module_readings_first():
    model = NnxAttention(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    overrides, message = first_remedies(state)
    assert "model=model" in message  # an nnx tree: passing the model is a remedy
    assert resolved(route_params(state, overrides)) == resolved(route_params(state, model=model))


def test_stacked_dense_layers_named_query_keep_the_stacked_reading_first():
    """A sibling bias (L, F) says (L, D, F) is stacked Dense layers, not (D, H, Dh)."""
    params = {"query": {"kernel": jnp.ones((3, D, 8)), "bias": jnp.ones((3, 8))}}
    overrides, _ = first_remedies(params)
    assert overrides == {"query.kernel": Route("dense", -2, -1),
                         "query.bias": Route("vector", batch=(0,))}


def test_scanned_attention_gets_the_attention_reading_per_layer():
    """nn.scan over L layers: (L, D, H, Dh) kernels, (L, H, Dh) biases, (L, H, Dh, D) out."""
    params = {"attn": {"query": {"kernel": jnp.ones((3, D, H, DH)), "bias": jnp.ones((3, H, DH))},
                       "out": {"kernel": jnp.ones((3, H, DH, D)), "bias": jnp.ones((3, D))}}}
    overrides, _ = first_remedies(params)
    got = resolved(route_params(params, overrides))
    assert got["attn.query.kernel"] == ("dense", (1,), (2, 3), (0,))
    assert got["attn.query.bias"] == ("vector", (), (), (0,))
    assert got["attn.out.kernel"] == ("dense", (1, 2), (3,), (0,))


def test_linen_errors_advise_linen_model_and_a_bare_module_says_how():
    model, variables = linen_params()
    _, message = first_remedies(variables["params"])
    assert "for a linen model pass model=sage_optax.linen_model(module, *inputs)" in message
    ids = jax.ShapeDtypeStruct((1, 4), jnp.int32)
    got = resolved(route_params(variables["params"],
                                model=sage_optax.linen_model(model, ids)))
    assert {k: got[k] for k in ATTENTION} == ATTENTION  # the modules' readings, no override
    for given in (model, model.bind(variables)):
        with pytest.raises(TypeError, match=r"flax linen module.*sage_optax\.linen_model"):
            route_params(variables["params"], model=given)
        with pytest.raises(TypeError, match="flax linen module"):
            sage_optax.make_optimizer("sage-hybrid", model=given)
    bound = sage_optax.linen_model(model.bind(variables), ids)  # a bound module: its clone
    assert resolved(route_params(variables["params"], model=bound)) == got


def test_converted_gpt2_state_dict_refuses_conv1d_names_with_the_module_reading_first():
    transformers = pytest.importorskip("transformers")
    import sage_torch

    transformers.logging.set_verbosity_error()
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=4 * D, n_embd=D, n_layer=1, n_head=2, n_positions=32))
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}
    overrides, message = first_remedies(params)
    assert "Route the model in PyTorch with sage_torch" in message
    assert set(overrides) == {k for k in params if ".c_" in k and k.endswith(".weight")}
    got = resolved(route_params(params, overrides))
    truth = {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
             for r in sage_torch.route_params(model)}
    assert {k: v[:3] for k, v in got.items()} == truth  # wpe a table, c_proj no head


def test_a_layers_kernel_of_the_heads_shape_is_refused_not_a_head():
    """Tied head (x @ E.T), an MLP of width V: layers.0.up.kernel (d, V) is a layer's."""
    params = {"tok": {"embedding": jnp.ones((V, D))},
              "layers": {"0": {"up": {"kernel": jnp.ones((D, V))},
                               "down": {"kernel": jnp.ones((V, D))}}}}
    overrides, message = first_remedies(params)
    assert "lies inside numbered layers" in message
    assert overrides == {"layers.0.up.kernel": Route("dense", -2, -1)}
    assert resolved(route_params(params, overrides))["layers.0.up.kernel"] == (
        "dense", (0,), (1,), ())


@pytest.mark.parametrize("arch", ["llama-tied-mlp-v", "opt-vocab-4d"])
def test_converted_state_dicts_never_take_a_layers_matrix_for_the_head(arch):
    pytest.importorskip("transformers")
    import sage_torch

    model = build(*ARCHITECTURES[arch][:2], **ARCHITECTURES[arch][2])
    params = {k: jnp.asarray(v.detach().numpy()) for k, v in model.named_parameters()}
    overrides, _ = first_remedies(params)
    got = resolved(route_params(params, overrides))
    truth = {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
             for r in sage_torch.route_params(model)}
    assert {k: v[:3] for k, v in got.items()} == truth
