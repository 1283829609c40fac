"""sage_torch's router on real architectures, against routing tables written by hand.

Tiny models built from ``transformers`` configs with random weights (nothing is downloaded),
with the shape coincidences that used to fool the router: GPT-Neo and BERT with hidden size
== positions, a T5 whose heads·d_kv == relative-attention buckets, a 2-label BERT classifier
(2 == token types), a LLaMA whose MLP width == vocabulary (its ``gate_proj`` has the token
embedding's shape).  Each table below gives, per parameter-name glob (first match wins), the
kind and the fan-in and fan-out dims, from the modules' documented layouts: ``nn.Linear``
``(out, in)``, ``nn.Embedding`` ``(V, d)`` with the vocab axis as fan-out, transformers'
``Conv1D`` ``(in, out)``, ``nn.Conv2d`` ``(out, in, kh, kw)`` as one ``(Cin·kh·kw) x Cout``
matrix.  A family that the installed transformers lacks is skipped, saying so.
"""

from __future__ import annotations

import fnmatch
import re

import pytest
import torch
from torch import nn

import sage_torch
from sage_torch import Route, RoutingError

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

pytestmark = pytest.mark.usefixtures("torch_one_thread")

V, D = 40, 16  # vocabulary, hidden size; D is also the number of positions on purpose

TABLE = ("embedding", (1,), (0,))  # a (V, d) table, or a head (V, d): vocab axis 0 = fan-out
LINEAR = ("dense", (1,), (0,))  # nn.Linear (out, in)
CONV1D = ("dense", (0,), (1,))  # transformers Conv1D (in, out)
CONV2D = ("dense", (1, 2, 3), (0,))  # nn.Conv2d (out, in, kh, kw): in, kh, kw merged
VECTOR = ("vector", (), ())


def family(name: str, model: str):
    """``(config class, model class)`` of a transformers family, or skip saying why."""
    config_cls = getattr(transformers, f"{name}Config", None)
    model_cls = getattr(transformers, model, None)
    if config_cls is None or model_cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model} ({name} family)")
    return config_cls, model_cls


def check(model: nn.Module, expected: dict, overrides=None) -> dict:
    """Route ``model`` and compare with the hand-written table; returns routes by name."""
    routed = sage_torch.route_params(model, overrides)
    assert [r.name for r in routed] == [n for n, p in model.named_parameters()
                                        if p.requires_grad]
    used = set()
    for r in routed:
        pattern = next((p for p in expected if fnmatch.fnmatchcase(r.name, p)), None)
        assert pattern is not None, f"{r.name} {tuple(r.param.shape)} is not in the table"
        used.add(pattern)
        got = (r.route.kind, r.route.fan_in, r.route.fan_out)
        assert got == expected[pattern], (
            f"{r.name} {tuple(r.param.shape)}: routed {got} ({r.route.evidence}), the table "
            f"says {expected[pattern]}")
    assert used == set(expected), f"table rows matching no parameter: {set(expected) - used}"
    return {r.name: r.route for r in routed}


def step_once(model: nn.Module, loss_fn, name: str = "sage-hybrid", **kw) -> None:
    """One step of configuration ``name``: every trained parameter moves and stays finite."""
    opt = sage_torch.make_optimizer(name, model, lr=1e-2, **kw)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    loss_fn(model).backward()
    opt.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
        if p.grad is not None and p.grad.abs().sum() > 0:
            assert not torch.equal(p, before[n]), f"{n} did not move"


def tokens(n: int = 8) -> torch.Tensor:
    return torch.randint(0, V, (2, n), generator=torch.Generator().manual_seed(0))


# ---------------------------------------------------------------------------
# GPT-2: Conv1D (in, out)
# ---------------------------------------------------------------------------

GPT2 = {
    "transformer.wte.weight": TABLE,
    "transformer.wpe.weight": TABLE,
    "transformer.h.*.attn.c_attn.weight": CONV1D,
    "transformer.h.*.attn.c_proj.weight": CONV1D,
    "transformer.h.*.mlp.c_fc.weight": CONV1D,
    "transformer.h.*.mlp.c_proj.weight": CONV1D,
    "transformer.h.*.ln_?.weight": VECTOR,
    "transformer.*.bias": VECTOR,
    "transformer.ln_f.weight": VECTOR,
}


