"""The transformers adapter: the layouts of transformers' own module types.

``Conv1D`` (GPT-2 and its relatives) stores its weight ``(in, out)`` (dense, fan-in 0,
fan-out 1).  ``XLNetRelativeAttention``'s ``q``/``k``/``v``/``r`` ``(d_model, heads, d_head)``
are read by ``einsum('ibh,hnd->ibnd')`` (fan-in 0, fan-out ``(1, 2)``), its ``o`` by
``einsum('ibnd,hnd->ibh')`` (fan-in ``(1, 2)``, fan-out 0); the per-head biases ``r_*_bias``
are vectors and ``seg_embed`` ``(2, heads, d_head)`` a table of 2 segments per head.

The mixture-of-experts modules: the layout of their fused expert tensors.

The experts of most mixture-of-experts families of transformers (5.x) are one module holding
3-D parameters ``(E, ., .)``, one matrix per expert: ``gate_up_proj`` (the gate and up
projections concatenated), ``down_proj`` (``up_proj`` without a gate, ``weight`` in JetMoE).
Which of the two other axes is the fan-in depends on the family's forward code:

* ``(E, out, in)`` (:data:`OUT_IN`): ``F.linear(x, W[e])`` (Mixtral, Qwen-MoE, DeepSeek,
  OLMoE, Jamba, GraniteMoE, GLM-4-MoE, JetMoE, ... and every class built by
  ``transformers.integrations.moe.use_experts_implementation`` with ``is_transposed=False``);
* ``(E, in, out)`` (:data:`IN_OUT`): ``x @ W[e]`` or ``torch.bmm(x, W)`` (GPT-OSS, Aria,
  OpenAI privacy filter: ``is_transposed=True``; Llama-4, read from its forward).

:data:`EXPERTS` maps each experts class (``<model>.modeling_<model>.<Class>`` under
``transformers.models``) to its layout; :data:`ROUTERS` lists the router (gate) classes
whose ``weight`` ``(E, d)`` is read as ``F.linear(x, W)``: one ``(out, in)`` matrix.  Each
entry's comment is the modeling line (transformers 5.24) it was read from.  The expert axis
is a batch axis: SinkGD and SAGE treat each expert's matrix by itself.  A class that
subclasses a listed one gets its layout; an experts class built by
``use_experts_implementation`` that the table does not know is read from the decorator's
``is_transposed`` flag; any other experts class is refused (:mod:`sage_torch.routing`).
transformers is never imported here: classes are named by their module path, and
:mod:`sage_torch.routing` loads this adapter once transformers is imported.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch
from torch import nn

from sage_optim.routing import VECTOR_OPTION, Option, Route, RoutingError, advice_lines, fmt_shape
from sage_torch.routing import (
    Adapter,
    _label,
    loaded_class,
    register_adapter,
)

__all__ = ["ADAPTER", "ELEMENTWISE", "EXPERTS", "FLATTENED", "IN_OUT", "LINEAR", "MATRICES",
           "OUT_IN", "ROUTERS", "X_AT_W",
           "experts_layout", "flattened_route", "moe_route", "module_route", "refuse"]

OUT_IN = "(E, out, in)"
"""Expert tensors read as ``F.linear(x, W[e])``: axis 1 the fan-out, axis 2 the fan-in."""

IN_OUT = "(E, in, out)"
"""Expert tensors read as ``x @ W[e]``: axis 1 the fan-in, axis 2 the fan-out."""

_READS = {OUT_IN: "F.linear(x, W[e])", IN_OUT: "x @ W[e]"}

EXPERTS: Mapping[str, str] = MappingProxyType({
    # modeling_afmoe.py:188,190 F.linear(current_state, self.gate_up_proj[expert_idx])
    "afmoe.modeling_afmoe.AfmoeExperts": OUT_IN,
    # modeling_aria.py:310,312 (current_state @ self.gate_up_proj[expert_idx])
    "aria.modeling_aria.AriaExperts": IN_OUT,
    # modeling_axk1.py:206,208 F.linear(current_state, self.gate_up_proj[expert_idx])
    "axk1.modeling_axk1.AXK1Experts": OUT_IN,
    # modeling_axk2.py:363,365 F.linear(current_state, self.gate_up_proj[expert_idx])
    "axk2.modeling_axk2.AXK2Experts": OUT_IN,
    # modeling_bailing_hybrid.py:176,178 F.linear(current_state, self.gate_up_proj[expert_idx])
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridExperts": OUT_IN,
    # modeling_beam.py:309,310 F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
    "beam.modeling_beam.BeamExperts": OUT_IN,
    # modeling_cohere2_moe.py:132,134 F.linear(current_state, self.gate_up_proj[expert_idx])
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeExperts": OUT_IN,
    # modeling_deepseek_ocr2.py:1130,1132 F.linear(current_state, self.gate_up_proj[expert_idx])
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextExperts": OUT_IN,
    # modeling_deepseek_v2.py:77,79 F.linear(current_state, self.gate_up_proj[expert_idx])
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2Experts": OUT_IN,
    # modeling_deepseek_v3.py:192,194 F.linear(current_state, self.gate_up_proj[expert_idx])
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3Experts": OUT_IN,
    # modeling_deepseek_v32.py:570,572 F.linear(current_state, self.gate_up_proj[expert_idx])
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32Experts": OUT_IN,
    # modeling_deepseek_v4.py:1062,1063 F.linear(hidden_states[token_idx], self.gate_up_proj[expe...
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Experts": OUT_IN,
    # modeling_diffusion_gemma.py:576,578 F.linear(current_state, self.gate_up_proj[expert_idx])
    "diffusion_gemma.modeling_diffusion_gemma.DiffusionGemmaTextExperts": OUT_IN,
    # modeling_dots1.py:344,346 F.linear(current_state, self.gate_up_proj[expert_idx])
    "dots1.modeling_dots1.Dots1Experts": OUT_IN,
    # modeling_dots3_note.py:373,375 F.linear(current_state, self.gate_up_proj[expert_idx])
    "dots3_note.modeling_dots3_note.Dots3NoteExperts": OUT_IN,
    # modeling_ernie4_5_moe.py:327,329 F.linear(current_state, self.gate_up_proj[expert_idx])
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeExperts": OUT_IN,
    # modeling_ernie4_5_vl_moe.py:388,390 F.linear(current_state, self.gate_up_proj[expert_idx])
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeExperts": OUT_IN,
    # modeling_exaone_moe.py:300,302 F.linear(current_state, self.gate_up_proj[expert_idx])
    "exaone_moe.modeling_exaone_moe.ExaoneMoeExperts": OUT_IN,
    # modeling_flex_olmo.py:326,328 F.linear(current_state, self.gate_up_proj[expert_idx])
    "flex_olmo.modeling_flex_olmo.FlexOlmoExperts": OUT_IN,
    # modeling_flint.py:136,138 F.linear(current_state, self.gate_up_proj[expert_idx])
    "flint.modeling_flint.FlintExperts": OUT_IN,
    # modeling_gemma4.py:1285,1287 F.linear(current_state, self.gate_up_proj[expert_idx])
    "gemma4.modeling_gemma4.Gemma4TextExperts": OUT_IN,
    # modeling_glm4_moe.py:362,364 F.linear(current_state, self.gate_up_proj[expert_idx])
    "glm4_moe.modeling_glm4_moe.Glm4MoeExperts": OUT_IN,
    # modeling_glm4_moe_lite.py:468,470 F.linear(current_state, self.gate_up_proj[expert_idx])
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteExperts": OUT_IN,
    # modeling_glm4v_moe.py:343,345 F.linear(current_state, self.gate_up_proj[expert_idx])
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextExperts": OUT_IN,
    # modeling_glm5_next.py:133,134 F.linear(hidden_states[token_idx], self.gate_up_proj[expert_i...
    "glm5_next.modeling_glm5_next.Glm5NextTextExperts": OUT_IN,
    # modeling_glm_moe_dsa.py:543,545 F.linear(current_state, self.gate_up_proj[expert_idx])
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaExperts": OUT_IN,
    # modeling_gpt_oss.py:108,110 current_state @ self.gate_up_proj[expert_idx] + self.gate_up_pr...
    "gpt_oss.modeling_gpt_oss.GptOssExperts": IN_OUT,
    # modeling_granitemoe.py:166,168 F.linear(current_state, self.gate_up_proj[expert_idx])
    "granitemoe.modeling_granitemoe.GraniteMoeExperts": OUT_IN,
    # modeling_granitemoe_swa.py:100,102 F.linear(current_state, self.gate_up_proj[expert_idx])
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWAExperts": OUT_IN,
    # modeling_granitemoehybrid.py:872,874 F.linear(current_state, self.gate_up_proj[expert_idx])
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridExperts": OUT_IN,
    # modeling_granitemoeshared.py:170,172 F.linear(current_state, self.gate_up_proj[expert_idx])
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedExperts": OUT_IN,
    # modeling_hunyuan_v1_moe.py:276,278 F.linear(current_state, self.gate_up_proj[expert_idx])
    "hunyuan_v1_moe.modeling_hunyuan_v1_moe.HunYuanMoEV1Experts": OUT_IN,
    # modeling_hy_v3.py:331,333 F.linear(current_state, self.gate_up_proj[expert_idx])
    "hy_v3.modeling_hy_v3.HYV3Experts": OUT_IN,
    # modeling_hy_v4.py:567,568 F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
    "hy_v4.modeling_hy_v4.HYV4Experts": OUT_IN,
    # modeling_hy_v4_vl.py:530,531 F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLExperts": OUT_IN,
    # modeling_inkling.py:325,327 F.linear(current_state, self.gate_up_proj[expert_idx])
    "inkling.modeling_inkling.InklingExperts": OUT_IN,
    # modeling_inkling.py:392,393,395 torch.bmm(hidden_states, self.gate_proj.transpose(1, 2))
    "inkling.modeling_inkling.InklingSharedExperts": OUT_IN,
    # modeling_inkling2.py:784,785 F.linear(current_state, self.gate_up_proj[expert_idx])
    "inkling2.modeling_inkling2.Inkling2Experts": OUT_IN,
    # modeling_inkling2_loop.py:802,803 F.linear(current_state, self.gate_up_proj[expert_idx])
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopExperts": OUT_IN,
    # modeling_jamba.py:674,676 F.linear(current_state, self.gate_up_proj[expert_idx])
    "jamba.modeling_jamba.JambaExperts": OUT_IN,
    # modeling_jetmoe.py:155 output_list.append(F.linear(input_list[i], self.weight[i]))
    "jetmoe.modeling_jetmoe.JetMoeParallelExperts": OUT_IN,
    # modeling_kimi_linear.py:129,131 F.linear(current_state, self.gate_up_proj[expert_idx])
    "kimi_linear.modeling_kimi_linear.KimiLinearExperts": OUT_IN,
    # modeling_kolibri1.py:258,260 F.linear(current_state, self.gate_up_proj[expert_idx])
    "kolibri1.modeling_kolibri1.Kolibri1Experts": OUT_IN,
    # modeling_laguna.py:209,211 F.linear(current_state, self.gate_up_proj[expert_idx])
    "laguna.modeling_laguna.LagunaExperts": OUT_IN,
    # modeling_lara_mini.py:756,758 F.linear(current_state, self.gate_up_proj[expert_idx])
    "lara_mini.modeling_lara_mini.LaraMiniExperts": OUT_IN,
    # modeling_lfm2_moe.py:162,164 F.linear(current_state, self.gate_up_proj[expert_idx])
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeExperts": OUT_IN,
    # modeling_llama4.py:80,82 torch.bmm(hidden_states, self.gate_up_proj)
    "llama4.modeling_llama4.Llama4TextExperts": IN_OUT,
    # modeling_longcat_flash.py:198,200 F.linear(current_state, self.gate_up_proj[expert_idx])
    "longcat_flash.modeling_longcat_flash.LongcatFlashExperts": OUT_IN,
    # modeling_mellum.py:305,307 F.linear(current_state, self.gate_up_proj[expert_idx])
    "mellum.modeling_mellum.MellumExperts": OUT_IN,
    # modeling_mimo_v2_flash.py:201,203 F.linear(current_state, self.gate_up_proj[expert_idx])
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashExperts": OUT_IN,
    # modeling_minimax.py:502,504 F.linear(current_state, self.gate_up_proj[expert_idx])
    "minimax.modeling_minimax.MiniMaxExperts": OUT_IN,
    # modeling_minimax_m2.py:98,100 F.linear(current_state, self.gate_up_proj[expert_idx])
    "minimax_m2.modeling_minimax_m2.MiniMaxM2Experts": OUT_IN,
    # modeling_minimax_m3_vl.py:220,221 F.linear(hidden_states[token_idx], self.gate_up_proj[expe...
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLExperts": OUT_IN,
    # modeling_mistral4.py:201,203 F.linear(current_state, self.gate_up_proj[expert_idx])
    "mistral4.modeling_mistral4.Mistral4Experts": OUT_IN,
    # modeling_mistral_large4.py:589,591 F.linear(current_state, self.gate_up_proj[expert_idx])
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextExperts": OUT_IN,
    # modeling_mixtral.py:87,89 F.linear(current_state, self.gate_up_proj[expert_idx])
    "mixtral.modeling_mixtral.MixtralExperts": OUT_IN,
    # modeling_muse_spark.py:222,224 F.linear(current_state, self.gate_up_proj[expert_idx])
    "muse_spark.modeling_muse_spark.MuseSparkExperts": OUT_IN,
    # modeling_nemotron_h.py:702,704 F.linear(current_state, self.up_proj[expert_idx])
    "nemotron_h.modeling_nemotron_h.NemotronHExperts": OUT_IN,
    # modeling_olmoe.py:309,311 F.linear(current_state, self.gate_up_proj[expert_idx])
    "olmoe.modeling_olmoe.OlmoeExperts": OUT_IN,
    # modeling_openai_privacy_filter.py:291,295 current_state @ self.gate_up_proj[expert_idx]
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterExperts": IN_OUT,
    # modeling_phimoe.py:331,333 F.linear(current_state, self.gate_up_proj[expert_idx])
    "phimoe.modeling_phimoe.PhimoeExperts": OUT_IN,
    # modeling_qwen2_moe.py:302,304 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeExperts": OUT_IN,
    # modeling_qwen3_5_moe.py:884,886 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeExperts": OUT_IN,
    # modeling_qwen3_moe.py:241,243 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts": OUT_IN,
    # modeling_qwen3_next.py:819,821 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_next.modeling_qwen3_next.Qwen3NextExperts": OUT_IN,
    # modeling_qwen3_omni_moe.py:2873,2875 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextExperts": OUT_IN,
    # modeling_qwen3_omni_moe.py:1336,1338 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextExperts": OUT_IN,
    # modeling_qwen3_vl_moe.py:144,146 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextExperts": OUT_IN,
    # modeling_qwen4_exp.py:965,967 F.linear(current_state, self.gate_up_proj[expert_idx])
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextExperts": OUT_IN,
    # modeling_solar_open.py:175,177 F.linear(current_state, self.gate_up_proj[expert_idx])
    "solar_open.modeling_solar_open.SolarOpenExperts": OUT_IN,
    # modeling_step3p7.py:564,565 F.linear(hidden_states[token_idx], self.gate_up_proj[expert_idx])
    "step3p7.modeling_step3p7.Step3p7Experts": OUT_IN,
    # modeling_unlimited_ocr.py:1113,1115 F.linear(current_state, self.gate_up_proj[expert_idx])
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextExperts": OUT_IN,
    # modeling_zaya.py:603,605 F.linear(current_state, self.gate_up_proj[expert_idx])
    "zaya.modeling_zaya.ZayaExperts": OUT_IN,
})
"""Experts class (``<model>.modeling_<model>.<Class>``) -> the layout of its 3-D tensors."""

ROUTERS: frozenset[str] = frozenset({
    # modeling_aria.py:268 F.linear(hidden_states, self.weight)
    "aria.modeling_aria.AriaTextTopKRouter",
    # modeling_axk1.py:149 F.linear(hidden_states, self.weight)
    "axk1.modeling_axk1.AXK1TopkRouter",
    # modeling_axk2.py:296 F.linear(hidden_states, self.weight)
    "axk2.modeling_axk2.AXK2TopkRouter",
    # modeling_bailing_hybrid.py:804 F.linear(hidden_states, self.weight)
    "bailing_hybrid.modeling_bailing_hybrid.BailingHybridTopkRouter",
    # modeling_beam.py:352 F.linear(hidden_states, self.weight)
    "beam.modeling_beam.BeamTopKRouter",
    # modeling_cohere2_moe.py:151 F.linear(hidden_states, self.weight)
    "cohere2_moe.modeling_cohere2_moe.Cohere2MoeTopKRouter",
    # modeling_deepseek_ocr2.py:1153 F.linear(hidden_states, self.weight)
    "deepseek_ocr2.modeling_deepseek_ocr2.DeepseekOcr2TextTopkRouter",
    # modeling_deepseek_v2.py:100 F.linear(hidden_states, self.weight)
    "deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter",
    # modeling_deepseek_v3.py:135 F.linear(hidden_states, self.weight)
    "deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter",
    # modeling_deepseek_v32.py:513 F.linear(hidden_states, self.weight)
    "deepseek_v32.modeling_deepseek_v32.DeepseekV32TopkRouter",
    # modeling_deepseek_v4.py:1121 F.linear(flat, self.weight)
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4HashRouter",
    # modeling_deepseek_v4.py:1090 F.linear(flat, self.weight)
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4TopKRouter",
    # modeling_dots1.py:287 F.linear(hidden_states, self.weight)
    "dots1.modeling_dots1.Dots1TopkRouter",
    # modeling_dots3_note.py:316 F.linear(hidden_states, self.weight)
    "dots3_note.modeling_dots3_note.Dots3NoteTextTopkRouter",
    # modeling_dots3_note.py:1308 F.linear(hidden_states, self.weight)
    "dots3_note.modeling_dots3_note.Dots3NoteVisionTopKRouter",
    # modeling_ernie4_5_moe.py:349 F.linear(hidden_states, self.weight)
    "ernie4_5_moe.modeling_ernie4_5_moe.Ernie4_5_MoeTopKRouter",
    # modeling_ernie4_5_vl_moe.py:346 F.linear(hidden_states, self.weight)
    "ernie4_5_vl_moe.modeling_ernie4_5_vl_moe.Ernie4_5_VLMoeMoeTopKRouter",
    # modeling_exaone_moe.py:243 F.linear(hidden_states, self.weight)
    "exaone_moe.modeling_exaone_moe.ExaoneMoeTopkRouter",
    # modeling_flex_olmo.py:285 F.linear(hidden_states, self.weight)
    "flex_olmo.modeling_flex_olmo.FlexOlmoTopKRouter",
    # modeling_flint.py:97 F.linear(hidden_states, self.weight)
    "flint.modeling_flint.FlintTopKRouter",
    # modeling_glm4_moe.py:284 F.linear(hidden_states, self.weight)
    "glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter",
    # modeling_glm4_moe_lite.py:390 F.linear(hidden_states, self.weight)
    "glm4_moe_lite.modeling_glm4_moe_lite.Glm4MoeLiteTopkRouter",
    # modeling_glm4v_moe.py:286 F.linear(hidden_states, self.weight)
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeTextTopkRouter",
    # modeling_glm5_next.py:161 F.linear(hidden_states, self.weight)
    "glm5_next.modeling_glm5_next.Glm5NextTextTopkRouter",
    # modeling_glm_moe_dsa.py:486 F.linear(hidden_states, self.weight)
    "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaTopkRouter",
    # modeling_gpt_oss.py:127 F.linear(hidden_states, self.weight, self.bias)
    "gpt_oss.modeling_gpt_oss.GptOssTopKRouter",
    # modeling_granitemoe.py:129 F.linear(hidden_states, self.weight)
    "granitemoe.modeling_granitemoe.GraniteMoeTopKRouter",
    # modeling_granitemoe_swa.py:63 F.linear(hidden_states, self.weight)
    "granitemoe_swa.modeling_granitemoe_swa.GraniteMoeSWATopKRouter",
    # modeling_granitemoehybrid.py:835 F.linear(hidden_states, self.weight)
    "granitemoehybrid.modeling_granitemoehybrid.GraniteMoeHybridTopKRouter",
    # modeling_granitemoeshared.py:133 F.linear(hidden_states, self.weight)
    "granitemoeshared.modeling_granitemoeshared.GraniteMoeSharedTopKRouter",
    # modeling_hy_v3.py:286 F.linear(hidden_states, self.weight)
    "hy_v3.modeling_hy_v3.HYV3TopKRouter",
    # modeling_hy_v4.py:516 F.linear(hidden_states, self.weight)
    "hy_v4.modeling_hy_v4.HYV4TopkRouter",
    # modeling_hy_v4_vl.py:479 F.linear(hidden_states, self.weight)
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLTopkRouter",
    # modeling_inkling.py:352 F.linear(flat, self.weight)
    "inkling.modeling_inkling.InklingTopkRouter",
    # modeling_inkling2.py:811 F.linear(flat, self.weight)
    "inkling2.modeling_inkling2.Inkling2TopKRouter",
    # modeling_inkling2_loop.py:1167 F.linear(flat, self.weight)
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopTopKRouter",
    # modeling_jamba.py:695 F.linear(hidden_states, self.weight)
    "jamba.modeling_jamba.JambaTopKRouter",
    # modeling_kimi_linear.py:734 F.linear(hidden_states, self.weight)
    "kimi_linear.modeling_kimi_linear.KimiLinearTopkRouter",
    # modeling_kolibri1.py:289 F.linear(hidden_states, self.weight)
    "kolibri1.modeling_kolibri1.Kolibri1TopKRouter",
    # modeling_laguna.py:162 F.linear(hidden_states, self.weight)
    "laguna.modeling_laguna.LagunaTopKRouter",
    # modeling_lara_mini.py:777 F.linear(hidden_states, self.weight)
    "lara_mini.modeling_lara_mini.LaraMiniTopKRouter",
    # modeling_lfm2_moe.py:183 F.linear(hidden_states, self.weight)
    "lfm2_moe.modeling_lfm2_moe.Lfm2MoeTopKRouter",
    # modeling_mellum.py:325 F.linear(hidden_states, self.weight)
    "mellum.modeling_mellum.MellumTopKRouter",
    # modeling_mimo_v2_flash.py:144 F.linear(hidden_states, self.weight)
    "mimo_v2_flash.modeling_mimo_v2_flash.MiMoV2FlashTopkRouter",
    # modeling_minimax.py:463 F.linear(hidden_states, self.weight)
    "minimax.modeling_minimax.MiniMaxTopKRouter",
    # modeling_minimax_m2.py:56 F.linear(hidden_states.to(self.weight.dtype), self.weight)
    "minimax_m2.modeling_minimax_m2.MiniMaxM2TopKRouter",
    # modeling_minimax_m3_vl.py:245 F.linear(hidden_states.to(self.weight.dtype), self.weight)
    "minimax_m3_vl.modeling_minimax_m3_vl.MiniMaxM3VLTopKRouter",
    # modeling_mistral4.py:147 F.linear(hidden_states, self.weight)
    "mistral4.modeling_mistral4.Mistral4TopkRouter",
    # modeling_mistral_large4.py:536 F.linear(hidden_states, self.weight)
    "mistral_large4.modeling_mistral_large4.MistralLarge4TextTopkRouter",
    # modeling_mixtral.py:106 F.linear(hidden_states, self.weight)
    "mixtral.modeling_mixtral.MixtralTopKRouter",
    # modeling_muse_spark.py:178 F.linear(hidden_states, self.weight)
    "muse_spark.modeling_muse_spark.MuseSparkTopkRouter",
    # modeling_nemotron_h.py:774 F.linear(hidden_states, self.weight)
    "nemotron_h.modeling_nemotron_h.NemotronHTopkRouter",
    # modeling_olmoe.py:329 F.linear(hidden_states, self.weight)
    "olmoe.modeling_olmoe.OlmoeTopKRouter",
    # modeling_openai_privacy_filter.py:313 F.linear(hidden_states, self.weight, self.bias)
    "openai_privacy_filter.modeling_openai_privacy_filter.OpenAIPrivacyFilterTopKRouter",
    # modeling_qwen2_moe.py:322 F.linear(hidden_states, self.weight)
    "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter",
    # modeling_qwen3_5_moe.py:904 F.linear(hidden_states, self.weight)
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeTopKRouter",
    # modeling_qwen3_moe.py:261 F.linear(hidden_states, self.weight)
    "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter",
    # modeling_qwen3_next.py:839 F.linear(hidden_states, self.weight)
    "qwen3_next.modeling_qwen3_next.Qwen3NextTopKRouter",
    # modeling_qwen3_omni_moe.py:2832 F.linear(hidden_states, self.weight)
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTalkerTextTopKRouter",
    # modeling_qwen3_omni_moe.py:1057 F.linear(hidden_states, self.weight)
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeTextTopKRouter",
    # modeling_qwen3_omni_moe.py:1356 F.linear(hidden_states, self.weight)
    "qwen3_omni_moe.modeling_qwen3_omni_moe.Qwen3OmniMoeThinkerTextTopKRouter",
    # modeling_qwen3_vl_moe.py:163 F.linear(hidden_states, self.weight)
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextTopKRouter",
    # modeling_qwen4_exp.py:985 F.linear(hidden_states, self.weight)
    "qwen4_exp.modeling_qwen4_exp.Qwen4ExpTextTopKRouter",
    # modeling_solar_open.py:118 F.linear(hidden_states, self.weight)
    "solar_open.modeling_solar_open.SolarOpenTopkRouter",
    # modeling_step3p7.py:587 F.linear(hidden_states.to(self.weight.dtype), self.weight)
    "step3p7.modeling_step3p7.Step3p7TopKRouter",
    # modeling_unlimited_ocr.py:1136 F.linear(hidden_states, self.weight)
    "unlimited_ocr.modeling_unlimited_ocr.UnlimitedOcrTextTopkRouter",
})
"""Router classes whose ``weight`` ``(E, d)`` is read as ``F.linear(x, W)`` (``(out, in)``)."""

ELEMENTWISE: Mapping[str, frozenset[str]] = MappingProxyType({
    # modeling_jamba.py:530 A = -torch.exp(self.A_log.float()): (intermediate, d_state)
    "jamba.modeling_jamba.JambaMambaMixer": frozenset({"A_log"}),
    # modeling_mamba.py:380 A = -torch.exp(self.A_log.float())
    "mamba.modeling_mamba.MambaMixer": frozenset({"A_log"}),
    # modeling_falcon_mamba.py:403 A = -torch.exp(self.A_log.float())
    "falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": frozenset({"A_log"}),
    # modeling_deepseek_v4.py:427 chunk_gate.view(...) + self.position_bias: (rate, head_dim)
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4HCACompressor": frozenset({"position_bias"}),
    # modeling_deepseek_v4.py:543 chunk_gate.view(batch, n_windows, ratio, -1) + self.position_bias
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4Indexer": frozenset({"position_bias"}),
    # modeling_deepseek_v4.py:658 chunk_gate.view(batch, n_windows, ratio, -1) + self.position_bias
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4CSACompressor": frozenset({"position_bias"}),
    # modeling_glm5_next.py:999 grouped_gate_scores.float() + self.index_kpool_compress_ape...
    "glm5_next.modeling_glm5_next.Glm5NextTextIndexer": frozenset({"index_kpool_compress_ape"}),
    # modeling_inkling2.py:157 hidden_states.float() * self.scale.float(): (heads, head_dim)
    "inkling2.modeling_inkling2.Inkling2ScaledL2Clip": frozenset({"scale"}),
    # modeling_inkling2.py:192 self.l2_clip(hidden_states.float() * self.scale.float())
    "inkling2.modeling_inkling2.Inkling2LogScaledL2Clip": frozenset({"scale"}),
    # modeling_inkling2_loop.py:200 hidden_states.float() * self.scale.float()
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopScaledL2Clip": frozenset({"scale"}),
    # modeling_inkling2_loop.py:235 self.l2_clip(hidden_states.float() * self.scale.float())
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopLogScaledL2Clip": frozenset({"scale"}),
    # modeling_inkling2_loop.py:152,165 query (loop layers, 4, d): learned query tokens, one
    # per message and loop layer, as a class token (self.query[loop_layer_idx] as the queries)
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopMessageAttentionResidual":
        frozenset({"query"}),
})
"""Matrices of these families' other modules that their forward reads element by element
(Mamba's ``A_log``, the log of a state matrix per channel, in Jamba's Mamba layers;
DeepSeek-V4's compressors' ``position_bias``, added to the gate of each position of a
window; Inkling-2's per-head ``scale``, multiplied in), and Inkling-2-Loop's learned query
tokens (used as activations, as a class token is): vectors."""

LINEAR = "F.linear(x, W)"
"""A custom matrix read as ``F.linear(x, W)``: ``(out, in)``."""

X_AT_W = "x @ W"
"""A custom matrix read as ``x @ W``: ``(in, out)``."""

MATRICES: Mapping[str, Mapping[str, str]] = MappingProxyType({
    # modeling_deepseek_v4.py:970 flattened = F.linear(flattened, self.fn.float())
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperConnection": MappingProxyType(
        {"fn": LINEAR}),
    # modeling_deepseek_v4.py:1013 mixes = F.linear(flat, self.hc_fn.float())
    "deepseek_v4.modeling_deepseek_v4.DeepseekV4HyperHead": MappingProxyType({"hc_fn": LINEAR}),
    # modeling_glm5_next.py:302 flattened = F.linear(flattened, self.fn.float())
    "glm5_next.modeling_glm5_next.Glm5NextTextHyperConnection": MappingProxyType(
        {"fn": LINEAR}),
    # modeling_glm5_next.py:837 gate_scores = F.linear(hidden_states, self.index_kpool_compre...
    "glm5_next.modeling_glm5_next.Glm5NextTextIndexer": MappingProxyType(
        {"index_kpool_compress_gate": LINEAR}),
    # modeling_hy_v4.py:631 mixes = F.linear(flat, self.fn.float()) * self.input_norm(flat)
    "hy_v4.modeling_hy_v4.HYV4HyperConnection": MappingProxyType({"fn": LINEAR}),
    # modeling_hy_v4.py:664 mixes = F.linear(flat, self.hc_fn.float()) * self.input_norm(flat)
    "hy_v4.modeling_hy_v4.HYV4HyperHead": MappingProxyType({"hc_fn": LINEAR}),
    # modeling_hy_v4_vl.py:594 mixes = F.linear(flat, self.fn.float()) * self.input_norm(flat)
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLHyperConnection": MappingProxyType({"fn": LINEAR}),
    # modeling_hy_v4_vl.py:627 mixes = F.linear(flat, self.hc_fn.float()) * self.input_norm(flat)
    "hy_v4_vl.modeling_hy_v4_vl.HYV4VLHyperHead": MappingProxyType({"hc_fn": LINEAR}),
    # modeling_inkling.py:129 rel_logits = (relative_states @ self.proj): (d_rel, rel_extent)
    "inkling.modeling_inkling.InklingRelativeLogits": MappingProxyType({"proj": X_AT_W}),
    # modeling_inkling2.py:224 rel_logits = (relative_states @ self.proj).transpose(1, 2)
    "inkling2.modeling_inkling2.Inkling2RelativePositionBias": MappingProxyType(
        {"proj": X_AT_W}),
    # modeling_inkling2_loop.py:267 rel_logits = (relative_states @ self.proj).transpose(1, 2)
    "inkling2_loop.modeling_inkling2_loop.Inkling2LoopRelativePositionBias": MappingProxyType(
        {"proj": X_AT_W}),
})
"""Custom matrices of these families outside the experts, by class and attribute, with how
their forward reads them: the hyper-connections' projections (DeepSeek-V4, HY-V4, GLM-5
Next: ``fn`` ``((2 + N)·N, N·d)`` and the head's ``hc_fn`` ``(N, N·d)``, read as
``F.linear``: ``(out, in)``), GLM-5 Next's indexer gate and Inkling's (and Inkling-2's)
relative-logits bank ``proj`` ``(d_rel, rel_extent)`` (``x @ W``: ``(in, out)``).  Dense
matrices."""

FLATTENED: Mapping[str, Mapping[str, str]] = MappingProxyType({
    # modeling_dbrx.py:298,300-302 split_expert_shape = (-1, self.ffn_hidden_size,
    # self.hidden_size); w1 = self.mlp.w1.view(split_expert_shape)[expert_idx];
    # :264,265,268 x.matmul(expert_w1.T), x.matmul(expert_v1.T) (each expert (out, in)),
    # intermediate_states.matmul(expert_w2) (each expert (in, out))
    "dbrx.modeling_dbrx.DbrxExpertGLU": MappingProxyType(
        {"w1": OUT_IN, "v1": OUT_IN, "w2": IN_OUT}),
})
"""Experts stored as 2-D ``(E·n, d)`` weights that the forward views per expert as
``(E, n, d)`` (``n`` the module's ``ffn_hidden_size``): routed with that view
(``Route(..., view=(E, n, d))``), the expert axis a batch axis; the value is each expert's
layout once viewed."""

FLATTENED_WIDTH = "ffn_hidden_size"
"""The attribute of a :data:`FLATTENED` module giving ``n``, each expert's row count."""

def flattened_layout(module: nn.Module, attr: str) -> str | None:
    """Each expert's layout of a :data:`FLATTENED` weight, or ``None``."""
    for cls in type(module).__mro__:
        layout = FLATTENED.get(_table_key(cls) or "", {}).get(attr)
        if layout is not None:
            return layout
    return None


def _table_key(cls: type) -> str | None:
    """``<model>.modeling_<model>.<Class>`` for a class of ``transformers.models``."""
    module = cls.__module__
    if not module.startswith("transformers.models."):
        return None
    return f"{module.removeprefix('transformers.models.')}.{cls.__qualname__}"


def experts_layout(module: nn.Module) -> tuple[str, str] | None:
    """``(layout, source)`` of an experts module's 3-D tensors, or ``None``.

    ``layout`` is :data:`OUT_IN` or :data:`IN_OUT`; ``source`` says where it was read:
    the :data:`EXPERTS` table (the module's class or a base class), or the flags that
    ``use_experts_implementation`` set on the module (``is_transposed``).
    """
    for cls in type(module).__mro__:
        key = _table_key(cls)
        if key is not None and key in EXPERTS:
            return EXPERTS[key], f"{cls.__name__} {EXPERTS[key]}"
    flag = getattr(module, "is_transposed", None)
    if isinstance(flag, bool) and isinstance(getattr(module, "has_gate", None), bool):
        layout = IN_OUT if flag else OUT_IN
        return layout, (f"{type(module).__name__} use_experts_implementation("
                        f"is_transposed={flag}): {layout}")
    return None


def flattened_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The per-expert route of a :data:`FLATTENED` weight ``(E·n, d)``, or ``None``.

    ``Route("dense", ..., batch=0, view=(E, n, d))`` with each expert's axes as its forward
    reads them; ``None`` for another module or parameter, or one whose rows are not a
    multiple of the module's ``ffn_hidden_size`` (then refused by the router).
    """
    layout = flattened_layout(module, attr)
    width = getattr(module, FLATTENED_WIDTH, None)
    if layout is None or param.dim() != 2 or not isinstance(width, int) or width <= 0:
        return None
    rows, d = (int(n) for n in param.shape)
    if rows % width:
        return None
    fan_in, fan_out = (2, 1) if layout == OUT_IN else (1, 2)
    return Route("dense", fan_in=fan_in, fan_out=fan_out, batch=0, view=(rows // width, width, d),
                 evidence=f"module {type(module).__name__}: {attr}.view(-1, {width}, {d})[e], "
                          f"{_READS[layout]}")


def _is_router(module: nn.Module) -> bool:
    return any(_table_key(cls) in ROUTERS for cls in type(module).__mro__)


def moe_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The route of a parameter of a transformers experts or router module, or ``None``.

    A parameter listed in :data:`ELEMENTWISE` is a vector, one in :data:`MATRICES` a dense
    matrix read as its forward reads it, one in :data:`FLATTENED` dense per expert with the
    view its forward takes (:func:`flattened_route`).  An experts tensor
    ``(E, ., .)`` is dense with the expert axis 0 a batch axis and its fan-in/fan-out axes
    from :func:`experts_layout`; a per-expert bias ``(E, out)`` is a vector.  A router's
    ``weight`` ``(E, d)`` is dense ``(out, in)``.  ``None`` for any other module or
    parameter.
    """
    for cls in type(module).__mro__:
        if attr in ELEMENTWISE.get(_table_key(cls) or "", ()):
            return Route("vector", evidence=f"module {type(module).__name__}: read element-wise")
        reading = MATRICES.get(_table_key(cls) or "", {}).get(attr)
        if reading is not None and param.dim() == 2:
            fan_in, fan_out = (1, 0) if reading == LINEAR else (0, 1)
            return Route("dense", fan_in=fan_in, fan_out=fan_out,
                         evidence=f"module {type(module).__name__}: {reading}")
    flat = flattened_route(module, attr, param)
    if flat is not None:
        return flat
    if _is_router(module):
        if attr == "weight" and param.dim() == 2:
            return Route("dense", fan_in=1, fan_out=0,
                         evidence=f"module {type(module).__name__}: F.linear(x, W), W (E, d)")
        return None
    found = experts_layout(module)
    if found is None:
        return None
    layout, source = found
    if param.dim() == 3:
        fan_in, fan_out = (2, 1) if layout == OUT_IN else (1, 2)
        return Route("dense", fan_in=fan_in, fan_out=fan_out, batch=0,
                     evidence=f"module {source}, {_READS[layout]}")
    if param.dim() == 2 and attr.endswith("bias"):
        return Route("vector", evidence=f"module {type(module).__name__}: a bias per expert")
    return None


_XLNET = "module XLNetRelativeAttention"


def _xlnet_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The layout of an ``XLNetRelativeAttention`` parameter, from its forward's einsums."""
    heads, d_head, d_model = (getattr(module, k, None) for k in ("n_head", "d_head", "d_model"))
    shape = tuple(param.shape)
    if attr in ("q", "k", "v", "r") and shape == (d_model, heads, d_head):
        return Route("dense", fan_in=0, fan_out=(1, 2),
                     evidence=f"{_XLNET}: einsum('ibh,hnd->ibnd')")
    if attr == "o" and shape == (d_model, heads, d_head):
        return Route("dense", fan_in=(1, 2), fan_out=0,
                     evidence=f"{_XLNET}: einsum('ibnd,hnd->ibh')")
    if attr in ("r_r_bias", "r_s_bias", "r_w_bias") and shape == (heads, d_head):
        return Route("vector", evidence=f"{_XLNET}: a bias added to each head")
    if attr == "seg_embed" and len(shape) == 3 and shape[1:] == (heads, d_head):
        return Route("embedding", fan_in=2, fan_out=0,
                     evidence=f"{_XLNET}: segment table, einsum('ibnd,snd->ibns')")
    return None


def _is(module: nn.Module, module_name: str, cls_name: str) -> bool:
    cls = loaded_class(module_name, cls_name)
    return cls is not None and isinstance(module, cls)


def module_route(module: nn.Module, attr: str, param: torch.Tensor) -> Route | None:
    """The route a transformers module type gives its parameter ``attr``, or ``None``.

    The experts and routers of the mixture-of-experts modules (:func:`moe_route`),
    ``XLNetRelativeAttention``'s projections, biases and segment table, and ``Conv1D``'s
    ``weight`` ``(in, out)``.
    """
    expert = moe_route(module, attr, param)
    if expert is not None:
        return expert
    if _is(module, "transformers.models.xlnet.modeling_xlnet", "XLNetRelativeAttention"):
        return _xlnet_route(module, attr, param)
    if (attr == "weight" and param.dim() >= 2
            and _is(module, "transformers.pytorch_utils", "Conv1D")):
        return Route("dense", fan_in=0, fan_out=1, evidence=f"module {_label(module)}")
    return None


def _flattened_experts(name: str, p: torch.Tensor, module: nn.Module,
                       layout: str) -> RoutingError:
    """The refusal of experts stored as one 2-D ``(E·n, d)`` weight (DBRX)."""
    shape = tuple(int(s) for s in p.shape)
    as_read = Route("dense", fan_in=1, fan_out=0) if layout == OUT_IN else Route(
        "dense", fan_in=0, fan_out=1)
    other = Route("dense", fan_in=as_read.fan_out, fan_out=as_read.fan_in)
    reads = "F.linear(x, W[e]), each expert (out, in)" if layout == OUT_IN else (
        "x @ W[e], each expert (in, out)")
    options: list[Option] = [
        (as_read, f"one matrix over all experts is acceptable, read as the forward reads each "
                  f"expert ({reads}; SinkGD's and SAGE's normalisations then mix the experts)"),
        (other, "it is the transposed reading (not what the forward does)"),
        VECTOR_OPTION]
    return RoutingError(
        f"cannot place parameter {name!r} of shape {fmt_shape(shape)} in module "
        f"{_label(module)}: it holds every expert's matrix "
        f"stacked along axis 0 and its forward views it per expert ({reads}), so no route "
        "gives each expert its own normalisation. E.g. if\n"
        f"{advice_lines(name, options)}\n"
        "(Route is sage_optim.routing.Route, also sage_torch.Route)",
        leaf=name, shape=shape, options=options,
    )


def refuse(name: str, p: torch.Tensor, module: nn.Module, attr: str,
           kind: str | None) -> RoutingError | None:
    """The refusal of an experts tensor whose layout is unknown, or ``None``.

    Flattened experts whose rows do not split per expert (:data:`FLATTENED`); an experts
    module the table lacks is refused by :mod:`sage_torch.routing` (its class name says so).
    """
    flattened = flattened_layout(module, attr)
    if flattened is not None and p.dim() == 2:
        return _flattened_experts(name, p, module, flattened)
    return None


ADAPTER = register_adapter(Adapter(
    "transformers",
    known="transformers Conv1D and XLNetRelativeAttention, the experts and routers of "
          "transformers' mixture-of-experts models",
    route=module_route, refuse=refuse))
"""The transformers adapter, registered with :func:`sage_torch.routing.register_adapter`."""
