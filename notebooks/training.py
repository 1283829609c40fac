# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Training comparison: SAGE-Hybrid against its baselines
#
# Train a small LLaMA on the embedded standard-library corpus with several of the paper's
# configurations and a few seeds each, with `sage_train.run.train.train`; compare final test
# perplexity, optimizer-state memory and throughput; then draw the paper's figures with
# `sage_train.store.figures`: perplexity curves, the heatmap of SAGE's damper `H_t` of the
# embedding (first steps and the whole run) and its PCA.
#
# With `SAGE_NOTEBOOK_FAST=1` (the test suite) every run is a few steps of the `tiny` model
# and everything goes into a temporary directory. Otherwise the runs go into
# `runs/notebooks/training/` under the working directory (the `tiny` model, 400 steps of
# 16x128 tokens: under a minute a run, about seven minutes in all on a 2-core CPU); a finished
# run found there is reused (delete the directory to train again).

# %%
import atexit
import os
import pathlib
import shutil
import tempfile

import numpy as np

from sage_optim.table import format_table
from sage_train.run.train import TrainConfig, train
from sage_train.store import figures

FAST = os.environ.get("SAGE_NOTEBOOK_FAST") == "1"
CONFIGS = ("sage-hybrid", "lion-hybrid") if FAST else (
    "sage-hybrid", "lion-hybrid", "sinkgd-hybrid", "adamw")
SEEDS = (0, 1) if FAST else (0, 1, 2)
BASE = TrainConfig(
    model="tiny",
    batch_size=8 if FAST else 16,
    seq_len=32 if FAST else 128,
    steps=6 if FAST else 400,
    eval_every=3 if FAST else 40,
    eval_batches=2 if FAST else 8,
    log_every=1 if FAST else 10,
    checkpoint_every=10_000,  # a checkpoint at the end only
    record_h_every=1 if FAST else 5,
    sharding="none" if FAST else "dp",
    progress=not FAST,
)
OUT = pathlib.Path(tempfile.mkdtemp(prefix="sage-training-") if FAST
                   else "runs/notebooks/training")
OUT.mkdir(parents=True, exist_ok=True)
if FAST:  # the temporary directory goes when the kernel (or the test process) exits
    atexit.register(shutil.rmtree, OUT, ignore_errors=True)
print(f"{len(CONFIGS)} configurations x {len(SEEDS)} seeds, {BASE.steps} steps of "
      f"{BASE.batch_size}x{BASE.seq_len} tokens, model {BASE.model!r}; output in {OUT}")

# %% [markdown]
# ## Train
#
# Each configuration uses its paper learning rate (`sage_optim.presets`) under the trainer's
# warmup + cosine schedule, with global-norm clipping at 1.

# %%
import dataclasses  # noqa: E402

run_dirs: dict[str, list[pathlib.Path]] = {}
for name in CONFIGS:
    for seed in SEEDS:
        run_dir = OUT / f"{name}-seed{seed}"
        cfg = dataclasses.replace(BASE, optimizer=name, seed=seed, run_dir=str(run_dir))
        result = train(cfg, log=lambda msg: None)
        if result.stopped_reason:
            print(f"{name} seed {seed}: {result.stopped_reason}")
        run_dirs.setdefault(name, []).append(run_dir)
        print(f"{name:14s} seed {seed}: {result.steps_done} steps, "
              f"final test perplexity {result.final_test_ppl}")

# %% [markdown]
# ## Results
#
# From each run's `metrics.jsonl`: the final test perplexity (mean and min-max over
# seeds), the optimizer state (bytes of every state leaf, exact), and the training
# throughput measured after the first (compiling) step. Throughput on a shared CPU is noisy.

# %%
def summary(dirs: list[pathlib.Path]) -> dict[str, float]:
    last = [figures.read_metrics(d)[-1] for d in dirs]
    ppl = np.array([r.get("test_ppl", np.nan) for r in last])
    return {"ppl": float(np.mean(ppl)), "lo": float(np.min(ppl)), "hi": float(np.max(ppl)),
            "state": float(last[0]["opt_state_bytes"]),
            "tps": float(np.mean([r["tokens_per_s"] for r in last]))}


stats = {name: summary(dirs) for name, dirs in run_dirs.items()}
reference = stats.get("adamw", stats[CONFIGS[0]])
rows = [(name, len(run_dirs[name]), f"{s['ppl']:.2f}", f"{s['lo']:.2f}-{s['hi']:.2f}",
         f"{s['state'] / 2**20:.3f}", f"{s['state'] / reference['state']:.2f}",
         f"{s['tps']:,.0f}")
        for name, s in sorted(stats.items(), key=lambda item: item[1]["ppl"])]
ref_name = "adamw" if "adamw" in stats else CONFIGS[0]
print(format_table(("configuration", "seeds", "test ppl", "min-max", "opt. state MiB",
                    f"state / {ref_name}", "tokens/s"), rows))

# %% [markdown]
# ## Perplexity curves
#
# Test perplexity against training tokens, the mean over seeds with the min-max band.

# %%
def show(path: pathlib.Path) -> None:
    """Display a PNG inline in Jupyter; print its path elsewhere."""
    try:
        from IPython.display import Image, display
    except ImportError:
        print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    else:
        display(Image(filename=str(path)))


curves = {name: [figures.perplexity_curve(d, x="tokens") for d in dirs]
          for name, dirs in run_dirs.items()}
show(figures.plot_perplexity_curves(
    curves, OUT / "perplexity.png", xlabel="tokens",
    title=f"LLaMA {BASE.model} on the standard-library corpus, {len(SEEDS)} seeds"))

# %% [markdown]
# ## SAGE's damper H_t
#
# The trainer records `H_t` of the embedding, the damper SAGE multiplies its sign step by
# (`damper_h.npz`: `steps` and `h`, one row per recorded step). In the heatmap, white is
# `H_t = 1` (no damping: Lion's step) and the coloured stripes are the embedding dimensions
# SAGE damps. The paper sees dense damping in the first steps and sparse, persistent stripes
# later.

# %%
steps, h = figures.load_damper(run_dirs["sage-hybrid"][0])
print(f"{len(steps)} records of H_t (d = {h.shape[1]}), steps {steps[0]}..{steps[-1]}; "
      f"fraction of entries damped (H_t < 1): {np.mean(h < 1):.2f}, "
      f"median H_t {np.median(h):.3f}, min {h.min():.2e}")
show(figures.plot_damper_heatmap(steps, h, OUT / "damper_heatmap.png",
                                 early=int(steps[max(0, len(steps) // 10 - 1)])))

# %% [markdown]
# ## PCA of H_t
#
# Principal components of the `H_t` rows over time: (a) the top-3 component scores per
# step, (b) the path in the PC1-PC2 plane. The paper describes an early excursion (fast
# calibration) followed by a return towards a fixed operating point.

# %%
scores, ratio = figures.damper_pca(h, k=3)
print("explained variance ratio of the top components:", np.round(ratio, 3))
show(figures.plot_damper_pca(steps, h, OUT / "damper_pca.png"))