def gpt2():
    config_cls, model_cls = family("GPT2", "GPT2LMHeadModel")
    torch.manual_seed(0)
    return model_cls(config_cls(vocab_size=V, n_embd=D, n_layer=2, n_head=2, n_positions=D))


def test_gpt2_conv1d_is_in_out():
    model = gpt2()
    routes = check(model, GPT2)
    assert "lm_head.weight" not in routes  # tied to wte: one parameter, one state
    assert routes["transformer.wte.weight"].evidence == (
        "model API: input embeddings, tied to lm_head.weight")
    assert routes["transformer.h.0.attn.c_attn.weight"].evidence == "module Conv1D"
    assert routes["transformer.h.0.ln_1.bias"].evidence == "shape: 1-D"
    step_once(model, lambda m: m(input_ids=tokens(), labels=tokens()).loss)


def test_gpt2_routing_table_prints_axes_and_evidence():
    table = sage_torch.routing_table("sage-hybrid", gpt2())
    text = str(table)
    header = text.splitlines()[0]
    for column in ("fan-in", "fan-out", "evidence", "state bytes"):
        assert column in header
    line = next(s for s in text.splitlines() if s.startswith("transformer.h.0.attn.c_attn.weight"))
    assert line.split()[1:10] == ["16x48", "dense", "sinkgd(unit,", "alpha=10)", "0.02",
                                  "(0.002", "x", "10)", "0"]  # the step: rate x alpha
    assert "0 (16)  1 (48)" in line
    assert "1 (48)" in line and "module Conv1D" in line
    line = next(s for s in text.splitlines() if s.startswith("transformer.wte.weight"))
    assert "1 (16)  0 (40)" in line and "model API: input embeddings, tied to lm_head" in line
    row = table.row("transformer.h.0.mlp.c_proj.weight")
    assert (row.fan_in, row.fan_out, row.evidence) == ("0 (64)", "1 (16)", "module Conv1D")


# ---------------------------------------------------------------------------
# GPT-Neo and BERT with hidden size == positions
# ---------------------------------------------------------------------------

GPT_NEO = {
    "transformer.wte.weight": TABLE,
    "transformer.wpe.weight": TABLE,
    "transformer.h.*.attn.attention.?_proj.weight": LINEAR,
    "transformer.h.*.attn.attention.out_proj.weight": LINEAR,
    "transformer.h.*.mlp.c_fc.weight": LINEAR,
    "transformer.h.*.mlp.c_proj.weight": LINEAR,
    "transformer.h.*.ln_?.weight": VECTOR,
    "transformer.*.bias": VECTOR,
    "transformer.ln_f.weight": VECTOR,
}


def test_gpt_neo_with_hidden_equal_to_positions():
    config_cls, model_cls = family("GPTNeo", "GPTNeoForCausalLM")
    model = model_cls(config_cls(vocab_size=V, hidden_size=D, num_layers=2, num_heads=2,
                                 max_position_embeddings=D, window_size=4,
                                 attention_types=[[["global", "local"], 1]]))
    assert model.transformer.h[0].attn.attention.q_proj.out_features == \
        model.transformer.wpe.num_embeddings  # what used to make every projection a "head"
    routes = check(model, GPT_NEO)
    assert "lm_head.weight" not in routes
    assert routes["transformer.wpe.weight"].evidence == "module nn.Embedding"


BERT = {
    "bert.embeddings.word_embeddings.weight": TABLE,
    "bert.embeddings.position_embeddings.weight": TABLE,
    "bert.embeddings.token_type_embeddings.weight": TABLE,
    "bert.encoder.layer.*.attention.self.query.weight": LINEAR,
    "bert.encoder.layer.*.attention.self.key.weight": LINEAR,
    "bert.encoder.layer.*.attention.self.value.weight": LINEAR,
    "bert.encoder.layer.*.attention.output.dense.weight": LINEAR,
    "bert.encoder.layer.*.intermediate.dense.weight": LINEAR,
    "bert.encoder.layer.*.output.dense.weight": LINEAR,
    "*LayerNorm.weight": VECTOR,
    "*.bias": VECTOR,
}


def bert_config(**kw):
    config_cls, _ = family("Bert", "BertModel")
    return config_cls(vocab_size=V, hidden_size=D, num_hidden_layers=2, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=D, **kw)


