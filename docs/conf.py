"""Sphinx configuration of the sage-optim documentation.

``make docs`` builds it as HTML into ``docs/_build/html`` with ``-W`` (a warning is an
error); ``tests/docs/test_docs_blocks.py`` runs the same build.  The pages are the Markdown files
of ``docs/`` (read by MyST) and ``docs/api/``, the reference generated from the docstrings
(autodoc, Google-style sections read by napoleon), as optax's documentation does it.
"""

from __future__ import annotations

import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # document this checkout's packages, installed or not

_PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

project = "sage-optim"
author = "The sage-optim developers"
copyright = "2026, The sage-optim developers"
version = release = _PROJECT["version"]

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
# docs/README.md is the folder's index on GitHub; index.md plays that part here.
exclude_patterns = ["_build", "README.md"]

# MyST: `#section` links between the pages resolve to their headings, as on GitHub.
myst_heading_anchors = 3

# autodoc: signatures keep the annotations as written (no expansion of aliases), members in
# source order, no private names.
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = False  # the values (0.9), not the source (_DEFAULTS["b1"])
autodoc_default_options = {"members": False}
napoleon_google_docstring = True
napoleon_numpy_docstring = False

# Unresolved cross-references (a type from jax, optax or torch without intersphinx) are not
# warnings: the build runs offline.
nitpicky = False

html_theme = "alabaster"
html_title = f"sage-optim {release}"
