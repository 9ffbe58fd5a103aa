r"""The paper's synthetic dependency simulation: coverage and relational waste.

Synthetic byte sequences carry a *known*, sparse, typed dependency graph G*.
Three relational topologies are scored against it: dense causal attention,
a local attention window, and the sheaf site that :func:`build_site` makes
for the same sequence.

::

    generate(n, seed) -> SyntheticSequence      ids (n,), G* = (src, dst, type) (D,)
        |                     \
        | build_site(ids)      dense / window: relations counted analytically
        v                       \
    site_graph(site) -> RelationGraph ----> relation_stats(graph, hops, G*)
                                              relations, coverage, waste
    run_table(n)  -> dict    the paper's table at one length
    run_scaling(ns) -> dict  edges against n, plot_scaling(result, path)

**The generator** (:func:`generate`). A structural causal model over bytes,
laid out as text so that the site's rules see its structure::

    ### 3\n\n fe qb hgd QRk pj. oin lb TSc ... .  \n### 6\n\n ...

- *sections* open with an instruction line ``### K`` (K a key digit, drawn
  freely) and a blank line; a section closes at the first sentence end after
  about ``section_len`` body tokens;
- *body tokens* follow a 2nd-order rule: the kind of token t (letter, word
  boundary ``' '``, sentence stop ``'.'``, entity name letter, ...) is a
  function of (x[t-2], x[t-1]) and free coins, and its value is
  ``x[t] = F_kind(x[t-2], x[t-1], extra, u[t])`` with F_kind a fixed random
  table (the "language", from ``language_seed``) and ``u[t]`` one of
  ``branching`` free choices (stored in :attr:`SyntheticSequence.choice`);
- *anchored* tokens (the first letter of every sentence) also read the
  section's key: ``letter((T[x[t-2], x[t-1], u] + shift[K]) mod 16)``;
- *entity mentions* are 3-byte words: two name letters (which entity, drawn
  from a table) and a value letter. The first mention of an entity draws the
  value; every later mention *copies* the value of the previous mention, so
  the word recurs verbatim.

The generator's G*, typed: **local** (t-2, t) and (t-1, t) for every body
token (the two inputs of its table); **anchor** (key, t) for every anchored
token; **entity** (value of the previous mention, t) for every repeated value.
Format bytes of the instruction lines and the keys have no sources. G* is
defined by the generator alone, never read off the site. A few local edges
are inputs whose value is fixed by the layout (the first letter of a
sentence always sees ``'. '`` or ``'\n\n'``); they stay in G* as the paper's
model ("each token depends on its two predecessors") has them.

**Relations.** A relation is a token pair (i, j), i < j: *the prediction of
token j can read token i*. A causal LM predicts token j from its state at
position j - 1, so the relations of

- **dense** causal attention are all pairs i < j: n(n-1)/2, counted
  analytically, never materialised;
- a **local window** of w keys (position t attends to t-w+1 .. t) are the
  pairs with 1 <= j - i <= w: sum_{j=1}^{n-1} min(w, j) = w(n-1) - w(w-1)/2
  for n > w;
- the **sheaf site** are the pairs joined by a path of at most H hops from
  token node i to output node j - 1 in its *relation graph*: every site edge
  (cover, chain, anchor, recurrence, retrieval, write and read edges), plus
  the token stream token t-1 -> token t (the selective scan Phi steps along
  it), each one hop. Causality of the site makes every such pair i < j.

A dependency (src, dst) of G* is **realised** by a topology when (src, dst)
is one of its relations.
**coverage** = realised dependencies / dependencies (distinct pairs);
**waste** = 1 - realised dependencies / relations, the fraction of the
topology's relations that no true dependency uses. **Edges**: the relations
for dense and window attention (one attention score per pair); for the site
its physical message edges, the edges of its relation graph.

**Hops.** ``hops`` (H, default 3) is what one block of the model can reach:
pool (token -> patch), glue (patch -> patch), read (patch -> output). One
attention layer is one hop, so dense and window are scored at one hop (their
L-layer reach is not counted, as in the paper). Caveat: the selective scan
carries a compressed summary of the *whole* prefix; counting it as one hop
per token step undercounts what the SSM may carry, while counting it as
reaching everything would make the site's relations the dense triangle.

**Beyond the paper: a learned topology** (:func:`run_learned`). A small
:class:`~sheafgnn.model.SheafStateLM` is trained by next-token prediction on
independent synthetic sequences; its kept candidate edges (union over
blocks) whose gate exceeds a threshold, plus the site's fixed edges (cover,
``token reads output``) and the stream, are scored with the same relations,
hops and G* as the designed site (:func:`topology_graph`). Two references
bound what any gating of the site can reach: ``fixed_only`` (no candidate
edge) and ``oracle`` (:func:`oracle_topology`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.config import ArgumentParser, at_least
from sheafgnn.site import CANDIDATE_EDGES, NODE_TYPES, SiteConfig, build_site
from sheafgnn.site.schema import EdgeType

# ---------------------------------------------------------------- the generator

LETTERS = b"abcdefghijklmnop"  # body letters; 16 = the modulus of the anchor shift
NAME_LETTERS = b"QRSTUVWX"  # entity name letters (entities = pairs of them)
KEY_LETTERS = b"0123456789"  # instruction keys

DEP_TYPES = ("local", "anchor", "entity")


class Kind:
    """Token kinds of the generator (stored per token as uint8)."""

    FORMAT = 0  # bytes of an instruction line ('\n', '#', ' '); no sources
    KEY = 1  # the instruction key; free
    LETTER = 2  # T[a, b, u]
    ANCHORED = 3  # sentence-first letter: T[a, b, u] shifted by the section key
    SPACE = 4  # a word boundary ' '
    STOP = 5  # a sentence stop '.'
    AFTER_STOP = 6  # the ' ' after a stop
    NAME = 7  # an entity name letter: N[a, b, u]
    VALUE_NEW = 8  # first mention's value: V[a, b, u]
    VALUE_COPY = 9  # later mention's value: the previous mention's value

    NAMES = ("format", "key", "letter", "anchored", "space", "stop", "after_stop", "name",
             "value_new", "value_copy")


@dataclass
class GeneratorConfig:
    """Densities of the synthetic sequences; defaults give ~67k dependencies at n = 32,768."""

    section_len: int = 1024  # mean body tokens per instruction section (uniform in [L/2, 3L/2])
    num_keys: int = 8  # distinct instruction keys (<= 10)
    word_end: float = 0.3  # chance a word of >= 2 letters ends after each letter
    sentence_end: float = 0.16  # chance a word boundary is a sentence stop
    mention_rate: float = 0.25  # chance a word (not sentence-first) is an entity mention
    branching: int = 4  # free choices u per table context
    language_seed: int = 0  # seeds the tables (the "language"), shared by all sequences

    def __post_init__(self) -> None:
        if not 1 <= self.num_keys <= len(KEY_LETTERS):
            raise ValueError(f"GeneratorConfig: num_keys must be in [1, {len(KEY_LETTERS)}] (got {self.num_keys})")
        if self.section_len < 16 or self.branching < 1:
            raise ValueError(f"GeneratorConfig: need section_len >= 16 and branching >= 1 "
                             f"(got {self.section_len} and {self.branching})")
        for name in ("word_end", "sentence_end", "mention_rate"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"GeneratorConfig: {name} must be in [0, 1) (got {getattr(self, name)})")


@dataclass
class Language:
    """The fixed tables of the generator, indexed by bytes (a, b) = (x[t-2], x[t-1]).

    Attributes:
        letter (np.ndarray): (256, 256, K) letter index in [0, 16) for LETTER/ANCHORED.
        name (np.ndarray): (256, 256, K) name letter index in [0, 8) for NAME.
        value (np.ndarray): (256, 256, K) letter index in [0, 16) for VALUE_NEW.
        shift (np.ndarray): (num_keys,) distinct anchor shifts in [1, 16).
    """

    letter: np.ndarray
    name: np.ndarray
    value: np.ndarray
    shift: np.ndarray


def make_language(config: GeneratorConfig) -> Language:
    """The tables of ``config``'s language (a function of language_seed, branching, num_keys)."""
    rng = np.random.default_rng(config.language_seed)
    k = config.branching
    return Language(
        letter=rng.integers(0, len(LETTERS), (256, 256, k), dtype=np.uint8),
        name=rng.integers(0, len(NAME_LETTERS), (256, 256, k), dtype=np.uint8),
        value=rng.integers(0, len(LETTERS), (256, 256, k), dtype=np.uint8),
        shift=(rng.permutation(len(LETTERS) - 1)[: config.num_keys] + 1).astype(np.uint8),
    )


