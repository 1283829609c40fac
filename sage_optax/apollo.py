"""APOLLO: SGD-like memory, AdamW-level performance (Zhu et al. 2024, arXiv:2412.05270).

For a dense matrix with gradient ``G`` at step ``t`` (from 1), per batch index of stacked
layers (``docs/algorithms.md``, APOLLO)::

    P   = projection(path, k, n, r)         k = (t − 1) // T, entries N(0, 1/r), not stored
    R   = G ×_c P                           compress axis c (the smaller one) to rank r
    M_t = b1 M_{t−1} + (1 − b1) R ;  V_t = b2 V_{t−1} + (1 − b2) R²
    R̃   = M_t / (√V_t + ε)                 (no bias correction inside R̃)
    s   = ‖R̃‖_F / (‖R‖_F + 1e-8)            "tensor": one factor per matrix
          ‖R̃_j‖ / (‖R_j‖ + 1e-8)            "channel": one per index j of the other axis
    U   = G · s · √scale
    U  ← U · γ ρ / ‖U‖_F   if ρ > 0 and ‖U‖_F > γ ρ ;  ρ ← ‖U‖_F    (norm-growth limiter)
    u_t = U · √(1 − b2^t) / (1 − b1^t)

and :func:`apollo` takes ``θ ← (θ − η_t u_t)(1 − η_t w)``: the decay is applied *after* the
step, as in APOLLO's code.  The compressed axis ``c`` is the fan-in axis when the fan-out
size is at least the fan-in size, otherwise the fan-out axis, so ``R``, ``M`` and ``V``
have ``r`` entries along ``c``: for APOLLO-Mini (rank 1, ``tensor``) the state of an
``(in, out)`` kernel is ``O(max(in, out))``.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sage_optax import axes as axes_lib
from sage_optax import boxes, validation
from sage_optax.registry import RuleContext, register
from sage_optim.hyperparams import ApolloHyperparams
from sage_optim.presets import RULE_DEFAULTS
from sage_optim.routing import ResolvedRoute

_DEFAULTS = RULE_DEFAULTS["apollo"]
_KERNEL = axes_lib.KERNEL  # a Flax kernel (in, out), leading axes stacked

Projection = Callable[[str, jax.Array, int, int], jax.Array]
"""``projection(path, refresh_index, n, rank) -> P`` with ``P.shape == (n, rank)``."""

_NORM_FLOOR = 1e-8  # the 1e-8 added to ‖R‖ in the scaling factor (docs/algorithms.md)


def gaussian_projection(seed: int = 0) -> Projection:
    r"""The default APOLLO projection: ``P`` with i.i.d. entries :math:`N(0, 1/r)`.

    ``P = jax.random.normal(key, (n, rank), float32) / sqrt(rank)`` with
    ``key = fold_in(fold_in(key(seed), crc32(path)), refresh_index)``.  Keying on the leaf's
    *path* (not its index among the leaves) keeps ``P`` identical when the leaf is trained
    inside ``optax.partition``/``optax.masked``, where other leaves become masked, and on
    the refresh index, so ``P`` changes every ``update_proj_gap`` steps without being
    stored.  The entries are float32 normals whatever the parameter dtype (callers cast up),
    so float32 and float64 runs see the same ``P``.

    Args:
      seed: base seed of the generator.

    Returns:
      A :data:`Projection` callable; ``refresh_index`` may be a traced integer.

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.
    """

    def projection(path: str, refresh_index: jax.Array, n: int, rank: int) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed), np.uint32(zlib.crc32(path.encode())))
        key = jax.random.fold_in(key, refresh_index)
        return jax.random.normal(key, (n, rank), jnp.float32) / math.sqrt(rank)

    return projection


class ScaleByApolloState(NamedTuple):
    """State of :func:`scale_by_apollo`.

    Attributes:
      count: number of steps taken so far (``int32``).
      mu: first moment ``M`` of the projected gradient ``R``, per leaf in the leaf's own
        layout with the compressed axis shrunk to ``rank`` (float32 or wider).
      nu: second moment ``V`` of ``R``, shaped like ``mu``.
      norm: ``‖U‖_F`` of the previous step after limiting, per leaf with the shape of its
        batch axes (a scalar for a plain matrix; float32 or wider); ``0`` means "not
        recorded yet".

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.
    """

    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count
    mu: optax.Updates
    nu: optax.Updates
    norm: optax.Updates


class _LeafPlan(NamedTuple):
    compressed: int  # axis of the (matrix view of the) leaf projected to rank r
    matrix_axes: tuple[int, int]  # (fan_in, fan_out), sorted
    moment_shape: tuple[int, ...]
    norm_shape: tuple[int, ...]
    merged: ResolvedRoute | None  # axis groups: work on this matrix view instead

    def _view_axes(self, ndim: int) -> tuple[int | None, ...]:
        """For each axis of the matrix view, the parameter axis it is (``None``: merged)."""
        if self.merged is None:
            return tuple(range(ndim))
        m = self.merged

        def one(group: tuple[int, ...]) -> int | None:
            return group[0] if len(group) == 1 else None

        return (*m.batch, one(m.fan_in), one(m.fan_out))

    def moment_axes(self, ndim: int) -> tuple[int | None, ...]:
        """The parameter axis of each axis of ``M`` and ``V`` (the rank axis: ``None``)."""
        view = self._view_axes(ndim)
        return tuple(None if i == self.compressed else a for i, a in enumerate(view))

    def norm_axes(self, ndim: int) -> tuple[int | None, ...]:
        """The parameter axis of each axis of the limiter norm (the batch axes)."""
        view = self._view_axes(ndim)
        return tuple(a for i, a in enumerate(view) if i not in self.matrix_axes)


def _plan(path: str, spec: Any, shape: tuple[int, ...], rank: int) -> _LeafPlan | None:
    """Resolve a leaf's axes; ``None`` for a leaf that passes through (spec ``None``).

    A leaf whose fan-in or fan-out is a group of axes is worked on as its matrix view
    ``(batch..., fan_in, fan_out)`` (:func:`~sage_optax.axes.to_matrix`, each
    group flattened in the order it lists its axes), and its moments are kept in that view.
    """
    if spec is None:
        return None
    if not axes_lib.is_axes(spec):
        raise TypeError(f"parameter {path!r}: axes must be a Route or None, got {spec!r}")
    if len(shape) < 2 or not spec.fan_in:
        raise ValueError(
            f"APOLLO needs a matrix, but parameter {path!r} has shape {tuple(shape)}"
            + ("" if len(shape) < 2 else " and vector axes")
            + "; route 1-D/0-D parameters to another rule (e.g. make_optimizer(...) or "
            "optax.partition)"
        )
    r = axes_lib.resolve_axes(spec, tuple(shape), path)
    merged = None
    if not r.is_simple:
        merged, r = r, r.matrix()
        shape = r.shape
    (fi,), (fo,) = r.fan_in, r.fan_out
    compressed = fi if shape[fo] >= shape[fi] else fo
    moment_shape = tuple(rank if a == compressed else n for a, n in enumerate(shape))
    norm_shape = tuple(n for a, n in enumerate(shape) if a not in (fi, fo))
    return _LeafPlan(compressed, (min(fi, fo), max(fi, fo)), moment_shape, norm_shape, merged)


def _one_minus_pow(b: Any, t: jax.Array, dtype: Any) -> jax.Array:
    """``1 − b^t`` without cancellation: ``−expm1(t·log1p(−(1 − b)))``.

    ``1 − b`` is formed before any cast (in Python double when ``b`` is a number), so the
    float32 bias correction of early steps is accurate to rounding instead of losing
    about four digits to ``1 − 0.999^t``.
    """
    return -jnp.expm1(t * jnp.log1p(-jnp.asarray(1 - b, dtype)))


def _project(g: jax.Array, p: jax.Array, axis: int) -> jax.Array:
    """Contract ``g``'s ``axis`` with ``p`` ``(n, r)``, keeping ``g``'s layout (``r`` there)."""
    moved = jnp.moveaxis(g, axis, -1)
    out = jnp.matmul(moved, p, precision=jax.lax.Precision.HIGHEST)
    return jnp.moveaxis(out, -1, axis)


def _norm(x: jax.Array, axis: Any) -> jax.Array:
    return jnp.sqrt(jnp.sum(jnp.square(x), axis=axis, keepdims=True))


def _scaling_factor(r: jax.Array, r_tilde: jax.Array, axis: Any) -> jax.Array:
    """APOLLO's ``s = ‖R̃‖/(‖R‖ + 1e-8)``, norms over ``axis`` (kept, to broadcast onto G)."""
    return _norm(r_tilde, axis) / (_norm(r, axis) + _NORM_FLOOR)


