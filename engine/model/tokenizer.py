"""The checkpoint's tokenizer, through transformers' ``AutoTokenizer`` (as vLLM and SGLang load it).

``load_tokenizer(model, tokenizer=None, trust_remote_code=False, chat_template=None)`` returns

- a :class:`Tokenizer` wrapping the transformers tokenizer of ``tokenizer`` (a directory) or of
  the checkpoint directory: ``tokenizer_config.json`` decides BOS/EOS, added special tokens and
  whether BOS is added; ``encode`` adds the special tokens the tokenizer adds (BOS for DeepSeek /
  Kimi / the tiny models), ``decode`` skips special tokens, ``apply_chat_template`` renders a
  conversation with the checkpoint's template (``tokenizer_config.json`` or
  ``chat_template.jinja``; ``chat_template`` — a file — overrides it);
- a :class:`NoTokenizer` when the directory has no tokenizer files: token ids still work, text
  raises :class:`NoTokenizerError` (the router turns that into a 400). There is no silent byte
  fallback for a checkpoint.

A tokenizer that ships code (``auto_map`` in ``tokenizer_config.json``, e.g. Kimi-K2's tiktoken
one) loads only with ``trust_remote_code``; without it the error names ``--trust-remote-code``.

Streaming: :meth:`Tokenizer.decode_stream` gives an incremental decoder whose ``step`` costs
O(new tokens): the tokenizers library's ``DecodeStream`` for fast tokenizers, an offset-based
window for Python ("slow") ones. Both hold text back while it ends in an incomplete UTF-8
character; ``finish`` returns what the full decode has beyond what was streamed, so the streamed
text always equals ``decode(all ids)``.

Length bound: :meth:`Tokenizer.min_tokens` gives a lower bound on ``len(encode(text))`` in
O(len(text)) without tokenizing, so the router can refuse a prompt that provably exceeds the
context before paying for its tokenization. It rests on :func:`max_token_bytes`, the most UTF-8
bytes one token can cover, which is proved only for byte-level BPE without a normalizer (GPT-2,
Llama-3, DeepSeek-V3, GLM, Qwen, the tiny and demo models) and is ``None`` otherwise.

The embedded tiny models ship a Hugging Face tokenizer folder with byte ids: 0 = <bos>,
1 = <eos>, 2 = <pad>, 3 + b for byte b, and ``<unused_N>`` special tokens up to the vocabulary.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("cpserve.tokenizer")

BYTE_OFFSET = 3
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


class TokenizerError(ValueError):
    """The tokenizer cannot be loaded (named file, flag or field in the message)."""


class NoTokenizerError(ValueError):
    """Text was given to a model served without a tokenizer."""


class NoChatTemplateError(ValueError):
    """A conversation was given to a tokenizer without a chat template."""


class Tokenizer:
    """A transformers tokenizer with the calls cpserve makes."""

    def __init__(self, hf: Any, source: Path):
        self.hf, self.source = hf, source
        self.bos_token_id: int | None = hf.bos_token_id
        self.eos_token_id: int | None = hf.eos_token_id
        self._backend = getattr(hf, "backend_tokenizer", None)  # a tokenizers.Tokenizer for fast ones

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's special tokens (BOS where it adds one)."""
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages: list[dict]) -> str:
        if not self.has_chat_template:
            raise NoChatTemplateError("the model's tokenizer has no chat template (pass --chat-template FILE)")
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """The ids of ``messages`` rendered with the chat template, generation prompt added. The
        template writes its own special tokens (BOS), so none are added when encoding it."""
        return self.encode_rendered(self.render_chat(messages))

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a rendered chat template (its special tokens are in the text: none added)."""
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode_stream(self, skip_special_tokens: bool = True) -> "FastDecodeStream | OffsetDecodeStream":
        if self._backend is not None:
            return FastDecodeStream(self, skip_special_tokens)
        return OffsetDecodeStream(self, skip_special_tokens)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        """:func:`max_token_bytes` of this tokenizer. The first read parses the whole
        ``tokenizer.json`` (the vocabulary included); read it once at start-up to keep that cost
        off a request."""
        return max_token_bytes(self.hf)

    def min_tokens(self, text: str) -> int | None:
        """A lower bound on ``len(self.encode(text))`` and on the ids of ``text`` encoded without
        special tokens (a rendered chat, whose special tokens are literal text), or ``None`` when
        the tokenizer gives no proof. Every token covers at most ``max_token_bytes`` bytes of
        ``text``, so ``ceil(bytes / max_token_bytes)`` tokens are needed; added BOS/EOS only add.
        Costs one UTF-8 encode of ``text`` unless it is ASCII (``isascii`` is O(1) in CPython)."""
        most = self.max_token_bytes
        if most is None:
            return None
        # surrogatepass: a lone surrogate (valid in JSON) counts as its 3 bytes instead of raising
        size = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return -(-size // most)


class _StreamBase:
    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self.sent = 0  # characters handed out

    def finish(self) -> str:
        """The text of all ids beyond what ``step`` returned (one full decode, at the end)."""
        if not self.ids:
            return ""
        full = self.tok.decode(self.ids, self.skip)
        tail = full[self.sent:] if len(full) > self.sent else ""
        self.sent += len(tail)
        return tail


class FastDecodeStream(_StreamBase):
    """tokenizers' ``DecodeStream``: O(1) amortised per token."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        super().__init__(tok, skip_special_tokens)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        try:
            piece = self._stream.step(self.tok._backend, token_id)
        except Exception:  # an id the tokenizer's vocabulary lacks (padded embedding rows): no text
            piece = None
        piece = piece or ""
        self.sent += len(piece)
        return piece


