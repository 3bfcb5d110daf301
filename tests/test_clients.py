"""Real clients against one `cpserve up` cluster: lm-evaluation-harness (`local-completions`,
`local-chat-completions`) and guidellm, run as their own CLIs, offline, on the task YAML and
data in tests/data/clients and the tiny model's tokenizer folder.

Each run's own output is read back: the number of samples or requests, zero errors (in the
client's report and in the router's outcome counters: guidellm exits 0 even when every request
fails, lm-eval patches a null answer with a placeholder), and the numbers themselves — lm-eval's
loglikelihoods and greedy generations equal the reference engine's on the same token ids."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from engine.model.sampler import SamplingParams
from engine.model.tiny import make_tiny
from engine.reference import ReferenceEngine
from services.up import cluster_args, start_cluster, stop_cluster

pytestmark = pytest.mark.slow
DATA = Path(__file__).parent / "data" / "clients"
MODEL = "tiny"
RUN_TIMEOUT_S = 120  # a run took 9-21 s here (mostly imports); the margin is for a loaded machine
LIMIT = 4  # documents per lm-eval run
MAX_GEN_TOKS = 8  # cpserve_gen.yaml's generation_kwargs
GUIDELLM_REQUESTS, GUIDELLM_OUTPUT_TOKENS = 8, 32


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("clients") / "tiny")


@pytest.fixture(scope="module")
def cluster(model_dir):
    """The router's base URL (cpserve up's default layout: prefill CP 2, decode DCP 2)."""
    children = start_cluster(cluster_args(["--model", str(model_dir), "--served-model-name", MODEL]), 0, None,
                             quiet=True)
    yield f"http://{children[-1].address}"
    stop_cluster(children)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir):
    return ReferenceEngine(str(model_dir))


def client_env(tmp: Path) -> dict[str, str]:
    """No network and no proxy; Hugging Face caches under ``tmp``."""
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HOME=str(tmp / "hf"),
               NO_PROXY="*", no_proxy="*")
    return env


def run_client(argv: list[str], cwd: Path, tmp: Path) -> float:
    """``python -m argv...`` with the client environment; its wall time in seconds."""
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-m", *argv], cwd=cwd, env=client_env(tmp), capture_output=True, text=True,
                       timeout=RUN_TIMEOUT_S)
    assert p.returncode == 0, f"{argv[0]} exited {p.returncode}:\n{(p.stdout + p.stderr)[-4000:]}"
    return time.monotonic() - t0


def outcomes(base: str) -> Counter:
    """The router's finished generations by outcome (one per prompt and choice)."""
    text = httpx.get(f"{base}/metrics", trust_env=False).text
    found = re.findall(r'^cpserve_router_requests_total\{status="(\w+)"\} (\S+)$', text, re.M)
    assert found, "the router exports no cpserve_router_requests_total"
    return Counter({status: int(float(v)) for status, v in found})


def served(base: str, before: Counter) -> dict[str, int]:
    """Outcomes since ``before``, zeros left out."""
    after = outcomes(base)
    return {k: after[k] - before[k] for k in after if after[k] != before[k]}


def lm_eval(base: str, tmp: Path, model: str, endpoint: str, task: str, *args: str, **model_args) -> tuple[list, dict]:
    """One `lm-eval run` from the data folder (the YAMLs' data_files are relative to it); its
    samples (by doc id) and results JSON."""
    out = tmp / "out"
    # max_retries=1: a failed request aborts the run instead of being retried out of sight
    margs = ",".join(f"{k}={v}" for k, v in {"model": MODEL, "base_url": f"{base}{endpoint}",
                                             "max_retries": 1, **model_args}.items())
    secs = run_client(["lm_eval", "run", "--model", model, "--model_args", margs, "--tasks", task,
                       "--include_path", str(DATA), "--limit", str(LIMIT), "--output_path", str(out),
                       "--log_samples", *args], DATA, tmp)
    (results,) = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    (samples_file,) = out.rglob(f"samples_{task}_*.jsonl")
    samples = sorted((json.loads(line) for line in samples_file.read_text().splitlines()), key=lambda s: s["doc_id"])
    assert results["n-samples"][task]["effective"] == LIMIT and len(samples) == LIMIT
    print(f"\nlm-eval {model} {task} {' '.join(args)}: {len(samples)} samples in {secs:.1f} s")
    return samples, results


