"""The trainer's attention implementations and SinkGD kernel: the rule, the model, the record.

* the one rule (``attention_choice``) per platform, dtype and head dim;
* the model on the CPU: ``auto`` is exactly XLA's attention, and XLA's is the written-out math;
* an emulated GPU host (``jax.default_backend`` says ``"gpu"``, cuDNN "detected"): ``auto``
  traces cuDNN's branch, and a jitted forward + grad on CPU arrays is bit for bit the CPU's;
* ``sage-train --attention/--sinkgd-kernel``: parsed, refused where they cannot run, printed,
  recorded in ``config.json`` and every ``metrics.jsonl`` row, checked on resume;
* ``benchmarks/attention.py`` and ``benchmarks/train_memory_plan.py`` at a tiny size.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import pathlib
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")
pytest.importorskip("orbax.checkpoint")

from train_helpers import config, quiet  # noqa: E402

from sage_optax import placement  # noqa: E402
from sage_optim import kernels  # noqa: E402
from sage_train.cli import configs, main, parse_args  # noqa: E402
from sage_train.job.errors import ConfigError, RunDirError  # noqa: E402
from sage_train.model import llama as model_mod  # noqa: E402
from sage_train.model.llama import (  # noqa: E402
    Llama,
    attention_choice,
    attention_implementation,
    causal_attention,
    cudnn_present,
    cudnn_supported,
    loss_fn,
    reference_attention,
)
from sage_train.model.shapes import MODELS  # noqa: E402
from sage_train.run.resolve import implementations  # noqa: E402
from sage_train.run.train import train  # noqa: E402
from sage_train.store import rundir  # noqa: E402

pytestmark = pytest.mark.usefixtures("token_cache")

ROOT = pathlib.Path(__file__).resolve().parents[2]
TINY = MODELS["tiny"]  # 4 query heads, 2 kv heads, head dim 24
BF16, F16, F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32)


H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def cpu_mesh(monkeypatch):
    """The trainer's mesh on the CPU devices, on any host (a GPU host's too: gpu-check)."""
    from sage_train.model import sharding

    monkeypatch.setattr(sharding, "mesh_devices", lambda: jax.devices("cpu"))


@pytest.fixture
def validated_h100(monkeypatch):
    """cuDNN's attention validated on H100s, and this process's GPU (if emulated) an H100."""
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "cudnn-attention": ("H100",)})
    monkeypatch.setattr(placement, "cuda_device_kind", lambda: H100)


def _load(name):
    path = ROOT / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# 1. the rule
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("requested,platform,dtype,head_dim,cudnn,want", [
    ("auto", "cuda", BF16, 64, True, "cudnn"),
    ("auto", "gpu", F16, 128, True, "cudnn"),  # "gpu" is CUDA; 128: the largest taken
    ("auto", "cuda", BF16, 8, True, "cudnn"),
    ("auto", "cuda", F32, 64, True, "xla"),  # no float32 flash attention
    ("auto", "cpu", BF16, 64, True, "xla"),
    ("auto", "rocm", BF16, 64, True, "xla"),
    ("auto", "tpu", BF16, 64, True, "xla"),
    ("auto", "cuda", BF16, 136, True, "xla"),  # > 128 (Hopper's 256 not relied on)
    ("auto", "cuda", BF16, 60, True, "xla"),  # not a multiple of 8
    ("auto", "cuda", BF16, 64, False, "xla"),  # no cuDNN in this JAX
    ("xla", "cuda", BF16, 64, True, "xla"),
    ("xla", "cpu", F32, 60, False, "xla"),
    ("cudnn", "cuda", BF16, 64, True, "cudnn"),
])
def test_attention_rule(requested, platform, dtype, head_dim, cudnn, want, validated_h100):
    """Where cuDNN's attention is validated (an H100, emulated), "auto" takes it wherever
    it is supported; on a GPU where it is not, "auto" is XLA's and only "cudnn" opts in."""
    got = attention_implementation(requested, platform, dtype, head_dim, cudnn=cudnn,
                                   device_kind=H100)
    assert got == want
    if requested == "auto":  # auto takes cuDNN exactly where it is supported
        assert cudnn_supported(platform, dtype, head_dim, cudnn=cudnn) == (want == "cudnn")
    for kind in (None, "NVIDIA H200"):  # not validated there
        got = attention_implementation(requested, platform, dtype, head_dim, cudnn=cudnn,
                                       device_kind=kind)
        assert got == (want if requested != "auto" else "xla")


