"""Framework-neutral pieces shared by :mod:`sage_optax` and :mod:`sage_torch`.

Nothing here imports JAX or PyTorch, and everything here serves both frameworks: the
configuration table and the default hyperparameters (:mod:`~sage_optim.presets`), their
ranges (:mod:`~sage_optim.hyperparams`), the routing policy (:mod:`~sage_optim.routing`),
the numeric helpers both use (:mod:`~sage_optim.numerics`), the kernel switch
(:mod:`~sage_optim.kernels`) and the routing-table formatter (:mod:`~sage_optim.table`), so
that both frameworks build the very same optimizers from the very same numbers.  The
paper's model shapes and the command-line helpers live with their users, in
:mod:`sage_train` (``sage_train.model_shapes``, ``sage_train.cli_args``).
"""

from sage_optim.presets import (
    CONFIG_NAMES,
    KINDS,
    PRESETS,
    RULE_DEFAULTS,
    Preset,
    RuleSpec,
    get_preset,
)

__all__ = [
    "CONFIG_NAMES",
    "KINDS",
    "PRESETS",
    "RULE_DEFAULTS",
    "Preset",
    "RuleSpec",
    "get_preset",
]
