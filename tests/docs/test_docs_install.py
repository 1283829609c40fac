"""Installs per framework: what each extra brings, and that each part runs without the others.

* Import isolation: subprocesses whose import system cannot see JAX (or PyTorch, or either)
  -- a wrapper around every ``sys.meta_path`` finder hides those packages, so ``import jax``
  raises ``ModuleNotFoundError`` and ``importlib.util.find_spec("jax")`` is ``None``, as
  when it is not installed -- import a package and take an optimizer step.
* Console scripts: each one, resolved from ``pyproject.toml`` as pip's generated script
  does, prints one line naming its extra and exits 1 when that extra is hidden.
* Packaging: the sdist (built from the checkout's files) and the wheel (built from that
  sdist) hold what they must; the wheel is then installed by pip, offline, into fresh
  virtual environments that hold only NumPy (base) or PyTorch and its requirements
  (``[torch]``): pip resolves the wheel's metadata there, so a base or PyTorch-only install
  that needed JAX would fail, and the installed package and console scripts run.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import textwrap
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
PACKAGES = ("sage_optim", "sage_optax", "sage_torch", "sage_repro", "sage_train")
JAX_SIDE = ("jax", "jaxlib", "optax", "flax", "orbax", "chex", "equinox")
TORCH_SIDE = ("torch", "triton", "transformers", "peft", "x_transformers")

# Runs first in every subprocess: the named top-level packages cannot be found.
HIDE = """
import sys

HIDDEN = frozenset({hidden!r})


class _Hide:
    '''A sys.meta_path finder that finds what the finder it wraps finds, less HIDDEN.'''

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        find = getattr(self._finder, "find_spec", None)
        return None if find is None else find(name, path, target)

    def __getattr__(self, attr):
        return getattr(self._finder, attr)


sys.meta_path[:] = [_Hide(finder) for finder in sys.meta_path]
for _name in HIDDEN:
    try:
        __import__(_name)
    except ModuleNotFoundError:
        pass
    else:
        raise SystemExit(f"hiding {{_name}} failed")
"""

CHECK_NONE_LOADED = """
loaded = sorted(m for m in sys.modules if m.partition(".")[0] in HIDDEN)
assert not loaded, f"imported what is hidden: {loaded}"
print("OK")
"""


def run_hidden(hidden: tuple[str, ...], code: str, *, check_none_loaded: bool = False):
    """Run ``code`` in a fresh interpreter (cwd: the checkout) with ``hidden`` unimportable.

    ``check_none_loaded``: then assert that nothing hidden was imported and print ``OK``.
    """
    script = HIDE.format(hidden=tuple(hidden)) + IMPORT_ALL + textwrap.dedent(code)
    if check_none_loaded:
        script += CHECK_NONE_LOADED
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "COV_"))}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=240)


def assert_ok(proc) -> None:
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("OK"), (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")


IMPORT_ALL = """
import importlib, pkgutil


def import_all(package):
    pkg = importlib.import_module(package)
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name != "__main__":
            importlib.import_module(f"{package}.{info.name}")
