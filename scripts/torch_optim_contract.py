"""``scripts/torch-optim-contract``: PyTorch's own optimizer tests, run over sage_torch.

PyTorch checks its optimizers with ``TestOptimRenewed`` (pytorch's ``test/test_optim.py``,
not in the torch wheel) over the ``OptimizerInfo`` table ``optim_db``.  This script loads a
pytorch checkout's ``test/test_optim.py`` with ``optim_db`` replaced by sage_torch's entries
(``scripts/torch_optim_infos.py``), runs the class on the CPU and prints one row per entry
(passed, failed, skipped), then every failure, grouped by test and first line of the error,
each marked with the deliberate difference it shows (:data:`DIFFERENCES`, stated in
docs/pytorch.md) or ``UNEXPECTED``.  Exit status: 0 when every failure is a listed
difference, 1 when one is not, 2 on a bad option.

    scripts/torch-optim-contract PATH/TO/pytorch/test/test_optim.py
    scripts/torch-optim-contract PATH --entries SAGE,sage_hybrid -k state_dict -v

The test file imports three sibling modules of pytorch's ``test/optim`` folder for their
test classes; they are replaced by empty stand-ins, since only ``TestOptimRenewed`` runs.
Needs ``expecttest`` (``pip install expecttest``), which ``torch.testing._internal`` imports.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import fnmatch
import importlib.abc
import importlib.util
import os
import pathlib
import re
import sys
import time
import traceback
import types
import unittest
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]

SIBLINGS = "optim"
"""The package of pytorch's ``test/optim`` folder, whose test classes the file imports."""


@dataclasses.dataclass(frozen=True)
class Difference:
    """A deliberate difference from ``torch.optim`` and the failures it explains.

    A failure is explained when its test name and its entry match ``test`` and ``entries``
    (regexes, matched in full) and its error's text matches ``error`` (a regex, searched).
    """

    key: str
    test: str
    entries: str
    error: str
    why: str


_CONFIGS = "adamw|lion|apollo|sinkgd_pure|sinkgd_hybrid|lion_hybrid|sage_pure|sage_hybrid"
DIFFERENCES: tuple[Difference, ...] = (
    Difference("complex", "test_complex(_2d)?", ".*", r"is complex \(torch\.complex",
               "SAGE, SinkGD and APOLLO refuse complex parameters: signs, Sinkhorn norms and "
               "real projections have no complex counterpart"),
    Difference("complex", "test_complex", "SinkGD|APOLLO", "Tensor-likes are not close",
               "SinkGD and APOLLO refuse complex parameters; with fallback= a complex matrix "
               "goes to the fallback (AdamW), while its torch.view_as_real twin, a real "
               "(10, 5, 2) tensor, is a stack of matrices for SinkGD or APOLLO"),
    Difference("norm", "test_complex_2d", "unit_norm_rule|sinkgd_pure",
               "Tensor-likes are not close",
               "the unit-norm step divides a gradient by its norm over the whole tensor: a "
               "complex vector is one tensor, not its real and imaginary parts as two "
               "(test_complex, against torch.view_as_real, passes)"),
    Difference("groups", "test_can_load_from_to_named_state_dict_.*", f"SinkGD|APOLLO|{_CONFIGS}",
               "length of the sequences mismatch",
               "one param group per kind and layout (and the fallback's parameters in their "
               "own group), so param_groups[0] does not hold all four parameters"),
    Difference("matrices", "test_param_group_with_lrscheduler_goes_right_direction|"
               "test_param_groups_lr", "SinkGD|APOLLO", "needs a matrix",
               "SinkGD and APOLLO take matrices only (fallback= for the rest); these tests "
               "build a group of vectors without the keyword set that carries fallback="),
    Difference("decay", "test_step_is_noop_for_zero_grads", ".*", "Tensor-likes are not close",
               "every rule's default weight_decay is 0.01 (torch.optim.AdamW's), so a zero "
               "gradient still decays the parameter; the test exempts AdamW by name only "
               "(with weight_decay=0 nothing moves)"),
)
"""The failures that are deliberate, as docs/pytorch.md words them."""


