"""The Flax LLaMA of sage_train: layout, HF parity (both directions), causality, jit."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from sage_optax import routing_table  # noqa: E402
from sage_optax.routing import iter_leaves  # noqa: E402
from sage_repro.llama_shapes import llama_param_shapes  # noqa: E402
from sage_train.hf import convert as hf_convert  # noqa: E402
from sage_train.model.llama import (  # noqa: E402
    Llama,
    abstract_params,
    chunked_cross_entropy,
    loss_fn,
    per_layer_params,
    reference_attention,
    stack_layers,
)
from sage_train.model.shapes import MODELS  # noqa: E402

TINY = MODELS["tiny"]
CONFIGS = {
    "tied": TINY,
    "untied": dataclasses.replace(TINY, tie_embeddings=False),
}
B, T = 2, 16

# Logit tolerance for Flax vs torch in float32: both compute the same ops in a different
# order (XLA einsums vs ATen SDPA), so they differ only by float32 rounding accumulated over
# 2 layers.  The weights below are drawn so that activations are O(1), attention is far from
# uniform and max |logit| is ~80 (tied) / ~4.5 (untied).  Measured max |diff| / max |logit|:
# 2.6e-7..7e-7 over 3 seeds (HF eager vs SDPA attention differ by 2e-7..5e-7 themselves).
# We allow 1e-5 of the logit scale, a >10x margin, while a wrong RoPE base, the interleaved
# rotary convention or a wrong GQA head order moves logits by O(1e-1) of the scale.
REL_TOL = 1e-5


def _tokens(config, seed=0):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, config.vocab_size)


def _names_shapes(tree):
    return [(n, tuple(x.shape), jnp.dtype(x.dtype)) for n, x in iter_leaves(tree)]


@pytest.mark.parametrize("tie", CONFIGS)
def test_param_layout_matches_llama_param_shapes(tie):
    config = CONFIGS[tie]
    model = Llama(config, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    assert _names_shapes(params) == _names_shapes(llama_param_shapes(config))
    assert _names_shapes(abstract_params(config)) == _names_shapes(llama_param_shapes(config))
    assert sum(x.size for _, x in iter_leaves(params)) == config.param_count()
    assert ("lm_head.kernel" in dict(iter_leaves(params))) is (tie == "untied")


def test_abstract_params_allocates_nothing():
    leaves = [x for _, x in iter_leaves(abstract_params(MODELS["270m"]))]
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == MODELS["270m"].param_count()


def test_init_statistics():
    params = dict(iter_leaves(nnx.state(Llama(CONFIGS["untied"], rngs=nnx.Rngs(0)), nnx.Param)))
    for name, x in params.items():
        if name.endswith(".scale"):
            np.testing.assert_array_equal(x, 1.0)
        else:
            assert abs(float(jnp.std(x)) - 0.02) < 0.002, name
            assert abs(float(jnp.mean(x))) < 0.002, name


@pytest.mark.parametrize("tie", CONFIGS)
def test_sage_hybrid_routes_every_param(tie):
    model = Llama(CONFIGS[tie], rngs=nnx.Rngs(0))
    table = routing_table("sage-hybrid", nnx.state(model, nnx.Param))
    kinds = {row.path: row.kind for row in table.rows}
    assert len(kinds) == len(iter_leaves(llama_param_shapes(CONFIGS[tie])))
    for path, kind in kinds.items():
        if path in ("embed.embedding", "lm_head.kernel"):
            want = "embedding"
        elif path.endswith(".kernel"):
            want = "dense"
        else:
            assert path.endswith(".scale")
            want = "vector"
        assert kind == want, path


# --- Hugging Face parity ------------------------------------------------------------------


def _hf_model(config, seed=0):
    """A random HF LlamaForCausalLM whose activations are O(1) (HF's 0.02 init is too tame)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    hf = transformers.LlamaForCausalLM(hf_convert.to_hf_config(config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0)
            else:  # (out, in) projection: unit-variance outputs for unit-variance inputs
                p.normal_(0.0, p.shape[1] ** -0.5)
    return hf


def _hf_logits(hf, tokens):
    torch = pytest.importorskip("torch")
    with torch.no_grad():
        out = hf(torch.from_numpy(np.array(tokens)).long()).logits
    return out.float().numpy()


def _assert_logits_close(ours, ref):
    scale = float(np.abs(ref).max())
    err = float(np.abs(np.asarray(ours) - ref).max())
    assert err <= REL_TOL * scale, f"max |diff| {err:.3g} > {REL_TOL} * max |logit| {scale:.3g}"


@pytest.mark.parametrize("layers", ["loop", "scan"])
@pytest.mark.parametrize("tie", CONFIGS)
def test_logits_match_transformers(tie, layers):
    config = CONFIGS[tie]
    assert config.num_kv_heads < config.num_heads  # grouped-query attention is exercised
    hf = _hf_model(config)
    assert ("lm_head.weight" in hf.state_dict()) and (
        hf.lm_head.weight is hf.model.embed_tokens.weight
    ) is config.tie_embeddings
    tokens = _tokens(config)
    ref = _hf_logits(hf, tokens)
    assert np.abs(ref).max() > 3  # the weights are not tame (see REL_TOL)

    model = Llama(config, rngs=nnx.Rngs(1), layers=layers)
    with jax.default_matmul_precision("highest"):  # float32 matmuls on a GPU too
        before = model(tokens)
        hf_convert.from_hf_state_dict(model, hf.state_dict())
        ours = model(tokens)
    assert ours.dtype == jnp.float32 and ours.shape == (B, T, config.vocab_size)
    assert np.abs(np.asarray(before) - ref).max() > 1.0  # loading actually changed the model
    _assert_logits_close(ours, ref)


@pytest.mark.parametrize("layers", ["loop", "scan"])
@pytest.mark.parametrize("tie", CONFIGS)
def test_export_roundtrip_through_transformers(tie, layers):
    transformers = pytest.importorskip("transformers")
    config = CONFIGS[tie]
    hf = _hf_model(config, seed=3)
    model = Llama(config, rngs=nnx.Rngs(0), layers=layers)
    hf_convert.from_hf_state_dict(model, hf.state_dict())
    tokens = _tokens(config, seed=1)

    exported = hf_convert.to_hf_state_dict(model)
    assert list(exported) == list(hf.state_dict())
    fresh = transformers.LlamaForCausalLM(hf_convert.to_hf_config(config)).eval()
    fresh.load_state_dict(exported, strict=True)
    for key, value in hf.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[key].numpy(), value.numpy(), key)
    with jax.default_matmul_precision("highest"):
        _assert_logits_close(model(tokens), _hf_logits(fresh, tokens))


