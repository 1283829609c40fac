"""Mixture-of-experts models of transformers, routed by module evidence (issue 31).

The experts of most MoE families are one module holding fused 3-D parameters ``(E, ., .)``;
whether axis 1 or axis 2 is an expert's fan-in depends on the family's forward code.  These
tests read the truth from the shapes of tiny configs, not from :mod:`sage_torch.moe`: the
hidden size (16) differs from the expert width (24, so ``gate_up_proj`` has 48 rows or
columns), so the axis of size 16 is the input of ``gate_up_proj``/``up_proj`` (and JetMoE's
input ``weight``) and the output of ``down_proj``; a router ``(E, d)`` reads ``d`` as its
input.  Each expert's matrix must get, in float64, exactly the SinkGD step of that layout on
its own (``reference_np.SinkGDRef``), and the deliberately transposed override must not.

The families are enumerated from the installed transformers, independently of the table:
an experts class that ``sage_torch.moe.EXPERTS`` lacks fails the first test by name.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import sage_torch
from sage_torch import Route, RoutingError
from sage_torch.adapters import transformers as moe

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

from reference_np import SinkGDRef  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

HIDDEN, WIDTH, EXPERTS, LR = 16, 24, 4, 1e-2
TINY = dict(vocab_size=40, hidden_size=HIDDEN, intermediate_size=WIDTH,
            moe_intermediate_size=WIDTH, shared_expert_intermediate_size=WIDTH,
            expert_ffn_hidden_size=WIDTH, moe_hidden_size=HIDDEN, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=2, head_dim=8, num_experts=EXPERTS,
            num_local_experts=EXPERTS, n_routed_experts=EXPERTS, moe_num_experts=EXPERTS,
            num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
            first_k_dense_replace=0, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
            qk_nope_head_dim=4, v_head_dim=8, max_position_embeddings=64, pad_token_id=0,
            zero_expert_num=0, experts_implementation="eager")  # the loop: float64 on CPU
EXTRA = {  # what a family's config validation needs besides TINY
    "zaya": dict(num_experts_per_tok=1),
    "granitemoehybrid": dict(mamba_n_heads=2, mamba_d_head=16),
    "hy_v4_vl": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                      "mrope_section": [1, 1, 0]}),
    "dots3_note": dict(per_layer_config={}, adapter_in_dim=HIDDEN, router_scaling_factor=1.0),
    "glm5_next": dict(qk_rope_head_dim=0),  # its DSA attention layers take no RoPE
    # the layer of a one-layer model is a dense MLP unless told otherwise
    "afmoe": dict(num_dense_layers=0),
    "ernie4_5_moe": dict(moe_layer_start_index=0),
    "flint": dict(mlp_only_layers=[]),
    "jamba": dict(expert_layer_offset=0, expert_layer_period=1),
    "longcat_flash": dict(num_hidden_layers=2, head_dim=4),  # one layer of two sublayers; MLA
    "jetmoe": dict(num_key_value_heads=1),  # attention experts (E, 8, 16): not square
    **{f: dict(head_dim=4) for f in ("axk1", "deepseek_v3")},  # MLA: head_dim = rope dims
    **{f: dict(mlp_layer_types=["sparse"]) for f in ("beam", "glm4_moe_lite", "hy_v3",
                                                     "hy_v4", "laguna", "mimo_v2_flash")},
}
ROUTER_EXTRA = {"ernie4_5_vl_moe": dict(moe_intermediate_size=[WIDTH, WIDTH])}  # text, vision
INPUTS = ("gate_up_proj", "up_proj", "gate_proj", "weight")  # the axis of size HIDDEN: fan-in
OUTPUTS = ("down_proj",)  # the axis of size HIDDEN: fan-out
SINKGD = dict(alpha=10.0, normalization="unit")  # sage-hybrid's dense rule


# ---------------------------------------------------------------------------
# the families of the installed transformers, found without sage_torch.moe
# ---------------------------------------------------------------------------

_PARAM_3D = re.compile(r"nn\.Parameter\(\s*torch\.\w+\(\s*\(?([^()]*(?:\([^()]*\))?[^()]*)\)")


def _decorated(cls: type) -> bool:
    """Built by ``use_experts_implementation`` (its ``__init__`` is the decorator's)."""
    code = getattr(cls.__init__, "__code__", None)
    return code is not None and code.co_filename.replace("\\", "/").endswith(
        "integrations/moe.py")


def _fused(cls: type) -> bool:
    """An experts class whose ``__init__`` creates a 3-D parameter."""
    if _decorated(cls):
        return True
    if "expert" not in cls.__name__.lower():
        return False
    try:
        source = inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False
    for args in _PARAM_3D.findall(source):
        dims = [a for a in args.split(",") if a.strip() and "=" not in a]
        if len(dims) == 3:
            return True
    return False


def _key(cls: type) -> str:
    return f"{cls.__module__.removeprefix('transformers.models.')}.{cls.__qualname__}"


def installed_experts() -> dict[str, type]:
    """Every experts class with fused 3-D parameters in ``transformers.models.*``."""
    root = Path(transformers.__file__).parent / "models"
    found: dict[str, type] = {}
    for path in sorted(root.glob("*/modeling_*.py")):
        if "xpert" not in path.read_text(encoding="utf-8"):
            continue
        name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional dependency is missing: not usable here
            continue
        for cls in vars(module).values():
            if (isinstance(cls, type) and issubclass(cls, nn.Module)
                    and cls.__module__ == name and _fused(cls)):
                found[_key(cls)] = cls
    return found


def test_every_experts_class_of_the_installed_transformers_is_in_the_table():
    found = installed_experts()
    assert len(found) >= 50, sorted(found)  # the scan works: about seventy in 5.24
    missing = sorted(set(found) - set(moe.EXPERTS))
    assert not missing, (
        f"transformers {transformers.__version__} has experts classes with fused 3-D "
        f"parameters that sage_torch.moe.EXPERTS lacks (read their forward, add them): "
        f"{missing}")
    # the table's decorated classes agree with the decorator's own flag
    for key, cls in found.items():
        if _decorated(cls):
            module = _build(key, cls)
            assert moe.EXPERTS[key] == (moe.IN_OUT if module.is_transposed else moe.OUT_IN), key


# ---------------------------------------------------------------------------
# one module per family, from its own config classes
# ---------------------------------------------------------------------------


def _family(key: str) -> str:
    return key.split(".")[0]


def _configs(family: str) -> list[type]:
    """The family's config classes, text configs first."""
    module = importlib.import_module(f"transformers.models.{family}.configuration_{family}")
    configs = [c for c in vars(module).values()
               if isinstance(c, type) and issubclass(c, transformers.PretrainedConfig)
               and c.__module__ == module.__name__]
    return sorted(configs, key=lambda c: ("Text" not in c.__name__, len(c.__name__)))


def _build(key: str, cls: type | None = None, extra: dict | None = None) -> nn.Module:
    """The experts or router class ``key`` built from a tiny config of its family."""
    path, name = key.rsplit(".", 1)
    cls = cls or getattr(importlib.import_module(f"transformers.models.{path}"), name)
    if key == "jetmoe.modeling_jetmoe.JetMoeParallelExperts":  # (num_experts, in, out)
        return cls(EXPERTS, HIDDEN, WIDTH)
    errors = []
    for config_cls in _configs(_family(key)):
        try:
            config = config_cls(**{**TINY, **EXTRA.get(_family(key), {}), **(extra or {})})
            with torch.device("meta"):
                size = sum(p.numel() for p in cls(config).parameters())
            if size > 100_000:
                raise ValueError(f"{size} parameters: the tiny config did not apply")
            torch.manual_seed(0)
            return cls(config)
        except Exception as e:  # noqa: BLE001 - try the family's next config class
            errors.append(f"{config_cls.__name__}: {type(e).__name__}: {e}"[:300])
    raise AssertionError(f"cannot build {key} from a tiny config: {errors}")


def _truth(name: str, shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of one expert's matrix, read from the shape (not the table)."""
    leaf = name.rpartition(".")[2]
    if name.endswith("output_linear.weight"):  # JetMoE's second ParallelExperts
        leaf = "down_proj"
    matrix = shape[-2:]
    assert matrix.count(HIDDEN) == 1, f"{name} {shape}: ambiguous in a tiny config"
    hidden = matrix.index(HIDDEN)
    if leaf in INPUTS:
        return hidden, 1 - hidden
    assert leaf in OUTPUTS, f"{name} {shape}: no rule for it in this test"
    return 1 - hidden, hidden


def _step(model: nn.Module, overrides=None, grads=None):
    """One sage-hybrid step in float64 with random (or given) gradients; ``(before, grads)``."""
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    if grads is None:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()}
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR, route_overrides=overrides)
    opt.step()
    return before, grads


