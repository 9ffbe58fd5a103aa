"""``line`` patches: every line, closed by its newline, with its indent.

The example of a patch type added as one file: tests/test_layout.py copies it
into ``sheafgnn/site/patches/`` of a copy of the package, and the type is then
in the schema, in SiteConfig (``line_max_indent``), in build_site and SiteStream,
and in the model (its ``indent`` attribute gets an embedding), with nothing else
changed. Roles: covered, chained, read by the outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sheafgnn.site import rules
from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, closed_spans, integer

_SPACE = rules.byte_set(rules.SPACE)
_NEWLINE = rules.NEWLINE


@dataclass
class LineConfig:
    line_max_indent: int = integer(8)  # indents are clipped to this many bytes


class Line(PatchRule):
    name = "line"
    config_fields = LineConfig
    covered = chained = True
    attribute = "indent"  # white-space bytes before the line's first other byte, at most line_max_indent

    def attribute_rows(self, config) -> int:
        return config.line_max_indent + 1

    def spans(self, window: Window, config) -> Patches:
        b = window.bytes.long()
        end = torch.nonzero(b == _NEWLINE).squeeze(1) + 1  # (L,) exclusive: the newline closes its line
        start = torch.cat([end.new_zeros(1), end])[:-1]
        # The first byte at or after each line start that is not white space (a newline ends a blank line).
        positions = torch.arange(b.numel())
        first = torch.where(~rules.SPACE[b] | (b == _NEWLINE), positions, b.numel())
        first = first.flip(0).cummin(0).values.flip(0)
        indent = (first[start] - start).clamp(max=config.line_max_indent)
        return Patches(window.to_tokens(start, end), indent)

    def scanner(self, config, topic_model) -> LineScanner:
        return LineScanner(config.line_max_indent)


class LineScanner:
    """The open line's start token and indent so far."""

    def __init__(self, max_indent: int) -> None:
        self.max_indent = max_indent
        self.start: int | None = None  # start token of the open line (None: starts at the next byte)
        self.indent = 0
        self.in_indent = False  # only white space on the line so far

    def push(self, chunk: Chunk) -> Patches | None:
        closed = []
        for byte, tok in zip(chunk.data, chunk.toks):
            if self.start is None:
                self.start, self.indent, self.in_indent = tok, 0, True
            if byte == _NEWLINE:
                closed.append((self.start, tok + 1, min(self.indent, self.max_indent)))
                self.start = None
            elif self.in_indent and byte in _SPACE:
                self.indent += 1
            else:
                self.in_indent = False
        if not closed:
            return None
        return Patches(closed_spans(closed), torch.tensor([c[2] for c in closed]))


RULE = Line()