def test_export_then_import_is_identity():
    pytest.importorskip("torch")
    config = CONFIGS["untied"]
    model = Llama(config, rngs=nnx.Rngs(0))
    exported = hf_convert.to_hf_state_dict(model)
    assert exported["lm_head.weight"].shape == (config.vocab_size, config.hidden_size)
    assert exported["model.layers.0.self_attn.k_proj.weight"].shape == (
        config.num_kv_heads * config.head_dim,
        config.hidden_size,
    )
    other = Llama(config, rngs=nnx.Rngs(1))
    hf_convert.from_hf_state_dict(other, {k: v.numpy() for k, v in exported.items()})
    for (n, a), (_, b) in zip(
        iter_leaves(nnx.state(model, nnx.Param)),
        iter_leaves(nnx.state(other, nnx.Param)),
        strict=True,
    ):
        np.testing.assert_array_equal(a, b, n)


def test_import_errors_name_the_keys():
    pytest.importorskip("torch")
    tied, untied = CONFIGS["tied"], CONFIGS["untied"]
    sd = hf_convert.to_hf_state_dict(Llama(untied, rngs=nnx.Rngs(0)))

    # an untied checkpoint into a tied model: its lm_head differs from the embedding
    with pytest.raises(ValueError, match="lm_head.weight"):
        hf_convert.from_hf_state_dict(Llama(tied, rngs=nnx.Rngs(0)), sd)
    # a tied checkpoint without lm_head.weight into an untied model
    no_head = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match=r"missing keys: \['lm_head.weight'\]"):
        hf_convert.from_hf_state_dict(Llama(untied, rngs=nnx.Rngs(0)), no_head)
    with pytest.raises(ValueError, match=r"unexpected keys: \['model.layers.9.mlp.up_proj.weight'"):
        hf_convert.from_hf_state_dict(
            Llama(untied, rngs=nnx.Rngs(0)),
            {**sd, "model.layers.9.mlp.up_proj.weight": sd["model.layers.0.mlp.up_proj.weight"]},
        )
    bad = {
        **sd,
        "model.layers.1.self_attn.k_proj.weight": sd["model.layers.1.self_attn.q_proj.weight"],
    }
    with pytest.raises(ValueError, match=r"shape mismatch for 'model.layers.1.self_attn.k_proj"):
        hf_convert.from_hf_state_dict(Llama(untied, rngs=nnx.Rngs(0)), bad)
    # the model is left untouched by a failed load; extra HF buffers are ignored
    model = Llama(untied, rngs=nnx.Rngs(5))
    before = nnx.state(model, nnx.Param)["embed"]["embedding"][...]
    with pytest.raises(ValueError):
        hf_convert.from_hf_state_dict(model, bad)
    np.testing.assert_array_equal(nnx.state(model, nnx.Param)["embed"]["embedding"][...], before)
    hf_convert.from_hf_state_dict(model, {**sd, "model.rotary_emb.inv_freq": np.zeros(12)})


