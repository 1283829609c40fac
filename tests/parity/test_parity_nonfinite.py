"""Numerics at the edges, in both frameworks: SinkGD for any finite gradient, zero-size and
all-zero matrices, and ``skip_nonfinite=N`` with one meaning (validated, documented, tested)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from reference_np import sinkhorn_ref

import sage_optax
from sage_optax import Route
from sage_optax.sinkgd import sinkhorn_normalize as jax_sinkhorn

torch = pytest.importorskip("torch")

import sage_torch  # noqa: E402
from sage_torch import chunked, sinkgd  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")

FLAX = Route("dense", -2, -1)  # (in, out); PyTorch (out, in) is fan_in_dim=-1, fan_out_dim=-2


def base_matrix(shape=(12, 7), seed=0):
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(shape) * np.exp(rng.uniform(-3, 3, shape[-1]))
    g[2] = 0.0  # an exactly-zero row
    return g.astype(np.float32)


def jax_x(g, normalization="unit", eps=1e-8):
    g = jnp.asarray(g)
    return np.asarray(jax_sinkhorn(g, FLAX.resolve(g.shape, "g"), 5, eps, normalization))


def torch_x(g, normalization="unit", eps=1e-8, matvec=None):
    # the Flax layout (in, out) is fan_in_dim=0, fan_out_dim=1 in torch terms
    return sinkgd.sinkhorn_normalize(torch.tensor(g), 0, 1, 5, eps, normalization,
                                    matvec=matvec).numpy()


SINKHORNS = {
    "jax": jax_x,
    "torch-matvec": lambda g, *a, **k: torch_x(g, *a, matvec=True, **k),
    "torch-elementwise": lambda g, *a, **k: torch_x(g, *a, matvec=False, **k),
}


@pytest.mark.parametrize("impl", list(SINKHORNS))
@pytest.mark.parametrize("normalization", ["unit", "sqrt"])
@pytest.mark.parametrize("scale", [1e19, 1e30, 1e36])
def test_sinkhorn_is_finite_and_right_for_huge_gradients(impl, normalization, scale):
    """float32 squares of 1e19 overflow; the rescaled computation matches float64."""
    g = base_matrix() * np.float32(scale)
    assert np.all(np.isfinite(g))
    with np.errstate(over="ignore"):
        assert np.isinf(np.square(g)).any()  # the plain computation would overflow
    x = SINKHORNS[impl](g, normalization)
    assert np.all(np.isfinite(x))
    want = sinkhorn_ref(g.astype(np.float64), normalization=normalization)
    np.testing.assert_allclose(x, want, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("impl", list(SINKHORNS))
def test_rescaling_is_exact(impl):
    """With eps = 0 Sinkhorn is scale-invariant, and the power-of-two rescaling makes it so
    bit for bit: 2^k·G gives exactly G's result, also where (2^k·G)² overflows."""
    g = base_matrix(seed=1)
    x = SINKHORNS[impl](g, eps=0.0)
    for k in (-40, 20, 70, 100):
        np.testing.assert_array_equal(SINKHORNS[impl](g * np.float32(2.0**k), eps=0.0), x)


def test_torch_fast_path_is_finite_for_huge_gradients():
    """The in-place CPU path of SinkGD (matrices of >= FAST_MIN_NUMEL elements)."""
    g = np.random.default_rng(2).standard_normal((256, 256)).astype(np.float32) * 1e20
    p = torch.nn.Parameter(torch.zeros(256, 256))
    assert chunked.use_fast_path(p, torch.tensor(g))
    opt = sage_torch.SinkGD([p], lr=1.0, alpha=1.0, weight_decay=0.0)
    p.grad = torch.tensor(g)
    opt.step()
    want = -sinkhorn_ref(g.astype(np.float64), fan_in_axis=1, fan_out_axis=0)
    np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("impl", list(SINKHORNS))
def test_all_zero_matrix_stays_zero(impl):
    x = SINKHORNS[impl](np.zeros((4, 5), np.float32))
    assert np.all(x == 0)


