"""What keeping KV for reuse costs requests that reuse nothing, per side, before and after the
cache pools have been written once (docs/benchmarks.md, "Reuse on vs off ...").

    .venv/bin/python scripts/reuse_cost.py [--variants off,both,prefill,decode] [--pool-tokens 12288]
        [--requests 20] [--prompt-len 1024] [--max-tokens 8]

Starts one default-shaped cluster (`cpserve up`: prefill CP 2, decode DCP 2, the benchmark
model) per variant — reuse off on both services, on both, on prefill only, on decode only
(through each service's YAML section) — with small pools, so that they are written through
quickly. Sends distinct random 1k-token prompts, the variants taking turns request by request
(the order rotating), and prints the median time to the first streamed token of each variant
and its ratio to the first variant's: first on the fresh clusters ("fresh", --requests each),
then, after as many more requests as fill every pool once (max_tokens 1, not timed), again
("written").
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from common import bench_model_dir  # noqa: E402

VARIANTS = {"off": (False, False), "both": (True, True), "prefill": (True, False), "decode": (False, True)}


def ttft_s(address: str, model: str, prompt: list[int], max_tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    start = time.perf_counter()
    with httpx.stream("POST", f"http://{address}/v1/completions", json=body, timeout=300, trust_env=False) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{address}: HTTP {r.status_code}: {r.read()[:200]!r}")
        first = None
        for line in r.iter_lines():
            if first is None and line.startswith("data:"):
                first = time.perf_counter() - start
    return first


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="off,both,prefill,decode")
    p.add_argument("--pool-tokens", type=int, default=12288, help="max_cache_tokens of every service")
    p.add_argument("--requests", type=int, default=20, help="timed requests per variant and phase")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown or not names:
        p.error(f"--variants: {unknown or 'none'}; choose from {', '.join(VARIANTS)}")

    from services.up import cluster_args, start_cluster, stop_cluster

    model = str(bench_model_dir())
    rng = random.Random(args.seed)
    clusters = {}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for name in names:
                pre, dec = VARIANTS[name]
                config = Path(tmp) / f"{name}.yaml"
                config.write_text(f"prefill:\n  max_cache_tokens: {args.pool_tokens}\n  prefix_cache: {str(pre).lower()}\n"
                                  f"decode:\n  max_cache_tokens: {args.pool_tokens}\n  prefix_cache: {str(dec).lower()}\n")
                clusters[name] = start_cluster(cluster_args(["--model", model, "--config", str(config)]), 0, None,
                                               quiet=True)
            fill = args.pool_tokens // args.prompt_len + 4
            for phase, count, max_tokens in (("fresh", args.requests, args.max_tokens), ("(writing pools)", fill, 1),
                                             ("written", args.requests, args.max_tokens)):
                times: dict[str, list[float]] = {n: [] for n in names}
                for i in range(count):
                    for name in names[i % len(names):] + names[:i % len(names)]:
                        prompt = [rng.randrange(3, 250) for _ in range(args.prompt_len)]
                        times[name].append(ttft_s(clusters[name][-1].address, model, prompt, max_tokens))
                if phase.startswith("("):
                    continue
                med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
                print(f"{phase:8s} TTFT p50 ms: " + ", ".join(f"{n} {med[n]:.1f} ({med[n] / med[names[0]]:.3f})"
                                                               for n in names), flush=True)
        finally:
            for children in clusters.values():
                stop_cluster(children)


if __name__ == "__main__":
    main()
