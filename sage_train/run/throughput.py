"""Model FLOPs per token, the peak rates of known accelerators, and model FLOPs utilisation.

MFU is the model's own arithmetic (forward and backward of every matmul, attention included,
no rematerialisation counted) per second, divided by the device's peak dense rate for the
computation dtype.  The peak comes from :data:`PEAK_TFLOPS` by the device's name, or from
``--peak-tflops``; where neither applies (the CPU, an unknown device) no MFU is reported.
"""

from __future__ import annotations

from sage_train.model.shapes import LlamaConfig

PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # dense tensor-core TFLOP/s per GPU from the vendor's data sheets (no sparsity);
    # "float32" is the TF32 tensor-core rate XLA uses for float32 matmuls by default.
    "H200": {"bfloat16": 989.4, "float32": 494.7},
    "H100 PCIe": {"bfloat16": 756.0, "float32": 378.0},
    "H100": {"bfloat16": 989.4, "float32": 494.7},  # SXM5 (jax names it "NVIDIA H100 80GB HBM3")
    "A100": {"bfloat16": 312.0, "float32": 156.0},
    "L4": {"bfloat16": 121.0, "float32": 60.0},
}
"""Known devices, matched in this order as substrings of ``jax.Device.device_kind``."""


def device_peak_tflops(device_kind: str, dtype: str) -> tuple[float, str] | None:
    """``(peak TFLOP/s, table entry)`` of a device for ``dtype``; ``None`` when unknown."""
    for name, peaks in PEAK_TFLOPS.items():
        if name.lower() in device_kind.lower() and dtype in peaks:
            return peaks[dtype], name
    return None


def flops_per_token(config: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs of one token: ``6 N + 6 L T h`` (PaLM's accounting, causal).

    ``N`` counts the weights of every matmul (all projections and the output head, the
    embedding lookup excluded: with tied embeddings the table is counted once, as the head);
    ``6 L T h`` is attention's score and value matmuls (``h = num_heads * head_dim``),
    forward and backward, halved for the causal mask.
    """
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_dim
    attn = d * hd * (2 * config.num_heads + 2 * config.num_kv_heads)
    mlp = 3 * d * f
    head = d * config.vocab_size
    n = config.num_layers * (attn + mlp) + head
    return 6.0 * n + 6.0 * config.num_layers * seq_len * config.num_heads * hd


def mfu(tokens_per_s: float, flops_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation in [0, 1] (``None`` without a peak)."""
    if not peak_tflops or peak_tflops <= 0:
        return None
    return tokens_per_s * flops_token / (peak_tflops * 1e12)


__all__ = ["PEAK_TFLOPS", "device_peak_tflops", "flops_per_token", "mfu"]
