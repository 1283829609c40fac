"""The packages depend one way: sage_optim (no framework) <- sage_optax (JAX) and sage_torch
(PyTorch) <- sage_repro and sage_train.  Every import statement counts, also the lazy ones
inside functions, so a framework cannot slip in through a rarely used code path."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
JAX_SIDE = {"jax", "jaxlib", "optax", "flax", "orbax"}
TORCH_SIDE = {"torch", "transformers"}
ABOVE = {"sage_repro", "sage_train"}
FORBIDDEN = {
    "sage_optim": JAX_SIDE | TORCH_SIDE | ABOVE | {"sage_optax", "sage_torch"},
    "sage_optax": TORCH_SIDE | ABOVE | {"sage_torch"},
    "sage_torch": JAX_SIDE | ABOVE | {"sage_optax"},
}


def imported_roots(path: pathlib.Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_only_what_is_below_it(package):
    bad = {}
    for path in sorted((ROOT / package).glob("*.py")):
        hits = imported_roots(path) & FORBIDDEN[package]
        if hits:
            bad[path.name] = sorted(hits)
    assert not bad, f"{package} imports what it must not: {bad}"


def test_the_scan_sees_lazy_imports(tmp_path):
    """The checker itself can fail: an import inside a function is found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch\n    from jax import numpy\n")
    assert imported_roots(module) == {"torch", "jax"}


@pytest.mark.parametrize(("package", "absent"), [
    ("sage_optim", ("jax", "torch")),
    ("sage_optax", ("torch", "sage_torch")),
    ("sage_torch", ("jax", "flax", "sage_optax")),
])
def test_importing_a_package_loads_no_other_framework(package, absent):
    code = (f"import sys, {package}; "
            f"print(','.join(m for m in {absent!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "", f"importing {package} loaded {out}"
