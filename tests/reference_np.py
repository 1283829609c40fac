"""Independent float64 NumPy reference implementations: the test oracle.

This module is the oracle that the tests compare ``sage_optax`` and
``sage_torch`` against. It was written only from the paper
(``paper/sage-paper.tex``: Algorithm 1 "Sign Adaptive GradiEnt", the Appendix
"Instantaneous Stability Constraint" and the "Unit-Norm SinkGD" paragraph) and
from the paper and ``docs/algorithms.md``, never from the real implementations, so that a bug there
cannot be copied here. It must never import ``sage_optax`` or ``sage_torch``.

Conventions
-----------
* Pure NumPy, float64 everywhere: every input is cast with
  ``np.asarray(x, dtype=np.float64)``; states are float64.
* Every function and class works on ONE parameter: a 2-D matrix or a 1-D
  vector (0-D where stated) in an explicitly stated layout. There is no
  stacking: for stacked layers, ``(L, in, out)``, callers loop over the
  leading axis themselves and keep one reference object per slice.
* ``step(theta, g, lr)`` never modifies its inputs; it returns the new
  parameter as a fresh float64 array and advances the object's own state.
* Step counts start at 1 (Algorithm 1: "t starts at 1").
* ``np.sign(0) == 0``, so a zero momentum/gradient entry gives no move.
"""

import math

import numpy as np

__all__ = [
    "rms",
    "sage_s_t",
    "sage_damper",
    "SageRef",
    "sinkhorn_ref",
    "SinkGDRef",
    "UnitNormRef",
    "AdamWRef",
    "LionRef",
    "apollo_scaling_factor",
    "ApolloRef",
    "gaussian_projection_fn",
]

_DAMPERS = ("both", "ema", "instant", "none")


def _f64(x):
    """Cast to a float64 ndarray (copying if needed)."""
    return np.asarray(x, dtype=np.float64)


def _check_same_shape(shape, theta, g):
    """Raise ValueError unless theta and g both have the expected shape."""
    if theta.shape != tuple(shape) or g.shape != tuple(shape):
        raise ValueError(
            f"expected theta and g of shape {tuple(shape)}, "
            f"got {theta.shape} and {g.shape}"
        )


