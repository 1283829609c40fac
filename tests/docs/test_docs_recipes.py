"""docs/recipes.md runs as written (issue 34): each Python block, where the packages its
first line names (``# needs: a, b``) are installed; skipped with the missing one otherwise."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

PAGE = pathlib.Path(__file__).resolve().parents[2] / "docs" / "recipes.md"
FENCE = re.compile(r"^## (.*?)$|^```python\n(.*?)^```", flags=re.S | re.M)


def recipes():
    title, found = "", []
    for m in FENCE.finditer(PAGE.read_text()):
        if m.group(1) is not None:
            title = m.group(1)
        else:
            found.append((title, m.group(2)))
    return found


RECIPES = recipes()


def test_the_recipes_are_there():
    titles = " ".join(t for t, _ in RECIPES)
    for words in ("optimizers=", "optimizer_cls_and_kwargs=", "accelerate", "Lightning",
                  "nanoGPT", "orbax"):
        assert words in titles, words
    assert all(block.startswith("# needs: ") for _, block in RECIPES)


@pytest.mark.parametrize("block", [b for _, b in RECIPES], ids=[t for t, _ in RECIPES])
def test_recipe_runs(block, capsys):
    needs = block.splitlines()[0].removeprefix("# needs: ").split(", ")
    for module in needs:
        try:
            found = importlib.util.find_spec(module) is not None
        except ImportError:
            found = False
        if not found:
            pytest.skip(f"{module} is not installed")
    exec(compile(block, f"{PAGE.name}", "exec"), {"__name__": "__main__"})
    out = capsys.readouterr().out
    assert out.strip()
    if "restored exactly" in out:  # the orbax round trip: model and optimizer state
        assert "restored exactly: True" in out, out
    if "vector_weight_decay=0.0" in block:  # nanoGPT's split: vectors undecayed
        assert "'vector': 0.0" in out and "'dense': 0.1" in out, out
