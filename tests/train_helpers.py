"""The trainer configuration the trainer tests share (so their compiled step is shared)."""

from __future__ import annotations

import dataclasses
from typing import Any

from sage_train.run.train import RunResult, TrainConfig, train


def config(corpus: Any, run_dir: Any, **kw: Any) -> TrainConfig:
    """The tiny sage-hybrid run of the trainer tests, with ``kw`` replaced."""
    base = TrainConfig(model="tiny", optimizer="sage-hybrid", batch_size=8, seq_len=32,
                       steps=8, eval_every=4, eval_batches=2, log_every=1,
                       data=str(corpus), run_dir=str(run_dir), checkpoint_every=4,
                       record_h_every=2, progress=False)
    return dataclasses.replace(base, **kw)


def quiet(cfg: TrainConfig, **kw: Any) -> tuple[RunResult, list[str]]:
    """``train(cfg, **kw)`` with its log collected instead of printed: (result, messages)."""
    messages: list[str] = []
    return train(cfg, log=messages.append, **kw), messages
