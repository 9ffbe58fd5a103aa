r"""Relation graphs: which token pairs a topology relates, and how well they cover known dependencies.

A *relation* is a token pair (i, j), i < j: *the prediction of token j can
read token i*. A causal LM predicts token j from its state at position
j - 1, so the relations of

- **dense** causal attention are all pairs i < j: n(n-1)/2
  (:func:`dense_relations`, counted analytically, never materialised);
- a **local window** of w keys (position t attends to t-w+1 .. t) are the
  pairs with 1 <= j - i <= w: sum_{j=1}^{n-1} min(w, j) = w(n-1) - w(w-1)/2
  for n > w (:func:`window_relations`);
- a **site** are the pairs joined by a path of at most H hops from token node
  i to output node j - 1 in its *relation graph* (:func:`site_graph`): every
  site edge (cover, chain, anchor, recurrence, retrieval, write and read
  edges), plus the token stream token t-1 -> token t (the selective scan Phi
  steps along it), each one hop. Causality of the site makes every such pair
  i < j. A learned topology keeps some gluing edges (:func:`topology_graph`).

A dependency (src, dst) is **realised** by a topology when (src, dst) is one
of its relations. **coverage** = realised dependencies / dependencies
(distinct pairs); **waste** = 1 - realised dependencies / relations, the
fraction of the topology's relations that no dependency uses. **Edges**: the
physical message edges of the relation graph.

**Hops.** H (``hops``) is what one block of the model can reach: pool (token
-> patch), glue (patch -> patch), read (patch -> output). One attention layer
is one hop. Caveat: the selective scan carries a compressed summary of the
*whole* prefix; counting it as one hop per token step undercounts what the
SSM may carry, while counting it as reaching everything would make the site's
relations the dense triangle.

::

    attention_graph(n, window) / site_graph(data) / topology_graph(topology, data) -> RelationGraph
    relation_stats(graph, hops, src, dst)   relations, realised flags, relations per destination
    reach_from_tokens(graph, tokens, hops)  the nodes each token reaches in <= hops hops
    relation_matrix(graph, hops)            the relations as a sparse (n, n) matrix (small n)
    score_graph(graph, hops, src, dst, dep_type, type_names)   coverage, waste, relations, edges

Used by the paper's simulation (:mod:`sheafgnn.experiments.simulation`), the
learned-topology study and topology inspection.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.optional import require
from sheafgnn.site import CANDIDATE_EDGES, NODE_TYPES
from sheafgnn.site.schema import EdgeType

sp = require("scipy.sparse", "sheafgnn.relations (the simulation, the learned-topology study, sheafgnn inspect)")


@dataclass
class RelationGraph:
    """A directed graph in which token pairs are relations (see the module docstring).

    Attributes:
        num_nodes (int): N.
        edge_index (np.ndarray): (2, E) int64 source -> destination.
        token_node (np.ndarray): (n,) the node where token i's information enters.
        read_node (np.ndarray): (n,) the node whose state predicts token t + 1.
        edges_by_type (dict): physical edge counts per edge type (reported, not used).
    """

    num_nodes: int
    edge_index: np.ndarray
    token_node: np.ndarray
    read_node: np.ndarray
    edges_by_type: dict[str, int] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.token_node.size)

    @property
    def num_edges(self) -> int:
        return int(self.edge_index.shape[1])


def dense_relations(n: int) -> int:
    """Relations of dense causal attention: the pairs i < j, n(n-1)/2."""
    return n * (n - 1) // 2


def window_relations(n: int, window: int) -> int:
    """Relations of a local window of ``window`` keys: pairs with 1 <= j - i <= w."""
    if n - 1 <= window:
        return dense_relations(n)
    return window * (n - 1) - window * (window - 1) // 2


def attention_graph(n: int, window: int | None = None) -> RelationGraph:
    """Dense (``window=None``) or windowed attention as an explicit graph: key i -> query t.

    Materialises O(n^2) or O(n w) edges: for tests and small n only.
    """
    t = np.arange(n)
    if window is None:
        src, dst = np.tril_indices(n)[1], np.tril_indices(n)[0]  # key <= query
    else:
        lag = np.arange(window)
        src, dst = (t[:, None] - lag).ravel(), np.repeat(t, window)
        keep = src >= 0
        src, dst = src[keep], dst[keep]
    return RelationGraph(2 * n, np.stack([src, dst + n]), t, t + n, {"attention": int(src.size)})


def node_offsets(data: HeteroData) -> tuple[dict[str, int], int]:
    """The global id of each node type's first node in a relation graph (:data:`NODE_TYPES` order,
    tokens first), and the number of nodes."""
    offset, total = {}, 0
    for node_type in NODE_TYPES:
        offset[node_type] = total
        total += data[node_type].num_nodes
    return offset, total


def graph_from_edges(data: HeteroData, edges: dict[EdgeType, Tensor], stream: bool = True) -> RelationGraph:
    """The relation graph of a site with the given typed edges (plus the token stream).

    Nodes get global ids in :data:`NODE_TYPES` order (:func:`node_offsets`);
    the read node of position t is output t.

    Args:
        data (HeteroData): the site (node counts).
        edges (dict): edge type -> (2, E) edge index in that type's node indices.
        stream (bool): add token t-1 -> token t, the selective scan (default: :obj:`True`).
    """
    offset, total = node_offsets(data)
    n = data["token"].num_nodes
    parts, by_type = [], {}
    for (src_type, rel, dst_type), edge_index in edges.items():
        ei = edge_index.detach().cpu().numpy() if isinstance(edge_index, Tensor) else np.asarray(edge_index)
        if ei.shape[1]:
            parts.append(np.stack([ei[0] + offset[src_type], ei[1] + offset[dst_type]]))
        by_type[f"{src_type}__{rel}__{dst_type}"] = int(ei.shape[1])
    if stream and n > 1:
        parts.append(np.stack([np.arange(n - 1), np.arange(1, n)]) + offset["token"])
        by_type["token__stream__token"] = n - 1
    edge_index = np.concatenate(parts, 1) if parts else np.zeros((2, 0), dtype=np.int64)
    tokens = np.arange(n)
    return RelationGraph(total, edge_index.astype(np.int64), tokens + offset["token"],
                         tokens + offset["output"], by_type)


def site_graph(data: HeteroData, stream: bool = True) -> RelationGraph:
    """The relation graph of a site: every edge type of ``data`` plus the token stream."""
    return graph_from_edges(data, {e: data[e].edge_index for e in data.edge_types}, stream)


def topology_graph(topology: dict[EdgeType, dict[str, Tensor]], data: HeteroData,
                   stream: bool = True) -> RelationGraph:
    """The relation graph of a learned topology: its kept gluing edges (every type of
    :data:`~sheafgnn.site.schema.GLUE_EDGES` it holds: rule, content-addressed and random), the
    site's fixed edges (cover, ``token reads output``) and the token stream.

    Args:
        topology (dict): edge type -> {"edge_index": (2, E), ...} in that type's node indices, e.g.
            ``SheafStateLM.topology(data)`` (a rule type it lacks contributes no edge).
        data (HeteroData): the site it was computed on.
    """
    edges = {e: data[e].edge_index for e in data.edge_types if e not in CANDIDATE_EDGES}
    edges.update({e: entry["edge_index"] for e, entry in topology.items()})
    return graph_from_edges(data, edges, stream)


def _relation_chunks(graph: RelationGraph, hops: int, chunk: int):
    """Yield (a, b, tok, j): the relations (tok[k], j[k]) whose read position t = j - 1 is in [a, b).

    Boolean sparse products walk backwards ``hops`` times from the read nodes
    of ``chunk`` positions at a time: memory is bounded by one chunk's
    reachable sets (degree-bounded in a site), never the whole pair set.
    """
    if hops < 1:
        raise ValueError(f"relation_stats: hops must be >= 1 (got {hops})")
    n, num = graph.num_tokens, graph.num_nodes
    ei = graph.edge_index
    back = sp.csr_matrix((np.ones(ei.shape[1], dtype=bool), (ei[1], ei[0])), shape=(num, num))  # (N, N) dst <- src
    column_token = np.full(num, -1, dtype=np.int64)
    column_token[graph.token_node] = np.arange(n)
    for a in range(0, n - 1, chunk):  # read positions t in [a, b) predict j = t + 1 <= n - 1
        b = min(a + chunk, n - 1)
        rows = b - a
        reach = sp.csr_matrix((np.ones(rows, dtype=bool), (np.arange(rows), graph.read_node[a:b])),
                              shape=(rows, num))  # (rows, N)
        for _ in range(hops):
            reach = reach + reach @ back  # paths one hop longer
        reach = reach.tocoo()
        tok = column_token[reach.col]
        t = reach.row.astype(np.int64) + a
        keep = (tok >= 0) & (tok <= t)  # token i with i < j = t + 1
        yield a, b, tok[keep], t[keep] + 1


def relation_stats(graph: RelationGraph, hops: int, src: np.ndarray | None = None,
                   dst: np.ndarray | None = None, chunk: int = 1 << 14) -> tuple[int, np.ndarray, np.ndarray]:
    """Count a graph's relations exactly and mark the dependencies it realises.

    Relation (i, j), i < j: token_node[i] reaches read_node[j - 1] in <= ``hops`` hops.

    Args:
        graph (RelationGraph): the topology.
        hops (int): H >= 1.
        src, dst (np.ndarray, optional): (D,) dependencies to test.
        chunk (int): read positions per sparse product (default: :obj:`16384`).

    Returns:
        (relations, realised (D,) bool, relations per destination j (n,) int64)
    """
    n = graph.num_tokens
    src = np.zeros(0, dtype=np.int64) if src is None else np.asarray(src, dtype=np.int64)
    dst = np.zeros(0, dtype=np.int64) if dst is None else np.asarray(dst, dtype=np.int64)
    realised = np.zeros(src.size, dtype=bool)
    per_dst = np.zeros(n, dtype=np.int64)
    dep_order = np.argsort(dst, kind="stable")
    dep_dst_sorted = dst[dep_order]
    total = 0
    for a, b, tok, j in _relation_chunks(graph, hops, chunk):
        total += int(tok.size)
        per_dst[a + 1: b + 1] = np.bincount(j - a - 1, minlength=b - a)
        lo, hi = np.searchsorted(dep_dst_sorted, [a + 1, b + 1])
        if hi > lo and tok.size:
            idx = dep_order[lo:hi]
            keys = np.sort(j * n + tok)
            want = dst[idx] * n + src[idx]
            pos = np.searchsorted(keys, want).clip(max=keys.size - 1)
            realised[idx] = keys[pos] == want
    return total, realised, per_dst


def reach_from_tokens(graph: RelationGraph, tokens: np.ndarray, hops: int) -> sp.csr_matrix:
    """(D, N) boolean: entry [d, v] is True when node v is reachable from token ``tokens[d]`` along
    the graph's edges in at most ``hops`` hops (0 hops: the token's own node).

    A relation (i, t + 1) of an edge u -> read node t exists when token i reaches u
    in ``hops - 1`` hops: this is the forward half of :func:`relation_stats`.
    """
    num, ei = graph.num_nodes, graph.edge_index
    forward = sp.csr_matrix((np.ones(ei.shape[1], dtype=bool), (ei[0], ei[1])), shape=(num, num))  # src -> dst
    tokens = np.asarray(tokens, dtype=np.int64)
    reach = sp.csr_matrix((np.ones(tokens.size, dtype=bool), (np.arange(tokens.size), graph.token_node[tokens])),
                          shape=(tokens.size, num))  # (D, N)
    for _ in range(hops):
        reach = reach + reach @ forward  # paths one hop longer
    return reach


def relation_matrix(graph: RelationGraph, hops: int, chunk: int = 1 << 14) -> sp.csr_matrix:
    """The relations as a boolean (n, n) matrix M[j, i] = (i, j) is a relation (lower triangle).

    Holds every pair: for inspection-sized texts, not for n in the millions.
    """
    n = graph.num_tokens
    tok, j = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for _, _, t_chunk, j_chunk in _relation_chunks(graph, hops, chunk):
        tok.append(t_chunk), j.append(j_chunk)
    tok, j = np.concatenate(tok), np.concatenate(j)
    return sp.csr_matrix((np.ones(tok.size, dtype=bool), (j, tok)), shape=(n, n))


def coverage_scores(realised: np.ndarray, dep_type: np.ndarray, relations: int,
                    type_names: tuple[str, ...] = ()) -> dict:
    """Coverage (overall and per dependency type) and waste from realised flags.

    Args:
        realised (np.ndarray): (D,) bool, dependency realised by the topology.
        dep_type (np.ndarray): (D,) index into ``type_names`` of each dependency.
        relations (int): the topology's relations.
        type_names (tuple[str, ...]): dependency type names (default: :obj:`()`, no per-type coverage).

    Returns:
        dict: ``coverage``, ``waste``, ``relations``, ``realised`` and ``coverage_by_type``
        (name -> coverage, None for a type without dependencies).
    """
    used = int(realised.sum())
    out = {
        "coverage": used / max(realised.size, 1),
        "waste": 1.0 - used / relations if relations else 0.0,
        "relations": int(relations),
        "realised": used,
        "coverage_by_type": {},
    }
    for i, name in enumerate(type_names):
        mask = dep_type == i
        out["coverage_by_type"][name] = float(realised[mask].mean()) if mask.any() else None
    return out


def score_graph(graph: RelationGraph, hops: int, src: np.ndarray, dst: np.ndarray,
                dep_type: np.ndarray | None = None, type_names: tuple[str, ...] = ()) -> dict:
    """Coverage, waste, relations and edges of any relation graph against dependencies (src, dst).

    Args:
        graph (RelationGraph): the topology.
        hops (int): H >= 1.
        src, dst (np.ndarray): (D,) the dependencies, src < dst.
        dep_type (np.ndarray, optional): (D,) index into ``type_names`` (default: all 0).
        type_names (tuple[str, ...]): dependency type names (default: :obj:`()`).

    Returns:
        dict: ``coverage``, ``waste``, ``relations``, ``realised``,
        ``coverage_by_type`` (by ``type_names``), ``edges``, ``edges_by_type``,
        ``relations_per_token`` and ``max_relations_per_token`` (over destinations j).
    """
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    dep_type = np.zeros(src.size, dtype=np.int64) if dep_type is None else np.asarray(dep_type)
    relations, realised, per_dst = relation_stats(graph, hops, src, dst)
    out = coverage_scores(realised, dep_type, relations, type_names)
    out["edges"] = graph.num_edges
    out["edges_by_type"] = {k: v for k, v in graph.edges_by_type.items() if v}
    out["relations_per_token"] = relations / max(graph.num_tokens - 1, 1)
    out["max_relations_per_token"] = int(per_dst.max()) if per_dst.size else 0
    return out
