"""Settings parsed once into typed values (issue 44, item 2).

``make_optimizer``'s keywords (``weight_decay=0.1, vector_weight_decay=0.0``) are read once,
by :func:`sage_optim.settings.parse_settings`, into frozen per-kind settings whose
hyperparameters are typed fields; each rule's builder reads them by name.  Checked here:

* the typed classes are the one table: ``RULE_DEFAULTS`` is read from them, and a parsed
  value lands in the named field of the kind it was given for (the precedence of
  ``tests/core/test_core_option_precedence.py``, read off the structure instead of the
  updates);
* the parsed structure is frozen (no later stage can change a value);
* ``weight_decay`` from :func:`sage_optax.sage_hybrid` reaches ``optax.add_decayed_weights``
  through named arguments only: the alias builds its settings from its arguments (no
  ``make_optimizer(**strings)``), and no rule builder unpacks a dict of hyperparameters
  (``**hp``), so a static tool can follow the path;
* the PyTorch param groups and both routing tables read the same structure.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import jax.numpy as jnp
import pytest
import torch

import sage_optax
import sage_torch
from sage_optax import registry as optax_registry
from sage_optim import hyperparams
from sage_optim.presets import CONFIG_NAMES, KINDS, RULE_DEFAULTS, get_preset
from sage_optim.settings import KindSettings, Settings, parse_settings


def test_the_rule_table_is_read_from_the_typed_classes():
    assert set(hyperparams.RULE_HYPERPARAMS) == set(RULE_DEFAULTS)
    for name, cls in hyperparams.RULE_HYPERPARAMS.items():
        assert cls.rule == name
        assert dict(RULE_DEFAULTS[name]) == {f.name: f.default for f in dataclasses.fields(cls)}
        assert list(RULE_DEFAULTS[name]) == [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_each_kind_gets_its_rules_class_and_the_presets_values(name):
    settings = parse_settings(name, None, {})
    preset = get_preset(name)
    assert settings.learning_rate == preset.learning_rate
    for kind in KINDS:
        k = settings.kind(kind)
        assert isinstance(k, KindSettings) and k.kind == kind
        assert type(k.hp) is hyperparams.RULE_HYPERPARAMS[preset.rule(kind).name]
        assert dict(k.hp) == preset.rule(kind).hyperparams
        assert k.learning_rate is None


def test_a_kinds_own_value_lands_in_its_named_field():
    overrides = {"weight_decay": 0.1, "vector_weight_decay": 0.0, "b1": 0.95,
                 "embedding_b1": 0.8, "dense_alpha": 5.0, "dense_learning_rate": 0.5,
                 "route_overrides": {}}
    settings = parse_settings("sage-hybrid", 1e-3, overrides, ("route_overrides",))
    assert overrides == {"route_overrides": {}}  # every hyperparameter consumed, once
    emb, dense, vec = settings.embedding.hp, settings.dense.hp, settings.vector.hp
    assert isinstance(emb, hyperparams.SageHyperparams)
    assert isinstance(dense, hyperparams.SinkGDHyperparams)
    assert isinstance(vec, hyperparams.SageHyperparams)
    assert (emb.weight_decay, dense.weight_decay, vec.weight_decay) == (0.1, 0.1, 0.0)
    assert (emb.b1, vec.b1) == (0.8, 0.95)
    assert (dense.alpha, dense.normalization) == (5.0, "unit")
    assert settings.learning_rate == 1e-3
    assert settings.own_rates == {"dense": 0.5}
    assert [k.rate(settings.learning_rate) for k in settings.kinds] == [1e-3, 0.5, 1e-3]


def test_a_rule_swap_gets_the_swapped_rules_class():
    settings = parse_settings("sage-hybrid", None, {"vector": "adamw", "weight_decay": 0.0})
    assert settings.vector.name == "adamw"
    assert settings.vector.hp == hyperparams.AdamWHyperparams(weight_decay=0.0)


def test_the_settings_are_frozen():
    settings = parse_settings("sage-hybrid", None, {})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.dense = settings.vector  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.dense.hp.weight_decay = 0.0  # type: ignore[misc]


def test_an_unknown_option_is_still_one_line_naming_it():
    with pytest.raises(ValueError, match=r"^vector_alpha: the vector rule of 'sage-hybrid' is "
                                         r"'sage', which has no hyperparameter 'alpha'") as e:
        parse_settings("sage-hybrid", None, {"vector_alpha": 1.0})
    assert "\n" not in str(e.value)


def _calls(func) -> list[ast.Call]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _name(call: ast.Call) -> str:
    return ast.unparse(call.func)


def test_sage_hybrids_weight_decay_is_a_named_argument_all_the_way():
    """The walk of issue 44: alias -> typed settings -> builder -> the rule's alias."""
    # the alias passes weight_decay by name into each kind's typed hyperparameters ...
    calls = _calls(sage_optax.sage_hybrid)
    assert "make_optimizer" not in {_name(c) for c in calls}  # no detour through strings
    typed = {_name(c): c for c in calls if _name(c).endswith("Hyperparams")}
    assert {"SageHyperparams", "SinkGDHyperparams", "AdamWHyperparams"} <= set(typed)
    for call in typed.values():
        assert "weight_decay" in {k.arg for k in call.keywords}, ast.unparse(call)
    # ... and every builder reads it by name and passes it on by name, no **hp
    for name in RULE_DEFAULTS:
        build = optax_registry.builder(name)
        calls = _calls(build)
        assert not [k for c in calls for k in c.keywords if k.arg is None], name  # no **hp
        wd = [k for c in calls for k in c.keywords if k.arg == "weight_decay"]
        assert [ast.unparse(k.value) for k in wd] == ["hp.weight_decay"], name


