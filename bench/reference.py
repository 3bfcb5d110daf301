"""Reference engine vs transformers: prefill and decode tokens/s on the same checkpoint,
the same thread count and the same prompts, measured side by side in one run.

Each prompt length runs ``--rounds`` rounds, transformers and ours alternating, so both see the
same machine load. Prefill tok/s comes from the median prefill time over the rounds; decode
tok/s from the median step time over every decode step of every round (a few slow steps — the
other tenants of a shared machine — move a median much less than a mean).

    python bench/reference.py [--quick] [--json] [--threads 2] [--lengths 1024,8192] [--decode-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import statistics
import time

from common import base_parser, emit_json, print_table, save_plot

import torch


def run_ours(engine, prompt: list[int], n_decode: int) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds)."""
    from engine.model.sampler import SamplingParams

    seq = engine.generate([prompt], SamplingParams(max_new_tokens=n_decode + 1, stop_token_ids=()))[0]
    t = seq.token_times
    return seq.ttft_ms / 1e3, [b - a for a, b in zip(t, t[1:])]


@torch.inference_mode()
def run_hf(model, prompt: list[int], n_decode: int) -> tuple[float, list[float]]:
    """(prefill seconds, decode step seconds), greedy, with transformers' own cache."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt])
    cache = DynamicCache(config=model.config)
    t0 = time.perf_counter()
    out = model(ids, cache=cache, use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    t = [time.perf_counter()]
    for _ in range(n_decode):
        out = model(token, cache=out.cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        t.append(time.perf_counter())
    return t[0] - t0, [b - a for a, b in zip(t, t[1:])]


def measure(engine, hf, prompt: list[int], n_decode: int, rounds: int) -> tuple[float, float, float, float]:
    """(ours prefill tok/s, HF prefill tok/s, ours decode tok/s, HF decode tok/s)."""
    pre = {"ours": [], "hf": []}
    steps = {"ours": [], "hf": []}
    for _ in range(rounds):
        for name, fn in (("hf", lambda: run_hf(hf, prompt, n_decode)), ("ours", lambda: run_ours(engine, prompt, n_decode))):
            p, s = fn()
            pre[name].append(p)
            steps[name].extend(s)
    n = len(prompt)
    return (n / statistics.median(pre["ours"]), n / statistics.median(pre["hf"]),
            1 / statistics.median(steps["ours"]), 1 / statistics.median(steps["hf"]))


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--model", default="tiny")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--lengths", default="1024,8192")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds per prompt length (median taken)")
    args = p.parse_args()
    lengths = [1024] if args.quick else [int(x) for x in args.lengths.split(",")]
    n_decode = 8 if args.quick else args.decode_tokens
    rounds = 1 if args.quick else args.rounds
    torch.set_num_threads(args.threads)

    import transformers

    from engine.model.tiny import resolve_model_dir
    from engine.reference import ReferenceEngine

    path = resolve_model_dir(args.model)
    engine = ReferenceEngine(str(path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = engine.cfg.vocab_size
    rows, figures = [], {"threads": args.threads, "model": str(args.model), "rounds": rounds, "results": []}
    warm = torch.randint(3, vocab, (64,)).tolist()
    run_ours(engine, warm, 2), run_hf(hf, warm, 2)
    for n in lengths:
        prompt = torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        our_pre, hf_pre, our_dec, hf_dec = measure(engine, hf, prompt, n_decode, rounds)
        rows.append([n, our_pre, hf_pre, our_pre / hf_pre, our_dec, hf_dec, our_dec / hf_dec])
        figures["results"].append({"prompt_tokens": n, "prefill_tok_s": {"ours": our_pre, "transformers": hf_pre},
                                   "decode_tok_s": {"ours": our_dec, "transformers": hf_dec},
                                   "prefill_ratio": our_pre / hf_pre, "decode_ratio": our_dec / hf_dec})
    print_table(f"reference engine vs transformers {transformers.__version__} ({args.threads} threads, fp32, {args.model})",
                ["prompt", "prefill tok/s ours", "prefill tok/s HF", "ratio", "decode tok/s ours", "decode tok/s HF",
                 "ratio"], rows)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    labels = [str(r[0]) for r in rows]
    for i, (title, a, b) in enumerate([("prefill tok/s", 1, 2), ("decode tok/s", 4, 5)]):
        xs = range(len(rows))
        ax[i].bar([x - 0.2 for x in xs], [r[a] for r in rows], 0.4, label="cpserve reference")
        ax[i].bar([x + 0.2 for x in xs], [r[b] for r in rows], 0.4, label="transformers")
        ax[i].set_xticks(list(xs), labels)
        ax[i].set_xlabel("prompt tokens")
        ax[i].set_title(title)
        ax[i].legend()
    save_plot(fig, args.out, "reference.png")
    emit_json(args.json, figures)


if __name__ == "__main__":
    main()
