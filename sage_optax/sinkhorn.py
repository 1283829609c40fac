"""SinkGD: Sinkhorn-normalised gradient descent (Scetbon et al. 2025; SAGE paper, Unit-Norm).

For a gradient matrix ``G`` (per batch index of stacked layers; a leaf with several fan-in
or fan-out axes is one matrix with each group merged), repeat ``num_iters`` times (axis groups:
``docs/routing.md``)::

    X ← X / (‖X‖₂ along the fan-in axis + eps) · t_in     (each output unit's vector)
    X ← X / (‖X‖₂ along the fan-out axis + eps) · t_out

with ``t_in = t_out = 1`` for ``normalization="unit"`` (the SAGE paper's Unit-Norm SinkGD)
and ``t_in = sqrt(fan-in size)``, ``t_out = sqrt(fan-out size)`` for ``"sqrt"`` (Scetbon et
al.'s SR-Sinkhorn).  The update of :func:`sinkgd` is ``θ ← θ(1 − ηw) − η·α·X``.

Implementation: ``X`` is kept as ``diag(c) · G · diag(r)`` with two scale vectors; each
half-iteration is one matrix-vector product of ``K = G²`` (formed once per step) with the
other vector's square, and ``X`` is formed once at the end, fused into the parameter update.
This is exactly the matrix rewrite above (the norm of a scaled column is the scale times the
weighted norm) but writes no matrix per half-iteration: the only matrix temporary is ``K``,
and a layer's ``K`` is small enough to stay in the CPU's last-level cache across the ``2L``
products (``benchmarks/jax_step.py``).

Range: ``K`` is formed from ``G/m`` with ``m`` a power of two close to the matrix's largest
magnitude (one per batch index), so the squares neither overflow (a float32 gradient entry
of 1e19 would make ``G²`` infinite) nor underflow; the first normalisation then uses
``eps/m``, since ``(G/m)/(‖G/m‖ + ε/m) = G/(‖G‖ + ε)``, and the later ones are unchanged.
Dividing by a power of two is exact, so for gradients whose squares are in range the
result is bit-for-bit that of the plain computation: the rescaling changes no number, it
only keeps every finite gradient finite.  An all-zero matrix stays zero.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from sage_optax import axes as axes_lib
from sage_optax import validation
from sage_optim.presets import RULE_DEFAULTS

_DEFAULTS = RULE_DEFAULTS["sinkgd"]
_KERNEL = axes_lib.LeafAxes(-2, -1)  # a Flax kernel (in, out), leading axes stacked


def _sharding_of(x: jax.Array) -> Any:
    """``x``'s sharding when the mesh has explicit axes (a dot needs it there), else None."""
    sharding = jax.typeof(x).sharding
    explicit = jax.sharding.AxisType.Explicit
    mesh = getattr(sharding, "mesh", None)
    if mesh is not None and not mesh.empty and explicit in mesh.axis_types:
        return sharding
    return None


def sinkhorn_normalize(
    g: jax.Array,
    axes: axes_lib.ResolvedAxes,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
) -> jax.Array:
    """Sinkhorn-normalise one matrix leaf along its named axes (see module docstring).

    Args:
      g: the gradient leaf.
      axes: its resolved axes (a matrix: ``fan_in`` and ``fan_out`` set; the rest batch).
      num_iters: number of (fan-in, fan-out) iteration pairs ``L``.
      eps: ε added to every norm.
      normalization: ``"unit"`` or ``"sqrt"``.

    Returns:
      ``X`` with the shape and dtype of ``g``.
    """
    c, r = sinkhorn_scales(g, axes, num_iters, eps, normalization)
    return apply_scales(g, axes, c, r).astype(g.dtype)


def apply_scales(
    g: jax.Array, axes: axes_lib.ResolvedAxes, c: jax.Array, r: jax.Array
) -> jax.Array:
    """``X = diag(c) · G · diag(r)`` (in the wide dtype of ``c``) from :func:`sinkhorn_scales`.

    ``c · G`` is formed first; :func:`sinkhorn_scales` splits the range factor between
    ``c`` and ``r`` so that this partial product is finite for any finite ``G``.
    """
    g = g.astype(c.dtype) if g.dtype != c.dtype else g
    return jnp.expand_dims(c, axes.fan_out) * g * jnp.expand_dims(r, axes.fan_in)


def range_scale(g: jax.Array, axes: axes_lib.ResolvedAxes) -> jax.Array:
    """``m``: a power of two with ``m ≤ max|G| < 2m`` per batch index (1 for an all-zero one).

    Shaped like ``g`` with size-1 fan-in and fan-out axes, in ``g``'s dtype; at least the
    dtype's smallest normal number, so that ``1/m`` and ``eps/m`` stay finite.  A matrix
    with a non-finite entry gets ``m = 1`` (its result is non-finite anyway).  Zero-size
    matrices give 1.
    """
    amax = jnp.max(jnp.abs(g), axis=(*axes.fan_in, *axes.fan_out), keepdims=True, initial=0.0)
    mantissa, _ = jnp.frexp(amax)  # amax = mantissa · 2^e with mantissa in [0.5, 1)
    ok = (amax > 0) & jnp.isfinite(amax)
    # amax / mantissa is exactly 2^e (a correctly rounded division with an exact result).
    m = jnp.where(ok, amax / jnp.where(ok, 2 * mantissa, 1), 1)
    return jnp.maximum(m, jnp.finfo(g.dtype).tiny).astype(g.dtype)


