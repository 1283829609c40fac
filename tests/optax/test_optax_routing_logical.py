"""Issue 31, JAX: logical axis names, mixture-of-experts kernels and stacked layers.

linen ``nn.with_partitioning``/``nn.with_logical_partitioning`` boxes and nnx ``out_sharding``
metadata name every axis (``sage_optax.logical``).  Each model here is written in a
convention of the JAX ecosystem (a nanodo-style linen LM with MaxText's names, linen
``nn.scan``/``nn.vmap`` stacks, an nnx mixture of experts, ``nnx.vmap``/``nnx.scan``, Equinox
``filter_vmap`` experts); every leaf's route is checked against its true layout, written by
hand from the model's forward code, and the float64 update of each matrix against the NumPy
reference of that layout, per expert and per layer (``tests/reference_np.py``).  The
transposed override fails that check, so the check can fail.
"""

from __future__ import annotations

import functools
from functools import partial

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_np as ref
from flax import linen as nn
from flax import nnx

import sage_optax
from sage_optax import Route, RoutingError, route_params
from sage_optax.routing import iter_leaves

V, D, H, F, L, E = 24, 8, 2, 12, 6, 3
INIT = nn.initializers.normal(0.5)


def part(*names):
    return nn.with_partitioning(INIT, names)


class Attn(nn.Module):
    """nanodo's attention: DenseGeneral (D, H, Dh) for q/k/v and (H, Dh, D) out."""

    @nn.compact
    def __call__(self, x):
        dg = partial(nn.DenseGeneral, axis=-1, features=(H, D // H), use_bias=False,
                     kernel_init=part("embed", "heads", "kv"))
        q, k, v = dg(name="query")(x), dg(name="key")(x), dg(name="value")(x)
        a = jax.nn.softmax(jnp.einsum("...qhd,...khd->...hqk", q, k), -1)
        o = jnp.einsum("...hqk,...khd->...qhd", a, v)
        return nn.DenseGeneral(D, axis=(-2, -1), use_bias=False, name="attn_out_proj",
                               kernel_init=part("heads", "kv", "embed"))(o)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        norm = partial(nn.LayerNorm, use_bias=False,
                       scale_init=nn.with_partitioning(nn.initializers.ones, ("embed",)))
        x = x + Attn()(norm()(x))
        h = nn.Dense(F, use_bias=False, kernel_init=part("embed", "mlp"))(norm()(x))
        return x + nn.Dense(D, use_bias=False, kernel_init=part("mlp", "embed"))(jax.nn.gelu(h))


class NanodoLM(nn.Module):
    """A nanodo-style decoder: every parameter annotated with nn.with_partitioning."""

    @nn.compact
    def __call__(self, ids):
        emb = partial(nn.Embed, features=D)
        x = emb(V, embedding_init=part("vocab", "embed"), name="embed")(ids)
        x = x + emb(L, embedding_init=part(None, "embed"), name="pos_embed")(
            jnp.arange(ids.shape[1]))
        x = Block(name="blocks_0")(x)
        return nn.Dense(V, use_bias=False, kernel_init=part("embed", "vocab"), name="head")(x)


# (kind, fan-in, fan-out, batch) of every parameter of one block, from the forward code above
BLOCK_TRUTH = {
    "Attn_0.query.kernel": ("dense", (0,), (1, 2), ()),   # x (D) -> (H, Dh)
    "Attn_0.key.kernel": ("dense", (0,), (1, 2), ()),
    "Attn_0.value.kernel": ("dense", (0,), (1, 2), ()),
    "Attn_0.attn_out_proj.kernel": ("dense", (0, 1), (2,), ()),  # (H, Dh) -> D
    "LayerNorm_0.scale": ("vector", (), (), ()),
    "LayerNorm_1.scale": ("vector", (), (), ()),
    "Dense_0.kernel": ("dense", (0,), (1,), ()),
    "Dense_1.kernel": ("dense", (0,), (1,), ()),
}
NANODO_TRUTH = {
    "embed.embedding": ("embedding", (1,), (0,), ()),     # (V, D): vocab is the fan-out
    "pos_embed.embedding": ("embedding", (1,), (0,), ()),
    "head.kernel": ("embedding", (0,), (1,), ()),         # (D, V): the untied head
    **{f"blocks_0.{k}": v for k, v in BLOCK_TRUTH.items()},
}


def routes_of(routing):
    return {n: (r.kind, r.fan_in, r.fan_out, r.batch) for n, r in iter_leaves(routing.routes)}


@functools.cache
def nanodo_variables():
    """The boxed variables, abstract (``jax.eval_shape``): the names are what matters."""
    return jax.eval_shape(NanodoLM().init, jax.random.key(0), jnp.ones((1, 4), jnp.int32))


def f64(tree):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, jnp.float64), tree)