def _right(after: np.ndarray, before: np.ndarray, grad: np.ndarray, axes) -> bool:
    """Whether ``after`` is, per leading index, the SinkGD step of matrices with ``axes``."""
    fan_in, fan_out = axes
    ref = SinkGDRef(**SINKGD, fan_in_axis=fan_in, fan_out_axis=fan_out)
    lead = before.reshape(-1, *before.shape[-2:])
    grads = grad.reshape(lead.shape)
    expected = np.stack([ref.step(w, g, LR) for w, g in zip(lead, grads, strict=True)])
    return bool(np.allclose(after.reshape(lead.shape), expected, rtol=0, atol=1e-10))


def _wrapped(key: str, extra: dict | None = None) -> nn.Module:
    return nn.ModuleDict({"m": _build(key, extra=extra)}).double()


@pytest.mark.parametrize("key", sorted(moe.EXPERTS))
def test_each_expert_gets_the_step_of_its_own_layout(key):
    model = _wrapped(key)
    routed = {r.name: r.route for r in sage_torch.route_params(model)}
    fused = {n: p for n, p in model.named_parameters() if p.dim() == 3}
    assert fused, key
    for n in fused:
        assert routed[n].batch == (0,), (n, routed[n])
        assert type(model["m"]).__name__ in routed[n].evidence, routed[n].evidence
    before, grads = _step(model)
    for n, p in fused.items():
        truth = _truth(n, tuple(p.shape))
        assert _right(p.detach().numpy(), before[n], grads[n], truth), (
            f"{key}: {n} {tuple(p.shape)} routed {routed[n]}, truth fan_in={truth[0] + 1}")
    # the transposed reading of every fused tensor is caught by the same check
    twin = _wrapped(key)
    flipped = {n: Route("dense", fan_in=_truth(n, tuple(p.shape))[1] + 1,
                        fan_out=_truth(n, tuple(p.shape))[0] + 1, batch=0)
               for n, p in twin.named_parameters() if p.dim() == 3}
    before, grads = _step(twin, flipped)
    for n, p in twin.named_parameters():
        if n in flipped:
            assert not _right(p.detach().numpy(), before[n], grads[n],
                              _truth(n, tuple(p.shape))), f"{key}: {n} transposed passed"


