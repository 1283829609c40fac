"""Every python block of docs/routing.md runs as written, each in a fresh namespace."""

from __future__ import annotations

import pathlib
import re
import warnings

import pytest

from sage_optim.rates import LearningRateNotice

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "routing.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_the_doc_has_a_worked_example_per_convention():
    text = "\n".join(BLOCKS)
    for marker in ("nnx.Optimizer", "linen", "equinox", '"embeddings"', "state_dict()",
                   "err.overrides"):
        assert marker in text, marker


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error", category=UserWarning)  # no fallback warning expected
        # a block that checks the math at lr 1 is noted once; that note is no fallback
        warnings.simplefilter("ignore", category=LearningRateNotice)
        exec(compile(BLOCKS[index], f"{DOC.name}[block {index}]", "exec"), {})  # noqa: S102
    assert capsys.readouterr().out or "assert" in BLOCKS[index]