@pytest.mark.parametrize("platform,dtype,head_dim,cudnn,reason", [
    ("cpu", BF16, 64, True, "needs a CUDA GPU, and the computation runs on cpu"),
    ("cuda", F32, 64, True, "needs bfloat16 or float16, and the attention is float32"),
    ("cuda", BF16, 60, True, "multiple of 8 and at most 128, and the model's is 60"),
    ("cuda", BF16, 256, True, "multiple of 8 and at most 128, and the model's is 256"),
    ("cuda", BF16, 64, False, "this JAX has no cuDNN"),
])
def test_explicit_cudnn_is_refused_with_the_reason(platform, dtype, head_dim, cudnn, reason):
    with pytest.raises(ValueError, match="attention='cudnn' cannot run here") as e:
        attention_choice("cudnn", platform, dtype, head_dim, cudnn=cudnn)
    assert reason in str(e.value) and "\n" not in str(e.value)
    impl, why = attention_choice("auto", platform, dtype, head_dim, cudnn=cudnn)
    assert impl == "xla" and why == f"auto: {str(e.value).split(': ', 1)[1]}"


def test_attention_reasons_and_unknown_choices(monkeypatch):
    # scripts/gpu-check validated it on an H100 (benchmarks/gpu/2026-11-26-h100.md), no other
    assert kernels.VALIDATED_ON["cudnn-attention"] == ("H100",)
    assert attention_choice("auto", "cuda", BF16, 64, device_kind="NVIDIA A100-SXM4-80GB") == (
        "xla", "auto: cuDNN attention is not yet validated on NVIDIA A100-SXM4-80GB by "
        "scripts/gpu-check (opt in with attention='cudnn')")
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "cudnn-attention": ()})
    assert attention_choice("auto", "cuda", BF16, 64, device_kind=H100)[0] == "xla"
    assert attention_choice("cudnn", "cuda", BF16, 64) == (
        "cudnn", "cudnn: cuDNN flash attention, bfloat16, head dim 64, cuda")
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "cudnn-attention": ("H100",)})
    assert attention_choice("auto", "cuda", BF16, 64, device_kind=H100) == (
        "cudnn", "auto: cuDNN flash attention, bfloat16, head dim 64, cuda")
    monkeypatch.setenv(kernels.ENV_VAR, "off")  # every kernel off: XLA's, also when asked
    assert attention_choice("auto", "cuda", BF16, 64, device_kind=H100) == (
        "xla", "auto: SAGE_KERNELS=off")
    kernels._warned.clear()
    with pytest.warns(RuntimeWarning, match="SAGE_KERNELS=off: attention='cudnn' is ignored"):
        assert attention_choice("cudnn", "cuda", BF16, 64)[0] == "xla"
    monkeypatch.delenv(kernels.ENV_VAR)
    assert attention_choice("xla", "cuda", BF16, 64)[1].startswith("requested: XLA's")
    with pytest.raises(ValueError, match=r"attention must be one of \('auto', 'cudnn', 'xla'\)"):
        attention_choice("flash", "cuda", BF16, 64)
    with pytest.raises(ValueError, match="attention must be one of"):
        Llama(TINY, rngs=nnx.Rngs(0), attention="flash")


