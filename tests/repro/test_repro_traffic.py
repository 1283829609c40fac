"""The analytic traffic model (sage_repro.traffic) as both step benchmarks apply it."""

from __future__ import annotations

import importlib.util
import math
import pathlib
import sys

import jax
import pytest

from sage_optim import CONFIG_NAMES
from sage_repro import traffic
from sage_repro.llama_shapes import llama_param_shapes
from sage_train.model.shapes import get_model_config

pytest.importorskip("torch")
BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


jax_step, torch_step = load("jax_step"), load("torch_step")


def test_sage_hybrid_by_hand():
    """tiny: V = 1024, d = 96, 2 layers; SAGE on the embedding and the vectors, SinkGD (L=5)
    on every dense matrix; state = M of everything routed to SAGE + S of each SAGE leaf."""
    shapes = llama_param_shapes(get_model_config("tiny"))
    leaves = jax.tree_util.tree_leaves_with_path(shapes)
    size = {jax.tree_util.keystr(k): math.prod(v.shape) * 4 for k, v in leaves}
    embed = size["['embed']['embedding']"]
    vectors = sum(math.prod(v.shape) * 4 for _, v in leaves if len(v.shape) == 1)
    dense = sum(size.values()) - embed - vectors
    state = (embed + 96 * 4) + 2 * vectors  # M and S(d) for the table; M and S for vectors
    expected = 3 * sum(size.values()) + 2 * state + 12 * dense + 1 * embed
    tx = jax_step.make_tx("sage-hybrid")
    got = jax_step.bytes_moved("sage-hybrid", shapes, jax.eval_shape(tx.init, shapes))
    assert got == expected


@pytest.mark.parametrize("name", [*CONFIG_NAMES, "baseline"])
def test_both_frameworks_count_the_same_bytes(name, torch_one_thread):
    """The JAX and PyTorch benchmarks apply one model to their own optimizers' states."""
    cfg = get_model_config("tiny")
    shapes = llama_param_shapes(cfg)
    jname = jax_step.BASELINE if name == "baseline" else name
    tname = torch_step.BASELINE if name == "baseline" else name
    jb = jax_step.bytes_moved(jname, shapes, jax.eval_shape(jax_step.make_tx(jname).init,
                                                            shapes))
    model = torch_step.build_model(cfg)
    opt = torch_step.make(tname, model, 1e-4, False)
    opt.step()
    assert jb == torch_step.bytes_moved(tname, model, opt)


def test_extra_passes():
    assert traffic.extra_passes("sinkgd", {"num_iters": 5}, 2) == 12
    assert traffic.extra_passes("sage", {}, 2) == 1
    assert traffic.extra_passes("sage", {}, 1) == 0
    assert traffic.extra_passes("adamw", {}, 2) == 0
