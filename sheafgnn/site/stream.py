"""SiteStream: the site of a growing text, built exactly and incrementally.

:func:`~sheafgnn.site.builder.build_site` is causal: the part of a site with
time <= t is the same whatever follows position t. So the site of a stream
can be built as it grows. :meth:`SiteStream.push` appends token ids and
returns a *delta*: the nodes and edges of ``build_site(all ids so far)`` whose
time falls in the new positions (an edge's time is its destination's), with
edges in the global node ids of the full site::

    push(ids (k,)) --token_bytes--> Chunk --scanner.push of every switched-on type--> closed patches
                                                                                            |
    delta: new nodes (node_offset), their link edges + structural edges (site/edges.py) <---+

Concatenating the deltas gives ``build_site`` of the whole text, node order
included (nodes of each type are in time order, and new nodes are later).

Each patch type's scanner (:mod:`sheafgnn.site.patches`: its file says what it
keeps) reads every new byte or token once and keeps only what an open patch
needs; links keep the latest ``links`` items of each key in a dict. The
structural edges come from :mod:`sheafgnn.site.edges`: cover and chain edges as
build_site makes them, with node offsets; anchors bisect the list of anchor
ends; reads count the nodes of each type.

Exact, with two caveats (each in its type's file): retrieval keys are the id
tuples themselves, where ``build_site`` hashes them once ``vocab ** retrieval_key_len``
exceeds 2^62 (they differ only on a collision); and an instruction cue may not
hold a newline before its last byte (not causal in ``build_site``), which
:class:`SiteStream` refuses.

Cost per push: a loop over the switched-on types, and O(new bytes + new nodes
+ new edges), plus O(log #instructions) per new local/sentence patch (the anchor
bisect) and, for the topic model, O(sentence length) when a sentence closes
(each byte once: amortised O(1)). Memory grows with the number of distinct keys
(words, topics, retrieval keys) and instructions, never with a re-scan of the
history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.site.builder import check_ids, empty_edges, gather_patches, hetero_data, load_topic_model
from sheafgnn.site.edges import (
    StreamAnchors,
    chain_edges,
    chain_lags,
    cover_edges,
    read_counts,
    stream_read_edges,
)
from sheafgnn.site.patches import RULES
from sheafgnn.site.patches.rule import NONE, Chunk, EdgeType, Spans
from sheafgnn.site.schema import EDGE_TYPES, NODE_TYPES, SiteConfig
from sheafgnn.site.tokenizer import ByteTokenizer
from sheafgnn.site.topic import TopicModel


@dataclass
class SiteDelta:
    """The nodes and edges one :meth:`SiteStream.push_delta` adds, as plain tensors.

    Attributes:
        ids (Tensor): (k,) the new token ids, at positions ``first, ..., first + k - 1``.
        first (int): position of the first new token.
        spans (dict[str, tuple[Tensor, Tensor]]): per patch type (``output`` included), the
            (start, end) token spans of its new nodes, in node order.
        attrs (dict[str, Tensor]): per patch type with a node attribute (:data:`NODE_ATTRIBUTES`:
            topic ids, workspace registers), its new nodes' attribute.
        edges (dict[EdgeType, numpy.ndarray]): (2, E) int64, every non-empty edge type's edges
            into new nodes, in global node ids (NumPy: its consumer indexes them on the host, and a
            step's ~10 small arrays cost ~1 us each in NumPy against ~5 as tensors).
        node_offset (dict[str, int]): per node type, the nodes before this push.
    """

    ids: Tensor
    first: int
    spans: dict[str, Spans]
    attrs: dict[str, Tensor]
    edges: dict[EdgeType, np.ndarray]
    node_offset: dict[str, int]

    def num_nodes(self, node_type: str) -> int:
        return self.ids.numel() if node_type == "token" else self.spans[node_type][0].numel()

    def to_hetero(self) -> HeteroData:
        """The delta as a HeteroData with every node and edge type of the schema (see :meth:`SiteStream.push`)."""
        edges = {e: torch.from_numpy(self.edges[e]) if e in self.edges else empty_edges()
                 for e in EDGE_TYPES}  # every type, in schema order
        data = hetero_data(self.ids, self.spans, self.attrs, edges, self.first)
        for t in NODE_TYPES:
            data[t].node_offset = self.node_offset[t]
        return data


class SiteStream:
    r"""The causal site of a growing token stream, built incrementally and exactly.

    After pushes of ``ids_1, ..., ids_k``, the deltas returned so far hold exactly
    the nodes and edges of ``build_site(cat(ids_1, ..., ids_k), config)``.

    Args:
        config (SiteConfig, optional): the rules (default: :obj:`SiteConfig()`).
        tokenizer (optional): maps ids to bytes (default: :class:`ByteTokenizer`).
        topic_model (TopicModel, optional): overrides ``config.topic_model``.

    Attributes:
        num_tokens (int): tokens pushed so far.
        num_nodes (dict[str, int]): nodes of each node type emitted so far.
    """

    def __init__(self, config: SiteConfig | None = None, *, tokenizer=None,
                 topic_model: TopicModel | None = None) -> None:
        config = config if config is not None else SiteConfig()
        if not isinstance(config, SiteConfig):
            raise TypeError(f"SiteStream: config must be a SiteConfig, got {type(config).__name__}")
        if topic_model is None and config.topic_model is not None and config.enabled("topic"):
            topic_model = load_topic_model(str(config.topic_model))
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.topic_model = topic_model if config.enabled("topic") else None
        self.num_tokens = 0
        self.num_bytes = 0
        self.num_nodes = {t: 0 for t in NODE_TYPES}
        scanners = {p: rule.scanner(config, self.topic_model) for p, rule in RULES.items() if config.enabled(p)}
        self._scanners = [(p, scanner) for p, scanner in scanners.items() if scanner is not None]
        self._anchors = StreamAnchors(config.anchor_scope)
        self._chain_lags = chain_lags(config)
        self._read_counts = read_counts(config)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(num_tokens={self.num_tokens}, "
                f"patch_types=[{', '.join(self.config.patch_types)}])")

    def push(self, ids: Tensor) -> HeteroData:
        """Append ``ids`` (1-D integer tensor, any length) and return the delta site.

        Returns:
            HeteroData with every node and edge type of the schema: the new nodes
            (attributes as in :func:`build_site`, plus ``node_offset``, the number of
            nodes of that type before this push) and every edge into a new node, in
            global node ids (:meth:`SiteDelta.to_hetero` of :meth:`push_delta`).

        Raises:
            TypeError, ValueError: for ids that are not a 1-D integer tensor in the
                vocabulary; the stream is then unchanged.
        """
        return self.push_delta(ids).to_hetero()

    def push_delta(self, ids: Tensor, validate: bool = True) -> SiteDelta:
        """:meth:`push` without the HeteroData: the same delta as plain arrays (what a per-token
        consumer such as :class:`~sheafgnn.stream.SheafStream` reads; a HeteroData of ~30 stores
        costs more to build than the delta itself). ``validate=False`` skips the checks of ``ids``
        for a caller that made them: then they must be a 1-D int64 CPU tensor of ids in the
        tokenizer's vocabulary."""
        if validate:
            if not isinstance(ids, Tensor):
                raise TypeError(f"SiteStream.push: expected a 1-D LongTensor of token ids, got {type(ids).__name__}")
            ids = check_ids(ids, self.tokenizer.vocab_size, "SiteStream.push")
        first, n = self.num_tokens, self.num_tokens + ids.numel()
        b, lengths = self.tokenizer.token_bytes(ids)
        data = b.numpy().tobytes()
        toks = (first + np.repeat(np.arange(ids.numel()), lengths.numpy())).tolist()  # token of each byte
        offsets = dict(self.num_nodes)
        chunk = Chunk(ids, data, toks, first, n, self.num_bytes, offsets)
        spans, attrs, edges = gather_patches(((p, scanner.push(chunk)) for p, scanner in self._scanners), NONE)
        edges.update(cover_edges(spans, offsets))
        edges.update(chain_edges(spans, self._chain_lags, offsets))
        edges.update(self._anchors.edges(spans, offsets))
        edges.update(stream_read_edges(spans, first, n, offsets, self._read_counts))
        # the builder's structural edges come as tensors (CPU): NumPy views of them
        delta = SiteDelta(ids, first, spans, attrs, {e: np.asarray(v) for e, v in edges.items() if v.shape[1]},
                          offsets)
        for t in NODE_TYPES:
            self.num_nodes[t] += delta.num_nodes(t)
        self.num_tokens, self.num_bytes = n, self.num_bytes + len(data)
        return delta
