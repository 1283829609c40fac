"""The commands' first check: is the extra each one needs installed.

``pip install sage-optim`` installs what every part needs (numpy); each framework comes with
an extra (``[jax]``, ``[torch]``, ``[train]``, ``[all]``).  A command started without its
extra prints one line naming it and exits with status 1, instead of a traceback from deep
inside an import::

    sage-train needs the [train] extra: pip install -e '.[train]' in a sage-optim checkout

Nothing is imported here: :func:`missing` asks the import system whether a module could be
found (:func:`importlib.util.find_spec`), so the check costs no framework import, and
``sage-train`` still catches its signals before JAX loads.  A module that is installed but
fails to import is not reported as missing: its own error shows.
"""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Iterable, Mapping

EXTRAS: Mapping[str, tuple[str, ...]] = types.MappingProxyType({
    "jax": ("jax", "optax"),
    "torch": ("torch",),
    "train": ("jax", "optax", "flax", "orbax.checkpoint", "tokenizers", "tqdm", "matplotlib",
              "safetensors", "tensorboardX"),
    "all": ("jax", "optax", "torch", "flax", "orbax.checkpoint", "tokenizers", "tqdm",
            "matplotlib", "safetensors", "tensorboardX"),
})
"""The modules each extra of ``pyproject.toml`` provides (import names)."""

ON_DEMAND: frozenset[str] = frozenset({"tensorboardX", "safetensors", "tqdm"})
"""Modules of an extra that a command does not need to start: only an option imports
``tensorboardX`` and ``safetensors`` and checks for them itself (``sage-train
--tensorboard``, ``--init-from-hf``, ``sage-train export``), and without ``tqdm`` there are no
progress bars (plain log lines instead). So ``sage-train`` runs on a GPU host that has none
of the three."""


def missing(modules: Iterable[str]) -> list[str]:
    """The modules of ``modules`` that the import system cannot find, in order."""
    absent = []
    for name in modules:
        if name in sys.modules:
            continue
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:  # a parent package is missing, or an import hook refuses it
            found = False
        if not found:
            absent.append(name)
    return absent


def require(command: str, *extras: str, packages: tuple[str, ...] = ()) -> None:
    """Exit with one line naming the extras (and plain ``packages``) if any is missing.

    Args:
      command: the command's name, as the user typed it (``"sage-train"``).
      *extras: the extras it needs, keys of :data:`EXTRAS` (their :data:`ON_DEMAND`
        modules are left to the options that import them).
      packages: further modules it needs that no extra provides, named as their pip
        package (``"transformers"``).

    Raises:
      SystemExit: status 1, after printing the line to stderr, when a module is missing.
      KeyError: an extra that is not in :data:`EXTRAS`.
    """
    needed = [module for extra in extras for module in EXTRAS[extra]
              if module not in ON_DEMAND]
    if not missing([*needed, *packages]):
        return
    print(f"{command} needs {needs(extras, packages)}", file=sys.stderr)
    raise SystemExit(1)


def install_command(extras: str) -> str:
    """How to install ``extras`` (``"jax"``, ``"jax,torch"``): from a checkout.

    Nothing is published on PyPI, so the command installs the checkout (``-e``: editable;
    a wheel from ``python -m build`` takes the same extras).
    """
    return f"pip install -e '.[{extras}]' in a sage-optim checkout"


def needs(extras: Iterable[str], packages: Iterable[str] = ()) -> str:
    """``the [jax] extra: pip install -e '.[jax]' in a sage-optim checkout`` (and packages)."""
    extras, packages = tuple(extras), tuple(packages)
    label = ",".join(extras)
    what = f"the [{label}] extra{'s' if len(extras) > 1 else ''}"
    install = install_command(label)
    if packages:
        what += " and " + ", ".join(packages)
        install += ", then pip install " + " ".join(packages)
    return f"{what}: {install}"


def require_for_import(package: str, extra: str) -> None:
    """Refuse to import ``package`` without ``extra``: one line naming it.

    Called first by ``sage_optax`` and ``sage_torch``, so that ``import sage_optax``
    without JAX says which extra to install instead of failing deep inside a module.

    Raises:
      ModuleNotFoundError: a module of ``extra`` is missing (an ``ImportError``, so code
        that tries a framework and falls back still catches it).
    """
    absent = missing(m for m in EXTRAS[extra] if m not in ON_DEMAND)
    if absent:
        raise ModuleNotFoundError(
            f"{package} needs {needs((extra,))} ({', '.join(absent)} not found)",
            name=absent[0])
