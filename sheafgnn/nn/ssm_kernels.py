r"""The fused ops of Phi beside the scan: the chain-aware conv and the gated norm.

Used by :class:`~sheafgnn.nn.ssm.SelectiveSSM` (the scan itself is in :mod:`sheafgnn.nn.ssd`).
Every fast path here has a slow, obviously-correct reference that the tests compare it with,
gradients included::

    chain_conv(x, pos, rows, w, b)           SiLU(depthwise causal conv) over padded chains,
                                             saving only its inputs (reference: chain_conv_reference)
    gated_rms_norm(y, z, weight, eps, proj)  RMSNorm(y * SiLU(z)) * weight [@ proj.T] in one op
                                             (reference: nn.RMSNorm(y * F.silu(z)))
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CONV_BLOCK_ROWS = 8192  # rows per block of _ChainConv's backward: (8192, conv_dim) temporaries

__all__ = ["chain_conv", "chain_conv_reference", "chain_layout", "gated_rms_norm"]


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
    layout is rebuilt in backward, and the pre-activation, SiLU' and per-tap products are made there
    :data:`CONV_BLOCK_ROWS` rows at a time (autograd would keep the (L + pad, C) layout and the
    (L, C) pre-activation, and a whole-length temporary per tap would extend the heap at 32k tokens).
    """

    @staticmethod
    def forward(ctx, x: Tensor, pos: Tensor, num_rows: int, w: Tensor, b: Tensor,
                window_rows: Tensor | None, window: Tensor | None) -> Tensor:
        ctx.num_rows = num_rows
        ctx.save_for_backward(x, pos, w, b, window_rows, window)
        xp = chain_layout(x, pos, num_rows, window_rows, window)  # (num_rows, C)
        return F.silu(_taps(xp, w, b).index_select(0, pos - (w.size(1) - 1)), inplace=True)  # (L, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        x, pos, w, b, window_rows, window = ctx.saved_tensors
        K = w.size(1)
        xp = chain_layout(x, pos, ctx.num_rows, window_rows, window)  # (num_rows, C), rebuilt
        n = xp.size(0) - K + 1  # conv rows: row r reads xp[r:r + K]
        g_rows = g.new_zeros(n, g.size(1)).index_copy_(0, pos - (K - 1), g)  # (n, C): zero at padding rows
        need_x, _, _, need_w, need_b, _, need_window = ctx.needs_input_grad
        dxp = torch.zeros_like(xp) if need_x or need_window else None  # (num_rows, C)
        dw = w.new_zeros(w.shape) if need_w else None  # (C, K)
        db = b.new_zeros(b.shape) if need_b else None  # (C,)
        for r0 in range(0, n, CONV_BLOCK_ROWS):
            r1 = min(n, r0 + CONV_BLOCK_ROWS)
            pre = _taps(xp[r0:r1 + K - 1], w, b)  # (R, C), rebuilt
            sig = torch.sigmoid(pre)
            # SiLU'(pre) = sig (1 + pre (1 - sig)), built in pre
            g_pre = pre.mul_(1.0 - sig).add_(1.0).mul_(sig).mul_(g_rows[r0:r1])  # (R, C)
            if need_b:
                db += g_pre.sum(0)
            for k in range(K):
                if dxp is not None:
                    dxp[r0 + k:r1 + k].addcmul_(g_pre, w[:, k])
                if need_w:
                    dw[:, k] += (g_pre * xp[r0 + k:r1 + k]).sum(0)
        dx = dxp.index_select(0, pos) if need_x else None
        dwindow = dxp.index_select(0, window_rows) if need_window else None
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