# --- forward properties -----------------------------------------------------------------


@pytest.mark.parametrize("tie", CONFIGS)
def test_causal(tie):
    config = CONFIGS[tie]
    model = Llama(config, rngs=nnx.Rngs(0))
    tokens = _tokens(config)
    t = 9
    changed = tokens.at[:, t].set((tokens[:, t] + 1) % config.vocab_size)
    a, b = model(tokens), model(changed)
    np.testing.assert_allclose(a[:, :t], b[:, :t], atol=1e-6, rtol=0)
    assert float(jnp.abs(a[:, t] - b[:, t]).max()) > 1e-3


def test_jit_matches_eager_and_loss():
    config = CONFIGS["untied"]
    model = Llama(config, rngs=nnx.Rngs(0))
    tokens = _tokens(config)
    eager = model(tokens)
    jitted = nnx.jit(lambda m, x: m(x))(model, tokens)
    np.testing.assert_allclose(jitted, eager, atol=1e-5, rtol=1e-5)

    stream = jax.random.randint(jax.random.key(1), (B, T + 1), 0, config.vocab_size)
    inputs, targets = stream[:, :-1], stream[:, 1:]  # (B, T) like every other call: no recompile
    loss = nnx.jit(loss_fn)(model, inputs, targets)
    logp = jax.nn.log_softmax(model(inputs), axis=-1)
    want = -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    # at init (std 0.02) the model is close to uniform over the vocabulary
    assert abs(float(loss) - np.log(config.vocab_size)) < 0.1


# --- attention, layouts, remat, mixed precision ----------------------------------------


def _qkv(dtype, seed=0, t=T):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (B, t, 4, 8), dtype)
    k = jax.random.normal(keys[1], (B, t, 2, 8), dtype)  # grouped-query: 2 kv heads for 4
    v = jax.random.normal(keys[2], (B, t, 2, 8), dtype)
    return 3 * q, 3 * k, v  # sharp attention: a wrong mask or head order shows


def test_dot_product_attention_matches_the_written_out_math():
    """jax.nn.dot_product_attention (what the model calls) against the old attention math:
    causal, query head h reading kv head h // 2, float32 softmax."""
    q, k, v = _qkv(jnp.float32)
    with jax.default_matmul_precision("highest"):
        ours = jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5)
        ref = reference_attention(q, k, v)
        # another head order or no causal mask gives another answer (the test can fail)
        swapped = reference_attention(q, k[:, :, ::-1], v[:, :, ::-1])
        full = jax.nn.dot_product_attention(q, k, v, is_causal=False, scale=8**-0.5)
    np.testing.assert_allclose(ours, ref, atol=2e-6, rtol=0)
    assert float(jnp.abs(swapped - ref).max()) > 0.1
    assert float(jnp.abs(full - ref).max()) > 0.1


def _pair(config, remat="none"):
    """A looped model and a scanned model with the same parameters."""
    loop = Llama(config, rngs=nnx.Rngs(0))
    scan = Llama(config, rngs=nnx.Rngs(7), layers="scan", remat=remat)
    stack_layers(loop, scan)
    return loop, scan


def _loss_and_grads(model, inputs, targets):
    loss, grads = nnx.value_and_grad(loss_fn)(model, inputs, targets)
    return loss, dict(iter_leaves(grads))