def greedy_text(reference, tokenizer, prompt_ids: list[int]) -> str:
    """The reference's greedy continuation as lm-eval reports it: cut at the task's stop string."""
    seq = reference.generate([prompt_ids], SamplingParams(max_new_tokens=MAX_GEN_TOKS))[0]
    return tokenizer.decode(seq.output_ids, skip_special_tokens=True).split("\n")[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_multiple_choice_loglikelihoods_equal_the_reference(cluster, model_dir, tokenizer, reference,
                                                                       tmp_path, batch_size):
    """local-completions sends `max_tokens: 1, logprobs: 1, echo: true` with token-id prompts
    (batch_size of them per request) and sums the echoed prompt logprobs of each choice."""
    before = outcomes(cluster)
    samples, results = lm_eval(cluster, tmp_path, "local-completions", "/v1/completions", "cpserve_mc",
                               "--batch_size", str(batch_size), tokenizer=model_dir)
    choices = sum(len(s["resps"]) for s in samples)
    assert choices == 4 * LIMIT
    assert served(cluster, before) == {"ok": choices}  # one generation per prompt, none failed
    print(f"  {choices} prompts, {batch_size} a request, all ok at the router")
    assert 0 <= results["results"]["cpserve_mc"]["acc,none"] <= 1
    for s in samples:
        for args, ((loglik, is_greedy),) in zip(s["arguments"].values(), s["resps"]):
            context, continuation = args["arg_0"], args["arg_1"]
            ctx = tokenizer(context, add_special_tokens=False).input_ids  # as lm-eval encodes them
            whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
            seq = reference.generate([whole], SamplingParams(max_new_tokens=1, stop_token_ids=(), prompt_logprobs=1))[0]
            scored = seq.prompt_logprobs()[len(ctx) - 1:]  # entry j scores prompt token j + 1
            assert len(scored) == len(whole) - len(ctx) > 0
            assert float(loglik) == pytest.approx(sum(e.logprob for e in scored), abs=1e-4), (s["doc_id"], continuation)
            assert (is_greedy == "True") == all(e.top_ids[0] == t for e, t in zip(scored, whole[len(ctx):]))


@pytest.mark.timeout(300)
def test_lm_eval_generate_until_through_completions(cluster, model_dir, tokenizer, reference, tmp_path):
    before = outcomes(cluster)
    samples, _ = lm_eval(cluster, tmp_path, "local-completions", "/v1/completions", "cpserve_gen",
                         tokenizer=model_dir)
    assert served(cluster, before) == {"ok": LIMIT}
    print(f"  {LIMIT} requests, all ok at the router")
    for s in samples:
        (args,) = s["arguments"].values()
        prompt_ids = tokenizer(args["arg_0"], add_special_tokens=False).input_ids  # what lm-eval sends
        assert s["resps"] == [[greedy_text(reference, tokenizer, prompt_ids)]], s["doc_id"]


@pytest.mark.timeout(300)
def test_lm_eval_chat_generate_until(cluster, tokenizer, reference, tmp_path):
    """local-chat-completions with --apply_chat_template sends the messages; the router renders
    them with the model's template."""
    before = outcomes(cluster)
    samples, _ = lm_eval(cluster, tmp_path, "local-chat-completions", "/v1/chat/completions", "cpserve_gen",
                         "--apply_chat_template")
    assert served(cluster, before) == {"ok": LIMIT}
    print(f"  {LIMIT} requests, all ok at the router")
    for s in samples:
        (args,) = s["arguments"].values()
        messages = json.loads(args["arg_0"][0])
        assert messages[-1]["role"] == "user"
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt_ids = tokenizer(text, add_special_tokens=False).input_ids  # the template writes <bos> itself
        assert s["resps"] == [[greedy_text(reference, tokenizer, prompt_ids)]], s["doc_id"]


@pytest.mark.timeout(300)
def test_guidellm_synchronous_streaming(cluster, model_dir, tokenizer, tmp_path):
    """guidellm streams chat completions with `stream_options.continuous_usage_stats` and reads
    the token counts from usage; it exits 0 whatever happened, so its report is checked."""
    before = outcomes(cluster)
    report_path = tmp_path / "report.json"
    secs = run_client(["guidellm", "run", "--backend", f"kind=openai_http,target={cluster},model={MODEL}",
                       "--profile", "kind=synchronous",
                       "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
                       "--data", f"kind=synthetic_text,prompt_tokens=256,output_tokens={GUIDELLM_OUTPUT_TOKENS}",
                       "--tokenizer", f"kind=hf_auto,model={model_dir}",
                       "--output", f"kind=json,path={report_path}", "--disable-console"], tmp_path, tmp_path)
    (bench,) = json.loads(report_path.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    print(f"\nguidellm synchronous streaming: {totals} in {secs:.1f} s")
    assert totals == {"successful": GUIDELLM_REQUESTS, "errored": 0, "incomplete": 0, "total": GUIDELLM_REQUESTS}
    assert served(cluster, before) == {"ok": GUIDELLM_REQUESTS}
    for r in bench["requests"]["successful"]:
        body = json.loads(r["request_args"])["body"]
        assert body["stream"] and body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # usage as the router reports it: the rendered chat prompt, and every requested token (ignore_eos)
        messages = [{"role": m["role"], "content": "".join(p["text"] for p in m["content"])} for m in body["messages"]]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert r["prompt_tokens"] == len(tokenizer(text, add_special_tokens=False).input_ids)
        assert r["output_tokens"] == GUIDELLM_OUTPUT_TOKENS and r["time_to_first_token_ms"] > 0
