"""``syntax`` patches: balanced brackets, paired quotes on a line and indentation blocks.

Brackets ``()[]{}`` nest at most ``syntax_max_depth`` deep; ``"`` and ````` ``
pair on a line (the 1st with the 2nd, the 3rd with the 4th...); a line indented
deeper than the previous non-blank line opens a block that closes on the first
non-space byte of a later line indented less. Spans longer than
``syntax_max_span`` tokens are dropped. The scanners keep:

- brackets: the running depth and the last bracket of each level <= max depth;
- quotes: the parity of the quotes seen on the current line and the last quote;
- indentation: the current line's start and indent, the previous line's indent,
  and the stack of pending openers (each popped once).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sheafgnn.site import rules
from sheafgnn.site.patches.rule import (
    Chunk,
    Closed,
    Patches,
    PatchRule,
    Window,
    closed_spans,
    integer,
    sort_by_time,
)

_SPACE = rules.byte_set(rules.SPACE)
_KIND = {**rules.OPEN, **{byte: -k for byte, k in rules.CLOSE.items()}}  # open > 0, close < 0
_QUOTES = frozenset(rules.QUOTES)
_NEWLINE = rules.NEWLINE


@dataclass
class SyntaxConfig:
    syntax_max_span: int = integer(512)  # drop bracket/quote/indent spans longer than this (tokens)
    syntax_max_depth: int = integer(8)  # drop brackets nested deeper than this


class Syntax(PatchRule):
    name = "syntax"
    # Off unless asked for: on text the default model was no better with it (off: -0.010 bits per byte at
    # 1.05M tokens, 2 seeds, inside the seed spread of 0.054); docs/results.md#the-lean-default
    on_by_default = False
    config_fields = SyntaxConfig
    covered = chained = True

    def spans(self, window: Window, config) -> Patches:
        b = window.bytes
        parts = [rules.brackets(b, config.syntax_max_depth), rules.quotes(b), rules.indent_blocks(b)]
        start, end = window.to_tokens(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
        keep = end - start <= config.syntax_max_span
        return Patches(sort_by_time(start[keep], end[keep])[:2])

    def scanner(self, config, topic_model) -> SyntaxScanner:
        return SyntaxScanner(config.syntax_max_span, config.syntax_max_depth)


class SyntaxScanner:
    """Closed brackets, quotes and indentation blocks up to ``max_span`` tokens, in the vectorised
    rule's order: (time, start), then brackets by (level, open byte), quotes, indents by level."""

    def __init__(self, max_span: int, max_depth: int) -> None:
        self.max_span = max_span
        self.parts = (BracketScanner(max_depth), QuoteScanner(), IndentScanner())

    def push(self, chunk: Chunk) -> Patches | None:
        closed = [c for part in self.parts for c in part.scan(chunk.data, chunk.toks, chunk.first_byte)
                  if c[1] - c[0] <= self.max_span]
        if not closed:
            return None
        closed.sort(key=lambda c: (c[1], c[0], c[2]))
        return Patches(closed_spans(closed))


class BracketScanner:
    """rules.brackets: the running depth and the last bracket (kind, token, byte) of each level."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.depth = 0
        self.last: dict[int, tuple[int, int, int]] = {}

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            kind = _KIND.get(byte)
            if kind is None:
                continue
            level = self.depth + 1 if kind > 0 else self.depth
            self.depth += 1 if kind > 0 else -1
            if level > self.max_depth:
                continue
            last = self.last.get(level)
            if last is not None and last[0] > 0 and kind == -last[0]:
                out.append((last[1], tok + 1, (0, level, last[2])))
            self.last[level] = (kind, tok, first_byte + i)
        return out


class QuoteScanner:
    """rules.quotes: the parity of the quotes on the current line and the last one."""

    def __init__(self) -> None:
        self.odd = False  # an odd number of quotes on this line so far
        self.last = (-1, -1, -1)  # (byte, token, byte position) of the last quote

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            if byte == _NEWLINE:
                self.odd = False
            elif byte in _QUOTES:
                if self.odd and self.last[0] == byte:
                    out.append((self.last[1], tok + 1, (1, self.last[2], 0)))
                self.odd = not self.odd
                self.last = (byte, tok, first_byte + i)
        return out


class IndentScanner:
    """rules.indent_blocks: the current line, the previous indent and the pending openers."""

    def __init__(self) -> None:
        self.at_line_start = True
        self.line = (0, 0)  # (start token, start byte) of the current line
        self.column = 0  # white-space bytes before the line's first non-space byte
        self.decided = False  # the line's indent (or blankness) is known
        self.prev_indent: int | None = None  # of the previous non-blank line
        self.pending: list[tuple[int, int, int]] = []  # (indent, start token, start byte), indents increasing

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            if self.at_line_start:
                self.at_line_start, self.decided, self.column = False, False, 0
                self.line = (tok, first_byte + i)
            if not self.decided:
                if byte == _NEWLINE:
                    self.decided = True  # a blank line
                elif byte in _SPACE:
                    self.column += 1
                else:
                    self.decided = True
                    out.extend(self._line_indented(self.column, tok))
            if byte == _NEWLINE:
                self.at_line_start = True
        return out

    def _line_indented(self, indent: int, tok: int) -> Closed:
        """A non-blank line with ``indent`` reached its first non-space byte (in token ``tok``)."""
        out = []
        while self.pending and self.pending[-1][0] > indent:
            level, start, start_byte = self.pending.pop()
            out.append((start, tok + 1, (2, level, start_byte)))
        if self.prev_indent is not None and indent > self.prev_indent:
            self.pending.append((indent, *self.line))
        self.prev_indent = indent
        return out


RULE = Syntax()
