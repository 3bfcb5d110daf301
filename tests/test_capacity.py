"""Decode capacity planning (engine/cache/capacity.py) and `cpserve plan`."""

import argparse
import json

import pytest

from engine.cache.capacity import (
    build_parser_plan,
    bytes_per_value,
    index_key_bytes,
    latent_entry_bytes,
    plan_capacity,
    run_plan,
)

GLM = dict(entry_bytes_per_layer=576, layers=78, index_bytes_per_layer=132, indexer_layers=21)


@pytest.mark.parametrize("dcp, factor", [(2, 1.89), (4, 3.41), (8, 5.69)])
def test_glm_fp8_copied_capacity_factor(dcp, factor):
    plan = plan_capacity(**GLM, dcp=dcp, indexer="copied", tokens=None)
    assert plan.entry_bytes == 44_928 and plan.index_bytes == 2_772
    assert round(plan.capacity_factor, 2) == factor
    assert round(plan.ceiling, 1) == 17.2


def test_glm_fp8_bytes_per_token_at_c8():
    copied = plan_capacity(**GLM, dcp=8, indexer="copied", tokens=None)
    split = plan_capacity(**GLM, dcp=8, indexer="split", tokens=None)
    assert copied.bytes_per_token_per_rank_rounded == 8_388
    assert split.bytes_per_token_per_rank == 5_962.5
    assert split.bytes_per_token_per_rank_rounded == 5_963
    assert split.ceiling is None
    assert split.capacity_factor == pytest.approx(8.0)


def test_no_index_has_no_ceiling():
    plan = plan_capacity(576, 61, 0, 0, dcp=4, indexer="copied", tokens=None)
    assert plan.ceiling is None and plan.capacity_factor == pytest.approx(4.0)


def test_busiest_rank_bytes():
    plan = plan_capacity(10, 1, 3, 1, dcp=4, indexer="copied", tokens=9)
    assert plan.bytes_per_rank == 3 * 10 + 9 * 3  # rank 0 holds tokens 0, 4, 8
    split = plan_capacity(10, 1, 3, 1, dcp=4, indexer="split", tokens=9)
    assert split.bytes_per_rank == 3 * 13


def test_fp8_convention():
    assert [bytes_per_value(d) for d in ("fp32", "bf16", "fp8")] == [4, 2, 1]
    assert latent_entry_bytes(512, 64, "fp8") == 576
    assert latent_entry_bytes(512, 64, "bf16") == 1152
    assert index_key_bytes(128, "fp8") == 132
    assert index_key_bytes(128, "fp32") == 512
    with pytest.raises(ValueError, match="kv_dtype"):
        bytes_per_value("int4")


def test_collectives():
    shape = dict(num_heads=8, kv_lora_rank=16, rope_dim=4, hidden_size=32, index_topk=5)
    plan = plan_capacity(**GLM, dcp=4, indexer="split", tokens=None, **shape)
    by_name = {c.name: c for c in plan.collectives}
    assert by_name["query heads"].bytes_in == 8 / 4 * 20 * 4
    assert by_name["query heads"].bytes_sent == 3 * 160
    assert by_name["output+LSE"].bytes_in == 8 * (16 * 4 + 4)
    assert by_name["index candidates"].bytes_in == 5 * 8
    assert by_name["index candidates"].num_layers == 21
    assert by_name["o_proj hidden"].bytes_sent == 2 * 3 / 4 * 128
    assert "LSE" not in by_name

    ag_rs = plan_capacity(**GLM, dcp=4, indexer="copied", tokens=None, exchange="ag_rs",
                          replicate_q_proj=True, **shape)
    names = [c.name for c in ag_rs.collectives]
    assert names == ["LSE", "partial output", "o_proj hidden", "MLP hidden"]
    assert plan_capacity(**GLM, dcp=1, indexer="split", tokens=None, **shape).collectives == ()


