"""``output`` nodes: one per position, the readout (R). Always on, and last of the node types.

Output t reads token t and the latest ``readout_last`` patches of every read type
with time <= t (``reads`` edges, :mod:`sheafgnn.site.edges`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, integer


@dataclass
class OutputConfig:
    readout_last: int = integer(1)  # latest patches of each type an output reads (workspace: all registers)


class Output(PatchRule):
    name = "output"
    config_fields = OutputConfig
    always_on = True
    read = False  # the reader

    def spans(self, window: Window, config) -> Patches:
        positions = torch.arange(window.ids.numel(), dtype=torch.long)
        return Patches((positions, positions + 1))

    def scanner(self, config, topic_model) -> OutputScanner:
        return OutputScanner()


class OutputScanner:
    def push(self, chunk: Chunk) -> Patches:
        return Patches((torch.arange(chunk.first, chunk.end), torch.arange(chunk.first + 1, chunk.end + 1)))


RULE = Output()
