"""Log-probabilities and logit processors in the engines, against transformers and formulas
written out here (the oracle does not share the engine's sampler code)."""

from __future__ import annotations

import pytest
import torch

from engine.model.sampler import SamplingParams, process_logits
from engine.prefill_engine import CPPrefillEngine
from engine.reference import ReferenceEngine
from tests.hf_models import build_hf

LENGTHS = [40, 71]
TOP = 5


def prompts(lengths=LENGTHS, seed=5, vocab=300):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def ckpt(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    return path, build_hf(request.param, path)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [n, V]


def check_top(ours_ids, ours_vals, theirs: torch.Tensor, tol: float) -> None:
    """Top-N ids equal, except where two candidates' logprobs are within ``tol`` (a near-tie)."""
    vals, ids = torch.topk(theirs, len(ours_ids))
    assert torch.allclose(torch.tensor(ours_vals), vals, atol=tol)
    for k, (a, b) in enumerate(zip(ours_ids, ids.tolist())):
        if a != b:
            assert abs(float(theirs[a]) - float(theirs[b])) < tol, (k, a, b)


def test_prompt_and_token_logprobs_match_transformers(ckpt):
    path, hf = ckpt
    params = SamplingParams(max_new_tokens=6, stop_token_ids=(), logprobs=TOP, prompt_logprobs=TOP)
    seqs = ReferenceEngine(str(path), chunk_size=16).generate(prompts(), params)  # several chunks a prompt
    for seq in seqs:
        full = seq.prompt_ids + seq.output_ids
        lp = hf_logprobs(hf, full)
        scored = seq.prompt_logprobs()
        assert len(scored) == len(seq.prompt_ids) - 1
        for p, entry in enumerate(scored, start=1):  # prompt token p given tokens < p
            assert abs(entry.logprob - float(lp[p - 1, full[p]])) < 1e-4, p
            check_top(entry.top_ids, entry.top_logprobs, lp[p - 1], 1e-4)
        assert len(seq.logprobs) == len(seq.output_ids)
        n = len(seq.prompt_ids)
        for i, entry in enumerate(seq.logprobs):
            row = lp[n - 1 + i]
            assert abs(entry.logprob - float(row[seq.output_ids[i]])) < 1e-4, i
            assert entry.top_ids[0] == seq.output_ids[i] or abs(float(row[entry.top_ids[0]] - row[seq.output_ids[i]])) < 1e-4
            check_top(entry.top_ids, entry.top_logprobs, row, 1e-4)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("cp,strategy,layer_split", [(2, "zigzag", False), (3, "interleave", True)])
def test_cp_prompt_logprobs_equal_the_reference(cp, strategy, layer_split):
    ps = prompts([33, 100, 7], seed=9)
    params = SamplingParams(max_new_tokens=1, stop_token_ids=(), logprobs=3, prompt_logprobs=4)
    ref = ReferenceEngine("tiny").generate(ps, params)
    with CPPrefillEngine("tiny", cp=cp, strategy=strategy, layer_split=layer_split, chunk_size=48) as eng:
        seqs = eng.generate(ps, params)
    for a, b in zip(seqs, ref):
        assert a.output_ids == b.output_ids
        pa, pb = a.prompt_logprobs(), b.prompt_logprobs()
        assert len(pa) == len(pb) == len(a.prompt_ids) - 1
        assert max(abs(x.logprob - y.logprob) for x, y in zip(pa, pb)) < 1e-5
        for x, y in zip(pa, pb):
            assert len(x.top_ids) == 4
            if x.top_ids != y.top_ids:  # only at a near-tie
                assert max(abs(u - v) for u, v in zip(x.top_logprobs, y.top_logprobs)) < 1e-5
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 1e-5


def penalized(logits: torch.Tensor, prompt: list[int], out: list[int], rep: float, freq: float, pres: float,
              bias: dict[int, float], min_tokens: int, stops: set[int]) -> torch.Tensor:
    """The processors written out token by token (the documented formulas)."""
    l = logits.double().tolist()
    for t, b in bias.items():
        l[t] += b
    if len(out) < min_tokens:
        for t in stops:
            l[t] = float("-inf")
    for t in set(prompt) | set(out):
        l[t] = l[t] / rep if l[t] > 0 else l[t] * rep
    for t in set(out):
        l[t] -= freq * out.count(t) + pres
    return torch.tensor(l)


def test_penalties_bias_and_min_tokens_change_tokens_as_the_formulas_say(ckpt):
    path, hf = ckpt
    (p,) = prompts([24], seed=11)
    eng = ReferenceEngine(str(path))
    plain = eng.generate([p], SamplingParams(max_new_tokens=16, stop_token_ids=()))[0].output_ids
    stops = {plain[0], plain[3]}  # plain greedy would stop at once
    bias = {plain[1]: -2.5, 7: 1.5}
    # (repetition, frequency, presence, bias, min_tokens, stop ids): one processor at a time, then all
    configs = [(1.3, 0, 0, {}, 0, set()), (1, 0.4, 0, {}, 0, set()), (1, 0, 0.3, {}, 0, set()),
               (1, 0, 0, bias, 0, set()), (1, 0, 0, {}, 4, stops), (1.3, 0.4, 0.3, bias, 4, stops)]
    for rep, freq, pres, b, min_tokens, st in configs:
        params = SamplingParams(max_new_tokens=16, stop_token_ids=tuple(sorted(st)), repetition_penalty=rep,
                                frequency_penalty=freq, presence_penalty=pres, logit_bias=tuple(sorted(b.items())),
                                min_tokens=min_tokens)
        seq = eng.generate([p], params)[0]
        out = seq.output_ids
        assert out != plain[: len(out)] and not set(out[:min_tokens]) & st
        for i, token in enumerate(out):
            with torch.no_grad():
                logits = hf(torch.tensor([p + out[:i]])).logits[0, -1]
            expect = penalized(logits, p, out[:i], rep, freq, pres, b, min_tokens, st)
            top2 = torch.topk(expect, 2).values
            assert token == int(torch.argmax(expect)) or float(top2[0] - top2[1]) < 1e-4, (rep, freq, pres, i)
        assert seq.finish_reason == "length" or out[-1] in st


def test_processors_equal_the_formulas_on_random_logits():
    g = torch.Generator().manual_seed(3)
    for trial in range(20):
        logits = torch.randn(300, generator=g) * 4
        prompt = torch.randint(0, 300, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
        out = torch.randint(0, 40, (int(torch.randint(0, 30, (1,), generator=g)),), generator=g).tolist()  # repeats
        rep, freq, pres = (float(x) for x in torch.rand(3, generator=g) * torch.tensor([1.5, 2.0, 2.0]) +
                           torch.tensor([0.5, -1.0, -1.0]))
        bias = {int(t): float(b) for t, b in zip(torch.randint(0, 300, (4,), generator=g),
                                                  torch.randn(4, generator=g) * 10)}
        stops, min_tokens = {1, 2, int(out[0]) if out else 3}, int(torch.randint(0, 40, (1,), generator=g))
        params = SamplingParams(max_new_tokens=64, repetition_penalty=rep, frequency_penalty=freq,
                                presence_penalty=pres, logit_bias=tuple(sorted(bias.items())), min_tokens=min_tokens)
        ours = process_logits(logits, params, prompt, out, frozenset(stops))
        expect = penalized(logits, prompt, out, rep, freq, pres, bias, min_tokens, stops).float()
        finite = torch.isfinite(expect)
        assert torch.equal(finite, torch.isfinite(ours)), trial
        assert torch.allclose(ours[finite], expect[finite], atol=1e-5), trial


def test_bad_processor_values_name_the_field():
    eng = ReferenceEngine("tiny")
    for params, field in ((SamplingParams(min_tokens=17), "min_tokens"),
                          (SamplingParams(repetition_penalty=0), "repetition_penalty"),
                          (SamplingParams(presence_penalty=3), "presence_penalty"),
                          (SamplingParams(logit_bias=((10**6, 1.0),)), "logit_bias"),
                          (SamplingParams(logprobs=21), "logprobs")):
        with pytest.raises(ValueError, match=f"^{field}"):
            eng.add_request([5, 6], params)
