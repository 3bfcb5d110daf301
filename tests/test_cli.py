"""`cpserve make-tiny`, `cpserve reference` and the tokenizers, as a user runs them."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cpserve.cli import main
from engine.model.sampler import SamplingParams
from engine.model.tiny import MODEL_TYPES, resolve_model_dir
from engine.model.tokenizer import NoTokenizer, Tokenizer, load_tokenizer
from engine.reference import ReferenceEngine

CPSERVE = Path(sys.executable).with_name("cpserve")  # the console script pip installed


def _digests(path: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_make_tiny_is_deterministic_and_loads_in_transformers(tmp_path, capsys, model_type):
    from transformers import AutoModelForCausalLM

    for name in ("a", "b"):
        assert main(["make-tiny", str(tmp_path / name), "--type", model_type]) == 0
    assert str(tmp_path / "a") in capsys.readouterr().out
    assert _digests(tmp_path / "a") == _digests(tmp_path / "b")
    assert main(["make-tiny", str(tmp_path / "c"), "--type", model_type, "--seed", "1"]) == 0
    assert _digests(tmp_path / "c")["model.safetensors"] != _digests(tmp_path / "a")["model.safetensors"]

    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["model_type"] == model_type
    # Loading must see every tensor under transformers' names: a missing one would be
    # initialised at random (and reported), an unexpected one reported.
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "a", dtype=torch.float32,
                                                    output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    hf.eval()
    length = 4 * config.get("index_topk", 16)  # far longer than the sparse selection keeps
    prompt = torch.randint(3, config["vocab_size"], (length,), generator=torch.Generator().manual_seed(5)).tolist()
    ours = ReferenceEngine(str(tmp_path / "a"), record_logits=True).generate(
        [prompt], SamplingParams(max_new_tokens=1, stop_token_ids=()))[0].logits[0]
    with torch.no_grad():
        theirs = hf(torch.tensor([prompt])).logits[0, -1]
    assert float((ours - theirs).abs().max() / theirs.abs().max()) < 1e-4


def test_default_tiny_model_is_a_sparse_moe_glm(tmp_path, monkeypatch):
    monkeypatch.setenv("CPSERVE_CACHE", str(tmp_path / "cache"))
    path = resolve_model_dir("tiny")
    assert path.is_relative_to(tmp_path / "cache")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa"
    assert "shared" in config["indexer_types"] and "full" in config["indexer_types"]
    assert config["n_routed_experts"] > 1 and "sparse" in config["mlp_layer_types"]
    assert config["index_topk"] <= 64  # well below the prompts tests and benches use
    assert resolve_model_dir("tiny") == path  # made once, then reused


def test_reference_cli_json(tmp_path):
    """The console script, run as a user runs it, prints one JSON object with the engine's tokens."""
    main(["make-tiny", str(tmp_path / "m")])
    argv = ["reference", "--model", str(tmp_path / "m"), "--prompt-ids", "5,6,7,8,9,10",
            "--max-new-tokens", "5", "--ignore-eos", "--json"]
    done = subprocess.run([str(CPSERVE), *argv], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result) == {"output_ids", "text", "ttft_ms", "tpot_ms"}
    expected = ReferenceEngine(str(tmp_path / "m")).generate(
        [[5, 6, 7, 8, 9, 10]], SamplingParams(max_new_tokens=5, stop_token_ids=()))[0].output_ids
    assert result["output_ids"] == expected
    assert result["text"] == load_tokenizer(tmp_path / "m").decode(expected)
    assert result["ttft_ms"] > 0 and result["tpot_ms"] > 0


def test_reference_cli_sampling_is_seeded(tmp_path, capsys):
    main(["make-tiny", str(tmp_path / "m")])
    capsys.readouterr()
    runs = []
    for seed in ("3", "3", "4"):
        argv = ["reference", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-new-tokens", "12",
                "--temperature", "1.0", "--top-p", "0.95", "--top-k", "100", "--seed", seed, "--ignore-eos",
                "--json"]
        assert main(argv) == 0
        runs.append(json.loads(capsys.readouterr().out)["output_ids"])
    assert runs[0] == runs[1] and runs[0] != runs[2]


