"""sage_torch's router on models built from the libraries themselves, and torch.optim's habits.

Three things are checked here, each against the math of the layout that the model's own
forward code uses (float64, one step, against the NumPy oracle of ``reference_np``):

* heads next to tables with ordinary names (x-transformers' ``TransformerWrapper``, a
  ``word``/``pos`` model): the untied head is found by the shape of a table, and a
  position table whose shape an MLP weight shares makes a refusal, never a silent head;
* the advice of one :class:`RoutingError` for every unplaceable parameter: options most
  likely first, one pasteable ``route_overrides = {...}`` block equal to ``err.overrides``,
  and that dict, applied, giving the reference math; module evidence for peft's LoRA
  ``Embedding`` and transformers' ``XLNetRelativeAttention``;
* what ``torch.optim`` takes as ``params``: ``model.parameters()``,
  ``model.named_parameters()``, param-group dicts, and ``add_param_group`` without ``kind``.
"""

from __future__ import annotations

import fnmatch
import math
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reference_np import SageRef, SinkGDRef
from routing_checks import paste_block
from torch import nn

from sage_torch import Route, RoutingError, make_optimizer, route_params, routing_table

pytestmark = pytest.mark.usefixtures("torch_one_thread")

V, D = 40, 16
LR = 1e-2

TABLE = ("embedding", (1,), (0,))  # (V, d): vocab axis 0 = fan-out (tables, heads (V, d))
LINEAR = ("dense", (1,), (0,))  # nn.Linear / F.linear (out, in)
VECTOR = ("vector", (), ())


def routes_of(model, overrides=None) -> dict:
    return {r.name: (r.route.kind, r.route.fan_in, r.route.fan_out)
            for r in route_params(model, overrides)}


def evidence_of(model, overrides=None) -> dict:
    return {r.name: r.route.evidence for r in route_params(model, overrides)}


# ---------------------------------------------------------------------------
# The oracle: one step of sage-hybrid in the layout the forward code uses
# ---------------------------------------------------------------------------


def _merged(x: np.ndarray, fan_in: tuple, fan_out: tuple):
    """``x`` as ``(batch, OUT, IN)`` matrices, and how to put it back."""
    nd = x.ndim
    fan_in = tuple(a % nd for a in fan_in)
    fan_out = tuple(a % nd for a in fan_out)
    batch = tuple(a for a in range(nd) if a not in fan_in + fan_out)
    perm = batch + fan_out + fan_in
    moved = np.transpose(x, perm)
    out = math.prod(x.shape[a] for a in fan_out)
    inn = math.prod(x.shape[a] for a in fan_in)
    return moved.reshape(-1, out, inn), perm, moved.shape


def reference_step(theta: np.ndarray, g: np.ndarray, truth: tuple) -> np.ndarray:
    """sage-hybrid's step (defaults, lr ``LR``) of one parameter whose true layout is ``truth``:
    SAGE over the vocab axis of a vocabulary matrix, Unit-Norm SinkGD on a dense one (each
    output unit's fan-in first), element-wise SAGE on a vector."""
    kind, fan_in, fan_out = truth
    if kind == "vector":
        return SageRef(theta.shape if theta.ndim <= 1 else (theta.size,),
                       vocab_axis=None).step(theta.reshape(-1) if theta.ndim > 1 else theta,
                                             g.reshape(-1) if g.ndim > 1 else g,
                                             LR).reshape(theta.shape)
    t, perm, moved = _merged(theta, fan_in, fan_out)
    gm, _, _ = _merged(g, fan_in, fan_out)
    new = []
    for b in range(t.shape[0]):
        if kind == "embedding":
            ref = SageRef(t[b].shape, vocab_axis=0)  # rows: the vocab (fan-out) axis
        else:
            ref = SinkGDRef(alpha=10.0, normalization="unit", fan_in_axis=1, fan_out_axis=0)
        new.append(ref.step(t[b], gm[b], LR))
    return np.transpose(np.stack(new).reshape(moved), np.argsort(perm))


