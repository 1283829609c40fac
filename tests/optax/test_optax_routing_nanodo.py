"""Issue 31, JAX: real nanodo routes with no override, by its linen module types.

google-deepmind/nanodo (``nanodo/model.py``, ``nanodo/fsdp.py``) annotates *mesh* axes, not
logical names: with its default ``fsdp_enabled=True`` every kernel is wrapped in
``nn.with_partitioning(init, ("data", None, None))`` and the like, and ``"data"`` says
nothing about which axis is the fan-in.  Its attention kernels are 3-D ``nn.DenseGeneral``
kernels, ``(D, H, Dh)`` for ``query``/``key``/``value`` (``axis=-1, features=(H, Dh)``) and
``(H, Dh, D)`` for ``attn_out_proj`` (``axis=(-2, -1), features=D``), so a params tree alone
is refused.  ``model=sage_optax.linen_model(module, tokens)`` reads every parameter's owner
module and its attributes instead.

The model below is written for this test from nanodo's architecture (same module classes,
names, shapes, initializers and partitioning annotations; small dimensions).  Each route is
checked against the true layout written from the forward code, each parameter's float64
update against the NumPy reference of that layout (``tests/reference_np.py``): q/k/v one
``D x (H·Dh)`` matrix, the output projection one ``(H·Dh) x D`` matrix, the MLP ``(in, out)``,
the tables SAGE over their vocab axis, the norms element-wise.  A transposed override fails
the same check.  The model then trains with no override on 8 CPU devices with nanodo's own
FSDP shardings.

Also here: linen ``nn.scan``/``nn.vmap`` stacks and experts by module evidence (the inserted
axis a batch axis wherever ``variable_axes`` puts it), the kind check between a module and
the axis names, and ``axis_names=`` paths that name no parameter.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_np as ref
from flax import linen as nn
from flax import nnx

import sage_optax
from sage_optax import Route, RoutingError, route_params
from sage_optax.routing import iter_leaves

# ------------------------------------------------------------------ nanodo, small


@dataclasses.dataclass
class DoConfig:
    """nanodo's hyper-parameters: width D, heads H, context L, blocks N, vocab V, MLP F."""

    D: int = 16
    H: int = 2
    L: int = 8
    N: int = 2
    V: int = 40
    F: int = 24
    kernel_init: Callable[..., Any] = nn.initializers.xavier_uniform()
    embed_init: Callable[..., Any] = nn.initializers.variance_scaling(
        1.0, "fan_in", "normal", out_axis=0)
    dtype: Any = jnp.float32
    fsdp_enabled: bool = True


MESH_AXES = {  # nanodo's fsdp.init: one axis of each kernel sharded over the mesh's "data"
    "embedding": (None, "data"),           # (V, D)
    "attn_in_proj": ("data", None, None),  # (D, H, Dh)
    "attn_out_proj": (None, None, "data"),  # (H, Dh, D)
    "mlp_kernel": ("data", None),          # (D, F) and (F, D)
}


def fsdp_init(kind: str, cfg: DoConfig) -> Callable[..., Any]:
    init = cfg.embed_init if kind == "embedding" else cfg.kernel_init
    return nn.with_partitioning(init, MESH_AXES[kind]) if cfg.fsdp_enabled else init