def random_like(tree, seed=0):
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float64), tree)


def expected(kind, g, fan_in, fan_out, batch):
    """The sage-hybrid step (lr 1, no decay) of ``g`` in the layout (fan_in, fan_out, batch):
    SinkGD (unit, alpha 10) of each (in, out) matrix, or SAGE's first step with the vocab
    (fan-out) axis reduced; returned in the (batch, in, out) matrix view."""
    m = matrix_view(g, fan_in, fan_out, batch)
    out = []
    for b in range(m.shape[0]):
        if kind == "dense":
            out.append(-10.0 * ref.sinkhorn_ref(m[b]))
        else:
            sage = ref.SageRef(m[b].shape, vocab_axis=1, weight_decay=0.0)
            out.append(sage.step(np.zeros(m[b].shape), m[b], 1.0))
    return np.stack(out)


def matrix_view(x, fan_in, fan_out, batch):
    x = np.asarray(x).transpose(*batch, *fan_in, *fan_out)
    nb = int(np.prod([x.shape[i] for i in range(len(batch))]))
    return x.reshape(nb, int(np.prod(x.shape[len(batch):len(batch) + len(fan_in)])), -1)


def check_updates(updates, grads, truth, skip_vectors=True):
    """Every matrix's update equals the reference of its true layout."""
    u, g = dict(iter_leaves(updates)), dict(iter_leaves(grads))
    for path, (kind, fan_in, fan_out, batch) in truth.items():
        if kind == "vector":
            continue
        want = expected(kind, g[path], fan_in, fan_out, batch)
        got = matrix_view(u[path], fan_in, fan_out, batch)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-10, err_msg=path)


def step(params, grads, **kw):
    tx = sage_optax.make_optimizer("sage-hybrid", 1.0, weight_decay=0.0, **kw)
    updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
    return updates


# ------------------------------------------------------------------------------ nanodo


def test_nanodo_style_linen_model_routes_by_its_axis_names_with_no_override():
    variables = nanodo_variables()
    assert routes_of(route_params(variables["params"])) == NANODO_TRUTH
    table = sage_optax.routing_table("sage-hybrid", variables["params"])
    evidence = {r.path: r.evidence for r in table.rows}
    assert evidence["head.kernel"] == "axis names ('embed', 'vocab')"
    assert evidence["blocks_0.Attn_0.attn_out_proj.kernel"] == (
        "axis names ('heads', 'kv', 'embed')")
    # the same names, given apart from unboxed params (nn.get_partition_spec)
    plain = nn.unbox(variables["params"])
    with pytest.raises(RoutingError):
        route_params(plain)  # without names: the 3-D kernels are refused, as before
    specs = nn.get_partition_spec(variables)  # {"params": ...}: either level will do
    assert routes_of(route_params(plain, axis_names=specs)) == NANODO_TRUTH
    assert routes_of(route_params(plain, axis_names=specs["params"])) == NANODO_TRUTH
    # make_optimizer reads the boxes of the params it is given
    jax.eval_shape(sage_optax.make_optimizer("sage-hybrid").init, variables["params"])


def test_nanodo_style_update_of_every_matrix_is_that_of_its_true_layout():
    with jax.enable_x64(True):
        variables = nanodo_variables()
        params = f64(nn.unbox(variables["params"]))
        grads = random_like(params)
        updates = step(params, grads, axis_names=variables["params"])
        check_updates(updates, grads, NANODO_TRUTH)
        # the transposed reading of the output projection fails the same check
        path = "blocks_0.Attn_0.attn_out_proj.kernel"
        g = {path: grads["blocks_0"]["Attn_0"]["attn_out_proj"]["kernel"]}
        wrong = step(jax.tree.map(jnp.zeros_like, g), g,
                     route_overrides={path: Route("dense", fan_in=2, fan_out=(0, 1))})
        with pytest.raises(AssertionError, match="attn_out_proj"):
            check_updates(wrong, g, {path: NANODO_TRUTH[path]})


