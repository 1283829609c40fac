"""A LLaMA decoder in Flax NNX, numerically the same as Hugging Face ``LlamaForCausalLM``.

Token embedding, then ``num_layers`` pre-norm blocks (RMSNorm → grouped-query attention with
RoPE → residual; RMSNorm → SwiGLU MLP → residual), a final RMSNorm and the vocabulary
projection (the transposed embedding when tied, else ``lm_head``).  Parameter names and
layouts are those of :func:`sage_repro.llama_shapes.llama_param_shapes`, so the SAGE router
places every leaf (``embed.embedding``/``lm_head.kernel`` → embedding, ``*.kernel`` → dense,
``*.scale`` → vector).

Two layouts of the decoder layers: ``layers="loop"`` keeps one module per layer
(``layers.<i>.attn.q_proj.kernel``, the layout of ``llama_param_shapes`` and of Hugging Face),
``layers="scan"`` builds them with ``nnx.vmap`` and runs them with ``nnx.scan``, so every
layer parameter has a leading layer axis (``layers.attn.q_proj.kernel`` of shape
``(L, d, h)``): one compiled layer body instead of ``L``, and the layout the SAGE router
treats as ``L`` stacked matrices when it is given the model (``make_optimizer(...,
model=model)``).  :func:`stack_layers`/:func:`unstack_layers` convert the parameters
between the two; :mod:`sage_train.hf.convert` accepts either.  ``remat`` recomputes each
layer's activations in the backward pass (``"dots"``: all but the unbatched matmuls,
``"full"``: everything), trading compute for memory.

Attention (:func:`causal_attention`) is :func:`jax.nn.dot_product_attention` with one of two
implementations: ``"xla"``, XLA's, which materialises the float32 ``T x T`` scores of every
head, and ``"cudnn"``, cuDNN's fused (flash) attention, which never forms them but runs only on
a CUDA GPU in bfloat16/float16 with a head dim that is a multiple of 8 (at most 128 here).
``attention="cudnn"`` opts in to cuDNN's; ``attention="auto"`` (the default) takes it only
where the computation runs on a CUDA device, cuDNN can run it and ``scripts/gpu-check`` has
shown it correct and faster on that GPU (:mod:`sage_optim.kernels`: H100s), XLA's
elsewhere; the choice is made per compiled program, by where the arrays are
(:mod:`sage_optax.placement`), and the rule lives in :func:`attention_choice`.

The loss (:func:`loss_fn`) can be computed over chunks of tokens (``loss_chunk``): the
vocabulary projection, log-softmax and cross-entropy of one chunk at a time in a
``jax.lax.scan`` that also forms the chunk's gradients, so that only one chunk's float32
logits (and their gradient) are ever alive instead of ``batch x seq x vocab`` of them: 7.8
GiB each for 16 x 1024 tokens of a 128,256-token vocabulary (:func:`chunked_cross_entropy`).
"""

from __future__ import annotations

import functools
import math
import numbers
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import sage_optax
from sage_optax import placement
from sage_optim import kernels
from sage_train.model.shapes import LlamaConfig

INIT_STD = 0.02
"""Standard deviation of the normal init of embeddings and kernels (HF ``initializer_range``)."""

LAYER_MODES: tuple[str, ...] = ("scan", "loop")
"""How the decoder layers run: stacked and scanned, or one module per layer (``--layers``)."""

REMAT_POLICIES: dict[str, Any] = {
    "none": None,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": jax.checkpoint_policies.nothing_saveable,
}
"""``--remat`` choices: no rematerialisation; save the weight matmuls' outputs and recompute
the rest (norms, RoPE, attention, activations); save nothing but each layer's input."""


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


ATTENTIONS: tuple[str, ...] = ("auto", "cudnn", "xla")
"""``attention`` choices: ``auto`` (cuDNN's fused attention where it can run and has been
validated on the GPU, else XLA's), ``cudnn`` (cuDNN's, refused where it cannot run) and
``xla`` (XLA's, everywhere).  ``SAGE_KERNELS=off`` makes every choice XLA's."""

CUDNN_DTYPES: tuple[str, ...] = ("bfloat16", "float16")
"""Computation dtypes of cuDNN's flash attention (it has no float32 flash kernel)."""

