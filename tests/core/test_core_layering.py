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
    for path in sorted((ROOT / package).rglob("*.py")):
        hits = imported_roots(path) & FORBIDDEN[package]
        if hits:
            bad[str(path.relative_to(ROOT))] = sorted(hits)
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
    ("sage_train.model.shapes", ("jax", "flax", "torch", "sage_optax", "sage_torch")),
    ("sage_train.job.cli_args", ("jax", "flax", "torch", "sage_optax", "sage_torch")),
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


def module_name(path: pathlib.Path) -> str:
    """The dotted name of the module at ``path`` (a package's ``__init__``: the package)."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(pkg: str) -> dict[str, set[str]]:
    """``module -> the modules of package ``pkg`` it imports`` (a package is its
    ``__init__``), subpackages included, every import statement counted, the lazy ones too."""
    paths = sorted((ROOT / pkg).rglob("*.py"))
    modules = {module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path)
        here = name if path.stem == "__init__" else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from . import x, from .x import y
                    anchor = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1)
                            if ".".join(parts[:k]) in modules), None)
                if hit is not None and hit != name:
                    edges.add(hit)
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
    for path in (ROOT / "sage_torch").rglob("*.py"):
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


# --------------------------------------------------------------- the routing adapters (issue 44)

OPTIMIZER_PACKAGES = ("sage_optim", "sage_optax", "sage_torch")
"""The packages whose routing knows only generic evidence outside their ``adapters``."""

OTHER_CLASSES = {"Conv1D", "XLNetRelativeAttention", "ParamWrapper", "GRUCell", "LSTMCell",
                 "PReLU"}
"""Classes of other libraries that an adapter reads besides the mixture-of-experts tables."""


def adapted_libraries() -> set[str]:
    """The libraries with an adapter: ``<package>/adapters/<library>.py``."""
    return {p.stem for pkg in OPTIMIZER_PACKAGES for p in (ROOT / pkg / "adapters").glob("*.py")
            if p.stem != "__init__"}


def adapted_classes() -> set[str]:
    """Every third-party class an adapter knows: the keys of the transformers adapter's
    tables (``mixtral.modeling_mixtral.MixtralExperts``) and their class names, and
    :data:`OTHER_CLASSES`."""
    tree = ast.parse((ROOT / "sage_torch" / "adapters" / "transformers.py").read_text())
    keys = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and ".modeling_" in n.value and " " not in n.value}
    return keys | {k.rpartition(".")[2] for k in keys} | OTHER_CLASSES


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            ids.add(id(body[0].value))
    # attribute docstrings: a string expression right after an assignment
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for stmt in body if isinstance(body, list) else ():
            if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
                ids.add(id(stmt.value))
    return ids


def third_party_names(source: str, libraries: set[str], classes: set[str]) -> set[str]:
    """The names of other libraries' modules and classes that ``source`` binds to: imports
    of the libraries, identifiers that are a class or hold a library's name as a word
    (``is_equinox_module``), and strings (not docstrings or prose) that are a class, a
    table key or a dotted path into a library (``"transformers.pytorch_utils"``)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = set()

    def library_word(name: str) -> bool:
        return bool(libraries & set(name.lower().split("_")))

    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] in libraries}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in libraries:
                found.add(node.module)
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        elif isinstance(node, ast.FunctionDef | ast.ClassDef | ast.AsyncFunctionDef):
            names = [node.name]
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docs):
            text = node.value
            if text in classes or text.split(".")[0] in libraries and " " not in text:
                found.add(text)
        found |= {n for n in names if n in classes or library_word(n)}
    return found


def test_no_module_outside_the_adapters_names_another_librarys_model():
    """Routing knows generic evidence; other libraries' models live in their adapter
    (``<package>/adapters/<library>.py``), loaded once that library is imported."""
    libraries, classes = adapted_libraries(), adapted_classes()
    assert {"transformers", "peft", "equinox"} <= libraries
    assert {"MixtralExperts", "DbrxExpertGLU", "Conv1D"} <= classes
    bad = {}
    for pkg in OPTIMIZER_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "adapters" in path.relative_to(ROOT).parts:
                continue
            hits = third_party_names(path.read_text(), libraries, classes)
            if hits:
                bad[str(path.relative_to(ROOT))] = sorted(hits)
    assert not bad, f"other libraries' modules or classes named outside the adapters: {bad}"


