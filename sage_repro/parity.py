"""Check that sage_torch and sage_optax make the same updates (docs/configurations.md).

sage-parity builds the same model in both frameworks with the same initial weights, steps
both optimizers with the same learning-rate schedule and compares them after every step.
In float64 (the default) both sides run their own trajectory and the parameters must agree
to 1e-10 after every step.  In float32 each step starts both sides from the same, synchronized
parameters and optimizer state (those of the float64 run, rounded to float32) and the same
gradient, and the two updates must agree to float32's resolution; with --trajectory, float32
runs both trajectories instead and reports how far they drift apart (not a check).

``--mode gradients`` feeds both optimizers the same synthetic gradient sequence (sparse
embedding rows, exact zeros, column scales over six orders of magnitude, spikes) on a small
mixed model (embedding, untied head, two dense matrices, a bias, two norms); ``--mode model``
trains that model on the same batches in both frameworks; ``--mode llama`` trains
transformers' ``LlamaForCausalLM`` (sage_torch) against the same LLaMA in JAX on the trainer's
Flax parameter tree (sage_optax).  APOLLO is fed the same projection in both frameworks.

Requires both JAX and PyTorch (the ``[jax,torch]`` extras; ``--mode llama`` also the
trainer's ``[train]`` and ``transformers``).  ``sage-parity`` (:func:`sage_repro.commands.parity`)
and ``python -m sage_repro.parity`` say so in one line when one is missing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from sage_optim.extras import require
from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_optim.table import format_table
from sage_train.job.cli_args import DefaultsFormatter, OneLineParser, checked

if __name__ == "__main__":  # python -m sage_repro.parity: the extras first, in one line
    require("sage-parity", "jax", "torch")

import torch  # noqa: E402  (after the check above)
from torch import nn  # noqa: E402

# name in PyTorch -> (name in Flax, kind, transpose between layouts)
PARAM_MAP: dict[str, tuple[str, str, bool]] = {
    "embed.weight": ("embed.embedding", "embedding", False),
    "up.weight": ("up.kernel", "dense", True),
    "down.weight": ("down.kernel", "dense", True),
    "down.bias": ("down.bias", "vector", False),
    "norm.weight": ("norm.scale", "vector", False),
    "final_norm.weight": ("final_norm.scale", "vector", False),
    "lm_head.weight": ("lm_head.kernel", "embedding", True),
}

MODES: tuple[str, ...] = ("gradients", "model", "llama")
"""``--mode`` choices (the module docstring)."""

KIND_COLUMNS: tuple[str, ...] = ("embedding", "dense", "vector")
"""The parameter kinds, one column each in the per-step tables."""

TOLERANCE = {"float64": 1e-10}
"""float64 trajectories: the largest absolute parameter difference allowed after any step."""

EPS32 = float(np.finfo(np.float32).eps)
"""float32's resolution: the spacing of float32 numbers at 1 (``2**-23``)."""

SYNC_ULPS = 64.0
"""Synchronized float32 steps: largest ``|u_torch − u_jax|`` allowed, in units of ``EPS32``
times the parameter's largest update ``max |u|`` (64 units: ``2**-17`` relative).  Both sides
start the step from the same float32 inputs, so they differ only by their own rounding (the
order of the reductions of SAGE, SinkGD and APOLLO, how each writes AdamW's bias
corrections): at most 13 units over the eight configurations, 100 steps, both modes of the
small model and the tiny LLaMA, measured on the CPU."""

SYNC_OFFSET = 0.25
"""Synchronized float32 steps: largest mean signed difference ``|u_torch| − |u_jax|`` allowed
over the sign-rule (SAGE, Lion) elements of a run, in float32 ulps of each element.  Their
magnitudes (``η·H``, ``η``) are invariant to the scale of the statistics, so rounding
differences average out (measured: within 0.07 ulp); a systematic error of one ulp, such as a
one-ulp change of the SAGE damper ``H`` in one framework, moves it to about 0.5-1."""

TIE_ULPS = 8.0
"""A sign flip counts as a tie when the sign's argument ``β1·M + (1−β1)·g`` is within
``TIE_ULPS·EPS32·(|M| + |g|)`` of zero: within the rounding of its float32 computation."""

SIGN_RULES: tuple[str, ...] = ("sage", "lion")
"""The rules whose update is a sign (the ties and the offset above)."""


