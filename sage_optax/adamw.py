"""AdamW, Optax's own (``optax.adamw``), registered as the ``adamw`` rule of the configurations.

The paper's baseline and the element-wise rule of the hybrids; ``b2 = 0.99`` by default,
as the paper runs every optimizer (:data:`sage_optim.presets.RULE_DEFAULTS`).
"""

from __future__ import annotations

import optax

from sage_optax import validation
from sage_optax.registry import RuleContext, register
from sage_optim.hyperparams import AdamWHyperparams


@register("adamw")
def build(learning_rate: optax.ScalarOrSchedule, hp: AdamWHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """``optax.adamw`` with the ``adamw`` rule's hyperparameters ``hp`` (its builder)."""
    return optax.adamw(learning_rate, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                       weight_decay=hp.weight_decay,
                       mask=validation.checked_mask(context.mask))
