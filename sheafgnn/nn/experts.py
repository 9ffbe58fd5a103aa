r"""E: site-aware experts, feed-forward blocks chosen by patch type.

Nodes of one type are contiguous in the model's flat layout (``type_ptr``),
so each type's experts run on a slice: no gather, no Python loop per node::

    h (N, D) --split by type_ptr--> [h_token, h_local, ..., h_output]
             --expert(s) of each type--> concatenated back (N, D)

With ``num_experts > 1`` a type has several experts and a learned top-1
router (Switch Transformer, Fedus et al. 2021) whose load-balancing loss
:math:`k \sum_i f_i P_i` is returned with the output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def feed_forward_reference(x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor,
                           proj_bias: Tensor) -> Tensor:
    """The plain composition ``proj(gelu(fc(x)))``; autograd keeps ``x``, ``fc(x)`` and ``gelu(fc(x))``."""
    return F.linear(F.gelu(F.linear(x, fc_weight, fc_bias)), proj_weight, proj_bias)


class _LeanFeedForward(torch.autograd.Function):
    """:func:`feed_forward_reference` that saves ``x`` and the pre-activation ``u = fc(x)`` only and
    recomputes ``gelu(u)`` in backward (an elementwise pass): one (n, hidden) tensor fewer kept per
    expert, 100 MB per block at 32k tokens (the experts run on every node)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor,
                proj_bias: Tensor) -> Tensor:
        u = F.linear(x, fc_weight, fc_bias)  # (n, hidden)
        ctx.save_for_backward(x, u, fc_weight, proj_weight)
        return F.linear(F.gelu(u), proj_weight, proj_bias)  # (n, C)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, u, fc_weight, proj_weight = ctx.saved_tensors
        need_x, need_fc_w, need_fc_b, need_proj_w, need_proj_b = ctx.needs_input_grad
        grad_proj_w = grad_out.t() @ F.gelu(u) if need_proj_w else None  # (C, hidden)
        grad_proj_b = grad_out.sum(0) if need_proj_b else None
        grad_x = grad_fc_w = grad_fc_b = None
        if need_x or need_fc_w or need_fc_b:
            grad_u = torch.ops.aten.gelu_backward(grad_out @ proj_weight, u)  # (n, hidden)
            grad_x = grad_u @ fc_weight if need_x else None  # (n, C)
            grad_fc_w = grad_u.t() @ x if need_fc_w else None  # (hidden, C)
            grad_fc_b = grad_u.sum(0) if need_fc_b else None
        return grad_x, grad_fc_w, grad_fc_b, grad_proj_w, grad_proj_b


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, ``channels -> hidden -> channels``.

    In training (plain :class:`~torch.nn.Linear` layers, gradients on) it runs as one autograd
    function that keeps ``x`` and ``fc(x)`` for backward and recomputes the GELU there
    (:class:`_LeanFeedForward`); quantised layers (:mod:`sheafgnn.nn.quant`) and inference run the
    plain composition.
    """

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, hidden)
        self.proj = nn.Linear(hidden, channels)

    def forward(self, x: Tensor) -> Tensor:
        fc, proj = self.fc, self.proj
        if torch.is_grad_enabled() and type(fc) is nn.Linear and type(proj) is nn.Linear:
            return _LeanFeedForward.apply(x, fc.weight, fc.bias, proj.weight, proj.bias)
        return proj(F.gelu(fc(x)))


class PatchExperts(nn.Module):
    r"""Expert feed-forward blocks routed by node type.

    .. math::
        \mathbf{x}'_v = \sum_{i} \mathbb{1}[r(v) = i] \, p_i(\mathbf{x}_v) \,
        \mathrm{FFN}_{\tau(v), i}(\mathbf{x}_v)

    where :math:`\tau(v)` is the node's type, :math:`r(v)` the top-1 expert
    of the type's router and :math:`p_i` its softmax weight (with one expert
    per type, :math:`p = 1`).

    Args:
        channels (int): node width :math:`D`.
        num_types (int): number of node types.
        hidden_channels (int): hidden width of each expert.
        num_experts (int, optional): experts per type. (default: :obj:`1`)

    Shapes:
        - **input:** node features :math:`(N, D)`, type pointer
          :math:`(\text{num\_types} + 1)` as a list of ints
        - **output:** node features :math:`(N, D)`, load-balancing loss (scalar)
    """

    def __init__(self, channels: int, num_types: int, hidden_channels: int, num_experts: int = 1) -> None:
        super().__init__()
        if num_experts < 1:
            raise ValueError(f"PatchExperts: num_experts must be >= 1 (got {num_experts})")
        self.channels = channels
        self.num_types = num_types
        self.hidden_channels = hidden_channels
        self.num_experts = num_experts
        self.experts = nn.ModuleList(
            nn.ModuleList(FeedForward(channels, hidden_channels) for _ in range(num_experts))
            for _ in range(num_types))
        self.routers = (nn.ModuleList(nn.Linear(channels, num_experts, bias=False) for _ in range(num_types))
                        if num_experts > 1 else None)

    def _route(self, t: int, x: Tensor) -> tuple[Tensor, Tensor | None]:
        """Type ``t``'s experts on its rows, and their load-balancing loss (None: nothing to balance)."""
        experts = self.experts[t]
        if self.routers is None or x.size(0) == 0:  # one expert, or an empty type: no load to balance
            return experts[0](x), None
        probs = self.routers[t](x).softmax(-1)  # (n, k)
        weight, choice = probs.max(-1)  # (n,), (n,)
        out = torch.zeros_like(x)
        for i, expert in enumerate(experts):  # a loop per expert
            rows = torch.nonzero(choice == i).squeeze(1)
            out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
        fraction = F.one_hot(choice, self.num_experts).float().mean(0)  # f_i
        balance = self.num_experts * (fraction * probs.mean(0)).sum()
        return out, balance

    def forward(self, x: Tensor, type_ptr: list[int]) -> tuple[Tensor, Tensor]:
        if len(type_ptr) != self.num_types + 1 or type_ptr[0] != 0 or type_ptr[-1] != x.size(0):
            raise ValueError(f"PatchExperts: type_ptr must have {self.num_types + 1} entries from 0 to "
                             f"x.size(0) = {x.size(0)} (got {list(type_ptr)})")
        outs, losses = [], []
        # a split, not slices: its backward is one cat, where each slice's would zero-fill x's gradient
        blocks = x.split([type_ptr[t + 1] - type_ptr[t] for t in range(self.num_types)])
        for t, block in enumerate(blocks):  # a loop per node type
            # Inference skips a type without nodes (a stream's step has few); training still runs it, so
            # that its weights get (zero) gradients and the optimizer treats every step alike.
            if block.size(0) == 0 and not torch.is_grad_enabled():
                continue
            out, loss = self._route(t, block)
            outs.append(out)
            if loss is not None:
                losses.append(loss)
        balance = torch.stack(losses).sum() / self.num_types if losses else x.new_zeros(())
        return (torch.cat(outs) if outs else torch.zeros_like(x)), balance

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, num_types={self.num_types}, "
                f"hidden_channels={self.hidden_channels}, num_experts={self.num_experts})")
