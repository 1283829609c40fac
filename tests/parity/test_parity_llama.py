"""Full-LLaMA parity: sage_optax on the trainer's Flax model vs sage_torch on transformers'
LlamaForCausalLM with converted weights, same batches: losses and parameters step by step."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from sage_repro.parity import TOLERANCE, run_llama_parity  # noqa: E402


@pytest.mark.parametrize("name,tied", [("sage-hybrid", True), ("sage-hybrid", False),
                                       ("adamw", True)])
def test_llama_losses_equal_step_by_step(name, tied):
    report = run_llama_parity(name, steps=6, tied=tied)
    for step, _, cols in report.rows:
        assert cols["loss"] <= 1e-5, (step, cols)  # float32 models, losses ~ 7
        if name != "adamw":
            assert cols["params"] <= TOLERANCE["float32"], (step, cols)
    if name == "adamw":
        # Adam's m/(sqrt(v)+eps) is ill-conditioned where a gradient entry sits at float32
        # noise level (~1e-9): a couple of the 301,536 entries land apart (reported as ties).
        assert report.ties <= 10
    else:
        assert report.ties == 0
