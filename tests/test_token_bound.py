"""The token-count lower bound (engine/model/tokenizer.py: ``max_token_bytes``, ``min_tokens``).

The router refuses a prompt whose ``min_tokens`` exceeds the context without tokenizing it, so the
bound must never exceed the real count. Checked on the shipped tokenizers and on tokenizer folders
in the formats releases use (built here with the ``tokenizers`` library); for each format that
gets ``None``, a counterexample shows that the naive bound would refuse a prompt that fits.
"""

import json
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from engine.model.tokenizer import NoTokenizer, Tokenizer, load_tokenizer, max_token_bytes

CORPUS = ["Context parallelism splits long prompts across ranks. ", "the quick brown fox jumps over the lazy dog ",
          "长上下文 并行 解码 预填充 长上下文 ", "naïve café über façade 2024 31415 ",
          "✓ ✓ → → 😀😀 ", "    indented\n\n\tcode();\r\n"] * 20
# Llama-3's pre-tokenizer regex (a Split before a regex-less ByteLevel).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT2_SPECIALS = ["<|endoftext|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|eot_id|>"] + [f"<|reserved_special_token_{i}|>" for i in range(4)]

PIECES = ["<bos>", "<eos>", "<pad>", "<unused_7>", "<|user|>", "<|assistant|>", "<|system|>", *GPT2_SPECIALS,
          *LLAMA3_SPECIALS, " ", "   ", "\n", "\n\n\n", "\t", "\r\n", "the", " quick", "长上下文", "\u1100\u1161", "😀",
          "👨\u200d👩\u200d👧", "🇺🇸", "e\u0301", "ﬃ", "12345", "ÿ", "\x00", "Ġ", "▁"]
# Random text, pieces above (alone and in long runs) and literal special tokens; no lone surrogates,
# which the tokenizers library cannot encode at all.
TEXTS = st.lists(st.one_of(st.text(max_size=20), st.sampled_from(PIECES),
                           st.sampled_from(PIECES).map(lambda p: p * 10)), max_size=30).map("".join)


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


def save(tok: RustTokenizer, path: Path, **config) -> Tokenizer:
    """``tok`` as a checkpoint's tokenizer folder, loaded as cpserve loads one."""
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    loaded = load_tokenizer(path)
    assert isinstance(loaded, Tokenizer)
    return loaded


def byte_level_bpe(pre_tokenizer, specials: list[str], corpus: list[str] = CORPUS,
                   full_alphabet: bool = True) -> RustTokenizer:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet() if full_alphabet else []
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials, show_progress=False,
                                                        initial_alphabet=alphabet))
    return tok


def gpt2_style(corpus: list[str] = CORPUS) -> RustTokenizer:
    return byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), GPT2_SPECIALS, corpus)


