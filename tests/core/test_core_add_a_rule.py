"""A new update rule needs no edit outside its own modules and the tables (issue 32).

``CONTRIBUTING.md`` ("Adding an update rule") lists the steps: a row of
``sage_optim.presets.RULE_DEFAULTS``, the ranges of any new hyperparameter, the rule's module in
each framework (which registers it) and its float64 oracle.  Here a toy rule, a
sign-momentum step with ``b1``/``b2`` and decoupled decay, is added by the test alone (the table
row, an Optax builder, a PyTorch ``UpdateRule``) and runs through both frameworks'
``make_optimizer`` (the router sends the dense matrices to it), ``routing_table`` and the
PyTorch schedulers' ``betas`` (read from the rule's defaults, not from a list of names),
matching a NumPy float64 transcription in both frameworks."""

from __future__ import annotations

import inspect
import types

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import sage_optax
import sage_torch
from sage_optax import registry as optax_registry
from sage_optim import presets
from sage_torch import registry as torch_registry
from sage_torch.common import UpdateRule, lr_of

TOY = types.MappingProxyType({"b1": 0.8, "b2": 0.95, "weight_decay": 0.1})
V, D, H = 11, 4, 6


def toy_reference(theta: np.ndarray, grads: list[np.ndarray], lr: float) -> np.ndarray:
    """The toy rule in float64: ``θ ← θ − η·(sign(b1·m + (1−b1)·g) + w·θ)``, ``m`` an EMA."""
    b1, b2, wd = TOY["b1"], TOY["b2"], TOY["weight_decay"]
    m = np.zeros_like(theta)
    for g in grads:
        u = np.sign(b1 * m + (1 - b1) * g)
        m = b2 * m + (1 - b2) * g
        theta = theta - lr * (u + wd * theta)
    return theta


def build_toy(learning_rate, hp, context):
    """The toy rule's Optax builder (what its sage_optax module would register)."""
    return optax.lion(learning_rate, hp["b1"], hp["b2"], weight_decay=hp["weight_decay"],
                      mask=context.mask)


class ToyRule(UpdateRule):
    """The toy rule's PyTorch behaviour (what its sage_torch module would register)."""

    name = "toy"
    layout_free = True

    def init_state(self, p, group, name, index=0):
        return {"m": torch.zeros_like(p)}

    def step(self, params, grads, states, names, group, foreach, fused=False):
        (b1, b2), lr, wd = group["betas"], lr_of(group), group["weight_decay"]
        for p, g, st in zip(params, grads, states, strict=True):
            m = st["m"]
            u = (m * b1 + g * (1 - b1)).sign()
            m.mul_(b2).add_(g, alpha=1 - b2)
            p.sub_((u + p * wd) * lr)


@pytest.fixture
def toy_rule(monkeypatch):
    """The toy rule in the table and both registries, for this test only."""
    monkeypatch.setitem(presets._RULE_TABLE, "toy", TOY)
    monkeypatch.setitem(optax_registry._BUILDERS, "toy", build_toy)
    monkeypatch.setitem(torch_registry._RULES, "toy", ToyRule)


def grads_of(steps: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"tok": rng.standard_normal((V, D)), "up": rng.standard_normal((D, H)),
             "norm": rng.standard_normal(D)} for _ in range(steps)]


def test_a_rule_added_by_its_modules_alone_runs_in_both_frameworks(toy_rule):
    rng = np.random.default_rng(1)
    theta = {"tok": rng.standard_normal((V, D)), "up": rng.standard_normal((D, H)),
             "norm": rng.standard_normal(D)}
    grads, lr = grads_of(3), 1e-2
    want = toy_reference(theta["up"], [g["up"] for g in grads], lr)

    # sage_optax: the router sends the dense (D, H) kernel to the toy rule
    params = {"tok": {"embedding": jnp.asarray(theta["tok"])},
              "up": {"kernel": jnp.asarray(theta["up"])},
              "norm": {"scale": jnp.asarray(theta["norm"])}}
    tx = sage_optax.make_optimizer("sage-hybrid", lr, dense="toy")
    state = tx.init(params)
    for g in grads:
        gt = {"tok": {"embedding": jnp.asarray(g["tok"])}, "up": {"kernel": jnp.asarray(g["up"])},
              "norm": {"scale": jnp.asarray(g["norm"])}}
        updates, state = tx.update(gt, state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(params["up"]["kernel"]), want, rtol=1e-5, atol=1e-6)
    table = sage_optax.routing_table("sage-hybrid", params, dense="toy")
    assert {r.path: r.rule for r in table.rows}["up.kernel"] == "toy"

    # sage_torch: an nn.Linear(D, H) weight is the (H, D) transpose
    model = torch.nn.ModuleDict({"tok": torch.nn.Embedding(V, D),
                                 "up": torch.nn.Linear(D, H, bias=False)}).double()
    with torch.no_grad():
        model["tok"].weight.copy_(torch.from_numpy(theta["tok"]))
        model["up"].weight.copy_(torch.from_numpy(theta["up"].T))
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr, dense="toy")
    (group,) = [g for g in opt.param_groups if g["rule"] == "toy"]
    assert group["betas"] == (TOY["b1"], TOY["b2"])  # from the rule's defaults
    for g in grads:
        model["tok"].weight.grad = torch.from_numpy(g["tok"])
        model["up"].weight.grad = torch.from_numpy(g["up"].T.copy())
        opt.step()
    np.testing.assert_allclose(model["up"].weight.detach().numpy().T, want, rtol=0, atol=1e-12)
    torch_table = sage_torch.routing_table("sage-hybrid", model, dense="toy")
    assert {r.path: r.rule for r in torch_table.rows}["up.weight"] == "toy"
    # a scheduler cycles the toy rule's momentum like any rule with betas
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=10)


def test_a_rule_with_no_module_is_named_in_one_line(monkeypatch):
    """A row of the table without an implementation: the error says where to put it."""
    monkeypatch.setitem(presets._RULE_TABLE, "ghost", TOY)
    with pytest.raises(ValueError, match=r"rule 'ghost' has no sage_optax implementation: "
                                         r"its module \(sage_optax/ghost.py\)"):
        sage_optax.make_optimizer("sage-hybrid", dense="ghost")


def test_no_rule_is_known_by_name_outside_its_modules():
    """make_optimizer's build step and the torch base read the registries, not if-chains."""
    import sage_optax.configs as configs
    import sage_torch.optimizer as base

    for source in (inspect.getsource(configs.build_rule),
                   inspect.getsource(base.RuleOptimizer.add_param_group)):
        for rule in presets.RULE_DEFAULTS:
            assert f'"{rule}"' not in source, rule
    assert set(optax_registry.rule_builders()) == set(presets.RULE_DEFAULTS)
    assert set(torch_registry.rule_classes()) == set(presets.RULE_DEFAULTS)
