"""sage_torch and sage_optax make the same updates (docs/configurations.md).

For each of the eight configurations: the same initial weights (converted between Flax and
PyTorch layouts), hyperparameters, warmup + cosine schedule and gradient sequence give the
same parameters after each step in float64 (to 1e-10); in float32 each step, started on both
sides from the same synchronized state, gives the same update to float32's resolution
(:data:`SYNC_ULPS`, :data:`SYNC_OFFSET`); a model-level run (same batches through both
frameworks' models) gives the same losses step by step.  A one-ulp change of the SAGE damper
in one framework fails the float32 check.
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from sage_optim import CONFIG_NAMES  # noqa: E402
from sage_repro import parity  # noqa: E402
from sage_repro.parity import (  # noqa: E402
    EPS32,
    SYNC_OFFSET,
    SYNC_ULPS,
    TIE_ULPS,
    TOLERANCE,
    main,
    run_parity,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_same_gradients_same_parameters_float64(name):
    report = run_parity(name, steps=100, dtype="float64")
    assert len(report.rows) == 100 and report.check == "trajectory"
    for step, _, cols in report.rows:
        for kind in ("embedding", "dense", "vector"):
            assert cols[kind] <= TOLERANCE["float64"], (name, step, kind, cols)
    assert report.ok and report.beyond == 0


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_synchronized_float32_updates_agree(name):
    """Every step from the same float32 state: the updates agree to float32's resolution."""
    report = run_parity(name, steps=15, dtype="float32")
    assert report.check == "sync" and report.ok, report.verdict()
    assert report.worst <= 16  # measured: at most 13 units (SYNC_ULPS leaves room)
    assert abs(report.offset) <= 0.1 and report.beyond == 0 and report.ties == 0
    assert report.gap64 <= 1e-14  # the synchronized states: the float64 run's, equal
    assert all(0 <= cols["ties"] for _, _, cols in report.rows)


def test_synchronized_tolerance_is_bound_and_stated():
    """The float32 tolerance is float32's resolution, as the docs and the verdict state it."""
    assert EPS32 == 2.0**-23 == float(np.finfo(np.float32).eps)
    assert (SYNC_ULPS, SYNC_OFFSET, TIE_ULPS, TOLERANCE) == (64.0, 0.25, 8.0,
                                                            {"float64": 1e-10})
    doc = " ".join((ROOT / "docs" / "configurations.md").read_text().split())
    for words in ("64 times float32's resolution", "0.25 ulp", "1e-10",
                  "within 8 float32 ulps"):
        assert words in doc, words
    verdict = run_parity("lion", steps=2, dtype="float32").verdict()
    assert "(tolerance 64)" in verdict and "(tolerance 0.25)" in verdict, verdict


@pytest.fixture
def damper_one_ulp_up(monkeypatch):
    """sage_torch's SAGE damper H moved up by one ulp (np.nextafter, element-wise)."""
    import sage_torch.sage as sage

    original = sage.sage_damper

    def bumped(*args, **kwargs):
        h = original(*args, **kwargs)
        return torch.from_numpy(np.nextafter(h.numpy(), np.inf))

    monkeypatch.setattr(sage, "sage_damper", bumped)


@pytest.mark.parametrize("name", ["sage-hybrid", "sage-pure"])
def test_one_ulp_change_of_the_damper_fails_the_float32_check(damper_one_ulp_up, name):
    report = run_parity(name, steps=3, dtype="float32")
    assert not report.ok and report.offset > SYNC_OFFSET, report.verdict()
    assert "FAILED" in report.verdict()


def test_one_ulp_change_fails_the_command(damper_one_ulp_up, capsys):
    assert main(["--config", "sage-hybrid", "--dtype", "float32", "--steps", "2"]) == 1
    out = capsys.readouterr().out
    assert "overall: FAILED: 1 of 1 configurations (sage-hybrid)" in out


def test_sign_ties_count_only_arguments_within_rounding_of_zero():
    """A flipped sign is a tie only where ``b1·M + (1−b1)·g`` is within rounding of zero;
    elsewhere it is an element beyond tolerance."""
    group = {"rule": "lion", "betas": (0.9, 0.99)}
    g = np.array([1.0, 1.0, 1.0])
    m = np.array([-1.0 / 9.0, 0.5, 0.5])  # argument: 0 (a tie), 0.55, 0.55
    state = {"exp_avg": torch.from_numpy(m)}
    ut = np.array([1e-3, 1e-3, 1e-3])
    uj = np.array([-1e-3, 1e-3, -1e-3])  # flipped at the tie and at a clear sign
    worst, beyond, ties, _, _ = parity._compare_updates(ut, uj, group, state, g)
    assert (ties, beyond) == (1, 1)
    assert worst == pytest.approx(2 / EPS32)
    # the same flip for a rule without a sign is never a tie
    assert parity._compare_updates(ut, uj, {"rule": "adamw"}, {}, g)[1:3] == (2, 0)


