"""Checkpoints as releases publish them: FP8 block weights, shards, MTP layers, kimi_k2, bf16 GLM."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct

import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig, ModelConfigError
from engine.model.loader import CheckpointError, load_model, read_header, resolve_dtype
from engine.model.sampler import SamplingParams
from engine.reference import ReferenceEngine
from tests.release_fixtures import bf16_glm_release, fp8_release


def rel_err(a, b):
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def prompt(n, seed=0, vocab=300):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8") / "release"
    return path, fp8_release(path)


def test_fp8_fixture_is_in_release_format(fp8):
    path, _ = fp8
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert index[name] != index[name + "_scale_inv"]  # weight and scale in different shards
    headers = {}
    for f in set(index.values()):
        headers.update(read_header(path / f))
    assert headers[name].dtype == "F8_E4M3" and headers[name].shape == (576, 320)
    assert headers[name + "_scale_inv"].shape == (5, 3)  # partial blocks in both dimensions
    assert any(k.startswith("model.layers.3.") for k in headers)  # the MTP layer


def test_fp8_release_matches_transformers_on_dequantized_weights(fp8, caplog):
    path, hf = fp8
    with caplog.at_level(logging.INFO, logger="cpserve.loader"):
        eng = ReferenceEngine(str(path), dtype="fp32", record_logits=True)
    assert "multi-token-prediction layer" in caplog.text
    for n, seed in ((9, 1), (40, 2)):
        p = prompt(n, seed)
        out = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=2,
                          output_logits=True, return_dict_in_generate=True)
        seq = eng.generate([p], SamplingParams(max_new_tokens=12, stop_token_ids=()))[0]
        assert seq.output_ids == out.sequences[0, n:].tolist()
        for ours, theirs in zip(seq.logits, out.logits):
            assert rel_err(ours, theirs[0]) < 1e-4


def test_fp8_auto_dtype_is_bf16_and_serves(fp8):
    path, hf = fp8
    assert resolve_dtype("auto", ModelConfig.from_dir(path)) == "bf16"
    eng = ReferenceEngine(str(path), record_logits=True)
    assert eng.dtype == "bf16"
    assert eng.lm.model.layers[0].self_attn.kv_a_proj_with_mqa.weight.dtype == torch.bfloat16
    p = prompt(20, 3)
    seq = eng.generate([p], SamplingParams(max_new_tokens=4, stop_token_ids=()))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([p])).logits[0, -1]
    assert len(seq.output_ids) == 4 and rel_err(seq.logits[0], ref) < 0.1


def test_kimi_k2_is_deepseek_v3(fp8, tmp_path):
    path, hf = fp8
    shutil.copytree(path, tmp_path / "k")
    cfg = json.loads((tmp_path / "k" / "config.json").read_text())
    cfg["model_type"] = "kimi_k2"
    (tmp_path / "k" / "config.json").write_text(json.dumps(cfg))
    assert ModelConfig.from_dir(tmp_path / "k").model_type == "deepseek_v3"
    p = prompt(16, 4)
    seq = ReferenceEngine(str(tmp_path / "k"), dtype="fp32").generate(
        [p], SamplingParams(max_new_tokens=6, stop_token_ids=()))[0]
    out = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert seq.output_ids == out[0, 16:].tolist()


def test_bf16_glm_with_index_sharing(tmp_path, caplog):
    hf = bf16_glm_release(tmp_path / "g")
    with caplog.at_level(logging.INFO, logger="cpserve.loader"):
        eng = ReferenceEngine(str(tmp_path / "g"), dtype="fp32", record_logits=True)
    assert "reuses an earlier layer's index" in caplog.text
    p = prompt(70, 5)  # past index_topk (16): the selection really selects
    seq = eng.generate([p], SamplingParams(max_new_tokens=8, stop_token_ids=()))[0]
    out = hf.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2)
    assert seq.output_ids == out[0, 70:].tolist()
    assert resolve_dtype("auto", eng.cfg) == "bf16"


# ---- refusals, before any tensor data is read ---------------------------------------------------
def _edit_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,pattern", [
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, r"quant_method 'awq' is not supported"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, r"fmt 'e5m2'"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "packing": 1}},
     r"does not know: packing"),
    ({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}, r"activation_scheme 'static'"),
    ({"scoring_func": "softmax"}, r"scoring_func 'softmax' is not implemented"),
    ({"topk_method": "greedy"}, r"topk_method 'greedy' is not implemented"),
    ({"model_type": "qwen3"}, r"model_type 'qwen3' is not supported"),
])
def test_unsupported_config_is_refused_naming_it(fp8, tmp_path, monkeypatch, changes, pattern):
    path = _edit_config(fp8[0], tmp_path / "c", **changes)
    monkeypatch.setattr("engine.model.loader.safe_open", _no_data_reads)
    with pytest.raises(ModelConfigError, match=pattern):
        load_model(path)


def _no_data_reads(*a, **k):
    raise AssertionError("tensor data was opened before the checkpoint was checked")


def test_fp8_weight_without_scale_is_refused(fp8, tmp_path, monkeypatch):
    path = tmp_path / "noscale"
    shutil.copytree(fp8[0], path)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    from safetensors.torch import load_file

    f = path / index["weight_map"].pop(name)
    t = load_file(str(f))
    del t[name]
    save_file(t, str(f))
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    monkeypatch.setattr("engine.model.loader.safe_open", _no_data_reads)
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.q_b_proj\.weight_scale_inv"):
        load_model(path)


def test_bad_header_of_a_multi_gb_checkpoint_is_refused_without_reading_data(fp8, tmp_path, monkeypatch):
    """One mis-shaped entry in a 4 GiB (sparse) shard: refused from the headers alone."""
    path = tmp_path / "big"
    shutil.copytree(fp8[0], path, ignore=shutil.ignore_patterns("*.safetensors", "*.json"))
    shutil.copy(fp8[0] / "config.json", path / "config.json")
    index = json.loads((fp8[0] / "model.safetensors.index.json").read_text())
    headers = {}
    for f in sorted(set(index["weight_map"].values())):
        headers.update(read_header(fp8[0] / f))
    entries, offset = {}, 0
    for name, info in sorted(headers.items()):
        shape = list(info.shape)
        if name == "model.layers.2.self_attn.o_proj.weight":
            shape = [shape[0], shape[1] + 1]
        n = info.nbytes
        entries[name] = {"dtype": info.dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    big = 4 << 30
    header = json.dumps(entries).encode()
    shard = path / "model-00001-of-00001.safetensors"
    with open(shard, "wb") as fh:
        fh.write(struct.pack("<Q", len(header)) + header)
    os.truncate(shard, 8 + len(header) + big)  # a sparse data region of 4 GiB
    (path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: shard.name for n in entries}}))
    monkeypatch.setattr("engine.model.loader.safe_open", _no_data_reads)
    with open("/proc/self/io") as f:
        before = int(next(l for l in f if l.startswith("rchar")).split()[1])
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.o_proj\.weight \(model-00001-of-00001"
                                              r"\.safetensors\) has shape \[320, 129\]"):
        load_model(path)
    with open("/proc/self/io") as f:
        after = int(next(l for l in f if l.startswith("rchar")).split()[1])
    assert after - before < 4 << 20  # headers and config only, not the 4 GiB data region


def test_dtype_flag_on_every_command():
    from cpserve.cli import build_parser
    from services.common.config import ConfigError, load_config

    parser = build_parser()
    for argv in (["reference", "--dtype", "auto", "--prompt", "x"], ["prefill", "--dtype", "fp16", "--prompt", "x"],
                 ["decode", "--dtype", "bf16", "--prompt", "x"], ["up", "--dtype", "bf16"],
                 ["generate", "--dtype", "fp32", "--prompt", "x"],
                 ["serve", "prefill", "--dtype", "fp16"], ["serve", "decode", "--dtype", "auto"]):
        assert parser.parse_args(argv).dtype == argv[argv.index("--dtype") + 1]
    assert load_config("decode").dtype == "auto"
    with pytest.raises(ConfigError, match=r"prefill\.dtype"):
        load_config("prefill", None, {"dtype": "fp8"})


def test_generation_config_eos_list_and_sampling_defaults(tmp_path):
    from engine.model.tiny import make_tiny
    from engine.model.tokenizer import load_tokenizer
    from services.router.params import ModelContext, parse_request

    path = make_tiny(tmp_path / "m", "deepseek_v3")
    p = [5, 6, 7, 8]
    free = ReferenceEngine(str(path)).generate([p], SamplingParams(max_new_tokens=6, stop_token_ids=()))[0].output_ids
    (path / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [free[2], 1], "temperature": 0.6, "top_p": 0.95}))
    cfg = ModelConfig.from_dir(path)
    assert cfg.eos_token_ids == (free[2], 1)
    seq = ReferenceEngine(str(path)).generate([p], SamplingParams(max_new_tokens=6))[0]
    assert seq.output_ids == free[:3] and seq.finish_reason == "stop"  # stopped at the list's first id

    ctx = ModelContext("m", load_tokenizer(path), cfg.vocab_size, cfg.eos_token_ids, cfg.max_position_embeddings,
                       lambda: None, sampling_defaults=cfg.sampling_defaults)
    s = parse_request({"prompt": [5, 6], "max_tokens": 2}, ctx, chat=False).completion.job.sampling
    assert s.temperature == pytest.approx(0.6) and s.top_p == pytest.approx(0.95) and s.top_k == 0
    s = parse_request({"prompt": [5, 6], "max_tokens": 2, "temperature": 0}, ctx, chat=False).completion.job.sampling
    assert s.temperature == 0  # a request's own value wins

    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [99999]}))
    with pytest.raises(ModelConfigError, match="generation_config.json: eos_token_id"):
        ModelConfig.from_dir(path)
    assert ModelConfig.from_dir(path, "none").eos_token_ids == (1,)  # --generation-config none: the file is ignored


def test_plan_reports_the_weights_every_rank_holds(fp8, capsys):
    """`cpserve plan --model DIR` sizes the weights from config.json alone; each figure equals
    what the loader really allocates for that decode rank of an FP8 release, for each dtype."""
    from cpserve.cli import main
    from engine.model.loader import load_model
    from engine.parallel.shard import WeightShard

    path, _ = fp8
    for dtype in ("fp32", "bf16"):
        capsys.readouterr()
        assert main(["plan", "--model", str(path), "--dcp", "2", "--indexer", "copied", "--dtype", dtype,
                     "--json"]) == 0
        weights = json.loads(capsys.readouterr().out)["weights"]
        whole = load_model(path, dtype)
        assert weights["whole_model"]["total"] == sum(t.numel() * t.element_size() for t in whole.state_dict().values())
        for r, planned in enumerate(weights["per_rank"]):
            lm = load_model(path, dtype, shard=WeightShard(r, 2, tp=True))
            assert planned["total"] == sum(t.numel() * t.element_size() for t in lm.state_dict().values())


def test_cpserve_up_passes_the_serving_flags_to_its_services(monkeypatch):
    """`cpserve up --tokenizer … --max-model-len …` reaches the router (and
    --generation-config / --dtype the engines), as the flags `cpserve serve` parses."""
    import services.up as up
    from cpserve.cli import build_parser

    started, told = {}, {}

    class Fake:
        def __init__(self, kind, argv, quiet=False, env=None):
            started[kind] = argv
            self.kind = kind

        def wait_ready(self, timeout):
            return "127.0.0.1:1"

        def settled(self, timeout):
            return True

        def check_starting(self):
            pass

        def tell(self, line):
            told[self.kind] = line

        def stop(self):
            pass

    monkeypatch.setattr(up, "Child", Fake)
    args = up.cluster_args(["--tokenizer", "/tok", "--trust-remote-code", "--chat-template", "/t.jinja",
                            "--generation-config", "none", "--max-model-len", "99", "--dtype", "bf16"])
    up.start_cluster(args, 0)
    parser = build_parser()
    router = parser.parse_args(["serve", "router", *started["router"]])
    assert router.backends_from_stdin and told == {"router": '{"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:1"]}'}
    assert (router.tokenizer, router.trust_remote_code, router.chat_template, router.generation_config,
            router.max_model_len) == ("/tok", True, "/t.jinja", "none", 99)
    for kind in ("prefill", "decode"):
        engine = parser.parse_args(["serve", kind, *started[kind]])
        assert (engine.generation_config, engine.dtype) == ("none", "bf16")


def test_cpserve_up_starts_several_services_behind_one_router(monkeypatch):
    """`--prefill-services 2 --decode-services 3`: five engine services, every address on the
    router's stdin, the router's --pairing flag passed on."""
    import services.up as up

    started, told, port = [], {}, iter(range(1, 100))

    class Fake:
        def __init__(self, kind, argv, quiet=False, env=None):
            started.append((kind, argv))
            self.kind, self.address = kind, f"127.0.0.1:{next(port)}"

        def wait_ready(self, timeout):
            return self.address

        def settled(self, timeout):
            return True

        def check_starting(self):
            pass

        def tell(self, line):
            told[self.kind] = line

        def stop(self):
            pass

    monkeypatch.setattr(up, "Child", Fake)
    args = up.cluster_args(["--prefill-services", "2", "--decode-services", "3", "--pairing", "load",
                            "--no-prefix-cache"])
    children = up.start_cluster(args, 0)
    assert [c.kind for c in children] == ["prefill"] * 2 + ["decode"] * 3 + ["router"]
    assert json.loads(told["router"]) == {"prefill": ["127.0.0.1:1", "127.0.0.1:2"],
                                          "decode": ["127.0.0.1:3", "127.0.0.1:4", "127.0.0.1:5"]}
    router_argv = dict(started)["router"]
    assert router_argv[router_argv.index("--pairing") + 1] == "load"
    assert all("--no-prefix-cache" in argv for kind, argv in started if kind != "router")
