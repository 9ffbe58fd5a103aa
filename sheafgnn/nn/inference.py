"""What a stream (:mod:`sheafgnn.stream`) keeps between steps and hands to the layers' steps: data, no math.

::

    RowBuffer       rows of a tensor that grows geometrically (amortised O(rows appended) per append)
    LayerCache      what one SheafBlock keeps for a batch of streams (SheafBlock.allocate_inference_cache):
                    every node's state and topology keys, the content blocks' summaries, the SSM states
    TopologyDelta   what the learned topology's step reads of a stream batch's new nodes (TopologyStep.step),
                    as its forward reads a TopologyInput
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sheafgnn.nn.ssm import SSMState


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
    """What one block keeps for a batch of streams; without gluing (the ssm ablation) the token chain's
    SSM state only (the other fields None)."""

    token_ssm: SSMState  # (B, ...) the token chain's SSM state of every stream (zero: not started)
    state: RowBuffer | None = None  # (rows, D) pre-gluing state of every non-output node of every stream
    key: RowBuffer | None = None  # (rows, r) its topology key
    block_token_key: RowBuffer | None = None  # (rows, r) a token's key of the block scorer, if any (undefined at
    # other rows)
    block_key: RowBuffer | None = None  # (blocks, B, r or 2r) content-block summary of each stream's complete blocks
    chain_ssm: SSMState | None = None  # (len(CHAINED_TYPES) * B, ...) per chained type and stream: row type * B +
    # stream


@dataclass
class TopologyDelta:
    """What the learned topology's step reads of a stream batch's new nodes
    (:meth:`~sheafgnn.nn.topology_step.TopologyStep.step`), as its forward reads a
    :class:`~sheafgnn.nn.topology.TopologyInput`; a part of :class:`~sheafgnn.stream.StreamDelta`. The new nodes
    are in flat order: the ``num_rows`` non-output ones first (the T tokens at their head), which take the next
    cache rows in order, then the T outputs (output ``i`` reads token ``i``). Sources are cache rows
    (:class:`LayerCache`)."""

    node_type: Tensor  # (N,) flat node type of every new node
    num_rows: int  # new non-output nodes
    num_tokens: int  # T, new tokens (and outputs)
    num_streams: int  # streams with new tokens
    token_stream: Tensor  # (T,) stream of each new token (and output)
    token_block: Tensor  # (T,) content block of each new token's position in its stream (position // block_size):
    # the blocks before it are complete
    previous_row: Tensor  # (T,) cache row of the token before each new token (any row at position 0)
    no_previous: Tensor  # (T, 1) True at position 0 (no token before)
    patch_rules: tuple[Tensor, Tensor, Tensor]  # (E,) each: rule candidates into new non-outputs (source cache row,
    # destination delta index, sorted; edge type)
    output_pool: tuple[Tensor, Tensor]  # (T, P1 + W) each: the candidates of every new output that no block's choice
    # changes (cache rows, -1: none; edge types): its position proposals, then its rule pool
    new_blocks: list[tuple[int, int, Tensor]]  # per stream: (stream, first new block, (blocks, B) token rows)
    token_rows: Tensor  # (positions, streams) cache row of each stream's token at each position so far
