"""`cpserve up` and `cpserve generate`: a whole cluster on this machine.

`up` starts each service as its own process — exactly the `cpserve serve prefill|decode|router`
commands that containers, Kubernetes and Ray run — waits for each to print its address, prints
the endpoints and serves until Ctrl-C, then stops every child (each stops its own rank
processes). `generate` does the same around one request and shuts the cluster down.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import typing


START_TIMEOUT_S = 600  # a real model's load; `--start-timeout-s` overrides
_SERVING = re.compile(r"serving (\w+) on (\S+)")


def _die_with_parent(parent_pid: int):
    """A preexec_fn: the child gets SIGTERM when this process dies, however it dies (SIGKILL
    included; Linux's PR_SET_PDEATHSIG), and exits if this process is already gone. The child
    stops gracefully on SIGTERM, and hard after a grace period (services/cli.py)."""
    def arm() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


class StartError(RuntimeError):
    """A service of the cluster ended before it was up; the message is its own error line (the
    field it refused) if it printed one, else the tail of its output."""


class Child:
    """One service process; its output (start-up included) is echoed with a ``[kind]`` prefix
    unless ``quiet``.

    It is up when it prints ``serving <kind> on <address>``. ``command`` replaces the default
    ``cpserve serve <kind> <argv>`` (e.g. a benchmark's own server mode).
    """

    def __init__(self, kind: str, argv: list[str], quiet: bool = False, command: list[str] | None = None,
                 env: dict[str, str] | None = None):
        self.kind, self.quiet = kind, quiet
        self.env = env if env is not None else dict(os.environ)
        cmd = command if command is not None else [sys.executable, "-m", "cpserve.cli", "serve", kind, *argv]
        # stdin is a pipe the child may watch: it closes when this process is gone, however it ends
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, bufsize=1, start_new_session=True, env=self.env,
                                     # the death signal follows the thread that forks: arm it
                                     # only from the main thread, which lives as long as we do
                                     preexec_fn=_die_with_parent(os.getpid())
                                     if threading.current_thread() is threading.main_thread() else None)
        self.address: str | None = None
        self.ready_at = float("nan")  # perf_counter() when the ready line came
        self.lines: list[str] = []
        self._ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            del self.lines[:-200]
            m = _SERVING.search(line)
            if not self.quiet:
                sys.stderr.write(f"[{self.kind}] {line}")
            if m and m.group(1) == self.kind and self.address is None:
                self.address, self.ready_at = m.group(2), time.perf_counter()
                self._ready.set()
        self._ready.set()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> str:
        self._ready.wait(timeout_s)
        if self.address is None:
            self._failed()
        return self.address

    def settled(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the process to become ready or end; whether it has."""
        return self._ready.wait(timeout_s)

    def check_starting(self) -> None:
        """Raise (as ``wait_ready`` does) if the process has already ended without becoming ready."""
        if self._ready.is_set() and self.address is None:
            self._failed()

    def tell(self, line: str) -> None:
        """Write one line to the process's stdin (e.g. the router's ``--backends-from-stdin``)."""
        try:
            self.proc.stdin.write(line.rstrip("\n") + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._ready.wait(5)  # the output up to its exit
            self._failed()

    def _failed(self) -> typing.NoReturn:
        self.stop()
        errors = [line for line in self.lines if line.startswith("error: ")]  # a refused flag or config
        why = errors[-1].removeprefix("error: ").strip() if errors else "\n" + "".join(self.lines[-15:])
        raise StartError(f"the {self.kind} service did not start (exit {self.proc.poll()}): {why}")

    def signal_stop(self) -> None:
        """Ask the process to stop (SIGTERM) without waiting."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 15) -> None:
        if self.proc.poll() is None:
            self.signal_stop()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def cluster_args(argv: list[str]) -> argparse.Namespace:
    """`cpserve up`'s cluster options parsed from ``argv``, every other one at its default (for
    code that starts a cluster without the CLI: benchmarks, tests)."""
    parser = argparse.ArgumentParser()
    add_cluster_args(parser)
    return parser.parse_args(argv)


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with prefill:/decode:/router: sections")
    p.add_argument("--model", default=None, help="checkpoint directory, 'demo' (the trained embedded model; default) "
                                                 "or 'tiny' (random weights, for exactness tests)")
    p.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default=None,
                   help="compute and cache dtype of prefill and decode (default auto: the checkpoint's torch_dtype)")
    p.add_argument("--prefill-cp", type=int, default=None, help="prefill context-parallel ranks (default 2)")
    p.add_argument("--cp-strategy", choices=["interleave", "zigzag"], default=None)
    p.add_argument("--layer-split", action="store_true", default=None)
    p.add_argument("--cp-attention", choices=["allgather", "ring"], default=None,
                   help="how prefill's CP ranks attend across the prompt: allgather (default: every rank ends "
                        "with every row) or ring (blocks passed round the ring over a cache sharded 1/C per rank, "
                        "striped by position; no --layer-split)")
    p.add_argument("--cp-ring-mode", choices=["auto", "pass_kv", "pass_q"], default=None,
                   help="the ring's mode per forward: pass_kv (cache rows travel), pass_q (queries travel) or "
                        "auto (default: the cheaper by the selector's estimate)")
    p.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV of earlier requests with the same prefix: prefill computes, and decode is "
                        "sent, only the new tokens (default: on; --no-prefix-cache: off on both services)")
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="prefill pushes each layer's KV to decode while later layers compute (default on; "
                        "--no-overlap: the whole prompt's KV after its forward)")
    p.add_argument("--prefill-services", type=_positive, default=1,
                   help="prefill services behind the router (each with --prefill-cp ranks; default 1)")
    p.add_argument("--decode-services", type=_positive, default=1,
                   help="decode services behind the router (each with --decode-dcp ranks; default 1)")
    p.add_argument("--pairing", choices=["cache_aware", "load"], default=None,
                   help="router: which pair takes a request: cache_aware (default: where its prefix is cached, "
                        "unless much busier) or load (least outstanding work only)")
    p.add_argument("--decode-dcp", type=int, default=None, help="decode context-parallel ranks (default 2)")
    p.add_argument("--indexer", choices=["copied", "split"], default=None)
    p.add_argument("--dcp-comm", choices=["a2a", "ag_rs"], default=None)
    p.add_argument("--moe-parallel", choices=["ep", "replicate"], default=None,
                   help="routed experts split across each group's ranks (ep, default) or held whole by every rank")
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp32", "bf16", "fp8", "fp8_ds_mla"], default=None,
                   help="how prefill and decode store cache entries (default auto: the compute dtype; "
                        "fp8, fp8_ds_mla: FP8 layouts, docs/architecture.md)")
    p.add_argument("--kv-cache-memory", default=None, metavar="BYTES",
                   help="decode cache bytes per rank, e.g. 2GiB (default: sized by tokens)")
    p.add_argument("--threads-per-rank", type=int, default=None,
                   help="torch threads in every rank process (default: usable cores ÷ all the ranks started, "
                        "at least 1)")
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--start-timeout-s", type=float, default=START_TIMEOUT_S,
                   help=f"how long each service may take to load and start (default {START_TIMEOUT_S} s)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--api-key", default=None, help="the router requires it (better: $CPSERVE_API_KEY or "
                                                   "--api-key-file)")
    p.add_argument("--api-key-file", default=None)
    from services.cli import add_internal_plane_args, add_model_serving_args

    add_internal_plane_args(p)
    add_model_serving_args(p)


def api_key_of(args: argparse.Namespace) -> str | None:
    """The key the router requires: --api-key, else $CPSERVE_API_KEY, else --api-key-file's."""
    from services.common.security import read_secret
    from services.router.server import API_KEY_ENV

    return args.api_key or read_secret(API_KEY_ENV, args.api_key_file, "api_key_file")


DEFAULT_MODEL = "demo"  # what `cpserve up` / `generate` serve without --model or a config's model


def _config_sections(args: argparse.Namespace) -> tuple[dict, dict]:
    """The --config file's router and prefill sections ({} where absent or unreadable: the
    services report a bad file themselves)."""
    if not args.config:
        return {}, {}
    import yaml

    try:
        doc = yaml.safe_load(open(args.config)) or {}
    except (OSError, yaml.YAMLError):
        doc = {}
    if not isinstance(doc, dict):
        return {}, {}
    return tuple(doc.get(k) if isinstance(doc.get(k), dict) else {} for k in ("router", "prefill"))


def with_default_model(args: argparse.Namespace) -> argparse.Namespace:
    """The command line's namespace with ``--model`` set to :data:`DEFAULT_MODEL` (the trained
    demo model) when neither the flags nor the --config file name a model. Only `cpserve up`
    and `cpserve generate` apply it; code that calls :func:`start_cluster` itself gets the
    services' own default (``tiny``)."""
    router, prefill = _config_sections(args)
    if args.model is None and not (prefill.get("model") or router.get("model")):
        args.model = DEFAULT_MODEL
    return args


def served_name(args: argparse.Namespace) -> str:
    """The model name the router serves (what requests must send as ``model``): the flags, else
    the --config file's router section (served_model_name, then model), else its prefill
    section's model, else "tiny"."""
    if args.served_model_name or args.model:
        return args.served_model_name or args.model
    router, prefill = _config_sections(args)
    name = router.get("served_model_name") or router.get("model") or prefill.get("model")
    return str(name) if name else "tiny"


def _flags(pairs: list[tuple[str, object]]) -> list[str]:
    out = []
    for flag, value in pairs:
        if value is None:
            continue
        if value is True:
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def cluster_env(args: argparse.Namespace) -> dict[str, str]:
    """The children's environment: ours, plus a fresh random internal token unless one is
    configured ($CPSERVE_INTERNAL_TOKEN or --internal-token-file), so the internal plane of a
    cluster `up` starts is closed by default."""
    from services.common.security import TOKEN_ENV

    env = dict(os.environ)
    if not env.get(TOKEN_ENV, "").strip() and not args.internal_token_file:
        import secrets

        env[TOKEN_ENV] = secrets.token_urlsafe(32)
    return env


def cluster_threads(args: argparse.Namespace, quiet: bool = False) -> dict[str, int | None]:
    """Threads per rank for the prefill and decode services `up` starts on this machine: the
    usable cores shared out over all their ranks (``--threads-per-rank`` or a YAML
    ``threads_per_rank`` wins). None: leave it to the service's config. Says what it picked."""
    from engine.parallel.threads import plan_threads
    from services.common.config import load_config

    pre = load_config("prefill", args.config, {"cp": args.prefill_cp})
    dec = load_config("decode", args.config, {"dcp": args.decode_dcp})
    plan = plan_threads(args.prefill_services * pre.cp + args.decode_services * dec.dcp, args.threads_per_rank)
    out = {"prefill": plan.threads, "decode": plan.threads}
    if args.threads_per_rank is None:  # a section's own threads_per_rank stays
        out.update({name: None for name, cfg in (("prefill", pre), ("decode", dec)) if cfg.threads_per_rank})
    if not quiet or plan.oversubscribed:
        services = "" if args.prefill_services == args.decode_services == 1 else \
            f" ({args.prefill_services} prefill and {args.decode_services} decode services)"
        print(f"threads: prefill CP {pre.cp} + decode DCP {dec.dcp}{services}: {plan.describe()}",
              file=sys.stderr if plan.oversubscribed else sys.stdout, flush=True)
    return out


def start_cluster(args: argparse.Namespace, port: int, grpc_port: int | None = 0, quiet: bool = False) -> list[Child]:
    """Start prefill, decode and router as child processes; return them (router last). Their
    internal RPCs carry the token of :func:`cluster_env` (``children[i].env``)."""
    env = cluster_env(args)
    common = _flags([("--config", args.config), ("--model", args.model), ("--host", args.host),
                     ("--internal-token-file", args.internal_token_file), ("--tls-cert", args.tls_cert),
                     ("--tls-key", args.tls_key), ("--tls-ca", args.tls_ca)])
    engine_common = _flags([("--dtype", args.dtype), ("--generation-config", args.generation_config),
                            ("--moe-parallel", args.moe_parallel), ("--kv-cache-dtype", args.kv_cache_dtype)])
    threads = cluster_threads(args, quiet)
    children = []
    reuse = ("--prefix-cache" if args.prefix_cache else "--no-prefix-cache", True if args.prefix_cache is not None
             else None)
    try:
        for _ in range(args.prefill_services):
            children.append(Child("prefill", common + engine_common + ["--port", "0"] + _flags([
                ("--cp", args.prefill_cp), ("--strategy", args.cp_strategy), ("--layer-split", args.layer_split),
                ("--cp-attention", args.cp_attention), ("--cp-ring-mode", args.cp_ring_mode), reuse,
                ("--threads-per-rank", threads["prefill"]),
                ("--overlap" if args.overlap else "--no-overlap", True if args.overlap is not None else None)]),
                quiet, env=env))
        for _ in range(args.decode_services):
            children.append(Child("decode", common + engine_common + ["--port", "0"] + _flags([
                ("--dcp", args.decode_dcp), ("--indexer", args.indexer), ("--dcp-comm", args.dcp_comm),
                ("--kv-cache-memory", args.kv_cache_memory), ("--threads-per-rank", threads["decode"]), reuse]),
                quiet, env=env))
        engines = list(children)
        # the router starts with the engines: it imports, checks its flags and loads the tokenizer
        # while they load their models, then gets their addresses on stdin
        router = Child("router", common + _flags([("--port", port), ("--grpc-port", grpc_port),
                                                  ("--api-key", args.api_key),
                                                  ("--api-key-file", args.api_key_file),
                                                  ("--served-model-name", args.served_model_name),
                                                  ("--tokenizer", args.tokenizer),
                                                  ("--trust-remote-code", args.trust_remote_code),
                                                  ("--chat-template", args.chat_template),
                                                  ("--generation-config", args.generation_config),
                                                  ("--max-model-len", args.max_model_len),
                                                  ("--max-request-bytes", args.max_request_bytes),
                                                  ("--request-read-timeout-s", args.request_read_timeout_s),
                                                  ("--pairing", args.pairing)])
                       + ["--backends-from-stdin"], quiet, env=env)
        children.append(router)
        deadline = time.monotonic() + args.start_timeout_s
        addresses: dict[str, list[str]] = {"prefill": [], "decode": []}
        for engine in engines:
            while not engine.settled(0.2) and time.monotonic() < deadline:
                router.check_starting()  # a bad router flag fails now, not after the models load
            addresses[engine.kind].append(engine.wait_ready(max(0.0, deadline - time.monotonic())))
        router.tell(json.dumps(addresses))
        router.wait_ready(args.start_timeout_s)
        return children
    except BaseException:
        stop_cluster(children)
        raise


def stop_cluster(children: list[Child]) -> None:
    """Stop the routers first (no new work reaches the engines), then every engine service at
    once: each shuts its rank group down on its own, so waiting for one before signalling the
    next only adds their stop times up."""
    routers = [c for c in reversed(children) if c.kind == "router"]
    engines = [c for c in reversed(children) if c.kind != "router"]
    for child in routers:
        child.stop()
    for child in engines:
        child.signal_stop()
    for child in engines:
        child.stop()


DEMO_PROMPT = "Context parallelism splits long prompts across ranks."


def stream_completion(address: str, body: dict, api_key: str | None = None,
                      path: str = "/v1/completions") -> tuple[list[int], float, float]:
    """POST a streamed ``path`` (``/v1/completions`` or ``/v1/chat/completions``) to the router
    at ``address``.

    Returns (token ids, TTFT ms, TPOT ms; NaN where undefined). Every failure raises
    ``RuntimeError`` with what went wrong: a non-200 answer (its status and body), an error
    event in the stream, or the connection itself.
    """
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    t0 = time.perf_counter()
    times: list[float] = []
    ids: list[int] = []
    try:
        with httpx.Client(timeout=600, trust_env=False) as client:
            with client.stream("POST", f"http://{address}{path}",
                               json={**body, "stream": True, "return_token_ids": True}, headers=headers) as resp:
                if resp.status_code != 200:
                    resp.read()
                    raise RuntimeError(f"{resp.status_code} {resp.text}")
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:  # a failure after the first token
                        raise RuntimeError(f"stream ended with an error: {chunk['error'].get('message')}")
                    new = chunk["choices"][0].get("token_ids") or []
                    if new:
                        times.append(time.perf_counter())
                        ids += new
    except httpx.HTTPError as e:
        raise RuntimeError(f"request to the router at {address} failed: {e!r}") from None
    ttft = (times[0] - t0) * 1e3 if times else float("nan")
    tpot = (times[-1] - times[0]) * 1e3 / (len(ids) - 1) if len(ids) > 1 else float("nan")
    return ids, ttft, tpot


DEMO_CHAT = "Tell me a short story about a fox."
# The demo's pass-key prompt: ~3,000 tokens (within the demo model's 4,096-token training length;
# prefill CP splits it across the ranks), the key at 40 % of the text.
DEMO_PASSKEY = {"seed": 7, "tokens": 3000, "depth": 0.4}


def demo_passkey(tokenizer):
    """The pass-key task `cpserve up` asks the demo model (cpserve/demo_text.py)."""
    import random

    from cpserve.demo_text import passkey_task

    def count(text: str) -> int:
        return len(tokenizer.hf.encode(text, add_special_tokens=False))

    return passkey_task(random.Random(DEMO_PASSKEY["seed"]), DEMO_PASSKEY["tokens"], DEMO_PASSKEY["depth"], count)


def run_demo(http: str, args: argparse.Namespace) -> None:
    """Print one generation through the cluster. With the trained demo model: a short chat turn,
    and a pass-key question over a prompt that prefill CP splits, with whether it is right; with
    any other model one completion of :data:`DEMO_PROMPT`. Raises RuntimeError on failure."""
    from services.cli import tokenizer_from_args

    tok, model = tokenizer_from_args(args), served_name(args)
    from engine.model.tiny import DEMO_DIR, resolve_model_dir

    if resolve_model_dir(args.model or "tiny").resolve() != DEMO_DIR.resolve():
        body = {"model": model, "prompt": DEMO_PROMPT, "max_tokens": 16, "temperature": 0}
        ids, ttft, tpot = stream_completion(http, body, api_key_of(args))
        print(f"  demo    : {DEMO_PROMPT!r} -> {tok.decode(ids)!r}")
        print(f"            {len(ids)} tokens, TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms/token, ids {ids}")
        return
    key = api_key_of(args)
    chat = {"model": model, "messages": [{"role": "user", "content": DEMO_CHAT}], "max_tokens": 160, "temperature": 0}
    ids, ttft, tpot = stream_completion(http, chat, key, "/v1/chat/completions")
    print(f"  demo    : chat {DEMO_CHAT!r}")
    print(f"            -> {tok.decode(ids)!r}")
    print(f"            {len(ids)} tokens, TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms/token")
    task = demo_passkey(tok)
    messages = [{"role": "user", "content": task.prompt}]
    n = len(tok.apply_chat_template(messages))
    body = {"model": model, "messages": messages, "max_tokens": 16, "temperature": 0}
    ids, ttft, tpot = stream_completion(http, body, key, "/v1/chat/completions")
    from cpserve.demo_text import is_right

    answer = tok.decode(ids)
    verdict = "right" if is_right(task, answer) else "WRONG"
    print(f"  demo    : pass key {task.value} hidden at {task.depth:.0%} of a {n:,}-token prompt "
          f"(prefill CP splits it across its ranks)")
    print(f"            -> {answer!r} ({verdict})")
    print(f"            {len(ids)} tokens, TTFT {ttft:.1f} ms, TPOT {tpot:.2f} ms/token")


def run_up(args: argparse.Namespace, parser=None) -> int:
    with_default_model(args)
    t0 = time.perf_counter()
    print("starting prefill, decode and router services ...", flush=True)
    try:
        children = start_cluster(args, args.port, args.grpc_port)
    except StartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        http = children[-1].address
        print(f"cluster ready in {time.perf_counter() - t0:.1f} s")
        for child in children[:-1]:
            print(f"  {child.kind:<8}: {child.address} (gRPC)")
        print(f"  router  : http://{http}/v1  (OpenAI API; /health, /metrics)", flush=True)
        from services.cli import tokenizer_from_args
        from engine.model.tokenizer import NoTokenizer

        if args.demo and isinstance(tokenizer_from_args(args), NoTokenizer):
            print("  demo    : skipped (the model has no tokenizer; send token ids)")
        elif args.demo:
            # Requests through the whole path (router → prefill group → KV transfer → decode
            # group) before serving: proof that the cluster works, with its timings.
            try:
                run_demo(http, args)
            except RuntimeError as e:
                print(f"error: the demo request failed: {e}; stopping", file=sys.stderr)
                return 1
        print(f"  try     : curl http://{http}/v1/completions -H 'Content-Type: application/json' "
              f"-d '{{\"model\": \"{served_name(args)}\", \"prompt\": \"Hello\", \"max_tokens\": 8}}'")
        print("Ctrl-C stops every service.", flush=True)
        while not stop.wait(1.0):
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                print(f"error: the {dead[0].kind} service exited ({dead[0].proc.returncode}); stopping",
                      file=sys.stderr)
                return 1
    finally:
        stop_cluster(children)
        print("stopped.", flush=True)
    return 0


def run_generate(args: argparse.Namespace, parser=None) -> int:
    from services.cli import print_generation, tokenizer_from_args

    with_default_model(args)
    body = {"model": served_name(args), "max_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_p": args.top_p, "ignore_eos": args.ignore_eos}
    if args.top_k:
        body["top_k"] = args.top_k
    if args.seed is not None:
        body["seed"] = args.seed
    if args.prompt_ids is not None:
        try:
            body["prompt"] = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            parser.error(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}")
    else:
        body["prompt"] = args.prompt
    try:
        children = start_cluster(args, 0, None, quiet=True)
    except StartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        try:
            ids, ttft, tpot = stream_completion(children[-1].address, body, api_key_of(args))
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print_generation(args, tokenizer_from_args(args), ids, ttft, tpot)
        return 0
    finally:
        stop_cluster(children)
