"""The prefill CP engine: the scheduler in the driver process, the model on C rank processes.

The driver holds no weights: it loads the config, owns the page allocator (every rank keeps
the same rows, so one numbering serves all) and sends each step plan to the group.
"""

from __future__ import annotations

from engine.cache.slots import pages_needed
from engine.model.config import ModelConfig
from engine.model.tiny import resolve_model_dir
from engine.model.tokenizer import load_tokenizer
from engine.parallel.group import WorkerGroup
from engine.parallel.prefill_cp import CPRunner
from engine.scheduler import Engine, Scheduler

STRATEGIES = ("interleave", "zigzag")


class CPPrefillEngine(Engine):
    def __init__(self, model: str = "tiny", cp: int = 2, strategy: str = "interleave", layer_split: bool = False,
                 dtype: str = "fp32", chunk_size: int = 4096, page_size: int = 16, max_cache_tokens: int = 1 << 16,
                 threads_per_rank: int = 1, record_logits: bool = False, trace: bool = False, prefix_cache: bool = False):
        if cp < 1:
            raise ValueError(f"cp: must be >= 1, got {cp}")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: {strategy!r} is not one of {', '.join(STRATEGIES)}")
        if layer_split and strategy != "interleave":
            raise ValueError("layer_split: supported with --strategy interleave only")
        self.model_dir = resolve_model_dir(model)
        self.cfg = ModelConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self.cp, self.strategy, self.layer_split = cp, strategy, layer_split
        num_pages = pages_needed(max_cache_tokens, page_size, 1)
        self.group = WorkerGroup(cp, "engine.parallel.prefill_cp:PrefillRank",
                                 (str(self.model_dir), dtype, strategy, layer_split, num_pages * page_size),
                                 threads_per_rank=threads_per_rank, name="prefill")
        self.group.ready()
        super().__init__(Scheduler(self.cfg, num_pages, page_size, chunk_size, 1, record_logits, prefix_cache),
                         CPRunner(self.group, trace))

    def close(self) -> None:
        self.group.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
