"""SiteStream: the site of a growing text, built exactly and incrementally.

:func:`~sheafgnn.site.builder.build_site` is causal: the part of a site with
time <= t is the same whatever follows position t. So the site of a stream
can be built as it grows. :meth:`SiteStream.push` appends token ids and
returns a *delta*: the nodes and edges of ``build_site(all ids so far)`` whose
time falls in the new positions (an edge's time is its destination's), with
edges in the global node ids of the full site::

    push(ids (k,)) --token_bytes--> new bytes --byte scanners--> closed spans
                                                                    |
    delta HeteroData: new nodes (node_offset), edges into them  <---+

Concatenating the deltas gives ``build_site`` of the whole text, node order
included (nodes of each type are in time order, and new nodes are later).

Each rule of :mod:`~sheafgnn.site.rules` becomes a scanner that reads every
byte once and keeps only what an open patch needs:

- sentences: the previous byte, the open sentence's start token (and its bytes,
  for the topic model); a sentence closes on white space after ``.!?`` or on
  the second newline of a blank line.
- brackets: the running depth and the last bracket of each level <= max depth.
- quotes: the parity of quotes seen on the current line and the last quote.
- indentation: the current line's start and indent, the previous line's
  indent, and the stack of pending openers (each popped once).
- instructions: the current line's start and its first max(len(cue)) bytes.
- memory: the open word's start, length and hash (``rules.WORD_HASH``).

Per token: local windows and workspace registers close every
``local_window`` tokens; retrieval keeps the last ``retrieval_key_len`` ids.
Links (topic, memory, retrieval) keep the latest ``links`` items of each key
in a dict; anchors bisect the list of instruction ends; reads count the nodes
of each type. The structural edges reuse the builder's functions with node
offsets.

Exact, with two caveats: retrieval keys are the id tuples themselves, where
``build_site`` uses a wrapping polynomial hash once ``vocab ** retrieval_key_len``
exceeds 2^62 (the two differ only on a hash collision there); and an instruction
cue may not hold a newline before its last byte (``build_site`` would need bytes
after the line's newline, which is not causal), so :class:`SiteStream` refuses it.

Cost per push: O(new bytes + new nodes + new edges), plus O(log #instructions)
per new local/sentence patch (the anchor bisect) and, for the topic model,
O(sentence length) when a sentence closes (each byte once: amortised O(1)).
Memory grows with the number of distinct keys (words, topics, retrieval keys)
and instructions, never with a re-scan of the history.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.site import rules
from sheafgnn.site.builder import (
    _EXTRA_ATTRS,
    Spans,
    _chain_edges,
    _check_ids,
    _cover_edges,
    _empty_edges,
    _hetero_data,
    _load_topic_model,
    _read_count,
    _workspace_patches,
)
from sheafgnn.site.schema import (
    ANCHORED_TYPES,
    EDGE_TYPES,
    NODE_TYPES,
    PATCH_TYPES,
    READ_TYPES,
    EdgeType,
    SiteConfig,
)
from sheafgnn.site.tokenizer import ByteTokenizer
from sheafgnn.site.topic import TopicModel

_SPACE = rules.byte_set(rules.SPACE)
_WORD = rules.byte_set(rules.WORD)
_STOP = rules.byte_set(rules.STOP)
_KIND = {**rules.OPEN, **{byte: -k for byte, k in rules.CLOSE.items()}}  # open > 0, close < 0
_QUOTES = frozenset(rules.QUOTES)
_NEWLINE = rules.NEWLINE
_WORD_HASH = rules.WORD_HASH.tolist()

Closed = list[tuple]  # closed spans (start token, end token exclusive, extra...)
_NONE = torch.zeros(0, dtype=torch.long)  # no new nodes: shared, never written (a push of one token mostly has none)
_NO_EDGES = np.zeros((2, 0), dtype=np.int64)  # no new edges: shared, never written


class _Sentences:
    """rules.sentences: the open sentence's start token and (if ``keep_text``) bytes."""

    def __init__(self, keep_text: bool) -> None:
        self.keep_text = keep_text
        self.prev = -1  # previous byte
        self.start: int | None = None  # start token of the open sentence (None: starts at the next byte)
        self.text = bytearray()

    def scan(self, data: bytes, toks: list[int]) -> Closed:
        out = []
        for byte, tok in zip(data, toks):
            if self.start is None:
                self.start = tok
            if self.keep_text:
                self.text.append(byte)
            if (self.prev in _STOP and byte in _SPACE) or (self.prev == _NEWLINE and byte == _NEWLINE):
                out.append((self.start, tok + 1, bytes(self.text)))
                self.start, self.text = None, bytearray()
            self.prev = byte
        return out


