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


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; finishes in under a minute")
    p.add_argument("--json", action="store_true", help="print one JSON object with the figures as the last line")
    p.add_argument("--out", default=str(OUT_DIR), help="where plots go (default bench/out)")
    return p


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
