"""The stateless normalised step ``g / (‖g‖₂ + ε)`` that ``sinkgd-pure`` uses on vectors."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from sage_optax import axes as axes_lib
from sage_optax import validation
from sage_optax.registry import RuleContext, register
from sage_optim.hyperparams import UnitNormHyperparams
from sage_optim.presets import RULE_DEFAULTS

_DEFAULTS = RULE_DEFAULTS["unit_norm"]


def scale_by_unit_norm(
    eps: float = _DEFAULTS["eps"], *, axes: axes_lib.AxesSpec = None
) -> optax.GradientTransformation:
    r"""Divide each leaf by its own L2 norm: :math:`u = g / (\|g\|_2 + \epsilon)` (stateless).

    Args:
      eps: ε added to the norm.
      axes: per-leaf axes; only the batch axes are used (a stacked leaf is normalised per
        batch index).  ``None`` normalises every leaf as a whole.

    Returns:
      An ``optax.GradientTransformation`` with empty state.

    Examples:
      >>> import jax.numpy as jnp, sage_optax
      >>> tx = sage_optax.scale_by_unit_norm()
      >>> updates, _ = tx.update({"scale": jnp.array([3.0, 4.0])}, tx.init(None))
      >>> print(updates["scale"])
      [0.6 0.8]

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (``sinkgd-pure``'s rule for 1-D parameters, which SinkGD cannot normalise).

      Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
      <https://arxiv.org/abs/2502.06742>`_, 2025 (stateless normalised steps).
    """
    validation.check_hyperparameters("unit_norm", eps=eps)

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params

        def normalize(path: str, spec: Any, g: jax.Array) -> jax.Array:
            if axes_lib.is_axes(spec):
                reduce_axes = axes_lib.resolve_axes(spec, tuple(g.shape), path).feature_axes
            else:
                reduce_axes = tuple(range(g.ndim))
            wide = g.astype(jnp.promote_types(g.dtype, jnp.float32))
            norm = jnp.sqrt(jnp.sum(jnp.square(wide), axis=reduce_axes, keepdims=True))
            return (wide / (norm + eps)).astype(g.dtype)

        return axes_lib.map_leaves(normalize, updates, axes), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def unit_norm_descent(
    learning_rate: optax.ScalarOrSchedule,
    weight_decay: float = _DEFAULTS["weight_decay"],
    *,
    eps: float = _DEFAULTS["eps"],
    mask: Any | None = None,
    axes: axes_lib.AxesSpec = None,
) -> optax.GradientTransformation:
    r"""Normalised descent with decay: :math:`\theta(1-\eta w) - \eta\, g/(\|g\|+\epsilon)`.

    Args:
      learning_rate: a float or an optax schedule.
      weight_decay: decoupled decay ``w``.
      eps: ε added to the norm.
      mask: which leaves get weight decay.
      axes: per-leaf axes (batch axes only), see :func:`scale_by_unit_norm`.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      Each step has length ``learning_rate`` (plus the decay), whatever the gradient's:

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> params = {"bias": jnp.array([3.0, 4.0])}
      >>> tx = sage_optax.unit_norm_descent(learning_rate=0.5, weight_decay=0.0)
      >>> grads = jax.tree.map(lambda p: 100.0 * p, params)
      >>> updates, _ = tx.update(grads, tx.init(params), params)
      >>> print(updates["bias"], jnp.linalg.norm(updates["bias"]))
      [-0.3 -0.4] 0.5

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (``sinkgd-pure``'s rule for 1-D parameters).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("unit_norm", weight_decay=weight_decay)
    return optax.chain(
        scale_by_unit_norm(eps, axes=axes),
        optax.add_decayed_weights(weight_decay, validation.checked_mask(mask)),
        optax.scale_by_learning_rate(learning_rate),
    )


@register("unit_norm")
def build(learning_rate: optax.ScalarOrSchedule, hp: UnitNormHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """:func:`unit_norm_descent` with the ``unit_norm`` rule's hyperparameters (its builder)."""
    return unit_norm_descent(learning_rate, weight_decay=hp.weight_decay, eps=hp.eps,
                             mask=context.mask, axes=context.axes)
