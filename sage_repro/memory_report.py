"""Print the paper's Appendix memory table, recomputed exactly from ``jax.eval_shape``.

``python -m sage_repro.memory_report`` (or ``sage-memory``) builds every configuration for
the paper's 270M / 0.6B / 1.3B LLaMA shapes, counts optimizer-state bytes of
``jax.eval_shape(tx.init, params)`` (nothing is allocated) and prints them next to the
paper's Appendix table ``tab:memory_full``.  "Total" is weights + gradients + optimizer
state, all float32, as in the paper.

Needs the ``[jax]`` extra; importing this module does not (JAX is imported when a table is
computed), so that ``sage-memory`` without it says so in one line.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import sys
from typing import Any

from sage_optim.console import console_script
from sage_optim.extras import require
from sage_optim.presets import CONFIG_NAMES
from sage_optim.table import format_table
from sage_repro.paper import PAPER_MEMORY_GIB
from sage_train.job.cli_args import DefaultsFormatter, OneLineParser
from sage_train.model.shapes import MODELS, PAPER_MODELS, get_model_config

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class MemoryRow:
    """Memory of one configuration on one model, in bytes, with the paper's GiB if known."""

    model: str
    config: str
    param_bytes: int
    state_bytes: int
    paper_state_gib: float | None
    paper_total_gib: float | None

    @property
    def state_gib(self) -> float:
        """Optimizer state in GiB."""
        return self.state_bytes / GIB

    @property
    def total_gib(self) -> float:
        """Weights + gradients + optimizer state in GiB (float32)."""
        return (2 * self.param_bytes + self.state_bytes) / GIB


def memory_rows(model: str, configs: tuple[str, ...] = CONFIG_NAMES) -> list[MemoryRow]:
    """Exact memory of every configuration for ``model`` (no allocation)."""
    import jax

    from sage_optax.configs import make_optimizer
    from sage_optax.memory import state_bytes
    from sage_repro.llama_shapes import llama_param_shapes

    params = llama_param_shapes(get_model_config(model))
    param_bytes = state_bytes(params)
    paper = PAPER_MEMORY_GIB.get(model, {})
    rows = []
    for name in configs:
        abstract_state = jax.eval_shape(make_optimizer(name).init, params)
        ref = paper.get(name)
        rows.append(
            MemoryRow(
                model, name, param_bytes, state_bytes(abstract_state),
                None if ref is None else ref[0], None if ref is None else ref[1],
            )
        )
    return rows


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_memory_table(models: tuple[str, ...] = tuple(PAPER_MODELS)) -> str:
    """The memory table as text: ours next to the paper's, per model and configuration."""
    blocks = []
    for model in models:
        rows = memory_rows(model)
        cfg = get_model_config(model)
        body = [
            (r.config, f"{r.state_gib:.3f}", _fmt(r.paper_state_gib),
             f"{r.total_gib:.3f}", _fmt(r.paper_total_gib))
            for r in rows
        ]
        title = (
            f"{model}: {cfg.param_count():,} parameters, embedding share "
            f"{cfg.embedding_fraction():.0%} (GiB, float32 states)"
        )
        headers = ("configuration", "opt", "paper opt", "total", "paper total")
        blocks.append(title + "\n" + format_table(headers, body))
    note = (
        "apollo: the paper's row comes from a run whose name filter left the attention\n"
        "matrices on AdamW; here APOLLO-Mini covers every attention and MLP matrix, as\n"
        "the paper's setup says, so its state is smaller (docs/configurations.md)."
    )
    return "\n\n".join(blocks) + "\n\n" + note


def hf_memory_rows(config: Any, configs: tuple[str, ...] = CONFIG_NAMES) -> list[MemoryRow]:
    """Exact memory of every configuration for a transformers model built from ``config``.

    ``config`` is a ``transformers.PretrainedConfig`` or the path of a ``config.json`` (or
    of the folder holding it): a mixture-of-experts model too, whose fused experts
    ``sage_torch`` routes per expert.  The model is built on the ``meta`` device and the
    state counted by :func:`sage_torch.routing_table`: nothing is allocated.  Float32
    weights, gradients and states, as the paper's table.
    """
    import torch
    import transformers

    import sage_torch

    if not isinstance(config, transformers.PretrainedConfig):
        config = transformers.AutoConfig.from_pretrained(str(config), local_files_only=True)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    param_bytes = 4 * sum(p.numel() for p in model.parameters() if p.requires_grad)
    name = getattr(config, "model_type", type(config).__name__)
    return [MemoryRow(name, c, param_bytes,
                      sage_torch.routing_table(c, model).total_bytes, None, None)
            for c in configs]


