"""Memory per rank with expert parallelism: each prefill CP and decode DCP rank's peak RSS against
the weights of its shard + a baseline, at C = 1, 2, 4, and the routed-expert copies a cluster holds.

The checkpoint is a deepseek_v3-family model with random weights (seeded) whose routed experts are
97% of the bytes: 6 MoE layers (no dense one) of 64 experts x 1024 wide, hidden 1024, small
attention (8 heads, LoRA ranks 256) and a 4,096-token vocabulary; 2.49 GB in bf16 (--quick: 3
layers of 32 experts x 512 and a 2,048-token vocabulary, 0.33 GB, 91% experts). It is written
shard by shard (one safetensors file per layer) by ``bench/load.py``'s ``make_checkpoints``, in
the driver: the ranks are forked from the rank server (a separate process that has imported torch,
not the driver), so they inherit none of the driver's memory.

Each configuration (service x C x ``moe_parallel``: ep at C = 1, 2, 4; replicate at C = 2, and
at C = 4 in the full run; C = 1 is the same for both) starts a real group, one group at a time:
``CPPrefillEngine(cp=C, strategy="zigzag")`` or ``DCPDecodeEngine(dcp=C, reference_prefill=False)``
(the driver loads no weights), dtype auto (bf16), ``max_cache_tokens=1024``, one thread per rank.
Once the group is ready it serves one short request, so that the compute path's allocations count
too: a 32-token prefill through the engine, or one decode step at position 32 (over zero KV rows)
through the group. Then ``VmHWM`` (peak RSS: file-backed pages and the load's transients
included) is read from /proc/<pid>/status of every rank (``WorkerGroup.pids``); the JSON also has
the VmHWM right after ``ready`` (~15-20 MB lower) and the final RssAnon / RssFile.

The formula for rank r of a C-rank group:

    formula(r) = weight_bytes(cfg, dtype, shard(r)) + baseline(service, C, r)

shard(r) is what the rank builds for itself: prefill ``WeightShard(r, C, tp=False, moe_parallel=m)``,
decode ``WeightShard(r, C, tp=True, moe_parallel=m, replicate_q_proj=False)`` (its heads and MLPs
are tensor-parallel slices too). ``engine.model.loader.weight_bytes`` gives the exact bytes of it,
checked against what the rank says it holds (``weights``). The baseline is the same rank of the
same kind of group (service, C, cache size, threads, layers, expert count, attention) started on a
checkpoint whose routed experts are 16 wide instead, serving the same request: its VmHWM minus its
own weight_bytes, i.e. python + torch + gloo + KV pool + activations (~0.32 GiB). measured /
formula must be within 10% for every rank at C = 2 and 4 with ep. The check is enforced with
--quick too (a failing run exits 1), as the baseline is the same process and the check has
margin even at 0.3 GB. The stricter ``(measured − baseline) / weights`` is shown next to it.

Expert copies of a group = Σ over its ranks of their routed-expert bytes / one full copy: ep holds
1.0 per service at every C, replicate C. The cluster rows add one prefill group and one decode
group of the same C and moe_parallel, ranks only (the drivers hold no weights). They are sums of
groups measured one after the other, never running together. For decode, ``cpserve plan --model
DIR --dcp C --moe-parallel m --json`` runs in this process; its per-rank weight figure is set
beside the formula's weights and the measured RSS, and must equal the formula's weights.

Measured (full run, 2 CPU cores, ~130 s): every rank within 0.3% of the formula, ep holding
1.0 + 1.0 expert copies at C = 1, 2, 4 and replicate 2 + 2 and 4 + 4. --quick takes ~1 min on an
idle machine (less with --no-replicate): most of it is starting the 14 groups' ranks, each one
importing torch.

    python bench/memory.py [--quick] [--json] [--out DIR] [--workdir DIR] [--keep] [--no-replicate] [--groups 1,2,4]
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from common import base_parser, emit_json, print_table, proc_status, save_plot

GiB = 1 << 30
GB = 1e9
BOUND = 0.10  # |measured / formula − 1| ≤ BOUND at C = 2, 4 (ep)
CACHE_TOKENS = 1024
PROMPT_TOKENS = 32
_COMMON = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256, kv_lora_rank=256,
               qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, n_group=4, topk_group=2,
               num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=0, intermediate_size=1024,
               vocab_size=4096, max_position_embeddings=4096)
# bf16: 2.49 GB, 97% routed experts (6 layers × 64 experts × 3 × 1024 × 1024 × 2 B)
FULL = dict(_COMMON, num_hidden_layers=6, n_routed_experts=64, moe_intermediate_size=1024)
# bf16: 0.33 GB, 91% routed experts
QUICK = dict(_COMMON, num_hidden_layers=3, n_routed_experts=32, moe_intermediate_size=512, vocab_size=2048)
BASE_EXPERT_WIDTH = 16  # the baseline checkpoint: the same model with 16-wide routed experts


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shard_of(service: str, rank: int, world: int, moe: str):
    """The WeightShard rank `rank` builds for itself (PrefillRank / DecodeRank)."""
    from engine.parallel.shard import WeightShard

    if service == "prefill":
        return WeightShard(rank, world, tp=False, moe_parallel=moe)
    return WeightShard(rank, world, tp=True, moe_parallel=moe, replicate_q_proj=False)


def expert_bytes(cfg, dtype: str, shard=None) -> int:
    """Bytes of the routed experts (``mlp.experts.*``) a shard holds (all of them without one)."""
    from engine.model.loader import weight_breakdown

    return weight_breakdown(cfg, dtype, shard)["routed_experts"]


# ---- one group, measured -----------------------------------------------------------------------
def measure_group(service: str, model_dir: Path, world: int, moe: str) -> dict:
    """Start the group, serve one short request, read every rank's /proc status, stop it."""
    import torch

    from engine.model.sampler import SamplingParams
    from engine.plan import DecodeItem, StepPlan

    t0 = time.perf_counter()
    if service == "prefill":
        from engine.prefill_engine import CPPrefillEngine

        eng = CPPrefillEngine(model=str(model_dir), cp=world, strategy="zigzag", dtype="auto",
                              max_cache_tokens=CACHE_TOKENS, threads_per_rank=1, moe_parallel=moe)
    else:
        from engine.decode_engine import DCPDecodeEngine

        eng = DCPDecodeEngine(model=str(model_dir), dcp=world, reference_prefill=False, dtype="auto",
                              max_cache_tokens=CACHE_TOKENS, threads_per_rank=1, moe_parallel=moe)
    try:
        start_s = time.perf_counter() - t0
        pids = eng.group.pids
        ready = [proc_status(p) for p in pids]
        held = eng.group.call("weights")
        prompt = [3 + (7 * i) % (eng.cfg.vocab_size - 3) for i in range(PROMPT_TOKENS)]
        if service == "prefill":
            seq = eng.generate([prompt], SamplingParams(max_new_tokens=1))[0]
            assert len(seq.output_ids) == 1
        else:  # one decode step at position PROMPT_TOKENS over zero KV rows (the ranks' pools)
            plan = StepPlan("decode", [DecodeItem(0, prompt[-1], PROMPT_TOKENS, torch.arange(PROMPT_TOKENS + 1))])
            out = eng.group.call("run", plan, False)
            assert 0 in out[0][0]
        after = [proc_status(p) for p in pids]
    finally:
        eng.close()
    return {"pids": pids, "start_s": start_s, "held": held,
            "ready_hwm": [s["VmHWM"] for s in ready], "hwm": [s["VmHWM"] for s in after],
            "rss": [s["VmRSS"] for s in after], "rss_anon": [s.get("RssAnon", 0) for s in after],
            "rss_file": [s.get("RssFile", 0) for s in after], "dtype": eng.dtype}