def scale_by_apollo(
    rank: int = _DEFAULTS["rank"],
    scale_type: str = _DEFAULTS["scale_type"],
    scale: float = _DEFAULTS["scale"],
    update_proj_gap: int = _DEFAULTS["update_proj_gap"],
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    eps: float = _DEFAULTS["eps"],
    limiter_gamma: float = _DEFAULTS["limiter_gamma"],
    seed: int = _DEFAULTS["seed"],
    *,
    axes: axes_lib.AxesSpec = _KERNEL,
    projection: Projection | None = None,
) -> optax.GradientTransformation:
    r"""Rescale each gradient matrix by APOLLO's projected AdamW ratio (Zhu et al. 2024).

    The update of a matrix leaf with gradient :math:`G` at step :math:`t` is

    .. math::

        u_t = \frac{\sqrt{1-\beta_2^t}}{1-\beta_1^t}\, \mathrm{lim}\big(G\, s_t \sqrt{c}\big),
        \qquad s_t = \frac{\|\tilde R_t\|}{\|R_t\| + 10^{-8}},\quad
        \tilde R_t = \frac{M_t}{\sqrt{V_t}+\epsilon},

    where :math:`R_t = G \times_{\text{axis}} P_k` is the gradient with its smaller axis
    (fan-in if fan-out ≥ fan-in, else fan-out) compressed to ``rank`` by a random
    projection :math:`P_k`, :math:`M_t, V_t` are AdamW moments of :math:`R_t`, :math:`c`
    is ``scale``, and :math:`\mathrm{lim}` is the norm-growth limiter (``docs/algorithms.md``):
    with :math:`\rho` the recorded norm of the previous step,
    :math:`U \leftarrow U\,\gamma\rho/\|U\|_F` if :math:`\rho > 0` and
    :math:`\|U\|_F > \gamma\rho`, then :math:`\rho \leftarrow \|U\|_F`.

    *Deviation from a literal reading:* the limiter acts only once a non-zero norm has been
    recorded.  When :math:`\rho = 0` (the first step, or every step so far had ``U = 0``)
    it only records, so an all-zero first gradient does not freeze the matrix forever
    (literally, ``‖U‖ ≤ γ·0`` would hold every later update at zero).

    Stacked leaves (batch axes, e.g. ``(L, in, out)``) are handled per batch index: one
    scale, one limiter norm (``norm`` has the batch shape) and separate moments per layer.
    All layers of one leaf share the projection ``P`` (one per leaf path and refresh).

    The projection ``P_k`` with ``k = (t-1) // update_proj_gap`` is regenerated from
    ``(seed, path, k)`` every step and never stored; moments are not reset at a refresh.
    Pass ``projection`` to supply it yourself, e.g. to feed the PyTorch twin and this
    transform the same matrices: it is called as ``projection(path, k, n, rank)`` with the
    dotted leaf path (``"layers.0.mlp.kernel"``), a traced ``int32`` refresh index ``k``
    (use it only in traceable code such as ``jax.random.fold_in``), the size ``n`` of the
    compressed axis and ``rank``, and must return an ``(n, rank)`` array.

    Args:
      rank: rank ``r`` of the projection (APOLLO-Mini: 1).  Structural.
      scale_type: ``"tensor"`` (one factor per matrix, APOLLO-Mini) or ``"channel"`` (one
        per index of the uncompressed axis, norms over the rank axis).  Structural.
      scale: the factor ``c`` under the square root (APOLLO-Mini: 128).
      update_proj_gap: refresh period ``T`` of the projection, in steps.  Structural.
      b1: β1 of the moment ``M``.
      b2: β2 of the moment ``V``.
      eps: ε of :math:`\tilde R`.
      limiter_gamma: growth bound γ of the limiter (``float("inf")`` disables it).
      seed: seed of the default projection.  Structural.
      axes: axes of each leaf: one :class:`~sage_optax.Route` (default: a Flax kernel
        ``(in, out)``, leading axes stacked), a pytree of them (``None`` leaves pass
        through unchanged, without state) or a callable of the params.
      projection: optional :data:`Projection` replacing :func:`gaussian_projection`.

    With ``optax.inject_hyperparams`` the numeric hyperparameters (``scale``, ``b1``,
    ``b2``, ``eps``, ``limiter_gamma``) may be arrays; ``rank``, ``scale_type``,
    ``update_proj_gap`` and ``seed`` fix shapes and code paths and must be passed through
    ``static_args``, and so must ``projection`` (``inject_hyperparams`` would take any
    callable for a schedule and call it with the step count).  Arithmetic is in float32,
    or the parameter dtype if wider; moments and norms are kept in that dtype; the update
    has the gradient's dtype.

    Returns:
      An ``optax.GradientTransformation`` with state :class:`ScaleByApolloState`.  A leaf
      that is not a matrix raises a ``ValueError`` naming its path and shape ("APOLLO
      needs a matrix").

    Examples:
      APOLLO-Mini (the defaults) on a Flax kernel ``(in, out) = (4, 3)``: the smaller axis,
      fan-out, is projected to rank 1, so the moments hold 4 numbers, not 12, and the update
      is the gradient times one positive factor (``"tensor"`` scaling):

      >>> import jax.numpy as jnp, sage_optax
      >>> grads = {"kernel": jnp.arange(1.0, 13.0).reshape(4, 3)}
      >>> tx = sage_optax.scale_by_apollo()
      >>> updates, state = tx.update(grads, tx.init(grads))
      >>> print(state.mu["kernel"].shape, state.nu["kernel"].shape)
      (4, 1) (4, 1)
      >>> ratio = updates["kernel"] / grads["kernel"]
      >>> print(bool(jnp.allclose(ratio, ratio[0, 0])), bool(ratio[0, 0] > 0))
      True True

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.
    """
    validation.check_hyperparameters(
        "apollo", rank=rank, scale_type=scale_type, scale=scale,
        update_proj_gap=update_proj_gap, b1=b1, b2=b2, eps=eps, limiter_gamma=limiter_gamma,
    )
    project_fn = projection if projection is not None else gaussian_projection(seed)

    def get_projection(path: str, k: jax.Array, n: int, dtype: Any) -> jax.Array:
        p = jnp.asarray(project_fn(path, k, n, rank))
        if tuple(p.shape) != (n, rank):
            raise ValueError(
                f"parameter {path!r}: the projection returned shape {tuple(p.shape)}, "
                f"expected {(n, rank)} (size of the compressed axis, rank)"
            )
        return p.astype(dtype)

    def init_fn(params: optax.Params) -> ScaleByApolloState:
        specs = axes_lib.resolve_spec(axes, params)
        treedef, leaves = axes_lib.flatten_with_spec(params, specs)
        mu, nu, norm = [], [], []
        moment_axes: list[boxes.AxisSources] = []
        norm_axes: list[boxes.AxisSources] = []
        for path, spec, p in leaves:
            plan = None if axes_lib.is_masked(p) else _plan(path, spec, p.shape, rank)
            if plan is None:
                masked = p if axes_lib.is_masked(p) else optax.MaskedNode()
                mu.append(masked)
                nu.append(masked)
                norm.append(masked)
                moment_axes.append(None)
                norm_axes.append(None)
                continue
            # Built by the very operations update_fn applies to the gradient (projection,
            # norm over the matrix axes), so that dtypes and shardings of the state match
            # what update_fn returns (explicit-sharding meshes make sharding part of the type).
            wide = axes_lib.wide(p.dtype)
            p_wide = p.astype(wide) if plan.merged is None else axes_lib.to_matrix(plan.merged, p)
            p_wide = p_wide.astype(wide)
            zero_proj = jnp.zeros((p_wide.shape[plan.compressed], rank), wide)
            r0 = jnp.zeros_like(_project(p_wide, zero_proj, plan.compressed))
            mu.append(r0)
            nu.append(jnp.zeros_like(r0))
            norm.append(
                jnp.zeros_like(jnp.squeeze(_norm(p_wide, plan.matrix_axes), plan.matrix_axes))
            )
            moment_axes.append(plan.moment_axes(p.ndim))
            norm_axes.append(plan.norm_axes(p.ndim))
        # Reduced shapes, in the parameters' boxes with their axis names where an axis comes
        # from one of the parameter's (the rank axis and merged axis groups are unnamed).
        return ScaleByApolloState(
            count=jnp.zeros([], jnp.int32),
            mu=boxes.state_like(params, mu, moment_axes),
            nu=boxes.state_like(params, nu, moment_axes),
            norm=boxes.state_like(params, norm, norm_axes),
        )

    def update_fn(
        updates: optax.Updates, state: ScaleByApolloState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, ScaleByApolloState]:
        del params
        count = optax.safe_increment(state.count)
        refresh = (count - 1) // update_proj_gap

        def leaf_update(path: str, spec: Any, g: jax.Array, m: Any, v: Any, prev: Any
                        ) -> tuple[Any, Any, Any, Any]:
            plan = _plan(path, spec, g.shape, rank)
            if plan is None:  # a None spec: pass through
                return g, m, v, prev
            if tuple(m.shape) != plan.moment_shape or tuple(prev.shape) != plan.norm_shape:
                raise ValueError(
                    f"parameter {path!r}: the gradient has shape {tuple(g.shape)}, which "
                    f"needs APOLLO moments of shape {plan.moment_shape}, but the optimizer "
                    f"state has {tuple(m.shape)} (was it initialised for other params?)"
                )
            wide = jnp.promote_types(axes_lib.wide(g.dtype), m.dtype)
            g32 = (g if plan.merged is None else axes_lib.to_matrix(plan.merged, g)).astype(wide)
            p = get_projection(path, refresh, g32.shape[plan.compressed], wide)
            r = _project(g32, p, plan.compressed)
            m_t = b1 * m.astype(wide) + (1 - b1) * r
            v_t = b2 * v.astype(wide) + (1 - b2) * jnp.square(r)
            r_tilde = m_t / (jnp.sqrt(v_t) + eps)
            # "tensor": over both matrix axes (one factor per batch index); "channel": over
            # the rank axis (one factor per index of the uncompressed axis).
            s_axes = plan.matrix_axes if scale_type == "tensor" else plan.compressed
            s = _scaling_factor(r, r_tilde, s_axes)
            u = g32 * (s * jnp.sqrt(jnp.asarray(scale, wide)))
            # Norm-growth limiter, per batch index; it only records until a norm > 0 exists.
            norm_u = _norm(u, plan.matrix_axes)
            prev_k = jnp.expand_dims(prev.astype(wide), plan.matrix_axes)
            bound = limiter_gamma * prev_k
            limit = (prev_k > 0) & (norm_u > bound)
            factor = jnp.where(limit, bound / jnp.where(limit, norm_u, 1), 1)
            u = u * factor
            t = count.astype(wide)
            correction = jnp.sqrt(_one_minus_pow(b2, t, wide)) / _one_minus_pow(b1, t, wide)
            u = u * correction
            return (
                (u if plan.merged is None else axes_lib.from_matrix(plan.merged, u)
                 ).astype(g.dtype),
                m_t.astype(m.dtype),
                v_t.astype(v.dtype),
                jnp.squeeze(norm_u * factor, plan.matrix_axes).astype(prev.dtype),
            )

        new_u, new_mu, new_nu, new_norm = axes_lib.map_leaves_with_state(
            leaf_update, updates, axes,
            {"the APOLLO first-moment state": state.mu,
             "the APOLLO second-moment state": state.nu,
             "the APOLLO limiter state": state.norm},
        )
        # The state keeps the structure init gave it, whatever boxes the gradients are in.
        keep = boxes.keep_structure
        return new_u, ScaleByApolloState(
            count=count, mu=keep(state.mu, new_mu), nu=keep(state.nu, new_nu),
            norm=keep(state.norm, new_norm),
        )

    return optax.GradientTransformation(init_fn, update_fn)


