"""Shared test data: hard gradient sequences and a small mixed model in Flax layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax
import numpy as np

V, D, F = 40, 12, 20  # vocab, model width, MLP width of the mixed test model


def hard_gradient(rng: np.random.Generator, shape: tuple[int, ...], step: int) -> np.ndarray:
    """A gradient with exact zeros and column scales spanning 6 orders of magnitude."""
    g = rng.standard_normal(shape)
    if len(shape) >= 1:
        scales = np.logspace(-3, 3, shape[-1])
        g = g * scales
    g[rng.random(shape) < 0.1] = 0.0  # exact-zero entries
    if step % 7 == 3:
        g = g * 1e3  # a sudden spike the instantaneous damper must catch
    return g


def sparse_embedding_gradient(
    rng: np.random.Generator, shape: tuple[int, ...], vocab_axis: int = -2
) -> np.ndarray:
    """An embedding gradient: a few active (Zipf-like) token rows, all others exactly zero."""
    g = hard_gradient(rng, shape, step=0)
    vocab = shape[vocab_axis]
    active = np.unique(np.minimum(rng.zipf(1.5, size=max(2, vocab // 6)) - 1, vocab - 1))
    keep = np.zeros(vocab, dtype=bool)
    keep[active] = True
    index = [None] * len(shape)
    index[vocab_axis] = slice(None)
    return g * keep[tuple(index)]


def mixed_params(rng: np.random.Generator, untied: bool = True) -> dict:
    """Flax-layout parameters: embedding (V, d), dense kernels, norms, a bias, maybe a head."""
    p = {
        "embed": {"embedding": rng.standard_normal((V, D)) * 0.5},
        "layers": {
            "0": {
                "mlp": {
                    "up": {"kernel": rng.standard_normal((D, F)) * 0.3},
                    "down": {"kernel": rng.standard_normal((F, D)) * 0.3},
                    "bias": rng.standard_normal((D,)) * 0.1,
                },
                "norm": {"scale": np.ones(D) + 0.1 * rng.standard_normal(D)},
            }
        },
        "final_norm": {"scale": np.ones(D)},
    }
    if untied:
        p["lm_head"] = {"kernel": rng.standard_normal((D, V)) * 0.3}
    return p


def mixed_gradient(rng: np.random.Generator, params: dict, step: int) -> dict:
    """A gradient for :func:`mixed_params`: sparse vocab matrices, hard dense ones."""
    g = {
        "embed": {"embedding": sparse_embedding_gradient(rng, (V, D), vocab_axis=0)},
        "layers": {
            "0": {
                "mlp": {
                    "up": {"kernel": hard_gradient(rng, (D, F), step)},
                    "down": {"kernel": hard_gradient(rng, (F, D), step)},
                    "bias": hard_gradient(rng, (D,), step),
                },
                "norm": {"scale": hard_gradient(rng, (D,), step)},
            }
        },
        "final_norm": {"scale": rng.standard_normal(D)},
    }
    if "lm_head" in params:
        g["lm_head"] = {"kernel": sparse_embedding_gradient(rng, (D, V), vocab_axis=1)}
    return g


@contextlib.contextmanager
def cuda_lowering_target(device_kind: str = "NVIDIA H100") -> Iterator[None]:
    """Lower Pallas's Triton calls for a ``device_kind`` GPU on a host that has none.

    JAX 0.11 asks the GPU being lowered for its compute capability (an abstract device where
    there is none: ``jax.sharding.use_abstract_mesh``); JAX 0.10 took 9.0 (an H100's) when it
    found no GPU, and ignores the abstract device.  On a host with a GPU, that GPU is the
    target and this does nothing.
    """
    if any(d.platform == "gpu" for d in jax.devices()):
        yield
        return
    device = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=None, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), (), abstract_device=device)):
        yield
