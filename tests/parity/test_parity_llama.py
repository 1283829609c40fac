"""Full-LLaMA parity: sage_optax on the trainer's Flax parameter tree vs sage_torch on
transformers' LlamaForCausalLM with converted weights, same batches: in float64 (both models
in float64 throughout) losses and parameters agree step by step to float64 rounding; in
float32, each step's updates from synchronized states agree to float32's resolution."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from sage_repro.parity import SYNC_ULPS, TOLERANCE, llama_loss, run_llama_parity  # noqa: E402


@pytest.mark.parametrize("name,tied", [("sage-hybrid", True), ("sage-hybrid", False),
                                       ("apollo", True)])
def test_llama_float64_trajectories_agree(name, tied):
    report = run_llama_parity(name, steps=5, tied=tied)
    assert report.check == "trajectory" and report.ok, report.verdict()
    for step, _, cols in report.rows:
        assert cols["loss"] <= 1e-12, (step, cols)  # float64 models, losses ~ 7
        assert max(cols[k] for k in ("embedding", "dense", "vector")) <= 1e-12, (step, cols)
    assert report.worst <= TOLERANCE["float64"]


def test_llama_synchronized_float32_updates_agree():
    report = run_llama_parity("sage-hybrid", steps=3, dtype="float32", tied=False)
    assert report.check == "sync" and report.ok, report.verdict()
    assert report.worst <= SYNC_ULPS and report.beyond == 0


def test_llama_loss_is_the_trainers_model():
    """The JAX side's loss is the trainer's Llama (float32, to its own rounding)."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from flax import nnx
    from transformers import LlamaForCausalLM

    from sage_repro.parity import _hf_config
    from sage_train.model.llama import Llama, loss_fn
    from sage_train.model.shapes import get_model_config

    for tied in (True, False):
        cfg = dataclasses.replace(get_model_config("tiny"), tie_embeddings=tied)
        model = Llama(cfg, rngs=nnx.Rngs(3))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 17))
        x, y = jnp.asarray(tokens[:, :-1]), jnp.asarray(tokens[:, 1:])
        hf = LlamaForCausalLM(_hf_config(cfg))
        cos, sin = hf.model.rotary_emb(torch.zeros(()), torch.arange(16)[None])
        ours = llama_loss(params, x, y, jnp.asarray(cos[0].numpy()), jnp.asarray(sin[0].numpy()),
                          cfg)
        theirs = loss_fn(model, x, y)
        assert abs(float(ours) - float(theirs)) <= 1e-5 * float(theirs), (tied, ours, theirs)