# ---------------------------------------------------------------------- contradictions


@pytest.mark.parametrize("names, first", [
    ((None, "embed", "mlp"), Route("dense", (1,), (2,), (0,))),     # an unnamed scan axis
    (("embed", "layers_x", "mlp"), Route("dense", (0,), (2,), (1,))),  # an unknown name
    (("embed", None, None), Route("dense", (0,), (1, 2), ())),      # unnamed heads
])
def test_an_axis_the_names_leave_unexplained_is_refused_with_their_reading_first(names, first):
    params = {"w": {"kernel": nn.Partitioned(jnp.ones((3, 4, 5)), names)}}
    with pytest.raises(RoutingError, match="has no role") as info:
        route_params(params)
    assert info.value.overrides == {"w.kernel": first}
    assert str(info.value).count("\n") == 4  # one line, then the paste block


@pytest.mark.parametrize("names, why", [
    (("embed", "mlp", "embed"), "'embed' names two axes"),
    (("mlp", "embed", "heads"), "between other named axes"),
    (("vocab", "embed", "vocab"), "two axes name the vocabulary"),
])
def test_contradicting_names_are_refused(names, why):
    params = {"w": {"kernel": nn.Partitioned(jnp.ones((3, 4, 5)), names)}}
    with pytest.raises(RoutingError, match=why):
        route_params(params)


def test_user_roles_extend_the_table_and_overrides_win():
    params = {"w": {"kernel": nn.Partitioned(jnp.ones((3, 4, 5)), ("my_e", "d_in", "d_out"))}}
    with pytest.raises(RoutingError, match=r"cannot tell the layout.*axis_roles=") as info:
        route_params(params)  # names the table does not know place nothing
    assert info.value.overrides == {"w.kernel": Route("dense", -2, -1)}  # stacked: first
    roles = {"my_e": "batch", "d_in": "fan_in", "d_out": "fan_out"}
    got = routes_of(route_params(params, axis_roles=roles))
    assert got["w.kernel"] == ("dense", (1,), (2,), (0,))
    # a role for the width only: the other named axis takes the other side
    got = routes_of(route_params(params, axis_roles={"my_e": "batch", "d_in": "embed"}))
    assert got["w.kernel"] == ("dense", (1,), (2,), (0,))
    got = routes_of(route_params(params, {"w.kernel": Route("dense", 2, 1)}, axis_roles=roles))
    assert got["w.kernel"] == ("dense", (2,), (1,), (0,))
    with pytest.raises(ValueError, match=r"axis_roles\['x'\] = 'fan-in'"):
        route_params(params, axis_roles={"x": "fan-in"})
    with pytest.raises(ValueError, match="axis_roles"):
        sage_optax.make_optimizer("sage-hybrid", axis_roles={"x": "rows"})


def test_names_settle_multi_axis_biases_and_the_torch_order():
    params = {"q": {"bias": nn.Partitioned(jnp.ones((H, 4)), ("heads", "kv")),
                    "kernel": nn.Partitioned(jnp.ones((D, H, 4)), ("embed", "heads", "kv"))},
              "s": {"bias": nn.Partitioned(jnp.ones((L, H, 4)), ("layers", "heads", "kv"))}}
    got = routes_of(route_params(params))
    assert got["q.bias"] == ("vector", (), (), ())       # one (heads, head_dim) vector
    assert got["s.bias"] == ("vector", (), (), (0,))     # one per layer
    # layout="torch": matrices are (out, in), so the width first is the fan-out
    w = {"up": {"weight": nn.Partitioned(jnp.ones((F, D)), ("mlp", "embed"))}}
    assert routes_of(route_params(w, layout="torch"))["up.weight"] == ("dense", (1,), (0,), ())


