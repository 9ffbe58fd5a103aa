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


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, ``channels -> hidden -> channels``."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, hidden)
        self.proj = nn.Linear(hidden, channels)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(F.gelu(self.fc(x)))


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

    def _route(self, t: int, x: Tensor) -> tuple[Tensor, Tensor]:
        experts = self.experts[t]
        if self.routers is None or x.size(0) == 0:  # an empty type has no load to balance
            return experts[0](x), x.new_zeros(())
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
        outs, balance = [], x.new_zeros(())
        # a split, not slices: its backward is one cat, where each slice's would zero-fill x's gradient
        blocks = x.split([type_ptr[t + 1] - type_ptr[t] for t in range(self.num_types)])
        for t, block in enumerate(blocks):  # a loop per node type
            # Inference skips a type without nodes (a stream's step has few); training still runs it, so
            # that its weights get (zero) gradients and the optimizer treats every step alike.
            if block.size(0) == 0 and not torch.is_grad_enabled():
                continue
            out, loss = self._route(t, block)
            outs.append(out)
            balance = balance + loss
        return (torch.cat(outs) if outs else torch.zeros_like(x)), balance / self.num_types

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, num_types={self.num_types}, "
                f"hidden_channels={self.hidden_channels}, num_experts={self.num_experts})")
