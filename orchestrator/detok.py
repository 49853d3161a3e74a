"""Incremental detokenization with stop strings, for streaming text deltas."""

from __future__ import annotations

from typing import Callable


class TextStream:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    Text is decoded from all ids so far (byte-level BPE pieces can split a UTF-8 character, so
    a trailing U+FFFD is held back until the next token completes it). Text that could be the
    start of a stop string is held back too; when a stop string appears, the text before it is
    the last delta and :attr:`stopped` becomes true.

    Args:
        decode: ``ids -> str`` (the tokenizer's decode).
        stop: stop strings (empty strings are ignored).
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | tuple[str, ...] = ()):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the new text that is safe to emit now."""
        self.ids.extend(new_ids)
        text = self._decode(self.ids)
        if self._stop:
            # A stop string can only start in the not-yet-emitted tail, or straddle its border.
            start = max(0, len(self.emitted) - max(len(s) for s in self._stop) + 1)
            hits = [i for s in self._stop if (i := text.find(s, start)) >= 0]
            if hits:
                self.stopped = True
                return self._advance(text[: min(hits)])
        while text.endswith("\ufffd"):
            text = text[:-1]
        hold = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return self._advance(text[: len(text) - hold] if hold else text)

    def finish(self) -> str:
        """Flush held-back text at the end of generation (unless a stop string matched)."""
        if self.stopped:
            return ""
        return self._advance(self._decode(self.ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