def test_the_adapter_scan_can_fail():
    """Each kind of naming is found; docstrings and prose are not."""
    libraries, classes = {"transformers", "equinox"}, {"Conv1D"}
    source = '''"""Reads transformers' Conv1D."""
import equinox as eqx
from transformers.pytorch_utils import Conv1D
def is_equinox_module(x):
    """equinox"""
    return getattr(sys.modules.get("transformers.pytorch_utils"), "Conv1D", None)
MESSAGE = "transformers' Conv1D stores it (in, out)"
'''
    assert third_party_names(source, libraries, classes) == {
        "equinox", "transformers.pytorch_utils", "Conv1D", "is_equinox_module"}
    assert third_party_names('"""transformers' + "' Conv1D" + '"""\nx = 1\n',
                             libraries, classes) == set()

# --------------------------------------------------------------------------------------------
# The trainer, grouped by concern (issue 44)

TRAINER_LAYERS: tuple[str, ...] = ("job", "store", "model", "data", "hf", "run", "")
"""``sage_train``'s subpackages, lowest first; ``""`` is the top (``cli``, ``commands``).
A module imports only from its own subpackage and the ones before it."""

IO_MODULES = ("sage_train.hf", "sage_train.store", "sage_train.data")
"""The trainer's subpackages that read and write files (checkpoints, run directories,
reports, token stores, Hugging Face checkpoints)."""


def trainer_layer(module: str) -> str:
    """The subpackage of a ``sage_train`` module (``""``: a module at the top)."""
    rest = module.split(".")[1:]
    return rest[0] if rest and rest[0] in TRAINER_LAYERS[:-1] else ""


def upward_arrows(graph: dict[str, set[str]], layers: tuple[str, ...] = TRAINER_LAYERS,
                  layer=trainer_layer) -> list[tuple[str, str]]:
    """The edges of ``graph`` from a module to one of a later (higher) layer."""
    rank = {name: i for i, name in enumerate(layers)}
    return sorted((a, b) for a, edges in graph.items() for b in edges
                  if rank[layer(b)] > rank[layer(a)])


def test_the_trainer_is_grouped_by_concern_with_no_upward_arrow():
    """Every module lives in a subpackage but the commands on top; no subpackage imports
    one above it (lazy imports counted)."""
    package = ROOT / "sage_train"
    subpackages = {p.parent.name for p in package.glob("*/__init__.py")}
    assert subpackages == set(TRAINER_LAYERS[:-1])
    top = sorted(p.stem for p in package.glob("*.py"))
    assert top == ["__init__", "__main__", "cli", "commands"]
    graph = import_graph("sage_train")
    assert not upward_arrows(graph), upward_arrows(graph)
    assert find_cycle(graph) is None


def test_the_upward_check_can_fail():
    graph = {"sage_train.store.rundir": {"sage_train.job.errors"},
             "sage_train.job.errors": {"sage_train.run.config"},
             "sage_train.cli": {"sage_train.run.config"}}
    assert upward_arrows(graph) == [("sage_train.job.errors", "sage_train.run.config")]


def test_the_settings_import_no_io_module():
    """``sage_train.run.config`` (the settings) reaches no module that reads or writes files."""
    graph = import_graph("sage_train")
    below = reachable(graph, "sage_train.run.config")
    assert not {m for m in below if m.startswith(IO_MODULES)}, sorted(below)
    assert "sage_train.run.config" in reachable(graph, "sage_train.run.resolve")  # can fail


def sage_optax_public() -> set[str]:
    """``sage_optax.__all__``, read from its source (nothing imported)."""
    tree = ast.parse((ROOT / "sage_optax" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    raise AssertionError("sage_optax has no __all__")


def private_sage_optax_uses(path: pathlib.Path, public: set[str]) -> list[str]:
    """The names of ``sage_optax`` that ``path`` imports or reads that are not public: a
    submodule imported (``from sage_optax.sinkgd import ...``), a name not in
    ``__all__`` (``from sage_optax import routing``, ``sage_optax.routing.iter_leaves``)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            bad += [a.name for a in node.names if a.name.startswith("sage_optax.")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith("sage_optax."):
                bad.append(node.module)
            elif node.module == "sage_optax":
                bad += [f"sage_optax.{a.name}" for a in node.names if a.name not in public]
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "sage_optax" and node.attr not in public):
            bad.append(f"sage_optax.{node.attr}")
    return bad


def test_the_trainer_imports_only_public_sage_optax_names():
    public = sage_optax_public()
    bad = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "sage_train").rglob("*.py"))
           if (found := private_sage_optax_uses(p, public))}
    assert not bad, f"sage_train uses sage_optax names outside sage_optax.__all__: {bad}"


def test_the_public_name_check_can_fail(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import sage_optax\nfrom sage_optax.sinkgd import IMPLS\n"
                      "from sage_optax import make_optimizer, placement\n"
                      "def f():\n    return sage_optax.routing.iter_leaves, sage_optax.unbox\n")
    assert private_sage_optax_uses(module, {"make_optimizer", "unbox"}) == [
        "sage_optax.sinkgd", "sage_optax.placement", "sage_optax.routing"]
