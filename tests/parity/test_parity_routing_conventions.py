"""The JAX router on the pytree conventions of the JAX ecosystem, on models built from the
libraries themselves: Equinox modules, Haiku-style dicts, PyTorch state dicts converted to
arrays, linen and nnx trees.  Every verdict is semantic: the route equals the layout that
model's own forward code uses (for a converted state dict, the one sage_torch reads from the
torch modules; for Equinox, ``eqx.nn.Linear`` computes ``weight @ x``), the update equals the
float64 reference in that layout, or the error's advice, applied, gives it."""

from __future__ import annotations

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_np as ref
from flax import linen, nnx

import sage_optax
from sage_optax import NoLayoutEvidenceWarning, Route, RoutingError, route_params
from sage_optim import routing as core

V, D = 40, 12


def routes_of(tree, **kw):
    r = route_params(tree, **kw)
    return {name: (x.kind, x.fan_in, x.fan_out, x.batch)
            for name, x in sage_optax.routing.iter_leaves(r.routes)}


def dense_update(tx_name, params, grads, **kw):
    tx = sage_optax.make_optimizer(tx_name, 1.0, weight_decay=0.0, **kw)
    updates, _ = tx.update(grads, tx.init(params), params)
    return updates


def random_like(tree, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float64), tree)


# --------------------------------------------------------------------------------- Equinox


class EqxLM(eqx.Module):
    """A small Equinox language model: a table named ``emb`` (no marker name), attention,
    an MLP, a norm, a conv stem and an untied head named ``out``."""

    emb: eqx.nn.Embedding
    attn: eqx.nn.MultiheadAttention
    mlp: eqx.nn.MLP
    norm: eqx.nn.LayerNorm
    stem: eqx.nn.Conv2d
    out: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 6)
        self.emb = eqx.nn.Embedding(V, D, key=k[0])
        self.attn = eqx.nn.MultiheadAttention(2, D, key=k[1])
        self.mlp = eqx.nn.MLP(D, D, 3 * D, depth=1, key=k[2])
        self.norm = eqx.nn.LayerNorm(D)
        self.stem = eqx.nn.Conv2d(3, D, (2, 2), key=k[3])
        self.out = eqx.nn.Linear(D, V, use_bias=False, key=k[4])


def eqx_model(dtype=jnp.float32):
    model = EqxLM(jax.random.key(0))
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, model)


@pytest.mark.parametrize("layout", [None, "torch"])
def test_equinox_modules_route_by_module_type(layout):
    """eqx.nn.Linear is (out, in), eqx.nn.Embedding (V, d) (also with layout="torch", where it
    used to be read as a dense matrix), a conv (Cout, Cin, kh, kw) merges input channels and
    taps, and the untied head next to a table of an ordinary name is the head."""
    params = eqx.filter(eqx_model(), eqx.is_inexact_array)
    got = routes_of(params, layout=layout)
    assert got["emb.weight"] == ("embedding", (1,), (0,), ())
    assert got["out.weight"] == ("embedding", (1,), (0,), ())  # head: (V, d), vocab axis 0
    assert got["attn.query_proj.weight"] == ("dense", (1,), (0,), ())
    assert got["mlp.layers.0.weight"] == ("dense", (1,), (0,), ())
    assert got["mlp.layers.0.bias"][0] == "vector"
    assert got["norm.weight"][0] == "vector"
    assert got["stem.weight"] == ("dense", (1, 2, 3), (0,), ())
    assert got["stem.bias"] == ("vector", (), (), ())
    table = sage_optax.routing_table("sage-hybrid", eqx_model())  # unfiltered model works too
    evidence = {r.path: r.evidence for r in table.rows}
    assert evidence["emb.weight"] == "module eqx.nn.Embedding (V, d)"
    assert evidence["out.weight"].startswith("head: shape of the token embedding 'emb.weight'")


def test_equinox_dense_update_is_sinkgd_of_the_out_in_matrix():
    """The math: SinkGD of an eqx.nn.Linear gradient (out, in) normalises each output row's
    fan-in first: the reference on the (in, out) transpose."""
    with jax.enable_x64(True):
        params = eqx.filter(eqx_model(jnp.float64), eqx.is_inexact_array)
        grads = random_like(params)
        u = dense_update("sinkgd-hybrid", params, grads)
        g = np.asarray(grads.mlp.layers[0].weight)  # (3D, D) = (out, in)
        want = -0.05 * ref.sinkhorn_ref(g.T, normalization="sqrt").T
        np.testing.assert_allclose(np.asarray(u.mlp.layers[0].weight), want, rtol=0,
                                   atol=1e-12)
        g = np.asarray(grads.stem.weight)  # (Cout, Cin, kh, kw): (Cin*kh*kw) x Cout
        want = -0.05 * ref.sinkhorn_ref(g.reshape(D, 12).T, normalization="sqrt").T
        np.testing.assert_allclose(np.asarray(u.stem.weight).reshape(D, 12), want, rtol=0,
                                   atol=1e-12)


