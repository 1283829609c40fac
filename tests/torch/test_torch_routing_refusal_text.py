"""sage_torch's routing refusal (issue 45): the fix first, one glob per layer role.

A GPT-2's ``named_parameters()`` without the model: its ``Conv1D`` matrices cannot be told
from ``nn.Linear`` ones by name.  The first line says to pass the model (at most 200
characters); the paste block has one entry per layer role, whatever the layer count, and
routes as the model's modules do.
"""

from __future__ import annotations

import pytest
from routing_checks import paste_block

import sage_torch
from sage_optim.routing import HEADLINE_LIMIT

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

ROLES = ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")


def gpt2(layers):
    import torch

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_embd=16, n_layer=layers, n_head=2,
                                     n_positions=32, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def routes(params, overrides=None):
    return {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
            for r in sage_torch.route_params(params, overrides)}


def test_named_parameters_without_the_model_lead_with_the_fix():
    model = gpt2(6)
    with pytest.raises(sage_torch.RoutingError) as info:
        sage_torch.make_optimizer("sage-hybrid", model.named_parameters())
    first = str(info.value).splitlines()[0]
    assert len(first) <= HEADLINE_LIMIT, (len(first), first)
    assert first.startswith("Fix: pass the model itself, make_optimizer(name, model)")
    block = paste_block(info.value)
    assert block == info.value.overrides
    assert sorted(block) == sorted(f"transformer.h.*.{role}.weight" for role in ROLES)
    by_module = routes(model)
    got = routes(model.named_parameters(), block)
    assert {n: r for n, r in got.items() if n in by_module} == by_module
    # the same block fits the 2-layer model
    small = gpt2(2)
    assert {n: r for n, r in routes(small.named_parameters(), block).items()
            if n in routes(small)} == routes(small)
