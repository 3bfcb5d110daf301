"""The `cpserve` command line."""

from __future__ import annotations

import argparse
import json
import sys
import time

from services.cli import print_generation, tokenizer_from_args

USER_ERRORS: tuple[type[BaseException], ...] = (ValueError,)  # InvalidRequest, ModelConfigError, CheckpointError


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny", help="checkpoint directory, or 'tiny' (embedded model; default)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="compute and cache dtype; auto (default) follows the checkpoint's torch_dtype "
                        "(bf16 for an FP8 release, fp32 for the embedded tiny models)")
    from services.cli import add_tokenizer_args

    add_tokenizer_args(p)


def add_kv_cache_dtype_arg(p: argparse.ArgumentParser) -> None:
    from engine.cache.kvformat import KV_CACHE_DTYPES

    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="how cache entries are stored: auto (default: the compute dtype), fp32, bf16, fp8 "
                        "(e4m3, a per-layer scale) or fp8_ds_mla (DeepSeek's 656-byte layout)")


def add_prompt_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("--prompt", help="prompt text (tokenised with the checkpoint's tokenizer)")
    g.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS token")


def prompt_ids_from_args(args: argparse.Namespace, tokenizer, parser: argparse.ArgumentParser) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}")
    return tokenizer.encode(args.prompt)


def sampling_from_args(args: argparse.Namespace):
    from engine.model.sampler import SamplingParams

    return SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, stop_token_ids=() if args.ignore_eos else None,
    )


# ---- commands ----------------------------------------------------------------------------
def cmd_reference(args, parser) -> int:
    from engine.reference import ReferenceEngine

    t0 = time.perf_counter()
    try:
        engine = ReferenceEngine(args.model, dtype=args.dtype, chunk_size=args.chunk_size, device=args.device,
                                 kv_cache_dtype=args.kv_cache_dtype)
    except ValueError as e:
        if not str(e).startswith("device:"):
            raise
        parser.error(f"--{e}")
    load_s = time.perf_counter() - t0
    ids = prompt_ids_from_args(args, tokenizer_from_args(args), parser)
    seq = engine.generate([ids], sampling_from_args(args))[0]
    extra = {} if args.json else {"model": str(engine.model_dir), "load": f"{load_s:.2f} s",
                                  "prompt": f"{len(ids)} tokens", "finish": seq.finish_reason}
    print_generation(args, tokenizer_from_args(args), seq.output_ids, seq.ttft_ms, seq.tpot_ms, extra)
    return 0


def cmd_prefill(args, parser) -> int:
    from engine.model.sampler import SamplingParams
    from engine.prefill_engine import CPPrefillEngine

    t0 = time.perf_counter()
    with CPPrefillEngine(args.model, cp=args.cp, strategy=args.strategy, layer_split=args.layer_split,
                         cp_attention=args.cp_attention, cp_ring_mode=args.cp_ring_mode, dtype=args.dtype,
                         chunk_size=args.chunk_size,
                         threads_per_rank=args.threads_per_rank,
                         max_cache_tokens=args.max_cache_tokens, moe_parallel=args.moe_parallel,
                         kv_cache_dtype=args.kv_cache_dtype) as engine:
        start_s = time.perf_counter() - t0
        ids = prompt_ids_from_args(args, tokenizer_from_args(args), parser)
        seq = engine.generate([ids], SamplingParams(max_new_tokens=1, stop_token_ids=()))[0]
        cache = engine.group.call("cache_bytes")
        ranks = [{"rank": r, "seconds": round(engine.runner.rank_seconds[r], 4),
                  "cache_bytes": c["persistent"] + c["scratch"], "layers": c["layers"]} for r, c in enumerate(cache)]
    result = {"first_token": seq.output_ids[0], "ttft_ms": round(seq.ttft_ms, 3), "prompt_tokens": len(ids),
              "cp": args.cp, "strategy": args.strategy, "layer_split": args.layer_split,
              "cp_attention": args.cp_attention, "ranks": ranks}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"prefill of {len(ids)} tokens on CP={args.cp} ({args.strategy}{', layer split' if args.layer_split else ''}, "
          f"{args.cp_attention} attention); "
          f"group start {start_s:.1f} s")
    print(f"first token: {seq.output_ids[0]} ({tokenizer_from_args(args).decode(seq.output_ids)!r})   TTFT {seq.ttft_ms:.1f} ms")
    for r in ranks:
        print(f"  rank {r['rank']}: {r['seconds'] * 1e3:9.1f} ms forward   cache {r['cache_bytes'] / 2**20:8.2f} MiB"
              f"   layers {r['layers'][0]}..{r['layers'][-1]}")
    return 0


