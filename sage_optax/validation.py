"""Checks of user input that turn silent wrong answers into errors naming the culprit."""

from __future__ import annotations

import numbers
from typing import Any

import jax
import numpy as np

from sage_optim import hyperparams


def is_static_number(x: Any) -> bool:
    """Whether ``x`` is a concrete Python/NumPy real number (not a tracer or array)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_hyperparameters(rule: str | None = None, **values: Any) -> None:
    """Check concrete hyperparameters against the shared table (:mod:`sage_optim.hyperparams`).

    Traced values (``optax.inject_hyperparams``) are not checked; strings, bools and Python
    or NumPy numbers are, with the message both frameworks give.
    """
    for name, value in values.items():
        if isinstance(value, str | bool) or is_static_number(value):
            hyperparams.check(name, value, rule)


def check_learning_rate(learning_rate: Any, name: str = "learning_rate") -> None:
    """Reject a negative, NaN, infinite or non-numeric learning rate.

    A number (or a concrete scalar array) is checked against the shared range table
    (:mod:`sage_optim.hyperparams`, the check ``sage_torch`` makes); a schedule (a callable)
    by its first value, ``schedule(0)``, where that can be read (traced values and
    schedules that fail outside a step pass).
    """
    if callable(learning_rate):
        try:
            first = _concrete(learning_rate(0))
        except Exception:  # a schedule that needs a traced step: checked by nothing here
            return
        if first is not None:
            hyperparams.check("learning_rate", first,
                              label=f"{name}(0), the schedule's first value,")
        return
    if is_static_number(learning_rate):
        if learning_rate < 0:
            raise ValueError(
                f"{name} must be >= 0, got {learning_rate}; a negative learning rate would "
                "ascend the loss (optimizers here subtract the update)"
            )
        hyperparams.check("learning_rate", float(learning_rate), label=name)
        return
    if hasattr(learning_rate, "shape") and hasattr(learning_rate, "dtype"):
        value = _concrete(learning_rate)  # e.g. injected by optax.inject_hyperparams
        if value is not None:
            hyperparams.check("learning_rate", value, label=name)
        return
    raise TypeError(
        f"{name} must be a number, a scalar array or a schedule (callable), got "
        f"{type(learning_rate).__name__}"
    )


def _concrete(value: Any) -> float | None:
    """``value`` as a Python float where it is a concrete real scalar (else ``None``)."""
    if is_static_number(value):
        return float(value)
    try:
        array = np.asarray(value)  # a tracer refuses
    except Exception:
        return None
    if array.shape != () or array.dtype.kind not in "fiu":
        return None
    return float(array)


def checked_mask(mask: Any) -> Any:
    """A weight-decay ``mask`` for ``optax.masked`` that refuses another structure by name.

    ``mask`` (a pytree of bools with the params' structure or a prefix of it, or a callable
    of the params returning one) is returned as a callable that checks the tree against the
    params it is given; ``None`` stays ``None``.  A mismatch raises a ``ValueError`` naming
    the mask and the first path that differs, instead of JAX's structure error.
    """
    if mask is None:
        return None

    def resolved(params: Any) -> Any:
        tree = mask(params) if callable(mask) else mask
        check_mask_structure(tree, params)
        return tree

    return resolved


def _path(path: tuple[Any, ...]) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return ".".join(parts) or "(the root)"


def check_mask_structure(mask: Any, params: Any) -> None:
    """Refuse a weight-decay ``mask`` without the structure of ``params`` (or of a prefix).

    Raises:
      ValueError: naming the mask and the first path that differs.
    """
    try:
        jax.tree.structure(mask).flatten_up_to(params)  # type: ignore[attr-defined]
        return
    except (ValueError, TypeError):
        pass
    mask_paths = [_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(mask)[0]]
    param_paths = [_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: x is None)[0]]

    def covers(prefix: str, path: str) -> bool:
        return prefix == "(the root)" or path == prefix or path.startswith(prefix + ".")

    for m in mask_paths:
        if not any(covers(m, p) for p in param_paths):
            raise ValueError(f"the weight-decay mask does not have the structure of the "
                             f"params: the mask has {m!r}, the params do not")
    for p in param_paths:
        if not any(covers(m, p) for m in mask_paths):
            raise ValueError(f"the weight-decay mask does not have the structure of the "
                             f"params: the params have {p!r}, the mask does not")
    raise ValueError("the weight-decay mask does not have the structure of the params: the "
                     f"same paths in other containers (mask {jax.tree.structure(mask)}, "
                     f"params {jax.tree.structure(params)})")


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    """Check a string option is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_positive_int(name: str, value: Any) -> None:
    """Check a count (rank, iterations, interval) is a positive integer when concrete."""
    if isinstance(value, bool) or (is_static_number(value) and (int(value) != value or value < 1)):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_skip_nonfinite(value: Any) -> int:
    """``value`` as a count of non-finite steps to skip, or a ``ValueError`` naming it.

    :func:`sage_optim.hyperparams.check_skip_nonfinite`: an integer in ``[0, 2**31 - 1]``
    (``optax.apply_if_finite`` counts in an ``int32``), the same check as ``sage_torch``'s.
    """
    return hyperparams.check_skip_nonfinite(value)
