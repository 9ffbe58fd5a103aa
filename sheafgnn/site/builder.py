"""SiteBuilder: a window of token ids to a causal, typed ``HeteroData`` (C, J).

::

    ids (n,) --token_bytes--> bytes (nb,) --rules--> byte spans --> token spans
                                                                       |
    HeteroData: token / 9 patch node types (time, span), typed edges <--+

    build_site
      |- _patches: one function per patch rule -> spans, extra attributes, link edges
      |            (_syntax_spans, _topic_patches, _memory_patches, _retrieval_patches,
      |             _workspace_patches)
      |- one function per structural edge family: _cover_edges, _chain_edges,
      |  _anchor_edges, _read_edges
      '- _hetero_data: every node and edge type of the schema, empty where the text has none

Every edge src -> dst satisfies ``time[src] <= time[dst]``, and the part of
the graph with time <= t is the same whatever follows position t: rules
close a patch only on the byte that proves it closed, links point only to
earlier occurrences, and the topic of a sentence is a function of that
sentence alone. Everything is built with tensor ops; the Python loops run
over patch types, cue patterns, indent levels and link lags, never tokens.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import torch
from torch import Tensor
from torch_geometric.data import HeteroData
from torch_geometric.transforms import BaseTransform

from sheafgnn.site import rules
from sheafgnn.site.schema import (
    ANCHORED_TYPES,
    CHAINED_TYPES,
    COVERED_TYPES,
    EDGE_TYPES,
    NODE_TYPES,
    PATCH_TYPES,
    READ_TYPES,
    EdgeType,
    SiteConfig,
)
from sheafgnn.site.tokenizer import ByteTokenizer
from sheafgnn.site.topic import TopicModel

Spans = tuple[Tensor, Tensor]  # (start (m,), end (m,)) token positions, end exclusive

# Extra per-node attributes of some patch types, always present (maybe empty).
_EXTRA_ATTRS = {"topic": "topic", "workspace": "register"}


def _arange(n: int) -> Tensor:
    return torch.arange(n, dtype=torch.long)


def _empty_edges() -> Tensor:
    return torch.zeros(2, 0, dtype=torch.long)


def _sort_by_time(start: Tensor, end: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
    """Sort spans by (time = end - 1, start), the order chains and scans use."""
    if start.numel() == 0:
        return (start, end, *extra)
    key = (end - 1) * (int(end.max()) + 1) + start
    order = torch.argsort(key, stable=True)
    return (start[order], end[order], *(x[order] for x in extra))


def _link_previous(keys: Tensor, links: int) -> tuple[Tensor, Tensor]:
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


def _cover(spans: Spans, first_node: int = 0) -> Tensor:
    """token -> patch edges: each patch from every token it spans (patch ids from ``first_node``)."""
    start, end = spans
    length = end - start
    total = int(length.sum())
    patch = torch.repeat_interleave(_arange(start.numel()) + first_node, length, output_size=total)
    shift = start - (torch.cumsum(length, 0) - length)  # token = edge rank + shift of its patch
    token = _arange(total) + torch.repeat_interleave(shift, length, output_size=total)
    return torch.stack([token, patch])


@lru_cache(maxsize=8)
def _load_topic_model(path: str) -> TopicModel:
    return TopicModel.load(path)


def _check_ids(ids: Tensor, vocab_size: int, caller: str) -> Tensor:
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
        return _check_ids(text_or_ids, tokenizer.vocab_size, "build_site")
    raise TypeError(f"build_site: expected text (str or bytes) or a 1-D LongTensor of token ids, "
                    f"got {type(text_or_ids).__name__}")


def build_site(text_or_ids: str | bytes | Tensor, config: SiteConfig | None = None, *,
               tokenizer=None, topic_model: TopicModel | None = None) -> HeteroData:
    r"""Build the causal typed site of a text window.

    Patch rules (each switched on by ``config.patch_types``):

    - ``local``: consecutive windows of ``local_window`` tokens (full windows only).
    - ``sentence``: spans closed by ``.``/``!``/``?`` + white space, or a blank line.
    - ``syntax``: balanced ``()[]{}`` (at most ``syntax_max_depth`` deep), paired
      ``"``/`````` quotes on a line, and indentation blocks; spans longer than
      ``syntax_max_span`` tokens are dropped.
    - ``instruction``: lines that start with one of ``instruction_cues``; each
      anchors the later ``local`` and ``sentence`` patches that start within
      ``anchor_scope`` tokens of its end, until the next instruction.
    - ``topic``: the sentences, each with a topic id from the fitted
      :class:`TopicModel` (none without one); each links to its
      ``topic_links`` previous sentences of the same topic.
    - ``memory``: words of at least ``memory_min_len`` bytes; each links to its
      ``memory_links`` previous occurrences.
    - ``retrieval``: positions t whose last ``retrieval_key_len`` tokens occurred
      before, ending at j < t; the token j + 1 after each of the latest
      ``retrieval_links`` matches links to t (the induction pattern).
    - ``workspace``: ``workspace_registers`` registers at the end of each local
      window, written by that window and chained to the same register before.
    - ``output``: one node per position; it reads token t and the latest
      ``readout_last`` patches of each type with time <= t.

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
        topic_model = _load_topic_model(str(config.topic_model))

    ids = _as_ids(text_or_ids, tokenizer)
    b, lengths = tokenizer.token_bytes(ids)
    token_of_byte = torch.repeat_interleave(_arange(ids.numel()), lengths, output_size=b.numel())
    window = _Window(ids, b, token_of_byte)
    spans, attrs, links = _patches(window, config, topic_model)
    edges = {e: _empty_edges() for e in EDGE_TYPES}  # every type, in schema order
    edges.update(links)
    edges.update(_cover_edges(spans))
    edges.update(_chain_edges(spans, config.workspace_registers))
    edges.update(_anchor_edges(spans, config.anchor_scope))
    edges.update(_read_edges(spans, ids.numel(), config))
    return _hetero_data(ids, spans, attrs, edges)