@lru_cache(maxsize=4)
def _language_lists(language_seed: int, branching: int, num_keys: int) -> tuple[list, list, list, list]:
    """The tables as nested lists, for the generator's scalar loop (cached: tolist is slow)."""
    lang = make_language(GeneratorConfig(num_keys=num_keys, branching=branching, language_seed=language_seed))
    return lang.letter.tolist(), lang.name.tolist(), lang.value.tolist(), lang.shift.tolist()


@dataclass
class SyntheticSequence:
    """A generated sequence and its true dependency graph G*.

    Attributes:
        ids (Tensor): (n,) byte token ids.
        kind (Tensor): (n,) uint8 :class:`Kind` of each token.
        choice (Tensor): (n,) uint8 free choice u of each table token (0 elsewhere).
        key_pos (Tensor): (n,) position of the section key each token sees (-1 before the first).
        src, dst (Tensor): (D,) G* edges, src < dst, distinct pairs.
        dep_type (Tensor): (D,) index into :data:`DEP_TYPES`.
        config (GeneratorConfig): the densities and language seed.
    """

    ids: Tensor
    kind: Tensor
    choice: Tensor
    key_pos: Tensor
    src: Tensor
    dst: Tensor
    dep_type: Tensor
    config: GeneratorConfig

    @property
    def text(self) -> str:
        return bytes(self.ids.to(torch.uint8).numpy()).decode("ascii")

    def dep_counts(self) -> dict[str, int]:
        counts = torch.bincount(self.dep_type, minlength=len(DEP_TYPES)).tolist()
        return {"total": int(self.src.numel()), **dict(zip(DEP_TYPES, counts))}


