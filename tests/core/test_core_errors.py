"""Bad input gets an error a user can act on, never a silent wrong answer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_optax import Route, RoutingError
from sage_optax import route_params as label_params
from sage_optim import CONFIG_NAMES


def params():
    return {
        "embed": {"embedding": jnp.ones((10, 4))},
        "mlp": {"kernel": jnp.ones((4, 6)), "bias": jnp.zeros(6)},
        "norm": {"scale": jnp.ones(4)},
    }


def test_sinkgd_on_a_vector_names_path_and_shape():
    with pytest.raises(ValueError, match=r"mlp\.bias.*\(6,\)"):
        sage_optax.sinkgd(1e-2).init(params())
    with pytest.raises(ValueError, match=r"'v'.*\(\)"):
        tx = sage_optax.scale_by_sinkhorn()
        tx.update({"v": jnp.ones(())}, optax.EmptyState())


def test_router_cannot_place_integer_leaf():
    p = params() | {"step": jnp.zeros((), jnp.int32)}
    with pytest.raises(RoutingError, match=r"'step'.*int32"):
        label_params(p)
    with pytest.raises(RoutingError, match="step"):
        sage_optax.make_optimizer("sage-hybrid").init(p)


def test_router_cannot_place_vocab_matrix_of_unknown_layout():
    p = {"tok_embed": {"w": jnp.ones((10, 4))}}
    with pytest.raises(RoutingError, match=r"tok_embed\.w.*\(10, 4\).*vocab_size"):
        label_params(p)
    # and the two remedies the message names both work
    assert label_params(p, vocab_size=10).axes["tok_embed"]["w"] == Route("embedding", -1, -2)
    fixed = label_params(p, {"tok_embed.*": Route("embedding", fan_in=-1, fan_out=-2)})
    assert fixed.labels["tok_embed"]["w"] == "embedding"
    assert fixed.axes["tok_embed"]["w"] == Route("embedding", -1, -2)


@pytest.mark.parametrize("make", [
    lambda lr: sage_optax.sage(lr),
    lambda lr: sage_optax.sinkgd(lr),
    lambda lr: sage_optax.apollo(lr),
    lambda lr: sage_optax.make_optimizer("sage-hybrid", lr),
    lambda lr: sage_optax.sage_hybrid(lr),
])
def test_negative_learning_rate(make):
    with pytest.raises(ValueError, match="learning_rate"):
        make(-1e-3)


@pytest.mark.parametrize("bad", [
    {"b1": 1.5}, {"b2": 1.0}, {"eps": -1.0}, {"damper": "sometimes"},
])
def test_bad_sage_hyperparameters_are_named(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        sage_optax.scale_by_sage(**bad)


def test_bad_sinkhorn_options_are_named():
    with pytest.raises(ValueError, match="normalization"):
        sage_optax.sinkgd(1e-2, normalization="l2")
    with pytest.raises(ValueError, match="num_iters"):
        sage_optax.sinkgd(1e-2, num_iters=0)


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_mismatched_trees(name):
    p = params()
    tx = sage_optax.make_optimizer(name)
    state = tx.init(p)
    missing = {k: v for k, v in p.items() if k != "norm"}
    grads = jax.tree.map(jnp.ones_like, missing)
    with pytest.raises(ValueError, match=r"norm\.scale"):
        tx.update(grads, state, p)
    wrong_shape = jax.tree.map(jnp.ones_like, p)
    wrong_shape["mlp"]["kernel"] = jnp.ones((4, 7))
    with pytest.raises(ValueError, match=r"mlp\.kernel.*\(4, 7\)"):
        tx.update(wrong_shape, state, p)


def test_state_from_another_model_is_named():
    tx = sage_optax.scale_by_sage()
    state = tx.init({"a": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match="SAGE momentum state"):
        tx.update({"b": jnp.ones((3, 2))}, state)
    with pytest.raises(ValueError, match=r"'a'.*\(3, 5\)"):
        tx.update({"a": jnp.ones((3, 5))}, state)


def test_bad_axes_are_named():
    with pytest.raises(ValueError, match=r"'k'.*fan_in axis 5"):
        sage_optax.sinkgd(1e-2, axes=Route("dense", 5, -1)).init({"k": jnp.ones((3, 4))})
    with pytest.raises(ValueError, match="axes=0.*leading"):
        sage_optax.sage(1e-2, axes=0).init({"k": jnp.ones((2, 3, 4))})


def test_nonfinite_gradient_without_guard_poisons_params():
    """Documented behaviour: NaN in, NaN out (SAGE's sign and damper both propagate it)."""
    p = params()
    tx = sage_optax.make_optimizer("sage-hybrid")
    state = tx.init(p)
    g = jax.tree.map(jnp.ones_like, p)
    g["embed"]["embedding"] = g["embed"]["embedding"].at[0, 0].set(jnp.nan)
    u, state = tx.update(g, state, p)
    assert np.isnan(np.asarray(u["embed"]["embedding"])).any()


@pytest.mark.parametrize("name", CONFIG_NAMES)
@pytest.mark.parametrize("bad", [jnp.nan, jnp.inf])
def test_skip_nonfinite_keeps_params_and_state(name, bad):
    p = params()
    rng = np.random.default_rng(0)

    def grad():
        return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), p)

    g1, g2 = grad(), grad()
    poisoned = jax.tree.map(jnp.array, g1)
    poisoned["mlp"]["kernel"] = poisoned["mlp"]["kernel"].at[1, 2].set(bad)

    guarded = sage_optax.make_optimizer(name, skip_nonfinite=3)
    update = jax.jit(guarded.update)
    s = guarded.init(p)
    u, s = update(g1, s, p)
    p1 = optax.apply_updates(p, u)
    u, s_bad = update(poisoned, s, p1)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))  # step skipped
    for a, b in zip(jax.tree.leaves(s.inner_state), jax.tree.leaves(s_bad.inner_state),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the run continues exactly as if the bad step never happened
    u_after, _ = update(g2, s_bad, p1)
    u_clean, _ = update(g2, s, p1)
    for a, b in zip(jax.tree.leaves(u_after), jax.tree.leaves(u_clean), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# issue 33: NaN and inf learning rates, and masks of another structure, in every builder
BUILDERS = {
    "sage": lambda lr, **kw: sage_optax.sage(lr, **kw),
    "sinkgd": lambda lr, **kw: sage_optax.sinkgd(lr, **kw),
    "apollo": lambda lr, **kw: sage_optax.apollo(lr, **kw),
    "unit_norm_descent": lambda lr, **kw: sage_optax.unit_norm_descent(lr, **kw),
    "lion": lambda lr, **kw: sage_optax.lion(lr, **kw),
    "sage_hybrid": lambda lr, **kw: sage_optax.sage_hybrid(lr, vocab_size=10, **kw),
    **{f"make_optimizer({c})": (lambda lr, c=c, **kw: sage_optax.make_optimizer(
        c, lr, vocab_size=10, **kw)) for c in CONFIG_NAMES},
}


@pytest.mark.parametrize("name", list(BUILDERS))
@pytest.mark.parametrize(("lr", "shown"), [
    (float("nan"), "learning_rate must be >= 0, got nan"),
    (float("inf"), "learning_rate must be >= 0, got inf"),
    (np.float32("nan"), "learning_rate must be >= 0, got nan"),
    (jnp.asarray(float("inf")), "learning_rate must be >= 0, got inf"),
    (optax.constant_schedule(float("nan")),
     "learning_rate(0), the schedule's first value, must be >= 0, got nan"),
    (optax.cosine_decay_schedule(float("inf"), 10),
     "learning_rate(0), the schedule's first value, must be >= 0, got inf"),
])
def test_a_nonfinite_learning_rate_is_refused_in_every_builder(name, lr, shown):
    with pytest.raises(ValueError) as e:
        BUILDERS[name](lr)
    assert str(e.value) == shown


def test_the_learning_rate_refusal_is_sage_torchs():
    torch = pytest.importorskip("torch")
    import sage_torch

    p = [torch.nn.Parameter(torch.zeros(2, 2))]
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValueError) as theirs:
            sage_torch.SAGE(p, lr=value)
        with pytest.raises(ValueError) as ours:
            sage_optax.sage(value)
        assert str(ours.value).replace("learning_rate", "lr") == str(theirs.value)


def test_a_schedule_read_inside_a_step_still_works():
    """A schedule is read at step 0 only to check it; its values still reach the update."""
    sched = optax.linear_schedule(1e-3, 0.0, 10)
    tx = sage_optax.sage(sched)
    p = params()
    state = tx.init(p)
    updates, _ = tx.update(jax.tree.map(jnp.ones_like, p), state, p)
    assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


@pytest.mark.parametrize("name", list(BUILDERS))
def test_a_mask_of_another_structure_is_refused_naming_it(name):
    p = {"embed": {"embedding": jnp.ones((10, 4))},
         "mlp": {"kernel": jnp.ones((4, 6)), "out": jnp.ones((6, 4))}}
    bad = {"embed": {"embedding": False}, "mlp": {"kernel": True, "bais": False}}
    tx = BUILDERS[name](1e-3, mask=bad)
    with pytest.raises(ValueError) as e:
        state = tx.init(p)
        tx.update(jax.tree.map(jnp.ones_like, p), state, p)
    message = str(e.value)
    assert message.startswith("the weight-decay mask does not have the structure of the "
                              "params"), message
    assert "'mlp.bais'" in message and "\n" not in message, message
    good = {"embed": False, "mlp": {"kernel": True, "out": False}}  # a prefix is fine
    tx = BUILDERS[name](1e-3, mask=good)
    state = tx.init(p)
    tx.update(jax.tree.map(jnp.ones_like, p), state, p)
