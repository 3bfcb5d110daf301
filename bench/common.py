"""Shared helpers for benchmarks: a rich table, a matplotlib plot, the `--json` last line, and a
process's memory figures."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OUT_DIR = ROOT / "bench" / "out"

# The serving benchmark model (bench/engine.py, bench/serving.py --model bench): deepseek_v3,
# random weights, written once under the cache dir.
BENCH_TYPE = "deepseek_v3"
BENCH_MODEL = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=4,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=8, num_experts_per_tok=2,
    n_shared_experts=1, n_group=1, topk_group=1,
)
BENCH_STD = 0.05


def bench_model_dir():
    """The pinned benchmark checkpoint, written once (deterministic) under the cache dir."""
    import hashlib
    import json

    from engine.model.tiny import cache_dir, make_tiny

    key = hashlib.sha256(json.dumps([BENCH_TYPE, BENCH_MODEL, BENCH_STD], sort_keys=True).encode()).hexdigest()[:12]
    path = cache_dir() / f"bench-engine-{key}"
    if not (path / "config.json").exists():
        make_tiny(path, BENCH_TYPE, seed=0, std=BENCH_STD, **BENCH_MODEL)
    return str(path)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; finishes in under a minute")
    p.add_argument("--json", action="store_true", help="print one JSON object with the figures as the last line")
    p.add_argument("--out", default=str(OUT_DIR), help="where plots go (default bench/out)")
    return p


def parse_args(p: argparse.ArgumentParser, quick: dict, argv: list[str] | None = None) -> argparse.Namespace:
    """``p.parse_args(argv)`` (None: the command line); with ``--quick``, ``quick``'s values
    replace the defaults, so an option given on the command line still wins over its quick value."""
    if p.parse_known_args(argv)[0].quick:
        p.set_defaults(**quick)
    return p.parse_args(argv)


def print_table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for c in columns:
        table.add_column(c, justify="right")
    for r in rows:
        table.add_row(*[f"{v:,.3f}" if isinstance(v, float) else str(v) for v in r])
    Console(width=160).print(table)


def save_plot(fig, out_dir: str, name: str) -> Path:
    os.makedirs(out_dir, exist_ok=True)
    path = Path(out_dir) / name
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
    return path


def emit_json(enabled: bool, figures: dict) -> None:
    if enabled:
        print(json.dumps(figures))


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """The memory fields of /proc/<pid>/status (``VmHWM``, ``VmRSS``, ``RssAnon``, ``RssFile``,
    ...), in bytes."""
    out = {}
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            key, _, rest = line.partition(":")
            if key.startswith(("Vm", "Rss")):
                out[key] = int(rest.split()[0]) * 1024
    return out


if __name__ == "__main__":  # `python bench/common.py`: the benchmark model's directory (for `cpserve up --model`)
    print(bench_model_dir())


def parse_shapes(p: argparse.ArgumentParser, text: str) -> list[tuple[int, int]]:
    """``--clusters``: shapes ``P+D`` (prefill CP + decode DCP), comma-separated."""
    try:
        shapes = [tuple(int(x) for x in sh.split("+")) for sh in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        p.error(f"--clusters: expected shapes like 2+2,1+1 (prefill CP + decode DCP), got {text!r}")
    return shapes


BYTE_VOCAB = 259  # ids 0-258: what every byte-level tokenizer has (cpserve's: 3 + b for byte b)


def vocab_size(args: argparse.Namespace) -> int:
    """Random token ids are below this: ``--vocab-size``, else the byte vocabulary for other servers, else the
    checkpoint's."""
    if args.vocab_size:
        return args.vocab_size
    if args.base_url:
        return BYTE_VOCAB
    from engine.model.config import ModelConfig

    return ModelConfig.load(args.model).vocab_size
