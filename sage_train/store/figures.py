"""Figures of training runs: perplexity curves, and the paper's figures of SAGE's damper ``H_t``.

Reads what :func:`sage_train.run.train.train` writes into a run directory (``metrics.jsonl``,
``config.json``, ``damper_h.npz``) and draws PNGs with matplotlib's object-oriented API on
the Agg canvas: no pyplot, so importing or calling these functions never switches the
backend of an interactive session (a notebook keeps its inline backend). matplotlib is
imported lazily, only when a figure is drawn.

- :func:`plot_perplexity_curves`: test perplexity per configuration, mean over seeds with a
  min-max band (the paper's convergence figure).
- :func:`plot_damper_heatmap`: ``H_t`` of the embedding as a heatmap, embedding dimension x
  step, over the first steps and over the whole run (the paper's ``fig:ht_heatmap``).
- :func:`plot_damper_pca`: top-3 principal component scores of ``H_t`` per step and the
  PC1-PC2 path (the paper's ``fig:ht_pca_analysis``); :func:`damper_pca` computes them.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PathLike = str | os.PathLike[str]
Curve = Sequence[tuple[float, float]]
"""One run's curve: ``(step or tokens, test perplexity)`` points."""


def read_metrics(run_dir: PathLike) -> list[dict[str, Any]]:
    """The records of ``run_dir/metrics.jsonl``, in file order (one dict per line).

    Raises:
      FileNotFoundError: the run directory has no ``metrics.jsonl``.
      ValueError: a line is not a JSON object (the message names the file and line).
    """
    path = pathlib.Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics file {path}: is {run_dir} a training run directory?")
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
        if not isinstance(record, dict):
            raise ValueError(
                f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
        records.append(record)
    return records


def perplexity_curve(run_dir: PathLike, *, x: str = "step") -> list[tuple[float, float]]:
    """The ``(x, test perplexity)`` points of a run, for :func:`plot_perplexity_curves`.

    Args:
      run_dir: a run directory written by :func:`sage_train.run.train.train`.
      x: ``"step"``, or ``"tokens"`` (step x batch size x sequence length, from the run's
        ``config.json``).
    """
    if x not in ("step", "tokens"):
        raise ValueError(f"x must be 'step' or 'tokens', got {x!r}")
    scale = 1
    if x == "tokens":
        config_path = pathlib.Path(run_dir) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config file {config_path}: needed for x='tokens'")
        config = json.loads(config_path.read_text())
        scale = int(config["batch_size"]) * int(config["seq_len"])
    return [(float(r["step"] * scale), float(r["test_ppl"]))
            for r in read_metrics(run_dir) if "test_ppl" in r]


def load_damper(run_dir: PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, h)`` recorded in ``run_dir/damper_h.npz``: shapes ``(n,)`` and ``(n, d)``.

    Only runs whose embedding is trained by SAGE (``sage-hybrid``, ``sage-pure``) record
    ``H_t``.

    Raises:
      FileNotFoundError: the run directory has no ``damper_h.npz``.
    """
    path = pathlib.Path(run_dir) / "damper_h.npz"
    if not path.is_file():
        raise FileNotFoundError(
            f"no damper record {path}: only runs whose embedding is trained by SAGE "
            "(sage-hybrid, sage-pure) record H_t")
    with np.load(path) as saved:
        steps, h = np.asarray(saved["steps"]), np.asarray(saved["h"])
    _check_damper(steps, h)
    return steps, h


def damper_pca(h: np.ndarray, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """Principal components of the rows of ``h`` (one ``H_t`` per recorded step).

    The rows are centred on their mean over time and decomposed with a thin SVD. Each
    component's sign is fixed so that its largest-magnitude loading is positive, which
    makes the result deterministic.

    Args:
      h: ``(n, d)`` array, ``n >= 2`` records of a ``d``-dimensional damper.
      k: number of components wanted (``>= 1``); at most ``min(n, d)`` are returned.

    Returns:
      ``(scores, explained_variance_ratio)``: the ``(n, k')`` projections of the centred
      rows on the top ``k' = min(k, n, d)`` components, and each component's share of the
      total variance, shape ``(k',)`` (all zeros when ``h`` does not vary).
    """
    h = np.asarray(h)
    if h.ndim != 2:
        raise ValueError(f"h must be 2-D (records x dimensions), got shape {h.shape}")
    if h.shape[0] < 2:
        raise ValueError(f"h needs at least 2 records (rows) for a PCA, got shape {h.shape}")
    if not np.all(np.isfinite(h)):
        raise ValueError("h must be finite")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    x = h.astype(np.float64)
    x = x - x.mean(axis=0)
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    k = min(k, s.size)
    signs = np.sign(vt[np.arange(k), np.argmax(np.abs(vt[:k]), axis=1)])
    signs[signs == 0] = 1.0
    scores = u[:, :k] * s[:k] * signs
    total = float(np.sum(s**2))
    ratio = s[:k] ** 2 / total if total > 0 else np.zeros(k)
    return scores, ratio


def plot_perplexity_curves(curves: Mapping[str, Sequence[Curve]], path: PathLike, *,
                           title: str | None = None, xlabel: str = "step") -> pathlib.Path:
    """Test perplexity per configuration: mean over seeds, shaded min-max band, log y.

    Args:
      curves: configuration name -> its runs (one per seed), each a sequence of
        ``(step or tokens, test perplexity)`` points (see :func:`perplexity_curve`). The
        mean and band are taken at the x values every run of the configuration has.
      path: where to write the PNG.
      title: the figure's title.
      xlabel: the x axis's label (``"tokens"`` when the points are in tokens).

    Returns:
      ``path`` as a :class:`pathlib.Path`.
    """
    if not isinstance(curves, Mapping) or not curves:
        raise ValueError("curves must be a non-empty mapping of configuration -> runs")
    series = {name: _mean_band(name, runs) for name, runs in curves.items()}
    fig, _ = _figure((9.0, 4.5))
    ax = fig.add_subplot()
    for name, (x, mean, lo, hi, n) in series.items():
        (line,) = ax.plot(x, mean, marker="o", markersize=3,
                          label=f"{name} ({n} seed{'s' if n > 1 else ''})")
        if n > 1:
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, linewidth=0)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test perplexity")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    ax.set_title(title or "test perplexity: mean over seeds, min-max band", fontsize="medium")
    return _save(fig, path)


def plot_damper_heatmap(steps: np.ndarray, h: np.ndarray, path: PathLike, *,
                        early: int | None = None) -> pathlib.Path:
    """The paper's heatmap of ``H_t``: embedding dimension x step, first steps and all steps.

    As in the paper, ``H_t = 1`` (no damping, Lion's step) is white and damped dimensions
    (``H_t << 1``) are coloured, on a log colour scale shared by both panels.

    Args:
      steps: ``(n,)`` steps of the records.
      h: ``(n, d)`` array, ``H_t`` per record.
      path: where to write the PNG.
      early: the left panel shows the records up to this step (default: the first quarter
        of the recorded steps, at least one record); the right panel shows the whole run.

    Returns:
      ``path`` as a :class:`pathlib.Path`.
    """
    steps, h = _check_damper(steps, h)
    if np.any(h <= 0):
        raise ValueError("h must be positive (H_t is in (0, 1]) for the log colour scale")
    if early is None:
        early = int(steps[max(0, len(steps) // 4 - 1)])
    first = steps <= early
    if not np.any(first):
        raise ValueError(f"early={early} is before the first recorded step {int(steps[0])}")
    from matplotlib.colors import LogNorm

    vmin = min(float(h.min()), 0.5)
    norm = LogNorm(vmin=vmin, vmax=max(float(h.max()), 1.0))
    fig, _ = _figure((12.0, 4.5))
    axes = fig.subplots(1, 2)
    panels = ((axes[0], first, f"over the first {early} steps"),
              (axes[1], np.ones_like(first), f"over the whole run ({int(steps[-1])} steps)"))
    mesh = None
    for ax, keep, label in panels:
        dims = np.arange(h.shape[1])
        mesh = ax.pcolormesh(steps[keep], dims, h[keep].T, norm=norm, cmap="Blues_r",
                             shading="nearest", rasterized=True)
        ax.set_xlabel("step")
        ax.set_ylabel("embedding dimension")
        ax.set_title(f"H_t {label}")
    fig.colorbar(mesh, ax=list(axes), label="H_t (log scale; 1 = undamped)")
    fig.suptitle(f"SAGE damper H_t of the embedding (d = {h.shape[1]})")
    return _save(fig, path)


def plot_damper_pca(steps: np.ndarray, h: np.ndarray, path: PathLike) -> pathlib.Path:
    """The paper's PCA of ``H_t``: top-3 component scores per step, and the PC1-PC2 path.

    Args:
      steps: ``(n,)`` steps of the records (``n >= 2``).
      h: ``(n, d)`` array, ``H_t`` per record.
      path: where to write the PNG.

    Returns:
      ``path`` as a :class:`pathlib.Path`.
    """
    steps, h = _check_damper(steps, h)
    scores, ratio = damper_pca(h, k=3)
    if scores.shape[1] < 2:  # one component: the path runs along PC1
        scores = np.concatenate([scores, np.zeros_like(scores)], axis=1)
        ratio = np.concatenate([ratio, [0.0]])
    fig, _ = _figure((12.0, 4.5))
    left, right = fig.subplots(1, 2)
    for i in range(scores.shape[1]):
        left.plot(steps, scores[:, i], label=f"PC{i + 1} ({100 * ratio[i]:.1f}% of variance)")
    left.axhline(0.0, color="0.6", linewidth=0.8)
    left.set_xlabel("step")
    left.set_ylabel("component score")
    left.set_title("(a) top principal components of H_t")
    left.legend()
    right.plot(scores[:, 0], scores[:, 1], color="0.7", linewidth=1.0, zorder=1)
    points = right.scatter(scores[:, 0], scores[:, 1], c=steps, cmap="viridis", s=14, zorder=2)
    right.annotate("start", (scores[0, 0], scores[0, 1]))
    right.annotate("end", (scores[-1, 0], scores[-1, 1]))
    right.set_xlabel(f"PC1 ({100 * ratio[0]:.1f}%)")
    right.set_ylabel(f"PC2 ({100 * ratio[1]:.1f}%)")
    right.set_title("(b) path in the PC1-PC2 plane")
    fig.colorbar(points, ax=right, label="step")
    fig.suptitle(f"PCA of H_t ({len(steps)} records, d = {h.shape[1]}): "
                 f"top-3 explain {100 * float(np.sum(ratio[:3])):.1f}% of the variance")
    return _save(fig, path)


def _check_damper(steps: np.ndarray, h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    steps, h = np.asarray(steps), np.asarray(h)
    if steps.ndim != 1:
        raise ValueError(f"steps must be 1-D, got shape {steps.shape}")
    if h.ndim != 2:
        raise ValueError(f"h must be 2-D (records x dimensions), got shape {h.shape}")
    if h.shape[0] != steps.shape[0]:
        raise ValueError(f"steps has {steps.shape[0]} entries but h has {h.shape[0]} rows; "
                         "they must match (one step per record)")
    if h.shape[0] == 0 or h.shape[1] == 0:
        raise ValueError(f"h is empty (shape {h.shape})")
    if not np.all(np.isfinite(h)):
        raise ValueError("h must be finite")
    return steps, h


def _mean_band(name: str, runs: Sequence[Curve]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                           np.ndarray, int]:
    if isinstance(runs, str | bytes) or not isinstance(runs, Sequence) or not runs:
        raise ValueError(f"curves[{name!r}] must be a non-empty list of runs")
    tables = []
    for i, run in enumerate(runs):
        points = np.asarray(run, dtype=np.float64)
        if points.ndim != 2 or points.shape[1] != 2 or points.shape[0] == 0:
            raise ValueError(f"curves[{name!r}][{i}] must be a non-empty sequence of "
                             f"(x, perplexity) pairs, got shape {points.shape}")
        if not np.all(np.isfinite(points)) or np.any(points[:, 1] <= 0):
            raise ValueError(f"curves[{name!r}][{i}]: perplexities must be finite and > 0 "
                             "(log scale)")
        tables.append(dict(zip(points[:, 0].tolist(), points[:, 1].tolist(), strict=True)))
    common = sorted(set.intersection(*(set(t) for t in tables)))
    if not common:
        raise ValueError(f"curves[{name!r}]: the runs share no x value to average at")
    y = np.array([[t[x] for x in common] for t in tables])
    return np.array(common), y.mean(axis=0), y.min(axis=0), y.max(axis=0), len(runs)


def _figure(size: tuple[float, float]) -> tuple[Any, Any]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, FigureCanvasAgg(fig)


def _save(fig: Any, path: PathLike) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


__all__ = ["damper_pca", "load_damper", "perplexity_curve", "plot_damper_heatmap",
           "plot_damper_pca", "plot_perplexity_curves", "read_metrics"]
