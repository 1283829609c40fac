"""sage_train.store.figures: the PCA of H_t against an independent computation, and the figures."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from sage_train.store import figures  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _damper(n=40, d=24, seed=0):
    rng = np.random.default_rng(seed)
    steps = np.arange(1, n + 1) * 5
    h = np.minimum(rng.lognormal(-0.3, 0.8, size=(n, d)), 1.0)
    return steps, h


def _assert_png(path, min_bytes=5000):
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > min_bytes


# ---- damper_pca ------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(40, 24), (7, 30), (50, 3)])
def test_pca_matches_covariance_eigendecomposition(shape):
    _, h = _damper(*shape, seed=sum(shape))
    k = 3
    scores, ratio = figures.damper_pca(h, k=k)
    assert scores.shape == (shape[0], k) and ratio.shape == (k,)
    # independent: eigenvectors of the covariance matrix, largest eigenvalues first
    x = h - h.mean(axis=0)
    cov = x.T @ x / (len(h) - 1)
    evals, evecs = np.linalg.eigh(cov)
    order = np.argsort(evals)[::-1]
    evals, evecs = evals[order], evecs[:, order]
    np.testing.assert_allclose(ratio, evals[:k] / evals.sum(), rtol=1e-9, atol=1e-12)
    expected = x @ evecs[:, :k]
    for i in range(k):  # equal up to the sign of each component
        sign = np.sign(expected[:, i] @ scores[:, i])
        assert sign != 0
        np.testing.assert_allclose(scores[:, i], sign * expected[:, i], atol=1e-9)
    # the scores are uncorrelated, with variance the eigenvalues
    np.testing.assert_allclose(scores.T @ scores / (len(h) - 1), np.diag(evals[:k]),
                               atol=1e-9)


def test_pca_of_rank_one_structure():
    rng = np.random.default_rng(3)
    t = np.linspace(0, 1, 60)
    direction = rng.standard_normal(32)
    amplitude = np.exp(-5 * t) * np.sin(9 * t)
    h = 0.7 + np.outer(amplitude, direction)
    scores, ratio = figures.damper_pca(h)
    assert ratio[0] == pytest.approx(1.0, abs=1e-10)
    np.testing.assert_allclose(ratio[1:], 0.0, atol=1e-10)
    centred = amplitude - amplitude.mean()
    # PC1 is the amplitude scaled by |direction|, up to sign
    expected = centred * np.linalg.norm(direction)
    assert np.abs(scores[:, 0]) == pytest.approx(np.abs(expected), abs=1e-9)
    # with a little noise, PC1 still dominates
    noisy = h + 1e-3 * rng.standard_normal(h.shape)
    assert figures.damper_pca(noisy)[1][0] > 0.99


def test_pca_sign_is_deterministic_and_k_is_capped():
    _, h = _damper(10, 6)
    a, _ = figures.damper_pca(h)
    np.testing.assert_array_equal(a, figures.damper_pca(h.copy())[0])
    np.testing.assert_allclose(a, figures.damper_pca(h + 3.0)[0], atol=1e-9)  # centred
    scores, ratio = figures.damper_pca(h[:2], k=3)  # two records: at most 2 components
    assert scores.shape == (2, 2) and ratio[0] == pytest.approx(1.0)
    constant = np.ones((5, 4))
    scores, ratio = figures.damper_pca(constant)
    np.testing.assert_array_equal(ratio, 0.0)
    np.testing.assert_array_equal(scores, 0.0)


@pytest.mark.parametrize("h, k, match", [
    (np.ones(5), 3, "h must be 2-D"),
    (np.ones((1, 5)), 3, "at least 2 records"),
    (np.ones((4, 5)), 0, "k must be"),
    (np.full((4, 5), np.nan), 3, "finite"),
])
def test_pca_rejects_bad_input(h, k, match):
    with pytest.raises(ValueError, match=match):
        figures.damper_pca(h, k=k)


# ---- the figures ------------------------------------------------------------------------


def test_damper_figures_write_png(tmp_path):
    steps, h = _damper()
    out = figures.plot_damper_heatmap(steps, h, tmp_path / "heat.png", early=50)
    assert out == tmp_path / "heat.png"
    _assert_png(out)
    _assert_png(figures.plot_damper_heatmap(steps, h, tmp_path / "sub" / "heat2.png"))
    _assert_png(figures.plot_damper_pca(steps, h, tmp_path / "pca.png"))
    # two records: one component only, still a figure
    _assert_png(figures.plot_damper_pca(steps[:2], h[:2], tmp_path / "pca2.png"))


@pytest.mark.parametrize("plot", ["plot_damper_heatmap", "plot_damper_pca"])
def test_damper_figures_reject_bad_input(plot, tmp_path):
    steps, h = _damper()
    fn = getattr(figures, plot)
    with pytest.raises(ValueError, match="h must be 2-D"):
        fn(steps, h[0], tmp_path / "x.png")
    with pytest.raises(ValueError, match="h must be 2-D"):
        fn(steps, h[None], tmp_path / "x.png")
    with pytest.raises(ValueError, match="steps has 39 entries but h has 40 rows"):
        fn(steps[:-1], h, tmp_path / "x.png")
    with pytest.raises(ValueError, match="steps must be 1-D"):
        fn(steps[:, None], h, tmp_path / "x.png")
    with pytest.raises(ValueError, match="h must be finite"):
        fn(steps, np.where(h > 0.5, np.inf, h), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_heatmap_rejects_early_before_first_record_and_nonpositive_h(tmp_path):
    steps, h = _damper()
    with pytest.raises(ValueError, match="early=1"):
        figures.plot_damper_heatmap(steps, h, tmp_path / "x.png", early=1)
    with pytest.raises(ValueError, match="h must be positive"):
        figures.plot_damper_heatmap(steps, h - 1.0, tmp_path / "x.png")


def test_perplexity_curves(tmp_path):
    curves = {
        "sage-hybrid": [[(10, 300.0), (20, 120.0), (30, 80.0)],
                        [(10, 320.0), (20, 110.0), (30, 85.0)]],
        "adamw": [[(10, 500.0), (20, 300.0), (30, 200.0)]],
    }
    out = figures.plot_perplexity_curves(curves, tmp_path / "ppl.png", title="t")
    _assert_png(out)
    # runs of one configuration that stop at different steps: averaged where all have points
    x, mean, lo, hi, n = figures._mean_band("a", [[(1, 4.0), (2, 2.0)], [(1, 2.0)]])
    assert x.tolist() == [1.0] and mean.tolist() == [3.0] and (lo, hi, n) == ([2.0], [4.0], 2)


@pytest.mark.parametrize("curves, match", [
    ({}, "non-empty mapping"),
    ({"a": []}, r"curves\['a'\] must be a non-empty list"),
    ({"a": [[(1, 2, 3)]]}, r"curves\['a'\]\[0\] must be"),
    ({"a": [[(1, 0.0)]]}, r"perplexities must be finite and > 0"),
    ({"a": [[(1, 5.0)], [(2, 5.0)]]}, "share no x value"),
])
def test_perplexity_curves_reject_bad_input(curves, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        figures.plot_perplexity_curves(curves, tmp_path / "x.png")


# ---- reading run directories ---------------------------------------------------------------


def test_read_run_directory(tmp_path):
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "test_ppl": 60.0},
               {"step": 4, "loss": 3.0, "test_ppl": 30.0}]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    (tmp_path / "config.json").write_text(json.dumps({"batch_size": 8, "seq_len": 32}))
    assert figures.read_metrics(tmp_path) == records
    assert figures.perplexity_curve(tmp_path) == [(2.0, 60.0), (4.0, 30.0)]
    assert figures.perplexity_curve(tmp_path, x="tokens") == [(512.0, 60.0), (1024.0, 30.0)]
    steps, h = _damper(5, 3)
    np.savez(tmp_path / "damper_h.npz", steps=steps, h=h, every=5)
    got_steps, got_h = figures.load_damper(tmp_path)
    np.testing.assert_array_equal(got_steps, steps)
    np.testing.assert_array_equal(got_h, h)


def test_read_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        figures.read_metrics(tmp_path)
    with pytest.raises(FileNotFoundError, match="damper_h.npz"):
        figures.load_damper(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{oops\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not valid JSON"):
        figures.read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(FileNotFoundError, match="config.json"):
        figures.perplexity_curve(tmp_path, x="tokens")
    with pytest.raises(ValueError, match="x must be"):
        figures.perplexity_curve(tmp_path, x="time")
