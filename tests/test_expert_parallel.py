"""Expert parallelism: placement, the grouped expert compute, the dispatchers on real groups,
per-rank loading (only a rank's slices are read, FP8 included) and what each rank holds.

The end-to-end exactness of every prefill CP / DCP layout with EP on (the default) is in
tests/test_prefill_cp.py and tests/test_decode_dcp.py; here are the cases those don't force:
an expert count the group size does not divide, experts and whole ranks that receive no
tokens, and a rank whose own token share is empty."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.model.config import ModelConfig
from engine.model.experts import LOCAL_EXPERTS, combine, grouped_experts
from engine.model.loader import load_model, weight_bytes
from engine.model.model import MoE
from engine.model.tiny import resolve_model_dir, tiny_config
from engine.parallel.group import WorkerGroup
from engine.parallel.layout import expert_owner_ranges
from engine.parallel.shard import WeightShard


# ---- placement -------------------------------------------------------------------------------
@pytest.mark.parametrize("experts,world", [(8, 1), (8, 2), (8, 3), (8, 4), (3, 4), (256, 7), (0, 2)])
def test_expert_owner_ranges_partition_the_experts(experts, world):
    ranges = expert_owner_ranges(experts, world)
    assert len(ranges) == world
    assert [e for r in ranges for e in r] == list(range(experts))  # contiguous, in rank order
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_expert_owner_ranges_refuse_bad_input():
    with pytest.raises(ValueError, match="num_experts"):
        expert_owner_ranges(-1, 2)
    with pytest.raises(ValueError):
        expert_owner_ranges(8, 0)


# ---- the compute, against a textbook per-token loop -------------------------------------------
def _moe(seed=0, **overrides):
    cfg = ModelConfig.from_dict(tiny_config("deepseek_v3", **overrides))
    g = torch.Generator().manual_seed(seed)
    moe = MoE(cfg)
    for p in list(moe.parameters()) + list(moe.buffers()):
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return cfg, moe


def _textbook(moe, x, idx, w):
    out = []
    for t in range(x.shape[0]):
        acc = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(idx.shape[1]):
            e = int(idx[t, j])
            h = x[t].double()
            g = torch.nn.functional.silu(moe.experts.gate_proj[e].double() @ h) * (moe.experts.up_proj[e].double() @ h)
            acc += w[t, j].double() * (moe.experts.down_proj[e].double() @ g)
        out.append(acc)
    return torch.stack(out)


def test_grouped_experts_equal_the_per_token_loop():
    cfg, moe = _moe()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, cfg.hidden_size, generator=g)
    idx = torch.tensor([[0, 1], [1, 0], [0, 2], [2, 1], [1, 0], [0, 1], [2, 0], [1, 2], [0, 1]])  # experts 3..7 idle
    w = torch.rand(9, 2, generator=g)
    y = grouped_experts(moe.experts, x, idx.reshape(-1), torch.arange(9).repeat_interleave(2))
    assert torch.allclose(combine(y.view(9, 2, -1), w).double(), _textbook(moe, x, idx, w), atol=1e-5)
    # the layer: routed + shared, through the reference dispatcher
    out = LOCAL_EXPERTS(moe, x, idx, w)
    assert torch.allclose(out.double(), _textbook(moe, x, idx, w) + moe.shared_experts(x).double(), atol=1e-5)
    assert grouped_experts(moe.experts, x[:0], idx[:0].reshape(-1)).shape == (0, cfg.hidden_size)


def test_combine_adds_the_slots_in_order():
    """(1e8 + 1) − 1e8 is 0 in fp32 (the 1 rounds away), 1e8 − 1e8 + 1 is 1: the result pins
    the order — slot 0, then 1, then 2 — that every layout shares with the reference."""
    y = torch.tensor([[[1e8], [1.0], [-1e8]]])
    assert combine(y, torch.ones(1, 3)).item() == 0.0


# ---- the dispatchers on real gloo groups -------------------------------------------------------
def _routing(cfg, tokens, hot, seed=2):
    """Each token picks two distinct experts from ``hot`` (the rest receive nothing)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    hot = torch.tensor(hot)
    picks = torch.stack([hot[torch.randperm(len(hot), generator=g)[:2]] for _ in range(tokens)])
    return x, picks, torch.rand(tokens, 2, generator=g)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,hot,own", [
    # 8 experts on 3 ranks (3, 3, 2); experts 3..7 idle: ranks 1 and 2 receive no pairs at all;
    # rank 2 holds no tokens of its own
    (3, [0, 1, 2], [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9, 10], []]),
    # every rank sends and receives; expert 7 idle, rank 0's own share is one token
    (4, [0, 2, 3, 4, 5, 6], [[3], [0, 4, 5, 8], [1, 2, 6], [7, 9, 10]]),
])
def test_prefill_all_to_all_dispatch_equals_one_process(world, hot, own):
    overrides = {"n_group": 1, "topk_group": 1}
    cfg, _ = _moe(**overrides)
    x, idx, w = _routing(cfg, 11, hot)
    with WorkerGroup(world, "tests.group_workers:ExpertWorker", (overrides,)) as group:
        results = group.call("run", "prefill", x, idx, w, own)
    for r, (out, ref, info) in enumerate(results):
        assert out.shape == (len(own[r]), cfg.hidden_size)
        # the owner's matmul sees a different number of rows than the reference's: fp32
        # rounding of the order of 1e-7 of the layer's scale, nothing more
        assert torch.allclose(out, ref, rtol=0, atol=2e-6 * max(float(ref.abs().max()) if ref.numel() else 0.0, 1.0)), f"rank {r}"
    held = [info["experts"] for _, _, info in results]
    assert held == [[r.start, r.stop] for r in expert_owner_ranges(8, world)]
    if world == 3:
        assert results[1][2]["pairs_per_expert"] == [0, 0, 0] and results[2][2]["pairs_per_expert"] == [0, 0]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_decode_reduced_dispatch_equals_one_process(world):
    overrides = {"n_group": 1, "topk_group": 1}
    cfg, _ = _moe(**overrides)
    x, idx, w = _routing(cfg, 3, [0, 1, 2, 3])  # experts 4..7 idle: with C = 2, rank 1 holds no routed pair
    with WorkerGroup(world, "tests.group_workers:ExpertWorker", (overrides,)) as group:
        results = group.call("run", "decode", x, idx, w, [])
    for r, (out, ref, info) in enumerate(results):
        # shared expert: TP partial sums
        assert torch.allclose(out, ref, rtol=0, atol=2e-6 * float(ref.abs().max())), f"rank {r}"
        assert torch.equal(out, results[0][0])  # every rank ends with the same output
    assert sum(sum(info["pairs_per_expert"]) for _, _, info in results) == idx.numel()
    # `cpserve plan`'s MoE all-reduce: (k + 1) rows of h fp32 values a token, what the ranks put in
    from engine.cache.capacity import plan_capacity

    plan = plan_capacity(576, 1, 0, 0, dcp=world, indexer="copied", tokens=None, hidden_size=cfg.hidden_size,
                         moe_layers=1, moe_rows=cfg.num_experts_per_tok + 1)
    moe_rows = next(c for c in plan.collectives if c.name == "MoE rows")
    assert all(info["bytes_in"] == x.shape[0] * moe_rows.bytes_in for _, _, info in results)


