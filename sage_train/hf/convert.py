"""Convert between :class:`sage_train.model.llama.Llama` and Hugging Face ``LlamaForCausalLM``.

HF ``nn.Linear`` weights are ``(out, in)``, Flax kernels ``(in, out)``: projections are
transposed, the embedding table ``(V, d)`` and the norm weights are copied as they are.
``torch``/``transformers`` are imported only inside the functions that need them.

Either layout of the decoder layers converts: a scanned model (``layers="scan"``, leaves with
a leading layer axis) is sliced into HF's per-layer tensors on export and restacked on
import (:func:`sage_train.model.llama.per_layer_params`), so the conversion happens here, at the
boundary, and HF names are always per layer.

On disk (what ``sage-train export`` writes and ``--init-from-hf`` reads):
:func:`save_pretrained` writes a directory that ``transformers``' ``AutoModelForCausalLM``
and ``AutoTokenizer`` load offline (``config.json``, ``model.safetensors``, the tokenizer);
:func:`read_config`, :func:`config_mismatches` and :func:`load_weights` read one back
(``safetensors`` only: no torch, no transformers).
"""

from __future__ import annotations

import json
import math
import operator
import os
import pathlib
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp
import numpy as np

from sage_train.model.llama import Llama, load_per_layer_params, per_layer_params
from sage_train.model.shapes import LlamaConfig, read_json_object

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

    Pass the ``rope_theta``/``norm_eps`` the :class:`~sage_train.model.llama.Llama` was built with
    (its defaults are these).  ``kwargs`` go to ``transformers.LlamaConfig`` (e.g.
    ``bos_token_id``), overriding the defaults chosen here.
    """
    import transformers

    fields = hf_config_fields(config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
    fields.update(kwargs)
    return transformers.LlamaConfig(**fields)


def hf_config_fields(config: LlamaConfig, *, rope_theta: float = 10000.0,
                     rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """The ``transformers.LlamaConfig`` fields of ``config`` (:func:`to_hf_config`'s)."""
    return {
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


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch.Tensor; numpy has no bfloat16, so widen it first
        x = x.detach().cpu()
        if x.element_size() < 4:
            x = x.float()
        # A copy: jnp.asarray may alias a CPU NumPy buffer, and this one is the torch
        # parameter's storage, which a torch optimizer would then update under JAX's feet.
        return x.numpy().copy()
    return np.array(x, copy=True)


def _drop_tied_head(given: dict[str, Any]) -> None:
    """Drop ``lm_head.weight`` from ``given`` for a tied model; refuse one unlike the embedding."""
    head = given.pop(LM_HEAD_KEY)
    if EMBED_KEY in given and head is not given[EMBED_KEY]:
        if not np.array_equal(_to_numpy(head), _to_numpy(given[EMBED_KEY])):
            raise ValueError(
                f"the model ties its embeddings, but the state dict's {LM_HEAD_KEY!r} differs "
                f"from {EMBED_KEY!r}: it comes from an untied model (tie_embeddings=False)"
            )


def _loaded_value(path: str, old: Any, given: Mapping[str, Any], problems: list[str]) -> Any:
    """The new value of the parameter at ``path`` from ``given``.

    ``old`` where ``given`` lacks it, or where its shape is wrong (noted in ``problems``).
    """
    key = hf_name(path)
    if key not in given:
        return old
    value = _to_numpy(given[key])
    if _is_kernel(path):
        value = value.T
    if value.shape != tuple(old.shape):
        want = tuple(old.shape)[::-1] if _is_kernel(path) else tuple(old.shape)
        got = value.shape[::-1] if _is_kernel(path) else value.shape
        problems.append(f"shape mismatch for {key!r} ({path}): expected {want}, got {got}")
        return old
    return jnp.asarray(value, dtype=old.dtype)


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
        _drop_tied_head(given)
    missing = sorted(set(expected) - set(given))
    unexpected = sorted(set(given) - set(expected))
    problems = []
    if missing:
        problems.append(f"missing keys: {missing}")
    if unexpected:
        problems.append(f"unexpected keys: {unexpected}")

    values = {path: _loaded_value(path, old, given, problems)
              for path, old in current.items()}
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


def to_hf_arrays(model: Llama) -> dict[str, np.ndarray]:
    """The HF tensors of ``model`` as NumPy arrays (``bfloat16`` too), in HF's order.

    Like :func:`to_hf_state_dict` without torch; a tied model has no ``lm_head.weight`` (HF
    ties it to the embedding on load).
    """
    out = {}
    for path, value in per_layer_params(model).items():
        array = np.asarray(value)
        out[hf_name(path)] = np.ascontiguousarray(array.T if _is_kernel(path) else array)
    return {key: out[key] for key in _hf_order(model.config) if key in out}


CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"


def save_pretrained(model: Llama, directory: os.PathLike[str] | str, *,
                    tokenizer_json: str | None = None, eos_token: str | None = None,
                    **config_kwargs: Any) -> list[pathlib.Path]:
    """Write ``model`` as a Hugging Face ``LlamaForCausalLM`` checkpoint in ``directory``.

    ``config.json`` (:func:`to_hf_config` with ``config_kwargs``; its ``dtype`` the
    parameters'), ``model.safetensors`` (the parameters in their dtype) and, given
    ``tokenizer_json`` (a ``tokenizers`` tokenizer's JSON), ``tokenizer.json`` with a
    ``tokenizer_config.json`` naming ``PreTrainedTokenizerFast`` and ``eos_token`` (also
    the BOS token).  Each file is written atomically; the directory is created.

    Returns:
      The files written.

    Raises:
      RunFileError: a file could not be written (one line naming it).
    """
    import safetensors.numpy

    from sage_train.job.errors import write_error
    from sage_train.store.rundir import atomic_write_bytes

    out = pathlib.Path(directory)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise write_error(out, e) from e
    arrays = to_hf_arrays(model)
    config = to_hf_config(model.config, rope_theta=model.rope_theta,
                          rms_norm_eps=model.norm_eps, dtype=str(arrays[EMBED_KEY].dtype),
                          architectures=["LlamaForCausalLM"], **config_kwargs)
    files = [(out / WEIGHTS_FILE, safetensors.numpy.save(arrays, metadata={"format": "pt"})),
             (out / CONFIG_FILE, config.to_json_string(use_diff=False).encode())]
    if tokenizer_json is not None:
        tokenizer_config: dict[str, Any] = {
            "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
            "model_max_length": model.config.max_position_embeddings}
        if eos_token is not None:
            tokenizer_config |= {"bos_token": eos_token, "eos_token": eos_token}
        files += [(out / TOKENIZER_FILE, tokenizer_json.encode()),
                  (out / TOKENIZER_CONFIG, json.dumps(tokenizer_config, indent=2).encode())]
    for path, data in files:
        atomic_write_bytes(path, operator.methodcaller("write", data))
    return [path for path, _ in files]


def read_config(directory: os.PathLike[str] | str) -> dict[str, Any]:
    """The ``config.json`` of a Hugging Face checkpoint directory.

    Raises:
      ValueError: it is missing or not a JSON object (one line naming it).
    """
    return read_json_object(pathlib.Path(directory) / CONFIG_FILE,
                            ": not a Hugging Face checkpoint directory")


def config_mismatches(hf: Mapping[str, Any], config: LlamaConfig, *,
                      rope_theta: float = 10000.0, rms_norm_eps: float = 1e-6) -> list[str]:
    """Every field of a HF ``config.json`` that differs from the architecture of ``config``.

    Absent fields read as ``transformers.LlamaConfig``'s defaults; each mismatch as
    ``"hidden_size 128 (not 96)"``.  Empty where the checkpoint's weights fit a
    :class:`Llama` of ``config`` and compute as it does (model type, activation, biases,
    RoPE, norm epsilon).
    """
    heads = hf.get("num_attention_heads", 32)
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    got = {
        "model_type": hf.get("model_type"),
        "vocab_size": hf.get("vocab_size", 32000),
        "hidden_size": hf.get("hidden_size", 4096),
        "intermediate_size": hf.get("intermediate_size", 11008),
        "num_hidden_layers": hf.get("num_hidden_layers", 32),
        "num_attention_heads": heads,
        "num_key_value_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf.get("hidden_size", 4096) // max(heads, 1),
        "tie_word_embeddings": hf.get("tie_word_embeddings", False),
        "hidden_act": hf.get("hidden_act", "silu"),
        "attention_bias": hf.get("attention_bias", False),
        "mlp_bias": hf.get("mlp_bias", False),
        "rms_norm_eps": hf.get("rms_norm_eps", 1e-6),
        "rope_theta": rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        "rope_type": rope.get("rope_type", rope.get("type", "default")),
    }
    want = hf_config_fields(config, rope_theta=rope_theta, rms_norm_eps=rms_norm_eps)
    want |= {"model_type": "llama", "rope_theta": rope_theta, "rope_type": "default"}
    out = []
    for key, value in got.items():
        expected = want[key]
        if isinstance(expected, float) and isinstance(value, int | float) \
                and not isinstance(value, bool):
            same = math.isclose(value, expected, rel_tol=1e-9)
        else:
            same = value == expected
        if not same:
            out.append(f"{key} {value!r} (not {expected!r})")
    return out


def load_weights(directory: os.PathLike[str] | str) -> dict[str, np.ndarray]:
    """The tensors of a HF checkpoint (``model.safetensors`` or its shards), as NumPy arrays.

    In transformers' order: ``model.safetensors`` where there is one (a stale index and
    shards beside it are not read), else the shards that ``model.safetensors.index.json``
    names.

    Raises:
      ValueError: ``directory`` holds no safetensors weights, its index cannot be read, or
        a weight file is missing or unreadable (truncated, damaged): one line naming the
        file(s).
    """
    from safetensors import safe_open

    root = pathlib.Path(directory)
    if (root / WEIGHTS_FILE).is_file():
        files = [root / WEIGHTS_FILE]
    elif (root / WEIGHTS_INDEX).is_file():
        index_path = root / WEIGHTS_INDEX
        try:
            index = json.loads(index_path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot read {index_path}: {_first_line(e)}") from None
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_path} names no weight files (no \"weight_map\")")
        files = sorted({root / str(name) for name in weight_map.values()})
        missing = [p for p in files if not p.is_file()]
        if missing:
            raise ValueError(f"{len(missing)} of the {len(files)} weight files that "
                             f"{index_path} names are missing: "
                             f"{', '.join(str(p) for p in missing)}")
    else:
        raise ValueError(f"{root} holds no {WEIGHTS_FILE} (nor {WEIGHTS_INDEX}); a "
                         "pytorch_model.bin checkpoint converts with transformers' "
                         "save_pretrained(DIR), which writes safetensors")
    out: dict[str, np.ndarray] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="numpy") as f:
                for key in f.keys():
                    out[key] = f.get_tensor(key)
        except Exception as e:  # SafetensorError, OSError: truncated, damaged, unreadable
            raise ValueError(f"cannot read the weight file {path}: {_first_line(e)}") from None
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _hf_order(config: LlamaConfig) -> list[str]:
    names = [EMBED_KEY]
    for i in range(config.num_layers):
        names += [f"model.layers.{i}.{n}" for n in _LAYER_NAMES.values()]
    names += ["model.norm.weight", LM_HEAD_KEY]
    return names


__all__ = [
    "CONFIG_FILE",
    "EMBED_KEY",
    "IGNORED_SUFFIXES",
    "LM_HEAD_KEY",
    "TOKENIZER_CONFIG",
    "TOKENIZER_FILE",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX",
    "config_mismatches",
    "from_hf_state_dict",
    "hf_config_fields",
    "hf_name",
    "load_weights",
    "read_config",
    "save_pretrained",
    "to_hf_arrays",
    "to_hf_config",
    "to_hf_state_dict",
]
