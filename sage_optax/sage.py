"""SAGE: Sign-Adaptive GradiEnt (paper Algorithm 1 and Appendix "Instantaneous Stability").

For each parameter with gradient ``g`` at step ``t`` (from 1)::

    s_t = mean_{vocab axis} |g|            (matrices; |g| element-wise for vectors)  Eq. (2)
    S_t = b2 * S_{t-1} + (1 - b2) * s_t ;   Ŝ_t = S_t / (1 - b2^t)
    σ = sqrt(mean(Ŝ_t²)) ;  γ = sqrt(mean(s_t²))
    H_t = min(σ / (Ŝ_t + eps), γ / (s_t + eps), 1)   broadcast over the vocab axis
    C_t = sign(b1 * M_{t-1} + (1 - b1) * g)    (computed as sign(b1 M_t + (b2-b1) g))
    u_t = C_t ⊙ H_t                         (θ ← θ - η_t u_t after decay, in :func:`sage`)
    M_t = b2 * M_{t-1} + (1 - b2) * g

States: ``M`` (parameter shape, like Lion) and ``S`` (the reduced shape: ``O(d)`` for an
embedding ``(V, d)``), plus a step count.  ``‖H_t‖∞ ≤ 1``, so the update is never larger
than Lion's; with ``damper="none"`` it *is* Lion's.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from sage_optax import axes as axes_lib
from sage_optax import boxes, validation
from sage_optax.numerics import pow2_floor
from sage_optax.registry import RuleContext, register
from sage_optim.hyperparams import SageHyperparams
from sage_optim.numerics import mean_scale
from sage_optim.presets import RULE_DEFAULTS

_DEFAULTS = RULE_DEFAULTS["sage"]


class ScaleBySageState(NamedTuple):
    """State of :func:`scale_by_sage`.

    Attributes:
      count: number of steps taken so far (``int32``).
      mu: Lion-style momentum ``M``, with the parameters' structure and shapes.
      s: EMA ``S`` of the mean absolute gradient, in the reduced shape of each leaf, in
        float32 or wider.

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1: the states ``M`` and ``S``).
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
    mu: optax.Updates
    s: optax.Updates


class _LeafPlan(NamedTuple):
    reduce_axes: tuple[int, ...] | None  # the vocab (fan-out) axes, None: element-wise s_t
    rms_axes: tuple[int, ...]  # axes of s_t that σ and γ average over

    def kept_axes(self, ndim: int) -> tuple[int, ...] | None:
        """The parameter axes ``S`` keeps, in order (``None``: all, element-wise)."""
        if self.reduce_axes is None:
            return None
        return tuple(a for a in range(ndim) if a not in self.reduce_axes)


def _plan(path: str, spec: Any, shape: tuple[int, ...]) -> _LeafPlan:
    ndim = len(shape)
    if ndim < 2:  # Eq. (2): vectors and scalars are element-wise whatever the spec
        return _LeafPlan(None, tuple(range(ndim)))
    if axes_lib.is_axes(spec):
        r = axes_lib.resolve_axes(spec, shape, path)
        if not r.is_matrix:
            return _LeafPlan(None, r.feature_axes)
        # s_t drops the fan-out axes; σ and γ average over the remaining feature axes.
        kept = [a for a in range(ndim) if a not in r.fan_out]
        rms = tuple(kept.index(a) for a in r.feature_axes if a not in r.fan_out)
        return _LeafPlan(r.fan_out, rms)
    if spec is None or ndim < 2:
        return _LeafPlan(None, tuple(range(ndim)))
    if not -ndim <= spec < ndim:
        raise ValueError(
            f"axes={spec} is out of range for parameter {path!r} of shape {tuple(shape)}"
        )
    axis = spec % ndim
    if axis < ndim - 2:
        raise ValueError(
            f"axes={spec} of parameter {path!r} with shape {tuple(shape)} is a leading "
            "(stacked-layer) axis; pass a Route with explicit batch axes instead"
        )
    other = ndim - 2 if axis == ndim - 1 else ndim - 1
    return _LeafPlan((axis,), (other - (other > axis),))


def _mean_abs(g: jax.Array, plan: _LeafPlan) -> jax.Array:
    a = jnp.abs(g.astype(axes_lib.wide(g.dtype)))
    if plan.reduce_axes is None:
        return a
    c = mean_scale(math.prod(g.shape[ax] for ax in plan.reduce_axes))
    if c == 1.0:
        return jnp.mean(a, axis=plan.reduce_axes)
    return jnp.mean(a * c, axis=plan.reduce_axes) / c