class MixedModel(nn.Module):
    """A tiny language model with every kind of parameter (the PyTorch side)."""

    def __init__(self, vocab: int = 40, dim: int = 12, hidden: int = 20) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim)
        self.final_norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy."""
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.up(self.norm(h))))
        logits = self.lm_head(self.final_norm(h))
        return nn.functional.cross_entropy(logits, targets)


def jax_loss(params: dict[str, Any], tokens: Any, targets: Any) -> Any:
    """The same model's loss in JAX on a Flax-layout parameter dict."""
    import jax
    import jax.numpy as jnp
    import optax

    def rms(x: Any, scale: Any) -> Any:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale

    h = params["embed"]["embedding"][tokens]
    x = jnp.tanh(rms(h, params["norm"]["scale"]) @ params["up"]["kernel"])
    h = h + x @ params["down"]["kernel"] + params["down"]["bias"]
    logits = rms(h, params["final_norm"]["scale"]) @ params["lm_head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def to_flax(state: dict[str, torch.Tensor]) -> dict[str, Any]:
    """PyTorch state dict (of :class:`MixedModel`) -> nested Flax-layout NumPy dict."""
    out: dict[str, Any] = {}
    for tname, (fname, _, transpose) in PARAM_MAP.items():
        # A copy: on the CPU, jnp.asarray may alias a NumPy buffer, and that buffer is the
        # PyTorch parameter's storage, which the PyTorch optimizer updates in place.
        x = state[tname].detach().cpu().numpy().copy()
        module, leaf = fname.split(".")
        out.setdefault(module, {})[leaf] = np.ascontiguousarray(x.T) if transpose else x
    return out


def from_flax(params: dict[str, Any]) -> dict[str, np.ndarray]:
    """Nested Flax-layout dict -> {PyTorch name: array in PyTorch layout}."""
    out = {}
    for tname, (fname, _, transpose) in PARAM_MAP.items():
        module, leaf = fname.split(".")
        x = np.asarray(params[module][leaf])
        out[tname] = x.T if transpose else x
    return out


def schedule(steps: int, peak: float) -> np.ndarray:
    """Per-step learning rates: 10% linear warmup, then cosine to ``peak/100``, float64."""
    warmup = max(1, steps // 10)
    t = np.arange(steps, dtype=np.float64)
    warm = peak * (t + 1) / warmup
    frac = np.clip((t - warmup) / max(1, steps - warmup), 0.0, 1.0)
    cos = peak / 100 + (peak - peak / 100) * 0.5 * (1 + np.cos(np.pi * frac))
    return np.where(t < warmup, warm, cos)


def hard_gradients(model: MixedModel, steps: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """A gradient sequence (PyTorch names and layouts) designed to stress the optimizers."""
    rng = np.random.default_rng(seed)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    vocab = shapes["embed.weight"][0]
    seq = []
    for t in range(steps):
        g = {}
        for name, shape in shapes.items():
            x = rng.standard_normal(shape) * np.logspace(-3, 3, shape[-1])
            x[rng.random(shape) < 0.1] = 0.0
            if t % 7 == 3:
                x *= 1e3
            if name in ("embed.weight", "lm_head.weight"):
                active = np.zeros(vocab, dtype=bool)
                active[np.minimum(rng.zipf(1.5, size=vocab // 6) - 1, vocab - 1)] = True
                x = x * active[:, None]
            g[name] = x
        seq.append(g)
    return seq


def projection_table(k_max: int = 8, n_max: int = 64, rank_max: int = 4) -> np.ndarray:
    """A fixed table of Gaussian projections shared by both frameworks (APOLLO)."""
    rng = np.random.default_rng(1234)
    return rng.standard_normal((k_max, n_max, rank_max))


@dataclasses.dataclass
class ParityReport:
    """Per-step differences between the two frameworks, and the run's verdict.

    ``check`` is ``"trajectory"`` (float64: parameters after each step, absolute, against
    ``tolerance``), ``"sync"`` (float32 updates from synchronized states, in units of
    ``EPS32·max|u|``, against :data:`SYNC_ULPS`; ``offset`` the sign rules' mean signed
    difference in ulps, against :data:`SYNC_OFFSET`) or ``"drift"`` (float32 trajectories:
    reported, never a failure).
    """

    config: str
    dtype: str
    mode: str
    rows: list[tuple[int, float, dict[str, float]]]  # (step, lr, {column: value})
    check: str = "trajectory"
    tolerance: float = TOLERANCE["float64"]
    beyond: int = 0
    ties: int = 0
    offset: float = 0.0
    signed: int = 0  # the sign-rule elements the offset averages over
    gap64: float = 0.0

    @property
    def worst(self) -> float:
        """The largest parameter (trajectory, drift) or update (sync) difference of the run."""
        return max((cols[k] for _, _, cols in self.rows for k in KIND_COLUMNS if k in cols),
                   default=0.0)

    @property
    def ok(self) -> bool:
        """Whether the run passes its check (a drift report always does)."""
        if self.check == "drift":
            return True
        if self.check == "sync":
            return (self.worst <= SYNC_ULPS and self.beyond == 0
                    and abs(self.offset) <= SYNC_OFFSET and self.gap64 <= TOLERANCE["float64"])
        return self.worst <= self.tolerance and self.beyond == 0

    def verdict(self) -> str:
        """One line: the configuration, what was checked, the worst value, OK or FAILED."""
        head = f"{self.config} ({self.mode}, {self.dtype}, {len(self.rows)} steps)"
        if self.check == "drift":
            first = max((v for k, v in self.rows[0][2].items() if k in KIND_COLUMNS),
                        default=0.0) if self.rows else 0.0
            last = max((v for k, v in self.rows[-1][2].items() if k in KIND_COLUMNS),
                       default=0.0) if self.rows else 0.0
            growth = f"x{last / first:.1e}" if first > 0 else "from exactly equal"
            return (f"{head}: float32 trajectories drift apart: {first:.1e} after step 1, "
                    f"{last:.1e} after step {len(self.rows)} ({growth}), at most "
                    f"{self.worst:.1e}; reported, not checked")
        if self.check == "sync":
            offset = f"{self.offset:+.3f} ulp" if self.signed else "- (no sign rule)"
            return (f"{head}: {'OK' if self.ok else 'FAILED'}: synchronized updates differ by "
                    f"at most {self.worst:.1f} (tolerance {SYNC_ULPS:g}) x float32 eps x max|u|; "
                    f"sign-rule offset {offset} (tolerance {SYNC_OFFSET:g}); "
                    f"sign ties {self.ties}; elements beyond tolerance {self.beyond}; "
                    f"float64 states {self.gap64:.1e} apart")
        return (f"{head}: {'OK' if self.ok else 'FAILED'}: parameters differ by at most "
                f"{self.worst:.1e} (tolerance {self.tolerance:g}); elements beyond tolerance "
                f"{self.beyond}")

    def table(self) -> str:
        """The per-step table as text."""
        columns = list(self.rows[0][2]) if self.rows else []

        def fmt(c: str, v: float) -> str:
            if c in ("beyond", "ties"):
                return str(int(v))
            return f"{v:.1f}" if self.check == "sync" and c in KIND_COLUMNS else f"{v:.2e}"

        body = [(step, f"{lr:.3e}", *(fmt(c, cols[c]) for c in columns))
                for step, lr, cols in self.rows]
        what = {"trajectory": "max |torch - jax| of the parameters",
                "drift": "max |torch - jax| of the parameters (drift)",
                "sync": "max |u_torch - u_jax| / (float32 eps x max|u|) of the updates"}
        title = f"{self.config} ({self.dtype}, {self.mode}): {what[self.check]} per step"
        return title + "\n" + format_table(("step", "lr", *columns), body)


def _jax_optimizer(name: str, lrs: np.ndarray, table: np.ndarray, dtype: Any) -> Any:
    import jax.numpy as jnp

    import sage_optax

    lr_table = jnp.asarray(lrs, dtype)

    def lr(count: Any) -> Any:
        return lr_table[count]

    extra: dict[str, Any] = {}
    if get_preset(name).dense.name == "apollo":
        p = jnp.asarray(table, dtype)
        extra["dense_projection"] = lambda path, k, n, rank: p[k % p.shape[0], :n, :rank]
        extra["dense_update_proj_gap"] = 7
    return sage_optax.make_optimizer(name, lr, **extra)


def _torch_optimizer(name: str, model: nn.Module, table: np.ndarray,
                     foreach: bool | None = None,
                     fused: bool | None = None) -> torch.optim.Optimizer:
    import sage_torch

    extra: dict[str, Any] = {"foreach": foreach}
    if fused:
        extra["fused"] = True
    if get_preset(name).dense.name == "apollo":
        p = torch.from_numpy(table)

        def projection(param_name: str, k: int, n: int, rank: int) -> torch.Tensor:
            return p[k % p.shape[0], :n, :rank]

        extra["dense_projection"] = projection
        extra["dense_update_proj_gap"] = 7
    return sage_torch.make_optimizer(name, model, lr=0.0, **extra)


# --------------------------------------------------------------------------------------------
# The two sides of one comparison


@dataclasses.dataclass
class _Pair:
    """One model in both frameworks: how to build each side and feed it a step's gradient."""

    make_model: Callable[[torch.dtype], nn.Module]  # same initial weights at every call
    to_jax: Callable[[dict[str, np.ndarray], Any], Any]  # torch-named arrays -> JAX tree
    to_torch: Callable[[Any], dict[str, np.ndarray]]  # JAX tree -> torch-named arrays
    torch_grads: Callable[[nn.Module, int], float | None]  # sets .grad; the loss or None
    jax_grads: Callable[[Any, int, Any], tuple[float | None, Any]]  # (params, t, dtype)
    table: np.ndarray  # APOLLO's projections


_TorchGrads = Callable[[nn.Module, int], float | None]
_JaxGrads = Callable[[Any, int, Any], tuple[float | None, Any]]


def _recorded_grads(make_model: Callable[[torch.dtype], nn.Module],
                    to_jax: Callable[[dict[str, np.ndarray], Any], Any], steps: int,
                    seed: int) -> tuple[_TorchGrads, _JaxGrads]:
    """Both sides fed the same recorded hard gradients (the ``gradients`` mode)."""
    seq = hard_gradients(make_model(torch.float64), steps, seed)  # type: ignore[arg-type]

    def torch_grads(model: nn.Module, t: int) -> float | None:
        for n, p in model.named_parameters():
            p.grad = torch.from_numpy(seq[t][n]).to(p.dtype)
        return None

    def jax_grads(params: Any, t: int, dtype: Any) -> tuple[float | None, Any]:
        return None, to_jax(seq[t], dtype)

    return torch_grads, jax_grads


def _mixed_loss_grads(vocab: int, steps: int, seed: int) -> tuple[_TorchGrads, _JaxGrads]:
    """Each side's own gradient of the same token batches (the ``model`` mode)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed + 1)
    batches = []
    for _ in range(steps):
        tokens = rng.integers(0, vocab, size=64)
        batches.append((tokens, (tokens * 7 + 3) % vocab))
    grad_fn = jax.jit(jax.value_and_grad(jax_loss))

    def torch_grads(model: nn.Module, t: int) -> float | None:
        model.zero_grad()
        x, y = batches[t]
        loss = model(torch.from_numpy(x), torch.from_numpy(y))
        loss.backward()
        return float(loss.detach())

    def jax_grads(params: Any, t: int, dtype: Any) -> tuple[float | None, Any]:
        x, y = batches[t]
        loss, g = grad_fn(params, jnp.asarray(x), jnp.asarray(y))
        return float(loss), g

    return torch_grads, jax_grads


def _mixed_pair(mode: str, steps: int, seed: int) -> _Pair:
    """The small :class:`MixedModel` (``gradients`` and ``model`` modes)."""
    import jax
    import jax.numpy as jnp

    torch.manual_seed(seed)
    initial = {n: p.detach().clone() for n, p in MixedModel().named_parameters()}

    def make_model(dtype: torch.dtype) -> nn.Module:
        model = MixedModel().to(dtype)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(initial[n])
        return model

    def to_jax(arrays: dict[str, np.ndarray], dtype: Any) -> Any:
        tensors = {n: torch.from_numpy(np.asarray(v)) for n, v in arrays.items()}
        return jax.tree.map(lambda x: jnp.asarray(x, dtype), to_flax(tensors))

    if mode == "gradients":
        torch_grads, jax_grads = _recorded_grads(make_model, to_jax, steps, seed)
    else:
        vocab = initial["embed.weight"].shape[0]
        torch_grads, jax_grads = _mixed_loss_grads(vocab, steps, seed)
    return _Pair(make_model, to_jax, from_flax, torch_grads, jax_grads, projection_table())


def _rms_norm_float64(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The RMSNorm of transformers' LLaMA without its cast to float32 (the float64 run)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _float64_norms(model: nn.Module) -> nn.Module:
    """``model`` with each ``LlamaRMSNorm`` computing in float64 (in place, returned)."""
    import types

    for module in model.modules():
        if type(module).__name__ == "LlamaRMSNorm":
            module.forward = types.MethodType(_rms_norm_float64, module)
    return model


def _tree_paths(tree: Any) -> list[tuple[Any, ...]]:
    """The key path of every leaf of a nested dict, keys as they are (ints for layers)."""
    import jax

    return [tuple(getattr(k, "key", getattr(k, "idx", None)) for k in p)
            for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def llama_loss(params: dict[str, Any], tokens: Any, targets: Any, cos: Any, sin: Any,
               config: Any, eps: float = 1e-6) -> Any:
    """The LLaMA of :class:`sage_train.model.llama.Llama` and transformers, written out in JAX.

    ``params`` is the trainer's parameter tree as a pure dict (Flax layouts), in any float
    dtype: every operation runs in that dtype (the trainer's model computes norms, RoPE and
    the softmax in float32).  ``cos``/``sin`` ``(T, head_dim)`` are RoPE's tables (taken from
    transformers' model, so both sides use the same numbers).
    """
    import jax
    import jax.numpy as jnp
    import optax

    def rms(x: Any, scale: Any) -> Any:
        return scale * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))

    def rope(x: Any) -> Any:
        x1, x2 = jnp.split(x, 2, axis=-1)
        rotated = jnp.concatenate([-x2, x1], axis=-1)
        return x * cos[None, :, None, :] + rotated * sin[None, :, None, :]

    b, t = tokens.shape
    nh, nk = config.num_heads, config.num_kv_heads
    hd = config.head_dim
    emb = params["embed"]["embedding"]
    h = emb[tokens]
    causal = jnp.tril(jnp.ones((t, t), dtype=bool))
    for i in range(config.num_layers):
        layer = params["layers"][i]
        attn = layer["attn"]
        x = rms(h, layer["attn_norm"]["scale"])
        q = rope((x @ attn["q_proj"]["kernel"]).reshape(b, t, nh, hd))
        k = rope((x @ attn["k_proj"]["kernel"]).reshape(b, t, nk, hd))
        v = (x @ attn["v_proj"]["kernel"]).reshape(b, t, nk, hd)
        k, v = jnp.repeat(k, nh // nk, axis=2), jnp.repeat(v, nh // nk, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * hd**-0.5
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        a = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, nh * hd)
        h = h + a @ attn["o_proj"]["kernel"]
        mlp = layer["mlp"]
        x = rms(h, layer["mlp_norm"]["scale"])
        h = h + (jax.nn.silu(x @ mlp["gate_proj"]["kernel"]) * (x @ mlp["up_proj"]["kernel"])
                 ) @ mlp["down_proj"]["kernel"]
    x = rms(h, params["final_norm"]["scale"])
    w = emb.T if config.tie_embeddings else params["lm_head"]["kernel"]
    return optax.softmax_cross_entropy_with_integer_labels(x @ w, targets).mean()


def _path_converters(paths: list[tuple[tuple[Any, ...], str]]) -> tuple[
        Callable[[dict[str, np.ndarray], Any], Any], Callable[[Any], dict[str, np.ndarray]]]:
    """``(to_jax, to_torch)`` between torch-named arrays and the nested Flax tree at ``paths``."""
    import jax.numpy as jnp

    def transposed(path: tuple[Any, ...]) -> bool:
        return path[-1] == "kernel"

    def to_jax(arrays: dict[str, np.ndarray], dtype: Any) -> Any:
        out: dict[Any, Any] = {}
        for path, tname in paths:
            x = np.array(arrays[tname])  # a copy: see to_flax
            node = out
            for key in path[:-1]:
                node = node.setdefault(key, {})
            node[path[-1]] = jnp.asarray(x.T if transposed(path) else x, dtype)
        return out

    def to_torch(tree: Any) -> dict[str, np.ndarray]:
        out = {}
        for path, tname in paths:
            node = tree
            for key in path:
                node = node[key]
            x = np.asarray(node)
            out[tname] = x.T if transposed(path) else x
        return out

    return to_jax, to_torch


def _llama_grads(hf: Any, cfg: Any, steps: int, seed: int, batch: int,
                 seq_len: int) -> tuple[_TorchGrads, _JaxGrads]:
    """Each side's own gradient of the same random token batches (``llama``)."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(steps):
        tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq_len + 1))
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    positions = torch.arange(seq_len)[None]
    tables = {}
    for dtype in (torch.float32, torch.float64):
        cos, sin = hf.model.rotary_emb(torch.zeros((), dtype=dtype), positions)
        tables[dtype] = (cos[0].numpy().copy(), sin[0].numpy().copy())
    grad_fns: dict[str, Any] = {}

    def torch_grads(m: nn.Module, t: int) -> float | None:
        m.zero_grad()
        x, y = batches[t]
        logits = m(torch.from_numpy(x)).logits
        loss = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                           torch.from_numpy(y).reshape(-1))
        loss.backward()
        return float(loss.detach())

    def jax_grads(params: Any, t: int, dtype: Any) -> tuple[float | None, Any]:
        key = jnp.dtype(dtype).name
        if key not in grad_fns:
            cos, sin = tables[torch.float64 if key == "float64" else torch.float32]
            c, s = jnp.asarray(cos, dtype), jnp.asarray(sin, dtype)
            grad_fns[key] = jax.jit(jax.value_and_grad(
                lambda p, x, y: llama_loss(p, x, y, c, s, cfg)))
        x, y = batches[t]
        loss, g = grad_fns[key](params, jnp.asarray(x), jnp.asarray(y))
        return float(loss), g

    return torch_grads, jax_grads


def _llama_pair(steps: int, seed: int, model: str, tied: bool, batch: int,
                seq_len: int) -> _Pair:
    """The ``LlamaForCausalLM`` of transformers and the trainer's Flax tree (``llama``)."""
    import copy

    from flax import nnx
    from transformers import LlamaForCausalLM

    from sage_train.hf.convert import from_hf_state_dict, hf_name
    from sage_train.model.llama import Llama
    from sage_train.model.shapes import get_model_config

    cfg = dataclasses.replace(get_model_config(model), tie_embeddings=tied)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(_hf_config(cfg)).float()
    flax_model = Llama(cfg, rngs=nnx.Rngs(seed))
    from_hf_state_dict(flax_model, hf.state_dict())
    template = nnx.to_pure_dict(nnx.state(flax_model, nnx.Param))
    paths = [(p, hf_name(".".join(map(str, p)))) for p in _tree_paths(template)]
    names = {tname for _, tname in paths}
    missing = names ^ {n for n, _ in hf.named_parameters()}
    assert not missing, f"parameters without a counterpart: {sorted(missing)}"

    def make_model(dtype: torch.dtype) -> nn.Module:
        m = copy.deepcopy(hf).to(dtype)
        return _float64_norms(m) if dtype == torch.float64 else m

    to_jax, to_torch = _path_converters(paths)
    torch_grads, jax_grads = _llama_grads(hf, cfg, steps, seed, batch, seq_len)

    largest = max(max(p.shape) for p in hf.parameters())
    return _Pair(make_model, to_jax, to_torch, torch_grads, jax_grads,
                 projection_table(n_max=largest))


def _hf_config(cfg: Any) -> Any:
    from sage_train.hf.convert import to_hf_config

    # sdpa: its float64 attention stays in float64 (the eager one takes the softmax in float32)
    return to_hf_config(cfg, attn_implementation="sdpa")


# --------------------------------------------------------------------------------------------
# The runs


def _cast32(x: Any) -> Any:
    """A float32 copy of an optimizer state dict (integers and the rest copied as they are)."""
    if isinstance(x, torch.Tensor):
        return x.to(torch.float32, copy=True) if x.is_floating_point() else x.clone()
    if isinstance(x, dict):
        return {k: _cast32(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_cast32(v) for v in x)
    return x


def _named(opt: torch.optim.Optimizer) -> dict[str, tuple[torch.Tensor, dict[str, Any]]]:
    """``{name: (parameter, its group)}`` of a ``make_optimizer`` optimizer."""
    out = {}
    for group in opt.param_groups:
        for n, p in zip(group["param_names"], group["params"], strict=True):
            out[n] = (p, group)
    return out


def _grad(p: torch.Tensor) -> torch.Tensor:
    """The gradient of ``p`` (every parameter has one in these runs)."""
    assert p.grad is not None
    return p.grad.detach()


def _compare_updates(ut: np.ndarray, uj: np.ndarray, group: dict[str, Any],
                     state: dict[str, Any], g: np.ndarray) -> tuple[float, int, int, float, int]:
    """One parameter's synchronized updates: (worst in units, beyond, ties, offset sum, n)."""
    scale = max(float(np.max(np.abs(ut), initial=0.0)), float(np.max(np.abs(uj), initial=0.0)))
    if scale == 0.0:
        return 0.0, 0, 0, 0.0, 0
    diff = np.abs(ut - uj) / (EPS32 * scale)
    flips = np.sign(ut) != np.sign(uj)
    ties = np.zeros_like(flips)
    offset, count = 0.0, 0
    if group.get("rule") in SIGN_RULES:
        b1 = group["betas"][0]
        m = (state["exp_avg"].to(torch.float32).double().numpy() if "exp_avg" in state
             else np.zeros_like(g))
        arg = b1 * m + (1 - b1) * g
        ties = flips & (np.abs(arg) <= TIE_ULPS * EPS32 * (np.abs(m) + np.abs(g)))
        same = ~flips & (ut != 0)
        if same.any():
            a, b = np.abs(ut[same]), np.abs(uj[same])
            offset = float(np.sum((a - b) / np.spacing(b.astype(np.float32)).astype(np.float64)))
            count = int(same.sum())
    kept = diff[~ties]
    worst = float(kept.max()) if kept.size else 0.0
    return worst, int(np.sum(kept > SYNC_ULPS)), int(ties.sum()), offset, count


def _sync_step(pair: _Pair, opt: torch.optim.Optimizer, opt32: torch.optim.Optimizer,
               named: dict[str, Any], named32: dict[str, Any], update32: Any, state: Any,
               cols: dict[str, float],
               running: tuple[int, float, int]) -> tuple[int, int, float, int]:
    """One ``sync`` step's float32 comparison.

    ``running`` is the run's ``(beyond, offset sum, signed count)`` so far; returns them
    updated, with this step's ties second. Fills ``cols`` with each kind's worst difference.
    """
    import jax
    import jax.numpy as jnp

    beyond, offset_sum, count = running
    # Both sides start the step from the same float32 parameters (zero, so that
    # the new parameter is the update itself, at full resolution), optimizer
    # state (the float64 run's, rounded) and gradient (torch's, rounded).
    g32 = {n: _grad(p).to(torch.float32) for n, (p, _) in named.items()}
    opt32.load_state_dict(_cast32(opt.state_dict()))
    with torch.no_grad():
        for n, (p, _) in named32.items():
            p.zero_()
            p.grad = g32[n].clone()
    opt32.step()
    g_tree = pair.to_jax({n: v.numpy() for n, v in g32.items()}, jnp.float32)
    state32 = jax.tree.map(
        lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, state)
    u32, _ = update32(g_tree, state32, jax.tree.map(jnp.zeros_like, g_tree))
    uj = pair.to_torch(u32)
    step_ties = 0
    for n, (p32, group) in named32.items():
        kind = group.get("kind", "vector")
        w, b, k, o, c = _compare_updates(
            p32.detach().double().numpy(), np.asarray(uj[n], np.float64), group,
            opt.state[named[n][0]], g32[n].double().numpy())
        cols[kind] = max(cols.get(kind, 0.0), w)
        beyond, step_ties, offset_sum, count = (beyond + b, step_ties + k,
                                                offset_sum + o, count + c)
    return beyond, step_ties, offset_sum, count


def _param_gaps(named: dict[str, Any], jax_params: dict[str, np.ndarray], check: str,
                cols: dict[str, float]) -> tuple[int, float]:
    """``(entries beyond tolerance, largest gap)`` between the two sides' parameters.

    Outside ``sync``, fills ``cols`` with each kind's largest difference.
    """
    step_beyond, gap = 0, 0.0
    for n, (p, group) in named.items():
        diff = np.abs(p.detach().numpy() - jax_params[n])
        gap = max(gap, float(np.max(diff)))
        if check != "sync":
            kind = group.get("kind", "vector")
            cols[kind] = max(cols.get(kind, 0.0), float(np.max(diff)))
            step_beyond += int(np.sum(diff > TOLERANCE["float64"]))
    return step_beyond, gap


def _run(pair: _Pair, name: str, steps: int, dtype: str, check: str, mode: str,
         peak: float, foreach: bool | None, fused: bool) -> ParityReport:
    """Both frameworks step by step: ``check`` is ``trajectory``, ``sync`` or ``drift``."""
    import jax
    import jax.numpy as jnp
    import optax

    run_dtype = "float64" if check == "sync" else dtype
    tdtype, lrs = getattr(torch, run_dtype), schedule(steps, peak)
    model = pair.make_model(tdtype)
    opt = _torch_optimizer(name, model, pair.table, foreach, fused)
    named = _named(opt)
    if check == "sync":
        model32 = pair.make_model(torch.float32)
        opt32 = _torch_optimizer(name, model32, pair.table, foreach, fused)
        named32 = _named(opt32)
    rows = []
    beyond = ties = count = 0
    offset_sum = gap64 = 0.0
    with jax.enable_x64(True):
        jdtype = jnp.dtype(run_dtype)
        params = pair.to_jax({n: p.detach().numpy() for n, p in model.named_parameters()}, jdtype)
        tx = _jax_optimizer(name, lrs, pair.table, jdtype)
        state = tx.init(params)
        update = jax.jit(tx.update)
        if check == "sync":
            update32 = jax.jit(_jax_optimizer(name, lrs, pair.table, jnp.float32).update)
        for t in range(steps):
            for each in (opt, opt32) if check == "sync" else (opt,):
                for group in each.param_groups:
                    group["lr"] = float(lrs[t])
            cols: dict[str, float] = {}
            loss_t = pair.torch_grads(model, t)
            loss_j, g_jax = pair.jax_grads(params, t, jdtype)
            if loss_t is not None and loss_j is not None:
                cols["loss"] = abs(loss_t - loss_j)
            if check == "sync":
                beyond, step_ties, offset_sum, count = _sync_step(
                    pair, opt, opt32, named, named32, update32, state, cols,
                    (beyond, offset_sum, count))
                ties += step_ties
                cols["ties"] = float(step_ties)
            opt.step()
            updates, state = update(g_jax, state, params)
            params = optax.apply_updates(params, updates)
            jax_params = pair.to_torch(params)
            step_beyond, gap = _param_gaps(named, jax_params, check, cols)
            if check == "sync":
                cols["float64 gap"] = gap
                gap64 = max(gap64, gap)
            elif check == "trajectory":
                cols["beyond"] = float(step_beyond)
                beyond = step_beyond  # at the last step
            rows.append((t + 1, float(lrs[t]), cols))
    return ParityReport(name, dtype, mode, rows, check=check, beyond=beyond, ties=ties,
                        offset=offset_sum / count if count else 0.0, signed=count,
                        gap64=gap64)


def _check_of(dtype: str, trajectory: bool) -> str:
    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype must be 'float64' or 'float32', got {dtype!r}")
    if dtype == "float64":
        return "trajectory"
    return "drift" if trajectory else "sync"


def run_parity(name: str, steps: int = 100, dtype: str = "float64", mode: str = "gradients",
               seed: int = 0, peak_lr: float | None = None,
               foreach: bool | None = None, fused: bool = False,
               trajectory: bool = False) -> ParityReport:
    """Run both frameworks side by side on the small model and return the report.

    Args:
      name: configuration name.
      steps: number of optimizer steps.
      dtype: ``"float64"`` (the trajectories, checked to :data:`TOLERANCE`) or
        ``"float32"`` (each step from synchronized states, checked to :data:`SYNC_ULPS` and
        :data:`SYNC_OFFSET`; with ``trajectory``, the drift of the two float32 trajectories,
        reported, not checked).
      mode: ``"gradients"`` (same synthetic gradient sequence) or ``"model"`` (same batches
        through both models; also compares the losses).
      seed: seed of the initial weights and of the data.
      peak_lr: peak of the warmup + cosine schedule (default: the configuration's).
      foreach: the torch path (``None``: torch's default, the single-tensor path on the CPU;
        ``True``: the multi-tensor path).
      fused: step sage_torch's SAGE, Lion and SinkGD groups on the fused (Triton) path;
        on the CPU its kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` is
        set for the run and restored after it).  Needs ``triton``.
      trajectory: float32 only: report the drift of the two trajectories instead.

    Raises:
      ValueError: an unknown ``dtype`` or ``mode``, or both ``fused`` and ``foreach``.
    """
    check = _check_of(dtype, trajectory)
    if mode not in ("gradients", "model"):
        raise ValueError(f"mode must be 'gradients' or 'model', got {mode!r}")
    if fused and foreach:
        raise ValueError("fused and foreach are two paths: pass one of them")
    peak = get_preset(name).learning_rate if peak_lr is None else peak_lr
    if mode == "model":
        peak = min(peak, 1e-2)
    pair = _mixed_pair(mode, steps, seed)
    if not fused:
        return _run(pair, name, steps, dtype, check, mode, peak, foreach, False)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return _run(pair, name, steps, dtype, check, mode, peak, None, True)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


def run_llama_parity(name: str, steps: int = 10, *, model: str = "tiny", tied: bool = True,
                     dtype: str = "float64", trajectory: bool = False,
                     lr: float | None = None, batch: int = 4, seq_len: int = 32,
                     seed: int = 0) -> ParityReport:
    """Full LLaMA parity: ``sage_optax`` against ``sage_torch`` on the same LLaMA, same batches.

    ``sage_torch`` steps transformers' ``LlamaForCausalLM`` (random init); ``sage_optax`` the
    trainer's Flax parameter tree of the same weights (converted).
    The JAX side's loss is :func:`llama_loss` on the trainer's
    :class:`~sage_train.model.llama.Llama` parameter tree (as the trainer's ``nnx`` optimizer
    sees it).  In float64 both models run
    in float64 throughout (transformers' RMSNorm without its float32 cast, sdpa attention);
    ``dtype`` and ``trajectory`` as in :func:`run_parity`; ``lr`` the schedule's peak (default:
    the configuration's).  Needs ``transformers`` and the trainer (``sage_train``).
    """
    check = _check_of(dtype, trajectory)
    pair = _llama_pair(steps, seed, model, tied, batch, seq_len)
    peak = get_preset(name).learning_rate if lr is None else lr
    mode = f"llama-{model}-{'tied' if tied else 'untied'}"
    return _run(pair, name, steps, dtype, check, mode, peak, None, False)


# --------------------------------------------------------------------------------------------
# The command


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: the exit status.

    0 when every configuration passes, 1 if one fails, 2 for an invalid option (one line,
    before any work).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    problem = _option_problem(args)
    if problem:
        parser.error(problem)
    return _run_command(args)


def _option_problem(args: Any) -> str | None:
    """The first option that cannot apply, as one clause; ``None`` when all can."""
    if args.foreach and args.fused:
        return "--foreach and --fused are two torch paths: pass one of them"
    if args.mode == "llama":
        for flag in ("foreach", "fused"):
            if getattr(args, flag):
                return f"--{flag} applies to --mode gradients and model, not llama"
    elif args.untied:
        return "--untied applies to --mode llama only"
    if args.trajectory and args.dtype != "float32":
        return ("--trajectory applies to --dtype float32 (float64 always compares the "
                "trajectories)")
    if args.fused:
        from sage_torch.common import triton_available

        if not triton_available():
            return "--fused needs the triton package (pip install triton)"
    return None


def build_parser() -> OneLineParser:
    """The ``sage-parity`` parser."""
    paragraphs = [" ".join(p.split()) for p in (__doc__ or "").split("\n\n")[:2]]
    parser = OneLineParser(prog="sage-parity", description="\n\n".join(paragraphs),
                           formatter_class=DefaultsFormatter)
    parser.add_argument("--config", default="sage-hybrid", choices=[*CONFIG_NAMES, "all"],
                        metavar="NAME",
                        help=f"the configuration to compare, or all: {', '.join(CONFIG_NAMES)}")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 1, "an integer >= 1"),
                        default=100, help="optimizer steps taken by both frameworks")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                        help="float64 compares the two trajectories; float32 compares each "
                        "step's updates from synchronized states")
    parser.add_argument("--trajectory", action="store_true",
                        help="with --dtype float32: run the two float32 trajectories instead "
                        "and report how far they drift apart (not a check)")
    parser.add_argument("--mode", default="gradients", choices=list(MODES),
                        help="gradients: the same gradient sequence fed to both optimizers; "
                        "model: both frameworks train the same small model on the same "
                        "batches; llama: transformers' LLaMA against the trainer's (slower: "
                        "about 2 minutes per configuration at 100 steps on a CPU)")
    parser.add_argument("--untied", action="store_true", help="llama mode: an untied head")
    parser.add_argument("--every", type=checked(int, lambda v: v >= 1, "an integer >= 1"),
                        default=10, help="print every N-th step of the tables")
    parser.add_argument("--foreach", action="store_true",
                        help="step sage_torch on its multi-tensor (foreach) path")
    parser.add_argument("--fused", action="store_true",
                        help="step sage_torch's SAGE, Lion and SinkGD groups on the fused "
                        "(Triton) path; on the CPU under Triton's interpreter (slow; needs "
                        "triton)")
    return parser


def _run_command(args: Any) -> int:
    require("sage-parity", "jax", "torch")
    if args.mode == "llama":
        require("sage-parity --mode llama", "all", packages=("transformers",))
    names = CONFIG_NAMES if args.config == "all" else (args.config,)
    reports = []
    for name in names:
        if args.mode == "llama":
            report = run_llama_parity(name, args.steps, tied=not args.untied, dtype=args.dtype,
                                      trajectory=args.trajectory)
        else:
            report = run_parity(name, args.steps, args.dtype, args.mode,
                                foreach=True if args.foreach else None, fused=args.fused,
                                trajectory=args.trajectory)
        shown = [r for r in report.rows
                 if r[0] % args.every == 0 or r[0] in (1, len(report.rows))]
        print(dataclasses.replace(report, rows=shown).table())
        print(report.verdict() + "\n")
        reports.append(report)
    failed = [r.config for r in reports if not r.ok]
    if reports[0].check == "drift":
        print(f"overall: {len(reports)} drift report(s), nothing checked")
    elif failed:
        print(f"overall: FAILED: {len(failed)} of {len(reports)} configurations "
              f"({', '.join(failed)})")
    else:
        print(f"overall: OK: all {len(reports)} configurations agree")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
