"""Link edges from the latest earlier patches with the same key (topic, entity, retrieval key).

:func:`link_previous` is the vectorised rule (build_site); :class:`Recent` the
incremental one (SiteStream), which keeps the latest ``links`` items of each key.
Both link an item to its ``links`` previous items of its key, nearest first.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import torch
from torch import Tensor

from sheafgnn.site.patches.rule import edge_array


def link_previous(keys: Tensor, links: int) -> tuple[Tensor, Tensor]:
    """Edges from each of the ``links`` previous items with an equal key to the item.

    Items are in time order; a stable sort by key keeps that order inside a key,
    so the j-th predecessor in the sorted list is the j-th earlier occurrence.
    """
    order = torch.argsort(keys, stable=True)
    sorted_keys = keys[order]
    src, dst = [], []
    for lag in range(1, links + 1):  # a loop per link lag
        same = sorted_keys[lag:] == sorted_keys[:-lag]
        src.append(order[:-lag][same])
        dst.append(order[lag:][same])
    if not src:
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    return torch.cat(src), torch.cat(dst)


class Recent:
    """The latest ``links`` items of each key: links each new item to them (as :func:`link_previous`)."""

    def __init__(self, links: int) -> None:
        self.links = links
        self.items: dict = {}

    def link(self, key, item: int, src: list[int], dst: list[int]) -> None:
        recent = self.items.get(key)
        if recent is None:
            recent = self.items[key] = deque(maxlen=self.links)
        src.extend(recent)
        dst.extend([item] * len(recent))
        recent.append(item)

    def link_all(self, keys: list, first_node: int) -> np.ndarray:
        """Edges from the latest earlier items of each new item's key (new items from ``first_node``)."""
        src, dst = [], []
        for i, key in enumerate(keys):
            self.link(key, first_node + i, src, dst)
        return edge_array(src, dst)
