"""``instruction`` patches: lines that start with one of ``instruction_cues``, closed by their newline.

Each anchors the later anchored patches (local, sentence) that start within
``anchor_scope`` tokens of its end, until the next instruction. The scanner
keeps the current line's start token and its first max(len(cue)) bytes.

A cue may not hold a newline before its last byte: :func:`~sheafgnn.site.build_site`
would then need bytes after the line's newline, which is not causal, so the
scanner refuses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from sheafgnn.site import rules
from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, closed_spans, integer, sort_by_time

DEFAULT_CUES = ("###", "Instruction:", "Q:", "User:", "Question:", "Task:")
_NEWLINE = rules.NEWLINE


@dataclass
class InstructionConfig:
    instruction_cues: tuple[str, ...] = DEFAULT_CUES  # a line starting with one opens an instruction
    anchor_scope: int = integer(4096, least=0)  # an instruction anchors patches starting within this many tokens


class Instruction(PatchRule):
    name = "instruction"
    config_fields = InstructionConfig
    covered = chained = anchors = True

    def spans(self, window: Window, config) -> Patches:
        start, end = window.to_tokens(*rules.instructions(window.bytes, config.instruction_cues))
        return Patches(sort_by_time(start, end)[:2])

    def scanner(self, config, topic_model) -> InstructionScanner:
        return InstructionScanner(config.instruction_cues)


class InstructionScanner:
    """rules.instructions: the current line's start token and its first bytes."""

    def __init__(self, cues: tuple[str, ...]) -> None:
        self.cues = tuple(c.encode("utf-8") for c in cues)
        if any(_NEWLINE in c[:-1] for c in self.cues):
            raise ValueError(f"SiteStream: an instruction cue may end with a newline but not hold one "
                             f"inside (got {list(cues)}); build_site would not be causal")
        self.head_len = max((len(c) for c in self.cues), default=0)
        self.at_line_start = True
        self.start = 0
        self.head = bytearray()

    def push(self, chunk: Chunk) -> Patches | None:
        out = []
        for byte, tok in zip(chunk.data, chunk.toks):
            if self.at_line_start:
                self.at_line_start, self.start, self.head = False, tok, bytearray()
            if byte == _NEWLINE:
                line = bytes(self.head) + b"\n"
                if any(line.startswith(c) for c in self.cues):
                    out.append((self.start, tok + 1))
                self.at_line_start = True
            elif len(self.head) < self.head_len:
                self.head.append(byte)
        return Patches(closed_spans(out)) if out else None


RULE = Instruction()
