"""sage_torch: the PyTorch twin of :mod:`sage_optax`, making the very same updates.

``torch.optim.Optimizer`` classes :class:`SAGE`, :class:`SinkGD`, :class:`Lion` and
:class:`APOLLO`; :func:`make_optimizer` builds any of the paper's eight configurations for
an ``nn.Module`` as one :class:`RuleOptimizer` whose param groups carry their rule, from the
table shared with :mod:`sage_optax` (:mod:`sage_optim.presets`); each algorithm module
registers its rule in :mod:`sage_torch.registry`, which the base optimizer reads.
:func:`route_params` places every parameter (kind, fan-in/fan-out axes, evidence;
:mod:`sage_torch.routing`), and :func:`routing_table` prints it.
"""

from sage_optim.presets import CONFIG_NAMES
from sage_optim.routing import Route, RoutingError
from sage_optim.table import RoutingRow, RoutingTable

# _require first: without PyTorch, one line naming the [torch] extra, not a deep traceback.
# The algorithm modules register their rules in sage_torch.registry as they are imported;
# the base optimizer (sage_torch.optimizer) imports none of them.
from sage_torch import _require, adamw, apollo, lion, sage, sinkgd, unit_norm  # noqa: F401
from sage_torch.apollo import APOLLO, gaussian_projection
from sage_torch.configs import make_optimizer, param_groups, routing_table
from sage_torch.lion import Lion
from sage_torch.optimizer import MomentumError, RuleOptimizer
from sage_torch.routing import RoutedParam, route_params
from sage_torch.sage import SAGE, sage_damper
from sage_torch.sinkgd import SinkGD, sinkhorn_normalize

__version__ = "0.1.0"

__all__ = [
    "APOLLO",
    "CONFIG_NAMES",
    "SAGE",
    "Lion",
    "MomentumError",
    "Route",
    "RoutedParam",
    "RoutingError",
    "RoutingRow",
    "RoutingTable",
    "RuleOptimizer",
    "SinkGD",
    "gaussian_projection",
    "make_optimizer",
    "param_groups",
    "route_params",
    "routing_table",
    "sage_damper",
    "sinkhorn_normalize",
]
