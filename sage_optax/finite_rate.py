"""Steps whose scheduled learning rate is not finite are skipped, not applied.

A schedule that returns NaN or Inf at step ``k`` (a bug in a hand-written schedule, a
division by a zero length) would make every parameter NaN: Optax applies whatever rate the
schedule returns, and a NaN rate given directly is refused only because it is checked when
the optimizer is built.  :func:`skip_nonfinite_rate` wraps an optimizer whose learning rate
is a schedule: a step whose rate is not finite returns zero updates and leaves the
optimizer's state as it was, and counts it in ``notfinite_lr_count``, as
``optax.apply_if_finite`` does for gradients.  An array rate (what
``optax.inject_hyperparams`` passes at each step) is skipped the same way, without a
count: the state keeps the structure it has with a constant rate.

The schedule still moves on: step ``t`` (counted by the wrapper, skipped steps included)
uses the rate ``schedule(t)``, so a schedule that is NaN at one step only skips that step.
The inner transformation counts only the steps it took; it is given the schedule shifted
by the number of skipped steps, so that both counts name the same step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax


class SkipNonFiniteRateState(NamedTuple):
    """The state of :func:`skip_nonfinite_rate`.

    Attributes:
      steps: steps so far, skipped ones included (the schedule's argument).
      notfinite_lr_count: steps skipped because their learning rate was NaN or Inf.
      inner_state: the wrapped optimizer's state (unchanged by a skipped step).
    """

    steps: jax.Array
    notfinite_lr_count: jax.Array
    inner_state: Any


def skip_nonfinite_rate(
    build: Callable[[optax.ScalarOrSchedule], optax.GradientTransformation],
    learning_rate: optax.ScalarOrSchedule,
) -> optax.GradientTransformationExtraArgs:
    """``build(learning_rate)``, with the steps whose rate is not finite skipped.

    Args:
      build: the optimizer for a given learning rate (float, array or schedule).
      learning_rate: a Python number (``build(learning_rate)`` as it is: it was checked
        when the optimizer was built), an array, or an Optax schedule.

    Returns:
      For a schedule, a transformation whose state is :class:`SkipNonFiniteRateState`: a
      step whose rate is NaN or Inf gives zero updates, keeps the inner state and adds
      one to ``notfinite_lr_count``.  For an array, the inner state itself (a skipped step
      is not counted).

    Examples:
      >>> import jax.numpy as jnp, optax
      >>> from sage_optax.finite_rate import skip_nonfinite_rate
      >>> tx = skip_nonfinite_rate(optax.sgd, lambda t: jnp.where(t == 1, jnp.nan, 0.25))
      >>> params = jnp.ones(2)
      >>> state = tx.init(params)
      >>> for _ in range(3):
      ...     updates, state = tx.update(jnp.ones(2), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(params, int(state.notfinite_lr_count))
      [0.5 0.5] 1
    """
    plain = optax.with_extra_args_support(build(learning_rate))
    if not callable(learning_rate):
        if isinstance(learning_rate, jax.Array | np.ndarray):
            return _skip_nonfinite_array(plain, learning_rate)
        return plain
    schedule: Callable[[Any], Any] = learning_rate

    def init(params: optax.Params) -> SkipNonFiniteRateState:
        return SkipNonFiniteRateState(jnp.zeros([], jnp.int32), jnp.zeros([], jnp.int32),
                                      plain.init(params))

    def update(updates: optax.Updates, state: SkipNonFiniteRateState,
               params: optax.Params | None = None, **extra: Any
               ) -> tuple[optax.Updates, SkipNonFiniteRateState]:
        skipped = state.notfinite_lr_count
        rate = schedule(state.steps)

        def shifted(count: Any) -> Any:
            """The rate of the inner step ``count``: the schedule's at the same step.

            Read as a number where not finite: the builders check ``shifted(0)``, and a
            step whose rate is not finite is skipped before its rate is used.
            """
            value = schedule(count + skipped)
            return jnp.where(jnp.isfinite(value), value, 0.0)

        inner = optax.with_extra_args_support(build(shifted))
        finite = jnp.all(jnp.isfinite(jnp.asarray(rate)))
        new_updates, inner_state = _select(
            finite, inner.update(updates, state.inner_state, params, **extra),
            (optax.tree.zeros_like(updates), state.inner_state))
        return new_updates, SkipNonFiniteRateState(
            optax.safe_increment(state.steps),
            jnp.where(finite, state.notfinite_lr_count,
                      optax.safe_increment(state.notfinite_lr_count)),
            inner_state)

    return optax.GradientTransformationExtraArgs(init, update)


def _skip_nonfinite_array(tx: optax.GradientTransformationExtraArgs, rate: Any
                          ) -> optax.GradientTransformationExtraArgs:
    """``tx`` (built with the array ``rate``) with a step skipped where ``rate`` is not finite.

    No state of its own: ``optax.inject_hyperparams`` rebuilds the optimizer at every step
    with that step's rate, and its state (``hyperparams["learning_rate"]``) shows the rate
    used; the inner state keeps its structure, and a skipped step is not counted.
    """

    def update(updates: optax.Updates, state: Any, params: optax.Params | None = None,
               **extra: Any) -> tuple[optax.Updates, Any]:
        return _select(jnp.all(jnp.isfinite(jnp.asarray(rate))),
                       tx.update(updates, state, params, **extra),
                       (optax.tree.zeros_like(updates), state))

    return optax.GradientTransformationExtraArgs(tx.init, update)


def _select(finite: jax.Array, taken: Any, skipped: Any) -> Any:
    """``taken`` where ``finite``, else ``skipped``, leaf by leaf.

    A select, not a ``lax.cond``: on a GPU a conditional's predicate is read on the host
    before the rest of the step can run; both are computed (the step with a rate of 0 where
    it is skipped) and XLA fuses the select into the step's own kernels.
    """
    return jax.tree.map(lambda a, b: jnp.where(finite, a, b), taken, skipped)
