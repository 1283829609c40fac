"""SinkGD's Sinkhorn iterations by blocks of rows in ``sage_torch`` (no ``K``; issue 41).

With ``sage_torch.sinkgd.BLOCK_ELEMENTS`` set, the single-tensor, chunked CPU and
multi-tensor paths never form ``K = (G/m)²``: each sweep squares one block of rows, does
the row half-iteration of its rows and accumulates the column sums.  Checked against the
float64 direct Sinkhorn (``tests/reference_np.py``) for ``unit`` and ``sqrt``, torch and
Flax layouts, stacked and MoE tensors, squares that leave float32, zero rows and
matrices, bfloat16 gradients; the paths against each other bit for bit (one shared
routine); and for what it saves: no operation makes a tensor of a matrix's size.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_np import sinkhorn_ref
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from sage_torch import RuleOptimizer, SinkGD, sinkgd


@pytest.fixture
def blocks(monkeypatch):
    """Blocks of at most 64 elements: many blocks per matrix, and tail blocks."""
    monkeypatch.setattr(sinkgd, "BLOCK_ELEMENTS", 64)


def _oracle(g, fan_in, fan_out, normalization):
    g = np.asarray(g, np.float64)
    return sinkhorn_ref(g, normalization=normalization, fan_in_axis=fan_in,
                        fan_out_axis=fan_out)


def _rel(x, want):
    return float(np.abs(np.asarray(x, np.float64) - want).max() / np.abs(want).max())


CASES = {  # name: (shape, fan_in_dim, fan_out_dim, scale)
    "torch (out, in)": ((37, 24), 1, 0, 1.0),  # 37 rows: a tail block
    "flax (in, out)": ((24, 37), 0, 1, 1.0),
    "overflowing squares": ((20, 30), 1, 0, 1e25),
    "underflowing squares": ((20, 30), 1, 0, 1e-25),
    "wide rows": ((5, 300), 1, 0, 1.0),  # a row wider than a block: one row per block
}


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("case", list(CASES))
def test_blocks_equal_the_float64_oracle(blocks, case, normalization):
    shape, fi, fo, scale = CASES[case]
    g = np.random.default_rng(41).standard_normal(shape) * scale
    g[3] = 0.0  # a zero row (fan-out units in torch layout, fan-in in Flax's) stays zero
    g = torch.tensor(g, dtype=torch.float32)
    x = sinkgd.sinkhorn_normalize(g, fi, fo, 5, 1e-8, normalization)
    assert _rel(x, _oracle(g.numpy(), fi, fo, normalization)) <= 2e-6
    assert not x[3].any()


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_blocks_stacked_and_moe_tensors(blocks, normalization):
    """Stacked layers ``(L, out, in)`` and experts ``(E, in, out)`` (a batch dim), one of
    them all zero: each matrix its own iteration."""
    rng = np.random.default_rng(42)
    for shape, fi, fo in (((3, 17, 9), 2, 1), ((4, 12, 10), 1, 2)):
        g = rng.standard_normal(shape)
        g[1] = 0.0
        x = sinkgd.sinkhorn_normalize(torch.tensor(g, dtype=torch.float32), fi, fo, 5, 1e-8,
                                      normalization)
        for k in (0, 2):
            want = _oracle(g[k], fi - 1, fo - 1, normalization)
            assert _rel(x[k], want) <= 2e-6, (shape, k)
        assert not x[1].any()


def test_blocks_bfloat16_gradients(blocks):
    """bfloat16 in, each block widened to float32 (no wide copy of ``G``)."""
    g = torch.tensor(np.random.default_rng(43).standard_normal((37, 24)),
                     dtype=torch.bfloat16)
    x = sinkgd.sinkhorn_normalize(g, 1, 0, 5, 1e-8, "unit")
    assert x.dtype == torch.float32
    assert _rel(x, _oracle(g.float().numpy(), 1, 0, "unit")) <= 2e-6


def _step(opt_kwargs, shapes, seed=44):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape) * 0.02
    out = {}
    for path, kw in opt_kwargs.items():
        ps = [torch.nn.Parameter(p.detach().clone()) for p in params]
        for p, q in zip(ps, params, strict=True):
            p.grad = q.grad.clone()
        SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw).step()
        out[path] = [p.detach() for p in ps]
    return out


def test_blocks_single_chunked_and_foreach_are_bitwise_equal(blocks, monkeypatch):
    """The three paths run one routine on each matrix: equal bit for bit (the chunked CPU
    path takes matrices of at least ``FAST_MIN_NUMEL`` elements: lowered to take them)."""
    from sage_torch import chunked

    monkeypatch.setattr(chunked, "FAST_MIN_NUMEL", 1)
    shapes = [(37, 24), (37, 24), (24, 37), (5, 300)]
    out = _step({"single": {"foreach": False}, "foreach": {"foreach": True},
                 "no chunks": {"foreach": False, "capturable": True}}, shapes)
    for a, b, c in zip(out["single"], out["foreach"], out["no chunks"], strict=True):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_blocks_change_the_result_by_rounding_only(monkeypatch):
    """Blocks against ``K`` whole (the default): the same math, float32 rounding apart."""
    shapes = [(37, 24), (4, 24, 37)]
    whole = _step({"foreach": {"foreach": True}}, shapes)["foreach"]
    monkeypatch.setattr(sinkgd, "BLOCK_ELEMENTS", 64)
    blocked = _step({"foreach": {"foreach": True}}, shapes)["foreach"]
    for a, b in zip(whole, blocked, strict=True):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_grouped_axes_optimizer_with_blocks(blocks):
    """A conv kernel (grouped fan-in) and stacked layers through the optimizer."""
    rng = np.random.default_rng(45)
    conv = torch.nn.Parameter(torch.zeros(6, 4, 3, 3))
    conv.grad = torch.tensor(rng.standard_normal((6, 4, 3, 3)), dtype=torch.float32)
    opt = RuleOptimizer([{"params": [conv], "fan_in_dim": (1, 2, 3), "fan_out_dim": 0}],
                        {"rule": "sinkgd", "lr": 1.0, "alpha": 1.0, "weight_decay": 0.0})
    opt.step()
    want = _oracle(conv.grad.numpy().reshape(6, 36), 1, 0, "unit").reshape(6, 4, 3, 3)
    assert _rel(-conv.detach(), want) <= 2e-6


class _Largest(TorchDispatchMode):
    """The most elements of any new tensor an operation returns (views of its inputs and
    results written into them, ``out=``, are not new)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("block", [None, 2**12])
def test_no_operation_makes_a_matrix_with_blocks(monkeypatch, block):
    """The scales of a 256 x 512 matrix: with blocks, no operation returns more than a
    block's elements (no ``K``); with ``K`` whole (the witness), one returns the matrix's."""
    monkeypatch.setattr(sinkgd, "BLOCK_ELEMENTS", block)
    g = torch.randn(256, 512)
    with _Largest() as mode:
        sinkgd.sinkhorn_scales(g, 1, 0)
    if block is None:
        assert mode.largest >= g.numel()
    else:
        assert mode.largest <= block
