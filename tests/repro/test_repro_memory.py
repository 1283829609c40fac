"""The paper's Appendix memory table (Table 4), recomputed from jax.eval_shape."""

from __future__ import annotations

import math

import jax
import pytest

import sage_optax
from sage_optax import Route
from sage_repro.llama_shapes import llama_param_shapes
from sage_repro.memory_report import format_memory_table, main, memory_rows
from sage_repro.paper import PAPER_MEMORY_GIB
from sage_train.model.shapes import PAPER_MODELS, get_model_config

GIB = 2**30

# The paper prints its figures as literals with 2 or 3 decimals; its "Total" column is not
# self-consistent in the last digit (e.g. 270M Lion: 3.067 printed, while its own weights +
# grads + state = 3 x 1.0226 GiB = 3.068), so totals are compared to one unit of the last
# printed digit.  The optimizer-state column must match exactly at printed precision.
PAPER_TEXT = {
    ("1.3b", "sage-pure"): ("4.92", "14.75"),
    ("1.3b", "adamw"): ("9.833", "19.67"),
    ("1.3b", "apollo"): ("3.648", "13.48"),
    ("1.3b", "lion"): ("4.916", "14.75"),
    ("1.3b", "sinkgd-hybrid"): ("1.958", "11.79"),
    ("1.3b", "lion-hybrid"): ("0.979", "10.81"),
    ("1.3b", "sage-hybrid"): ("0.979", "10.81"),
}


def decimals(model, config, column):
    text = PAPER_TEXT.get((model, config))
    if text is None:
        return 3
    return len(text[column].split(".")[1])


CASES = [(m, c) for m in PAPER_MODELS for c in PAPER_MEMORY_GIB[m] if c != "apollo"]


@pytest.mark.parametrize("model,config", CASES)
def test_optimizer_state_matches_paper_at_printed_precision(model, config):
    row = {r.config: r for r in memory_rows(model, (config,))}[config]
    paper_opt, paper_total = PAPER_MEMORY_GIB[model][config]
    nd = decimals(model, config, 0)
    assert round(row.state_gib, nd) == pytest.approx(paper_opt, abs=1e-12), (row.state_gib, nd)
    nt = decimals(model, config, 1)
    assert abs(round(row.total_gib, nt) - paper_total) <= 10.0**-nt + 1e-12


def test_state_bytes_are_exact_integers_for_sage_hybrid_270m():
    """SAGE-Hybrid on 270M: M of the (V, d) embedding + S of d + M and S of 27 norms."""
    cfg = get_model_config("270m")
    row = memory_rows("270m", ("sage-hybrid",))[0]
    d = cfg.hidden_size
    vectors = (2 * cfg.num_layers + 1) * d
    expected = 4 * (cfg.vocab_size * d + d) + 4 * 2 * vectors + 2 * 4  # + 2 SAGE step counts
    assert row.state_bytes == expected


# APOLLO: the paper's row cannot be reproduced with APOLLO on every attention and MLP matrix
# (docs/configurations.md).  Pin our numbers ...
OUR_APOLLO_GIB = {"270m": 0.980, "0.6b": 1.470, "1.3b": 1.962}


@pytest.mark.parametrize("model", list(PAPER_MODELS))
def test_apollo_pinned(model):
    row = memory_rows(model, ("apollo",))[0]
    assert round(row.state_gib, 3) == OUR_APOLLO_GIB[model]
    assert row.state_gib < PAPER_MEMORY_GIB[model]["apollo"][0]


# ... and show where the paper's came from: with the attention matrices left on AdamW (the
# name filter of the paper's run missed them) the paper's figures come back exactly.
@pytest.mark.parametrize("model", list(PAPER_MODELS))
def test_apollo_paper_row_is_attention_on_adamw(model):
    params = llama_param_shapes(get_model_config(model))
    # the 'embedding' kind runs AdamW in the apollo configuration
    attn_on_adamw = {"layers.*.attn.*": Route("embedding", fan_in=-2, fan_out=-1)}
    tx = sage_optax.make_optimizer("apollo", route_overrides=attn_on_adamw)
    gib = sage_optax.state_bytes(jax.eval_shape(tx.init, params)) / GIB
    assert round(gib, 3) == PAPER_MEMORY_GIB[model]["apollo"][0]


def test_eval_shape_counts_equal_allocated_counts():
    """Counting from eval_shape is exact: it equals the bytes of a real state (tiny model)."""
    params = jax.tree.map(
        lambda s: jax.numpy.zeros(s.shape, s.dtype),
        llama_param_shapes(get_model_config("tiny")),
    )
    for name in ("sage-hybrid", "adamw", "apollo"):
        init = sage_optax.make_optimizer(name).init
        assert sage_optax.state_bytes(init(params)) == sage_optax.state_bytes(
            jax.eval_shape(init, params)
        )