CUDNN_MAX_HEAD_DIM = 128
"""Largest head dim taken for cuDNN's flash attention: every GPU's limit (Hopper and later
allow 256, which this rule does not rely on)."""


def cudnn_present() -> bool:
    """Whether this JAX can trace cuDNN's fused attention (``False``: no cuDNN detected).

    Asks :func:`jax.nn.dot_product_attention` itself, on abstract bfloat16 inputs (nothing is
    computed or compiled): a JAX without cuDNN (every CPU-only jaxlib) raises there.
    """
    x = jax.ShapeDtypeStruct((1, 8, 1, 8), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(jax.nn.dot_product_attention, is_causal=True,
                                         implementation="cudnn"), x, x, x)
    except RuntimeError:
        return False
    return True


def cudnn_problem(platform: str, dtype: Any, head_dim: int, *,
                  cudnn: bool = True) -> str | None:
    """Why cuDNN's fused attention cannot run there, or ``None`` where it can.

    Args:
      platform: where the computation runs (``"cuda"``, ``"cpu"``...; ``"gpu"`` is taken as
        CUDA), as :mod:`sage_optax.placement` names it.
      dtype: the dtype of the queries, keys and values (the computation dtype).
      head_dim: the size of each attention head.
      cudnn: whether this JAX has cuDNN (:func:`cudnn_present`).

    Returns:
      One clause naming the first condition that fails: a CUDA platform, cuDNN, a dtype of
      :data:`CUDNN_DTYPES`, a head dim that is a multiple of 8 and at most
      :data:`CUDNN_MAX_HEAD_DIM`; ``None`` when all hold.
    """
    if platform not in ("cuda", "gpu"):
        return f"cuDNN attention needs a CUDA GPU, and the computation runs on {platform}"
    if not cudnn:
        return "this JAX has no cuDNN (jax.nn.dot_product_attention does not detect it)"
    name = jnp.dtype(dtype).name
    if name not in CUDNN_DTYPES:
        return f"cuDNN flash attention needs bfloat16 or float16, and the attention is {name}"
    if head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return (f"cuDNN flash attention needs a head dim that is a multiple of 8 and at most "
                f"{CUDNN_MAX_HEAD_DIM}, and the model's is {head_dim}")
    return None


def cudnn_supported(platform: str, dtype: Any, head_dim: int, *, cudnn: bool = True) -> bool:
    """Whether cuDNN's fused attention can run there (:func:`cudnn_problem` finds nothing)."""
    return cudnn_problem(platform, dtype, head_dim, cudnn=cudnn) is None


def attention_choice(requested: str, platform: str, dtype: Any, head_dim: int, *,
                     cudnn: bool = True, device_kind: str | None = None) -> tuple[str, str]:
    """The implementation ``requested`` (:data:`ATTENTIONS`) computes with there, and why.

    The one rule of the choice: ``"auto"`` takes ``"cudnn"`` where :func:`cudnn_supported`
    (a CUDA platform, cuDNN present, bfloat16/float16, a head dim that is a multiple of 8
    and at most 128) *and* ``scripts/gpu-check`` has shown it correct and faster on that GPU
    (``device_kind``, :func:`sage_optim.kernels.validated`: H100s), ``"xla"``
    elsewhere; ``"xla"`` is XLA's everywhere; ``"cudnn"`` is cuDNN's (the opt-in), and
    refused where it cannot run.  Other arguments as :func:`cudnn_problem`.

    Returns:
      ``(implementation, reason)``: ``"cudnn"`` or ``"xla"``, and ``"auto: ..."`` or
      ``"requested: ..."`` saying why, e.g. ``("cudnn", "auto: cuDNN flash attention,
      bfloat16, head dim 64, cuda")``.

    Raises:
      ValueError: ``requested`` is not one of :data:`ATTENTIONS`, or is ``"cudnn"`` where
        cuDNN's attention cannot run (the message names the reason).
    """
    if requested not in ATTENTIONS:
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {requested!r}")
    if requested == "xla":
        return "xla", "requested: XLA's attention, float32 T x T scores materialised"
    if not kernels.kernels_enabled():
        if requested == "cudnn":
            kernels.warn_overridden("attention='cudnn'")
        return "xla", f"{requested}: {kernels.ENV_VAR}=off"
    problem = cudnn_problem(platform, dtype, head_dim, cudnn=cudnn)
    if problem is None and (requested == "cudnn"
                            or kernels.validated("cudnn-attention", device_kind)):
        return "cudnn", (f"{requested}: cuDNN flash attention, {jnp.dtype(dtype).name}, "
                         f"head dim {head_dim}, {platform}")
    if requested == "cudnn":
        raise ValueError(f"attention='cudnn' cannot run here: {problem}")
    if problem is None:
        return "xla", (f"auto: cuDNN attention is not yet validated on {device_kind or 'this GPU'}"
                       " by scripts/gpu-check (opt in with attention='cudnn')")
    return "xla", f"auto: {problem}"


