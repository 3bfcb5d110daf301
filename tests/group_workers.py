"""Worker classes for tests/test_group.py. They live in their own module because the rank
processes import them by module path."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from engine.parallel.group import RankContext


class EchoWorker:
    """Small SPMD worker: a collective, per-rank state, and ways to fail."""

    def __init__(self, ctx: RankContext, tag: str = "echo"):
        self.ctx = ctx
        self.tag = tag
        self.calls = 0

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def all_reduce_rank(self) -> float:
        self.calls += 1
        value = torch.tensor([float(self.ctx.rank)])
        dist.all_reduce(value, group=self.ctx.group)
        return value.item()

    def scale(self, values: torch.Tensor) -> torch.Tensor:
        return values * (self.ctx.rank + 1)

    def state(self) -> dict:
        return {"rank": self.ctx.rank, "world_size": self.ctx.world_size, "tag": self.tag,
                "calls": self.calls, "pid": os.getpid(), "threads": torch.get_num_threads()}

    def raise_on(self, bad_rank: int) -> int:
        """Every rank but ``bad_rank`` enters an all-reduce; ``bad_rank`` raises instead."""
        if self.ctx.rank == bad_rank:
            raise ValueError(f"rank {bad_rank} refuses")
        dist.all_reduce(torch.zeros(1), group=self.ctx.group)
        return self.ctx.rank

    def stall_on(self, slow_rank: int, sleep_s: float) -> int:
        """``slow_rank`` sleeps while every other rank waits in the all-reduce."""
        if self.ctx.rank == slow_rank:
            time.sleep(sleep_s)
        dist.all_reduce(torch.zeros(1), group=self.ctx.group)
        return self.ctx.rank


class ClosingWorker:
    """Holds a named semaphore (as tqdm's lock does in a rank that loads a model) and writes
    ``<out>/closed-<rank>`` from ``close()``."""

    def __init__(self, ctx: RankContext, out: str):
        import multiprocessing

        self.ctx, self.out = ctx, out
        self.lock = multiprocessing.get_context("spawn").RLock()

    def rank(self) -> int:
        return self.ctx.rank

    def close(self) -> None:
        with open(os.path.join(self.out, f"closed-{self.ctx.rank}"), "w") as f:
            f.write("closed")


class FailingInitWorker:
    """Raises in the constructor on one rank."""

    def __init__(self, ctx: RankContext, bad_rank: int):
        if ctx.rank == bad_rank:
            raise ValueError(f"bad config on rank {ctx.rank}")


class SlowInitWorker:
    """Takes ``seconds`` to construct (a model that loads slowly)."""

    def __init__(self, ctx: RankContext, seconds: float = 30.0):
        time.sleep(seconds)


class PeerLossWorker:
    """Rank 0 raises at once (as gloo's survivors do: "Connection closed by peer"); rank 1
    dies a moment later. The dead rank is the one to blame."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    def lose_peer(self) -> None:
        if self.ctx.rank == 0:
            raise RuntimeError("Connection closed by peer")
        time.sleep(0.1)
        os._exit(3)


class ExpertWorker:
    """One MoE layer with seeded random weights, every expert on every rank (the reference)
    and this rank's expert-parallel copy (its experts only; a TP slice of the shared expert
    when ``tp``), for driving the dispatchers of engine/parallel/expert.py directly."""

    def __init__(self, ctx: RankContext, overrides: dict, seed: int = 0):
        from engine.model.config import ModelConfig
        from engine.model.model import MoE
        from engine.model.tiny import tiny_config

        self.ctx = ctx
        self.cfg = ModelConfig.from_dict(tiny_config("deepseek_v3", **overrides))
        g = torch.Generator().manual_seed(seed)
        self.full = MoE(self.cfg)
        for p in list(self.full.parameters()) + list(self.full.buffers()):
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)

    def _sharded(self, tp: bool):
        import copy

        from engine.parallel.shard import WeightShard

        shard = WeightShard(self.ctx.rank, self.ctx.world_size, tp=tp)
        moe = copy.deepcopy(self.full)
        for name, p in list(moe.named_parameters()):
            part = shard.part(self.cfg, f"model.layers.1.mlp.{name}", tuple(p.shape))
            if part is not None:
                owner, attr = name.rsplit(".", 1)
                setattr(moe.get_submodule(owner), attr, torch.nn.Parameter(p[part].clone(), requires_grad=False))
        moe.experts.first = shard.experts(self.cfg).start
        return moe

    def run(self, kind: str, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, own: list[list[int]]):
        """``kind`` prefill: rank r computes tokens ``own[r]`` through the all-to-all
        dispatcher; decode: every token through the reduced one. Returns (EP output of this
        rank's tokens, the one-process reference's output of them, tokens each local expert got)."""
        from engine.model.experts import LOCAL_EXPERTS
        from engine.parallel.expert import AllToAllExperts, ReducedExperts

        r, c = self.ctx.rank, self.ctx.world_size
        if kind == "prefill":
            mine = torch.tensor(own[r], dtype=torch.long)
            moe = self._sharded(tp=False)
            dispatch = AllToAllExperts(self.ctx.comm, r, c, self.cfg.n_routed_experts)
        else:
            mine = torch.arange(x.shape[0])
            moe = self._sharded(tp=True)
            dispatch = ReducedExperts(self.ctx.comm, c)
        out = dispatch(moe, x[mine], idx[mine], weights[mine])
        ref = LOCAL_EXPERTS(self.full, x, idx, weights)[mine]
        held = moe.experts.held
        got = [int((idx == e).sum()) for e in held]
        return out, ref, {"experts": [held.start, held.stop], "pairs_per_expert": got, "bytes_in": dispatch.bytes_sent}


class CommWorker:
    """Runs every collective of engine/parallel/comm.py beside torch.distributed's own."""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx

    def compare(self, seed: int) -> dict:
        comm, r, c = self.ctx.comm, self.ctx.rank, self.ctx.world_size
        g = torch.Generator().manual_seed(seed * 100 + r)  # each rank its own data
        out = {"uses_shm": comm.uses_shm, "sums": [], "mismatch": []}
        before = (comm.shm_ops, comm.group_ops)
        # small messages (shared memory) and one larger than a slot (the process group)
        for shape, dtype in [((3, 5), torch.float32), ((2, 4, 8), torch.bfloat16), ((1,), torch.float32),
                             ((c * 7,), torch.int64), (((comm.slot_bytes // 4) + 8,), torch.float32)]:
            x = (torch.randn(shape, generator=g) * 100).to(dtype)
            mine, ref = x.clone(), x.clone()
            comm.all_reduce(mine)
            dist.all_reduce(ref, group=self.ctx.group)
            out["sums"].append(mine)
            tol = {"rtol": 1e-2, "atol": 2.0} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-3}
            if not torch.allclose(mine.float(), ref.float(), **tol):  # another order of the same sum
                out["mismatch"].append(("all_reduce", shape, dtype))
            flat = x.reshape(-1)[: (x.numel() // c) * c].contiguous()
            got, want = torch.empty(c * flat.numel(), dtype=dtype), torch.empty(c * flat.numel(), dtype=dtype)
            comm.all_gather_single(got, flat)
            dist.all_gather_single(want, flat, group=self.ctx.group)
            if not torch.equal(got, want):
                out["mismatch"].append(("all_gather", shape, dtype))
            got, want = torch.empty_like(flat), torch.empty_like(flat)
            comm.all_to_all_single(got, flat)
            dist.all_to_all_single(want, flat, group=self.ctx.group)
            if not torch.equal(got, want):
                out["mismatch"].append(("all_to_all", shape, dtype))
            if dtype.is_floating_point:
                got = torch.empty(flat.numel() // c, dtype=dtype)
                want = torch.empty_like(got)
                comm.reduce_scatter_single(got, flat)
                dist.reduce_scatter_single(want, flat, group=self.ctx.group)
                if not torch.allclose(got.float(), want.float(), **tol):
                    out["mismatch"].append(("reduce_scatter", shape, dtype))
            src = (seed + len(out["sums"])) % c
            got, want = x.clone(), x.clone()
            comm.broadcast(got, src)
            dist.broadcast(want, group=self.ctx.group, group_src=src)
            if not torch.equal(got, want):
                out["mismatch"].append(("broadcast", shape, dtype))
        # a non-contiguous tensor reduced in place (shared memory; gloo needs a contiguous copy)
        x = (torch.randn(6, 4, generator=g) * 100).t()
        mine, ref = x.clone(), x.contiguous()  # clone keeps the transposed strides
        comm.all_reduce(mine)
        dist.all_reduce(ref, group=self.ctx.group)
        out["sums"].append(mine.contiguous())
        if mine.is_contiguous() or not torch.allclose(mine, ref, rtol=1e-6, atol=1e-3):
            out["mismatch"].append(("all_reduce", "non-contiguous"))
        mine, ref = x.clone(), x.contiguous()
        comm.broadcast(mine, c - 1)
        dist.broadcast(ref, group=self.ctx.group, group_src=c - 1)
        if mine.is_contiguous() or not torch.equal(mine, ref):
            out["mismatch"].append(("broadcast", "non-contiguous"))
        out["ops"] = (comm.shm_ops - before[0], comm.group_ops - before[1])
        return out

    def uneven_and_ring(self, seed: int) -> dict:
        """The uneven all-to-all beside torch.distributed's, and C − 1 ring steps (each rank
        sends to rank + 1 and receives from rank − 1) in which every rank sees every other
        rank's block once; one block is larger than a slot."""
        comm, r, c = self.ctx.comm, self.ctx.rank, self.ctx.world_size
        out = {"mismatch": []}
        before = (comm.shm_ops, comm.group_ops, comm.p2p_bytes)
        rows = lambda i, j: (i + 2 * j + seed) % 3  # rows rank i sends rank j (some none)
        in_splits, out_splits = [rows(r, j) for j in range(c)], [rows(i, r) for i in range(c)]
        x = torch.randn(sum(in_splits), 5, generator=torch.Generator().manual_seed(seed * 100 + r))
        got, want = torch.empty(sum(out_splits), 5), torch.empty(sum(out_splits), 5)
        comm.all_to_all(got, x, out_splits, in_splits)
        dist.all_to_all_single(want, x, out_splits, in_splits, group=self.ctx.group)
        if not torch.equal(got, want):
            out["mismatch"].append("all_to_all")
        sent = 0
        for numel in (7, comm.slot_bytes // 4 + 8):
            block = lambda rank: torch.arange(numel, dtype=torch.float32) + 1000 * rank + seed
            held = block(r)
            for step in range(1, c):
                nxt = torch.empty_like(held)
                comm.sendrecv(held, (r + 1) % c, nxt, (r - 1) % c)
                sent += held.numel() * held.element_size()
                held = nxt
                if not torch.equal(held, block((r - step) % c)):
                    out["mismatch"].append(("ring", numel, step))
        out["ops"] = (comm.shm_ops - before[0], comm.group_ops - before[1])
        out["p2p_bytes"] = (comm.p2p_bytes - before[2], sent)
        return out
