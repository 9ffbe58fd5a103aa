"""``workspace`` patches: ``workspace_registers`` registers at the end of each local window.

Register r of a window is written by that window's local patch (``writes``, with
local patches on), chains to register r of the window before, and carries its
index (``register``). Outputs read the latest ``readout_last`` of every register.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, integer, no_patches

_WRITES = ("local", "writes", "workspace")  # a window writes the registers at its end


@dataclass
class WorkspaceConfig:
    workspace_registers: int = integer(4)  # registers updated at each local-window boundary


class Workspace(PatchRule):
    name = "workspace"
    config_fields = WorkspaceConfig
    chained = True
    links = (_WRITES,)
    attribute = "register"  # the register's index in its window, 0 .. workspace_registers - 1

    def chain_lag(self, config) -> int:
        return config.workspace_registers  # register r of the window before

    def read_count(self, config) -> int:
        return config.readout_last * config.workspace_registers

    def attribute_rows(self, config) -> int:
        return config.workspace_registers

    def spans(self, window: Window, config) -> Patches:
        num_windows = window.ids.numel() // config.local_window
        if not num_windows:
            return no_patches()
        return registers(torch.arange(num_windows, dtype=torch.long), config)

    def scanner(self, config, topic_model) -> WorkspaceScanner:
        return WorkspaceScanner(config)


class WorkspaceScanner:
    """The registers of the windows that the new tokens complete."""

    def __init__(self, config) -> None:
        self.config = config

    def push(self, chunk: Chunk) -> Patches | None:
        w = self.config.local_window
        if chunk.end // w == chunk.first // w:  # most pushes complete no window
            return None
        return registers(torch.arange(chunk.first // w, chunk.end // w), self.config)


def registers(windows: Tensor, config) -> Patches:
    """The registers over the local ``windows`` (their indices), their register ids, and (local patches on)
    the edges from each window's local patch to its registers."""
    w, count = config.local_window, config.workspace_registers
    window = torch.repeat_interleave(windows, count)  # (num_windows * R,)
    register = torch.arange(window.numel(), dtype=torch.long) % count
    links = {_WRITES: torch.stack([window, window * count + register])} if config.enabled("local") else None
    return Patches((window * w, window * w + w), register, links)


RULE = Workspace()
