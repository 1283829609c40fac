"""LLaMA model shapes: the paper's Appendix "Model Configurations" and smaller ones.

Only shapes live here (no framework code), so memory accounting, the Flax trainer and the
PyTorch side all agree on what "270m" means.  It lives beside the trainer, its main user,
and imports no framework (``sage_train/__init__.py`` imports nothing), so the reproduction
code, the benchmarks and torch-only code read it without loading JAX or Flax
(``tests/core/test_core_layering.py`` checks it).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import types
from collections.abc import Mapping
from typing import Any


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shape of a LLaMA-architecture decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    max_position_embeddings: int = 8192
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_heads={self.num_heads}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden_size // self.num_heads

    def param_count(self) -> int:
        """Exact number of parameters (biases-free projections, as LLaMA)."""
        d, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        attn = d * self.num_heads * hd * 2 + d * self.num_kv_heads * hd * 2
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    def embedding_fraction(self) -> float:
        """Share of parameters in the vocabulary matrices (the paper's "Emb. Params")."""
        vocab = self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)
        return vocab / self.param_count()


PAPER_MODELS: Mapping[str, LlamaConfig] = types.MappingProxyType(
    {
        "270m": LlamaConfig("270m", 128256, 1024, 2816, 13, 16, 2),
        "0.6b": LlamaConfig("0.6b", 128256, 1536, 4224, 16, 24, 3),
        "1.3b": LlamaConfig("1.3b", 128256, 2048, 5632, 24, 32, 4),
    }
)
"""The paper's three configurations (Appendix table ``tab:model_configs``), tied embeddings."""

MID_VOCAB_SIZE = 32768
"""Vocabulary of the mid-size models: a byte-level BPE trained locally (``--data installed``)."""

MID_MODELS: Mapping[str, LlamaConfig] = types.MappingProxyType(
    {
        # the 270M at a quarter of its width, its 13 layers: 17.6M parameters, 47.8% in the
        # embedding (the 270M: 48%); 4 heads allow a 4:1 grouping at most
        "20m": LlamaConfig("20m", MID_VOCAB_SIZE, 256, 704, 13, 4, 1,
                           max_position_embeddings=2048),
        # the 270M's own layer (every matrix of its shape), 3 of them: 66.6M parameters,
        # 50.4% in the embedding
        "60m": LlamaConfig("60m", MID_VOCAB_SIZE, 1024, 2816, 3, 16, 2,
                           max_position_embeddings=2048),
    }
)
"""Sizes between ``small`` and ``270m``, for a GPU comparison on ~100M tokens in minutes.

The paper's proportions (the 270M's): head width 64, intermediate size 2.75 x hidden, tied
embeddings, about half the parameters in the embedding, grouped-query attention 8:1 where
the head count allows it. With a vocabulary of :data:`MID_VOCAB_SIZE` that share fixes the
depth for a width, so ``20m`` is narrow and 13 layers deep and ``60m`` wide and 3 deep.
"""

MODELS: Mapping[str, LlamaConfig] = types.MappingProxyType(
    {
        "tiny": LlamaConfig("tiny", 1024, 96, 256, 2, 4, 2, max_position_embeddings=256),
        "small": LlamaConfig("small", 4096, 256, 704, 4, 8, 4, max_position_embeddings=1024),
        # ``small`` on a 1,024-token vocabulary: the grid's model (sage_repro.pieces.GRID_PLAN)
        "small-v1k": LlamaConfig("small-v1k", 1024, 256, 704, 4, 8, 4,
                                 max_position_embeddings=1024),
        **MID_MODELS,
        "130m": LlamaConfig("130m", 32000, 768, 2048, 12, 12, 12, max_position_embeddings=2048),
        **PAPER_MODELS,
    }
)
"""Every named configuration: ``tiny``/``small`` for tests and CPU runs (``small-v1k``, the
grid's, is ``small`` on a 1,024-token vocabulary), then larger ones."""


SHAPE_KEYS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "vocab_size": ("vocab_size",),
    "hidden_size": ("hidden_size",),
    "intermediate_size": ("intermediate_size",),
    "num_layers": ("num_layers", "num_hidden_layers"),
    "num_heads": ("num_heads", "num_attention_heads"),
    "num_kv_heads": ("num_kv_heads", "num_key_value_heads"),
    "max_position_embeddings": ("max_position_embeddings",),
    "tie_embeddings": ("tie_embeddings", "tie_word_embeddings"),
})
"""The fields of a model file (:func:`load_model_file`): each :class:`LlamaConfig` field and
the names a Hugging Face ``config.json`` gives it."""