# ---- per-rank loading --------------------------------------------------------------------------
def _slices_match(full_lm, part_lm, shard):
    """Every tensor of ``part_lm`` equals its shard's slice of ``full_lm``, bit for bit."""
    full = full_lm.state_dict()
    for name, t in part_lm.state_dict().items():
        part = shard.part(full_lm.cfg, name, tuple(full[name].shape))
        want = full[name] if part is None else full[name][part]
        if name.endswith("self_attn.o_proj.bias") and shard.tp and shard.rank:
            want = torch.zeros_like(want)
        assert torch.equal(t, want), name


@pytest.mark.parametrize("world,tp", [(3, False), (2, True), (4, True)])
def test_a_rank_loads_only_its_slices(world, tp):
    full = load_model("tiny")
    total = 0
    for r in range(world):
        shard = WeightShard(r, world, tp=tp)
        lm = load_model("tiny", shard=shard)
        _slices_match(full, lm, shard)
        held = range(*[(x.start, x.stop) for x in expert_owner_ranges(8, world)][r])
        for layer in lm.model.layers:
            if isinstance(layer.mlp, MoE):
                assert layer.mlp.experts.held == held
                assert layer.mlp.experts.gate_proj.shape[0] == len(held)
        nbytes = sum(t.numel() * t.element_size() for t in lm.state_dict().values())
        assert nbytes == weight_bytes(full.cfg, "fp32", shard)
        total += nbytes
    assert total < world * weight_bytes(full.cfg, "fp32")