class _Brackets:
    """rules.brackets: the running depth and the last bracket (kind, token, byte) of each level."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.depth = 0
        self.last: dict[int, tuple[int, int, int]] = {}

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            kind = _KIND.get(byte)
            if kind is None:
                continue
            level = self.depth + 1 if kind > 0 else self.depth
            self.depth += 1 if kind > 0 else -1
            if level > self.max_depth:
                continue
            last = self.last.get(level)
            if last is not None and last[0] > 0 and kind == -last[0]:
                out.append((last[1], tok + 1, (0, level, last[2])))
            self.last[level] = (kind, tok, first_byte + i)
        return out


class _Quotes:
    """rules.quotes: the parity of the quotes on the current line and the last one."""

    def __init__(self) -> None:
        self.odd = False  # an odd number of quotes on this line so far
        self.last = (-1, -1, -1)  # (byte, token, byte position) of the last quote

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            if byte == _NEWLINE:
                self.odd = False
            elif byte in _QUOTES:
                if self.odd and self.last[0] == byte:
                    out.append((self.last[1], tok + 1, (1, self.last[2], 0)))
                self.odd = not self.odd
                self.last = (byte, tok, first_byte + i)
        return out


class _Indents:
    """rules.indent_blocks: the current line, the previous indent and the pending openers."""

    def __init__(self) -> None:
        self.at_line_start = True
        self.line = (0, 0)  # (start token, start byte) of the current line
        self.column = 0  # white-space bytes before the line's first non-space byte
        self.decided = False  # the line's indent (or blankness) is known
        self.prev_indent: int | None = None  # of the previous non-blank line
        self.pending: list[tuple[int, int, int]] = []  # (indent, start token, start byte), indents increasing

    def scan(self, data: bytes, toks: list[int], first_byte: int) -> Closed:
        out = []
        for i, (byte, tok) in enumerate(zip(data, toks)):
            if self.at_line_start:
                self.at_line_start, self.decided, self.column = False, False, 0
                self.line = (tok, first_byte + i)
            if not self.decided:
                if byte == _NEWLINE:
                    self.decided = True  # a blank line
                elif byte in _SPACE:
                    self.column += 1
                else:
                    self.decided = True
                    out.extend(self._line_indented(self.column, tok))
            if byte == _NEWLINE:
                self.at_line_start = True
        return out

    def _line_indented(self, indent: int, tok: int) -> Closed:
        """A non-blank line with ``indent`` reached its first non-space byte (in token ``tok``)."""
        out = []
        while self.pending and self.pending[-1][0] > indent:
            level, start, start_byte = self.pending.pop()
            out.append((start, tok + 1, (2, level, start_byte)))
        if self.prev_indent is not None and indent > self.prev_indent:
            self.pending.append((indent, *self.line))
        self.prev_indent = indent
        return out


class _Instructions:
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

    def scan(self, data: bytes, toks: list[int]) -> Closed:
        out = []
        for byte, tok in zip(data, toks):
            if self.at_line_start:
                self.at_line_start, self.start, self.head = False, tok, bytearray()
            if byte == _NEWLINE:
                line = bytes(self.head) + b"\n"
                if any(line.startswith(c) for c in self.cues):
                    out.append((self.start, tok + 1))
                self.at_line_start = True
            elif len(self.head) < self.head_len:
                self.head.append(byte)
        return out


class _Words:
    """rules.words: the open word's start token, length and entity key."""

    def __init__(self, min_len: int, max_len: int) -> None:
        self.min_len, self.max_len = min_len, max_len
        self.length = 0  # 0: no open word
        self.start = 0
        self.key = 0

    def scan(self, data: bytes, toks: list[int]) -> Closed:
        out = []
        for byte, tok in zip(data, toks):
            if byte in _WORD:
                if self.length == 0:
                    self.start, self.key = tok, 0
                if self.length < self.max_len:
                    self.key += (byte + 1) * _WORD_HASH[self.length]
                self.length += 1
            elif self.length:
                if self.length >= self.min_len:
                    out.append((self.start, tok + 1, self.key))
                self.length = 0
        return out


class _Recent:
    """The latest ``links`` items of each key: links each new item to them (``_link_previous``)."""

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


def _spans(closed: Closed) -> Spans:
    if not closed:
        return _NONE, _NONE
    return torch.tensor([c[0] for c in closed]), torch.tensor([c[1] for c in closed])


def _edges(src: list[int], dst: list[int]) -> np.ndarray:
    return np.array([src, dst], dtype=np.int64) if src else _NO_EDGES


