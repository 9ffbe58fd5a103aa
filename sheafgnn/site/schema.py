"""The site's schema: node types, edge types and the builder's config (C, J), derived from the patch types.

Every patch type is one file of :mod:`sheafgnn.site.patches` (its docstring says
what the type's patches are). From their rules, in their order, come:

- ``PATCH_TYPES`` and ``NODE_TYPES`` (``token`` first); the role tables
  (``COVERED_TYPES``, ``CHAINED_TYPES``, ``ANCHORED_TYPES``, ``READ_TYPES``) and
  ``NODE_ATTRIBUTES`` (topic ids, workspace registers);
- the edge families, ``EDGE_TYPES`` = cover + chain + anchor + link + read, and
  ``GLUE_EDGES``, whose order is the model's edge-type ids;
- :class:`SiteConfig`, whose fields are every type's config fields.

Every graph the builder makes has every node type and edge type listed here,
empty where the text has none (PyG batching silently drops a type that the
first graph of a batch lacks). Nodes: ``token`` (x: the ids, pos, time), and per
patch type ``time`` and ``span`` (plus its attribute, if it has one). ``time``
is the last token position a node's state may depend on; a patch over tokens
[s, e) has time e - 1. Patches close on the byte that proves they closed (a
sentence on the space after its full stop), so a patch never depends on text
after its time.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field, fields

from sheafgnn.config import ConfigFile
from sheafgnn.site.patches import RULES
from sheafgnn.site.patches.rule import EdgeType, PatchRule

PATCH_TYPES: tuple[str, ...] = tuple(RULES)
PatchType = enum.StrEnum("PatchType", [(p.upper(), p) for p in PATCH_TYPES])
PatchType.__doc__ = "The patch types of the Sheaf-State LM site."
NODE_TYPES: tuple[str, ...] = ("token",) + PATCH_TYPES
# The patch types a SiteConfig switches on unless told: those of the default model (each rule's on_by_default says
# why it is off).
DEFAULT_PATCH_TYPES: tuple[str, ...] = tuple(p for p, rule in RULES.items() if rule.on_by_default)
# Every patch type that text makes without being asked for by name: the whole typed site (all but retrieval,
# whose job the content proposals do). The default model reads fewer (DEFAULT_PATCH_TYPES: the others did not pay
# on text); `sheafgnn build --all-types` and the rule tests build these.
ALL_TEXT_PATCH_TYPES: tuple[str, ...] = tuple(p for p in PATCH_TYPES if p != "retrieval")
# The patch types made whatever patch_types says (output).
ALWAYS_ON: tuple[str, ...] = tuple(p for p, rule in RULES.items() if rule.always_on)

# Patch types whose nodes pool the tokens they cover (token -> patch 'in').
COVERED_TYPES = tuple(p for p, rule in RULES.items() if rule.covered)
# Patch types chained to the previous patch of the same type ('next').
CHAINED_TYPES = tuple(p for p, rule in RULES.items() if rule.chained)
# Patch types that anchor ('anchors') the anchored types' patches.
ANCHORING_TYPES = tuple(p for p, rule in RULES.items() if rule.anchors)
ANCHORED_TYPES = tuple(p for p, rule in RULES.items() if rule.anchored)
# The node types whose latest nodes every output reads ('reads'): token and every patch type but output.
READ_TYPES = ("token",) + tuple(p for p, rule in RULES.items() if rule.read)
# The per-node attribute of each patch type that has one (the model embeds it).
NODE_ATTRIBUTES: dict[str, str] = {p: rule.attribute for p, rule in RULES.items() if rule.attribute is not None}

COVER_EDGES: tuple[EdgeType, ...] = tuple(("token", "in", p) for p in COVERED_TYPES)
CHAIN_EDGES: tuple[EdgeType, ...] = tuple((p, "next", p) for p in CHAINED_TYPES)
ANCHOR_EDGES: tuple[EdgeType, ...] = tuple((a, "anchors", p) for a in ANCHORING_TYPES for p in ANCHORED_TYPES)
# topic same_topic topic, memory recurs memory, token recalls retrieval, local writes workspace: each type's own
LINK_EDGES: tuple[EdgeType, ...] = tuple(edge_type for rule in RULES.values() for edge_type in rule.links)
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


@dataclass
class _Switches:
    patch_types: tuple[str, ...] = DEFAULT_PATCH_TYPES  # switched-on types; output is always on


def config_bases(rules: dict[str, PatchRule]) -> tuple[type, ...]:
    """The patch types' config dataclasses, last type first: a dataclass collects its bases' fields from the
    last base to the first, so SiteConfig's fields are patch_types, every type's in type order, then extra."""
    owner = {"patch_types": "SiteConfig", "extra": "SiteConfig"}
    for p, rule in rules.items():
        for f in fields(rule.config_fields) if rule.config_fields is not None else ():
            if f.name in owner:  # one would silently replace the other
                raise TypeError(f"SiteConfig: patch type {p!r} declares the field {f.name!r} of {owner[f.name]!r}")
            owner[f.name] = p
    return tuple(rule.config_fields for rule in reversed(rules.values()) if rule.config_fields is not None)


@dataclass
class SiteConfig(ConfigFile, *config_bases(RULES), _Switches):
    """How text becomes a site. Every rule can be switched off or tuned.

    The fields are ``patch_types``, every patch type's own (``local_window``, ...;
    see :mod:`sheafgnn.site.patches`) and ``extra``. Printing a config shows every
    field; :meth:`to_dict` and :meth:`from_dict` round-trip it through YAML/TOML/JSON.
    """

    extra: dict = field(default_factory=dict)  # free-form notes kept with the config

    def __post_init__(self) -> None:
        self.patch_types = tuple(str(getattr(p, "value", p)) for p in self.patch_types)
        unknown = sorted(set(self.patch_types) - set(PATCH_TYPES))
        if unknown:
            raise ValueError(f"SiteConfig: unknown patch types {unknown}; choose from {list(PATCH_TYPES)}")
        for f in fields(self):
            if isinstance(f.default, tuple):
                setattr(self, f.name, tuple(getattr(self, f.name)))  # YAML, TOML and JSON give lists
            if f.metadata.get("least") is not None:
                _check_integer(f.name, getattr(self, f.name), f.metadata["least"], f.metadata["most"])

    def enabled(self, patch_type: str) -> bool:
        return patch_type in self.patch_types or patch_type in ALWAYS_ON

    def to_dict(self) -> dict:
        out = asdict(self)
        return {name: list(value) if isinstance(value, tuple) else value for name, value in out.items()}


def _check_integer(name: str, value, least: int, most: int | None) -> None:
    """A :func:`~sheafgnn.site.patches.rule.integer` field's value is an integer in [least, most]."""
    if not isinstance(value, int) or value < least:
        described = {0: "a non-negative integer", 1: "a positive integer"}.get(least, f"an integer >= {least}")
        raise ValueError(f"SiteConfig: {name} must be {described} (got {value!r})")
    if most is not None and value > most:
        raise ValueError(f"SiteConfig: {name} must be at most {most} (got {value})")
