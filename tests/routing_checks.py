"""Helpers of the routing tests (both frameworks): the paste block a RoutingError prints, and
the transformers architectures that issue 28's tests route by names and by module."""

from __future__ import annotations

from typing import Any

from sage_optim.routing import Route, RoutingError

V, D = 40, 16


def paste_block(err: RoutingError) -> dict:
    """The message's one ``route_overrides = {...}`` block, executed with ``Route`` in scope."""
    message = str(err)
    assert message.count("route_overrides = {") == 1, message
    block = message[message.index("route_overrides = {"):]
    block = block[:block.index("\n}") + 2]
    scope: dict = {"Route": Route}
    exec(block, scope)  # noqa: S102 - our own message: the block users paste
    return scope["route_overrides"]


def build(config: str, model: str, **kw: Any) -> Any:
    """A transformers model from a tiny config (random weights, seed 0), or skip saying why."""
    import pytest
    import torch

    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config_cls = getattr(transformers, config, None)
    model_cls = getattr(transformers, model, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model}")
    torch.manual_seed(0)
    return model_cls(config_cls(**kw))


GPT2 = dict(n_embd=D, n_layer=2, n_head=2, n_positions=32)
WIDE = 4 * D  # vocab_size == MLP width == 4 * hidden: an MLP matrix has the table's shape

ARCHITECTURES = {  # id: (config class, model class, config)
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, **GPT2)),
    "gpt2-vocab-4d": ("GPT2Config", "GPT2LMHeadModel",
                      dict(vocab_size=WIDE, n_embd=D, n_layer=1, n_head=2, n_positions=32)),
    "gpt2-cross-attention": ("GPT2Config", "GPT2LMHeadModel",
                             dict(vocab_size=V, add_cross_attention=True, **GPT2)),
    "openai-gpt": ("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", dict(vocab_size=V, **GPT2)),
    "gpt-bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(vocab_size=V, **GPT2)),
    "gpt-bigcode-vocab-4d": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM",
                             dict(vocab_size=WIDE, **GPT2)),
    "llama-tied-mlp-v": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=V, hidden_size=D, intermediate_size=V, num_hidden_layers=2,
        num_attention_heads=2, tie_word_embeddings=True)),
    "llama-untied-mlp-v": ("LlamaConfig", "LlamaForCausalLM", dict(
        vocab_size=V, hidden_size=D, intermediate_size=V, num_hidden_layers=2,
        num_attention_heads=2, tie_word_embeddings=False)),
    "gpt-neox-vocab-4d": ("GPTNeoXConfig", "GPTNeoXForCausalLM", dict(
        vocab_size=WIDE, hidden_size=D, intermediate_size=WIDE, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32)),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=V, hidden_size=D, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=32, word_embed_proj_dim=D)),
    "opt-vocab-4d": ("OPTConfig", "OPTForCausalLM", dict(
        vocab_size=WIDE, hidden_size=D, ffn_dim=WIDE, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32, word_embed_proj_dim=D)),
    "bert-vocab-4d": ("BertConfig", "BertForMaskedLM", dict(
        vocab_size=WIDE, hidden_size=D, intermediate_size=WIDE, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32)),
    "roberta": ("RobertaConfig", "RobertaForMaskedLM", dict(
        vocab_size=V, hidden_size=D, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=32)),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=V, d_model=D, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8)),
    "t5-vocab-4d": ("T5Config", "T5ForConditionalGeneration", dict(
        vocab_size=WIDE, d_model=D, d_kv=8, d_ff=WIDE, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8)),
    "bart-vocab-4d": ("BartConfig", "BartForConditionalGeneration", dict(
        vocab_size=WIDE, d_model=D, encoder_ffn_dim=WIDE, decoder_ffn_dim=WIDE,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, max_position_embeddings=32)),
    # embedding_size != hidden_size: an nn.Linear named embeddings_project (both words)
    "electra": ("ElectraConfig", "ElectraForMaskedLM", dict(
        vocab_size=V, embedding_size=8, hidden_size=D, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=32)),
}
