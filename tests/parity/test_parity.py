"""sage_torch and sage_optax make the same updates (docs/configurations.md).

For each of the eight configurations: the same initial weights (converted between Flax and
PyTorch layouts), hyperparameters, warmup + cosine schedule and gradient sequence give the
same parameters after each of 100 steps, float64 to 1e-10 and float32 to 1e-5; a model-level
run (same batches through both frameworks' models) gives the same losses step by step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from sage_optim import CONFIG_NAMES  # noqa: E402
from sage_repro.parity import TOLERANCE, main, run_parity  # noqa: E402


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_same_gradients_same_parameters(name, dtype):
    report = run_parity(name, steps=100, dtype=dtype)
    assert len(report.rows) == 100
    for step, _, cols in report.rows:
        for kind in ("embedding", "dense", "vector"):
            assert cols[kind] <= TOLERANCE[dtype], (name, dtype, step, kind, cols)
    assert report.ties == 0


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_same_batches_same_losses(name):
    report = run_parity(name, steps=30, dtype="float64", mode="model")
    for step, _, cols in report.rows:
        assert cols["loss"] <= 1e-12, (name, step, cols)
        assert max(cols[k] for k in ("embedding", "dense", "vector")) <= 1e-10
    # the models actually trained (the comparison is not between two frozen models)
    first, last = report.rows[0][2], report.rows[-1][2]
    assert set(first) == set(last)


def test_parity_is_not_vacuous():
    """A different configuration on one side is caught at once."""
    import sage_repro.parity as parity

    original = parity._torch_optimizer
    try:
        parity._torch_optimizer = lambda name, model, table, *rest: original("lion", model,
                                                                             table, *rest)
        report = run_parity("sage-hybrid", steps=3)
    finally:
        parity._torch_optimizer = original
    assert report.worst > 1e-6


@pytest.mark.parametrize("name", ["sage-hybrid", "sinkgd-pure"])
def test_foreach_path_has_parity(name):
    """The multi-tensor path of sage_torch against sage_optax (float64)."""
    report = run_parity(name, steps=6, foreach=True)
    assert report.worst <= 1e-10, report.table()


def test_command_prints_table(capsys):
    assert main(["--config", "sage-hybrid", "--steps", "12", "--every", "4"]) == 0
    out = capsys.readouterr().out
    assert "sage-hybrid (float64, gradients)" in out
    assert "beyond tol" in out and "OK" in out
    rows = [line for line in out.splitlines() if line.strip().startswith(("4 ", "8 ", "12 "))]
    assert len(rows) == 3


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