def test_cudnn_presence_is_asked_of_jax(monkeypatch):
    """This CPU-only jaxlib has no cuDNN; with cuDNN's version check answering, it has."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU JAX: cuDNN is present")
    assert cudnn_present() is False
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    assert cudnn_present() is True


# ---------------------------------------------------------------------------
# 2. the model on the CPU, and on an emulated GPU host
# ---------------------------------------------------------------------------


def _qkv(dtype, b=2, t=16):
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (b, t, 4, 8), dtype)
    k = jax.random.normal(keys[1], (b, t, 2, 8), dtype)  # grouped-query: 2 kv heads for 4
    v = jax.random.normal(keys[2], (b, t, 2, 8), dtype)
    return 3 * q, 3 * k, v


def test_auto_and_xla_are_xlas_attention_on_the_cpu():
    """causal_attention "auto" and "xla": exactly jax.nn.dot_product_attention's XLA result
    (eager and jitted), and the written-out math within test_train_model's tolerance;
    "cudnn" is refused on CPU arrays (committed to a CPU device: so on a GPU host too)."""
    q, k, v = jax.device_put(_qkv(jnp.float32), jax.devices("cpu")[0])

    def xla_call(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, scale=8**-0.5,
                                            implementation="xla")

    with jax.default_matmul_precision("highest"):
        xla, xla_jitted = xla_call(q, k, v), jax.jit(xla_call)(q, k, v)
        ref = reference_attention(q, k, v)
        for name in ("auto", "xla"):
            np.testing.assert_array_equal(causal_attention(q, k, v, name), xla)
            jitted = jax.jit(lambda q, k, v, name=name: causal_attention(q, k, v, name))
            np.testing.assert_array_equal(jitted(q, k, v), xla_jitted)
    np.testing.assert_allclose(xla, ref, atol=2e-6, rtol=0)
    with pytest.raises(ValueError, match="needs a CUDA GPU, and the computation runs on cpu"):
        causal_attention(q, k, v, "cudnn")
    with pytest.raises(ValueError, match="attention must be one of"):
        causal_attention(q, k, v, "flash")


@pytest.mark.parametrize("layers", ["loop", "scan"])
def test_model_auto_is_the_xla_model_on_the_cpu(layers):
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, TINY.vocab_size)
    logits = {name: Llama(TINY, rngs=nnx.Rngs(0), layers=layers, attention=name)(tokens)
              for name in ("auto", "xla")}
    np.testing.assert_array_equal(logits["auto"], logits["xla"])
    model = Llama(TINY, rngs=nnx.Rngs(0), layers=layers, attention="cudnn")
    with pytest.raises(ValueError, match="attention='cudnn' cannot run here"):
        model(tokens)


def _forward_and_grad(dtype, attention="auto"):
    """A fresh jitted loss and gradient of the tiny model (fresh: traced anew each call)."""
    model = Llama(TINY, rngs=nnx.Rngs(0), dtype=dtype, layers="scan", attention=attention)
    stream = jax.random.randint(jax.random.key(1), (2, 17), 0, TINY.vocab_size)
    step = nnx.jit(lambda m, x, y: nnx.value_and_grad(loss_fn)(m, x, y))
    loss, grads = step(model, stream[:, :-1], stream[:, 1:])
    return [np.asarray(x) for x in jax.tree.leaves((loss, nnx.state(grads)))]


@pytest.fixture
def cudnn_spy(monkeypatch):
    """Counts the traces of cuDNN's attention (the model looks it up at each call)."""
    calls: list[str] = []
    real = model_mod.cudnn_attention

    def spy(q, k, v, scale):
        calls.append(jnp.dtype(q.dtype).name)
        return real(q, k, v, scale)

    monkeypatch.setattr(model_mod, "cudnn_attention", spy)
    return calls


