r"""Reads of dense candidate pools, lean in memory: the weighted read of the candidates' states and
the query-key dot products (:class:`~sheafgnn.nn.topology.LearnedTopology`'s output pools).

A pool is an (M, P) index tensor ``sources`` into the node rows; gathering its (M, P, D) states or
(M, P, r) keys for autograd would keep ~1 GB per layer at 32k tokens, so each op is one autograd
function that keeps the indices only::

    pool_read(weight, x, sources)   out_m = sum_p w_mp x_{s_mp}      gradient to the weights only
    pool_dot(q, k, sources)         dot_mp = <q_m, k_{s_mp}>          gradients to q and k

and :func:`rule_pools`, which lays candidates listed edge by edge out as such pools.

Where :func:`~sheafgnn.nn.segment.use_spmm`, torch-sparse's CSR SpMM (a pool is a CSR matrix with P
entries per row) runs ``pool_read``'s forward and ``pool_dot``'s backward; elsewhere they gather (in
chunks of rows for ``pool_read``). Each is tested against its plain gather composition.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sheafgnn.nn.segment import csr_transpose, ptr_from_index, use_spmm

POOL_CHUNK_ELEMENTS = 1 << 20  # gathered candidate states per chunk of pool_read (4 MiB in float32)


class _PoolRead(torch.autograd.Function):
    """out = einsum('mp,mpd->md', weight, x[sources]); the gradient reaches ``weight`` only (``x`` is
    read, not trained). Forward: torch-sparse's CSR SpMM where :func:`~sheafgnn.nn.segment.use_spmm`
    (it never gathers the states), else the gather a chunk of rows at a time. Backward: the chunked
    gather again, with an einsum per chunk (torch-sparse's value gradient runs on one thread: 2x slower
    at 32k tokens on 2 threads)."""

    @staticmethod
    def forward(ctx, weight: Tensor, x: Tensor, sources: Tensor) -> Tensor:
        ctx.save_for_backward(x, sources)
        M, P = sources.shape
        if use_spmm():
            rowptr = torch.arange(0, M * P + 1, P, device=x.device)  # (M + 1,): rows of P entries
            # detached: torch-sparse asks for its backward's index arrays whenever an input requires grad,
            # also under no_grad (this backward is ours)
            return torch.ops.torch_sparse.spmm_sum(None, rowptr, sources.flatten(), weight.detach().flatten(), None,
                                                   None, x.detach())
        rows = _pool_chunk(sources, x)
        out = x.new_empty(M, x.size(1))  # (M, D)
        for m0 in range(0, M, rows):
            out[m0 : m0 + rows] = torch.einsum("mp,mpd->md", weight[m0 : m0 + rows], x[sources[m0 : m0 + rows]])
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        x, sources = ctx.saved_tensors
        rows = _pool_chunk(sources, x)
        grad_weight = torch.zeros(sources.shape, dtype=x.dtype, device=x.device)  # (M, P)
        for m0 in range(0, sources.size(0), rows):
            grad_weight[m0 : m0 + rows] = torch.einsum("md,mpd->mp", grad_out[m0 : m0 + rows],
                                                       x[sources[m0 : m0 + rows]])
        return grad_weight, None, None


def _pool_chunk(sources: Tensor, x: Tensor) -> int:
    return max(1, POOL_CHUNK_ELEMENTS // max(1, sources.size(1) * x.size(1)))


def pool_read(weight: Tensor, x: Tensor, sources: Tensor) -> Tensor:
    r"""The weighted read of dense pools, :math:`\mathbf{out}_m = \sum_p w_{mp} \mathbf{x}_{s_{mp}}`,
    differentiable in ``weight`` only, with memory :math:`O(M P)` besides ``x``: the
    :math:`(M, P, D)` candidate states are gathered a chunk of rows at a time, in forward and
    again in backward (autograd would keep them all, ~1 GB per layer at 32k tokens).

    Args:
        weight (Tensor): (M, P) weights.
        x (Tensor): (N, D) states (their gradient is not computed: pass them detached).
        sources (Tensor): (M, P) indices into ``x``.

    Returns:
        (M, D); equal to ``(weight.unsqueeze(-1) * x[sources]).sum(1)`` up to float rounding. The
        forward is one torch-sparse CSR SpMM (rows of ``P`` entries, values ``weight``) where
        :func:`~sheafgnn.nn.segment.use_spmm` says so (:class:`_PoolRead`).
    """
    if weight.shape != sources.shape or x.dim() != 2:
        raise ValueError(f"pool_read: expected weight and sources (M, P) and x (N, D) (got {tuple(weight.shape)}, "
                         f"{tuple(sources.shape)}, {tuple(x.shape)})")
    return _PoolRead.apply(weight, x, sources)


class _PoolDot(torch.autograd.Function):
    """dot[m, p] = <q_m, k_{s_mp}> as one bmm over the gathered keys. Backward: where
    :func:`~sheafgnn.nn.segment.use_spmm`, two torch-sparse CSR SpMMs that gather no (M, P, r) keys,
    ``grad_q = G k`` and ``grad_k = G^T q`` with ``G`` the (M, N) matrix of the entries ``g_mp`` at
    columns ``s_mp`` (4x faster at 32k tokens); else the keys gathered again and an index_add."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, sources: Tensor) -> Tensor:
        ctx.save_for_backward(q, k, sources)
        # a chunk of rows at a time: the whole (M, P, r) gather was the step's largest temporary (120 MiB
        # per layer at 32k tokens), and a temporary that fits no hole of the heap extends it
        rows = _pool_chunk(sources, k)
        out = q.new_empty(sources.shape)  # (M, P)
        for m0 in range(0, sources.size(0), rows):
            torch.bmm(k[sources[m0 : m0 + rows]], q[m0 : m0 + rows].unsqueeze(2), out=out[m0 : m0 + rows].unsqueeze(2))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, sources = ctx.saved_tensors
        if use_spmm():
            return (*_spmm_pool_dot_grads(grad, q, k, sources, *ctx.needs_input_grad[:2]), None)
        grad_q = torch.bmm(grad.unsqueeze(1), k[sources]).squeeze(1) if ctx.needs_input_grad[0] else None  # (M, r)
        grad_k = None
        if ctx.needs_input_grad[1]:  # scatter g_mp q_m to the sources: an index_add
            per_candidate = (grad.unsqueeze(2) * q.unsqueeze(1)).flatten(0, 1)  # (M P, r)
            grad_k = torch.zeros_like(k).index_add_(0, sources.flatten(), per_candidate)
        return grad_q, grad_k, None


