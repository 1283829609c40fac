"""Grouped fan axes in sage_torch's rules: a multi-axis matrix is one matrix.

A ``Conv2d`` weight ``(out, in, kh, kw)`` routed ``fan_in=(1, 2, 3), fan_out=0`` must get
exactly the update of its ``(Cout, Cin·kh·kw)`` matrix, computed here independently (the
float64 NumPy oracle on an explicit reshape, and torch on a reshaped copy); GPT-2's
``Conv1D`` ``(in, out)`` routed ``fan_in=0, fan_out=1`` must train exactly like an
``nn.Linear`` holding the transposed weight, under every configuration.  Float64, tolerances
of 1e-12 or bit equality.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_np import ApolloRef, SageRef, SinkGDRef
from torch import nn

import sage_torch
from sage_optim import CONFIG_NAMES
from sage_torch import APOLLO, SAGE, SinkGD, sinkhorn_normalize

TOL = 1e-12

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def grads(shape, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for t in range(steps):
        g = torch.randn(shape, generator=gen, dtype=torch.float64)
        g = g * torch.logspace(-3, 3, shape[-1], dtype=torch.float64)  # 6 decades of scales
        if t == 1:
            g.view(shape[0], -1)[:, 0] = 0.0  # an exactly-zero fan-in column
        out.append(g)
    return out


def param(shape, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(shape, generator=gen, dtype=torch.float64) * 0.5)


def run(opt, p, gs, lrs):
    for g, lr in zip(gs, lrs, strict=True):
        for group in opt.param_groups:
            group["lr"] = lr
        p.grad = g.clone()
        opt.step()


LRS = [1e-2, 2e-2, 1.5e-2, 5e-3]
CONV = (6, 4, 3, 3)  # Conv2d(4, 6, 3).weight: a 6 x 36 matrix


def _force_fast_path(monkeypatch, on: bool) -> None:
    from sage_torch import chunked

    monkeypatch.setattr(chunked, "FAST_MIN_NUMEL", 1 if on else 1 << 62)
    monkeypatch.setattr(chunked, "CHUNK_NUMEL", 40)


@pytest.mark.parametrize("fast", [False, True], ids=["whole", "in-place"])
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_sinkgd_on_conv2d_is_sinkgd_on_the_merged_matrix(normalization, fast, monkeypatch):
    _force_fast_path(monkeypatch, fast)
    alpha = 10.0 if normalization == "unit" else 0.05
    p = param(CONV)
    flat = nn.Parameter(p.detach().clone().reshape(6, 36))
    conv_opt = SinkGD([p], alpha=alpha, normalization=normalization, weight_decay=0.1,
                      fan_in_dim=(1, 2, 3), fan_out_dim=0)
    flat_opt = SinkGD([flat], alpha=alpha, normalization=normalization, weight_decay=0.1)
    ref = SinkGDRef(alpha=alpha, normalization=normalization, weight_decay=0.1,
                    fan_in_axis=1, fan_out_axis=0)
    theta = p.detach().numpy().reshape(6, 36).copy()
    gs = grads(CONV, len(LRS))
    run(conv_opt, p, gs, LRS)
    run(flat_opt, flat, [g.reshape(6, 36) for g in gs], LRS)
    for g, lr in zip(gs, LRS, strict=True):
        theta = ref.step(theta, g.numpy().reshape(6, 36), lr)
    np.testing.assert_allclose(p.detach().numpy().reshape(6, 36), theta, rtol=0, atol=TOL)
    assert torch.equal(p.detach().reshape(6, 36), flat.detach())  # the same code on the view


def test_sinkgd_normalises_taps_and_channels_together():
    """Not 9 separate (out, in) matrices over the taps: one 6 x 36 matrix.

    At the fixed point every fan-in column (one per (in, kh, kw)) has norm 1 and every
    output row the same norm, sqrt(36/6).
    """
    g = grads(CONV, 1)[0]
    x = sinkhorn_normalize(g, (1, 2, 3), 0, num_iters=30).reshape(6, 36)
    assert torch.allclose(x.norm(dim=0), torch.ones(36, dtype=torch.float64), atol=1e-6)
    assert torch.allclose(x.norm(dim=1), torch.full((6,), 6.0**0.5, dtype=torch.float64),
                          atol=1e-6)
    per_tap = sinkhorn_normalize(g, 1, 0, num_iters=30)  # the old reading: batch over taps
    assert not torch.allclose(per_tap.reshape(6, 36), x, atol=1e-3)


def test_grouped_axes_out_of_order_are_a_permuted_matrix():
    """fan_in=(2, 0), fan_out=1 of an (a, b, c) tensor: the (b, c·a) matrix of permute(1, 2, 0)."""
    shape = (3, 5, 4)
    p = param(shape)
    opt = SinkGD([p], weight_decay=0.0, fan_in_dim=(2, 0), fan_out_dim=1)
    ref = SinkGDRef(weight_decay=0.0, fan_in_axis=1, fan_out_axis=0)
    theta = p.detach().permute(1, 2, 0).reshape(5, 12).numpy().copy()
    gs = grads(shape, 3)
    run(opt, p, gs, LRS[:3])
    for g, lr in zip(gs, LRS[:3], strict=True):
        theta = ref.step(theta, g.permute(1, 2, 0).reshape(5, 12).numpy(), lr)
    got = p.detach().permute(1, 2, 0).reshape(5, 12).numpy()
    np.testing.assert_allclose(got, theta, rtol=0, atol=TOL)
    x = sinkhorn_normalize(gs[0], (2, 0), (1,))
    expected = sinkhorn_normalize(gs[0].permute(1, 2, 0).reshape(5, 12), 1, 0)
    assert torch.equal(x.permute(1, 2, 0).reshape(5, 12), expected)


def test_sage_reduces_over_the_fan_out_group():
    """An (in, heads, head_dim) kernel with fan_out=(1, 2): SAGE of the in x (heads·hd) matrix."""
    shape = (5, 3, 4)
    p = param(shape)
    opt = SAGE([p], weight_decay=0.1, fan_out_dim=(1, 2))
    ref = SageRef((5, 12), weight_decay=0.1, vocab_axis=1)
    theta = p.detach().reshape(5, 12).numpy().copy()
    gs = grads(shape, 4)
    run(opt, p, gs, LRS)
    for g, lr in zip(gs, LRS, strict=True):
        theta = ref.step(theta, g.reshape(5, 12).numpy(), lr)
    np.testing.assert_allclose(p.detach().reshape(5, 12).numpy(), theta, rtol=0, atol=TOL)
    assert opt.state[p]["scale_avg"].shape == (5,)  # one entry per fan-in index
    np.testing.assert_allclose(opt.state[p]["scale_avg"].numpy(), ref.S, rtol=TOL, atol=0)


def test_sage_vector_groups_are_element_wise_for_every_shape():
    p = param((4, 3))
    opt = SAGE([p], weight_decay=0.0, fan_out_dim=None)
    ref = SageRef((4, 3), weight_decay=0.0, vocab_axis=None)
    theta = p.detach().numpy().copy()
    gs = grads((4, 3), 3)
    run(opt, p, gs, LRS[:3])
    for g, lr in zip(gs, LRS[:3], strict=True):
        theta = ref.step(theta, g.numpy(), lr)
    np.testing.assert_allclose(p.detach().numpy(), theta, rtol=0, atol=TOL)
    assert opt.state[p]["scale_avg"].shape == (4, 3)


def fixed_projection(name, refresh_index, n, rank):
    gen = torch.Generator().manual_seed(1000 * refresh_index + n)
    return torch.randn(n, rank, generator=gen, dtype=torch.float64) / rank**0.5


@pytest.mark.parametrize("scale_type", ["tensor", "channel"])
def test_apollo_on_conv2d_is_apollo_on_the_merged_matrix(scale_type):
    p = param(CONV)
    flat = nn.Parameter(p.detach().clone().reshape(6, 36))
    kw = dict(rank=2, scale_type=scale_type, update_proj_gap=2, weight_decay=0.1,
              projection=fixed_projection)
    conv_opt = APOLLO([p], fan_in_dim=(1, 2, 3), fan_out_dim=0, **kw)
    flat_opt = APOLLO([flat], **kw)
    ref = ApolloRef((6, 36), rank=2, scale_type=scale_type, update_proj_gap=2,
                    weight_decay=0.1, scale=conv_opt.param_groups[0]["scale"],
                    projection_fn=lambda i, n, r: fixed_projection("", i, n, r).numpy())
    theta = p.detach().reshape(6, 36).numpy().copy()
    gs = grads(CONV, 4)
    run(conv_opt, p, gs, LRS)
    run(flat_opt, flat, [g.reshape(6, 36) for g in gs], LRS)
    for g, lr in zip(gs, LRS, strict=True):
        theta = ref.step(theta, g.reshape(6, 36).numpy(), lr)
    np.testing.assert_allclose(p.detach().reshape(6, 36).numpy(), theta, rtol=0, atol=TOL)
    assert torch.equal(p.detach().reshape(6, 36), flat.detach())
    assert conv_opt.state[p]["exp_avg"].shape == (2, 36)  # the 6 x 36 matrix, out compressed


def test_grouped_axes_are_validated_naming_the_parameter():
    p = nn.Parameter(torch.zeros(CONV))
    for fan_in, fan_out, words in [((1, 4), 0, "out of range"), ((1, 2), (2, 0), "same dim"),
                                   ((1, 1), 0, "twice"), ((), 0, "non-empty")]:
        opt = SinkGD([("conv.weight", p)], fan_in_dim=fan_in, fan_out_dim=fan_out)
        p.grad = torch.ones(CONV)
        with pytest.raises(ValueError, match=words) as info:
            opt.step()
        assert "conv.weight" in str(info.value) or words == "non-empty"


# ---------------------------------------------------------------------------
# Conv1D (in, out) trains exactly like nn.Linear with the transposed weight
# ---------------------------------------------------------------------------


class Twin(nn.Module):
    """An embedding, one dense layer (Conv1D or Linear), a norm, a tied read-out."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.embed = nn.Embedding(24, 8)
        self.layer = layer
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 8, bias=False)

    def forward(self, x):
        h = self.norm(self.layer(self.embed(x)))
        return self.out(h) @ self.embed.weight.T


