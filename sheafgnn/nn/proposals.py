r"""The proposals of the learned topology that are not the site's rules: content blocks and random tokens.

::

    content blocks   the tokens of the best complete blocks of B tokens before a destination, by a
                     query against each block's summary key (NSA / MoBA: the mean of its tokens'
                     keys; Quest: their channel-wise max and min, an upper bound of its best token)
    random tokens    seeded pseudo-random past tokens, a pure function of (seed, position)

**Causality.** Block ``j`` of a graph (tokens ``[jB, jB + B)``) qualifies for
position ``p`` iff ``jB + B <= p``; random tokens sit at positions ``<= p`` of
the same graph. Both read nothing of the future.

**Cost.** Scoring the complete blocks before every one of n destinations is
``n * n / B`` dot products of rank r (2r for the bounds), O(n^2 r / B) time.
On the CPU a C++ kernel scores and ranks a row's blocks in one pass, O(n)
memory (:func:`~sheafgnn.nn.cpu_kernels.block_topk`); the PyTorch reference
scores chunks of rows, O(n + chunk * n / B) memory
(``benchmarks/bench_model.py`` measures both). The chosen blocks give
``num_blocks * B`` candidates per destination, O(n) in all.

::

    summarize_blocks, summary_query     one block's summary key and the query that scores it
    summary_width                       the width of a summary
    block_summaries                     every complete block of every graph and its summary
    best_blocks                         the best blocks per row (the C++ kernel, or:)
    ranked_blocks_reference, top_blocks the same in PyTorch, chunked; the masked top-k
    content_blocks                      the proposals of a batch of destinations (the full forward)
    stream_blocks                       the best blocks of a stream batch's new rows (the streamed step)
    random_proposals                    the seeded random tokens
"""

from __future__ import annotations

import torch
from torch import Tensor

from sheafgnn.nn import cpu_kernels

# Multipliers of the position hash (odd 31-bit constants; int64 products wrap).
_HASH_MULTIPLIERS = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F)
# Block scores held at once (rows x blocks) by the PyTorch reference: 2 MiB, cache-resident for topk. Its time
# at 64k tokens is the (rows x r) @ (r x blocks) products (r = 16: 16 GFLOP/s at 2 threads, 40-47 at 1) and
# topk, about half each; an exact two-stage topk was no faster at 2 threads (0.86-0.94x). The C++ kernel
# writes no scores at all (benchmarks/bench_model.py compares the two).
_SCORE_CHUNK = 1 << 19
BLOCK_SUMMARIES = ("mean", "bounds")


def random_proposals(position: Tensor, graph_start: Tensor, count: int, seed: int = 0) -> Tensor:
    r"""``count`` pseudo-random past tokens per destination, a pure function of (seed, position).

    Token ``graph_start + (hash(seed, p, i) mod (p + 1))`` for ``i < count``:
    positions ``<= p`` of the same graph, the same for the same position
    whatever the text, so the proposals are causal and reproducible (a
    stream that meets position ``p`` later draws the same tokens).

    Args:
        position (Tensor): (M,) position ``p`` of each destination in its graph.
        graph_start (Tensor): (M,) global index of its graph's first token.
        count (int): proposals per destination.
        seed (int, optional): (default: :obj:`0`)

    Returns:
        (M, count) global token indices.
    """
    a, b, c, d = _HASH_MULTIPLIERS
    i = torch.arange(count, device=position.device)  # (R,)
    x = position.view(-1, 1) * a + i * b + (seed + 1) * c  # (M, R), int64 products wrap
    x = x ^ (x >> 15)
    x = x * d
    x = (x ^ (x >> 13)) & ((1 << 62) - 1)  # non-negative
    return graph_start.view(-1, 1) + x % (position.view(-1, 1) + 1)


def summarize_blocks(member_keys: Tensor, kind: str = "mean") -> Tensor:
    r"""The summary key of each block from its tokens' keys (..., B, r).

    ``"mean"``: their mean (..., r), scored by :math:`\langle q, \bar{k} \rangle` (NSA, MoBA).
    ``"bounds"``: the channel-wise max and min, :math:`[k^{\max}, k^{\min}]` (..., 2r), scored by
    :func:`summary_query` as :math:`\sum_i \max(q_i k^{\max}_i, q_i k^{\min}_i) \ge \max_{u \in j}
    \langle q, k_u \rangle` (Quest's criticality bound): a block holding one strong match scores at least
    that match, where the mean divides it by B among the block's other tokens.
    """
    if kind == "mean":
        return member_keys.mean(-2)
    return torch.cat([member_keys.amax(-2), member_keys.amin(-2)], -1)


