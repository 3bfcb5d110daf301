"""Generated token ids → text deltas, with stop strings applied on the decoded text.

Rules (the same for HTTP and gRPC):

- text is held back while it ends in an incomplete UTF-8 character (the tokenizer's incremental
  decoder holds those bytes) or in a prefix of some stop string, so a delta never has to be
  taken back;
- when a stop string appears, the text ends just before it (the stop string is not sent;
  with ``include_stop``, vLLM's ``include_stop_str_in_output``, just after it) and the stream
  finishes with reason "stop";
- the text of a stop token (a stop id or EOS, ending the stream) is not rendered unless
  ``include_stop``; its id is still reported among the generated ids;
- special tokens render as nothing unless ``skip_special_tokens`` is False;
- at the end, whatever was held back (a stop-string prefix that never completed) is flushed.

Each token costs O(its text + the longest stop string): the tokenizer's ``decode_stream()``
turns ids into text incrementally (engine/model/tokenizer.py), and stop strings are searched
only in the tail that the new text can complete. ``flush`` decodes the whole output once, so the
streamed text equals the tokenizer's decode of the ids.
"""

from __future__ import annotations


class TextAssembler:
    def __init__(self, tokenizer, stop: tuple[str, ...] = (), stop_token_ids: frozenset[int] = frozenset(),
                 include_stop: bool = False, skip_special_tokens: bool = True):
        self.tokenizer, self.stop, self.include_stop = tokenizer, stop, include_stop
        self.stop_token_ids = frozenset() if include_stop else stop_token_ids
        self._decoder = tokenizer.decode_stream(skip_special_tokens)
        self._text = ""  # decoded text of the rendered ids
        self._sent = 0  # characters of _text already handed out
        self.stopped = False  # a stop string was found

    def push(self, token_id: int) -> str:
        """The new text that ``token_id`` makes safe to send ("" if none)."""
        if self.stopped:
            return ""
        if token_id in self.stop_token_ids:
            return ""
        self._text += self._decoder.step(token_id)
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return self._take(cut[1] if self.include_stop else cut[0])
        return self._take(len(self._text) - self._stop_prefix_len())

    def flush(self) -> str:
        """Everything not yet sent (at the end of the stream)."""
        if self.stopped:
            return ""
        self._text += self._decoder.finish()
        cut = self._find_stop()
        if cut is not None:
            self.stopped = True
            return self._take(cut[1] if self.include_stop else cut[0])
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        if end <= self._sent:
            return ""
        delta, self._sent = self._text[self._sent:end], end
        return delta

    def _find_stop(self) -> tuple[int, int] | None:
        """(start, end) of the first stop string in the text, if any."""
        if not self.stop:
            return None
        start = max(0, self._sent - max(len(s) for s in self.stop))
        hits = [(i, i + len(s)) for s, i in ((s, self._text.find(s, start)) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_len(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
