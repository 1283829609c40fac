"""Every console script survives a closed output pipe (``sage-memory | head``).

Each entry point of ``pyproject.toml`` runs in a subprocess whose stdout is a pipe already
closed by its reader: the command ends without a traceback (``BrokenPipeError``) and
without Python's "Exception ignored" line from the flush at exit.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
RUN = "import importlib, sys; m, f = sys.argv.pop(1).split(':'); " \
      "sys.exit(getattr(importlib.import_module(m), f)())"


def closed_pipe(entry: str, *args: str) -> subprocess.CompletedProcess[str]:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes anything
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    try:
        return subprocess.run([sys.executable, "-c", RUN, entry, *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, env=env, timeout=600,
                              cwd=ROOT)
    finally:
        os.close(write)


def test_every_console_script_is_covered():
    assert set(SCRIPTS) == {"sage-train", "sage-memory", "sage-parity", "sage-repro"}


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_help_into_a_closed_pipe_is_quiet(script):
    proc = closed_pipe(SCRIPTS[script], "--help")
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, (
        proc.stderr)
    assert proc.returncode in (0, 1), proc.stderr  # 1: a missing extra, or the closed pipe


def test_the_memory_table_into_a_closed_pipe_is_quiet():
    pytest.importorskip("jax")
    proc = closed_pipe(SCRIPTS["sage-memory"], "--models", "tiny")
    assert proc.stderr == "" and proc.returncode == 1