@pytest.mark.parametrize("key", sorted(moe.ROUTERS))
def test_each_router_is_an_out_in_matrix(key):
    extra = ROUTER_EXTRA.get(_family(key))
    model = _wrapped(key, extra)
    weight = model["m"].weight
    assert weight.shape[1] == HIDDEN != weight.shape[0], key  # (E, d); Inkling adds an expert
    before, grads = _step(model)
    assert _right(weight.detach().numpy(), before["m.weight"], grads["m.weight"], (1, 0)), key
    twin = _wrapped(key, extra)
    before, grads = _step(twin, {"m.weight": Route("dense", fan_in=0, fan_out=1)})
    assert not _right(twin["m"].weight.detach().numpy(), before["m.weight"],
                      grads["m.weight"], (1, 0)), key


# ---------------------------------------------------------------------------
# whole models: no override, one training step, experts checked with real gradients
# ---------------------------------------------------------------------------

HC_MULT, D_REL, REL_EXTENT = 2, 6, 10
CUSTOM = {  # families with custom matrices outside the MoE (the tiny config sets their sizes)
    "deepseek_v4": dict(hc_mult=HC_MULT),  # hyper-connections, compressors' position_bias
    "hy_v4": dict(hc_mult=HC_MULT),  # hyper-connections
    "hy_v4_vl": dict(hc_mult=HC_MULT),  # hyper-connections
    "glm5_next": dict(hc_mult=HC_MULT),  # hyper-connections, the indexer's gate
    **{f: dict(d_rel=D_REL, rel_extent=REL_EXTENT, sliding_window_size=REL_EXTENT)
       for f in ("inkling2", "inkling2_loop")},  # relative position bias (d_rel, extent)
    "inkling": dict(d_rel=D_REL, rel_extent=REL_EXTENT,  # relative logits (d_rel, extent)
                    sliding_window_size=REL_EXTENT),  # a sliding layer's extent
}


