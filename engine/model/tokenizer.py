"""Tokenizers: the checkpoint's ``tokenizer.json`` (Hugging Face tokenizers), else byte-level.

Byte-level ids: 0 = <bos>, 1 = <eos>, 2 = <pad>, 3 + b for byte b; ids above 258 decode to "".
"""

from __future__ import annotations

from pathlib import Path

BYTE_OFFSET = 3


class ByteTokenizer:
    bos_token_id, eos_token_id = 0, 1

    def encode(self, text: str) -> list[int]:
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        data = bytes(i - BYTE_OFFSET for i in ids if BYTE_OFFSET <= i < BYTE_OFFSET + 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model: str | Path):
    """The tokenizer of a checkpoint directory or of an embedded model name (``tiny``...)."""
    from engine.model.tiny import resolve_model_dir

    path = resolve_model_dir(model) / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else ByteTokenizer()