def attention_implementation(requested: str, platform: str, dtype: Any, head_dim: int, *,
                             cudnn: bool = True, device_kind: str | None = None) -> str:
    """``"cudnn"`` or ``"xla"``: what ``requested`` computes with there.

    The first item of :func:`attention_choice` (same arguments, same errors).
    """
    return attention_choice(requested, platform, dtype, head_dim, cudnn=cudnn,
                            device_kind=device_kind)[0]


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """XLA's causal attention (``implementation="xla"``: the float32 scores materialised)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                        implementation="xla")


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, scale: float) -> jax.Array:
    """The fused causal attention of cuDNN (``implementation="cudnn"``; a CUDA GPU only)."""
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                        implementation="cudnn")


def _platform_of(args: Any) -> str:
    """Where a computation on ``args`` runs.

    Their devices' platform; under a trace, ``"cuda"`` where this process has a CUDA device
    (the branch the model would compile for it), else the default backend's.
    """
    platform = placement.concrete_platform(args)
    if platform is not None:
        return platform
    return "cuda" if placement.cuda_device_count() > 0 else jax.default_backend()


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, attention: str = "auto",
                     scale: float | None = None) -> jax.Array:
    """Causal grouped-query attention by the implementation ``attention`` selects.

    ``q`` ``(B, T, H, D)``, ``k``/``v`` ``(B, T, K, D)`` with ``H`` a multiple of ``K`` (query
    head ``h`` reads kv head ``h // (H // K)``); logits and softmax in float32; ``scale``
    defaults to ``D ** -0.5``.  ``"auto"`` goes through :func:`sage_optax.placement.by_platform`:
    XLA's attention for arrays on the CPU (and every platform but CUDA), cuDNN's for arrays
    on a CUDA device where :func:`attention_choice` takes it; on a machine without a CUDA
    device only XLA's is traced, so the program is exactly ``"xla"``'s.  ``"cudnn"`` always
    calls cuDNN's and raises where it cannot run.

    Raises:
      ValueError: an unknown ``attention``, or ``"cudnn"`` where cuDNN's attention cannot
        run (no CUDA device, no cuDNN, float32, an unsupported head dim).
    """
    head_dim = q.shape[-1]
    scale = head_dim**-0.5 if scale is None else scale
    xla = functools.partial(xla_attention, scale=scale)
    cudnn = functools.partial(cudnn_attention, scale=scale)
    if attention == "xla":
        return xla(q, k, v)
    if attention == "cudnn":
        impl, _ = attention_choice("cudnn", _platform_of((q, k, v)), q.dtype, head_dim,
                                   cudnn=cudnn_present())
        return cudnn(q, k, v) if impl == "cudnn" else xla(q, k, v)  # xla: SAGE_KERNELS=off
    if attention != "auto":
        raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
    cuda = None
    if placement.cuda_device_count() > 0 and attention_implementation(
            "auto", "cuda", q.dtype, head_dim, cudnn=cudnn_present(),
            device_kind=placement.cuda_device_kind()) == "cudnn":
        cuda = cudnn
    return placement.by_platform((q, k, v), cpu=xla, cuda=cuda)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal grouped-query attention written out (the score matrix materialised).

    ``q`` ``(B, T, H, D)``, ``k``/``v`` ``(B, T, K, D)`` with ``H`` a multiple of ``K``; logits
    and softmax in float32.  The model uses :func:`causal_attention`; this is the math it
    must match (tests).
    """
    t, h, d = q.shape[1], q.shape[2], q.shape[3]
    repeats = h // k.shape[2]  # query head i reads kv head i // repeats
    k, v = jnp.repeat(k, repeats, axis=2), jnp.repeat(v, repeats, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


class Attention(nnx.Module):
    """Causal grouped-query self-attention with RoPE, by :func:`causal_attention`.

    ``attention`` is its implementation (:data:`ATTENTIONS`).
    """

    def __init__(
        self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype: Any, param_dtype: Any, theta: float,
        attention: str = "auto",
    ):
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.theta, self.attention = theta, attention
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
        # Grouped-query heads are native to dot_product_attention (query head h reads kv head
        # h // (num_heads // num_kv_heads)); logits and softmax are float32 inside it.  Its
        # default (implementation=None) is XLA's attention on every platform, GPUs included
        # (the float32 T x T scores materialised): causal_attention picks cuDNN's flash
        # attention explicitly, on CUDA arrays, where attention="auto" allows it.
        out = causal_attention(q, k, v, self.attention, scale=self.head_dim**-0.5)
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
        attention: str = "auto",
    ):
        d = config.hidden_size
        self.attn_norm = _rms_norm(d, eps, rngs, dtype, param_dtype)
        self.attn = Attention(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype, theta=theta,
                              attention=attention)
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
      dtype: computation dtype of the projections (norm statistics, RoPE, attention logits
        and softmax are always float32; logits are returned in float32).
      param_dtype: storage dtype of the parameters.
      rope_theta: RoPE base.
      norm_eps: RMSNorm epsilon.
      layers: ``"loop"`` (one module per layer) or ``"scan"`` (stacked, run by ``nnx.scan``);
        see the module docstring.  The two compute the same function of the same
        parameters (:func:`stack_layers`), but draw different initial values.
      remat: ``"none"``, ``"dots"`` or ``"full"`` (:data:`REMAT_POLICIES`).
      loss_chunk: tokens per chunk of :func:`loss_fn`'s chunked cross-entropy, an integer
        ``>= 0``; 0 computes the loss over all the logits at once.  It changes no value
        beyond float32 summation order; only the memory the loss needs.
      attention: the attention's implementation, ``"auto"``, ``"cudnn"`` or ``"xla"``
        (:data:`ATTENTIONS`, :func:`causal_attention`).  cuDNN's and XLA's compute the same
        function, with different rounding (and far less memory for cuDNN's).
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
        layers: Literal["loop", "scan"] = "loop",
        remat: Literal["none", "dots", "full"] = "none",
        loss_chunk: int = 0,
        attention: Literal["auto", "cudnn", "xla"] = "auto",
    ):
        if layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {LAYER_MODES}, got {layers!r}")
        if remat not in REMAT_POLICIES:
            raise ValueError(f"remat must be one of {tuple(REMAT_POLICIES)}, got {remat!r}")
        check_loss_chunk(loss_chunk)
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
        self.config = config
        self.layout, self.remat, self.loss_chunk = layers, remat, int(loss_chunk)
        self.attention = attention
        self.rope_theta, self.norm_eps = float(rope_theta), float(norm_eps)
        d = config.hidden_size
        self.embed = nnx.Embed(
            config.vocab_size,
            d,
            embedding_init=nnx.initializers.normal(INIT_STD),
            dtype=dtype,
            param_dtype=param_dtype,
            rngs=rngs,
        )

        def block(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                         theta=rope_theta, eps=norm_eps, attention=attention)

        if layers == "scan":
            stacked = nnx.split_rngs(splits=config.num_layers)(
                nnx.vmap(block, in_axes=(0,), out_axes=0, axis_size=config.num_layers))
            self.layers: Any = stacked(rngs)
        else:
            self.layers = nnx.List(block(rngs) for _ in range(config.num_layers))
        self.final_norm = _rms_norm(d, norm_eps, rngs, dtype, param_dtype)
        if not config.tie_embeddings:
            self.lm_head = _linear(d, config.vocab_size, rngs, dtype, param_dtype)

    def _decoder(self, x: jax.Array) -> jax.Array:
        def apply(layer: Block, x: jax.Array) -> jax.Array:
            return layer(x)

        if self.remat != "none":
            # In a scan the loop boundary already keeps XLA from merging the recomputation
            # into the forward pass, so CSE prevention is only needed unrolled.
            apply = nnx.remat(apply, policy=REMAT_POLICIES[self.remat],
                              prevent_cse=self.layout == "loop")
        if self.layout == "loop":
            for layer in self.layers:
                x = apply(layer, x)
            return x

        def body(x: jax.Array, layer: Block) -> jax.Array:
            return apply(layer, x)

        return nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)(x, self.layers)

    def hidden(self, tokens: jax.Array) -> jax.Array:
        """Integer tokens ``(B, T)`` → the final-normed hidden states ``(B, T, d)``.

        In the computation dtype; :meth:`head` of them is :meth:`__call__`.
        """
        x = self._decoder(self.embed(tokens))
        return self.final_norm(x.astype(jnp.float32))

    def head_weights(self) -> tuple[jax.Array, Any]:
        """The output layer ``(W, dtype)`` of :meth:`head`.

        ``W`` ``(V, d)`` is the embedding when tied, else ``lm_head``'s kernel transposed;
        ``dtype`` is the computation dtype of its matmul.
        """
        if self.config.tie_embeddings:
            return self.embed.embedding[...], self.embed.dtype
        return self.lm_head.kernel[...].T, self.lm_head.dtype

    def head(self, x: jax.Array) -> jax.Array:
        """Hidden states ``(..., d)`` → float32 logits ``(..., V)`` (:func:`head_logits`)."""
        w, dtype = self.head_weights()
        return head_logits(x, w, dtype)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        """Integer tokens ``(B, T)`` at positions ``0..T-1`` → float32 logits ``(B, T, V)``."""
        return self.head(self.hidden(tokens))