def _custom_truth(name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """``(fan_in, fan_out)`` of a custom matrix from its forward (not from sage_torch.moe).

    Hyper-connections read ``F.linear(flat, fn)`` with ``flat`` the ``hc_mult`` streams of
    the hidden state concatenated (width ``hc_mult·d``); Inkling's relative logits read
    ``relative_states @ proj`` with ``relative_states`` of width ``d_rel``; GLM-5 Next's
    indexer ``F.linear(hidden_states, index_kpool_compress_gate)``.  ``None`` for another
    parameter.
    """
    leaf = name.rpartition(".")[2]
    if leaf in ("fn", "hc_fn"):
        hidden = shape.index(HC_MULT * HIDDEN)
        return hidden, 1 - hidden
    if name.endswith(("rel_logits_proj.proj", "relative_position_bias.proj")):
        assert shape == (D_REL, REL_EXTENT), shape
        return 0, 1
    if leaf == "index_kpool_compress_gate":  # F.linear(hidden_states, gate)
        hidden = shape.index(HIDDEN)
        return hidden, 1 - hidden
    return None


LANGUAGE_MODELS = {  # families without a *ForCausalLM: the language model of the composite
    **{f: f"{c}TextModel" for f, c in (
        ("deepseek_ocr2", "DeepseekOcr2"), ("ernie4_5_vl_moe", "Ernie4_5_VLMoe"),
        ("glm4v_moe", "Glm4vMoe"), ("glm5_next", "Glm5Next"), ("hy_v4_vl", "HYV4VL"),
        ("mistral_large4", "MistralLarge4"), ("muse_spark", "MuseSpark"),
        ("qwen3_omni_moe", "Qwen3OmniMoeThinker"), ("qwen3_vl_moe", "Qwen3VLMoe"),
        ("step3p7", "Step3p7"), ("unlimited_ocr", "UnlimitedOcr"))},
    "diffusion_gemma": "DiffusionGemmaEncoderTextModel",  # its decoder is the same layers
    "openai_privacy_filter": "OpenAIPrivacyFilterForTokenClassification",  # a tagger
}
MODEL_EXTRA = {  # what a whole tiny model needs besides TINY and EXTRA (sizes, MoE layers)
    "gemma4": dict(vocab_size_per_layer_input=40, hidden_size_per_layer_input=8,
                   global_head_dim=8, enable_moe_block=True, top_k_experts=2),
    **{f: dict(unpadded_vocab_size=40, swa_num_attention_heads=2, swa_num_key_value_heads=2,
               swa_head_dim=8) for f in ("inkling2", "inkling2_loop")},
    "kimi_linear": dict(linear_attn_config={"head_dim": 8, "num_heads": 2,
                                            "short_conv_kernel_size": 4,
                                            "full_attn_layers": [], "kda_layers": [1]}),
    "glm5_next": dict(linear_head_dim=8, linear_num_heads=2, mlp_layer_types=["sparse"]),
    "step3p7": dict(mlp_layer_types=["sparse"], share_expert_dim=WIDTH, sliding_window=4),
    "hy_v4_vl": dict(mlp_layer_types=["sparse"]),
    "diffusion_gemma": dict(top_k_experts=2),
    "glm4v_moe": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": [1, 1, 0]}),
    "deepseek_ocr2": dict(mlp_layer_types=["sparse"]),
    "lfm2_moe": dict(num_dense_layers=0, layer_types=["full_attention"]),
    "ernie4_5_vl_moe": dict(moe_intermediate_size=[WIDTH, WIDTH], mlp_layer_types=["sparse"],
                            moe_k=2, moe_num_experts=EXPERTS,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "mrope_section": [1, 1, 2]}),
}


