r"""Phi: the selective state-space recurrence (Mamba-2 / SSD style).

Every chain of states in a batch (the token stream of each graph, each patch
type's chain of patch states in time order) is scanned in ONE flat pass: the
chains are concatenated along the length axis and ``reset`` marks where each
chain starts. State never crosses a chain start.

::

    SelectiveSSM(d_model=D, d_state=N, expand=E, headdim=P, chunk_size=Q)
      x ...................................... (L, D)    reset (L,) bool
      in_proj -> z ........................... (L, E*D)  gate
              -> xBC ......................... (L, E*D + 2N)
              -> dt .......................... (L, H)    H = E*D / P
      xBC -> causal depthwise conv (chain-aware, width d_conv) -> SiLU
          -> x ............................... (L, H, P)
          -> B, C ............................ (L, N)    shared by all heads
      dt  -> softplus(dt + dt_bias) .......... (L, H)
      A = -exp(A_log) ........................ (H,)
      y = ssd_scan(x, dt, A, B, C, reset) .... (L, H, P)
        + D * x .............................. (L, H, P)
      y = RMSNorm(y * SiLU(z)) ............... (L, E*D)
      out_proj ............................... (L, D)

    ssd_scan: per chain, per head h, the recurrence
      h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T ... (P, N)   h = 0 at a chain start
      y_t = h_t C_t .................................. (P,)
    computed by chunks of Q steps (state space duality):
      intra-chunk: quadratic form with a segment-sum of log decays (T, H, Q, Q)
      chunk states: (T, H, P, N), passed between chunks by an odd-even scan
      T = ceil(L / Q) chunks; cost O(L Q H + T H P N), no (L, L) tensor.

``ssd_scan_sequential`` is the plain per-step recurrence beside it; the tests
check that both agree, gradients included. ``SelectiveSSM.step`` runs the same
block recurrently, O(1) per token, for generation.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "SSMState",
    "SelectiveSSM",
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


def _chain_starts(reset: Tensor | None, L: int, device: torch.device) -> Tensor:
    """Bool (L,) with element 0 always a chain start."""
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


class _ShiftConv(torch.autograd.Function):
    r"""Depthwise causal conv over rows: ``out[r] = b + sum_k w[:, k] xp[r + k]``.

    Fused taps (in-place accumulation) with a hand-written backward, so no
    per-tap temporaries are made or saved; only ``xp`` and ``w`` are kept.

    Shapes:
        - **input:** xp (n + K - 1, C), w (C, K), b (C,)
        - **output:** (n, C)
    """

    @staticmethod
    def forward(ctx, xp: Tensor, w: Tensor, b: Tensor) -> Tensor:
        K = w.size(1)
        n = xp.size(0) - K + 1
        out = torch.addcmul(b, xp[:n], w[:, 0])  # (n, C)
        for k in range(1, K):
            out.addcmul_(xp[k:k + n], w[:, k])
        ctx.save_for_backward(xp, w)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g: Tensor):
        xp, w = ctx.saved_tensors
        K = w.size(1)
        n = g.size(0)
        dxp = dw = db = None
        if ctx.needs_input_grad[0]:
            dxp = g.new_zeros(xp.shape)  # (n + K - 1, C)
            for k in range(K):
                dxp[k:k + n].addcmul_(g, w[:, k])
        if ctx.needs_input_grad[1]:
            dw = torch.stack([(g * xp[k:k + n]).sum(0) for k in range(K)], dim=1)  # (C, K)
        if ctx.needs_input_grad[2]:
            db = g.sum(0)  # (C,)
        return dxp, dw, db


class _GatedRMSNorm(torch.autograd.Function):
    r"""``RMSNorm(y * SiLU(z)) * weight`` in one op (the gated norm of Mamba-2).

    Saves only ``y``, ``z`` and the per-row ``1/rms``; the gate and the
    normalised rows are rebuilt in backward instead of being stored.

    Shapes:
        - **input:** y (L, C), z (L, C), weight (C,)
        - **output:** (L, C)
    """

    @staticmethod
    def forward(ctx, y: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
        g = F.silu(z).mul_(y)  # (L, C)
        rstd = torch.rsqrt(g.square().mean(dim=-1, keepdim=True).add_(eps))  # (L, 1)
        ctx.save_for_backward(y, z, weight, rstd)
        return g.mul_(rstd).mul_(weight)  # (L, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, go: Tensor):
        y, z, weight, rstd = ctx.saved_tensors
        sig = torch.sigmoid(z)  # (L, C)
        s = z * sig  # (L, C): SiLU(z)
        n = (y * s).mul_(rstd)  # (L, C): normalised rows
        dw = (go * n).sum(dim=0) if ctx.needs_input_grad[2] else None  # (C,)
        gw = go * weight  # (L, C)
        dot = (gw * n).mean(dim=-1, keepdim=True)  # (L, 1)
        dg = gw.sub_(n.mul_(dot)).mul_(rstd)  # (L, C): d(y * SiLU(z))
        dy = dg * s if ctx.needs_input_grad[0] else None  # (L, C)
        dz = None
        if ctx.needs_input_grad[1]:  # SiLU'(z) = sig (1 + z (1 - sig))
            dz = dg.mul_(y).mul_(sig.mul_(1.0 + z * (1.0 - sig)))  # (L, C)
        return dy, dz, dw, None


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
        E = a_cum.unsqueeze(-1) - a_cum.unsqueeze(-2)  # (T, H, Q, Q)
        E.masked_fill_(~keep.unsqueeze(1), 0.0)
        return E.exp_()  # (T, H, Q, Q): 1 where masked

    @staticmethod
    def forward(ctx, CB: Tensor, a_cum: Tensor, keep: Tensor, xdt: Tensor) -> Tensor:
        CBm = CB * keep  # (T, Q, Q): zero outside the causal same-chain mask
        M = _IntraChunk._decay(a_cum, keep).mul_(CBm.unsqueeze(1))  # (T, H, Q, Q)
        ctx.save_for_backward(CBm, a_cum, keep, xdt)
        return M @ xdt  # (T, H, Q, P)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, gy: Tensor):
        CBm, a_cum, keep, xdt = ctx.saved_tensors
        E = _IntraChunk._decay(a_cum, keep)  # (T, H, Q, Q)
        dM = gy @ xdt.transpose(-1, -2)  # (T, H, Q, Q)
        dCB = None
        if ctx.needs_input_grad[0]:
            dCB = (dM * E).sum(dim=1).mul_(keep)  # (T, Q, Q)
        M = E.mul_(CBm.unsqueeze(1))  # (T, H, Q, Q): zero where masked
        dxdt = M.transpose(-1, -2) @ gy if ctx.needs_input_grad[3] else None  # (T, H, Q, P)
        da = None
        if ctx.needs_input_grad[1]:
            dseg = dM.mul_(M)  # (T, H, Q, Q): zero where masked
            da = dseg.sum(dim=-1) - dseg.sum(dim=-2)  # (T, H, Q)
        return dCB, da, None, dxdt


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
    if out_dtype in (torch.float16, torch.bfloat16):  # log decays need fp32, as in Mamba
        x, dt, A, B, C = (t.float() for t in (x, dt, A, B, C))
    starts = _chain_starts(reset, L, x.device)  # (L,)
    Q = chunk_size
    T = -(-L // Q)  # number of chunks
    pad = T * Q - L
    if pad:  # padded steps: dt = 0 (decay 1), x = B = C = 0, no reset
        x = F.pad(x, (0, 0, 0, 0, 0, pad))  # (T*Q, H, P)
        dt = F.pad(dt, (0, 0, 0, pad))  # (T*Q, H)
        B = F.pad(B, (0, 0, 0, pad))  # (T*Q, N)
        C = F.pad(C, (0, 0, 0, pad))  # (T*Q, N)
        starts = F.pad(starts, (0, pad))  # (T*Q,)

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
    g = g.masked_fill(startc.any(dim=1, keepdim=True), 0.0)  # a chain start cuts it
    h_end = _linear_scan(g, S)  # (T, H, P, N)
    h_start = torch.cat([torch.zeros_like(h_end[:1]), h_end[:-1]])  # (T, H, P, N)

    # 4. inter-chunk: y_i += exp(a_{0..i}) h_start C_i, until the first chain start
    open_chain = chain == 0  # (T, Q): no chain start in [0, i]
    from_start = a_cum.masked_fill(~open_chain.unsqueeze(1), -math.inf)  # (T, H, Q)
    Cw = torch.exp(from_start).unsqueeze(-1) * Cc  # (T, H, Q, N): decay folded into C
    y = torch.baddbmm(y.view(T * H, Q, P), Cw.view(T * H, Q, N),
                      h_start.view(T * H, P, N).transpose(-1, -2)).view(T, H, Q, P)

    y = y.transpose(1, 2).reshape(T * Q, H, P)[:L].to(out_dtype)  # (L, H, P)
    if return_final_state:
        return y, h_end[-1].to(out_dtype)  # (L, H, P), (H, P, N)
    return y


def ssd_scan_sequential(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                        reset: Tensor | None = None, chunk_size: int = 64,
                        return_final_state: bool = False,
                        ) -> Tensor | tuple[Tensor, Tensor]:
    r"""Reference for :func:`ssd_scan`: the plain recurrence, one step at a time.

    ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T`` with ``h = 0`` at each chain
    start, ``y_t = h_t C_t``. Slow (a Python loop over ``L``) and obviously
    correct; ``chunk_size`` is accepted for a matching signature and ignored.

    Shapes:
        - **input:** x (L, H, P), dt (L, H), A (H,), B (L, N), C (L, N),
          reset (L,)
        - **output:** y (L, H, P); with ``return_final_state`` also the final
          state (H, P, N)
    """
    _check_scan_inputs(x, dt, A, B, C, reset, chunk_size)
    L, H, P = x.shape
    N = B.size(1)
    starts = _chain_starts(reset, L, x.device).tolist()
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


class SSMState(NamedTuple):
    """Recurrent state of :class:`SelectiveSSM` for a batch of chains.

    Shapes:
        - **conv:** the last ``d_conv - 1`` conv inputs, oldest first
          (batch, d_conv - 1, d_inner + 2 * d_state)
        - **ssm:** the SSM state (batch, H, P, N)
    """

    conv: Tensor
    ssm: Tensor


class SelectiveSSM(nn.Module):
    r"""Phi: the selective state-space block of Mamba-2 (SSD), made chain-aware.

    From `"Transformers are SSMs: Generalized Models and Efficient Algorithms
    Through Structured State Space Duality" <https://arxiv.org/abs/2405.21060>`_.
    Per head :math:`h` and chain,

    .. math::
        \mathbf{h}_t = e^{\Delta_t A_h} \mathbf{h}_{t-1}
        + \Delta_t \mathbf{x}_t \mathbf{B}_t^{\top}, \qquad
        \mathbf{y}_t = \mathbf{h}_t \mathbf{C}_t + D_h \mathbf{x}_t,

    with input-dependent :math:`\Delta_t, \mathbf{B}_t, \mathbf{C}_t`, then
    :math:`\mathrm{RMSNorm}(\mathbf{y} \odot \mathrm{SiLU}(\mathbf{z}))` and an
    output projection. The short causal conv and the scan both restart at every
    chain start, so no information crosses from one chain to another.

    Args:
        d_model (int): input and output size :math:`D`.
        d_state (int, optional): state size :math:`N`. (default: :obj:`16`)
        expand (int, optional): inner size is ``expand * d_model``.
            (default: :obj:`2`)
        headdim (int, optional): head size :math:`P`; must divide
            ``expand * d_model``. (default: :obj:`32`)
        chunk_size (int, optional): chunk length of the parallel scan.
            (default: :obj:`64`)
        d_conv (int, optional): width of the causal depthwise conv on
            ``(x, B, C)``; ``1`` makes it pointwise. (default: :obj:`4`)
        dt_min (float, optional): smallest initial step. (default: :obj:`0.001`)
        dt_max (float, optional): largest initial step. (default: :obj:`0.1`)

    Shapes:
        - **input:** x (L, D), reset (L,) bool (optional)
        - **output:** (L, D); with ``return_state`` also an :class:`SSMState`
          with batch 1 (the state after the last element)
        - **step:** x_t (batch, D), :class:`SSMState` -> (batch, D),
          :class:`SSMState`
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: int = 2,
                 headdim: int = 32, chunk_size: int = 64, *, d_conv: int = 4,
                 dt_min: float = 0.001, dt_max: float = 0.1) -> None:
        super().__init__()
        name = self.__class__.__name__
        for arg, value in (("d_model", d_model), ("d_state", d_state), ("expand", expand),
                           ("headdim", headdim), ("chunk_size", chunk_size),
                           ("d_conv", d_conv)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: {arg} must be a positive int (got {value!r})")
        if (d_model * expand) % headdim != 0:
            raise ValueError(
                f"{name}: headdim must divide d_model * expand (got headdim={headdim}, "
                f"d_model * expand = {d_model} * {expand} = {d_model * expand}); "
                f"pick headdim from the divisors of {d_model * expand}")
        if not 0.0 < dt_min <= dt_max:
            raise ValueError(f"{name}: need 0 < dt_min <= dt_max (got {dt_min} and {dt_max})")

        self.d_model = d_model
        self.d_state = d_state
        self.expand = expand
        self.headdim = headdim
        self.chunk_size = chunk_size
        self.d_conv = d_conv
        self.dt_min = dt_min
        self.dt_max = dt_max
        self.d_inner = d_model * expand
        self.nheads = self.d_inner // headdim
        self.conv_dim = self.d_inner + 2 * d_state  # conv runs over (x, B, C)

        self.in_proj = nn.Linear(d_model, self.d_inner + self.conv_dim + self.nheads,
                                 bias=False)  # -> z, xBC, dt
        self.conv_weight = nn.Parameter(torch.empty(self.conv_dim, d_conv))
        self.conv_bias = nn.Parameter(torch.empty(self.conv_dim))
        self.dt_bias = nn.Parameter(torch.empty(self.nheads))
        self.A_log = nn.Parameter(torch.empty(self.nheads))
        self.D = nn.Parameter(torch.empty(self.nheads))
        for p in (self.dt_bias, self.A_log, self.D):
            p._no_weight_decay = True  # as in Mamba: keep these out of weight decay
        self.norm = nn.RMSNorm(self.d_inner)
        self.out_proj = nn.Linear(self.d_inner, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        r"""Mamba-style init: ``softplus(dt_bias)`` log-uniform in
        ``[dt_min, dt_max]``, ``A = -U(1, 16)``, ``D = 1``."""
        self.in_proj.reset_parameters()
        self.out_proj.reset_parameters()
        self.norm.reset_parameters()
        bound = 1.0 / math.sqrt(self.d_conv)  # nn.Conv1d default, fan_in = d_conv
        with torch.no_grad():
            nn.init.uniform_(self.conv_weight, -bound, bound)
            nn.init.uniform_(self.conv_bias, -bound, bound)
            u = torch.rand(self.nheads, device=self.dt_bias.device)  # (H,)
            dt = torch.exp(u * (math.log(self.dt_max) - math.log(self.dt_min))
                           + math.log(self.dt_min)).clamp(min=1e-4)  # (H,)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            A = torch.empty(self.nheads, device=self.A_log.device).uniform_(1.0, 16.0)
            self.A_log.copy_(torch.log(A))
            self.D.fill_(1.0)

    def _split(self, zxbcdt: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        z, xBC, dt = torch.split(zxbcdt, [self.d_inner, self.conv_dim, self.nheads], dim=-1)
        return z, xBC, dt

    def _conv(self, xBC: Tensor, starts: Tensor) -> Tensor:
        """Causal depthwise conv that never reads across a chain start.

        Shapes:
            - **input:** xBC (L, conv_dim), starts (L,) bool
            - **output:** (L, conv_dim)
        """
        K = self.d_conv
        L = xBC.size(0)
        if K == 1 or L == 0:
            return torch.addcmul(self.conv_bias, xBC, self.conv_weight[:, 0])  # (L, conv_dim)
        # Lay the chains out with K-1 zero rows before each chain start, so every
        # tap is a plain shifted slice (a view) and never reads another chain.
        chain = starts.long().cumsum(0)  # (L,): 1 for the first chain
        pos = torch.arange(L, device=xBC.device) + (K - 1) * chain  # (L,)
        Lp = L + (K - 1) * int(chain[-1])
        xp = xBC.new_zeros(Lp, xBC.size(1)).index_copy(0, pos, xBC)  # (Lp, conv_dim)
        out = _ShiftConv.apply(xp, self.conv_weight, self.conv_bias)  # (Lp - K + 1, conv_dim)
        return out.index_select(0, pos - (K - 1))  # (L, conv_dim)

    def _conv_tail(self, xBC: Tensor, starts: Tensor) -> Tensor:
        """The last ``d_conv - 1`` conv inputs of the last chain, zero-padded.

        Shapes:
            - **input:** xBC (L, conv_dim), starts (L,) bool
            - **output:** (1, d_conv - 1, conv_dim)
        """
        K = self.d_conv
        chain = starts.long().cumsum(0)  # (L,)
        tail = F.pad(xBC, (0, 0, K - 1, 0))[xBC.size(0):]  # (K-1, conv_dim)
        tail_chain = F.pad(chain, (K - 1, 0), value=-1)[chain.size(0):]  # (K-1,)
        keep = (tail_chain == chain[-1]).unsqueeze(-1)  # (K-1, 1)
        return torch.where(keep, tail, 0.0).unsqueeze(0)  # (1, K-1, conv_dim)

    def _gate_out(self, y: Tensor, z: Tensor) -> Tensor:
        norm = self.norm
        if norm.weight is None or y.dtype != norm.weight.dtype:
            return self.out_proj(norm(y * F.silu(z)))
        eps = torch.finfo(y.dtype).eps if norm.eps is None else norm.eps
        return self.out_proj(_GatedRMSNorm.apply(y, z, norm.weight, eps))

    def forward(self, x: Tensor, reset: Tensor | None = None,
                return_state: bool = False) -> Tensor | tuple[Tensor, SSMState]:
        r"""Scan every chain of the flat stream ``x`` in parallel.

        Args:
            x (Tensor): flat concatenation of chains, (L, D).
            reset (BoolTensor, optional): ``True`` at each chain start, (L,);
                ``None`` means one chain. (default: :obj:`None`)
            return_state (bool, optional): also return the recurrent state
                after the last element, to continue the last chain with
                :meth:`step`. (default: :obj:`False`)
        """
        if x.dim() != 2 or x.size(-1) != self.d_model:
            raise ValueError(f"{self.__class__.__name__}: x must have shape (L, {self.d_model}) "
                             f"(got {tuple(x.shape)})")
        L = x.size(0)
        if reset is not None and reset.shape != (L,):
            raise ValueError(f"{self.__class__.__name__}: reset must have shape ({L},) "
                             f"(got {tuple(reset.shape)})")
        H, P, N = self.nheads, self.headdim, self.d_state
        starts = _chain_starts(reset, L, x.device)  # (L,)
        z, xBC, dt = self._split(self.in_proj(x))  # (L, d_inner), (L, conv_dim), (L, H)
        xBC_act = F.silu(self._conv(xBC, starts))  # (L, conv_dim)
        xs, B, C = torch.split(xBC_act, [self.d_inner, N, N], dim=-1)
        xs = xs.reshape(L, H, P)  # (L, H, P)
        dt = F.softplus(dt + self.dt_bias)  # (L, H)
        A = -torch.exp(self.A_log)  # (H,)
        y, h = ssd_scan(xs, dt, A, B, C, starts, self.chunk_size,
                        return_final_state=True)  # (L, H, P), (H, P, N)
        y = y + xs * self.D.unsqueeze(-1)  # (L, H, P)
        out = self._gate_out(y.reshape(L, self.d_inner), z)  # (L, D)
        if not return_state:
            return out
        if L == 0:
            return out, self.init_state(1, x.device, x.dtype)
        return out, SSMState(self._conv_tail(xBC, starts), h.unsqueeze(0))

    def init_state(self, batch_size: int, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> SSMState:
        """Zero state for ``batch_size`` fresh chains."""
        device = self.A_log.device if device is None else device
        dtype = self.A_log.dtype if dtype is None else dtype
        conv = torch.zeros(batch_size, self.d_conv - 1, self.conv_dim,
                           device=device, dtype=dtype)  # (batch, K-1, conv_dim)
        ssm = torch.zeros(batch_size, self.nheads, self.headdim, self.d_state,
                          device=device, dtype=dtype)  # (batch, H, P, N)
        return SSMState(conv, ssm)

    def step(self, x_t: Tensor, state: SSMState) -> tuple[Tensor, SSMState]:
        r"""One recurrent step for a batch of chains, O(1) in sequence length.

        Shapes:
            - **input:** x_t (batch, D), state :class:`SSMState`
            - **output:** y_t (batch, D), new :class:`SSMState`
        """
        Bsz = x_t.size(0)
        H, P, N = self.nheads, self.headdim, self.d_state
        z, xBC, dt = self._split(self.in_proj(x_t))  # (b, d_inner), (b, conv_dim), (b, H)
        window = torch.cat([state.conv, xBC.unsqueeze(1)], dim=1)  # (b, K, conv_dim)
        conv_out = (window * self.conv_weight.t()).sum(dim=1) + self.conv_bias  # (b, conv_dim)
        xs, B, C = torch.split(F.silu(conv_out), [self.d_inner, N, N], dim=-1)
        xs = xs.reshape(Bsz, H, P)  # (b, H, P)
        dt = F.softplus(dt + self.dt_bias)  # (b, H)
        A = -torch.exp(self.A_log)  # (H,)
        decay = torch.exp(dt * A)  # (b, H)
        u = dt.unsqueeze(-1) * xs  # (b, H, P)
        h = decay[..., None, None] * state.ssm + u.unsqueeze(-1) * B[:, None, None, :]  # (b, H, P, N)
        y = torch.einsum("bhpn,bn->bhp", h, C) + xs * self.D.unsqueeze(-1)  # (b, H, P)
        out = self._gate_out(y.reshape(Bsz, self.d_inner), z)  # (b, D)
        return out, SSMState(window[:, 1:], h)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.d_model}, d_state={self.d_state}, "
                f"expand={self.expand}, headdim={self.headdim}, "
                f"chunk_size={self.chunk_size})")
