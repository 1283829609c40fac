"""A compiled training step with a sage_torch optimizer compiles no more than with
``torch.optim.AdamW``, and never again after the first step.

Dynamo treats every ``torch.optim.Optimizer`` specially: it runs a method named
``_init_group`` eagerly instead of tracing it, so the state an optimizer creates on its
first step is made outside the graph.  :class:`sage_torch.RuleOptimizer` creates its state
there; before, the traced step created it and guarded on ``not opt.state``, so step 2
compiled the optimizer a second time (and, with several param groups, Dynamo's stale view
of the state made the trace fail and the optimizer fall back to eager).  Counted here over
three steps of one small model, with the ``eager`` backend (Dynamo's graphs run op by op:
what is compiled and when does not depend on the backend), for the whole step
(``zero_grad → forward → backward → opt.step()`` in one ``torch.compile``) and for
``torch.compile(opt.step)``.  Compile times: ``benchmarks/torch_compile.py``.

APOLLO is left out: it reads its step count on the host by design (it picks the
projection refresh and the bias corrections there; ``capturable=True`` is refused), so its
step has graph breaks; it does not recompile either (checked below, without the AdamW bound).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import sage_torch
from sage_optim.presets import CONFIG_NAMES

pytestmark = [
    pytest.mark.usefixtures("torch_one_thread"),
    pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace:UserWarning"),
]

STEPS = 3
TRACED = [name for name in CONFIG_NAMES if name != "apollo"]


class Model(nn.Module):
    """Every kind of parameter: a token table, dense matrices, biases and a norm."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.norm = nn.LayerNorm(16)
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.head(h)


def counts(name: str, whole: bool, foreach: bool | None = None) -> list[dict[str, int]]:
    """Dynamo's counters after each of STEPS compiled steps of optimizer ``name``."""
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = Model()
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3) if name == "torch.optim.AdamW"
           else sage_torch.make_optimizer(name, model, lr=1e-3, foreach=foreach))
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))

    def forward_backward() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        return loss

    if whole:
        @torch.compile(backend="eager")
        def step() -> torch.Tensor:
            loss = forward_backward()
            opt.step()
            return loss
    else:
        opt_step = torch.compile(opt.step, backend="eager")

        def step() -> torch.Tensor:
            loss = forward_backward()
            opt_step()
            return loss

    before = [p.detach().clone() for p in model.parameters()]
    out = []
    for _ in range(STEPS):
        step()
        out.append({"graphs": counters["stats"]["unique_graphs"],
                    "frames": counters["frames"]["total"], "ok": counters["frames"]["ok"]})
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    assert all(opt.state[p] for p in model.parameters())
    torch._dynamo.reset()
    return out


@pytest.fixture(scope="module")
def adamw():
    return {whole: counts("torch.optim.AdamW", whole) for whole in (True, False)}


@pytest.mark.parametrize("foreach", [None, False], ids=["default", "single-tensor"])
@pytest.mark.parametrize("whole", [True, False], ids=["whole-step", "opt.step"])
@pytest.mark.parametrize("name", TRACED)
def test_compiles_once_and_no_more_than_adamw(name, whole, foreach, adamw):
    """``foreach=None`` takes the foreach path under compile; ``False`` the single-tensor one."""
    got, want = counts(name, whole, foreach), adamw[whole]
    assert got[1:] == [got[0]] * (STEPS - 1), f"compiled again after step 1: {got}"
    first = got[0]
    assert first["ok"] == first["frames"], f"a frame fell back to eager: {first}"
    # as many graphs as AdamW's (fewer: the optimizer was not compiled), in as many frames
    assert first["graphs"] == want[0]["graphs"], (first, want[0])
    assert first["frames"] <= want[0]["frames"], (first, want[0])


@pytest.mark.parametrize("whole", [True, False], ids=["whole-step", "opt.step"])
def test_apollo_does_not_recompile(whole):
    got = counts("apollo", whole)
    assert got[1:] == [got[0]] * (STEPS - 1), f"compiled again after step 1: {got}"