class AddDecayedWeightsAfterStepState(NamedTuple):
    """State of :func:`add_decayed_weights_after_step`: the step count for the schedule."""

    count: jax.Array  # type: ignore[assignment]  # optax's name; shadows tuple.count


def add_decayed_weights_after_step(
    weight_decay: Any,
    learning_rate: optax.ScalarOrSchedule,
    mask: Any | None = None,
) -> optax.GradientTransformation:
    r"""Apply the learning rate, then decoupled weight decay to the *stepped* parameters.

    APOLLO's code decays after the step: :math:`\theta_{t} = (\theta_{t-1} - \eta_t u_t)
    (1 - \eta_t w)`.  This transform therefore replaces ``add_decayed_weights`` *and*
    ``scale_by_learning_rate``: it returns

    .. math:: \Delta_t = -\eta_t u_t - \eta_t w\,(\theta_{t-1} - \eta_t u_t)

    for decayed leaves and :math:`-\eta_t u_t` for the others, so that
    ``optax.apply_updates`` gives the formula above.  :math:`\eta_t` is
    ``learning_rate(count)`` for a schedule (count from 0, as
    ``optax.scale_by_learning_rate``) or the constant itself.

    Args:
      weight_decay: the decay ``w`` (multiplied by the learning rate).
      learning_rate: a float, a scalar array or an optax schedule.
      mask: which leaves get weight decay: a pytree of bools with the params' structure
        (or a prefix of it) or a callable of the params, as ``optax.add_decayed_weights``.
        All leaves are stepped by the learning rate regardless.

    Returns:
      An ``optax.GradientTransformation`` with state
      :class:`AddDecayedWeightsAfterStepState`; its update needs ``params``.

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters(weight_decay=weight_decay)

    def init_fn(params: optax.Params) -> AddDecayedWeightsAfterStepState:
        del params
        return AddDecayedWeightsAfterStepState(count=jnp.zeros([], jnp.int32))

    def update_fn(
        updates: optax.Updates,
        state: AddDecayedWeightsAfterStepState,
        params: optax.Params | None = None,
    ) -> tuple[optax.Updates, AddDecayedWeightsAfterStepState]:
        if params is None:
            raise ValueError(
                "add_decayed_weights_after_step (the decay of apollo) needs the params: "
                "call update(updates, state, params)"
            )
        eta = learning_rate(state.count) if callable(learning_rate) else learning_rate
        with_path, treedef = jax.tree_util.tree_flatten_with_path(
            updates, is_leaf=axes_lib.is_masked
        )
        names = [axes_lib.path_str(path) for path, _ in with_path]
        flat_p = axes_lib.flatten_like(treedef, params, "the params")
        if mask is None:
            flat_m = [True] * len(flat_p)
        else:
            mask_tree = validation.checked_mask(mask)(params)
            # Broadcast a prefix mask over the subtrees it covers.
            full = jax.tree.map(
                lambda m, sub: jax.tree.map(lambda _: m, sub, is_leaf=axes_lib.is_masked),
                mask_tree,
                params,
                is_leaf=axes_lib.is_masked,
            )
            flat_m = axes_lib.flatten_like(treedef, full, "the weight-decay mask")
        axes_lib.check_same_shapes(
            names, flat_p, [u for _, u in with_path], "the update", "the params"
        )
        out = []
        for (_, u), p, m in zip(with_path, flat_p, flat_m, strict=True):
            if axes_lib.is_masked(u):
                out.append(u)
                continue
            wide = jnp.promote_types(axes_lib.wide(u.dtype), p.dtype)
            lr = jnp.asarray(eta, wide)
            step = -lr * u.astype(wide)
            if m:
                step = step - lr * weight_decay * (p.astype(wide) + step)
            out.append(step.astype(u.dtype))
        return jax.tree_util.tree_unflatten(treedef, out), AddDecayedWeightsAfterStepState(
            count=optax.safe_increment(state.count)
        )

    return optax.GradientTransformation(init_fn, update_fn)


def apollo(
    learning_rate: optax.ScalarOrSchedule,
    rank: int = _DEFAULTS["rank"],
    scale_type: str = _DEFAULTS["scale_type"],
    scale: float = _DEFAULTS["scale"],
    update_proj_gap: int = _DEFAULTS["update_proj_gap"],
    b1: float = _DEFAULTS["b1"],
    b2: float = _DEFAULTS["b2"],
    eps: float = _DEFAULTS["eps"],
    weight_decay: float = _DEFAULTS["weight_decay"],
    limiter_gamma: float = _DEFAULTS["limiter_gamma"],
    seed: int = _DEFAULTS["seed"],
    *,
    mask: Any | None = None,
    axes: axes_lib.AxesSpec = _KERNEL,
    projection: Projection | None = None,
) -> optax.GradientTransformation:
    r"""The APOLLO optimizer (Zhu et al. 2024) with decay after the step, as its code does.

    Per step: :math:`\theta \leftarrow (\theta - \eta_t u_t)(1 - \eta_t w)` with
    :math:`u_t` the update of :func:`scale_by_apollo` (bias correction
    :math:`\sqrt{1-\beta_2^t}/(1-\beta_1^t)` included), i.e.
    ``chain(scale_by_apollo(...), add_decayed_weights_after_step(w, η, mask))``.
    The defaults are APOLLO-Mini as the paper's baseline ran it (``docs/algorithms.md``): rank 1,
    ``tensor`` scaling, scale 128, refresh every 200 steps.  Every leaf must be a matrix;
    route embeddings and 1-D parameters to AdamW (``make_optimizer`` / ``optax.partition``).

    Args:
      learning_rate: a float or an optax schedule (the paper's setup: 1e-4).
      rank: projection rank ``r`` (static under ``inject_hyperparams``).
      scale_type: ``"tensor"`` or ``"channel"`` (static).
      scale: gradient scale factor ``c`` (the update is multiplied by ``√c``).
      update_proj_gap: refresh period of the projection (static).
      b1: β1 of the projected first moment.
      b2: β2 of the projected second moment.
      eps: ε of the projected AdamW ratio.
      weight_decay: decoupled decay ``w``, applied after the step.
      limiter_gamma: norm-growth bound γ.
      seed: seed of the default projection (static).
      mask: which leaves get weight decay (pytree of bools or callable).
      axes: per-leaf axes, see :func:`scale_by_apollo`.
      projection: optional injected projection, see :func:`scale_by_apollo`.

    Under ``optax.inject_hyperparams`` list ``rank``, ``scale_type``, ``update_proj_gap``,
    ``seed`` and any callable ``projection``, ``mask`` or ``axes`` in ``static_args``;
    ``learning_rate``, ``scale``, ``b1``, ``b2``, ``eps``, ``weight_decay`` and
    ``limiter_gamma`` may be injected.

    Returns:
      An ``optax.GradientTransformation``.

    Examples:
      >>> import jax, jax.numpy as jnp, optax, sage_optax
      >>> target = jnp.array([[1.0, -1.0, 0.5], [0.0, 2.0, 1.0]])
      >>> def loss(params):
      ...     return jnp.sum((params["kernel"] - target) ** 2)
      >>> params = {"kernel": jnp.zeros((2, 3))}
      >>> tx = sage_optax.apollo(learning_rate=0.01)  # the projection: random, seed 0
      >>> state, before = tx.init(params), loss(params)
      >>> for _ in range(2):
      ...     updates, state = tx.update(jax.grad(loss)(params), state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> print(f"{before:.3f}", bool(loss(params) < before))
      7.250 True

    References:
      Zhu et al., `APOLLO: SGD-like Memory, AdamW-level Performance
      <https://arxiv.org/abs/2412.05270>`_, 2024.

      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019 (the decoupled weight decay).
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("apollo", weight_decay=weight_decay)
    return optax.chain(
        scale_by_apollo(
            rank,
            scale_type,
            scale,
            update_proj_gap,
            b1,
            b2,
            eps,
            limiter_gamma,
            seed,
            axes=axes,
            projection=projection,
        ),
        add_decayed_weights_after_step(weight_decay, learning_rate, mask),
    )


@register("apollo")
def build(learning_rate: optax.ScalarOrSchedule, hp: ApolloHyperparams,
          context: RuleContext) -> optax.GradientTransformation:
    """:func:`apollo` with the ``apollo`` rule's hyperparameters ``hp`` (its builder)."""
    return apollo(learning_rate, rank=hp.rank, scale_type=hp.scale_type, scale=hp.scale,
                  update_proj_gap=hp.update_proj_gap, b1=hp.b1, b2=hp.b2, eps=hp.eps,
                  weight_decay=hp.weight_decay, limiter_gamma=hp.limiter_gamma, seed=hp.seed,
                  mask=context.mask, axes=context.axes, projection=hp.projection)