FLOAT32_ROUTERS = {
    # modeling_inkling2.py:809,811 hidden_states.float(); F.linear(flat, self.weight)
    "inkling2.modeling_inkling2.Inkling2TopKRouter",
    # modeling_inkling2_loop.py:1165,1167 (the same)
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopTopKRouter",
}


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The model's training loss on ``ids``: next-token, tagging, or the hidden states'."""
    name = type(model).__name__
    if name.endswith("ForCausalLM"):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    if name.endswith("ForTokenClassification"):
        return model(input_ids=ids, labels=ids % model.config.num_labels).loss
    return model(input_ids=ids, use_cache=False).last_hidden_state.pow(2).mean()


def _causal_lm(family: str) -> nn.Module:
    """A tiny model of ``family``: its *ForCausalLM, or :data:`LANGUAGE_MODELS`'s model."""
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    names = sorted(n for n in dir(module) if n.endswith("ForCausalLM"))
    names = names or [n for n in (LANGUAGE_MODELS.get(family),) if n is not None]
    if not names:
        pytest.skip(f"{family}: no *ForCausalLM and no language model in LANGUAGE_MODELS; "
                    "its experts are tested as modules above")
    model_cls = getattr(module, names[0])
    try:
        config = model_cls.config_class(**{**TINY, **EXTRA.get(family, {}),
                                           **CUSTOM.get(family, {}),
                                           **MODEL_EXTRA.get(family, {})})
        with torch.device("meta"):
            size = sum(p.numel() for p in model_cls(config).parameters())
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"{family}: the tiny config does not validate ({type(e).__name__}); its "
                    "experts are tested as modules above")
    if size > 1_000_000:
        pytest.skip(f"{family}: {size} parameters from the tiny config (sizes it does not "
                    "take); its experts are tested as modules above")
    torch.manual_seed(0)
    model = model_cls(config).double().eval()
    for module in model.modules():  # routers that compute in float32 (hidden_states.float())
        if _key(type(module)) in FLOAT32_ROUTERS:
            module.float()
    return model


@pytest.mark.parametrize("family", sorted({_family(k) for k in moe.EXPERTS}))
def test_a_tiny_model_of_each_family_trains_with_no_override(family):
    model = _causal_lm(family)
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    keep = copy.deepcopy(model.state_dict())
    loss = _loss(model, ids)
    loss.backward()
    experts = [m for m in model.modules() if _fused(type(m))]
    fused = {n: p for n, p in model.named_parameters() if p.dim() == 3 and p.grad is not None
             and p.grad.abs().sum() > 0
             and any(p is q for m in experts for q in m.parameters(recurse=False))}
    assert fused, f"{family}: no expert received a gradient"
    custom = {n: _custom_truth(n, tuple(p.shape)) for n, p in model.named_parameters()
              if p.dim() == 2 and p.grad is not None and _custom_truth(n, tuple(p.shape))}
    assert bool(custom) == (family in CUSTOM), (family, sorted(custom))
    routes = {r.name: r.route for r in sage_torch.route_params(model)}
    assert all(routes[n].kind == "vector" for n in routes if n.endswith("position_bias"))
    truths = {**{n: _truth(n, tuple(p.shape)) for n, p in fused.items()}, **custom}
    fused = {**fused, **{n: p for n, p in model.named_parameters() if n in custom}}
    before = {n: p.detach().numpy().copy() for n, p in fused.items()}
    grads = {n: p.grad.detach().numpy().copy() for n, p in fused.items()}
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    opt.step()
    for n, p in model.named_parameters():
        assert torch.isfinite(p).all(), n
    for n, p in fused.items():
        assert _right(p.detach().numpy(), before[n], grads[n], truths[n]), (
            f"{family}: {n} {tuple(p.shape)}")
    model.load_state_dict(keep)


# ---------------------------------------------------------------------------
# classes the table does not know; peft LoRA on the experts
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("transposed", [False, True])
def test_an_unlisted_decorated_experts_class_is_read_from_is_transposed(transposed):
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_transposed=transposed)
    class NewExperts(nn.Module):  # a family newer than the table
        def __init__(self, config):
            super().__init__()
            shape = (EXPERTS, HIDDEN, 2 * WIDTH) if transposed else (EXPERTS, 2 * WIDTH, HIDDEN)
            self.gate_up_proj = nn.Parameter(torch.zeros(shape))

    model = nn.ModuleDict({"m": NewExperts(transformers.PretrainedConfig())}).double()
    route = sage_torch.route_params(model)[0].route
    assert "use_experts_implementation(is_transposed=" in route.evidence
    before, grads = _step(model)
    weight = model["m"].gate_up_proj
    assert _right(weight.detach().numpy(), before["m.gate_up_proj"], grads["m.gate_up_proj"],
                  _truth("gate_up_proj", tuple(weight.shape)))


def test_a_subclass_of_a_listed_experts_class_gets_its_layout():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    class MyExperts(GptOssExperts):
        pass

    config = transformers.GptOssConfig(**TINY)
    routed = {r.name: r.route for r in sage_torch.route_params(MyExperts(config))}
    assert (routed["gate_up_proj"].fan_in, routed["gate_up_proj"].fan_out) == ((1,), (2,))


