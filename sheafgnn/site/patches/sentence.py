"""``sentence`` patches: spans closed by ``.``/``!``/``?`` and white space, or by a blank line.

The white-space byte after the stop (or the second newline) closes a sentence
(:func:`~sheafgnn.site.rules.sentences`): only then is "3.14" told apart from
"end. Next". The scanner keeps the previous byte and the open sentence's start
token (and, for topic patches, its bytes).
"""

from __future__ import annotations

from sheafgnn.site import rules
from sheafgnn.site.patches.rule import Chunk, Closed, Patches, PatchRule, Window, closed_spans

_SPACE = rules.byte_set(rules.SPACE)
_STOP = rules.byte_set(rules.STOP)
_NEWLINE = rules.NEWLINE


class Sentence(PatchRule):
    name = "sentence"
    # Off unless asked for: on text the default model was no better with it (off: -0.020 bits per byte at
    # 1.05M tokens, 2 seeds, inside the seed spread of 0.054); docs/results.md#the-lean-default
    on_by_default = False
    covered = chained = anchored = True

    def spans(self, window: Window, config) -> Patches:
        return Patches(window.to_tokens(*rules.sentences(window.bytes)))

    def scanner(self, config, topic_model) -> SentenceScanner:
        return SentenceScanner(keep_text=False)


class SentenceScanner:
    """rules.sentences: the open sentence's start token and (if ``keep_text``) bytes."""

    def __init__(self, keep_text: bool) -> None:
        self.keep_text = keep_text
        self.prev = -1  # previous byte
        self.start: int | None = None  # start token of the open sentence (None: starts at the next byte)
        self.text = bytearray()

    def scan(self, data: bytes, toks: list[int]) -> Closed:
        """The sentences that ``data`` (the bytes of tokens ``toks``) closes: (start, end, their bytes)."""
        out = []
        for byte, tok in zip(data, toks):
            if self.start is None:
                self.start = tok
            if self.keep_text:
                self.text.append(byte)
            if (self.prev in _STOP and byte in _SPACE) or (self.prev == _NEWLINE and byte == _NEWLINE):
                out.append((self.start, tok + 1, bytes(self.text)))
                self.start, self.text = None, bytearray()
            self.prev = byte
        return out

    def push(self, chunk: Chunk) -> Patches | None:
        closed = self.scan(chunk.data, chunk.toks)
        return Patches(closed_spans(closed)) if closed else None


RULE = Sentence()