def per_layer_params(model: Llama) -> dict[str, jax.Array]:
    """Every parameter by its per-layer dotted path (``layers.<i>.<name>``), in either layout.

    The stacked leaves of a scanned model are sliced along their layer axis; the others are
    returned as they are.  Order: the model's own leaf order, layers expanded in place.
    """
    out: dict[str, jax.Array] = {}
    for p, x in jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]:
        path = _dotted(p)
        if model.layout == "scan" and path.startswith("layers."):
            for i in range(x.shape[0]):
                out[f"layers.{i}.{path[len('layers.'):]}"] = x[i]
        else:
            out[path] = x
    return out


def load_per_layer_params(model: Llama, values: dict[str, Any]) -> None:
    """Set every parameter of ``model`` from ``values`` keyed as :func:`per_layer_params`.

    Values are cast to each parameter's dtype; a scanned model's layers are stacked.

    Raises:
      KeyError: a parameter of the model is missing from ``values``.
    """
    state = nnx.state(model, nnx.Param)
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    leaves = []
    for p, old in flat:
        path = _dotted(p)
        if model.layout == "scan" and path.startswith("layers."):
            rest = path[len("layers."):]
            value = jnp.stack([jnp.asarray(values[f"layers.{i}.{rest}"])
                               for i in range(old.shape[0])])
        else:
            value = jnp.asarray(values[path])
        leaves.append(value.astype(old.dtype))
    nnx.update(model, jax.tree_util.tree_unflatten(treedef, leaves))


