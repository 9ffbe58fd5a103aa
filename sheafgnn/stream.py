r"""Streaming inference for :class:`~sheafgnn.model.SheafStateLM`: constant work per new token.

The site is causal by construction, so it grows by deltas
(:class:`~sheafgnn.site.stream.SiteStream`): feeding tokens yields the new
nodes (time in the new positions) and the edges into them, with the same ids
as :func:`~sheafgnn.site.build_site` gives for the whole prefix. A block only
ever reads states of nodes with ``time <= time[v]``, so the new nodes' states
follow from the cached states of old ones::

    feed(ids) per stream --SiteStream.push--> deltas --StreamDelta--> one flat batch of new nodes
    per block l (SheafBlock.step, with its LayerCache):
      Phi token chain      continues each stream's SSM state          SelectiveSSM.continue_chains
      pool                 reads the cached token states of each new patch's span
      Phi patch chains     continue each (stream, chained type)'s     SelectiveSSM.continue_chains
                           SSM state
      choose               new destinations' pools from the cached    LearnedTopology.step (a TopologyDelta)
                           keys: rule edges of the delta, content
                           blocks (cached block summaries), own
                           block, random tokens
      G gluing             the new nodes read their cached sources    SheafConv on (cached states, new nodes)
                           in place
      E, broadcast         node-wise                                  SheafBlock.step_tail
    R                      logits of the new outputs

This module is the loop and the bookkeeping, not the math (as :mod:`sheafgnn.lm` is a consumer of the model):
it turns the sites' deltas into one flat :class:`StreamDelta` whose sources are cache rows, keeps the host
tables of rows, and calls the model; each layer computes its own step, and the caches are allocated by the
blocks (:meth:`SheafBlock.allocate_inference_cache <sheafgnn.model.SheafBlock.allocate_inference_cache>`,
:mod:`sheafgnn.nn.inference`).

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
compute runs in the C++ kernels of :mod:`sheafgnn.nn.cpu_kernels` (``ssm_step``, ``block_tail``, ``glue_diag``,
and the topology's ``stream_keys`` and ``stream_pools``, :mod:`sheafgnn.nn.topology_step`), each one call where
PyTorch dispatched 10-40 ops; each is tested against its PyTorch reference. The delta's
index bookkeeping (:meth:`SheafStream._delta`) runs in NumPy on the host tables, and a NumPy op on a few
integers costs a tenth of a PyTorch op. (On a GPU the delta's arrays, the (positions, B) table of token rows
included, are copied to the device at every step: the step is built for the CPU.)

Streamed logits equal the full forward's
(``model(build_site(all ids so far))``) up to float rounding: the chunked
scan and the step order sums differently. The random-score ablation is not
streamable (its noise is drawn per forward pass).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from sheafgnn.generation import TokenStream
from sheafgnn.nn.inference import RowBuffer, TopologyDelta
from sheafgnn.site.flat import FLAT_TYPES, FlatBlocks
from sheafgnn.site.schema import CANDIDATE_EDGES, CHAINED_TYPES, COVER_EDGES
from sheafgnn.site.stream import SiteDelta, SiteStream

if TYPE_CHECKING:  # the model creates its streams (SheafStateLM.stream), so this module names its type only
    from sheafgnn.model import SheafStateLM

_OUTPUT = FLAT_TYPES.index("output")
_TYPE_INDEX = {t: i for i, t in enumerate(FLAT_TYPES)}
# edge type -> its index in COVER_EDGES / CANDIDATE_EDGES (a delta holds a few of the ~30 types: look them up)
_COVER_INDEX = {e: i for i, e in enumerate(COVER_EDGES)}
_CANDIDATE_INDEX = {e: i for i, e in enumerate(CANDIDATE_EDGES)}


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
    token_streams: list[int]  # streams with new tokens, in order
    token_reset: Tensor  # (T,) True at each stream's first new token
    cover_src: Tensor  # (C,) cache row of the token of each cover edge into a new patch
    cover_ptr: Tensor  # (num_new_patches + 1,)
    chain_rows: list[int]  # row in LayerCache.chain_ssm of every new patch chain, in order
    chain_reset: Tensor  # (num_new_chained,)
    topology: TopologyDelta  # what the learned topology's step reads: the candidates of the new nodes


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

    def __init__(self, model: SheafStateLM, batch_size: int = 1, tokenizer=None) -> None:
        super().__init__(batch_size, model.config.vocab_size)
        if model.config.glues and any(block.topology.random_scores for block in model.blocks):
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
        if model.config.glues:
            # The position proposals of every position so far (a pure function of the position, the same for
            # every stream and block), grown geometrically: a generation step reads its row instead of ~30 ops.
            near, types = model.blocks[0].topology.position_proposals(torch.zeros(1, dtype=torch.long),
                                                                      torch.zeros(1, dtype=torch.long))
            self.position_table = RowBuffer(near.shape[1:], torch.long)  # (positions, P1), -1: none; host
            self.position_types = types[0].numpy()  # (P1,) their edge types, the same at every position
        self.num_rows = 0
        dtype = model.token_embedding.weight.dtype
        self.caches = [block.allocate_inference_cache(batch_size, device, dtype) for block in model.blocks]

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        if not any(x.numel() for x in ids):
            return [self.model.token_embedding.weight.new_zeros(0, self.vocab_size) for _ in ids]
        if not self.model.config.glues:
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

        tensor, streams = self._tensor, [b for b, _, _ in tokens]
        node_type = tensor(np.arange(len(FLAT_TYPES)).repeat([sum(per_stream) for per_stream in counts]))
        topology = TopologyDelta(
            node_type, type_ptr[_OUTPUT], token_pos.size, len(streams), tensor(token_stream),
            tensor(token_pos // self.model.config.topology.block_size), tensor(previous_row),
            tensor(token_pos[:, None] == 0),
            (tensor(rule_src[:into_patch]), tensor(rule_dst[:into_patch]), tensor(rule_type[:into_patch])),
            tuple(map(tensor, output_pool)), self._new_blocks(deltas, token_rows), tensor(token_rows))
        return StreamDelta(
            type_ptr, node_type,
            concat([d.ids for d in present]), {p: concat([d.attrs[p] for d in present]) for p in present[0].attrs},
            streams, tensor(token_reset), tensor(cover_src),
            tensor(cover_ptr), [row for row, _ in chains], tensor(chain_reset), topology)

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
        settings) as cache rows, then their rule pools (:func:`~sheafgnn.nn.pools.rule_pools`, the
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
        B = self.model.config.topology.block_size
        out = []
        for b, d in enumerate(deltas):
            if d is None or not self.model.config.topology.content_blocks:
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
