"""FP8 KV cache (--kv-cache-dtype fp8 | fp8_ds_mla): the byte layouts, the one quantizer, the
checkpoint's k_scale, and every layout — prefill CP, decode DCP, the Mooncake hand-off — equal
to the one-process reference engine with the same FP8 cache."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine.cache.kvformat import FP8, KVFormat
from engine.cache.slots import token_slots
from engine.decode_engine import DCPDecodeEngine
from engine.handoff import LayoutMismatch, layout_fingerprint
from engine.model.config import ModelConfig
from engine.model.loader import CheckpointError, read_kv_scales
from engine.model.sampler import SamplingParams
from engine.model.tiny import make_tiny
from engine.parallel.transfer_plan import plan_bytes, plan_transfer
from engine.prefill_engine import CPPrefillEngine
from engine.reference import ReferenceEngine

FIRST = SamplingParams(max_new_tokens=1, stop_token_ids=())
STEPS = SamplingParams(max_new_tokens=24, stop_token_ids=())
LENGTHS = [70, 3, 45, 1, 130]  # shorter than C, not multiples of C, above index_topk (32)


def prompts(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in lengths]


class Deepseek:  # the real models' cache sizes
    kv_lora_rank, qk_rope_head_dim, index_head_dim, num_layers = 512, 64, 128, 2


# ---- the layouts -------------------------------------------------------------------------------
def test_entry_and_index_bytes_of_each_layout():
    sizes = {kind: (KVFormat.of(Deepseek, kind).entry_bytes, KVFormat.of(Deepseek, kind).index_bytes)
             for kind in ("fp32", "bf16", "fp8", "fp8_ds_mla")}
    assert sizes == {"fp32": (2304, 512), "bf16": (1152, 256), "fp8": (576, 132), "fp8_ds_mla": (656, 132)}
    assert KVFormat.of(Deepseek, "auto", "bf16").kind == "bf16" and KVFormat.of(Deepseek, "auto", "fp32").kind == "fp32"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVFormat.of(Deepseek, "int4")


def test_plan_takes_entry_bytes_from_the_layout(capsys):
    from cpserve.cli import main

    cfg = ModelConfig.load("tiny")
    out = {}
    for flag, kind in (("--kv-cache-dtype", "fp8_ds_mla"), ("--kv-dtype", "fp8"), ("--kv-cache-dtype", "auto")):
        capsys.readouterr()
        assert main(["plan", "--model", "tiny", "--dcp", "2", flag, kind, "--json"]) == 0
        out[kind] = json.loads(capsys.readouterr().out)
    r, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    assert out["fp8_ds_mla"]["entry_bytes"] == cfg.num_layers * (r + 4 * -(-r // 128) + 2 * dr)
    assert out["fp8"]["entry_bytes"] == cfg.num_layers * (r + dr)
    assert out["auto"]["entry_bytes"] == cfg.num_layers * (r + dr) * 4  # tiny computes in fp32
    assert out["fp8"]["index_bytes"] == out["fp8_ds_mla"]["index_bytes"] == 2 * (cfg.index_head_dim + 4)


def test_fp8_ds_mla_bytes_are_deepseeks_layout():
    """[512 e4m3 latent][4 float32 scales, amax/448 of each 128 values][64 bf16 rope]."""
    fmt = KVFormat.of(Deepseek, "fp8_ds_mla")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g) * torch.tensor([0.01, 1.0, 30.0])[:, None]
    x[0, 128:256] = 0.0  # an all-zero tile: scale 1.0, values 0
    stored = fmt.encode_latent(0, x)
    assert stored.dtype == torch.uint8 and stored.shape == (3, 656)
    scales = stored[:, 512:528].contiguous().view(torch.float32)
    amax = x[:, :512].reshape(3, 4, 128).abs().amax(-1)
    assert torch.equal(scales, torch.where(amax > 0, amax / 448, torch.ones_like(amax)))
    want = (x[:, :512].reshape(3, 4, 128) / scales[..., None]).to(FP8).reshape(3, 512)
    assert torch.equal(stored[:, :512].contiguous().view(FP8).float(), want.float())
    assert torch.equal(stored[:, 528:].contiguous().view(torch.bfloat16), x[:, 512:].to(torch.bfloat16))
    back = fmt.decode_latent(0, stored, torch.float32)
    assert torch.equal(back[0, 128:256], torch.zeros(128))
    assert torch.equal(back[:, 512:], x[:, 512:].to(torch.bfloat16).float())
    err = (back[:, :512] - x[:, :512]).abs().reshape(3, 4, 128).amax(-1)
    assert bool((err <= amax / 448 * 16).all())  # e4m3 keeps 3 bits: half an ulp of 448 is 16


def test_fp8_quantizer_rounds_to_nearest_and_saturates():
    fmt = KVFormat.of(Deepseek, "fp8", scales=(1.0, 0.25))
    x = torch.tensor([[0.0, -0.0, 1e-4, 0.3, -0.3, 17.2, 448.0, 500.0, -1e4] + [1.0] * 567])
    for layer, s in enumerate(fmt.scales):
        stored = fmt.encode_latent(layer, x)
        assert torch.equal(stored, fmt.encode_latent(layer, x.clone()))  # deterministic
        back = fmt.decode_latent(layer, stored, torch.float32)[0]
        q = (x[0] / s).clamp(-448, 448)
        assert torch.equal(back, q.to(FP8).float() * s)
        assert float(back[7]) == 448 * s and float(back[8]) == -448 * s  # saturated, never NaN
        assert not torch.isnan(back).any()
    keys = torch.randn(4, 128) * 5
    stored = fmt.encode_index(keys)
    assert stored.shape == (4, 132)
    scale = stored[:, 128:].contiguous().view(torch.float32)[:, 0]
    assert torch.equal(scale, keys.abs().amax(-1) / 448)
    assert float((fmt.decode_index(stored, torch.float32) - keys).abs().max()) <= float(keys.abs().max()) / 448 * 16


# ---- the checkpoint's scales -----------------------------------------------------------------
@pytest.fixture(scope="module")
def scaled_release(tmp_path_factory):
    """The FP8 release fixture (DeepSeek-V3 format, 576-wide entries) with a k_scale per layer."""
    from tests.release_fixtures import add_kv_scales, fp8_release

    path = tmp_path_factory.mktemp("scaled") / "release"
    path.mkdir()
    fp8_release(path)
    add_kv_scales(path, [0.125, 2.0, 0.5])
    return path


@pytest.mark.timeout(300)
def test_checkpoint_k_scales_load_and_quantize_the_entries(scaled_release):
    """The loader accepts k_scale / v_scale tensors; the fp8 cache stores e4m3(x / k_scale) of
    each layer (layer 0's entries do not depend on the cache, so they are bit-equal to the fp32
    cache's, and their stored bytes can be checked exactly)."""
    cfg = ModelConfig.load(str(scaled_release))
    assert read_kv_scales(scaled_release, cfg) == (0.125, 2.0, 0.5)
    (p,) = prompts([60])
    pools = {}
    for kind in ("fp32", "fp8"):
        eng = ReferenceEngine(str(scaled_release), dtype="fp32", kv_cache_dtype=kind)
        seq = eng.add_request(p, FIRST)
        eng.scheduler._admit()
        slots = token_slots(seq.pages, len(p), eng.scheduler.page_size, 1)
        while eng.has_work:
            eng.step()
        pools[kind] = (eng, slots)
    (ref, ref_slots), (fp8, slots) = pools["fp32"], pools["fp8"]
    assert fp8.kv_format.scales == (0.125, 2.0, 0.5)
    entries = ref.pool.latent(0)[ref_slots]
    stored = fp8.pool.latent(0)[slots]
    assert torch.equal(stored, (entries / 0.125).clamp(-448, 448).to(FP8).view(torch.uint8))
    assert not torch.equal(stored, entries.clamp(-448, 448).to(FP8).view(torch.uint8))  # scale 1 would differ
    # every layer decodes to the fp32 cache's entries within the e4m3 rounding of x / k_scale
    for layer, s in enumerate(fp8.kv_format.scales):
        got = fp8.pool.read_latent(layer, slots)
        want = ref.pool.latent(layer)[ref_slots]
        assert float((got - want).abs().max()) <= max(float(want.abs().max()) / 448 * 16, 16 * s) * 1.01


def test_scales_for_some_layers_only_are_refused(tmp_path):
    from tests.release_fixtures import add_kv_scales

    path = make_tiny(tmp_path / "tiny", "deepseek_v3")
    add_kv_scales(path, [0.5, 0.5])
    cfg = ModelConfig.load(str(path))
    assert read_kv_scales(path, cfg) == (0.5, 0.5, 1.0, 1.0)  # the fixture writes 1.0 past the list
    from safetensors.torch import load_file, save_file

    scales = load_file(str(path / "kv-scales.safetensors"))
    del scales["model.layers.3.self_attn.k_scale"]
    save_file(scales, str(path / "kv-scales.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.self_attn\.k_scale"):
        read_kv_scales(path, cfg)


# ---- every layout equals the reference with the same FP8 cache --------------------------------
def fp8_ulps(a: torch.Tensor, b: torch.Tensor, fmt: KVFormat, layer: int) -> float:
    """The largest difference between two stored rows' decoded entries, in units in the last
    place of e4m3 at the entry's magnitude (times its scale); bf16 rope values of fp8_ds_mla in
    bf16 ulps."""
    da, db = (fmt.decode_latent(layer, x, torch.float32) for x in (a, b))
    r = fmt.kv_lora_rank
    if fmt.kind == "fp8":
        scale = torch.full_like(db, fmt.scales[layer])
        bits = 3
    else:
        t = fmt.tiles
        scale = torch.ones_like(db)
        scale[:, :r] = torch.maximum(*(x[:, r : r + 4 * t].contiguous().view(torch.float32) for x in (a, b))
                                     ).repeat_interleave(128, dim=1)[:, :r]
        bits = torch.full_like(db, 7.0)
        bits[:, :r] = 3
    mag = torch.maximum(da.abs(), db.abs()) / scale
    exponent = torch.floor(torch.log2(mag.clamp_min(2.0 ** -6)))
    ulp = torch.pow(2.0, exponent - bits) * scale
    return float(((da - db).abs() / ulp).max())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,kind,cp,strategy,layer_split,attention",
                         [("tiny", "fp8", 3, "interleave", True, "allgather"),
                          ("tiny", "fp8_ds_mla", 2, "zigzag", False, "ring")])
def test_prefill_cp_with_an_fp8_cache_equals_the_reference(model, kind, cp, strategy, layer_split, attention):
    """First tokens equal; every rank's entries within one FP8 step of the reference's (the
    ring: the rows each rank holds, blocks travelling as stored bytes). (Decode DCP and both
    layouts on both model types: the `cpserve up` tests below.)"""
    ref = ReferenceEngine(model, record_logits=True, kv_cache_dtype=kind)
    ps = prompts()
    ref_seqs = [ref.add_request(p, FIRST) for p in ps]
    ref.scheduler._admit()
    ref_slots = [token_slots(s.pages, len(p), ref.scheduler.page_size, 1) for s, p in zip(ref_seqs, ps)]
    while ref.has_work:
        ref.step()
    with CPPrefillEngine(model, cp=cp, strategy=strategy, layer_split=layer_split, record_logits=True,
                         kv_cache_dtype=kind, cp_attention=attention) as eng:
        seqs = [eng.add_request(p, FIRST) for p in ps]
        eng.scheduler._admit()
        shards = cp if attention == "ring" else 1
        slots = [token_slots(s.pages, len(p), eng.scheduler.page_size, shards) for s, p in zip(seqs, ps)]
        while eng.has_work:
            eng.step()
        assert [s.output_ids for s in seqs] == [s.output_ids for s in ref_seqs]
        for a, b in zip(seqs, ref_seqs):
            assert float((a.logits[0] - b.logits[0]).abs().max() / b.logits[0].abs().max()) < 1e-3
        fmt = ref.kv_format
        worst = 0.0
        for s, rs in zip(slots, ref_slots):
            for r in range(cp):
                dump = eng.group.call_rank(r, "dump", s)
                held = dump["held"] if dump["held"] is not None else torch.arange(len(rs))
                for layer, rows in dump["latent"].items():
                    assert rows.dtype == torch.uint8 and rows.shape[1] == fmt.entry_bytes
                    if held.numel():
                        worst = max(worst, fp8_ulps(rows, ref.pool.latent(layer)[rs[held]], fmt, layer))
        # the same quantizer on values that differ by fp32 rounding (a matmul over another set of
        # tokens blocks differently, even on layer 0 for very short shares): at most one FP8 step
        assert worst <= 1.0, worst


# ---- the hand-off ----------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_fp8_hand_off_moves_the_stored_bytes_and_refuses_another_layout():
    kind, dcp = "fp8_ds_mla", 2
    ps = prompts()
    ref = ReferenceEngine("tiny", kv_cache_dtype=kind)
    want = [ref.generate([p], STEPS)[0].output_ids for p in ps]
    with CPPrefillEngine("tiny", cp=2, kv_transport="tcp", kv_cache_dtype=kind) as pre, \
            DCPDecodeEngine("tiny", dcp=dcp, kv_transport="tcp", reference_prefill=False, kv_cache_dtype=kind) as dec:
        fmt, cfg = pre.kv_format, pre.cfg
        outs = []
        for p in ps:
            dest = dec.reserve(len(p), STEPS.max_new_tokens)
            first = pre.prefill_to(p, STEPS, dest, before_write=lambda: dec.begin_write(dest.reservation_id),
                                   after_write=lambda: dec.end_write(dest.reservation_id))
            moved = sum(r["bytes"] for r in pre.transfer_stats)
            writes = plan_transfer(num_tokens=len(p), prefill_cp=2, layer_split=False, num_layers=cfg.num_layers,
                                   indexer_layers=list(cfg.indexer_layer_ids), src_slots=range(len(p)),
                                   decode_dcp=dcp, dst_slots=list(dest.slots[: len(p)]), decode_index="copied")
            per_token = cfg.num_layers * fmt.entry_bytes + cfg.num_indexer_layers * fmt.index_bytes * dcp
            assert moved == plan_bytes(writes, fmt.entry_bytes, fmt.index_bytes) == len(p) * per_token
            # decode holds the reference's entries for those tokens, within one FP8 step
            ref_seq = ref.add_request(p, FIRST)
            ref.scheduler._admit()
            ref_slots = token_slots(ref_seq.pages, len(p), ref.scheduler.page_size, 1)
            while ref.has_work:
                ref.step()
            for r in range(dcp):
                got = dec.group.call_rank(r, "rows", torch.tensor(dest.slots))["latent"]
                owned = ref_slots[torch.arange(r, max(len(p), r), dcp)]
                assert got.dtype == torch.uint8 and got.shape[1] == owned.numel()
                for layer in range(cfg.num_layers):
                    if owned.numel():
                        assert fp8_ulps(got[layer], ref.pool.latent(layer)[owned], fmt, layer) <= 1.0
            outs.append(dec.commit(dest.reservation_id, p, STEPS, first.seed, first.output_ids[0]))
        while dec.has_work:
            dec.step()
        assert [s.output_ids for s in outs] == want
        mem = dec.group.call("memory")[0]  # the pool's bytes: the layout's, per row
        assert mem["latent_bytes"] == mem["num_rows"] * cfg.num_layers * fmt.entry_bytes
        assert mem["index_bytes"] == mem["num_rows"] * dcp * cfg.num_indexer_layers * fmt.index_bytes
        # a decode group storing bf16 is refused before any compute, naming both layouts
        dest = dec.reserve(10, 4)
        bf16 = layout_fingerprint(cfg, pre.dtype, KVFormat.of(cfg, "bf16"))
        with pytest.raises(LayoutMismatch, match="kv_cache_dtype: prefill has 'fp8_ds_mla', decode has 'bf16'"):
            pre.prefill_to(ps[0][:10], STEPS, dataclasses.replace(dest, fingerprint=bf16))
        # and one whose scales differ (another checkpoint's k_scale) as well
        with pytest.raises(LayoutMismatch, match="kv_scales"):
            pre.submit_prefill(ps[0][:10], STEPS, dataclasses.replace(
                dest, fingerprint={**pre.fingerprint, "kv_scales": [0.5] * cfg.num_layers}))
        assert dec.abort_reservation(dest.reservation_id)
        assert pre.allocator.num_free == pre.allocator.num_pages
        assert dec.allocator.num_free == dec.allocator.num_pages


# ---- end to end through `cpserve up` ----------------------------------------------------------
LAYOUT_A = dict(prefill_cp=2, cp_strategy="interleave", layer_split=True, decode_dcp=2, indexer="split",
                dcp_comm="ag_rs")
LAYOUT_B = dict(prefill_cp=3, cp_strategy="zigzag", decode_dcp=2, indexer="copied", dcp_comm="a2a")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout,model,kind", [
    (LAYOUT_A, "tiny", "fp8"), (LAYOUT_A, "tiny-v3", "fp8_ds_mla"),
    (LAYOUT_B, "tiny", "fp8_ds_mla"), (LAYOUT_B, "tiny-v3", "fp8"),
], ids=["A-tiny-fp8", "A-tinyv3-fp8_ds_mla", "B-tiny-fp8_ds_mla", "B-tinyv3-fp8"])
def test_cpserve_up_with_an_fp8_cache_equals_the_reference(layout, model, kind):
    """(CP 2 interleave + layer split → DCP 2 split index, ag_rs) and (CP 3 zigzag → DCP 2 copied
    index, a2a), each on both model types with both FP8 layouts between them: every token the
    cluster streams equals the one-process reference engine's with the same FP8 cache."""
    from services.up import start_cluster, stop_cluster
    from tests.test_cluster_e2e import MAX_TOKENS, client_for, cluster_args, completion_ids
    from tests.test_cluster_e2e import prompts as e2e_prompts

    ref = ReferenceEngine(model, kv_cache_dtype=kind)
    params = SamplingParams(max_new_tokens=MAX_TOKENS, stop_token_ids=())
    ps = e2e_prompts()
    want = [s.output_ids for s in ref.generate(ps, params)]
    children = start_cluster(cluster_args(model=model, kv_cache_dtype=kind, **layout), 0, None, quiet=True)
    try:
        client = client_for(children)
        for i, (p, expected) in enumerate(zip(ps, want)):
            assert completion_ids(client, model, p, stream=bool(i % 2)) == expected, len(p)
    finally:
        stop_cluster(children)
