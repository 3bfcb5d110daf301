"""Long-context retrieval on the trained demo model: pass-key and key–value accuracy against
prompt length and needle depth, for the reference engine and for `cpserve up` layouts.

    python bench/needle.py [--quick] [--json] [--lengths 1024,2048,4096,8192,16384]
                           [--depths 0,0.25,0.5,0.75,1] [--samples 3] [--tasks passkey,kv]
                           [--layouts cp2-interleave/dcp2,...] [--layout-lengths ...] [--model demo]

Prompts (cpserve/demo_text.py, seeded per point): a haystack of generated stories with the
needle sentence at the given depth (a fraction of the haystack's tokens) and the question last,
as one user message through the model's chat template — the format the model was trained on.
Each point asks ``--samples`` prompts of each task (3 by default: with one, a point of the heat
map is 0 or 100 % and the accuracy up to the training length moves by 3 % per answer). An
answer is right when it holds the needle's number and no other (``demo_text.is_right``).

Every prompt goes through the one-process reference engine (greedy, 16 new tokens, stop at
EOS): its accuracy per (task, length, depth) is the heat map. Then each layout — a `cpserve up`
cluster (:func:`services.up.start_cluster`, prefill CP C with a strategy and optional layer
split, decode DCP D) — gets the same token ids over HTTP (``/v1/completions``, greedy,
``return_token_ids``), by default on the prompts up to ``--layout-lengths``; its answers must
equal the reference's token for token (the layouts are exact, so any difference is a defect and
the run exits 1). The demo model is dense MLA (no DSA indexer), so the index modes (copied /
split) do not apply to it. ``--quick``: 1k and 2k tokens, three depths, two layouts.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

from common import base_parser, emit_json, parse_args, print_table, save_plot

# name → `cpserve up` flags. Together: prefill CP 2 and 3, interleave and zigzag, layer split,
# decode DCP 2 and 4, both LSE exchanges.
LAYOUTS = {
    "cp2-interleave/dcp2": ["--prefill-cp", "2", "--cp-strategy", "interleave", "--decode-dcp", "2"],
    "cp2-zigzag/dcp4": ["--prefill-cp", "2", "--cp-strategy", "zigzag", "--decode-dcp", "4", "--dcp-comm", "ag_rs"],
    "cp3-interleave-layer-split/dcp2": ["--prefill-cp", "3", "--cp-strategy", "interleave", "--layer-split",
                                       "--decode-dcp", "2", "--dcp-comm", "ag_rs"],
    "cp3-zigzag/dcp4": ["--prefill-cp", "3", "--cp-strategy", "zigzag", "--decode-dcp", "4"],
}
MAX_NEW_TOKENS = 16


def make_prompts(tokenizer, tasks, lengths, depths, samples) -> list[dict]:
    """One dict per prompt: task, length (asked), depth, the Task and its chat-template ids."""
    from cpserve import demo_text

    def count(text: str) -> int:
        return len(tokenizer.hf.encode(text, add_special_tokens=False))

    make = {"passkey": demo_text.passkey_task, "kv": demo_text.kv_task}
    out = []
    for kind in tasks:
        for length in lengths:
            for depth in depths:
                for s in range(samples):
                    rng = random.Random(f"{kind}/{length}/{depth}/{s}")
                    task = make[kind](rng, length, depth, count)
                    ids = tokenizer.apply_chat_template([{"role": "user", "content": task.prompt}])
                    out.append({"task": kind, "length": length, "depth": depth, "sample": s, "t": task, "ids": ids})
    return out


def run_reference(model: str, prompts: list[dict], tokenizer) -> None:
    from cpserve.demo_text import is_right
    from engine.model.sampler import SamplingParams
    from engine.reference import ReferenceEngine

    need = max(len(p["ids"]) for p in prompts) + MAX_NEW_TOKENS + 64
    engine = ReferenceEngine(model, dtype="fp32", max_cache_tokens=need)
    for p in prompts:  # one at a time: the longest prompts fill the cache
        t0 = time.perf_counter()
        seq = engine.generate([p["ids"]], SamplingParams(max_new_tokens=MAX_NEW_TOKENS))[0]
        p["ref_ms"] = (time.perf_counter() - t0) * 1e3
        p["ref_ids"] = seq.output_ids
        p["answer"] = tokenizer.decode(seq.output_ids)
        p["right"] = is_right(p["t"], p["answer"])


def run_layout(model: str, flags: list[str], prompts: list[dict], concurrency: int) -> list[list[int]]:
    """The prompts' greedy answers from a `cpserve up` cluster with ``flags``."""
    from services.up import cluster_args, start_cluster, stop_cluster, stream_completion

    longest = max(len(p["ids"]) for p in prompts) + MAX_NEW_TOKENS
    args = cluster_args(["--model", model, "--dtype", "fp32", "--max-model-len", str(max(longest, 4096)), *flags])
    children = start_cluster(args, 0, None, quiet=True)
    try:
        address = children[-1].address

        def ask(p):
            body = {"model": model, "prompt": p["ids"], "max_tokens": MAX_NEW_TOKENS, "temperature": 0}
            return stream_completion(address, body)[0]

        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(ask, prompts))
    finally:
        stop_cluster(children)