_HF_DEFAULTS: Mapping[str, Any] = types.MappingProxyType({
    "max_position_embeddings": 2048, "tie_embeddings": False})
"""``transformers.LlamaConfig``'s defaults of the fields a model file may leave out."""


def is_model_file(model: str) -> bool:
    """Whether ``model`` names a file of a shape (``.json``, or a checkpoint directory)."""
    path = pathlib.Path(model).expanduser()
    return model not in MODELS and (model.endswith(".json") or path.is_dir())


def read_json_object(file: pathlib.Path, missing: str = "") -> dict[str, Any]:
    """The JSON object in ``file`` (a model file, a checkpoint's ``config.json``).

    Raises:
      ValueError: ``{file} does not exist{missing}``, ``cannot read {file}: ...`` or
        ``{file} holds no JSON object`` (one line).
    """
    try:
        data = json.loads(file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{file} does not exist{missing}") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{file} holds no JSON object")
    return data


def _shape_field(model: str, file: pathlib.Path, data: dict[str, Any], field: str,
                 names: tuple[str, ...]) -> Any:
    """:func:`load_model_file`'s value of ``field`` (under one of ``names``), checked."""
    value = next((data[n] for n in names if n in data), None)
    if value is None and field == "num_kv_heads":
        value = next((data[n] for n in SHAPE_KEYS["num_heads"] if n in data), None)
    if value is None:
        if field not in _HF_DEFAULTS:
            raise ValueError(f"--model {model}: {file} has no {' or '.join(names)}")
        value = _HF_DEFAULTS[field]
    if field == "tie_embeddings":
        if not isinstance(value, bool):
            raise ValueError(f"--model {model}: {names[-1]} must be true or false, "
                             f"got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"--model {model}: {names[0]} must be an integer >= 1, "
                         f"got {value!r}")
    return value


def load_model_file(model: str) -> LlamaConfig:
    """The LLaMA shape of a JSON file, or of a Hugging Face checkpoint's ``config.json``.

    ``model`` is a ``.json`` file or a directory holding ``config.json``.  Its keys are
    :class:`LlamaConfig`'s fields or a ``transformers.LlamaConfig``'s names for them
    (:data:`SHAPE_KEYS`; other keys are ignored): ``vocab_size``, ``hidden_size``,
    ``intermediate_size``, ``num_layers``, ``num_heads`` and ``num_kv_heads`` are required
    (``num_kv_heads`` defaults to ``num_heads`` in a Hugging Face file);
    ``max_position_embeddings`` (default 2048) and ``tie_embeddings`` (default ``False``)
    are optional; ``name`` names it (default: the file's or directory's name).

    Raises:
      ValueError: the file is missing, not JSON, not a LLaMA's, or a field is missing or
        not a positive integer (one line naming it).
    """
    path = pathlib.Path(model).expanduser()
    file = path / "config.json" if path.is_dir() else path
    try:
        data = read_json_object(file, f" (a model is one of {', '.join(MODELS)}, a .json file "
                                "of a LLaMA shape or a Hugging Face LLaMA checkpoint directory)")
    except ValueError as e:
        raise ValueError(f"--model {model}: {e}") from None
    if data.get("model_type", "llama") != "llama":
        raise ValueError(f"--model {model}: {file} is a {data['model_type']!r} model's "
                         "config, not a LLaMA's")
    fields = {field: _shape_field(model, file, data, field, names)
              for field, names in SHAPE_KEYS.items()}
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim * fields["num_heads"] != fields["hidden_size"]:
        raise ValueError(f"--model {model}: head_dim {head_dim} x {fields['num_heads']} heads "
                         f"is not hidden_size {fields['hidden_size']}; this LLaMA needs "
                         "hidden_size = heads x head_dim")
    name = data.get("name") or (path.name if path.is_dir() else path.stem)
    try:
        return LlamaConfig(str(name), **fields)
    except ValueError as e:
        raise ValueError(f"--model {model}: {e}") from None


def get_model_config(name: str) -> LlamaConfig:
    """The model configuration called ``name``, or of the file ``name`` (:func:`load_model_file`).

    An unknown name lists the valid ones.
    """
    if name in MODELS:
        return MODELS[name]
    if is_model_file(name):
        return load_model_file(name)
    raise ValueError(
        f"unknown model configuration {name!r}; valid names: {', '.join(MODELS)}, or a .json "
        "file of a LLaMA shape, or a Hugging Face LLaMA checkpoint directory"
    )
