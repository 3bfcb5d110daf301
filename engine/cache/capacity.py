"""Capacity planning for the decode cache under DCP, and the `cpserve plan` command.

Notation, per token: ``E = entry_bytes_per_layer * layers`` is the latent cache (one entry of
``kv_lora_rank + qk_rope_head_dim`` values per layer, shared by all heads) and
``I = index_bytes_per_layer * indexer_layers`` the sparse-attention index keys (only layers
that store index keys). C is the DCP group size.

The three questions:

- store, bytes per token on one rank: copied index ``E/C + I`` (every rank keeps every index
  key); split index ``(E + I)/C`` (each rank keeps the keys of its own tokens).
- cross: the collectives in ``CapacityPlan.collectives`` (formulas in ``plan_capacity``).
- cost: ``capacity_factor = (E + I) / bytes_per_token_per_rank`` more tokens fit than at C=1;
  with a copied index the factor can never exceed ``ceiling = (E + I) / I``.

Entry bytes come from the cache layout (engine/cache/kvformat.py, ``--kv-cache-dtype``): fp8
takes ``kv_lora_rank + qk_rope_head_dim`` bytes a latent entry (576 for the real models),
fp8_ds_mla 656 (512 e4m3 + 4 float32 scales + 64 bf16), and under either an index key takes
``index_head_dim + 4`` bytes (one float32 scale; 132).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Literal

from engine.cache.kvformat import KV_CACHE_DTYPES, KVFormat

Indexer = Literal["copied", "split"]
Exchange = Literal["a2a", "ag_rs"]
KV_DTYPES: tuple[str, ...] = tuple(k for k in KV_CACHE_DTYPES if k != "auto")
_BYTES_PER_VALUE = {"fp32": 4, "bf16": 2, "fp8": 1}
_LSE_BYTES = 4  # LSEs stay fp32 whatever the activation dtype
_CANDIDATE_BYTES = 8  # one split-index candidate: fp32 score + int32 position


def bytes_per_value(kv_dtype: str) -> int:
    """Bytes of one value: fp32 4, bf16 2, fp8 1 (activations; cache entries: KVFormat)."""
    if kv_dtype not in _BYTES_PER_VALUE:
        raise ValueError(f"kv_dtype must be one of {', '.join(_BYTES_PER_VALUE)}; got {kv_dtype!r}")
    return _BYTES_PER_VALUE[kv_dtype]


def latent_entry_bytes(kv_lora_rank: int, rope_dim: int, kv_dtype: str) -> int:
    """Bytes of one latent cache entry (one token, one layer) in layout ``kv_dtype``."""
    return KVFormat(kv_dtype, kv_lora_rank, rope_dim, 0).entry_bytes


def index_key_bytes(index_head_dim: int, kv_dtype: str) -> int:
    """Bytes of one index key (one token, one indexer layer); fp8 layouts add a 4-byte scale."""
    return KVFormat(kv_dtype, 0, 0, index_head_dim).index_bytes


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_bytes(value: int | str, field: str = "bytes") -> int:
    """``20GiB``, ``512MB``, ``1.5GiB``, ``1048576`` → bytes (binary units: KiB, MiB, GiB, TiB;
    decimal: KB, MB, GB, TB)."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        text = str(value).strip().replace("_", "")
        num = text.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ").strip()
        unit = text[len(num):].strip().lower()
        try:
            if unit not in _UNITS:
                raise ValueError
            n = int(float(num) * _UNITS[unit])
        except ValueError:
            raise ValueError(f"{field}: {value!r} is not a byte count (use e.g. 20GiB, 512MiB, 1000000)") from None
    if n < 0:
        raise ValueError(f"{field}: must be >= 0, got {value!r}")
    return n


def decode_row_bytes(cfg, fmt: KVFormat, dcp: int, indexer: str) -> int:
    """Cache bytes one decode rank spends per row it owns: its latent entry on every layer, plus
    index keys — C of them with a copied index (every rank keeps every token's), one when split."""
    latent = cfg.num_layers * fmt.entry_bytes
    index = len(cfg.indexer_layer_ids) * fmt.index_bytes
    return latent + index * (dcp if indexer == "copied" else 1)


def pages_in_budget(cfg, budget: int, fmt: KVFormat, page_size: int, dcp: int, indexer: str) -> int:
    """Virtual pages whose rows fit in ``budget`` bytes of cache on each decode rank."""
    row = decode_row_bytes(cfg, fmt, dcp, indexer)
    pages = _whole_pages(budget, row, page_size)
    if pages < 1:
        raise ValueError(f"kv_cache_memory: {budget} bytes per rank hold no page of {page_size} rows "
                         f"({row} bytes a row); give at least {row * page_size}")
    return pages