@pytest.mark.parametrize("family", sorted(CUSTOM))
def test_custom_matrices_get_the_step_of_their_forward_reading(family):
    model = _causal_lm(family)
    custom = {n: _custom_truth(n, tuple(p.shape)) for n, p in model.named_parameters()
              if p.dim() == 2 and _custom_truth(n, tuple(p.shape))}
    assert custom, family
    before, grads = _step(model)
    params = dict(model.named_parameters())
    for n, truth in custom.items():
        assert _right(params[n].detach().numpy(), before[n], grads[n], truth), n
    twin = _causal_lm(family)
    flipped = {n: Route("dense", fan_in=t[1], fan_out=t[0]) for n, t in custom.items()}
    before, grads = _step(twin, flipped)
    params = dict(twin.named_parameters())
    for n, truth in custom.items():
        assert not _right(params[n].detach().numpy(), before[n], grads[n], truth), n


# ---------------------------------------------------------------------------
# views: peft LoRA on fused experts, DBRX's flattened experts
# ---------------------------------------------------------------------------


def _per_expert_right(after, before, grad, split, axes) -> bool:
    """Whether each expert's matrix ``split(x)[e]`` got the SinkGD step of ``axes``."""
    return _right(split(after), split(before), split(grad), axes)


def _lora_model(family: str):
    peft = pytest.importorskip("peft")
    if not hasattr(peft.LoraConfig(), "target_parameters"):
        pytest.skip(f"peft {peft.__version__} has no target_parameters (LoRA on experts)")
    modules = ["q_proj", "o_proj"] + (["shared_expert.gate_proj"] if family == "qwen2_moe"
                                      else [])
    return peft.get_peft_model(_causal_lm(family), peft.LoraConfig(
        r=2, target_modules=modules,
        target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))


def _lora_factors(model) -> dict[str, tuple[int, int, int]]:
    """Each expert factor's name -> ``(E, r, which)``, checked against peft's own delta.

    peft's ``ParamWrapper.get_delta_weight`` is the truth: the factors are read per expert
    as ``A.reshape(E, r, in)[e]`` and ``B.reshape(out, r, E)[:, :, e]`` exactly when the
    delta of expert ``e`` is ``B_e @ A_e`` (as (out, in); transposed for an (E, in, out)
    tensor), which this checks on random factors.
    """
    from peft.tuners.lora.layer import ParamWrapper

    found = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for wrapper in (m for m in model.modules() if isinstance(m, ParamWrapper)):
        a, b = wrapper.lora_A["default"].weight, wrapper.lora_B["default"].weight
        experts, r = wrapper.num_experts, wrapper.r["default"]
        with torch.no_grad():
            a.normal_(), b.normal_()
            delta = wrapper.get_delta_weight("default") / wrapper.scaling["default"]
            mine = torch.stack([b.reshape(b.shape[0], r, experts)[:, :, e]
                                @ a.reshape(experts, r, -1)[e] for e in range(experts)])
        if tuple(delta.shape) != tuple(mine.shape):
            mine = mine.transpose(1, 2)  # the tensor is (E, in, out)
        assert torch.allclose(delta, mine, rtol=0, atol=1e-10), names[id(a)]
        found[names[id(a)]] = (experts, r, 0)
        found[names[id(b)]] = (experts, r, 1)
    return found