@pytest.mark.parametrize("world,tp", [(2, True), (3, False)])
def test_fp8_release_loads_sliced_across_scale_blocks(tmp_path, world, tp):
    """FP8 block weights read as slices: hidden 320 and MLP widths 200 / 160 cut 128-blocks
    mid-block, so each slice's scales start inside the grid; the dequantized slice equals the
    whole tensor's dequantized slice bit for bit."""
    from tests.release_fixtures import fp8_release

    fp8_release(tmp_path)
    full = load_model(tmp_path, "fp32")
    for r in range(world):
        shard = WeightShard(r, world, tp=tp)
        _slices_match(full, load_model(tmp_path, "fp32", shard=shard), shard)


def test_fused_experts_load_per_rank(tmp_path):
    """Experts stored fused (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``), as
    transformers' in-memory format writes them: each rank reads its experts' rows only."""
    src = resolve_model_dir("tiny")
    full = load_model(src)
    state = {}
    for name, t in full.state_dict().items():
        if ".mlp.experts." in name:
            base, proj = name.rsplit(".", 1)
            if proj == "gate_proj":
                state[f"{base}.gate_up_proj"] = torch.cat([t, full.state_dict()[f"{base}.up_proj"]], dim=1)
            elif proj == "down_proj":
                state[name] = t
        elif name != "lm_head.weight" or not full.cfg.tie_word_embeddings:
            state[name] = t
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "model.safetensors"))
    shutil.copy(Path(src) / "config.json", tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text())["n_routed_experts"] == 8
    for r in range(3):
        shard = WeightShard(r, 3, tp=False)
        _slices_match(full, load_model(tmp_path, shard=shard), shard)


def test_replicate_keeps_every_expert():
    cfg = load_model("tiny").cfg
    assert weight_bytes(cfg, "fp32", WeightShard(1, 2, tp=False, moe_parallel="replicate")) == weight_bytes(cfg, "fp32")
    with pytest.raises(ValueError, match="moe_parallel: 'tp'"):
        WeightShard(0, 2, tp=False, moe_parallel="tp")


# ---- what each rank of a real group holds ------------------------------------------------------
@pytest.mark.timeout(180)
def test_each_rank_of_a_group_holds_only_its_experts():
    from engine.decode_engine import DCPDecodeEngine
    from engine.prefill_engine import CPPrefillEngine

    cfg = load_model("tiny").cfg
    expert_total = None
    with CPPrefillEngine("tiny", cp=3, max_cache_tokens=256) as pre:
        held = pre.group.call("weights")
    with DCPDecodeEngine("tiny", dcp=4, reference_prefill=False, max_cache_tokens=256) as dec:
        held_d = dec.group.call("weights")
    for world, tp, ranks in ((3, False, held), (4, True, held_d)):
        owners = expert_owner_ranges(cfg.n_routed_experts, world)
        for r, info in enumerate(ranks):
            assert info["experts"] == [owners[r].start, owners[r].stop]
            assert set(info["experts_per_layer"]) == {len(owners[r])}
            assert info["bytes"] == weight_bytes(cfg, "fp32", WeightShard(r, world, tp=tp))
        expert_total = expert_total or sum(i["expert_bytes"] for i in ranks)
        assert sum(i["expert_bytes"] for i in ranks) == expert_total  # one copy of the experts per group
    full = load_model("tiny")
    one_copy = sum(p.numel() * p.element_size() for n, p in full.state_dict().items() if ".mlp.experts." in n)
    assert expert_total == one_copy