def llama3_style() -> RustTokenizer:
    return byte_level_bpe(pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), LLAMA3_SPECIALS)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    root = tmp_path_factory.mktemp("tok")
    return {"tiny": load_tokenizer("tiny"), "demo": load_tokenizer("demo"),
            "gpt2": save(gpt2_style(), root / "gpt2", bos_token="<|endoftext|>", eos_token="<|endoftext|>"),
            "llama3": save(llama3_style(), root / "llama3", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")}


def test_shipped_tokenizers_bound_by_their_longest_special_token(tokenizers):
    tiny, demo = tokenizers["tiny"], tokenizers["demo"]
    last_unused = f"<unused_{tiny.hf.backend_tokenizer.get_vocab_size() - 1}>"
    assert tiny.max_token_bytes == len(last_unused)
    assert demo.max_token_bytes == len("<|assistant|>") == 13


def test_trained_byte_level_bpe_bound_is_longest_token(tokenizers):
    for name, specials in (("gpt2", GPT2_SPECIALS), ("llama3", LLAMA3_SPECIALS)):
        backend = tokenizers[name].hf.backend_tokenizer
        longest_merge = max(len(t) for t in backend.get_vocab(with_added_tokens=False))
        assert longest_merge > 1  # the trainer merged something
        assert tokenizers[name].max_token_bytes == max(longest_merge, *map(utf8_len, specials))


@pytest.mark.parametrize("name", ["tiny", "demo", "gpt2", "llama3"])
def test_bound_never_exceeds_token_count(tokenizers, name):
    tok = tokenizers[name]

    @settings(max_examples=40, deadline=None)
    @given(TEXTS)
    def check(text):
        bound = tok.min_tokens(text)
        assert bound == -(-utf8_len(text) // tok.max_token_bytes)
        assert bound <= len(tok.encode(text))
        # a rendered chat is encoded without added special tokens; its own are literal text
        assert bound <= len(tok.hf.encode(text, add_special_tokens=False))

    check()


@settings(max_examples=40, deadline=None)
@given(st.binary(max_size=300).map(lambda b: b.decode("latin-1").replace("<", "")))
def test_tiny_bound_is_within_its_factor_of_byte_count(tokenizers, text):
    """Without a literal special token the tiny tokenizer spends one token per byte plus BOS, so
    the bound is that count divided by M, rounded up: loose by the factor M on plain text."""
    tiny = tokenizers["tiny"]
    size = utf8_len(text)
    assert len(tiny.encode(text)) == size + 1
    assert tiny.min_tokens(text) == -(-size // tiny.max_token_bytes)


@pytest.mark.parametrize("name", ["tiny", "demo", "llama3"])
def test_bound_is_met_by_a_run_of_the_longest_special(tokenizers, name):
    """M cannot be smaller: a run of the longest special token, encoded as a rendered chat is,
    has exactly the bound's count."""
    tok = tokenizers[name]
    longest = max(tok.hf.backend_tokenizer.get_added_tokens_decoder().values(), key=lambda t: len(t.content)).content
    assert utf8_len(longest) == tok.max_token_bytes
    text = longest * 50
    assert len(tok.hf.encode(text, add_special_tokens=False)) == tok.min_tokens(text) == 50


def naive_bound(tok: Tokenizer, text: str) -> int:
    """The bound as if every token covered at most as many bytes as its string has characters."""
    most = max(len(t) for t in tok.hf.backend_tokenizer.get_vocab(with_added_tokens=True))
    return -(-utf8_len(text) // most)


def with_normalizer(normalizer, corpus: list[str]) -> RustTokenizer:
    tok = gpt2_style(corpus)
    tok.normalizer = normalizer
    return tok


def with_pre_tokenizer(pre_tokenizer) -> RustTokenizer:
    tok = gpt2_style()
    tok.pre_tokenizer = pre_tokenizer
    return tok


def with_lstrip_mask() -> RustTokenizer:
    tok = gpt2_style()
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, special=True)])
    return tok


def metaspace_byte_fallback() -> RustTokenizer:
    """SentencePiece converted (Llama-2, Mistral): Metaspace pieces, unknown bytes as <0xAB>."""
    tok = RustTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(["长上下文 "] * 20, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                  show_progress=False))
    return tok


def word_level() -> RustTokenizer:
    tok = RustTokenizer(models.WordLevel({"[UNK]": 0, "the": 1, "fox": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


NO_PROOF = {
    # NFKC folds full-width letters (3 bytes) into ASCII, which then merges
    "nfkc": (lambda: with_normalizer(normalizers.NFKC(), [" quick brown"] * 20),
             "\u3000ｑｕｉｃｋ\u3000ｂｒｏｗｎ" * 50),
    # NFC composes Hangul jamo (6 bytes) into a syllable (3 bytes)
    "nfc": (lambda: with_normalizer(normalizers.NFC(), ["가가가가 "] * 20), "\u1100\u1161" * 400),
    "removing_split": (lambda: with_pre_tokenizer(pre_tokenizers.Sequence([
        pre_tokenizers.Split(" ", behavior="removed"), pre_tokenizers.ByteLevel(add_prefix_space=False)])), " " * 200),
    # bytes missing from the vocabulary vanish (there is no unknown token)
    "partial_alphabet": (lambda: byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), GPT2_SPECIALS,
                                                full_alphabet=False), "\x00" * 100),
    "lstrip_added_token": (with_lstrip_mask, " " * 200 + "<mask>"),
    # a piece of k characters covers up to 4k bytes
    "metaspace_byte_fallback": (metaspace_byte_fallback, "长上下文 " * 100),
    # an unknown word of any length is one [UNK]
    "word_level": (word_level, "x" * 1000),
}


@pytest.mark.parametrize("name", NO_PROOF)
def test_formats_without_proof_get_none(tmp_path, name):
    build, counterexample = NO_PROOF[name]
    tok = save(build(), tmp_path / name)
    assert tok.max_token_bytes is None
    assert tok.min_tokens("any text") is None
    assert len(tok.encode(counterexample)) < naive_bound(tok, counterexample)


def test_subclass_that_rewrites_text_gets_none(tmp_path):
    from transformers import PreTrainedTokenizerFast

    class Shortening(PreTrainedTokenizerFast):
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus(text[:10], *args, **kwargs)

    hf = Shortening(tokenizer_object=gpt2_style())
    assert max_token_bytes(hf) is None
    assert max_token_bytes(PreTrainedTokenizerFast(tokenizer_object=gpt2_style())) is not None


def test_no_tokenizer_has_no_bound(tmp_path):
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, NoTokenizer)
    assert tok.max_token_bytes is None and tok.min_tokens("hello") is None


@pytest.mark.parametrize("name", ["tiny", "demo"])
@pytest.mark.parametrize("unit", ["a", "长", "😀 x"])
def test_ten_mib_prompt_is_refused_fast(tokenizers, name, unit):
    tok = tokenizers[name]
    tok.max_token_bytes  # computed once; the router reads it at start-up
    text = unit * ((10 << 20) // utf8_len(unit))
    elapsed = []
    for _ in range(3):  # the best of three: a busy machine may preempt one run
        start = time.perf_counter()
        bound = tok.min_tokens(text)
        elapsed.append(time.perf_counter() - start)
    # A sanity check with a generous limit (it takes milliseconds), not a benchmark.
    assert min(elapsed) < 0.2
    assert bound > tok.hf.model_max_length
