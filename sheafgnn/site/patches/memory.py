"""``memory`` patches: words, identifiers and numbers of at least ``memory_min_len`` bytes.

A word closes on the first non-word byte after it. Each occurrence links to its
``memory_links`` previous occurrences of the same entity (``recurs``); entity keys
hash a word's first ``memory_max_len`` bytes (:func:`~sheafgnn.site.rules.words`).
The scanner keeps the open word's start, length and hash.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sheafgnn.site import rules
from sheafgnn.site.patches.links import Recent, link_previous
from sheafgnn.site.patches.rule import Chunk, Patches, PatchRule, Window, closed_spans, integer, sort_by_time

_RECURS = ("memory", "recurs", "memory")  # previous occurrences of the same entity
_WORD = rules.byte_set(rules.WORD)
_WORD_HASH = rules.WORD_HASH.tolist()


@dataclass
class MemoryConfig:
    memory_min_len: int = integer(3)  # shortest word (bytes) that counts as an entity
    memory_max_len: int = integer(32, most=64)  # words are compared on at most this many bytes
    memory_links: int = integer(1, least=0)  # previous occurrences linked per occurrence


class Memory(PatchRule):
    name = "memory"
    # Off unless asked for: on text the default model was no better with it (off: -0.023 bits per byte at
    # 1.05M tokens, 2 seeds, inside the seed spread of 0.054); docs/results.md#the-lean-default
    on_by_default = False
    config_fields = MemoryConfig
    covered = True
    links = (_RECURS,)

    def spans(self, window: Window, config) -> Patches:
        start, end, entity = rules.words(window.bytes, config.memory_min_len, config.memory_max_len)
        start, end, entity = sort_by_time(*window.to_tokens(start, end), entity)
        return Patches((start, end), links={_RECURS: torch.stack(link_previous(entity, config.memory_links))})

    def scanner(self, config, topic_model) -> MemoryScanner:
        return MemoryScanner(config.memory_min_len, config.memory_max_len, config.memory_links)


class MemoryScanner:
    """rules.words: the open word's start token, length and entity key; the latest occurrences of each entity."""

    def __init__(self, min_len: int, max_len: int, links: int) -> None:
        self.min_len, self.max_len = min_len, max_len
        self.length = 0  # 0: no open word
        self.start = 0
        self.key = 0
        self.recent = Recent(links)

    def push(self, chunk: Chunk) -> Patches | None:
        words = []
        for byte, tok in zip(chunk.data, chunk.toks):
            if byte in _WORD:
                if self.length == 0:
                    self.start, self.key = tok, 0
                if self.length < self.max_len:
                    self.key += (byte + 1) * _WORD_HASH[self.length]
                self.length += 1
            elif self.length:
                if self.length >= self.min_len:
                    words.append((self.start, tok + 1, self.key))
                self.length = 0
        if not words:
            return None
        links = self.recent.link_all([w[2] for w in words], chunk.offsets["memory"])
        return Patches(closed_spans(words), links={_RECURS: links})


RULE = Memory()
