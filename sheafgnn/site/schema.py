"""The site's schema: patch types, edge types and the builder's config (C, J).

Every graph the builder makes has every node type and edge type listed here,
empty where the text has none (PyG batching silently drops a type that the
first graph of a batch lacks).

Node types::

    token        one per position            x (ids), pos, time
    local        windows of w tokens          time, span
    sentence     sentence spans               time, span
    syntax       brackets, quotes, indents    time, span
    instruction  cue lines (###, Q:, ...)     time, span
    topic        sentences with a topic id    time, span, topic
    memory       word occurrences             time, span
    retrieval    positions with a hash match  time, span
    workspace    registers per window         time, span, register
    output       one per position (readout)   time, span

``time`` is the last token position a node's state may depend on; a patch
over tokens [s, e) has time e - 1. Patches close on the byte that proves
they closed (a sentence on the space after its full stop), so a patch never
depends on text after its time.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field

from sheafgnn.config import ConfigFile

EdgeType = tuple[str, str, str]


class PatchType(enum.StrEnum):
    """The nine patch types of the Sheaf-State LM site."""

    LOCAL = "local"
    SENTENCE = "sentence"
    SYNTAX = "syntax"
    INSTRUCTION = "instruction"
    TOPIC = "topic"
    MEMORY = "memory"
    RETRIEVAL = "retrieval"
    WORKSPACE = "workspace"
    OUTPUT = "output"


PATCH_TYPES: tuple[str, ...] = tuple(p.value for p in PatchType)
NODE_TYPES: tuple[str, ...] = ("token",) + PATCH_TYPES
# The patch types a SiteConfig switches on unless told: every rule but the token-hash retrieval patches,
# whose job (find an earlier occurrence of what is read now) the learned topology's content proposals do:
# they solve MQAR with retrieval off (benchmarks/results/tasks/), and on text retrieval patches bought
# +0.005 bits/byte, under the seed noise of 0.031, for 0.7 of the 3.2 nodes and 4.6 of the 18 edges per
# token (benchmarks/results/ablation.md).
DEFAULT_PATCH_TYPES: tuple[str, ...] = tuple(p for p in PATCH_TYPES if p != "retrieval")

# Patch types whose nodes pool the tokens they cover (token -> patch 'in').
COVERED_TYPES = ("local", "sentence", "syntax", "instruction", "topic", "memory", "retrieval")
# Patch types chained to the previous patch of the same type ('next').
CHAINED_TYPES = ("local", "sentence", "syntax", "instruction", "workspace")
# Patch types that instructions anchor ('anchors').
ANCHORED_TYPES = ("local", "sentence")
# Every node type but output feeds the readout ('reads').
READ_TYPES = ("token",) + tuple(p for p in PATCH_TYPES if p != "output")

COVER_EDGES: tuple[EdgeType, ...] = tuple(("token", "in", p) for p in COVERED_TYPES)
CHAIN_EDGES: tuple[EdgeType, ...] = tuple((p, "next", p) for p in CHAINED_TYPES)
ANCHOR_EDGES: tuple[EdgeType, ...] = tuple(("instruction", "anchors", p) for p in ANCHORED_TYPES)
LINK_EDGES: tuple[EdgeType, ...] = (
    ("topic", "same_topic", "topic"),  # recent earlier sentences of the same topic
    ("memory", "recurs", "memory"),  # previous occurrences of the same entity
    ("token", "recalls", "retrieval"),  # token after an earlier match of the key
    ("local", "writes", "workspace"),  # a window writes the registers at its end
)
READ_EDGES: tuple[EdgeType, ...] = tuple((p, "reads", "output") for p in READ_TYPES)

EDGE_TYPES: tuple[EdgeType, ...] = COVER_EDGES + CHAIN_EDGES + ANCHOR_EDGES + LINK_EDGES + READ_EDGES
# Edges that the learned topology scores and prunes (the gluing candidates).
CANDIDATE_EDGES: tuple[EdgeType, ...] = CHAIN_EDGES + ANCHOR_EDGES + LINK_EDGES + READ_EDGES[1:]
# Proposals the model makes itself (sheafgnn.nn.topology), not site edges: the tokens of the best
# complete blocks before an output (content-addressed), and seeded random past tokens.
CONTENT_EDGE: EdgeType = ("token", "matches", "output")
RANDOM_EDGE: EdgeType = ("token", "explores", "output")
# Every gluing edge type, in the order of the model's edge-type ids.
GLUE_EDGES: tuple[EdgeType, ...] = CANDIDATE_EDGES + (CONTENT_EDGE, RANDOM_EDGE)

DEFAULT_CUES = ("###", "Instruction:", "Q:", "User:", "Question:", "Task:")


@dataclass
class SiteConfig(ConfigFile):
    """How text becomes a site. Every rule can be switched off or tuned.

    Printing a config shows every field; :meth:`to_dict` and
    :meth:`from_dict` round-trip it through YAML/TOML/JSON.
    """

    patch_types: tuple[str, ...] = DEFAULT_PATCH_TYPES  # switched-on types; output is always on
    local_window: int = 16  # tokens per local window
    syntax_max_span: int = 512  # drop bracket/quote/indent spans longer than this (tokens)
    syntax_max_depth: int = 8  # drop brackets nested deeper than this
    instruction_cues: tuple[str, ...] = DEFAULT_CUES  # a line starting with one opens an instruction
    anchor_scope: int = 4096  # an instruction anchors patches starting within this many tokens
    topic_links: int = 2  # a sentence links to this many earlier sentences of its topic
    memory_min_len: int = 3  # shortest word (bytes) that counts as an entity
    memory_max_len: int = 32  # words are compared on at most this many bytes
    memory_links: int = 1  # previous occurrences linked per occurrence
    retrieval_key_len: int = 3  # tokens hashed into a retrieval key
    retrieval_links: int = 2  # earlier matches linked per position
    workspace_registers: int = 4  # registers updated at each local-window boundary
    readout_last: int = 1  # latest patches of each type an output reads (workspace: all registers)
    topic_model: str | None = None  # path of a fitted TopicModel; None: no topic patches
    extra: dict = field(default_factory=dict)  # free-form notes kept with the config

    def __post_init__(self) -> None:
        self.patch_types = tuple(str(getattr(p, "value", p)) for p in self.patch_types)
        self.instruction_cues = tuple(self.instruction_cues)
        unknown = sorted(set(self.patch_types) - set(PATCH_TYPES))
        if unknown:
            raise ValueError(f"SiteConfig: unknown patch types {unknown}; choose from {list(PATCH_TYPES)}")
        for name in ("local_window", "syntax_max_span", "syntax_max_depth", "memory_min_len",
                     "memory_max_len", "retrieval_key_len", "workspace_registers", "readout_last"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"SiteConfig: {name} must be a positive integer (got {value!r})")
        if self.memory_max_len > 64:
            raise ValueError(f"SiteConfig: memory_max_len must be at most 64 (got {self.memory_max_len})")
        for name in ("anchor_scope", "topic_links", "memory_links", "retrieval_links"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"SiteConfig: {name} must be a non-negative integer (got {value!r})")

    def enabled(self, patch_type: str) -> bool:
        return patch_type == "output" or patch_type in self.patch_types

    def to_dict(self) -> dict:
        out = asdict(self)
        out["patch_types"] = list(self.patch_types)
        out["instruction_cues"] = list(self.instruction_cues)
        return out