class CausalAttn(nn.Module):
    cfg: DoConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dh = c.D // c.H
        proj = functools.partial(nn.DenseGeneral, axis=-1, features=(c.H, dh), use_bias=False,
                                 kernel_init=fsdp_init("attn_in_proj", c), dtype=c.dtype)
        q, k, v = proj(name="query")(x), proj(name="key")(x), proj(name="value")(x)
        q = q / dh ** 0.5
        scores = jnp.einsum("...qhd,...khd->...hqk", q, k).astype(jnp.float32)
        n = x.shape[1]
        causal = jnp.tril(jnp.ones((1, 1, n, n), jnp.bool_))
        scores = jnp.where(causal, scores, jnp.finfo(c.dtype).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(c.dtype)
        mixed = jnp.einsum("...hqk,...khd->...qhd", probs, v)
        return nn.DenseGeneral(features=c.D, axis=(-2, -1), use_bias=False, dtype=c.dtype,
                               kernel_init=fsdp_init("attn_out_proj", c),
                               name="attn_out_proj")(mixed)


class Mlp(nn.Module):
    cfg: DoConfig

    @nn.compact
    def __call__(self, x):
        c = self.cfg
        dense = functools.partial(nn.Dense, use_bias=False, dtype=c.dtype,
                                  kernel_init=fsdp_init("mlp_kernel", c))
        h = dense(c.F)(x)  # Dense_0 (D, F), created first
        return dense(c.D)(jax.nn.gelu(h))  # Dense_1 (F, D)


class TBlock(nn.Module):
    docfg: DoConfig

    @nn.compact
    def __call__(self, x):
        c = self.docfg
        h = CausalAttn(c)(nn.LayerNorm(dtype=c.dtype, use_bias=False)(x)) + x
        return h + Mlp(c)(nn.LayerNorm(dtype=c.dtype, use_bias=False)(h))


class TransformerDo(nn.Module):
    """nanodo's decoder: token and position tables, N pre-norm blocks, a head tied to the
    token table (``embed.attend``)."""

    docfg: DoConfig

    def setup(self):
        c = self.docfg
        self.embed = nn.Embed(c.V, c.D, embedding_init=fsdp_init("embedding", c))
        self.pos_embed = nn.Embed(c.L, c.D, embedding_init=fsdp_init("embedding", c))
        self.blocks = [TBlock(c) for _ in range(c.N)]
        self.out_ln = nn.LayerNorm(dtype=c.dtype, use_bias=False)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos_embed(jnp.arange(tokens.shape[1])[None])
        for block in self.blocks:
            x = block(x)
        return self.embed.attend(self.out_ln(x).astype(jnp.float32))


CFG = DoConfig()
TOKENS = jax.ShapeDtypeStruct((2, CFG.L), jnp.int32)

BLOCK_TRUTH = {  # (kind, fan-in, fan-out, batch), from the forward code above
    "CausalAttn_0.query.kernel": ("dense", (0,), (1, 2), ()),       # D -> (H, Dh)
    "CausalAttn_0.key.kernel": ("dense", (0,), (1, 2), ()),
    "CausalAttn_0.value.kernel": ("dense", (0,), (1, 2), ()),
    "CausalAttn_0.attn_out_proj.kernel": ("dense", (0, 1), (2,), ()),  # (H, Dh) -> D
    "LayerNorm_0.scale": ("vector", (), (), ()),
    "LayerNorm_1.scale": ("vector", (), (), ()),
    "Mlp_0.Dense_0.kernel": ("dense", (0,), (1,), ()),                # D -> F
    "Mlp_0.Dense_1.kernel": ("dense", (0,), (1,), ()),                # F -> D
}
TRUTH = {
    "embed.embedding": ("embedding", (1,), (0,), ()),    # (V, D), also the tied head
    "pos_embed.embedding": ("embedding", (1,), (0,), ()),  # (L, D)
    "out_ln.scale": ("vector", (), (), ()),
    **{f"blocks_{i}.{k}": v for i in range(CFG.N) for k, v in BLOCK_TRUTH.items()},
}


@functools.cache
def nanodo_variables():
    return jax.eval_shape(TransformerDo(CFG).init, jax.random.key(0), TOKENS)


def linen_nanodo():
    return sage_optax.linen_model(TransformerDo(CFG), TOKENS)


def routes_of(routing):
    return {n: (r.kind, r.fan_in, r.fan_out, r.batch) for n, r in iter_leaves(routing.routes)}


# --------------------------------------------------------------------- references


def matrix_view(x, fan_in, fan_out, batch):
    """``x`` as ``(copies, fan-in, fan-out)``: its true layout's matrices."""
    x = np.asarray(x).transpose(*batch, *fan_in, *fan_out)
    copies = int(np.prod([x.shape[i] for i in range(len(batch))]))
    rows = int(np.prod(x.shape[len(batch):len(batch) + len(fan_in)]))
    return x.reshape(copies, rows, -1)


def expected(kind, g, fan_in, fan_out, batch):
    """sage-hybrid's first step (lr 1, no decay) of ``g`` in its true layout: SinkGD (unit,
    alpha 10) of each matrix, SAGE with the fan-out (vocab) axis reduced for a table,
    element-wise SAGE for a vector."""
    if kind == "vector":  # one vector per copy (its dampers' RMS is the copy's)
        rest = tuple(a for a in range(np.ndim(g)) if a not in batch)
        m = matrix_view(g, (), rest, batch)[:, 0]
        return np.stack([ref.SageRef(v.shape, vocab_axis=None, weight_decay=0.0).step(
            np.zeros(v.shape), v, 1.0) for v in m])
    m = matrix_view(g, fan_in, fan_out, batch)
    out = []
    for b in range(m.shape[0]):
        if kind == "dense":
            out.append(-10.0 * ref.sinkhorn_ref(m[b]))
        else:
            sage = ref.SageRef(m[b].shape, vocab_axis=1, weight_decay=0.0)
            out.append(sage.step(np.zeros(m[b].shape), m[b], 1.0))
    return np.stack(out)


def check_updates(updates, grads, truth):
    """Every parameter's update equals the reference of its true layout."""
    u, g = dict(iter_leaves(updates)), dict(iter_leaves(grads))
    for path, (kind, fan_in, fan_out, batch) in truth.items():
        want = expected(kind, g[path], fan_in, fan_out, batch)
        if kind == "vector":
            fan_out = tuple(a for a in range(np.ndim(g[path])) if a not in batch)
        got = matrix_view(u[path], fan_in, fan_out, batch)
        got = got[:, 0] if kind == "vector" else got
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=path)