@pytest.mark.parametrize("argv,field", [
    (["--prompt-ids", "5,x"], "--prompt-ids"),
    (["--prompt-ids", "5", "--max-new-tokens", "0"], "max_new_tokens"),
    (["--prompt-ids", "5,99999"], "prompt"),
    (["--prompt-ids", ","], "prompt"),  # no ids ("" as text is BOS alone: a valid prompt, as in vLLM)
])
def test_reference_cli_bad_input_names_the_field(tmp_path, capsys, argv, field):
    main(["make-tiny", str(tmp_path / "m")])
    capsys.readouterr()
    try:
        code = main(["reference", "--model", str(tmp_path / "m"), *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and field in err and "Traceback" not in err


def test_reference_cli_unknown_model_dir(tmp_path, capsys):
    assert main(["reference", "--model", str(tmp_path / "nope"), "--prompt-ids", "5"]) == 2
    assert "model:" in capsys.readouterr().err


def _word_tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate("the cat sat on a mat .".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


def test_checkpoint_tokenizer_json_is_used(tmp_path, capsys):
    main(["make-tiny", str(tmp_path / "m")])
    (tmp_path / "m" / "tokenizer_config.json").unlink()
    _word_tokenizer(tmp_path / "m")
    tok = load_tokenizer(tmp_path / "m")
    assert isinstance(tok, Tokenizer)
    ids = tok.encode("the cat sat on a mat")
    assert ids == [2, 3, 4, 5, 6, 7]
    assert tok.decode(ids) == "the cat sat on a mat"

    capsys.readouterr()
    assert main(["reference", "--model", str(tmp_path / "m"), "--prompt", "the cat sat",
                 "--max-new-tokens", "4", "--ignore-eos", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = ReferenceEngine(str(tmp_path / "m")).generate(
        [[2, 3, 4]], SamplingParams(max_new_tokens=4, stop_token_ids=()))[0].output_ids
    assert result["output_ids"] == expected and result["text"] == tok.decode(expected)


def test_checkpoint_without_tokenizer_refuses_text_not_ids(tmp_path, capsys):
    """No silent byte fallback: text is refused with a message that says why; ids still work."""
    main(["make-tiny", str(tmp_path / "m")])
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "m" / name).unlink()
    assert isinstance(load_tokenizer(tmp_path / "m"), NoTokenizer)
    capsys.readouterr()
    assert main(["reference", "--model", str(tmp_path / "m"), "--prompt", "hello", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "no tokenizer" in err and "Traceback" not in err
    assert main(["reference", "--model", str(tmp_path / "m"), "--prompt-ids", "5,6,7", "--max-new-tokens", "2",
                 "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["output_ids"]) == 2


def test_tiny_tokenizer_keeps_byte_ids_and_loads_with_auto_tokenizer():
    """The embedded models' tokenizer folder: ids 0 <bos>, 1 <eos>, 2 <pad>, 3 + b for byte b; BOS
    added as tokenizer_config.json says; a chat template; loadable by any AutoTokenizer user."""
    from transformers import AutoTokenizer

    from engine.model.tiny import resolve_model_dir

    tok = load_tokenizer("tiny")
    text = "long context · 长上下文 ✓"
    ids = tok.encode(text)
    assert ids == [0] + [b + 3 for b in text.encode()]
    assert tok.decode(ids) == text
    assert tok.decode([tok.eos_token_id, *ids[1:], 300]) == text  # specials and unused ids drop
    hf = AutoTokenizer.from_pretrained(str(resolve_model_dir("tiny")))
    assert hf(text)["input_ids"] == ids and len(hf) == 320
    assert (hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (0, 1, 2)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rendered = hf.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert rendered == "<bos><|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\n"
    assert tok.apply_chat_template(chat) == [0] + [b + 3 for b in rendered[len("<bos>"):].encode()]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_demo_hands_the_cp_prefill_kv_to_the_dcp_decode_over_mooncake():
    done = subprocess.run([str(CPSERVE), "demo", "--max-new-tokens", "4"], capture_output=True, text=True,
                          timeout=280)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    m = re.search(r"prefill CP=2 .*\(matches the reference\).*? ([\d.]+) MB of KV written to the decode ranks",
                  done.stdout)
    assert m and float(m.group(1)) > 0, done.stdout
    assert "equal to the reference" in done.stdout


def test_cpserve_up_demo_uses_the_model_name_of_its_config(tmp_path):
    from services.up import cluster_args, served_name

    cfg = tmp_path / "c.yaml"
    cfg.write_text("prefill:\n  model: /models/GLM\nrouter:\n  model: /models/GLM\n  served_model_name: glm\n")
    assert served_name(cluster_args(["--config", str(cfg)])) == "glm"
    cfg.write_text("prefill:\n  model: /models/GLM\ndecode:\n  model: /models/GLM\n")
    assert served_name(cluster_args(["--config", str(cfg)])) == "/models/GLM"
    assert served_name(cluster_args(["--config", str(cfg), "--served-model-name", "x"])) == "x"
    assert served_name(cluster_args([])) == "tiny"


@pytest.mark.parametrize("argv", [["up"], ["serve", "prefill"], ["prefill"]])
def test_cp_attention_is_a_flag_of_every_command_that_starts_prefill(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"--cp-attention \{allgather,ring\}", out)
    assert re.search(r"--cp-ring-mode \{auto,pass_kv,pass_q\}", out)


@pytest.mark.timeout(120)
def test_cpserve_up_refuses_a_ring_with_layer_split_naming_the_field(capsys):
    """The prefill service `up` starts refuses the combination before loading the model; `up`
    stops the others and says why in one line, without a traceback."""
    code = main(["up", "--model", "tiny", "--cp-attention", "ring", "--layer-split", "--no-demo"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert re.search(r"^error: the prefill service did not start \(exit 2\): prefill\.layer_split: ", err, re.M), err
