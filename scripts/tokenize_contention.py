"""Is it the router or the cores? Four short streams' inter-token latency on `cpserve up`'s
default demo cluster (prefill CP 2, decode DCP 2), 15 s each: alone; beside a separate process
that renders and tokenizes a 32,768-token chat prompt in a loop (the router not involved); and
beside two clients sending that prompt through the router (bench/router_stall.py's heavy
clients, refused after tokenizing). Two repetitions. Where the second and third slow the
streams alike, the cost is the CPU time tokenizing takes from the rank processes, not the
router's event loop (docs/benchmarks.md, "Router under large prompts").

    .venv/bin/python scripts/tokenize_contention.py
"""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]


def burn(stop) -> None:
    """Render and tokenize the heavy prompt until ``stop`` is set (another process: no router)."""
    from engine.model.tokenizer import load_tokenizer
    from router_stall import heavy_messages

    tok = load_tokenizer("demo")
    messages = heavy_messages(tok, 32768)
    n = 0
    while not stop.is_set():
        tok.apply_chat_template(messages)
        n += 1
    print(f"    (the external process tokenized the prompt {n} times)", flush=True)


def main() -> None:
    from http_load import probe
    from router_stall import (build_heavy, figures_of, light_prompts, local_tokenizer, own_cluster, parse_args,
                              run_phase, warm_up)

    args = parse_args(["--phase-s", "15", "--rounds", "1"])
    with own_cluster("demo", "") as (target, _):
        probe(target, None)
        heavy = build_heavy(local_tokenizer("demo"), target, "refused")
        light = light_prompts(args)
        warm_up(target, heavy, light, args)
        for _ in range(2):
            for cond in ("alone", "external", "router"):
                stop, proc = mp.Event(), None
                if cond == "external":
                    proc = mp.Process(target=burn, args=(stop,))
                    proc.start()
                    time.sleep(3)  # its tokenizer loaded
                phase = asyncio.run(run_phase(target, light, heavy if cond == "router" else None, 2, args.phase_s,
                                              args.timeout, 0, cond))
                if proc is not None:
                    stop.set()
                    proc.join()
                f = figures_of([phase], heavy.expected)
                print(f"{cond:8s} ITL p50 {f['itl_ms_p50']:.1f} ms, p99 {f['itl_ms_p99']:.1f} ms; TPOT p50 "
                      f"{f['tpot_ms_p50']:.1f} ms; heavy requests {f['heavy_requests']}; loop-lag samples > 100 ms "
                      f"{f['loop_lag_over_100ms']}", flush=True)


if __name__ == "__main__":
    main()