def rms(x: jax.Array, axes: tuple[int, ...]) -> jax.Array:
    """``sqrt(mean(x²))`` over ``axes`` (kept, size 1), finite for every finite ``x``.

    Computed as ``m · sqrt(mean((x/m)²))`` with ``m`` the power of two ``m ≤ max|x| < 2m``
    (:func:`sage_optax.numerics.pow2_floor`), at most ``1/tiny`` of the dtype (``2^126`` in float32:
    XLA:CPU divides by multiplying by the reciprocal and flushes subnormals, so ``1/m`` must stay
    normal). The squares are then in range, where a plain ``x²`` overflows float32 from ``|x| ≈
    1.8e19``. Dividing and multiplying by a power of two is exact and the square root of ``y/m²`` is
    ``sqrt(y)/m`` exactly, so where ``x²`` is in range the result is
    bit for bit that of the plain formula.
    """
    m = pow2_floor(jnp.max(jnp.abs(x), axis=axes, keepdims=True, initial=0.0))
    return jnp.sqrt(jnp.mean(jnp.square(x / m), axis=axes, keepdims=True)) * m


def lion_direction(g: jax.Array, mu_prev: jax.Array, mu_new: jax.Array, b1: Any, b2: Any
                   ) -> jax.Array:
    """The sign direction ``C_t = sign(b1·M_{t−1} + (1−b1)·g)``, computed from ``M_t``.

    With ``M_t = b2·M_{t−1} + (1−b2)·g`` and ``b2 > 0``, ``b2·(b1·M_{t−1} + (1−b1)·g) =
    b1·M_t + (b2 − b1)·g``, so ``C_t = sign(b1·M_t + (b2 − b1)·g)``: the same sign, but read
    from the *new* momentum.  That matters for speed and memory: when the momentum buffer is
    updated in place (a donated jit step) and the update reads the old one, XLA must copy
    the old momentum first (a temporary of the size of all parameters on XLA:CPU, measured
    in ``benchmarks/jax_step.py``); read from ``M_t``, the whole step fuses into the donated
    buffers.  Rounding can differ from the direct form only where the argument is a tie
    within a few ulp.  ``b2 = 0`` (where ``M_{t−1}`` cannot be recovered) uses the direct
    form, also when ``b2`` is traced (``optax.inject_hyperparams``), via a select.
    """
    direct = b1 * mu_prev + (1.0 - b1) * g
    if isinstance(b2, (int, float)):
        return jnp.sign(direct if b2 == 0 else b1 * mu_new + (b2 - b1) * g)
    return jnp.sign(jnp.where(b2 > 0, b1 * mu_new + (b2 - b1) * g, direct))


def sage_damper(
    s: jax.Array,
    s_hat: jax.Array,
    eps: Any,
    damper: str = "both",
    rms_axes: tuple[int, ...] | None = None,
) -> jax.Array:
    """The adaptive scale ``H_t`` of SAGE in the reduced shape of ``s`` (Algorithm 1).

    Args:
      s: instantaneous mean absolute gradient ``s_t``.
      s_hat: bias-corrected EMA ``Ŝ_t``.
      eps: the ε of the paper.
      damper: one of :data:`DAMPERS`.
      rms_axes: axes of ``s`` that the RMS values σ and γ average over (the others are
        batch axes); ``None``: every axis.  The arguments come in the order of
        :func:`sage_torch.sage_damper`'s (``dims`` there).

    Returns:
      ``H_t = min(σ/(Ŝ_t+ε), γ/(s_t+ε), 1)`` (terms dropped per ``damper``), finite for
      every finite ``s`` and ``Ŝ`` (σ and γ are computed by :func:`rms`).

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1, the EMA damper; Appendix "Instantaneous Stability", the instantaneous
      one).
    """
    if rms_axes is None:
        rms_axes = tuple(range(jnp.ndim(s)))
    h = jnp.ones_like(s)
    if damper in ("both", "ema"):
        sigma = rms(s_hat, rms_axes)
        h = jnp.minimum(h, sigma / (s_hat + eps))
    if damper in ("both", "instant"):
        gamma = rms(s, rms_axes)
        h = jnp.minimum(h, gamma / (s + eps))
    return h


