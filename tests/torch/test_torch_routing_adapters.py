"""The torch router's adapters, each alone (issue 44): ``sage_torch/adapters/<library>.py``
adds the evidence of one library's module types, and is loaded once that library is
imported.  The truths here are the libraries' forward code (``Conv1D``: ``x @ W``, W
``(in, out)``; peft's ``ParamWrapper``: ``A.reshape(E, r, in)``, ``B.reshape(out, r, E)``)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn

import sage_torch
from sage_torch import Route, routing


def test_adapters_load_only_with_their_library():
    code = ("import sys, torch, sage_torch\n"
            "sage_torch.route_params(torch.nn.Linear(3, 4))\n"
            "print(sorted(m for m in sys.modules if m.startswith('sage_torch.adapters.')))\n"
            "import peft\n"
            "sage_torch.route_params(torch.nn.Linear(3, 4))\n"
            "print(sorted(m for m in sys.modules if m.startswith('sage_torch.adapters.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert "'sage_torch.adapters.peft'" in out[1]  # peft imports transformers: both load


def test_transformers_adapter_reads_conv1d_as_x_at_w():
    from transformers.pytorch_utils import Conv1D

    from sage_torch.adapters import transformers as adapter

    conv = Conv1D(6, 4)  # nf=6 outputs, nx=4 inputs: weight (4, 6), forward x @ W
    x = torch.randn(2, 4)
    assert torch.allclose(conv(x), x @ conv.weight + conv.bias)
    route = adapter.module_route(conv, "weight", conv.weight)
    assert route == Route("dense", fan_in=0, fan_out=1, evidence="module Conv1D")
    assert adapter.module_route(conv, "bias", conv.bias) is None
    linear = nn.Linear(4, 6)
    assert adapter.module_route(linear, "weight", linear.weight) is None  # torch.nn's own
    assert adapter.refuse("w", linear.weight, linear, "weight", None) is None


def test_peft_adapter_factor_routes_follow_peft_reshape():
    from sage_torch.adapters import peft as adapter

    experts, r, fan_in, fan_out = 3, 2, 5, 7
    a = torch.randn(experts * r, fan_in)
    b = torch.randn(fan_out, r * experts)
    ra = adapter.factor_route("lora_A", a, experts, "X.w").resolve(a.shape)
    rb = adapter.factor_route("lora_B", b, experts, "X.w").resolve(b.shape)
    # peft: delta[e] = B.reshape(out, r, E)[:, :, e] @ A.reshape(E, r, in)[e]
    a_e = a.reshape(experts, r, fan_in)[1]
    b_e = b.reshape(fan_out, r, experts)[:, :, 1]
    assert (b_e @ a_e).shape == (fan_out, fan_in)
    assert ra.view == (experts, r, fan_in) and ra.batch == (0,)
    assert (ra.fan_in, ra.fan_out) == ((2,), (1,))  # A[e] (r, in): F.linear
    assert rb.view == (fan_out, r, experts) and rb.batch == (2,)
    assert (rb.fan_in, rb.fan_out) == ((1,), (0,))  # B[:, :, e] (out, r): F.linear
    assert adapter.factor_route("lora_A", torch.randn(5, 4), 3, "X.w") is None  # 5 rows: no
    assert adapter.child_route(nn.Linear(2, 2), "lora_embedding_A", torch.randn(2, 2)) is None
    assert adapter.model_routes(nn.Linear(2, 2), {}) == {}


class MyAttention(nn.Module):
    """A module no adapter knows: ``w`` (d, heads, d_head) read as einsum('bd,dhk->bhk')."""

    def __init__(self, d=8, heads=2, d_head=4):
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, heads, d_head))

    def forward(self, x):
        return torch.einsum("bd,dhk->bhk", x, self.w)


def test_a_registered_adapter_places_a_module_no_library_knows():
    with pytest.raises(sage_torch.RoutingError):
        sage_torch.route_params(MyAttention())

    def route(module, attr, param):
        if isinstance(module, MyAttention) and attr == "w":
            return Route("dense", fan_in=0, fan_out=(1, 2), evidence="module MyAttention")
        return None

    routing.register_adapter(routing.Adapter("my_attention_test", route=route))
    try:
        (placed,) = sage_torch.route_params(MyAttention())
        assert (placed.route.fan_in, placed.route.fan_out) == ((0,), (1, 2))
        assert placed.route.evidence == "module MyAttention"
    finally:
        routing._ADAPTERS.pop("my_attention_test")
    with pytest.raises(TypeError, match="register_adapter takes an Adapter"):
        routing.register_adapter(route)
