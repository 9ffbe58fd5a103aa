r"""Streaming inference for :class:`~sheafgnn.model.SheafStateLM`: constant work per new token.

The site is causal by construction, so it grows by deltas
(:class:`~sheafgnn.site.stream.SiteStream`): feeding tokens yields the new
nodes (time in the new positions) and the edges into them, with the same ids
as :func:`~sheafgnn.site.build_site` gives for the whole prefix. A block only
ever reads states of nodes with ``time <= time[v]``, so the new nodes' states
follow from the cached states of old ones::

    feed(ids) per stream --SiteStream.push--> deltas --StreamDelta--> one flat batch of new nodes
    per block l (SheafBlock.step):
      Phi token chain      continues each stream's SSM state          (SelectiveSSM, state=...)
      pool                 reads the cached token states of each new patch's span
      Phi patch chains     continue each (stream, chained type)'s SSM state
      choose               new destinations' pools from the cached keys: rule edges of the delta,
                           content blocks (cached block summaries), own block, random tokens
      G gluing             SheafConv on (cached states, new nodes): the new nodes read their sources in place
      E, broadcast         node-wise
    R                      logits of the new outputs

**What is cached, per block:** the pre-gluing state and key of every node
but the outputs (any of them can be a later source: random proposals reach
any past token), the summary key of every complete content block, and the
SSM state of the token chain and of every patch chain. Memory is
O(nodes x (D + r)) per block, like a Transformer's KV cache. Shared by the
blocks and streams, on the host: the cache row of every node by (site id, type, stream),
and the position proposals of every position so far (both O(n) integers).

**Cost per new token:** the site delta, O(1) SSM steps, the new nodes'
projections and pools (O(k) sources), and the content-block scores: one
rank-r dot product per complete block before the token (O(n / B)), the
only term that grows with the context (as the design states).

**Launches, not arithmetic.** A batch-1 step computes a few rows per block, so each PyTorch op costs its
launch (a few microseconds on a CPU) far more than its work. Without gradients on the CPU, the step's
compute runs in the C++ kernels of :mod:`sheafgnn.nn.cpu_kernels` (``ssm_step``, ``feed_forward``,
``glue_diag``, ``stream_keys`` for :func:`new_queries_and_keys` and ``stream_pools`` for :func:`compete_outputs`),
each one call where PyTorch dispatched 10-40 ops; each is tested against its PyTorch reference. The delta's
index bookkeeping (:meth:`SheafStream._delta`) runs in NumPy on the host tables, and a NumPy op on a few
integers costs a tenth of a PyTorch op. (On a GPU the delta's arrays, the (positions, B) table of token rows
included, are copied to the device at every step: the step is built for the CPU.)

Streamed logits equal the full forward's
(``model(build_site(all ids so far))``) up to float rounding: the chunked
scan and the step order sums differently. The random-score ablation is not
streamable (its noise is drawn per forward pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from sheafgnn.generation import TokenStream
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.pools import pool_dot
from sheafgnn.nn.proposals import best_blocks, summarize_blocks, summary_query, summary_width, top_blocks
from sheafgnn.nn.ssm import SSMState
from sheafgnn.nn.topology import LearnedTopology
from sheafgnn.site.flat import FLAT_TYPES, FlatBlocks
from sheafgnn.site.schema import CANDIDATE_EDGES, CHAINED_TYPES, COVER_EDGES
from sheafgnn.site.stream import SiteDelta, SiteStream

_OUTPUT = FLAT_TYPES.index("output")
_TYPE_INDEX = {t: i for i, t in enumerate(FLAT_TYPES)}
# edge type -> its index in COVER_EDGES / CANDIDATE_EDGES (a delta holds a few of the ~30 types: look them up)
_COVER_INDEX = {e: i for i, e in enumerate(COVER_EDGES)}
_CANDIDATE_INDEX = {e: i for i, e in enumerate(CANDIDATE_EDGES)}


class RowBuffer:
    """Rows of a tensor that grows geometrically: appends cost O(rows appended), amortised.

    Args:
        shape (tuple): the shape of one row (``()`` for scalars).
        dtype (torch.dtype): element type.
        device (torch.device, optional): where the rows live.
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device=None) -> None:
        self._storage = torch.empty((16, *shape), dtype=dtype, device=device)
        self.size = 0
        self._data = self._storage[:0]  # the view, made once per extend: a step reads it ~10 times

    @property
    def data(self) -> Tensor:
        """The rows so far, a view: (size, *shape)."""
        return self._data

    def extend(self, n: int) -> int:
        """Allocate ``n`` rows (contents undefined until written); returns the first of them."""
        if self.size + n > self._storage.size(0):
            capacity = max(2 * self._storage.size(0), self.size + n)
            storage = self._storage.new_empty((capacity, *self._storage.shape[1:]))
            storage[: self.size] = self.data
            self._storage = storage
        self.size += n
        self._data = self._storage[: self.size]
        return self.size - n

    def grow_to(self, n: int) -> None:
        """At least ``n`` rows (new rows undefined until written)."""
        if n > self.size:
            self.extend(n - self.size)

    def write(self, first: int, values: Tensor) -> None:
        """Rows ``first, ..., first + len(values) - 1`` (allocated) := ``values``."""
        self._storage[first : first + values.size(0)] = values


