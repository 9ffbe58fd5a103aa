r"""Learned topology: score the candidate edges, keep the top-k, gate messages.

The site builder proposes candidate edges from cheap causal generators; this
module decides which of them carry messages. For a candidate
:math:`e = (u \to v)` of type :math:`\tau`,

.. math::
    s_e = \frac{\langle \mathbf{Q} \mathbf{x}_v, \mathbf{K} \mathbf{x}_u
    \rangle}{\sqrt{r}} + b_\tau, \qquad g_e = \sigma(s_e),

the edges with the ``k`` highest scores among each destination's in-edges
of one type are kept, and :math:`g_e` weights the kept edge's message. The
penalty :math:`\lambda \cdot \mathrm{mean}(g)` pushes unused edges towards
zero. Scores depend on the two endpoint states only, and a destination's
choice on its own in-edges only, so the topology stays causal. There is no
sampling: training and evaluation pick the same edges for the same states.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def topk_per_group(score: Tensor, group: Tensor, k: int) -> Tensor:
    """Mask of the ``k`` highest scores within each group (ties: lower index first).

    Args:
        score (Tensor): (E,) scores.
        group (Tensor): (E,) group ids (e.g. destination * num_types + type).
        k (int): edges kept per group.

    Returns:
        keep (BoolTensor): (E,).
    """
    if score.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=score.device)
    by_score = torch.sort(score.detach(), descending=True, stable=True).indices  # (E,)
    by_group = torch.sort(group[by_score], stable=True).indices
    order = by_score[by_group]  # sorted by (group, -score)
    sorted_group = group[order]
    starts = torch.ones_like(sorted_group, dtype=torch.bool)
    starts[1:] = sorted_group[1:] != sorted_group[:-1]
    position = torch.arange(order.numel(), device=score.device)
    first = torch.where(starts, position, 0).cummax(0).values
    keep = torch.empty_like(starts)
    keep[order] = position - first < k
    return keep


class TopologyScorer(nn.Module):
    r"""Scores candidate edges and keeps the top-k per destination and type.

    Args:
        channels (int): node width :math:`D`.
        num_edge_types (int): number of candidate edge types.
        k (int): edges kept per destination and edge type.
        rank (int, optional): width :math:`r` of the query/key projections.
            (default: :obj:`16`)

    Shapes:
        - **input:** node features :math:`(N, D)`, edge indices
          :math:`(2, E)`, edge types :math:`(E,)`
        - **output:** gates :math:`(E,)` in :math:`(0, 1)`, keep mask :math:`(E,)`
    """

    def __init__(self, channels: int, num_edge_types: int, k: int, rank: int = 16) -> None:
        super().__init__()
        if k < 1:
            raise ValueError(f"TopologyScorer: k must be >= 1 (got {k})")
        self.channels, self.num_edge_types, self.k, self.rank = channels, num_edge_types, k, rank
        self.query = nn.Linear(channels, rank, bias=False)
        self.key = nn.Linear(channels, rank, bias=False)
        self.type_bias = nn.Parameter(torch.empty(num_edge_types))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        self.query.reset_parameters()
        self.key.reset_parameters()
        # Start open (gate ~ 0.88): every candidate carries its message until learned otherwise.
        nn.init.constant_(self.type_bias, 2.0)

    def forward(self, x: Tensor, edge_index: Tensor, edge_type: Tensor) -> tuple[Tensor, Tensor]:
        src, dst = edge_index
        q, kk = self.query(x), self.key(x)  # (N, r) each: per node, then gathered per edge
        score = (q[dst] * kk[src]).sum(-1) / math.sqrt(self.rank) + self.type_bias[edge_type]  # (E,)
        keep = topk_per_group(score, dst * self.num_edge_types + edge_type, self.k)
        return torch.sigmoid(score), keep

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.channels}, num_edge_types={self.num_edge_types}, k={self.k})"
