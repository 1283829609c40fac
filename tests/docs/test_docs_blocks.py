"""The documentation runs: its Python blocks, its Sphinx build, its citation.

* Every ```python block of README.md and docs/ (docs/gpu.md and docs/routing.md have their
  own tests: tests/docs/test_docs_gpu.py, tests/docs/test_docs_routing.py) runs as written,
  each in a fresh namespace.  What cannot run on a CPU test machine (a GPU, a long training
  run) is a ```bash or ```text block instead.
* ``make docs``'s Sphinx build (MyST pages, the API reference from the docstrings) passes
  with ``-W``, and the API pages cover every name of each package's ``__all__``.
* CITATION.cff is valid enough for GitHub (cff-version 1.2.0) and names the same two papers,
  with the same years, as the README's BibTeX.
"""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
OWN_TESTS = {"gpu.md", "routing.md", "recipes.md"}  # tests/docs/test_docs_{gpu,routing,recipes}.py
PAGES = [ROOT / "README.md"] + sorted(
    p for p in (ROOT / "docs").rglob("*.md")
    if p.name not in OWN_TESTS and "_build" not in p.parts)
FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
BLOCKS = [(page, i, block) for page in PAGES
          for i, block in enumerate(FENCE.findall(page.read_text()))]


def _id(item) -> str:
    page, index, _ = item
    return f"{page.relative_to(ROOT)}[{index}]"


def test_the_pages_have_blocks():
    names = {page.name for page, _, _ in BLOCKS}
    assert {"README.md", "configurations.md"} <= names


@pytest.mark.parametrize("item", BLOCKS, ids=[_id(b) for b in BLOCKS])
def test_block_runs_as_written(item, capsys):
    page, index, block = item
    namespace = {"__name__": "__main__"}
    exec(compile(block, f"{page.relative_to(ROOT)}[python block {index}]", "exec"), namespace)
    out = capsys.readouterr().out
    if "print(" in block:
        assert out.strip(), "the block prints nothing"


def test_apollo_block_reproduces_the_paper(capsys):
    page = ROOT / "docs" / "configurations.md"
    (block,) = [b for b in FENCE.findall(page.read_text()) if '"apollo"' in b]
    exec(compile(block, "configurations.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.strip() == "1.208 GiB"


# --------------------------------------------------------------------------------------------
# Sphinx


def test_sphinx_build_has_no_warning(tmp_path):
    pytest.importorskip("sphinx")
    pytest.importorskip("myst_parser")
    out = tmp_path / "html"
    proc = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
         "-d", str(tmp_path / "doctrees"), str(ROOT / "docs"), str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reference = (out / "api" / "sage_optax.html").read_text()
    assert 'id="sage_optax.make_optimizer"' in reference
    for page in ("algorithms", "configurations", "routing", "gpu"):
        assert (out / f"{page}.html").exists(), page


@pytest.mark.parametrize("package", ["sage_optax", "sage_torch", "sage_optim"])
def test_api_page_covers_all(package):
    page = (ROOT / "docs" / "api" / f"{package}.md").read_text()
    names = importlib.import_module(package).__all__
    missing = [n for n in names if not re.search(rf"[.`]{re.escape(n)}\b", page)]
    assert not missing, f"docs/api/{package}.md does not document {missing}"


# --------------------------------------------------------------------------------------------
# Citation


def _bibtex_entries(text: str) -> dict[str, dict[str, str]]:
    (block,) = re.findall(r"^```bibtex\n(.*?)^```", text, flags=re.S | re.M)
    entries = {}
    for key, body in re.findall(r"@\w+\{([^,]+),(.*?)\n\}", block, flags=re.S):
        fields = dict(re.findall(r"^\s*(\w+)\s*=\s*\{(.*)\},?\s*$", body, flags=re.M))
        entries[key] = fields
    return entries


def test_citation_cff_and_readme_agree():
    yaml = pytest.importorskip("yaml")
    cff = yaml.safe_load((ROOT / "CITATION.cff").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert cff["cff-version"] == "1.2.0" and cff["type"] == "software"
    assert cff["version"] == project["version"] and cff["license"] == project["license"]
    assert cff["message"] and cff["authors"] and cff["title"]
    readme = (ROOT / "README.md").read_text()
    assert "## Citation" in readme and "CITATION.cff" in readme
    entries = _bibtex_entries(readme)
    assert len(entries) == len(cff["references"]) == 2
    for ref in cff["references"]:
        bib = [e for e in entries.values()
               if e["title"].replace("{", "").replace("}", "") == ref["title"]]
        assert len(bib) == 1, ref["title"]
        assert int(bib[0]["year"]) == ref["year"]
        families = [a["family-names"] for a in ref["authors"]]
        assert [a.split(",")[0].strip() for a in bib[0]["author"].split(" and ")] == families
        if "doi" in ref:
            assert bib[0]["doi"] == ref["doi"]
    for text in (readme, (ROOT / "CITATION.cff").read_text()):
        assert "shared/" not in text and ".tex" not in text