@dataclass
class LayerCache:
    """What one block keeps for a batch of streams."""

    state: RowBuffer  # (rows, D) pre-gluing state of every non-output node of every stream
    key: RowBuffer  # (rows, r) its topology key
    block_token_key: RowBuffer  # (rows, r) a token's key of the block scorer, if any (undefined at other rows)
    block_key: RowBuffer  # (blocks, B, r or 2r) content-block summary of each stream's complete blocks
    token_ssm: SSMState  # (B, ...) the token chain's SSM state of every stream (zero: not started)
    chain_ssm: SSMState | None  # (len(CHAINED_TYPES) * B, ...) per chained type and stream: row type * B + stream


@dataclass
class StreamDelta(FlatBlocks):
    """The new nodes of a batch of streams, flat: node types in FLAT_TYPES order, each
    type's block holding stream 0's new nodes, then stream 1's, ... (like a PyG batch).

    Node "rows" index the caches (:class:`LayerCache`); every block appends the
    new non-output nodes (``type_ptr[-2]`` of them) in this order, so a node has the same row in every block.
    """

    type_ptr: list[int]  # (num_types + 1,) block offsets of the new nodes
    node_type: Tensor  # (N,)
    token_ids: Tensor  # (T,) ids of the new tokens
    attributes: dict[str, Tensor]  # per patch type with a node attribute (topic ids, registers): its new nodes'
    first_row: int  # cache row of the first new node: the new non-output nodes have rows first_row + i, in order
    token_streams: list[int]  # streams with new tokens, in order
    token_stream: Tensor  # (T,) stream of each new token (and output)
    token_reset: Tensor  # (T,) True at each stream's first new token
    token_block: Tensor  # (T,) content block of each new token's (and output's) position in its stream
    # (position // proposal_block): the blocks before it are complete
    previous_row: Tensor  # (T,) cache row of the token before each new token (any row at position 0)
    no_previous: Tensor  # (T, 1) True at position 0 (no token before)
    cover_src: Tensor  # (C,) cache row of the token of each cover edge into a new patch
    cover_ptr: Tensor  # (num_new_patches + 1,)
    chain_rows: list[int]  # row in LayerCache.chain_ssm of every new patch chain, in order
    chain_reset: Tensor  # (num_new_chained,)
    patch_rules: tuple[Tensor, Tensor, Tensor]  # (E,) each: rule candidates into new patches (source cache row,
    # destination delta index, sorted; index into CANDIDATE_EDGES)
    output_pool: tuple[Tensor, Tensor]  # (M, P1 + W) each: the candidates of every new output that no block's
    # choice changes (cache rows, -1: none; edge types): its position proposals, then its rule pool
    new_blocks: list[tuple[int, int, Tensor]]  # per stream: (stream, first new block, (blocks, B) token rows)
    token_rows: Tensor  # (positions, B) cache row of each stream's token at each position so far