@pytest.mark.parametrize("remat", ["none", "dots", "full"])
def test_scanned_layers_match_the_loop(remat):
    """Stacked, scanned (and rematerialised) layers: the same logits, loss and gradients as
    one module per layer; the per-layer view and HF export of both are identical."""
    config = CONFIGS["untied"]
    loop, scan = _pair(config, remat)
    kernel = nnx.state(scan, nnx.Param)["layers"]["attn"]["q_proj"]["kernel"]
    assert kernel.shape == (config.num_layers, config.hidden_size, config.hidden_size)
    stream = jax.random.randint(jax.random.key(1), (B, T + 1), 0, config.vocab_size)
    inputs, targets = stream[:, :-1], stream[:, 1:]
    with jax.default_matmul_precision("highest"):
        np.testing.assert_allclose(scan(inputs), loop(inputs), atol=1e-5, rtol=1e-5)
        loss_l, g_l = _loss_and_grads(loop, inputs, targets)
        loss_s, g_s = nnx.jit(_loss_and_grads)(scan, inputs, targets)
    np.testing.assert_allclose(loss_s, loss_l, rtol=1e-6)
    for name, g in g_s.items():
        if name.startswith("layers."):
            for i in range(config.num_layers):
                np.testing.assert_allclose(g[i], g_l[f"layers.{i}.{name[7:]}"], atol=1e-6,
                                           rtol=1e-4, err_msg=f"{name}[{i}]")
        else:
            np.testing.assert_allclose(g, g_l[name], atol=1e-6, rtol=1e-4, err_msg=name)
    a, b = per_layer_params(loop), per_layer_params(scan)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], name)


def test_scanned_layers_route_as_stacked_matrices():
    """With the model, the router reads the layer axis as a batch axis: fan-in and fan-out
    are those of one layer's matrix (without the model a 3-D kernel would be refused)."""
    config = CONFIGS["untied"]
    model = Llama(config, rngs=nnx.Rngs(0), layers="scan")
    rows = {row.path: row for row in routing_table("sage-hybrid", model).rows}
    q = rows["layers.attn.q_proj.kernel"]
    assert q.kind == "dense" and q.shape == (config.num_layers, 96, 96)
    assert (q.fan_in, q.fan_out) == ("1 (96)", "2 (96)")  # axis 0: the layer (batch)
    down = rows["layers.mlp.down_proj.kernel"]
    assert (down.fan_in, down.fan_out) == ("1 (256)", "2 (96)")
    assert rows["layers.attn_norm.scale"].kind == "vector"
    assert rows["embed.embedding"].kind == "embedding"
    assert rows["lm_head.kernel"].kind == "embedding"


def test_bfloat16_computation_keeps_float32_params_and_logits():
    config = CONFIGS["untied"]
    loop, _ = _pair(config)
    bf16 = Llama(config, rngs=nnx.Rngs(0), layers="scan", dtype=jnp.bfloat16)
    stack_layers(loop, bf16)
    assert {x.dtype for _, x in iter_leaves(nnx.state(bf16, nnx.Param))} == {
        jnp.dtype(jnp.float32)}
    tokens = _tokens(config)
    with jax.default_matmul_precision("highest"):
        ref, ours = loop(tokens), bf16(tokens)
    assert ours.dtype == jnp.float32
    err = float(jnp.abs(ours - ref).max())
    # bfloat16 rounding (8 bits of mantissa) at logit scale ~1, not a different function
    assert 0 < err < 0.05, err


# --- chunked cross-entropy ------------------------------------------------------------


def _np_cross_entropy(logits, targets):
    """Mean cross-entropy and its gradient w.r.t. the logits, in float64 NumPy."""
    z = np.asarray(logits, np.float64).reshape(-1, logits.shape[-1])
    t = np.asarray(targets).reshape(-1)
    z = z - z.max(axis=-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=-1, keepdims=True))
    onehot = np.eye(z.shape[-1])[t]
    return -(logp * onehot).sum(-1).mean(), (np.exp(logp) - onehot) / len(t)


