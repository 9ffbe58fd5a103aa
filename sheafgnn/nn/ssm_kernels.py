r"""The kernels of Phi: the chunked SSD scan, its sequential reference, and two fused ops.

Used by :class:`~sheafgnn.nn.ssm.SelectiveSSM`. Every fast path here has a
slow, obviously-correct reference that the tests compare it with, gradients
included::

    ssd_scan(x, dt, A, B, C, reset)          chunked parallel scan (SSD, Mamba-2)
      per chain, per head h, the recurrence
        h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T ... (P, N)   h = 0 at a chain start
        y_t = h_t C_t .................................. (P,)
      computed by chunks of Q steps (state space duality):
        intra-chunk: quadratic form with a segment-sum of log decays (T, H, Q, Q)
                     (_IntraChunk: fused backward, nothing (T, H, Q, Q) saved)
        chunk states: (T, H, P, N), passed between chunks by an odd-even scan
        T = ceil(L / Q) chunks; cost O(L Q H + T H P N), no (L, L) tensor.
    ssd_scan_sequential(...)                 reference: the plain per-step recurrence
    chain_conv(x, pos, rows, w, b)           SiLU(depthwise causal conv) over padded chains,
                                             saving only its inputs (reference: chain_conv_reference)
    gated_rms_norm(y, z, weight, eps, proj)  RMSNorm(y * SiLU(z)) * weight [@ proj.T] in one op
                                             (reference: nn.RMSNorm(y * F.silu(z)))

A chain is a run of the flat length axis that starts where ``reset`` is
``True``; element 0 always starts one, and no state crosses a chain start.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

INTRA_BLOCK_ELEMENTS = 1 << 22  # (T_b, H, Q, Q) elements per block of _IntraChunk (16 MiB in float32)

__all__ = [
    "chain_conv",
    "chain_conv_reference",
    "chain_layout",
    "chain_starts",
    "gated_rms_norm",
    "ssd_scan",
    "ssd_scan_sequential",
]


def _check_scan_inputs(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                       reset: Tensor | None, chunk_size: int) -> None:
    if x.dim() != 3:
        raise ValueError(f"ssd_scan: x must have shape (L, H, P) (got {tuple(x.shape)})")
    L, H, _ = x.shape
    if dt.shape != (L, H):
        raise ValueError(f"ssd_scan: dt must have shape (L, H) = {(L, H)} "
                         f"(got {tuple(dt.shape)})")
    if A.shape != (H,):
        raise ValueError(f"ssd_scan: A must have shape (H,) = {(H,)} (got {tuple(A.shape)})")
    if B.dim() != 2 or B.shape[0] != L or C.shape != B.shape:
        raise ValueError(f"ssd_scan: B and C must both have shape (L, N) with L={L} "
                         f"(got {tuple(B.shape)} and {tuple(C.shape)})")
    if reset is not None and (reset.shape != (L,) or reset.dtype != torch.bool):
        raise ValueError(f"ssd_scan: reset must be a bool tensor of shape (L,) = {(L,)} "
                         f"(got {reset.dtype} {tuple(reset.shape)})")
    if chunk_size < 1:
        raise ValueError(f"ssd_scan: chunk_size must be positive (got {chunk_size})")


def chain_starts(reset: Tensor | None, L: int, device: torch.device) -> Tensor:
    """The chain starts of a flat stream of length ``L``: ``reset`` with element 0
    forced to ``True`` (``None``: one chain). Bool (L,)."""
    first = torch.ones(min(L, 1), dtype=torch.bool, device=device)  # (1,)
    if reset is None:
        rest = torch.zeros(max(L - 1, 0), dtype=torch.bool, device=device)  # (L-1,)
    else:
        rest = reset[1:]  # (L-1,)
    return torch.cat([first, rest])  # (L,)


def _linear_scan(g: Tensor, s: Tensor) -> Tensor:
    r"""Inclusive scan of ``h_c = g_c h_{c-1} + s_c`` with ``h_{-1} = 0``.

    Odd-even (work-efficient) parallel scan: pairs are combined, the half as
    long problem is solved recursively, and the even positions are filled in.
    ``O(T)`` work and memory, ``O(log T)`` vectorised steps, plain autograd.

    Shapes:
        - **input:** decays g (T, H), states s (T, H, P, N)
        - **output:** h (T, H, P, N)
    """
    T = g.size(0)
    if T <= 1:
        return s
    if T % 2 == 1:  # pad with a no-op step (g = 1, s = 0)
        g = torch.cat([g, g.new_ones(1, *g.shape[1:])])  # (T+1, H)
        s = torch.cat([s, s.new_zeros(1, *s.shape[1:])])  # (T+1, H, P, N)
    g_even, g_odd = g[0::2], g[1::2]  # (T2, H)
    s_even, s_odd = s[0::2], s[1::2]  # (T2, H, P, N)
    g_pair = g_odd * g_even  # (T2, H)
    s_pair = g_odd[..., None, None] * s_even + s_odd  # (T2, H, P, N)
    h_odd = _linear_scan(g_pair, s_pair)  # (T2, H, P, N): h at 1, 3, 5, ...
    h_prev = torch.cat([torch.zeros_like(h_odd[:1]), h_odd[:-1]])  # (T2, H, P, N)
    h_even = g_even[..., None, None] * h_prev + s_even  # (T2, H, P, N)
    h = torch.stack([h_even, h_odd], dim=1).flatten(0, 1)  # (2*T2, H, P, N)
    return h[:T]



def chain_layout(x: Tensor, pos: Tensor, num_rows: int, window_rows: Tensor | None = None,
                 window: Tensor | None = None) -> Tensor:
    """The padded layout of chains for a causal conv: row ``pos[i]`` holds ``x[i]``, the rows
    ``window_rows`` hold ``window`` (a chain's inputs before its start, or zeros), the rest zeros.

    Shapes:
        - **input:** x (L, C), pos (L,), window_rows (R,), window (R, C)
        - **output:** (num_rows, C)
    """
    xp = x.new_zeros(num_rows, x.size(1)).index_copy_(0, pos, x)  # (num_rows, C)
    if window is not None:
        xp.index_copy_(0, window_rows, window)
    return xp


def _taps(xp: Tensor, w: Tensor, b: Tensor) -> Tensor:
    """``b + sum_k w[:, k] xp[r + k]`` for every row ``r`` that has ``K`` rows from it on: (num_rows - K + 1, C)."""
    K = w.size(1)
    n = xp.size(0) - K + 1
    out = torch.addcmul(b, xp[:n], w[:, 0])  # (n, C)
    for k in range(1, K):
        out.addcmul_(xp[k:k + n], w[:, k])
    return out


class _ChainConv(torch.autograd.Function):
    r"""``SiLU(b + sum_k w[:, k] xp[pos_i - K + 1 + k])`` with ``xp = chain_layout(x, ...)``.

    Saves only its inputs (``x`` is a view of the SSM's input projection, kept anyway): the padded
    layout, the pre-activation and the per-tap products are rebuilt in backward instead of stored
    (autograd would keep the (L + pad, C) layout and the (L, C) pre-activation).
    """

    @staticmethod
    def forward(ctx, x: Tensor, pos: Tensor, num_rows: int, w: Tensor, b: Tensor,
                window_rows: Tensor | None, window: Tensor | None) -> Tensor:
        ctx.num_rows = num_rows
        ctx.save_for_backward(x, pos, w, b, window_rows, window)
        xp = chain_layout(x, pos, num_rows, window_rows, window)  # (num_rows, C)
        return F.silu(_taps(xp, w, b).index_select(0, pos - (w.size(1) - 1)))  # (L, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, pos, w, b, window_rows, window = ctx.saved_tensors
        K = w.size(1)
        xp = chain_layout(x, pos, ctx.num_rows, window_rows, window)  # (num_rows, C), rebuilt
        rows = pos - (K - 1)  # (L,): the conv row of every element
        pre = _taps(xp, w, b).index_select(0, rows)  # (L, C), rebuilt
        sig = torch.sigmoid(pre)
        g_pre = g * sig.mul_(1.0 + pre * (1.0 - sig))  # (L, C): SiLU'(pre) = sig (1 + pre (1 - sig))
        n = xp.size(0) - K + 1
        g_rows = g.new_zeros(n, g.size(1)).index_copy_(0, rows, g_pre)  # (n, C): zero at padding rows
        need_x, _, _, need_w, need_b, _, need_window = ctx.needs_input_grad
        dx = dw = db = dwindow = None
        if need_x or need_window:
            dxp = torch.zeros_like(xp)  # (num_rows, C)
            for k in range(K):
                dxp[k:k + n].addcmul_(g_rows, w[:, k])
            dx = dxp.index_select(0, pos) if need_x else None
            dwindow = dxp.index_select(0, window_rows) if need_window else None
        if need_w:
            dw = torch.stack([(g_rows * xp[k:k + n]).sum(0) for k in range(K)], dim=1)  # (C, K)
        if need_b:
            db = g_pre.sum(0)  # (C,)
        return dx, None, None, dw, db, None, dwindow


class _GatedRMSNorm(torch.autograd.Function):
    r"""``RMSNorm(y * SiLU(z)) * weight`` in one op (the gated norm of Mamba-2), optionally followed
    by the output projection ``@ proj.T``.

    Saves only ``y``, ``z`` and the per-row ``1/rms`` (and ``proj``); the gate and the normalised
    rows are rebuilt in backward instead of being stored (with ``proj``, autograd would also keep
    the normed rows for the projection's weight gradient).

    Shapes:
        - **input:** y (L, C), z (L, C), weight (C,), proj (D, C) or None
        - **output:** (L, C), or (L, D) with ``proj``
    """

    @staticmethod
    def forward(ctx, y: Tensor, z: Tensor, weight: Tensor, eps: float, proj: Tensor | None) -> Tensor:
        g = F.silu(z).mul_(y)  # (L, C)
        # the mean square from the row norm: no (L, C) temporary of squares
        rstd = torch.linalg.vector_norm(g, dim=-1, keepdim=True).square_().div_(g.size(-1)).add_(eps).rsqrt_()  # (L, 1)
        ctx.save_for_backward(y, z, weight, rstd, proj)
        out = g.mul_(rstd).mul_(weight)  # (L, C)
        return out if proj is None else out @ proj.t()  # (L, C) or (L, D)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go: Tensor):
        y, z, weight, rstd, proj = ctx.saved_tensors
        # in place wherever it can be: each (L, C) temporary of a long context may extend the heap
        sig = torch.sigmoid(z)  # (L, C)
        s = z * sig  # (L, C): SiLU(z)
        n = (y * s).mul_(rstd)  # (L, C): normalised rows
        dproj = None
        if proj is not None:
            # go^T (n * weight) = (go^T n) * weight: the scaling on the small (D, C) product
            dproj = (go.t() @ n).mul_(weight) if ctx.needs_input_grad[4] else None  # (D, C)
            go = go @ proj  # (L, C): the gradient at the norm's output
        dw = (go * n).sum(dim=0) if ctx.needs_input_grad[2] else None  # (C,)
        gw = go * weight  # (L, C)
        dot = (gw * n).mean(dim=-1, keepdim=True)  # (L, 1)
        dg = gw.sub_(n.mul_(dot)).mul_(rstd)  # (L, C): d(y * SiLU(z))
        dy = dg * s if ctx.needs_input_grad[0] else None  # (L, C)
        dz = None
        if ctx.needs_input_grad[1]:  # SiLU'(z) = sig (1 + z (1 - sig)) = sig (1 + z - s), built in s
            dz = dg.mul_(y).mul_(s.neg_().add_(z).add_(1.0).mul_(sig))  # (L, C)
        return dy, dz, dw, None, dproj


class _IntraChunk(torch.autograd.Function):
    r"""Intra-chunk SSD term ``y = (CB * exp(seg)) @ xdt`` with
    ``seg_ij = a_cum_i - a_cum_j`` where ``keep`` and ``-inf`` elsewhere
    (computed as ``(CB * keep) * exp(where(keep, seg, 0))``).

    Fused forward/backward: the (T, H, Q, Q) decay matrix is built in place and
    rebuilt in backward from the small inputs instead of being stored (as the
    Mamba-2 kernels do), so no (T, H, Q, Q) tensor is saved for backward. With
    ``M = CB * exp(seg)``: ``dseg = dM * M``, ``dCB = sum_h dM * exp(seg)``.

    Shapes:
        - **input:** CB (T, Q, Q), a_cum (T, H, Q), keep (T, Q, Q) bool,
          xdt (T, H, Q, P)
        - **output:** y (T, H, Q, P)
    """

    @staticmethod
    def _decay(a_cum: Tensor, keep: Tensor) -> Tensor:
        # Masked entries get seg = 0 (exp = 1) and are zeroed by the masked CB;
        # exp(-inf) and exp(+large) take a slow path on CPU, exp(0) does not.
        seg = a_cum.unsqueeze(-1) - a_cum.unsqueeze(-2)  # (T, H, Q, Q)
        seg.masked_fill_(~keep.unsqueeze(1), 0.0)
        return seg.exp_()  # (T, H, Q, Q): 1 where masked

    @staticmethod
    def _blocks(a_cum: Tensor) -> range:
        """Starts of the blocks of chunks whose (T_b, H, Q, Q) temporaries hold about
        :data:`INTRA_BLOCK_ELEMENTS` elements: at 32k tokens a whole (T, H, Q, Q) tensor is 64 MiB,
        and each one that fits no hole of the heap extends it."""
        T, H, Q = a_cum.shape
        return range(0, T, max(1, INTRA_BLOCK_ELEMENTS // (H * Q * Q)))

    @staticmethod
    def forward(ctx, CB: Tensor, a_cum: Tensor, keep: Tensor, xdt: Tensor) -> Tensor:
        CBm = CB * keep  # (T, Q, Q): zero outside the causal same-chain mask
        ctx.save_for_backward(CBm, a_cum, keep, xdt)
        blocks = _IntraChunk._blocks(a_cum)
        y = xdt.new_empty(xdt.shape)  # (T, H, Q, P)
        for t0 in blocks:
            t = slice(t0, t0 + blocks.step)
            M = _IntraChunk._decay(a_cum[t], keep[t]).mul_(CBm[t].unsqueeze(1))  # (T_b, H, Q, Q)
            torch.matmul(M, xdt[t], out=y[t])
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor):
        CBm, a_cum, keep, xdt = ctx.saved_tensors
        need_cb, need_a, _, need_xdt = ctx.needs_input_grad
        dCB = torch.empty_like(CBm) if need_cb else None  # (T, Q, Q)
        da = torch.empty_like(a_cum) if need_a else None  # (T, H, Q)
        dxdt = torch.empty_like(xdt) if need_xdt else None  # (T, H, Q, P)
        blocks = _IntraChunk._blocks(a_cum)
        for t0 in blocks:
            t = slice(t0, t0 + blocks.step)
            decay = _IntraChunk._decay(a_cum[t], keep[t])  # (T_b, H, Q, Q)
            dM = gy[t] @ xdt[t].transpose(-1, -2)  # (T_b, H, Q, Q)
            if need_cb:
                torch.sum(dM * decay, dim=1, out=dCB[t]).mul_(keep[t])  # (T_b, Q, Q)
            M = decay.mul_(CBm[t].unsqueeze(1))  # (T_b, H, Q, Q): zero where masked
            if need_xdt:
                torch.matmul(M.transpose(-1, -2), gy[t], out=dxdt[t])  # (T_b, H, Q, P)
            if need_a:
                dseg = dM.mul_(M)  # (T_b, H, Q, Q): zero where masked
                torch.sub(dseg.sum(dim=-1), dseg.sum(dim=-2), out=da[t])  # (T_b, H, Q)
        return dCB, da, None, dxdt



def chain_conv(x: Tensor, pos: Tensor, num_rows: int, w: Tensor, b: Tensor,
               window_rows: Tensor | None = None, window: Tensor | None = None) -> Tensor:
    r"""SiLU of a depthwise causal conv over chains laid out with ``K - 1`` rows before each chain
    (:func:`chain_layout`): ``SiLU(b + sum_k w[:, k] xp[pos_i - K + 1 + k])`` for every element
    ``i``, in one op that saves only its inputs (:class:`_ChainConv`; reference:
    :func:`chain_conv_reference`).

    Shapes:
        - **input:** x (L, C), pos (L,) rows of the layout (each >= K - 1), w (C, K), b (C,),
          window_rows (R,), window (R, C)
        - **output:** (L, C)
    """
    return _ChainConv.apply(x, pos, num_rows, w, b, window_rows, window)


def chain_conv_reference(x: Tensor, pos: Tensor, num_rows: int, w: Tensor, b: Tensor,
                         window_rows: Tensor | None = None, window: Tensor | None = None) -> Tensor:
    """:func:`chain_conv` as the plain composition: layout, a sum of shifted slices, SiLU."""
    xp = x.new_zeros(num_rows, x.size(1)).index_copy(0, pos, x)
    if window is not None:
        xp = xp.index_copy(0, window_rows, window)
    K = w.size(1)
    n = num_rows - K + 1
    pre = b + sum(w[:, k] * xp[k:k + n] for k in range(K))  # (n, C)
    return F.silu(pre[pos - (K - 1)])


def gated_rms_norm(y: Tensor, z: Tensor, weight: Tensor, eps: float, proj: Tensor | None = None) -> Tensor:
    r"""``RMSNorm(y * SiLU(z)) * weight``, then ``@ proj.T`` if given, in one op that saves only
    ``y``, ``z``, ``1/rms`` (and ``proj``) for backward (see :class:`_GatedRMSNorm`). Without
    gradients it is the plain composition: nothing is saved then, and an autograd function's call
    costs more than the whole norm on the few rows of a generation step.

    Shapes:
        - **input:** y (L, C), z (L, C), weight (C,), proj (D, C)
        - **output:** (L, C), or (L, D) with ``proj``
    """
    if not torch.is_grad_enabled():
        out = F.rms_norm(y * F.silu(z), weight.shape, weight, eps)
        return out if proj is None else F.linear(out, proj)
    return _GatedRMSNorm.apply(y, z, weight, eps, proj)


def _scan_precision(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The scan's inputs in float32 when ``x`` (the first) is half precision: log decays need fp32,
    as in Mamba."""
    if tensors[0].dtype in (torch.float16, torch.bfloat16):
        return tuple(t.float() for t in tensors)
    return tensors


def ssd_scan(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
             reset: Tensor | None = None, chunk_size: int = 64,
             return_final_state: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    r"""Chunked parallel selective scan (SSD, Mamba-2) over many chains.

    Computes, for each head :math:`h` and each chain independently,

    .. math::
        \mathbf{h}_t = e^{\Delta_t A_h} \mathbf{h}_{t-1}
        + \Delta_t \mathbf{x}_t \mathbf{B}_t^{\top}, \qquad
        \mathbf{y}_t = \mathbf{h}_t \mathbf{C}_t,

    with :math:`\mathbf{h} = 0` before each chain start. Within a chunk of
    ``chunk_size`` steps the map is the masked quadratic form
    :math:`y_i = \sum_{j \le i} (C_i^{\top} B_j)\, e^{\sum_{j<k\le i}\Delta_k A}
    \Delta_j x_j`; chunk-final states are passed between chunks by a
    vectorised odd-even scan. Time and memory are linear in ``L``. As in the
    Mamba-2 kernels, a segment sum of log decays is a difference of in-chunk
    cumulative sums; half-precision inputs are scanned in float32.

    Args:
        x (Tensor): SSM input, split into heads.
        dt (Tensor): positive step sizes (after softplus).
        A (Tensor): per-head decay rates; negative for a stable recurrence.
        B (Tensor): input projections onto the state, shared across heads.
        C (Tensor): output projections from the state, shared across heads.
        reset (BoolTensor, optional): ``True`` at the first element of each
            chain; element 0 is always a chain start. ``None`` means one
            chain. (default: :obj:`None`)
        chunk_size (int, optional): scan chunk length. (default: :obj:`64`)
        return_final_state (bool, optional): also return the state after the
            last element (the state of the last chain). (default: :obj:`False`)

    Shapes:
        - **input:** x (L, H, P), dt (L, H), A (H,), B (L, N), C (L, N),
          reset (L,)
        - **output:** y (L, H, P); with ``return_final_state`` also the final
          state (H, P, N)
    """
    _check_scan_inputs(x, dt, A, B, C, reset, chunk_size)
    L, H, P = x.shape
    N = B.size(1)
    if L == 0:
        y = x.new_zeros(0, H, P)  # (0, H, P)
        return (y, x.new_zeros(H, P, N)) if return_final_state else y

    out_dtype = x.dtype
    x, dt, A, B, C = _scan_precision(x, dt, A, B, C)
    starts = chain_starts(reset, L, x.device)  # (L,)
    x, dt, B, C, starts = _pad_to_chunks(chunk_size, x, dt, B, C, starts)  # length T*Q
    y, h_end = _scan_chunks(x, dt, A, B, C, starts, chunk_size)  # (T*Q, H, P), (T, H, P, N)
    y = y[:L].to(out_dtype)  # (L, H, P)
    if return_final_state:
        return y, h_end[-1].to(out_dtype)  # (L, H, P), (H, P, N)
    return y


def ssd_scan_chains(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, reset: Tensor | None,
                    initial_state: Tensor, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    r""":func:`ssd_scan` with a given state before each chain, returning every chain's final state.

    Chain :math:`c` starts from :math:`\mathbf{h} = \mathbf{h}^{(c)}_0` instead of zero (the
    continuation of a chain scanned before, e.g. by a stream). Each chain is laid out on
    whole chunks (padded with no-op steps), so a chunk belongs to one chain: its initial
    state enters where the chain's first chunk begins, and the state at the end of a
    chain's last chunk is its final state. The chunk length is ``chunk_size``, or the
    longest chain rounded up to a power of two if that is shorter (short chains, as in
    generation, are not padded to a whole ``chunk_size``).

    Shapes:
        - **input:** as :func:`ssd_scan`, plus initial_state (num_chains, H, P, N)
        - **output:** y (L, H, P), final states (num_chains, H, P, N)
    """
    _check_scan_inputs(x, dt, A, B, C, reset, chunk_size)
    L, H, P = x.shape
    N = B.size(1)
    starts = chain_starts(reset, L, x.device)  # (L,)
    first = torch.nonzero(starts).squeeze(1)  # (num_chains,)
    if initial_state.shape != (first.numel(), H, P, N):
        raise ValueError(f"ssd_scan_chains: initial_state must have shape {(first.numel(), H, P, N)} "
                         f"(got {tuple(initial_state.shape)})")
    out_dtype = x.dtype
    x, dt, A, B, C, initial_state = _scan_precision(x, dt, A, B, C, initial_state)
    length = torch.diff(first, append=first.new_tensor([L]))  # (num_chains,)
    Q = min(chunk_size, 1 << (int(length.max()) - 1).bit_length())
    chunks = (length + Q - 1) // Q  # (num_chains,) whole chunks per chain
    chunk_start = torch.cumsum(chunks, 0) - chunks  # (num_chains,) first chunk of each chain
    chain = starts.long().cumsum(0) - 1  # (L,)
    slot = chunk_start[chain] * Q + torch.arange(L, device=x.device) - first[chain]  # (L,) padded position
    T = int(chunks.sum())

    def spread(t: Tensor) -> Tensor:  # (L, *) -> (T*Q, *), zeros (no-op steps) in the padding
        return t.new_zeros((T * Q, *t.shape[1:])).index_copy(0, slot, t)

    h0 = initial_state.new_zeros(T, H, P, N).index_copy(0, chunk_start, initial_state)  # (T, H, P, N)
    y, h_end = _scan_chunks(spread(x), spread(dt), A, spread(B), spread(C), spread(starts), Q, h0)
    final = h_end[chunk_start + chunks - 1]  # (num_chains, H, P, N)
    return y[slot].to(out_dtype), final.to(out_dtype)


def _pad_to_chunks(Q: int, x: Tensor, dt: Tensor, B: Tensor, C: Tensor,
                   starts: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Pads the length to a multiple of ``Q`` with no-op steps:
    dt = 0 (decay 1), x = B = C = 0, no reset."""
    pad = -x.size(0) % Q
    if not pad:
        return x, dt, B, C, starts
    return (F.pad(x, (0, 0, 0, 0, 0, pad)),  # (T*Q, H, P)
            F.pad(dt, (0, 0, 0, pad)),  # (T*Q, H)
            F.pad(B, (0, 0, 0, pad)),  # (T*Q, N)
            F.pad(C, (0, 0, 0, pad)),  # (T*Q, N)
            F.pad(starts, (0, pad)))  # (T*Q,)


def _scan_chunks(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, starts: Tensor,
                 Q: int, h0: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """:func:`ssd_scan` on a length that is a multiple of ``Q``.

    With ``h0`` (T, H, P, N), chains are laid out on whole chunks (:func:`ssd_scan_chains`) and a chunk
    whose first step starts a chain starts from its ``h0`` row instead of zero.

    Returns the outputs (T*Q, H, P) and the state at the end of every chunk (T, H, P, N).
    """
    T = x.size(0) // Q  # number of chunks
    H, P, N = x.size(1), x.size(2), B.size(1)
    xdt = (x * dt.unsqueeze(-1)).view(T, Q, H, P).transpose(1, 2).contiguous()  # (T, H, Q, P)
    Bc = B.view(T, 1, Q, N)  # (T, 1, Q, N)
    Cc = C.view(T, 1, Q, N)  # (T, 1, Q, N)
    startc = starts.view(T, Q)  # (T, Q)
    chain = startc.long().cumsum(dim=1)  # (T, Q): chain index within the chunk
    a = (dt * A).view(T, Q, H).transpose(1, 2)  # (T, H, Q): log decay per step
    a_cum = a.cumsum(dim=-1)  # (T, H, Q): a_0 + ... + a_i within the chunk

    # 1. intra-chunk: y_i += sum_{j <= i, same chain} (C_i.B_j) exp(a_{j+1..i}) dt_j x_j
    #    The segment sum a_{j+1..i} is a_cum_i - a_cum_j, as in the Mamba-2 kernels;
    #    masked entries are set to -inf BEFORE exp, so no inf reaches autograd.
    causal = torch.ones(Q, Q, dtype=torch.bool, device=x.device).tril()  # (Q, Q)
    keep = (chain.unsqueeze(2) == chain.unsqueeze(1)) & causal  # (T, Q, Q)
    CB = C.view(T, Q, N) @ B.view(T, Q, N).transpose(-1, -2)  # (T, Q, Q), shared by heads
    y = _IntraChunk.apply(CB, a_cum, keep, xdt)  # (T, H, Q, P)

    # 2. chunk states: what each chunk leaves behind for the chain it ends in
    in_last = chain == chain[:, -1:]  # (T, Q): no chain start in (j, Q-1]
    to_end = a_cum[..., -1:] - a_cum  # (T, H, Q): a_{j+1} + ... + a_{Q-1}
    to_end = to_end.masked_fill(~in_last.unsqueeze(1), -math.inf)  # (T, H, Q)
    # weight B (N wide) rather than xdt (P wide): a smaller tensor to make and save
    S = xdt.transpose(-1, -2) @ (torch.exp(to_end).unsqueeze(-1) * Bc)  # (T, H, P, N)

    # 3. pass states between chunks: h_end[c] = g[c] h_end[c-1] + S[c]
    g = torch.exp(a_cum[..., -1])  # (T, H): decay over a whole chunk
    open_chain = chain == 0  # (T, Q): no chain start in [0, i]
    if h0 is not None:  # a chunk is one chain's: a chain's initial state decays through its first chunk
        S = S + g[..., None, None] * h0
        open_chain = torch.ones_like(open_chain)
    g = g.masked_fill(startc.any(dim=1, keepdim=True), 0.0)  # a chain start cuts it
    h_end = _linear_scan(g, S)  # (T, H, P, N)
    h_start = torch.cat([torch.zeros_like(h_end[:1]), h_end[:-1]])  # (T, H, P, N)
    if h0 is not None:
        h_start = torch.where(startc[:, :1, None, None], h0, h_start)

    # 4. inter-chunk: y_i += exp(a_{0..i}) h_start C_i, until the first chain start
    from_start = a_cum.masked_fill(~open_chain.unsqueeze(1), -math.inf)  # (T, H, Q)
    Cw = torch.exp(from_start).unsqueeze(-1) * Cc  # (T, H, Q, N): decay folded into C
    y = torch.baddbmm(y.view(T * H, Q, P), Cw.view(T * H, Q, N),
                      h_start.view(T * H, P, N).transpose(-1, -2)).view(T, H, Q, P)
    return y.transpose(1, 2).reshape(T * Q, H, P), h_end


def ssd_scan_sequential(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                        reset: Tensor | None = None, chunk_size: int = 64,
                        return_final_state: bool = False,
                        ) -> Tensor | tuple[Tensor, Tensor]:
    r"""Reference for :func:`ssd_scan`: the plain recurrence, one step at a time.

    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T`` with ``h = 0`` at each chain
    start, ``y_t = h_t C_t``. Slow (a Python loop over ``L``) and obviously
    correct. Arguments, shapes and outputs are those of :func:`ssd_scan`;
    ``chunk_size`` is accepted for a matching signature and ignored.
    """
    _check_scan_inputs(x, dt, A, B, C, reset, chunk_size)
    L, H, P = x.shape
    N = B.size(1)
    starts = chain_starts(reset, L, x.device).tolist()
    h = x.new_zeros(H, P, N)  # (H, P, N)
    ys = []
    for t in range(L):
        if starts[t]:
            h = x.new_zeros(H, P, N)  # (H, P, N)
        decay = torch.exp(dt[t] * A)  # (H,)
        u = dt[t].unsqueeze(-1) * x[t]  # (H, P)
        h = decay[:, None, None] * h + u.unsqueeze(-1) * B[t]  # (H, P, N)
        ys.append(h @ C[t])  # (H, P)
    y = torch.stack(ys) if ys else x.new_zeros(0, H, P)  # (L, H, P)
    return (y, h) if return_final_state else y