class SheafStream(TokenStream):
    r"""A batch of independent streams of a :class:`~sheafgnn.model.SheafStateLM`.

    ``feed(ids)`` returns the logits of the fed positions, equal to the full
    forward's at those positions; ``generate(n)`` samples from it. See the
    module docstring for what is cached and what a token costs. Created by
    :meth:`SheafStateLM.stream <sheafgnn.model.SheafStateLM.stream>`.

    Args:
        model (SheafStateLM): the model (its weights are read, not copied).
        batch_size (int, optional): independent streams. (default: :obj:`1`)
        tokenizer (optional): maps ids to bytes for the site rules (default: byte tokenizer).
    """

    def __init__(self, model, batch_size: int = 1, tokenizer=None) -> None:
        super().__init__(batch_size, model.config.vocab_size)
        if model.config.gluing and any(block.topology.random_scores for block in model.blocks):
            raise ValueError("SheafStream: the random-score ablation is not streamable (its noise is drawn "
                             "per forward pass); switch random_scores off")
        self.model = model
        device = model.token_embedding.weight.device
        self.device = device
        self.sites = [SiteStream(model.config.site_config, tokenizer=tokenizer) for _ in range(batch_size)]
        if self.sites[0].tokenizer.vocab_size < self.vocab_size:  # the sites read every id the model may emit
            raise ValueError(f"SheafStream: the tokenizer knows {self.sites[0].tokenizer.vocab_size} ids, fewer "
                             f"than the model's vocabulary of {self.vocab_size}")
        # One table (ids so far, node types but the outputs (never sources), B) of the cache row of each
        # stream's node of each type by its id in the full site, so that the edges of every type and stream
        # read their sources with one gather, and a batch of proposals its tokens with one. Its rows run to
        # the largest id of any type (the tokens'): 9 longs per token and stream, ~2% of the caches. On the
        # host, like the site deltas it indexes (read through NumPy by _delta).
        self.node_rows = RowBuffer((_OUTPUT, batch_size), torch.long)
        self.num_blocks = [0] * batch_size  # complete content blocks per stream (the same in every cache)
        if model.config.gluing:
            # The position proposals of every position so far (a pure function of the position, the same for
            # every stream and block), grown geometrically: a generation step reads its row instead of ~30 ops.
            near, types = model.blocks[0].topology.position_proposals(torch.zeros(1, dtype=torch.long),
                                                                      torch.zeros(1, dtype=torch.long))
            self.position_table = RowBuffer(near.shape[1:], torch.long)  # (positions, P1), -1: none; host
            self.position_types = types[0].numpy()  # (P1,) their edge types, the same at every position
        self.num_rows = 0
        D, dtype = model.config.d_model, model.token_embedding.weight.dtype
        rank = model.config.topology_rank
        summary = summary_width(rank, model.config.block_summary)
        self.caches = [LayerCache(RowBuffer((D,), dtype, device), RowBuffer((rank,), dtype, device),
                                  RowBuffer((rank,), dtype, device), RowBuffer((batch_size, summary), dtype, device),
                                  block.phi_token.init_state(batch_size, device, dtype),
                                  block.phi_patch.init_state(len(CHAINED_TYPES) * batch_size, device, dtype)
                                  if block.gluing else None)
                       for block in model.blocks]

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        if not any(x.numel() for x in ids):
            return [self.model.token_embedding.weight.new_zeros(0, self.vocab_size) for _ in ids]
        if not self.model.config.gluing:
            return self._feed_tokens_only(ids)
        # TokenStream validated the ids (or sampled them): the sites need not check them again
        deltas = [site.push_delta(x if x.device.type == "cpu" else x.cpu(), validate=False) if x.numel() else None
                  for site, x in zip(self.sites, ids)]
        delta = self._delta(deltas)
        model = self.model
        h = model.embed(delta.token_ids.to(self.device), delta.node_type, delta.type_ptr,
                        {p: ids.to(self.device) for p, ids in delta.attributes.items()})  # (N, D)
        for block, cache in zip(model.blocks, self.caches):
            h = block.step(h, delta, cache)
        logits = model.readout(h[model.read_rows(delta)])  # (T, V)
        return list(logits.split([x.numel() for x in ids]))

    def _feed_tokens_only(self, ids: list[Tensor]) -> list[Tensor]:
        """The ssm ablation (gluing off): the token chain only."""
        lengths = [x.numel() for x in ids]
        streams = [b for b, n in enumerate(lengths) if n]
        token_ids = torch.cat(ids).to(self.device)
        reset = torch.zeros(token_ids.numel(), dtype=torch.bool, device=self.device)
        reset[[sum(lengths[:b]) for b in streams]] = True  # each stream's first new token
        delta = _TokensOnly(token_ids, reset, streams)
        h = self.model.embed(token_ids, None, None, None)
        for block, cache in zip(self.model.blocks, self.caches):
            h = block.step(h, delta, cache)
        return list(self.model.readout(h).split([x.numel() for x in ids]))

    # ------------------------------------------------------------------ #
    # the flat delta of a batch
    # ------------------------------------------------------------------ #
    def _delta(self, deltas: list[SiteDelta | None]) -> StreamDelta:
        # Index bookkeeping in NumPy on the host tables: a NumPy op on a few integers costs ~0.1-0.7 us where a
        # PyTorch op costs 2-6 us (a generation step's delta is ~20 of them), and both scale alike on a prompt.
        B = self.batch_size
        counts = [[d.num_nodes(t) if d is not None else 0 for d in deltas] for t in FLAT_TYPES]
        type_ptr = [0]
        for per_stream in counts:
            type_ptr.append(type_ptr[-1] + sum(per_stream))
        # Delta index of stream b's first new node of each type.
        first = {t: [type_ptr[i] + sum(counts[i][:b]) for b in range(B)] for i, t in enumerate(FLAT_TYPES)}
        first_row, self.num_rows = self.num_rows, self.num_rows + type_ptr[_OUTPUT]  # outputs: never sources
        table = self._write_rows(deltas, counts, first, first_row)  # (ids, types, B) cache rows
        token_rows = table[:, 0]  # (positions, B)
        tokens = [(b, d.first, n) for b, (d, n) in enumerate(zip(deltas, counts[0])) if n]
        token_pos = np.concatenate([np.arange(start, start + n) for _, start, n in tokens])  # (T,)
        token_stream = np.repeat([b for b, _, _ in tokens], [n for _, _, n in tokens])  # (T,)
        token_reset = np.zeros(token_pos.size, dtype=bool)
        token_reset[[first["token"][b] for b, _, _ in tokens]] = True  # each stream's first new token
        previous_row = token_rows[np.maximum(token_pos - 1, 0), token_stream]  # (T,); any row at position 0
        cover_src, _, _, cover_ptr = self._edges(deltas, first, _COVER_INDEX, type_ptr, table)
        cover_ptr = cover_ptr[type_ptr[1] : type_ptr[_OUTPUT] + 1]  # over the new patches
        rule_src, rule_dst, rule_type, rule_ptr = self._edges(deltas, first, _CANDIDATE_INDEX, type_ptr, table)
        into_patch = rule_ptr[type_ptr[_OUTPUT]]  # edges into patches: the sorted head
        output_pool = self._output_pool(token_pos, token_stream, token_rows, rule_src[into_patch:],
                                        rule_dst[into_patch:] - type_ptr[_OUTPUT], rule_type[into_patch:])
        chains = [(i * B + b, counts[_TYPE_INDEX[t]][b]) for i, t in enumerate(CHAINED_TYPES) for b in range(B)
                  if counts[_TYPE_INDEX[t]][b]]  # (pool row, new patches) of every continued chain
        chain_reset = np.zeros(sum(size for _, size in chains), dtype=bool)
        if chains:  # most generated tokens close no patch
            chain_reset[np.cumsum([0] + [size for _, size in chains[:-1]])] = True  # each chain's first
        present = [d for d in deltas if d is not None]

        def concat(parts: list[Tensor]) -> Tensor:  # one stream's: as it is
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        tensor = self._tensor
        return StreamDelta(
            type_ptr, tensor(np.arange(len(FLAT_TYPES)).repeat([sum(per_stream) for per_stream in counts])),
            concat([d.ids for d in present]), {p: concat([d.attrs[p] for d in present]) for p in present[0].attrs},
            first_row, [b for b, _, _ in tokens],
            tensor(token_stream), tensor(token_reset), tensor(token_pos // self.model.config.proposal_block),
            tensor(previous_row),
            tensor(token_pos[:, None] == 0), tensor(cover_src), tensor(cover_ptr), [row for row, _ in chains],
            tensor(chain_reset),
            (tensor(rule_src[:into_patch]), tensor(rule_dst[:into_patch]), tensor(rule_type[:into_patch])),
            tuple(map(tensor, output_pool)), self._new_blocks(deltas, token_rows), tensor(token_rows))

    def _tensor(self, array: np.ndarray) -> Tensor:
        """A host array as a tensor on the model's device (on the CPU: the same memory)."""
        out = torch.from_numpy(array)
        return out if self.device.type == "cpu" else out.to(self.device)

    def _write_rows(self, deltas, counts, first, first_row: int) -> np.ndarray:
        """Record the cache rows of the new non-output nodes (``first_row`` on, in delta order) in the
        node table (each new node by its id in the full site, its type and its stream); returns the table."""
        self.node_rows.grow_to(max(max(site.num_nodes[t] for t in FLAT_TYPES[:_OUTPUT]) for site in self.sites))
        table = self.node_rows.data.numpy()  # (ids, types, B): shares the buffer's memory
        for i, t in enumerate(FLAT_TYPES[:_OUTPUT]):  # per type and stream, one run of ids and one of rows
            for b, d in enumerate(deltas):
                if counts[i][b]:
                    ids, row = slice(d.node_offset[t], d.node_offset[t] + counts[i][b]), first_row + first[t][b]
                    table[ids, i, b] = np.arange(row, row + counts[i][b])
        return table

    @staticmethod
    def _edges(deltas, first, edge_index: dict, type_ptr,
               table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Source rows (from the node ``table``), destination delta indices and type ids of the deltas' edges
        of the types in ``edge_index`` (edge type -> type id; ``deltas``: per stream, its
        :class:`~sheafgnn.site.stream.SiteDelta` or None), sorted by destination (stably: per destination
        by type id, like ``flatten_site``), and the destination CSR pointer over the new nodes."""
        chunks = sorted((edge_index[e], b, e, d) for b, d in enumerate(deltas) if d is not None
                        for e in d.edges if e in edge_index)  # edge-type major, like flatten_site
        ptr = np.zeros(type_ptr[-1] + 1, dtype=np.int64)
        if not chunks:  # e.g. the cover edges of a generated token that closes no patch
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, ptr
        index = np.concatenate([d.edges[e] for _, _, e, d in chunks], 1)  # (2, E) ids per site
        # per chunk: edge type, stream, destination shift (site id -> delta index), source type
        meta = np.array([[i, b, first[e[2]][b] - d.node_offset[e[2]], _TYPE_INDEX[e[0]]] for i, b, e, d in chunks])
        types, stream, shift, src_type = meta.repeat([d.edges[e].shape[1] for _, _, e, d in chunks], 0).T
        src, dst = table[index[0], src_type, stream], index[1] + shift  # (E,) each
        order = dst.argsort(kind="stable")
        np.cumsum(np.bincount(dst, minlength=type_ptr[-1]), out=ptr[1:])
        return src[order], dst[order], types[order], ptr

    def _output_pool(self, pos: np.ndarray, stream: np.ndarray, token_rows: np.ndarray, rule_src: np.ndarray,
                     rule_dst: np.ndarray, rule_type: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The candidates of the new outputs that are the same in every block: their position proposals
        (:meth:`LearnedTopology.position_proposals`; every block's topology has the model's proposal
        settings) as cache rows, then their rule pools (:func:`~sheafgnn.nn.topology.rule_pools`, the
        edges of each output in order); (M, P1 + W) each (-1: none)."""
        near = self._position_proposals(pos)  # (M, P1) positions
        near = np.where(near >= 0, token_rows[np.maximum(near, 0), stream[:, None]], -1)
        degree = np.bincount(rule_dst, minlength=pos.size)  # (M,)
        slot = np.arange(rule_dst.size) - (np.cumsum(degree) - degree)[rule_dst]  # each edge's column in its row
        pool = np.empty((pos.size, near.shape[1] + degree.max(initial=0)), dtype=np.int64)
        pool.fill(-1)
        types = np.zeros(pool.shape, dtype=np.int64)
        pool[:, : near.shape[1]], types[:, : near.shape[1]] = near, self.position_types
        pool[rule_dst, near.shape[1] + slot], types[rule_dst, near.shape[1] + slot] = rule_src, rule_type
        return pool, types

    def _position_proposals(self, pos: np.ndarray) -> np.ndarray:
        """:meth:`LearnedTopology.position_proposals` of ``pos`` (M,) from the table, grown to cover every
        stream's positions so far (the same sources as computing them: the table holds that function's rows)."""
        needed, table = max(site.num_tokens for site in self.sites), self.position_table
        if table.size < needed:
            new = torch.arange(table.size, max(needed, 2 * table.size))
            table.write(table.extend(new.numel()), self.model.blocks[0].topology.position_proposals(
                new, torch.zeros_like(new))[0])
        return table.data.numpy()[pos]

    def _new_blocks(self, deltas, token_rows: np.ndarray) -> list[tuple[int, int, Tensor]]:
        """Per stream, the index of its first content block completed by this feed and the cache rows
        of the tokens of every such block."""
        B = self.model.config.proposal_block
        out = []
        for b, d in enumerate(deltas):
            if d is None or not self.model.config.content_blocks:
                continue
            start, done = self.num_blocks[b], self.sites[b].num_tokens // B  # complete blocks before / after
            if done > start:
                out.append((b, start, self._tensor(token_rows[start * B : done * B, b].reshape(done - start, B))))
                self.num_blocks[b] = done
        return out


@dataclass
class _TokensOnly:
    """The delta of the ssm ablation: new tokens only."""

    token_ids: Tensor
    token_reset: Tensor
    token_streams: list[int]


def continue_chains(ssm, x: Tensor, reset: Tensor, pool: SSMState, rows: list[int],
                    norm=None) -> tuple[Tensor, SSMState]:
    """Run the SSM ``ssm`` over chains of ``norm(x)`` (``x`` without ``norm``) that continue from rows ``rows``
    of the state batch ``pool`` (a chain not started yet has a zero state, as :meth:`SelectiveSSM.init_state`
    gives); returns the outputs and the pool with those rows advanced."""
    if not rows:  # no chain has new elements
        return x, pool
    every = rows == list(range(pool.conv.size(0)))  # generation with every stream: no gather, no scatter
    index = None if every else torch.tensor(rows, device=x.device)
    state = pool if every else SSMState(pool.conv[index], pool.ssm[index])
    if x.size(0) == len(rows):  # one new element per chain (generation): the recurrent step
        y, new = ssm.step(x, state, norm=norm)
    else:
        y, new = ssm(x, reset, state=state, return_state=True, norm=norm)
    if every:
        return y, new
    pool.conv[index], pool.ssm[index] = new.conv, new.ssm
    return y, pool


def select_streamed(topology: LearnedTopology, h: Tensor, delta: StreamDelta,
                    cache: LayerCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The learned topology's choice for the new destinations of a delta, from the caches.

    Mirrors :meth:`LearnedTopology.forward` (same pools, in the same column order, same
    competitions); writes the new nodes' keys and the new content blocks' summaries to the cache.

    Returns:
        source rows (E,), destination delta indices (E,) sorted, edge types (E,), weights (E,); every
        output has ``k`` edges (or its pool's size), those past its pool's candidates with weight 0.
    """
    num_rows, first = delta.type_ptr[_OUTPUT], delta.first_row
    q, key = new_queries_and_keys(topology, h, delta, cache)  # (N, r), (rows, r)
    cache.key.extend(num_rows)
    cache.key.write(first, key)
    block_keys = cache.key
    if topology.block_scorer:
        block_keys = cache.block_token_key
        block_keys.extend(num_rows)
        block_keys.write(first, topology.block_token_keys(h[delta.block("token")], _previous_states(delta, cache)))
    if delta.new_blocks:
        cache.block_key.grow_to(max(start + members.size(0) for _, start, members in delta.new_blocks))
        for b, start, members in delta.new_blocks:
            cache.block_key.data[start : start + members.size(0), b] = summarize_blocks(block_keys.data[members],
                                                                                         topology.block_summary)

    # Non-output destinations: their rule candidates, edge by edge.
    out0 = delta.type_ptr[_OUTPUT]
    src, dst, types = delta.patch_rules
    patch_edges = None  # most generated tokens close no patch
    if dst.numel():
        score = topology._score((q[dst] * cache.key.data[src]).sum(-1), types)
        keep, weight = topology.compete_sparse(score, dst, topology.sink[delta.node_type[:out0]])
        patch_edges = (src[keep], dst[keep], types[keep], weight)

    # Outputs: one dense pool each (content proposals, then the rest), as LearnedTopology._output_pool.
    q_out = q[out0:]  # (M, r)
    block_query = topology.block_query(h[out0:]) if topology.block_scorer else q_out
    output_edges = compete_outputs(topology, q_out, block_query, topology.sink[delta.node_type[out0:]], delta,
                                   cache, out0)
    if patch_edges is None or patch_edges[0].numel() == 0:
        return output_edges
    return tuple(torch.cat([a, b]) for a, b in zip(patch_edges, output_edges))


# What new_queries_and_keys reads of the topology: its projections (to check), then their weights.
_KEY_ARGUMENTS = ("query", "key", "key_previous", "query.weight", "key.weight", "key_previous.weight")


def new_queries_and_keys(topology: LearnedTopology, h: Tensor, delta: StreamDelta,
                         cache: LayerCache) -> tuple[Tensor, Tensor]:
    """The learned topology's queries (N, r) of a delta's new nodes ``h`` (N, D) and keys (rows, r) of its
    non-output ones, as :meth:`LearnedTopology._keys` holds them: a token's key also reads the cached state of
    the token before it (nothing at position 0). Without gradients, on the CPU, for at most
    :data:`~sheafgnn.nn.cpu_kernels.STEP_ROWS` new nodes per stream, one call of the C++ kernel ``stream_keys``
    (:mod:`sheafgnn.nn.cpu_kernels`: ~10 ops a block in one); elsewhere, and as the reference,
    :func:`new_queries_and_keys_reference`."""
    *layers, query, key, key_previous = cpu_kernels.registered(topology, _KEY_ARGUMENTS)
    kernel = None
    if h.size(0) <= cpu_kernels.STEP_ROWS * len(delta.token_streams) and \
            all(type(layer) is nn.Linear for layer in layers) and cpu_kernels.kernel_inputs(h, query.dtype):
        kernel = cpu_kernels.stream_keys()
    if kernel is None:
        return new_queries_and_keys_reference(topology, h, delta, cache)
    return kernel(h, cache.state.data, delta.previous_row, delta.no_previous, delta.type_ptr[_OUTPUT], query, key,
                  key_previous)


def new_queries_and_keys_reference(topology: LearnedTopology, h: Tensor, delta: StreamDelta,
                                   cache: LayerCache) -> tuple[Tensor, Tensor]:
    """:func:`new_queries_and_keys` as PyTorch ops."""
    key = topology.key(h[: delta.type_ptr[_OUTPUT]])  # (rows, r)
    key[delta.block("token")].add_(topology.key_previous(_previous_states(delta, cache)))
    return topology.query(h), key


def _previous_states(delta: StreamDelta, cache: LayerCache) -> Tensor:
    """(T, D) the cached state of the token before each new token (zero at position 0)."""
    return cache.state.data[delta.previous_row].masked_fill_(delta.no_previous, 0.0)


def compete_outputs(topology: LearnedTopology, query: Tensor, block_query: Tensor, sink: Tensor, delta: StreamDelta,
                    cache: LayerCache, first_dst: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The competition of a delta's M new outputs, as :meth:`LearnedTopology._output_pool` and
    :meth:`~LearnedTopology.compete_dense` hold it in the full forward: each output's pool is its content
    proposals (the tokens of the blocks its ``block_query`` (M, r) ranks best among its stream's cached block
    summaries), then its position and rule candidates (``delta.output_pool``), scored by ``query`` (M, r)
    against the cached keys; ``sink`` (M,) its "nothing" logit. Without gradients, on the CPU, for at most
    :data:`~sheafgnn.nn.cpu_kernels.STEP_ROWS` outputs per stream, it is one call of the C++ kernel
    ``stream_pools`` (:mod:`sheafgnn.nn.cpu_kernels`: ~30 ops a block in one); elsewhere, and as the
    reference, :func:`compete_outputs_reference`.

    Returns:
        the edges into the outputs, ``k`` per output (or its pool's size) in output order, into delta indices
        ``first_dst, ..., first_dst + M - 1``: source rows, destinations, edge types and weights, (M k,) each.
        The padding of a short pool (and a candidate under ``sink_threshold``) is kept with weight 0 and a real
        source (row 0 for padding), so its message and its share of L_vv are exact zeros (filtering them cost
        9 ops a block).
    """
    kernel = None
    # The kernel scores a row's blocks one by one: a step's few rows, not a prompt's (best_blocks' kernel)
    if query.size(0) <= cpu_kernels.STEP_ROWS * len(delta.token_streams) and \
            cpu_kernels.kernel_inputs(query, topology.type_bias.dtype):
        kernel = cpu_kernels.stream_pools()
    if kernel is None:
        return compete_outputs_reference(topology, query, block_query, sink, delta, cache, first_dst)
    sources, types = delta.output_pool
    return kernel(query, cache.key.data, sources, types, topology.type_bias, sink, topology.k,
                  math.sqrt(topology.rank), topology.sink_threshold, summary_query(block_query, topology.block_summary),
                  cache.block_key.data, delta.token_stream, delta.token_block, delta.token_rows,
                  topology.content_blocks, topology.block_size, topology.content_type, first_dst)


def compete_outputs_reference(topology: LearnedTopology, query: Tensor, block_query: Tensor, sink: Tensor,
                              delta: StreamDelta, cache: LayerCache,
                              first_dst: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`compete_outputs` as PyTorch ops: the pools, their scores (:func:`~sheafgnn.nn.pools.pool_dot`),
    :meth:`LearnedTopology.compete_dense`, and the kept columns as edges."""
    sources, types = delta.output_pool
    if topology.content_blocks:
        far, far_types = _content_proposals(topology, block_query, delta, cache)
        sources, types = torch.cat([far, sources], 1), torch.cat([far_types, types], 1)
    score = topology._score(pool_dot(query, cache.key.data, sources.clamp(min=0)), types)  # (M, P)
    _, pick, weight = topology.compete_dense(score.masked_fill(sources < 0, float("-inf")), sink.unsqueeze(1))
    dst = torch.arange(first_dst, first_dst + pick.size(0), device=pick.device).repeat_interleave(pick.size(1))
    return sources.gather(1, pick).clamp(min=0).flatten(), dst, types.gather(1, pick).flatten(), weight.flatten()


def _content_proposals(topology: LearnedTopology, block_query: Tensor, delta: StreamDelta,
                       cache: LayerCache) -> tuple[Tensor, Tensor]:
    """(M, content_blocks * B) cache rows of the tokens of every new output's chosen blocks (-1: none),
    chosen by the outputs' ``block_query`` (M, r), and their edge types: the stream's
    :meth:`LearnedTopology.block_proposals`, read as rows of the block-major token table."""
    B, J = topology.block_size, cache.block_key.size
    stream = delta.token_stream  # (M,): output i sits at token i
    blocks = stream_blocks(summary_query(block_query, topology.block_summary), stream, delta.token_block,
                           cache.block_key.data, topology.content_blocks,
                           one_per_stream=stream.numel() == len(delta.token_streams))  # (M, m) block indices
    if J:
        block_rows = delta.token_rows[: J * B].view(J, B, delta.token_rows.size(1))  # (J, B, streams): by block
        rows = block_rows[blocks.clamp(min=0), :, stream.unsqueeze(1)]  # (M, m, B)
        rows = rows.masked_fill_((blocks < 0).unsqueeze(2), -1).flatten(1)  # (M, m * B)
    else:  # no complete block yet
        rows = blocks.new_full((blocks.size(0), blocks.size(1) * B), -1)
    return rows, torch.full_like(rows, topology.content_type)


@torch.no_grad()
def stream_blocks(query: Tensor, stream: Tensor, last: Tensor, block_key: Tensor, num_blocks: int,
                  one_per_stream: bool) -> Tensor:
    """For each query row, the ``num_blocks`` best of its stream's blocks ``j < last`` (as :func:`best_blocks`).

    Args:
        query (Tensor): (M, r'), as :func:`~sheafgnn.nn.proposals.summary_query` gives it.
        stream (Tensor): (M,) stream of each row.
        last (Tensor): (M,) one past the last block each row may choose.
        block_key (Tensor): (J, B, r') the summaries of every stream's complete blocks.
        num_blocks (int): blocks kept per row.
        one_per_stream (bool): each stream has at most one row (generation).

    Returns:
        (M, num_blocks) block indices (best first), -1 where fewer blocks qualify.
    """
    M, J = query.size(0), block_key.size(0)
    if one_per_stream:  # all streams in one product
        # Rows are in stream order, so with every stream present the keys need no gather (at 32k tokens
        # and 16 streams the gather would copy 8 MB per block and step).
        keys = block_key if M == block_key.size(1) else block_key[:, stream]
        score = torch.einsum("mr,jmr->mj", query, keys)  # (M, J)
        return top_blocks(score, None, last, num_blocks)
    out = torch.full((M, num_blocks), -1, dtype=torch.long, device=query.device)
    block_index = torch.arange(J, device=query.device)
    for b in stream.unique().tolist():  # many rows per stream (a prompt): each stream's rows share its keys
        rows = torch.nonzero(stream == b).squeeze(1)
        out[rows] = best_blocks(query[rows], block_key[:, b], block_index, torch.zeros_like(rows), last[rows],
                                num_blocks)
    return out
