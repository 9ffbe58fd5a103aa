"""The structural edge families, from the patch types' roles: cover, chain, anchor, read.

::

    cover   token -> p 'in'         every covered type: each patch from every token it spans
    chain   p -> p 'next'           every chained type: each patch from the one chain_lag nodes before
    anchor  a -> p 'anchors'        the latest anchoring patch ending at or before p's start, within anchor_scope
    read    p -> output 'reads'     output t from token t and the latest read_count patches of p with time <= t

Cover and chain edges of new nodes need only those nodes (and their ids), so
build_site and SiteStream share :func:`cover_edges` and :func:`chain_edges`.
Anchor and read edges look back at earlier nodes: :func:`anchor_edges` and
:func:`read_edges` build them over a whole site with tensor ops, and
:class:`StreamAnchors` and :func:`stream_read_edges` for one push, from what the
stream kept (the anchors' ends, the node counts), in the same order.
"""

from __future__ import annotations

import bisect

import numpy as np
import torch
from torch import Tensor

from sheafgnn.site.patches import RULES
from sheafgnn.site.patches.rule import EdgeType, Spans, edge_array
from sheafgnn.site.schema import ANCHORED_TYPES, ANCHORING_TYPES, CHAINED_TYPES, COVERED_TYPES, READ_TYPES


def _arange(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.long)


def _cover(spans: Spans, first_node: int = 0) -> Tensor:
    """token -> patch edges: each patch from every token it spans (patch ids from ``first_node``)."""
    start, end = spans
    length = end - start
    total = int(length.sum())
    patch = torch.repeat_interleave(_arange(start.numel()) + first_node, length, output_size=total)
    shift = start - (torch.cumsum(length, 0) - length)  # token = edge rank + shift of its patch
    token = _arange(total) + torch.repeat_interleave(shift, length, output_size=total)
    return torch.stack([token, patch])


def cover_edges(spans: dict[str, Spans], first_node: dict[str, int] | None = None) -> dict[EdgeType, Tensor]:
    """token -> patch 'in' edges of every covered type (patch ids from ``first_node[p]``, default 0)."""
    first_node = first_node or {}
    return {("token", "in", p): _cover(spans[p], first_node.get(p, 0)) for p in COVERED_TYPES if spans[p][0].numel()}


def chain_lags(config) -> dict[str, int]:
    """Per chained type, how many nodes back the previous patch of a node's chain is."""
    return {p: RULES[p].chain_lag(config) for p in CHAINED_TYPES}


def chain_edges(spans: dict[str, Spans], lags: dict[str, int],
                first_node: dict[str, int] | None = None) -> dict[EdgeType, Tensor]:
    """patch -> next patch of the same type, ``lags[p]`` nodes back (:func:`chain_lags`).

    The patches of type p are nodes ``first_node[p]`` (default 0) onwards; their
    predecessors may be earlier nodes.
    """
    first_node = first_node or {}
    edges = {}
    for p in CHAINED_TYPES:
        if not spans[p][0].numel():  # most pushes of a stream close no patch
            continue
        lag = lags[p]
        node = _arange(spans[p][0].numel()) + first_node.get(p, 0)
        node = node[node >= lag]
        if node.numel():
            edges[(p, "next", p)] = torch.stack([node - lag, node])
    return edges


def anchor_edges(spans: dict[str, Spans], anchor_scope: int) -> dict[EdgeType, Tensor]:
    """The latest anchoring patch -> each anchored patch that starts within ``anchor_scope`` tokens of its end."""
    edges = {}
    for a in ANCHORING_TYPES:
        anchor_end = spans[a][1]
        if not anchor_end.numel():
            continue
        for p in ANCHORED_TYPES:
            target_start = spans[p][0]
            latest = torch.searchsorted(anchor_end, target_start, right=True) - 1
            ok = (latest >= 0) & (target_start - anchor_end[latest.clamp(min=0)] < anchor_scope)
            edges[(a, "anchors", p)] = torch.stack([latest[ok], _arange(target_start.numel())[ok]])
    return edges