@pytest.mark.parametrize("shape", [(5, 0), (0, 3), (2, 0, 4)])
def test_zero_size_matrices(shape):
    """JAX used to crash with "zero-size array to reduction operation min"; torch did not."""
    params = {"w": jnp.ones(shape), "k": jnp.ones((4, 3))}
    tx = sage_optax.sinkgd(1e-2)
    u, _ = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    assert u["w"].shape == shape and np.all(np.isfinite(np.asarray(u["k"])))
    p = torch.nn.Parameter(torch.ones(shape))
    opt = sage_torch.SinkGD([p], lr=1e-2)
    p.grad = torch.ones(shape)
    opt.step()
    assert p.shape == shape


# ---------------------------------------------------------------------------
# skip_nonfinite
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, True, 2.7, "3", None])
def test_skip_nonfinite_is_validated(bad):
    with pytest.raises(ValueError, match="skip_nonfinite"):
        sage_optax.make_optimizer("sage-hybrid", skip_nonfinite=bad)
    with pytest.raises(ValueError, match="skip_nonfinite"):
        sage_torch.make_optimizer("sage-hybrid", TinyLM(), skip_nonfinite=bad)


def test_skip_nonfinite_accepts_counts():
    for n in (0, 2, np.int64(3)):
        sage_optax.make_optimizer("sage-hybrid", skip_nonfinite=n)
        opt = sage_torch.make_optimizer("sage-hybrid", TinyLM(), skip_nonfinite=n)
        assert isinstance(opt, sage_torch.RuleOptimizer)


def test_skip_nonfinite_range_is_that_of_int32():
    """optax counts non-finite steps in an int32: larger values are refused up front, in
    both frameworks, with one line naming the option and its range (not an OverflowError
    at the first update); the largest count, 2**31 - 1, builds and steps in both: a
    non-finite gradient is skipped (parameters unchanged), a finite one applied."""
    msg = r"^skip_nonfinite must be an integer in \[0, 2147483647\] [^\n]*, got "
    for bad in (2**31, 2**70, np.uint64(2**63), 10**400):
        with pytest.raises(ValueError, match=msg):
            sage_optax.make_optimizer("sage-hybrid", skip_nonfinite=bad)
        with pytest.raises(ValueError, match=msg):
            sage_torch.make_optimizer("sage-hybrid", TinyLM(), skip_nonfinite=bad)
    n = 2**31 - 1
    p = jax_params()
    tx = sage_optax.make_optimizer("sage-hybrid", 1e-2, skip_nonfinite=n)
    state = tx.init(p)
    bad = jax.tree.map(lambda x: jnp.full(x.shape, jnp.nan, x.dtype), p)
    u, state = jax.jit(tx.update)(bad, state, p)
    assert all(np.all(np.asarray(x) == 0) for x in jax.tree.leaves(u))
    u, state = jax.jit(tx.update)(jax.tree.map(jnp.ones_like, p), state, p)
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(u))
    assert any(np.any(np.asarray(x) != 0) for x in jax.tree.leaves(u))
    model = TinyLM()
    opt = sage_torch.make_optimizer("sage-hybrid", model, skip_nonfinite=n)
    assert opt.skip_nonfinite == n
    before = copy.deepcopy(model.state_dict())
    for q in model.parameters():
        q.grad = torch.full_like(q, float("nan"))
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


# A gradient sequence: "ok" finite, "bad" with one NaN in a dense matrix.
SEQUENCE = ["ok", "bad", "bad", "bad", "bad", "ok", "bad", "ok"]


def expected_applied(n: int) -> list[bool]:
    """At most n consecutive bad steps are skipped; the (n+1)-th in a row is applied."""
    applied, run = [], 0
    for kind in SEQUENCE:
        run = 0 if kind == "ok" else run + 1
        applied.append(run <= 0 or run > n)
    return applied


def test_expected_pattern_is_what_the_docs_say():
    assert expected_applied(2) == [True, False, False, True, True, True, False, True]
    assert expected_applied(0) == [True] * len(SEQUENCE)


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.norm(self.fc(self.embed(x))) @ self.embed.weight.T