def test_param_counts_match_paper_embedding_share():
    for model, share in (("270m", 0.48), ("0.6b", 0.33), ("1.3b", 0.20)):
        assert round(get_model_config(model).embedding_fraction(), 2) == share
    # AdamW state is exactly twice the float32 weights
    cfg = get_model_config("270m")
    assert memory_rows("270m", ("adamw",))[0].state_bytes == 2 * 4 * cfg.param_count() + 3 * 4


def test_memory_report_prints_every_row(capsys):
    main(["--models", "270m"])
    out = capsys.readouterr().out
    for config in PAPER_MEMORY_GIB["270m"]:
        assert config in out
    assert "0.489" in out and "2.045" in out
    assert math.isfinite(len(format_memory_table(("tiny",))))


@pytest.mark.parametrize(
    "config,bound", [("sage-hybrid", 1.0), ("sage-pure", 1.0), ("sinkgd-hybrid", 1.0),
                     # SinkGD on the embedding itself: its K = G² is the largest parameter's
                     # size, plus the scale vectors.
                     ("sinkgd-pure", 1.1)])
def test_donated_step_needs_no_more_temporary_memory_than_the_largest_parameter(config, bound):
    """Issue 5's memory target: a jitted, donated update of these configurations compiles
    with a temporary no larger than the largest parameter (XLA's own count, not a timing).

    Without the two fixes it guards, this fails: a sign read from the *old* momentum forces
    XLA:CPU to copy all momenta (temp = |P|), and all layers' K = G² alive at once in the
    Sinkhorn loops gives temp = all dense bytes."""
    import optax

    shapes = llama_param_shapes(get_model_config("small"))
    largest = max(math.prod(s.shape) * s.dtype.itemsize for s in jax.tree.leaves(shapes))
    tx = sage_optax.make_optimizer(config, 1e-3)
    state = jax.eval_shape(tx.init, shapes)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(shapes, state, shapes).compile()
    temp = compiled.memory_analysis().temp_size_in_bytes
    mib = 2**20
    assert temp <= bound * largest, f"{config}: temp {temp / mib:.1f} MiB > {largest / mib:.1f}"


def test_hf_moe_config_prints_the_state_of_every_configuration(tmp_path, capsys):
    """sage-memory --hf-config: a tiny Qwen3-MoE config.json, routed by sage_torch on the meta
    device; SAGE-Hybrid's state is SAGE's on the (untied) token table and head and the
    vectors, none on the per-expert matrices (SinkGD is stateless)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
        num_experts_per_tok=2, head_dim=8, tie_word_embeddings=False)
    config.save_pretrained(tmp_path)
    main(["--hf-config", str(tmp_path)])
    out = capsys.readouterr().out
    assert out.startswith("qwen3_moe: ") and "sage-hybrid" in out and "adamw" in out
    from sage_repro.memory_report import hf_memory_rows

    rows = {r.config: r for r in hf_memory_rows(config, ("adamw", "sage-hybrid"))}
    import torch

    with torch.device("meta"):
        tensors = list(transformers.AutoModelForCausalLM.from_config(config).parameters())
    n = rows["adamw"].param_bytes // 4
    assert n == sum(p.numel() for p in tensors)
    # m and v of every parameter, and torch's float32 step per tensor
    assert rows["adamw"].state_bytes == 2 * 4 * n + 4 * len(tensors)
    assert rows["sage-hybrid"].state_bytes < rows["adamw"].state_bytes / 4


@pytest.mark.parametrize("case", ["truncated", "negative vocabulary", "missing", "a list"])
def test_a_bad_hf_config_is_one_line(tmp_path, capsys, case):
    """A truncated config.json, ``vocab_size: -64`` or a missing path: one line naming the
    file, exit status 2 (never a traceback, nor a look-up on the Hub)."""
    pytest.importorskip("transformers")
    import json

    good = {"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1}
    path = tmp_path / "model"
    path.mkdir()
    text = {"truncated": json.dumps(good)[:40],
            "negative vocabulary": json.dumps({**good, "vocab_size": -64}),
            "missing": None, "a list": "[1, 2]"}[case]
    if text is not None:
        (path / "config.json").write_text(text)
    code = main(["--hf-config", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("sage-memory: error: --hf-config") and str(path) in err
    expected = {"truncated": "not valid JSON", "negative vocabulary": "vocab_size must be",
                "missing": "does not exist", "a list": "not an object"}[case]
    assert expected in err