def f64(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float64), tree)


def random_like(tree, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float64), tree)


def step(params, grads, **kw):
    tx = sage_optax.make_optimizer("sage-hybrid", 1.0, weight_decay=0.0, **kw)
    return jax.jit(tx.update)(grads, tx.init(params), params)[0]


# -------------------------------------------------------------------------- nanodo


def test_real_nanodo_routes_by_its_module_types_with_no_override():
    params = nanodo_variables()["params"]
    # the mesh names place nothing: without the module the 3-D kernels are refused
    with pytest.raises(RoutingError) as info:
        route_params(params)
    assert "model=sage_optax.linen_model(module, *inputs)" in str(info.value)
    assert set(info.value.overrides) == {  # one glob per layer role (issue 45)
        f"blocks_*.CausalAttn_0.{m}.kernel" for m in ("query", "key", "value", "attn_out_proj")}
    got = routes_of(route_params(params, model=linen_nanodo()))
    assert got == TRUTH
    # the first remedies the refusal pastes are right: the same routes as the modules give
    assert routes_of(route_params(params, info.value.overrides)) == TRUTH
    table = sage_optax.routing_table("sage-hybrid", params, model=linen_nanodo())
    evidence = {r.path: r.evidence for r in table.rows}
    assert evidence["blocks_0.CausalAttn_0.attn_out_proj.kernel"].startswith(
        "module nn.DenseGeneral")
    assert evidence["embed.embedding"].startswith("module nn.Embed")
    # the whole variables tree, unboxed params and a bound module route the same
    variables = nanodo_variables()
    bound = sage_optax.linen_model(TransformerDo(CFG).bind(variables), TOKENS)
    assert routes_of(route_params(nn.unbox(params), model=bound)) == TRUTH
    whole = routes_of(route_params(variables, model=linen_nanodo()))
    assert whole == {f"params.{k}": v for k, v in TRUTH.items()}


def test_real_nanodo_update_of_every_parameter_is_that_of_its_true_layout():
    with jax.enable_x64(True):
        params = f64(nn.unbox(nanodo_variables()["params"]))
        grads = random_like(params)
        check_updates(step(params, grads, model=linen_nanodo()), grads, TRUTH)
        # a transposed reading of the q kernel ((H, Dh) as the fan-in) fails the check
        path = "blocks_0.CausalAttn_0.query.kernel"
        g = {path: grads["blocks_0"]["CausalAttn_0"]["query"]["kernel"]}
        wrong = step(f64(g), g, route_overrides={path: Route("dense", (1, 2), 0)})
        with pytest.raises(AssertionError, match="query"):
            check_updates(wrong, g, {path: TRUTH[path]})


