"""The axis-group convention is the same in both frameworks: a convolution, a multi-head kernel
and stacked matrices make the very same updates in sage_optax and sage_torch, for every
configuration (float64, injected APOLLO projection, 4 steps)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import sage_optax
from sage_optim.presets import CONFIG_NAMES
from sage_optim.routing import Route

torch = pytest.importorskip("torch")
nn = torch.nn
import sage_torch  # noqa: E402

STEPS, TOL, LR = 4, 1e-10, 1e-2
RNG = np.random.default_rng(0)
P_FIXED = RNG.standard_normal((64, 2))


def jax_projection(path, k, n, rank):
    return jnp.asarray(P_FIXED[:n, :rank])


def torch_projection(name, k, n, rank):
    return torch.from_numpy(P_FIXED[:n, :rank].copy())


class Conv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3)


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.query = nn.Linear(6, 6)  # in 6 -> 2 heads x 3


class Stacked(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3, 5, 4))  # 3 layers of (out 5, in 4)


# each case: torch model, torch overrides, {torch name: (jax path, to_jax, to_torch)},
# jax overrides
CASES = {
    "conv": (
        Conv, {},
        {"conv.weight": ("conv.kernel", lambda w: w.transpose(2, 3, 1, 0),
                         lambda k: k.transpose(3, 2, 0, 1)),
         "conv.bias": ("conv.bias", lambda b: b, lambda b: b)},
        # nnx.Conv's layout: (kh, kw, Cin, Cout), fan-in = Cin then the taps
        {"conv.kernel": Route("dense", fan_in=(2, 0, 1), fan_out=3)},
    ),
    "heads": (
        Heads, {},
        {"query.weight": ("query.kernel", lambda w: w.T.reshape(6, 2, 3),
                          lambda k: k.reshape(6, 6).T),
         "query.bias": ("query.bias", lambda b: b.reshape(2, 3), lambda b: b.reshape(6))},
        # nnx.LinearGeneral's layout: (in, heads, head_dim)
        {"query.kernel": Route("dense", fan_in=0, fan_out=(1, 2)),
         "query.bias": Route("vector")},
    ),
    "stacked": (
        Stacked, {"w": Route("dense", fan_in=-1, fan_out=-2)},
        {"w": ("w", lambda w: w.transpose(0, 2, 1), lambda k: k.transpose(0, 2, 1))},
        {"w": Route("dense", fan_in=-2, fan_out=-1)},
    ),
}


def nested(flat):
    out = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


@pytest.mark.parametrize("name", CONFIG_NAMES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_axis_groups_make_the_same_updates(case, name, torch_one_thread):
    make_model, t_over, mapping, j_over = CASES[case]
    torch.manual_seed(0)
    model = make_model().double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.from_numpy(RNG.standard_normal(tuple(p.shape))))
    t_opt = sage_torch.make_optimizer(name, model, LR, route_overrides=t_over,
                                      dense_projection=torch_projection)
    tparams = dict(model.named_parameters())
    with jax.enable_x64(True):
        params = nested({jpath: jnp.asarray(to_jax(tparams[t].detach().numpy()))
                         for t, (jpath, to_jax, _) in mapping.items()})
        extra = {"dense_projection": jax_projection} if name == "apollo" else {}
        tx = sage_optax.make_optimizer(name, LR, route_overrides=j_over, **extra)
        state = tx.init(params)
        for step in range(STEPS):
            grads = {t: RNG.standard_normal(tuple(p.shape)) for t, p in tparams.items()}
            for t, p in tparams.items():
                p.grad = torch.from_numpy(grads[t])
            t_opt.step()
            g = nested({jpath: jnp.asarray(to_jax(grads[t]))
                        for t, (jpath, to_jax, _) in mapping.items()})
            updates, state = tx.update(g, state, params)
            params = optax.apply_updates(params, updates)
            flat = dict(sage_optax.routing.iter_leaves(params))
            for t, (jpath, _, to_torch) in mapping.items():
                gap = np.max(np.abs(to_torch(np.asarray(flat[jpath]))
                                    - tparams[t].detach().numpy()))
                assert gap < TOL, f"{case}/{name} step {step + 1}: {t} differs by {gap:.2e}"


def test_routers_agree_on_the_axes():
    """The two routers give the same merged matrix: fan-in and fan-out sizes agree."""
    table = sage_torch.routing_table("sage-hybrid", Conv())
    row = table.row("conv.weight")
    assert (row.kind, row.fan_in, row.fan_out) == ("dense", "1,2,3 (2x3x3=18)", "0 (4)")
    from flax import nnx

    class JaxConv(nnx.Module):
        def __init__(self, rngs):
            self.conv = nnx.Conv(2, 4, kernel_size=(3, 3), rngs=rngs)

    j_row = sage_optax.routing_table("sage-hybrid", JaxConv(nnx.Rngs(0))).row("conv.kernel")
    assert (j_row.fan_in, j_row.fan_out) == ("2,0,1 (2x3x3=18)", "3 (4)")
