"""benchmarks/torch_step.py runs end to end on the small model and prints every row."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

torch = pytest.importorskip("torch")

PATH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "torch_step.py"
spec = importlib.util.spec_from_file_location("torch_step", PATH)
torch_step = importlib.util.module_from_spec(spec)
sys.modules["torch_step"] = torch_step
spec.loader.exec_module(torch_step)

from sage_optim.presets import CONFIG_NAMES  # noqa: E402


def test_model_has_the_exact_llama_shapes_and_routes():
    import sage_torch
    from sage_train.model.shapes import get_model_config

    config = get_model_config("tiny")
    model = torch_step.build_model(config)
    assert sum(p.numel() for p in model.parameters()) == config.param_count()
    kinds = {r.route.kind for r in sage_torch.route_params(model)}
    assert kinds == {"embedding", "dense", "vector"}
    assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())


def test_end_to_end_tiny_every_config(capsys):
    threads = torch.get_num_threads()
    try:
        rows = torch_step.main(["--model", "tiny", "--repeats", "1", "--warmup", "1",
                                "--device", "cpu", "--threads", "1", "--bw-mib", "8"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| configuration | path | ms/step | vs AdamW |")
    for name in CONFIG_NAMES:
        for path in ("single-tensor", "foreach"):
            assert any(line.startswith(f"| {name} | {path} |") for line in table), (name, path)
    assert any(line.startswith(f"| {torch_step.BASELINE} |") for line in table)
    assert len(rows) == 2 * len(CONFIG_NAMES) + 1
    assert all(r["bytes"] > 0 and r["ms"] > 0 and r["peak"] is not None for r in rows)
    assert "1 thread(s)" in out
    assert "target (sage-hybrid step no slower than" in out
    assert out.rstrip().endswith(("MET", "NOT MET"))


def test_bytes_moved_counts_sinkgd_passes():
    from sage_train.model.shapes import get_model_config

    model = torch_step.build_model(get_model_config("tiny"))
    p_bytes = sum(p.numel() * 4 for p in model.parameters())
    opt = torch_step.make("sinkgd-pure", model, 1e-4, False)
    opt.step()
    dense = sum(p.numel() * 4 for p in model.parameters() if p.dim() == 2)
    # sinkgd-pure: SinkGD (L = 5) on every matrix: 2L + 2 extra passes (sage_repro.traffic).
    assert torch_step.bytes_moved("sinkgd-pure", model, opt) == 3 * p_bytes + 12 * dense
    base = torch_step.make(torch_step.BASELINE, model, 1e-4, True)
    base.step()
    assert torch_step.bytes_moved(torch_step.BASELINE, model, base) == 7 * p_bytes


# ---------------------------------------------------------------------------
# aten op count on the meta device (deterministic, no timing)
# ---------------------------------------------------------------------------

# Issue 13's target for sage-hybrid at 270M was 300 (torch's foreach AdamW: 250); the
# overflow-safe SAGE reductions (a power-of-two range scale for σ, γ and the vocab mean, so
# that every finite gradient gives a finite step) add 2 ops per SAGE bucket and 2 for the
# embedding's mean: 296 -> 302.
OP_BOUND = 302


def test_foreach_op_count_is_bounded_and_does_not_grow_with_depth():
    """One kernel per shape bucket and operation: the count is the same for 2 and 4 layers.

    (The same holds at 270M, 13 layers: ``python benchmarks/torch_step.py --op-count``.)
    """
    from sage_train.model.shapes import get_model_config

    tiny = torch_step.meta_model(get_model_config("tiny"))  # 2 layers
    small = torch_step.meta_model(get_model_config("small"))  # 4 layers
    counts = {}
    for name in ("sage-hybrid", "lion-hybrid", "sinkgd-hybrid", "sage-pure", "lion", "adamw"):
        counts[name] = torch_step.count_ops(name, tiny, True)[0]
        assert torch_step.count_ops(name, small, True)[0] == counts[name], name
    assert counts["sage-hybrid"] <= OP_BOUND, counts
    single = torch_step.count_ops("sage-hybrid", small, False)[0]
    assert single > 5 * counts["sage-hybrid"], (single, counts)
    base = torch_step.count_ops(torch_step.BASELINE, small, True)[0]
    assert counts["adamw"] <= base + 5, (counts["adamw"], base)  # torch's own foreach AdamW


def test_peak_memory_mode_counts_new_storages_on_meta():
    """The meta-device peak: new storages alive at once, views and known storages excluded."""
    known = torch.empty(1000, device="meta")
    mode = torch_step._PeakMemory({torch_step._storage_key(known)})
    with mode:
        a = known * 2  # 4000 new bytes
        view = a[10:]  # a view: no new storage
        known.add_(1)  # in place on a known storage
        b = a + 1  # 4000 more, both alive
        del a, b
        assert mode.live == 4000  # the view keeps a's storage alive
        del view
        c = torch.empty(250, device="meta")  # 1000 bytes after both were freed
    assert mode.peak == 8000 and mode.live == 1000, (mode.peak, mode.live)
    del c


def test_270m_op_count_and_sinkgd_rounds():
    """Issue 13's meta-device target at 270M, and what SinkGD's rounds do to it.

    A sage-hybrid foreach step dispatches at most ``OP_BOUND`` (302) aten ops (the default
    rounds hold the whole model's K: 2 x the 501 MiB embedding is more than all of it).
    Rounds of 128 MiB repeat the iterations' element-wise kernels (more ops) but bound
    sinkgd-pure's peak below that of one round: the check of the peak column can fail.
    """
    from sage_train.model.shapes import get_model_config

    model = torch_step.meta_model(get_model_config("270m"))
    ops, _ = torch_step.count_ops("sage-hybrid", model, True)
    assert ops <= OP_BOUND, ops
    # Two temporaries of the largest tensor (the embedding) and small ones, not four.
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    for name in ("sage-hybrid", "lion", "adamw", "sage-pure"):
        assert torch_step.count_ops(name, model, True)[1] <= 2.6 * largest, name

    def step(group_bytes):
        from sage_torch import make_optimizer

        opt = make_optimizer("sinkgd-pure", model, lr=1e-4, foreach=True)
        for group in opt.param_groups:
            group["group_bytes"] = group_bytes
        opt.step()
        counter, peak = torch_step.OpCounter(), torch_step._peak_mode(opt, model)
        with counter, peak:
            opt.step()
        return counter.total, peak.peak

    default, chunked = step(None), step(128 * 2**20)
    assert chunked[0] > default[0] and chunked[1] < default[1], (default, chunked)


def test_270m_fused_step_peak_is_at_most_the_largest_parameter():
    """Issue 13's memory target on the fused path (``fused=True``, opt-in), launches not run."""
    from sage_torch.common import triton_available
    from sage_train.model.shapes import get_model_config

    if not triton_available():
        pytest.skip("triton is not installed (pip install triton==3.6.0; the dev extra has it)")
    model = torch_step.meta_model(get_model_config("270m"))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    # sage-hybrid holds one parameter-sized temporary, |g| of the embedding for SAGE's
    # statistics, with a few vectors beside it (24 KiB at 270M): within 0.1% of the target.
    for name, bound in (("sage-hybrid", largest * 1.001), ("sinkgd-pure", largest),
                        ("lion-hybrid", largest)):
        ops, peak, launches = torch_step.count_fused(name, model)
        assert 0 < peak <= bound, (name, peak, largest)
        assert launches > 0, name
    # and the foreach path does not meet it (the check can fail)
    assert torch_step.count_ops("sage-hybrid", model, True)[1] > largest


def test_op_count_table(capsys):
    rows = torch_step.main(["--model", "tiny", "--op-count", "--configs", "sage-hybrid"])
    out = capsys.readouterr().out
    assert "| sage-hybrid | foreach |" in out and "| torch.optim.AdamW | foreach |" in out
    from sage_torch.common import triton_available

    fused = ["fused"] if triton_available() else []  # sage-hybrid's, launches counted
    assert [r["path"] for r in rows] == ["single-tensor", "foreach", *fused, "single-tensor",
                                         "foreach", "fused"]
    assert all(r["ops"] is None or r["ops"][0] > 0 for r in rows)


def test_fused_path_is_timed_on_cuda_only():
    """The fused rows join the CUDA timings (when triton is there), never the CPU's."""
    from sage_torch.common import triton_available

    assert torch_step.sage_paths("cpu") == ("single-tensor", "foreach")
    cuda = torch_step.sage_paths("cuda")
    assert cuda == (("single-tensor", "foreach", "fused") if triton_available()
                    else ("single-tensor", "foreach"))


def test_fused_vs_foreach_table_and_labels(capsys):
    """The table that decides the CUDA default: fused against foreach per configuration."""
    rows = [
        {"config": "sage-hybrid", "path": "single-tensor", "ms": 9.0, "peak": None},
        {"config": "sage-hybrid", "path": "foreach", "ms": 4.0, "peak": 2 * 2**20},
        {"config": "sage-hybrid", "path": "fused", "ms": 3.0, "peak": 2**20},
        {"config": "lion", "path": "foreach", "ms": 2.0, "peak": None},
        {"config": "lion", "path": "fused", "ms": 2.5, "peak": None},
        {"config": "adamw", "path": "foreach", "ms": 1.0, "peak": None},
    ]
    torch_step.print_fused_vs_foreach(rows)
    out = capsys.readouterr().out
    assert "| sage-hybrid | 4.00 | 3.00 | 0.75x | 2.0 | 1.0 |" in out
    assert "| lion | 2.00 | 2.50 | 1.25x | n/a | n/a |" in out
    assert "| adamw |" not in out
    assert out.rstrip().endswith("fused faster than foreach in 1 of 2 configuration(s)")
    torch_step.print_fused_vs_foreach(rows[:2])  # no fused rows (CPU): nothing
    assert capsys.readouterr().out == ""


def test_bfloat16_run_on_the_cpu(capsys):
    threads = torch.get_num_threads()
    try:
        rows = torch_step.main(["--model", "tiny", "--repeats", "1", "--warmup", "1",
                                "--device", "cpu", "--threads", "1", "--bw-mib", "8",
                                "--configs", "lion-hybrid", "--dtype", "bfloat16"])
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    assert "bfloat16" in out.splitlines()[0]
    assert "foreach (foreach=True: the default on CUDA, as torch.optim)" in out
    assert [r["path"] for r in rows] == ["single-tensor", "foreach", "foreach"]
    model = torch_step.build_model(torch_step.get_model_config("tiny"), dtype=torch.bfloat16)
    assert all(p.dtype == p.grad.dtype == torch.bfloat16 for p in model.parameters())


def test_fused_step_benchmark_runs_on_the_tiny_model(capsys, monkeypatch):
    """benchmarks/torch_fused_step.py end to end on the CPU (Triton's interpreter): every
    row, and the fused sweep's step as close to the single-tensor path as foreach's."""
    from sage_torch.common import triton_available

    if not triton_available():
        pytest.skip("triton is not installed: the fused path cannot run")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    path = PATH.parent / "torch_fused_step.py"
    spec2 = importlib.util.spec_from_file_location("torch_fused_step", path)
    bench = importlib.util.module_from_spec(spec2)
    spec2.loader.exec_module(bench)
    assert bench.main(["--model", "tiny", "--device", "cpu", "--repeats", "1", "--warmup", "0",
                       "--configs", "sinkgd-hybrid", "--group-mib", "1024"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[1].strip(): line.split("|") for line in out.splitlines()
            if line.startswith("| ") and "---" not in line}
    assert {"AdamW(fused=True)", "AdamW(foreach=True)", "sinkgd-hybrid foreach",
            "sinkgd-hybrid fused sweep 1024 MiB"} <= set(rows)
    err = {k: float(v[6]) for k, v in rows.items() if k.startswith("sinkgd-hybrid")}
    assert max(err.values()) <= 2 * err["sinkgd-hybrid foreach"] + 1e-6, err