def test_equinox_vmapped_layers_are_batch_axes():
    """Layers stacked by eqx.filter_vmap: every leading axis is a batch axis, per layer."""
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(1), 3)
        make = lambda k: eqx.nn.Linear(D, 2 * D, key=k)  # noqa: E731
        layers = eqx.filter_vmap(make)(keys)
        params = eqx.filter(layers, eqx.is_inexact_array)
        got = routes_of(params)
        assert got["weight"] == ("dense", (2,), (1,), (0,))
        assert got["bias"] == ("vector", (), (), (0,))
        grads = random_like(params)
        u = dense_update("sinkgd-hybrid", params, grads)
        for layer in range(3):
            g = np.asarray(grads.weight[layer])
            np.testing.assert_allclose(
                np.asarray(u.weight[layer]),
                -0.05 * ref.sinkhorn_ref(g.T, normalization="sqrt").T, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------ converted torch


def torch_llama():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=16, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def torch_bert():
    torch = pytest.importorskip("torch")
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=V, hidden_size=16, intermediate_size=24,
                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=20,
                        tie_word_embeddings=False)
    return BertForMaskedLM(config)


def converted(model, nested):
    """The model's state dict as float64 arrays: a flat ``{"a.b.weight": x}`` dict, or nested."""
    flat = {k: jnp.asarray(v.detach().double().numpy()) for k, v in model.named_parameters()}
    if not nested:
        return flat
    tree: dict = {}
    for key, x in flat.items():
        *parents, leaf = key.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = x
    return tree


@pytest.mark.parametrize("build", [torch_llama, torch_bert])
@pytest.mark.parametrize("nested", [False, True])
def test_converted_torch_state_dict_routes_as_the_torch_modules(build, nested):
    """A PyTorch state dict converted to arrays (flat or nested) gets, with no layout
    declared, the route sage_torch reads from the torch modules themselves: weights (out, in),
    tables (V, d) (position and token-type tables too) and the untied head."""
    import sage_torch

    model = build()
    want = {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
            for r in sage_torch.route_params(model)}
    with jax.enable_x64(True):
        got = routes_of(converted(model, nested))
    assert {k: v[:3] for k, v in got.items()} == want


def test_converted_state_dict_matches_torch_step():
    """The math, across frameworks: one sage-hybrid step of the converted LLaMA dict equals
    sage_torch's step on the torch model, parameter by parameter (float64)."""
    import torch

    import sage_torch

    model = build = torch_llama().double()
    del build
    with jax.enable_x64(True):
        params = converted(model, nested=False)
        grads = random_like(params, seed=4)
        tx = sage_optax.make_optimizer("sage-hybrid", 1e-2)
        updates, _ = tx.update(grads, tx.init(params), params)
        new = optax.apply_updates(params, updates)
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=1e-2)
    for name, p in model.named_parameters():
        p.grad = torch.from_numpy(np.array(grads[name]))
    opt.step()
    for name, p in model.named_parameters():
        np.testing.assert_allclose(np.asarray(new[name]), p.detach().numpy(), rtol=0,
                                   atol=1e-12, err_msg=name)


# ---------------------------------------------------------------------- Haiku, linen, nnx


def test_haiku_style_dict_routes_w_as_in_out_and_embeddings_as_tables():
    """Haiku's names: ``w`` (in, out), ``embeddings`` (V, d), ``scale``/``offset``; the head
    ``w`` of shape (d, V) next to the table is the head."""
    params = {
        "embed": {"embeddings": jnp.ones((V, D))},
        "mlp/~/linear_0": {"w": jnp.ones((D, 3 * D)), "b": jnp.ones(3 * D)},
        "layer_norm": {"scale": jnp.ones(D), "offset": jnp.ones(D)},
        "unembed": {"w": jnp.ones((D, V))},
    }
    got = routes_of(params)
    assert got["embed.embeddings"] == ("embedding", (1,), (0,), ())
    assert got["mlp/~/linear_0.w"] == ("dense", (0,), (1,), ())
    assert got["unembed.w"] == ("embedding", (0,), (1,), ())
    assert got["layer_norm.offset"][0] == "vector"