def test_real_nanodo_trains_on_8_devices_with_its_fsdp_shardings_and_no_override():
    assert jax.device_count() >= 8  # tests/conftest.py
    cfg = DoConfig(N=1)  # one block: one compile, the same modules
    module, tokens = TransformerDo(cfg), jax.random.randint(
        jax.random.key(1), (8, cfg.L + 1), 0, cfg.V)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("data",))  # as nanodo builds it
    specs = nn.get_partition_spec(jax.eval_shape(module.init, jax.random.key(0), TOKENS))
    shardings = jax.tree.map(lambda s: jax.sharding.NamedSharding(mesh, s), specs)["params"]
    params = jax.jit(lambda key: nn.unbox(module.init(key, tokens[:, :-1]))["params"],
                     out_shardings=shardings)(jax.random.key(0))
    tx = sage_optax.make_optimizer("sage-hybrid", 1e-2,
                                   model=sage_optax.linen_model(module, TOKENS))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.device_put(tx.init(params), replicated)

    def train_step(params, state):
        def loss_fn(p):
            logits = module.apply({"params": p}, tokens[:, :-1])
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    # the shardings out are the shardings in: one compile for every step
    train_step = jax.jit(train_step, out_shardings=(
        shardings, jax.tree.map(lambda _: replicated, state), replicated))
    losses = []
    for _ in range(3):
        params, state, loss = train_step(params, state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    q = params["blocks_0"]["CausalAttn_0"]["query"]["kernel"]
    assert q.sharding.is_equivalent_to(shardings["blocks_0"]["CausalAttn_0"]["query"]["kernel"],
                                       3)


# ------------------------------------------------------------- linen stacks, experts


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.DenseGeneral((2, 3), use_bias=True, name="query")(x)       # (D, 2, 3)
        x = x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), name="out")(h)  # (2, 3, D)
        return nn.LayerNorm()(x), None


class Stacks(nn.Module):
    """nn.scan on params axis 1 (MaxText's param_scan_axis) with no axis names, experts made
    by nn.vmap on axis 0, and per-expert matrices of one DenseGeneral (batch_dims)."""

    @nn.compact
    def __call__(self, x):
        layers = nn.scan(ScanBody, variable_axes={"params": 1}, split_rngs={"params": True},
                         length=5)
        x = layers(name="layers")(x, None)[0]
        experts = nn.vmap(nn.Dense, variable_axes={"params": 0}, split_rngs={"params": True},
                          in_axes=None, out_axes=0, axis_size=4)
        h = experts(7, name="experts")(x)                                     # (4, D, 7)
        per = nn.DenseGeneral(6, axis=-1, batch_dims=0, name="per_expert")(h)  # (4, 7, 6)
        return per


STACK_TRUTH = {
    "layers.query.kernel": ("dense", (0,), (2, 3), (1,)),   # (D, L, 2, 3)
    "layers.query.bias": ("vector", (), (), (1,)),           # (2, L, 3)
    "layers.out.kernel": ("dense", (0, 2), (3,), (1,)),      # (2, L, 3, D)
    "layers.out.bias": ("vector", (), (), (1,)),             # (D, L)
    "layers.LayerNorm_0.scale": ("vector", (), (), (1,)),
    "layers.LayerNorm_0.bias": ("vector", (), (), (1,)),
    "experts.kernel": ("dense", (1,), (2,), (0,)),           # (E, D, 7)
    "experts.bias": ("vector", (), (), (0,)),
    "per_expert.kernel": ("dense", (1,), (2,), (0,)),        # (E, 7, 6): batch_dims=0
    "per_expert.bias": ("vector", (), (), (0,)),
}


