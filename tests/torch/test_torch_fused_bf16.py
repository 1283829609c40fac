"""bfloat16 on the fused path, under Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``).

The kernels read bfloat16 into float32 and round to bfloat16 where the single-tensor
functions store a bfloat16 tensor (:mod:`sage_torch.triton_kernels`).  Against the
single-tensor path in bfloat16, with weight decay, step by step from the same state:

* ``M`` (SAGE, Lion) bit for bit: the same float32 operations and the same roundings
  (Lion rounds every product and sum, as its bfloat16 tensor operations do; SAGE's ``M``
  does not depend on the damper).
* ``θ`` within one bfloat16 unit of the parameter.  One rounding can differ: torch's CPU
  ``add(alpha=)`` rounds ``alpha`` (``−η``, ``w``) to bfloat16 in its vectorised loop (not
  in its scalar tail), the kernels keep it in float32 as torch's CUDA ``add`` does; SAGE's
  ``H`` comes from the stacked reductions of :func:`~sage_torch.sage._dampers` and
  SinkGD's scales from sums over tiles (another summation order than the single path's),
  a float32 difference that can flip the rounding of the update to bfloat16.  Each moves
  ``θ − η·d`` by far less than half a unit of ``θ`` (``|θ| ≥ 0.5``, ``η = 10⁻²``, the data
  below), so the two results are equal or adjacent bfloat16 numbers.
* At most 5% of the entries differ: the sources above flip a rounding with a probability
  of about ``η·|d|·2⁻⁹ / unit(θ)`` (≈ 1%); a systematic error of one unit (truncating
  instead of rounding to nearest) would move about half of them.

Also: :func:`_round_bf16` is torch's conversion (ties to even, carries, inf, NaN,
subnormals) under the interpreter, whose own float32-to-bfloat16 cast truncates.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import triton.language as tl
from torch import nn

from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available

pytestmark = pytest.mark.skipif(not triton_available(),
                                reason="the triton package is not installed")

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rounding_kernel(x_ptr, y_ptr, N, BLOCK: tl.constexpr):  # pragma: no cover - Triton
    from sage_torch.triton_kernels import _round_bf16

    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    tl.store(y_ptr + idx, _round_bf16(tl.load(x_ptr + idx, mask=ok, other=0.0)), mask=ok)


def test_round_bf16_is_torchs_conversion():
    from sage_torch import triton_kernels as tk

    one = 1.0
    special = torch.tensor([
        one + 2**-8,  # a tie, even below: down
        one + 3 * 2**-8,  # a tie, odd below: up
        one + 2**-8 + 2**-20,  # just above a tie: up
        2 - 2**-9,  # rounds up into the next binade (carry into the exponent)
        3.999,  # odd exponent, mantissa all ones: carry
        3.4e38,  # above the largest bfloat16: inf
        float("inf"), -float("inf"), float("nan"), 0.0, -0.0,
        2.0**-130 + 2.0**-140,  # subnormal in bfloat16
        -(one + 3 * 2**-8),
    ], dtype=torch.float32)
    x = torch.cat([special, torch.randn(5000, generator=torch.Generator().manual_seed(0)) * 1e3])
    y = torch.empty_like(x)
    tk._kernel(_rounding_kernel, True)[(tk._cdiv(x.numel(), 1024),)](x, y, x.numel(),
                                                                      BLOCK=1024)
    want = x.to(BF16).float()
    same = (y == want) | (y.isnan() & want.isnan())
    assert bool(same.all()), (x[~same], y[~same], want[~same])
    assert torch.equal(torch.signbit(y[~y.isnan()]), torch.signbit(want[~want.isnan()]))


def _data(shapes, steps, seed):
    """bfloat16 parameters with ``|θ| ≥ 0.5`` (see the module docstring), gradients."""
    gen = torch.Generator().manual_seed(seed)
    start = []
    for s in shapes:
        sign = torch.randint(0, 2, s, generator=gen) * 2 - 1
        start.append((sign * (0.5 + torch.rand(s, generator=gen))).to(BF16))
    grads = [[torch.randn(s, generator=gen).to(BF16) for s in shapes] for _ in range(steps)]
    return start, grads


def _optimizers(make: Callable, start, capturable: bool):
    out = {}
    for path in ("fused", "single"):
        ps = [nn.Parameter(p.clone()) for p in start]
        kw: dict = {"fused": True} if path == "fused" else {"foreach": False}
        if capturable:
            kw.update(capturable=True, lr=torch.tensor(1e-2))
        out[path] = (ps, make(ps, kw))
    return out


def _ulp(x: torch.Tensor) -> torch.Tensor:
    _, e = torch.frexp(x.float().abs())
    return torch.ldexp(torch.full_like(x, 2.0**-7, dtype=torch.float32), e - 1)


def _step_by_step(make, shapes, steps, seed, state_keys, capturable=False):
    """Step fused and single-tensor from the same state each step.

    Per step: ``θ`` within one bfloat16 unit, the listed state bit for bit.  Returns the
    fraction of the parameters' entries that differ, over all steps.
    """
    start, grads = _data(shapes, steps, seed)
    runs = _optimizers(make, start, capturable)
    (pf, of), (ps_, os_) = runs["fused"], runs["single"]
    differ = total = 0
    for gs in grads:
        for (ps, opt) in runs.values():
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        for a, b in zip(pf, ps_, strict=True):
            assert a.dtype == BF16
            assert bool(((a - b).float().abs() <= _ulp(b)).all())
            differ += int((a != b).sum())
            total += a.numel()
            for key in state_keys:
                assert torch.equal(of.state[a][key], os_.state[b][key]), key
            # the next step starts from the same state (the single path's)
            with torch.no_grad():
                a.copy_(b)
            for key, value in os_.state[b].items():
                of.state[a][key].copy_(value)
    return differ / total


LION = {"lion": lambda ps, kw: Lion(ps, **{"lr": 1e-2, "weight_decay": 0.1, **kw}),
        "lion-b2": lambda ps, kw: Lion(ps, **{"lr": 1e-2, "betas": (0.95, 0.98),
                                              "weight_decay": 0.5, **kw})}


@pytest.mark.parametrize("capturable", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", sorted(LION))
def test_lion_bf16_within_one_unit_of_single_tensor(name, capturable):
    differ = _step_by_step(LION[name], [(37, 50), (1100,), (3, 4)], 5, 2, ("exp_avg",),
                           capturable)
    assert differ <= 0.05


SAGE_MAKERS = {
    "columns": lambda ps, kw: SAGE(ps, **{"lr": 1e-2, "weight_decay": 0.1, **kw}),
    "rows": lambda ps, kw: SAGE(ps, **{"lr": 1e-2, "weight_decay": 0.1, "fan_out_dim": -1,
                                       **kw}),
    "b2-zero": lambda ps, kw: SAGE(ps, **{"lr": 1e-2, "betas": (0.9, 0.0),
                                          "weight_decay": 0.1, **kw}),
}


@pytest.mark.parametrize("capturable", [False, True], ids=["float-lr", "tensor-lr"])
@pytest.mark.parametrize("name", sorted(SAGE_MAKERS))
def test_sage_bf16_within_one_unit_of_single_tensor(name, capturable):
    differ = _step_by_step(SAGE_MAKERS[name], [(37, 50), (40,), (3, 4)], 4, 3, ("exp_avg",),
                           capturable)
    assert differ <= 0.05


@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
def test_sinkgd_bf16_within_one_unit_of_single_tensor(normalization):
    def make(ps, kw):
        return SinkGD(ps, **{"lr": 1e-2, "weight_decay": 0.1, "normalization": normalization,
                             **kw})

    differ = _step_by_step(make, [(37, 50), (37, 50), (9, 4)], 3, 4, ())
    assert differ <= 0.05
