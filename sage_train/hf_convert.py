"""Convert between :class:`sage_train.model.Llama` and Hugging Face ``LlamaForCausalLM``.

HF ``nn.Linear`` weights are ``(out, in)``, Flax kernels ``(in, out)``: projections are
transposed, the embedding table ``(V, d)`` and the norm weights are copied as they are.
``torch``/``transformers`` are imported only inside the functions that need them.

Either layout of the decoder layers converts: a scanned model (``layers="scan"``, leaves with
a leading layer axis) is sliced into HF's per-layer tensors on export and restacked on
import (:func:`sage_train.model.per_layer_params`), so the conversion happens here, at the
boundary, and HF names are always per layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from sage_optim.models import LlamaConfig
from sage_train.model import Llama, load_per_layer_params, per_layer_params

EMBED_KEY = "model.embed_tokens.weight"
"""HF name of the token embedding table."""

LM_HEAD_KEY = "lm_head.weight"
"""HF name of the output projection (absent from, or equal to the embedding in, tied models)."""

IGNORED_SUFFIXES: tuple[str, ...] = ("rotary_emb.inv_freq",)
"""HF keys that hold no parameter (buffers some old checkpoints saved); skipped on import."""

_LAYER_NAMES = {
    "attn.q_proj.kernel": "self_attn.q_proj.weight",
    "attn.k_proj.kernel": "self_attn.k_proj.weight",
    "attn.v_proj.kernel": "self_attn.v_proj.weight",
    "attn.o_proj.kernel": "self_attn.o_proj.weight",
    "mlp.gate_proj.kernel": "mlp.gate_proj.weight",
    "mlp.up_proj.kernel": "mlp.up_proj.weight",
    "mlp.down_proj.kernel": "mlp.down_proj.weight",
    "attn_norm.scale": "input_layernorm.weight",
    "mlp_norm.scale": "post_attention_layernorm.weight",
}


def hf_name(path: str) -> str:
    """The HF ``state_dict`` key of the Flax parameter at dotted ``path``."""
    if path == "embed.embedding":
        return EMBED_KEY
    if path == "final_norm.scale":
        return "model.norm.weight"
    if path == "lm_head.kernel":
        return LM_HEAD_KEY
    parts = path.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}"
    raise ValueError(f"no Hugging Face name for parameter {path!r}")


def _is_kernel(path: str) -> bool:
    return path.endswith(".kernel")


def to_hf_config(
    config: LlamaConfig,
    *,
    rope_theta: float = 10000.0,
    rms_norm_eps: float = 1e-6,
    **kwargs: Any,
) -> Any:
    """The ``transformers.LlamaConfig`` of ``config``.

    Pass the ``rope_theta``/``norm_eps`` the :class:`~sage_train.model.Llama` was built with
    (its defaults are these).  ``kwargs`` go to ``transformers.LlamaConfig`` (e.g.
    ``bos_token_id``), overriding the defaults chosen here.
    """
    import transformers

    fields: dict[str, Any] = {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings,
        "hidden_act": "silu",
        "rms_norm_eps": rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
    }
    fields.update(kwargs)
    return transformers.LlamaConfig(**fields)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch.Tensor; numpy has no bfloat16, so widen it first
        x = x.detach().cpu()
        if x.element_size() < 4:
            x = x.float()
        # A copy: jnp.asarray may alias a CPU NumPy buffer, and this one is the torch
        # parameter's storage, which a torch optimizer would then update under JAX's feet.
        return x.numpy().copy()
    return np.array(x, copy=True)


def from_hf_state_dict(model: Llama, state_dict: Mapping[str, Any]) -> None:
    """Load HF ``LlamaForCausalLM`` weights (torch tensors or numpy arrays) into ``model``.

    Linear weights are transposed to kernels and cast to the model's parameter dtypes.  For a
    tied model ``lm_head.weight`` may be absent or equal to ``model.embed_tokens.weight``.

    Raises:
      ValueError: naming every missing or unexpected key and every shape mismatch, or when a
        tied model is given an ``lm_head.weight`` that differs from the embedding.
    """
    current = per_layer_params(model)
    paths = list(current)
    expected = {hf_name(p): p for p in paths}

    given = {k: v for k, v in state_dict.items() if not k.endswith(IGNORED_SUFFIXES)}
    tied = model.config.tie_embeddings
    if tied and LM_HEAD_KEY in given:
        head = given.pop(LM_HEAD_KEY)
        if EMBED_KEY in given and head is not given[EMBED_KEY]:
            if not np.array_equal(_to_numpy(head), _to_numpy(given[EMBED_KEY])):
                raise ValueError(
                    f"the model ties its embeddings, but the state dict's {LM_HEAD_KEY!r} differs "
                    f"from {EMBED_KEY!r}: it comes from an untied model (tie_embeddings=False)"
                )
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:
        problems.append(f"unexpected keys: {unexpected}")

    values: dict[str, Any] = {}
    for path, old in current.items():
        key = hf_name(path)
        if key not in given:
            values[path] = old
            continue
        value = _to_numpy(given[key])
        if _is_kernel(path):
            value = value.T
        if value.shape != tuple(old.shape):
            want = tuple(old.shape)[::-1] if _is_kernel(path) else tuple(old.shape)
            got = value.shape[::-1] if _is_kernel(path) else value.shape
            problems.append(f"shape mismatch for {key!r} ({path}): expected {want}, got {got}")
            values[path] = old
            continue
        values[path] = jnp.asarray(value, dtype=old.dtype)
    if problems:
        raise ValueError(
            "cannot load the Hugging Face state dict into Llama("
            f"{model.config.name!r}, tie_embeddings={tied}): " + "; ".join(problems)
        )
    load_per_layer_params(model, values)


def to_hf_state_dict(model: Llama) -> dict[str, Any]:
    """The HF ``LlamaForCausalLM.state_dict()`` of ``model``: ``{name: torch.Tensor}``.

    Keys come in HF's order.  Like HF, a tied model lists ``lm_head.weight`` too, as the very
    tensor of ``model.embed_tokens.weight``, so ``load_state_dict(..., strict=True)`` accepts it.
    Tensors keep the parameter dtype (``bfloat16`` included) and are contiguous.
    """
    import torch

    out: dict[str, Any] = {}
    for path, value in per_layer_params(model).items():
        array = np.asarray(jnp.asarray(value, jnp.float32))  # numpy/torch interop lacks bf16
        array = np.array(array.T if _is_kernel(path) else array, order="C")  # writable copy
        dtype = getattr(torch, jnp.dtype(value.dtype).name)
        out[hf_name(path)] = torch.from_numpy(array).to(dtype)
    if model.config.tie_embeddings:
        out[LM_HEAD_KEY] = out[EMBED_KEY]
    return {key: out[key] for key in _hf_order(model.config)}


def _hf_order(config: LlamaConfig) -> list[str]:
    names = [EMBED_KEY]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{n}" for n in _LAYER_NAMES.values()]
    names += ["model.norm.weight", LM_HEAD_KEY]
    return names


__all__ = [
    "EMBED_KEY",
    "IGNORED_SUFFIXES",
    "LM_HEAD_KEY",
    "from_hf_state_dict",
    "hf_name",
    "to_hf_config",
    "to_hf_state_dict",
]