def scale_by_sage(
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    eps: float = _DEFAULTS["eps"],
    *,
    axes: axes_lib.AxesSpec = axes_lib.EMBEDDING_TABLE,
    mu_dtype: Any | None = None,
    damper: str = _DEFAULTS["damper"],
) -> optax.GradientTransformation:
    r"""Rescale updates by the SAGE rule: ``sign(momentum) ⊙ H_t`` (Algorithm 1).

    The returned update is :math:`C_t \odot H_t` with :math:`\|H_t\|_\infty \le 1`; chain it
    with weight decay and the learning rate (or use :func:`sage`).

    Args:
      b1: interpolation between momentum and gradient for the sign direction (β1).
        The authors' public PyTorch code updates ``M`` before forming the sign, which is
        this rule with ``b1 = 0.9 * 0.99 = 0.891``.
      b2: decay of the momentum ``M`` and of the scale EMA ``S`` (β2).
      eps: ε added to the denominators of both dampers.
      axes: the axis ``s_t`` averages over (the vocab axis of an embedding): a
        :class:`~sage_optax.Route` (reduce over its ``fan_out`` axis; the default
        ``EMBEDDING_TABLE = Route("embedding", fan_in=-1, fan_out=-2)`` is an ``nnx.Embed`` table
        ``(V, d)``, leading axes of a stacked leaf being batch axes), an ``int`` axis,
        ``None`` (element-wise ``s_t = |g|`` everywhere), a pytree of these, or a callable
        mapping params to one (such as ``lambda p: sage_optax.route_params(p).axes``).
        1-D and 0-D leaves are always element-wise.  Under ``optax.inject_hyperparams`` an
        ``int`` would become an array: pass it in ``static_args`` (the default needs not).
      mu_dtype: dtype of ``M`` (defaults to the parameter dtype), as in ``optax.lion``.
      damper: which dampers enter ``H_t``; see :data:`DAMPERS`.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleBySageState`.

    Examples:
      One step on a ``(V, d) = (2, 2)`` embedding table: ``s_t``, the mean of ``|g|`` over
      the vocab axis, is ``[2, 3]`` with RMS ``√6.5 ≈ 2.55``, so the first column keeps
      ``H = 1`` and the second, above the RMS, is damped to ``H = 2.55 / 3 ≈ 0.85``; the
      scale state ``S`` has one entry per column:

      >>> import jax.numpy as jnp, sage_optax
      >>> tx = sage_optax.scale_by_sage()
      >>> params = {"embedding": jnp.zeros((2, 2))}
      >>> grads = {"embedding": jnp.array([[1.0, 2.0], [3.0, -4.0]])}
      >>> updates, state = tx.update(grads, tx.init(params))
      >>> print(updates["embedding"].round(3))
      [[ 1.    0.85]
       [ 1.   -0.85]]
      >>> print(state.mu["embedding"].shape, state.s["embedding"].shape)
      (2, 2) (2,)

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1 and Appendix "Instantaneous Stability").

      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023 (Lion, the sign direction).
    """
    validation.check_hyperparameters("sage", b1=b1, b2=b2, eps=eps, damper=damper)
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params: optax.Params) -> ScaleBySageState:
        specs = axes_lib.resolve_spec(axes, params)
        treedef, leaves = axes_lib.flatten_with_spec(params, specs)
        mu, s = [], []
        s_axes: list[boxes.AxisSources] = []
        for path, spec, p in leaves:
            if axes_lib.is_masked(p):
                mu.append(p)
                s.append(p)
                s_axes.append(None)
                continue
            plan = _plan(path, spec, p.shape)
            mu.append(jnp.zeros_like(p, dtype=mu_dtype or p.dtype))
            # Built from the reduction of the parameter itself so that its dtype and
            # sharding are exactly those of what update_fn returns.
            s.append(jnp.zeros_like(_mean_abs(p, plan)))
            s_axes.append(plan.kept_axes(p.ndim))
        return ScaleBySageState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree_util.tree_unflatten(treedef, mu),
            # The reduced shape, in the parameter's box with the fan-out axes' names dropped.
            s=boxes.state_like(params, s, s_axes),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleBySageState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleBySageState]:
        del params
        count = optax.safe_increment(state.count)

        def leaf_update(path: str, spec: Any, g: jax.Array, m: jax.Array, s_prev: jax.Array
                        ) -> tuple[jax.Array, jax.Array, jax.Array]:
            axes_lib.check_same_shapes(
                [path], [m], [g], "the gradient", "the optimizer state"
            )
            plan = _plan(path, spec, g.shape)
            wide = axes_lib.wide(g.dtype)
            g32, m32 = g.astype(wide), m.astype(wide)
            s_t = _mean_abs(g, plan)
            s_ema = (b2 * s_prev.astype(wide) + (1 - b2) * s_t).astype(s_prev.dtype)
            bias = 1 - jnp.asarray(b2, wide) ** count.astype(wide)
            h = sage_damper(s_t, s_ema.astype(wide) / bias, eps, damper, plan.rms_axes)
            if plan.reduce_axes is not None:
                h = jnp.expand_dims(h, plan.reduce_axes)
            mu_t = (1 - b2) * g32 + b2 * m32
            u = (lion_direction(g32, m32, mu_t, b1, b2) * h).astype(g.dtype)
            return u, mu_t.astype(m.dtype), s_ema

        new_u, new_mu, new_s = axes_lib.map_leaves_with_state(
            leaf_update, updates, axes,
            {"the SAGE momentum state": state.mu, "the SAGE scale state": state.s},
        )
        # The state keeps the structure init gave it, whatever boxes the gradients are in.
        return new_u, ScaleBySageState(
            count=count, mu=boxes.keep_structure(state.mu, new_mu),
            s=boxes.keep_structure(state.s, new_s),
        )

    return optax.GradientTransformation(init_fn, update_fn)