@pytest.mark.parametrize("family", ["gpt_oss", "qwen2_moe", "qwen3_moe"])
def test_peft_lora_factors_of_fused_experts_get_each_experts_step(family):
    model = _lora_model(family)
    factors = _lora_factors(model)
    assert len(factors) == 4, sorted(factors)
    routed = {r.name: r.route for r in sage_torch.route_params(model)}
    linear = [n for n in routed if ".lora_" in n and n not in factors]
    assert linear and all(routed[n].evidence == "module nn.Linear" for n in linear), linear

    def split(name):
        experts, r, which = factors[name]
        if which == 0:  # A (E·r, in) -> (E, r, in)
            return lambda x: x.reshape(experts, r, -1)
        return lambda x: np.moveaxis(x.reshape(x.shape[0], r, experts), 2, 0)  # B: (E, out, r)

    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(1)
    for p in trainable.values():
        p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        p.grad = torch.randn(p.shape, generator=gen, dtype=torch.float64)
    before = {n: p.detach().numpy().copy() for n, p in trainable.items()}
    grads = {n: p.grad.detach().numpy().copy() for n, p in trainable.items()}
    state = copy.deepcopy(model.state_dict())
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    opt.step()
    for n in factors:  # each expert's factor is an (out, in) matrix of F.linear
        after = trainable[n].detach().numpy()
        assert _per_expert_right(after, before[n], grads[n], split(n), (1, 0)), n
        assert not _right(after, before[n], grads[n], (1, 0)), f"{n}: merged passed"
    for n in linear:
        assert _right(trainable[n].detach().numpy(), before[n], grads[n], (1, 0)), n
    # the transposed reading of each expert's factor (same view) and the merged one fail
    for wrong in ("transposed", "merged"):
        model.load_state_dict(state)
        for n, p in trainable.items():
            p.grad = torch.from_numpy(grads[n].copy())
        overrides = {n: Route("dense", fan_in=1, fan_out=0) if wrong == "merged" else Route(
                         "dense", fan_in=routed[n].fan_out, fan_out=routed[n].fan_in,
                         batch=routed[n].batch, view=routed[n].view) for n in factors}
        sage_torch.make_optimizer("sage-hybrid", model, lr=LR, route_overrides=overrides).step()
        for n in factors:
            assert not _per_expert_right(trainable[n].detach().numpy(), before[n], grads[n],
                                         split(n), (1, 0)), f"{n}: {wrong} passed"


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_peft_lora_on_moe_models_trains_with_no_override(family):
    model = _lora_model(family)
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    views = [g["view"] for g in opt.param_groups if g.get("view") is not None]
    assert len(views) == 4, views
    ids = torch.randint(0, TINY["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        losses.append(float(loss.detach()))
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert losses[-1] < losses[0], losses
    saved = opt.state_dict()  # the state of a viewed factor has the view's shape
    fresh = sage_torch.make_optimizer("sage-hybrid", model, lr=LR)
    fresh.load_state_dict(saved)
    assert all(torch.equal(fresh.state[p]["step"], opt.state[p]["step"]) for p in opt.state)


def test_docs_routing_lists_every_experts_class_with_its_layout():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text()
    for key, layout in moe.EXPERTS.items():
        row = next((line for line in doc.splitlines()
                    if f"| `{key.rsplit('.', 1)[1]}` |" in line), None)
        assert row is not None and f"| {layout} |" in row, key


def test_docs_routing_lists_every_custom_matrix_with_its_route():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "routing.md").read_text()
    tables = [(moe.MATRICES, lambda r: f"dense {'(out, in)' if r == moe.LINEAR else '(in, out)'}"),
              ({k: dict.fromkeys(v, None) for k, v in moe.ELEMENTWISE.items()}, lambda r: "vector")]
    for table, route in tables:
        for key, attrs in table.items():
            for attr, reading in attrs.items():
                row = f"| `{key.rsplit('.', 1)[1]}` | `{attr}` | {route(reading)} |"
                assert row in doc, row


def test_every_router_class_with_a_weight_matrix_is_in_the_table():
    """Router classes holding their own ``weight`` ``(E, d)`` parameter (not an nn.Linear)."""
    root = Path(transformers.__file__).parent / "models"
    found = set()
    for path in sorted(root.glob("*/modeling_*.py")):
        text = path.read_text(encoding="utf-8")
        if "Router" not in text:
            continue
        name = f"transformers.models.{path.parent.name}.{path.stem}"
        try:
            module = importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional dependency is missing
            continue
        for cls in vars(module).values():
            if (isinstance(cls, type) and issubclass(cls, nn.Module) and cls.__module__ == name
                    and "router" in cls.__name__.lower()
                    and re.search(r"self\.weight = nn\.Parameter\(\s*torch\.\w+\(\s*[^,()]+,"
                                  r"\s*[^,()]+[,)]", inspect.getsource(cls.__init__))):
                found.add(_key(cls))
    assert len(found) >= 50, sorted(found)
    assert not sorted(found - moe.ROUTERS), sorted(found - moe.ROUTERS)


def _dbrx():
    if getattr(transformers, "DbrxForCausalLM", None) is None:
        pytest.skip(f"transformers {transformers.__version__} has no DBRX")
    torch.manual_seed(0)
    return transformers.DbrxForCausalLM(transformers.DbrxConfig(
        vocab_size=40, d_model=HIDDEN, n_layers=1, n_heads=2, max_seq_len=32,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=WIDTH, moe_num_experts=EXPERTS, moe_top_k=2))).double()