def test_linen_scan_and_vmap_stacks_by_module_evidence_per_layer_and_expert():
    x = jax.ShapeDtypeStruct((1, 8), jnp.float32)
    model = sage_optax.linen_model(Stacks(), x)
    params = jax.eval_shape(Stacks().init, jax.random.key(0), x)["params"]
    with pytest.raises(RoutingError):
        route_params(params)  # shapes alone: refused
    assert {k: v for k, v in routes_of(route_params(params, model=model)).items()
            if k in STACK_TRUTH} == STACK_TRUTH
    with jax.enable_x64(True):
        params = f64(params)
        grads = random_like(params, 1)
        check_updates(step(params, grads, model=model), grads, STACK_TRUTH)
        path = "layers.query.kernel"  # the scan axis merged into the fan-out: fails
        g = {path: grads["layers"]["query"]["kernel"]}
        wrong = step(f64(g), g, route_overrides={path: Route("dense", 0, (1, 2, 3))})
        with pytest.raises(AssertionError, match=path):
            check_updates(wrong, g, {path: STACK_TRUTH[path]})


class SquareBody(nn.Module):
    names: tuple | None = None

    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.normal()
        if self.names is not None:
            init = nn.with_partitioning(init, self.names)
        return nn.Dense(3, use_bias=False, kernel_init=init)(x), None


def square_stack(names, metadata):
    class Square(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.scan(SquareBody, variable_axes={"params": 1},
                           split_rngs={"params": True}, length=3,
                           metadata_params=metadata)(names, name="layers")(x, None)[0]
    return Square()


def test_a_stack_whose_sizes_hide_the_inserted_axis_is_refused_unless_named():
    """(3, 3) Dense kernels scanned 3 times on axis 1: (3, 3, 3) fits three placements."""
    x = jax.ShapeDtypeStruct((1, 3), jnp.float32)
    module = square_stack(None, {})
    params = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    with pytest.raises(RoutingError, match="do not say which axes") as info:
        route_params(params, model=sage_optax.linen_model(module, x))
    first = info.value.overrides["layers.Dense_0.kernel"]
    assert first == Route("dense", 1, 2, batch=(0,))  # variable_axes=0, the default, first
    assert Route("dense", 0, 2, batch=(1,)) in [o for o, _ in info.value.problems[0].options]
    # nn.scan's axis name settles it: the names place the leaf where the module cannot
    module = square_stack(("embed", "mlp"), {nn.PARTITION_NAME: "layers"})
    params = jax.eval_shape(module.init, jax.random.key(0), x)["params"]
    got = routes_of(route_params(params, model=sage_optax.linen_model(module, x)))
    assert got["layers.Dense_0.kernel"] == ("dense", (0,), (2,), (1,))


# ---------------------------------------------------------------- item 4: the checks


def test_module_and_names_must_agree_on_the_kind_a_head_named_vocab_is_kept():
    class Head(nn.Module):
        @nn.compact
        def __call__(self, ids):
            x = nn.Embed(12, 4, embedding_init=nn.with_partitioning(
                nn.initializers.normal(), self.table), name="tok")(ids)
            return nn.Dense(12, use_bias=False, kernel_init=nn.with_partitioning(
                nn.initializers.normal(), self.head), name="head")(x)

        table: tuple = ("vocab", "embed")
        head: tuple = ("embed", "vocab")

    ids = jax.ShapeDtypeStruct((1, 3), jnp.int32)

    def route(**names):
        module = Head(**names)
        params = jax.eval_shape(module.init, jax.random.key(0), ids)["params"]
        return route_params(params, model=sage_optax.linen_model(module, ids),
                            axis_roles={"rows": "fan_out", "cols": "fan_in"})

    got = routes_of(route())
    assert got["head.kernel"] == ("embedding", (0,), (1,), ())  # the untied head: SAGE
    assert got["tok.embedding"] == ("embedding", (1,), (0,), ())
    # names that make the nn.Embed table a matrix (same axes, other kind): refused
    with pytest.raises(RoutingError, match=r"module nn.Embed \(V, d\) makes it a table or "
                       r"head \(embedding\) but its axis names \('rows', 'cols'\) make it a "
                       r"matrix \(dense\)") as info:
        route(table=("rows", "cols"))
    assert info.value.overrides == {"tok.embedding": Route("embedding", 1, 0, ())}
    # names that put the vocabulary on a Dense's input: refused (the module's reading first)
    with pytest.raises(RoutingError, match="module nn.Dense") as info:
        route(head=("vocab", "embed"))
    assert info.value.overrides == {"head.kernel": Route("dense", 0, 1, ())}


def test_nnx_head_named_vocab_gets_the_embedding_kind():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.head = nnx.Linear(4, 12, use_bias=False, rngs=rngs, kernel_init=(
                nnx.with_partitioning(nnx.initializers.normal(), ("embed", "vocab"))))

    with nnx.use_eager_sharding(False):
        model = M(nnx.Rngs(0))
    assert routes_of(route_params(model))["head.kernel"] == ("embedding", (0,), (1,), ())


def test_axis_names_that_name_no_parameter_are_refused_in_one_line():
    params = {"mlp": {"kernel": jnp.ones((4, 6))}}
    names = {"mlp.kernel": ("embed", "mlp"), "mlpp.kernel": ("embed", "mlp")}
    with pytest.raises(RoutingError, match=r"axis_names: 1 path\(s\) name no parameter .*"
                       r"'mlpp.kernel' \(nearest: mlp.kernel\)") as info:
        route_params(params, axis_names=names)
    assert "\n" not in str(info.value)
    tx = sage_optax.make_optimizer("sage-hybrid", axis_names=names)
    with pytest.raises(RoutingError, match="'mlpp.kernel'"):
        tx.init(params)
    # the variables level: only its params collection is looked at, with or without it
    boxed = {"params": {"mlp": {"kernel": nn.Partitioned(jnp.ones((4, 6)), ("embed", "mlp"))}},
             "cache": {"k": nn.Partitioned(jnp.ones((2, 4)), ("batch", "embed"))}}
    assert routes_of(route_params(params, axis_names=boxed))["mlp.kernel"] == (
        "dense", (0,), (1,), ())
    jax.eval_shape(sage_optax.make_optimizer("sage-hybrid", axis_names=boxed).init, params)


def test_linen_model_traces_array_inputs_and_keeps_python_ones_static():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, *, train):
            x = nn.DenseGeneral((2, 3), name="query")(x)
            if train:  # Python control flow on a keyword input
                x = nn.Dropout(0.5, deterministic=False)(x)
            return nn.Dense(4, name="out")(x.reshape(x.shape[:-2] + (6,)))

    x = jax.ShapeDtypeStruct((1, 5), jnp.float32)
    params = jax.eval_shape(functools.partial(Net().init, train=False), jax.random.key(0), x)
    for given in (x, np.ones((1, 5), np.float32)):
        got = routes_of(route_params(params["params"], model=sage_optax.linen_model(
            Net(), given, train=True)))
        assert got["query.kernel"] == ("dense", (0,), (1, 2), ())
        assert got["query.bias"] == ("vector", (), (), ())


