"""sage_torch under ``torch.compile``: a compiled HuggingFace Llama, and a compiled train step.

Two paths, each against the same 5 eager steps of the same tiny random ``LlamaForCausalLM``:

* the model compiled with Inductor (forward and backward), the optimizer eager.  Inductor
  is told not to emit SIMD kernels (``cpp.vec_isa_ok=False``, for this compile only): that
  halves a cold-cache compile of the model on a CPU-only machine (measured 35 s -> 17 s);
* the whole step ``zero_grad → forward → backward → opt.step()`` compiled, so that Dynamo
  traces the optimizer too, with the ``eager`` backend (Dynamo's graphs, run op by op):
  Inductor's code generation for the optimizer graph (hundreds of small per-parameter
  kernels) takes minutes on a CPU, which no unit test should spend.  Besides equal losses,
  the optimizer step must trace without graph breaks (the only breaks allowed are
  ``Optimizer.zero_grad``, which Dynamo never traces, and ``loss.backward()``): a break
  inside the loop over parameters makes Dynamo give up on the whole rule.
"""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import sage_torch

transformers = pytest.importorskip("transformers")

CONFIGS = ("sage-hybrid", "sage-pure")
STEPS = 5
LR = 1e-2
# Graph breaks that are not the optimizer's: Dynamo skips Optimizer.zero_grad by design and
# does not trace Tensor.backward() by default.
EXPECTED_BREAKS = ("zero_grad", "backward")
INDUCTOR = {"cpp.vec_isa_ok": False}  # scalar C++ kernels: a faster cold compile


pytestmark = pytest.mark.filterwarnings(  # raised while Dynamo traces transformers
    "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"
)


pytestmark = pytest.mark.usefixtures("torch_one_thread")


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    return transformers.LlamaForCausalLM(config)


def batch() -> torch.Tensor:
    return torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1234))


def run(name: str, compile_model: bool = False, compile_step: str | None = None):
    """Losses of STEPS training steps of ``name`` and Dynamo's counters of the run."""
    torch._dynamo.reset()
    counters.clear()
    model = llama()
    opt = sage_torch.make_optimizer(name, model, lr=LR)
    forward = torch.compile(model, options=INDUCTOR) if compile_model else model

    def step(x, y):
        opt.zero_grad()
        loss = forward(input_ids=x, labels=y).loss
        loss.backward()
        opt.step()
        return loss

    if compile_step is not None:
        step = torch.compile(step, backend=compile_step)
    x = batch()
    losses = torch.stack([step(x, x).detach() for _ in range(STEPS)])
    stats = {"graphs": counters["stats"]["unique_graphs"],
             "breaks": dict(counters["graph_break"])}
    torch._dynamo.reset()
    return losses, stats


@pytest.fixture(scope="module")
def eager():
    return {name: run(name)[0] for name in CONFIGS}


@pytest.fixture(scope="module")
def whole_step():
    return {name: run(name, compile_step="eager") for name in CONFIGS}


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_model_eager_optimizer(name, eager):
    losses, stats = run(name, compile_model=True)
    assert stats["graphs"] >= 1, "nothing was compiled"
    assert losses[-1] < losses[0]
    torch.testing.assert_close(losses, eager[name], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_compiled_whole_step_matches_eager(name, eager, whole_step):
    losses, stats = whole_step[name]
    assert stats["graphs"] >= 2, "the step was not compiled"
    torch.testing.assert_close(losses, eager[name], rtol=1e-5, atol=0)


@pytest.mark.parametrize("name", CONFIGS)
def test_optimizer_step_traces_without_graph_breaks(name, whole_step):
    _, stats = whole_step[name]
    foreign = {reason.splitlines()[0]: n for reason, n in stats["breaks"].items()
               if not any(word in reason for word in EXPECTED_BREAKS)}
    assert not foreign, f"graph breaks inside opt.step(): {foreign}"
    # forward (+ backward) and opt.step(): the state is created outside the graph
    # (RuleOptimizer._init_group), so later steps reuse it (tests/torch/test_torch_recompile.py)
    assert stats["graphs"] <= 2, stats