def sage(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    eps: float = _DEFAULTS["eps"],
    weight_decay: float = _DEFAULTS["weight_decay"],
    *,
    mask: Any | None = None,
    axes: axes_lib.AxesSpec = axes_lib.EMBEDDING_TABLE,
    mu_dtype: Any | None = None,
    damper: str = _DEFAULTS["damper"],
) -> optax.GradientTransformation:
    r"""The SAGE optimizer (paper Algorithm 1) with decoupled weight decay.

    Per step: :math:`\theta \leftarrow \theta (1 - \eta_t w) - \eta_t\, C_t \odot H_t`
    (Algorithm 1; ``docs/algorithms.md``), i.e. ``chain(scale_by_sage, add_decayed_weights(w, mask),
    scale_by_learning_rate(η))``.

    Args:
      learning_rate: a float or an optax schedule (the paper uses 2e-3 with cosine decay
        and 10% warmup).
      b1: β1 of the sign direction (``0.891`` reproduces the authors' code; see
        :func:`scale_by_sage`).
      b2: β2 of the momentum and scale EMA.
      eps: ε of the dampers.
      weight_decay: decoupled decay ``w`` (multiplied by the learning rate).
      mask: which leaves get weight decay (pytree of bools or callable), as ``optax.adamw``.
      axes: see :func:`scale_by_sage`.  Without routing every matrix is treated as an
        embedding table ``(V, d)``; use :func:`sage_optax.make_optimizer` (``sage-pure``) to
        reduce dense kernels over their fan-out axis.
      mu_dtype: dtype of the momentum state.
      damper: see :data:`DAMPERS`.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      A few steps on a quadratic, as with any optax optimizer; the step is at most
      ``learning_rate`` per entry (``‖H_t‖∞ ≤ 1``):

      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> def loss(params):
      ...     return jnp.sum((params["embedding"] - 1.0) ** 2)
      >>> params = {"embedding": jnp.zeros((4, 3))}
      >>> tx = sage_optax.sage(learning_rate=0.1)
      >>> state = tx.init(params)
      >>> for _ in range(3):
      ...     grads = jax.grad(loss)(params)
      ...     updates, state = tx.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(f"{loss(params):.3f}", params["embedding"].max().round(3))
      5.885 0.3

    References:
      Lee and Kim, `SAGE: Sign-Adaptive Gradient for Memory-Efficient LLM Optimization
      <https://arxiv.org/abs/2604.07663>`_, 2026
      (Algorithm 1 and Appendix "Instantaneous Stability").

      Chen et al., `Symbolic Discovery of Optimization Algorithms
      <https://arxiv.org/abs/2302.06675>`_, 2023 (Lion, the sign direction).

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("sage", weight_decay=weight_decay)
    return optax.chain(
        scale_by_sage(b1, b2, eps, axes=axes, mu_dtype=mu_dtype, damper=damper),
        optax.add_decayed_weights(weight_decay, validation.checked_mask(mask)),
        optax.scale_by_learning_rate(learning_rate),
    )


@register("sage")
def build(learning_rate: optax.ScalarOrSchedule, hp: SageHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """:func:`sage` with the ``sage`` rule's hyperparameters ``hp`` (its builder)."""
    return sage(learning_rate, b1=hp.b1, b2=hp.b2, eps=hp.eps, weight_decay=hp.weight_decay,
                damper=hp.damper, mask=context.mask, axes=context.axes)
