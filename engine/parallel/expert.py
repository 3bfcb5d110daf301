"""Expert parallelism (EP): a group's routed experts are partitioned across its ranks.

Rank r holds experts ``expert_owner_ranges(E, C)[r]`` (engine/parallel/layout.py) and loads
only those (engine/parallel/shard.py). The router gate, shared experts, dense MLPs and norms
are replicated (DCP keeps its tensor-parallel slices of them). The MoE layer hands its routed
tokens to one of the dispatchers below through ``ForwardBatch.moe``; each returns the layer's
complete output for the rank's tokens.

- :class:`AllToAllExperts` (prefill CP: every rank holds different tokens). Each rank sorts
  its (token, slot) pairs by expert id — which groups them by owner rank, since owners hold
  contiguous ranges — all-gathers its per-expert counts (E integers), sends each pair's hidden
  row to the owner (one uneven all-to-all), the owner runs its experts as grouped matmuls, and
  a second all-to-all with the splits reversed brings the outputs home. The combine runs where
  the token lives, in slot order, as the reference does.
- :class:`ReducedExperts` (decode DCP: every rank holds the same tokens). Each rank runs its
  experts for every pair routed to them and writes the outputs into a [T, k(+1), H] buffer of
  zeros (the extra slot: its tensor-parallel partial of the shared experts); one all-reduce
  sums the buffer. A routed slot has exactly one nonzero contributor, so its sum is that
  contributor's value bit for bit; the combine then runs on every rank in slot order.
- :class:`ReplicatedDecodeExperts` (DCP with ``moe_parallel: replicate``): every rank holds
  every expert and computes the routed output itself; only the shared experts' partial is
  all-reduced.

Cost per MoE layer (T own tokens, k experts a token, H hidden): AllToAll moves at most
2·T·k·H values out of a rank (the pairs whose expert lives elsewhere, (C−1)/C of them when
routing is uniform) plus C·E counts; Reduced all-reduces T·(k+1)·H values — more bytes than
one T·H all-reduce of partial sums, bought for an exact combine in the reference's order.
"""

from __future__ import annotations

import torch

from engine.model.experts import LOCAL_EXPERTS, combine, grouped_experts, pair_rows
from engine.parallel.layout import expert_owner_ranges

MOE_PARALLEL = ("ep", "replicate")


def check_moe_parallel(value: str) -> str:
    if value not in MOE_PARALLEL:
        raise ValueError(f"moe_parallel: {value!r} is not one of {', '.join(MOE_PARALLEL)}")
    return value


class AllToAllExperts:
    """Prefill CP dispatch/combine over all-to-all (see the module docstring).
    ``comm``: the group's engine.parallel.comm.Comm."""

    def __init__(self, comm, rank: int, world: int, num_experts: int):
        self.comm, self.rank, self.world = comm, rank, world
        ranges = expert_owner_ranges(num_experts, world)
        self.bounds = [(r.start, r.stop) for r in ranges]
        self.owner = torch.tensor([r for r, rg in enumerate(ranges) for _ in rg], dtype=torch.long)
        self.num_experts = num_experts
        self.bytes_sent = 0

    def __call__(self, moe, x, idx, weights):
        t, k = idx.shape
        h = x.shape[1]
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, hence by owner rank
        counts = torch.bincount(flat, minlength=self.num_experts)
        every = torch.empty(self.world * self.num_experts, dtype=torch.long)
        self.comm.all_gather_single(every, counts)
        every = every.view(self.world, self.num_experts)
        lo, hi = self.bounds[self.rank]
        send = [int(counts[a:b].sum()) for a, b in self.bounds]
        recv = every[:, lo:hi].sum(dim=1).tolist()
        rows = x.index_select(0, order // k)
        got = x.new_empty(sum(recv), h)
        self.comm.all_to_all(got, rows, recv, send)
        ids = torch.repeat_interleave(torch.arange(lo, hi).repeat(self.world), every[:, lo:hi].reshape(-1))
        out = grouped_experts(moe.experts, got, ids)
        back = x.new_empty(t * k, h)
        self.comm.all_to_all(back, out, send, recv)
        self.bytes_sent += (rows.numel() - send[self.rank] * h + out.numel() - recv[self.rank] * h) * x.element_size()
        y = torch.empty_like(back)
        y[order] = back
        result = combine(y.view(t, k, h), weights)
        if moe.shared_experts is not None:
            result = result + moe.shared_experts(x)
        return result


class ReducedExperts:
    """Decode DCP: own experts for every token, one all-reduce (see the module docstring).
    ``comm``: the group's engine.parallel.comm.Comm."""

    def __init__(self, comm, world: int):
        self.comm, self.world = comm, world
        self.bytes_sent = 0

    def __call__(self, moe, x, idx, weights):
        t, k = idx.shape
        held = moe.experts.held
        shared = moe.shared_experts is not None
        packed = x.new_zeros(t, k + shared, x.shape[1])
        flat = idx.reshape(-1)
        mine = ((flat >= held.start) & (flat < held.stop)).nonzero().squeeze(1)
        if mine.numel():  # pair p = (token p // k, slot p % k) sits at row token·(k+shared) + slot
            at = mine // k * (k + shared) + mine % k
            packed.view(-1, x.shape[1])[at] = grouped_experts(moe.experts, x, flat[mine], pair_rows(t, k)[mine])
        if shared:
            packed[:, k] = moe.shared_experts(x)  # this rank's tensor-parallel partial
        self.comm.all_reduce(packed)
        self.bytes_sent += packed.numel() * packed.element_size()
        out = combine(packed[:, :k], weights)
        return out + packed[:, k] if shared else out


class ReplicatedDecodeExperts:
    """Decode DCP with every expert on every rank: only the shared partial is reduced."""

    def __init__(self, comm, world: int):
        self.comm, self.world = comm, world
        self.bytes_sent = 0

    def __call__(self, moe, x, idx, weights):
        t, k = idx.shape
        out = combine(grouped_experts(moe.experts, x, idx.reshape(-1), pair_rows(t, k)).view(t, k, -1), weights)
        if moe.shared_experts is None:
            return out
        part = moe.shared_experts(x)
        self.comm.all_reduce(part)
        self.bytes_sent += part.numel() * part.element_size()
        return out + part


def prefill_dispatch(moe_parallel: str, comm, rank: int, world: int, num_experts: int):
    if world == 1 or moe_parallel == "replicate" or num_experts == 0:
        return LOCAL_EXPERTS
    return AllToAllExperts(comm, rank, world, num_experts)


def decode_dispatch(moe_parallel: str, comm, world: int):
    if world == 1:
        return LOCAL_EXPERTS
    return ReducedExperts(comm, world) if moe_parallel == "ep" else ReplicatedDecodeExperts(comm, world)
