# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # PyTorch-to-JAX parity
#
# `sage_torch` and `sage_optax` implement the same eight configurations (docs/configurations.md)
# and must make the same updates (docs/configurations.md). This notebook shows how that is
# checked: the same model in both frameworks, the same gradients, both optimizers side by
# side, and the largest difference between the two frameworks' parameters after each step,
# in float64 and float32; then the trainer's full Flax LLaMA against `transformers`' PyTorch
# LLaMA with converted weights; and why sign-based rules can, in principle, differ at ties.
#
# Set `SAGE_NOTEBOOK_FAST=1` for a smoke run with a few steps (the test suite does).

# %%
import os

import jax
import jax.numpy as jnp
import numpy as np
import torch

import sage_optax
import sage_torch
from sage_optim.table import format_table
from sage_repro import parity

FAST = os.environ.get("SAGE_NOTEBOOK_FAST") == "1"
CONFIGS = ("sage-hybrid", "lion-hybrid") if FAST else (
    "sage-hybrid", "sage-pure", "lion-hybrid", "sinkgd-hybrid", "adamw", "apollo")
STEPS = 4 if FAST else 100  # optimizer steps per parity run
MODEL_STEPS = 3 if FAST else 30  # steps of the model-level run
# The LLaMA run costs ~15 s of imports and compilation even for one step: skipped in fast
# mode (tests/parity/test_parity_llama.py covers it in the test suite).
LLAMA_STEPS = 0 if FAST else 10  # steps of the full LLaMA run
torch.set_num_threads(1)  # the models are tiny: threads only add contention

# %% [markdown]
# ## The same model in both frameworks
#
# `parity.MixedModel` is a tiny language model with every kind of parameter the routing
# distinguishes: an embedding, two dense matrices (one with a bias), two RMSNorm scales and
# an untied output head. `parity.jax_loss` is the same model written in JAX on a Flax-layout
# parameter dict. PyTorch stores a dense weight as `(out, in)`, Flax as `(in, out)`:
# `parity.to_flax` transposes where the layouts differ (`parity.PARAM_MAP`).

# %%
torch.manual_seed(0)
model = parity.MixedModel().double()
params = parity.to_flax(model.state_dict())
rows = [(tname, tuple(model.state_dict()[tname].shape), fname,
         tuple(params[fname.split(".")[0]][fname.split(".")[1]].shape), kind)
        for tname, (fname, kind, _) in parity.PARAM_MAP.items()]
print(format_table(("PyTorch", "shape", "Flax", "shape", "kind"), rows))

# %% [markdown]
# Same weights, same batch: the losses and the gradients agree to float64 rounding.

# %%
rng = np.random.default_rng(0)
vocab = model.embed.num_embeddings
tokens = rng.integers(0, vocab, size=64)
targets = (tokens * 7 + 3) % vocab

loss_t = model(torch.from_numpy(tokens), torch.from_numpy(targets))
loss_t.backward()
with jax.enable_x64(True):
    jparams = jax.tree.map(jnp.asarray, params)
    loss_j, grads_j = jax.value_and_grad(parity.jax_loss)(jparams, tokens, targets)
    grads_j = parity.from_flax(jax.tree.map(np.asarray, grads_j))  # back to PyTorch layout
print(f"loss: torch {float(loss_t.detach()):.12f}  jax {float(loss_j):.12f}")
print(format_table(("parameter", "max |grad torch - grad jax|"), [
    (n, f"{np.max(np.abs(p.grad.numpy() - grads_j[n])):.1e}")
    for n, p in model.named_parameters()]))

# %% [markdown]
# ## The same optimizer in both frameworks
#
# `sage_torch.make_optimizer(name, model)` builds parameter groups from the PyTorch module,
# `sage_optax.make_optimizer(name, lr)` an Optax transformation that routes by path and
# shape. Both route each parameter to the same rule, with the same state (float32 here):

# %%
model32 = parity.MixedModel()
print(sage_torch.routing_table("sage-hybrid", model32))
print()
print(sage_optax.routing_table("sage-hybrid", parity.to_flax(model32.state_dict())))

# %% [markdown]
# ## Same gradients, same parameters: per-step max |torch − jax|
#
# `parity.run_parity` feeds both optimizers the same gradient sequence, designed to be hard:
# sparse embedding rows (tokens absent from a batch), exact zeros, column scales over six
# orders of magnitude and periodic 1000x spikes, under the same warmup + cosine schedule,
# and compares the two frameworks after every step. In float64 each framework runs its own
# trajectory and the parameters must agree to 1e-10. In float32 each step starts both
# sides from the same synchronized state (the float64 run's, rounded) and the two updates
# must agree to float32's resolution: 64 x 2**-23 x the parameter's largest update, and the
# sign rules' mean signed difference within 0.25 ulp (docs/configurations.md).

