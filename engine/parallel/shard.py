"""Which part of each weight a rank of a group holds — read from the files as exactly that part.

:class:`WeightShard` answers, per parameter, the slice of the full tensor this rank keeps;
the loader (engine/model/loader.py) reads only that slice from the safetensors files
(``get_slice``), so a rank never holds, even briefly, what belongs to another.

| weight                                   | prefill CP rank | decode DCP rank                     |
|------------------------------------------|-----------------|-------------------------------------|
| routed experts (``mlp.experts.*``)       | own experts (``ep``) or all (``replicate``) — same on both |
| q_b_proj / q_proj                        | whole           | output rows of its heads (unless ``replicate_q_proj``) |
| o_proj                                   | whole           | input columns of its heads (bias counted once: zero on rank ≠ 0) |
| dense MLP and shared experts gate / up   | whole           | output rows (``tensor_split`` of the intermediate dim) |
| dense MLP and shared experts down        | whole           | input columns (same split)          |
| embeddings, lm_head, norms, kv_a / kv_b, router gate, indexer | whole | whole                |

Expert placement is :func:`engine.parallel.layout.expert_owner_ranges`.
"""

from __future__ import annotations

import re

import torch

from engine.model.config import ModelConfig
from engine.parallel.expert import check_moe_parallel
from engine.parallel.layout import contiguous_ranges, expert_owner_ranges

_Q = re.compile(r"\.self_attn\.(q_b_proj|q_proj)\.weight$")
_O = re.compile(r"\.self_attn\.o_proj\.weight$")
_MLP_IN = re.compile(r"\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$")
_MLP_OUT = re.compile(r"\.mlp\.(shared_experts\.)?down_proj\.weight$")
_EXPERTS = re.compile(r"\.mlp\.experts\.(gate_proj|up_proj|down_proj)$")

Part = tuple[slice, ...]


def _whole(shape) -> Part:
    return tuple(slice(0, d) for d in shape)


def _span(r: range) -> slice:
    return slice(r.start, r.stop)


class WeightShard:
    """The weights of rank ``rank`` of a ``world``-rank group.

    ``tp``: the decode layout, whose heads and MLPs are tensor-parallel slices (see the module
    table); without it (prefill CP) only the routed experts are split. ``moe_parallel``:
    ``ep`` partitions the routed experts by :func:`expert_owner_ranges`, ``replicate`` keeps all.
    """

    def __init__(self, rank: int, world: int, *, tp: bool, moe_parallel: str = "ep",
                 replicate_q_proj: bool = False):
        self.rank, self.world, self.tp = rank, world, tp
        self.moe_parallel = check_moe_parallel(moe_parallel)
        self.replicate_q_proj = replicate_q_proj

    def check(self, cfg: ModelConfig) -> None:
        if self.tp and cfg.num_heads % self.world:
            raise ValueError(f"dcp: {self.world} ranks must divide the model's {cfg.num_heads} attention heads")

    def experts(self, cfg: ModelConfig) -> range:
        """Global ids of the routed experts this rank holds."""
        if self.moe_parallel == "replicate" or self.world == 1:
            return range(cfg.n_routed_experts)
        return expert_owner_ranges(cfg.n_routed_experts, self.world)[self.rank]

    def _heads(self, cfg: ModelConfig, width: int) -> slice:
        per_head = width // cfg.num_heads
        per = cfg.num_heads // self.world
        return slice(self.rank * per * per_head, (self.rank + 1) * per * per_head)

    def part(self, cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> Part | None:
        """The slice of parameter ``name`` (full shape ``shape``) held here; None = all of it."""
        if _EXPERTS.search(name):
            held = self.experts(cfg)
            return None if len(held) == shape[0] else (_span(held),) + _whole(shape[1:])
        if not self.tp or self.world == 1:
            return None
        if _Q.search(name):
            return None if self.replicate_q_proj else (self._heads(cfg, shape[0]), slice(0, shape[1]))
        if _O.search(name):
            return slice(0, shape[0]), self._heads(cfg, shape[1])
        if _MLP_IN.search(name):
            return _span(contiguous_ranges(shape[0], self.world)[self.rank]), slice(0, shape[1])
        if _MLP_OUT.search(name):
            return slice(0, shape[0]), _span(contiguous_ranges(shape[1], self.world)[self.rank])
        return None

    def finish(self, lm) -> None:
        """After loading: what the modules need to know about their slices."""
        from engine.model.model import MoE

        cfg = lm.cfg
        per = cfg.num_heads // self.world
        for layer in lm.model.layers:
            attn = layer.self_attn
            if self.tp:
                attn.head_slice = slice(self.rank * per, (self.rank + 1) * per)
                if attn.o_proj.bias is not None and self.rank != 0:
                    with torch.no_grad():
                        attn.o_proj.bias.zero_()  # the all-reduce adds the bias once
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts.first = self.experts(cfg).start



def weights_held(lm, shard: WeightShard) -> dict:
    """What a rank holds (for tests and benchmarks): bytes of its parameters and buffers, its
    routed experts and their bytes."""
    from engine.model.model import MoE

    total = sum(t.numel() * t.element_size() for t in lm.state_dict().values())
    moes = [layer.mlp.experts for layer in lm.model.layers if isinstance(layer.mlp, MoE)]
    expert_bytes = sum(p.numel() * p.element_size() for ex in moes for p in (ex.gate_proj, ex.up_proj, ex.down_proj))
    held = shard.experts(lm.cfg)
    return {"bytes": total, "expert_bytes": expert_bytes, "experts": [held.start, held.stop],
            "experts_per_layer": [ex.gate_proj.shape[0] for ex in moes]}