def jax_params():
    return {"embed": {"embedding": jnp.ones((16, 4))}, "mlp": {"kernel": jnp.ones((4, 6))},
            "norm": {"scale": jnp.ones(4)}}


def jax_applied(n: int) -> list[bool]:
    p = jax_params()
    tx = sage_optax.make_optimizer("sage-hybrid", 1e-2, skip_nonfinite=n)
    update, state = jax.jit(tx.update), tx.init(p)
    rng = np.random.default_rng(0)
    applied = []
    for kind in SEQUENCE:
        g = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), p)
        if kind == "bad":
            g["mlp"]["kernel"] = g["mlp"]["kernel"].at[0, 0].set(jnp.nan)
        before = jax.tree.map(np.asarray, p)
        u, state = update(g, state, p)
        p = optax.apply_updates(p, u)
        applied.append(any(not np.array_equal(np.asarray(a), b) for a, b in
                           zip(jax.tree.leaves(p), jax.tree.leaves(before), strict=True)))
        p = jax.tree.map(lambda x: jnp.nan_to_num(x, nan=1.0), p)  # keep going after an apply
    return applied


def torch_applied(n: int) -> list[bool]:
    torch.manual_seed(0)
    model = TinyLM()
    opt = sage_torch.make_optimizer("sage-hybrid", model, lr=1e-2, skip_nonfinite=n)
    gen = torch.Generator().manual_seed(0)
    applied = []
    for kind in SEQUENCE:
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        if kind == "bad":
            model.fc.weight.grad[0, 0] = float("nan")
        before = copy.deepcopy(model.state_dict())
        opt.step()
        applied.append(any(not torch.equal(v, before[k]) for k, v in model.state_dict().items()))
        with torch.no_grad():
            for p in model.parameters():
                p.nan_to_num_(nan=1.0)
    return applied


@pytest.mark.parametrize("n", [0, 2])
def test_skip_nonfinite_same_meaning_in_both_frameworks(n):
    want = expected_applied(n)
    assert jax_applied(n) == want
    assert torch_applied(n) == want


def test_torch_skip_leaves_params_and_state_untouched_and_resumes():
    """A skipped step changes nothing (state and step counts included); the run then
    continues exactly as if the bad step never happened; the counters survive state_dict."""
    torch.manual_seed(0)
    model = TinyLM()
    twin = copy.deepcopy(model)
    opt = sage_torch.make_optimizer("sage-hybrid", model, skip_nonfinite=3)
    clean = sage_torch.make_optimizer("sage-hybrid", twin)
    x = torch.randint(0, 16, (3, 5), generator=torch.Generator().manual_seed(1))

    def step(m, o, poison=False):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
        if poison:
            m.embed.weight.grad[3, 1] = float("inf")
        o.step()

    step(model, opt)
    step(twin, clean)
    state_before = copy.deepcopy(opt.state_dict())
    params_before = copy.deepcopy(model.state_dict())
    step(model, opt, poison=True)
    assert opt.nonfinite_count == 1 and opt.total_nonfinite == 1
    for k, v in model.state_dict().items():
        assert torch.equal(v, params_before[k]), k
    after = opt.state_dict()
    for i, st in state_before["state"].items():
        for key, value in st.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    # save/load in the middle of a run of bad steps keeps the count
    fresh_model = copy.deepcopy(model)
    fresh = sage_torch.make_optimizer("sage-hybrid", fresh_model, skip_nonfinite=3)
    fresh.load_state_dict(after)
    assert (fresh.nonfinite_count, fresh.total_nonfinite) == (1, 1)
    for _ in range(2):
        step(model, opt)
        step(twin, clean)
    assert opt.nonfinite_count == 0 and opt.total_nonfinite == 1
    for (name, p), (_, q) in zip(model.named_parameters(), twin.named_parameters(),
                                 strict=True):
        assert torch.equal(p, q), name
