"""The trained demo model (engine/model/demo, written by scripts/train_demo.py): a release folder
transformers loads, whose greedy tokens the reference engine reproduces, and which answers what
it was trained to answer (so random or stale weights fail here)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
import torch

from cpserve import demo_text
from engine.model.tiny import DEMO_DIR, resolve_model_dir
from tests.test_reference import rel_err


@pytest.fixture(scope="module")
def ref():
    from engine.reference import ReferenceEngine

    return ReferenceEngine("demo", dtype="fp32", record_logits=True)


def chat_ids(tok, content: str) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": content}])


def count_with(tok):
    return lambda text: len(tok.hf.encode(text, add_special_tokens=False))


def test_release_folder_is_the_training_scripts_output():
    assert resolve_model_dir("demo") == DEMO_DIR
    names = {p.name for p in DEMO_DIR.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "train_log.json"} <= names, names
    assert sum(p.stat().st_size for p in DEMO_DIR.iterdir()) <= 20 * 2**20
    log = json.loads((DEMO_DIR / "train_log.json").read_text())
    assert hashlib.sha256((DEMO_DIR / "model.safetensors").read_bytes()).hexdigest() == log["model_safetensors_sha256"]
    cfg = json.loads((DEMO_DIR / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["rope_parameters"]["rope_type"] == "yarn"
    assert cfg["rope_parameters"]["original_max_position_embeddings"] == max(p[1] for p in log["phases"])


def test_tokenizer_has_chat_template_and_bos():
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(DEMO_DIR))
    text = hf.apply_chat_template([{"role": "user", "content": "Hi!"}], add_generation_prompt=True, tokenize=False)
    ids = hf.encode(text, add_special_tokens=False)
    assert ids[0] == hf.bos_token_id and text == "<bos><|user|>\nHi!\n<|assistant|>\n"
    assert [hf.convert_ids_to_tokens(i) for i in ids[1:2]] == ["<|user|>"]  # one special token
    assert hf.decode(hf.encode("The pass key is 71432.", add_special_tokens=False)) == "The pass key is 71432."


@pytest.mark.timeout(300)
def test_transformers_and_reference_give_the_same_greedy_tokens(ref):
    """Greedy tokens (and every step's logits) of transformers' DeepseekV3ForCausalLM on the
    demo checkpoint equal the reference engine's, for a chat turn and a 1,500-token pass-key
    prompt (yarn rotary on both)."""
    from transformers import AutoModelForCausalLM

    from engine.model.sampler import SamplingParams

    hf = AutoModelForCausalLM.from_pretrained(str(DEMO_DIR), dtype=torch.float32).eval()
    tok = ref.tokenizer
    task = demo_text.passkey_task(random.Random(3), 1500, 0.3, count_with(tok))
    for prompt, n in ((chat_ids(tok, "Tell me a story about a cat."), 32), (chat_ids(tok, task.prompt), 12)):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, eos_token_id=None, pad_token_id=2)
        hf_ids = out.sequences[0, len(prompt):].tolist()
        seq = ref.generate([prompt], SamplingParams(max_new_tokens=n, stop_token_ids=()))[0]
        assert seq.output_ids == hf_ids
        for ours, theirs in zip(seq.logits, out.logits):
            assert rel_err(ours, theirs[0]) < 1e-4


def test_demo_model_answers_what_it_was_trained_on(ref):
    """What `make up` shows comes from training, not from random weights: the self-description
    word for word, and a story made of the corpus's words and sentences."""
    import re

    from engine.model.sampler import SamplingParams

    tok = ref.tokenizer
    who, story = ref.generate([chat_ids(tok, "Who are you?"), chat_ids(tok, "Tell me a short story about a fox.")],
                              SamplingParams(max_new_tokens=120))
    assert tok.decode(who.output_ids) == demo_text.SELF
    text = tok.decode(story.output_ids)
    corpus = " ".join(demo_text.story(random.Random(i)) for i in range(2000))
    vocabulary = set(re.findall(r"[A-Za-z]+", corpus))
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 8 and set(words) <= vocabulary, text
    assert story.finish_reason == "stop"  # it ends its answer with EOS


def test_demo_model_retrieves_the_pass_key_up_asks(ref):
    """Retrieval is learnt, not guessed: `cpserve up`'s own pass-key question (~3,000 tokens, the
    key at 40 %) gets exactly the needle's number (a 5-digit number a guessing model hits once
    in 30,000; the earlier weights, which had not learnt to copy, failed here). Key–value
    lookup is only partly learnt (README, "The demo model")."""
    from engine.model.sampler import SamplingParams
    from services.up import demo_passkey

    tok = ref.tokenizer
    task = demo_passkey(tok)
    seq = ref.generate([chat_ids(tok, task.prompt)], SamplingParams(max_new_tokens=16))[0]
    assert demo_text.is_right(task, tok.decode(seq.output_ids)), (task.answer, tok.decode(seq.output_ids))


def test_cpserve_up_serves_the_demo_model_by_default(tmp_path):
    from services.up import cluster_args, served_name, with_default_model

    assert with_default_model(cluster_args([])).model == "demo"
    assert served_name(with_default_model(cluster_args([]))) == "demo"
    assert with_default_model(cluster_args(["--model", "tiny"])).model == "tiny"
    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill:\n  model: /models/GLM\ndecode:\n  model: /models/GLM\n")
    assert with_default_model(cluster_args(["--config", str(cfg)])).model is None  # the config's model stays


def test_is_right_takes_exactly_the_needle():
    t = demo_text.Task("passkey", "", "The pass key is 12345.", "12345", 0.5)
    assert demo_text.is_right(t, "The pass key is 12345.")
    assert not demo_text.is_right(t, "The pass key is 12346.")
    assert not demo_text.is_right(t, "The pass key is 12345 or 54321.")
    assert not demo_text.is_right(t, "")