"""


# --------------------------------------------------------------------------------------------
# Import isolation


def test_sage_torch_runs_without_jax():
    proc = run_hidden(JAX_SIDE, """
    import torch
    import sage_optim, sage_torch
    from sage_optim.extras import missing

    assert missing(["jax", "optax", "torch"]) == ["jax", "optax"]

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(40, 8)
            self.up = torch.nn.Linear(8, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.lm_head = torch.nn.Linear(16, 40, bias=False)

        def forward(self, tokens):
            return self.lm_head(self.norm(torch.tanh(self.up(self.embed(tokens)))))

    torch.manual_seed(0)
    model = TinyLM()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = sage_torch.make_optimizer("sage-hybrid", model)
    tokens = torch.arange(12) % 40
    loss = torch.nn.functional.cross_entropy(model(tokens), (tokens + 1) % 40)
    loss.backward()
    opt.step()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all() and not torch.equal(p, before[name]), name
    print(sage_torch.routing_table("sage-hybrid", model))
    import_all("sage_optim")
    import_all("sage_torch")
    """, check_none_loaded=True)
    assert_ok(proc)
    assert "embed.weight" in proc.stdout and "sinkgd" in proc.stdout


def test_sage_optax_runs_without_torch():
    proc = run_hidden(TORCH_SIDE, """
    import jax, jax.numpy as jnp, numpy as np, optax
    import sage_optim, sage_optax

    params = {"tok": {"embedding": jax.random.normal(jax.random.key(0), (40, 8))},
              "mlp": {"kernel": jax.random.normal(jax.random.key(1), (8, 16))},
              "norm": {"scale": jnp.ones(16)}}
    tx = sage_optax.make_optimizer("sage-hybrid")
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape),
                         params)
    updates, state = tx.update(grads, state, params)
    new = optax.apply_updates(params, updates)
    for path, (a, b) in zip(jax.tree_util.tree_leaves_with_path(params),
                            zip(jax.tree.leaves(params), jax.tree.leaves(new))):
        assert np.isfinite(b).all() and not np.array_equal(a, b), path
    print(sage_optax.routing_table("sage-hybrid", params))
    import_all("sage_optim")
    import_all("sage_optax")
    """, check_none_loaded=True)
    assert_ok(proc)
    assert "tok.embedding" in proc.stdout


def test_sage_optim_needs_neither_framework():
    proc = run_hidden(JAX_SIDE + TORCH_SIDE + ("numpy",), """
    import sage_optim
    from sage_optim import CONFIG_NAMES, get_preset
    from sage_optim.extras import EXTRAS, missing
    from sage_train.model.shapes import get_model_config  # framework-free, beside the trainer
    from sage_optim.routing import Route

    assert [get_preset(name).name for name in CONFIG_NAMES] == list(CONFIG_NAMES)
    assert get_model_config("270m").param_count() > 0
    Route("dense", fan_in=0, fan_out=1)
    assert missing(["jax", "torch", "json"]) == ["jax", "torch"]
    import_all("sage_optim")
    # the reproduction package and its JAX-free modules import without a framework too
    import sage_repro, sage_repro.paper, sage_repro.traffic, sage_repro.memory_report
    import sage_repro.commands, sage_repro.sweep, sage_repro.sweep_report, sage_repro.pieces
    """, check_none_loaded=True)
    assert_ok(proc)


# --------------------------------------------------------------------------------------------
# Console scripts without their extra

SCRIPTS = PROJECT["scripts"]
CHECKOUT = "in a sage-optim checkout"
MESSAGES = {
    "sage-memory": f"sage-memory needs the [jax] extra: pip install -e '.[jax]' {CHECKOUT}",
    "sage-parity": ("sage-parity needs the [jax,torch] extras: "
                    f"pip install -e '.[jax,torch]' {CHECKOUT}"),
    "sage-repro": f"sage-repro needs the [train] extra: pip install -e '.[train]' {CHECKOUT}",
    "sage-train": f"sage-train needs the [train] extra: pip install -e '.[train]' {CHECKOUT}",
}


@pytest.mark.parametrize(("package", "hidden", "extra", "absent"), [
    ("sage_optax", JAX_SIDE, "jax", "jax, optax"),
    ("sage_optax", ("optax",), "jax", "optax"),
    ("sage_torch", TORCH_SIDE, "torch", "torch"),
])
def test_import_without_its_framework_names_the_extra(package, hidden, extra, absent):
    """``import sage_optax`` without JAX: one line naming the extra (issue 34), raised as a
    ModuleNotFoundError (an ImportError: code that falls back on another framework still
    catches it), not a raw error from deep inside a module."""
    proc = run_hidden(hidden, f"""
    try:
        import {package}
    except ModuleNotFoundError as e:
        print(repr(str(e)), e.name)
    """)
    assert proc.returncode == 0, proc.stderr
    message, _, name = proc.stdout.strip().rpartition(" ")
    assert eval(message) == (f"{package} needs the [{extra}] extra: pip install -e "
                             f"'.[{extra}]' {CHECKOUT} ({absent} not found)")
    assert name == absent.split(",")[0]


def test_every_script_has_a_message():
    assert set(SCRIPTS) == set(MESSAGES)


@pytest.mark.parametrize(("script", "hidden"), [
    ("sage-memory", JAX_SIDE),
    ("sage-parity", TORCH_SIDE),
    ("sage-parity", JAX_SIDE),
    ("sage-train", JAX_SIDE),
    ("sage-train", ("tokenizers",)),
    ("sage-repro", JAX_SIDE),
])
def test_script_without_its_extra_prints_one_line(script, hidden):
    module, _, function = SCRIPTS[script].partition(":")
    proc = run_hidden(hidden, f"""
    import importlib
    sys.argv = [{script!r}]
    sys.exit(getattr(importlib.import_module({module!r}), {function!r})())
    """)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", MESSAGES[script] + "\n")


@pytest.mark.parametrize(("module", "script", "hidden"), [
    ("sage_repro.memory_report", "sage-memory", JAX_SIDE),
    ("sage_repro.parity", "sage-parity", TORCH_SIDE),
    ("sage_train", "sage-train", JAX_SIDE),
    ("sage_repro", "sage-repro", JAX_SIDE),
])
def test_python_m_without_its_extra_prints_one_line(module, script, hidden):
    proc = run_hidden(hidden, f"""
    import runpy
    sys.argv = [{module!r}]
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
    """)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", MESSAGES[script] + "\n")


@pytest.mark.parametrize("module", ["sage_train", "sage_repro"])
def test_commands_start_without_their_on_demand_modules(module):
    """tensorboardX and safetensors are imported only by the options that check for them,
    tqdm only for progress bars (a GPU host without them still trains): ``--help`` runs with
    all three hidden."""
    proc = run_hidden(("tensorboardX", "safetensors", "tqdm"), f"""
    import runpy
    sys.argv = [{module!r}, "--help"]
    runpy.run_module({module!r}, run_name="__main__", alter_sys=True)
    """)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: "), proc.stderr


def test_llama_mode_names_transformers():
    proc = run_hidden(("transformers",), """
    from sage_repro.parity import main
    sys.exit(main(["--mode", "llama", "--steps", "1"]))
    """)
    assert (proc.returncode, proc.stderr) == (1, (
        "sage-parity --mode llama needs the [all] extra and transformers: "
        f"pip install -e '.[all]' {CHECKOUT}, then pip install transformers\n"))


# --------------------------------------------------------------------------------------------
# The metadata: base dependencies, extras, and the guard's table agree

IMPORT_TO_DIST = {"orbax.checkpoint": "orbax-checkpoint", "tensorboardX": "tensorboardx"}


def _name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0].lower()


def _resolve(extra: str) -> set[str]:
    """Distribution names an extra brings, self-references (``sage-optim[jax]``) expanded."""
    names = set()
    for req in PROJECT["optional-dependencies"][extra]:
        if _name(req) == PROJECT["name"]:
            inner = re.search(r"\[(.*)\]", req)
            assert inner, req
            for sub in inner.group(1).split(","):
                names |= _resolve(sub.strip())
        else:
            names.add(_name(req))
    return names


def test_base_install_needs_no_framework():
    assert [_name(r) for r in PROJECT["dependencies"]] == ["numpy"]


def test_extras_match_the_entry_guard():
    from sage_optim.extras import EXTRAS

    for extra, modules in EXTRAS.items():
        dists = {IMPORT_TO_DIST.get(m, m) for m in modules}
        assert dists == _resolve(extra), extra
    assert _resolve("all") == _resolve("jax") | _resolve("torch") | _resolve("train")
    for extra in ("jax", "torch", "train", "all", "cuda", "dev"):
        assert extra in PROJECT["optional-dependencies"], extra
    assert "torch" not in _resolve("train") and "jax" not in _resolve("torch")


def test_sage_optim_imports_only_the_standard_library():
    bad = {}
    for path in sorted((ROOT / "sage_optim").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0
                     and node.module else [])
            for name in names:
                root = name.partition(".")[0]
                if root not in sys.stdlib_module_names and root != "sage_optim":
                    bad.setdefault(path.name, []).append(name)
    assert not bad


def test_make_test_pins_cpu_torch_before_the_editable_install():
    if shutil.which("make") is None:
        pytest.skip("no make")
    out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), ".venv/.dev-installed"],
                         capture_output=True, text=True, check=True).stdout
    lines = [line for line in out.splitlines() if "pip install" in line]
    torch_line = next(i for i, line in enumerate(lines) if "torch==2.13.0" in line)
    editable = next(i for i, line in enumerate(lines) if " -e " in line)
    assert torch_line < editable, out
    assert "'.[all,dev]'" in lines[editable], lines[editable]


def _makefile_torch_pin() -> str:
    return re.search(r"^TORCH\s*:=\s*torch==(\S+)", (ROOT / "Makefile").read_text(),
                     flags=re.M).group(1)


def test_the_makefile_pins_a_cpu_only_torch_wheel():
    """The pin names the CPU build's own version (local segment ``+cpu``): no index can
    resolve it to a CUDA wheel, as a plain ``torch==2.13.0`` resolves on PyPI (issue 45)."""
    version = _makefile_torch_pin()
    assert version.endswith("+cpu"), version
    text = (ROOT / "Makefile").read_text()
    assert "--index-url $(TORCH_CPU_INDEX)" in text
    assert "TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu" in text


def test_the_installed_torch_is_the_makefiles_cpu_wheel():
    """What ``make test`` resolved: the installed distribution's version carries the pin's
    local segment and the build has no CUDA (``torch.version.cuda is None``)."""
    pytest.importorskip("torch")
    import torch

    installed = importlib.metadata.version("torch")
    if installed.partition("+")[0] != _makefile_torch_pin().partition("+")[0]:
        pytest.skip(f"torch {installed} was not installed by the Makefile's pin")
    assert installed == _makefile_torch_pin(), installed
    assert torch.version.cuda is None, torch.version.cuda


def test_make_demo_shows_progress_while_it_installs():
    """No silent minute (issue 45): each install step is announced, the long ones show pip's
    progress (not --quiet), and setuptools' boxed editable-install notice is filtered."""
    if shutil.which("make") is None:
        pytest.skip("no make")
    for target in (".venv/.core-installed", ".venv/.dev-installed"):
        out = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target],
                             capture_output=True, text=True, check=True).stdout
        lines = out.splitlines()
        editable = next(i for i, line in enumerate(lines) if " -e " in line)
        assert "--quiet" not in lines[editable] and " -q " not in lines[editable], out
        assert "--progress-bar on" in lines[editable], out
        assert "PYTHONWARNINGS=ignore::UserWarning" in lines[editable], out
        assert lines[editable - 1].startswith("echo "), out


