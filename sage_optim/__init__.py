"""Framework-neutral pieces shared by :mod:`sage_optax` and :mod:`sage_torch`.

Nothing here imports JAX or PyTorch (``tests/test_layering.py`` checks it).  Written once,
so that both frameworks build the very same optimizers from the very same numbers:

* :mod:`sage_optim.presets`: the paper's eight configurations and every rule's default
  hyperparameters (exported here: ``CONFIG_NAMES``, ``KINDS``, ``PRESETS``,
  ``RULE_DEFAULTS``, :class:`Preset`, :class:`Rule`, :func:`get_preset`);
* :mod:`sage_optim.hyperparams`: the hyperparameter choices and valid ranges, so a bad value
  gets the same message in both;
* :mod:`sage_optim.routing`: the language both routers speak (:class:`~sage_optim.routing.Route`,
  :class:`~sage_optim.routing.RoutingError`, the override grammar, the head policy);
* :mod:`sage_optim.table`: the routing table both ``routing_table`` functions return;
* :mod:`sage_optim.kernels`: ``SAGE_KERNELS``, the one switch of every GPU kernel.

Also here, for the trainer and the reproduction rather than the optimizers: the LLaMA shapes
of :mod:`sage_optim.models` (exported here: ``PAPER_MODELS``, :class:`LlamaConfig`,
:func:`get_model_config`) and the command-line helpers :mod:`sage_optim.cli_args`.  The
optimizer-state memory is counted by each framework from the state it builds
(:func:`sage_optax.state_bytes`, :func:`sage_torch.routing_table`), not here.
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
