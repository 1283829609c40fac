"""make_optimizer: the eight configurations train, route, and hold exactly the state they should."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import D, F, V, mixed_params

import sage_optax
from sage_optim import CONFIG_NAMES, get_preset

# --- a tiny tied language model: embedding -> norm -> MLP (+bias) -> norm -> tied logits -----


def init_model(seed=0):
    rng = np.random.default_rng(seed)
    p = mixed_params(rng, untied=False)
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), p)


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def loss_fn(p, tokens, targets):
    h = p["embed"]["embedding"][tokens]
    layer = p["layers"]["0"]
    x = rms_norm(h, layer["norm"]["scale"])
    x = jax.nn.gelu(x @ layer["mlp"]["up"]["kernel"]) @ layer["mlp"]["down"]["kernel"]
    h = h + x + layer["mlp"]["bias"]
    logits = rms_norm(h, p["final_norm"]["scale"]) @ p["embed"]["embedding"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(64,))
    return jnp.asarray(tokens), jnp.asarray((tokens * 7 + 3) % V)  # a fixed mapping to learn


# Learning rates for this toy problem (not the paper's, which are for LLM pretraining).
TEST_LR = {"adamw": 3e-2, "lion": 3e-3, "apollo": 3e-2, "sinkgd-pure": 5e-2,
           "sinkgd-hybrid": 3e-2, "lion-hybrid": 3e-3, "sage-pure": 1e-2, "sage-hybrid": 1e-2}


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_every_configuration_trains(name):
    params = init_model()
    tokens, targets = batch()
    tx = sage_optax.make_optimizer(name, TEST_LR[name])
    state = tx.init(params)

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, targets)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for _ in range(60):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[-1] < 0.7 * losses[0], (name, losses[0], losses[-1])


# --- exact state bytes, counted by hand from docs/configurations.md -------------------------------

F32 = 4
COUNT = 4  # one int32 step count


def hand_count(rule: str, shapes: list[tuple[str, tuple[int, ...]]]) -> int:
    """State bytes of one rule over its leaves, from the algorithms' definitions."""
    total = 0
    for kind, shape in shapes:
        size = int(np.prod(shape))
        if rule == "adamw":
            total += 2 * size * F32  # m, v
        elif rule == "lion":
            total += size * F32  # m
        elif rule == "sage":
            reduced = shape[0] if kind == "dense" else (shape[1] if len(shape) == 2 else size)
            if kind == "embedding":  # (V, d) table: S is O(d)
                reduced = shape[1]
            total += size * F32 + reduced * F32  # M and S
        elif rule == "apollo":  # rank-1 moments on the larger axis + one limiter norm
            total += 2 * max(shape) * F32 + F32
    counts = {"adamw": COUNT, "lion": COUNT, "sage": COUNT, "apollo": 2 * COUNT}
    return total + (counts.get(rule, 0) if shapes or rule in counts else 0)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_state_bytes_equal_hand_count(name):
    params = init_model()
    shapes = {
        "embedding": [("embedding", (V, D))],
        "dense": [("dense", (D, F)), ("dense", (F, D))],
        "vector": [("vector", (D,))] * 3,
    }
    preset = get_preset(name)
    expected = sum(hand_count(preset.rule(k).name, shapes[k]) for k in shapes)
    state = sage_optax.make_optimizer(name).init(params)
    assert sage_optax.state_bytes(state) == expected
    assert sage_optax.state_bytes(jax.eval_shape(sage_optax.make_optimizer(name).init, params)) \
        == expected
    table = sage_optax.routing_table(name, params)
    assert table.total_bytes == expected


