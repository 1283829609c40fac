"""Both frameworks take one routing decision on the same evidence (issue 28).

The policy (token table, head by shape, the refusals and their first remedies) lives once in
:mod:`sage_optim.routing`; each router only gathers evidence.  Fed the same model in each
framework's form, they must agree:

* **names only**: ``sage_torch.route_params(model.named_parameters())`` and
  ``sage_optax.route_params`` on the same tensors as a converted state dict (``{name:
  array}``): the same routes, or refusals of the same parameters with the same first
  remedies (checked against every transformers architecture of ``routing_checks`` and
  hand-built models whose heads test each rule of the shared head policy);
* **modules**: a small LM written as an ``nn.Module`` and as an ``nnx.Module`` (PyTorch
  ``(out, in)`` against Flax ``(in, out)``): each parameter gets the same kind and the same
  fan-in and fan-out sizes.
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest
from routing_checks import ARCHITECTURES, D, V, build
from torch import nn

import sage_optax
import sage_torch
from sage_optim.routing import ResolvedRoute, RoutingError

pytestmark = pytest.mark.usefixtures("torch_one_thread")


def decision(route) -> tuple:
    return route.kind, route.fan_in, route.fan_out, route.batch


def torch_names(model: nn.Module) -> dict | RoutingError:
    try:
        return {r.name: decision(r.route)
                for r in sage_torch.route_params(model.named_parameters())}
    except RoutingError as err:
        return err


def jax_names(model: nn.Module) -> dict | RoutingError:
    tree = {n: jnp.asarray(p.detach().numpy()) for n, p in model.named_parameters()}
    try:
        routed = sage_optax.route_params(tree, warn=False)
    except RoutingError as err:
        return err
    return {n: decision(r) for n, r in routed.routes.items()}


def first_remedies(err: RoutingError, shapes: dict) -> dict:
    out = {}
    for p in err.problems:
        route = p.options[0][0] if p.options else None
        if isinstance(route, str):
            out[p.leaf] = route
        elif route is not None:
            out[p.leaf] = decision(route.resolve(shapes[p.leaf], p.leaf))
    return out


def assert_same_decision(model: nn.Module) -> None:
    a, b = torch_names(model), jax_names(model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    if isinstance(a, RoutingError) or isinstance(b, RoutingError):
        assert isinstance(a, RoutingError) and isinstance(b, RoutingError), (a, b)
        assert first_remedies(a, shapes) == first_remedies(b, shapes)
    else:
        assert a == b, {n: (a[n], b.get(n)) for n in a if a[n] != b.get(n)}


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_named_parameters_and_a_converted_state_dict_get_one_decision(arch):
    config, model_cls, kw = ARCHITECTURES[arch]
    assert_same_decision(build(config, model_cls, **kw))


class LM(nn.Module):
    """A token table, layers, a norm and (optionally) an untied head, named as given."""

    def __init__(self, head: str | None = "lm_head", width: int = 2 * D, pos: bool = False):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        if pos:
            self.wpe = nn.Embedding(8, D)
        self.layers = nn.ModuleList(
            nn.ModuleDict({"up": nn.Linear(D, width), "down": nn.Linear(width, D)})
            for _ in range(2))
        self.norm = nn.LayerNorm(D)
        if head is not None:
            self.add_module(head, nn.Linear(D, V, bias=False))


@pytest.mark.parametrize("kw", [
    {},                                   # a head named lm_head: the head
    {"head": "to_logits"},                # no head name, names only: refused, head first
    {"head": None, "width": V},           # an MLP of width V inside layers: refused, dense
    {"width": V},                         # ... beside a named head: the head, layers dense
    {"head": "output", "pos": True},      # two tables, the token one named: the head
], ids=["lm_head", "to_logits", "mlp-v-tied", "mlp-v-untied", "wte-wpe"])
def test_the_head_policy_is_one_in_both_frameworks(kw):
    assert_same_decision(LM(**kw))


def test_names_that_cannot_say_are_refused_alike():
    """Indices only (an ``nn.Sequential``) and ELECTRA's ``embeddings_project`` (a Linear)."""
    seq = nn.Sequential(nn.Embedding(V, D), nn.Linear(D, D), nn.Linear(D, V))
    assert_same_decision(seq)
    assert isinstance(torch_names(seq), RoutingError)

    class Electra(nn.Module):
        def __init__(self):
            super().__init__()
            self.word_embeddings = nn.Embedding(V, 8)
            self.embeddings_project = nn.Linear(8, D)

    err = jax_names(Electra())
    assert isinstance(err, RoutingError)
    assert err.overrides == {"embeddings_project.weight": sage_optax.Route("dense", 1, 0)}
    assert_same_decision(Electra())


def test_a_model_in_both_frameworks_forms_gets_the_same_kinds_and_matrix_sizes():
    nnx = pytest.importorskip("flax.nnx")

    class JaxLM(nnx.Module):
        def __init__(self, rngs):
            self.wte = nnx.Embed(V, D, rngs=rngs)
            self.layers = nnx.List([nnx.Dict(up=nnx.Linear(D, 2 * D, rngs=rngs),
                                              down=nnx.Linear(2 * D, D, rngs=rngs))
                                    for _ in range(2)])
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.lm_head = nnx.Linear(D, V, use_bias=False, rngs=rngs)

    def sizes(r: ResolvedRoute) -> tuple:
        return r.kind, r.fan_in_size if r.is_matrix else 0, r.fan_out_size if r.is_matrix else 0

    torch_side = {r.name.replace(".weight", ""): sizes(r.route)
                  for r in sage_torch.route_params(LM())}
    jax_model = JaxLM(nnx.Rngs(0))
    routed = sage_optax.route_params(jax_model)
    jax_side = {n.replace(".kernel", "").replace(".embedding", "").replace(".scale", ""):
                sizes(r) for n, r in sage_optax.routing.iter_leaves(routed.routes)}
    assert jax_side == torch_side
    assert torch_side["lm_head"] == ("embedding", D, V)  # vocab axis = fan-out in both
    assert torch_side["layers.0.up"] == ("dense", D, 2 * D)


def test_a_frozen_token_table_still_names_the_head():
    """Fine-tuning freezes the embedding: its shape still makes the untied head a head."""
    model = LM(head="to_vocab")
    model.wte.weight.requires_grad_(False)
    routes = {r.name: r.route for r in sage_torch.route_params(model)}
    assert "wte.weight" not in routes  # frozen: not trained, but evidence
    assert routes["to_vocab.weight"].kind == "embedding"
    assert routes["to_vocab.weight"].evidence == "head: shape of the token embedding 'wte.weight'"


def test_no_override_trains_what_cannot_be_trained():
    """An override never routes a non-floating leaf (the decision keeps a final refusal)."""
    tree = {"ids": jnp.zeros((4, 8), jnp.int32), "w": {"kernel": jnp.ones((8, 8))}}
    with pytest.raises(RoutingError, match="not floating point"):
        sage_optax.route_params(tree, {"ids": sage_optax.Route("dense", -2, -1)})
