"""What a patch type declares (:class:`PatchRule`) and what its two builders read and return.

::

    build_site:  Window (the whole text)       --PatchRule.spans-->        Patches
    SiteStream:  Chunk (one push's new tokens) --PatchRule.scanner().push--> Patches or None

Both must give the same patches: concatenated over the pushes, the scanner's
equal the vectorised rule's on the whole text (tests/test_site_stream.py).
"""

from __future__ import annotations

from dataclasses import field
from typing import NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from sheafgnn.site.topic import TopicModel

EdgeType = tuple[str, str, str]
Spans = tuple[Tensor, Tensor]  # (start (m,), end (m,)) token positions, end exclusive
Closed = list[tuple]  # a scanner's closed spans: (start token, end token exclusive, extra...)

NONE = torch.zeros(0, dtype=torch.long)  # no new nodes: shared, never written (a push of one token mostly has none)
NO_EDGES = np.zeros((2, 0), dtype=np.int64)  # no new edges: shared, never written


def integer(default: int, least: int = 1, most: int | None = None) -> int:
    """A config field that SiteConfig checks is an integer in [least, most] (``least`` 1: positive, 0: non-negative)."""
    return field(default=default, metadata={"least": least, "most": most})


class Patches(NamedTuple):
    """The patches a rule makes, in time order, with their attribute and the link edges into them."""

    spans: Spans  # (start (m,), end (m,)) token positions, end exclusive
    attribute: Tensor | None = None  # (m,) the node attribute (PatchRule.attribute); None: the type has none
    links: dict[EdgeType, Tensor | np.ndarray] | None = None  # (2, E) edges of PatchRule.links types, if any


class Window(NamedTuple):
    """The text a site is built from (:func:`~sheafgnn.site.build_site`)."""

    ids: Tensor  # (n,) token ids
    bytes: Tensor  # (nb,) uint8, the bytes of the tokens
    token_of_byte: Tensor  # (nb,) the token each byte belongs to
    topic_model: TopicModel | None  # the fitted topic model of topic patches, if any

    def to_tokens(self, start: Tensor, end: Tensor) -> Spans:
        """Byte spans -> the spans of the tokens that hold them."""
        return self.token_of_byte[start], self.token_of_byte[end - 1] + 1


class Chunk(NamedTuple):
    """The tokens of one :meth:`~sheafgnn.site.SiteStream.push`."""

    ids: Tensor  # (k,) the new token ids
    data: bytes  # their bytes
    toks: list[int]  # the token (position) of each new byte
    first: int  # position of the first new token
    end: int  # tokens pushed so far, these included
    first_byte: int  # bytes pushed before these
    offsets: dict[str, int]  # per node type, the nodes before this push (new nodes' global ids start there)


class Scanner(Protocol):
    """A patch type's incremental rule: it reads every byte once and keeps only what an open patch needs."""

    def push(self, chunk: Chunk) -> Patches | None:
        """The patches that closed in ``chunk``, link edges in global node ids; None if none did."""


class PatchRule:
    """One patch type: its schema roles, its config fields and its two builders.

    A subclass in ``sheafgnn/site/patches/<name>.py`` (one instance, ``RULE``) sets
    the attributes it needs and implements :meth:`spans` and :meth:`scanner`. The
    ``config`` argument of the methods is a :class:`~sheafgnn.site.SiteConfig`, which
    holds every type's fields (it is built from the rules, so not imported here).

    Attributes:
        name (str): the node type; the module is named for it.
        config_fields (type, optional): a dataclass of the type's SiteConfig fields, named
            for the type (``local_window``; ``anchor_scope`` and ``readout_last`` are older)
            and unique among the types; :func:`integer` fields are checked.
        on_by_default (bool): in SiteConfig's default ``patch_types``.
        always_on (bool): made whatever ``patch_types`` says (``output``).
        covered (bool): its patches pool the tokens they span (``token in p`` edges).
        chained (bool): each patch follows an earlier one of its type (``p next p``;
            :meth:`chain_lag` nodes back).
        anchors (bool): its patches anchor the later anchored patches that start
            within ``anchor_scope`` tokens (``p anchors q``).
        anchored (bool): the anchoring types' patches anchor its patches.
        read (bool): every output reads its latest patches (``p reads output``;
            :meth:`read_count` of them).
        links (tuple[EdgeType, ...]): the link edge types its builders make (into its nodes).
        attribute (str, optional): a per-node LongTensor its builders give (``data[name][attribute]``),
            which the model embeds (:meth:`attribute_rows` values).
    """

    name: str
    config_fields: type | None = None
    on_by_default = True
    always_on = False
    covered = False
    chained = False
    anchors = False
    anchored = False
    read = True
    links: tuple[EdgeType, ...] = ()
    attribute: str | None = None

    def chain_lag(self, config) -> int:
        """How many nodes back the previous patch of a node's chain is."""
        return 1

    def read_count(self, config) -> int:
        """How many of the latest patches of the type each output reads (``readout_last``, output's field)."""
        return config.readout_last

    def attribute_rows(self, config) -> int | None:
        """How many values the attribute takes (the model's embedding rows); None: no bound in the site config."""
        return None

    def spans(self, window: Window, config) -> Patches:
        """The type's patches over the whole ``window``, vectorised (tensor ops, no loop over tokens)."""
        raise NotImplementedError

    def scanner(self, config, topic_model: TopicModel | None) -> Scanner | None:
        """A fresh incremental scanner for one stream; None if the type makes no patches (topic: no model)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


def sort_by_time(start: Tensor, end: Tensor, *extra: Tensor) -> tuple[Tensor, ...]:
    """Sort spans by (time = end - 1, start), the order chains and scans use."""
    if start.numel() == 0:
        return (start, end, *extra)
    key = (end - 1) * (int(end.max()) + 1) + start
    order = torch.argsort(key, stable=True)
    return (start[order], end[order], *(x[order] for x in extra))


def no_patches() -> Patches:
    """No patches, as fresh tensors (a site owns its tensors)."""
    return Patches((torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)))


def closed_spans(closed: Closed) -> Spans:
    """A scanner's closed spans as tensors."""
    if not closed:
        return NONE, NONE
    return torch.tensor([c[0] for c in closed]), torch.tensor([c[1] for c in closed])


def edge_array(src: list[int], dst: list[int]) -> np.ndarray:
    """(2, E) int64 edges from source and destination lists."""
    return np.array([src, dst], dtype=np.int64) if src else NO_EDGES
