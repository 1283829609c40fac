"""Distributed runs of sage_torch optimizers, launched by tests/torch/test_torch_distributed.py.

Usage: ``python tests/torch_dist_worker.py OUT_JSON [FILTER]``.

The launcher (this script's main process) first trains every case's model in a single
process on the full batches (the reference), then becomes rank 0 of a 2-rank gloo process
group whose rank 1 is a child forked at start-up (spawned where fork does not exist); they
meet through a ``TCPStore`` on 127.0.0.1 whose port the OS picks, so parallel test
sessions never race for a port.  The ranks run every case of :func:`cases`:

* ``fsdp:...``: the model sharded with FSDP2 (``fully_shard``; every parameter is a DTensor
  sharded on dim 0: the vocab dim of the embedding and of the head), the optimizer stepping
  the DTensor parameters directly; final parameters gathered with ``full_tensor()``;
* ``fsdp:.../naive-per-shard``: negative controls, the same rules applied to each rank's
  local shard as a plain tensor (SAGE's vocab mean and SinkGD's norms then see only half of
  the vocab), which must NOT match;
* ``ddp:...``: the model wrapped in ``DistributedDataParallel``.

Rank ``r`` trains on rows ``[r*B/2, (r+1)*B/2)`` of each global batch; the loss is a mean
and both wrappers average gradients over the ranks, so the distributed gradients equal the
single-process ones up to rounding.  OUT_JSON receives, per case, the largest absolute
difference from the single-process run (``max_diff``, and ``diffs`` per parameter), how far
the single-process run moved the parameters (``moved``), and for DDP the largest difference
between the two replicas (``replica_diff``).  FILTER (comma-separated substrings of case
names) restricts the cases, for debugging.  Progress goes to stderr.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import sage_torch  # noqa: E402
from sage_torch.optimizer import RuleOptimizer  # noqa: E402

WORLD = 2
V, D, FF = 45, 16, 33  # vocab, width, MLP width (odd: uneven shards)
BATCH, SEQ, STEPS = 4, 9, 10
HOST = "127.0.0.1"
PG_TIMEOUT = datetime.timedelta(seconds=60)  # a stuck collective raises instead of hanging
FSDP_CONFIGS = ("sage-hybrid", "sage-pure", "lion-hybrid", "sinkgd-pure", "apollo")


def cases() -> list[dict]:
    out = [{"wrap": "fsdp", "config": config, "dtype": "float64", "foreach": foreach}
           for foreach in (False, True) for config in FSDP_CONFIGS]
    out += [{"wrap": "fsdp", "config": "sage-pure", "dtype": "float32", "foreach": True},
            {"wrap": "fsdp", "config": "apollo", "dtype": "float32", "foreach": False}]
    # APOLLO's other variant: rank 2, channel-wise scaling (over the sharded dim of
    # down.weight), projection refreshed every 4 steps
    out.append({"wrap": "fsdp", "config": "apollo", "dtype": "float64", "foreach": True,
                "overrides": {"dense_rank": 2, "dense_scale_type": "channel",
                              "dense_update_proj_gap": 4}})
    # a tied head: the embedding is also the output matrix
    out.append({"wrap": "fsdp", "config": "sage-hybrid", "dtype": "float64", "foreach": True,
                "tied": True})
    for config in ("sage-hybrid", "sinkgd-pure"):
        out.append({"wrap": "fsdp", "config": config, "dtype": "float64", "foreach": False,
                    "naive": True})
    for dtype, foreach, tied in (("float64", False, False), ("float64", True, False),
                                 ("float64", False, True), ("float32", True, False)):
        out.append({"wrap": "ddp", "config": "sage-hybrid", "dtype": dtype,
                    "foreach": foreach, "tied": tied})
    for case in out:
        case.setdefault("overrides", {})
        case.setdefault("tied", False)
        case.setdefault("naive", False)
    return out


def case_name(case: dict) -> str:
    name = f"{case['wrap']}:{case['config']}/{case['dtype']}/foreach={case['foreach']}"
    name += "".join(f"/{k}={v}" for k, v in case["overrides"].items())
    return name + "/tied" * case["tied"] + "/naive-per-shard" * case["naive"]


def selected(filter_arg: str) -> list[dict]:
    keys = [k for k in filter_arg.split(",") if k]
    return [c for c in cases() if not keys or any(k in case_name(c) for k in keys)]


def log(*what: object) -> None:
    t0 = float(os.environ.setdefault("SAGE_DIST_T0", str(time.time())))
    print(f"[{time.time() - t0:6.2f}s]", *what, file=sys.stderr, flush=True)


class TinyLM(nn.Module):
    """Embedding (V, d), a residual MLP block (two nn.Linear), a LayerNorm and a head."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.up = nn.Linear(D, FF)
        self.down = nn.Linear(FF, D)
        self.norm = nn.LayerNorm(D)
        self.head = None if tied else nn.Linear(D, V, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        h = h + self.down(torch.tanh(self.up(h)))
        h = self.norm(h)
        return h @ self.embed.weight.t() if self.head is None else self.head(h)


def make_model(case: dict) -> nn.Module:
    torch.manual_seed(1234)
    model = TinyLM(case["tied"]).to(getattr(torch, case["dtype"]))
    with torch.no_grad():  # LayerNorm starts at (1, 0): make its parameters less special
        model.norm.weight.add_(0.1 * torch.randn_like(model.norm.weight))
        model.norm.bias.add_(0.1 * torch.randn_like(model.norm.bias))
    return model


def batches() -> list[torch.Tensor]:
    """Global token batches, Zipf-like: many vocab rows get exactly zero gradient."""
    gen = torch.Generator().manual_seed(99)
    weights = 1.0 / torch.arange(1, V + 1, dtype=torch.float64) ** 1.2
    return [torch.multinomial(weights, BATCH * SEQ, replacement=True, generator=gen)
            .reshape(BATCH, SEQ) for _ in range(STEPS)]


def projection(name: str, refresh: int, n: int, rank: int) -> torch.Tensor:
    """A deterministic APOLLO projection, injected through make_optimizer."""
    i = torch.arange(n * rank, dtype=torch.float64).reshape(n, rank)
    return (torch.cos(1.3 * i + 0.7 * refresh + 0.1 * len(name)) / math.sqrt(rank)).float()


def make_opt(model: nn.Module, case: dict) -> RuleOptimizer:
    return sage_torch.make_optimizer(case["config"], model, foreach=case["foreach"],
                                     dense_projection=projection, **case["overrides"])


def train(model: nn.Module, opt: torch.optim.Optimizer, rows: slice,
          before_step=None) -> None:
    for tokens in batches():
        opt.zero_grad(set_to_none=True)
        x = tokens[rows]
        logits = model(x[:, :-1])
        F.cross_entropy(logits.reshape(-1, V), x[:, 1:].reshape(-1)).backward()
        if before_step is not None:
            before_step()
        opt.step()


def reference(case: dict) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process run on the full batches: (initial, final) parameters by name."""
    model = make_model(case)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train(model, make_opt(model, case), slice(None))
    return start, {n: p.detach().clone() for n, p in model.named_parameters()}


def naive_per_shard_opt(model: nn.Module, case: dict):
    """The configuration's optimizer on each rank's local shards alone (what must NOT be done).

    Plain parameters share storage with the DTensor parameters' local shards; returns the
    optimizer and a hook that points their ``.grad`` at the local gradient shards.
    """
    pairs, groups = [], []
    for group in sage_torch.param_groups(model, case["config"], foreach=case["foreach"],
                                          **case["overrides"]):
        local = [nn.Parameter(p.to_local().detach()) for p in group["params"]]
        pairs += zip(group["params"], local, strict=True)
        groups.append({**group, "params": local})
    opt = RuleOptimizer(groups, {"lr": 0.0}, projection=projection)

    def set_grads() -> None:
        for p, q in pairs:
            q.grad = p.grad.to_local()

    return opt, set_grads


def run_fsdp(case: dict, rank: int, rows: slice, mesh) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Shard

    model = make_model(case)
    fully_shard(model.up, mesh=mesh)
    fully_shard(model.down, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for n, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.placements == (Shard(0),), (n, type(p))
    if case["naive"]:
        opt, hook = naive_per_shard_opt(model, case)
        train(model, opt, rows, hook)
    else:
        opt = make_opt(model, case)
        train(model, opt, rows)
        for p in model.parameters():  # the optimizer state is distributed like the params
            for key, value in opt.state[p].items():
                # step and APOLLO's proj_seed: host scalars, the same on every rank
                assert key in ("step", "proj_seed") or isinstance(value, DTensor), (
                    key, type(value))
                assert not any(pl.is_partial() for pl in getattr(value, "placements", ())), key
    return {n: p.detach().full_tensor() for n, p in model.named_parameters()}


def run_ddp(case: dict, rank: int, rows: slice) -> tuple[dict[str, torch.Tensor], float]:
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(case)
    train(DistributedDataParallel(model), make_opt(model, case), rows)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat = torch.cat([p.reshape(-1) for p in final.values()])
    both = [torch.empty_like(flat) for _ in range(WORLD)]
    dist.all_gather(both, flat)
    return final, (both[0] - both[1]).abs().max().item()


def run_rank(rank: int, store: dist.Store, filter_arg: str) -> dict:
    """Join the process group and run every selected case; returns rank 0's results."""
    from torch.distributed.device_mesh import init_device_mesh

    warnings.filterwarnings("ignore", message=".*returned a view tensor")  # FSDP2, harmless
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD,
                            timeout=PG_TIMEOUT)
    log(f"rank {rank}: process group up")
    try:
        mesh = init_device_mesh("cpu", (WORLD,))
        rows = slice(rank * BATCH // WORLD, (rank + 1) * BATCH // WORLD)
        results = {}
        for case in selected(filter_arg):
            t = time.perf_counter()
            if case["wrap"] == "fsdp":
                results[case_name(case)] = (run_fsdp(case, rank, rows, mesh), None)
            else:
                results[case_name(case)] = run_ddp(case, rank, rows)
            if rank == 0:
                log(f"rank 0: {case_name(case)} {time.perf_counter() - t:.2f}s")
        dist.barrier()
        return results
    finally:
        dist.destroy_process_group()


def other_rank(rank: int, port_conn, filter_arg: str) -> None:
    """Rank 1, in a child process: connects to the launcher's store and runs the cases."""
    torch.set_num_threads(1)
    port = port_conn.recv()
    store = dist.TCPStore(HOST, port, WORLD, is_master=False, timeout=PG_TIMEOUT)
    run_rank(rank, store, filter_arg)
    log(f"rank {rank}: done")


def main() -> None:
    out_json = os.path.abspath(sys.argv[1])
    filter_arg = sys.argv[2] if len(sys.argv) > 2 else ""
    log("launcher: start")
    t0 = time.perf_counter()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # loopback only (inherited by rank 1)
    # Import what the ranks need before forking, so rank 1 starts with it loaded.
    import torch.distributed.device_mesh  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    # The launcher is rank 0; rank 1 is forked before any thread exists (spawned where
    # fork is unavailable).  The store listens on 127.0.0.1, on a port the OS picks.
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    port_recv, port_send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=other_rank, args=(1, port_recv, filter_arg), daemon=True)
    child.start()
    torch.set_num_threads(1)
    store = dist.TCPStore(HOST, 0, WORLD, is_master=True, timeout=PG_TIMEOUT,
                          wait_for_workers=False)
    port_send.send(store.port)
    todo = selected(filter_arg)
    refs = {}
    for case in todo:
        ref_case = {**case, "wrap": "ref", "naive": False}
        if case_name(ref_case) not in refs:
            refs[case_name(ref_case)] = reference(ref_case)
    log("launcher: single-process runs done")
    try:
        got = run_rank(0, store, filter_arg)
    except BaseException:
        child.kill()  # it may be waiting in a collective for rank 0
        raise
    child.join(timeout=PG_TIMEOUT.total_seconds())
    if child.exitcode is None:
        child.kill()
    if child.exitcode != 0:
        raise RuntimeError(f"rank 1 failed with exit code {child.exitcode} (see above)")
    log("launcher: ranks done")
    report = {"runtime_s": time.perf_counter() - t0, "cases": {}}
    for case in todo:
        start, ref = refs[case_name({**case, "wrap": "ref", "naive": False})]
        final, replica_diff = got[case_name(case)]
        diffs = {n: (final[n] - ref[n]).abs().max().item() for n in ref}
        moved = {n: (ref[n] - start[n]).abs().max().item() for n in ref}
        report["cases"][case_name(case)] = {
            **case, "max_diff": max(diffs.values()), "diffs": diffs, "moved": moved,
            "replica_diff": replica_diff,
        }
    with open(out_json, "w") as f:
        json.dump(report, f, indent=1)
    log("launcher: done")


if __name__ == "__main__":
    main()