def _spmm_pool_dot_grads(grad: Tensor, q: Tensor, k: Tensor, sources: Tensor, need_q: bool,
                         need_k: bool) -> tuple[Tensor | None, Tensor | None]:
    """(grad_q (M, r), grad_k (N, r)) of :class:`_PoolDot` as CSR SpMMs of ``G`` (rows m: P entries
    ``grad[m, p]`` at columns ``sources[m, p]``) and of its transpose (the entries sorted by column)."""
    M, P = sources.shape
    # detached: torch-sparse asks for its own backward's index arrays whenever an input requires grad
    value, col, q, k = grad.detach().contiguous().flatten(), sources.flatten(), q.detach(), k.detach()  # e = m P + p
    spmm = torch.ops.torch_sparse.spmm_sum
    grad_q = grad_k = None
    if need_q:
        rowptr = torch.arange(0, M * P + 1, P, device=q.device)  # (M + 1,)
        grad_q = spmm(None, rowptr, col, value, None, None, k.contiguous())  # (M, r)
    if need_k:
        order, colptr = csr_transpose(col, k.size(0))  # (M P,): the entries by source, (N + 1,)
        grad_k = spmm(None, colptr, order.div(P, rounding_mode="floor"), value[order], None, None,
                      q.contiguous())  # (N, r): entry e's row is e // P
    return grad_q, grad_k


def pool_dot(q: Tensor, k: Tensor, sources: Tensor) -> Tensor:
    r"""The query-key dot products of dense pools, :math:`\mathrm{dot}_{mp} = \langle \mathbf{q}_m,
    \mathbf{k}_{s_{mp}} \rangle`, differentiable in ``q`` and ``k``. Autograd keeps ``q``, ``k`` and
    ``sources`` only, not the :math:`(M, P, r)` gathered keys (a quarter of a GB per layer at 32k tokens):
    backward runs two SpMMs where :func:`~sheafgnn.nn.segment.use_spmm`, else gathers the keys again.

    Args:
        q (Tensor): (M, r) queries.
        k (Tensor): (N, r) keys.
        sources (Tensor): (M, P) indices into ``k`` (no padding: clamp it first).

    Returns:
        (M, P); equal to ``(q.unsqueeze(1) * k[sources]).sum(-1)`` up to float rounding.
    """
    if q.dim() != 2 or k.dim() != 2 or sources.dim() != 2 or q.size(0) != sources.size(0) or q.size(1) != k.size(1):
        raise ValueError(f"pool_dot: expected q (M, r), k (N, r) and sources (M, P) (got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(sources.shape)})")
    if not torch.is_grad_enabled() and _pool_chunk(sources, k) >= sources.size(0):  # e.g. a generation step
        return torch.bmm(k[sources], q.unsqueeze(2)).squeeze(2)  # one chunk: the function's call costs more
    return _PoolDot.apply(q, k, sources)


def rule_pools(src: Tensor, dst: Tensor, edge_type: Tensor, num_dst: int) -> tuple[Tensor, Tensor]:
    """Rule candidates listed edge by edge -> one padded row per destination.

    Args:
        src (Tensor): (E,) source of each candidate.
        dst (Tensor): (E,) its destination in ``[0, num_dst)``, sorted.
        edge_type (Tensor): (E,)
        num_dst (int): destinations.

    Returns:
        sources (num_dst, W) (-1: padding) and their edge types (num_dst, W), in edge order;
        W is the largest in-degree.
    """
    ptr = ptr_from_index(dst, num_dst)
    width = int(ptr.diff().max()) if num_dst else 0
    slot = torch.arange(src.numel(), device=src.device) - ptr[dst]
    sources = torch.full((num_dst, width), -1, dtype=torch.long, device=src.device)
    sources[dst, slot] = src
    types = torch.zeros_like(sources)
    types[dst, slot] = edge_type
    return sources, types
