"""Prefill context-parallel (CP) token layouts: which rank owns which new token.

This module is the one place that decides how a prefill batch is split over the C ranks of a
CP group. Everything here is a pure function of (new-token lengths, cached-prefix lengths, C,
strategy); the runner and the benchmarks call it and never redo the arithmetic.

Indexing. Tokens are named by their *flattened index* over the batch's new tokens: request 0's
new tokens first, then request 1's, and so on. New token ``j`` of request ``r`` sits at
position ``cached_lengths[r] + j``; positions never change, whichever rank owns the token.

Strategies:

- ``interleave``: flattened index ``i`` goes to rank ``i mod C``; the count does not restart
  per request.
- ``zigzag``: each request's new tokens are cut into 2C contiguous blocks (the first
  ``n mod 2C`` blocks hold one extra token); rank ``r`` gets blocks ``r`` and ``2C-1-r``, which
  pairs a cheap early block with an expensive late one.
- ``contiguous``: each request's new tokens are cut into C consecutive pieces (same remainder
  rule). Unbalanced; kept only as the benchmark baseline.
- ``striped``: the token at *position* ``p`` goes to rank ``p mod C``, per request, cached prefix
  and later chunks included — the ring's interleave (engine/parallel/ring.py), under which the
  rank that computes a token is the rank that stores it, and the one DCP wants it on. Each
  request's new tokens split within one token per rank; over a batch the ranks that get a
  request's extra token depend on where its prefix ends, so the spread is at most one token
  per request (in practice less: the starts differ).

The three questions, for a CP attention layer:

- store: every rank keeps the whole cache of the batch (cached prefix plus all new tokens);
  it computes queries, cache entries and index keys only for the tokens it owns.
- cross: each rank's new cache entries (and index keys) are all-gathered; every rank pads its
  buffer to ``max_tokens_per_rank`` and ``BatchLayout.gather_order`` restores batch order.
- cost: a rank computes ``RankLayout.pairs`` causal query-key pairs; the spread of ``pairs``
  over ranks is the load imbalance the strategy leaves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

Strategy = Literal["interleave", "zigzag", "contiguous", "striped"]
STRATEGIES: tuple[str, ...] = ("interleave", "zigzag", "contiguous", "striped")


@dataclass(frozen=True)
class QueryBlock:
    """A maximal run of consecutive owned tokens of one request.

    ``token_start``/``token_end`` are flattened indices, half open. ``kv_end`` is the number of
    keys the block's last query reads, cached prefix included (its position + 1); query
    ``token_start + k`` reads ``kv_end - (token_end - token_start) + k + 1`` keys.
    """

    request: int
    token_start: int
    token_end: int
    kv_end: int

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start


@dataclass(frozen=True)
class RankLayout:
    """What one CP rank owns.

    Invariants: ``token_indices`` is strictly increasing; ``positions`` and ``request_ids`` are
    aligned with it; ``blocks`` cover exactly ``token_indices``, in the same order.
    """

    rank: int
    token_indices: tuple[int, ...]
    positions: tuple[int, ...]
    request_ids: tuple[int, ...]
    blocks: tuple[QueryBlock, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.token_indices)

    @property
    def pairs(self) -> int:
        """Causal query-key pairs this rank computes: sum over owned tokens of position + 1."""
        return sum(p + 1 for p in self.positions)


@dataclass(frozen=True)
class BatchLayout:
    """The split of one prefill batch over a CP group; ``ranks[r].rank == r``."""

    cp: int
    strategy: str
    new_lengths: tuple[int, ...]
    cached_lengths: tuple[int, ...]
    ranks: tuple[RankLayout, ...]

    @property
    def num_tokens(self) -> int:
        """New tokens in the batch (the length of the flattened index space)."""
        return sum(self.new_lengths)

    @property
    def max_tokens_per_rank(self) -> int:
        """Padded per-rank buffer length for all-gathers (every rank pads to this)."""
        return max(r.num_tokens for r in self.ranks)

    def gather_order(self) -> list[int]:
        """Permutation that puts an all-gathered buffer back in batch order.

        Contract: rank ``r`` writes its owned tokens, in ``token_indices`` order, to the first
        ``ranks[r].num_tokens`` rows of a buffer of ``max_tokens_per_rank`` rows (the rest is
        padding); the all-gather concatenates the C buffers in rank order. Then
        ``perm = gather_order()`` has ``num_tokens`` entries and ``gathered[perm]`` holds
        flattened token ``i`` in row ``i``. Padding rows are never selected.
        """
        width = self.max_tokens_per_rank
        perm = [0] * self.num_tokens
        for layout in self.ranks:
            base = layout.rank * width
            for k, token in enumerate(layout.token_indices):
                perm[token] = base + k
        return perm


def piece_sizes(total: int, pieces: int) -> list[int]:
    """Sizes of ``pieces`` contiguous pieces of ``total`` items; the first ``total mod pieces``
    pieces hold one extra item. The sizes sum to ``total`` and differ by at most one."""
    base, extra = divmod(total, pieces)
    return [base + 1 if k < extra else base for k in range(pieces)]


def split_batch(
    new_lengths: Sequence[int], cached_lengths: Sequence[int], cp: int, strategy: str
) -> BatchLayout:
    """Split a batch's new tokens over ``cp`` ranks with ``strategy``.

    Every new token is owned by exactly one rank. Raises ``ValueError`` naming the argument on
    bad input.
    """
    new, cached = _validate(new_lengths, cached_lengths, cp, strategy)
    owned: list[list[int]] = [[] for _ in range(cp)]
    for token, owner in enumerate(_owners(new, cached, cp, strategy)):
        owned[owner].append(token)
    request_of, position_of = _token_coordinates(new, cached)
    ranks = tuple(_rank_layout(r, tuple(owned[r]), request_of, position_of) for r in range(cp))
    return BatchLayout(cp, strategy, new, cached, ranks)


def _validate(
    new_lengths: Sequence[int], cached_lengths: Sequence[int], cp: int, strategy: str
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    _check_cp(cp)
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
    new, cached = tuple(new_lengths), tuple(cached_lengths)
    if len(new) != len(cached):
        raise ValueError(
            f"cached_lengths has {len(cached)} entries but new_lengths has {len(new)}; "
            "give one cached length per request"
        )
    for name, values in (("new_lengths", new), ("cached_lengths", cached)):
        bad = [v for v in values if not _is_int(v) or v < 0]
        if bad:
            raise ValueError(f"{name} must be integers >= 0, got {bad[0]!r}")
    return tuple(int(v) for v in new), tuple(int(v) for v in cached)


def _check_cp(cp: int) -> None:
    if not _is_int(cp) or cp < 1:
        raise ValueError(f"cp must be an integer >= 1, got {cp!r}")


def _check_num_layers(num_layers: int) -> None:
    if not _is_int(num_layers) or num_layers < 0:
        raise ValueError(f"num_layers must be an integer >= 0, got {num_layers!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _owners(new: tuple[int, ...], cached: tuple[int, ...], cp: int, strategy: str) -> list[int]:
    """Owner rank of every flattened new token."""
    if strategy == "interleave":
        return [i % cp for i in range(sum(new))]
    if strategy == "striped":
        return [p % cp for n, c in zip(new, cached) for p in range(c, c + n)]
    owners: list[int] = []
    for n in new:
        owners.extend(_request_owners(n, cp, strategy))
    return owners


def _request_owners(n: int, cp: int, strategy: str) -> list[int]:
    """Owner rank of each new token of one request, for the per-request strategies."""
    if strategy == "contiguous":
        block_rank = list(range(cp))
    else:  # zigzag: block b of 2C goes to min(b, 2C-1-b)
        block_rank = [min(b, 2 * cp - 1 - b) for b in range(2 * cp)]
    owners: list[int] = []
    for rank, size in zip(block_rank, piece_sizes(n, len(block_rank))):
        owners.extend([rank] * size)
    return owners


def _token_coordinates(
    new: tuple[int, ...], cached: tuple[int, ...]
) -> tuple[list[int], list[int]]:
    """Request id and position of every flattened new token."""
    request_of: list[int] = []
    position_of: list[int] = []
    for request, (n, c) in enumerate(zip(new, cached)):
        request_of.extend([request] * n)
        position_of.extend(range(c, c + n))
    return request_of, position_of


def _rank_layout(
    rank: int, tokens: tuple[int, ...], request_of: list[int], position_of: list[int]
) -> RankLayout:
    return RankLayout(
        rank=rank,
        token_indices=tokens,
        positions=tuple(position_of[i] for i in tokens),
        request_ids=tuple(request_of[i] for i in tokens),
        blocks=_blocks(tokens, request_of, position_of),
    )


def _blocks(
    tokens: tuple[int, ...], request_of: list[int], position_of: list[int]
) -> tuple[QueryBlock, ...]:
    """Group sorted owned tokens into maximal runs that stay inside one request."""
    blocks: list[QueryBlock] = []
    start = 0
    for k in range(1, len(tokens) + 1):
        ends_run = (
            k == len(tokens)
            or tokens[k] != tokens[k - 1] + 1
            or request_of[tokens[k]] != request_of[tokens[k - 1]]
        )
        if ends_run:
            last = tokens[k - 1]
            request, kv_end = request_of[last], position_of[last] + 1
            blocks.append(QueryBlock(request, tokens[start], last + 1, kv_end))
            start = k
    return tuple(blocks)


def layer_owner_ranges(num_layers: int, cp: int) -> list[range]:
    """Contiguous layer ranges per rank for the layer-split prefill cache.

    The ranges partition ``range(num_layers)`` in rank order; the first ``num_layers mod cp``
    ranks own one extra layer. With fewer layers than ranks, the last ranks own none.
    """
    _check_cp(cp)
    _check_num_layers(num_layers)
    return contiguous_ranges(num_layers, cp)


def contiguous_ranges(total: int, parts: int) -> list[range]:
    """``range(total)`` cut into ``parts`` contiguous pieces in order, the first ``total mod
    parts`` one longer (``torch.tensor_split``'s rule): layers, experts and TP slices alike."""
    ranges: list[range] = []
    start = 0
    for size in piece_sizes(total, parts):
        ranges.append(range(start, start + size))
        start += size
    return ranges


def expert_owner_ranges(num_experts: int, world: int) -> list[range]:
    """Which routed experts each rank of an expert-parallel group holds: rank r owns
    ``expert_owner_ranges(E, C)[r]``, contiguous, the first ``E mod C`` ranks one extra (with
    fewer experts than ranks the last ranks hold none). Prefill CP and decode DCP groups use the
    same placement; the KV layout does not depend on it."""
    _check_cp(world)
    if not _is_int(num_experts) or num_experts < 0:
        raise ValueError(f"num_experts must be a non-negative integer, got {num_experts!r}")
    return contiguous_ranges(num_experts, world)


def layer_owner(layer: int, num_layers: int, cp: int) -> int:
    """The rank whose range in ``layer_owner_ranges(num_layers, cp)`` contains ``layer``."""
    _check_cp(cp)
    _check_num_layers(num_layers)
    if not _is_int(layer) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in [0, {num_layers}), got {layer!r}")
    base, extra = divmod(num_layers, cp)
    boundary = extra * (base + 1)
    if layer < boundary:
        return layer // (base + 1)
    return extra + (layer - boundary) // base


CP_ATTENTION: tuple[str, ...] = ("allgather", "ring")
RING_MODES: tuple[str, ...] = ("auto", "pass_kv", "pass_q")


def check_cp_attention(cp_attention: str, strategy: str, layer_split: bool) -> str:
    """The CP attention mechanism (engine/parallel/prefill_cp.py, engine/parallel/ring.py),
    checked against the layout it is asked to run with."""
    if cp_attention not in CP_ATTENTION:
        raise ValueError(f"cp_attention: {cp_attention!r} is not one of {', '.join(CP_ATTENTION)}")
    if cp_attention == "ring" and layer_split:
        raise ValueError("layer_split: the ring already keeps 1/C of every layer per rank; "
                         "layer split is for --cp-attention allgather")
    return cp_attention


def check_ring_mode(mode: str) -> str:
    if mode not in RING_MODES:
        raise ValueError(f"cp_ring_mode: {mode!r} is not one of {', '.join(RING_MODES)}")
    return mode
