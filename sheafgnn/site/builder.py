"""SiteBuilder: a window of token ids to a causal, typed ``HeteroData`` (C, J).

::

    ids (n,) --token_bytes--> bytes (nb,) --PatchRule.spans of every switched-on type--> patches
                                                                                          |
    HeteroData: token / patch node types (time, span, attribute), typed edges  <-----------+
                (the types' link edges + the structural families of site/edges.py)

Every edge src -> dst satisfies ``time[src] <= time[dst]``, and the part of
the graph with time <= t is the same whatever follows position t: rules
close a patch only on the byte that proves it closed, links point only to
earlier occurrences, and the topic of a sentence is a function of that
sentence alone. Everything is built with tensor ops; the Python loops run
over patch types, cue patterns, indent levels and link lags, never tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import HeteroData
from torch_geometric.transforms import BaseTransform

from sheafgnn.site.edges import anchor_edges, chain_edges, chain_lags, cover_edges, read_counts, read_edges
from sheafgnn.site.patches import RULES
from sheafgnn.site.patches.rule import EdgeType, Patches, Spans, Window
from sheafgnn.site.schema import EDGE_TYPES, NODE_ATTRIBUTES, NODE_TYPES, PATCH_TYPES, SiteConfig
from sheafgnn.site.tokenizer import ByteTokenizer
from sheafgnn.site.topic import TopicModel


def empty_edges() -> Tensor:
    return torch.zeros(2, 0, dtype=torch.long)


@lru_cache(maxsize=8)
def load_topic_model(path: str) -> TopicModel:
    """The topic model saved at ``path``, loaded once (build_site and SiteStream read ``config.topic_model``)."""
    return TopicModel.load(path)


def check_ids(ids: Tensor, vocab_size: int, caller: str) -> Tensor:
    """``ids`` as a 1-D LongTensor on the CPU, or a clear error naming ``caller``."""
    if ids.dim() != 1:
        raise ValueError(f"{caller}: token ids must be 1-D, got shape {tuple(ids.shape)}")
    if ids.dtype.is_floating_point or ids.dtype in (torch.bool, torch.complex64, torch.complex128):
        raise TypeError(f"{caller}: token ids must be an integer tensor, got {ids.dtype}")
    ids = ids.long().cpu()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{caller}: token ids must lie in [0, {vocab_size}) "
                         f"(got min {int(ids.min())}, max {int(ids.max())})")
    return ids


def _as_ids(text_or_ids, tokenizer) -> Tensor:
    if isinstance(text_or_ids, (str, bytes, bytearray)):
        return tokenizer.encode(text_or_ids)
    if isinstance(text_or_ids, Tensor):
        return check_ids(text_or_ids, tokenizer.vocab_size, "build_site")
    raise TypeError(f"build_site: expected text (str or bytes) or a 1-D LongTensor of token ids, "
                    f"got {type(text_or_ids).__name__}")


def build_site(text_or_ids: str | bytes | Tensor, config: SiteConfig | None = None, *,
               tokenizer=None, topic_model: TopicModel | None = None) -> HeteroData:
    r"""Build the causal typed site of a text window.

    One node type per patch type of :mod:`sheafgnn.site.patches` (each file says what
    its patches are), made by the types that ``config.patch_types`` switches on
    (``output``, one node per position, always), plus the structural edges of
    their roles (:mod:`sheafgnn.site.edges`).

    Args:
        text_or_ids (str, bytes or Tensor): text, or a 1-D tensor of token ids.
        config (SiteConfig, optional): the rules (default: :obj:`SiteConfig()`).
        tokenizer (optional): encodes text and maps ids to bytes
            (default: :class:`ByteTokenizer`).
        topic_model (TopicModel, optional): overrides ``config.topic_model``.

    Returns:
        HeteroData with every type of :data:`NODE_TYPES` and :data:`EDGE_TYPES`.
    """
    config = config if config is not None else SiteConfig()
    if not isinstance(config, SiteConfig):
        raise TypeError(f"build_site: config must be a SiteConfig, got {type(config).__name__}")
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if topic_model is None and config.topic_model is not None and config.enabled("topic"):
        topic_model = load_topic_model(str(config.topic_model))

    ids = _as_ids(text_or_ids, tokenizer)
    b, lengths = tokenizer.token_bytes(ids)
    token_of_byte = torch.repeat_interleave(torch.arange(ids.numel(), dtype=torch.long), lengths, output_size=b.numel())
    window = Window(ids, b, token_of_byte, topic_model)
    made = ((p, rule.spans(window, config)) for p, rule in RULES.items() if config.enabled(p))
    spans, attrs, links = gather_patches(made, torch.zeros(0, dtype=torch.long))
    edges = {e: empty_edges() for e in EDGE_TYPES}  # every type, in schema order
    edges.update(links)
    edges.update(cover_edges(spans))
    edges.update(chain_edges(spans, chain_lags(config)))
    edges.update(anchor_edges(spans, config.anchor_scope))
    edges.update(read_edges(spans, ids.numel(), read_counts(config)))
    return hetero_data(ids, spans, attrs, edges)


def gather_patches(made: Iterable[tuple[str, Patches | None]], empty: Tensor
                   ) -> tuple[dict[str, Spans], dict[str, Tensor], dict[EdgeType, Tensor | np.ndarray]]:
    """Per patch type, the spans of the patches ``made`` ((type, Patches or None: none) pairs), ``empty``
    (an empty LongTensor) for the rest; per type with a node attribute, theirs; and their link edges."""
    no_spans: Spans = (empty, empty)
    spans: dict[str, Spans] = dict.fromkeys(PATCH_TYPES, no_spans)
    attrs: dict[str, Tensor] = dict.fromkeys(NODE_ATTRIBUTES, empty)
    links: dict[EdgeType, Tensor | np.ndarray] = {}
    for p, patches in made:
        if patches is None:  # a stream's push mostly closes no patch of most types
            continue
        spans[p] = patches.spans
        if patches.attribute is not None:
            attrs[p] = patches.attribute
        if patches.links:
            links.update(patches.links)
    return spans, attrs, links


def hetero_data(ids: Tensor, spans: dict[str, Spans], attrs: dict[str, Tensor],
                edges: dict[EdgeType, Tensor], first: int = 0) -> HeteroData:
    """The site as a HeteroData: token ids and times, patch spans and times, extra attributes, edges.

    ``ids`` are the tokens at positions ``first`` onwards."""
    n = ids.numel()
    positions = torch.arange(n, dtype=torch.long) + first
    data = HeteroData()
    data["token"].x = ids
    data["token"].pos = positions
    data["token"].time = positions.clone()
    data["token"].num_nodes = n
    for p in PATCH_TYPES:
        start, end = spans[p]
        data[p].span = torch.stack([start, end], 1)
        data[p].time = end - 1
        data[p].num_nodes = start.numel()
    for p, name in NODE_ATTRIBUTES.items():
        data[p][name] = attrs[p]
    for edge_type, edge_index in edges.items():
        data[edge_type].edge_index = edge_index
    return data


def validate_site(data: HeteroData) -> HeteroData:
    """Check the schema and causality of a site (or a batch of sites).

    Raises:
        ValueError: naming the missing type or attribute, or the edge type and
            an example edge with ``time[src] > time[dst]``.
    """
    if not isinstance(data, HeteroData):
        raise ValueError(f"validate_site: expected a HeteroData, got {type(data).__name__}")
    for node_type in NODE_TYPES:
        if node_type not in data.node_types:
            raise ValueError(f"validate_site: node type '{node_type}' is missing")
        store = data[node_type]
        time = store.get("time")
        if not isinstance(time, Tensor) or time.dtype != torch.long or time.dim() != 1:
            raise ValueError(f"validate_site: '{node_type}'.time must be a 1-D LongTensor")
        if time.numel() != store.num_nodes:
            raise ValueError(f"validate_site: '{node_type}' has {store.num_nodes} nodes but {time.numel()} times")
        if node_type == "token":
            for name in ("x", "pos"):
                if store.get(name) is None or store[name].shape != time.shape:
                    raise ValueError(f"validate_site: 'token'.{name} must be a LongTensor of shape {tuple(time.shape)}")
            continue
        span = store.get("span")
        if not isinstance(span, Tensor) or span.shape != (time.numel(), 2):
            raise ValueError(f"validate_site: '{node_type}'.span must have shape ({time.numel()}, 2)")
        bad = (span[:, 0] >= span[:, 1]) | (time != span[:, 1] - 1)
        if bad.any():
            i = int(torch.nonzero(bad)[0])
            raise ValueError(f"validate_site: '{node_type}' node {i} has span {span[i].tolist()} "
                             f"and time {int(time[i])}; need start < end and time == end - 1")
        name = NODE_ATTRIBUTES.get(node_type)
        if name is not None and (store.get(name) is None or store[name].shape != time.shape):
            raise ValueError(f"validate_site: '{node_type}'.{name} must have shape {tuple(time.shape)}")
    for edge_type in EDGE_TYPES:
        if edge_type not in data.edge_types:
            raise ValueError(f"validate_site: edge type {edge_type} is missing")
        edge_index = data[edge_type].get("edge_index")
        if not isinstance(edge_index, Tensor) or edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(f"validate_site: {edge_type}.edge_index must have shape (2, num_edges)")
        src_type, _, dst_type = edge_type
        src, dst = edge_index
        for index, node_type in ((src, src_type), (dst, dst_type)):
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= data[node_type].num_nodes):
                raise ValueError(f"validate_site: {edge_type} indexes a '{node_type}' node out of range")
        future = data[src_type].time[src] > data[dst_type].time[dst]
        if future.any():
            i = int(torch.nonzero(future)[0])
            s, d = int(src[i]), int(dst[i])
            raise ValueError(f"validate_site: edge type {edge_type} is not causal: edge {s} -> {d} has "
                             f"time {int(data[src_type].time[s])} > {int(data[dst_type].time[d])}")
    return data


class SiteBuilder(BaseTransform):
    r"""The site builder as a PyG transform: text or token ids to a causal site.

    Accepts a ``str``/``bytes``/1-D id tensor, or a ``Data``/``HeteroData``
    whose ids are in ``x`` (or ``data['token'].x``); see :func:`build_site`.

    Args:
        config (SiteConfig, optional): the patch rules.
        tokenizer (optional): the tokenizer (default: :class:`ByteTokenizer`).
        topic_model (TopicModel, optional): for ``topic`` patches.
    """

    def __init__(self, config: SiteConfig | None = None, tokenizer=None,
                 topic_model: TopicModel | None = None) -> None:
        self.config = config if config is not None else SiteConfig()
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.topic_model = topic_model

    def forward(self, data) -> HeteroData:
        if isinstance(data, HeteroData):
            data = data["token"].x
        elif hasattr(data, "x") and isinstance(data.x, Tensor):
            data = data.x
        return build_site(data, self.config, tokenizer=self.tokenizer, topic_model=self.topic_model)

    def __repr__(self) -> str:
        types = ", ".join(self.config.patch_types)
        return f"{self.__class__.__name__}(patch_types=[{types}], local_window={self.config.local_window})"
