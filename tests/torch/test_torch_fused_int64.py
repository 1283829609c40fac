"""64-bit offsets of the fused kernels (``INT64``): when they are chosen, and what they compute.

The choice is a pure function of sizes and strides (checked on sizes far past ``2**31``
without allocating anything, and through the launchers on ``meta`` tensors); with the
limit forced down to 1, every launch takes the int64 variant, which must give bit for bit
the int32 variant's results under Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sage_torch import SAGE, Lion, SinkGD
from sage_torch.common import triton_available

pytestmark = pytest.mark.skipif(not triton_available(),
                                reason="the triton package is not installed")

LIMIT = 2**31
BLOCK = 1024


@pytest.fixture(autouse=True)
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def test_elementwise_choice_at_the_limit():
    """The last lane of the last block is the largest index formed (masked lanes too)."""
    from sage_torch import triton_kernels as tk

    assert tk.INDEX_LIMIT == LIMIT
    assert not tk.elementwise_int64(LIMIT - BLOCK)
    assert not tk.elementwise_int64(LIMIT)  # lanes 0 .. 2**31 − 1
    assert tk.elementwise_int64(LIMIT + 1)  # one more block: lanes up to 2**31 + 1023
    assert not tk.elementwise_int64(0) and not tk.elementwise_int64(1)


def test_sage_choice_reads_the_damper_strides():
    from sage_torch import triton_kernels as tk

    n, cols = 2**30, 2**15
    assert not tk.sage_int64(n, cols, (0, 1))  # H per column: (1, C) broadcast
    assert not tk.sage_int64(n, cols, (1, 0))  # H per row
    assert not tk.sage_int64(n, n, (0, 1))  # element-wise: H read flat
    assert tk.sage_int64(LIMIT + 1, LIMIT + 1, (0, 1))
    # a small tensor whose H is read through a huge stride
    assert tk.sage_int64(4096, 64, (2**26, 1))
    assert not tk.sage_int64(4096, 64, (2**20, 1))


def test_sinkgd_update_choice_reads_both_views():
    from sage_torch import triton_kernels as tk

    contiguous = (2**20, 2**10, 1)
    assert not tk.sinkgd_update_int64((2048, 1024, 1024), contiguous, contiguous)  # 2**31
    assert tk.sinkgd_update_int64((2049, 1024, 1024), contiguous, contiguous)
    # 2**30 elements, but the parameter is a strided view of twice as much memory
    gap = (2**22, 2**10, 1)
    assert not tk.sinkgd_update_int64((1024, 1024, 1024), contiguous, contiguous)
    assert tk.sinkgd_update_int64((1024, 1024, 1024), gap, contiguous)
    assert tk.sinkgd_update_int64((1024, 1024, 1024), contiguous, gap)
    # a transposed (IN, OUT) layout reaches the same largest offset as the contiguous one
    transposed = (2**20, 1, 2**10)
    assert not tk.sinkgd_update_int64((1024, 1024, 1024), transposed, contiguous)


def test_sinkhorn_choice_reads_the_tiles():
    from sage_torch import triton_kernels as tk

    rows = tk.SINKHORN_BLOCKS["rows"]
    # one (2**16, 2**15) matrix: offsets up to 2**31 − 1 exactly
    assert not tk.sinkhorn_int64((1, 2**16, 2**15), (2**31, 2**15, 1), rows)
    assert tk.sinkhorn_int64((2, 2**16, 2**15), (2**31, 2**15, 1), rows)
    # N_OUT not a multiple of BLOCK_O: the masked rows of the last tile count
    assert tk.sinkhorn_int64((1, 2**16 + 1, 2**15), (2**31, 2**15, 1), rows)
    # an expanded G (zero strides): only the scale vectors' offsets B·N_OUT overflow
    assert tk.sinkhorn_int64((2**16, 2**15 + 16, 1), (0, 1, 0), rows)
    assert not tk.sinkhorn_int64((2**15, 2**15, 1), (0, 1, 0), rows)


def test_launchers_set_the_flag_from_meta_tensors(monkeypatch):
    """The launchers pass ``INT64`` from the tensors' sizes (meta: nothing allocated)."""
    from sage_torch import triton_kernels as tk

    flags: list[tuple[str, bool]] = []
    monkeypatch.setattr(tk, "_launch",
                        lambda fn, device, grid, *a, **meta: flags.append((fn.__name__,
                                                                           meta["INT64"])))
    hp, lr = torch.empty(6, device="meta"), torch.empty((), device="meta")
    for n in (LIMIT, LIMIT + 5):
        big = torch.empty(n, device="meta", dtype=torch.bfloat16)
        tk.lion_update(big, big, big, hp, lr)
        tk.sage_update(big, big, big, torch.empty(n, device="meta"), (0, 1), n, hp, lr, False)
    assert flags == [("_lion_update", False), ("_sage_update", False),
                     ("_lion_update", True), ("_sage_update", True)]
    flags.clear()
    g = torch.empty(1, 2**16, 2**15 + 1, device="meta")
    c, r = torch.empty(1, 2**15 + 1, device="meta"), torch.empty(1, 2**16, device="meta")
    tk.sinkhorn_iterations(g, c, r, hp[:1], hp[:1], hp, 1)
    tk.sinkgd_update(g, g, c, r, hp[:1], hp[:1], hp, lr)
    assert flags == [("_sinkhorn_half", True), ("_sinkhorn_half", True),
                     ("_sinkgd_update", True)]
    flags.clear()
    small = torch.empty(3, 40, 50, device="meta").transpose(1, 2)
    tk.sinkhorn_iterations(small, c[:, :40], r[:, :50], hp[:3], hp[:3], hp, 1)
    tk.sinkgd_update(small, small, c[:, :40], r[:, :50], hp[:3], hp[:3], hp, lr)
    assert [f for _, f in flags] == [False, False, False]


