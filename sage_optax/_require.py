"""Imported first by :mod:`sage_optax`: without JAX or Optax, one line naming the extra."""

from sage_optim.extras import require_for_import

require_for_import("sage_optax", "jax")
