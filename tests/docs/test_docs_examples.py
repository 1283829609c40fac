"""The docstrings run and cite: optax's ``Examples:`` and ``References:`` sections.

* Every ``>>>`` example in a docstring of a public module of :mod:`sage_optim`,
  :mod:`sage_optax` and :mod:`sage_torch` runs as a doctest (``doctest.DocTestFinder``), in
  a namespace of its own (an example imports what it uses, so it can be pasted as it is),
  and must print what its docstring says: a wrong example fails here.
* The main entry points (the aliases, the ``scale_by_*`` transforms, ``make_optimizer``,
  ``routing_table``, the ``torch.optim`` classes) have such an example.
* Every public function and class of ``sage_optax.__all__`` and ``sage_torch.__all__`` has a
  ``References:`` section, and every arXiv id a docstring of the packages cites is one of
  the papers listed below (checked against the papers themselves: a typo fails).
"""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil
import re
import sys
import types

import pytest

PACKAGES = ("sage_optim", "sage_optax", "sage_torch")

ARXIV = {
    "1506.01186": "Cyclical Learning Rates for Training Neural Networks",  # Smith
    # Smith and Topin (OneCycleLR)
    "1708.07120": "Super-Convergence: Very Fast Training of Neural Networks Using Large "
                  "Learning Rates",
    "1711.05101": "Decoupled Weight Decay Regularization",  # Loshchilov and Hutter (AdamW)
    "2302.06675": "Symbolic Discovery of Optimization Algorithms",  # Chen et al. (Lion)
    "2412.05270": "APOLLO: SGD-like Memory, AdamW-level Performance",  # Zhu et al.
    "2502.06742": "Gradient Multi-Normalization for Stateless and Scalable LLM Training",
    "2604.07663": "SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization",  # Lee, Kim
}
"""The papers the docstrings may cite, by arXiv id, with their titles."""

SAGE_TITLE = "SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization"

ENTRY_POINTS = {
    "sage_optax": (
        "make_optimizer", "routing_table", "sage_hybrid",
        "sage", "lion", "sinkgd", "apollo", "unit_norm_descent",
        "scale_by_sage", "scale_by_lion", "scale_by_sinkhorn", "scale_by_apollo",
        "scale_by_unit_norm",
    ),
    "sage_torch": (
        "make_optimizer", "routing_table", "SAGE", "SinkGD", "Lion", "APOLLO", "RuleOptimizer",
    ),
}
"""The names whose docstrings must show their use in a runnable ``Examples:`` block."""


def _public_modules() -> list[types.ModuleType]:
    """The packages and the public modules they import.

    Not the modules they import only when used (``sage_torch.triton_kernels``,
    ``sage_optax.sinkgd_pallas``): importing Triton here, before the fused tests set
    ``TRITON_INTERPRET``, would change what the rest of the suite runs.
    """
    for name in PACKAGES:
        importlib.import_module(name)
    return [module for name, module in sorted(sys.modules.items())
            if name.split(".")[0] in PACKAGES
            and not any(part.startswith("_") for part in name.split(".")[1:])]


def _doctests() -> list[doctest.DocTest]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    tests = []
    for module in _public_modules():
        # globs={}: an example sees only what it imports itself
        tests += [t for t in finder.find(module, globs={}) if t.examples]
    return sorted(tests, key=lambda t: t.name)


DOCTESTS = _doctests()


def _public_objects(package: str) -> list[tuple[str, object]]:
    module = importlib.import_module(package)
    return [(name, getattr(module, name)) for name in module.__all__
            if inspect.isclass(getattr(module, name)) or callable(getattr(module, name))]


def test_the_entry_points_have_examples():
    names = {t.name for t in DOCTESTS}
    missing = []
    for package, entry_points in ENTRY_POINTS.items():
        module = importlib.import_module(package)
        for name in entry_points:
            obj = getattr(module, name)
            qualified = f"{obj.__module__}.{obj.__qualname__}"
            if qualified not in names or "Examples:" not in (obj.__doc__ or ""):
                missing.append(f"{package}.{name}")
    assert not missing, f"no runnable Examples: block in the docstring of {missing}"


@pytest.mark.parametrize("test", DOCTESTS, ids=[t.name for t in DOCTESTS])
def test_example_runs_as_written(test, request):
    if test.name.startswith("sage_torch"):
        request.getfixturevalue("torch_one_thread")
        torch = importlib.import_module("torch")
        # an example's nn.Module draws from torch's global generator: leave it as it was
        state = torch.random.get_rng_state()
        request.addfinalizer(lambda: torch.random.set_rng_state(state))
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    report: list[str] = []
    result = runner.run(test, out=report.append, clear_globs=True)
    assert result.failed == 0, "".join(report)


@pytest.mark.parametrize("package", ["sage_optax", "sage_torch"])
def test_every_public_name_has_references(package):
    missing = [name for name, obj in _public_objects(package)
               if not re.search(r"^\s*References:\s*$", inspect.getdoc(obj) or "", re.M)]
    assert not missing, f"{package}: no References: section in the docstring of {missing}"


def test_the_cited_papers_are_the_right_ones():
    cited: dict[str, set[str]] = {}
    for module in _public_modules():
        source = inspect.getsource(module)
        for arxiv_id in re.findall(r"(?:arxiv\.org/abs/|arXiv:)(\d{4}\.\d{4,5})", source):
            cited.setdefault(arxiv_id, set()).add(module.__name__)
        # a link's title is the paper's: `Title <https://arxiv.org/abs/ID>`_
        for title, arxiv_id in re.findall(
                r"`([^`<]+?)\s*<https://arxiv\.org/abs/(\d{4}\.\d{4,5})>`_", source):
            title = " ".join(title.split())
            assert arxiv_id in ARXIV and title == ARXIV[arxiv_id], (
                f"{module.__name__}: `{title}` is linked to arXiv {arxiv_id}, the paper "
                f"{ARXIV.get(arxiv_id, 'of no known title')!r}")
    unknown = {i: sorted(m) for i, m in cited.items() if i not in ARXIV}
    assert not unknown, f"arXiv ids cited that are not in the checked list: {unknown}"
    assert {"1711.05101", "2302.06675", "2412.05270", "2502.06742", "2604.07663"} <= set(cited)


def test_the_sage_paper_is_cited_by_its_title():
    sage_optax = importlib.import_module("sage_optax")
    sage_torch = importlib.import_module("sage_torch")
    for obj in (sage_optax.sage, sage_optax.scale_by_sage, sage_optax.make_optimizer,
                sage_torch.SAGE, sage_torch.make_optimizer):
        doc = " ".join((inspect.getdoc(obj) or "").split())
        assert SAGE_TITLE in doc, f"{obj.__module__}.{obj.__qualname__}"


def test_the_sage_optim_docstring_lists_its_modules():
    # it once listed "memory figures" the package does not hold and none of its modules
    package = importlib.import_module("sage_optim")
    doc = package.__doc__ or ""
    modules = {info.name for info in pkgutil.iter_modules(package.__path__)
               if not info.name.startswith("_")}
    named = set(re.findall(r":mod:`sage_optim\.(\w+)`", doc))
    assert named == modules, (f"modules the docstring does not name: {modules - named}; "
                              f"names that are no module: {named - modules}")
    assert not [n for n in package.__all__ if n not in doc]