def _normalize_axis(axis, ndim):
    """Map a possibly negative axis to 0..ndim-1, raising ValueError if bad."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} out of range for a {ndim}-D array")
    return axis % ndim


def rms(x):
    """Root mean square over ALL entries of x (Algorithm 1; docs/algorithms.md, SAGE step 4).

    sqrt(mean(x**2)); Algorithm 1's sigma_rms and gamma_rms (the 1/d sum).
    """
    x = _f64(x)
    return float(np.sqrt(np.mean(x * x)))


# ---------------------------------------------------------------------------
# SAGE
# ---------------------------------------------------------------------------


def sage_s_t(g, vocab_axis):
    """Per-dimension gradient loudness s_t (Algorithm 1, Eq. s_t_calc).

    Algorithm 1, Eq. (2): for a matrix, the mean of |g| over the vocab axis;
    the mean divides by V, the full size of that axis, so all-zero rows of
    tokens absent from the batch count. For 1-D and 0-D g, or when
    ``vocab_axis`` is None, s_t = |g| element-wise.
    """
    g = _f64(g)
    if g.ndim <= 1 or vocab_axis is None:
        return np.abs(g)
    if g.ndim != 2:
        raise ValueError(f"sage_s_t takes a 0-D, 1-D or 2-D g, got {g.shape}")
    axis = _normalize_axis(vocab_axis, 2)
    return np.sum(np.abs(g), axis=axis) / g.shape[axis]


def sage_damper(S_hat, s, eps=1e-8, damper="both"):
    """Adaptive scale H_t (Algorithm 1 inner loop; Appendix "Instantaneous
    Stability Constraint"; docs/algorithms.md, SAGE steps 4-5).

    sigma = rms(S_hat), gamma = rms(s) (means over all entries), then
      D_ema  = sigma / (S_hat + eps)
      D_inst = gamma / (s + eps)
      H      = min(D_ema, D_inst, 1)            for damper="both" (default)
    "ema" drops D_inst, "instant" drops D_ema, "none" gives H = 1 (Lion).
    The result has the shape of s (not yet broadcast over the vocab axis).
    """
    if damper not in _DAMPERS:
        raise ValueError(f"damper must be one of {_DAMPERS}, got {damper!r}")
    S_hat = _f64(S_hat)
    s = _f64(s)
    H = np.ones_like(s)
    if damper in ("both", "ema"):
        sigma = rms(S_hat)
        H = np.minimum(H, sigma / (S_hat + eps))
    if damper in ("both", "instant"):
        gamma = rms(s)
        H = np.minimum(H, gamma / (s + eps))
    return H


class SageRef:
    """Stateful SAGE (Sign Adaptive GradiEnt) for ONE parameter.

    Paper Algorithm 1 + Appendix "Instantaneous Stability Constraint", with
    docs/algorithms.md deciding every detail. Layout: for a 2-D parameter,
    ``vocab_axis`` (0 or 1) is the axis indexing tokens; s_t, S and H have the
    shape of the other axis, O(d). For a 1-D or 0-D shape, or
    ``vocab_axis=None``, everything is element-wise (s_t = |g|).

    State: ``M`` (parameter shape), ``S`` (shape of s_t), ``t`` (steps done,
    0 before the first step). ``last_H`` is the H_t of the last step, in the
    shape of s_t (before broadcasting), for property tests.
    """

    def __init__(
        self,
        shape,
        *,
        b1=0.9,
        b2=0.99,
        eps=1e-8,
        weight_decay=0.01,
        vocab_axis: int | None = 0,
        damper: str = "both",
    ):
        if damper not in _DAMPERS:
            raise ValueError(f"damper must be one of {_DAMPERS}, got {damper!r}")
        self.shape = tuple(int(n) for n in shape)
        ndim = len(self.shape)
        if ndim > 2:
            raise ValueError(
                f"SageRef takes one 0-D, 1-D or 2-D parameter, got {self.shape}"
                " (loop over stacked layers yourself)"
            )
        if ndim <= 1 or vocab_axis is None:
            self.vocab_axis = None  # element-wise s_t = |g|
            s_shape = self.shape
        else:
            self.vocab_axis = _normalize_axis(vocab_axis, 2)
            s_shape = (self.shape[1 - self.vocab_axis],)
        self.b1 = float(b1)
        self.b2 = float(b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.damper = damper
        self.M = np.zeros(self.shape, dtype=np.float64)
        self.S = np.zeros(s_shape, dtype=np.float64)
        self.t = 0
        self.last_H = None

    def _broadcast(self, H):
        """Broadcast H (shape of s_t) back over the vocab axis (step 5)."""
        if self.vocab_axis is None:
            return H
        return np.expand_dims(H, axis=self.vocab_axis)

    def step(self, theta, g, lr):
        """One SAGE step; returns the new theta (docs/algorithms.md, SAGE steps 1-7)."""
        theta = _f64(theta)
        g = _f64(g)
        _check_same_shape(self.shape, theta, g)
        lr = float(lr)
        self.t += 1
        t = self.t
        # Step 1: decoupled weight decay, applied first.
        theta = theta * (1.0 - lr * self.weight_decay)
        # Step 2: per-dimension loudness.
        s = sage_s_t(g, self.vocab_axis)
        # Step 3: EMA of s_t and its bias correction.
        self.S = self.b2 * self.S + (1.0 - self.b2) * s
        S_hat = self.S / (1.0 - self.b2**t)
        # Steps 4-5: relative-RMS dampers, clipped at 1.
        H = sage_damper(S_hat, s, eps=self.eps, damper=self.damper)
        self.last_H = H
        # Step 6: Lion direction (interpolated with beta1), scaled by H.
        C = np.sign(self.b1 * self.M + (1.0 - self.b1) * g)
        theta = theta - lr * (C * self._broadcast(H))
        # Step 7: momentum update with beta2, after the step.
        self.M = self.b2 * self.M + (1.0 - self.b2) * g
        return theta


# ---------------------------------------------------------------------------
# SinkGD
# ---------------------------------------------------------------------------


def _normalize_along(X, axis, eps, target):
    """X / (||X||_2 along ``axis`` + eps) * target (one Sinkhorn half-step).

    The norm sums over ``axis`` (keepdims), so each slice taken along that
    axis is rescaled to norm ~ target.
    """
    norm = np.sqrt(np.sum(X * X, axis=axis, keepdims=True))
    return X / (norm + eps) * target


def sinkhorn_ref(
    G,
    num_iters=5,
    eps=1e-8,
    normalization="unit",
    fan_in_axis=0,
    fan_out_axis=1,
):
    """Sinkhorn normalisation of ONE gradient matrix (docs/algorithms.md, SinkGD).

    Written the direct way: the matrix itself is rewritten every half
    iteration. Each of ``num_iters`` iterations first normalises along the
    fan-in axis (norms summed over ``fan_in_axis``: each output unit's weight
    vector), then along the fan-out axis (norms summed over
    ``fan_out_axis``). Default axes are the Flax kernel layout ``(in, out)``;
    PyTorch ``(out, in)`` is ``fan_in_axis=1, fan_out_axis=0``.

    ``normalization="unit"`` (paper's Unit-Norm SinkGD): target norm 1.
    ``normalization="sqrt"`` (Scetbon et al.'s SR-Sinkhorn): the fan-in step
    targets sqrt(size of the fan-in axis), the fan-out step sqrt(size of the
    fan-out axis).
    """
    X = _f64(G)
    if X.ndim != 2:
        raise ValueError(f"sinkhorn_ref takes one 2-D matrix, got shape {X.shape}")
    fan_in_axis = _normalize_axis(fan_in_axis, 2)
    fan_out_axis = _normalize_axis(fan_out_axis, 2)
    if fan_in_axis == fan_out_axis:
        raise ValueError("fan_in_axis and fan_out_axis must differ")
    if normalization == "unit":
        target_in = 1.0
        target_out = 1.0
    elif normalization == "sqrt":
        target_in = math.sqrt(X.shape[fan_in_axis])
        target_out = math.sqrt(X.shape[fan_out_axis])
    else:
        raise ValueError(
            f"normalization must be 'unit' or 'sqrt', got {normalization!r}"
        )
    for _ in range(int(num_iters)):
        X = _normalize_along(X, fan_in_axis, eps, target_in)
        X = _normalize_along(X, fan_out_axis, eps, target_out)
    return X


class SinkGDRef:
    """Stateless SinkGD step for ONE 2-D matrix (docs/algorithms.md, SinkGD).

    theta <- theta * (1 - lr * w) - lr * alpha * sinkhorn_ref(g); the decay
    uses lr, not lr * alpha. Axes as in ``sinkhorn_ref``.
    """

    def __init__(
        self,
        *,
        alpha=10.0,
        num_iters=5,
        eps=1e-8,
        weight_decay=0.01,
        normalization="unit",
        fan_in_axis=0,
        fan_out_axis=1,
    ):
        if normalization not in ("unit", "sqrt"):
            raise ValueError(
                f"normalization must be 'unit' or 'sqrt', got {normalization!r}"
            )
        self.alpha = float(alpha)
        self.num_iters = int(num_iters)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.normalization = normalization
        self.fan_in_axis = fan_in_axis
        self.fan_out_axis = fan_out_axis

    def step(self, theta, g, lr):
        """One SinkGD step; returns the new theta."""
        theta = _f64(theta)
        g = _f64(g)
        if theta.shape != g.shape:
            raise ValueError(f"theta {theta.shape} and g {g.shape} differ")
        lr = float(lr)
        X = sinkhorn_ref(
            g,
            num_iters=self.num_iters,
            eps=self.eps,
            normalization=self.normalization,
            fan_in_axis=self.fan_in_axis,
            fan_out_axis=self.fan_out_axis,
        )
        return theta * (1.0 - lr * self.weight_decay) - lr * self.alpha * X


class UnitNormRef:
    """Stateless normalised step of ``sinkgd-pure`` for 1-D (and 0-D) params.

    docs/algorithms.md, unit-norm step: g / (||g||_2 + eps), with decoupled decay:
    theta <- theta * (1 - lr * w) - lr * g / (||g||_2 + eps).
    The norm is over all entries of the vector.
    """

    def __init__(self, *, eps=1e-8, weight_decay=0.01):
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)

    def step(self, theta, g, lr):
        """One normalised step; returns the new theta."""
        theta = _f64(theta)
        g = _f64(g)
        if theta.shape != g.shape:
            raise ValueError(f"theta {theta.shape} and g {g.shape} differ")
        if g.ndim > 1:
            raise ValueError(f"UnitNormRef takes a 0-D or 1-D param, got {g.shape}")
        lr = float(lr)
        norm = float(np.sqrt(np.sum(g * g)))
        return theta * (1.0 - lr * self.weight_decay) - lr * g / (norm + self.eps)


# ---------------------------------------------------------------------------
# Baselines: AdamW and Lion
# ---------------------------------------------------------------------------


class AdamWRef:
    """Textbook AdamW (Loshchilov & Hutter), as ``optax.adamw`` computes it.

    m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
    m_hat = m / (1 - b1^t);  v_hat = v / (1 - b2^t)
    theta <- theta - lr * (m_hat / (sqrt(v_hat) + eps) + w * theta)
    Works element-wise on a parameter of any single shape.
    """

    def __init__(self, shape, *, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.01):
        self.shape = tuple(int(n) for n in shape)
        self.b1 = float(b1)
        self.b2 = float(b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.m = np.zeros(self.shape, dtype=np.float64)
        self.v = np.zeros(self.shape, dtype=np.float64)
        self.t = 0

    def step(self, theta, g, lr):
        """One AdamW step; returns the new theta."""
        theta = _f64(theta)
        g = _f64(g)
        _check_same_shape(self.shape, theta, g)
        lr = float(lr)
        self.t += 1
        t = self.t
        self.m = self.b1 * self.m + (1.0 - self.b1) * g
        self.v = self.b2 * self.v + (1.0 - self.b2) * (g * g)
        m_hat = self.m / (1.0 - self.b1**t)
        v_hat = self.v / (1.0 - self.b2**t)
        u = m_hat / (np.sqrt(v_hat) + self.eps)
        return theta - lr * (u + self.weight_decay * theta)


class LionRef:
    """Lion (Chen et al.), as ``optax.lion`` computes it.

    theta <- theta - lr * (sign(b1 m + (1-b1) g) + w * theta)
    m <- b2 m + (1-b2) g   (after forming the direction)
    Works element-wise on a parameter of any single shape.
    """

    def __init__(self, shape, *, b1=0.9, b2=0.99, weight_decay=0.01):
        self.shape = tuple(int(n) for n in shape)
        self.b1 = float(b1)
        self.b2 = float(b2)
        self.weight_decay = float(weight_decay)
        self.m = np.zeros(self.shape, dtype=np.float64)
        self.t = 0

    def step(self, theta, g, lr):
        """One Lion step; returns the new theta."""
        theta = _f64(theta)
        g = _f64(g)
        _check_same_shape(self.shape, theta, g)
        lr = float(lr)
        self.t += 1
        C = np.sign(self.b1 * self.m + (1.0 - self.b1) * g)
        new_theta = theta - lr * (C + self.weight_decay * theta)
        self.m = self.b2 * self.m + (1.0 - self.b2) * g
        return new_theta


# ---------------------------------------------------------------------------
# APOLLO
# ---------------------------------------------------------------------------


def sinkhorn_ref_stack(G, fan_in_axis, fan_out_axis, normalization="unit"):
    """:func:`sinkhorn_ref` of every matrix of ``G`` (its last two axes; leading axes batch)."""
    G = np.asarray(G, np.float64)
    flat = G.reshape(-1, *G.shape[-2:])
    out = [sinkhorn_ref(m, normalization=normalization, fan_in_axis=fan_in_axis,
                        fan_out_axis=fan_out_axis) for m in flat]
    return np.stack(out).reshape(G.shape)


def apollo_scaling_factor(R, R_tilde, scale_type, uncompressed_axis):
    """APOLLO gradient scaling factor s (docs/algorithms.md, "APOLLO, as the apollo
    configuration uses it").

    "tensor": s = ||R_tilde||_F / (||R||_F + 1e-8), a scalar.
    "channel": one factor per index of the uncompressed axis, norms taken
    over the rank axis (the other axis of R), returned with keepdims so that
    it broadcasts onto the raw gradient along the uncompressed axis.
    """
    R = _f64(R)
    R_tilde = _f64(R_tilde)
    if scale_type == "tensor":
        return float(
            np.sqrt(np.sum(R_tilde * R_tilde)) / (np.sqrt(np.sum(R * R)) + 1e-8)
        )
    if scale_type == "channel":
        rank_axis = 1 - uncompressed_axis
        num = np.sqrt(np.sum(R_tilde * R_tilde, axis=rank_axis, keepdims=True))
        den = np.sqrt(np.sum(R * R, axis=rank_axis, keepdims=True)) + 1e-8
        return num / den
    raise ValueError(f"scale_type must be 'tensor' or 'channel', got {scale_type!r}")


def gaussian_projection_fn(seed=0):
    """A convenience ``projection_fn`` for ApolloRef (smoke tests only).

    Returns f(refresh_index, n, r) -> (n, r) matrix with entries N(0, 1/r),
    deterministic in (seed, refresh_index). Parity tests should inject the
    projection the framework under test uses instead.
    """

    def projection_fn(refresh_index, n, r):
        rng = np.random.default_rng([int(seed), int(refresh_index)])
        return rng.normal(0.0, math.sqrt(1.0 / r), size=(n, r))

    return projection_fn


class ApolloRef:
    """APOLLO (Zhu et al. 2024) for ONE matrix in PyTorch layout (out, in).

    Fan-out axis 0, fan-in axis 1. Implements docs/algorithms.md "APOLLO, as the apollo
    configuration uses it":

    * Projection P = projection_fn(refresh_index, n, r), shape (n, r), with
      refresh_index = (t - 1) // update_proj_gap (t starts at 1); P is
      fetched, never stored, and moments are not reset on refresh.
    * The smaller axis is compressed: if out >= in, the fan-in axis:
      R = G @ P, P (in, r), R (out, r); otherwise R = P.T @ G, P (out, r),
      R (r, in).
    * AdamW moments on R: M <- b1 M + (1-b1) R, V <- b2 V + (1-b2) R^2,
      R_tilde = M / (sqrt(V) + eps) (no bias correction inside R_tilde).
    * U = G * s * sqrt(scale), s from ``apollo_scaling_factor``.
    * Norm-growth limiter: if t > 1 and ||U||_F > gamma * prev, then
      U <- U * gamma * prev / ||U||_F; prev <- ||U||_F after limiting (the
      first step only records).
    * theta <- theta - lr * sqrt(1 - b2^t) / (1 - b1^t) * U, and AFTER that
      theta <- theta * (1 - lr * w).
    """

    def __init__(
        self,
        shape,
        *,
        rank=1,
        scale_type="tensor",
        scale=128.0,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        weight_decay=0.01,
        limiter_gamma=1.01,
        update_proj_gap=200,
        projection_fn,
    ):
        self.shape = tuple(int(n) for n in shape)
        if len(self.shape) != 2:
            raise ValueError(f"ApolloRef takes one 2-D (out, in) matrix, got {shape}")
        if scale_type not in ("tensor", "channel"):
            raise ValueError(
                f"scale_type must be 'tensor' or 'channel', got {scale_type!r}"
            )
        out_dim, in_dim = self.shape
        self.rank = int(rank)
        self.scale_type = scale_type
        self.scale = float(scale)
        self.b1 = float(b1)
        self.b2 = float(b2)
        self.eps = float(eps)
        self.weight_decay = float(weight_decay)
        self.limiter_gamma = float(limiter_gamma)
        self.update_proj_gap = int(update_proj_gap)
        self.projection_fn = projection_fn
        # Compress the fan-in axis (1) when out >= in, else the fan-out axis (0).
        self.compressed_axis = 1 if out_dim >= in_dim else 0
        self.uncompressed_axis = 1 - self.compressed_axis
        if self.compressed_axis == 1:
            r_shape = (out_dim, self.rank)
        else:
            r_shape = (self.rank, in_dim)
        self.M = np.zeros(r_shape, dtype=np.float64)
        self.V = np.zeros(r_shape, dtype=np.float64)
        self.prev_norm = None  # ||U_{t-1}||_F after limiting
        self.t = 0

    def projection(self, t):
        """The projection P used at step t (fetched from projection_fn)."""
        n = self.shape[self.compressed_axis]
        refresh_index = (t - 1) // self.update_proj_gap
        P = _f64(self.projection_fn(refresh_index, n, self.rank))
        if P.shape != (n, self.rank):
            raise ValueError(
                f"projection_fn returned shape {P.shape}, expected {(n, self.rank)}"
            )
        return P

    def project(self, G, P):
        """Compress G to rank r along the compressed axis: R = G@P or P.T@G."""
        if self.compressed_axis == 1:
            return G @ P
        return P.T @ G

    def step(self, theta, g, lr):
        """One APOLLO step; returns the new theta."""
        theta = _f64(theta)
        G = _f64(g)
        _check_same_shape(self.shape, theta, G)
        lr = float(lr)
        self.t += 1
        t = self.t
        R = self.project(G, self.projection(t))
        self.M = self.b1 * self.M + (1.0 - self.b1) * R
        self.V = self.b2 * self.V + (1.0 - self.b2) * (R * R)
        R_tilde = self.M / (np.sqrt(self.V) + self.eps)
        s = apollo_scaling_factor(R, R_tilde, self.scale_type, self.uncompressed_axis)
        U = G * s * math.sqrt(self.scale)
        # Norm-growth limiter.
        norm_U = float(np.sqrt(np.sum(U * U)))
        if t > 1:
            bound = self.limiter_gamma * self.prev_norm
            if norm_U > bound:
                U = U * bound / norm_U
                norm_U = float(np.sqrt(np.sum(U * U)))
        self.prev_norm = norm_U
        step_size = lr * math.sqrt(1.0 - self.b2**t) / (1.0 - self.b1**t)
        theta = theta - step_size * U
        # Decoupled decay AFTER the step.
        return theta * (1.0 - lr * self.weight_decay)


# ---------------------------------------------------------------------------
# Smoke check
# ---------------------------------------------------------------------------


def _smoke():
    """Run each reference a few steps on random data; check outputs finite."""
    rng = np.random.default_rng(0)
    lr = 1e-2

    def run(name, opt, shape, steps=5):
        theta = rng.normal(size=shape)
        for _ in range(steps):
            theta = opt.step(theta, rng.normal(size=shape), lr)
        ok = bool(np.all(np.isfinite(theta)))
        print(f"{name:<32s} shape={str(shape):<10s} finite={ok}")
        return ok

    results = []
    for damper in _DAMPERS:
        results.append(run(f"SageRef(vocab 0, {damper})",
                           SageRef((7, 5), damper=damper), (7, 5)))
    results.append(run("SageRef(vocab 1)", SageRef((7, 5), vocab_axis=1), (7, 5)))
    results.append(run("SageRef(1-D)", SageRef((6,)), (6,)))
    results.append(run("SageRef(0-D)", SageRef(()), ()))
    results.append(run("SinkGDRef(unit)", SinkGDRef(), (6, 4)))
    results.append(run("SinkGDRef(sqrt, a=0.05)",
                       SinkGDRef(alpha=0.05, normalization="sqrt"), (6, 4)))
    results.append(run("UnitNormRef", UnitNormRef(), (6,)))
    results.append(run("AdamWRef", AdamWRef((6, 4)), (6, 4)))
    results.append(run("LionRef", LionRef((6, 4)), (6, 4)))
    for shape in ((8, 5), (5, 8)):
        for scale_type in ("tensor", "channel"):
            opt = ApolloRef(shape, rank=2, scale_type=scale_type,
                            update_proj_gap=2,
                            projection_fn=gaussian_projection_fn(0))
            results.append(run(f"ApolloRef({scale_type})", opt, shape))
    X = sinkhorn_ref(rng.normal(size=(6, 4)), num_iters=50)
    print("sinkhorn unit col/row norms:",
          np.round(np.linalg.norm(X, axis=0), 6),
          np.round(np.linalg.norm(X, axis=1), 6))
    print("all finite:", all(results))
    return all(results)


if __name__ == "__main__":
    raise SystemExit(0 if _smoke() else 1)
