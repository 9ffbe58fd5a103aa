"""``topic`` patches: the sentences, each with a topic id from the fitted :class:`~sheafgnn.site.TopicModel`.

None without a topic model. Each sentence links to its ``topic_links`` previous
sentences of the same topic (``same_topic``). A sentence's topic depends on that
sentence alone, so the patches stay causal. The scanner is a sentence scanner
that keeps the open sentence's bytes for the topic model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sheafgnn.site import rules
from sheafgnn.site.patches.links import Recent, link_previous
from sheafgnn.site.patches.rule import (
    Chunk,
    Patches,
    PatchRule,
    Window,
    closed_spans,
    integer,
    no_patches,
    sort_by_time,
)
from sheafgnn.site.patches.sentence import SentenceScanner
from sheafgnn.site.topic import TopicModel

_SAME_TOPIC = ("topic", "same_topic", "topic")  # recent earlier sentences of the same topic


@dataclass
class TopicConfig:
    topic_links: int = integer(2, least=0)  # a sentence links to this many earlier sentences of its topic
    topic_model: str | None = None  # path of a fitted TopicModel; None: no topic patches


class Topic(PatchRule):
    name = "topic"
    config_fields = TopicConfig
    covered = True
    links = (_SAME_TOPIC,)
    attribute = "topic"  # the topic id of the sentence

    def spans(self, window: Window, config) -> Patches:
        if window.topic_model is None:
            return no_patches()
        start, end = rules.sentences(window.bytes)
        if not start.numel():
            return no_patches()
        raw = bytes(window.bytes.numpy())
        texts = [raw[s:e].decode("utf-8", errors="replace") for s, e in zip(start.tolist(), end.tolist())]
        start, end, topic = sort_by_time(*window.to_tokens(start, end), window.topic_model.predict(texts))
        return Patches((start, end), topic, {_SAME_TOPIC: torch.stack(link_previous(topic, config.topic_links))})

    def scanner(self, config, topic_model: TopicModel | None) -> TopicScanner | None:
        return TopicScanner(topic_model, config.topic_links) if topic_model is not None else None


class TopicScanner:
    """The closed sentences, their topics, and the latest ``links`` sentences of each topic."""

    def __init__(self, topic_model: TopicModel, links: int) -> None:
        self.topic_model = topic_model
        self.sentences = SentenceScanner(keep_text=True)
        self.recent = Recent(links)

    def push(self, chunk: Chunk) -> Patches | None:
        closed = self.sentences.scan(chunk.data, chunk.toks)
        if not closed:
            return None
        topic = self.topic_model.predict([s[2].decode("utf-8", errors="replace") for s in closed])
        links = self.recent.link_all(topic.tolist(), chunk.offsets["topic"])
        return Patches(closed_spans(closed), topic, {_SAME_TOPIC: links})


RULE = Topic()
