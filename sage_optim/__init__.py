"""Framework-neutral pieces shared by :mod:`sage_optax` and :mod:`sage_torch`.

Nothing here imports JAX or PyTorch: the configuration table, the default hyperparameters,
the paper's model shapes and memory figures, and the text-table formatter live here once so
that both frameworks build the very same optimizers from the very same numbers.
"""

from sage_optim.models import PAPER_MODELS, LlamaConfig, get_model_config
from sage_optim.presets import (
    CONFIG_NAMES,
    KINDS,
    PRESETS,
    RULE_DEFAULTS,
    Preset,
    Rule,
    get_preset,
)

__all__ = [
    "CONFIG_NAMES",
    "KINDS",
    "PAPER_MODELS",
    "PRESETS",
    "RULE_DEFAULTS",
    "LlamaConfig",
    "Preset",
    "Rule",
    "get_model_config",
    "get_preset",
]