def summary_width(rank: int, kind: str = "mean") -> int:
    """The width of :func:`summarize_blocks`' summaries of rank-``rank`` keys: ``rank``, or ``2 rank`` for
    ``"bounds"``."""
    return rank if kind == "mean" else 2 * rank


def summary_query(query: Tensor, kind: str = "mean") -> Tensor:
    """The query (M, r) that scores :func:`summarize_blocks`' summaries by a plain dot product: itself
    for ``"mean"``, :math:`[q^+, q^-]` (M, 2r) (positive and negative parts) for ``"bounds"``."""
    if kind == "mean":
        return query
    return torch.cat([query.clamp(min=0), query.clamp(max=0)], -1)


def block_summaries(token_key: Tensor, position: Tensor, graph_start: Tensor,
                    block_size: int, kind: str = "mean") -> tuple[Tensor, Tensor]:
    """The complete blocks of every graph and their summary keys (:func:`summarize_blocks` of ``kind``).

    Block ``j`` of a graph holds its positions ``[jB, jB + B)``; only complete blocks count.

    Returns:
        block_start (num_blocks,) global index of each block's first token (sorted), and
        block_key (num_blocks, r), or (num_blocks, 2r) for ``"bounds"``.
    """
    n, B = token_key.size(0), block_size
    index = torch.arange(n, device=token_key.device)
    end = index + B - 1
    complete = (position % B == 0) & (end < n)
    complete &= graph_start[end.clamp(max=n - 1)] == graph_start
    block_start = index[complete]  # (num_blocks,)
    members = block_start.unsqueeze(1) + torch.arange(B, device=token_key.device)  # (num_blocks, B)
    return block_start, summarize_blocks(token_key[members], kind)  # (num_blocks, r or 2r)


@torch.compiler.disable  # a detached, data-dependent choice (a C++ kernel or host-synced chunks): run eagerly
@torch.no_grad()
def best_blocks(query: Tensor, block_key: Tensor, block_start: Tensor, first: Tensor, last: Tensor,
                num_blocks: int, random_scores: bool = False) -> Tensor:
    r"""For each query row, the ``num_blocks`` best of the blocks ``first <= j < last`` by ``<q, k_block>``.

    On the CPU the C++ kernel :func:`~sheafgnn.nn.cpu_kernels.block_topk` scores and ranks in one pass
    (no score matrix; equal scores rank by block index); elsewhere, or without the kernel,
    :func:`ranked_blocks_reference` does it in chunks of rows. The choice is detached (no gradient
    passes a hard top-k).

    Args:
        query (Tensor): (M, r'), as :func:`summary_query` gives it.
        block_key (Tensor): (num_all_blocks, r') block summaries, in block order.
        block_start (Tensor): (num_all_blocks,) index of each block's first token.
        first (Tensor): (M,) first block each row may choose.
        last (Tensor): (M,) one past the last block each row may choose.
        num_blocks (int): blocks kept per row.
        random_scores (bool, optional): rank blocks by seeded noise instead (the random-score
            ablation). (default: :obj:`False`)

    Returns:
        (M, num_blocks) first token of each chosen block (best first), -1 where fewer blocks qualify.
    """
    M = query.size(0)
    if block_start.numel() == 0 or M == 0:
        return torch.full((M, num_blocks), -1, dtype=torch.long, device=query.device)
    # the kernel's inputs hold under this function's no_grad: the choice is detached
    kernel = cpu_kernels.block_topk() if not random_scores and cpu_kernels.kernel_inputs(query, block_key.dtype) \
        else None
    if kernel is not None:
        pick = kernel(query, block_key, first, last, num_blocks)  # (M, m)
    else:
        pick = ranked_blocks_reference(query, block_key, first, last, num_blocks, random_scores)
    return torch.where(pick >= 0, block_start[pick.clamp(min=0)], -1)