def cmd_decode(args, parser) -> int:
    from engine.decode_engine import DCPDecodeEngine

    with DCPDecodeEngine(args.model, dcp=args.dcp, exchange=args.dcp_comm, indexer=args.indexer,
                         replicate_q_proj=args.replicate_q_proj, dtype=args.dtype,
                         threads_per_rank=args.threads_per_rank, max_cache_tokens=args.max_cache_tokens,
                         moe_parallel=args.moe_parallel, kv_cache_memory=args.kv_cache_memory,
                         kv_cache_dtype=args.kv_cache_dtype) as engine:
        ids = prompt_ids_from_args(args, tokenizer_from_args(args), parser)
        seq = engine.generate([ids], sampling_from_args(args))[0]
        memory = engine.group.call("memory")
    steps = [round((b - a) * 1e3, 3) for a, b in zip(seq.token_times, seq.token_times[1:])]
    extra = {"dcp": args.dcp, "dcp_comm": args.dcp_comm, "indexer": args.indexer, "step_ms": steps,
             "cache_bytes_per_rank": [m["latent_bytes"] + m["index_bytes"] for m in memory]}
    print_generation(args, tokenizer_from_args(args), seq.output_ids, seq.ttft_ms, seq.tpot_ms, extra)
    return 0


def cmd_demo(args, parser) -> int:
    """One prompt through the reference, then through a CP prefill group whose ranks write the
    prompt's KV over Mooncake (TCP) straight into a DCP decode group's reserved rows — the
    hand-off the services use — which then decodes; with timings."""
    import time

    from engine.decode_engine import DCPDecodeEngine
    from engine.model.sampler import SamplingParams
    from engine.prefill_engine import CPPrefillEngine
    from engine.reference import ReferenceEngine

    params = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
    ref = ReferenceEngine(args.model)
    ids = tokenizer_from_args(args).encode(args.prompt)
    print(f"model {ref.model_dir} ({ref.cfg.model_type}, {ref.cfg.num_layers} layers); prompt {len(ids)} tokens")
    seq = ref.generate([ids], params)[0]
    print(f"reference      : {seq.output_ids[:12]}...  TTFT {seq.ttft_ms:7.1f} ms  TPOT {seq.tpot_ms:6.2f} ms")
    with CPPrefillEngine(args.model, cp=args.cp, kv_transport="tcp") as pre, \
            DCPDecodeEngine(args.model, dcp=args.dcp, kv_transport="tcp", reference_prefill=False) as dec:
        t0 = time.perf_counter()
        dest = dec.reserve(len(ids), params.max_new_tokens)
        first = pre.prefill_to(ids, params, dest, before_write=lambda: dec.begin_write(dest.reservation_id),
                               after_write=lambda: dec.end_write(dest.reservation_id))
        ttft = (time.perf_counter() - t0) * 1e3
        sent = sum(r["bytes"] for r in pre.transfer_stats or [])
        print(f"prefill CP={args.cp}   : first token {first.output_ids[0]} "
              f"({'matches' if first.output_ids[0] == seq.output_ids[0] else 'DIFFERS from'} the reference)  "
              f"TTFT {ttft:7.1f} ms, {sent / 1e6:.2f} MB of KV written to the decode ranks")
        out = dec.commit(dest.reservation_id, ids, params, first.seed, first.output_ids[0])
        t1 = time.perf_counter()
        while dec.has_work:
            dec.step()
        tpot = (time.perf_counter() - t1) * 1e3 / max(len(out.output_ids) - 1, 1)
    same = out.output_ids == seq.output_ids
    print(f"decode DCP={args.dcp}   : {out.output_ids[:12]}...  TPOT {tpot:6.2f} ms  "
          f"({'equal to' if same else 'DIFFERENT from'} the reference)")
    print(f"text: {tokenizer_from_args(args).decode(seq.output_ids)!r}")
    return 0 if same else 1


def cmd_make_tiny(args, parser) -> int:
    from engine.model.tiny import make_tiny

    path = make_tiny(args.dir, args.type, seed=args.seed)
    print(f"wrote {args.type} tiny checkpoint to {path}")
    return 0