def test_emulated_gpu_host_traces_cudnn_and_runs_cpu_arrays_bit_for_bit(monkeypatch, cudnn_spy,
                                                                        validated_h100):
    """On a host where JAX's default backend is a GPU, "auto" traces cuDNN's attention for
    the CUDA branch, and the CPU program keeps the XLA branch only: a jitted forward +
    gradient of a bfloat16 model on CPU arrays equals the plain CPU result bit for bit."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    with jax.default_device(jax.devices("cpu")[0]):  # CPU arrays, also on a real GPU host
        _emulated_gpu_host_runs_cpu_arrays(monkeypatch, cudnn_spy, fa)


def _emulated_gpu_host_runs_cpu_arrays(monkeypatch, cudnn_spy, fa):
    plain = _forward_and_grad(jnp.bfloat16)
    # The CUDA branch is traced exactly where the process has a CUDA device (and lowered
    # only for CUDA arrays): on a CPU host only XLA's attention was traced.
    assert bool(cudnn_spy) == (placement.cuda_device_count() > 0)
    cudnn_spy.clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 90800)
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "cudnn-attention": ()})
    _forward_and_grad(jnp.bfloat16)
    assert cudnn_spy == []  # not validated on this GPU: auto has no cuDNN branch
    monkeypatch.setattr(kernels, "VALIDATED_ON", {**kernels.VALIDATED_ON,
                                                  "cudnn-attention": ("H100",)})
    emulated = _forward_and_grad(jnp.bfloat16)
    assert cudnn_spy and set(cudnn_spy) == {"bfloat16"}  # the CUDA branch was traced
    assert len(emulated) == len(plain) > 10
    for a, b in zip(emulated, plain, strict=True):
        np.testing.assert_array_equal(a, b)
    # float32: no flash attention, so no CUDA branch (the rule said xla)
    cudnn_spy.clear()
    _forward_and_grad(jnp.float32)
    assert cudnn_spy == []


# ---------------------------------------------------------------------------
# 3. sage-train: options, refusal, print, record, resume
# ---------------------------------------------------------------------------


def test_both_options_parse_and_reach_the_configurations():
    args = parse_args(["--attention", "xla", "--sinkgd-kernel", "jnp", "--optimizer", "adamw",
                       "sage-hybrid"])
    assert [(c.attention, c.sinkgd_kernel) for c in configs(args)] == [("xla", "jnp")] * 2
    defaults = configs(parse_args([]))[0]
    assert (defaults.attention, defaults.sinkgd_kernel) == ("auto", "auto")


@pytest.mark.parametrize("args,option", [
    (["--attention", "flash"], "--attention"), (["--attention", "XLA"], "--attention"),
    (["--sinkgd-kernel", "triton"], "--sinkgd-kernel"),
])
def test_cli_refuses_bad_choices_in_one_line(tmp_path, capsys, args, option):
    with pytest.raises(SystemExit) as e:
        main(["--model", "tiny", "--run-dir", str(tmp_path / "runs"), *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {option}" in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_cli_refuses_cudnn_on_the_cpu_before_anything(train_corpus, tmp_path, capsys, cpu_mesh):
    runs = tmp_path / "runs"
    code = main(["--model", "tiny", "--optimizer", "adamw", "sage-hybrid", "--attention",
                 "cudnn", "--steps", "2", "--data", str(train_corpus), "--run-dir", str(runs),
                 "--no-progress"])
    assert code == 2
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("sage-train: error: --attention cudnn cannot run here: ")
    assert "needs a CUDA GPU, and the computation runs on cpu" in captured.err
    assert "training" not in captured.out and not runs.exists()
    with pytest.raises(ConfigError, match="--attention cudnn cannot run here"):
        train(config(train_corpus, tmp_path / "api", attention="cudnn"))
    assert not (tmp_path / "api").exists()


def test_cli_prints_and_records_the_choices(train_corpus, tmp_path, capsys, cpu_mesh):
    """Every run says what it computes with, and records it in config.json and every
    metrics.jsonl row (the SinkGD kernel null for a configuration without SinkGD)."""
    code = main(["--model", "tiny", "--optimizer", "sage-hybrid", "adamw", "--steps", "2",
                 "--batch-size", "8", "--seq-len", "32", "--eval-every", "2",
                 "--eval-batches", "1", "--log-every", "1", "--data", str(train_corpus),
                 "--run-dir", str(tmp_path), "--no-progress", "--attention", "auto",
                 "--sinkgd-kernel", "auto"])
    assert code == 0
    out = capsys.readouterr().out.splitlines()
    attention = "attention:       xla (auto: cuDNN attention needs a CUDA GPU, and the " \
                "computation runs on cpu)"  # a line of the aligned start header
    assert out.count(attention) == 2
    kernel = [x for x in out if x.startswith("sinkgd kernel: ")]
    assert kernel[0].startswith("sinkgd kernel:   jnp (auto: ")
    assert kernel[0].endswith(" cpu devices)") or kernel[0].endswith(" cpu device)")
    assert kernel[1] == "sinkgd kernel:   - (adamw runs no SinkGD)"
    for name, want in (("sage-hybrid", "jnp"), ("adamw", None)):
        run = tmp_path / f"tiny-{name}"
        settings = json.loads((run / "config.json").read_text())
        assert (settings["attention"], settings["sinkgd_kernel"]) == ("xla", want)
        rows = list(rundir.iter_metrics(run))
        assert [r["step"] for r in rows] == [1, 2]
        assert all(r["attention"] == "xla" and r["sinkgd_kernel"] == want for r in rows)


def test_sage_kernels_off_records_jnp(train_corpus, tmp_path, monkeypatch):
    """--sinkgd-kernel pallas (the interpreted kernel on the CPU) under SAGE_KERNELS=off: the
    jnp path is what runs, and what is recorded."""
    monkeypatch.delenv("SAGE_KERNELS", raising=False)
    cfg = config(train_corpus, tmp_path / "pallas", sinkgd_kernel="pallas", steps=1)
    assert implementations(cfg).sinkgd_kernel == "pallas"
    monkeypatch.setenv("SAGE_KERNELS", "off")
    with warnings.catch_warnings():  # "kernel='pallas' is ignored" (once per process)
        warnings.simplefilter("ignore", RuntimeWarning)
        result, messages = quiet(cfg)
    assert result.steps_done == 1
    assert any(m.startswith("sinkgd kernel:   jnp (pallas: ") and "SAGE_KERNELS=off" in m
               for m in messages)
    assert json.loads((tmp_path / "pallas" / "config.json").read_text())["sinkgd_kernel"] == "jnp"
    assert [r["sinkgd_kernel"] for r in rundir.iter_metrics(tmp_path / "pallas")] == ["jnp"]
    monkeypatch.setenv("SAGE_KERNELS", "sometimes")
    with pytest.raises(ConfigError, match="SAGE_KERNELS must be one of"):
        quiet(config(train_corpus, tmp_path / "bad"))


def test_attention_is_checked_on_resume(train_corpus, tmp_path, monkeypatch):
    """attention is a MATH_FIELD: a run recorded with cuDNN's attention is not continued with
    XLA's unless allowed."""
    from sage_train.run import steps as train_mod

    assert {"attention", "sinkgd_kernel"} <= set(rundir.MATH_FIELDS)
    seen: list[str] = []
    real = model_mod.causal_attention

    def spy(q, k, v, attention="auto", scale=None):
        seen.append(attention)
        return real(q, k, v, attention, scale)

    monkeypatch.setattr(model_mod, "causal_attention", spy)
    monkeypatch.setattr(train_mod, "_STEP_CACHE", {})
    run = tmp_path / "run"
    quiet(config(train_corpus, run), stop_after=1)
    assert set(seen) == {"auto"}
    settings = json.loads((run / "config.json").read_text())
    assert settings["attention"] == "xla"
    (run / "config.json").write_text(json.dumps(settings | {"attention": "cudnn"}))
    with pytest.raises(RunDirError, match="attention 'cudnn' -> 'xla'"):
        quiet(config(train_corpus, run))


