"""The JAX router on models this project did not write: flax's own modules, a linen model, a
plain dict, a PyTorch-layout pytree; hand-written expected tables, and the math that every
piece of advice in its errors gives (float64, against tests/reference_np.py)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_np as ref
from flax import linen, nnx

import sage_optax
from sage_optax import Route, RoutingError, route_params
from sage_optim.presets import CONFIG_NAMES, KINDS, get_preset

V, D = 50, 32


class Zoo(nnx.Module):
    """One of each flax module with parameters of a known layout, plus an untied head."""

    def __init__(self, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(D, D, rngs=rngs)  # positions == width: no head may come of it
        self.attn = nnx.MultiHeadAttention(num_heads=4, in_features=D, decode=False, rngs=rngs)
        self.patch_embed = nnx.Conv(3, 8, kernel_size=(3, 3), rngs=rngs)
        self.ein = nnx.Einsum("BTD,NDH->BTNH", (4, D, 8), rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)
        self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)


# (kind, fan-in, fan-out) of every parameter, written by hand from flax's documented layouts.
ZOO_TABLE = {
    "tok.embedding": ("embedding", "1 (32)", "0 (50)"),  # (V, d): vocab is fan-out
    "pos.embedding": ("embedding", "1 (32)", "0 (32)"),
    "attn.query.kernel": ("dense", "0 (32)", "1,2 (4x8=32)"),  # (in, heads, head_dim)
    "attn.key.kernel": ("dense", "0 (32)", "1,2 (4x8=32)"),
    "attn.value.kernel": ("dense", "0 (32)", "1,2 (4x8=32)"),
    "attn.out.kernel": ("dense", "0,1 (4x8=32)", "2 (32)"),  # (heads, head_dim, out)
    "attn.query.bias": ("vector", "-", "-"),
    "attn.key.bias": ("vector", "-", "-"),
    "attn.value.bias": ("vector", "-", "-"),
    "attn.out.bias": ("vector", "-", "-"),
    "patch_embed.kernel": ("dense", "2,0,1 (3x3x3=27)", "3 (8)"),  # (kh, kw, Cin, Cout)
    "patch_embed.bias": ("vector", "-", "-"),
    "ein.kernel": ("dense", "1 (32)", "0,2 (4x8=32)"),  # NDH: D contracted, N and H kept
    "norm.scale": ("vector", "-", "-"),
    "norm.bias": ("vector", "-", "-"),
    "mlp.kernel": ("dense", "0 (32)", "1 (32)"),  # (d, d) == (d, positions): still dense
    "mlp.bias": ("vector", "-", "-"),
    "lm_head.kernel": ("embedding", "0 (32)", "1 (50)"),  # the head: (d, V) of 'tok'
}


def rows(table):
    return {r.path: (r.kind, r.fan_in, r.fan_out) for r in table.rows}


def test_flax_modules_route_by_module_type():
    model = Zoo(nnx.Rngs(0))
    table = sage_optax.routing_table("sage-hybrid", model)
    assert rows(table) == ZOO_TABLE
    evidence = {r.path: r.evidence for r in table.rows}
    assert evidence["attn.query.kernel"] == "module nnx.LinearGeneral"
    assert evidence["lm_head.kernel"].startswith("head: shape of the token embedding 'tok.")
    text = str(table)
    assert "1,2 (4x8=32)" in text and "module nnx.Conv" in text
    # nnx.Optimizer with model= keeps exactly the state the table counts
    opt = nnx.Optimizer(model, sage_optax.make_optimizer("sage-hybrid", model=model),
                        wrt=nnx.Param)
    assert sage_optax.state_bytes(opt.opt_state) == table.total_bytes


def test_plain_state_refuses_multi_axis_kernels_and_names_both_remedies():
    model = Zoo(nnx.Rngs(0))
    state = nnx.state(model, nnx.Param)
    with pytest.raises(RoutingError) as info:
        route_params(state)
    msg = str(info.value)
    assert "model=model" in msg and "route_overrides=" in msg
    with pytest.raises(RoutingError, match="model=model"):
        nnx.Optimizer(model, sage_optax.make_optimizer("sage-hybrid"), wrt=nnx.Param)
    # remedy 1 (the model) gives the table above; on the state with model=, the same
    assert rows(sage_optax.routing_table("sage-hybrid", state, model=model)) == ZOO_TABLE


def sinkgd_update(tx_name, params, grads, **kw):
    tx = sage_optax.make_optimizer(tx_name, 1.0, weight_decay=0.0, **kw)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates


def test_conv_and_multi_head_kernels_are_one_merged_matrix():
    """SinkGD of an nnx.Conv kernel is SinkGD of (Cin·kh·kw) x Cout; of a query kernel, of
    in x (heads·head_dim): the float64 reference on the merged matrix, by an explicit reshape."""
    with jax.enable_x64(True):
        model = Zoo(nnx.Rngs(0))
        state = jax.tree.map(lambda x: jnp.asarray(x, jnp.float64),
                             nnx.state(model, nnx.Param))
        rng = np.random.default_rng(0)
        grads = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape)), state)
        u = sinkgd_update("sinkgd-hybrid", state, grads, model=model)
        alpha = 0.05  # sinkgd-hybrid: sqrt normalisation, alpha 0.05
        g = np.asarray(grads["patch_embed"]["kernel"].get_value())  # (kh, kw, Cin, Cout)
        merged = g.transpose(2, 0, 1, 3).reshape(27, 8)
        want = -alpha * ref.sinkhorn_ref(merged, normalization="sqrt")
        got = np.asarray(u["patch_embed"]["kernel"].get_value()).transpose(2, 0, 1, 3)
        np.testing.assert_allclose(got.reshape(27, 8), want, rtol=0, atol=1e-12)
        g = np.asarray(grads["attn"]["query"]["kernel"].get_value())  # (in, heads, head_dim)
        want = -alpha * ref.sinkhorn_ref(g.reshape(D, 32), normalization="sqrt")
        got = np.asarray(u["attn"]["query"]["kernel"].get_value()).reshape(D, 32)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
        g = np.asarray(grads["ein"]["kernel"].get_value())  # (N, D, H): D is the fan-in
        want = -alpha * ref.sinkhorn_ref(g.transpose(1, 0, 2).reshape(D, 32),
                                         normalization="sqrt")
        got = np.asarray(u["ein"]["kernel"].get_value()).transpose(1, 0, 2).reshape(D, 32)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)


def test_sage_pure_reduces_over_the_merged_fan_out():
    """sage-pure on a (in, heads, head_dim) kernel: SAGE on the merged in x (heads·head_dim)
    matrix, s_t averaging over the fan-out group (3 steps against the float64 reference)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(1)
        params = {"q": {"kernel": jnp.asarray(rng.standard_normal((6, 2, 5)))}}
        route = {"q.kernel": Route("dense", fan_in=0, fan_out=(1, 2))}
        tx = sage_optax.make_optimizer("sage-pure", 1e-2, route_overrides=route)
        state = tx.init(params)
        theta = np.asarray(params["q"]["kernel"]).reshape(6, 10)
        sage = ref.SageRef((6, 10), vocab_axis=1)  # the fan-out (reduced) axis
        for step in range(3):
            g = rng.standard_normal((6, 2, 5))
            updates, state = tx.update({"q": {"kernel": jnp.asarray(g)}}, state, params)
            params = optax.apply_updates(params, updates)
            theta = sage.step(theta, g.reshape(6, 10), 1e-2)
            np.testing.assert_allclose(np.asarray(params["q"]["kernel"]).reshape(6, 10), theta,
                                       rtol=0, atol=1e-12, err_msg=f"step {step}")
        is_sage = lambda x: isinstance(x, sage_optax.ScaleBySageState)  # noqa: E731
        sage_states = [x for x in jax.tree.leaves(state, is_leaf=is_sage) if is_sage(x)]
        s_shapes = {x.shape for st in sage_states for x in jax.tree.leaves(st.s)}
        assert s_shapes == {(6,)}  # S: one entry per fan-in index