def heatmaps(prompts: list[dict], tasks, lengths, depths, train_len: int | None, out_dir: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(tasks), figsize=(5.2 * len(tasks), 3.8), squeeze=False)
    for ax, kind in zip(axes[0], tasks):
        grid = np.full((len(depths), len(lengths)), np.nan)
        for i, d in enumerate(depths):
            for j, n in enumerate(lengths):
                ps = [p for p in prompts if p["task"] == kind and p["length"] == n and p["depth"] == d]
                grid[i, j] = sum(p["right"] for p in ps) / len(ps)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                ax.text(j, i, f"{grid[i, j]:.0%}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(lengths)), [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        if train_len:
            past = [j for j, n in enumerate(lengths) if n > train_len]
            if past:
                ax.axvline(past[0] - 0.5, color="black", lw=1.5)
        ax.set_xlabel("prompt tokens" + (f" (line: training length {train_len})" if train_len else ""))
        ax.set_ylabel("needle depth")
        ax.set_title({"passkey": "pass key", "kv": "key–value lookup"}[kind] + ": reference accuracy")
    fig.colorbar(im, ax=axes[0, -1])
    return save_plot(fig, out_dir, "needle.png")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", default="demo")
    p.add_argument("--lengths", default="1024,2048,4096,8192,16384", help="prompt lengths in tokens")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1", help="needle depths (fractions of the haystack)")
    p.add_argument("--samples", type=int, default=3, help="prompts per task, length and depth")
    p.add_argument("--tasks", default="passkey,kv")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="`cpserve up` layouts checked against the reference")
    p.add_argument("--layout-lengths", default=None,
                   help="prompt lengths the layouts run (default: every length)")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight per cluster")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the reference engine")
    args = parse_args(p, {"lengths": "1024,2048", "depths": "0,0.5,1", "samples": 1,
                          "layouts": "cp2-interleave/dcp2,cp3-zigzag/dcp4"})
    lengths = [int(x) for x in args.lengths.split(",")]
    depths = [float(x) for x in args.depths.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = [t for t in tasks if t not in ("passkey", "kv")] + [n for n in layouts if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown task or layout: {', '.join(unknown)} (layouts: {', '.join(LAYOUTS)})")
    layout_lengths = set(int(x) for x in args.layout_lengths.split(",")) if args.layout_lengths else set(lengths)

    import json

    import torch

    torch.set_num_threads(args.threads)
    from engine.model.tiny import resolve_model_dir
    from engine.model.tokenizer import load_tokenizer

    t_start = time.perf_counter()
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(args.model)
    rope = json.loads((model_dir / "config.json").read_text()).get("rope_parameters") or {}
    train_len = rope.get("original_max_position_embeddings")
    prompts = make_prompts(tokenizer, tasks, lengths, depths, args.samples)
    run_reference(args.model, prompts, tokenizer)
    ref_s = time.perf_counter() - t_start

    layout_results = {}
    for name in layouts:
        subset = [q for q in prompts if q["length"] in layout_lengths]
        t0 = time.perf_counter()
        answers = run_layout(args.model, LAYOUTS[name], subset, args.concurrency)
        same = [a == q["ref_ids"] for a, q in zip(answers, subset)]
        layout_results[name] = {"prompts": len(subset), "equal_to_reference": sum(same),
                                "exact": all(same), "seconds": round(time.perf_counter() - t0, 1),
                                "differs_at": [{"task": q["task"], "length": q["length"], "depth": q["depth"]}
                                               for q, ok in zip(subset, same) if not ok]}

    rows, table = [], []
    for kind in tasks:
        for n in lengths:
            ps = [q for q in prompts if q["task"] == kind and q["length"] == n]
            acc = sum(q["right"] for q in ps) / len(ps)
            tokens = sum(len(q["ids"]) for q in ps) / len(ps)
            by_depth = {f"{d:g}": sum(q["right"] for q in ps if q["depth"] == d) / sum(1 for q in ps if q["depth"] == d)
                        for d in depths}
            rows.append({"task": kind, "length": n, "mean_prompt_tokens": round(tokens), "accuracy": acc,
                         "accuracy_by_depth": by_depth, "past_training_length": bool(train_len and n > train_len)})
            table.append([kind, n, round(tokens), f"{acc:.0%}", " ".join(f"{v:.0%}" for v in by_depth.values()),
                          "yes" if train_len and n > train_len else ""])
    print_table(f"reference engine ({args.model}), greedy, {args.samples} prompt(s) per point; training length "
                f"{train_len}", ["task", "length", "prompt tokens", "accuracy",
                                  "by depth " + " ".join(f"{d:g}" for d in depths), "past training length"], table)
    print_table("cpserve up layouts vs the reference (token-for-token answers)",
                ["layout", "prompts", "equal", "exact", "seconds"],
                [[n, r["prompts"], r["equal_to_reference"], "yes" if r["exact"] else "NO", r["seconds"]]
                 for n, r in layout_results.items()])
    heatmaps(prompts, tasks, lengths, depths, train_len, args.out)
    within = [q["right"] for q in prompts if not train_len or q["length"] <= train_len]
    elapsed = time.perf_counter() - t_start
    print(f"runtime: {elapsed:.1f} s (reference {ref_s:.1f} s)")
    exact = all(r["exact"] for r in layout_results.values())
    emit_json(args.json, {
        "model": str(model_dir), "training_length": train_len, "samples": args.samples, "lengths": lengths,
        "depths": depths, "results": rows,
        "accuracy_up_to_training_length": sum(within) / len(within) if within else None,
        "layouts": layout_results, "layouts_exact": exact, "runtime_s": round(elapsed, 1),
        "answers": [{"task": q["task"], "length": q["length"], "depth": q["depth"], "sample": q["sample"],
                     "prompt_tokens": len(q["ids"]), "right": q["right"], "answer": q["answer"]} for q in prompts]})
    if not exact:
        raise SystemExit("a layout's answers differ from the reference's")


if __name__ == "__main__":
    main()