# %%
reports = {(name, dtype): parity.run_parity(name, steps=STEPS, dtype=dtype)
           for name in CONFIGS for dtype in ("float64", "float32")}
print(format_table(
    ("configuration", "dtype", "check", "steps", "worst", "ties", "verdict"),
    [(name, dtype, r.check, len(r.rows),
      f"{r.worst:.1f} units" if r.check == "sync" else f"{r.worst:.1e}", r.ties,
      "OK" if r.ok else "FAILED")
     for (name, dtype), r in reports.items()]))

# %% [markdown]
# The per-step table of one run (every 10th step in the full run):

# %%
report = reports[("sage-hybrid", "float32")]
every = 1 if FAST else 10
shown = [row for row in report.rows if row[0] == 1 or row[0] % every == 0]
print(parity.ParityReport(report.config, report.dtype, report.mode, shown,
                          check=report.check).table())
print(report.verdict())

# %% [markdown]
# Two float32 *trajectories* do drift apart (a sign whose argument is within rounding of
# zero flips on one side, and every later step builds on it), which is why float32 is
# checked one synchronized step at a time; `trajectory=True` reports the drift:

# %%
print(parity.run_parity("sage-hybrid", steps=STEPS, dtype="float32", trajectory=True).verdict())

# %% [markdown]
# ## Same batches, same losses
#
# `mode="model"` trains both models on the same batches instead: the gradients now come
# from each framework's own autodiff, and the losses stay equal step after step.

# %%
model_report = parity.run_parity("sage-hybrid", steps=MODEL_STEPS, dtype="float64",
                                 mode="model")
print(model_report.table())

# %% [markdown]
# ## The full LLaMA: Flax NNX vs `transformers`
#
# `parity.run_llama_parity` builds a random `transformers.LlamaForCausalLM`, converts its
# weights into the trainer's Flax NNX `Llama` parameter tree (`sage_train.hf.convert`), and
# trains both on the same batches with the same configuration, in float64 on both sides
# (transformers' RMSNorm without its float32 cast, sdpa attention; the JAX side's forward is
# `parity.llama_loss`), so losses and parameters agree to float64 rounding.
# (`python -m sage_repro.parity --mode llama --config all` runs it for every configuration.)

# %%
if LLAMA_STEPS:
    llama = parity.run_llama_parity("sage-hybrid", steps=LLAMA_STEPS, model="tiny",
                                    batch=4, seq_len=32)
    print(llama.table())
    print(llama.verdict())
else:
    print("fast mode: the LLaMA comparison is skipped")

# %% [markdown]
# ## Why sign ties exist
#
# SAGE and Lion step by `sign(b1·M_{t−1} + (1−b1)·g)`. `sage_optax` forms the argument from
# the updated momentum as `b1·M_t + (b2−b1)·g` (algebraically the same), `sage_torch` in the
# same way in its fused path; other orderings of the same arithmetic round differently. When
# the argument is within rounding of zero, two correct implementations can disagree on its
# sign, and that element then moves by `2·η·H` in one framework relative to the other.
# The float32 check counts a flipped sign as a tie (the `ties` column) only where its
# argument is within rounding of zero; any other flip fails. With the same formula in both
# frameworks there are none. Here is how often two orderings disagree when the argument is
# near zero, in float32:

# %%
b1, b2 = np.float32(0.9), np.float32(0.99)
gen = np.random.default_rng(1)
g = gen.standard_normal(100_000).astype(np.float32)
m_prev = (-(1 - b1) / b1 * g * (1 + gen.standard_normal(g.size) * 1e-7)).astype(np.float32)
m_new = b2 * m_prev + (1 - b2) * g
direct = b1 * m_prev + (1 - b1) * g  # Algorithm 1 as written
from_new = b1 * m_new + (b2 - b1) * g  # from the updated momentum
disagree = np.sign(direct) != np.sign(from_new)
print(f"near-tie arguments: {g.size}, signs that disagree: {int(disagree.sum())} "
      f"({100 * disagree.mean():.1f}%)")
generic = g[::-1].copy()  # a momentum unrelated to g: the argument is far from zero
disagree = (np.sign(b1 * generic + (1 - b1) * g)
            != np.sign(b1 * (b2 * generic + (1 - b2) * g) + (b2 - b1) * g))
print(f"generic arguments: {g.size}, signs that disagree: {int(disagree.sum())}")
