"""Defaults are written once (sage_optim.presets) and every public signature agrees with them:
the Optax transforms and aliases, the torch.optim classes, and the shared validation table."""

from __future__ import annotations

import inspect
import math

import pytest

import sage_optax
from sage_optim import hyperparams
from sage_optim.presets import PRESETS, RULE_DEFAULTS

torch = pytest.importorskip("torch")
import sage_torch  # noqa: E402

OPTAX = {  # rule -> the functions whose keyword defaults must be the rule's
    "sage": (sage_optax.scale_by_sage, sage_optax.sage),
    "sinkgd": (sage_optax.scale_by_sinkhorn, sage_optax.sinkgd),
    "apollo": (sage_optax.scale_by_apollo, sage_optax.apollo),
    "unit_norm": (sage_optax.scale_by_unit_norm, sage_optax.unit_norm_descent),
}
TORCH = {"sage": sage_torch.SAGE, "sinkgd": sage_torch.SinkGD, "lion": sage_torch.Lion,
         "apollo": sage_torch.APOLLO}


def defaults(fn) -> dict:
    return {name: p.default for name, p in inspect.signature(fn).parameters.items()
            if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("rule", sorted(OPTAX))
def test_optax_signatures_default_to_the_table(rule):
    table = RULE_DEFAULTS[rule]
    for fn in OPTAX[rule]:
        found = defaults(fn)
        shared = set(found) & set(table)
        assert shared, f"{fn.__name__} shares no hyperparameter with the table"
        for name in shared:
            assert found[name] == table[name], f"{fn.__name__}({name}=) != table"


@pytest.mark.parametrize("rule", sorted(TORCH))
def test_torch_classes_default_to_the_table(rule):
    table = RULE_DEFAULTS[rule]
    found = defaults(TORCH[rule].__init__)
    if "betas" in found:
        found["b1"], found["b2"] = found.pop("betas")
    for name in set(found) & set(table):
        assert found[name] == table[name], f"{TORCH[rule].__name__}({name}=) != table"
    assert {"b1", "b2"} & set(table) <= set(found), "betas missing"


@pytest.mark.parametrize("rule", sorted(OPTAX))
def test_optax_and_torch_defaults_are_equal(rule):
    if rule not in TORCH:
        pytest.skip(f"{rule} has no torch.optim class (it runs inside RuleOptimizer)")
    jax_side = defaults(OPTAX[rule][1])
    torch_side = defaults(TORCH[rule].__init__)
    if "betas" in torch_side:
        torch_side["b1"], torch_side["b2"] = torch_side.pop("betas")
    # group_bytes is an execution limit, not math (the result does not depend on it), and
    # differs on purpose: sage_torch's foreach default scales with the model
    # (SinkGDRule.group_bytes; its fused default is sage_optax's, tested in test_torch_fused).
    for name in set(jax_side) & set(torch_side) - {"learning_rate", "lr", "group_bytes"}:
        assert jax_side[name] == torch_side[name], name


def test_learning_rates_come_from_the_presets():
    assert defaults(sage_torch.SAGE.__init__)["lr"] == PRESETS["sage-hybrid"].learning_rate
    assert defaults(sage_optax.sage_hybrid)["learning_rate"] == \
        PRESETS["sage-hybrid"].learning_rate


@pytest.mark.parametrize("rule", sorted(RULE_DEFAULTS))
def test_every_default_passes_the_shared_validation(rule):
    for name, value in RULE_DEFAULTS[rule].items():
        assert hyperparams.problem(name, value, rule) is None, (rule, name, value)


@pytest.mark.parametrize(("name", "bad"), [
    ("b2", 1.0), ("b1", -0.1), ("eps", -1e-8), ("num_iters", 0), ("num_iters", 2.5),
    ("rank", True), ("scale", 0.0), ("limiter_gamma", 0.5), ("damper", "max"),
    ("normalization", "l1"), ("weight_decay", -math.inf),
])
def test_both_frameworks_refuse_with_one_message(name, bad):
    message = hyperparams.problem(name, bad)
    assert message is not None and message.startswith(name)
    rule = next(r for r in ("sage", "sinkgd", "apollo") if name in RULE_DEFAULTS[r])
    alias = {"sage": sage_optax.sage, "sinkgd": sage_optax.sinkgd, "apollo": sage_optax.apollo}
    with pytest.raises(ValueError) as jax_error:
        alias[rule](1e-3, **{name: bad})
    assert str(jax_error.value) == message
    # PyTorch: the same message, naming the parameter as torch spells it (betas=(b1, b2))
    param = [torch.nn.Parameter(torch.zeros(3, 4))]
    kwargs, label = {name: bad}, None
    if name in ("b1", "b2"):
        betas = [RULE_DEFAULTS[rule]["b1"], RULE_DEFAULTS[rule]["b2"]]
        betas[name == "b2"] = bad
        kwargs, label = {"betas": tuple(betas)}, f"betas[{int(name == 'b2')}] ({name})"
    with pytest.raises(ValueError) as torch_error:
        TORCH[rule](param, **kwargs)
    assert str(torch_error.value) == hyperparams.problem(name, bad, rule, label)