def test_routing_table_rows_and_print():
    params = init_model()
    table = sage_optax.routing_table("sage-hybrid", params)
    emb, up, norm = (table.row(p) for p in
                     ("embed.embedding", "layers.0.mlp.up.kernel", "final_norm.scale"))
    assert (emb.kind, emb.rule, emb.state_bytes) == ("embedding", "sage", (V * D + D) * F32)
    assert (emb.fan_in, emb.fan_out) == (f"1 ({D})", f"0 ({V})")  # (V, d): vocab is fan-out
    assert (up.kind, up.rule, up.state_bytes) == ("dense", "sinkgd(unit, alpha=10)", 0)
    assert (up.fan_in, up.fan_out) == (f"0 ({D})", f"1 ({up.shape[1]})")  # Flax (in, out)
    assert (norm.kind, norm.rule, norm.state_bytes) == ("vector", "sage", 2 * D * F32)
    assert (norm.fan_in, norm.fan_out) == ("-", "-")
    text = str(table)
    assert "embed.embedding" in text and "sinkgd(unit, alpha=10)" in text
    assert text.splitlines()[0].split() == [
        "path", "shape", "kind", "rule", "step", "fan-in", "fan-out", "evidence", "state",
        "bytes"]


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError) as e:
        sage_optax.make_optimizer("sage-hybird")
    for name in CONFIG_NAMES:
        assert name in str(e.value)


def test_overrides():
    params = init_model()
    base = sage_optax.state_bytes(sage_optax.make_optimizer("sage-hybrid").init(params))
    adamw_vectors = sage_optax.make_optimizer("sage-hybrid", vector="adamw").init(params)
    # 3 vectors of D: SAGE keeps M + S (2D floats), AdamW m + v (2D floats) -> same floats
    # but AdamW's vectors are one partition with its own count, as SAGE's was.
    assert sage_optax.state_bytes(adamw_vectors) == base
    lion_emb = sage_optax.make_optimizer("sage-hybrid", embedding="lion").init(params)
    assert sage_optax.state_bytes(lion_emb) == base - D * F32
    with pytest.raises(ValueError, match="dense_b1"):
        sage_optax.make_optimizer("sage-hybrid", dense_b1=0.5)
    with pytest.raises(ValueError, match="nonsense"):
        sage_optax.make_optimizer("sage-hybrid", nonsense=1)


def test_b1_override_reaches_sage_and_authors_variant_differs():
    params = init_model()
    tokens, targets = batch()
    grads = jax.grad(loss_fn)(params, tokens, targets)
    outs = []
    for b1 in (0.9, 0.891):
        tx = sage_optax.make_optimizer("sage-hybrid", b1=b1)
        state = tx.init(params)
        _, state = tx.update(grads, state, params)  # M = 0.01 g
        # sign(b1 * 0.01 g - (1 - b1) * 0.085 g) flips between b1 = 0.9 and 0.891.
        u, state = tx.update(jax.tree.map(lambda g: -0.085 * g, grads), state, params)
        outs.append(np.asarray(u["embed"]["embedding"]))
    assert not np.array_equal(outs[0], outs[1])


def test_sage_hybrid_alias_equals_make_optimizer():
    params = init_model()
    grads = jax.grad(loss_fn)(params, *batch())
    a, b = sage_optax.sage_hybrid(1e-3), sage_optax.make_optimizer("sage-hybrid", 1e-3)
    ua, _ = a.update(grads, a.init(params), params)
    ub, _ = b.update(grads, b.init(params), params)
    for x, y in zip(jax.tree.leaves(ua), jax.tree.leaves(ub), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_default_learning_rates_follow_the_paper():
    assert get_preset("sage-hybrid").learning_rate == 2e-3
    assert get_preset("sage-pure").learning_rate == 2e-3
    assert get_preset("adamw").learning_rate == 1e-4
    assert get_preset("lion").learning_rate == 1e-4
    assert get_preset("apollo").learning_rate == 1e-4
    assert get_preset("sinkgd-hybrid").learning_rate == 2e-2
    assert get_preset("sinkgd-hybrid").dense.hyperparams["alpha"] == 0.05
    assert get_preset("sage-hybrid").dense.hyperparams["alpha"] == 10.0