@pytest.mark.parametrize("name", ["sage-hybrid", "adamw"])
def test_float32_trajectories_are_reported_as_drift(name):
    report = run_parity(name, steps=8, dtype="float32", trajectory=True)
    assert report.check == "drift" and report.ok
    assert "drift apart" in report.verdict() and "not checked" in report.verdict()


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_same_batches_same_losses(name):
    report = run_parity(name, steps=30, dtype="float64", mode="model")
    for step, _, cols in report.rows:
        assert cols["loss"] <= 1e-12, (name, step, cols)
        assert max(cols[k] for k in ("embedding", "dense", "vector")) <= 1e-10
    assert report.ok


def test_parity_is_not_vacuous():
    """A different configuration on one side is caught at once, in both dtypes."""
    original = parity._torch_optimizer
    try:
        parity._torch_optimizer = lambda name, model, table, *rest: original(
            "lion", model, table, *rest)
        assert not run_parity("sage-hybrid", steps=3).ok
        assert not run_parity("sage-hybrid", steps=3, dtype="float32").ok
    finally:
        parity._torch_optimizer = original


@pytest.mark.parametrize("name", ["sage-hybrid", "sinkgd-pure"])
def test_foreach_path_has_parity(name):
    """The multi-tensor path of sage_torch against sage_optax (float64, float32 synchronized)."""
    assert run_parity(name, steps=6, foreach=True).ok
    assert run_parity(name, steps=3, foreach=True, dtype="float32").ok


def test_command_prints_tables_verdicts_and_overall(capsys):
    assert main(["--config", "sage-hybrid", "--steps", "12", "--every", "4"]) == 0
    out = capsys.readouterr().out
    assert "sage-hybrid (float64, gradients)" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("4 ", "8 ", "12 "))]
    assert len(rows) == 3
    assert re.search(r"^sage-hybrid \(gradients, float64, 12 steps\): OK: parameters differ "
                     r"by at most \S+ \(tolerance 1e-10\)", out, re.M), out
    assert out.rstrip().endswith("overall: OK: all 1 configurations agree")


def test_command_float32_every_configuration(capsys):
    assert main(["--config", "all", "--dtype", "float32", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert sum(line.endswith(" apart") and ": OK: synchronized" in line
               for line in out.splitlines()) == len(CONFIG_NAMES)
    assert out.rstrip().endswith(f"overall: OK: all {len(CONFIG_NAMES)} configurations agree")


def test_command_drift_is_never_a_failure(capsys):
    assert main(["--dtype", "float32", "--trajectory", "--steps", "4"]) == 0
    assert "overall: 1 drift report(s), nothing checked" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "words"), [
    (["--every", "0"], "argument --every: must be an integer >= 1, got '0'"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1, got '0'"),
    (["--foreach", "--fused"], "--foreach and --fused are two torch paths"),
    (["--untied"], "--untied applies to --mode llama only"),
    (["--trajectory"], "--trajectory applies to --dtype float32"),
    (["--mode", "llama", "--foreach"], "--foreach applies to --mode gradients and model"),
    (["--mode", "llama", "--fused"], "--fused applies to --mode gradients and model"),
    (["--config", "sage"], "argument --config: invalid choice"),
])
def test_every_option_is_checked_before_any_work(argv, words, capsys, monkeypatch):
    monkeypatch.setattr(parity, "_run_command", lambda args: pytest.fail("work started"))
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2 and words in err, err
    assert err.count("\n") == 1 and err.startswith("sage-parity: error: ")


@pytest.mark.skipif(not __import__("sage_torch.common").common.triton_available(),
                    reason="the triton package is not installed: the fused kernels cannot run "
                           "under Triton's CPU interpreter")
@pytest.mark.parametrize("name", ["sage-hybrid", "lion-hybrid"])
def test_fused_path_has_parity(name):
    """The fused (Triton, interpreted on the CPU) path against sage_optax (float64)."""
    import os

    before = os.environ.get("TRITON_INTERPRET")
    report = run_parity(name, steps=3, fused=True)
    assert report.worst <= 1e-10, report.table()
    assert os.environ.get("TRITON_INTERPRET") == before  # restored


def test_fused_and_foreach_are_exclusive():
    with pytest.raises(ValueError, match="fused and foreach"):
        run_parity("sage-hybrid", steps=1, foreach=True, fused=True)
