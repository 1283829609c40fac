"""Framework-neutral pieces shared by :mod:`sage_optax` and :mod:`sage_torch`.

Nothing here imports JAX or PyTorch (``tests/core/test_core_layering.py`` checks it), and everything
here serves both frameworks, written once so that they build the very same optimizers from
the very same numbers:

* :mod:`sage_optim.presets`: the paper's eight configurations and every rule's default
  hyperparameters (exported here: ``CONFIG_NAMES``, ``KINDS``, ``PRESETS``,
  ``RULE_DEFAULTS``, :class:`Preset`, :class:`RuleSpec`, :func:`get_preset`);
* :mod:`sage_optim.hyperparams`: each rule's typed hyperparameters (one frozen dataclass per
  rule, whose defaults are ``RULE_DEFAULTS``), the hyperparameter choices and valid ranges, so
  a bad value gets the same message in both;
* :mod:`sage_optim.settings`: a ``make_optimizer`` call's keywords parsed once into typed
  per-kind settings, which both frameworks build from;
* :mod:`sage_optim.routing`: the language both routers speak (:class:`~sage_optim.routing.Route`,
  :class:`~sage_optim.routing.RoutingError`, the override grammar, the adapter registry);
  :mod:`sage_optim.naming`: the name rules both routers read; :mod:`sage_optim.decision`:
  their one decision (overrides, then the head policy); :mod:`sage_optim.adapters`: the
  name conventions of other libraries' models;
* :mod:`sage_optim.numerics`: the numeric helpers both use (the power-of-two range scale, the
  mean scale);
* :mod:`sage_optim.table`: the routing table both ``routing_table`` functions return;
* :mod:`sage_optim.rates`: each kind's effective step (the rate times the rule's scale),
  ``<kind>_learning_rate=``, and the notice for a rate far from a configuration's;
* :mod:`sage_optim.kernels`: ``SAGE_KERNELS``, the one switch of every GPU kernel;
* :mod:`sage_optim.extras`: the optional extras and the one-line message naming the extra a
  missing framework needs;
* :mod:`sage_optim.console`: what every console script shares (a closed output pipe ends
  it quietly).

The paper's model shapes and the command-line helpers live with their users, in
:mod:`sage_train` (``sage_train.model.shapes``, ``sage_train.job.cli_args``).  The
optimizer-state memory is counted by each framework from the state it builds
(:func:`sage_optax.state_bytes`, :func:`sage_torch.routing_table`), not here.
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
