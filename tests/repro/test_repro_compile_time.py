"""``benchmarks/compile_time.py``: its table at a tiny size, and its options (no timings)."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("compile_time_bench",
                                                  ROOT / "benchmarks" / "compile_time.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_table_has_every_configuration_against_adamw(capsys, monkeypatch):
    bench = _load()
    sinkgd_mod = bench._sinkgd
    monkeypatch.setattr(sinkgd_mod, "CPU_GROUPING", sinkgd_mod.CPU_GROUPING)  # restored after
    monkeypatch.setattr(sinkgd_mod, "CPU_NATIVE", sinkgd_mod.CPU_NATIVE)
    cache = jax.config.jax_enable_compilation_cache
    try:
        bench.main(["--model", "tiny", "--configs", "sinkgd-hybrid", "--what", "update",
                    "--repeats", "1", "--cpu-grouping", "leaf", "--cpu-native", "off"])
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)
    out = capsys.readouterr().out
    assert sinkgd_mod.CPU_GROUPING == "leaf"  # the options reached the library
    assert not sinkgd_mod.CPU_NATIVE and "SinkGD on the CPU: jnp (grouping leaf)" in out
    rows = re.findall(r"^\| (optax\.adamw \(baseline\)|sinkgd-hybrid) \|(.*)\|$", out, re.M)
    assert [name for name, _ in rows] == ["optax.adamw (baseline)", "sinkgd-hybrid"]
    cells = [float(c.strip().rstrip("x")) for c in rows[0][1].split("|")]
    assert cells[2] == 1.0 and cells[4] == 1.0  # the baseline against itself
    assert all(float(c.strip().rstrip("x")) > 0 for c in rows[1][1].split("|"))


def test_repeats_must_be_positive():
    with pytest.raises(SystemExit):
        _load().parse_args(["--repeats", "0"])