def check_step(model: nn.Module, loss_fn, truth: dict, params=None, overrides=None,
               config: str = "sage-hybrid") -> None:
    """One step of ``config`` on ``model`` (float64) against the oracle, parameter by
    parameter, each in the layout ``truth`` gives (globs, first match; default: vector)."""
    opt = make_optimizer(config, model if params is None else params, lr=LR,
                         route_overrides=overrides)
    opt.zero_grad()
    loss_fn(model).backward()
    before = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    grads = {n: p.grad.detach().numpy().copy() for n, p in model.named_parameters()
             if p.grad is not None}
    opt.step()
    checked = 0
    for name, p in model.named_parameters():
        if name not in grads or not p.requires_grad:
            continue
        layout = next((v for k, v in truth.items() if fnmatch.fnmatchcase(name, k)), VECTOR)
        expected = reference_step(before[name], grads[name], layout)
        np.testing.assert_allclose(p.detach().numpy(), expected, rtol=0, atol=1e-10,
                                   err_msg=f"{name} {tuple(p.shape)} in layout {layout}")
        checked += 1
    assert checked >= 3


def tokens(n: int = 6, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (2, n), generator=torch.Generator().manual_seed(0))


def lm_loss(model: nn.Module) -> torch.Tensor:
    x = tokens()
    return F.cross_entropy(model(x).flatten(0, 1), x.flatten())


# ---------------------------------------------------------------------------
# 1. Heads next to tables with ordinary names
# ---------------------------------------------------------------------------

XT = {
    "token_emb.emb.weight": TABLE,
    "pos_emb.emb.weight": TABLE,
    "attn_layers.*.weight": LINEAR,  # to_q/to_k/to_v/to_out and the MLP: nn.Linear
    "to_logits.weight": TABLE,  # logits = F.linear(h, W): W (V, d), vocab axis 0
}


def x_transformer(max_seq_len: int, **kw):
    xt = pytest.importorskip("x_transformers")
    torch.manual_seed(0)
    model = xt.TransformerWrapper(num_tokens=V, max_seq_len=max_seq_len,
                                  attn_layers=xt.Decoder(dim=D, depth=1, heads=2), **kw)
    return model.double()


def xt_params(model) -> dict:
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def test_x_transformers_untied_head_is_found_by_the_table_shape():
    model = x_transformer(max_seq_len=12)  # tie_embedding=False: to_logits is its own Linear
    shapes = xt_params(model)
    assert shapes["to_logits.weight"] == shapes["token_emb.emb.weight"] == (V, D)
    assert not hasattr(model, "get_input_embeddings")  # no API: the shapes must say it
    routes = routes_of(model)
    assert routes["to_logits.weight"] == TABLE
    assert evidence_of(model)["to_logits.weight"] == (
        "head: shape of the table 'token_emb.emb.weight'")
    assert all(routes[n] == LINEAR for n in routes
               if n.startswith("attn_layers") and n.endswith(".weight") and len(shapes[n]) == 2)
    check_step(model, lm_loss, XT)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_x_transformers_position_table_colliding_with_the_mlp_is_refused(tied):
    """max_seq_len = 4·dim: the MLP's first weight (4·dim, dim) has the position table's
    shape.  That is never a silent head: the router refuses, and the advice is right."""
    model = x_transformer(max_seq_len=4 * D, tie_embedding=tied)
    mlp = next(n for n, s in xt_params(model).items() if s == (4 * D, D) and "ff" in n)
    with pytest.raises(RoutingError) as info:
        route_params(model)
    err = info.value
    message = str(err)
    assert mlp in message and "pos_emb.emb.weight" in message, message
    expected = {mlp: Route("dense", fan_in=1, fan_out=0)}
    if not tied:
        assert "to_logits.weight" in message
        expected["to_logits.weight"] = Route("embedding", fan_in=1, fan_out=0)
    assert err.overrides == expected
    assert paste_block(err) == err.overrides
    assert routes_of(model, err.overrides)[mlp] == LINEAR
    if tied:
        loss = lm_loss
        truth = {k: v for k, v in XT.items() if k != "to_logits.weight"}
    else:
        loss, truth = lm_loss, XT
    check_step(model, loss, truth, overrides=err.overrides)