class _StandIns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``optim`` and ``optim.*`` as empty modules whose every name is an empty class.

    pytorch's test file imports test classes of its ``test/optim`` folder (``from
    optim.test_lrscheduler import TestLRScheduler``, ...) so that they run with it; only
    ``TestOptimRenewed`` runs here, so any such name is a stand-in.
    """

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:  # noqa: D102
        if fullname == SIBLINGS or fullname.startswith(SIBLINGS + "."):
            return importlib.util.spec_from_loader(fullname, self, is_package=True)
        return None

    def create_module(self, spec: Any) -> None:  # noqa: D102
        return None

    def exec_module(self, module: types.ModuleType) -> None:  # noqa: D102
        def stand_in(name: str) -> type:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

        module.__getattr__ = stand_in  # type: ignore[method-assign]


def load_tests(path: pathlib.Path, entries: list[Any]) -> type[unittest.TestCase]:
    """Load ``path`` with ``optim_db`` replaced by ``entries``; its CPU test class."""
    import torch.testing._internal.common_optimizers as common

    saved = common.optim_db
    common.optim_db = entries
    finder = _StandIns()
    sys.meta_path.insert(0, finder)
    try:
        spec = importlib.util.spec_from_file_location("pytorch_test_optim", path)
        if spec is None or spec.loader is None:
            raise SystemExit(f"error: cannot load {path} as a Python module")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    finally:
        common.optim_db = saved
        sys.meta_path.remove(finder)
    cls = getattr(module, "TestOptimRenewedCPU", None)
    if cls is None:
        raise SystemExit(f"error: {path} defines no TestOptimRenewed (TestOptimRenewedCPU)")
    return cls


class _Result(unittest.TestResult):
    """Every test's outcome: ``passed``, ``failed`` (with the error text) or ``skipped``."""

    def __init__(self) -> None:
        super().__init__()
        self.outcomes: dict[str, tuple[str, str]] = {}

    def addSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("passed", "")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("failed", "".join(traceback.format_exception(*err)))

    addError = addFailure  # noqa: N815

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("skipped", reason)

    def addExpectedFailure(self, test: unittest.TestCase, err: Any) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("skipped", "expected failure")

    def addUnexpectedSuccess(self, test: unittest.TestCase) -> None:  # noqa: N802
        self.outcomes[test.id()] = ("passed", "")


def split_name(method: str, entries: list[str]) -> tuple[str, str]:
    """``test_foo_is_named_True_SAGE_cpu_float32`` -> (``test_foo_is_named_True``, ``SAGE``)."""
    for e in sorted(entries, key=len, reverse=True):
        m = re.fullmatch(rf"(.*)_{re.escape(e)}_cpu(?:_\w+)?", method)
        if m:
            return m.group(1), e
    return method, "-"


def _error_line(text: str) -> str:
    """The last line of a traceback that says what went wrong, shortened."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Warning)\b|^[\w.]+: ", ln):
            return ln[:240]
    return (lines[-1] if lines else "")[:240]


def explain(test: str, entry: str, text: str) -> Difference | None:
    """The deliberate difference that explains this failure, if any."""
    for d in DIFFERENCES:
        if (re.fullmatch(d.test, test) and re.fullmatch(d.entries, entry)
                and re.search(d.error, text)):
            return d
    return None


def _print_failures(failures: dict[tuple[str, str], list[str]],
                    texts: dict[tuple[str, str, str], str],
                    by_key: collections.Counter[str]) -> None:
    """:func:`report`'s failures: one line each, ``texts`` in full, then the count by key."""
    if failures:
        print("\nfailures (test: [difference] error: entries)")
        for (test, line), entries in sorted(failures.items()):
            print(f"- {test}: {line}: {', '.join(entries)}")
    for (test, entry, key), text in sorted(texts.items()):
        print(f"\n=== {test} {entry} [{key}]\n{text}")
    if by_key:
        print("\nfailures by difference: "
              + ", ".join(f"{k} {n}" for k, n in sorted(by_key.items())))
        for d in DIFFERENCES:
            if d.key in by_key:
                print(f"  {d.key}: {d.why}")