def test_weight_in_a_flax_tree_is_refused_with_both_layouts():
    """A custom ``weight`` in a tree whose other matrices are Flax kernels: the conventions
    contradict each other, so it is refused; the advice's first option (x @ weight, the
    Flax convention) applied gives SinkGD of the (in, out) matrix."""
    params = {"dense": {"kernel": jnp.ones((D, D))}, "custom": {"weight": jnp.ones((D, 2 * D))}}
    with pytest.raises(RoutingError) as info:
        route_params(params)
    err = info.value
    assert [p.leaf for p in err.problems] == ["custom.weight"]
    assert err.overrides == {"custom.weight": Route("dense", -2, -1)}
    assert routes_of(params, overrides=err.overrides)["custom.weight"][:3] == (
        "dense", (0,), (1,))
    assert routes_of(params, layout="flax")["custom.weight"][:3] == ("dense", (0,), (1,))


class TwoTables(nnx.Module):
    """Token and position tables with ordinary names, and an untied head ``out``."""

    def __init__(self, rngs):
        self.word = nnx.Embed(V, D, rngs=rngs)
        self.pos = nnx.Embed(16, D, rngs=rngs)
        self.mlp = nnx.Linear(D, 4 * D, rngs=rngs)
        self.out = nnx.Linear(D, V, use_bias=False, rngs=rngs)


def test_head_next_to_tables_with_ordinary_names():
    """The head rule does not depend on the table's name being one of a list: nnx, and the
    same tree as a linen-style dict."""
    model = TwoTables(nnx.Rngs(0))
    assert routes_of(model)["out.kernel"] == ("embedding", (0,), (1,), ())
    assert routes_of(model)["mlp.kernel"][0] == "dense"
    plain = {"word": {"embedding": jnp.ones((V, D))}, "pos": {"embedding": jnp.ones((16, D))},
             "out": {"kernel": jnp.ones((D, V))}, "mlp": {"kernel": jnp.ones((D, 4 * D))}}
    got = routes_of(plain)
    assert got["out.kernel"] == ("embedding", (0,), (1,), ())
    # (d, 16) has the shape of the *position* table: with the token table unknown, two
    # matrices fit two tables, so the router refuses rather than guess
    with pytest.raises(RoutingError, match="output head") as info:
        route_params({**plain, "mlp": {"kernel": jnp.ones((D, 16))},
                      "out": {"kernel": jnp.ones((D, V))}, "out2": {"kernel": jnp.ones((D, 16))}})
    assert {p.leaf for p in info.value.problems} == {"mlp.kernel", "out.kernel", "out2.kernel"}


def test_a_classifier_with_the_tables_shape_gets_the_head_rule_and_says_why():
    """What decides is the shape: a 4-label classifier next to a 4-token table has the table's
    shape, so it is routed as a head, and the routing table says so; 'dense' overrides it."""
    params = {"tok": {"embedding": jnp.ones((4, D))}, "cls": {"kernel": jnp.ones((D, 4))}}
    table = sage_optax.routing_table("sage-hybrid", params)
    row = next(r for r in table.rows if r.path == "cls.kernel")
    assert row.kind == "embedding" and row.evidence.startswith("head: shape of the token")
    assert routes_of(params, overrides={"cls.kernel": "dense"})["cls.kernel"][:3] == (
        "dense", (0,), (1,))


def test_overriding_only_the_head_keeps_other_square_matrices_dense():
    """hidden == vocab: two (d, V) matrices fit; overriding the one that is the head must not
    make the other a second head."""
    sq = jnp.ones((16, 16))
    params = {"tok": {"embedding": sq}, "a": {"kernel": sq}, "b": {"kernel": sq}}
    with pytest.raises(RoutingError, match="output head"):
        route_params(params)
    got = routes_of(params, overrides={"b.kernel": "embedding"})
    assert got["b.kernel"][0] == "embedding" and got["a.kernel"][0] == "dense"


def test_linear_general_batch_axis_bias_is_per_batch_entry():
    """nnx.LinearGeneral(batch_axis=...): the kernel is one matrix per batch entry, and so is
    the bias: sinkgd-pure's g/||g|| runs per batch entry (NumPy reference)."""
    with jax.enable_x64(True):
        lg = nnx.LinearGeneral((3, 4), (5, 2), axis=(-2, -1), batch_axis={0: 6},
                               param_dtype=jnp.float64, rngs=nnx.Rngs(0))
        got = routes_of(lg)
        assert got["kernel"] == ("dense", (1, 2), (3, 4), (0,))
        assert got["bias"] == ("vector", (), (), (0,))
        state = nnx.state(lg, nnx.Param)
        grads = random_like(state)
        u = dense_update("sinkgd-pure", state, grads, model=lg)
        g = np.asarray(grads["bias"].get_value())
        got_u = np.asarray(u["bias"].get_value())
        for i in range(6):
            gi = g[i]
            np.testing.assert_allclose(got_u[i], -gi / (np.linalg.norm(gi) + 1e-8),
                                       rtol=1e-12)


