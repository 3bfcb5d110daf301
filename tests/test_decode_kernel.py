"""The fused decode-attention kernel (engine/kernels/mla_decode.c) against the torch path and
the textbook formula: every shape class it handles, empty requests, shuffled row lists, and
results that do not depend on the batch or the thread count (same bits); FP8 rows decoded in
the kernel to the same bits as KVFormat.decode_latent."""

from __future__ import annotations

import pytest
import torch

import engine.kernels as kernels
from engine.cache.gather import RowGatherer, fused_decode_attention
from engine.cache.kvformat import KVFormat


def fp32(latent_dim: int, r: int) -> KVFormat:
    return KVFormat("fp32", r, latent_dim - r, 0)


@pytest.fixture(scope="module")
def fused_r():
    def make(latent_dim: int, r: int, kind: str = "fp32", scales=()):
        f = fused_decode_attention(KVFormat(kind, r, latent_dim - r, 0, scales), torch.float32, "cpu")
        if f is None:
            pytest.fail("the fused kernel did not build on this machine (a C compiler is part of make setup)")
        return f
    return make


def textbook(pool, rows, q, r, scale):
    """softmax(scale · q rowsᵀ) @ rows[:, :r] and logsumexp, one request at a time, in float64."""
    outs, lses = [], []
    for b, idx in enumerate(rows):
        k = pool[idx].double()
        s = scale * q[b].double() @ k.T  # [H, n]
        if idx.numel() == 0:
            outs.append(torch.zeros(q.shape[1], r, dtype=torch.float64))
            lses.append(torch.full((q.shape[1],), float("-inf"), dtype=torch.float64))
            continue
        outs.append(torch.softmax(s, -1) @ k[:, :r])
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


LENGTHS = [0, 1, 3, 15, 16, 17, 255, 256, 257, 700]


@pytest.mark.parametrize("heads,r,rope", [(4, 512, 64), (4, 64, 16), (3, 48, 16), (16, 128, 32), (1, 16, 0)])
def test_kernel_equals_the_formula_and_the_torch_path(fused_r, heads, r, rope):
    g = torch.Generator().manual_seed(heads * 1000 + r)
    d = r + rope
    pool = torch.randn(2048, d, generator=g)
    rows = [torch.randperm(2048, generator=g)[:n] for n in LENGTHS] + [torch.arange(600, 1600)]
    q = torch.randn(len(rows), heads, d, generator=g) * 0.3
    out, lse = RowGatherer(fused_r(d, r)).attend(pool, rows, q, r, 0.125, return_lse=True)
    want_out, want_lse = textbook(pool, rows, q, r, 0.125)
    torch_out, torch_lse = RowGatherer().attend(pool, rows, q, r, 0.125, return_lse=True)
    assert torch.allclose(out.double(), want_out, atol=2e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse.double()[finite], want_lse[finite], atol=2e-6)
    assert torch.equal(out[0], torch.zeros(heads, r)) and bool(torch.isneginf(lse[0]).all())  # no rows
    assert torch.allclose(out[1:], torch_out[1:], atol=2e-6) and torch.allclose(lse[1:], torch_lse[1:], atol=2e-6)
    # without the LSE (the reference engine's call) the output is the same
    alone, none = RowGatherer(fused_r(d, r)).attend(pool, rows, q, r, 0.125, return_lse=False)
    assert none is None and torch.equal(alone, out)


def test_a_request_gets_the_same_bits_alone_in_any_batch_and_thread_count(fused_r):
    g = torch.Generator().manual_seed(1)
    pool = torch.randn(8192, 576, generator=g)
    rows = [torch.randperm(8192, generator=g)[:n] for n in (1000, 37, 2049, 256, 511)]
    q = torch.randn(len(rows), 4, 576, generator=g) * 0.2
    gather = RowGatherer(fused_r(576, 512))
    out, lse = gather.attend(pool, rows, q, 512, 0.1, return_lse=True)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            for b in range(len(rows)):
                o, l = RowGatherer(fused_r(576, 512)).attend(pool, rows[b:b + 1], q[b:b + 1], 512, 0.1, return_lse=True)
                assert torch.equal(o[0], out[b]) and torch.equal(l[0], lse[b]), (n, b)
            o, l = gather.attend(pool, rows[::-1], q.flip(0), 512, 0.1, return_lse=True)
            assert torch.equal(o, out.flip(0)) and torch.equal(l, lse.flip(0))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kind,r,rope,scales", [("fp8", 512, 64, (0.5, 2.0)), ("fp8", 64, 16, (1.0, 1.0)),
                                                  ("fp8_ds_mla", 512, 64, ()), ("fp8_ds_mla", 64, 16, ()),
                                                  ("fp8_ds_mla", 144, 16, ())])
