r"""Phi: the selective state-space recurrence (Mamba-2 / SSD style).

Every chain of states in a batch (the token stream of each graph, each patch
type's chain of patch states in time order) is scanned in ONE flat pass: the
chains are concatenated along the length axis and ``reset`` marks where each
chain starts. State never crosses a chain start.

::

    SelectiveSSM(d_model=D, d_state=N, expand, headdim=P, chunk_size=Q)
      I = expand * D: the inner width
      x ...................................... (L, D)    reset (L,) bool
      in_proj -> z ........................... (L, I)    gate
              -> xBC ......................... (L, I + 2N)
              -> dt .......................... (L, H)    H = I / P
      xBC -> causal depthwise conv (chain-aware, width d_conv) -> SiLU
          -> x ............................... (L, H, P)
          -> B, C ............................ (L, N)    shared by all heads
      dt  -> softplus(dt + dt_bias) .......... (L, H)
      A = -exp(A_log) ........................ (H,)
      y = ssd_scan(x, dt, A, B, C, reset) .... (L, H, P)
        + D * x .............................. (L, H, P)
      y = RMSNorm(y * SiLU(z)) ............... (L, I)
      out_proj ............................... (L, D)

The scan and its sequential reference are in :mod:`sheafgnn.nn.ssd`, the fused
conv and gated-norm ops in :mod:`sheafgnn.nn.ssm_kernels`. ``SelectiveSSM.step`` runs the same
block recurrently, O(1) per token, for generation, and ``SelectiveSSM.continue_chains`` continues a
stream's chains from a pool of states (:mod:`sheafgnn.stream`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from sheafgnn.config import ConfigFile
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.norm_linear import norm_linear
from sheafgnn.nn.ssd import chain_starts, ssd_scan, ssd_scan_chains
from sheafgnn.nn.ssm_kernels import chain_conv, chain_layout, gated_rms_norm

__all__ = ["SSMState", "SelectiveSSM"]


class SSMState(NamedTuple):
    """Recurrent state of :class:`SelectiveSSM` for a batch of chains.

    Shapes:
        - **conv:** the last ``d_conv - 1`` conv inputs, oldest first
          (batch, d_conv - 1, d_inner + 2 * d_state)
        - **ssm:** the SSM state (batch, H, P, N)
    """

    conv: Tensor
    ssm: Tensor


# What SelectiveSSM._step_kernel reads of the layer: the projections and their biases (to check), then the kernel's
# weights in its order, and the gate's norm (for its eps).
_STEP_ARGUMENTS = ("in_proj", "out_proj", "in_proj.bias", "out_proj.bias", "in_proj.weight", "conv_weight",
                   "conv_bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", "norm")


@dataclass
class SSMConfig(ConfigFile):
    """Phi of :class:`~sheafgnn.model.SheafStateLM`: the :class:`SelectiveSSM` of every chain (its arguments)."""

    d_state: int = 16  # state size N
    expand: int = 2  # inner width = expand * d_model
    headdim: int = 32  # head dimension P; must divide expand * d_model
    chunk_size: int = 64  # SSD chunk length
    recompute: bool = False  # training: keep the input projection only, rerun conv, scan and gated norm in backward
    shared: bool = True  # the patch chains run the token chain's SSM (its weights; their own norm)

    def __post_init__(self) -> None:
        for name in ("d_state", "expand", "headdim", "chunk_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SSMConfig: {name} must be a positive integer (got {value!r})")

    def module(self, d_model: int) -> SelectiveSSM:
        """The :class:`SelectiveSSM` of width ``d_model`` this config describes."""
        return SelectiveSSM(d_model, self.d_state, self.expand, self.headdim, self.chunk_size,
                            recompute=self.recompute)


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
        recompute (bool, optional): in training, keep only the input projection
            for backward and run the conv, scan, gated norm and output
            projection again there (:func:`torch.utils.checkpoint.checkpoint`);
            without it the block keeps the conv output, the scan's inputs and chunk-end
            states, and the gated norm's input. (default: :obj:`False`)

    Shapes:
        - **input:** x (L, D), reset (L,) bool (optional)
        - **output:** (L, D); with ``return_state`` also an :class:`SSMState`
          with batch 1 (the state after the last element)
        - **step:** x_t (batch, D), :class:`SSMState` -> (batch, D),
          :class:`SSMState`
    """

    def __init__(self, d_model: int, d_state: int = 16, expand: int = 2,
                 headdim: int = 32, chunk_size: int = 64, *, d_conv: int = 4,
                 dt_min: float = 0.001, dt_max: float = 0.1, recompute: bool = False) -> None:
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
        self.recompute = recompute
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

    def _layout(self, starts: Tensor) -> tuple[Tensor, int, Tensor]:
        """Rows of the chains' padded conv layout: ``d_conv - 1`` rows before each chain start, so
        every tap is a plain shifted slice and never reads another chain.

        Returns the row of every element (L,), the number of rows, and the rows before each chain
        start (num_chains * (d_conv - 1),), chain by chain, oldest first.
        """
        K, L = self.d_conv, starts.numel()
        chain = starts.long().cumsum(0)  # (L,): 1 for the first chain
        pos = torch.arange(L, device=starts.device) + (K - 1) * chain  # (L,)
        before = (pos[starts] - (K - 1)).unsqueeze(1) + torch.arange(K - 1, device=starts.device)  # (C, K-1)
        return pos, L + (K - 1) * int(chain[-1]), before.flatten()

    def _conv(self, xBC: Tensor, layout: tuple[Tensor, int, Tensor], window: Tensor | None = None) -> Tensor:
        """SiLU of the causal depthwise conv, never reading across a chain start.

        Each chain reads ``d_conv - 1`` rows before its start (``layout``, from :meth:`_layout`): zeros,
        or its rows of ``window`` (the last conv inputs of the chain so far, :attr:`SSMState.conv`, one
        row per position before a start).

        Shapes:
            - **input:** xBC (L, conv_dim), window (num_chains * (d_conv - 1), conv_dim)
            - **output:** (L, conv_dim)
        """
        if self.d_conv == 1:  # no taps before the current input: nothing to lay out
            return F.silu(torch.addcmul(self.conv_bias, xBC, self.conv_weight[:, 0]))
        pos, num_rows, before = layout
        return chain_conv(xBC, pos, num_rows, self.conv_weight, self.conv_bias, before, window)

    def _conv_tails(self, xBC: Tensor, starts: Tensor, layout: tuple[Tensor, int, Tensor],
                    window: Tensor | None) -> Tensor:
        """The last ``d_conv - 1`` conv inputs of every chain (reading into the rows before a short
        chain: its ``window``, or zeros): (num_chains, d_conv - 1, conv_dim)."""
        K = self.d_conv
        pos, num_rows, before = layout
        xp = chain_layout(xBC, pos, num_rows, before, window)  # (num_rows, conv_dim)
        last = torch.cat([torch.nonzero(starts).squeeze(1)[1:] - 1, pos.new_tensor([pos.numel() - 1])])
        rows = pos[last].unsqueeze(1) + torch.arange(-(K - 2), 1, device=xp.device)  # (C, K-1)
        return xp[rows]  # (C, K-1, conv_dim)

    def _gate_out(self, y: Tensor, z: Tensor) -> Tensor:
        norm = self.norm
        if norm.weight is None or y.dtype != norm.weight.dtype:
            return self.out_proj(norm(y * F.silu(z)))
        eps = torch.finfo(y.dtype).eps if norm.eps is None else norm.eps
        proj = self.out_proj
        if type(proj) is nn.Linear and proj.bias is None:  # the projection inside: its input is not kept
            return gated_rms_norm(y, z, norm.weight, eps, proj.weight)
        return proj(gated_rms_norm(y, z, norm.weight, eps))

    def forward(self, x: Tensor, reset: Tensor | None = None, state: SSMState | None = None,
                return_state: bool = False, norm: nn.LayerNorm | None = None) -> Tensor | tuple[Tensor, SSMState]:
        r"""Scan every chain of the flat stream ``x`` in parallel.

        Args:
            x (Tensor): flat concatenation of chains, (L, D).
            reset (BoolTensor, optional): ``True`` at each chain start, (L,);
                ``None`` means one chain. (default: :obj:`None`)
            state (SSMState, optional): one entry per chain (batch = number of chains):
                chain ``c`` continues from ``state[c]`` exactly as if its earlier elements
                had been scanned before (e.g. by :meth:`step`). (default: :obj:`None`, zero)
            return_state (bool, optional): also return every chain's state after its
                last element, an :class:`SSMState` with one entry per chain, to continue
                with :meth:`step` or another call. (default: :obj:`False`)
            norm (LayerNorm, optional): the caller's norm of ``x``, fused into the
                input projection (:func:`~sheafgnn.nn.norm_linear.norm_linear`: autograd
                keeps ``x``, not the normed rows). (default: :obj:`None`, ``x`` as given)
        """
        if x.dim() != 2 or x.size(-1) != self.d_model:
            raise ValueError(f"{self.__class__.__name__}: x must have shape (L, {self.d_model}) "
                             f"(got {tuple(x.shape)})")
        L = x.size(0)
        if reset is not None and reset.shape != (L,):
            raise ValueError(f"{self.__class__.__name__}: reset must have shape ({L},) "
                             f"(got {tuple(reset.shape)})")
        if L == 0:
            if state is not None:
                raise ValueError(f"{self.__class__.__name__}: a state needs at least one element per chain")
            out = x.new_zeros(0, self.d_model)
            return (out, self.init_state(0, x.device, x.dtype)) if return_state else out
        H, P, N = self.nheads, self.headdim, self.d_state
        starts = chain_starts(reset, L, x.device)  # (L,)
        if state is not None:
            self._check_state(state, int(starts.sum()))
        zxbcdt = self.in_proj(x) if norm is None else norm_linear(x, norm, self.in_proj)  # (L, d_inner + conv_dim + H)
        layout = self._layout(starts)  # shared by the conv and, with return_state, its tails
        if state is None and not return_state:  # training: zero start, no states kept
            if self.recompute and torch.is_grad_enabled():  # keeps the input projection only
                return checkpoint(self._mix, zxbcdt, starts, layout, use_reentrant=False, preserve_rng_state=False)
            return self._mix(zxbcdt, starts, layout)
        z, xBC, dt = self._split(zxbcdt)  # (L, d_inner), (L, conv_dim), (L, H)
        window = None if state is None else state.conv.reshape(-1, self.conv_dim)  # (C * (K-1), conv_dim)
        xs, dt, A, B, C = self._scan_inputs(xBC, dt, layout, window)
        h0 = state.ssm if state is not None else xs.new_zeros(int(starts.sum()), H, P, N)
        y, h = ssd_scan_chains(xs, dt, A, B, C, starts, h0, self.chunk_size)  # (L, H, P), (C, H, P, N)
        out = self._skip_gate_out(y, xs, z)  # (L, D)
        if not return_state:
            return out
        return out, SSMState(self._conv_tails(xBC, starts, layout, window), h)

    def _mix(self, zxbcdt: Tensor, starts: Tensor, layout: tuple[Tensor, int, Tensor]) -> Tensor:
        """The training path from the input projection on (zero start, no state kept): conv, scan,
        skip, gated norm and output projection, (L, D)."""
        z, xBC, dt = self._split(zxbcdt)
        xs, dt, A, B, C = self._scan_inputs(xBC, dt, layout)
        return self._skip_gate_out(ssd_scan(xs, dt, A, B, C, starts, self.chunk_size), xs, z)  # (L, D)

    def _scan_inputs(self, xBC: Tensor, dt: Tensor, layout: tuple[Tensor, int, Tensor],
                     window: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The scan's inputs from the conv input and the raw steps: xs (L, H, P), dt (L, H) after the
        softplus, A (H,), B and C (L, N)."""
        N = self.d_state
        xs, B, C = torch.split(self._conv(xBC, layout, window), [self.d_inner, N, N], dim=-1)
        dt = F.softplus(dt + self.dt_bias)  # (L, H)
        return xs.reshape(xs.size(0), self.nheads, self.headdim), dt, -torch.exp(self.A_log), B, C

    def _skip_gate_out(self, y: Tensor, xs: Tensor, z: Tensor) -> Tensor:
        """The scan's output ``y`` (L, H, P) plus the skip ``D x``, gated, normed and projected: (L, D)."""
        y = torch.addcmul(y, xs, self.D.unsqueeze(-1))  # (L, H, P): y + D x
        return self._gate_out(y.reshape(y.size(0), self.d_inner), z)

    def _check_state(self, state: SSMState, num_chains: int) -> None:
        conv = (num_chains, self.d_conv - 1, self.conv_dim)
        ssm = (num_chains, self.nheads, self.headdim, self.d_state)
        if tuple(state.conv.shape) != conv or tuple(state.ssm.shape) != ssm:
            raise ValueError(f"{self.__class__.__name__}: the state must hold one entry per chain: conv {conv} "
                             f"and ssm {ssm} (got {tuple(state.conv.shape)} and {tuple(state.ssm.shape)})")

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

    def step(self, x_t: Tensor, state: SSMState, norm: nn.LayerNorm | None = None) -> tuple[Tensor, SSMState]:
        r"""One recurrent step for a batch of chains, O(1) in sequence length, of ``x_t`` or, with the
        caller's ``norm``, of ``norm(x_t)`` (as :meth:`forward` takes it).

        Without gradients, on the CPU, it is one call of the C++ kernel ``ssm_step``
        (:mod:`sheafgnn.nn.cpu_kernels`: a step's 25 ops cost their launches, about 150 us at batch 1,
        against about 20 us); elsewhere, and as the reference, :meth:`step_reference`.

        Shapes:
            - **input:** x_t (batch, D), state :class:`SSMState`
            - **output:** y_t (batch, D), new :class:`SSMState`
        """
        call = self._step_kernel(x_t, norm)
        if call is None:
            return self.step_reference(x_t if norm is None else norm(x_t), state)
        kernel, (in_w, conv_w, conv_b, dt_bias, A_log, D, norm_w, out_w, gate_norm), x_norm = call
        eps = torch.finfo(x_t.dtype).eps if gate_norm.eps is None else gate_norm.eps
        y, conv, ssm = kernel(x_t, state.conv, state.ssm, in_w, conv_w, conv_b, dt_bias, A_log, D, norm_w, eps, out_w,
                              *x_norm)
        return y, SSMState(conv, ssm)

    def continue_chains(self, x: Tensor, reset: Tensor, pool: SSMState, rows: list[int],
                        norm: nn.LayerNorm | None = None) -> tuple[Tensor, SSMState]:
        """This SSM over chains of ``norm(x)`` (``x`` without ``norm``) that continue from rows ``rows`` of the state
        batch ``pool`` (a chain not started yet has a zero state, as :meth:`init_state` gives): :meth:`step` where
        every chain has one new element (generation), else :meth:`forward` from the rows' states. Returns the outputs
        and the pool with those rows advanced (written in place, unless the rows are the whole pool in order).

        Shapes:
            - **input:** x (L, D), reset (L,) bool (each chain's first new element), ``len(rows)`` chains
            - **output:** y (L, D), the pool
        """
        if not rows:  # no chain has new elements
            return x, pool
        every = rows == list(range(pool.conv.size(0)))  # generation with every stream: no gather, no scatter
        index = None if every else torch.tensor(rows, device=x.device)
        state = pool if every else SSMState(pool.conv[index], pool.ssm[index])
        if x.size(0) == len(rows):  # one new element per chain (generation): the recurrent step
            y, new = self.step(x, state, norm=norm)
        else:
            y, new = self(x, reset, state=state, return_state=True, norm=norm)
        if every:
            return y, new
        pool.conv[index], pool.ssm[index] = new.conv, new.ssm
        return y, pool

    def _step_kernel(self, x_t: Tensor, norm: nn.LayerNorm | None) -> tuple | None:
        """The ``ssm_step`` kernel, this layer's arguments to it and those of ``norm``, where it computes what
        :meth:`step_reference` does (no gradients, CPU, float32/64, plain bias-free projections, an affine
        ``norm`` if any), else None."""
        in_proj, out_proj, in_bias, out_bias, *weights = cpu_kernels.registered(self, _STEP_ARGUMENTS)
        x_norm = cpu_kernels.norm_arguments(x_t, norm)
        if x_norm is None or not cpu_kernels.kernel_inputs(x_t, weights[4].dtype) or weights[6] is None:
            return None
        if type(in_proj) is not nn.Linear or type(out_proj) is not nn.Linear or in_bias is not None or \
                out_bias is not None:
            return None
        kernel = cpu_kernels.ssm_step()
        return None if kernel is None else (kernel, weights, x_norm)

    def step_reference(self, x_t: Tensor, state: SSMState) -> tuple[Tensor, SSMState]:
        """:meth:`step` as PyTorch ops."""
        Bsz = x_t.size(0)
        H, P, N = self.nheads, self.headdim, self.d_state
        z, xBC, dt = self._split(self.in_proj(x_t))  # (b, d_inner), (b, conv_dim), (b, H)
        window = torch.cat([state.conv, xBC.unsqueeze(1)], dim=1)  # (b, K, conv_dim)
        conv_out = (window * self.conv_weight.t()).sum(dim=1) + self.conv_bias  # (b, conv_dim)
        xs, B, C = torch.split(F.silu(conv_out), [self.d_inner, N, N], dim=-1)
        xs = xs.view(Bsz, H, P)  # (b, H, P)
        dt = F.softplus(dt + self.dt_bias)  # (b, H)
        decay = torch.exp(dt * -torch.exp(self.A_log))  # (b, H): exp(dt A)
        u = (dt.unsqueeze(-1) * xs).unsqueeze(-1)  # (b, H, P, 1)
        h = torch.addcmul(decay.view(Bsz, H, 1, 1) * state.ssm, u, B.view(Bsz, 1, 1, N))  # (b, H, P, N)
        # a product and a sum, not a matmul or an einsum: on a step's few rows each op's dispatch costs more than
        # its arithmetic, and the broadcast matmul dispatches five
        y = torch.addcmul((h * C.view(Bsz, 1, 1, N)).sum(-1), xs, self.D.unsqueeze(-1))  # (b, H, P)
        out = self._gate_out(y.reshape(Bsz, self.d_inner), z)  # (b, D)
        return out, SSMState(window[:, 1:], h)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.d_model}, d_state={self.d_state}, "
                f"expand={self.expand}, headdim={self.headdim}, "
                f"chunk_size={self.chunk_size})")
