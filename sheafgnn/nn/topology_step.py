r"""The learned topology's streamed step: its choice for the new nodes of a batch of streams only.

A stream (:mod:`sheafgnn.stream`) computes, per block, only the nodes of its new tokens; their candidates read
the cached keys of the old nodes (:class:`~sheafgnn.nn.inference.LayerCache`), and the choice is the full
forward's: the same pools, in the same column order, and the same competitions::

    step(h (N, D), TopologyDelta, LayerCache) -> source cache rows, destinations, edge types, weights   (E,) each
      queries_and_keys    the new nodes' queries, and keys into the cache (a token's      C++ stream_keys
                          key also reads the cached state of the token before it)         | queries_and_keys_reference
      block summaries     of the content blocks the new tokens complete, into the cache
      non-output nodes    their rule candidates, edge by edge (compete_sparse)
      outputs             one dense pool each: content proposals from the cached block   C++ stream_pools
                          summaries (stream_blocks), then the position and rule           | compete_outputs_reference
                          candidates of the delta (compete_pools, as in forward)

:class:`TopologyStep` is a base class of :class:`~sheafgnn.nn.topology.LearnedTopology` (as mamba_ssm's
``GenerationMixin`` is of its models), so that ``topology.step`` sits beside ``topology.forward``.

**Launches, not arithmetic.** A batch-1 step computes a few rows per block, so each PyTorch op costs its launch
(a few microseconds on a CPU) far more than its work: without gradients on the CPU, the queries and keys and the
outputs' competition each run in one call of a C++ kernel (:mod:`sheafgnn.nn.cpu_kernels`), tested against the
PyTorch reference beside it.

**Cost per new token:** O(k + pool) scores, and the content-block scores: one rank-r dot product per complete
block of its stream (O(n / B)), the only term that grows with the context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.inference import LayerCache, TopologyDelta
from sheafgnn.nn.proposals import stream_blocks, summarize_blocks, summary_query

# What queries_and_keys reads of the topology: its projections (to check), then their weights.
_KEY_ARGUMENTS = ("query", "key", "key_previous", "query.weight", "key.weight", "key_previous.weight")


class TopologyStep:
    """The streamed selection of :class:`~sheafgnn.nn.topology.LearnedTopology`, a base class of it: the methods
    read the topology's projections (``query``, ``key``, ``key_previous``, ``block_query``, ``block_token_keys``),
    the norms of its queries and keys (``query_norm``, ``key_norm``), parameters (``sink``, ``type_bias``),
    settings and competitions (``score``, ``compete_sparse``, ``compete_pools``)."""

    def step(self, h: Tensor, delta: TopologyDelta, cache: LayerCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`LearnedTopology.forward <sheafgnn.nn.topology.LearnedTopology.forward>` for the new destinations of
        a stream batch, from the cached keys of the old nodes: the same pools, in the same column order, and the same
        competitions. Writes the new nodes' keys and the new content blocks' summaries to ``cache``.

        Args:
            h (Tensor): (N, D) the new nodes' states, in ``delta``'s order.
            delta (TopologyDelta): the new nodes and their candidates.
            cache (LayerCache): the block's cache (the states of the old and new non-output nodes written).

        Returns:
            source cache rows (E,), destination delta indices (E,) sorted, edge types (E,), weights (E,); every
            output has ``k`` edges (or its pool's size), those past its pool's candidates with weight 0.
        """
        num_rows = delta.num_rows
        q, key = self.queries_and_keys(h, delta, cache)  # (N, r), (rows, r)
        first = cache.key.extend(num_rows)
        cache.key.write(first, key)
        block_keys = cache.key
        if self.block_scorer:
            block_keys = cache.block_token_key
            block_keys.extend(num_rows)
            block_keys.write(first, self.block_token_keys(h[: delta.num_tokens], self._previous_states(delta, cache)))
        if delta.new_blocks:
            cache.block_key.grow_to(max(start + members.size(0) for _, start, members in delta.new_blocks))
            for b, start, members in delta.new_blocks:
                cache.block_key.data[start : start + members.size(0), b] = summarize_blocks(block_keys.data[members],
                                                                                             self.block_summary)

        # Non-output destinations: their rule candidates, edge by edge.
        src, dst, types = delta.patch_rules
        patch_edges = None  # most generated tokens close no patch
        if dst.numel():
            score = self.score((q[dst] * cache.key.data[src]).sum(-1), types)
            keep, weight = self.compete_sparse(score, dst, self.sink[delta.node_type[:num_rows]])
            patch_edges = (src[keep], dst[keep], types[keep], weight)

        # Outputs: one dense pool each (content proposals, then the rest), as _output_pool.
        q_out = q[num_rows:]  # (T, r)
        block_query = self.block_query(h[num_rows:]) if self.block_scorer else q_out
        output_edges = self.compete_outputs(q_out, block_query, self.sink[delta.node_type[num_rows:]], delta, cache)
        if patch_edges is None or patch_edges[0].numel() == 0:
            return output_edges
        return tuple(torch.cat([a, b]) for a, b in zip(patch_edges, output_edges))

    def queries_and_keys(self, h: Tensor, delta: TopologyDelta, cache: LayerCache) -> tuple[Tensor, Tensor]:
        """The queries (N, r) of a stream batch's new nodes ``h`` (N, D) and the keys (num_rows, r) of its non-output
        ones, as the forward computes them: a token's key also reads the cached state of the token before it (nothing
        at position 0). Without gradients, on the CPU, for at most :data:`~sheafgnn.nn.cpu_kernels.STEP_ROWS` new
        nodes per stream, one call of the C++ kernel ``stream_keys`` (:mod:`sheafgnn.nn.cpu_kernels`: ~10 ops a
        block in one); elsewhere, and as the reference, :meth:`queries_and_keys_reference`."""
        *layers, query, key, key_previous = cpu_kernels.registered(self, _KEY_ARGUMENTS)
        kernel = None
        if h.size(0) <= cpu_kernels.STEP_ROWS * delta.num_streams and \
                all(type(layer) is nn.Linear for layer in layers) and cpu_kernels.kernel_inputs(h, query.dtype):
            kernel = cpu_kernels.stream_keys()
        if kernel is None:
            return self.queries_and_keys_reference(h, delta, cache)
        q, key = kernel(h, cache.state.data, delta.previous_row, delta.no_previous, delta.num_rows, query, key,
                        key_previous)
        return self.query_norm(q), self.key_norm(key)  # QK-norm: two launches, not worth a kernel

    def queries_and_keys_reference(self, h: Tensor, delta: TopologyDelta, cache: LayerCache) -> tuple[Tensor, Tensor]:
        """:meth:`queries_and_keys` as PyTorch ops."""
        key = self.key(h[: delta.num_rows])  # (rows, r)
        key[: delta.num_tokens].add_(self.key_previous(self._previous_states(delta, cache)))
        return self.query_norm(self.query(h)), self.key_norm(key)

    @staticmethod
    def _previous_states(delta: TopologyDelta, cache: LayerCache) -> Tensor:
        """(T, D) the cached state of the token before each new token (zero at position 0)."""
        return cache.state.data[delta.previous_row].masked_fill_(delta.no_previous, 0.0)

    def compete_outputs(self, query: Tensor, block_query: Tensor, sink: Tensor, delta: TopologyDelta,
                        cache: LayerCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The competition of a stream batch's T new outputs, as :meth:`forward` holds it: each output's pool is its
        content proposals (the tokens of the blocks its ``block_query`` (T, r) ranks best among its stream's cached
        block summaries), then its position and rule candidates (``delta.output_pool``), scored by ``query`` (T, r)
        against the cached keys; ``sink`` (T,) its "nothing" logit. Without gradients, on the CPU, for at most
        :data:`~sheafgnn.nn.cpu_kernels.STEP_ROWS` outputs per stream, one call of the C++ kernel ``stream_pools``
        (:mod:`sheafgnn.nn.cpu_kernels`: ~30 ops a block in one); elsewhere, and as the reference,
        :meth:`compete_outputs_reference`.

        Returns:
            the edges into the outputs, ``k`` per output (or its pool's size) in output order, into delta indices
            ``num_rows, ..., num_rows + T - 1``: source rows, destinations, edge types and weights, (T k,) each.
            The padding of a short pool (and a candidate under ``sink_threshold``) is kept with weight 0 and a real
            source (row 0 for padding), so its message and its share of L_vv are exact zeros (filtering them cost
            9 ops a block).
        """
        kernel = None
        # The kernel scores a row's blocks one by one: a step's few rows, not a prompt's (best_blocks' kernel)
        if query.size(0) <= cpu_kernels.STEP_ROWS * delta.num_streams and \
                cpu_kernels.kernel_inputs(query, self.type_bias.dtype):
            kernel = cpu_kernels.stream_pools()
        if kernel is None:
            return self.compete_outputs_reference(query, block_query, sink, delta, cache)
        sources, types = delta.output_pool
        return kernel(query, cache.key.data, sources, types, self.type_bias, sink, self.k, math.sqrt(self.rank),
                      self.sink_threshold, summary_query(block_query, self.block_summary), cache.block_key.data,
                      delta.token_stream, delta.token_block, delta.token_rows, self.content_blocks, self.block_size,
                      self.content_type, delta.num_rows)

    def compete_outputs_reference(self, query: Tensor, block_query: Tensor, sink: Tensor, delta: TopologyDelta,
                                  cache: LayerCache) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`compete_outputs` as PyTorch ops: the pools, :meth:`compete_pools`, and the kept columns as edges."""
        sources, types = delta.output_pool
        if self.content_blocks:
            far, far_types = self._cached_block_proposals(block_query, delta, cache)
            sources, types = torch.cat([far, sources], 1), torch.cat([far_types, types], 1)
        _, _, src, edge_type, weight = self.compete_pools(query, cache.key.data, sources, types, sink.unsqueeze(1))
        dst = torch.arange(delta.num_rows, delta.num_rows + src.size(0), device=src.device)
        return src.clamp(min=0).flatten(), dst.repeat_interleave(src.size(1)), edge_type.flatten(), weight.flatten()

    def _cached_block_proposals(self, block_query: Tensor, delta: TopologyDelta,
                                cache: LayerCache) -> tuple[Tensor, Tensor]:
        """The content proposals of a stream batch's T new outputs (the forward's
        :meth:`~sheafgnn.nn.topology.LearnedTopology.block_proposals`), chosen by their ``block_query`` (T, r) among
        their streams' cached block summaries (:func:`~sheafgnn.nn.proposals.stream_blocks`): (T, content_blocks * B)
        cache rows of the chosen blocks' tokens (-1: none), read from the block-major token table, and their edge
        types."""
        B, J = self.block_size, cache.block_key.size
        stream = delta.token_stream  # (T,): output i sits at token i
        blocks = stream_blocks(summary_query(block_query, self.block_summary), stream, delta.token_block,
                               cache.block_key.data, self.content_blocks,
                               one_per_stream=stream.numel() == delta.num_streams)  # (T, m) block indices
        if J:
            block_rows = delta.token_rows[: J * B].view(J, B, delta.token_rows.size(1))  # (J, B, streams): by block
            rows = block_rows[blocks.clamp(min=0), :, stream.unsqueeze(1)]  # (T, m, B)
            rows = rows.masked_fill_((blocks < 0).unsqueeze(2), -1).flatten(1)  # (T, m * B)
        else:  # no complete block yet
            rows = blocks.new_full((blocks.size(0), blocks.size(1) * B), -1)
        return rows, torch.full_like(rows, self.content_type)
