"""Transfer plan: which prefill rank writes which cache bytes into which decode rows.

This module is the one place that owns the index math of the prefill -> decode hand-off. It is
pure: a plan is a function of the prefill layout, the decode group and the reserved rows, and
every prefill rank computes the same plan and executes its own part (`writes_by_rank`).

Addressing (the facts the plan relies on):

- Prefill. Token ``p`` of the request sits at row ``src_slots[p]`` of a prefill rank's pool
  ``[layer, row, latent_dim]`` (the prefill scheduler's slot; page size 1 on prefill). Without
  layer split every prefill rank holds every layer of every row; with layer split rank ``r``
  holds only ``layer_owner_ranges(L, Cp)[r]``. A *sharded* prefill (the ring,
  engine/parallel/ring.py) numbers slots as DCP does: token ``p`` lives on prefill rank
  ``src_slots[p] % Cp`` only, at row ``src_slots[p] // Cp``, every layer of it.
- Decode. Token ``p`` has group slot ``s = dst_slots[p]``; its latent entries live on decode rank
  ``s % Cd`` at row ``s // Cd`` (``engine/cache/slots.py``). Index keys (DSA indexer layers
  only): with a ``copied`` index every decode rank keeps every token's key at index row ``s``
  (the group slot); with a ``split`` index only rank ``s % Cd`` keeps it, at row ``s // Cd``.

Who sends what. Layer ``l`` is sent by ``layer_owner(l, L, Cp)``, with or without layer split:
with layer split that rank is the only one that holds it; with full copies every rank holds it,
and spreading the layers the same way makes all ``Cp`` ranks send at once, each about ``1/Cp``
of the bytes. With full copies and fewer layers than ranks (``L < Cp``, only tiny test models),
each layer is given a group of ranks instead (``piece_sizes(Cp, L)`` ranks, in order) which
split the layer's tokens into contiguous pieces, so every rank still sends.

Sharded, each rank sends its own rows, all layers: every row leaves its rank once, and when
both groups stripe by position with ``Cp == Cd`` it goes from rank ``r`` to rank ``r``.

Tokens ``[0, decode_prefix)`` are already on decode (prefix hit) and are never sent.

A `Write` is one contiguous run: consecutive sent tokens bound for one decode rank whose
destination rows are consecutive, for a contiguous range of layers. Its source rows need not be
contiguous; the sender packs them into a staging buffer, layer after layer (``len(layers) *
num_rows`` rows), and writes one range per layer, because the destination pool is layer-major.
Index writes cover maximal ranges of consecutive *indexer* layers (model layer numbers; the
decode side maps a layer to its index pool with ``KVPool.index``).

Types. Slot inputs may be any sequence of ints or a 1-D integer tensor; everything in a
`Write` is a plain Python int (``src_rows`` a tuple), so plans are cheap to pickle and compare.
Writes that share a token run share one ``src_rows`` tuple object.

Store / cross / cost: the plan stores nothing on a rank; what crosses is, per sent token, the
latent entry of every layer once and its index key once per destination that keeps it (``Cd``
times for a copied index, once for a split one) — see `plan_bytes`; computing it costs a few
vectorised passes over the ``N`` slots plus one Python tuple per run.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.parallel.layout import layer_owner_ranges, piece_sizes

__all__ = ["Write", "plan_transfer", "writes_by_rank", "plan_bytes", "KINDS", "DECODE_INDEX_MODES"]

KINDS = ("latent", "index")
DECODE_INDEX_MODES = ("copied", "split")


@dataclass(frozen=True)
class Write:
    """Rows ``src_rows`` of layers ``layers`` on prefill rank ``src_rank`` go to rows
    ``[dst_row_start, dst_row_start + num_rows)`` of the same layers on decode rank
    ``dst_rank``; ``kind`` says which pool (``"latent"`` or ``"index"``).

    Invariants: ``len(src_rows) == num_rows >= 1``; ``layers`` is a non-empty contiguous range
    (for ``"index"``, every layer in it is an indexer layer); ``src_rows`` are in token order.
    """

    src_rank: int
    dst_rank: int
    layers: range
    src_rows: tuple[int, ...]
    dst_row_start: int
    num_rows: int
    kind: str

    @property
    def dst_rows(self) -> range:
        return range(self.dst_row_start, self.dst_row_start + self.num_rows)


def plan_transfer(
    *,
    num_tokens: int,
    prefill_cp: int,
    layer_split: bool,
    num_layers: int,
    indexer_layers: Sequence[int],
    src_slots: Sequence[int] | torch.Tensor,
    decode_dcp: int,
    dst_slots: Sequence[int] | torch.Tensor,
    decode_index: str,
    decode_prefix: int = 0,
    sharded: bool = False,
) -> list[Write]:
    """The writes that move tokens ``[decode_prefix, num_tokens)`` of one request.

    Every (token, layer) latent entry is written exactly once, to its reserved row; every index
    key once per decode rank that keeps it. Order: by sending rank, then latent before index,
    then layer range, destination rank and token order. Raises ``ValueError`` naming the
    argument on bad input (slot counts, duplicate destination slots, layers out of range).
    """
    _check_positive("prefill_cp", prefill_cp)
    _check_positive("decode_dcp", decode_dcp)
    _check_count("num_tokens", num_tokens)
    _check_count("num_layers", num_layers)
    if not 0 <= decode_prefix <= num_tokens:
        raise ValueError(
            f"decode_prefix must be in [0, num_tokens={num_tokens}], got {decode_prefix}")
    if decode_index not in DECODE_INDEX_MODES:
        raise ValueError(f"decode_index must be one of {DECODE_INDEX_MODES}, got {decode_index!r}")
    if sharded and layer_split:
        raise ValueError("layer_split: a sharded (ring) prefill keeps every layer of its own rows")
    indexer = _indexer_set(indexer_layers, num_layers)
    src = _slots("src_slots", src_slots, num_tokens)
    dst = _slots("dst_slots", dst_slots, num_tokens)
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError("dst_slots must be distinct: two tokens cannot share a decode slot")

    src, dst = src[decode_prefix:], dst[decode_prefix:]
    writes: list[Write] = []
    for rank, layers, piece, pieces in _senders(num_layers, prefill_cp, layer_split, sharded):
        if sharded:  # the rank's own tokens, at their rows on it
            held = src % prefill_cp == rank
            piece_src, piece_dst = src[held] // prefill_cp, dst[held]
        else:
            start = sum(piece_sizes(dst.numel(), pieces)[:piece])
            stop = start + piece_sizes(dst.numel(), pieces)[piece]
            piece_src, piece_dst = src[start:stop], dst[start:stop]
        if piece_dst.numel() == 0:
            continue
        latent_runs = _runs(piece_src, piece_dst % decode_dcp, piece_dst // decode_dcp)
        writes += _writes(rank, [layers], latent_runs, "latent")
        index_layers = _consecutive_ranges([l for l in layers if l in indexer])
        if not index_layers:
            continue
        if decode_index == "split":
            index_runs = latent_runs
        else:
            every_rank = _runs(piece_src, torch.zeros_like(piece_dst), piece_dst)
            index_runs = [(d, row, src_rows)
                          for d in range(decode_dcp) for _, row, src_rows in every_rank]
        writes += _writes(rank, index_layers, index_runs, "index")
    return writes


def writes_by_rank(writes: Sequence[Write]) -> dict[int, list[Write]]:
    """The writes each prefill rank executes, keyed by ``src_rank`` (ranks with none are
    absent); each list keeps the plan's order."""
    grouped: dict[int, list[Write]] = defaultdict(list)
    for w in writes:
        grouped[w.src_rank].append(w)
    return dict(grouped)