@pytest.mark.parametrize(
    "kwargs, name",
    [(dict(dcp=0), "dcp"), (dict(indexer="both"), "indexer"), (dict(tokens=-1), "tokens"),
     (dict(layers=0), "layers"), (dict(indexer_layers=99), "indexer_layers")],
)
def test_bad_input_names_the_argument(kwargs, name):
    args = dict(GLM, dcp=2, indexer="copied", tokens=None) | kwargs
    with pytest.raises(ValueError, match=name):
        plan_capacity(**args)


def parse(argv):
    parser = argparse.ArgumentParser(prog="cpserve")
    build_parser_plan(parser.add_subparsers(dest="command"))
    return parser.parse_args(["plan", *argv])


RAW = ["--entry-bytes", "576", "--layers", "78", "--index-bytes", "132", "--indexer-layers", "21"]


def test_cli_raw_json(capsys):
    args = parse([*RAW, "--dcp", "8", "--indexer", "copied", "--tokens", "1000", "--json",
                  "--num-heads", "64", "--kv-lora-rank", "512", "--rope-dim", "64"])
    assert args.func is run_plan
    assert run_plan(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["bytes_per_token_per_rank"] == 8_388
    assert round(out["capacity_factor"], 2) == 5.69
    assert round(out["ceiling"], 1) == 17.2
    assert out["bytes_per_rank"] == 125 * 44_928 + 1000 * 2_772
    assert [c["name"] for c in out["collectives"]] == ["query heads", "output+LSE"]


def test_cli_raw_json_split_has_null_ceiling(capsys):
    run_plan(parse([*RAW, "--dcp", "8", "--indexer", "split", "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert out["ceiling"] is None
    assert out["bytes_per_token_per_rank_rounded"] == 5_963
    assert out["collectives"] == []


def test_cli_table(capsys):
    run_plan(parse([*RAW, "--dcp", "4", "--indexer", "copied", "--tokens", "4096",
                    "--num-heads", "64", "--kv-lora-rank", "512", "--rope-dim", "64",
                    "--hidden-size", "6144"]))
    out = capsys.readouterr().out
    assert "3.41" in out and "17.2" in out and "output+LSE" in out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--dcp", "2", "--indexer", "copied"], "--entry-bytes"),
        (["--entry-bytes", "576", "--dcp", "2", "--indexer", "copied"], "--layers"),
        (["--entry-bytes", "576", "--layers", "3", "--index-bytes", "4", "--dcp", "2",
          "--indexer", "copied"], "--indexer-layers"),
        ([*RAW, "--kv-dtype", "fp8", "--dcp", "2", "--indexer", "copied"], "--kv-dtype"),
        (["--model", "tiny", "--layers", "3", "--dcp", "2", "--indexer", "copied"], "--layers"),
        ([*RAW, "--dcp", "0", "--indexer", "copied"], "--dcp"),
        ([*RAW, "--dcp", "2", "--indexer", "both"], "--indexer"),
    ],
)
def test_cli_bad_flags_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as excinfo:
        run_plan(parse(argv))
    assert excinfo.value.code == 2
    assert flag in capsys.readouterr().err


def test_cli_model_mode_reads_the_config(capsys):
    config = pytest.importorskip("engine.model.config")
    cfg = config.ModelConfig.load("tiny")
    run_plan(parse(["--model", "tiny", "--kv-dtype", "fp8", "--dcp", "2", "--indexer", "copied",
                    "--json"]))
    out = json.loads(capsys.readouterr().out)
    assert out["entry_bytes"] == cfg.num_layers * cfg.latent_dim
    assert out["index_bytes"] == cfg.num_indexer_layers * (cfg.index_head_dim + 4)
    assert out["dcp"] == 2 and out["collectives"]


def test_cli_unknown_model_names_the_flag(capsys, tmp_path):
    pytest.importorskip("engine.model.config")
    with pytest.raises(SystemExit):
        run_plan(parse(["--model", str(tmp_path / "missing"), "--dcp", "2", "--indexer", "split"]))
    assert "--model" in capsys.readouterr().err
