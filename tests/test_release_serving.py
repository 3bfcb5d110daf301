"""A released model served end to end: `cpserve up` (prefill CP 2, decode DCP 2) on the FP8
release fixture, driven with the official openai client. Ground truth: transformers in fp32 on
the dequantized weights, and transformers' own tokenizer (BOS, chat template)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
import torch

from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from services.up import start_cluster, stop_cluster
from tests.release_fixtures import fp8_release, remote_code_tokenizer
from tests.test_cluster_e2e import cluster_args

pytestmark = pytest.mark.slow
NAME = "deepseek-test"
TEXTS = ["Context parallelism splits long prompts across ranks.", "长上下文 naïve café ✓ → the lazy dog"]
CHATS = [
    [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "What is context parallelism?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 长上下文"},
     {"role": "user", "content": [{"type": "text", "text": "Split "}, {"type": "text", "text": "the prompt."}]}],
]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    path = tmp_path_factory.mktemp("release") / "DeepSeek-V3-fixture"
    hf = fp8_release(path)
    from transformers import AutoTokenizer

    return path, hf, AutoTokenizer.from_pretrained(str(path))


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2)
    return out[0, len(ids):].tolist()


def flat(messages):
    """What the template sees: text parts joined (as the router normalises them)."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else "".join(p["text"] for p in m["content"])}
            for m in messages]


def client_for(children) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{children[-1].address}/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(trust_env=False, timeout=300))


EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.mark.timeout(900)
def test_fp8_release_through_cpserve_up_equals_transformers(release):
    path, hf, tok = release
    ref = ReferenceEngine(str(path), dtype="fp32")
    children = start_cluster(cluster_args(model=str(path), dtype="fp32", served_model_name=NAME), 0, None, quiet=True)
    try:
        client = client_for(children)
        model = client.models.list().data[0]
        assert model.id == NAME and model.model_extra["max_model_len"] == 4096  # max_position_embeddings
        for text in TEXTS:
            ids = tok(text)["input_ids"]
            assert ids[0] == tok.bos_token_id == 0  # add_bos_token
            expected = hf_greedy(hf, ids, 10)
            assert ref.generate([ids], SamplingParams(max_new_tokens=10, stop_token_ids=()))[0].output_ids == expected
            r = client.completions.create(model=NAME, prompt=text, max_tokens=10, temperature=0, extra_body=EXTRA)
            assert r.usage.prompt_tokens == len(ids) and r.choices[0].prompt_token_ids == ids
            assert r.choices[0].token_ids == expected
            assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
        for messages in CHATS:
            ids = tok.apply_chat_template(flat(messages), add_generation_prompt=True, tokenize=True, return_dict=False)
            expected = hf_greedy(hf, ids, 8)
            r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                               extra_body=EXTRA)
            assert r.usage.prompt_tokens == len(ids) and r.model_extra["prompt_token_ids"] == ids
            assert r.choices[0].token_ids == expected
            content = r.choices[0].message.content
            assert content == tok.decode(expected, skip_special_tokens=True)
            chunks = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                         stream=True, extra_body=EXTRA))
            assert len([c for c in chunks if c.choices and c.choices[0].finish_reason is None]) == 8  # one per token
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    finally:
        stop_cluster(children)


@pytest.mark.timeout(300)
def test_remote_code_tokenizer_needs_the_flag(release, tmp_path, capsys):
    """Kimi-K2's config and a tokenizer shipped as code: refused without --trust-remote-code
    (naming it), served with it; its Python tokenizer streams through the offset decoder."""
    import shutil

    from cpserve.cli import main
    from engine.model.tokenizer import OffsetDecodeStream, TokenizerError, load_tokenizer

    path, hf, _ = release
    kimi = tmp_path / "kimi"
    shutil.copytree(path, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    remote_code_tokenizer(kimi)
    with pytest.raises(TokenizerError, match="--trust-remote-code"):
        load_tokenizer(kimi)
    capsys.readouterr()
    argv = ["reference", "--model", str(kimi), "--dtype", "fp32", "--prompt", "a世b", "--max-new-tokens", "5",
            "--ignore-eos", "--json"]
    assert main(argv) == 2 and "--trust-remote-code" in capsys.readouterr().err
    assert main(argv + ["--trust-remote-code"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = [0] + [b + 3 for b in "a世b".encode()]  # the shipped tokenizer: BOS, then byte ids
    assert out["output_ids"] == hf_greedy(hf, ids, 5)
    tok = load_tokenizer(kimi, trust_remote_code=True)
    stream = tok.decode_stream()
    assert isinstance(stream, OffsetDecodeStream)
    pieces = [stream.step(i) for i in ids[1:]] + [stream.finish()]
    assert pieces == ["a", "", "", "世", "b", ""]


def _readme_release_commands() -> list[list[str]]:
    import shlex
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = text[text.index("## Serving a released model"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    return [shlex.split(line, comments=True) for line in block.strip().splitlines() if line.strip()]


@pytest.mark.timeout(900)
def test_readme_release_commands_work_as_written(release):
    """The README's "Serving a released model" block, line by line, against the FP8 fixture
    (`/path/to/release` → the fixture, port 8000 → a free one). Its `cpserve up` has no
    --dtype: auto must pick bf16 for the FP8 release (both services log it) and serve text (the
    demo request) and chat (the curl line, sampled with generation_config.json's defaults)."""
    import signal
    import socket
    import subprocess
    import sys
    import threading

    path, _, _ = release
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def fill(argv):
        return [str(path) if a == "/path/to/release" else a.replace("8000", port) for a in argv]

    commands = [fill(c) for c in _readme_release_commands()]
    assert [c[:2] for c in commands] == [["cpserve", "plan"], ["cpserve", "reference"], ["cpserve", "up"],
                                         ["curl", f"http://127.0.0.1:{port}/v1/chat/completions"]]
    cli = [sys.executable, "-m", "cpserve.cli"]
    plan = subprocess.run(cli + commands[0][1:], capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "weights per rank" in plan.stdout, plan.stderr
    ref = subprocess.run(cli + commands[1][1:], capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr
    assert len(json.loads(ref.stdout.strip().splitlines()[-1])["output_ids"]) == 8

    up = subprocess.Popen(cli + commands[2][1:], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    ready = threading.Event()

    def pump():
        for line in up.stdout:
            lines.append(line)
            if "Ctrl-C stops every service" in line:
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert ready.wait(600) and up.poll() is None, "".join(lines[-30:])
        out = "".join(lines)
        for kind in ("prefill", "decode"):  # auto → bf16 on both services
            assert re.search(rf"\[{kind}\] .*serving {kind} on .*dtype bf16", out), out[-3000:]
        assert "demo    :" in out  # the demo request (text, BOS and all) went through
        curl = commands[3]
        body = json.loads(curl[curl.index("-d") + 1])
        r = httpx.post(curl[1], json=body, timeout=120, trust_env=False)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "my-model" and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
            code = up.wait()
    assert code == 0, "".join(lines[-20:])
