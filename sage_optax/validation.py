"""Checks of user input that turn silent wrong answers into errors naming the culprit."""

from __future__ import annotations

import numbers
from typing import Any

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
    """Reject a negative or non-numeric learning rate; schedules (callables) pass."""
    if callable(learning_rate):
        return
    if is_static_number(learning_rate):
        if learning_rate < 0:
            raise ValueError(
                f"{name} must be >= 0, got {learning_rate}; a negative learning rate would "
                "ascend the loss (optimizers here subtract the update)"
            )
        return
    if hasattr(learning_rate, "shape") and hasattr(learning_rate, "dtype"):
        return  # an array (e.g. injected by optax.inject_hyperparams)
    raise TypeError(
        f"{name} must be a number, a scalar array or a schedule (callable), got "
        f"{type(learning_rate).__name__}"
    )


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

    A non-negative integer (Python or NumPy); booleans, fractions and negative numbers are
    refused (``True`` is not "skip one", ``2.7`` and ``-1`` have no meaning).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 0:
        raise ValueError(
            f"skip_nonfinite must be a non-negative integer (the number of consecutive "
            f"non-finite steps to skip; 0 disables skipping), got {value!r}"
        )
    return int(value)