# ---- options ------------------------------------------------------------------------------
def test_options_reach_the_engines_and_bad_values_name_their_field(tmp_path):
    from engine.cache.capacity import decode_row_bytes, pages_in_budget, parse_bytes
    from engine.cache.kvformat import KVFormat
    from services.common.config import ConfigError, load_config

    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("prefill:\n  moe_parallel: replicate\ndecode:\n  kv_cache_memory: 64MiB\n")
    pre, dec = load_config("prefill", yaml_file), load_config("decode", yaml_file)
    assert pre.engine_kwargs["moe_parallel"] == "replicate" and dec.engine_kwargs["moe_parallel"] == "ep"
    assert dec.engine_kwargs["kv_cache_memory"] == "64MiB"
    with pytest.raises(ConfigError, match="moe_parallel"):
        load_config("decode", overrides={"moe_parallel": "tp"})
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        load_config("decode", overrides={"kv_cache_memory": "lots"})
    assert parse_bytes("20GiB") == 20 << 30 and parse_bytes("1.5 MB") == 1_500_000 and parse_bytes(4096) == 4096
    cfg = load_model("tiny").cfg
    fp32 = KVFormat.of(cfg, "fp32")
    row = decode_row_bytes(cfg, fp32, 2, "copied")
    assert pages_in_budget(cfg, 64 << 20, fp32, 16, 2, "copied") == (64 << 20) // (row * 16)
    assert decode_row_bytes(cfg, fp32, 2, "split") < row
    with pytest.raises(ValueError, match="kv_cache_memory: 100 bytes"):
        pages_in_budget(cfg, 100, fp32, 16, 2, "copied")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dcp,moe_parallel", [(2, "ep"), (4, "ep"), (2, "replicate")])
def test_plan_weights_and_tokens_equal_what_the_decode_ranks_hold(dcp, moe_parallel, capsys):
    """`cpserve plan --memory-per-rank`: its weight bytes per rank are the sum of each decode
    rank's parameter bytes (exact), and a decode service given the cache budget it prints holds
    exactly the tokens it says fit."""
    from cpserve.cli import main
    from engine.decode_engine import DCPDecodeEngine

    capsys.readouterr()
    assert main(["plan", "--model", "tiny", "--dcp", str(dcp), "--moe-parallel", moe_parallel, "--kv-dtype", "fp32",
                 "--memory-per-rank", "12MiB", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    budget = plan["cache_bytes_per_rank"]
    assert budget == (12 << 20) - plan["weight_bytes_per_rank"] > 0
    with DCPDecodeEngine("tiny", dcp=dcp, reference_prefill=False, kv_cache_memory=budget,
                         moe_parallel=moe_parallel) as dec:
        held, mem = dec.group.call("weights"), dec.group.call("memory")
    assert [r["total"] for r in plan["weights"]["per_rank"]] == [w["bytes"] for w in held]
    assert [r["routed_experts"] for r in plan["weights"]["per_rank"]] == [w["expert_bytes"] for w in held]
    assert plan["weight_bytes_per_rank"] == max(w["bytes"] for w in held)
    assert plan["weights"]["expert_copies"] == (1.0 if moe_parallel == "ep" else dcp)
    assert plan["tokens_that_fit"] == sum(m["num_rows"] for m in mem)
    for m in mem:
        used = m["latent_bytes"] + m["index_bytes"]
        page = used // m["num_rows"] * 16
        assert used <= budget < used + page  # the pool fills the budget to within one page


def test_plan_memory_per_rank_errors(capsys):
    from cpserve.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--dcp", "2", "--memory-per-rank", "lots"])
    assert "--memory-per-rank" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", "--entry-bytes", "576", "--layers", "3", "--dcp", "2", "--memory-per-rank", "1GiB"])
    assert "--memory-per-rank needs --model" in capsys.readouterr().err
    assert main(["plan", "--model", "tiny", "--dcp", "2", "--memory-per-rank", "1MiB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens_that_fit"] == 0 and out["cache_bytes_per_rank"] == 0  # the weights alone exceed it
    with pytest.raises(SystemExit):
        main(["plan", "--model", "tiny", "--dcp", "3"])
    assert "--dcp 3 must divide" in capsys.readouterr().err