def stack_layers(source: Llama, target: Llama) -> None:
    """Copy the parameters of ``source`` into ``target``, whatever the layout of each."""
    load_per_layer_params(target, per_layer_params(source))


unstack_layers = stack_layers
"""The same copy, named for the other direction (scanned ``source``, looped ``target``)."""


def _dotted(key_path: Any) -> str:
    return str(sage_optax.leaf_name_path(key_path))


def abstract_params(config: LlamaConfig, **model_kwargs: Any) -> nnx.State:
    """The ``nnx.Param`` state of ``Llama(config, **model_kwargs)`` as shapes, nothing allocated."""
    model = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0), **model_kwargs))
    return nnx.state(model, nnx.Param)


def check_loss_chunk(loss_chunk: Any) -> None:
    """Refuse a ``loss_chunk`` that is not an integer ``>= 0``.

    Raises:
      ValueError: naming ``loss_chunk`` and the value.
    """
    if isinstance(loss_chunk, bool) or not isinstance(loss_chunk, numbers.Integral) \
            or loss_chunk < 0:
        raise ValueError(f"loss_chunk must be an integer >= 0 (0: unchunked), "
                         f"got {loss_chunk!r}")


def head_logits(x: jax.Array, w: jax.Array, dtype: Any = None) -> jax.Array:
    """Float32 logits ``x @ w.T`` of hidden states ``(..., d)`` and an output layer ``(V, d)``.

    The operands in ``dtype`` (default: their common dtype), the products accumulated and
    returned in float32 (never rounded to bfloat16).
    """
    dtype = dtype if dtype is not None else jnp.result_type(x, w)
    return jnp.einsum("...d,vd->...v", x.astype(dtype), w.astype(dtype),
                      preferred_element_type=jnp.float32)


