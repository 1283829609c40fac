"""Lion (Chen et al. 2023) whose step reads only the new momentum, so it runs in place.

``optax.scale_by_lion`` forms the direction ``sign(b1·M_{t−1} + (1−b1)·g)`` from the *old*
momentum and then writes ``M_t``; in a donated jit step XLA must therefore keep a copy of
``M_{t−1}`` while ``M_t`` overwrites it: a temporary the size of every parameter Lion
updates (501 MiB for the 270M model's token table on the CPU, ``benchmarks/RESULTS.md``).
:func:`scale_by_lion` reads the same sign from ``M_t`` (:func:`sage_optax.sage.lion_direction`,
``sign(b1·M_t + (b2−b1)·g)``, equal to the direct form but for ties within a few ulp), so the
whole step fuses into the donated buffers.  The state is optax's own
``optax.ScaleByLionState``: checkpoints of ``optax.lion`` and of :func:`lion` are
interchangeable.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from sage_optax import validation
from sage_optax.registry import RuleContext, register
from sage_optax.sage import lion_direction
from sage_optim.hyperparams import LionHyperparams
from sage_optim.presets import RULE_DEFAULTS

_DEFAULTS = RULE_DEFAULTS["lion"]


def scale_by_lion(
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    mu_dtype: Any | None = None,
) -> optax.GradientTransformation:
    r"""Rescale updates by Lion's rule: :math:`\mathrm{sign}(\beta_1 M_{t-1} + (1-\beta_1) g)`.

    The momentum is :math:`M_t = \beta_2 M_{t-1} + (1-\beta_2) g`; the sign is computed
    from :math:`M_t` as :math:`\mathrm{sign}(\beta_1 M_t + (\beta_2-\beta_1) g)` (the same
    value for :math:`\beta_2 > 0`; the direct form for :math:`\beta_2 = 0`), so the update
    needs no copy of :math:`M_{t-1}`.  Arithmetic is in the gradient's dtype, as
    ``optax.scale_by_lion``.

    Args:
      b1: interpolation between momentum and gradient for the sign (β1).
      b2: decay of the momentum (β2).
      mu_dtype: dtype of the momentum (defaults to the parameters' dtype).

    Returns:
      An ``optax.GradientTransformation`` with state ``optax.ScaleByLionState``.

    Examples:
      The update is a sign, whatever the gradient's size; the state is optax's own:

      >>> import jax.numpy as jnp, optax, sage_optax
      >>> params = {"w": jnp.array([1.0, -2.0])}
      >>> tx = sage_optax.scale_by_lion()
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.array([0.5, -0.1])}, state)
      >>> print(updates["w"])
      [ 1. -1.]
      >>> print(isinstance(state, optax.ScaleByLionState), state.mu["w"].round(3))
      True [ 0.005 -0.001]

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023.
    """
    validation.check_hyperparameters("lion", b1=b1, b2=b2)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params: optax.Params) -> optax.ScaleByLionState:
        mu = optax.tree.zeros_like(params, dtype=mu_dtype)
        return optax.ScaleByLionState(count=jnp.zeros([], jnp.int32), mu=mu)

    def update_fn(
        updates: optax.Updates,
        state: optax.ScaleByLionState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, optax.ScaleByLionState]:
        del params
        mu = optax.tree.update_moment(updates, state.mu, b2, 1)
        direction = jax.tree.map(
            lambda g, m_prev, m: None if g is None else lion_direction(g, m_prev, m, b1, b2),
            updates, state.mu, mu, is_leaf=lambda x: x is None,
        )
        mu = optax.tree.cast(mu, mu_dtype)
        return direction, optax.ScaleByLionState(
            count=optax.safe_increment(state.count), mu=mu
        )

    return optax.GradientTransformation(init_fn, update_fn)


def lion(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    mu_dtype: Any | None = None,
    weight_decay: float = _DEFAULTS["weight_decay"],
    mask: Any | None = None,
) -> optax.GradientTransformation:
    r"""The Lion optimizer, ``optax.lion``'s chain with the in-place :func:`scale_by_lion`.

    Per step: :math:`\theta \leftarrow \theta(1 - \eta_t w) - \eta_t\,
    \mathrm{sign}(\beta_1 M_{t-1} + (1-\beta_1) g)`, i.e. ``chain(scale_by_lion,
    add_decayed_weights(w, mask), scale_by_learning_rate(η))``, the same transformations
    and state as ``optax.lion``.

    Args:
      learning_rate: a float or an optax schedule.
      b1: β1 of the sign.
      b2: β2 of the momentum.
      mu_dtype: dtype of the momentum.
      weight_decay: decoupled decay ``w``.
      mask: which leaves get weight decay (pytree of bools or callable).

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      A drop-in for ``optax.lion``: the same steps, the same state:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> def loss(params):
      ...     return jnp.sum((params["w"] - 1.0) ** 2)
      >>> params = {"w": jnp.array([0.0, 2.0, 0.5])}
      >>> ours, theirs = sage_optax.lion(0.1), optax.lion(0.1, b2=0.99, weight_decay=0.01)
      >>> a, b = ours.init(params), theirs.init(params)
      >>> p = q = params
      >>> for _ in range(3):
      ...     ua, a = ours.update(jax.grad(loss)(p), a, p)
      ...     ub, b = theirs.update(jax.grad(loss)(q), b, q)
      ...     p, q = optax.apply_updates(p, ua), optax.apply_updates(q, ub)
      >>> print(" ".join(f"{w:.3f}" for w in p["w"]), bool(jnp.allclose(p["w"], q["w"])))
      0.300 1.694 0.798 True

    References:
      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023.
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("lion", weight_decay=weight_decay)
    return optax.chain(
        scale_by_lion(b1, b2, mu_dtype),
        optax.add_decayed_weights(weight_decay, validation.checked_mask(mask)),
        optax.scale_by_learning_rate(learning_rate),
    )


@register("lion")
def build(learning_rate: optax.ScalarOrSchedule, hp: LionHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """:func:`lion` with the ``lion`` rule's hyperparameters ``hp`` (its builder)."""
    return lion(learning_rate, b1=hp.b1, b2=hp.b2, weight_decay=hp.weight_decay,
                mask=context.mask)
