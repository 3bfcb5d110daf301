"""The one-process reference engine: no parallelism, the ground truth for every layout.

Batched prefill of mixed-length requests, chunked prefill (``chunk_size`` new tokens per
forward), continuous-batching decode (requests join and leave every step), greedy and seeded
sampling, stop tokens and ``max_new_tokens`` — the scheduler of engine/scheduler.py driving a
:class:`LocalRunner` that holds every cache row.
"""

from __future__ import annotations

import torch

from engine.cache.kvformat import KVFormat
from engine.cache.pool import KVPool
from engine.cache.slots import pages_needed
from engine.model.config import ModelConfig
from engine.model.loader import load_model, parse_dtype, resolve_dtype
from engine.model.tiny import resolve_model_dir
from engine.runner import LocalRunner
from engine.scheduler import Engine, Scheduler


class ReferenceEngine(Engine):
    def __init__(self, model: str = "tiny", dtype: str = "auto", chunk_size: int = 4096, page_size: int = 16,
                 max_cache_tokens: int = 1 << 17, record_logits: bool = False, trace: bool = False, prefix_cache: bool = False,
                 device: str = "cpu", kv_cache_dtype: str = "auto"):
        self.device = parse_device(device)
        self.model_dir = resolve_model_dir(model)
        dtype = self.dtype = resolve_dtype(dtype, ModelConfig.from_dir(self.model_dir))
        self.lm = load_model(self.model_dir, dtype, self.device)
        self.cfg = self.lm.cfg
        self.kv_format = KVFormat.for_checkpoint(self.model_dir, self.cfg, kv_cache_dtype, dtype)
        num_pages = pages_needed(max_cache_tokens, page_size, 1)
        self.pool = KVPool(self.cfg, num_pages * page_size, parse_dtype(dtype), device=self.device, fmt=self.kv_format)
        super().__init__(Scheduler(self.cfg, num_pages, page_size, chunk_size, 1, record_logits, prefix_cache),
                         LocalRunner(self.lm, self.pool, trace, self.device))


def parse_device(device: str | torch.device) -> torch.device:
    """'cpu', 'cuda' or 'cuda:N', checked against what this machine has."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device: {device!r} is not a torch device ('cpu', 'cuda', 'cuda:N')") from e
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {device!r} asked for, but torch sees no CUDA device (torch {torch.__version__})")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r} asked for, but there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"device: {device!r} is not supported (cpu or cuda)")
    return dev