def twins():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    torch.manual_seed(0)
    a = Twin(conv1d(12, 8)).double()  # Conv1D(nf=out, nx=in): weight (in, out) = (8, 12)
    b = Twin(nn.Linear(8, 12)).double()  # weight (out, in) = (12, 8)
    b.load_state_dict({k: (v.T if k == "layer.weight" else v)
                       for k, v in a.state_dict().items()})
    return a, b


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_conv1d_trains_like_a_transposed_linear(name):
    a, b = twins()
    ra = {r.name: r.route for r in sage_torch.route_params(a)}
    assert (ra["layer.weight"].fan_in, ra["layer.weight"].fan_out) == ((0,), (1,))
    assert ra["layer.weight"].evidence == "module Conv1D"
    opts = [sage_torch.make_optimizer(name, m, lr=2e-2, dense_projection=fixed_projection)
            for m in (a, b)]
    x = torch.randint(0, 24, (4, 6), generator=torch.Generator().manual_seed(3))
    for _ in range(4):
        for m, opt in zip((a, b), opts, strict=True):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
    for (key, va), vb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        vb = vb.T if key == "layer.weight" else vb
        np.testing.assert_allclose(va.numpy(), vb.numpy(), rtol=0, atol=TOL, err_msg=key)
    start = twins()[0].layer.weight
    assert (a.layer.weight - start).abs().max() > 1e-3  # the test moved the weight
