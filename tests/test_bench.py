"""Every benchmark still runs: `--quick --json` exits 0, writes its plot, and its last line is
one JSON object with figures (a benchmark whose hooks point at renamed code fails here, not in
front of the next person who wants its numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# smaller than --quick where a benchmark allows it: this checks that it runs, not its figures
SMALLER = {"kv_transfer": ["--tokens", "1024,2048", "--repeats", "1"], "serving": ["--concurrency", "1,4"],
           "memory": ["--groups", "2"], "engine": ["--batches", "1,4", "--new-tokens", "8"],
           "prefill_cp": ["--lengths", "1024,2048", "--balance-tokens", "16384", "--ring-lengths", "1024",
                          "--sweep-tokens", "1024", "--sweep-fractions", "1/16,1"],
           "needle": ["--lengths", "512", "--depths", "0,1", "--layouts", "cp2-interleave/dcp2"]}
BENCHES = {  # benchmark → (plot it writes, a key its JSON must have)
    "reference": ("reference.png", "results"),
    "prefill_cp": ("prefill_cp.png", "ring_sweep"),
    "decode_dcp": ("decode_dcp.png", "runtime_s"),
    "kv_transfer": ("kv_transfer.png", "runtime_s"),
    "serving": ("serving.png", "token_ids_match"),
    "load": ("load.png", "pass"),
    "memory": ("memory.png", "within_10pct"),
    "engine": ("engine.png", "tokens_match"),
    "capacity": ("capacity.png", "min_ratio_to_formula"),
    "kv_quality": ("kv_quality.png", "results"),
    "needle": ("needle.png", "layouts_exact"),
}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_benchmark_quick_run(name, tmp_path):
    plot, key = BENCHES[name]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"), "--quick", "--json", "--out", str(tmp_path),
                           *SMALLER.get(name, [])],
                          cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert isinstance(figures, dict) and key in figures, sorted(figures)
    assert (tmp_path / plot).stat().st_size > 0