def test_bert_with_hidden_equal_to_positions():
    _, model_cls = family("Bert", "BertForMaskedLM")
    model = model_cls(bert_config())
    assert model.config.hidden_size == model.config.max_position_embeddings
    table = {**BERT, "cls.predictions.transform.dense.weight": LINEAR}
    routes = check(model, table)
    assert "cls.predictions.decoder.weight" not in routes  # tied to the word embeddings
    assert routes["bert.embeddings.word_embeddings.weight"].evidence.startswith(
        "model API: input embeddings, tied to cls.predictions.decoder.weight")


def test_bert_sequence_classifier_with_two_labels_is_dense():
    _, model_cls = family("Bert", "BertForSequenceClassification")
    model = model_cls(bert_config(num_labels=2))
    assert model.classifier.out_features == model.config.type_vocab_size == 2
    routes = check(model, {**BERT, "bert.pooler.dense.weight": LINEAR, "classifier.weight": LINEAR})
    assert routes["classifier.weight"].evidence == "module nn.Linear"
    labels = torch.tensor([0, 1])
    step_once(model, lambda m: m(input_ids=tokens(), labels=labels).loss)


# ---------------------------------------------------------------------------
# T5 with heads·d_kv == relative-attention buckets
# ---------------------------------------------------------------------------

T5 = {
    "shared.weight": TABLE,
    "*.SelfAttention.[qkvo].weight": LINEAR,
    "*.EncDecAttention.[qkvo].weight": LINEAR,
    "*.relative_attention_bias.weight": TABLE,  # (buckets, heads): a table like any other
    "*.DenseReluDense.w[io].weight": LINEAR,
    "*layer_norm.weight": VECTOR,
}


def test_t5_with_inner_dim_equal_to_buckets():
    config_cls, model_cls = family("T5", "T5ForConditionalGeneration")
    model = model_cls(config_cls(vocab_size=V, d_model=D, d_kv=8, num_heads=4, d_ff=32,
                                 num_layers=1, num_decoder_layers=1,
                                 relative_attention_num_buckets=32, decoder_start_token_id=0,
                                 pad_token_id=0))
    attn = model.encoder.block[0].layer[0].SelfAttention
    assert attn.q.out_features == attn.relative_attention_bias.num_embeddings == 32
    routes = check(model, T5)
    assert routes["shared.weight"].evidence == (
        "model API: input embeddings, tied to lm_head.weight, encoder.embed_tokens.weight "
        "(+1 more)")
    step_once(model, lambda m: m(input_ids=tokens(), labels=tokens(4)).loss)


# ---------------------------------------------------------------------------
# LLaMA (tied and untied), Qwen2, Mistral, Gemma
# ---------------------------------------------------------------------------

LLAMA = {
    "model.embed_tokens.weight": TABLE,
    "model.layers.*.self_attn.[qkvo]_proj.weight": LINEAR,
    "model.layers.*.mlp.*_proj.weight": LINEAR,
    "model.*norm.weight": VECTOR,
}
DECODERS = {  # family: (model class, extra config, extra table rows)
    "Llama": ("LlamaForCausalLM", {}, {}),
    "Qwen2": ("Qwen2ForCausalLM", {}, {"model.layers.*.self_attn.[qkv]_proj.bias": VECTOR}),
    "Mistral": ("MistralForCausalLM", {}, {}),
    "Gemma": ("GemmaForCausalLM", {"head_dim": 8}, {}),
}


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("name", list(DECODERS))
def test_decoder_families(name, tied):
    model_name, extra, rows = DECODERS[name]
    config_cls, model_cls = family(name, model_name)
    # intermediate_size == V: gate_proj/up_proj have the token embedding's shape (V, d)
    model = model_cls(config_cls(vocab_size=V, hidden_size=D, intermediate_size=V,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 num_key_value_heads=1, tie_word_embeddings=tied, **extra))
    assert model.model.layers[0].mlp.gate_proj.weight.shape == model.lm_head.weight.shape
    table = {**rows, **LLAMA} if tied else {**rows, **LLAMA, "lm_head.weight": TABLE}
    routes = check(model, table)
    assert ("lm_head.weight" in routes) != tied
    if tied:
        assert routes["model.embed_tokens.weight"].evidence == (
            "model API: input embeddings, tied to lm_head.weight")
    else:
        assert routes["lm_head.weight"].evidence == "model API: output embeddings"
        assert routes["model.embed_tokens.weight"].evidence == "model API: input embeddings"
    assert routes["model.layers.0.mlp.gate_proj.weight"].evidence == "module nn.Linear"