def test_a_square_width_matrix_is_left_to_its_leaf_name():
    params = {"proj": {"kernel": nn.Partitioned(jnp.ones((4, 4)), ("embed", "embed"))}}
    assert routes_of(route_params(params))["proj.kernel"] == ("dense", (0,), (1,), ())


def test_mesh_axis_names_say_nothing_and_leave_the_leaf_to_its_name():
    """Real nanodo annotates mesh axes (("data", None)): no role, the name rules decide."""
    params = {"mlp": {"kernel": nn.Partitioned(jnp.ones((4, 6)), ("data", None))},
              "out": {"kernel": nn.Partitioned(jnp.ones((6, 4)), (None, "data"))}}
    got = routes_of(route_params(params))
    assert got["mlp.kernel"] == ("dense", (0,), (1,), ())
    assert got["out.kernel"] == ("dense", (0,), (1,), ())


def test_real_nanodo_mesh_names_get_the_attention_readings_first():
    """nanodo itself annotates the mesh axis ("data") of each kernel: no role; the module
    names order the remedies, attn_out_proj (H, Dh, D) included (it had the stacked one)."""
    params = {"attn": {
        "query": {"kernel": nn.Partitioned(jnp.ones((D, H, 4)), ("data", None, None))},
        "attn_out_proj": {"kernel": nn.Partitioned(jnp.ones((H, 4, D)), (None, None, "data"))},
    }}
    with pytest.raises(RoutingError) as info:
        route_params(params)
    assert info.value.overrides == {
        "attn.query.kernel": Route("dense", 0, (1, 2)),
        "attn.attn_out_proj.kernel": Route("dense", (0, 1), 2)}


