"""Abstract LLaMA parameter trees in Flax NNX layout, for counting memory without allocating."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sage_optim.routing import Route
from sage_train.model.shapes import LlamaConfig

STACKED_ROUTES: dict[str, Route] = {
    "layers.*.kernel": Route("dense", fan_in=-2, fan_out=-1),
    "layers.*.scale": Route("vector", batch=0),
}
"""Route overrides that declare the stacked layout of :func:`llama_param_shapes`
(``stacked=True``): a plain pytree does not say that its leading axis is the layer axis."""


def llama_param_shapes(
    config: LlamaConfig, dtype: Any = jnp.float32, *, stacked: bool = False
) -> dict[str, Any]:
    """The parameter tree of a LLaMA model as ``jax.ShapeDtypeStruct`` leaves.

    Names and layouts follow Flax NNX (``nnx.Embed.embedding`` ``(V, d)``,
    ``nnx.Linear.kernel`` ``(in, out)``, ``nnx.RMSNorm.scale`` ``(d,)``), one entry per
    layer, projections without biases; an untied model adds ``lm_head.kernel`` ``(d, V)``.
    ``stacked=True`` gives the layout of an ``nnx.scan`` model instead: one ``layers``
    subtree whose leaves have a leading layer axis (route it with :data:`STACKED_ROUTES`).
    """
    d, f, v = config.hidden_size, config.intermediate_size, config.vocab_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim

    def s(*shape: int) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype)

    def stack(tree: Any) -> Any:
        return jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((config.num_layers, *x.shape), x.dtype), tree
        )

    def layer() -> dict[str, Any]:
        return {
            "attn": {
                "q_proj": {"kernel": s(d, q)},
                "k_proj": {"kernel": s(d, kv)},
                "v_proj": {"kernel": s(d, kv)},
                "o_proj": {"kernel": s(q, d)},
            },
            "mlp": {
                "gate_proj": {"kernel": s(d, f)},
                "up_proj": {"kernel": s(d, f)},
                "down_proj": {"kernel": s(f, d)},
            },
            "attn_norm": {"scale": s(d)},
            "mlp_norm": {"scale": s(d)},
        }

    tree: dict[str, Any] = {
        "embed": {"embedding": s(v, d)},
        "layers": (stack(layer()) if stacked
                   else {str(i): layer() for i in range(config.num_layers)}),
        "final_norm": {"scale": s(d)},
    }
    if not config.tie_embeddings:
        tree["lm_head"] = {"kernel": s(d, v)}
    return tree