def test_the_cuda_extra_matches_jax_current_gpu_wheels():
    """``[cuda]`` installs the CUDA 13 wheels (jax 0.11.2's GPU machines run CUDA 13)."""
    assert PROJECT["optional-dependencies"]["cuda"] == ["jax[cuda13]"]


# --------------------------------------------------------------------------------------------
# sdist and wheel


def _checkout_files() -> list[str]:
    """The repository's files: tracked ones and new ones git does not ignore."""
    if (ROOT / ".git").exists() and shutil.which("git"):
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], cwd=ROOT, capture_output=True,
                             check=True).stdout.decode()
        # docs/_build is `make docs`'s output, not a source
        return sorted(f for f in out.split("\0") if f and (ROOT / f).is_file()
                      and not f.startswith("docs/_build/"))
    skip = {".venv", ".git", "build", "dist", "runs", "_build", "__pycache__", ".pytest_cache",
            ".mypy_cache", ".ruff_cache", ".ipynb_checkpoints"}
    return sorted(str(p.relative_to(ROOT)) for p in ROOT.rglob("*")
                  if p.is_file() and not skip & set(p.relative_to(ROOT).parts)
                  and ".egg-info" not in str(p))


def _build(out: pathlib.Path) -> dict:
    pytest.importorskip("build")
    src = out / "src"
    for name in _checkout_files():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    # sdist first, then the wheel from the unpacked sdist (what pip does with an sdist)
    proc = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir",
                           str(out / "dist"), str(src)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"sdist": str(next((out / "dist").glob("*.tar.gz"))),
            "wheel": str(next((out / "dist").glob("*.whl"))),
            "log": proc.stdout + proc.stderr, "files": _checkout_files()}


