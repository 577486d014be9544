"""Text from a stream of token ids: deltas safe to send, and stop strings applied.

Each step decodes the whole output so far (a few µs per token with ``tokenizers``) and hands
on only what is settled: text ending in an incomplete UTF-8 sequence waits, and so does a tail
that could still become a stop string. When a stop string appears the text ends before it —
the rule the engines apply (``LLMEngine._hit_stop_string``), so streamed and whole answers agree.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes of a character not yet complete


class TextStream:
    """Turns growing token ids into text deltas for one request."""

    def __init__(self, decode: Callable[[list[int]], str], stop: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stop = stop
        self._ids: list[int] = []
        self.sent = ""  # text handed on so far
        self.stopped = False  # a stop string was seen: nothing more is sent

    def add(self, token_ids: tuple[int, ...] | list[int]) -> str:
        """Take new tokens; the text that can be sent now."""
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        cut = self._stop_at(text)
        if cut is not None:
            self.stopped = True
            return self._emit(text[:cut])
        return self._emit(text[: len(text) - self._held_back(text)])

    def finish(self, token_ids: list[int]) -> str:
        """The request ended with ``token_ids``: whatever text remains to send."""
        if self.stopped:
            return ""
        self._ids = list(token_ids)
        text = self._decode(self._ids)
        cut = self._stop_at(text)
        self.stopped = True
        return self._emit(text if cut is None else text[:cut])

    def _emit(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""  # a decode that rewrote earlier text: keep what was sent
        delta, self.sent = text[len(self.sent):], text
        return delta

    def _stop_at(self, text: str) -> int | None:
        hits = [i for s in self._stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """How many trailing characters to keep until the next tokens settle them."""
        held = 1 if text.endswith(REPLACEMENT) else 0
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held


def final_text(decode: Callable[[list[int]], str], token_ids: list[int],
               stop: tuple[str, ...]) -> str:
    """The whole answer's text, cut before the first stop string."""
    return TextStream(decode, stop).finish(token_ids)