# ---------------------------------------------------------------------------
# ViT: a patch convolution, a class token, a position table the router asks about
# ---------------------------------------------------------------------------

VIT = {
    "vit.embeddings.cls_token": VECTOR,  # (1, 1, d): one non-unit axis
    "vit.embeddings.position_embeddings": ("embedding", (2,), (1,)),  # (1, N, d) table
    "vit.embeddings.patch_embeddings.projection.weight": CONV2D,
    "vit.*.attention.*.weight": LINEAR,
    "vit.*.mlp.fc?.weight": LINEAR,
    "vit.*layernorm*.weight": VECTOR,
    "classifier.weight": LINEAR,
    "*.bias": VECTOR,
}


def advised(message: str) -> list[dict]:
    """Every ``route_overrides={...}`` an error message advises, as override dicts."""
    return [eval(m, {"Route": Route})  # noqa: S307 - our own message, our own names
            for m in re.findall(r"route_overrides=(\{[^{}]*\})", message)]


def test_vit_patch_conv_and_the_position_table_override():
    config_cls, model_cls = family("ViT", "ViTForImageClassification")
    torch.manual_seed(0)
    model = model_cls(config_cls(hidden_size=D, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=32, image_size=8, patch_size=4,
                                 num_channels=3, num_labels=3))
    with pytest.raises(RoutingError) as info:
        sage_torch.route_params(model)
    message = str(info.value)
    assert "'vit.embeddings.position_embeddings' of shape (1, 5, 16)" in message, message
    # the advice for a table of 5 positions x 16 features: positions are the fan-out axis
    table_advice = next(a for a in advised(message)
                        if getattr(a["vit.embeddings.position_embeddings"], "kind", None)
                        == "embedding")
    routes = check(model, VIT, table_advice)
    assert routes["vit.embeddings.position_embeddings"].evidence.startswith("override")
    assert routes["vit.embeddings.cls_token"].evidence == "shape: one non-unit axis"
    assert routes["vit.embeddings.patch_embeddings.projection.weight"].evidence == (
        "module nn.Conv2d")
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    step_once(model, lambda m: m(pixel_values=pixels, labels=torch.tensor([0, 2])).loss,
              route_overrides=table_advice)


# ---------------------------------------------------------------------------
# A plain Conv2d CNN
# ---------------------------------------------------------------------------

CNN = {
    "0.weight": CONV2D,  # (8, 3, 3, 3): a 27 x 8 matrix
    "1.weight": VECTOR,  # BatchNorm2d
    "3.weight": CONV2D,  # depthwise (8, 1, 3, 3): a 9 x 8 matrix
    "4.weight": CONV2D,  # pointwise (16, 8, 1, 1): an 8 x 16 matrix
    "7.weight": LINEAR,
    "*.bias": VECTOR,
}


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.Conv2d(8, 8, 3, groups=8), nn.Conv2d(8, 16, 1),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


@pytest.mark.parametrize("name", ["sage-hybrid", "sage-pure", "apollo", "sinkgd-pure"])
def test_conv2d_cnn(name):
    model = cnn()
    routes = check(model, CNN)
    assert routes["0.weight"].evidence == "module nn.Conv2d"
    assert routes["0.weight"].describe_fan_in() == "1,2,3 (3x3x3=27)"
    text = str(sage_torch.routing_table(name, model))
    assert "1,2,3 (3x3x3=27)  0 (8)" in text and "module nn.Conv2d" in text
    x = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    step_once(model, lambda m: m(x).square().mean(), name)


def test_a_wrapped_model_keeps_its_api():
    """A transformers model held by another module (a training module, DDP's ``module``):
    its gate_proj/up_proj have the token embedding's shape, yet only the API's head is one."""
    config_cls, model_cls = family("Llama", "LlamaForCausalLM")
    wrapper = nn.ModuleDict({"module": model_cls(config_cls(
        vocab_size=V, hidden_size=D, intermediate_size=V, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))})
    table = {f"module.{k}": v for k, v in {**LLAMA, "lm_head.weight": TABLE}.items()}
    routes = check(wrapper, table)
    assert routes["module.lm_head.weight"].evidence == "model API: output embeddings"