@pytest.fixture(scope="session")
def built(tmp_path_factory, worker_id):
    """sdist and wheel, built once per test session (shared by the xdist workers)."""
    if worker_id == "master":
        return _build(tmp_path_factory.mktemp("build"))
    shared = tmp_path_factory.getbasetemp().parent / "sage-build"
    shared.mkdir(exist_ok=True)
    with open(shared / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        done = shared / "built.json"
        if not done.exists():
            done.write_text(json.dumps(_build(shared)))
        return json.loads(done.read_text())


def _readme_links(path: pathlib.Path) -> set[str]:
    base = path.parent.relative_to(ROOT)
    links = set()
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()):
        if "://" not in target:
            links.add(os.path.normpath(base / target))
    return links


def test_sdist_holds_docs_tests_and_what_the_readme_links_to(built):
    with tarfile.open(built["sdist"]) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
    needed = {"README.md", "LICENSE", "CHANGELOG.md", "CITATION.cff", "pyproject.toml",
              "MANIFEST.in", "Makefile", "docs/conf.py", "docs/index.md"}
    needed |= {f for f in built["files"] if f.startswith(("docs/", "tests/", *PACKAGES))}
    needed |= _readme_links(ROOT / "README.md")
    for doc in (ROOT / "docs").glob("*.md"):
        needed |= _readme_links(doc)
    assert not needed - names, sorted(needed - names)
    assert not [n for n in names if "__pycache__" in n or n.startswith("docs/_build")]


