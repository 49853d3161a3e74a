"""Incremental detokenization with stop strings, for streaming text deltas."""

from __future__ import annotations

from typing import Callable


class TextStream:
    """Turns a growing list of token ids into text deltas, honouring stop strings.

    The text is that of all ids so far (byte-level BPE pieces can split a UTF-8 character, so
    a trailing U+FFFD is held back until the next token completes it). Text that could be the
    start of a stop string is held back too; when a stop string appears, the text before it is
    the last delta and :attr:`stopped` becomes true.

    Incremental (the default): each push decodes only the ids after the last point where the
    text ended on a whole character (no trailing U+FFFD), and appends that to the text decoded
    before it, so a push costs its own tokens, not the whole output (decoding everything on every
    push made a stream's detokenisation quadratic in its length: issue 23). This is the text of
    all ids whenever ``decode(a + b) == decode(a) + decode(b)`` for every ``a`` whose text does
    not end in U+FFFD: true of byte-level BPE (the bytes of the pieces, decoded as UTF-8 with
    replacement), the only kind :class:`runtime.tokenizer.GGUFTokenizer` reads. Pass
    ``incremental=False`` for a decode without that property.

    Args:
        decode: ``ids -> str`` (the tokenizer's decode).
        stop: stop strings (empty strings are ignored).
        incremental: decode only the new ids (above); False: all ids at every push.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str] | tuple[str, ...] = (), *,
                 incremental: bool = True):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._incremental = incremental
        self._base = 0        # ids[:_base] decode to _stable, which ends on a whole character
        self._stable = ""
        self.ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    @property
    def has_stops(self) -> bool:
        """Whether it watches for stop strings (without, pushing ``a`` then ``b`` gives, joined,
        the text of pushing ``a + b`` once)."""
        return bool(self._stop)

    def _text(self) -> str:
        """The text of every id so far (moving the stable point to the end when it may)."""
        if not self._incremental:
            return self._decode(self.ids)
        tail = self._decode(self.ids[self._base:])
        text = self._stable + tail
        if tail and not tail.endswith("\ufffd"):
            self._stable, self._base = text, len(self.ids)
        return text

    def push(self, new_ids: list[int]) -> str:
        """Add ids; return the new text that is safe to emit now."""
        self.ids.extend(new_ids)
        text = self._text()
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
        return self._advance(self._text())

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