MAKERS = {
    "sage": lambda ps, kw: SAGE(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sage-b2-zero": lambda ps, kw: SAGE(ps, lr=1e-2, betas=(0.9, 0.0), weight_decay=0.1, **kw),
    "sage-rows": lambda ps, kw: SAGE(ps, lr=1e-2, fan_out_dim=-1, **kw),
    "lion": lambda ps, kw: Lion(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sinkgd": lambda ps, kw: SinkGD(ps, lr=1e-2, weight_decay=0.1, **kw),
    "sinkgd-sqrt-in-out": lambda ps, kw: SinkGD(ps, lr=1e-2, normalization="sqrt",
                                                 fan_in_dim=0, fan_out_dim=1, **kw),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MAKERS))
def test_int64_variant_is_bitwise_the_int32_variant(name, dtype, monkeypatch):
    """Every kernel with ``INT64`` forced on: the same bits, over steps (interpreter).

    SinkGD on its two-launch kernels: the sweep kernel (the fused default) forms every
    offset in int64 from its descriptor table, with no int32 variant.
    """
    from sage_torch import fused_check, sinkgd
    from sage_torch import triton_kernels as tk

    monkeypatch.setattr(sinkgd, "FUSED_SWEEP", False)
    assert fused_check.fused_ready(torch.device("cpu"), dtype)
    flags: list[bool] = []
    launch = tk._launch

    def recording(fn, *args, **meta):
        flags.append(meta["INT64"])
        return launch(fn, *args, **meta)

    monkeypatch.setattr(tk, "_launch", recording)
    gen = torch.Generator().manual_seed(5)
    shapes = [(37, 50), (37, 50), (1100,), (3, 4)] if "sinkgd" not in name else \
        [(37, 50), (37, 50), (9, 4), (3, 4)]
    start = [torch.randn(s, generator=gen).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=gen).to(dtype) for s in shapes] for _ in range(2)]
    out = {}
    for limit in (LIMIT, 1):
        monkeypatch.setattr(tk, "INDEX_LIMIT", limit)
        flags.clear()
        ps = [nn.Parameter(p.clone()) for p in start]
        opt = MAKERS[name](ps, {"fused": True})
        for gs in grads:
            for p, g in zip(ps, gs, strict=True):
                p.grad = g.clone()
            opt.step()
        assert flags and all(f is (limit == 1) for f in flags), (limit, flags)
        out[limit] = ([p.detach() for p in ps],
                      [t for st in opt.state.values() for t in st.values()])
    for a, b in zip(out[1][0] + out[1][1], out[LIMIT][0] + out[LIMIT][1], strict=True):
        assert torch.equal(a, b)
