"""Reference engine throughput as requests are batched: output tok/s at batch 1, 8 and 32 and
prefill tok/s, on a pinned benchmark model and the embedded tiny models, measured in one run.

    python bench/engine.py [--quick] [--json] [--threads 2] [--prompt-tokens 1024] [--new-tokens 128]
                           [--batches 1,8,32] [--models bench,tiny,tiny-v3]

The benchmark model (``BENCH_MODEL``, written once under the cache dir): deepseek_v3, vocab
512, hidden 256, intermediate 512, moe_intermediate 128, 4 layers (the first dense), 4 heads,
q_lora 96, kv_lora 512, rope 64, nope 32, v 32, 8 routed experts top-2, 1 shared expert,
n_group 1, random weights (std 0.05), fp32. At batch 32 × 1k tokens one decode step reads
~300 MB of cache, so the step is memory- and attention-bound, not launch-bound.

For each model and batch B: B distinct prompts of --prompt-tokens tokens go in together
(``Engine.generate``, greedy, no stop tokens, --new-tokens each). Prefill tok/s = B × prompt
tokens / the time to the last request's first token (the engine prefills the batch in chunks
of its chunk budget). Output tok/s = B × (new tokens − 1) / the decode phase's wall time (last
first token → last token). Each request's tokens are compared with the same prompt's tokens at
batch 1 (``tokens_match``): batching must not change a token (the run exits 1 if one does). The headline ratios are output
tok/s at batch 8 and 32 over batch 1, measured in the same run. ``--quick``: 256-token prompts,
32 new tokens, the benchmark model only.
"""

from __future__ import annotations

import time

from common import (BENCH_MODEL, BENCH_STD, BENCH_TYPE, base_parser, bench_model_dir, emit_json, parse_args, print_table,
                    save_plot)

import torch

def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length * 7919 + n)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_batch(engine, batch: list[list[int]], new_tokens: int) -> dict:
    from engine.model.sampler import SamplingParams

    t0 = time.perf_counter()
    seqs = engine.generate(batch, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=()))
    t_end = time.perf_counter()
    first = max(s.token_times[0] for s in seqs)
    last = max(s.token_times[-1] for s in seqs)
    n_prompt = sum(len(p) for p in batch)
    decode_s = last - first
    return {"batch": len(batch), "prefill_s": first - t0, "prefill_tok_s": n_prompt / (first - t0),
            "decode_s": decode_s, "output_tok_s": len(batch) * (new_tokens - 1) / decode_s if decode_s else None,
            "step_ms": decode_s / (new_tokens - 1) * 1e3, "wall_s": t_end - t0,
            "tokens": [s.output_ids for s in seqs]}


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--models", default="bench,tiny,tiny-v3")
    args = parse_args(p, {"prompt_tokens": 256, "new_tokens": 32, "models": "bench"})
    batches = sorted({int(b) for b in args.batches.split(",")} | {1})
    torch.set_num_threads(args.threads)
    from engine.reference import ReferenceEngine

    t_start = time.perf_counter()
    results, rows = [], []
    for name in [m for m in args.models.split(",") if m]:
        model = bench_model_dir() if name == "bench" else name
        need = max(batches) * (args.prompt_tokens + args.new_tokens) + 64
        engine = ReferenceEngine(model, dtype="fp32", max_cache_tokens=need)
        every = prompts(max(batches), args.prompt_tokens, engine.cfg.vocab_size)
        run_batch(engine, every[:1], 4)  # warm-up
        alone = {}
        for b in batches:
            r = run_batch(engine, every[:b], args.new_tokens)
            if b == 1:
                alone[0] = r["tokens"][0]
            results.append(dict(r, model=name))
        for i in range(1, max(batches)):  # batch-1 tokens of every prompt, to compare with
            if any(b > i for b in batches):
                alone[i] = run_batch(engine, every[i:i + 1], args.new_tokens)["tokens"][0]
        base = next(r for r in results if r["model"] == name and r["batch"] == 1)
        for r in (x for x in results if x["model"] == name):
            r["tokens_match"] = all(t == alone[i] for i, t in enumerate(r["tokens"]))
            r["output_speedup_vs_batch1"] = r["output_tok_s"] / base["output_tok_s"]
            r["prefill_speedup_vs_batch1"] = r["prefill_tok_s"] / base["prefill_tok_s"]
            rows.append([name, r["batch"], r["prefill_tok_s"], r["prefill_speedup_vs_batch1"], r["step_ms"],
                         r["output_tok_s"], r["output_speedup_vs_batch1"], "yes" if r["tokens_match"] else "NO"])
        del engine
    print_table(f"reference engine, fp32, {args.threads} threads, {args.prompt_tokens}-token prompts, "
                f"{args.new_tokens} new tokens (greedy)",
                ["model", "batch", "prefill tok/s", "vs batch 1", "decode step ms", "output tok/s", "vs batch 1",
                 "tokens = batch 1"], rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for name in dict.fromkeys(r["model"] for r in results):
        rs = [r for r in results if r["model"] == name]
        ax[0].plot([r["batch"] for r in rs], [r["output_tok_s"] for r in rs], marker="o", label=name)
        ax[1].plot([r["batch"] for r in rs], [r["prefill_tok_s"] for r in rs], marker="o", label=name)
    for a, what in zip(ax, ("output tok/s (decode)", "prefill tok/s")):
        a.set_xscale("log", base=2)
        a.set_xlabel("batch (requests at once)")
        a.set_ylabel(what)
        a.legend(fontsize=8)
    ax[0].set_title("decode throughput vs batch")
    ax[1].set_title("prefill throughput vs batch")
    save_plot(fig, args.out, "engine.png")
    elapsed = time.perf_counter() - t_start
    print(f"runtime: {elapsed:.1f} s")
    headline = {m: {str(r["batch"]): r["output_speedup_vs_batch1"] for r in results if r["model"] == m}
                for m in dict.fromkeys(x["model"] for x in results)}
    emit_json(args.json, {
        "threads": args.threads, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens,
        "bench_model": dict(BENCH_MODEL, model_type=BENCH_TYPE, std=BENCH_STD),
        "results": [{k: v for k, v in r.items() if k != "tokens"} for r in results],
        "output_speedup_vs_batch1": headline,
        "tokens_match": all(r["tokens_match"] for r in results), "runtime_s": elapsed})
    if not all(r["tokens_match"] for r in results):
        raise SystemExit("batching changed a token (tokens_match: no)")


if __name__ == "__main__":
    main()