def plan_weights(model_dir: Path, world: int, moe: str) -> list[int]:
    """`cpserve plan --model DIR --dcp C --moe-parallel m --json`'s weight bytes per decode rank.
    Run in this process (the CLI's own entry point): a subprocess would pay python + torch
    start-up for each figure."""
    import io

    from cpserve.cli import main as cpserve

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cpserve(["plan", "--model", str(model_dir), "--dcp", str(world), "--moe-parallel", moe, "--json"]) == 0
    return [r["total"] for r in json.loads(buf.getvalue().strip().splitlines()[-1])["weights"]["per_rank"]]


# ---- the benchmark -----------------------------------------------------------------------------
def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--workdir", default=None, help="where the checkpoints are written (a temp dir inside it, "
                                                   "deleted afterwards; default: the system temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the generated checkpoints (prints where)")
    p.add_argument("--no-replicate", action="store_true", help="skip the moe_parallel=replicate groups")
    p.add_argument("--groups", default="1,2,4", help="group sizes C to measure (default 1,2,4)")
    args = p.parse_args()
    cs = tuple(int(c) for c in args.groups.split(","))

    import torch

    from load import disk_bytes, make_checkpoints

    from engine.model.config import ModelConfig
    from engine.model.loader import weight_bytes

    torch.set_num_threads(1)
    wall0 = time.perf_counter()
    overrides = QUICK if args.quick else FULL
    base_overrides = dict(overrides, moe_intermediate_size=BASE_EXPERT_WIDTH)
    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="cpserve-memory-", dir=args.workdir))
    runs, baselines, notes = [], {}, []
    try:
        log(f"writing the checkpoints in {root} ({'quick' if args.quick else 'full'} sizes)")
        for sub in ("model", "baseline"):
            (root / sub).mkdir()
        with contextlib.redirect_stdout(sys.stderr):  # make_checkpoints reports its shards on stdout
            model_dir = make_checkpoints(root / "model", overrides, ["bf16"])["bf16"]
            base_dir = make_checkpoints(root / "baseline", base_overrides, ["bf16"])["bf16"]
        os.sync()
        gen_s = time.perf_counter() - wall0
        cfg, base_cfg = ModelConfig.from_dir(model_dir), ModelConfig.from_dir(base_dir)
        ckpt_bytes = disk_bytes(model_dir)
        full_weights = weight_bytes(cfg, "auto")
        one_copy = expert_bytes(cfg, "auto")
        log(f"  checkpoint {ckpt_bytes / GB:.2f} GB on disk, weights {full_weights / GB:.2f} GB "
            f"({one_copy / full_weights:.1%} routed experts); baseline checkpoint {disk_bytes(base_dir) / GB:.3f} GB "
            f"({gen_s:.0f} s)")

        configs = [(c, "ep") for c in cs]
        if not args.no_replicate:
            configs += [(2, "replicate")] if 2 in cs else []
            avail = _mem_available()
            need = 4 * full_weights * 1.15 + 4 * 0.6 * GB
            if args.quick:
                notes.append("C=4 replicate: full run only")
            elif avail is not None and avail < need:
                notes.append(f"C=4 replicate skipped: {avail / GiB:.1f} GiB available, ~{need / GiB:.1f} GiB needed")
            elif 4 in cs:
                configs.append((4, "replicate"))
        for service in ("prefill", "decode"):
            for world in cs:
                log(f"{service} C={world}: baseline group (16-wide experts) ...")
                b = measure_group(service, base_dir, world, "ep")
                base = []
                for r in range(world):
                    wb = weight_bytes(base_cfg, b["dtype"], shard_of(service, r, world, "ep"))
                    base.append(b["hwm"][r] - wb)
                baselines[(service, world)] = {"hwm": b["hwm"], "weights": [
                    weight_bytes(base_cfg, b["dtype"], shard_of(service, r, world, "ep")) for r in range(world)],
                    "baseline": base, "start_s": b["start_s"]}
                log(f"  baseline per rank {', '.join(f'{x / GiB:.3f}' for x in base)} GiB ({b['start_s']:.1f} s start)")
                for c, moe in configs:
                    if c != world:
                        continue
                    log(f"{service} C={world} moe_parallel={moe}: starting the group ...")
                    m = measure_group(service, model_dir, world, moe)
                    planned = plan_weights(model_dir, world, moe) if service == "decode" else [None] * world
                    ranks = []
                    for r in range(world):
                        shard = shard_of(service, r, world, moe)
                        w = weight_bytes(cfg, m["dtype"], shard)
                        formula = w + base[r]
                        ranks.append({
                            "rank": r, "pid": m["pids"][r], "measured_bytes": m["hwm"][r],
                            "measured_at_ready_bytes": m["ready_hwm"][r], "rss_bytes": m["rss"][r],
                            "rss_anon_bytes": m["rss_anon"][r], "rss_file_bytes": m["rss_file"][r],
                            "weight_bytes": w, "held_bytes": m["held"][r]["bytes"],
                            "expert_bytes": m["held"][r]["expert_bytes"], "experts": m["held"][r]["experts"],
                            "expert_bytes_formula": expert_bytes(cfg, m["dtype"], shard),
                            "baseline_bytes": base[r], "formula_bytes": formula, "ratio": m["hwm"][r] / formula,
                            "over_baseline_per_weight": (m["hwm"][r] - base[r]) / w,
                            "plan_weight_bytes": planned[r]})
                    copies = sum(x["expert_bytes"] for x in ranks) / one_copy
                    rec = {"service": service, "C": world, "moe_parallel": moe, "start_s": m["start_s"],
                           "ranks": ranks, "expert_copies": copies,
                           "measured_sum_bytes": sum(x["measured_bytes"] for x in ranks),
                           "formula_sum_bytes": sum(x["formula_bytes"] for x in ranks),
                           "weights_match": all(x["held_bytes"] == x["weight_bytes"] for x in ranks)}
                    runs.append(rec)
                    meas_s = ", ".join(f"{x['measured_bytes'] / GiB:.3f}" for x in ranks)
                    form_s = ", ".join(f"{x['formula_bytes'] / GiB:.3f}" for x in ranks)
                    log(f"  {m['start_s']:.1f} s start; VmHWM per rank {meas_s} GiB vs formula {form_s} GiB; "
                        f"expert copies {copies:.2f}")
    finally:
        if args.keep:
            log(f"checkpoints kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    wall = time.perf_counter() - wall0

    # ---- figures -------------------------------------------------------------------------------
    def get(service, c, moe):
        if c == 1:
            moe = "ep"  # one expert copy either way
        return next((r for r in runs if (r["service"], r["C"], r["moe_parallel"]) == (service, c, moe)), None)

    checked = [x for r in runs if r["C"] in (2, 4) and r["moe_parallel"] == "ep" for x in r["ranks"]]
    within = bool(checked) and all(abs(x["ratio"] - 1) <= BOUND for x in checked)
    worst = max((abs(x["ratio"] - 1) for x in checked), default=None)
    all_within = all(abs(x["ratio"] - 1) <= BOUND for r in runs for x in r["ranks"])
    expert_copies = {s: {str(c): get(s, c, "ep")["expert_copies"] for c in cs} for s in ("prefill", "decode")}
    expert_copies_rep = {s: {str(c): r["expert_copies"] for c in cs if (r := get(s, c, "replicate"))}
                         for s in ("prefill", "decode")}
    one_copy_ep = all(abs(v - 1.0) < 1e-9 for d in expert_copies.values() for v in d.values())
    rep_c_copies = all(abs(v - int(c)) < 1e-9 for d in expert_copies_rep.values() for c, v in d.items())
    weights_match = all(r["weights_match"] for r in runs)
    plan_match = all(x["plan_weight_bytes"] == x["weight_bytes"] for r in runs if r["service"] == "decode"
                     for x in r["ranks"])

    for service in ("prefill", "decode"):
        rows = []
        for r in (x for x in runs if x["service"] == service):
            for x in r["ranks"]:
                rows.append([r["C"], r["moe_parallel"], x["rank"], x["measured_bytes"] / GiB, x["weight_bytes"] / GiB,
                             x["baseline_bytes"] / GiB, x["formula_bytes"] / GiB, x["ratio"],
                             x["over_baseline_per_weight"], f"{x['experts'][0]}–{x['experts'][1]}",
                             f"{r['expert_copies']:.2f}"])
        print_table(f"{service} ranks: peak RSS (VmHWM, after a {PROMPT_TOKENS}-token "
                    f"{'prefill' if service == 'prefill' else 'decode step'}) vs formula = weight_bytes(shard) + "
                    f"baseline (GiB; bound ±{BOUND:.0%} at C=2,4 ep)",
                    ["C", "moe_parallel", "rank", "measured GiB", "weights GiB", "baseline GiB", "formula GiB",
                     "measured/formula", "(meas−base)/weights", "experts", "expert copies (group)"], rows)
    rows, cluster = [], []
    for c, moe in [(c, "ep") for c in cs] + [(c, "replicate") for c in (2, 4) if c in cs]:
        pre, dec = get("prefill", c, moe), get("decode", c, moe)
        if pre is None or dec is None or (c == 1 and moe == "replicate"):
            continue
        meas = pre["measured_sum_bytes"] + dec["measured_sum_bytes"]
        form = pre["formula_sum_bytes"] + dec["formula_sum_bytes"]
        cluster.append({"C": c, "moe_parallel": moe, "prefill_bytes": pre["measured_sum_bytes"],
                        "decode_bytes": dec["measured_sum_bytes"], "measured_bytes": meas, "formula_bytes": form,
                        "ratio": meas / form, "expert_copies": {"prefill": pre["expert_copies"],
                                                                "decode": dec["expert_copies"]}})
        rows.append([c, moe, 2 * c, pre["measured_sum_bytes"] / GiB, dec["measured_sum_bytes"] / GiB, meas / GiB,
                     form / GiB, meas / form, f"{pre['expert_copies']:.2f} + {dec['expert_copies']:.2f}"])
    print_table("cluster: one prefill group + one decode group, Σ peak RSS of their ranks (GiB; drivers excluded)",
                ["C", "moe_parallel", "ranks", "prefill GiB", "decode GiB", "cluster GiB", "formula GiB",
                 "measured/formula", "expert copies (prefill + decode)"], rows)
    rows = []
    for r in (x for x in runs if x["service"] == "decode"):
        for x in r["ranks"]:
            pw = x["plan_weight_bytes"]
            rows.append([r["C"], r["moe_parallel"], x["rank"], pw / GiB, x["weight_bytes"] / GiB,
                         (x["measured_bytes"] - x["baseline_bytes"]) / GiB, x["measured_bytes"] / GiB,
                         x["measured_bytes"] / (pw + x["baseline_bytes"])])
    print_table("decode: `cpserve plan` weight bytes per rank vs weight_bytes(shard) and the measured RSS (GiB)",
                ["C", "moe_parallel", "rank", "plan GiB", "formula weights GiB",
                 "measured − baseline GiB", "measured GiB", "measured/(plan+baseline)"], rows)
    rows = [[s, c, ", ".join(f"{x / GiB:.3f}" for x in b["hwm"]), ", ".join(f"{x / GiB:.4f}" for x in b["weights"]),
             ", ".join(f"{x / GiB:.3f}" for x in b["baseline"])] for (s, c), b in baselines.items()]
    print_table("baselines: the same groups on the 16-wide-expert checkpoint (GiB)",
                ["service", "C", "VmHWM per rank", "its weights per rank", "baseline = VmHWM − weights"], rows)
    enforce = True
    print(f"checkpoint {ckpt_bytes / GB:.2f} GB ({one_copy / full_weights:.1%} routed experts); "
          f"within ±{BOUND:.0%} at C=2,4 ep: {'yes' if within else 'NO'} (worst {worst:.1%}); "
          f"ep expert copies 1.0 per service: {'yes' if one_copy_ep else 'NO'}; replicate C copies: "
          f"{'yes' if rep_c_copies else 'NO'}; rank weights = formula: {'yes' if weights_match else 'NO'}; "
          f"plan = formula: {'yes' if plan_match else 'NO'}")
    for n in notes:
        print(f"note: {n}")
    print(f"wall time {wall:.0f} s (checkpoints {gen_s:.0f} s)")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 1, figsize=(max(7, 0.45 * max(len(r["ranks"]) for r in runs) * len(runs) / 2), 7))
    for ax, service in zip(axes, ("prefill", "decode")):
        labels, meas, form, base = [], [], [], []
        for r in (x for x in runs if x["service"] == service):
            for x in r["ranks"]:
                labels.append(f"C{r['C']} {r['moe_parallel'][:3]}\nr{x['rank']}")
                meas.append(x["measured_bytes"] / GiB)
                form.append(x["formula_bytes"] / GiB)
                base.append(x["baseline_bytes"] / GiB)
        xs = list(range(len(labels)))
        ax.bar([i - 0.2 for i in xs], meas, 0.4, label="measured VmHWM")
        ax.bar([i + 0.2 for i in xs], form, 0.4, label="formula (weights + baseline)", color="tab:gray")
        ax.scatter(xs, base, color="black", marker="_", s=200, zorder=3, label="baseline")
        ax.set_xticks(xs, labels, fontsize=7)
        ax.set_ylabel("GiB")
        ax.set_ylim(0, 1.3 * max(meas + form))
        ax.set_title(f"{service} ranks: peak RSS vs formula" + (" (quick)" if args.quick else ""))
        ax.legend(fontsize=7, ncol=3, loc="upper center")
    save_plot(fig, args.out, "memory.png")

    def rank_json(x):
        return {k: x[k] for k in ("rank", "measured_bytes", "measured_at_ready_bytes", "rss_bytes", "rss_anon_bytes",
                                  "rss_file_bytes", "weight_bytes", "held_bytes", "expert_bytes", "experts",
                                  "baseline_bytes", "formula_bytes", "ratio", "over_baseline_per_weight",
                                  "plan_weight_bytes")}

    emit_json(args.json, {
        "within_10pct": within, "enforced": enforce, "worst_deviation": worst, "all_configs_within_10pct": all_within,
        "expert_copies": expert_copies, "expert_copies_replicate": expert_copies_rep,
        "ep_one_copy_per_service": one_copy_ep, "replicate_c_copies": rep_c_copies, "weights_match": weights_match,
        "plan_matches_formula": plan_match, "checkpoint_bytes": ckpt_bytes, "weight_bytes": full_weights, "expert_bytes_one_copy": one_copy,
        "expert_fraction": one_copy / full_weights, "config": overrides, "quick": args.quick,
        "cache_tokens": CACHE_TOKENS, "prompt_tokens": PROMPT_TOKENS,
        "baselines": [{"service": s, "C": c, "hwm_bytes": b["hwm"], "weight_bytes": b["weights"],
                       "baseline_bytes": b["baseline"]} for (s, c), b in baselines.items()],
        "runs": [dict({k: v for k, v in r.items() if k != "ranks"}, ranks=[rank_json(x) for x in r["ranks"]])
                 for r in runs],
        "cluster": cluster, "notes": notes, "generate_s": gen_s, "runtime_s": wall})
    if enforce and not (within and one_copy_ep and rep_c_copies and weights_match and plan_match):
        sys.exit(1)


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


if __name__ == "__main__":
    main()
