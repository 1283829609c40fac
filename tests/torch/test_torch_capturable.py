"""``capturable=True`` (as ``torch.optim.Adam``'s): step counts on the device, a tensor
``lr`` never read back, so a step can be captured in a CUDA graph.

On the CPU: no ``aten._local_scalar_dense`` (the op behind ``.item()``/``float(t)``) is
dispatched during a capturable step, the step completes on the ``meta`` device with a
``meta`` learning rate, and the updates are those of the ordinary path (float64 ≤ 1e-12
relative), over steps with a changing learning rate.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from sage_torch import APOLLO, RuleOptimizer

pytestmark = pytest.mark.usefixtures("torch_one_thread")

SHAPES = [(12, 8), (12, 8), (8, 12), (7,), ()]
MATRICES = [(12, 8), (12, 8), (8, 12)]
RULES = {
    "sage": SHAPES, "lion": SHAPES, "adamw": SHAPES, "unit_norm": SHAPES, "sinkgd": MATRICES,
}


class _HostReads(TorchDispatchMode):
    """Counts ``aten._local_scalar_dense`` (a tensor value read on the host)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


def _build(rule, ps, foreach, capturable, lr):
    groups = [{"params": [p for p in ps if p.dim() == 2]},
              {"params": [p for p in ps if p.dim() < 2], "fan_out_dim": None}]
    return RuleOptimizer([g for g in groups if g["params"]],
                         {"rule": rule, "lr": lr, "weight_decay": 0.1, "foreach": foreach,
                          "capturable": capturable})


@pytest.mark.parametrize("foreach", [False, True], ids=["single", "foreach"])
@pytest.mark.parametrize("rule", list(RULES))
def test_capturable_reads_nothing_on_the_host_and_matches(rule, foreach):
    rng = np.random.default_rng(11)
    shapes = RULES[rule]
    ref = [nn.Parameter(torch.tensor(rng.standard_normal(s))) for s in shapes]
    cap = [nn.Parameter(p.detach().clone()) for p in ref]
    lr = torch.tensor(1e-2, dtype=torch.float64)
    opt_r = _build(rule, ref, foreach, False, 1e-2)
    opt_c = _build(rule, cap, foreach, True, lr)
    start = [p.detach().clone() for p in cap]
    for t in range(6):
        for group in opt_r.param_groups:
            group["lr"] = 1e-2 * (t + 1) / 6
        lr.fill_(1e-2 * (t + 1) / 6)  # a scheduler writes the tensor in place
        for p, q in zip(ref, cap, strict=True):
            g = torch.tensor(rng.standard_normal(p.shape))
            p.grad, q.grad = g, g.clone()
        opt_r.step()
        mode = _HostReads()
        with mode:
            opt_c.step()
        assert mode.reads == 0, f"{rule}: {mode.reads} host reads in a capturable step"
        for p, q in zip(ref, cap, strict=True):
            scale = max(float(p.detach().abs().max()), 1e-300)
            assert float((p - q).detach().abs().max()) <= 1e-12 * scale, (rule, t, p.shape)
    moved = max(float((p.detach() - s).abs().max()) for p, s in zip(cap, start, strict=True))
    assert moved > 1e-3, "the parameters barely moved (test too weak)"
    for p in cap:
        if opt_c.state[p]:
            assert opt_c.state[p]["step"].device == p.device
            assert float(opt_c.state[p]["step"]) == 6.0


@pytest.mark.parametrize("rule", list(RULES))
def test_capturable_step_completes_on_meta(rule):
    """Every value on ``meta`` (parameters, step counts, lr): a host read would raise."""
    ps = [nn.Parameter(torch.empty(s, device="meta")) for s in RULES[rule]]
    for p in ps:
        p.grad = torch.empty_like(p)
    for foreach in (False, True):
        opt = _build(rule, ps, foreach, True, torch.tensor(1e-2, device="meta"))
        opt.step()
        opt.step()
        assert all(st["step"].device.type == "meta" for st in opt.state.values())


def test_apollo_refuses_capturable():
    with pytest.raises(ValueError, match="capturable"):
        RuleOptimizer([nn.Parameter(torch.zeros(4, 3))],
                      {"rule": "apollo", "lr": 1e-3, "weight_decay": 0.0, "capturable": True})
    assert APOLLO([nn.Parameter(torch.zeros(4, 3))]).param_groups[0]["capturable"] is False


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a CUDA device (scripts/gpu-check runs it there)")
@pytest.mark.parametrize("rule", list(RULES))
def test_cuda_graph_replay_matches_eager(rule):
    """A captured ``opt.step()`` replayed on new gradients = the eager foreach step."""
    rng = np.random.default_rng(12)
    shapes = RULES[rule]
    eager = [nn.Parameter(torch.tensor(rng.standard_normal(s), device="cuda")) for s in shapes]
    cap = [nn.Parameter(p.detach().clone()) for p in eager]
    for q in cap:
        q.grad = torch.zeros_like(q)  # static gradient buffers, written in place
    lr = torch.tensor(1e-2, dtype=torch.float64, device="cuda")
    opt_e = _build(rule, eager, True, False, 1e-2)
    opt_c = _build(rule, cap, True, True, lr)

    def feed(t):
        for p, q in zip(eager, cap, strict=True):
            g = torch.tensor(rng.standard_normal(p.shape) * (1 + t % 3), device="cuda")
            p.grad = g
            q.grad.copy_(g)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (creates the state) off the capture stream
        for t in range(3):
            feed(t)
            opt_e.step()
            opt_c.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt_c.step()
    for t in range(3, 9):
        feed(t)
        opt_e.step()
        graph.replay()
    torch.cuda.synchronize()
    for p, q in zip(eager, cap, strict=True):
        scale = max(float(p.detach().abs().max()), 1e-300)
        assert float((p - q).detach().abs().max()) <= 1e-12 * scale, (rule, tuple(p.shape))