def generate(n: int, seed: int = 0, config: GeneratorConfig | None = None) -> SyntheticSequence:
    """Generate ``n`` tokens with a known typed dependency graph G* (see the module docstring).

    Deterministic in (n, seed, config); a prefix of a longer sequence with the
    same seed is *not* guaranteed (the layout draws depend on n).

    Args:
        n (int): tokens (bytes) to generate, >= 8.
        seed (int): seeds the layout coins and free choices (default: :obj:`0`).
        config (GeneratorConfig, optional): densities (default: :obj:`GeneratorConfig()`).
    """
    if n < 8:
        raise ValueError(f"generate: n must be >= 8 (got {n})")
    config = config if config is not None else GeneratorConfig()
    letter, name, value, shift = _language_lists(config.language_seed, config.branching, config.num_keys)
    rng = np.random.default_rng(seed)
    coin = rng.random((n, 2)).tolist()  # (n, 2) layout coins per position
    choice = rng.integers(0, config.branching, n).tolist()  # (n,) free choices u
    keys = rng.integers(0, config.num_keys, n // 8 + 2).tolist()
    lengths = rng.integers(config.section_len // 2, config.section_len * 3 // 2 + 1, n // 8 + 2).tolist()

    x = [0] * n
    kind = [Kind.FORMAT] * n
    u_out = [0] * n
    key_of = [-1] * n
    src, dst, typ = [], [], []
    last_value: dict[tuple[int, int], int] = {}
    sp_, dot, nl = ord(" "), ord("."), ord("\n")
    lower = set(LETTERS)
    upper = set(NAME_LETTERS)
    section, key_pos, body, target = -1, -1, 0, 0
    t = 0
    while t < n:
        a, b = (x[t - 2], x[t - 1]) if t >= 2 else (0, 0)
        if t == 0 or (b == sp_ and a == dot and body >= target):  # open a section
            section += 1
            header = (b"" if t == 0 else b"\n") + b"### " + bytes([KEY_LETTERS[keys[section]]]) + b"\n\n"
            for offset, byte in enumerate(header):
                if t + offset < n:
                    x[t + offset] = byte
                    key_of[t + offset] = key_pos
            key_pos = t + len(header) - 3
            if key_pos < n:
                kind[key_pos] = Kind.KEY
            t += len(header)
            body, target = 0, lengths[section]
            continue
        c, u = coin[t], choice[t]
        key_of[t] = key_pos
        if b == dot:
            k, v = Kind.AFTER_STOP, sp_
        elif (a, b) in ((dot, sp_), (nl, nl)):
            k = Kind.ANCHORED
            v = LETTERS[(letter[a][b][u] + shift[x[key_pos] - KEY_LETTERS[0]]) % len(LETTERS)]
        elif b == sp_ and c[0] < config.mention_rate or b in upper and a == sp_:
            k, v = Kind.NAME, NAME_LETTERS[name[a][b][u]]
        elif b in upper:  # a and b are the entity's name letters
            prev = last_value.get((a, b))
            if prev is None:
                k, v = Kind.VALUE_NEW, LETTERS[value[a][b][u]]
            else:
                k, v = Kind.VALUE_COPY, x[prev]
                src.append(prev), dst.append(t), typ.append(2)
            last_value[(a, b)] = t
        elif b in lower and (a in upper or (a in lower and c[0] < config.word_end)):
            k, v = (Kind.STOP, dot) if c[1] < config.sentence_end else (Kind.SPACE, sp_)
        else:  # a word start or a word's next letter
            k, v = Kind.LETTER, LETTERS[letter[a][b][u]]
        x[t], kind[t], u_out[t] = v, k, u
        src += [t - 2, t - 1]
        dst += [t, t]
        typ += [0, 0]
        if k == Kind.ANCHORED:
            src.append(key_pos), dst.append(t), typ.append(1)
        body += 1
        t += 1

    order = np.lexsort((np.asarray(src), np.asarray(dst)))  # by dst, then src
    as_long = lambda values: torch.as_tensor(np.asarray(values, dtype=np.int64)[order])
    return SyntheticSequence(
        ids=torch.tensor(x, dtype=torch.long),
        kind=torch.tensor(kind, dtype=torch.uint8),
        choice=torch.tensor(u_out, dtype=torch.uint8),
        key_pos=torch.tensor(key_of, dtype=torch.long),
        src=as_long(src), dst=as_long(dst), dep_type=as_long(typ),
        config=config,
    )


# ---------------------------------------------------------------- relations

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


def graph_from_edges(data: HeteroData, edges: dict[EdgeType, Tensor], stream: bool = True) -> RelationGraph:
    """The relation graph of a site with the given typed edges (plus the token stream).

    Nodes get global ids in :data:`NODE_TYPES` order (tokens first); the read
    node of position t is output t.

    Args:
        data (HeteroData): the site (node counts).
        edges (dict): edge type -> (2, E) edge index in that type's node indices.
        stream (bool): add token t-1 -> token t, the selective scan (default: :obj:`True`).
    """
    offset, total = {}, 0
    for node_type in NODE_TYPES:
        offset[node_type] = total
        total += data[node_type].num_nodes
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
    """The relation graph of a learned topology: its kept candidate edges, the site's fixed edges
    (cover, ``token reads output``) and the token stream.

    Args:
        topology (dict): ``SheafStateLM.topology(data)``: edge type -> {"edge_index", "gate", "energy"}.
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


def _score(realised: np.ndarray, dep_type: np.ndarray, relations: int) -> dict:
    """Coverage (overall and per dependency type) and waste from realised flags."""
    used = int(realised.sum())
    out = {
        "coverage": used / max(realised.size, 1),
        "waste": 1.0 - used / relations if relations else 0.0,
        "relations": int(relations),
        "realised": used,
        "coverage_by_type": {},
    }
    for i, name in enumerate(DEP_TYPES):
        mask = dep_type == i
        out["coverage_by_type"][name] = float(realised[mask].mean()) if mask.any() else None
    return out


def score_graph(graph: RelationGraph, hops: int, src: np.ndarray, dst: np.ndarray,
                dep_type: np.ndarray | None = None) -> dict:
    """Coverage, waste, relations and edges of any relation graph against dependencies (src, dst).

    Returns:
        dict: ``coverage``, ``waste``, ``relations``, ``realised``,
        ``coverage_by_type`` (by :data:`DEP_TYPES`), ``edges``, ``edges_by_type``,
        ``relations_per_token`` and ``max_relations_per_token`` (over destinations j).
    """
    src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
    dep_type = np.zeros(src.size, dtype=np.int64) if dep_type is None else np.asarray(dep_type)
    relations, realised, per_dst = relation_stats(graph, hops, src, dst)
    out = _score(realised, dep_type, relations)
    out["edges"] = graph.num_edges
    out["edges_by_type"] = {k: v for k, v in graph.edges_by_type.items() if v}
    out["relations_per_token"] = relations / max(graph.num_tokens - 1, 1)
    out["max_relations_per_token"] = int(per_dst.max()) if per_dst.size else 0
    return out


def score_dense(seq: SyntheticSequence) -> dict:
    """Dense causal attention, analytically: every dependency realised, n(n-1)/2 relations."""
    n = seq.ids.numel()
    out = _score((seq.src < seq.dst).numpy(), seq.dep_type.numpy(), dense_relations(n))
    out["edges"] = dense_relations(n)
    return out


def score_window(seq: SyntheticSequence, window: int) -> dict:
    """A local window of ``window`` keys, analytically: dependencies with dst - src <= w."""
    n = seq.ids.numel()
    lag = (seq.dst - seq.src).numpy()
    out = _score((lag >= 1) & (lag <= window), seq.dep_type.numpy(), window_relations(n, window))
    out["edges"] = window_relations(n, window)
    return out


def score_site(seq: SyntheticSequence, data: HeteroData, hops: int, stream: bool = True) -> dict:
    """The sheaf site of ``seq`` (see :func:`site_graph`) scored against its G*."""
    return score_graph(site_graph(data, stream=stream), hops, seq.src.numpy(), seq.dst.numpy(),
                       seq.dep_type.numpy())


# ---------------------------------------------------------------- experiments

def matched_site_config() -> SiteConfig:
    """Only the patch types whose rules the generator's structure feeds (the rest stay empty or add noise)."""
    return SiteConfig(patch_types=("local", "sentence", "instruction", "memory", "retrieval"))


def run_table(n: int = 32768, seed: int = 0, hops: int = 3, window: int = 8,
              config: GeneratorConfig | None = None, site_config: SiteConfig | None = None,
              extra_sites: dict[str, SiteConfig] | None = None) -> dict:
    """The paper's table at one length: coverage, waste and edges per topology.

    Args:
        n (int): tokens (default: :obj:`32768`).
        seed (int): sequence seed (default: :obj:`0`).
        hops (int): H for the site's relations (default: :obj:`3`, one block).
        window (int): keys of the local window (default: :obj:`8`).
        config (GeneratorConfig, optional): generator densities.
        site_config (SiteConfig, optional): the site's rules (default: :obj:`SiteConfig()`).
        extra_sites (dict, optional): more site rows, name -> SiteConfig.

    Returns:
        dict with ``n``, ``deps`` (counts per type), ``topologies`` (name ->
        coverage, waste, relations, edges, ...) and ``seconds``.
    """
    start = time.perf_counter()
    seq = generate(n, seed, config)
    rows = {"dense": score_dense(seq), "local": score_window(seq, window)}
    sites = {"sheaf": site_config if site_config is not None else SiteConfig(), **(extra_sites or {})}
    for name, cfg in sites.items():
        rows[name] = score_site(seq, build_site(seq.ids, cfg), hops)
        rows[name]["site_config"] = {"patch_types": list(cfg.patch_types), "local_window": cfg.local_window}
    return {
        "n": n, "seed": seed, "hops": hops, "window": window,
        "generator": asdict(seq.config), "deps": seq.dep_counts(),
        "topologies": rows, "seconds": time.perf_counter() - start,
    }


def _slope(ns: list[int], values: list[float]) -> float | None:
    """Least-squares exponent a of values ~ n^a (log-log fit)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(ns, values) if y and y > 0]
    if len(pts) < 2:
        return None
    lx, ly = np.array(pts).T
    return float(np.polyfit(lx, ly, 1)[0])


def run_scaling(ns: tuple[int, ...] = tuple(2**k for k in range(10, 21)), seed: int = 0, hops: int = 3,
                window: int = 8, config: GeneratorConfig | None = None, site_config: SiteConfig | None = None,
                relations_up_to: int = 1 << 20) -> dict:
    """Edges against n per topology, and the site's relations and coverage.

    Dense and window edges are analytic; the site is built and counted at
    every n (its relations only up to ``relations_up_to``, the costly part).

    Returns:
        dict with ``ns`` and, per topology, a list per n of ``edges`` (plus
        ``relations``, ``coverage``, ``waste`` for the site), ``deps`` per n,
        and ``slope`` (fitted exponent of edges ~ n^a) per topology.
    """
    site_config = site_config if site_config is not None else SiteConfig()
    out = {"ns": list(ns), "seed": seed, "hops": hops, "window": window, "deps": [], "seconds": [],
           "dense": {"edges": []}, "local": {"edges": [], "coverage": []},
           "sheaf": {"edges": [], "relations": [], "coverage": [], "waste": []}}
    for n in ns:
        start = time.perf_counter()
        seq = generate(n, seed, config)
        out["deps"].append(int(seq.src.numel()))
        out["dense"]["edges"].append(dense_relations(n))
        window_row = score_window(seq, window)
        out["local"]["edges"].append(window_row["edges"])
        out["local"]["coverage"].append(window_row["coverage"])
        data = build_site(seq.ids, site_config)
        if n <= relations_up_to:
            row = score_site(seq, data, hops)
            out["sheaf"]["edges"].append(row["edges"])
            for key in ("relations", "coverage", "waste"):
                out["sheaf"][key].append(row[key])
        else:
            out["sheaf"]["edges"].append(site_graph(data).num_edges)
            for key in ("relations", "coverage", "waste"):
                out["sheaf"][key].append(None)
        out["seconds"].append(time.perf_counter() - start)
    for name in ("dense", "local", "sheaf"):
        out[name]["slope"] = _slope(out["ns"], out[name]["edges"])
    out["sheaf"]["relations_slope"] = _slope(out["ns"], out["sheaf"]["relations"])
    out["deps_slope"] = _slope(out["ns"], out["deps"])
    return out


def plot_scaling(result: dict, path) -> None:
    """Log-log plot of edges against n per topology (and the site's relations, G*), PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = result["ns"]
    fig, ax = plt.subplots(figsize=(6.4, 4.8), dpi=120)
    series = [
        ("dense attention", result["dense"]["edges"], "-", "tab:red"),
        (f"local window (w={result['window']})", result["local"]["edges"], "-", "tab:orange"),
        ("sheaf site: message edges", result["sheaf"]["edges"], "-", "tab:blue"),
        (f"sheaf site: relations (H={result['hops']})", result["sheaf"]["relations"], "--", "tab:blue"),
        ("true dependencies G*", result["deps"], ":", "black"),
    ]
    for label, values, style, color in series:
        pts = [(x, y) for x, y in zip(ns, values) if y]
        if pts:
            slope = _slope(*map(list, zip(*pts)))
            ax.loglog(*zip(*pts), style, marker="o", ms=3, color=color,
                      label=f"{label}  ($\\propto n^{{{slope:.2f}}}$)" if slope is not None else label)
    ax.set_xlabel("sequence length n (tokens)")
    ax.set_ylabel("edges / relations")
    ax.set_title("Relations against context length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_table(result: dict) -> str:
    """The table as text, beside the paper's figures."""
    paper = {"dense": ("100%", "99.98%", "536M"), "local": ("96.5%", "~75%", ""),
             "sheaf": ("100%", "32.5%", "100k")}
    lines = [f"n = {result['n']}, G* = {result['deps']['total']} dependencies "
             f"({', '.join(f'{k} {v}' for k, v in result['deps'].items() if k != 'total')}), "
             f"H = {result['hops']} hops, window = {result['window']}, {result['seconds']:.1f} s",
             f"{'topology':<16}{'coverage':>10}{'waste':>10}{'relations':>14}{'edges':>14}"
             f"   | {'paper: cov.':>14}{'waste':>8}{'edges':>7}"]
    for name, row in result["topologies"].items():
        p = paper.get(name, ("", "", ""))
        lines.append(f"{name:<16}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%"
                     f"{row['relations']:>14,}{row['edges']:>14,}   | {p[0]:>14}{p[1]:>8}{p[2]:>7}")
    return "\n".join(lines)


def hop_sweep(n: int, seed: int, hops: tuple[int, ...]) -> dict:
    """The default site's coverage, waste and relations at several hop counts H."""
    seq = generate(n, seed)
    data = build_site(seq.ids)
    out = {}
    for h in hops:
        row = score_site(seq, data, h)
        out[h] = {k: row[k] for k in ("coverage", "waste", "relations", "coverage_by_type")}
    return out


def main_simulate(argv: list[str] | None = None) -> int:
    """``sheafgnn simulate``: the table at n = 32,768 and the scaling run, JSON + PNG."""
    parser = ArgumentParser(prog="sheafgnn simulate", description="the paper's synthetic dependency simulation")
    parser.add_argument("--n", type=at_least(8), default=32768, help="tokens for the table (default: 32768)")
    parser.add_argument("--seed", type=at_least(0), default=0)
    parser.add_argument("--hops", type=at_least(1), default=3, help="hops H of the site's relations (default: 3)")
    parser.add_argument("--window", type=at_least(1), default=8, help="keys of the local window (default: 8)")
    parser.add_argument("--max-log2", type=at_least(10), default=20,
                        help="scaling run up to n = 2^this (default: 20)")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--learned", action="store_true",
                        help="instead: train SheafStateLM and score its learned topology (simulate_learned.json)")
    parser.add_argument("--steps", type=at_least(1), default=4500,
                        help="--learned: optimizer steps (default: 4500)")
    parser.add_argument("--n-train", type=at_least(8), default=1 << 19,
                        help="--learned: training tokens (default: 2^19)")
    parser.add_argument("--lr", type=float, default=5e-3, help="--learned: peak learning rate (default: 5e-3)")
    parser.add_argument("--train-window", type=at_least(2), default=1024,
                        help="--learned: tokens per window (default: 1024)")
    parser.add_argument("--gate-penalty", type=float, default=0.01, help="--learned: gate penalty (default: 0.01)")
    parser.add_argument("--max-seconds", type=float, default=None, help="--learned: stop training after this long")
    parser.add_argument("--threads", type=at_least(0), default=1,
                        help="--learned: torch threads (default: 1, the model is tiny; 0: torch's default)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.learned:
        return _main_learned(args, out)

    table = run_table(args.n, args.seed, args.hops, args.window,
                        extra_sites={"sheaf (matched)": matched_site_config()})
    table["hop_sweep"] = hop_sweep(args.n, args.seed, (1, 2, 3, 4))
    table["paper"] = {"dense": {"coverage": 1.0, "waste": 0.9998, "edges": 536_000_000},
                      "local": {"coverage": 0.965, "waste": 0.75},
                      "sheaf": {"coverage": 1.0, "waste": 0.325, "edges": 100_000}}
    print(format_table(table))
    print("\n'sheaf' is the default SiteConfig; 'sheaf (matched)' keeps only local, sentence, instruction,"
          "\nmemory and retrieval patches. Edges: attention pairs for dense/local, message edges for the site.")
    print(f"\nsite at H hops:  {'H':>3}{'coverage':>10}{'waste':>10}{'relations':>14}")
    for h, row in table["hop_sweep"].items():
        print(f"{'':17}{h:>3}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%{row['relations']:>14,}")
    (out / "simulate_table.json").write_text(json.dumps(table, indent=2))

    start = time.perf_counter()
    ns = tuple(2**k for k in range(10, args.max_log2 + 1))
    scaling = run_scaling(ns, args.seed, args.hops, args.window)
    scaling["total_seconds"] = time.perf_counter() - start
    (out / "simulate_scaling.json").write_text(json.dumps(scaling, indent=2))
    plot_scaling(scaling, out / "simulate_scaling.png")
    print(f"\nscaling, n = 2^10 .. 2^{args.max_log2} ({scaling['total_seconds']:.0f} s)")
    print(f"{'n':>9}{'G*':>11}{'dense':>17}{'local':>11}{'site edges':>12}{'site rel.':>12}{'site cov.':>10}")
    for i, n in enumerate(ns):
        rel = scaling["sheaf"]["relations"][i]
        cov = scaling["sheaf"]["coverage"][i]
        print(f"{n:>9}{scaling['deps'][i]:>11,}{scaling['dense']['edges'][i]:>17,}{scaling['local']['edges'][i]:>11,}"
              f"{scaling['sheaf']['edges'][i]:>12,}{rel if rel is not None else '-':>12,}"
              f"{100 * cov if cov is not None else float('nan'):>9.2f}%")
    slopes = {k: scaling[k]["slope"] for k in ("dense", "local", "sheaf")}
    print("fitted exponents (edges ~ n^a): " + ", ".join(f"{k} {v:.3f}" for k, v in slopes.items())
          + f", site relations {scaling['sheaf']['relations_slope']:.3f}")
    print(f"\nwrote {out / 'simulate_table.json'}, {out / 'simulate_scaling.json'}, {out / 'simulate_scaling.png'}")
    return 0


# ---------------------------------------------------------------- beyond the paper: a learned topology

LEARNED_THRESHOLDS = (0.5, 0.7, 0.9)  # gate thresholds reported by run_learned (besides top-k only)
LONG_RANGE_KINDS = (Kind.ANCHORED, Kind.VALUE_COPY)  # target kinds whose G* has a long-range source


def threshold_topology(topology: dict[EdgeType, dict[str, Tensor]],
                       threshold: float | None) -> dict[EdgeType, dict[str, Tensor]]:
    """Keep the kept edges whose gate exceeds ``threshold`` (``None``: the top-k topology as it is).

    Args:
        topology (dict): ``SheafStateLM.topology(data)``: edge type -> {"edge_index" (2, E),
            "gate" (E,), "energy" (E,)}.
        threshold (float, optional): strict lower bound on the gate.
    """
    if threshold is None:
        return topology
    out = {}
    for edge_type, entry in topology.items():
        mask = entry["gate"] > threshold  # (E,)
        out[edge_type] = {k: v[..., mask] for k, v in entry.items()}
    return out


def oracle_topology(seq: SyntheticSequence, data: HeteroData) -> dict[EdgeType, dict[str, Tensor]]:
    """A reference gating that reads the generator's labels: the best this site's candidates allow.

    Keeps ``instruction reads output`` into output t exactly when token t + 1 is
    anchored (it needs the section key), ``retrieval reads output`` exactly when
    token t + 1 copies an entity value, and every ``token recalls retrieval``
    edge (they reach an output only through a kept read); every other
    candidate is dropped. The fixed edges and the stream stay (see
    :func:`topology_graph`). Gates are 1.
    """
    n = seq.ids.numel()
    next_kind = torch.full((n,), -1, dtype=torch.long)
    next_kind[:-1] = seq.kind[1:].long()  # (n,) kind of the token that output t predicts
    wanted = {("instruction", "reads", "output"): Kind.ANCHORED, ("retrieval", "reads", "output"): Kind.VALUE_COPY}
    out = {}
    for edge_type in CANDIDATE_EDGES:
        ei = data[edge_type].edge_index if edge_type in data.edge_types else torch.zeros(2, 0, dtype=torch.long)
        if edge_type in wanted:
            ei = ei[:, next_kind[ei[1]] == wanted[edge_type]]
        elif edge_type != ("token", "recalls", "retrieval"):
            ei = ei[:, :0]
        out[edge_type] = {"edge_index": ei, "gate": torch.ones(ei.size(1))}
    return out


def learned_topology(model, data: HeteroData) -> dict[EdgeType, dict[str, Tensor]]:
    """The learned topology of every block, merged: an edge is kept if any block keeps it, with
    its largest gate (one block's topology when the model has one block).

    Every block glues along its own kept edges, so the model's relations are
    those of the union; ``SheafStateLM.topology(data, block=i)`` gives one block's.

    Returns:
        ``{edge_type: {"edge_index": (2, E), "gate": (E,)}}``, edges sorted by (dst, src).
    """
    per_block = [model.topology(data, block=i) for i in range(len(model.blocks))]
    out = {}
    for edge_type in per_block[0]:
        ei = torch.cat([top[edge_type]["edge_index"] for top in per_block], 1)  # (2, sum E_b)
        gate = torch.cat([top[edge_type]["gate"] for top in per_block])  # (sum E_b,)
        num_src = int(ei[0].max()) + 1 if ei.numel() else 1
        unique, inverse = torch.unique(ei[1] * num_src + ei[0], return_inverse=True)  # sorted by (dst, src)
        best = torch.full((unique.numel(),), -1.0, dtype=gate.dtype).scatter_reduce(0, inverse, gate, "amax")
        out[edge_type] = {"edge_index": torch.stack([unique % num_src, unique // num_src]), "gate": best}
    return out


def _window_site(ids: Tensor, start: int, window: int, site_config: SiteConfig) -> HeteroData:
    """The site of ``ids[start : start + window]`` with next-token targets ``y`` (window,)."""
    data = build_site(ids[start : start + window], site_config)
    data["token"].y = ids[start + 1 : start + window + 1].clone()
    return data


def _eval_site(seq: SyntheticSequence, site_config: SiteConfig) -> HeteroData:
    """The site of the whole sequence; ``y`` is the next token (-100 at the last position)."""
    data = build_site(seq.ids, site_config)
    y = torch.full_like(seq.ids, -100)
    y[:-1] = seq.ids[1:]
    data["token"].y = y
    return data


@torch.no_grad()
def next_token_loss(model, data: HeteroData, seq: SyntheticSequence) -> dict:
    """Next-token cross-entropy (nats) of ``model`` on ``data`` (eval mode), overall and by target kind."""
    import torch.nn.functional as F

    was_training = model.training
    model.eval()
    logits = model(data)  # (n, V)
    model.train(was_training)
    ce = F.cross_entropy(logits[:-1].float(), seq.ids[1:], reduction="none")  # (n - 1,)
    target_kind = seq.kind[1:].long()
    by_kind = {}
    for k, name in enumerate(Kind.NAMES):
        mask = target_kind == k
        if mask.any():
            by_kind[name] = float(ce[mask].mean())
    long_range = torch.isin(target_kind, torch.tensor(LONG_RANGE_KINDS))
    return {"loss": float(ce.mean()), "by_target_kind": by_kind,
            "long_range": float(ce[long_range].mean()) if long_range.any() else None}


def _auc(positive: np.ndarray, negative: np.ndarray) -> float | None:
    """P(a positive's gate > a negative's), ties counted half (the Mann-Whitney AUC)."""
    if positive.size == 0 or negative.size == 0:
        return None
    from scipy.stats import rankdata

    ranks = rankdata(np.concatenate([positive, negative]))
    return float((ranks[: positive.size].sum() - positive.size * (positive.size + 1) / 2)
                 / (positive.size * negative.size))


def gate_stats(topology: dict[EdgeType, dict[str, Tensor]], seq: SyntheticSequence, bins: int = 20) -> dict:
    """Per candidate edge type: kept edges, gate mean and histogram; for reads into outputs also
    the mean gate where the predicted token has a long-range source (anchored, entity copy) or not,
    and the AUC of the gate separating the two (0.5: no separation)."""
    n = seq.ids.numel()
    next_kind = np.full(n, -1)
    next_kind[:-1] = seq.kind[1:].numpy()
    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {}
    for (src_type, rel, dst_type), entry in topology.items():
        gate = entry["gate"].detach().float().cpu().numpy()
        if gate.size == 0:
            continue
        row = {"kept": int(gate.size), "mean": float(gate.mean()), "hist": np.histogram(gate, edges)[0].tolist()}
        if dst_type == "output":
            t = entry["edge_index"][1].cpu().numpy()
            long_range = np.isin(next_kind[t], LONG_RANGE_KINDS)
            row["mean_long_range"] = float(gate[long_range].mean()) if long_range.any() else None
            row["mean_other"] = float(gate[~long_range].mean()) if (~long_range).any() else None
            row["auc_long_range"] = _auc(gate[long_range], gate[~long_range])
        out[f"{src_type}__{rel}__{dst_type}"] = row
    return {"bin_edges": edges.tolist(), "types": out}


def _score_topology(topology: dict, data: HeteroData, seq: SyntheticSequence, hops: int) -> dict:
    """Coverage, waste, relations and edges of a (thresholded) topology against G*."""
    graph = topology_graph(topology, data)
    row = score_graph(graph, hops, seq.src.numpy(), seq.dst.numpy(), seq.dep_type.numpy())
    row["candidate_edges"] = int(sum(entry["edge_index"].size(1) for entry in topology.values()))
    return row


def _threshold_rows(topology: dict, data: HeteroData, seq: SyntheticSequence, hops: int,
                    thresholds: tuple[float, ...]) -> dict:
    """Score the top-k topology and its thresholded versions: name ('top-k', 'gate>0.5', ...) -> row."""
    rows = {"top-k": _score_topology(topology, data, seq, hops)}
    for thr in thresholds:
        rows[f"gate>{thr:g}"] = _score_topology(threshold_topology(topology, thr), data, seq, hops)
    return rows


def waste_floor(fixed: dict, deps: int, coverage: float) -> float:
    """The least waste of any topology that contains ``fixed``'s relations and reaches ``coverage``.

    Gating only removes candidate edges, so every learned topology keeps the
    relations of the fixed edges (``fixed``: a scored row with ``relations``
    and ``realised``). Reaching ``coverage`` of ``deps`` dependencies needs
    ``ceil(coverage * deps) - realised`` more realised pairs, each at least one
    more relation; the best case adds nothing else.
    """
    need = max(0, math.ceil(coverage * deps - 1e-9) - fixed["realised"])
    return 1.0 - (fixed["realised"] + need) / (fixed["relations"] + need)


def learned_model_config(d_model: int = 32, n_layers: int = 2, topology_k: int = 1, gate_penalty: float = 0.01,
                         site_config: SiteConfig | None = None):
    """A small :class:`~sheafgnn.model.SheafStateConfig` for the learned-topology run."""
    from sheafgnn.model import SheafStateConfig

    site_config = site_config if site_config is not None else matched_site_config()
    return SheafStateConfig(d_model=d_model, n_layers=n_layers, stalk_dim=4, d_state=16, headdim=16,
                            topology_k=topology_k, gate_penalty=gate_penalty, site=site_config.to_dict())


def train_learned(model, sequences: Tensor | list[Tensor], site_config: SiteConfig, steps: int, window: int = 1024,
                  batch: int = 1,
                  lr: float = 3e-3, gate_penalty: float = 0.1, penalty_ramp: float = 0.5, seed: int = 0,
                  max_seconds: float | None = None, log_every: int = 50, verbose: bool = False) -> dict:
    """Next-token training of ``model`` on random windows of ``sequences`` with AdamW (the run_learned loop).

    Each window is drawn from a random sequence (1-D token ids, at least
    ``window + 1`` tokens each) at a random offset.

    5% linear warm-up, cosine decay to lr / 10, gradient clipping at 1; the
    gate penalty ramps from 0 to ``gate_penalty`` over ``penalty_ramp`` of the
    steps (it is left at ``gate_penalty``). Leaves the model in eval mode.

    Returns:
        dict: ``steps`` done, ``steps_requested``, ``seconds``, ``tokens`` and the loss ``curve``
        (mean training loss, penalties included, per ``log_every`` steps).
    """
    from torch_geometric.data import Batch

    sequences = [sequences] if isinstance(sequences, Tensor) else list(sequences)
    lengths = [ids.numel() for ids in sequences]
    if not sequences or min(lengths) < window + 1:
        raise ValueError(f"train_learned: every sequence needs more than window = {window} tokens "
                         f"(got lengths {sorted(set(lengths))[:5]})")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)
    schedule = lambda s: (s + 1) / warmup if s < warmup else 0.1 + 0.45 * (1 + math.cos(
        math.pi * (s - warmup) / max(1, steps - warmup)))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    rng = torch.Generator().manual_seed(seed)
    curve, running, done = [], [], 0
    start = time.perf_counter()
    model.train()
    for step in range(steps):
        picks = torch.randint(0, len(sequences), (batch,), generator=rng).tolist()
        offsets = [int(torch.randint(0, lengths[i] - window, (1,), generator=rng)) for i in picks]
        sites = [_window_site(sequences[i], o, window, site_config) for i, o in zip(picks, offsets)]
        model.config.gate_penalty = gate_penalty * min(1.0, step / max(1.0, penalty_ramp * steps))
        loss = model.loss(sites[0] if batch == 1 else Batch.from_data_list(sites))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        running.append(float(loss.detach()))
        done = step + 1
        if done % log_every == 0 or done == steps:
            curve.append({"step": done, "loss": float(np.mean(running)), "seconds": time.perf_counter() - start})
            running = []
            if verbose:
                print(f"step {done:5d}  train loss {curve[-1]['loss']:.4f}  {curve[-1]['seconds']:.0f} s", flush=True)
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
    model.config.gate_penalty = gate_penalty
    model.eval()
    return {"steps": done, "steps_requested": steps, "seconds": time.perf_counter() - start,
            "tokens": done * batch * window, "curve": curve}


def run_learned(n_train: int = 1 << 19, n_eval: int = 32768, steps: int = 4500, seed: int = 0,
                window: int = 1024, batch: int = 1, lr: float = 5e-3, d_model: int = 32, n_layers: int = 2,
                topology_k: int = 1, gate_penalty: float = 0.01, penalty_ramp: float = 0.5, hops: int = 3,
                thresholds: tuple[float, ...] = LEARNED_THRESHOLDS,
                growth_ns: tuple[int, ...] = tuple(2**k for k in range(12, 17)),
                sweep: tuple[float, ...] = tuple(np.round(np.arange(0.0, 1.0, 0.05), 2)),
                max_seconds: float | None = None, config: GeneratorConfig | None = None,
                site_config: SiteConfig | None = None, log_every: int = 50, verbose: bool = False) -> dict:
    """Train a :class:`~sheafgnn.model.SheafStateLM` on synthetic sequences; score its learned topology.

    The model reads the site that the simulation uses (default:
    :func:`matched_site_config`) and learns, per candidate edge, a gate and a
    top-k choice (:class:`~sheafgnn.nn.topology.TopologyScorer`). After
    next-token training with AdamW (:func:`train_learned`) on independent
    training sequences, the topology of every block, merged
    (:func:`learned_topology`), on an evaluation sequence (seed ``seed``, the
    one :func:`run_table` scores) is thresholded and scored against G* with
    the definitions and hops of the designed site: a kept edge is one
    relation-graph edge, the site's fixed edges (cover, ``token reads
    output``) and the token stream stay (:func:`topology_graph`).

    Args:
        n_train (int): training tokens: ``n_train // (window + 1)`` independent sequences of
            ``window + 1`` tokens, seeds apart from the evaluation's (default: :obj:`2**19`).
            Independent sequences matter: an entity's value is drawn once per sequence, so
            windows of one long sequence would let a model memorise values instead of copying.
        n_eval (int): tokens of the evaluation sequence (default: :obj:`32768`).
        steps (int): optimizer steps (default: :obj:`4500`, about 8 minutes on one CPU thread).
        seed (int): evaluation sequence, model init and window order (default: :obj:`0`).
        window (int): tokens per training window (default: :obj:`1024`).
        batch (int): windows per step (default: :obj:`1`).
        lr (float): peak AdamW learning rate; 5% warm-up, cosine to lr / 10 (default: :obj:`5e-3`).
        d_model, n_layers, topology_k, gate_penalty: the model (:func:`learned_model_config`).
        penalty_ramp (float): the gate penalty grows linearly from 0 to ``gate_penalty`` over this
            share of the steps, so that edges become useful before they are pruned (default: :obj:`0.5`).
        hops (int): H of the relations (default: :obj:`3`, one block).
        thresholds (tuple): gate thresholds reported in full (default: :data:`LEARNED_THRESHOLDS`).
        growth_ns (tuple): lengths at which the learned topology's edges are counted.
        sweep (tuple): thresholds of the coverage-waste curve.
        max_seconds (float, optional): stop training after this long (the steps done are reported).
        config (GeneratorConfig, optional): generator densities.
        site_config (SiteConfig, optional): the site's rules (default: :func:`matched_site_config`).
        log_every (int): steps per training-loss record (default: :obj:`50`).
        verbose (bool): print progress.

    Returns:
        dict with ``model_config``, ``train`` (steps, seconds, loss curve),
        ``loss_before`` / ``loss_after`` (eval next-token loss, overall and by
        target kind), ``designed`` (the site's row), ``untrained`` and
        ``learned`` (threshold name -> coverage, waste, relations, edges, ...),
        ``references`` (``fixed_only``: no candidate edges; ``oracle``:
        :func:`oracle_topology`), ``sweep``, ``gates`` (:func:`gate_stats`),
        ``growth`` (edges per n and fitted slopes) and ``seconds``.
    """
    from sheafgnn.model import SheafStateLM

    if window < 16 or n_train < window + 1:
        raise ValueError(f"run_learned: need window >= 16 and n_train > window (got {window} and {n_train})")
    start_all = time.perf_counter()
    site_config = site_config if site_config is not None else matched_site_config()
    torch.manual_seed(seed)
    model_config = learned_model_config(d_model, n_layers, topology_k, gate_penalty, site_config)
    model = SheafStateLM(model_config)
    train_ids = [generate(window + 1, 1_000_003 * (seed + 1) + i, config).ids
                 for i in range(max(1, n_train // (window + 1)))]
    seq = generate(n_eval, seed, config)
    data = _eval_site(seq, site_config)
    log = lambda msg: print(msg, flush=True) if verbose else None

    loss_before = next_token_loss(model, data, seq)
    untrained_topology = learned_topology(model, data)
    untrained = _threshold_rows(untrained_topology, data, seq, hops, thresholds)
    log(f"eval loss before: {loss_before['loss']:.4f}")

    # ---- train: random windows of the training sequence
    train = train_learned(model, train_ids, site_config, steps=steps, window=window, batch=batch, lr=lr,
                          gate_penalty=gate_penalty, penalty_ramp=penalty_ramp, seed=seed, max_seconds=max_seconds,
                          log_every=log_every, verbose=verbose)
    model.eval()

    # ---- read out and score the learned topology
    loss_after = next_token_loss(model, data, seq)
    log(f"eval loss after: {loss_after['loss']:.4f}")
    topology = learned_topology(model, data)
    learned = _threshold_rows(topology, data, seq, hops, thresholds)
    designed = score_site(seq, data, hops)
    designed["candidate_edges"] = int(sum(data[e].edge_index.size(1) for e in CANDIDATE_EDGES if e in data.edge_types))
    references = {"fixed_only": _score_topology({e: {"edge_index": torch.zeros(2, 0, dtype=torch.long)}
                                                 for e in CANDIDATE_EDGES}, data, seq, hops),
                  "oracle": _score_topology(oracle_topology(seq, data), data, seq, hops)}
    sweep_rows = []
    for thr in sweep:
        row = _score_topology(threshold_topology(topology, float(thr)), data, seq, hops)
        sweep_rows.append({"threshold": float(thr), **{k: row[k] for k in ("coverage", "waste", "relations",
                                                                           "edges", "candidate_edges")}})

    # ---- edges against n
    names = ["top-k"] + [f"gate>{thr:g}" for thr in thresholds]
    growth = {"ns": list(growth_ns), "designed": {"edges": [], "relations": []},
              **{name: {"edges": [], "candidate_edges": [], "relations": [], "coverage": [], "waste": []}
                 for name in names}}
    for n in growth_ns:
        seq_n = generate(n, seed, config)
        data_n = build_site(seq_n.ids, site_config)
        top_n = learned_topology(model, data_n)
        designed_n = score_site(seq_n, data_n, hops)
        growth["designed"]["edges"].append(designed_n["edges"])
        growth["designed"]["relations"].append(designed_n["relations"])
        for name, thr in zip(names, (None, *thresholds)):
            row = _score_topology(threshold_topology(top_n, thr), data_n, seq_n, hops)
            for key in ("edges", "candidate_edges", "relations", "coverage", "waste"):
                growth[name][key].append(row[key])
        log(f"growth n = {n}: top-k edges {growth['top-k']['edges'][-1]:,}")
    for name in ["designed", *names]:
        for key in ("edges", "candidate_edges", "relations"):
            if key in growth[name]:
                growth[name][f"{key}_slope"] = _slope(growth["ns"], growth[name][key])

    return {
        "n_train": n_train, "n_eval": n_eval, "seed": seed, "hops": hops, "window": window, "batch": batch,
        "lr": lr, "generator": asdict(seq.config), "site_config": site_config.to_dict(),
        "model_config": model_config.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()), "deps": seq.dep_counts(),
        "train": train,
        "loss_before": loss_before, "loss_after": loss_after,
        "designed": designed, "untrained": untrained, "learned": learned, "references": references,
        "sweep": sweep_rows, "gates": gate_stats(topology, seq), "gates_untrained": gate_stats(untrained_topology, seq),
        "growth": growth, "targets": {"coverage": 0.99, "waste": 0.325},
        "waste_floor_at_target_coverage": waste_floor(references["fixed_only"], int(seq.src.numel()), 0.99),
        "seconds": time.perf_counter() - start_all,
    }


def plot_learned(result: dict, path) -> None:
    """Three panels, PNG: gate histograms by candidate edge type; coverage and waste against the
    gate threshold (designed site, oracle and targets marked); edges against n (log-log)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8), dpi=110)
    ax = axes[0]
    bins = np.asarray(result["gates"]["bin_edges"])
    centres = (bins[1:] + bins[:-1]) / 2
    for i, (name, row) in enumerate(sorted(result["gates"]["types"].items())):
        hist = np.asarray(row["hist"], dtype=float)
        ax.step(centres, np.maximum(hist / max(hist.sum(), 1), 1e-6), where="mid",
                color=plt.get_cmap("tab20")(i % 20), label=f"{name} ({row['kept']:,})")
    ax.set_yscale("log")
    ax.set_ylim(1e-5, 1.5)
    ax.set_xlabel("gate")
    ax.set_ylabel("share of kept edges")
    ax.set_title(f"gates after {result['train']['steps']} steps (n = {result['n_eval']:,})")
    ax.legend(fontsize=6)

    ax = axes[1]
    thr = [row["threshold"] for row in result["sweep"]]
    ax.plot(thr, [row["coverage"] for row in result["sweep"]], "-o", ms=3, color="tab:blue", label="learned coverage")
    ax.plot(thr, [row["waste"] for row in result["sweep"]], "-o", ms=3, color="tab:red", label="learned waste")
    for name, style in (("designed", ":"), ("oracle", "--")):
        row = result["designed"] if name == "designed" else result["references"][name]
        ax.axhline(row["coverage"], ls=style, color="tab:blue", lw=1, label=f"{name} coverage {row['coverage']:.3f}")
        ax.axhline(row["waste"], ls=style, color="tab:red", lw=1, label=f"{name} waste {row['waste']:.3f}")
    floor = result["references"]["fixed_only"]
    ax.axhline(floor["waste"], ls="-.", color="grey", lw=1,
               label=f"no candidate edges: cov. {floor['coverage']:.3f}, waste {floor['waste']:.3f}")
    ax.axhspan(result["targets"]["coverage"], 1.0, color="tab:blue", alpha=0.08, label="target coverage >= 99%")
    ax.axhspan(0.0, result["targets"]["waste"], color="tab:red", alpha=0.08, label="target waste <= 32.5%")
    ax.set_xlabel("gate threshold (edge kept if gate > threshold)")
    ax.set_ylabel("coverage / waste")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"learned topology against G* (H = {result['hops']})")
    ax.legend(fontsize=6, loc="center left")

    ax = axes[2]
    growth = result["growth"]
    names = [k for k in growth if k not in ("ns", "designed")]
    for i, name in enumerate(["designed", *names]):
        slope = growth[name].get("edges_slope")
        ax.loglog(growth["ns"], growth[name]["edges"], "-o", ms=3, color=plt.get_cmap("tab10")(i),
                  label=f"{name} edges ($\\propto n^{{{slope:.2f}}}$)" if slope is not None else name)
        if name != "designed":
            cand = [max(v, 1) for v in growth[name]["candidate_edges"]]
            ax.loglog(growth["ns"], cand, ":", color=plt.get_cmap("tab10")(i), lw=1)
    ax.set_xlabel("sequence length n")
    ax.set_ylabel("relation-graph edges (dotted: kept candidates)")
    ax.set_title("learned topology: edges against n")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def format_learned(result: dict) -> str:
    """The learned topology beside the designed site, as text."""
    before, after = result["loss_before"], result["loss_after"]
    train = result["train"]
    lines = [f"learned topology: n_eval = {result['n_eval']:,}, G* = {result['deps']['total']:,}, "
             f"H = {result['hops']}, "
             f"{result['parameters']:,} parameters, {train['steps']} steps x {result['batch']} x {result['window']} "
             f"tokens ({train['seconds']:.0f} s)",
             f"eval next-token loss (nats): {before['loss']:.3f} before -> {after['loss']:.3f} after; "
             f"long-range targets {before['long_range']:.3f} -> {after['long_range']:.3f} "
             f"(anchored {after['by_target_kind'].get('anchored', float('nan')):.3f}, "
             f"entity copy {after['by_target_kind'].get('value_copy', float('nan')):.3f})",
             f"{'topology':<22}{'coverage':>10}{'waste':>10}{'relations':>12}{'edges':>11}{'candidates':>12}"
             f"{'anchor cov.':>13}{'entity cov.':>13}"]
    rows = [("designed site", result["designed"])]
    rows += [(f"untrained {k}", v) for k, v in result["untrained"].items() if k == "top-k"]
    rows += [(f"learned {k}", v) for k, v in result["learned"].items()]
    rows += [(f"ref: {k}", v) for k, v in result["references"].items()]
    for name, row in rows:
        by = row["coverage_by_type"]
        fmt = lambda v: f"{100 * v:.1f}%" if v is not None else "-"
        lines.append(f"{name:<22}{100 * row['coverage']:>9.2f}%{100 * row['waste']:>9.2f}%{row['relations']:>12,}"
                     f"{row['edges']:>11,}{row.get('candidate_edges', 0):>12,}{fmt(by['anchor']):>13}"
                     f"{fmt(by['entity']):>13}")
    if "waste_floor_at_target_coverage" in result:
        lines.append(f"least waste of any gating of this site at {100 * result['targets']['coverage']:.0f}% coverage: "
                     f"{100 * result['waste_floor_at_target_coverage']:.2f}% (its fixed edges and stream stay)")
    lines.append("threshold sweep (gate > thr): " + "  ".join(
        f"{r['threshold']:g}: {100 * r['coverage']:.1f}%/{100 * r['waste']:.1f}%" for r in result["sweep"])
        + "  (coverage/waste)")
    gates = result["gates"]["types"]
    separation = [f"{k.replace('__reads__output', '')} {v['mean_long_range']:.2f}/{v['mean_other']:.2f} "
                  f"(AUC {v['auc_long_range']:.2f})" for k, v in gates.items()
                  if v.get("auc_long_range") is not None]
    lines.append("reads -> output, mean gate at long-range / other targets: " + ", ".join(separation))
    growth = result["growth"]
    fmt_slope = lambda v: f"{v:.3f}" if v is not None else "-"
    slopes = ", ".join(f"{k} {fmt_slope(growth[k]['edges_slope'])}" for k in growth if k != "ns")
    lines.append(f"edges ~ n^a over n = {growth['ns'][0]:,} .. {growth['ns'][-1]:,}: {slopes}")
    return "\n".join(lines)


def _main_learned(args: argparse.Namespace, out: Path) -> int:
    """``sheafgnn simulate --learned``: :func:`run_learned`, printed, JSON + PNG in ``out``."""
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    result = run_learned(n_train=args.n_train, n_eval=args.n, steps=args.steps, seed=args.seed, hops=args.hops,
                         window=args.train_window, lr=args.lr, gate_penalty=args.gate_penalty,
                         max_seconds=args.max_seconds,
                         verbose=True)
    print(format_learned(result))
    (out / "simulate_learned.json").write_text(json.dumps(result, indent=2))
    plot_learned(result, out / "simulate_learned.png")
    print(f"\nwrote {out / 'simulate_learned.json'}, {out / 'simulate_learned.png'} ({result['seconds']:.0f} s)")
    return 0
