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
    readme = (ROOT / "README.md").read_text()
    assert "[Gloo]" in readme and "not errors" in readme


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