def test_apollo_works_on_the_merged_matrix_in_group_order():
    """APOLLO on a conv kernel (kh, kw, Cin, Cout) with fan_in=(Cin, kh, kw): the reference on
    the merged (Cout, Cin·kh·kw) matrix (PyTorch layout), same injected projection."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(2)
        shape = (3, 3, 2, 4)
        params = {"c": {"kernel": jnp.asarray(rng.standard_normal(shape))}}
        fixed = rng.standard_normal((18, 1))

        def projection(path, k, n, rank):
            return jnp.asarray(fixed[:n, :rank])

        route = {"c.kernel": Route("dense", fan_in=(2, 0, 1), fan_out=3)}
        tx = sage_optax.make_optimizer("apollo", 1e-2, route_overrides=route,
                                       dense_projection=projection, dense_rank=1)
        state = tx.init(params)

        def merge(x):  # (kh, kw, Cin, Cout) -> (Cout, Cin*kh*kw)
            return np.asarray(x).transpose(2, 0, 1, 3).reshape(18, 4).T

        apollo = ref.ApolloRef((4, 18), projection_fn=lambda k, n, r: fixed[:n, :r])
        theta = merge(params["c"]["kernel"])
        for step in range(3):
            g = rng.standard_normal(shape)
            updates, state = tx.update({"c": {"kernel": jnp.asarray(g)}}, state, params)
            params = optax.apply_updates(params, updates)
            theta = apollo.step(theta, merge(g), 1e-2)
            np.testing.assert_allclose(merge(params["c"]["kernel"]), theta, rtol=0, atol=1e-12,
                                       err_msg=f"step {step}")


def test_stacked_layers_need_a_declaration_and_the_advised_one_is_per_layer():
    params = {"layers": {"mlp": {"kernel": jnp.ones((3, 8, 16))},
                         "norm": {"scale": jnp.ones((3, 8))}}}
    with pytest.raises(RoutingError) as info:
        route_params(params)
    advice = "Route('dense', fan_in=-2, fan_out=-1)"
    assert advice in str(info.value) and "stacked layers" in str(info.value)
    with jax.enable_x64(True):
        rng = np.random.default_rng(3)
        g = rng.standard_normal((3, 8, 16))
        p = {"k": jnp.zeros((3, 8, 16), jnp.float64)}
        u = sinkgd_update("sage-hybrid", p, {"k": jnp.asarray(g)},
                          route_overrides={"k": Route("dense", fan_in=-2, fan_out=-1)})
        for layer in range(3):
            np.testing.assert_allclose(np.asarray(u["k"][layer]),
                                       -10.0 * ref.sinkhorn_ref(g[layer]), rtol=0, atol=1e-12)


def test_nnx_vmapped_layers_are_batch_axes_by_module_evidence():
    class Stack(nnx.Module):
        def __init__(self, rngs):
            @nnx.vmap(in_axes=0, out_axes=0)
            def make(key):
                return nnx.Linear(8, 16, rngs=nnx.Rngs(key))

            self.layers = make(jax.random.split(rngs.params(), 3))
            self.norm = nnx.LayerNorm(8, rngs=rngs)

    table = sage_optax.routing_table("sage-hybrid", Stack(nnx.Rngs(0)))
    assert rows(table)["layers.kernel"] == ("dense", "1 (8)", "2 (16)")  # axis 0: layers
    r = route_params(Stack(nnx.Rngs(0))).routes
    assert r["layers"]["bias"].batch == (0,)  # (3, 16): three layers' biases


class LinenLM(linen.Module):
    @linen.compact
    def __call__(self, ids):
        x = linen.Embed(V, D)(ids)
        x = linen.LayerNorm()(x)
        x = linen.Dense(4 * D)(x)
        x = linen.Dense(D)(x)
        return linen.Dense(V, use_bias=False)(x)  # untied head: (d, V)


def test_linen_model_routes_by_flax_names():
    params = jax.eval_shape(LinenLM().init, jax.random.key(0), jnp.zeros((1, 4), jnp.int32))
    table = sage_optax.routing_table("sage-hybrid", params["params"])
    assert rows(table) == {
        "Embed_0.embedding": ("embedding", "1 (32)", "0 (50)"),
        "LayerNorm_0.scale": ("vector", "-", "-"),
        "LayerNorm_0.bias": ("vector", "-", "-"),
        "Dense_0.kernel": ("dense", "0 (32)", "1 (128)"),
        "Dense_0.bias": ("vector", "-", "-"),
        "Dense_1.kernel": ("dense", "0 (128)", "1 (32)"),
        "Dense_1.bias": ("vector", "-", "-"),
        "Dense_2.kernel": ("embedding", "0 (32)", "1 (50)"),  # the only (d, V) matrix
    }


def test_plain_dict_with_tables_heads_and_vocab_size():
    params = {
        "wte": jnp.ones((V, D)),  # GPT-2 style raw tables
        "wpe": {"embedding": jnp.ones((D, D))},
        "blocks": {"0": {"w1": jnp.ones((D, 4 * D)), "w2": jnp.ones((4 * D, D)),
                         "proj": jnp.ones((D, D))}},
        "head": {"w": jnp.ones((D, 10))},  # a classifier named head: dense, not a vocab matrix
    }
    got = rows(sage_optax.routing_table("sage-hybrid", params))
    assert got["wte"] == ("embedding", "1 (32)", "0 (50)")
    assert got["wpe.embedding"] == ("embedding", "1 (32)", "0 (32)")
    assert got["blocks.0.proj"] == ("dense", "0 (32)", "1 (32)")  # (d, d) = (d, positions)
    assert got["head.w"] == ("dense", "0 (32)", "1 (10)")
    # an unnamed tree: only vocab_size can say which (d, V) matrix is the head
    plain = {"x": jnp.ones((D, 64)), "y": jnp.ones((64, D)), "z": jnp.ones((D, V))}
    assert rows(sage_optax.routing_table("sage-hybrid", plain))["z"][0] == "dense"
    got = rows(sage_optax.routing_table("sage-hybrid", plain, vocab_size=V))
    assert got["z"] == ("embedding", "0 (32)", "1 (50)") and got["x"][0] == "dense"
    # Meta's LLaMA naming: tok_embeddings and an untied 'output'
    meta = {"tok_embeddings": {"embedding": jnp.ones((V, D))},
            "layers": {"0": {"wq": {"kernel": jnp.ones((D, D))}}},
            "output": {"kernel": jnp.ones((D, V))}}
    got = rows(sage_optax.routing_table("sage-hybrid", meta))
    assert got["output.kernel"] == ("embedding", "0 (32)", "1 (50)")


def test_ambiguous_heads_are_refused_and_the_advice_places_them():
    params = {"tok": {"embedding": jnp.ones((V, D))},
              "a": {"kernel": jnp.ones((D, V))}, "b": {"kernel": jnp.ones((D, V))}}
    with pytest.raises(RoutingError, match="output head") as info:
        route_params(params)
    msg = str(info.value)
    assert "Route('embedding', fan_in=-2, fan_out=-1)" in msg
    fixed = route_params(params, {"a.kernel": Route("embedding", fan_in=-2, fan_out=-1),
                                  "b.kernel": Route("dense", fan_in=-2, fan_out=-1)})
    assert fixed.labels["a"]["kernel"] == "embedding" and fixed.labels["b"]["kernel"] == "dense"


def test_torch_layout_pytree_reads_weights_as_out_in():
    params = {
        "model": {"embed_tokens": {"weight": jnp.ones((V, D))},
                  "layers": {"0": {"q_proj": {"weight": jnp.ones((2 * D, D))}}},
                  "norm": {"weight": jnp.ones((D,))}},
        "lm_head": {"weight": jnp.ones((V, D))},
    }
    got = rows(sage_optax.routing_table("sage-hybrid", params, layout="torch"))
    assert got == {
        "model.embed_tokens.weight": ("embedding", "1 (32)", "0 (50)"),
        "model.layers.0.q_proj.weight": ("dense", "1 (32)", "0 (64)"),  # (out, in)
        "model.norm.weight": ("vector", "-", "-"),
        "lm_head.weight": ("embedding", "1 (32)", "0 (50)"),  # (V, d)
    }
    # and the math: SinkGD of a (out, in) weight is that of the transposed Flax kernel
    with jax.enable_x64(True):
        g = jnp.asarray(np.random.default_rng(4).standard_normal((2 * D, D)))
        torch_u = sinkgd_update("sage-hybrid", {"w": jnp.zeros_like(g)}, {"w": g},
                                layout="torch")["w"]
        flax_u = sinkgd_update("sage-hybrid", {"kernel": jnp.zeros_like(g.T)},
                               {"kernel": g.T})["kernel"]
        np.testing.assert_allclose(np.asarray(torch_u), np.asarray(flax_u).T, rtol=0,
                                   atol=1e-13)
    with pytest.raises(RoutingError, match=r"conv\.weight.*fan_in=\(1, 2, 3\)"):
        route_params({"conv": {"weight": jnp.ones((8, 3, 3, 3))}}, layout="torch")


def test_a_single_non_unit_axis_is_a_vector_in_both_frameworks():
    params = {"cls_token": jnp.ones((1, 1, D)), "proj": {"kernel": jnp.ones((D, D))},
              "conv": {"bias": jnp.ones((8, 1, 1))}}  # an Equinox Conv2d bias
    for path in ("cls_token", "conv.bias"):
        r = dict(sage_optax.routing.iter_leaves(route_params(params).routes))[path]
        assert (r.kind, r.fan_in, r.evidence) == ("vector", (), "shape: one non-unit axis")


def test_kind_only_overrides_place_any_leaf():
    params = {"tok_emb": jnp.ones((V, D)), "pos_embedding": jnp.ones((16, D)),
              "proj": {"kernel": jnp.ones((D, D))}}
    with pytest.raises(RoutingError, match="pos_embedding"):
        route_params(params)
    r = route_params(params, {"pos_embedding": "vector"})
    assert r.labels["pos_embedding"] == "vector"
    assert r.axes["tok_emb"] == sage_optax.Route("embedding", -1, -2)  # (V, d)
    r = route_params(params, {"pos_embedding": "vector", "tok_emb": "embedding"})
    assert r.routes["tok_emb"].fan_out == (0,)
    r = route_params(params, {"pos_embedding": "embedding"}, vocab_size=16)
    assert r.routes["pos_embedding"].fan_out == (0,)
    with pytest.raises(RoutingError, match="axes are not known"):
        route_params({"w": jnp.ones((3, 3, 3))}, {"w": "dense"})


def test_override_globs_that_match_nothing_name_the_nearest_paths():
    params = {"layers": {"0": {"attn": {"kernel": jnp.ones((4, 4))}}}}
    with pytest.raises(RoutingError, match=r"'layers\.\*\.atn\.\*'.*layers\.0\.attn\.kernel"):
        route_params(params, {"layers.*.atn.*": "dense"})
    with pytest.raises(RoutingError, match="match no parameter"):
        sage_optax.make_optimizer("sage-hybrid", route_overrides={"nope": "dense"}).init(params)


def test_override_forms_are_equivalent():
    params = {"k": jnp.ones((4, 2, 3))}
    forms = [Route("dense", fan_in=0, fan_out=(1, 2)),
             ("dense", {"fan_in": 0, "fan_out": (1, 2)})]
    for form in forms:
        r = route_params(params, {"k": form}).routes["k"]
        assert (r.fan_in, r.fan_out, r.batch, r.evidence) == ((0,), (1, 2), (), "override")


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_inject_hyperparams_works_with_make_optimizer(name):
    params = {"embed": {"embedding": jnp.ones((16, 4))},
              "l": {"kernel": jnp.arange(32.0).reshape(4, 8) / 7}, "n": {"scale": jnp.ones(4)}}
    grads = jax.tree.map(lambda x: jnp.sin(3 * x + 1), params)
    sched = optax.linear_schedule(1e-3, 1e-4, 10)
    preset = get_preset(name)
    hps = {"weight_decay": 0.02}
    if any("b1" in preset.rule(k).hyperparams for k in KINDS):
        hps["b1"] = 0.8
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no deprecation or other warning on this path
        tx = optax.inject_hyperparams(sage_optax.make_optimizer, static_args="name")(
            name=name, learning_rate=sched, **hps)
    state = tx.init(params)
    assert {"learning_rate", *hps} <= set(state.hyperparams)
    direct = sage_optax.make_optimizer(name, sched, **hps)
    d_state = direct.init(params)
    for _ in range(2):
        u, state = jax.jit(tx.update)(grads, state, params)
        want, d_state = direct.update(grads, d_state, params)
        for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want), strict=True):
            # injected hyperparameters are float32 arrays, the direct ones Python floats
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-9)
    # an injected hyperparameter changes the update: the state's value is used
    state = state._replace(hyperparams={**state.hyperparams, "weight_decay": jnp.float32(5.0)})
    u2, _ = tx.update(grads, state, params)
    assert not np.allclose(jax.tree.leaves(u2)[0], jax.tree.leaves(u)[0])
