"""The notebooks: each percent-format source runs end to end in fast mode, and each is paired
with an ``.ipynb`` holding exactly the same cells (so the two cannot drift apart).

After editing a notebook, regenerate its pair with ``jupytext --sync notebooks/NAME.py`` (or
``jupytext --to ipynb notebooks/NAME.py``); outputs are not committed.
"""

from __future__ import annotations

import json
import pathlib
import runpy

import jupytext
import pytest

NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.py"))
PAIRED_FORMATS = "ipynb,py:percent"


def test_notebooks_exist():
    assert {p.stem for p in NOTEBOOKS} >= {"quickstart", "parity", "training"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SAGE_NOTEBOOK_FAST", "1")
    monkeypatch.chdir(tmp_path)  # nothing may land in the repository tree
    runpy.run_path(str(path), run_name="__main__")
    assert capsys.readouterr().out.strip()
    assert not list(tmp_path.iterdir()), "fast mode must write into a temporary directory"


def _cells(nb) -> list[tuple[str, str]]:
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list)
             else c["source"]) for c in nb["cells"]]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_paired_with_ipynb(path):
    ipynb = path.with_suffix(".ipynb")
    assert ipynb.is_file(), f"{path.name} has no paired {ipynb.name}: run jupytext --sync"
    source = jupytext.read(path)
    assert source.metadata["jupytext"]["formats"] == PAIRED_FORMATS, path.name
    raw = json.loads(ipynb.read_text())  # the .ipynb as saved, not through jupytext
    assert raw["metadata"]["jupytext"]["formats"] == PAIRED_FORMATS, ipynb.name
    expected, stored = _cells(source), _cells(raw)
    assert [t for t, _ in stored] == [t for t, _ in expected], (
        f"{ipynb.name} and {path.name} have different cells: run jupytext --sync {path.name}")
    for i, ((kind, want), (_, got)) in enumerate(zip(expected, stored, strict=True)):
        assert got == want, (f"{kind} cell {i} of {ipynb.name} differs from {path.name}: "
                             f"run jupytext --sync {path.name}")
    for cell in raw["cells"]:  # committed without outputs
        if cell["cell_type"] == "code":
            assert cell.get("outputs") == [] and cell.get("execution_count") is None


def test_every_ipynb_has_a_source():
    orphans = [p.name for p in NOTEBOOK_DIR.glob("*.ipynb") if not p.with_suffix(".py").is_file()]
    assert not orphans