class _Window(NamedTuple):
    """The window of text that a site is built from."""

    ids: Tensor  # (n,) token ids
    bytes: Tensor  # (nb,) uint8, the bytes of the tokens
    token_of_byte: Tensor  # (nb,) the token each byte belongs to

    def to_tokens(self, start: Tensor, end: Tensor) -> Spans:
        """Byte spans -> the spans of the tokens that hold them."""
        return self.token_of_byte[start], self.token_of_byte[end - 1] + 1


def _patches(window: _Window, config: SiteConfig,
             topic_model: TopicModel | None) -> tuple[dict[str, Spans], dict[str, Tensor], dict[EdgeType, Tensor]]:
    """Spans of every patch type (time order), their extra attributes, and the link edges."""
    n, b = window.ids.numel(), window.bytes
    empty: Spans = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
    spans: dict[str, Spans] = {p: empty for p in PATCH_TYPES}
    attrs: dict[str, Tensor] = {p: torch.zeros(0, dtype=torch.long) for p in _EXTRA_ATTRS}
    links: dict[EdgeType, Tensor] = {}
    sentence_bytes = rules.sentences(b)
    if config.enabled("local"):
        starts = _arange(n // config.local_window) * config.local_window
        spans["local"] = (starts, starts + config.local_window)
    if config.enabled("sentence"):
        spans["sentence"] = window.to_tokens(*sentence_bytes)
    if config.enabled("syntax"):
        spans["syntax"] = _syntax_spans(window, config)
    if config.enabled("instruction"):
        spans["instruction"] = _sort_by_time(*window.to_tokens(*rules.instructions(b, config.instruction_cues)))[:2]
    if config.enabled("topic") and topic_model is not None and sentence_bytes[0].numel():
        spans["topic"], attrs["topic"], links[("topic", "same_topic", "topic")] = _topic_patches(
            window, sentence_bytes, topic_model, config.topic_links)
    if config.enabled("memory"):
        spans["memory"], links[("memory", "recurs", "memory")] = _memory_patches(window, config)
    if config.enabled("retrieval") and n > config.retrieval_key_len:
        spans["retrieval"], links[("token", "recalls", "retrieval")] = _retrieval_patches(window.ids, config)
    if config.enabled("workspace") and n // config.local_window:
        spans["workspace"], attrs["workspace"], writes = _workspace_patches(_arange(n // config.local_window), config)
        if config.enabled("local"):
            links[("local", "writes", "workspace")] = writes
    spans["output"] = (_arange(n), _arange(n) + 1)
    return spans, attrs, links


def _syntax_spans(window: _Window, config: SiteConfig) -> Spans:
    """Brackets, quotes and indentation blocks up to ``syntax_max_span`` tokens long."""
    b = window.bytes
    parts = [rules.brackets(b, config.syntax_max_depth), rules.quotes(b), rules.indent_blocks(b)]
    start, end = window.to_tokens(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
    keep = end - start <= config.syntax_max_span
    return _sort_by_time(start[keep], end[keep])[:2]


def _topic_patches(window: _Window, sentence_bytes: Spans, topic_model: TopicModel,
                   topic_links: int) -> tuple[Spans, Tensor, Tensor]:
    """The sentences with their topic ids, and edges to earlier sentences of the same topic."""
    raw = bytes(window.bytes.numpy())
    texts = [raw[s:e].decode("utf-8", errors="replace")
             for s, e in zip(sentence_bytes[0].tolist(), sentence_bytes[1].tolist())]
    start, end, topic = _sort_by_time(*window.to_tokens(*sentence_bytes), topic_model.predict(texts))
    return (start, end), topic, torch.stack(_link_previous(topic, topic_links))


def _memory_patches(window: _Window, config: SiteConfig) -> tuple[Spans, Tensor]:
    """Word occurrences, and edges from the previous occurrences of the same word."""
    start, end, entity = rules.words(window.bytes, config.memory_min_len, config.memory_max_len)
    start, end, entity = _sort_by_time(*window.to_tokens(start, end), entity)
    return (start, end), torch.stack(_link_previous(entity, config.memory_links))


def _retrieval_patches(ids: Tensor, config: SiteConfig) -> tuple[Spans, Tensor]:
    """Positions t whose key (the last ``retrieval_key_len`` ids) occurred before, and
    edges from the token after each earlier match to t (the induction pattern)."""
    n, m = ids.numel(), config.retrieval_key_len
    keys = _window_keys(ids, m)  # (n-m+1,), key of the window ending at t = i+m-1
    earlier, later = _link_previous(keys, config.retrieval_links)
    has_match = torch.zeros(n, dtype=torch.bool)
    has_match[later + m - 1] = True
    positions = torch.nonzero(has_match).squeeze(1)
    node_of_position = torch.cumsum(has_match, 0) - 1
    # the token right after the earlier match -> the retrieval node at t
    recalls = torch.stack([earlier + m, node_of_position[later + m - 1]])
    return (positions - m + 1, positions + 1), recalls


def _workspace_patches(windows: Tensor, config: SiteConfig) -> tuple[Spans, Tensor, Tensor]:
    """``workspace_registers`` registers over each of the full local ``windows`` (their
    indices), their register ids, and the edges from each window's local patch to its registers."""
    w, registers = config.local_window, config.workspace_registers
    window = torch.repeat_interleave(windows, registers)  # (num_windows * R,)
    register = _arange(window.numel()) % registers
    writes = torch.stack([window, window * registers + register])
    return (window * w, window * w + w), register, writes


def _cover_edges(spans: dict[str, Spans], first_node: dict[str, int] | None = None) -> dict[EdgeType, Tensor]:
    """token -> patch 'in' edges of every covered type (patch ids from ``first_node[p]``, default 0)."""
    first_node = first_node or {}
    return {("token", "in", p): _cover(spans[p], first_node.get(p, 0)) for p in COVERED_TYPES if spans[p][0].numel()}


def _chain_edges(spans: dict[str, Spans], registers: int,
                 first_node: dict[str, int] | None = None) -> dict[EdgeType, Tensor]:
    """patch -> next patch of the same type; each workspace register chains to itself.

    The patches of type p are nodes ``first_node[p]`` (default 0) onwards; their
    predecessors may be earlier nodes.
    """
    first_node = first_node or {}
    edges = {}
    for p in CHAINED_TYPES:
        if not spans[p][0].numel():  # most pushes of a stream close no patch
            continue
        lag = registers if p == "workspace" else 1
        node = _arange(spans[p][0].numel()) + first_node.get(p, 0)
        node = node[node >= lag]
        if node.numel():
            edges[(p, "next", p)] = torch.stack([node - lag, node])
    return edges


def _anchor_edges(spans: dict[str, Spans], anchor_scope: int) -> dict[EdgeType, Tensor]:
    """The latest instruction -> each anchored patch that starts within ``anchor_scope`` tokens of its end."""
    instr_end = spans["instruction"][1]
    if not instr_end.numel():
        return {}
    edges = {}
    for p in ANCHORED_TYPES:
        target_start = spans[p][0]
        latest = torch.searchsorted(instr_end, target_start, right=True) - 1
        ok = (latest >= 0) & (target_start - instr_end[latest.clamp(min=0)] < anchor_scope)
        edges[("instruction", "anchors", p)] = torch.stack([latest[ok], _arange(target_start.numel())[ok]])
    return edges


def _read_edges(spans: dict[str, Spans], n: int, config: SiteConfig) -> dict[EdgeType, Tensor]:
    """Output t reads token t and the latest ``readout_last`` patches of each type with time <= t
    (the workspace: ``readout_last`` per register). Edges of each type are k-major: the latest
    patch of every output, then the second latest, ...; :class:`~sheafgnn.site.stream.SiteStream`
    emits the same order."""
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
    last = torch.tensor([_read_count(config, p) for p in types])  # (P,) patches read per type
    k = _arange(int(last.max())).view(1, -1, 1)
    src = latest.unsqueeze(1) - k  # (P, K, n): the k-th latest, k-major per type
    ok = (src >= 0) & (k < last.view(-1, 1, 1))
    split = ok.flatten(1).sum(1).tolist()
    for p, s, d in zip(types, src[ok].split(split), positions.expand_as(src)[ok].split(split)):
        edges[(p, "reads", "output")] = torch.stack([s, d])
    return edges


def _read_count(config: SiteConfig, patch_type: str) -> int:
    """How many of the latest patches of a type each output reads."""
    return config.readout_last * (config.workspace_registers if patch_type == "workspace" else 1)


def _hetero_data(ids: Tensor, spans: dict[str, Spans], attrs: dict[str, Tensor],
                 edges: dict[EdgeType, Tensor], first: int = 0) -> HeteroData:
    """The site as a HeteroData: token ids and times, patch spans and times, extra attributes, edges.

    ``ids`` are the tokens at positions ``first`` onwards."""
    n = ids.numel()
    positions = _arange(n) + first
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
    for p, name in _EXTRA_ATTRS.items():
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
        name = _EXTRA_ATTRS.get(node_type)
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
