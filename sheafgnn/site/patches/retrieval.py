"""``retrieval`` patches: positions t whose last ``retrieval_key_len`` tokens occurred before.

The token after each of the latest ``retrieval_links`` earlier matches links to
t (``recalls``: the induction pattern). Keys are the id windows: exact base-V
digits while they fit in 62 bits, else a polynomial hash that wraps in int64.
The scanner keeps the last ``retrieval_key_len`` ids and keys them by the id
tuple itself, so it differs from :func:`~sheafgnn.site.build_site` only on a
hash collision of a vocabulary with ``V ** retrieval_key_len`` over 2^62.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from sheafgnn.site.patches.links import Recent, link_previous
from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, edge_array, integer, no_patches

_RECALLS = ("token", "recalls", "retrieval")  # token after an earlier match of the key


@dataclass
class RetrievalConfig:
    retrieval_key_len: int = integer(3)  # tokens hashed into a retrieval key
    retrieval_links: int = integer(2, least=0)  # earlier matches linked per position


class Retrieval(PatchRule):
    name = "retrieval"
    config_fields = RetrievalConfig
    # Off unless asked for: its job (find an earlier occurrence of what is read now) the learned topology's
    # content proposals do: they solve MQAR with retrieval off (benchmarks/results/tasks/), and on text
    # retrieval patches bought +0.005 bits/byte, under the seed noise of 0.031, for 0.7 of the 3.2 nodes and
    # 4.6 of the 18 edges per token (benchmarks/results/ablation.md).
    on_by_default = False
    covered = True
    links = (_RECALLS,)

    def spans(self, window: Window, config) -> Patches:
        ids = window.ids
        n, m = ids.numel(), config.retrieval_key_len
        if n <= m:
            return no_patches()
        keys = _window_keys(ids, m)  # (n-m+1,), key of the window ending at t = i+m-1
        earlier, later = link_previous(keys, config.retrieval_links)
        has_match = torch.zeros(n, dtype=torch.bool)
        has_match[later + m - 1] = True
        positions = torch.nonzero(has_match).squeeze(1)
        node_of_position = torch.cumsum(has_match, 0) - 1
        # the token right after the earlier match -> the retrieval node at t
        recalls = torch.stack([earlier + m, node_of_position[later + m - 1]])
        return Patches((positions - m + 1, positions + 1), links={_RECALLS: recalls})

    def scanner(self, config, topic_model) -> RetrievalScanner:
        return RetrievalScanner(config.retrieval_key_len, config.retrieval_links)


def _window_keys(ids: Tensor, m: int) -> Tensor:
    """Key of every window of ``m`` consecutive ids: exact base-(V) digits while they fit
    in 62 bits, else a polynomial hash that wraps in int64 (equal windows, equal keys)."""
    windows = ids.unfold(0, m, 1)  # (n-m+1, m)
    base = int(ids.max()) + 1
    if base ** m < (1 << 62):
        weights = torch.tensor([base**j for j in range(m)], dtype=torch.long)
    else:
        weights = torch.tensor([pow(1_000_003, j, 1 << 62) for j in range(m)], dtype=torch.long)
    return (windows * weights).sum(1)


class RetrievalScanner:
    """The last ``key_len`` ids, and the latest ``links`` positions of each key (the id tuple)."""

    def __init__(self, key_len: int, links: int) -> None:
        self.key_len = key_len
        self.tail: deque[int] = deque(maxlen=key_len)  # the latest ids
        self.recent = Recent(links)

    def push(self, chunk: Chunk) -> Patches | None:
        m, first_node = self.key_len, chunk.offsets["retrieval"]
        positions, src, dst = [], [], []
        for t, token in enumerate(chunk.ids.tolist(), chunk.first):
            self.tail.append(token)
            if t < m - 1:
                continue
            earlier: list[int] = []
            self.recent.link(tuple(self.tail), t - m + 1, earlier, [])
            if earlier:
                src.extend(e + m for e in earlier)
                dst.extend([first_node + len(positions)] * len(earlier))
                positions.append(t)
        if not positions:
            return None
        end = torch.tensor(positions, dtype=torch.long) + 1
        return Patches((end - m, end), links={_RECALLS: edge_array(src, dst)})


RULE = Retrieval()
