"""Check that :mod:`sage_torch` and :mod:`sage_optax` make the same updates (``docs/``).

``python -m sage_repro.parity --config sage-hybrid --steps 100 --dtype float64`` builds the
same small mixed model (embedding, untied head, two dense matrices, a bias, two norms) in
both frameworks with the same initial weights (converted between Flax ``(in, out)`` and
PyTorch ``(out, in)`` layouts), feeds both optimizers the same gradient sequence (sparse
embedding rows, exact zeros, column scales over six orders of magnitude, spikes) under the
same warmup + cosine schedule, and prints after every step the largest absolute difference
between the two frameworks' parameters, per kind.  ``--mode model`` instead trains both
models on the same batches and compares the losses step by step.  APOLLO is fed the same
projection in both frameworks.

Requires both JAX and PyTorch (the ``[jax,torch]`` extras; ``--mode llama`` also the
trainer's ``[train]`` and ``transformers``).  ``sage-parity`` (:func:`sage_repro.commands.parity`)
and ``python -m sage_repro.parity`` say so in one line when one is missing.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from sage_optim.extras import require
from sage_optim.presets import CONFIG_NAMES, get_preset
from sage_optim.table import format_table
from sage_train.cli_args import DefaultsFormatter, OneLineParser, checked

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


TOLERANCE = {"float64": 1e-10, "float32": 1e-5}
"""Largest absolute parameter difference allowed after any step (``docs/configurations.md``)."""


@dataclasses.dataclass
class ParityReport:
    """Per-step maximum absolute differences between the two frameworks."""

    config: str
    dtype: str
    mode: str
    rows: list[tuple[int, float, dict[str, float]]]  # (step, lr, {column: max |diff|})

    @property
    def worst(self) -> float:
        """The largest difference over all steps and columns (the tie count aside)."""
        return max((max(v for k, v in cols.items() if k != "beyond tol")
                    for _, _, cols in self.rows), default=0.0)

    @property
    def ties(self) -> int:
        """Elements beyond the tolerance at the last step (sign flips at ties)."""
        return int(self.rows[-1][2]["beyond tol"]) if self.rows else 0

    def table(self) -> str:
        """The per-step table as text."""
        columns = list(self.rows[0][2]) if self.rows else []
        def fmt(c: str, v: float) -> str:
            return str(int(v)) if c == "beyond tol" else f"{v:.2e}"

        body = [(step, f"{lr:.3e}", *(fmt(c, cols[c]) for c in columns))
                for step, lr, cols in self.rows]
        title = f"{self.config} ({self.dtype}, {self.mode}): max |torch - jax| per step"
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


def run_parity(name: str, steps: int = 100, dtype: str = "float64", mode: str = "gradients",
               seed: int = 0, peak_lr: float | None = None,
               foreach: bool | None = None, fused: bool = False) -> ParityReport:
    """Run both frameworks side by side and return the per-step differences.

    Args:
      name: configuration name.
      steps: number of optimizer steps.
      dtype: ``"float64"`` or ``"float32"``.
      mode: ``"gradients"`` (same synthetic gradient sequence; compares parameters per
        kind) or ``"model"`` (same batches through both models; compares losses and
        parameters).
      seed: seed of the initial weights and of the data.
      peak_lr: peak of the warmup + cosine schedule (default: the configuration's).
      foreach: the torch path (``None``: torch's default, the single-tensor path on the CPU;
        ``True``: the multi-tensor path).
      fused: step sage_torch's SAGE, Lion and SinkGD groups on the fused (Triton) path;
        on the CPU its kernels run under Triton's interpreter (``TRITON_INTERPRET=1`` is
        set for the run and restored after it).  Needs ``triton``.
    """
    if fused:
        if foreach:
            raise ValueError("fused and foreach are two paths: pass one of them")
        previous = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            return _run_parity(name, steps, dtype, mode, seed, peak_lr, None, True)
        finally:
            if previous is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = previous
    return _run_parity(name, steps, dtype, mode, seed, peak_lr, foreach, False)


def _run_parity(name: str, steps: int, dtype: str, mode: str, seed: int,
                peak_lr: float | None, foreach: bool | None, fused: bool) -> ParityReport:
    """:func:`run_parity` with the torch path settled."""
    import jax
    import jax.numpy as jnp
    import optax

    if dtype not in ("float64", "float32"):
        raise ValueError(f"dtype must be 'float64' or 'float32', got {dtype!r}")
    if mode not in ("gradients", "model"):
        raise ValueError(f"mode must be 'gradients' or 'model', got {mode!r}")
    tdtype = getattr(torch, dtype)
    torch.manual_seed(seed)
    model = MixedModel().to(tdtype)
    peak = get_preset(name).learning_rate if peak_lr is None else peak_lr
    if mode == "model":
        peak = min(peak, 1e-2)
    lrs = schedule(steps, peak)
    table = projection_table()
    opt = _torch_optimizer(name, model, table, foreach, fused)
    rows = []
    with jax.enable_x64(dtype == "float64"):
        jdtype = jnp.dtype(dtype)
        params = jax.tree.map(lambda x: jnp.asarray(x, jdtype), to_flax(model.state_dict()))
        tx = _jax_optimizer(name, lrs, table, jdtype)
        state = tx.init(params)
        update = jax.jit(tx.update)
        grad_fn = jax.jit(jax.value_and_grad(jax_loss))
        grads_seq = hard_gradients(model, steps, seed) if mode == "gradients" else None
        rng = np.random.default_rng(seed + 1)
        vocab = model.embed.num_embeddings
        for t in range(steps):
            for group in opt.param_groups:
                group["lr"] = float(lrs[t])
            cols: dict[str, float] = {}
            if grads_seq is not None:
                g_torch = grads_seq[t]
                for n, p in model.named_parameters():
                    p.grad = torch.from_numpy(g_torch[n]).to(tdtype)
                g_jax = jax.tree.map(lambda x: jnp.asarray(x, jdtype), to_flax(
                    {n: torch.from_numpy(v) for n, v in g_torch.items()}))
            else:
                tokens = rng.integers(0, vocab, size=64)
                targets = (tokens * 7 + 3) % vocab
                opt.zero_grad()
                loss_t = model(torch.from_numpy(tokens), torch.from_numpy(targets))
                loss_t.backward()
                loss_j, g_jax = grad_fn(params, jnp.asarray(tokens), jnp.asarray(targets))
                cols["loss"] = abs(float(loss_t.detach()) - float(loss_j))
            opt.step()
            updates, state = update(g_jax, state, params)
            params = optax.apply_updates(params, updates)
            torch_params = dict(model.named_parameters())
            beyond = 0
            for tname, jarr in from_flax(params).items():
                kind = PARAM_MAP[tname][1]
                diff = np.abs(torch_params[tname].detach().numpy() - jarr)
                cols[kind] = max(cols.get(kind, 0.0), float(np.max(diff)))
                beyond += int(np.sum(diff > TOLERANCE[dtype]))
            # Elements beyond the tolerance: with sign-based rules these are sign flips at
            # ties (an argument of sign() within rounding of zero), reported separately.
            cols["beyond tol"] = float(beyond)
            rows.append((t + 1, float(lrs[t]), cols))
    return ParityReport(name, dtype, mode, rows)


def run_llama_parity(name: str, steps: int = 10, *, model: str = "tiny", tied: bool = True,
                     lr: float = 1e-3, batch: int = 4, seq_len: int = 32,
                     seed: int = 0) -> ParityReport:
    """Full LLaMA parity: ``sage_optax`` on the Flax model vs ``sage_torch`` on HF's.

    A ``transformers.LlamaForCausalLM`` (random init) and the trainer's Flax NNX ``Llama``
    with its weights converted get the same batches; the report has, per step, the loss
    difference and the largest parameter difference (float32, as both models compute).
    Needs ``transformers`` and the trainer (``sage_train``).
    """
    import jax.numpy as jnp
    from flax import nnx
    from transformers import LlamaForCausalLM

    import sage_optax
    import sage_torch
    from sage_train.hf_convert import from_hf_state_dict, to_hf_state_dict
    from sage_train.model import Llama, loss_fn
    from sage_train.model_shapes import get_model_config

    cfg = dataclasses.replace(get_model_config(model), tie_embeddings=tied)
    torch.manual_seed(seed)
    hf = LlamaForCausalLM(_hf_config(cfg)).float()
    flax_model = Llama(cfg, rngs=nnx.Rngs(seed))
    from_hf_state_dict(flax_model, hf.state_dict())
    torch_opt = sage_torch.make_optimizer(name, hf, lr=lr)
    jax_opt = nnx.Optimizer(flax_model, sage_optax.make_optimizer(name, lr), wrt=nnx.Param)

    @nnx.jit
    def jax_step(m: Any, opt: Any, x: Any, y: Any) -> Any:
        loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
        opt.update(m, grads)
        return loss

    rng = np.random.default_rng(seed)
    rows = []
    for t in range(steps):
        tokens = rng.integers(0, cfg.vocab_size, size=(batch, seq_len + 1))
        x, y = tokens[:, :-1], tokens[:, 1:]
        torch_opt.zero_grad()
        logits = hf(torch.from_numpy(x)).logits
        loss_t = nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size),
                                             torch.from_numpy(y).reshape(-1))
        loss_t.backward()
        torch_opt.step()
        loss_j = jax_step(flax_model, jax_opt, jnp.asarray(x), jnp.asarray(y))
        exported, current = to_hf_state_dict(flax_model), hf.state_dict()
        diffs = [(current[k].detach() - exported[k]).abs() for k in current]
        rows.append((t + 1, lr, {
            "loss": abs(float(loss_t.detach()) - float(loss_j)),
            "params": max(float(d.max()) for d in diffs),
            "beyond tol": float(sum(int((d > TOLERANCE["float32"]).sum()) for d in diffs)),
        }))
    return ParityReport(name, "float32", f"llama-{model}-{'tied' if tied else 'untied'}", rows)


def _hf_config(cfg: Any) -> Any:
    from sage_train.hf_convert import to_hf_config

    return to_hf_config(cfg, attn_implementation="eager")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; exits non-zero when a tolerance is exceeded."""
    args = build_parser().parse_args(argv)
    return _run(args)