# ---------------------------------------------------------------------------
# 4. the benchmarks
# ---------------------------------------------------------------------------


def _table(text):
    """The rows of the markdown table of ``text`` as lists of cells (header dropped)."""
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ")]
    return rows[1:]


def test_attention_benchmark_on_the_cpu(capsys):
    bench = _load("attention")
    with jax.default_device(jax.devices("cpu")[0]):  # on a GPU host too
        assert bench.main(["--batch-size", "2", "--seq-len", "32", "--heads", "4",
                           "--kv-heads", "2", "--head-dim", "16", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "batch 2 x 32, 4 query / 2 kv heads, head dim 16, bfloat16" in out
    assert "cudnn: skipped: cuDNN attention needs a CUDA GPU, and the computation runs on cpu" \
        in out.splitlines()
    (row,) = _table(out)
    assert row[0] == "xla"
    errors = [float(x) for x in row[1:5]]
    assert all(0 < e < 0.1 for e in errors), errors  # bfloat16 rounding, not another function
    assert float(row[5]) > 0 and float(row[6].replace(",", "")) > 0


@pytest.mark.skipif(placement.cuda_device_count() == 0 or not cudnn_present(),
                    reason="needs a CUDA GPU with cuDNN (scripts/gpu-check runs it there)")
def test_cudnn_attention_is_as_accurate_as_xlas_on_the_gpu():
    """The evidence behind cuDNN's validation (sage_optim.kernels.VALIDATED_ON): at the 270M
    model's heads, cuDNN's output and gradients are within twice the error of XLA's own
    bfloat16 attention, both against a float32 XLA reference at the highest precision
    (measured on an H100: 0.74x, 0.80x, 1.37x, 1.72x for out, dq, dk, dv)."""
    bench = _load("attention")
    cfg = MODELS["270m"]
    q, k, v, g = bench.inputs(2, 1024, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                              jnp.bfloat16)
    with jax.default_matmul_precision("highest"):
        ref = bench.forward_backward("xla")(*[x.astype(jnp.float32) for x in (q, k, v, g)])
    errors = {}
    for name in ("xla", "cudnn"):
        out, grads = bench.forward_backward(name)(q, k, v, g)
        errors[name] = [bench.max_diff(a, b) for a, b in
                        zip((out, *grads), (ref[0], *ref[1]), strict=True)]
    for what, x, c in zip(("out", "dq", "dk", "dv"), errors["xla"], errors["cudnn"],
                          strict=True):
        assert 0 < x and c <= 2 * x, f"{what}: cudnn {c:.3g} against xla {x:.3g}"


def test_train_memory_plan_with_both_implementations(capsys):
    plan = _load("train_memory_plan")
    cpu = jax.default_device(jax.devices("cpu")[0])  # the CPU plan, on a GPU host too
    with cpu:
        plan.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "128", "--layers",
                   "loop", "--remat", "none", "--loss-chunk", "0", "--attention", "xla",
                   "cudnn", "--unit", "MiB"])
    out = capsys.readouterr().out
    assert ("--attention auto on a CUDA GPU (with cuDNN) takes xla (auto: cuDNN attention is "
            "not yet validated on this GPU by scripts/gpu-check (opt in with "
            "attention='cudnn')); --attention cudnn runs cuDNN flash attention there") in out
    assert "cudnn: a memory stand-in of cuDNN's flash attention (cuDNN attention needs a " \
           "CUDA GPU" in out
    rows = {r[0]: r for r in _table(out)}
    assert set(rows) == {"xla", "cudnn (stand-in)"}
    temporaries = {k: float(r[6]) for k, r in rows.items()}
    # the stand-in keeps no T x T scores: less temporary memory than XLA's attention
    assert 0 < temporaries["cudnn (stand-in)"] < temporaries["xla"], temporaries
    with cpu:
        plan.main(["--model", "tiny", "--batch-size", "2", "--seq-len", "32", "--layers",
                   "loop", "--remat", "none", "--loss-chunk", "0", "--attention", "cudnn",
                   "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "takes xla (auto: cuDNN flash attention needs bfloat16 or float16" in out
    assert "--attention cudnn cannot (cuDNN flash attention needs bfloat16" in out
    assert "cudnn skipped: cuDNN flash attention needs bfloat16 or float16" in out
    assert _table(out) == []


def test_implementations_follow_the_mesh_not_the_default_backend(train_corpus, tmp_path,
                                                                  monkeypatch, cpu_mesh):
    """The platform is the mesh's devices': a GPU default backend with a CPU mesh is "cpu"
    (auto: XLA's attention, jnp), and the device count is the mesh's."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    for sharding, n in (("none", 1), ("dp", len(jax.devices("cpu")))):
        impl = implementations(dataclasses.replace(config(train_corpus, tmp_path),
                                                   sharding=sharding, dtype="bfloat16"))
        assert (impl.platform, impl.devices) == ("cpu", n)
        assert (impl.attention, impl.sinkgd_kernel) == ("xla", "jnp")