def plan_bytes(writes: Sequence[Write], latent_bytes_per_row_per_layer: int,
               index_bytes_per_row: int) -> int:
    """Bytes the writes move: rows x layers x the row width of their kind
    (``index_bytes_per_row`` is per indexer layer)."""
    width = {"latent": latent_bytes_per_row_per_layer, "index": index_bytes_per_row}
    return sum(w.num_rows * len(w.layers) * width[w.kind] for w in writes)


# ---- helpers -----------------------------------------------------------------------------------

_Run = tuple[int, int, tuple[int, ...]]  # (dst_rank, dst_row_start, src_rows)


def _senders(num_layers: int, cp: int, layer_split: bool, sharded: bool = False) -> list[tuple[int, range, int, int]]:
    """(rank, layers, piece, pieces): ``rank`` sends token piece ``piece`` of ``pieces`` of
    ``layers``. Pieces are contiguous splits of the sent tokens (``piece_sizes``); sharded,
    every rank sends every layer of the tokens it holds (piece and pieces unused)."""
    if sharded:
        return [(r, range(num_layers), 0, 1) for r in range(cp)] if num_layers else []
    if layer_split or num_layers >= cp:
        return [(r, layers, 0, 1) for r, layers in enumerate(layer_owner_ranges(num_layers, cp))
                if len(layers)]
    senders = []
    rank = 0
    for layer, group in enumerate(piece_sizes(cp, num_layers)):
        senders += [(rank + k, range(layer, layer + 1), k, group) for k in range(group)]
        rank += group
    return senders


def _runs(src: torch.Tensor, ranks: torch.Tensor, rows: torch.Tensor) -> list[_Run]:
    """Split tokens (in order) into runs per destination rank whose rows are consecutive."""
    runs: list[_Run] = []
    for d in torch.unique(ranks).tolist():
        mine = ranks == d
        d_rows, d_src = rows[mine], src[mine]
        breaks = torch.nonzero(d_rows[1:] != d_rows[:-1] + 1).flatten() + 1
        bounds = [0, *breaks.tolist(), d_rows.numel()]
        starts, src_list = d_rows.tolist(), d_src.tolist()
        runs += [(d, starts[a], tuple(src_list[a:b])) for a, b in zip(bounds, bounds[1:])]
    return runs


def _writes(rank: int, layer_ranges: list[range], runs: list[_Run], kind: str) -> list[Write]:
    return [Write(rank, d, layers, src_rows, start, len(src_rows), kind)
            for layers in layer_ranges for d, start, src_rows in runs]


def _consecutive_ranges(layers: list[int]) -> list[range]:
    """Maximal ranges of consecutive integers in an increasing list."""
    ranges: list[range] = []
    for l in layers:
        if ranges and ranges[-1].stop == l:
            ranges[-1] = range(ranges[-1].start, l + 1)
        else:
            ranges.append(range(l, l + 1))
    return ranges


def _indexer_set(indexer_layers: Sequence[int], num_layers: int) -> set[int]:
    layers = [int(l) for l in indexer_layers]
    if len(set(layers)) != len(layers) or any(not 0 <= l < num_layers for l in layers):
        raise ValueError(
            f"indexer_layers must be distinct layers in [0, num_layers={num_layers}), got {layers}")
    return set(layers)


def _slots(name: str, slots: Sequence[int] | torch.Tensor, num_tokens: int) -> torch.Tensor:
    tensor = torch.as_tensor(slots, dtype=torch.long).reshape(-1)
    if tensor.numel() != num_tokens:
        raise ValueError(
            f"{name} must hold one slot per token ({num_tokens}), got {tensor.numel()}")
    if tensor.numel() and int(tensor.min()) < 0:
        raise ValueError(f"{name} must be >= 0, got {int(tensor.min())}")
    return tensor


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _check_count(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