# ------------------------------------------------------------- refusals, fallback, strict


class LinenStack(linen.Module):
    @linen.compact
    def __call__(self, x):
        x = linen.DenseGeneral((2, 4), name="q")(x)
        return linen.Dense(3, name="o")(x.reshape(x.shape[:-2] + (8,)))


def test_every_ambiguous_leaf_is_reported_at_once_with_a_pasteable_dict():
    """A tree with several multi-axis leaves: one error names all of them, its printed block
    is Python that evaluates to ``err.overrides``, and applied, the stacked kernels step per
    layer as the reference does."""
    params = {"layers": {"mlp": {"kernel": jnp.ones((3, 8, 16))},
                         "attn": {"kernel": jnp.ones((3, 8, 8))},
                         "norm": {"scale": jnp.ones((3, 8))}},
              "experts": jnp.ones((4, 8, 16))}
    with pytest.raises(RoutingError) as info:
        route_params(params)
    err = info.value
    assert {p.leaf for p in err.problems} == {"layers.mlp.kernel", "layers.attn.kernel",
                                              "layers.norm.scale", "experts"}
    text = str(err)
    assert text.count("route_overrides = {") == 1
    block = text[text.index("route_overrides = {"):]
    scope = {"Route": Route}
    exec(block, scope)  # noqa: S102 - the block is meant to be pasted
    assert scope["route_overrides"] == err.overrides
    # the first remedies are the stacked readings: (E, in, out) experts, (L, in, out) layers
    assert err.overrides["experts"] == Route("dense", -2, -1)
    assert err.overrides["layers.norm.scale"] == Route("vector", batch=(0,))
    with jax.enable_x64(True):
        p64 = jax.tree.map(lambda x: x.astype(jnp.float64), params)
        grads = random_like(p64, seed=2)
        u = dense_update("sage-hybrid", p64, grads, route_overrides=err.overrides)
        for e in range(4):
            g = np.asarray(grads["experts"][e])
            np.testing.assert_allclose(np.asarray(u["experts"][e]),
                                       -10.0 * ref.sinkhorn_ref(g), rtol=0, atol=1e-12)


def test_nnx_bridge_model_is_not_asked_for_again():
    """A linen model wrapped in nnx.bridge.ToNNX and given as the model: the message says its
    modules do not settle the layout instead of asking for model= again."""
    model = nnx.bridge.ToNNX(LinenStack(), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, jnp.ones((2, 5)))
    with pytest.raises(RoutingError) as info:
        route_params(model)
    assert "model=model" not in str(info.value)
    assert "modules do not settle it" in str(info.value)
    fixed = {"q.kernel": Route("dense", fan_in=0, fan_out=(1, 2)), "q.bias": "vector"}
    assert routes_of(model, overrides=fixed)["q.kernel"][:3] == ("dense", (0,), (1, 2))


