"""Heterogeneous outside, flat inside: a site (or batch) as one flat graph.

The model runs one fused pass over all edge types, so it sees the site as a
single node set (types in :data:`FLAT_TYPES` order, each a contiguous block)
and destination-sorted CSR edge lists with an edge-type id per edge::

    node ids   [ token | local ... workspace | topic ... retrieval | output ]
                         chained types (Phi)    other patch types
    type_ptr   offsets of the blocks, (num_types + 1,) ints
    cover      token -> patch edges, sorted by destination, + ptr over the
               patch nodes (num_patches + 1,)
    glue       candidate edges (CANDIDATE_EDGES), sorted by destination,
               edge_type ids, + ptr (N + 1,)

In a PyG ``Batch`` every type's block holds graph 0's nodes, then graph 1's,
each in time order, so chains are contiguous runs: ``token_reset`` and
``chain_reset`` mark where a new chain starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.nn.segment import sort_by_destination
from sheafgnn.site.schema import CANDIDATE_EDGES, CHAINED_TYPES, COVER_EDGES, NODE_TYPES

# Node types in the model's flat order: the chained patch types (scanned by Phi) form one run.
FLAT_TYPES: tuple[str, ...] = (("token",) + CHAINED_TYPES
                               + tuple(t for t in NODE_TYPES[1:-1] if t not in CHAINED_TYPES) + ("output",))


class FlatBlocks:
    """Node types as contiguous blocks of a flat node order (FLAT_TYPES), given ``type_ptr``."""

    type_ptr: list[int]  # (num_types + 1,) block offsets in FLAT_TYPES order

    @property
    def num_nodes(self) -> int:
        return self.type_ptr[-1]

    def block(self, node_type: str) -> slice:
        t = FLAT_TYPES.index(node_type)
        return slice(self.type_ptr[t], self.type_ptr[t + 1])


@dataclass
class FlatSite(FlatBlocks):
    type_ptr: list[int]  # (num_types + 1,) block offsets in FLAT_TYPES order
    node_type: Tensor  # (N,) index into FLAT_TYPES of every node
    time: Tensor  # (N,) last token position each node may depend on
    cover_src: Tensor  # (C,) token of each cover edge, sorted by destination
    cover_ptr: Tensor  # (num_patches + 1,) CSR pointer of the cover edges over the patch nodes
    glue_index: Tensor  # (2, num_edges) candidate edges, sorted by destination
    glue_type: Tensor  # (num_edges,) index into CANDIDATE_EDGES
    glue_ptr: Tensor  # (N + 1,) CSR pointer of the candidate edges
    token_reset: Tensor  # (num_tokens,) True where a new token chain (graph) starts
    token_pos: Tensor  # (num_tokens,) position of each token in its graph
    token_graph_start: Tensor  # (num_tokens,) node id of the first token of each token's graph
    chain_reset: Tensor  # (num_chained,) True where a new patch chain starts

    @property
    def tokens(self) -> slice:
        return self.block("token")

    @property
    def patches(self) -> slice:
        """Every patch node but the outputs: chained types first."""
        return slice(self.type_ptr[1], self.type_ptr[-2])

    @property
    def chained(self) -> slice:
        return slice(self.type_ptr[1], self.type_ptr[1 + len(CHAINED_TYPES)])

    @property
    def outputs(self) -> slice:
        return self.block("output")


def _graph_id(store, device) -> Tensor:
    batch = store.get("batch")
    return batch if batch is not None else torch.zeros(store.num_nodes, dtype=torch.long, device=device)


def _starts(*keys: Tensor) -> Tensor:
    """True where any key differs from the previous element (and at 0)."""
    n = keys[0].numel()
    out = torch.ones(n, dtype=torch.bool, device=keys[0].device)
    if n > 1:
        out[1:] = torch.stack([k[1:] != k[:-1] for k in keys]).any(0)
    return out


def _global_edges(data: HeteroData, edge_types, offset: dict[str, int]) -> tuple[Tensor, Tensor]:
    parts, types = [], []
    for i, edge_type in enumerate(edge_types):
        src_type, _, dst_type = edge_type
        edge_index = data[edge_type].edge_index
        shift = torch.tensor([[offset[src_type]], [offset[dst_type]]], device=edge_index.device)
        parts.append(edge_index + shift)
        types.append(torch.full((edge_index.size(1),), i, dtype=torch.long, device=edge_index.device))
    return torch.cat(parts, 1), torch.cat(types)


def flatten_site(data: HeteroData) -> FlatSite:
    """Flatten a site or a batch of sites for the model's fused passes."""
    device = data["token"].x.device
    sizes = [data[t].num_nodes for t in FLAT_TYPES]
    type_ptr = [0]
    for size in sizes:
        type_ptr.append(type_ptr[-1] + size)
    offset = dict(zip(FLAT_TYPES, type_ptr[:-1]))
    num_nodes = type_ptr[-1]
    node_type = torch.repeat_interleave(torch.arange(len(FLAT_TYPES), device=device),
                                        torch.tensor(sizes, device=device), output_size=num_nodes)
    time = torch.cat([data[t].time for t in FLAT_TYPES])

    cover_index, _ = _global_edges(data, COVER_EDGES, offset)
    cover_index, cover_ptr = sort_by_destination(cover_index, num_nodes=num_nodes)
    cover_ptr = cover_ptr[type_ptr[1] : type_ptr[-2] + 1]  # only patches are covered: starts at 0
    glue_index, glue_type = _global_edges(data, CANDIDATE_EDGES, offset)
    glue_index, glue_type, glue_ptr = sort_by_destination(glue_index, glue_type, num_nodes=num_nodes)

    token_reset = _starts(_graph_id(data["token"], device))
    chain_graph = torch.cat([_graph_id(data[t], device) for t in CHAINED_TYPES])
    chain_reset = _starts(node_type[type_ptr[1] : type_ptr[1 + len(CHAINED_TYPES)]], chain_graph)
    token_pos = data["token"].pos
    token_graph_start = torch.arange(token_pos.numel(), device=device) - token_pos
    return FlatSite(type_ptr, node_type, time, cover_index[0], cover_ptr, glue_index, glue_type, glue_ptr,
                    token_reset, token_pos, token_graph_start, chain_reset)