class StreamAnchors:
    """:func:`anchor_edges` for a stream: the ends of every anchoring patch so far, in order."""

    def __init__(self, anchor_scope: int) -> None:
        self.anchor_scope = anchor_scope
        self.ends: dict[str, list[int]] = {a: [] for a in ANCHORING_TYPES}

    def edges(self, spans: dict[str, Spans], first_node: dict[str, int]) -> dict[EdgeType, np.ndarray]:
        """Record the new anchoring patches; the edges into the new anchored patches (from ``first_node[p]``).
        O(log #anchors) per new anchored patch."""
        edges = {}
        for a, ends in self.ends.items():
            ends.extend(spans[a][1].tolist())
            if not ends:
                continue
            for p in ANCHORED_TYPES:
                src, dst = [], []
                for i, start in enumerate(spans[p][0].tolist()):
                    latest = bisect.bisect_right(ends, start) - 1
                    if latest >= 0 and start - ends[latest] < self.anchor_scope:
                        src.append(latest)
                        dst.append(first_node[p] + i)
                edges[(a, "anchors", p)] = edge_array(src, dst)
        return edges


def read_counts(config) -> dict[str, int]:
    """Per read patch type, how many of its latest patches each output reads."""
    return {p: RULES[p].read_count(config) for p in READ_TYPES[1:]}


def read_edges(spans: dict[str, Spans], n: int, counts: dict[str, int]) -> dict[EdgeType, Tensor]:
    """Output t reads token t and the latest ``counts[p]`` patches of each type p with time <= t
    (:func:`read_counts`). Edges of each type are k-major: the latest patch of every output, then the
    second latest, ...; :func:`stream_read_edges` emits the same order."""
    positions = _arange(n)
    edges = {("token", "reads", "output"): torch.stack([positions, positions])}
    types = [p for p in READ_TYPES[1:] if spans[p][0].numel()]
    if not types:
        return edges
    # All types at once, as rows of (P, n): one pass of a few ops, whatever the number of types.
    P = len(types)
    count = torch.tensor([spans[p][0].numel() for p in types])  # (P,) nodes of each type
    row = torch.repeat_interleave(_arange(P), count)  # type row of every node
    node = _arange(row.numel()) - torch.repeat_interleave(count.cumsum(0) - count, count)  # its index in the type
    time = torch.cat([spans[p][1] for p in types]) - 1
    # Latest node of each type with time <= t: the node ending at t (if any), carried forward.
    latest = torch.full((P * n,), -1, dtype=torch.long).scatter_reduce_(0, row * n + time, node, "amax")
    latest = latest.view(P, n).cummax(1).values
    last = torch.tensor([counts[p] for p in types])  # (P,) patches read per type
    k = _arange(int(last.max())).view(1, -1, 1)
    src = latest.unsqueeze(1) - k  # (P, K, n): the k-th latest, k-major per type
    ok = (src >= 0) & (k < last.view(-1, 1, 1))
    split = ok.flatten(1).sum(1).tolist()
    for p, s, d in zip(types, src[ok].split(split), positions.expand_as(src)[ok].split(split)):
        edges[(p, "reads", "output")] = torch.stack([s, d])
    return edges


def stream_read_edges(spans: dict[str, Spans], first: int, n: int, first_node: dict[str, int],
                      counts: dict[str, int]) -> dict[EdgeType, np.ndarray]:
    """:func:`read_edges` of the outputs t in [first, n), the new nodes of type p being nodes ``first_node[p]``
    on. The patches before this push all have time < first, so the latest with time <= t is the last of the
    ``first_node[p]`` old ones and the new ones ending at or before t: O(new nodes + edges) per push, in plain
    Python (a push of one token reads ~10 patches; tensor ops would cost more than the edges)."""
    edges = {("token", "reads", "output"): np.arange(first, n)[None].repeat(2, 0)}  # (2, n - first)
    types, src, dst, sizes = [], [], [], []
    for p in READ_TYPES[1:]:
        ends = spans[p][1].tolist()  # new nodes, in time order
        if not ends and not first_node[p]:
            continue
        latest, j = [], 0
        for t in range(first, n):
            while j < len(ends) and ends[j] <= t + 1:
                j += 1
            latest.append(first_node[p] + j - 1)
        size = len(src)
        for k in range(counts[p]):
            for t, node in enumerate(latest, first):
                if node >= k:
                    src.append(node - k)
                    dst.append(t)
        types.append(p)
        sizes.append(len(src) - size)
    index, start = edge_array(src, dst), 0  # one array for all types
    for p, size in zip(types, sizes):
        edges[(p, "reads", "output")], start = index[:, start : start + size], start + size
    return edges