def test_a_module_that_fails_on_the_sample_input_says_so_in_one_line():
    with pytest.raises(ValueError, match=r"linen_model: TransformerDo.init on the sample "
                       r"inputs \(ShapeDtypeStruct\(1, 5, 7\)\) failed") as info:
        sage_optax.make_optimizer("sage-hybrid", model=sage_optax.linen_model(
            TransformerDo(CFG), jax.ShapeDtypeStruct((1, 5, 7), jnp.float32)))  # not tokens
    assert "\n" not in str(info.value) and info.value.__cause__ is not None


def test_nnx_stacks_off_axis_0_are_batch_where_the_transform_put_them():
    """nnx.vmap with StateAxes({nnx.Param: 1}): kernel (in, L, out); the module's own shape
    (in_features, out_features) says axis 1 is the stack (it was read as the fan-in)."""
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 6, rngs=rngs)
            self.attn = nnx.LinearGeneral(6, (2, 5), rngs=rngs)
            self.norm = nnx.RMSNorm(6, rngs=rngs)

    @nnx.split_rngs(splits=3)
    @nnx.vmap(in_axes=(0,), out_axes=nnx.StateAxes({nnx.Param: 1, ...: 0}))
    def make(rngs):
        return Layer(rngs)

    truth = {"up.kernel": ("dense", (0,), (2,), (1,)),        # (4, L, 6)
             "up.bias": ("vector", (), (), (1,)),             # (6, L)
             "attn.kernel": ("dense", (0,), (2, 3), (1,)),    # (6, L, 2, 5)
             "attn.bias": ("vector", (), (), (1,)),           # (2, L, 5)
             "norm.scale": ("vector", (), (), (1,))}
    model = make(nnx.Rngs(0))
    assert routes_of(route_params(model)) == truth
    with jax.enable_x64(True):
        params = f64(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        grads = random_like(params, 4)
        check_updates(step(params, grads, model=model), grads, truth)


def test_equinox_stacks_off_axis_0_are_batch_where_filter_vmap_put_them():
    """eqx.filter_vmap(..., out_axes=1): weight (out, E, in); it was read (E as fan-out)."""
    import equinox as eqx

    experts = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 6, key=k), out_axes=1)(
        jax.random.split(jax.random.key(0), 3))
    params = eqx.filter(experts, eqx.is_inexact_array)
    truth = {"weight": ("dense", (2,), (0,), (1,)), "bias": ("vector", (), (), (1,))}
    assert routes_of(route_params(params)) == truth
    with jax.enable_x64(True):
        params = {"weight": jnp.zeros((6, 3, 4)), "bias": jnp.zeros((6, 3))}
        grads = random_like(params, 5)
        check_updates(step(params, grads, model=experts), grads, truth)