def chunked_cross_entropy(x: jax.Array, w: jax.Array, targets: jax.Array, chunk: int,
                          dtype: Any = None) -> jax.Array:
    """Mean cross-entropy of the logits ``head_logits(x, w, dtype)``, ``chunk`` tokens at a time.

    The value of ``optax.softmax_cross_entropy_with_integer_labels(head_logits(x, w, dtype),
    targets).mean()`` (float32 log-softmax; only the order of the sums differs), but the
    logits of only one chunk exist at a time: a ``jax.lax.scan`` over the chunks.  Under
    differentiation (a ``jax.custom_vjp``) the same scan also forms each chunk's gradient
    (``softmax - onehot``) and from it the gradients of ``x`` and ``w`` (accumulated over the
    chunks in float32), which the backward pass only scales: no logits are stored and none
    are recomputed, so the matmuls are those of the unchunked loss and its gradient.  (Not
    differentiable twice.)

    Chunk ``i`` holds the tokens ``i, i + n, i + 2n, ...`` of the flattened batch (``n``
    chunks), so a batch sharded over its leading axis stays sharded inside every chunk; a
    token count that ``chunk`` does not divide is padded with tokens that count for nothing.

    Args:
      x: hidden states ``(..., d)``.
      w: the output layer ``(V, d)``.
      targets: integer labels of the shape of ``x`` without its last axis.
      chunk: tokens per chunk, ``>= 1``.
      dtype: computation dtype of the matmuls (:func:`head_logits`).

    Returns:
      The float32 scalar mean over every token.

    Raises:
      ValueError: ``chunk`` is not an integer ``>= 1``.
    """
    check_loss_chunk(chunk)
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy needs loss_chunk >= 1, got {chunk}")
    dtype = jnp.dtype(dtype if dtype is not None else jnp.result_type(x, w))
    return _chunked_ce(x, w, targets, int(chunk), dtype)