def test_the_alias_builds_what_make_optimizer_builds():
    params = {"embed": {"embedding": jnp.linspace(-1, 1, 64).reshape(16, 4)},
              "mlp": {"kernel": jnp.linspace(-2, 1, 32).reshape(4, 8),
                      "bias": jnp.linspace(0, 1, 8)}}
    grads = {"embed": {"embedding": jnp.cos(params["embed"]["embedding"])},
             "mlp": {"kernel": jnp.sin(params["mlp"]["kernel"]),
                     "bias": jnp.cos(params["mlp"]["bias"] * 3)}}
    for vector in ("sage", "adamw"):
        alias = sage_optax.sage_hybrid(1e-2, weight_decay=0.3, alpha=4.0, num_iters=3,
                                       vector_rule=vector)
        named = sage_optax.make_optimizer("sage-hybrid", 1e-2, weight_decay=0.3,
                                          dense_alpha=4.0, dense_num_iters=3, vector=vector)
        for a, b in zip(_steps(alias, params, grads), _steps(named, params, grads),
                        strict=True):
            assert jnp.array_equal(a, b)


def _steps(tx, params, grads):
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    updates, _ = tx.update(grads, state, params)
    return [updates["embed"]["embedding"], updates["mlp"]["kernel"], updates["mlp"]["bias"]]


@pytest.mark.filterwarnings("ignore::sage_optim.rates.LearningRateNotice")
def test_torch_groups_and_both_tables_read_the_parsed_settings():
    settings = parse_settings("sinkgd-hybrid", 1e-3, {"vector_weight_decay": 0.0,
                                                      "dense_alpha": 2.0})
    assert isinstance(settings, Settings)
    model = torch.nn.Sequential(torch.nn.Embedding(16, 4), torch.nn.Linear(4, 8))
    opt = sage_torch.make_optimizer("sinkgd-hybrid", model, 1e-3, vector_weight_decay=0.0,
                                    dense_alpha=2.0)
    for group in opt.param_groups:
        k = settings.kind(group["kind"])
        hp = dict(k.hp)
        if "b1" in hp:
            hp["betas"] = (hp.pop("b1"), hp.pop("b2"))
        hp.pop("projection", None)
        assert {key: group[key] for key in hp} == hp
        assert group["rule"] == k.name and group["lr"] == k.rate(settings.learning_rate)
        assert opt.kinds[group["kind"]]["weight_decay"] == k.hp.weight_decay
    torch_rows = sage_torch.routing_table("sinkgd-hybrid", model, lr=1e-3,
                                          vector_weight_decay=0.0, dense_alpha=2.0).rows
    params = {"embed": {"embedding": jnp.ones((16, 4))}, "mlp": {"kernel": jnp.ones((4, 8))}}
    optax_rows = sage_optax.routing_table("sinkgd-hybrid", params, learning_rate=1e-3,
                                          vector_weight_decay=0.0, dense_alpha=2.0).rows
    for row in (*torch_rows, *optax_rows):
        assert row.rule == settings.kind(row.kind).describe()
    assert {r.kind: r.step for r in optax_rows}["dense"] == "0.002 (0.001 x 2)"
