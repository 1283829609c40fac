"""What a newcomer meets in the README and docs/ (issue 34), checked without running them.

* Installs come from a checkout or a built wheel: nothing is published on PyPI, so
  ``pip install 'sage-optim[jax]'`` fails as written.
* Each README Python block imports only what the extra it names installs (by default the
  ``[jax]`` extra of the Quick start; ``[torch]`` in the PyTorch section): the second Quick
  start block uses ``flax.nnx``, which ``[jax]`` does not install.
* A local multi-process command says how many steps (the default 300 took 12.7 minutes on
  2 CPU cores) and deals with Gloo's connection notices.
* PyTorch is installed as ``make test`` installs it: the pinned CPU build first (an unpinned
  line gave whatever torch the index held, not the one the tests ran on).
"""

from __future__ import annotations

import re
import sys
import tomllib

from test_docs_blocks import PAGES, ROOT

from sage_optim.extras import EXTRAS

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.S | re.M)
OURS = {"sage_optim", "sage_optax", "sage_torch", "sage_train", "sage_repro"}
ALL_PAGES = [*PAGES, ROOT / "docs" / "gpu.md", ROOT / "docs" / "routing.md"]


def blocks(kind: str):
    for page in ALL_PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == kind:
                yield page, text, m


def shell_lines():
    for page, _, m in blocks("bash"):
        body = m.group(2).replace("\\\n", " ")
        for line in body.splitlines():
            yield page, line.split("#", 1)[0] if "pip" in line else line


def test_installs_are_from_a_checkout_or_a_wheel():
    installs = [(p.name, line) for p, line in shell_lines()
                if re.search(r"pip install .*sage[-_]optim", line) or "pip install -e" in line]
    assert installs, "the README shows how to install"
    for page, line in installs:
        assert "'sage-optim[" not in line and '"sage-optim[' not in line, (page, line)
    readme = (ROOT / "README.md").read_text()
    assert "pip install -e '.[jax]'" in readme and "python -m build --wheel" in readme
    for page in ALL_PAGES:  # prose too
        for line in page.read_text().splitlines():
            assert "pip install 'sage-optim[" not in line, (page.name, line)


def _imports(code: str) -> set[str]:
    names = set(re.findall(r"^\s*from\s+([A-Za-z_]\w*)", code, flags=re.M))
    for line in re.findall(r"^\s*import\s+(.+)$", code, flags=re.M):
        names |= {part.strip().split(".")[0].split(" ")[0] for part in line.split(",")}
    return names


def test_readme_blocks_import_what_their_extra_installs():
    text = (ROOT / "README.md").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    assert any(r.startswith("flax") for r in extras["train"])
    checked = 0
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        before = text[:m.start()].rstrip()
        paragraph = before.rsplit("\n\n", 1)[-1]
        section = before.rsplit("\n## ", 1)[-1].split("\n", 1)[0]
        named = re.findall(r"`\[(\w+)\]`", paragraph)
        extra = named[0] if named else ("torch" if "PyTorch" in section else "jax")
        provided = {m.split(".")[0] for m in EXTRAS[extra]}
        third_party = _imports(m.group(1)) - OURS - set(sys.stdlib_module_names)
        assert third_party <= provided, (section, extra, third_party - provided)
        checked += 1
    assert checked >= 3


def test_local_multi_process_commands_are_short_and_quiet():
    local = [(p.name, line) for p, line in shell_lines()
             if "--num-processes" in line and "127.0.0.1" in line]
    assert local
    for page, line in local:
        assert "--steps" in line, (page, line)
        assert "Gloo" in line, (page, line)
    for page in {p for p, _ in local}:
        text = next(q for q in ALL_PAGES if q.name == page).read_text()
        assert "[Gloo]" in text and "not errors" in text, page


def test_torch_is_installed_as_make_test_installs_it():
    """Every line that installs torch itself pins the Makefile's version, from the CPU
    wheel index (or before the extra that needs it), as `make test` does."""
    pinned = re.search(r"^TORCH\s*:=\s*(torch==\S+)", (ROOT / "Makefile").read_text(),
                       flags=re.M).group(1)
    lines = [(p.name, line) for p, line in shell_lines()
             if re.search(r"pip install (\S+ )*torch\b", line)]
    assert lines, "the README shows how to install PyTorch's CPU build"
    for page, line in lines:
        assert pinned in line.split(), (page, line, pinned)
        assert "--index-url https://download.pytorch.org/whl/cpu" in line, (page, line)


# --------------------------------------------------------------------------------------------
# The README is a page a newcomer finishes (issue 45)

README_LIMIT = 250


def test_the_readme_is_a_page():
    """At most 250 lines: what it is, the two commands, install, a Quick start per entry
    point, the configurations, links into docs/ for everything else."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LIMIT, len(text.splitlines())
    headings = re.findall(r"^## (.*)$", text, flags=re.M)
    for heading in ("Install", "Quick start: Optax", "Quick start: PyTorch",
                    "Quick start: `sage-train`", "The eight configurations", "Documentation",
                    "Citation"):
        assert heading in headings, heading
    assert "make demo" in text and "make test" in text
    from sage_optim.presets import CONFIG_NAMES

    table = text.split("## The eight configurations")[1].split("\n## ")[0]
    for name in CONFIG_NAMES:
        assert f"| `{name}` |" in table, name


def test_the_readme_names_what_ci_runs():
    """The README's test command is what `.ci/run` and the Makefile's `test` target run."""
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^test:", (ROOT / "Makefile").read_text(), flags=re.M)
    assert "`make test` is exactly what CI runs (`.ci/run`)" in (ROOT / "README.md").read_text()


def test_the_readme_links_resolve_and_reach_every_doc_page():
    text = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    local = [link for link in links if "://" not in link]
    missing = [link for link in local if not (ROOT / link).exists()]
    assert not missing, missing
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md")
                   if p.name not in ("README.md", "index.md"))
    unlinked = [page for page in pages if f"docs/{page}" not in local]
    assert not unlinked, f"README.md links to no docs/{unlinked}"


def test_the_readme_says_the_package_is_not_published():
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "not published on PyPI" in text
    for page in ALL_PAGES:
        for line in page.read_text().splitlines():
            assert not re.search(r"pip install ['\"]?sage[-_]optim\b(?!\.|-)", line) or \
                "not published" in line or "finds nothing" in line, (page.name, line)


def test_the_gpu_install_line_installs_what_its_commands_need():
    """The GPU line names the trainer's extra with the CUDA one: `.[cuda]` alone gives no
    sage-train (issue 45)."""
    lines = [(p.name, line) for p, line in shell_lines()
             if re.search(r"pip install .*cuda", line)]
    assert lines
    for page, line in lines:
        assert "[train,cuda]" in line or ("[train]" in line and "jax[cuda" in line), (page, line)


def test_docs_index_lists_every_page():
    """The Sphinx index's table of contents holds every page of docs/."""
    index = (ROOT / "docs" / "index.md").read_text()
    trees = "\n".join(re.findall(r"```\{toctree\}(.*?)```", index, flags=re.S))
    listed = {line.strip() for line in trees.splitlines() if line.strip()
              and not line.strip().startswith(":")}
    for page in sorted((ROOT / "docs").glob("*.md")):
        if page.name not in ("README.md", "index.md"):
            assert page.stem in listed, page.name
