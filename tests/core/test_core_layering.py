"""The packages depend one way: sage_optim (no framework) <- sage_optax (JAX) and sage_torch
(PyTorch) <- sage_repro and sage_train.  Every import statement counts, also the lazy ones
inside functions, so a framework cannot slip in through a rarely used code path."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
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
    # the trainer's framework-free pieces, read by torch-only code (benchmarks, sage_repro)
    ("sage_train.model_shapes", ("jax", "flax", "torch", "sage_optax", "sage_torch")),
    ("sage_train.cli_args", ("jax", "flax", "torch", "sage_optax", "sage_torch")),
])
def test_importing_a_package_loads_no_other_framework(package, absent):
    code = (f"import sys, {package}; "
            f"print(','.join(m for m in {absent!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True).stdout.strip()
    assert out == "", f"importing {package} loaded {out}"


def torch_import_graph() -> dict[str, set[str]]:
    """``module -> the sage_torch modules it imports`` (:func:`import_graph`)."""
    return import_graph("sage_torch")


def import_graph(pkg: str) -> dict[str, set[str]]:
    """``module -> the modules of package ``pkg`` it imports`` (``pkg`` is the package's
    ``__init__``), every import statement counted, the lazy ones too."""
    package = ROOT / pkg
    modules = {p.stem for p in package.glob("*.py")} - {"__init__"}

    def name(path: pathlib.Path) -> str:
        return pkg if path.stem == "__init__" else f"{pkg}.{path.stem}"

    graph: dict[str, set[str]] = {}
    for path in sorted(package.glob("*.py")):
        edges = graph.setdefault(name(path), set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    base = pkg + (f".{base}" if base else "")
                targets = [f"{base}.{a.name}" if base == pkg and a.name in modules
                           else base for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                if parts[0] == pkg:
                    edges.add(".".join(parts[:2]))
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (its modules in order, the first repeated), or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def algorithm_modules() -> set[str]:
    """The sage_torch modules that define an update rule (a subclass of ``UpdateRule``)."""
    found = set()
    for path in (ROOT / "sage_torch").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id == "UpdateRule" for b in node.bases):
                found.add(f"sage_torch.{path.stem}")
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_the_base_optimizer_imports_no_algorithm():
    """As torch.optim.Optimizer, RuleOptimizer knows no algorithm: the rules register."""
    graph = torch_import_graph()
    algorithms = algorithm_modules()
    assert algorithms == {f"sage_torch.{m}" for m in
                          ("adamw", "apollo", "lion", "sage", "sinkgd", "unit_norm")}
    for base in ("sage_torch.optimizer", "sage_torch.registry", "sage_torch.common",
                 "sage_torch.fused_check"):
        below = reachable(graph, base)
        assert not below & (algorithms | {"sage_torch"}), (
            f"{base} imports {sorted(below & (algorithms | {'sage_torch'}))}")


def test_the_cycle_check_can_fail(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_every_shared_rule_is_registered_once_per_optimizer():
    torch = pytest.importorskip("torch")
    import sage_torch
    from sage_optim.presets import RULE_DEFAULTS
    from sage_torch import registry

    classes = registry.rule_classes()
    assert set(classes) == set(RULE_DEFAULTS)
    assert {c.__module__ for c in classes.values()} == algorithm_modules()
    with pytest.raises(ValueError, match="two rule classes named 'sage'"):
        registry.register(type("OtherSage", (classes["adamw"],), {"name": "sage"}))
    projection = sage_torch.gaussian_projection(3)
    w = torch.nn.Parameter(torch.ones(4, 4))
    a = sage_torch.APOLLO([w], projection=projection)
    b = sage_torch.APOLLO([w])
    assert a.rule_of(a.param_groups[0]).projection is projection
    assert b.rule_of(b.param_groups[0]).projection is None
    assert set(a._rules) == set(RULE_DEFAULTS)
    assert not {id(r) for r in a._rules.values()} & {id(r) for r in b._rules.values()}


def test_the_torch_optimizer_base_knows_no_routing():
    """As ``torch.optim.Optimizer`` knows no algorithm, ``RuleOptimizer`` knows no routing:
    the routing of groups added later lives in ``sage_torch.grouping`` (issue 28)."""
    modules = set()
    for node in ast.walk(ast.parse((ROOT / "sage_torch" / "optimizer.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            modules.add(node.module)
            modules |= {f"{node.module}.{alias.name}" for alias in node.names}
    routing = {"sage_torch.routing", "sage_torch.grouping", "sage_torch.configs",
               "sage_optim.routing"}
    assert not modules & routing, sorted(modules & routing)


@pytest.mark.parametrize(
    "package", ["sage_optim", "sage_optax", "sage_torch", "sage_train", "sage_repro"])
def test_no_package_imports_its_modules_in_a_cycle(package):
    """No module of any package imports, through others of its package, itself (issue 32).

    Every import statement counts, the lazy ones inside functions too: a lazy import only
    hides a cycle from the interpreter, not from a reader.
    """
    # an import of the package itself (its __init__) closes no cycle of its modules
    graph = {m: e - {package} for m, e in import_graph(package).items()}
    cycle = find_cycle(graph)
    assert cycle is None, f"{package} modules import each other in a cycle: {' -> '.join(cycle)}"