def sinkhorn_scales(
    g: jax.Array,
    axes: axes_lib.ResolvedAxes,
    num_iters: Any = 5,
    eps: Any = 1e-8,
    normalization: str = "unit",
    after: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The scale vectors ``(c, r)`` with ``X = diag(c) · G · diag(r)``.

    ``c`` has ``g``'s shape without the fan-out axes (one scale per fan-in index), ``r``
    without the fan-in axes (one per output unit), both in float32 or wider.  With axis
    groups the norms run over every axis of a group: the merged matrix, without a reshape.

    The iteration runs on ``G/m`` (:func:`range_scale`), whose squares are in range for
    any finite ``G``: ``r`` then carries a factor ``m``, and ``1/m`` is split between the
    returned ``c`` and ``r`` (two exact powers of two) so that neither they nor ``c · G``
    leave the range.  Their product, and so ``X``, is that of the plain computation.
    """
    wide = jnp.promote_types(g.dtype, jnp.float32)
    g = g.astype(wide) if g.dtype != wide else g
    fi, fo = axes.fan_in, axes.fan_out  # axis groups: a merged matrix needs no reshape here
    if normalization == "unit":
        t_in = t_out = jnp.asarray(1.0, wide)
    else:
        t_in = jnp.sqrt(jnp.asarray(axes.fan_in_size, wide))
        t_out = jnp.sqrt(jnp.asarray(axes.fan_out_size, wide))
    m = range_scale(g, axes)
    gm = g / m  # exact: m is a power of two
    # K = (G/m)², formed once; every half-iteration is then one (batched) matrix-vector
    # product with it, in full float32 precision on every backend (no TF32).
    k = jnp.square(gm)
    if after is not None:
        # A data dependency (the two branches are bitwise equal) that makes this K wait
        # for ``after``, so that consecutive leaves' K are not all alive at once.
        k = jnp.where(after >= 0, k, jnp.abs(gm) * jnp.abs(gm))
    sub = "abcdefghijklmnopqrstuvwxyz"[: g.ndim]
    c_sub = "".join(sub[a] for a in range(g.ndim) if a not in fo)
    r_sub = "".join(sub[a] for a in range(g.ndim) if a not in fi)
    # Scale vectors shaped (and, under explicit sharding, sharded) like reductions of K.
    c = jnp.ones_like(jnp.sum(k, axis=fo))  # one scale per fan-in index
    r = jnp.ones_like(jnp.sum(k, axis=fi))  # one scale per output unit
    hi = jax.lax.Precision.HIGHEST
    row_norms = functools.partial(  # one squared norm per output unit (over the fan-in axis)
        jnp.einsum, f"{sub},{c_sub}->{r_sub}", precision=hi, out_sharding=_sharding_of(r)
    )
    col_norms = functools.partial(
        jnp.einsum, f"{sub},{r_sub}->{c_sub}", precision=hi, out_sharding=_sharding_of(c)
    )

    def rescale(scale: jax.Array, norm_sq: jax.Array, target: jax.Array, eps: Any
                ) -> jax.Array:
        norm = jnp.sqrt(norm_sq)
        new = scale * target / (scale * norm + eps)
        # An all-zero slice stays zero whatever its scale; keep the scale finite there.
        return jnp.where(norm > 0, new, scale)

    # The first half-iteration normalises G/m with eps/m (= G/(‖G‖ + eps)); from then on
    # r carries the factor m and every later half-iteration is the plain one.
    eps_first = eps / jnp.squeeze(m, fi)

    def body(i: Any, carry: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        c, r = carry
        r = rescale(r, row_norms(k, jnp.square(c)), t_in, jnp.where(i == 0, eps_first, eps))
        c = rescale(c, col_norms(k, jnp.square(r)), t_out, eps)
        return c, r

    c, r = jax.lax.fori_loop(0, num_iters, body, (c, r))
    # X = c·(G/m)·r = (c·2^-a)·G·(r·2^-b) with 2^a·2^b = m, a ≈ b: both scales and c·G
    # stay in range.
    half = _pow2_sqrt_floor(m)
    return c / jnp.squeeze(half, fo), r / jnp.squeeze(m / half, fi)


def _pow2_sqrt_floor(m: jax.Array) -> jax.Array:
    """For a power of two ``m = 2^k``, the power of two ``2^⌊k/2⌋`` (exact)."""
    _, e = jnp.frexp(m)  # m = 0.5 · 2^e, so k = e − 1
    # sqrt of an even power of two is exact; for odd k take sqrt(m / 2) = 2^((k − 1) / 2)
    return jnp.where(e % 2 == 0, jnp.sqrt(m / 2), jnp.sqrt(m))


def _check_matrix(path: str, spec: Any, x: Any) -> axes_lib.ResolvedAxes | None:
    if spec is None:
        return None
    if not isinstance(spec, axes_lib.LeafAxes):
        raise TypeError(f"parameter {path!r}: axes must be LeafAxes or None, got {spec!r}")
    if x.ndim < 2 or not spec.is_matrix:
        raise ValueError(
            f"SinkGD needs a matrix, but parameter {path!r} has shape {tuple(x.shape)}"
            + ("" if x.ndim < 2 else " and vector axes")
            + "; route 1-D/0-D parameters to another rule (e.g. make_optimizer(...) or "
            "optax.partition)"
        )
    return spec.resolve(tuple(x.shape), path)


def scale_by_sinkhorn(
    num_iters: int = _DEFAULTS["num_iters"],
    eps: float = _DEFAULTS["eps"],
    normalization: str = _DEFAULTS["normalization"],
    *,
    axes: axes_lib.AxesSpec = _KERNEL,
    dims: Any = axes_lib.UNSET,
) -> optax.GradientTransformation:
    """Replace each gradient matrix by its Sinkhorn normalisation ``X`` (stateless).

    Args:
      num_iters: number ``L`` of (fan-in, fan-out) iteration pairs (paper: 5).
      eps: ε added to every norm.
      normalization: ``"unit"`` (Unit-Norm SinkGD) or ``"sqrt"`` (SR-Sinkhorn).
      axes: axes of each leaf: one :class:`~sage_optax.LeafAxes` (default: a Flax kernel
        ``(in, out)``, leading axes stacked), a pytree of them (``None`` leaves pass
        through unchanged) or a callable of the params.
      dims: deprecated name of ``axes``.

    Returns:
      An ``optax.GradientTransformation`` with empty state.  A leaf with fewer than two
      dimensions raises a ``ValueError`` naming its path and shape.
    """
    validation.check_hyperparameters(
        "sinkgd", num_iters=num_iters, eps=eps, normalization=normalization
    )
    axes = axes_lib.renamed_axes(axes, dims, "dims", _KERNEL)

    def init_fn(params: optax.Params) -> optax.EmptyState:
        axes_lib.map_leaves(_check_matrix, params, axes)  # fail at init, before any step
        return optax.EmptyState()

    def update_fn(
        updates: optax.Updates, state: optax.EmptyState, params: optax.Params | None = None
    ) -> tuple[optax.Updates, optax.EmptyState]:
        del params

        previous: list[Any] = []  # per matrix done so far: a scalar of its scales

        def normalize(path: str, spec: Any, g: jax.Array) -> jax.Array:
            resolved = _check_matrix(path, spec, g)
            if resolved is None:  # a None spec: pass through
                return g
            # Order the leaves: this leaf's K = G² is formed only once the previous
            # leaf's scales are done, so one K is alive at a time (the compiled
            # temporary memory is the largest K, not the sum of all of them).
            after = previous[-1] if previous else None
            c, r = sinkhorn_scales(g, resolved, num_iters, eps, normalization, after)
            previous.append(jnp.min(r, initial=jnp.inf))  # defined for (n, 0) too
            return apply_scales(g, resolved, c, r).astype(g.dtype)

        return axes_lib.map_leaves(normalize, updates, axes), state

    return optax.GradientTransformation(init_fn, update_fn)


def sinkgd(
    learning_rate: optax.ScalarOrSchedule,
    alpha: float = _DEFAULTS["alpha"],
    num_iters: int = _DEFAULTS["num_iters"],
    weight_decay: float = _DEFAULTS["weight_decay"],
    normalization: str = _DEFAULTS["normalization"],
    *,
    eps: float = _DEFAULTS["eps"],
    mask: Any | None = None,
    axes: axes_lib.AxesSpec = _KERNEL,
    dims: Any = axes_lib.UNSET,
) -> optax.GradientTransformation:
    r"""SinkGD with decoupled weight decay: :math:`\theta(1-\eta w) - \eta\alpha X`.

    ``chain(scale_by_sinkhorn, scale(alpha), add_decayed_weights(w, mask),
    scale_by_learning_rate(η))``: the decay uses ``η``, not ``η·α`` (``docs/algorithms.md``).

    Args:
      learning_rate: a float or an optax schedule.
      alpha: update scale α (paper: 10 for ``unit``; Scetbon et al.: 0.05 for ``sqrt``).
      num_iters: Sinkhorn iterations ``L``.
      weight_decay: decoupled decay ``w``.
      normalization: ``"unit"`` or ``"sqrt"``.
      eps: ε added to every norm.
      mask: which leaves get weight decay (pytree of bools or callable).
      axes: per-leaf axes, see :func:`scale_by_sinkhorn`.
      dims: deprecated name of ``axes``.

    Returns:
      An ``optax.GradientTransformation``.
    """
    validation.check_learning_rate(learning_rate)
    validation.check_hyperparameters("sinkgd", alpha=alpha, weight_decay=weight_decay)
    axes = axes_lib.renamed_axes(axes, dims, "dims", _KERNEL)
    return optax.chain(
        scale_by_sinkhorn(num_iters, eps, normalization, axes=axes),
        optax.scale(alpha),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