@pytest.mark.parametrize("chunk", [1, 5, 8, 40])  # 5: the last chunk padded; 40: one chunk
def test_chunked_cross_entropy_against_float64(chunk):
    """A linear head over 40 tokens: the chunked loss and its gradients (w.r.t. the head's
    weights, accumulated over chunks, and the hidden states) are the float64 values."""
    keys = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(keys[0], (4, 10, 6))
    w = 2 * jax.random.normal(keys[1], (50, 6))  # (V, d)
    targets = jax.random.randint(keys[2], (4, 10), 0, 50)

    def loss(w, x):
        return chunked_cross_entropy(x, w, targets, chunk)

    with jax.default_matmul_precision("highest"):
        value, (gw, gx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
        forward_only = jax.jit(loss)(w, x)
    xs, ws = np.asarray(x, np.float64).reshape(-1, 6), np.asarray(w, np.float64)
    want, dlogits = _np_cross_entropy(xs @ ws.T, targets)
    np.testing.assert_allclose(value, want, rtol=2e-6)
    np.testing.assert_allclose(forward_only, want, rtol=2e-6)
    np.testing.assert_allclose(gw, dlogits.T @ xs, atol=1e-6, rtol=1e-5)
    np.testing.assert_allclose(gx.reshape(-1, 6), dlogits @ ws, atol=1e-6, rtol=1e-5)
    assert value.dtype == jnp.float32 and gx.shape == x.shape and gw.shape == w.shape


def test_chunked_cross_entropy_refuses_bad_chunks():
    x, w, t = jnp.zeros((4, 3)), jnp.zeros((5, 3)), jnp.zeros((4,), jnp.int32)
    for bad in (-1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="loss_chunk must be an integer >= 0"):
            chunked_cross_entropy(x, w, t, bad)
    with pytest.raises(ValueError, match="loss_chunk >= 1"):
        chunked_cross_entropy(x, w, t, 0)
    with pytest.raises(ValueError, match="loss_chunk must be an integer >= 0.*-3"):
        Llama(TINY, rngs=nnx.Rngs(0), loss_chunk=-3)


@pytest.mark.parametrize("tie,layers,dtype", [
    ("tied", "loop", jnp.float32), ("untied", "scan", jnp.float32),
    ("tied", "scan", jnp.bfloat16),
])
def test_chunked_loss_matches_the_unchunked_model(tie, layers, dtype):
    """loss_fn over chunks of 12 tokens (32 tokens: the last chunk padded): the loss is the
    float64 cross-entropy of the model's logits and the unchunked loss; in float32 every
    gradient is the unchunked one's, tied (the embedding is also the output layer) or
    untied; in bfloat16 the gradients are as close to the float32 ones as the unchunked
    bfloat16 gradients are (bfloat16 rounding)."""
    config = CONFIGS[tie]
    whole = Llama(config, rngs=nnx.Rngs(0), layers=layers, dtype=dtype)
    chunked = Llama(config, rngs=nnx.Rngs(0), layers=layers, dtype=dtype, loss_chunk=12)
    assert chunked.loss_chunk == 12 and whole.loss_chunk == 0
    stream = jax.random.randint(jax.random.key(1), (B, T + 1), 0, config.vocab_size)
    inputs, targets = stream[:, :-1], stream[:, 1:]
    with jax.default_matmul_precision("highest"):
        loss_w, g_w = nnx.jit(_loss_and_grads)(whole, inputs, targets)
        loss_c, g_c = nnx.jit(_loss_and_grads)(chunked, inputs, targets)
        logits = nnx.jit(lambda m, x: m(x))(whole, inputs)
        if dtype == jnp.float32:
            g_ref, tol = g_w, 1e-5
        else:  # the float32 model's gradients, which bfloat16 gets within ~1.3%
            _, g_ref = nnx.jit(_loss_and_grads)(
                Llama(config, rngs=nnx.Rngs(0), layers=layers), inputs, targets)
            tol = 2**-5
    want, _ = _np_cross_entropy(logits, targets)
    np.testing.assert_allclose(loss_c, want, rtol=2e-6)
    np.testing.assert_allclose(loss_c, loss_w, rtol=2e-6)
    assert sorted(g_c) == sorted(g_ref)
    for name in g_ref:
        scale = float(jnp.abs(g_ref[name]).max())
        assert scale > 0, name
        for g in (g_c, g_w):
            np.testing.assert_allclose(g[name], g_ref[name], atol=tol * scale, rtol=0,
                                       err_msg=name)


def test_chunked_cross_entropy_on_a_batch_sharded_over_8_devices():
    """The 8 host devices of tests/conftest.py: the batch sharded over its leading axis
    (data parallelism) gives the single-device loss and gradients."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    cpus = jax.devices("cpu")
    assert len(cpus) == 8
    keys = jax.random.split(jax.random.key(5), 3)
    x = jax.random.normal(keys[0], (8, 16, 6))
    w = jax.random.normal(keys[1], (50, 6))
    targets = jax.random.randint(keys[2], (8, 16), 0, 50)
    step = jax.jit(jax.value_and_grad(
        lambda w, x, t: chunked_cross_entropy(x, w, t, 32), argnums=(0, 1)))
    with jax.default_matmul_precision("highest"):
        want, (gw_want, gx_want) = step(w, x, targets)
        batch = NamedSharding(Mesh(np.array(cpus), ("data",)), P("data"))
        value, (gw, gx) = step(w, jax.device_put(x, batch), jax.device_put(targets, batch))
    np.testing.assert_allclose(value, want, rtol=1e-6)
    np.testing.assert_allclose(gw, gw_want, atol=1e-7, rtol=1e-5)
    np.testing.assert_allclose(gx, gx_want, atol=1e-7, rtol=1e-5)