@dataclass
class SiteDelta:
    """The nodes and edges one :meth:`SiteStream.push_delta` adds, as plain tensors.

    Attributes:
        ids (Tensor): (k,) the new token ids, at positions ``first, ..., first + k - 1``.
        first (int): position of the first new token.
        spans (dict[str, tuple[Tensor, Tensor]]): per patch type (``output`` included), the
            (start, end) token spans of its new nodes, in node order.
        attrs (dict[str, Tensor]): the new topic and workspace nodes' ``topic`` / ``register``.
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
        edges = {e: torch.from_numpy(self.edges[e]) if e in self.edges else _empty_edges()
                 for e in EDGE_TYPES}  # every type, in schema order
        data = _hetero_data(self.ids, self.spans, self.attrs, edges, self.first)
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
            topic_model = _load_topic_model(str(config.topic_model))
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        self.topic_model = topic_model if config.enabled("topic") else None
        self.num_tokens = 0
        self.num_bytes = 0
        self.num_nodes = {t: 0 for t in NODE_TYPES}
        with_sentences = config.enabled("sentence") or self.topic_model is not None
        self._sentences = _Sentences(self.topic_model is not None) if with_sentences else None
        self._syntax = (_Brackets(config.syntax_max_depth), _Quotes(), _Indents())
        self._instructions = _Instructions(config.instruction_cues)
        self._words = _Words(config.memory_min_len, config.memory_max_len)
        self._instruction_ends: list[int] = []  # end token of every instruction, in order
        self._topics = _Recent(config.topic_links)
        self._entities = _Recent(config.memory_links)
        self._keys = _Recent(config.retrieval_links)
        self._tail: deque[int] = deque(maxlen=config.retrieval_key_len)  # the latest ids

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
            ids = _check_ids(ids, self.tokenizer.vocab_size, "SiteStream.push")
        first, n = self.num_tokens, self.num_tokens + ids.numel()
        b, lengths = self.tokenizer.token_bytes(ids)
        data = b.numpy().tobytes()
        toks = (first + np.repeat(np.arange(ids.numel()), lengths.numpy())).tolist()  # token of each byte
        offsets = dict(self.num_nodes)
        spans, attrs, edges = self._patches(ids, data, toks, offsets)
        edges.update(_cover_edges(spans, offsets))
        edges.update(_chain_edges(spans, self.config.workspace_registers, offsets))
        edges.update(self._anchor_edges(spans, offsets))
        edges.update(self._read_edges(spans, first, n, offsets))
        # the builder's structural edges come as tensors (CPU): NumPy views of them
        delta = SiteDelta(ids, first, spans, attrs, {e: np.asarray(v) for e, v in edges.items() if v.shape[1]},
                          offsets)
        for t in NODE_TYPES:
            self.num_nodes[t] += delta.num_nodes(t)
        self.num_tokens, self.num_bytes = n, self.num_bytes + len(data)
        return delta

    def _patches(self, ids: Tensor, data: bytes, toks: list[int], offsets: dict[str, int]
                 ) -> tuple[dict[str, Spans], dict[str, Tensor], dict[EdgeType, Tensor | np.ndarray]]:
        """The new spans of every patch type (time order), their extra attributes, and link edges."""
        config, first, n = self.config, self.num_tokens, self.num_tokens + ids.numel()
        empty: Spans = (_NONE, _NONE)
        spans: dict[str, Spans] = {p: empty for p in PATCH_TYPES}
        attrs: dict[str, Tensor] = {p: _NONE for p in _EXTRA_ATTRS}
        links: dict[EdgeType, Tensor | np.ndarray] = {}
        sentences = self._sentences.scan(data, toks) if self._sentences is not None else []
        windows = torch.arange(first // config.local_window, n // config.local_window)
        if config.enabled("local") and windows.numel():
            spans["local"] = (windows * config.local_window, (windows + 1) * config.local_window)
        if config.enabled("sentence"):
            spans["sentence"] = _spans(sentences)
        if config.enabled("syntax"):
            spans["syntax"] = self._syntax_spans(data, toks)
        if config.enabled("instruction"):
            spans["instruction"] = _spans(self._instructions.scan(data, toks))
            self._instruction_ends.extend(spans["instruction"][1].tolist())
        if self.topic_model is not None and sentences:
            topic = self.topic_model.predict([s[2].decode("utf-8", errors="replace") for s in sentences])
            spans["topic"], attrs["topic"] = _spans(sentences), topic
            links[("topic", "same_topic", "topic")] = self._link(self._topics, topic.tolist(), offsets["topic"])
        if config.enabled("memory"):
            words = self._words.scan(data, toks)
            spans["memory"] = _spans(words)
            links[("memory", "recurs", "memory")] = self._link(self._entities, [w[2] for w in words],
                                                              offsets["memory"])
        if config.enabled("retrieval"):
            spans["retrieval"], links[("token", "recalls", "retrieval")] = self._retrieval(ids, offsets["retrieval"])
        if config.enabled("workspace") and windows.numel():
            spans["workspace"], attrs["workspace"], writes = _workspace_patches(windows, config)
            if config.enabled("local"):
                links[("local", "writes", "workspace")] = writes
        spans["output"] = (torch.arange(first, n), torch.arange(first + 1, n + 1))
        return spans, attrs, links

    def _syntax_spans(self, data: bytes, toks: list[int]) -> Spans:
        """Closed brackets, quotes and indentation blocks up to ``syntax_max_span`` tokens, in the
        builder's order: (time, start), then brackets by (level, open byte), quotes, indents by level."""
        brackets, quotes, indents = self._syntax
        closed = (brackets.scan(data, toks, self.num_bytes) + quotes.scan(data, toks, self.num_bytes)
                  + indents.scan(data, toks, self.num_bytes))
        closed = [c for c in closed if c[1] - c[0] <= self.config.syntax_max_span]
        closed.sort(key=lambda c: (c[1], c[0], c[2]))
        return _spans(closed)

    @staticmethod
    def _link(recent: _Recent, keys: list, first_node: int) -> np.ndarray:
        """Edges from the latest earlier items of each new item's key (new items from ``first_node``)."""
        src, dst = [], []
        for i, key in enumerate(keys):
            recent.link(key, first_node + i, src, dst)
        return _edges(src, dst)

    def _retrieval(self, ids: Tensor, first_node: int) -> tuple[Spans, np.ndarray]:
        """New positions t whose last ``retrieval_key_len`` ids occurred before, and edges from the
        token after each of the latest ``retrieval_links`` earlier matches (keys: the id tuples)."""
        m = self.config.retrieval_key_len
        positions, src, dst = [], [], []
        for t, token in enumerate(ids.tolist(), self.num_tokens):
            self._tail.append(token)
            if t < m - 1:
                continue
            earlier: list[int] = []
            self._keys.link(tuple(self._tail), t - m + 1, earlier, [])
            if earlier:
                src.extend(e + m for e in earlier)
                dst.extend([first_node + len(positions)] * len(earlier))
                positions.append(t)
        if not positions:
            return (_NONE, _NONE), _NO_EDGES
        end = torch.tensor(positions, dtype=torch.long) + 1
        return (end - m, end), _edges(src, dst)

    def _read_edges(self, spans: dict[str, Spans], first: int, n: int, offsets: dict[str, int]
                    ) -> dict[EdgeType, np.ndarray]:
        """Output t (t in [first, n)) reads token t and the latest patches of each type with time <= t,
        in :func:`~sheafgnn.site.builder._read_edges`' order (k-major). The patches before this push
        all have time < first, so the latest with time <= t is the last of the ``offsets[p]`` old ones
        and the new ones ending at or before t: O(new nodes + edges) per push, in plain Python (a push
        of one token reads ~10 patches; tensor ops would cost more than the edges)."""
        edges = {("token", "reads", "output"): np.arange(first, n)[None].repeat(2, 0)}  # (2, n - first)
        types, src, dst, sizes = [], [], [], []
        for p in READ_TYPES[1:]:
            ends = spans[p][1].tolist()  # new nodes, in time order
            if not ends and not offsets[p]:
                continue
            latest, j = [], 0
            for t in range(first, n):
                while j < len(ends) and ends[j] <= t + 1:
                    j += 1
                latest.append(offsets[p] + j - 1)
            size = len(src)
            for k in range(_read_count(self.config, p)):
                for t, node in enumerate(latest, first):
                    if node >= k:
                        src.append(node - k)
                        dst.append(t)
            types.append(p)
            sizes.append(len(src) - size)
        index, start = _edges(src, dst), 0  # one array for all types
        for p, size in zip(types, sizes):
            edges[(p, "reads", "output")], start = index[:, start : start + size], start + size
        return edges

    def _anchor_edges(self, spans: dict[str, Spans], offsets: dict[str, int]) -> dict[EdgeType, np.ndarray]:
        """The latest instruction ending at or before each new anchored patch's start, within ``anchor_scope``."""
        ends = self._instruction_ends
        if not ends:
            return {}
        edges = {}
        for p in ANCHORED_TYPES:
            src, dst = [], []
            for i, start in enumerate(spans[p][0].tolist()):
                latest = bisect.bisect_right(ends, start) - 1
                if latest >= 0 and start - ends[latest] < self.config.anchor_scope:
                    src.append(latest)
                    dst.append(offsets[p] + i)
            edges[("instruction", "anchors", p)] = _edges(src, dst)
        return edges