@torch.no_grad()
def ranked_blocks_reference(query: Tensor, block_key: Tensor, first: Tensor, last: Tensor, num_blocks: int,
                            random_scores: bool = False) -> Tensor:
    """:func:`best_blocks`' ranking in PyTorch: (M, num_blocks) block indices, best first, -1 where fewer
    qualify. Scores are computed in chunks of rows (``query @ block_key.T``, then :func:`top_blocks`), so
    memory stays O(chunk * num_blocks); ``random_scores``: seeded noise in place of the scores."""
    M, J = query.size(0), block_key.size(0)
    out = torch.full((M, num_blocks), -1, dtype=torch.long, device=query.device)
    rows = max(1, _SCORE_CHUNK // J)
    generator = torch.Generator(device=query.device).manual_seed(0) if random_scores else None
    for a in range(0, M, rows):
        b = min(M, a + rows)
        lo, hi = int(first[a:b].min()), int(last[a:b].max())
        if hi <= lo:
            continue
        if random_scores:
            score = torch.rand(b - a, hi - lo, generator=generator, device=query.device)
        else:
            score = query[a:b] @ block_key[lo:hi].T  # (rows, blocks)
        out[a:b] = top_blocks(score, first[a:b], last[a:b], num_blocks, lo)  # (rows, m)
    return out


def top_blocks(score: Tensor, first: Tensor | None, last: Tensor, num_blocks: int, col0: int = 0) -> Tensor:
    """(R, num_blocks) the best columns ``first <= col0 + j < last`` of each row of ``score`` (R, C),
    as block indices ``col0 + j``, best first; -1 where fewer qualify. ``score`` is overwritten;
    ``first`` None: every row from column ``col0``.

    Only the columns outside ``[max(first), min(last))`` can be out of a row's range, so only those are
    masked: in a chunk of consecutive positions of one graph, the few columns past the earliest row's
    last block (masking all of them was 60% of the content proposals' time at 64k tokens)."""
    C = score.size(1)
    lo = 0 if first is None else int(first.max()) - col0
    hi = int(last.min()) - col0  # columns every row may choose: [lo, hi)
    for a, b in ((0, min(max(lo, 0), C)), (min(max(hi, 0), C), C)):  # the slabs that need a mask
        if b > a:
            col = torch.arange(col0 + a, col0 + b, device=score.device)
            out_of_range = col >= last.unsqueeze(1)  # (R, b - a)
            if first is not None:
                out_of_range |= col < first.unsqueeze(1)
            score[:, a:b].masked_fill_(out_of_range, float("-inf"))
    top, pick = score.topk(min(num_blocks, C), dim=1)
    pick = torch.where(torch.isfinite(top), pick + col0 if col0 else pick, -1)
    if C >= num_blocks:  # no padding (a generation step: its ops are most of its cost)
        return pick
    out = torch.full((score.size(0), num_blocks), -1, dtype=torch.long, device=score.device)
    out[:, :C] = pick
    return out


def content_blocks(query: Tensor, token_key: Tensor, position: Tensor, graph_start: Tensor,
                   block_size: int, num_blocks: int, random_scores: bool = False, summary: str = "mean") -> Tensor:
    r"""The ``num_blocks`` best complete blocks before each destination (NSA / MoBA-style proposals).

    Tokens are cut into blocks of ``block_size`` per graph (:func:`block_summaries`).
    Destination ``m`` at position ``p`` scores the blocks with ``jB + B <= p`` by
    ``<q_m, k_block>`` (``summary``: :func:`summarize_blocks`) and takes the best ones
    (:func:`best_blocks`). The block
    summaries share ``W_k`` with the token scores, so they sharpen as the
    token-level competition learns.

    Args:
        query (Tensor): (M, r) destination queries (one per token position, in token order).
        token_key (Tensor): (num_tokens, r) token keys.
        position (Tensor): (num_tokens,) position of each token in its graph.
        graph_start (Tensor): (num_tokens,) global index of each token's graph's first token.
        block_size (int): B.
        num_blocks (int): blocks kept per destination.
        random_scores (bool, optional): rank blocks by seeded noise instead. (default: :obj:`False`)
        summary (str, optional): ``"mean"`` or ``"bounds"`` (:func:`summarize_blocks`). (default: :obj:`"mean"`)

    Returns:
        (M, num_blocks) global index of each chosen block's first token, -1 where fewer
        blocks qualify.
    """
    block_start, block_key = block_summaries(token_key.detach(), position, graph_start, block_size, summary)
    first = torch.searchsorted(block_start, graph_start)  # (n,) first block of the row's graph
    last = first + position // block_size  # (n,) one past the last qualifying block
    return best_blocks(summary_query(query.detach(), summary), block_key, block_start, first, last, num_blocks,
                       random_scores)


@torch.no_grad()
def stream_blocks(query: Tensor, stream: Tensor, last: Tensor, block_key: Tensor, num_blocks: int,
                  one_per_stream: bool) -> Tensor:
    """For each query row, the ``num_blocks`` best of its stream's blocks ``j < last`` (as :func:`best_blocks`).

    Args:
        query (Tensor): (M, r'), as :func:`summary_query` gives it.
        stream (Tensor): (M,) stream of each row.
        last (Tensor): (M,) one past the last block each row may choose.
        block_key (Tensor): (J, streams, r') the summaries of every stream's complete blocks.
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