class OffsetDecodeStream(_StreamBase):
    """For tokenizers without a Rust backend: decode a short window of recent ids and send what
    it has beyond the window's previous text, unless that ends in an incomplete character."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = True):
        super().__init__(tok, skip_special_tokens)
        self._prefix = 0  # window start
        self._read = 0  # ids whose text was sent

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        before = self.tok.decode(self.ids[self._prefix:self._read], self.skip)
        after = self.tok.decode(self.ids[self._prefix:], self.skip)
        if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        piece = after[len(before):]
        self.sent += len(piece)
        return piece


class NoTokenizer:
    """A model served without a tokenizer: ids in, ids out; text is refused."""

    bos_token_id = eos_token_id = None
    has_chat_template = False
    max_token_bytes = None

    def __init__(self, source: Path):
        self.source = source

    def min_tokens(self, text: str) -> None:
        """No bound: text is refused anyway (``encode`` raises :class:`NoTokenizerError`)."""
        return None

    def _refuse(self, *_a, **_k):
        raise NoTokenizerError(f"the model has no tokenizer ({self.source} has none of {', '.join(TOKENIZER_FILES)}; "
                               "pass --tokenizer DIR, or send token ids)")

    encode = render_chat = apply_chat_template = encode_rendered = _refuse

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""

    def decode_stream(self, skip_special_tokens: bool = True) -> "_Silent":
        return _Silent()


class _Silent:
    def step(self, token_id: int) -> str:
        return ""

    def finish(self) -> str:
        return ""


def _needs_remote_code(path: Path) -> str | None:
    cfg_path = path / "tokenizer_config.json"
    if not cfg_path.is_file():
        return None
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, ValueError) as e:
        raise TokenizerError(f"tokenizer: cannot read {cfg_path}: {e}") from None
    auto_map = cfg.get("auto_map") or {}
    ref = auto_map.get("AutoTokenizer") if isinstance(auto_map, dict) else None
    if isinstance(ref, list):
        ref = next((r for r in ref if r), None)
    return ref or None


def load_tokenizer(model: str | Path, tokenizer: str | Path | None = None, trust_remote_code: bool = False,
                   chat_template: str | Path | None = None) -> Tokenizer | NoTokenizer:
    """The tokenizer of ``tokenizer`` (a directory), else of the checkpoint ``model`` (a directory
    or an embedded model name such as ``tiny``)."""
    from engine.model.tiny import resolve_model_dir

    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.is_dir():
            raise TokenizerError(f"--tokenizer: {str(tokenizer)!r} is not a directory")
    else:
        path = resolve_model_dir(model)
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        if tokenizer is not None:
            raise TokenizerError(f"--tokenizer: {path} has none of {', '.join(TOKENIZER_FILES)}")
        logger.warning("%s has no tokenizer: text requests will be refused, token ids work", path)
        return NoTokenizer(path)
    remote = _needs_remote_code(path)
    if remote and not trust_remote_code:
        raise TokenizerError(f"tokenizer: {path / 'tokenizer_config.json'} maps AutoTokenizer to code shipped with "
                             f"the checkpoint ({remote}); pass --trust-remote-code to run it")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code, local_files_only=True)
    except Exception as e:  # transformers raises many kinds; the message names the cause
        raise TokenizerError(f"tokenizer: cannot load {path}: {type(e).__name__}: {e}") from None
    if chat_template is not None:
        file = Path(chat_template)
        try:
            hf.chat_template = file.read_text()
        except OSError as e:
            raise TokenizerError(f"--chat-template: cannot read {file}: {e.strerror or e}") from None
    return Tokenizer(hf, path)


def byte_tokenizer_files(vocab_size: int, chat_template: str) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` (as text) of a byte-level BPE tokenizer
    with the tiny models' ids: 0 <bos>, 1 <eos>, 2 <pad>, 3 + b for byte b, then ``<unused_N>``
    special tokens up to ``vocab_size``; BOS added to every encoding."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors

    if vocab_size < BYTE_OFFSET + 256:
        raise ValueError(f"vocab_size: a byte tokenizer needs at least {BYTE_OFFSET + 256} ids, got {vocab_size}")
    chars = pre_tokenizers.ByteLevel.alphabet()
    byte_char = _bytes_to_unicode()
    assert set(byte_char.values()) == set(chars)
    specials = ["<bos>", "<eos>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({byte_char[b]: BYTE_OFFSET + b for b in range(256)})
    unused = [f"<unused_{i}>" for i in range(BYTE_OFFSET + 256, vocab_size)]
    vocab.update({t: BYTE_OFFSET + 256 + k for k, t in enumerate(unused)})
    tok = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + unused])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", pair="<bos> $A <bos> $B",
                                                       special_tokens=[("<bos>", 0)])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True, "add_eos_token": False,
              "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "model_max_length": 131072,
              "clean_up_tokenization_spaces": False, "chat_template": chat_template}
    return {"tokenizer.json": tok.to_str(pretty=True), "tokenizer_config.json": json.dumps(config, indent=2)}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (the one ByteLevel pre-tokenizers use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


# Pre-tokenizers that only cut text into pieces; with behavior "Removed" a cut drops what it matches.
_SPLITTERS = ("Split", "Digits", "Punctuation")


def max_token_bytes(hf: Any) -> int | None:
    """The most UTF-8 bytes of input text that one token of the transformers tokenizer ``hf`` can
    cover, or ``None`` when no cheap proof exists.

    Proved only when ``hf`` encodes through its Rust backend unchanged and that backend's JSON has
    no normalizer, no truncation, a ByteLevel pre-tokenizer (alone or in a Sequence with splitters
    that drop nothing), a BPE model without subword prefix/suffix whose vocabulary holds all 256
    byte characters, and no added token that strips blanks beside it. Then the text reaches the
    model as one character per byte, so a vocabulary token of k characters covers k bytes, no byte
    becomes an unknown token (which could stand for any number of bytes) or vanishes, and an added
    token covers exactly its content's bytes. The answer is the maximum of those.
    Why ``None`` elsewhere: a normalizer may shrink text (NFKC folds full-width "Ａ" into "A", NFC
    composes, Replace and Strip remove), WordLevel/WordPiece/Unigram map a whole unknown word to one
    token, and a Python subclass may rewrite the text before the backend sees it."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or not _encodes_through_backend(hf):
        return None
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if (spec.get("normalizer") is not None or spec.get("truncation") is not None
            or not _byte_level_splits_only(spec.get("pre_tokenizer"))
            or model.get("type") != "BPE" or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")):
        return None
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = model.get("vocab") or {}
    if not all(ch in vocab for ch in ByteLevel.alphabet()):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    most = max([len(t) for t in vocab] + [len(t["content"].encode("utf-8")) for t in added])
    return most if most >= 1 else None


def _encodes_through_backend(hf: Any) -> bool:
    """Whether ``hf.encode`` hands the text to the Rust backend as transformers' own fast class
    does (not a subclass that overrides the encode path, as some model and remote-code classes do)."""
    from transformers import PreTrainedTokenizerFast

    cls = type(hf)
    return isinstance(hf, PreTrainedTokenizerFast) and all(
        getattr(cls, name, None) is getattr(PreTrainedTokenizerFast, name, None)
        for name in ("encode", "_encode_plus", "_batch_encode_plus"))


def _byte_level_splits_only(pre: dict | None) -> bool:
    steps = (pre.get("pretokenizers") or []) if pre and pre.get("type") == "Sequence" else [pre]
    kinds = [step.get("type") if isinstance(step, dict) else None for step in steps]
    return "ByteLevel" in kinds and all(
        kind == "ByteLevel" or (kind in _SPLITTERS and step.get("behavior") != "Removed")
        for kind, step in zip(kinds, steps))
