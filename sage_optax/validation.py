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

    :func:`sage_optim.hyperparams.check_skip_nonfinite`: an integer in ``[0, 2**31 - 1]``
    (``optax.apply_if_finite`` counts in an ``int32``), the same check as ``sage_torch``'s.
    """
    return hyperparams.check_skip_nonfinite(value)