def test_dbrx_flattened_experts_get_each_experts_step():
    """DBRX stores its experts as (E·ffn, d) weights and reads ``w.view(-1, ffn, d)[e]``:
    ``x.matmul(w1[e].T)``, ``x.matmul(v1[e].T)`` (each (out, in)), ``h.matmul(w2[e])``
    ((in, out))."""
    truth = {"w1": (1, 0), "v1": (1, 0), "w2": (0, 1)}  # modeling_dbrx.py:264,265,268

    def split(x):
        return x.reshape(-1, WIDTH, HIDDEN)

    prefix = "transformer.blocks.0.ffn.experts.mlp."
    model = _dbrx()
    routed = {r.name: r.route for r in sage_torch.route_params(model)}
    assert {routed[prefix + w].view for w in truth} == {(EXPERTS, WIDTH, HIDDEN)}
    before, grads = _step(model)
    params = dict(model.named_parameters())
    for w, axes in truth.items():
        n = prefix + w
        after = params[n].detach().numpy()
        assert _per_expert_right(after, before[n], grads[n], split, axes), n
        assert not _right(after, before[n], grads[n], axes), f"{n}: merged passed"
    for wrong in ("transposed", "merged"):
        twin = _dbrx()
        overrides = {prefix + w: Route("dense", fan_in=axes[1] + 1, fan_out=axes[0] + 1,
                                       batch=0, view=(EXPERTS, WIDTH, HIDDEN))
                     if wrong == "transposed" else Route("dense", fan_in=axes[0],
                                                         fan_out=axes[1])
                     for w, axes in truth.items()}
        before, grads = _step(twin, overrides)
        params = dict(twin.named_parameters())
        for w, axes in truth.items():
            n = prefix + w
            assert not _per_expert_right(params[n].detach().numpy(), before[n], grads[n],
                                         split, axes), f"{n}: {wrong} passed"
    # a real step with no override; the state has the view's shape and round-trips
    model = _dbrx()
    opt = sage_torch.make_optimizer("sage-pure", model, lr=LR)
    ids = torch.randint(0, 40, (2, 6), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    w1 = dict(model.named_parameters())[prefix + "w1"]
    assert tuple(opt.state[w1]["exp_avg"].shape) == (EXPERTS, WIDTH, HIDDEN)
    assert tuple(opt.state[w1]["scale_avg"].shape) == (EXPERTS, HIDDEN)  # per expert
    fresh = sage_torch.make_optimizer("sage-pure", model, lr=LR)
    fresh.load_state_dict(opt.state_dict())
    assert torch.equal(fresh.state[w1]["exp_avg"], opt.state[w1]["exp_avg"])


def test_a_route_view_is_checked_and_refused_by_sage_optax():
    with pytest.raises(RoutingError, match=r"views it as \(3, 4, 4\), which has 48 elements"):
        Route("dense", fan_in=2, fan_out=1, batch=0, view=(3, 4, 4)).resolve((8, 4), "w")
    with pytest.raises(RoutingError, match="view must be a tuple of positive ints"):
        Route("dense", fan_in=2, fan_out=1, view=(2, 0, 4))
    model = _dbrx()
    name = "transformer.blocks.0.ffn.experts.mlp.w1"
    with pytest.raises(ValueError, match=r"cannot be viewed as \(5, 24, 16\)"):
        sage_torch.make_optimizer("sage-hybrid", model, route_overrides={
            name: Route("dense", fan_in=2, fan_out=1, batch=0, view=(4, 24, 16))}
        ).add_param_group({"params": [nn.Parameter(torch.zeros(96, 16))], "kind": "dense",
                           "view": (5, 24, 16), "fan_in_dim": 2, "fan_out_dim": 1})
    jnp = pytest.importorskip("jax.numpy")
    sage_optax = pytest.importorskip("sage_optax")
    with pytest.raises(RoutingError, match=r"parameter 'w': Route\(view=\(2, 4, 4\)\) is not "
                                           "supported by sage_optax"):
        sage_optax.route_params({"w": jnp.zeros((8, 4))}, {"w": Route(
            "dense", fan_in=2, fan_out=1, batch=0, view=(2, 4, 4))})
    tx = sage_optax.sinkgd(1e-2, axes={"w": Route("dense", fan_in=2, fan_out=1, batch=0,
                                                  view=(2, 4, 4))})
    params = {"w": jnp.ones((8, 4))}
    with pytest.raises(RoutingError, match=r"parameter '.*w.*': Route\(view=\(2, 4, 4\)\) is not"):
        tx.update(params, tx.init(params), params)
