"""Worker classes for tests/test_group.py. They live in their own module because the spawned
rank processes re-import them by module path."""

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


class FailingInitWorker:
    """Raises in the constructor on one rank."""

    def __init__(self, ctx: RankContext, bad_rank: int):
        if ctx.rank == bad_rank:
            raise ValueError(f"bad config on rank {ctx.rank}")


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