def add_moe_parallel_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--moe-parallel", default="ep", choices=["ep", "replicate"],
                   help="routed experts split across the ranks (ep, default) or held whole by each (replicate)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cpserve", description="Disaggregated prefill/decode serving with context parallelism")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("reference", help="generate with the one-process reference engine (no parallelism)")
    add_model_args(p)
    add_prompt_args(p)
    add_sampling_args(p)
    p.add_argument("--chunk-size", type=int, default=4096, help="prefill chunk size in tokens")
    add_kv_cache_dtype_arg(p)
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(handler=cmd_reference, cmd_parser=p)

    p = sub.add_parser("prefill", help="run one prompt through a real prefill context-parallel group")
    add_model_args(p)
    add_prompt_args(p)
    p.add_argument("--cp", type=int, default=2, help="context-parallel ranks")
    p.add_argument("--strategy", default="interleave", choices=["interleave", "zigzag"])
    p.add_argument("--layer-split", action="store_true", help="each rank keeps only its range of layers")
    p.add_argument("--cp-attention", default="allgather", choices=["allgather", "ring"],
                   help="allgather (default: every rank ends with every row) or ring (blocks passed round the "
                        "ring over a cache sharded 1/C per rank, striped by position; no --layer-split)")
    p.add_argument("--cp-ring-mode", default="auto", choices=["auto", "pass_kv", "pass_q"],
                   help="the ring's mode per forward: pass_kv, pass_q or auto (default: the selector's choice)")
    add_moe_parallel_arg(p)
    add_kv_cache_dtype_arg(p)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--max-cache-tokens", type=int, default=1 << 16)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_prefill, cmd_parser=p)

    p = sub.add_parser("decode", help="prefill with the reference, then decode with a real DCP group")
    add_model_args(p)
    add_prompt_args(p)
    add_sampling_args(p)
    p.add_argument("--dcp", type=int, default=2, help="decode context-parallel ranks (must divide the heads)")
    p.add_argument("--dcp-comm", default="a2a", choices=["a2a", "ag_rs"], help="attention output exchange")
    p.add_argument("--indexer", default="copied", choices=["copied", "split"], help="DSA index placement")
    p.add_argument("--replicate-q-proj", action="store_true", help="full query projection on every rank")
    add_moe_parallel_arg(p)
    add_kv_cache_dtype_arg(p)
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="cache bytes per rank, e.g. 512MiB (overrides --max-cache-tokens)")
    p.add_argument("--threads-per-rank", type=int, default=1)
    p.add_argument("--max-cache-tokens", type=int, default=1 << 16)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=cmd_decode, cmd_parser=p)

    p = sub.add_parser("demo", help="one prompt through the reference, a CP prefill group and a DCP decode group")
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompt", default="Context parallelism splits long prompts across ranks.")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--dcp", type=int, default=2)
    p.set_defaults(handler=cmd_demo, cmd_parser=p)

    from services.up import add_cluster_args, run_generate, run_up

    p = sub.add_parser("up", help="start router + prefill + decode on this machine and serve until Ctrl-C")
    add_cluster_args(p)
    p.add_argument("--port", type=int, default=8000, help="router HTTP port (OpenAI API)")
    p.add_argument("--grpc-port", type=int, default=0, help="router gRPC port (0: a free one)")
    p.add_argument("--no-demo", dest="demo", action="store_false",
                   help="skip the demo request that `up` sends through the cluster once it is ready")
    p.set_defaults(handler=run_up, cmd_parser=p)

    p = sub.add_parser("generate", help="one request through a temporary local cluster (same options as up)")
    add_cluster_args(p)
    add_prompt_args(p)
    add_sampling_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=run_generate, cmd_parser=p)

    p = sub.add_parser("make-tiny", help="write a deterministic tiny Hugging Face-format checkpoint")
    p.add_argument("dir")
    p.add_argument("--type", default="glm_moe_dsa", choices=["deepseek_v3", "deepseek_v32", "glm_moe_dsa"])
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(handler=cmd_make_tiny, cmd_parser=p)

    from engine.cache.capacity import build_parser_plan
    from engine.parallel.layout_cli import build_parser_layout

    build_parser_layout(sub)
    build_parser_plan(sub)

    from services.cli import build_parser_serve

    build_parser_serve(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "handler"):
            return args.handler(args, args.cmd_parser) or 0
        return args.func(args) or 0
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