@pytest.mark.parametrize("sizes", [("scalar", 4), (4, "scalar"), ("scalar", "scalar")])
def test_equinox_scalar_linear_routes_stacked_or_not(sizes):
    """eqx.nn.Linear stores a "scalar" side as size 1 (weight (4, 1), bias (1,)); the
    stacking step read it as absent and raised an internal error on every such layer."""
    import equinox as eqx

    def linear(key):
        return eqx.nn.Linear(*sizes, key=key)

    single = eqx.filter(linear(jax.random.key(0)), eqx.is_inexact_array)
    assert routes_of(route_params(single)) == {"weight": ("dense", (1,), (0,), ()),
                                               "bias": ("vector", (), (), ())}
    stack = eqx.filter_vmap(linear, out_axes=1)(jax.random.split(jax.random.key(0), 3))
    truth = {"weight": ("dense", (2,), (0,), (1,)), "bias": ("vector", (), (), (1,))}
    assert routes_of(route_params(eqx.filter(stack, eqx.is_inexact_array))) == truth
    with jax.enable_x64(True):
        params = {"weight": jnp.zeros(stack.weight.shape), "bias": jnp.zeros(stack.bias.shape)}
        grads = random_like(params, 6)
        check_updates(step(params, grads, model=stack), grads, truth)


def test_linen_einsum_and_conv_kernels_by_module_evidence():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, img, x):
            y = nn.Conv(5, (3, 3), name="conv")(img)                     # (3, 3, 2, 5)
            experts = nn.Einsum((4, 6, 7), "bed,edf->bef", name="experts")(x)  # per expert
            joint = nn.Einsum((6, 2, 3), name="joint")(x, "bed,dhk->behk")  # at call time
            return y, experts, joint

    img = jax.ShapeDtypeStruct((1, 8, 8, 2), jnp.float32)
    x = jax.ShapeDtypeStruct((1, 4, 6), jnp.float32)
    params = jax.eval_shape(Net().init, jax.random.key(0), img, x)["params"]
    got = routes_of(route_params(params, model=sage_optax.linen_model(Net(), img, x)))
    assert got["conv.kernel"] == ("dense", (2, 0, 1), (3,), ())   # Cin then taps, as nnx.Conv
    assert got["experts.kernel"] == ("dense", (1,), (2,), (0,))   # e in input and output
    assert got["joint.kernel"] == ("dense", (0,), (1, 2), ())     # d -> (h, k)
    assert got["conv.bias"] == ("vector", (), (), ())
    assert got["experts.bias"] == ("vector", (), (), ())           # (e, f): one vector, as nnx