def _chunks(x: jax.Array, targets: jax.Array, chunk: int
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(n, chunk, d)`` hidden states, ``(n, chunk)`` targets and validity of ``n`` chunks."""
    d = x.shape[-1]
    x, targets = x.reshape(-1, d), targets.reshape(-1)
    total = x.shape[0]
    n = math.ceil(total / chunk)
    pad = n * chunk - total
    valid = jnp.ones((total,), jnp.bool_)
    if pad:
        x = jnp.concatenate([x, jnp.zeros((pad, d), x.dtype)])
        targets = jnp.concatenate([targets, jnp.zeros((pad,), targets.dtype)])
        valid = jnp.concatenate([valid, jnp.zeros((pad,), jnp.bool_)])
    # token j * n + i goes to chunk i: the leading (batch) axis stays the leading axis of
    # every chunk
    return (jnp.swapaxes(x.reshape(chunk, n, d), 0, 1), targets.reshape(chunk, n).T,
            valid.reshape(chunk, n).T)


def _unchunk(xs: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of :func:`_chunks` for ``(n, chunk, d)`` values of the hidden states."""
    n, chunk, d = xs.shape
    total = math.prod(shape[:-1])
    return jnp.swapaxes(xs, 0, 1).reshape(n * chunk, d)[:total].reshape(shape)


def _chunk_losses(logits: jax.Array, targets: jax.Array, valid: jax.Array) -> jax.Array:
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(jnp.where(valid, losses, 0.0), dtype=jnp.float32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_ce(x: jax.Array, w: jax.Array, targets: jax.Array, chunk: int,
                dtype: Any) -> jax.Array:
    xs, ts, vs = _chunks(x, targets, chunk)

    def body(acc: jax.Array, c: tuple[jax.Array, jax.Array, jax.Array]
             ) -> tuple[jax.Array, None]:
        return acc + _chunk_losses(head_logits(c[0], w, dtype), c[1], c[2]), None

    acc, _ = jax.lax.scan(body, jnp.zeros((), jnp.float32), (xs, ts, vs))
    return acc / targets.size


def _chunked_ce_fwd(x: jax.Array, w: jax.Array, targets: jax.Array, chunk: int,
                    dtype: Any) -> tuple[jax.Array, Any]:
    xs, ts, vs = _chunks(x, targets, chunk)
    total = targets.size
    wc = w.astype(dtype)

    def body(carry: tuple[jax.Array, jax.Array], c: tuple[jax.Array, jax.Array, jax.Array]
             ) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
        acc, gw = carry
        xc, tc, vc = c
        xc = xc.astype(dtype)
        logits = jnp.einsum("cd,vd->cv", xc, wc, preferred_element_type=jnp.float32)
        acc = acc + _chunk_losses(logits, tc, vc)
        # d(mean loss)/d(logits) of this chunk: (softmax - onehot) / tokens, padding zero
        g = jax.nn.softmax(logits, axis=-1) - jax.nn.one_hot(tc, logits.shape[-1],
                                                             dtype=jnp.float32)
        g = (jnp.where(vc[:, None], g, 0.0) / total).astype(dtype)
        gx = jnp.einsum("cv,vd->cd", g, wc, preferred_element_type=jnp.float32)
        gw = gw + jnp.einsum("cv,cd->vd", g, xc, preferred_element_type=jnp.float32)
        return (acc, gw), gx.astype(x.dtype)

    init = (jnp.zeros((), jnp.float32), jnp.zeros(w.shape, jnp.float32))
    (acc, gw), gxs = jax.lax.scan(body, init, (xs, ts, vs))
    return acc / total, (_unchunk(gxs, x.shape), gw.astype(w.dtype), targets)


def _chunked_ce_bwd(chunk: int, dtype: Any, res: Any, g: jax.Array
                    ) -> tuple[jax.Array, jax.Array, Any]:
    gx, gw, targets = res
    zero_targets = np.zeros(targets.shape, jax.dtypes.float0)
    return (g * gx).astype(gx.dtype), (g * gw).astype(gw.dtype), zero_targets


_chunked_ce.defvjp(_chunked_ce_fwd, _chunked_ce_bwd)


def loss_fn(model: Llama, inputs: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (float32) of ``model(inputs)`` against ``targets``.

    Over chunks of ``model.loss_chunk`` tokens (:func:`chunked_cross_entropy`) when that is
    set and smaller than the batch; else over all the logits at once.
    """
    chunk = model.loss_chunk
    if chunk == 0 or chunk >= inputs.size:
        logits = model(inputs)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    w, dtype = model.head_weights()
    return chunked_cross_entropy(model.hidden(inputs), w, targets, chunk, dtype)


__all__ = [
    "ATTENTIONS",
    "CUDNN_DTYPES",
    "CUDNN_MAX_HEAD_DIM",
    "INIT_STD",
    "LAYER_MODES",
    "REMAT_POLICIES",
    "Llama",
    "abstract_params",
    "apply_rope",
    "attention_choice",
    "attention_implementation",
    "causal_attention",
    "check_loss_chunk",
    "chunked_cross_entropy",
    "cudnn_attention",
    "cudnn_present",
    "cudnn_problem",
    "cudnn_supported",
    "head_logits",
    "load_per_layer_params",
    "loss_fn",
    "per_layer_params",
    "reference_attention",
    "rope_tables",
    "stack_layers",
    "unstack_layers",
    "xla_attention",
]
