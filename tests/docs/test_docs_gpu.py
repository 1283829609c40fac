"""Every code block of docs/gpu.md runs as written (python blocks, and bash commands).

The bash blocks run with this interpreter's ``bin`` first on ``PATH`` (as in the project's
virtual environment) and the checkout on ``PYTHONPATH``; ``OUT_DIR`` is a temporary folder.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "gpu.md"
BLOCKS = re.findall(r"```(python|bash)\n(.*?)```", DOC.read_text(), flags=re.S)


def _env(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env.pop("SAGE_KERNELS", None)
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["OUT_DIR"] = str(tmp_path / "out")
    return env


def test_the_doc_has_blocks():
    assert [kind for kind, _ in BLOCKS].count("python") >= 2
    assert [kind for kind, _ in BLOCKS].count("bash") >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_block_runs(index, tmp_path):
    kind, code = BLOCKS[index]
    if kind == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code.replace("OUT_DIR", '"$OUT_DIR"')]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    if "SAGE_KERNELS=off" in code:
        assert proc.stdout.strip() == "jnp"  # what the doc says it prints
    if "validated(" in code:
        assert proc.stdout.strip().endswith("False")
