"""The site (C, J): tokenizers, patch types and the causal site builder."""

from sheafgnn.site.builder import SiteBuilder, build_site, validate_site
from sheafgnn.site.schema import (
    ALL_TEXT_PATCH_TYPES,
    CANDIDATE_EDGES,
    DEFAULT_PATCH_TYPES,
    EDGE_TYPES,
    NODE_TYPES,
    PATCH_TYPES,
    PatchType,
    SiteConfig,
)
from sheafgnn.site.stream import SiteStream
from sheafgnn.site.tokenizer import BPETokenizer, ByteTokenizer
from sheafgnn.site.topic import TopicModel

__all__ = [
    "ALL_TEXT_PATCH_TYPES",
    "BPETokenizer",
    "ByteTokenizer",
    "CANDIDATE_EDGES",
    "DEFAULT_PATCH_TYPES",
    "EDGE_TYPES",
    "NODE_TYPES",
    "PATCH_TYPES",
    "PatchType",
    "SiteBuilder",
    "SiteConfig",
    "SiteStream",
    "TopicModel",
    "build_site",
    "validate_site",
]