def test_leaves_without_any_name_get_the_element_wise_rule_with_a_warning():
    """optax's convention (``optax.contrib.muon``): a leaf with no layout evidence at all (a
    3-axis array in a list) gets the element-wise rule, shown in the routing table, with one
    warning that names it and gives the override; ``strict=True`` refuses it; a named leaf is
    refused as before (the fallback never silences a refusal)."""
    params = [jnp.ones((2, 3)), jnp.ones((2, 5, 2))]
    with pytest.warns(NoLayoutEvidenceWarning, match=r"'1' \(2, 5, 2\)") as record:
        tx = sage_optax.make_optimizer("sage-hybrid")
        state = tx.init(params)
        tx.update(params, state, params)
    assert len(record) == 1
    assert "route_overrides = {" in str(record[0].message)
    with pytest.warns(NoLayoutEvidenceWarning):
        table = sage_optax.routing_table("sage-hybrid", params)
    by_path = {r.path: r for r in table.rows}
    assert by_path["1"].kind == "vector" and by_path["1"].evidence == "no layout evidence"
    assert by_path["0"].kind == "dense"
    with pytest.raises(RoutingError, match="strict=True"):
        sage_optax.make_optimizer("sage-hybrid", strict=True).init(params)
    with pytest.raises(RoutingError, match="experts"):
        sage_optax.make_optimizer("sage-hybrid").init({"experts": jnp.ones((2, 5, 2))})
    # the element-wise rule it gets is the vector kind's (sage-hybrid: SAGE element-wise)
    routed = route_params(params, overrides={"1": "vector"}, warn=False)
    assert jax.tree.leaves(routed.labels) == ["dense", "vector"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        route_params(params, overrides={"1": Route("dense", -2, -1)})  # no warning


def test_advice_for_flax_three_axis_kernels_offers_the_right_readings():
    """A 3-axis Flax kernel: stacked layers first, then one (in, heads, head_dim) or one
    (heads, head_dim, out) kernel, then a convolution; each, applied, is that layout."""
    with pytest.raises(RoutingError) as info:
        route_params({"q": {"kernel": jnp.ones((8, 2, 4))}})
    routes = [r for r, _ in info.value.problems[0].options]
    assert routes[:3] == [Route("dense", -2, -1), Route("dense", 0, (1, 2)),
                          Route("dense", (0, 1), 2)]
    for r in routes[:3]:
        got = routes_of({"q": {"kernel": jnp.ones((8, 2, 4))}}, overrides={"q.kernel": r})
        want = r.resolve((8, 2, 4))
        assert got["q.kernel"][:3] == ("dense", want.fan_in, want.fan_out)


def test_paste_block_is_python_for_every_route_form():
    routes = [Route("dense", 0, (1, 2)), Route("vector", batch=(0,)), "vector",
              Route("embedding", -1, -2)]
    errs = [RoutingError("x", leaf=f"p{i}", shape=(2, 3, 4), options=[(r, "so")])
            for i, r in enumerate(routes)]
    combined = RoutingError.combine(errs)
    scope = {"Route": Route}
    exec(core.paste_block(combined.problems).split("\n", 1)[1], scope)  # noqa: S102
    assert scope["route_overrides"] == {f"p{i}": r for i, r in enumerate(routes)}


def test_a_matrix_shaped_like_only_a_position_table_is_refused_not_a_head():
    """Tied model (no head), tables `word` and `pos` of unknown role, and one MLP matrix with
    the shape of the position table (4d = positions): refused, never silently a head."""
    params = {"word": {"embedding": jnp.ones((V, D))}, "pos": {"embedding": jnp.ones((4 * D, D))},
              "mlp": {"kernel": jnp.ones((D, 4 * D))}}
    with pytest.raises(RoutingError, match="positions") as info:
        route_params(params)
    assert info.value.overrides == {"mlp.kernel": Route("dense", -2, -1)}
    assert routes_of(params, overrides=info.value.overrides)["mlp.kernel"][0] == "dense"


class Deconv(nnx.Module):
    def __init__(self, rngs):
        self.up = nnx.ConvTranspose(3, 5, kernel_size=(2, 2), rngs=rngs)
        self.conv = nnx.Conv(3, 5, kernel_size=(2, 2), rngs=rngs)


def test_transposed_convolutions_are_refused_and_the_advice_reads_them_as_convolutions():
    """A transposed convolution's fan-in is a modelling choice, so nnx.ConvTranspose and
    eqx.nn.ConvTranspose2d kernels are refused; the first option, applied, routes the kernel
    as the library's own convolution of the same shape is routed (nnx: (kh, kw, Cin, Cout),
    input channels and taps in; Equinox: (Cout, Cin, kh, kw))."""
    model = Deconv(nnx.Rngs(0))
    with pytest.raises(RoutingError) as info:
        route_params(nnx.state(model, nnx.Param), model=model)
    err = info.value
    assert [p.leaf for p in err.problems] == ["up.kernel"]
    assert "an nnx.ConvTranspose kernel (*taps, Cin, Cout)" in str(err)
    got = routes_of(nnx.state(model, nnx.Param), model=model, overrides=err.overrides)
    # the same axes in (a group's order does not change SinkGD: it sums over the group)
    assert [(k, tuple(sorted(i)), o) for k, i, o, _ in (got["up.kernel"], got["conv.kernel"])
            ] == [("dense", (0, 1, 2), (3,))] * 2

    keys = jax.random.split(jax.random.key(0), 2)
    eqx_params = eqx.filter(
        {"up": eqx.nn.ConvTranspose2d(3, 5, (2, 2), key=keys[0]),
         "conv": eqx.nn.Conv2d(3, 5, (2, 2), key=keys[1])}, eqx.is_inexact_array)
    with pytest.raises(RoutingError) as info:
        route_params(eqx_params)
    err = info.value
    assert [p.leaf for p in err.problems] == ["up.weight"]
    assert "an eqx.nn.ConvTranspose weight has no layout" in str(err)
    got = routes_of(eqx_params, overrides=err.overrides)
    assert got["up.weight"][:3] == got["conv.weight"][:3] == ("dense", (1, 2, 3), (0,))