def test_fp8_rows_decode_in_the_kernel_to_the_torch_bits(fused_r, kind, r, rope, scales):
    """The kernel over FP8 rows equals, bit for bit, the kernel over the same rows decoded by
    KVFormat.decode_latent (the torch decode every other reader uses): its in-kernel decoding
    gives the same fp32 entries. Subnormal e4m3 values, negative zeros and saturated ±448 are in
    the rows; fp8_ds_mla at r = 144 has a partial last tile."""
    g = torch.Generator().manual_seed(r + rope)
    fmt = KVFormat(kind, r, rope, 0, scales)
    entries = torch.randn(1500, r + rope, generator=g) * torch.logspace(-4, 3, r + rope)
    entries[:5] = 0.0
    entries[5, :] = -0.0
    layer = len(scales) - 1 if scales else 0
    stored = fmt.encode_latent(layer, entries)
    assert stored.dtype == torch.uint8 and stored.shape == (1500, fmt.entry_bytes)
    decoded = fmt.decode_latent(layer, stored, torch.float32)
    rows = [torch.randperm(1500, generator=g)[:n] for n in LENGTHS if n <= 1500] + [torch.arange(100, 1400)]
    q = torch.randn(len(rows), 4, r + rope, generator=g) * 0.01
    out, lse = RowGatherer(fused_r(r + rope, r, kind, scales), fmt).attend(stored, rows, q, r, 0.1, True, layer)
    want, want_lse = RowGatherer(fused_r(r + rope, r)).attend(decoded, rows, q, r, 0.1, True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    torch_out, torch_lse = RowGatherer(None, fmt).attend(stored, rows, q, r, 0.1, True, layer)
    assert (out - torch_out).abs().max() <= 1e-5 * out.abs().max()  # values up to ~1e3: relative to the largest
    assert torch.allclose(lse[1:], torch_lse[1:], rtol=1e-5, atol=1e-5)


def test_where_the_kernel_applies(monkeypatch):
    assert fused_decode_attention(fp32(576, 512), torch.bfloat16, "cpu") is None  # fp32 queries only
    assert fused_decode_attention(KVFormat("bf16", 512, 64, 0), torch.float32, "cpu") is None  # not bf16 rows
    assert fused_decode_attention(fp32(576, 512), torch.float32, "meta") is None  # the CPU only
    assert fused_decode_attention(fp32(580, 512), torch.float32, "cpu") is None  # widths in 16s
    kernels.mla_decode.cache_clear()
    try:
        monkeypatch.setenv(kernels.ENV, "torch")
        assert fused_decode_attention(fp32(576, 512), torch.float32, "cpu") is None
        kernels.mla_decode.cache_clear()
        monkeypatch.setenv(kernels.ENV, "fused")
        monkeypatch.setattr(kernels, "_compiler", lambda: None)
        with pytest.raises(RuntimeError, match="no C compiler"):
            fused_decode_attention(fp32(576, 512), torch.float32, "cpu")
        kernels.mla_decode.cache_clear()
        monkeypatch.setenv(kernels.ENV, "auto")  # without a compiler: the torch path, said in the log
        assert fused_decode_attention(fp32(576, 512), torch.float32, "cpu") is None
        kernels.mla_decode.cache_clear()
        monkeypatch.setenv(kernels.ENV, "sometimes")
        with pytest.raises(ValueError, match=kernels.ENV):
            kernels.mla_decode()
    finally:
        kernels.mla_decode.cache_clear()


@pytest.mark.parametrize("b,h,r,c", [(1, 4, 512, 2), (3, 6, 64, 3), (5, 8, 16, 4), (2, 2, 32, 1)])
def test_dcp_pack_lays_out_the_partials_as_the_torch_path(fused_r, b, h, r, c):
    """engine/parallel/dcp.py's a2a exchange: head slice j of every request (output, then its
    lse) goes to rank j; the C packing gives the bits of the torch path."""
    fused_r(r + 16, r)  # the kernels are built
    pack = kernels.dcp_pack()
    assert pack is not None
    g = torch.Generator().manual_seed(b * 100 + h)
    out, lse = torch.randn(b, h, r, generator=g), torch.randn(b, h, generator=g)
    lse[0, 0] = float("-inf")  # an empty shard's
    send = torch.full((c, b, h // c, r + 1), float("nan"))
    pack(out.data_ptr(), lse.data_ptr(), b, h, r, c, send.data_ptr())
    want = torch.cat([out, lse.unsqueeze(-1)], dim=-1).view(b, c, h // c, r + 1).permute(1, 0, 2, 3)
    assert torch.equal(send, want)