def test_module_and_names_that_disagree_are_refused():
    class M(nnx.Module):
        def __init__(self, rngs):
            self.attn_in = nnx.LinearGeneral(
                D, (H, D // H), rngs=rngs, use_bias=False,
                kernel_init=nnx.with_partitioning(INIT, ("heads", "kv", "embed")))

    with nnx.use_eager_sharding(False):
        model = M(nnx.Rngs(0))
    with pytest.raises(RoutingError, match="module nnx.LinearGeneral gives fan-in") as info:
        route_params(model)
    assert info.value.overrides == {"attn_in.kernel": Route("dense", (-3,), (-2, -1))}


# ----------------------------------------------------------------- experts and stacks


class LinenMoE(nn.Module):
    """MaxText's MoE layout: wi (E, embed, mlp), wo (E, mlp, embed), a router (embed, E);
    layers scanned on axis 1 as MaxText's param_scan_axis=1."""

    @nn.compact
    def __call__(self, x, _):
        gate = self.param("gate", part("embed", None), (D, E))
        wi = self.param("wi", part("exp", "embed", "mlp"), (E, D, F))
        wo = self.param("wo", part("exp", "mlp", "embed"), (E, F, D))
        p = jax.nn.softmax(x @ gate, -1)
        h = jax.nn.gelu(jnp.einsum("btd,edf->btef", x, wi))
        return x + jnp.einsum("bte,btef,efd->btd", p, h, wo), None


class ScannedMoE(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(LinenMoE, variable_axes={"params": 1}, split_rngs={"params": True},
                        length=2, metadata_params={nn.PARTITION_NAME: "layers"})
        return stack(name="layers")(x, None)[0]


LINEN_MOE_TRUTH = {  # after nn.scan on axis 1: (E, layers, ...) and (embed, layers, E)
    "layers.gate": ("dense", (0,), (2,), (1,)),
    "layers.wi": ("dense", (2,), (3,), (0, 1)),
    "layers.wo": ("dense", (2,), (3,), (0, 1)),
}


def test_linen_experts_and_scanned_layers_by_names_per_expert_and_layer():
    with jax.enable_x64(True):
        variables = jax.eval_shape(ScannedMoE().init, jax.random.key(0), jnp.ones((1, 2, D)))
        params = variables["params"]
        assert routes_of(route_params(params)) == LINEN_MOE_TRUTH
        plain = f64(nn.unbox(params))
        grads = random_like(plain, 1)
        check_updates(step(plain, grads, axis_names=params), grads, LINEN_MOE_TRUTH)
        g = {"layers.wi": grads["layers"]["wi"]}
        wrong = step(jax.tree.map(jnp.zeros_like, g), g,
                     route_overrides={"layers.wi": Route("dense", 3, 2, (0, 1))})
        with pytest.raises(AssertionError, match="layers.wi"):
            check_updates(wrong, g, {"layers.wi": LINEN_MOE_TRUTH["layers.wi"]})


class NnxMoE(nnx.Module):
    """A hand-written nnx MoE: expert kernels as nnx.Param with out_sharding names, and a
    stack of expert nnx.Linear made by nnx.vmap (module evidence, no names)."""

    def __init__(self, rngs):
        init = nnx.initializers.normal(0.5)
        self.wi = nnx.Param(init(rngs.params(), (E, D, F)), out_sharding=("exp", "embed", "mlp"))
        self.wo = nnx.Param(init(rngs.params(), (E, F, D)), out_sharding=("exp", "mlp", "embed"))
        self.router = nnx.Linear(D, E, use_bias=False, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0)
        def shared(key):
            return nnx.Linear(D, F, rngs=nnx.Rngs(key))

        self.shared = shared(jax.random.split(rngs.params(), E))

    def __call__(self, x):
        p = jax.nn.softmax(self.router(x), -1)
        h = jnp.einsum("bd,edf->bef", x, self.wi.value)
        return jnp.einsum("be,bef,efd->bd", p, h, self.wo.value)


NNX_MOE_TRUTH = {
    "wi": ("dense", (1,), (2,), (0,)),
    "wo": ("dense", (1,), (2,), (0,)),
    "router.kernel": ("dense", (0,), (1,), ()),
    "shared.kernel": ("dense", (1,), (2,), (0,)),  # nnx.vmap: one Linear per expert
    "shared.bias": ("vector", (), (), (0,)),
}


def test_nnx_experts_train_with_no_override_per_expert():
    with jax.enable_x64(True), nnx.use_eager_sharding(False):
        model = NnxMoE(nnx.Rngs(0))
        assert routes_of(route_params(model)) == NNX_MOE_TRUTH
        # nnx.Optimizer inits on the boxes (their names) and updates on bare arrays
        model = jax.tree.map(lambda x: x.astype(jnp.float64), model)
        opt = nnx.Optimizer(model, sage_optax.make_optimizer("sage-hybrid", 1.0,
                                                             weight_decay=0.0, model=model),
                            wrt=nnx.Param)
        before = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        grads = random_like(nnx.state(model, nnx.Param), 2)
        nnx.jit(lambda opt, model, grads: opt.update(model, grads))(opt, model, grads)
        grads = nnx.to_pure_dict(grads)
        after = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        updates = jax.tree.map(lambda a, b: np.asarray(a) - b, after, before)
        check_updates(updates, grads, NNX_MOE_TRUTH)


def test_nnx_scan_stacks_and_equinox_vmapped_experts_are_batch_axes():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(D, F, rngs=rngs)
            self.norm = nnx.RMSNorm(F, rngs=rngs)

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
        return Layer(rngs)

    got = routes_of(route_params(make(nnx.Rngs(0))))
    assert got == {"up.kernel": ("dense", (1,), (2,), (0,)), "up.bias": ("vector", (), (), (0,)),
                   "norm.scale": ("vector", (), (), (0,))}
    experts = eqx.filter_vmap(lambda k: eqx.nn.Linear(D, F, key=k))(jax.random.split(
        jax.random.key(0), E))
    got = routes_of(route_params(eqx.filter(experts, eqx.is_inexact_array)))
    assert got["weight"] == ("dense", (2,), (1,), (0,))  # (E, out, in): per expert
    with jax.enable_x64(True):
        params = f64(eqx.filter(experts, eqx.is_inexact_array))
        grads = random_like(params, 3)
        check_updates(step(params, grads), grads, {"weight": ("dense", (2,), (1,), (0,))})


def test_docs_list_every_name_of_the_table():
    import pathlib

    doc = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text()
    section = doc[doc.index("### Logical axis names"):doc.index("## The routing table")]
    for name, role in sage_optax.logical.AXIS_ROLES.items():
        row = next(line for line in section.splitlines() if f"`{name}`" in line)
        assert f"| `{role}` |" in row, (name, role)