def test_wheel_holds_the_five_packages_typed(built):
    with zipfile.ZipFile(built["wheel"]) as whl:
        names = set(whl.namelist())
        info = next(n.partition("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = whl.read(f"{info}/METADATA").decode()
        entry_points = whl.read(f"{info}/entry_points.txt").decode()
        license_text = whl.read(f"{info}/licenses/LICENSE").decode()
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, package
        sources = {f for f in built["files"] if f.startswith(f"{package}/") and f.endswith(".py")}
        assert sources and not sources - names, (package, sorted(sources - names))
    assert {n.partition("/")[0] for n in names} == {*PACKAGES, info}
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
    assert license_text == (ROOT / "LICENSE").read_text()
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert [r for r in requires if "extra ==" not in r] == ["Requires-Dist: numpy>=1.26"]
    for script, target in SCRIPTS.items():
        assert f"{script} = {target}" in entry_points
    for key in ("Homepage", "Documentation", "Changelog", "Issues"):
        assert f"Project-URL: {key}, https://" in metadata, key


def test_build_has_no_deprecation_warning(built):
    """setuptools warns about a ``license`` table or License classifiers (PEP 639)."""
    assert "deprecat" not in built["log"].lower(), built["log"]


def test_license_is_the_apache_2_0_text():
    copyright_line, _, text = (ROOT / "LICENSE").read_text().partition("\n")
    assert copyright_line == "Copyright 2026 The sage-optim developers"
    # the MD5 of https://www.apache.org/licenses/LICENSE-2.0.txt, byte for byte
    assert hashlib.md5(text.encode()).hexdigest() == "3b83ef96387f14655fc854ddc3c6bd57"


# --------------------------------------------------------------------------------------------
# Installing the wheel into fresh virtual environments, offline


def _closure(names: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``names`` need (their requirements, recursively)."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = list(names)
    while todo:
        name = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower().replace("_", "-")
        if key in seen:
            continue
        seen[key] = dist
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return list(seen.values())


def _venv_with(tmp: pathlib.Path, dists: list[str]) -> pathlib.Path:
    """A fresh venv holding only ``dists`` and their requirements (linked from this env)."""
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = env / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    site = site / "site-packages"
    for dist in _closure(dists):
        origin = pathlib.Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in tops:
            if (origin / top).exists() and not (site / top).exists():
                (site / top).symlink_to(origin / top)
    return env


def _pip_install(env: pathlib.Path, wheel: str, requirement: str) -> None:
    links = env.parent / "wheels"
    links.mkdir()
    shutil.copy(wheel, links)
    pip_env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    pip_env["PIP_CONFIG_FILE"] = os.devnull  # only the wheel above: no index, no config
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(env / "bin" / "python"), "install",
         "--no-index", "--find-links", str(links), "--no-compile", "--no-cache-dir",
         "--disable-pip-version-check", "--quiet", requirement],
        capture_output=True, text=True, env=pip_env, cwd=env.parent, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _run_in(env: pathlib.Path, *args: str, code: str | None = None):
    argv = [str(env / "bin" / "python"), "-c", textwrap.dedent(code)] if code else [
        str(env / "bin" / args[0]), *args[1:]]
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    return subprocess.run(argv, capture_output=True, text=True, cwd=env.parent, env=clean,
                          timeout=240)


def test_clean_venv_base_install(built, tmp_path):
    env = _venv_with(tmp_path, ["numpy"])
    _pip_install(env, built["wheel"], "sage-optim")
    proc = _run_in(env, code="""
        import importlib.util, sys
        import sage_optim, sage_repro
        assert sage_optim.__file__.startswith(sys.prefix), sage_optim.__file__
        for name in ("jax", "optax", "torch", "flax"):
            assert importlib.util.find_spec(name) is None, name
        try:
            import sage_torch
        except ModuleNotFoundError as err:
            assert err.name == "torch", err
        print(sage_optim.get_preset("sage-hybrid").name, "OK")
    """)
    assert_ok(proc)
    for script in ("sage-memory", "sage-parity", "sage-train"):
        proc = _run_in(env, script)
        assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", MESSAGES[script] + "\n")


def test_clean_venv_torch_install_has_no_jax(built, tmp_path):
    env = _venv_with(tmp_path, ["numpy", "torch"])
    _pip_install(env, built["wheel"], "sage-optim[torch]")
    proc = _run_in(env, code="""
        import importlib.util, sys
        import torch, sage_torch
        assert sage_torch.__file__.startswith(sys.prefix), sage_torch.__file__
        for name in ("jax", "jaxlib", "optax", "flax"):
            assert importlib.util.find_spec(name) is None, name
        model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 8))
        opt = sage_torch.make_optimizer("sage-hybrid", model)
        model(torch.arange(6)).square().mean().backward()
        opt.step()
        print("OK")
    """)
    assert_ok(proc)
    proc = _run_in(env, "sage-memory")
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", MESSAGES["sage-memory"] + "\n")