def report(result: _Result, names: list[str], test_file: pathlib.Path, seconds: float,
           verbose: bool) -> int:
    """Print the table and the failures of ``result``; 1 if a failure is unexplained."""
    rows: dict[str, collections.Counter[str]] = {n: collections.Counter() for n in names}
    failures: dict[tuple[str, str], list[str]] = collections.defaultdict(list)
    texts: dict[tuple[str, str, str], str] = {}
    unexpected = 0
    by_key: collections.Counter[str] = collections.Counter()
    for test_id, (outcome, text) in result.outcomes.items():
        test, entry = split_name(test_id.rsplit(".", 1)[-1], names)
        if entry == "-":
            continue  # a test of no entry (none in TestOptimRenewed)
        rows[entry][outcome] += 1
        if outcome == "failed":
            diff = explain(test, entry, text)
            key = diff.key if diff else "UNEXPECTED"
            unexpected += diff is None
            by_key[key] += 1
            failures[(test, f"[{key}] {_error_line(text)}")].append(entry)
            texts[(test, entry, key)] = text

    total = collections.Counter[str]()
    print(f"TestOptimRenewed over sage_torch ({test_file}), CPU, {seconds:.0f} s")
    print(f"{'entry':<16} {'passed':>7} {'failed':>7} {'skipped':>8}")
    for entry, c in rows.items():
        total.update(c)
        print(f"{entry:<16} {c['passed']:>7} {c['failed']:>7} {c['skipped']:>8}")
    print(f"{'total':<16} {total['passed']:>7} {total['failed']:>7} {total['skipped']:>8}")
    _print_failures(failures, texts if verbose else {}, by_key)
    print(f"\n{total['failed'] - unexpected} failures are deliberate differences "
          f"(docs/pytorch.md), {unexpected} are not")
    return 1 if unexpected else 0


def main(argv: list[str] | None = None) -> int:
    """Run the test class over the entries and print the table; see the module docstring."""
    parser = argparse.ArgumentParser(
        prog="scripts/torch-optim-contract",
        description="Run pytorch's TestOptimRenewed (a pytorch checkout's "
                    "test/test_optim.py) over sage_torch's OptimizerInfo entries (CPU).")
    parser.add_argument("test_file", type=pathlib.Path,
                        help="pytorch's test/test_optim.py (from a checkout of pytorch)")
    parser.add_argument("--entries", default="",
                        help="comma-separated entry names or globs (default: all)")
    parser.add_argument("-k", dest="pattern", default="",
                        help="run only tests whose name contains this string")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="print each failure's full traceback")
    args = parser.parse_args(argv)
    if not args.test_file.is_file():
        parser.error(f"test_file: no such file: {args.test_file}")
    os.environ.setdefault("PYTORCH_TESTING_DEVICE_ONLY_FOR", "cpu")
    os.environ.setdefault("PYTORCH_PRINT_REPRO_ON_FAILURE", "0")
    try:
        import expecttest  # noqa: F401
    except ImportError:
        print("error: torch.testing._internal needs expecttest: pip install expecttest",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch
    import torch_optim_infos

    torch.set_num_threads(1)
    infos = torch_optim_infos.optim_infos()
    if args.entries:
        globs = [g.strip() for g in args.entries.split(",") if g.strip()]
        infos = [i for i in infos if any(fnmatch.fnmatchcase(i.name, g) for g in globs)]
        if not infos:
            parser.error(f"--entries: {args.entries!r} matches no entry")
    names = [i.name for i in infos]
    cls = load_tests(args.test_file, infos)
    loader = unittest.TestLoader()
    methods = [m for m in loader.getTestCaseNames(cls) if args.pattern in m]
    suite = unittest.TestSuite(cls(m) for m in methods)
    result = _Result()
    start = time.perf_counter()
    suite.run(result)
    seconds = time.perf_counter() - start

    return report(result, names, args.test_file, seconds, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
