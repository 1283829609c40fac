# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # sage_optax quickstart
#
# Build the paper's SAGE-Hybrid for a small Flax NNX model, look at how it routes each
# parameter, chain it into an Optax pipeline and train a few steps.

# %%
import jax
import optax
from flax import nnx

import sage_optax


class TinyLM(nnx.Module):
    """Embedding -> RMSNorm -> MLP -> tied logits."""

    def __init__(self, vocab: int, dim: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.norm = nnx.RMSNorm(dim, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        h = self.embed(tokens)
        h = h + self.down(jax.nn.gelu(self.up(self.norm(h))))
        return self.embed.attend(h)


model = TinyLM(vocab=64, dim=32, rngs=nnx.Rngs(0))

# %% [markdown]
# ## The routing table
# Every parameter gets a kind (embedding / dense / vector), a rule, and its exact state bytes.

# %%
print(sage_optax.routing_table("sage-hybrid", nnx.state(model, nnx.Param)))

# %% [markdown]
# ## An Optax pipeline: clipping, warmup + cosine, SAGE-Hybrid

# %%
steps = 60
schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=6, decay_steps=steps)
tx = optax.chain(
    optax.clip_by_global_norm(1.0),
    sage_optax.make_optimizer("sage-hybrid", learning_rate=schedule),
)
optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

tokens = jax.random.randint(jax.random.key(1), (128,), 0, 64)
targets = (tokens * 5 + 1) % 64


@nnx.jit
def train_step(model, optimizer, tokens, targets):
    def loss_fn(model):
        logits = model(tokens)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


losses = [float(train_step(model, optimizer, tokens, targets)) for _ in range(steps)]
print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
assert losses[-1] < losses[0]

# %% [markdown]
# ## Memory of the paper's models, without allocating them

# %%
from sage_repro.memory_report import format_memory_table  # noqa: E402

print(format_memory_table(("270m",)))
print("optimizer state of this model:", sage_optax.state_bytes(optimizer.opt_state), "bytes")
