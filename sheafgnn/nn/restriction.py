r"""Restriction maps from the outputs of :class:`~sheafgnn.nn.sheaf.SheafConv`'s map learner.

The learner gives every (edge, side) a vector :math:`h = \Psi(x_u, x_v)`; :func:`maps_from_learner` turns it
into the map :math:`\mathbf{F}_{v \trianglelefteq e}` of its kind::

    h           (E, P)      P = d (diag), d * d (general), d (d - 1) / 2 (orthogonal)
    diag        (E, d)      tanh(h) + offset                     (stored as the diagonal)
    general     (E, d, d)   tanh(h) + offset * I
    orthogonal  (E, d, d)   Cayley (I + A)^-1 (I - A), A skew with h above its diagonal: exactly orthogonal

With ``offset`` 1 (``map_init="identity"``) and the learner's last layer at zero, every map starts at I; the
Cayley transform of A = 0 is I already, so orthogonal maps take no offset.
"""
from __future__ import annotations

import torch
from torch import Tensor


def maps_from_learner(h: Tensor, map_kind: str, stalk_dim: int, offset: float = 0.0) -> Tensor:
    """The restriction maps of the learner outputs ``h`` (E, P): (E, d) for diag, else (E, d, d)."""
    d = stalk_dim
    if map_kind == "diag":
        return torch.tanh(h) + offset  # (E, d)
    if map_kind == "general":
        maps = torch.tanh(h).view(-1, d, d)  # (E, d, d)
        return maps + offset * torch.eye(d, dtype=h.dtype, device=h.device) if offset else maps
    if map_kind != "orthogonal":
        raise ValueError(f"maps_from_learner: no learned maps of kind {map_kind!r}")
    rows, cols = torch.triu_indices(d, d, offset=1, device=h.device)  # (P,) each
    a = h.new_zeros(h.size(0), d, d)  # (E, d, d)
    a[:, rows, cols] = h
    a = a - a.transpose(1, 2)
    eye = torch.eye(d, dtype=h.dtype, device=h.device)
    # solve_ex: no error check, so no host sync (I + A is invertible)
    return torch.linalg.solve_ex(eye + a, eye - a)[0]  # (E, d, d)
