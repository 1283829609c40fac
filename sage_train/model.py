"""A LLaMA decoder in Flax NNX, numerically the same as Hugging Face ``LlamaForCausalLM``.

Token embedding, then ``num_layers`` pre-norm blocks (RMSNorm → grouped-query attention with
RoPE → residual; RMSNorm → SwiGLU MLP → residual), a final RMSNorm and the vocabulary
projection (the transposed embedding when tied, else ``lm_head``).  Parameter names and
layouts are those of :func:`sage_repro.llama_shapes.llama_param_shapes`, so the SAGE router
places every leaf (``embed.embedding``/``lm_head.kernel`` → embedding, ``*.kernel`` → dense,
``*.scale`` → vector).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from sage_optim.models import LlamaConfig

INIT_STD = 0.02
"""Standard deviation of the normal init of embeddings and kernels (HF ``initializer_range``)."""


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``cos``/``sin`` tables ``(seq_len, head_dim)`` of HF Llama's default RoPE, in float32."""
    inv_freq = 1.0 / theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    freqs = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``(B, T, H, D)`` by position (HF's ``rotate_half`` convention)."""
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return (x32 * cos + rotated * sin).astype(x.dtype)


def _linear(d_in: int, d_out: int, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> nnx.Linear:
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=False,
        kernel_init=nnx.initializers.normal(INIT_STD),
        dtype=dtype,
        param_dtype=param_dtype,
        rngs=rngs,
    )


def _rms_norm(d: int, eps: float, rngs: nnx.Rngs, dtype: Any, param_dtype: Any) -> nnx.RMSNorm:
    return nnx.RMSNorm(d, epsilon=eps, dtype=dtype, param_dtype=param_dtype, rngs=rngs)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE; softmax in float32."""

    def __init__(
        self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any, theta: float
    ):
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.theta = theta
        self.q_proj = _linear(d, config.num_heads * hd, rngs, dtype, param_dtype)
        self.k_proj = _linear(d, config.num_kv_heads * hd, rngs, dtype, param_dtype)
        self.v_proj = _linear(d, config.num_kv_heads * hd, rngs, dtype, param_dtype)
        self.o_proj = _linear(config.num_heads * hd, d, rngs, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(B, T, d)`` → ``(B, T, d)``, position ``t`` attending to positions ``0..t``."""
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = rope_tables(t, self.head_dim, self.theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        repeats = self.num_heads // self.num_kv_heads  # query head h reads kv head h // repeats
        k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)

        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores * (self.head_dim**-0.5)
        causal = jnp.tril(jnp.ones((t, t), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any):
        d, f = config.hidden_size, config.intermediate_size
        self.gate_proj = _linear(d, f, rngs, dtype, param_dtype)
        self.up_proj = _linear(d, f, rngs, dtype, param_dtype)
        self.down_proj = _linear(f, d, rngs, dtype, param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(..., d)`` → ``(..., d)``."""
        return self.down_proj(nnx.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nnx.Module):
    """One pre-norm decoder layer: ``x + attn(attn_norm(x))``, then ``x + mlp(mlp_norm(x))``."""

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any,
        param_dtype: Any,
        theta: float,
        eps: float,
    ):
        d = config.hidden_size
        self.attn_norm = _rms_norm(d, eps, rngs, dtype, param_dtype)
        self.attn = Attention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, theta=theta)
        self.mlp_norm = _rms_norm(d, eps, rngs, dtype, param_dtype)
        self.mlp = MLP(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """``(B, T, d)`` → ``(B, T, d)``."""
        x = x + self.attn(self.attn_norm(x.astype(jnp.float32)))
        return x + self.mlp(self.mlp_norm(x.astype(jnp.float32)))


class Llama(nnx.Module):
    """LLaMA causal language model with the math of HF ``LlamaForCausalLM``.

    Args:
      config: the model shape.
      rngs: initialisation randomness (``params`` stream).
      dtype: computation dtype of the projections (norm statistics, RoPE and softmax are
        always float32; logits are returned in float32).
      param_dtype: storage dtype of the parameters.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        rngs: nnx.Rngs,
        dtype: Any = jnp.float32,
        param_dtype: Any = jnp.float32,
        rope_theta: float = 10000.0,
        norm_eps: float = 1e-6,
    ):
        self.config = config
        d = config.hidden_size
        self.embed = nnx.Embed(
            config.vocab_size,
            d,
            embedding_init=nnx.initializers.normal(INIT_STD),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )
        self.layers = nnx.List(
            Block(
                config,
                rngs=rngs,
                dtype=dtype,
                param_dtype=param_dtype,
                theta=rope_theta,
                eps=norm_eps,
            )
            for _ in range(config.num_layers)
        )
        self.final_norm = _rms_norm(d, norm_eps, rngs, dtype, param_dtype)
        if not config.tie_embeddings:
            self.lm_head = _linear(d, config.vocab_size, rngs, dtype, param_dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Integer tokens ``(B, T)`` at positions ``0..T-1`` → float32 logits ``(B, T, V)``."""
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        x = self.final_norm(x.astype(jnp.float32))
        logits = self.embed.attend(x) if self.config.tie_embeddings else self.lm_head(x)
        return logits.astype(jnp.float32)


def abstract_params(config: LlamaConfig, **model_kwargs: Any) -> nnx.State:
    """The ``nnx.Param`` state of ``Llama(config, **model_kwargs)`` as shapes, nothing allocated."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), **model_kwargs))
    return nnx.state(model, nnx.Param)


def loss_fn(model: Llama, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``model(inputs)`` against ``targets``."""
    logits = model(inputs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


__all__ = ["INIT_STD", "Llama", "abstract_params", "apply_rope", "loss_fn", "rope_tables"]
