"""What an FP8 KV cache costs in accuracy: fp8 and fp8_ds_mla (and fp32) against a bf16 cache on
the same prompts, with the same fp32 compute.

    python bench/kv_quality.py [--quick] [--json] [--new-tokens 256] [--lengths 32,512,2048]
                               [--models tiny,tiny-v3,tiny-v32,release]

For every model and cache layout, the one-process reference engine (``--kv-cache-dtype``,
compute in fp32) generates ``--new-tokens`` greedy tokens for each prompt (random token ids, one
batch). Against the bf16 cache's run:

- greedy agreement: the share of the generated tokens equal to bf16's at the same position, and
  how many tokens match before the first difference (after it the contexts differ, so later
  tokens are rarely equal);
- logit error: |logit - bf16's logit|, its maximum over the vocabulary at each step up to the
  first difference (the steps where both saw the same tokens); the report gives the largest
  (absolute, and relative to the largest |logit| of bf16's at those steps) and the median step's.
  MoE routing is discontinuous — a near tie between two experts' router scores goes either way
  — so the largest is set by the rare step where an expert choice flips (seen with bf16 against
  fp32 too); the median is the typical step.

Models: the embedded ``tiny`` (glm_moe_dsa), ``tiny-v3`` (deepseek_v3) and ``tiny-v32``
(deepseek_v32), whose latent is 64 + 16 wide (one fp8_ds_mla tile of 64), and ``release``: the
test suite's released-format fixture (tests/release_fixtures.py ``fp8_release``: DeepSeek-V3's
FP8 block weights and DeepSeek's entry width, 512 + 64, so fp8_ds_mla has its four 128-value
tiles). All have random weights: the figures say how far the cache moves the logits of such a
model, not the accuracy of a trained one. ``--quick``: release only, one 64-token prompt, 16 new
tokens.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from common import ROOT, base_parser, emit_json, parse_args, print_table, save_plot

LAYOUTS = ("fp32", "fp8", "fp8_ds_mla")  # each against bf16
BASELINE = "bf16"


def release_dir() -> str:
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.release_fixtures import fp8_release

    path = Path(tempfile.mkdtemp()) / "release"
    path.mkdir()
    fp8_release(path)
    return str(path)


def generate(model: str, kind: str, prompts: list[list[int]], new_tokens: int):
    from engine.model.sampler import SamplingParams
    from engine.reference import ReferenceEngine

    eng = ReferenceEngine(model, dtype="fp32", kv_cache_dtype=kind, record_logits=True)
    return eng.generate(prompts, SamplingParams(max_new_tokens=new_tokens, stop_token_ids=()))


def compare(seqs, base) -> dict:
    import torch

    n = sum(len(s.output_ids) for s in base)
    equal = sum(a == b for s, t in zip(seqs, base) for a, b in zip(s.output_ids, t.output_ids))
    prefix, errs, scale = [], [], 0.0
    for s, t in zip(seqs, base):
        same = next((i for i, (a, b) in enumerate(zip(s.output_ids, t.output_ids)) if a != b), len(t.output_ids))
        prefix.append(same)
        for a, b in zip(s.logits[: same + 1], t.logits[: same + 1]):  # the step that differs saw the same context
            errs.append(float((a - b).abs().max()))
            scale = max(scale, float(b.abs().max()))
    err = max(errs)
    return {"agreement": equal / n, "matched_before_first_difference": prefix,
            "min_matched_prefix": min(prefix), "max_logit_error": err,
            "max_logit_error_relative": err / scale if scale else 0.0,
            "median_step_logit_error": float(torch.tensor(errs).median())}


def plot(rows: list[dict], out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    w = 0.8 / len(LAYOUTS)
    for j, kind in enumerate(LAYOUTS):
        rs = [next(r for r in rows if r["model"] == m and r["kv_cache_dtype"] == kind) for m in models]
        xs = [x + j * w for x in range(len(models))]
        a.bar(xs, [r["agreement"] for r in rs], w, label=kind)
        b.bar(xs, [max(r["max_logit_error_relative"], 1e-9) for r in rs], w, label=kind)
    for ax in (a, b):
        ax.set_xticks([x + 0.4 - w / 2 for x in range(len(models))], models)
        ax.legend(fontsize=8)
    a.set_title("greedy tokens equal to the bf16 cache's")
    a.set_ylim(0, 1.05)
    b.set_yscale("log")
    b.set_title("max |logit error| / max |logit| (same context)")
    save_plot(fig, out_dir, "kv_quality.png")


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--lengths", default="32,512,2048", help="prompt lengths (one prompt each)")
    p.add_argument("--models", default="tiny,tiny-v3,tiny-v32,release")
    p.add_argument("--seed", type=int, default=0)
    args = parse_args(p, {"new_tokens": 16, "lengths": "64", "models": "release"})
    import torch

    t0 = time.perf_counter()
    rows = []
    for name in args.models.split(","):
        model = release_dir() if name == "release" else name
        from engine.model.config import ModelConfig

        vocab = ModelConfig.load(model).vocab_size
        g = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in args.lengths.split(",")]
        base = generate(model, BASELINE, prompts, args.new_tokens)
        for kind in LAYOUTS:
            rows.append({"model": name, "kv_cache_dtype": kind, "against": BASELINE,
                         **compare(generate(model, kind, prompts, args.new_tokens), base)})
            print(f"  {time.perf_counter() - t0:6.1f}s {name} {kind}", flush=True)
    runtime = time.perf_counter() - t0
    print_table(f"cache layouts against a bf16 cache: greedy, {args.new_tokens} new tokens, prompts of "
                f"{args.lengths} tokens, fp32 compute",
                ["model", "cache", "tokens equal to bf16's", "matched before first difference (per prompt)",
                 "max |logit error|", "relative to max |logit|", "median step's max |logit error|"],
                [[r["model"], r["kv_cache_dtype"], r["agreement"], str(r["matched_before_first_difference"]),
                  r["max_logit_error"], r["max_logit_error_relative"], r["median_step_logit_error"]] for r in rows])
    print(f"runtime {runtime:.1f} s")
    plot(rows, args.out)
    emit_json(args.json, {"new_tokens": args.new_tokens, "lengths": [int(x) for x in args.lengths.split(",")],
                          "baseline": BASELINE, "results": rows, "runtime_s": runtime})


if __name__ == "__main__":
    main()
