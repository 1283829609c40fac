"""sage_optax: SAGE, Unit-Norm SinkGD, APOLLO and the paper's hybrids as Optax transformations.

Quick start::

    import optax, sage_optax
    tx = sage_optax.make_optimizer("sage-hybrid")        # paper defaults, lr 2e-3
    print(sage_optax.routing_table("sage-hybrid", params))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)
    params = optax.apply_updates(params, updates)

The transforms follow Optax: ``scale_by_*`` transformations hold the rule; the aliases
(:func:`sage`, :func:`lion`, :func:`sinkgd`, :func:`unit_norm_descent`) chain it with
decoupled weight decay and the learning rate, and :func:`apollo` with
``add_decayed_weights_after_step`` (the step, then the decay, as APOLLO's code does);
:func:`make_optimizer` assembles the paper's configurations from them.  ``docs/`` states
every convention.

References:
  Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
  <https://arxiv.org/abs/2604.07663>`_, 2026.

  Scetbon et al., `Gradient Multi-Normalization for Stateless and Scalable LLM Training
  <https://arxiv.org/abs/2502.06742>`_, 2025.

  Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
  <https://arxiv.org/abs/2412.05270>`_, 2024.

  Chen et al., `Symbolic Discovery of Optimization Algorithms
  <https://arxiv.org/abs/2302.06675>`_, 2023.
"""

# first: without JAX/Optax, one line naming the [jax] extra instead of a deep traceback
from sage_optax import (
    _require,  # noqa: F401
    placement,
)
from sage_optax import adamw as _adamw  # noqa: F401  (registers the adamw rule)
from sage_optax.apollo import ScaleByApolloState, apollo, scale_by_apollo
from sage_optax.axes import EMBEDDING_TABLE, unbox
from sage_optax.configs import RoutingTable, make_optimizer, routing_table, sage_hybrid
from sage_optax.linen_evidence import LinenModel, linen_model
from sage_optax.lion import lion, scale_by_lion
from sage_optax.memory import state_bytes, state_bytes_by_leaf
from sage_optax.routing import (
    PARAM_LAYOUTS,
    NoLayoutEvidenceWarning,
    ParamRouting,
    ResolvedRoute,
    Route,
    RoutingError,
    iter_leaves,
    leaf_name_path,
    module_routes,
    route_params,
)
from sage_optax.sage import ScaleBySageState, sage, sage_damper, scale_by_sage
from sage_optax.sinkgd import IMPLS as SINKGD_IMPLS
from sage_optax.sinkgd import resolved_impl as resolved_sinkgd_impl
from sage_optax.sinkgd import scale_by_sinkhorn, sinkgd, sinkhorn_normalize
from sage_optax.unit_norm import scale_by_unit_norm, unit_norm_descent
from sage_optim.hyperparams import DAMPERS, NORMALIZATIONS, SCALE_TYPES
from sage_optim.presets import CONFIG_NAMES

__version__ = "0.1.0"

__all__ = [
    "CONFIG_NAMES",
    "DAMPERS",
    "EMBEDDING_TABLE",
    "LinenModel",
    "PARAM_LAYOUTS",
    "NORMALIZATIONS",
    "NoLayoutEvidenceWarning",
    "ParamRouting",
    "ResolvedRoute",
    "Route",
    "RoutingError",
    "RoutingTable",
    "ScaleByApolloState",
    "SCALE_TYPES",
    "SINKGD_IMPLS",
    "ScaleBySageState",
    "apollo",
    "iter_leaves",
    "leaf_name_path",
    "linen_model",
    "lion",
    "make_optimizer",
    "module_routes",
    "placement",
    "resolved_sinkgd_impl",
    "route_params",
    "routing_table",
    "sage",
    "sage_damper",
    "sage_hybrid",
    "scale_by_apollo",
    "scale_by_lion",
    "scale_by_sage",
    "scale_by_sinkhorn",
    "scale_by_unit_norm",
    "sinkgd",
    "sinkhorn_normalize",
    "unbox",
    "state_bytes",
    "state_bytes_by_leaf",
    "unit_norm_descent",
]
