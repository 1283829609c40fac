"""``torch.optim.Optimizer`` classes: SAGE, SinkGD, Lion, APOLLO and the multi-rule optimizer.

Every class is a :class:`RuleOptimizer` (:mod:`sage_torch.optimizer`): each param group
carries the name of its update rule (``group["rule"]``) and that rule's hyperparameters, so
one optimizer can run SAGE on the embedding and SinkGD on the dense matrices (what
:func:`sage_torch.make_optimizer` returns) while ``torch.optim.lr_scheduler`` and
``state_dict`` work as with any optimizer.  As in ``torch.optim``, each algorithm has its
own module holding its class, its rule and its ``_single_tensor_*``/``_multi_tensor_*``
step functions: :mod:`sage_torch.sage`, :mod:`sage_torch.sinkgd`, :mod:`sage_torch.lion`,
:mod:`sage_torch.adamw`, :mod:`sage_torch.unit_norm`, :mod:`sage_torch.apollo`; this module
gathers the classes.
"""

from __future__ import annotations

from sage_torch.apollo import APOLLO
from sage_torch.lion import Lion
from sage_torch.optimizer import MomentumError, ParamsT, RuleOptimizer
from sage_torch.sage import SAGE
from sage_torch.sinkgd import SinkGD

__all__ = ["APOLLO", "SAGE", "Lion", "MomentumError", "ParamsT", "RuleOptimizer", "SinkGD"]