def format_hf_memory_table(config: Any) -> str:
    """The memory table of a transformers model from ``config`` (:func:`hf_memory_rows`)."""
    rows = hf_memory_rows(config)
    largest = max(2 * r.param_bytes + r.state_bytes for r in rows)
    unit, size = next((u, n) for u, n in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10))
                      if largest >= n or u == "KiB")
    body = [(r.config, f"{r.state_bytes / size:.3f}",
             f"{(2 * r.param_bytes + r.state_bytes) / size:.3f}") for r in rows]
    title = (f"{rows[0].model}: {rows[0].param_bytes // 4:,} parameters "
             f"({unit}, float32 states; routed by sage_torch)")
    return title + "\n" + format_table(("configuration", "opt", "total"), body)


_POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                   "num_attention_heads", "num_key_value_heads", "head_dim",
                   "moe_intermediate_size", "num_experts", "num_local_experts")
"""Fields of a transformers ``config.json`` that must be positive integers where given."""


def check_hf_config(path: str | pathlib.Path) -> pathlib.Path:
    """The folder of the ``config.json`` at ``path`` (the file or its folder), checked.

    Read here, without transformers (which would look a missing path up on the Hub):
    it must exist, be a JSON object, and give positive integers for the sizes of
    :data:`_POSITIVE_SIZES` (``vocab_size: -64`` fails in PyTorch, deep in the model).

    Raises:
      ValueError: one line saying what is wrong with the file.
    """
    p = pathlib.Path(path).expanduser()
    file = p / "config.json" if p.is_dir() else p
    if not file.is_file():
        raise ValueError(f"{file} does not exist (give a transformers config.json or the "
                         "folder holding it)")
    try:
        config = json.loads(file.read_text())
    except OSError as e:
        raise ValueError(f"{file} cannot be read: {e.strerror or e}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file} holds a JSON {type(config).__name__}, not an object")
    for section in (config, *(v for v in config.values() if isinstance(v, dict))):
        for key in _POSITIVE_SIZES:
            value = section.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise ValueError(f"{file}: {key} must be a positive integer, got {value!r}")
    return file.parent


@console_script
def main(argv: list[str] | None = None) -> int:
    """Command-line entry point (``sage-memory``): print the memory table.

    Returns 0, or 2 after one line on stderr naming an ``--hf-config`` file that cannot be
    used.
    """
    args = build_parser().parse_args(argv)
    if args.hf_config:
        require("sage-memory --hf-config", "torch", packages=("transformers",))
        for path in args.hf_config:
            try:
                table = format_hf_memory_table(check_hf_config(path))
            except (ValueError, OSError, KeyError, TypeError, RuntimeError) as e:
                text = (str(e).strip().splitlines() or [type(e).__name__])[0]
                print(f"sage-memory: error: --hf-config {path}: {text}", file=sys.stderr)
                return 2
            print(table)
        return 0
    require("sage-memory", "jax")
    print(format_memory_table(tuple(args.models)))
    return 0


def build_parser() -> OneLineParser:
    """The ``sage-memory`` parser."""
    parser = OneLineParser(prog="sage-memory", description=__doc__.split("\n\n")[0],
                           formatter_class=DefaultsFormatter)
    parser.add_argument(
        "--models", nargs="+", default=list(PAPER_MODELS), choices=list(MODELS),
        metavar="MODEL",
        help=f"model sizes, of {', '.join(MODELS)} (default: the paper's three, "
             f"{' '.join(PAPER_MODELS)})",
    )
    parser.add_argument(
        "--hf-config", nargs="+", default=None, metavar="PATH",
        help="instead, transformers config.json files (or their folders), mixture-of-experts "
             "models included: the state of every configuration as sage_torch routes the "
             "model (built on the meta device)",
    )
    return parser


if __name__ == "__main__":
    raise SystemExit(main())