def build_parser() -> OneLineParser:
    """The ``sage-parity`` parser."""
    parser = OneLineParser(prog="sage-parity", description="\n\n".join(__doc__.split("\n\n")[:2]),
                           formatter_class=DefaultsFormatter)
    parser.add_argument("--config", default="sage-hybrid", choices=[*CONFIG_NAMES, "all"],
                        metavar="NAME",
                        help=f"the configuration to compare, or all: {', '.join(CONFIG_NAMES)}")
    parser.add_argument("--steps", type=checked(int, lambda v: v >= 1, "an integer >= 1"),
                        default=100, help="optimizer steps taken by both frameworks")
    parser.add_argument("--dtype", default="float64", choices=["float64", "float32"],
                        help="the precision of both sides (--mode llama: float32)")
    parser.add_argument("--mode", default="gradients", choices=["gradients", "model", "llama"],
                        help="gradients: the same gradient sequence fed to both optimizers; "
                        "model: both frameworks train the same small model on the same "
                        "batches; llama: the trainer's Flax LLaMA vs transformers' (float32)")
    parser.add_argument("--untied", action="store_true", help="llama mode: untied head")
    parser.add_argument("--every", type=int, default=10, help="print every N-th step")
    parser.add_argument("--foreach", action="store_true",
                        help="step sage_torch on its multi-tensor (foreach) path")
    parser.add_argument("--fused", action="store_true",
                        help="step sage_torch's SAGE/Lion/SinkGD groups on the fused (Triton) "
                             "path; on the CPU under Triton's interpreter (slow; needs triton)")
    return parser


def _run(args: Any) -> int:
    require("sage-parity", "jax", "torch")
    if args.mode == "llama":
        require("sage-parity --mode llama", "all", packages=("transformers",))
    tol = TOLERANCE["float32" if args.mode == "llama" else args.dtype]
    names = CONFIG_NAMES if args.config == "all" else (args.config,)
    failed = False
    for name in names:
        if args.mode == "llama":
            report = run_llama_parity(name, args.steps, tied=not args.untied)
        else:
            report = run_parity(name, args.steps, args.dtype, args.mode,
                                foreach=True if args.foreach else None, fused=args.fused)
        shown = [r for r in report.rows if r[0] % args.every == 0 or r[0] == 1]
        print(dataclasses.replace(report, rows=shown).table())
        verdict = "OK" if report.worst <= tol else "EXCEEDS"
        failed |= report.worst > tol
        print(f"worst {report.worst:.2e} vs tolerance {tol:g}: {verdict}; "
              f"elements beyond tolerance (sign ties): {report.ties}\n")
    return 1 if failed else 0

if __name__ == "__main__":
    raise SystemExit(main())
