"""The model and the reference engine against Hugging Face transformers (the ground truth)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.model.config import ModelConfigError
from engine.model.loader import CheckpointError, load_model
from engine.model.sampler import InvalidRequest, SamplingParams
from engine.reference import ReferenceEngine
from tests.hf_models import build_hf

TYPES = ["deepseek_v3", "deepseek_v32", "glm_moe_dsa"]
TOPK = 16  # index_topk of the HF test models
GREEDY = SamplingParams(max_new_tokens=1, stop_token_ids=())


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def prompts(lengths, seed=0, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=TYPES)
def hf_ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    model = build_hf(request.param, path)
    return request.param, path, model


@pytest.fixture(scope="module")
def engine(hf_ckpt):
    return ReferenceEngine(str(hf_ckpt[1]), record_logits=True)


def test_batch_logits_match_transformers(hf_ckpt, engine):
    _, _, hf = hf_ckpt
    lengths = [1, 2, 7, TOPK - 1, TOPK, TOPK + 1, 2 * TOPK + 3, 4 * TOPK, 4 * TOPK + 9]
    ps = prompts(lengths)
    seqs = engine.generate(ps, GREEDY)
    for p, seq in zip(ps, seqs):
        with torch.no_grad():
            ref = hf(torch.tensor([p])).logits[0, -1]
        assert rel_err(seq.logits[0], ref) < 1e-4, len(p)


@pytest.mark.parametrize("length", [TOPK // 2, 3 * TOPK])
def test_greedy_generation_matches_transformers(hf_ckpt, engine, length):
    _, _, hf = hf_ckpt
    (p,) = prompts([length], seed=length)
    out = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=2,
                      output_logits=True, return_dict_in_generate=True)
    expected = out.sequences[0, length:].tolist()
    seq = engine.generate([p], SamplingParams(max_new_tokens=32, stop_token_ids=()))[0]
    assert seq.output_ids == expected
    for step, (ours, theirs) in enumerate(zip(seq.logits, out.logits)):
        assert rel_err(ours, theirs[0]) < 1e-4, step


@pytest.mark.parametrize("chunk", [1, 5, TOPK, 33])
def test_chunked_prefill_gives_the_unchunked_tokens(hf_ckpt, engine, chunk):
    (p,) = prompts([70], seed=3)
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    whole = engine.generate([p], params)[0]
    chunked = ReferenceEngine(str(hf_ckpt[1]), chunk_size=chunk, record_logits=True).generate([p], params)[0]
    assert chunked.output_ids == whole.output_ids
    assert rel_err(chunked.logits[0], whole.logits[0]) < 1e-5


def test_mixed_batch_gives_single_request_tokens(hf_ckpt, engine):
    ps = prompts([3, 50, 17, 1, 90], seed=4)
    params = SamplingParams(max_new_tokens=10, stop_token_ids=())
    together = engine.generate(ps, params)
    alone = [engine.generate([p], params)[0] for p in ps]
    assert [s.output_ids for s in together] == [s.output_ids for s in alone]
    # requests joining mid-decode
    eng = ReferenceEngine(str(hf_ckpt[1]), chunk_size=20)
    first = eng.add_request(ps[1], params)
    for _ in range(4):
        eng.step()
    late = eng.add_request(ps[4], params)
    while eng.has_work:
        eng.step()
    assert first.output_ids == alone[1].output_ids and late.output_ids == alone[4].output_ids
    assert eng.allocator.num_free == eng.allocator.num_pages


@pytest.mark.parametrize("variant", [
    dict(q_lora_rank=None, rope_interleave=False,
         rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                          "mscale_all_dim": 1.0, "original_max_position_embeddings": 512}),
    dict(tie_word_embeddings=True),
])
def test_deepseek_v3_variants(tmp_path, variant):
    hf = build_hf("deepseek_v3", tmp_path / "v", **variant)
    eng = ReferenceEngine(str(tmp_path / "v"), record_logits=True)
    (p,) = prompts([40], seed=5)
    seq = eng.generate([p], GREEDY)[0]
    with torch.no_grad():
        assert rel_err(seq.logits[0], hf(torch.tensor([p])).logits[0, -1]) < 1e-4


def test_sharded_checkpoint_and_bf16(tmp_path):
    hf = build_hf("glm_moe_dsa", tmp_path / "a")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    (p,) = prompts([30], seed=6)
    a = ReferenceEngine(str(tmp_path / "a"), record_logits=True).generate([p], GREEDY)[0]
    b = ReferenceEngine(str(tmp_path / "sharded"), record_logits=True).generate([p], GREEDY)[0]
    assert torch.equal(a.logits[0], b.logits[0])
    c = ReferenceEngine(str(tmp_path / "a"), dtype="bf16", record_logits=True).generate([p], GREEDY)[0]
    assert rel_err(c.logits[0], a.logits[0]) < 0.1


# ---- bad input ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def glm_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bad") / "glm"
    build_hf("glm_moe_dsa", path)
    return path


def test_unknown_model_type(glm_dir, tmp_path):
    shutil.copytree(glm_dir, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "llama"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="model_type 'llama' is not supported"):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("edit,pattern", [
    ("drop", r"1 missing tensors: model\.layers\.1\.self_attn\.kv_b_proj\.weight"),
    ("reshape", r"model\.layers\.1\.self_attn\.kv_b_proj\.weight \(model\.safetensors\) has shape"),
    ("extra", r"1 unexpected tensors: model\.layers\.0\.self_attn\.bogus\.weight \(model\.safetensors\)"),
    ("drop_expert", r"1 missing tensors: model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight"),
])
def test_bad_tensors_are_named(glm_dir, tmp_path, edit, pattern):
    shutil.copytree(glm_dir, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    t = load_file(str(f))
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    if edit == "drop":
        del t[name]
    elif edit == "reshape":
        t[name] = t[name][:-1].contiguous()
    elif edit == "extra":
        t["model.layers.0.self_attn.bogus.weight"] = torch.zeros(2)
    else:
        del t["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(t, str(f))
    with pytest.raises(CheckpointError, match=pattern):
        load_model(tmp_path / "m")


@pytest.mark.parametrize("prompt,params,field", [
    ([], SamplingParams(), "prompt"),
    ([5, 300], SamplingParams(), "prompt"),
    ([5, -1], SamplingParams(), "prompt"),
    ([5], SamplingParams(max_new_tokens=0), "max_new_tokens"),
    ([5] * 4000, SamplingParams(max_new_tokens=200), "max_new_tokens"),
    ([5], SamplingParams(temperature=-1.0), "temperature"),
    ([5], SamplingParams(top_p=0.0), "top_p"),
])
def test_bad_requests_name_the_field(glm_dir, prompt, params, field):
    eng = ReferenceEngine(str(glm_dir))
    with pytest.raises(InvalidRequest) as e:
        eng.add_request(prompt, params)
    assert e.value.field == field and field in str(e.value)
    assert not eng.has_work and eng.allocator.num_free == eng.allocator.num_pages


def test_seeded_sampling_is_reproducible(glm_dir):
    eng = ReferenceEngine(str(glm_dir))
    (p,) = prompts([20], seed=7)
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=42, stop_token_ids=())
    a, b = eng.generate([p], sp)[0], eng.generate([p, p[:5]], sp)[0]
    assert a.output_ids == b.output_ids
    c = eng.generate([p], SamplingParams(max_new_tokens=12, temperature=1.0, seed=43, stop_token_ids=()))[0]
    assert c.output_ids != a.output_ids
    greedy = eng.generate([p], SamplingParams(max_new_tokens=12, stop_token_ids=()))[0]
    top1 = eng.generate([p], SamplingParams(max_new_tokens=12, temperature=0.7, top_k=1, seed=1, stop_token_ids=()))[0]
    assert top1.output_ids == greedy.output_ids


def test_stop_token_ends_generation(glm_dir):
    eng = ReferenceEngine(str(glm_dir))
    (p,) = prompts([20], seed=8)
    full = eng.generate([p], SamplingParams(max_new_tokens=10, stop_token_ids=()))[0].output_ids
    stopped = eng.generate([p], SamplingParams(max_new_tokens=10, stop_token_ids=(full[3],)))[0]
    assert stopped.output_ids == full[: full.index(full[3]) + 1] and stopped.finish_reason == "stop"


def test_sparse_extend_attention_equals_dense_masked():
    from engine.model.attention import extend_attention, sparse_extend_attention, topk_mask

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(50, 3, 8, generator=g), torch.randn(300, 3, 8, generator=g), torch.randn(300, 3, 5, generator=g)
    q_pos = torch.arange(250, 300)
    q_pos[:5] = torch.arange(5)  # early queries see fewer keys than the selection width
    causal = torch.arange(300)[None] <= q_pos[:, None]
    mask = topk_mask(torch.randn(50, 300, generator=g), 16, causal)
    dense = extend_attention(q, k, v, mask, 0.3)[0]
    assert torch.allclose(sparse_extend_attention(q, k, v, mask, 0.3, 16), dense, atol=1e-6)
    # both forms return the same base-e LSE when asked
    dense_out, dense_lse = extend_attention(q, k, v, mask, 0.3, return_lse=True)
    sparse_out, sparse_lse = sparse_extend_attention(q, k, v, mask, 0.3, 16, return_lse=True)
    assert torch.allclose(sparse_out, dense_out, atol=1e-6) and torch.allclose(sparse_lse, dense_lse, atol=1e-5)
    scores = torch.einsum("qhd,khd->qhk", q, k) * 0.3
    assert torch.allclose(dense_lse, scores.masked_fill(~mask[:, None], float("-inf")).logsumexp(-1), atol=1e-5)


# ---- decode fast paths: each equals the general form it replaces -----------------------------
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("width", [16, 40])
def test_rope_matrix_form_equals_elementwise(interleave, width):
    from engine.model.rope import RopeTables

    g = torch.Generator().manual_seed(width)
    pos = torch.tensor([0, 5, 1023, 70000])
    inv = 1 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    f = pos.float()[:, None] * inv
    emb = torch.cat([f, f], -1)
    cos, sin = emb.cos() * 1.2, emb.sin() * 1.2
    for shape in [(4, width), (4, 3, width)]:
        x = torch.randn(*shape, generator=g)
        elementwise = RopeTables(cos, sin, as_matrix=False).apply(x, interleave)
        matrix = RopeTables(cos, sin, as_matrix=True).apply(x, interleave)
        assert torch.allclose(matrix, elementwise, atol=1e-6)
        assert torch.equal(matrix[..., 16:], x[..., 16:])  # past the rotary dims: untouched


def test_topk_select_equals_topk_mask_with_ties():
    from engine.model.attention import topk_mask, topk_select

    g = torch.Generator().manual_seed(1)
    for n, k in [(5, 8), (100, 16), (300, 32)]:
        for ties in (False, True):
            s = torch.randn(n, generator=g)
            if ties:  # integer scores: many ties across the k-th place
                s = torch.randint(0, 4, (n,), generator=g).float()
            want = topk_mask(s[None], k, torch.ones(1, n, dtype=torch.bool))[0].nonzero().squeeze(1)
            assert torch.equal(topk_select(s, k), want)


def test_absorbed_decode_forms_agree():
    from engine.model.attention import absorbed_decode

    g = torch.Generator().manual_seed(2)
    q, rows = torch.randn(2, 4, 12, generator=g), torch.randn(2, 7, 12, generator=g)
    all_valid = torch.ones(2, 7, dtype=torch.bool)
    out, lse = absorbed_decode(q, rows, all_valid, 8, 0.3)
    assert lse.shape == (2, 4)
    for valid in (None, all_valid):
        o2, l2 = absorbed_decode(q, rows, valid, 8, 0.3, return_lse=False)
        assert l2 is None and torch.allclose(o2, out, atol=1e-6)
    scores = torch.einsum("bhd,bld->bhl", q, rows) * 0.3  # the textbook form
    assert torch.allclose(out, torch.einsum("bhl,blr->bhr", scores.softmax(-1), rows[..., :8]), atol=1e-6)
    assert torch.allclose(lse, scores.logsumexp(-1), atol=1e-6)


# ---- device -----------------------------------------------------------------------------------
def test_device_is_checked(glm_dir, capsys):
    from cpserve.cli import main

    with pytest.raises(ValueError, match="device: 'tpu'"):
        ReferenceEngine(str(glm_dir), device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: 'cuda'.*no CUDA device"):
            ReferenceEngine(str(glm_dir), device="cuda")
        with pytest.raises(SystemExit) as e:
            main(["reference", "--model", str(glm_dir), "--prompt-ids", "5,6", "--max-new-tokens", "2", "--device", "cuda"])
        assert e.value.code == 2 and "--device: 'cuda'" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("model_type", TYPES)
def test_cuda_engine_matches_cpu(tmp_path, model_type):
    path = tmp_path / "ckpt"
    build_hf(model_type, path)
    cpu = ReferenceEngine(str(path), record_logits=True)
    gpu = ReferenceEngine(str(path), record_logits=True, device="cuda")
    assert gpu.pool.latent_pool.is_cuda and next(gpu.lm.parameters()).is_cuda
    batch = prompts([5, TOPK + 7, 4 * TOPK + 9], seed=11)
    params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    for a, b in zip(cpu.generate(batch, params), gpu.generate(batch, params)):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.stack(a.logits), torch.stack(b.logits), rtol=1e-3, atol=1e-3)


def test_row_gatherer_reuses_its_buffer_for_large_gathers():
    from engine.cache.gather import RowGatherer

    g = torch.Generator().manual_seed(4)
    pool = torch.randn(5000, 300, generator=g)
    gather = RowGatherer()
    small = torch.randperm(5000, generator=g)[:100]
    big = torch.randperm(5000, generator=g)[: RowGatherer.FRESH_MAX_VALUES // 300 + 1]
    rows, valid = gather(pool, [small])
    assert valid is None and torch.equal(rows[0], pool[small]) and gather.buf is None  # fresh tensor
    rows, valid = gather(pool, [big])
    assert valid is None and torch.equal(rows[0], pool[big]) and rows.data_ptr() == gather.buf.data_ptr()
    rows2, valid = gather(pool, [small, big[:7]])  # padded batch: same buffer, a mask
    assert rows2.data_ptr() == gather.buf.data_ptr() and valid.sum(1).tolist() == [100, 7]
    assert torch.equal(rows2[0], pool[small]) and torch.equal(rows2[1, :7], pool[big[:7]])
    assert torch.equal(rows2[1, 7:], pool[0].expand(93, -1))  # padding: row 0 of the pool, finite
    rows3, valid = gather(pool, [small[:0], big[:3]])  # a request with no rows here (a DCP shard)
    assert valid.sum(1).tolist() == [0, 3] and torch.equal(rows3[1], pool[big[:3]])


def test_row_gatherer_grows_geometrically_as_decode_lengthens():
    """Decode adds one row per request a step: the buffer must not be re-allocated each step."""
    from engine.cache.gather import RowGatherer

    pool = torch.randn(20000, 64)
    gather, allocations, held = RowGatherer(), 0, None
    for n in range(2000, 2400):
        rows, valid = gather(pool, [torch.arange(n), torch.arange(n // 2)])
        if gather.buf is not held:
            allocations, held = allocations + 1, gather.buf
        assert torch.equal(rows[0], pool[:n]) and torch.equal(rows[1, : n // 2], pool[: n // 2])
    assert allocations <= 2


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_attention_in_chunks_of_requests_equals_one_batch(monkeypatch, return_lse):
    """``RowGatherer.attend`` splits a batch into cache-sized chunks of requests; each request's
    output (and LSE) is what the one-batch computation gives, a request with no rows here
    (a DCP shard) included."""
    from engine.cache.gather import RowGatherer
    from engine.model.attention import absorbed_decode

    g = torch.Generator().manual_seed(5)
    pool = torch.randn(4000, 72, generator=g)
    lens = [300, 5, 0 if return_lse else 1, 120, 299, 64, 1]
    rows = [torch.randperm(4000, generator=g)[:n] for n in lens]
    q = torch.randn(len(lens), 4, 72, generator=g)
    whole, valid = RowGatherer()(pool, rows)
    want, want_lse = absorbed_decode(q, whole.clone(), valid, 64, 0.125, return_lse=return_lse)
    monkeypatch.setattr(RowGatherer, "CHUNK_BYTES", 2 * 300 * 72 * 4)  # at most two requests a chunk
    chunks = []
    gather = RowGatherer()
    real_call = RowGatherer.__call__
    monkeypatch.setattr(RowGatherer, "__call__", lambda self, p, r: chunks.append(len(r)) or real_call(self, p, r))
    out, lse = gather.attend(pool, rows, q, 64, 0.125, return_lse=return_lse)
    assert len(chunks) >= 4 and sum(chunks) == len(lens)
    assert torch.allclose(out, want, rtol=0, atol=1e-6)
    if return_lse:
        assert torch.allclose(lse, want_lse, rtol=0, atol=1e-5) and torch.isneginf(lse[2]).all()
        assert torch.equal(out[2], torch.zeros_like(out[2]))


@pytest.mark.parametrize("return_lse", [False, True])
def test_decode_attention_over_contiguous_rows_reads_the_pool_in_place(monkeypatch, return_lse):
    """A request whose rows are one ascending run of the pool is attended over a view (no
    gather); the others are gathered — a run out of order, and rows whose first and last look
    like a run but are not, included. Every output equals the one-batch computation."""
    from engine.cache.gather import RowGatherer
    from engine.model.attention import absorbed_decode

    g = torch.Generator().manual_seed(6)
    pool = torch.randn(4000, 72, generator=g)
    rows = [torch.arange(100, 400), torch.randperm(4000, generator=g)[:50], torch.arange(1000, 1300).flip(0),
            torch.tensor([7, 9, 3000, 8, 10]), torch.arange(2000, 2600), torch.arange(50, 60)]
    q = torch.randn(len(rows), 4, 72, generator=g)
    whole, valid = RowGatherer()(pool, rows)
    want, want_lse = absorbed_decode(q, whole.clone(), valid, 64, 0.125, return_lse=return_lse)
    gathered = []
    real_call = RowGatherer.__call__
    monkeypatch.setattr(RowGatherer, "__call__", lambda self, p, r: gathered.extend(x.numel() for x in r)
                        or real_call(self, p, r))
    out, lse = RowGatherer().attend(pool, rows, q, 64, 0.125, return_lse=return_lse)
    # in place: the two runs of >= VIEW_MIN_ROWS rows; the short run (10 rows) is gathered with the rest
    assert sorted(gathered) == sorted([50, 300, 5, 10])
    assert torch.allclose(out, want, rtol=0, atol=1e-6)
    if return_lse:
        assert torch.allclose(lse, want_lse, rtol=0, atol=1e-5)


def test_bound_attributes_follow_reassignment(glm_dir):
    """`bind_attributes` makes parameters plain instance attributes; setting one again (as the
    DCP head split does) must be seen, never the stale bound one."""
    from engine.model.loader import load_model

    lm = load_model(glm_dir)
    proj = lm.model.layers[0].self_attn.o_proj
    assert proj.__dict__["weight"] is proj._parameters["weight"]
    replacement = torch.nn.Parameter(torch.zeros_like(proj.weight), requires_grad=False)
    proj.weight = replacement
    assert proj.weight is replacement
    lm.bind_attributes()
    assert proj.__dict__["weight"] is replacement