def _whole_pages(budget: int, row_bytes: int, page_size: int) -> int:
    """Pages of ``page_size`` rows of ``row_bytes`` each that fit in ``budget`` bytes."""
    return max(0, budget) // (row_bytes * page_size)


@dataclass(frozen=True)
class Collective:
    """One collective of a decode step, per decoded token and per layer it runs on.

    ``bytes_in`` is what one rank puts in: its contribution for an all-gather, its whole input
    buffer for all-to-all, reduce-scatter and all-reduce. ``bytes_sent`` is what one rank sends
    with ring / pairwise algorithms: all-gather ``(C-1) * bytes_in``; all-to-all and
    reduce-scatter ``(C-1)/C * bytes_in``; all-reduce ``2 (C-1)/C * bytes_in``.
    """

    name: str
    op: Literal["all_gather", "all_to_all", "reduce_scatter", "all_reduce"]
    layers: Literal["all", "indexer", "dense", "moe"]
    num_layers: int
    bytes_in: float
    bytes_sent: float


@dataclass(frozen=True)
class CapacityPlan:
    """Cache bytes and communication per DCP rank; derived values are properties."""

    dcp: int
    indexer: str
    entry_bytes: int  # E, all layers, per token
    index_bytes: int  # I, all indexer layers, per token
    bytes_per_token_per_rank: float
    capacity_factor: float
    ceiling: float | None
    tokens: int | None
    collectives: tuple[Collective, ...]

    @property
    def bytes_per_token_per_rank_rounded(self) -> int:
        """``bytes_per_token_per_rank`` rounded half up (for display)."""
        return math.floor(self.bytes_per_token_per_rank + 0.5)

    @property
    def bytes_per_rank(self) -> int | None:
        """Cache bytes on the busiest rank for ``tokens`` tokens (token p on rank p mod C):
        copied ``ceil(N/C) E + N I``; split ``ceil(N/C) (E + I)``."""
        if self.tokens is None:
            return None
        rows = -(-self.tokens // self.dcp)
        if self.indexer == "copied":
            return rows * self.entry_bytes + self.tokens * self.index_bytes
        return rows * (self.entry_bytes + self.index_bytes)

    @property
    def bytes_sent_per_token_per_step(self) -> float:
        """Bytes one rank sends per decoded token per step, over all layers."""
        return sum(c.bytes_sent * c.num_layers for c in self.collectives)

    def to_dict(self) -> dict:
        """JSON-ready view; ``ceiling`` is None where there is none."""
        out = asdict(self)
        out["collectives"] = [asdict(c) for c in self.collectives]
        out["bytes_per_token_per_rank_rounded"] = self.bytes_per_token_per_rank_rounded
        out["bytes_per_rank"] = self.bytes_per_rank
        out["bytes_sent_per_token_per_step"] = self.bytes_sent_per_token_per_step
        return out


def plan_capacity(
    entry_bytes_per_layer: int,
    layers: int,
    index_bytes_per_layer: int,
    indexer_layers: int,
    dcp: int,
    indexer: Indexer,
    tokens: int | None,
    num_heads: int | None = None,
    kv_lora_rank: int | None = None,
    rope_dim: int | None = None,
    act_bytes: int = 4,
    *,
    hidden_size: int | None = None,
    index_topk: int | None = None,
    exchange: Exchange = "a2a",
    replicate_q_proj: bool = False,
    moe_layers: int = 0,
    moe_rows: int = 1,
) -> CapacityPlan:
    """Plan one decode DCP group. Memory formulas are in the module docstring.

    Collectives per decode step, per decoded token (none at C = 1). H = ``num_heads``,
    r = ``kv_lora_rank``, d = ``rope_dim``, a = ``act_bytes``, h = ``hidden_size``; a
    collective is listed only when the sizes it needs are given.

    - query all-gather, every layer: each rank contributes its H/C heads of absorbed queries,
      ``(H/C)(r + d) a``; none with ``replicate_q_proj`` (each rank computes all heads).
    - output exchange, every layer. ``a2a``: one all-to-all of every head's partial latent
      output and LSE, ``H (r a + 4)``. ``ag_rs``: all-gather of the LSEs, ``4 H``, then a
      reduce-scatter of the rescaled partial outputs, ``H r a``.
    - split-index candidates, indexer layers, split index only: all-gather of each rank's local
      top-k of (fp32 score, int32 position), ``topk * 8``. A copied index sends nothing.
    - tensor-parallel all-reduce of the hidden state after o_proj, ``h a``, and after the MLP:
      dense layers (TP over the same group) ``h a``; the ``moe_layers`` MoE layers
      ``moe_rows h a``, where ``moe_rows`` is k + 1 with expert parallelism (each token's k
      routed outputs, of which each rank computed its own, plus the shared experts' TP
      partial: an exact combine in the reference's order), 1 with replicated experts and a
      shared expert, 0 with replicated experts and none.
    """
    _check_plan_inputs(entry_bytes_per_layer, layers, index_bytes_per_layer, indexer_layers,
                       dcp, indexer, tokens)
    if exchange not in ("a2a", "ag_rs"):
        raise ValueError(f"exchange must be 'a2a' or 'ag_rs', got {exchange!r}")
    if not 0 <= moe_layers <= layers:
        raise ValueError(f"moe_layers must be in 0..layers ({layers}), got {moe_layers}")
    total_e = entry_bytes_per_layer * layers
    total_i = index_bytes_per_layer * indexer_layers
    if indexer == "copied":
        per_rank = total_e / dcp + total_i
        ceiling = (total_e + total_i) / total_i if total_i else None
    else:
        per_rank = (total_e + total_i) / dcp
        ceiling = None
    collectives = _collectives(
        dcp, layers, indexer_layers, indexer, num_heads, kv_lora_rank, rope_dim, act_bytes,
        hidden_size, index_topk, exchange, replicate_q_proj, moe_layers, moe_rows,
    )
    return CapacityPlan(
        dcp=dcp, indexer=indexer, entry_bytes=total_e, index_bytes=total_i,
        bytes_per_token_per_rank=per_rank, capacity_factor=(total_e + total_i) / per_rank,
        ceiling=ceiling, tokens=tokens, collectives=collectives,
    )


def _check_plan_inputs(
    entry_bytes_per_layer: int, layers: int, index_bytes_per_layer: int, indexer_layers: int,
    dcp: int, indexer: str, tokens: int | None,
) -> None:
    if dcp < 1:
        raise ValueError(f"dcp must be >= 1, got {dcp}")
    if indexer not in ("copied", "split"):
        raise ValueError(f"indexer must be 'copied' or 'split', got {indexer!r}")
    for name, value in (("entry_bytes_per_layer", entry_bytes_per_layer), ("layers", layers),
                        ("index_bytes_per_layer", index_bytes_per_layer),
                        ("indexer_layers", indexer_layers)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if entry_bytes_per_layer * layers == 0:
        raise ValueError("entry_bytes_per_layer and layers must be > 0 (the cache is empty)")
    if indexer_layers > layers:
        raise ValueError(f"indexer_layers ({indexer_layers}) exceeds layers ({layers})")
    if tokens is not None and tokens < 0:
        raise ValueError(f"tokens must be >= 0, got {tokens}")


def _collectives(
    C: int, layers: int, indexer_layers: int, indexer: str, num_heads: int | None,
    kv_lora_rank: int | None, rope_dim: int | None, a: int, hidden_size: int | None,
    index_topk: int | None, exchange: str, replicate_q_proj: bool, moe_layers: int = 0, moe_rows: int = 1,
) -> tuple[Collective, ...]:
    if C == 1:
        return ()
    out: list[Collective] = []
    if num_heads is not None and kv_lora_rank is not None and rope_dim is not None:
        H, r = num_heads, kv_lora_rank
        if not replicate_q_proj:
            query_bytes = H / C * (r + rope_dim) * a
            out.append(_make("query heads", "all_gather", "all", layers, query_bytes, C))
        if exchange == "a2a":
            exchanged = H * (r * a + _LSE_BYTES)
            out.append(_make("output+LSE", "all_to_all", "all", layers, exchanged, C))
        else:
            out.append(_make("LSE", "all_gather", "all", layers, H * _LSE_BYTES, C))
            out.append(_make("partial output", "reduce_scatter", "all", layers, H * r * a, C))
    if indexer == "split" and indexer_layers and index_topk is not None:
        out.append(_make("index candidates", "all_gather", "indexer", indexer_layers,
                         index_topk * _CANDIDATE_BYTES, C))
    if hidden_size is not None:
        out.append(_make("o_proj hidden", "all_reduce", "all", layers, hidden_size * a, C))
        if not moe_layers:
            out.append(_make("MLP hidden", "all_reduce", "all", layers, hidden_size * a, C))
        else:
            if layers > moe_layers:
                out.append(_make("MLP hidden", "all_reduce", "dense", layers - moe_layers, hidden_size * a, C))
            if moe_rows:
                out.append(_make("MoE rows", "all_reduce", "moe", moe_layers, moe_rows * hidden_size * a, C))
    return tuple(out)


_SENT_PER_BYTE_IN = {
    "all_gather": lambda C: C - 1,
    "all_to_all": lambda C: (C - 1) / C,
    "reduce_scatter": lambda C: (C - 1) / C,
    "all_reduce": lambda C: 2 * (C - 1) / C,
}


def _make(name: str, op: str, layers: str, num_layers: int, bytes_in: float, C: int) -> Collective:
    return Collective(name, op, layers, num_layers, float(bytes_in),
                      float(bytes_in * _SENT_PER_BYTE_IN[op](C)))


# --- `cpserve plan` ---------------------------------------------------------------------------

_RAW_FLAGS = ("entry_bytes", "layers", "index_bytes", "indexer_layers")
_SHAPE_FLAGS = ("num_heads", "kv_lora_rank", "rope_dim", "hidden_size", "index_topk")


def build_parser_plan(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand; its handler is ``args.func`` (``run_plan``)."""
    parser = subparsers.add_parser(
        "plan", help="decode cache bytes and communication per DCP rank",
        description="Either --model DIR|tiny, or the raw sizes --entry-bytes --layers "
        "[--index-bytes --indexer-layers] (bytes per token per layer).",
    )
    parser.add_argument("--model", help="checkpoint directory, or 'tiny'")
    parser.add_argument("--entry-bytes", type=_non_negative_int, help="latent bytes per layer")
    parser.add_argument("--layers", type=_non_negative_int, help="layers with a latent cache")
    parser.add_argument("--index-bytes", type=_non_negative_int, help="index key bytes per layer")
    parser.add_argument("--indexer-layers", type=_non_negative_int, help="layers with index keys")
    for flag in _SHAPE_FLAGS:
        parser.add_argument("--" + flag.replace("_", "-"), type=_non_negative_int,
                            help="raw mode only: model size for the collectives")
    parser.add_argument("--kv-cache-dtype", "--kv-dtype", dest="kv_dtype", choices=KV_CACHE_DTYPES,
                        help="with --model: the cache layout (default auto: the compute dtype, --dtype); fp8 and "
                        "fp8_ds_mla as in docs/architecture.md")
    parser.add_argument("--dtype", choices=("auto", "bf16", "fp16", "fp32"), default="auto",
                        help="with --model: the weights' compute dtype (default auto: the checkpoint's)")
    parser.add_argument("--act-dtype", choices=("fp32", "bf16"), default="fp32",
                        help="activation dtype of the collectives (default fp32)")
    parser.add_argument("--dcp", required=True, type=_positive_int, help="DCP group size C")
    parser.add_argument("--indexer", choices=("copied", "split"), default="copied",
                        help="sparse-attention index on decode (default copied, as the decode service)")
    parser.add_argument("--exchange", choices=("a2a", "ag_rs"), default="a2a")
    parser.add_argument("--replicate-q-proj", action="store_true")
    parser.add_argument("--moe-parallel", choices=("ep", "replicate"), default="ep",
                        help="with --model: routed experts split across the DCP ranks (ep, the default) "
                        "or a full copy on each (replicate)")
    parser.add_argument("--memory-per-rank", type=_byte_count, metavar="BYTES",
                        help="with --model: memory of one decode rank (e.g. 20GiB); prints the tokens of "
                        "cache that fit beside the weights (runtime overhead not included)")
    parser.add_argument("--page-size", type=_positive_int, default=16,
                        help="cache rows per page, as the decode service (default 16)")
    parser.add_argument("--tokens", type=_non_negative_int, help="cached tokens to size for")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_plan, plan_parser=parser)
    return parser


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan described by ``args``; returns the exit status (0)."""
    if args.model is None and args.memory_per_rank is not None:
        _fail(args, "--memory-per-rank needs --model (the weights come from its config.json)")
    sizes = _model_sizes(args) if args.model is not None else _raw_sizes(args)
    plan = plan_capacity(
        **sizes, dcp=args.dcp, indexer=args.indexer, tokens=args.tokens,
        act_bytes=bytes_per_value(args.act_dtype), exchange=args.exchange,
        replicate_q_proj=args.replicate_q_proj,
    )
    weights = _weights(args) if args.model is not None else None
    fit = (tokens_in_budget(plan, args.memory_per_rank - weights["per_rank_max"], args.page_size)
           if weights is not None and args.memory_per_rank is not None else None)
    if args.json:
        out = plan.to_dict()
        if weights is not None:
            out["weight_bytes_per_rank"] = weights["per_rank_max"]
            out["weights"] = weights
        if fit is not None:
            out["memory_per_rank"] = args.memory_per_rank
            out["cache_bytes_per_rank"] = max(0, args.memory_per_rank - weights["per_rank_max"])
            out["tokens_that_fit"] = fit
        print(json.dumps(out))
    else:
        _print_plan(plan, weights, args.memory_per_rank, fit)
    return 0


def tokens_in_budget(plan: CapacityPlan, budget: int, page_size: int) -> int:
    """Cached tokens a DCP group holds when each rank has ``budget`` bytes of cache, paged as the
    decode service pages it (``pages_in_budget``): a rank's row costs E plus I once (split
    index) or C times (copied: every rank keeps every token's keys); the group holds C rows per
    token slot."""
    row = plan.entry_bytes + plan.index_bytes * (plan.dcp if plan.indexer == "copied" else 1)
    return _whole_pages(budget, row, page_size) * page_size * plan.dcp


def _weights(args: argparse.Namespace) -> dict:
    """What each decode rank of the layout holds of the model (in the compute dtype), by kind.
    Reads config.json only: a plan needs no weights on disk."""
    from engine.model.config import ModelConfig
    from engine.model.loader import resolve_dtype, weight_breakdown
    from engine.parallel.shard import WeightShard

    cfg = ModelConfig.load(args.model)
    dtype = resolve_dtype(args.dtype, cfg)
    if cfg.num_heads % args.dcp:
        _fail(args, f"--dcp {args.dcp} must divide the model's {cfg.num_heads} attention heads")
    whole = weight_breakdown(cfg, dtype)
    ranks = [weight_breakdown(cfg, dtype, WeightShard(r, args.dcp, tp=True, moe_parallel=args.moe_parallel,
                                                          replicate_q_proj=args.replicate_q_proj))
             for r in range(args.dcp)]
    experts = whole["routed_experts"]
    return {"dtype": dtype, "moe_parallel": args.moe_parallel, "whole_model": whole, "per_rank": ranks,
            "per_rank_max": max(r["total"] for r in ranks),
            "expert_copies": sum(r["routed_experts"] for r in ranks) / experts if experts else None}


def _raw_sizes(args: argparse.Namespace) -> dict:
    if args.kv_dtype is not None:
        _fail(args, "--kv-cache-dtype (--kv-dtype) applies only with --model (--entry-bytes is already in bytes)")
    missing = [f for f in ("entry_bytes", "layers") if getattr(args, f) is None]
    if missing:
        _fail(args, "give --model DIR|tiny, or the raw sizes; missing "
              + ", ".join(_flag(f) for f in missing))
    if (args.index_bytes is None) != (args.indexer_layers is None):
        _fail(args, "--index-bytes and --indexer-layers go together (omit both for no index)")
    return dict(
        entry_bytes_per_layer=args.entry_bytes, layers=args.layers,
        index_bytes_per_layer=args.index_bytes or 0, indexer_layers=args.indexer_layers or 0,
        num_heads=args.num_heads, kv_lora_rank=args.kv_lora_rank, rope_dim=args.rope_dim,
        hidden_size=args.hidden_size, index_topk=args.index_topk,
    )


def _model_sizes(args: argparse.Namespace) -> dict:
    given = [_flag(f) for f in _RAW_FLAGS + _SHAPE_FLAGS if getattr(args, f) is not None]
    if given:
        _fail(args, f"--model and {', '.join(given)} contradict: sizes come from the model")
    from engine.model.config import ModelConfig

    try:
        cfg = ModelConfig.load(args.model)
    except (OSError, ValueError) as error:
        _fail(args, f"--model {args.model}: {error}")
    from engine.model.loader import resolve_dtype

    fmt = KVFormat.of(cfg, args.kv_dtype or "auto", resolve_dtype(args.dtype, cfg))
    has_index = cfg.num_indexer_layers > 0
    moe_layers = sum(cfg.is_moe_layer(layer) for layer in range(cfg.num_layers))
    shared = 1 if cfg.n_shared_experts else 0
    moe_rows = cfg.num_experts_per_tok + shared if args.moe_parallel == "ep" else shared
    return dict(
        entry_bytes_per_layer=fmt.entry_bytes, layers=cfg.num_layers,
        index_bytes_per_layer=fmt.index_bytes if has_index else 0,
        indexer_layers=cfg.num_indexer_layers, num_heads=cfg.num_heads,
        kv_lora_rank=cfg.kv_lora_rank, rope_dim=cfg.qk_rope_head_dim,
        hidden_size=cfg.hidden_size, index_topk=cfg.index_topk if has_index else None,
        moe_layers=moe_layers, moe_rows=moe_rows,
    )


def _print_plan(plan: CapacityPlan, weights: dict | None = None, memory: int | None = None,
                fit: int | None = None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"decode cache per rank, DCP={plan.dcp}, {plan.indexer} index")
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("latent E (bytes/token, all layers)", f"{plan.entry_bytes:,}")
    table.add_row("index I (bytes/token, indexer layers)", f"{plan.index_bytes:,}")
    table.add_row("bytes/token on one rank", f"{plan.bytes_per_token_per_rank_rounded:,}")
    table.add_row("capacity factor vs DCP=1", f"{plan.capacity_factor:.2f}")
    table.add_row("ceiling (C → ∞)", "none" if plan.ceiling is None else f"{plan.ceiling:.1f}")
    if plan.tokens is not None:
        table.add_row(f"busiest rank, {plan.tokens:,} tokens", _human(plan.bytes_per_rank))
    console = Console()
    console.print(table)
    if weights is not None:
        _print_weights(console, plan, weights, memory, fit)
    if not plan.collectives:
        return
    comm = Table(title="collectives per decode step: bytes per rank, layer and decoded token")
    for column in ("collective", "op", "layers", "bytes in", "bytes sent"):
        comm.add_column(column, justify="left" if column in ("collective", "op") else "right")
    for c in plan.collectives:
        layers = f"{c.layers} ({c.num_layers})"
        comm.add_row(c.name, c.op, layers, f"{c.bytes_in:,.0f}", f"{c.bytes_sent:,.0f}")
    comm.caption = f"sent per rank per token per step: {_human(plan.bytes_sent_per_token_per_step)}"
    console.print(comm)


def _print_weights(console, plan: CapacityPlan, weights: dict, memory: int | None, fit: int | None) -> None:
    from rich.table import Table

    ranks = weights["per_rank"]
    table = Table(title=f"weights per rank (decode, DCP={plan.dcp}), moe_parallel {weights['moe_parallel']}, "
                  f"{weights['dtype']}")
    table.add_column("")
    for column in ("routed experts", "embeddings + lm_head", "other", "total"):
        table.add_column(column, justify="right")
    kinds = ("routed_experts", "embeddings", "other", "total")
    table.add_row("whole model", *(_human(weights["whole_model"][k]) for k in kinds))
    for r, rank in enumerate(ranks):
        table.add_row(f"rank {r}", *(_human(rank[k]) for k in kinds))
    table.caption = "other: attention, norms, router, shared experts, dense MLPs"
    if weights["expert_copies"] is not None:
        table.caption += f"; the group holds {weights['expert_copies']:.2f} copies of the routed experts"
    console.print(table)
    if plan.tokens is not None:
        console.print(f"weights + cache, busiest rank, {plan.tokens:,} tokens: "
                      f"{_human(weights['per_rank_max'] + plan.bytes_per_rank)}")
    if memory is not None:
        free = memory - weights["per_rank_max"]
        if free <= 0:
            console.print(f"[bold red]{_human(memory)} per rank does not hold the weights "
                          f"({_human(weights['per_rank_max'])} on the busiest rank): no cache fits[/]")
        else:
            console.print(f"{_human(memory)} per rank: {_human(free)} of cache beside the weights → "
                          f"[bold]{fit:,} tokens[/] fit (decode --kv-cache-memory {free})")


def _human(num_bytes: float) -> str:
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} GiB"


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _fail(args: argparse.Namespace, message: str) -> None:
    parser = getattr(args, "plan_parser", None)
    if parser is None:
        raise SystemExit(f"cpserve plan: error: {message}")
    parser.error(message)


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _byte_count(text: str) -> int:
    try:
        return parse_bytes(text, "--memory-per-rank")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error))


def _positive_int(text: str) -> int:
    value = _non_negative_int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
