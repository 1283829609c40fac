"""sage_torch: the effective step per kind in the routing table, ``<kind>_learning_rate=``,
and the notice for an AdamW-style rate (issue 45), as in sage_optax."""

from __future__ import annotations

import warnings

import pytest
import torch

import sage_torch
from sage_optim import rates


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 24))


def test_the_table_shows_each_kinds_effective_step():
    steps = {r.kind: r.step for r in sage_torch.routing_table("sinkgd-hybrid", model()).rows}
    assert steps == {"dense": "0.001 (0.02 x 0.05)", "embedding": "0.02", "vector": "0.02"}
    table = sage_torch.routing_table("sinkgd-hybrid", model(), lr=1.6e-3)
    assert table.row("1.weight").step == "8e-05 (0.0016 x 0.05)"


def test_a_kinds_rate_is_one_keyword():
    opt = sage_torch.make_optimizer("sinkgd-hybrid", model(), 1.6e-3, dense_learning_rate=2e-2)
    assert {g["kind"]: g["lr"] for g in opt.param_groups} == {
        "embedding": 1.6e-3, "dense": 2e-2, "vector": 1.6e-3}


def test_an_adamw_style_rate_gets_a_notice_naming_the_presets_rate():
    rates._NOTED.clear()
    with pytest.warns(rates.LearningRateNotice, match=r"preset's rate 0\.02") as seen:
        sage_torch.make_optimizer("sinkgd-hybrid", model(), 1.6e-3)
    assert seen[0].filename == __file__  # points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sage_torch.make_optimizer("sinkgd-hybrid", model(), 1.6e-3)  # once
        sage_torch.make_optimizer("sinkgd-hybrid", model())
