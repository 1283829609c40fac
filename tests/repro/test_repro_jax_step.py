"""``benchmarks/jax_step.py``'s A/B of SinkGD's range pass and its median over processes."""

from __future__ import annotations

import importlib.util
import pathlib
import re
import subprocess
import sys

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

import sage_optax

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("jax_step_ab", ROOT / "benchmarks" /
                                                  "jax_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _primitives(jaxpr):
    """Every primitive name in ``jaxpr`` and its loops' bodies, not in a ``cond``'s
    branches (the checked path's fallback, which finds the range, is one)."""
    names = []
    for eqn in jaxpr.eqns:
        names.append(eqn.primitive.name)
        if eqn.primitive.name != "cond":
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                names += _primitives(sub)
    return names


def test_a_range_pass_entry_traces_the_range_scaled_computation(monkeypatch):
    """The plain entry's SinkGD is the checked path (its fallback is a ``cond``); the
    ``[range pass]`` entry's finds ``max|G|`` (a ``reduce_max``) and has no ``cond``; both
    give the same update, and the substitution ends with the context."""
    js = _load()
    monkeypatch.setattr(importlib.import_module("sage_optax.sinkgd"), "CPU_NATIVE", False)
    params = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)),
                               jnp.float32)}
    tx = sage_optax.scale_by_sinkhorn()
    state = tx.init(params)

    def prims(entry):  # a new transformation each time: JAX caches a function's trace
        fresh = sage_optax.scale_by_sinkhorn()
        with js.traced_as(entry):
            return _primitives(jax.make_jaxpr(fresh.update)(params, state).jaxpr)

    assert "cond" in prims("sinkgd-hybrid") and "reduce_max" not in prims("sinkgd-hybrid")
    ab = prims(f"sinkgd-hybrid [{js.RANGE_PASS}]")
    assert "cond" not in ab and "reduce_max" in ab
    assert "cond" in prims("sinkgd-hybrid")  # restored
    with js.traced_as(f"x [{js.RANGE_PASS}]"):
        ranged = jax.jit(tx.update)(params, state)[0]["w"]
    checked = jax.jit(sage_optax.scale_by_sinkhorn().update)(params, state)[0]["w"]
    np.testing.assert_array_equal(ranged, checked)
    assert js.split_entry(f"sinkgd-hybrid [{js.RANGE_PASS}]") == ("sinkgd-hybrid", "jnp")


def test_processes_report_each_ratio_and_their_median():
    """Two fresh processes on the tiny model: each one's table, then per configuration the
    two ratios and their median, the baseline's being 1.00 in each."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "jax_step.py"), "--model", "tiny",
         "--configs", "sinkgd-hybrid", "--compare-range-pass", "sinkgd-hybrid",
         "--schedule", "all", "--repeats", "1", "--warmup", "0", "--bw-mib", "4",
         "--bw-repeats", "3", "--processes", "2"],
        capture_output=True, text=True, check=True, cwd=ROOT, timeout=600).stdout
    assert re.findall(r"^process (\d) of 2:$", out, re.M) == ["1", "2"]
    assert "2 processes" in out
    rows = {m[0]: m[1:] for m in re.findall(
        r"^\| ([^|]+?) \| ([0-9.]+), ([0-9.]+) \| ([0-9.]+)x \| ([0-9.]+) \|$", out, re.M)}
    assert set(rows) == {"sinkgd-hybrid", "sinkgd-hybrid [range pass]",
                         "optax.adamw (baseline)"}
    assert rows["optax.adamw (baseline)"][:3] == ("1.00", "1.00", "1.00")
    for a, b, median, _ in rows.values():  # the median of two: their mean, as printed
        assert abs(float(median) - (float(a) + float(b)) / 2) <= 0.006


def test_processes_must_be_positive():
    js = _load()
    try:
        js.parse_args(["--processes", "0"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--processes 0 was accepted")


def test_a_grouping_entry_is_traced_with_its_cpu_grouping():
    """``--compare-groupings``: ``"<name> [grouping G]"`` runs XLA's CPU path (``"jnp"``)
    with SinkGD's CPU grouping G while it is traced, and the library's default afterwards."""
    bench = _load()
    sinkgd_mod = bench.sinkhorn
    entry = "sage-hybrid [grouping leaf]"
    assert bench.split_entry(entry) == ("sage-hybrid", "jnp")
    assert bench.grouping_of(entry) == "leaf" and bench.grouping_of("sage-hybrid [jnp]") is None
    default = sinkgd_mod.CPU_GROUPING
    with bench.traced_as(entry):
        assert sinkgd_mod.CPU_GROUPING == "leaf"
    assert sinkgd_mod.CPU_GROUPING == default
    args = bench.parse_args(["--configs", "sage-hybrid", "--compare-groupings", "sage-hybrid"])
    assert bench._entries(args) == ["sage-hybrid", "sage-hybrid [grouping leaf]",
                                    "sage-hybrid [grouping sequence]"]