class WordPos(nn.Module):
    """Tables named ``word`` and ``pos`` (no token-table marker, no API), an MLP, a head."""

    def __init__(self, positions: int = 12, head: str = "out", hidden: int = 32):
        super().__init__()
        self.word = nn.Embedding(V, D)
        self.pos = nn.Embedding(positions, D)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, hidden)
        self.down = nn.Linear(hidden, D)
        self.head_name = head
        setattr(self, head, nn.Linear(D, V, bias=False))

    def forward(self, x):
        h = self.word(x) + self.pos(torch.arange(x.shape[1]))
        h = h + self.down(F.gelu(self.up(self.norm(h))))
        return getattr(self, self.head_name)(h)


WORD_POS = {"word.weight": TABLE, "pos.weight": TABLE, "up.weight": LINEAR,
            "down.weight": LINEAR, "out.weight": TABLE, "lm_head.weight": TABLE}


def test_word_pos_model_head_is_found_and_named_by_its_table():
    torch.manual_seed(0)
    model = WordPos().double()
    assert routes_of(model)["out.weight"] == TABLE
    assert evidence_of(model)["out.weight"] == "head: shape of the table 'word.weight'"
    check_step(model, lm_loss, WORD_POS)


def test_word_pos_collision_is_refused_and_a_head_name_breaks_the_tie():
    torch.manual_seed(0)
    model = WordPos(positions=32).double()  # up.weight (32, 16) == pos.weight (32, 16)
    with pytest.raises(RoutingError) as info:
        route_params(model)
    assert info.value.overrides == {"up.weight": Route("dense", fan_in=1, fan_out=0),
                                    "out.weight": Route("embedding", fan_in=1, fan_out=0)}
    check_step(model, lm_loss, WORD_POS, overrides=info.value.overrides)
    named = WordPos(positions=32, head="lm_head")
    routes = routes_of(named)
    assert routes["lm_head.weight"] == TABLE and routes["up.weight"] == LINEAR
    assert evidence_of(named)["lm_head.weight"].endswith("+ name")


def test_a_frozen_linear_is_not_a_candidate():
    model = WordPos(positions=32)
    model.up.weight.requires_grad_(False)  # frozen: not trained, so not in doubt
    assert routes_of(model)["out.weight"] == TABLE


class TwoVocabularies(nn.Module):
    """Two tables of different vocabularies and two Linears shaped like them, no head name."""

    def __init__(self):
        super().__init__()
        self.src = nn.Embedding(V, D)
        self.tgt = nn.Embedding(V + 4, D)
        self.to_src = nn.Linear(D, V, bias=False)
        self.to_tgt = nn.Linear(D, V + 4, bias=False)


def test_two_linears_matching_two_tables_are_refused_in_one_error():
    model = TwoVocabularies()
    with pytest.raises(RoutingError) as info:
        route_params(model)
    err = info.value
    message = str(err)
    assert "to_src.weight" in message and "to_tgt.weight" in message, message
    assert "src.weight" in message and "tgt.weight" in message
    assert [p.leaf for p in err.problems] == ["to_src.weight", "to_tgt.weight"]
    assert all(len(p.options) == 2 for p in err.problems)
    assert paste_block(err) == err.overrides
    # each option of each is one of the two readings (head over a table, or a Linear)
    for p in err.problems:
        assert {r.kind for r, _ in p.options} == {"embedding", "dense"}
    # adamw and sage-pure update both readings alike: no refusal there
    for config in ("adamw", "sage-pure"):
        table = routing_table(config, model)
        assert "unsettled, no matter" in table.row("to_src.weight").evidence


