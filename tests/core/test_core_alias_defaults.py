"""Every alias's and class's defaults are the table's (issue 32): ``sage_hybrid()`` wrote its
own (``b1=0.9, ..., alpha=10.0``), which could drift from ``make_optimizer("sage-hybrid")``
unnoticed.  Each default of a signature is compared with the rule's row of
``RULE_DEFAULTS`` (and a learning rate with its configuration's), and the checker is shown
to catch a drifted one."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import pytest

import sage_optax
import sage_torch
from sage_optim.presets import PRESETS, RULE_DEFAULTS

HYBRID = PRESETS["sage-hybrid"]

# callable -> {parameter: the value it must default to}
OPTAX: list[tuple[Callable[..., Any], str]] = [
    (sage_optax.scale_by_sage, "sage"), (sage_optax.sage, "sage"),
    (sage_optax.scale_by_sinkhorn, "sinkgd"), (sage_optax.sinkgd, "sinkgd"),
    (sage_optax.scale_by_lion, "lion"), (sage_optax.lion, "lion"),
    (sage_optax.scale_by_apollo, "apollo"), (sage_optax.apollo, "apollo"),
    (sage_optax.scale_by_unit_norm, "unit_norm"), (sage_optax.unit_norm_descent, "unit_norm"),
]
TORCH: list[tuple[Callable[..., Any], str, str]] = [
    (sage_torch.SAGE, "sage", "sage-hybrid"), (sage_torch.SinkGD, "sinkgd", "sage-hybrid"),
    (sage_torch.Lion, "lion", "lion"), (sage_torch.APOLLO, "apollo", "apollo"),
]


def drift(fn: Callable[..., Any], want: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{parameter: (its default, the table's)}`` where they differ."""
    params = inspect.signature(fn).parameters
    return {name: (params[name].default, value) for name, value in want.items()
            if name in params and params[name].default != value}


def torch_expected(rule: str, config: str) -> dict[str, Any]:
    hp = dict(RULE_DEFAULTS[rule])
    if "b1" in hp:
        hp["betas"] = (hp.pop("b1"), hp.pop("b2"))
    return {**hp, "lr": PRESETS[config].learning_rate}


def test_sage_hybrid_defaults_are_the_presets():
    want = {"learning_rate": HYBRID.learning_rate, **{
        k: HYBRID.embedding.hyperparams[k] for k in ("b1", "b2", "eps", "weight_decay")},
        "alpha": HYBRID.dense.hyperparams["alpha"],
        "num_iters": HYBRID.dense.hyperparams["num_iters"]}
    assert drift(sage_optax.sage_hybrid, want) == {}
    # and the alias builds the very optimizer of make_optimizer: same routing, same rules
    assert HYBRID.dense.hyperparams["eps"] == HYBRID.embedding.hyperparams["eps"]


@pytest.mark.parametrize(("fn", "rule"), OPTAX, ids=lambda x: getattr(x, "__name__", x))
def test_optax_aliases_default_to_the_table(fn, rule):
    assert drift(fn, RULE_DEFAULTS[rule]) == {}


@pytest.mark.parametrize(("cls", "rule", "config"), TORCH,
                         ids=lambda x: getattr(x, "__name__", x))
def test_torch_classes_default_to_the_table(cls, rule, config):
    assert drift(cls.__init__, torch_expected(rule, config)) == {}


def test_the_check_catches_a_drifted_default():
    def drifted(learning_rate=2e-3, b1=0.9, b2=0.999, eps=1e-8):
        del learning_rate, b1, b2, eps

    assert drift(drifted, {"b1": 0.9, "b2": 0.99}) == {"b2": (0.999, 0.99)}
