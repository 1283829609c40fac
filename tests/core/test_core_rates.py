"""Swapping from AdamW without traps (issue 45): each kind's effective step, a per-kind rate
as one keyword, and a one-time notice for a rate far from the configuration's.

The trap: ``sinkgd-hybrid`` multiplies its dense matrices' step by ``alpha = 0.05``, so a
program's AdamW-style 1.6e-3 gives them 8e-5 where the preset's 2e-2 gives 1e-3.
"""

from __future__ import annotations

import math
import warnings

import pytest

from sage_optim import rates
from sage_optim.presets import PRESETS, RuleSpec, get_preset


def test_step_scale_is_the_rules_own_factor():
    assert rates.step_scale(get_preset("sinkgd-hybrid").dense) == 0.05
    assert rates.step_scale(get_preset("sage-hybrid").dense) == 10.0
    assert rates.step_scale(get_preset("apollo").dense) == pytest.approx(math.sqrt(128))
    assert rates.step_scale(RuleSpec("adamw")) == 1.0


def test_describe_step_multiplies_the_rate_by_the_scale():
    assert rates.describe_step(get_preset("sinkgd-hybrid").dense, 1.6e-3) == \
        "8e-05 (0.0016 x 0.05)"
    assert rates.describe_step(RuleSpec("sage"), 2e-3) == "0.002"
    assert rates.describe_step(RuleSpec("sinkgd"), lambda step: 1e-3) == "schedule x 10"


def test_every_preset_rate_is_within_its_own_range():
    for name, preset in PRESETS.items():
        lrs = dict.fromkeys(("embedding", "dense", "vector"), preset.learning_rate)
        assert rates.far_rate_message(name, preset, lrs) is None, name


def test_an_adamw_style_rate_is_noted_with_the_presets_rate():
    preset = get_preset("sinkgd-hybrid")
    message = rates.far_rate_message("sinkgd-hybrid", preset, dict.fromkeys(
        ("embedding", "dense", "vector"), 1.6e-3))
    assert message is not None
    assert "preset's rate 0.02" in message and "dense_learning_rate=0.02" in message
    assert "8e-05 (0.0016 x 0.05), 12.5x below the preset's 0.001" in message
    # within a factor 10 of the preset's own step: nothing to say
    assert rates.far_rate_message("sinkgd-hybrid", preset, dict.fromkeys(
        ("embedding", "dense", "vector"), 4e-3)) is None


def test_the_notice_is_given_once():
    preset = get_preset("lion-hybrid")
    lrs = dict.fromkeys(("embedding", "dense", "vector"), 0.123)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rates.notice_far_rates("lion-hybrid", preset, lrs)
        rates.notice_far_rates("lion-hybrid", preset, lrs)
        rates.notice_far_rates("lion-hybrid", preset, lrs, per_kind=True)
    assert [w.category for w in seen] == [rates.LearningRateNotice]


def test_pop_kind_learning_rates_consumes_only_its_keys():
    overrides = {"dense_learning_rate": 0.02, "dense_alpha": 5.0, "b1": 0.9}
    assert rates.pop_kind_learning_rates(overrides) == {"dense": 0.02}
    assert overrides == {"dense_alpha": 5.0, "b1": 0.9}