def test_an_identified_token_table_keeps_the_old_rule():
    """The token table known (by name): only its shape counts, position tables do not."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok_emb = nn.Embedding(V, D)
            self.pos = nn.Embedding(32, D)
            self.up = nn.Linear(D, 32)  # the position table's shape: not a candidate
            self.proj = nn.Linear(D, V)

    routes = routes_of(Model())
    assert routes["up.weight"] == LINEAR and routes["proj.weight"] == TABLE


# ---------------------------------------------------------------------------
# 2. Advice right for the leaf it names, one error, one paste block
# ---------------------------------------------------------------------------


class Custom(nn.Module):
    """Custom parameters whose true layouts are what the router's first options say:

    * ``pos_emb`` (N, d): a position table, ``pos_emb[:n]`` (name says emb: table first);
    * ``w`` (out, in): ``F.linear(h, w)`` (no evidence: PyTorch's (out, in) first);
    * ``experts`` (E, in, out): ``einsum('bi,eio->beo')`` (stacked (in, out) first);
    * ``unembed_w`` (d, V): logits ``h @ unembed_w`` (an axis of the token table's V rows:
      the reading whose vocab axis is that one first).
    """

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos_emb = nn.Parameter(torch.randn(6, D) * 0.1)
        self.w = nn.Parameter(torch.randn(D, D) * 0.2)
        self.experts = nn.Parameter(torch.randn(3, D, D) * 0.2)
        self.unembed_w = nn.Parameter(torch.randn(D, V) * 0.2)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        h = self.tok(x) + self.pos_emb[: x.shape[1]]
        h = F.linear(self.norm(h), self.w)
        h = h + torch.einsum("bti,eio->bteo", h, self.experts).mean(2)
        return h @ self.unembed_w


CUSTOM = {"tok.weight": TABLE, "pos_emb": TABLE, "w": LINEAR,
          "experts": ("dense", (1,), (2,)), "unembed_w": ("embedding", (0,), (1,))}


def test_every_unplaceable_parameter_in_one_error_first_options_give_the_math():
    torch.manual_seed(0)
    model = Custom().double()
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model)
    err = info.value
    message = str(err)
    assert message.startswith("cannot place 4 parameters:"), message
    for name, shape in [("pos_emb", (6, D)), ("w", (D, D)), ("experts", (3, D, D)),
                        ("unembed_w", (D, V))]:
        assert f"{name!r} of shape {shape}" in message
    assert err.overrides == {
        "pos_emb": Route("embedding", fan_in=1, fan_out=0),
        "w": Route("dense", fan_in=1, fan_out=0),
        "experts": Route("dense", fan_in=-2, fan_out=-1),
        "unembed_w": Route("embedding", fan_in=0, fan_out=1),
    }
    assert paste_block(err) == err.overrides
    for p in err.problems:  # every option listed, and 'vector' last
        assert len(p.options) >= 3 and p.options[-1][0] == "vector"
    # the 3-D options include one matrix with axis 0 as fan-in and the rest merged
    experts = next(p for p in err.problems if p.leaf == "experts")
    assert Route("dense", fan_in=0, fan_out=(1, 2)) in [r for r, _ in experts.options]
    assert Route("dense", fan_in=(1, 2), fan_out=0) in [r for r, _ in experts.options]
    assert routes_of(model, err.overrides)["experts"] == ("dense", (1,), (2,))
    check_step(model, lm_loss, CUSTOM, overrides=err.overrides)


def test_kind_override_of_an_unknown_layout_offers_only_that_kind():
    model = Custom()
    with pytest.raises(RoutingError) as info:
        route_params(model, {"w": "embedding", "pos_emb": "vector", "experts": "vector",
                             "unembed_w": "vector"})
    (problem,) = info.value.problems
    assert [r.kind for r, _ in problem.options[:-1]] == ["embedding", "embedding"]
    assert "routed 'embedding' by an override" in str(info.value)


def test_tied_layout_conflict_carries_options():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D
    model = nn.ModuleDict({"a": nn.Linear(D, D), "b": conv1d(D, D)})
    model["b"].weight = model["a"].weight
    with pytest.raises(RoutingError) as info:
        route_params(model)
    assert info.value.overrides == {"a.weight": Route("dense", fan_in=1, fan_out=0)}
    assert [r for r, _ in info.value.problems[0].options][:2] == [
        Route("dense", fan_in=1, fan_out=0), Route("dense", fan_in=0, fan_out=1)]
    assert paste_block(info.value) == info.value.overrides


def test_peft_lora_embedding_is_module_evidence():
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=1)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                peft.LoraConfig(r=4, target_modules=["embed_tokens", "q_proj"]))
    model = model.double()
    layer = model.base_model.model.model.embed_tokens
    assert type(layer).__module__ == "peft.tuners.lora.layer"
    with torch.no_grad():  # peft starts A at zero: give B a gradient too
        layer.lora_embedding_A["default"].normal_(0, 0.1)
    prefix = "base_model.model.model.embed_tokens."
    routes = routes_of(model)
    assert routes[prefix + "lora_embedding_A.default"] == ("embedding", (0,), (1,))
    assert routes[prefix + "lora_embedding_B.default"] == ("dense", (1,), (0,))
    evidence = evidence_of(model)[prefix + "lora_embedding_A.default"]
    assert evidence.startswith("module peft lora.Embedding")
    truth = {
        "*lora_embedding_A.default": ("embedding", (0,), (1,)),  # F.embedding(x, A.T)
        "*lora_embedding_B.default": LINEAR,  # after_A @ B.T: B (d, r) = (out, in)
        "*lora_[AB].default.weight": LINEAR,
    }
    check_step(model, lambda m: m(input_ids=tokens(), labels=tokens()).loss, truth)


def test_a_lora_like_table_without_peft_is_refused_with_the_vocab_reading_first():
    class LoraLike(nn.Module):  # peft's names, not peft's class: no module evidence
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(V, D)
            self.lora_embedding_A = nn.ParameterDict({"default": nn.Parameter(torch.zeros(4, V))})

    with pytest.raises(RoutingError) as info:
        route_params(LoraLike())
    assert info.value.overrides == {
        "lora_embedding_A.default": Route("embedding", fan_in=0, fan_out=1)}


XLNET = {
    "transformer.word_embedding.weight": TABLE,
    "*.rel_attn.[qkvr]": ("dense", (0,), (1, 2)),  # einsum('ibh,hnd->ibnd'): h in, (n, d) out
    "*.rel_attn.o": ("dense", (1, 2), (0,)),  # einsum('ibnd,hnd->ibh'): (n, d) in, h out
    # einsum('ibnd,snd->ibns'): per head n (a batch axis), d in, the 2 segments out
    "*.rel_attn.seg_embed": ("embedding", (2,), (0,)),
    "*.ff.layer_?.weight": LINEAR,
}


def test_xlnet_attention_is_module_evidence_and_its_math():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config_cls = getattr(transformers, "XLNetConfig", None)
    if config_cls is None:
        pytest.skip("this transformers has no XLNet")
    torch.manual_seed(0)
    model = transformers.XLNetLMHeadModel(config_cls(vocab_size=V, d_model=D, n_layer=1,
                                                     n_head=2, d_inner=32)).double()
    routes = routes_of(model)
    for name, route in routes.items():
        layout = next((v for k, v in XLNET.items() if fnmatch.fnmatchcase(name, k)), VECTOR)
        assert route == layout, name
    assert evidence_of(model)["transformer.layer.0.rel_attn.r_w_bias"].startswith(
        "module XLNetRelativeAttention")
    types = torch.tensor([[0, 0, 0, 1, 1, 1]] * 2)
    check_step(model, lambda m: m(input_ids=tokens(), token_type_ids=types,
                                  labels=tokens()).loss, XLNET)


def test_a_3d_parameter_of_unknown_module_gets_the_stacked_in_out_reading_first():
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, D, 8))  # (L, in, out)

    with pytest.raises(RoutingError) as info:
        route_params(Stack())
    assert info.value.overrides == {"w": Route("dense", fan_in=-2, fan_out=-1)}


def test_a_3d_parameter_of_an_unknown_experts_module_gets_the_out_in_reading_first():
    """Most MoE families read W[e] as F.linear(x, W[e]): (E, out, in) is the first remedy."""

    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, D))  # (E, out, in)

    with pytest.raises(RoutingError) as info:
        route_params(Experts())
    assert info.value.overrides == {"w": Route("dense", fan_in=2, fan_out=1, batch=0)}
    message = str(info.value)
    assert "F.linear(x, W[e]) means (E, out, in)" in message
    assert "x @ W[e] or torch.bmm(x, W) means (E, in, out)" in message
    assert "or Route('dense', fan_in=1, fan_out=2, batch=(0,)) if it is (E, in, out)" in message


# ---------------------------------------------------------------------------
# 3. torch.optim habits
# ---------------------------------------------------------------------------


class Small(nn.Module):
    """Embedding, Linear layers, LayerNorm and an untied head: names that say it all."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.fc1 = nn.Linear(D, 32)
        self.fc2 = nn.Linear(32, D)
        self.norm = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, V, bias=False)

    def forward(self, x):
        h = self.embed(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.lm_head(self.norm(h))


SMALL = {"embed.weight": TABLE, "fc?.weight": LINEAR, "lm_head.weight": TABLE}


def small() -> nn.Module:
    torch.manual_seed(0)
    return Small().double()


def test_named_parameters_route_as_the_model():
    model = small()
    by_model = routes_of(model)
    assert routes_of(model.named_parameters()) == by_model
    groups = [(g["kind"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"])
              for g in make_optimizer("sage-hybrid", model.named_parameters()).param_groups]
    assert groups == [(g["kind"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"])
                      for g in make_optimizer("sage-hybrid", model).param_groups]
    assert evidence_of(model.named_parameters())["lm_head.weight"] == (  # names only: shape
        "head: shape of the token embedding 'embed.weight' + name")  # and the head's name
    check_step(model, lm_loss, SMALL, params=model.named_parameters())


def test_bare_tensors_place_vectors_and_refuse_matrices_naming_their_index():
    model = small()
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", model.parameters())
    err = info.value
    message = str(err)
    index = {n: i for i, (n, _) in enumerate(model.named_parameters())}
    matrices = [f"params[{index[n]}]" for n, p in model.named_parameters() if p.dim() == 2]
    assert [p.leaf for p in err.problems] == matrices
    assert f"'params[0]' of shape ({V}, {D})" in message
    assert "a bare tensor" in message and "model.named_parameters()" in message
    assert "route_overrides" in message and paste_block(err) == err.overrides
    # the overrides of the true layouts, by the names the error gave (globs match literally)
    truth = {f"params[{index[n]}]": Route(*(r[0],), fan_in=r[1], fan_out=r[2])
             for n, r in routes_of(model).items() if r[0] != "vector"}
    check_step(model, lm_loss, SMALL, params=model.parameters(), overrides=truth)


@pytest.mark.parametrize("config", ["adamw", "lion"])
def test_element_wise_configs_need_no_layout(config):
    model = small()
    opt = make_optimizer(config, model.parameters(), lr=LR)
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
    if config != "adamw":
        return
    twin = small()
    ref = torch.optim.AdamW(twin.parameters(), lr=LR, betas=(0.9, 0.99), eps=1e-8,
                            weight_decay=0.01)
    for m, o in ((model, opt), (twin, ref)):
        lm_loss(m).backward()
        o.step()
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=n)


def test_layout_dependent_configs_refuse_bare_matrices():
    model = small()
    for config in ("sage-pure", "sinkgd-pure", "apollo", "lion-hybrid"):
        with pytest.raises(RoutingError, match="params\\[0\\]"):
            make_optimizer(config, model.parameters())


def test_a_weight_named_only_by_indices_is_refused_where_the_kind_matters():
    seq = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D))
    with pytest.raises(RoutingError) as info:
        make_optimizer("sage-hybrid", seq.named_parameters())
    assert [p.leaf for p in info.value.problems] == ["0.weight", "1.weight"]
    assert "nn.Linear (out, in) or an nn.Embedding table (V, d)" in str(info.value)
    # sage-pure runs SAGE on both kinds, with the same axes: the kind does not matter
    rows = routing_table("sage-pure", seq.named_parameters()).rows
    assert [(r.path, r.fan_in, r.fan_out) for r in rows][:2] == [
        ("0.weight", f"1 ({D})", f"0 ({V})"), ("1.weight", f"1 ({D})", f"0 ({D})")]


def test_param_group_dicts_carry_kinds_axes_and_options():
    model = small()
    named = dict(model.named_parameters())
    groups = [
        {"params": [named["embed.weight"], named["lm_head.weight"]], "kind": "embedding"},
        {"params": [("fc1.weight", named["fc1.weight"])], "lr": 3e-3},
        {"params": [named["fc2.weight"]], "kind": "dense", "fan_in_dim": 1, "fan_out_dim": 0},
        {"params": [p for n, p in named.items() if p.dim() == 1], "weight_decay": 0.0},
    ]
    opt = make_optimizer("sage-hybrid", groups, lr=LR)
    got = {(g["kind"], g["lr"], g["weight_decay"], g["fan_in_dim"], g["fan_out_dim"]):
           g["param_names"] for g in opt.param_groups}
    assert got == {
        ("embedding", LR, 0.01, 1, 0): ["param_groups[0].params[0]",
                                        "param_groups[0].params[1]"],
        ("dense", 3e-3, 0.01, 1, 0): ["fc1.weight"],
        ("dense", LR, 0.01, 1, 0): ["param_groups[2].params[0]"],
        ("vector", LR, 0.0, None, None): [f"param_groups[3].params[{i}]" for i in range(4)],
    }
    with pytest.raises(RoutingError, match="no kind; add kind='dense' or kind='embedding'"):
        make_optimizer("sage-hybrid", [{"params": [named["fc2.weight"]], "fan_in_dim": 1,
                                        "fan_out_dim": 0}])
    with pytest.raises(ValueError, match="make_optimizer gives each kind"):
        make_optimizer("sage-hybrid", [{"params": [named["fc2.weight"]], "rule": "adamw"}])


def test_add_param_group_without_kind_routes_by_names_and_shapes():
    model = small()
    opt = make_optimizer("sage-hybrid", model, lr=LR)
    extra = nn.Linear(D, 4).double()
    n = len(opt.param_groups)
    opt.add_param_group({"params": [extra.bias]})  # all vectors: the vector kind
    g = opt.param_groups[-1]
    assert (g["kind"], g["rule"], g["fan_out_dim"], g["param_names"]) == (
        "vector", "sage", None, [f"param_groups[{n}].params[0]"])
    with pytest.raises(ValueError, match=(
            rf"param_groups\[{n + 1}\]\.params\[0\] of shape \(4, 16\).*kind=.*"
            r"fan_in_dim=/fan_out_dim=")):
        opt.add_param_group({"params": [extra.weight]})
    with pytest.raises(ValueError, match="mixes kinds.*split it"):
        opt.add_param_group({"params": [(f"extra.{k}", p) for k, p in extra.named_parameters()]})
    assert len(opt.param_groups) == n + 1  # the refused groups left nothing behind
    opt.add_param_group({"params": [extra.weight], "param_names": ["extra.weight"]})
    g = opt.param_groups[-1]
    assert (g["kind"], g["rule"], g["fan_in_dim"], g["fan_out_dim"], g["param_names"]) == (
        "dense", "sinkgd", -1, -2, ["extra.weight"])
    with pytest.raises(ValueError, match="2 param_names for 1 params"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))], "param_names": ["a", "b"]})
    x = tokens()
    before = extra.weight.detach().clone()
    extra(model(x) @ model.lm_head.weight).square().mean().backward()
    opt.step()
    assert not torch.equal(before, extra.weight)


def test_add_param_group_on_an_element_wise_configuration_takes_bare_matrices():
    opt = make_optimizer("adamw", small())
    opt.add_param_group({"params": [nn.Parameter(torch.randn(3, 4, 5))]})
    assert opt.param_groups[-1]["rule"] == "adamw"


def test_params_of_other_forms_fail_like_torch_optim():
    with pytest.raises(TypeError, match="iterable of Tensors or dicts"):
        make_optimizer("adamw", nn.Parameter(torch.zeros(3)))
    with pytest.raises(ValueError, match="empty parameter list"):
        make_optimizer("adamw", [])
    with pytest.raises(RoutingError, match=re.escape("'params[9]' (nearest: ")):
        make_optimizer("adamw", [nn.Parameter(torch.zeros(3))],
                       route_overrides={"params[9]": "vector"})
