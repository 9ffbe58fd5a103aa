r"""G: sheaf gluing, a causal sheaf-diffusion :class:`MessagePassing` layer.

Stalks and restriction maps (Neural Sheaf Diffusion, Bodnar et al. 2022)::

    x      (N, d * f)          node features = stalks (F): d stalk dims x f channels
    X      (N, d, f)           the same, viewed per stalk dim
    F_src  (num_edges, d, d)   F_{u <= e}: source stalk -> edge stalk
    F_dst  (num_edges, d, d)   F_{v <= e}: destination stalk -> edge stalk
                               (stored as (num_edges, d) for map_kind='diag')

    SheafConv.forward
      |- _sorted_edges: check the edges, sort them by destination (skipped when `ptr` is given)
      |- _maps: the map learner Psi, node-level projections gathered per edge
      |         -> restriction maps (diag / orthogonal (Cayley) / general)    (num_edges, d, d)
      |- _transport: F_v^T F_u, and the diagonal block F_v^T F_v              (num_edges, d, d)
      |- _diagonal_block: L_vv = segment_sum(alpha_e F_v^T F_v)               (N, d, d)
      |- Y = W2 X W1                                                          (N, d, f)
      |- transport_sum: sum_{e=(u->v)} alpha_e F_v^T F_u Y_u, fused (gluing.py) (N, d, f)
      |    (propagate: message + aggregate, only with message hooks / explain mode)
      |- _normalize_laplacian: D_in^-1 (L_vv Y_v - aggr)                      (N, d, f)
      |- X' = (1 + tanh eps) X - act(...)                                     (N, d, f)
      '- _energy (with return_energy): ||F_v X_v - F_u X_u||^2                (num_edges,)

Only in-edges of the destination enter its update, and the normaliser D_in
counts only those in-edges, so the layer is causal on a causal graph.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch_geometric.nn.conv import MessagePassing
from torch_geometric.nn.inits import glorot
from torch_geometric.nn.resolver import activation_resolver
from torch_geometric.typing import OptTensor, SparseTensor
from torch_geometric.utils import is_torch_sparse_tensor

from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.gluing import reads_by_stalk_dim, restrict, transport_sum, weigh
from sheafgnn.nn.restriction import maps_from_learner
from sheafgnn.nn.segment import (
    index_from_ptr,
    ptr_from_index,
    segment_sum,
    sort_by_destination,
)

__all__ = ["MAP_KINDS", "NORMALIZATIONS", "SheafConv"]

MAP_KINDS = ("diag", "orthogonal", "general", "identity")
MAP_INITS = ("random", "identity")  # where learned maps start (SheafConv's map_init)
NORMALIZATIONS = ("in_degree", "weight", "none")


class _Edges(NamedTuple):
    """The edges of one :meth:`SheafConv.forward`, sorted by destination."""

    index: Tensor  # (2, num_edges); in input order when msg_perm is set
    type: OptTensor  # (num_edges,)
    weight: OptTensor  # (num_edges,): alpha
    ptr: Tensor  # (N + 1,) destination CSR pointer
    perm: OptTensor  # (num_edges,): sorted = input[perm], to restore the input order
    msg_perm: OptTensor  # (num_edges,): with message hooks, messages are sorted in aggregate
    num_edges: int


class SheafConv(MessagePassing):
    r"""The causal sheaf diffusion operator, after the
    `"Neural Sheaf Diffusion: A Topological Perspective on Heterophily and
    Oversmoothing in GNNs" <https://arxiv.org/abs/2202.04579>`_ paper
    (Bodnar et al., 2022), restricted to in-edges so that it is causal on a
    directed graph whose edges go from the past to the present.

    Each node :math:`v` carries a stalk :math:`\mathbf{X}_v \in
    \mathbb{R}^{d \times f}` (its feature row of width :math:`d \cdot f`
    viewed as :math:`d` stalk dims by :math:`f` channels). Each edge
    :math:`e = (u \to v)` of type :math:`\tau_e` has learned restriction maps

    .. math::
        \mathbf{F}_{u \trianglelefteq e} = \Psi(\mathbf{x}_u, \mathbf{x}_v,
        \tau_e), \qquad
        \mathbf{F}_{v \trianglelefteq e} = \Psi(\mathbf{x}_v, \mathbf{x}_u,
        \tau_e) \in \mathbb{R}^{d \times d},

    where the map learner :math:`\Psi` is a linear layer (or a one-hidden-layer MLP) on
    :math:`[\mathbf{x}_a \,\|\, \mathbf{x}_b \,\|\,
    \mathrm{emb}(\tau_e)]` followed by :math:`\tanh` and a diagonal embedding
    (:obj:`"diag"`), :math:`\tanh` (:obj:`"general"`), or the Cayley transform
    :math:`(\mathbf{I} + \mathbf{A})^{-1}(\mathbf{I} - \mathbf{A})` of a skew
    matrix :math:`\mathbf{A}` (:obj:`"orthogonal"`: exactly orthogonal, in
    :math:`SO(d)`); :obj:`"identity"` fixes every map to :math:`\mathbf{I}` (no map learner: the
    ablation of learned maps). With :obj:`map_init="identity"` learned maps start there: the learner's
    last layer starts at zero and the diag and general maps are :math:`\mathbf{I} + \tanh(\cdot)`
    (the Cayley transform of zero is already :math:`\mathbf{I}`). The first layer of :math:`\Psi` is
    evaluated per node and gathered per edge, which equals the per-edge linear layer on the
    concatenation at :math:`O(|\mathcal{V}|)` instead of :math:`O(|\mathcal{E}|)` matmul cost.

    The layer applies the destination's row of the in-edge sheaf Laplacian,
    in matrix form

    .. math::
        \mathbf{X}' = (1 + \tanh \boldsymbol{\varepsilon}) \odot \mathbf{X}
        - \sigma\left( \mathbf{D}^{-1} \mathbf{L}_{\mathcal{F}}
        (\mathbf{I}_n \otimes \mathbf{W}_2) \mathbf{X} \mathbf{W}_1 \right),

    with the blocks :math:`\mathbf{L}_{vv} = \sum_{e=(u \to v)} \alpha_e
    \mathbf{F}_{v \trianglelefteq e}^\top \mathbf{F}_{v \trianglelefteq e}`
    and :math:`\mathbf{L}_{vu} = -\sum_{e=(u \to v)} \alpha_e
    \mathbf{F}_{v \trianglelefteq e}^\top \mathbf{F}_{u \trianglelefteq e}`;
    node-wise, with :math:`\mathbf{Y}_u = \mathbf{W}_2 \mathbf{X}_u
    \mathbf{W}_1`,

    .. math::
        \mathbf{X}'_v = (1 + \tanh \boldsymbol{\varepsilon}) \odot
        \mathbf{X}_v - \sigma\left( \frac{1}{D_v} \sum_{e = (u \to v)}
        \alpha_e \, \mathbf{F}_{v \trianglelefteq e}^\top \left(
        \mathbf{F}_{v \trianglelefteq e} \mathbf{Y}_v -
        \mathbf{F}_{u \trianglelefteq e} \mathbf{Y}_u \right) \right).

    :math:`\mathbf{W}_1 \in \mathbb{R}^{f \times f}` mixes channels,
    :math:`\mathbf{W}_2 \in \mathbb{R}^{d \times d}` mixes stalk dims
    (:math:`\mathbf{I}` unless :obj:`stalk_mixing=True`; NSD names these two
    the other way round), :math:`\boldsymbol{\varepsilon} \in \mathbb{R}^d`
    is the learned residual scale ("1 + eps" of NSD, one per stalk dim), and
    :math:`\alpha_e` is the optional edge weight (1 when absent).

    **Causality.** :math:`D_v` is the in-degree of :math:`v` (the number of
    its in-edges, :obj:`normalize="in_degree"`), or :math:`\sum_{e \to v}
    \alpha_e` (:obj:`"weight"`), or 1 (:obj:`"none"`). It never involves
    source degrees: the symmetric :math:`\mathbf{D}^{-1/2} \mathbf{L}
    \mathbf{D}^{-1/2}` of NSD scales by the source's degree, which counts the
    source's edges to later nodes and so leaks the future into the past on a
    causal graph. Hence :math:`\mathbf{X}'_v` depends only on
    :math:`\mathbf{X}_v` and the sources of its in-edges.

    The diagonal block :math:`\mathbf{L}_{vv}` is reduced per node first
    (a :math:`d \times d` matrix per edge), so messages only gather and
    transport source stalks, :math:`\alpha_e \mathbf{F}_{v \trianglelefteq
    e}^\top \mathbf{F}_{u \trianglelefteq e} \mathbf{Y}_u`, and are summed
    per destination over a destination-sorted CSR with
    :func:`~sheafgnn.nn.segment.segment_sum` (:obj:`torch_scatter` or a
    PyTorch fallback), in one pass over all edge types. In explain mode the
    edge mask multiplies :math:`\alpha_e`, so a masked edge drops out of both
    blocks.

    The per-edge gluing energy :math:`\| \mathbf{F}_{v \trianglelefteq e}
    \mathbf{X}_v - \mathbf{F}_{u \trianglelefteq e} \mathbf{X}_u \|_F^2`
    (zero on a global section) is returned with :obj:`return_energy=True`.

    Args:
        in_channels (int): Width of the node features, :math:`d \cdot f`.
        stalk_dim (int): Stalk dimension :math:`d`; must divide
            :obj:`in_channels`.
        map_kind (str, optional): :obj:`"diag"`, :obj:`"orthogonal"`,
            :obj:`"general"` or :obj:`"identity"` restriction maps. (default: :obj:`"diag"`)
        num_edge_types (int, optional): Number of edge types :math:`T`; the
            map learner sees a learned embedding of the type.
            (default: :obj:`1`)
        map_hidden_channels (int, optional): Hidden width of the map learner
            ReLU MLP; :obj:`None` for a linear map learner.
            (default: :obj:`None`)
        stalk_mixing (bool, optional): Learn :math:`\mathbf{W}_2`.
            (default: :obj:`False`)
        normalize (str, optional): :obj:`"in_degree"`, :obj:`"weight"` or
            :obj:`"none"` (see above). (default: :obj:`"in_degree"`)
        act (str or Callable, optional): The non-linearity :math:`\sigma`.
            (default: :obj:`"elu"`)
        map_init (str, optional): Where learned maps start: :obj:`"random"`
            (the learner's default initialisation) or :obj:`"identity"` (see
            above). (default: :obj:`"random"`)

    Shapes:
        - **input:**
          node features :math:`(|\mathcal{V}|, d \cdot f)`,
          edge indices :math:`(2, |\mathcal{E}|)` (source, destination) or a
          transposed sparse adjacency :obj:`adj_t` (CSR rows = destinations),
          edge types :math:`(|\mathcal{E}|)` *(optional)*,
          edge weights :math:`(|\mathcal{E}|)` *(optional)*,
          destination CSR pointer :math:`(|\mathcal{V}| + 1)` *(optional,
          edges then must be sorted by destination)*
        - **output:** node features :math:`(|\mathcal{V}|, d \cdot f)`, and
          with :obj:`return_energy=True` also the edge energies
          :math:`(|\mathcal{E}|)` in the order of the input edges
    """

    def __init__(
        self,
        in_channels: int,
        stalk_dim: int,
        map_kind: str = "diag",
        num_edge_types: int = 1,
        map_hidden_channels: int | None = None,
        stalk_mixing: bool = False,
        normalize: str = "in_degree",
        act: str | Callable | None = "elu",
        map_init: str = "random",
    ) -> None:
        super().__init__(aggr="sum", node_dim=0)
        name = self.__class__.__name__
        if stalk_dim < 1 or in_channels < 1:
            raise ValueError(f"{name}: in_channels and stalk_dim must be positive (got {in_channels} and {stalk_dim})")
        if in_channels % stalk_dim != 0:
            raise ValueError(f"{name}: stalk_dim must divide in_channels (got {stalk_dim} and {in_channels})")
        if map_kind not in MAP_KINDS:
            raise ValueError(f"{name}: map_kind must be one of {MAP_KINDS} (got {map_kind!r})")
        if num_edge_types < 1:
            raise ValueError(f"{name}: num_edge_types must be >= 1 (got {num_edge_types})")
        if map_hidden_channels is not None and map_hidden_channels < 1:
            raise ValueError(f"{name}: map_hidden_channels must be >= 1 or None (got {map_hidden_channels})")
        if normalize not in NORMALIZATIONS:
            raise ValueError(f"{name}: normalize must be one of {NORMALIZATIONS} (got {normalize!r})")
        if map_init not in MAP_INITS:
            raise ValueError(f"{name}: map_init must be one of {MAP_INITS} (got {map_init!r})")

        self.in_channels = in_channels
        self.stalk_dim = stalk_dim
        self.channels = in_channels // stalk_dim  # f
        self.map_kind = map_kind
        self.map_init = map_init
        # "identity": F = I + tanh(h) with h's layer at zero (diag, general); Cayley(0) is already I (orthogonal)
        self.map_offset = float(map_init == "identity" and map_kind in ("diag", "general"))
        self.num_edge_types = num_edge_types
        self.map_hidden_channels = map_hidden_channels
        self.stalk_mixing = stalk_mixing
        self.normalize = normalize
        self.act = activation_resolver(act) if act is not None else None
        if isinstance(act, str) and getattr(self.act, "inplace", None) is False:
            # our own module, applied to a fresh tensor that nothing else reads: an in-place ELU keeps
            # its output for backward, where the out-of-place one keeps a second (N, d, f) tensor
            self.act.inplace = True

        d = stalk_dim
        # P: map-learner outputs per (edge, side)
        self.num_map_params = {"diag": d, "general": d * d, "orthogonal": d * (d - 1) // 2, "identity": 0}[map_kind]
        hidden = map_hidden_channels or self.num_map_params
        self._map_width = hidden
        if self.num_map_params > 0:
            # [x_a || x_b || emb(type)] @ W = x_a @ W_a + x_b @ W_b + emb'(type)
            self.map_lin = nn.Linear(in_channels, 2 * hidden, bias=False)
            self.map_type_emb = nn.Embedding(num_edge_types, hidden)
            self.map_out = (nn.Linear(hidden, self.num_map_params)
                            if map_hidden_channels is not None else None)
        else:  # identity, or orthogonal with d == 1 (whose only map is the identity): nothing to learn
            self.map_lin = self.map_type_emb = self.map_out = None

        self.weight_channel = nn.Parameter(torch.empty(self.channels, self.channels))  # W1
        self.weight_stalk = nn.Parameter(torch.empty(d, d)) if stalk_mixing else None  # W2
        self.eps = nn.Parameter(torch.empty(d))

        self.reset_parameters()

    def reset_parameters(self) -> None:
        r"""Resets all learnable parameters of the module."""
        super().reset_parameters()
        if self.map_lin is not None:
            self.map_lin.reset_parameters()
            nn.init.normal_(self.map_type_emb.weight,
                            std=1.0 / math.sqrt(self.in_channels))
            if self.map_out is not None:
                self.map_out.reset_parameters()
            if self.map_init == "identity":  # the learner's last layer at zero: h = 0, so every map starts at I
                last = [self.map_out.weight, self.map_out.bias] if self.map_out is not None else \
                    [self.map_lin.weight, self.map_type_emb.weight]
                for weight in last:
                    nn.init.zeros_(weight)
        glorot(self.weight_channel)
        if self.weight_stalk is not None:
            with torch.no_grad():
                self.weight_stalk.copy_(torch.eye(self.stalk_dim))
        nn.init.zeros_(self.eps)

    # ------------------------------------------------------------------ #
    # restriction maps
    # ------------------------------------------------------------------ #
    def _maps(self, x: Tensor, src: Tensor, dst: Tensor,
              edge_type: OptTensor) -> tuple[Tensor, Tensor]:
        r"""The map learner :math:`\Psi`: compact maps for the edges
        (src, dst), (num_edges, d) for diag, else (num_edges, d, d);
        returns (F_src, F_dst)."""
        d, num_edges = self.stalk_dim, src.numel()
        if self.map_lin is None:  # identity maps, as diag ones; orthogonal with d == 1
            eye = x.new_ones(num_edges, d) if self.map_kind == "identity" else x.new_ones(num_edges, 1, 1)
            return eye, eye
        H = self._map_width
        node = self.map_lin(x)  # (N, 2H): [x W_a, x W_b]
        g_src, g_dst = node[src], node[dst]  # (num_edges, 2H) each
        if edge_type is None:
            emb = self.map_type_emb.weight[0]  # (H,) broadcast
        else:
            emb = self.map_type_emb(edge_type)  # (num_edges, H)
        h_src = g_src[:, :H] + g_dst[:, H:] + emb  # (num_edges, H): Psi(x_u, x_v)
        h_dst = g_dst[:, :H] + g_src[:, H:] + emb  # (num_edges, H): Psi(x_v, x_u)
        h = torch.cat([h_src, h_dst], dim=0)  # (2 * num_edges, H)
        if self.map_out is not None:
            h = self.map_out(torch.relu(h))  # (2 * num_edges, P)
        maps = maps_from_learner(h, self.map_kind, d, self.map_offset)  # (2 * num_edges, d[, d])
        return maps[:num_edges], maps[num_edges:]

    def restriction_maps(self, x: Tensor, edge_index: Tensor, edge_type: OptTensor = None) -> tuple[Tensor, Tensor]:
        r"""Returns the dense restriction maps
        :math:`(\mathbf{F}_{u \trianglelefteq e}, \mathbf{F}_{v
        \trianglelefteq e})`, each :math:`(|\mathcal{E}|, d, d)`, in the order
        of :obj:`edge_index` (a :math:`(2, |\mathcal{E}|)` tensor)."""
        self._check_x(x)
        f_src, f_dst = self._maps(x, edge_index[0], edge_index[1], edge_type)
        if f_src.dim() == 2:
            f_src, f_dst = torch.diag_embed(f_src), torch.diag_embed(f_dst)
        return f_src, f_dst

    # ------------------------------------------------------------------ #
    # forward
    # ------------------------------------------------------------------ #
    def _check_x(self, x: Tensor) -> None:
        if x.dim() != 2 or x.size(-1) != self.in_channels:
            raise ValueError(f"{self.__class__.__name__}: expected x of shape (N, in_channels={self.in_channels}) "
                             f"(got {tuple(x.shape)})")

    def _edges_from_adj(self, adj_t, num_nodes: int):
        r"""(edge_index, ptr, values) from a transposed sparse adjacency,
        whose CSR rows are the destinations (already sorted)."""
        if isinstance(adj_t, SparseTensor):
            dst, src, value = adj_t.coo()
            ptr = adj_t.storage.rowptr()
        else:  # torch.sparse
            if adj_t.layout == torch.sparse_csr:
                ptr, src = adj_t.crow_indices(), adj_t.col_indices()
                value = adj_t.values()
                dst = index_from_ptr(ptr, src.numel())
            else:
                adj_t = adj_t.coalesce()  # sorted by (dst, src)
                dst, src = adj_t.indices()
                value = adj_t.values()
                ptr = ptr_from_index(dst, num_nodes)
        return torch.stack([src, dst], dim=0), ptr.long(), value

    def forward(self, x: Tensor | tuple[Tensor, Tensor], edge_index: Tensor | SparseTensor, edge_type: OptTensor = None,
                edge_weight: OptTensor = None, return_energy: bool = False,
                ptr: OptTensor = None) -> Tensor | tuple[Tensor, Tensor]:
        r"""Runs the forward pass of the module.

        Args:
            x (torch.Tensor or (Tensor, Tensor)): Node stalks :math:`(N, d \cdot f)`; or, bipartite
                as in PyG, the pair :obj:`(x_src, x_dst)`: :obj:`edge_index[0]` indexes the source
                stalks :obj:`x_src`, :obj:`edge_index[1]` (and :obj:`ptr`) the destinations
                :obj:`x_dst`, and the output has the destinations' rows (e.g. a stream's new nodes
                glued to their cached sources).
            edge_index (torch.Tensor or SparseTensor): :math:`(2, |\mathcal{E}|)` edges
                (source, destination), in any order; or a transposed sparse
                adjacency (:class:`torch_sparse.SparseTensor` or
                :class:`torch.sparse.Tensor`) whose values, if any, serve as
                :obj:`edge_weight`.
            edge_type (torch.Tensor, optional): :math:`(|\mathcal{E}|,)` ids in
                :math:`[0, T)`, in the order of the edges (for a sparse
                adjacency: its CSR order). (default: :obj:`None`, all type 0)
            edge_weight (torch.Tensor, optional): :math:`(|\mathcal{E}|,)` weights
                :math:`\alpha_e` (the learned-topology gates).
                (default: :obj:`None`)
            return_energy (bool, optional): Also return the per-edge gluing
                energy :math:`(|\mathcal{E}|,)` in the input edge order (CSR order for a
                sparse adjacency).
                (default: :obj:`False`)
            ptr (torch.Tensor, optional): :math:`(N + 1,)` destination CSR
                pointer of an :obj:`edge_index` that is already sorted by
                destination (e.g. from
                :func:`sheafgnn.nn.segment.sort_by_destination`); skips the
                sort. Not checked. (default: :obj:`None`)
        """
        if isinstance(x, tuple):
            return self._bipartite(*x, edge_index, edge_type, edge_weight, return_energy, ptr)
        self._check_x(x)
        call = None if return_energy else self._kernel(x, edge_index, edge_type, edge_weight, ptr)
        if call is not None:
            kernel, weights = call
            return kernel(x, edge_index[0], ptr, edge_type, edge_weight, *weights, x.new_empty(0), self.map_offset)
        N = x.size(0)
        d, f = self.stalk_dim, self.channels
        edges = self._sorted_edges(x, edge_index, edge_type, edge_weight, ptr)
        src, dst = edges.index  # (num_edges,), (num_edges,)

        # restriction maps: (num_edges, d) each for diag, else (num_edges, d, d)
        maps_src, maps_dst = self._maps(x, src, dst, edges.type)
        transport, self_block = self._transport(maps_src, maps_dst)
        diag_block = self._diagonal_block(self_block, edges)  # (N, d[, d]) = L_vv

        X = x.view(N, d, f)  # (N, d, f)
        Y = X @ self.weight_channel  # (N, d, f)
        if self.weight_stalk is not None:
            Y = torch.einsum("ij,njf->nif", self.weight_stalk, Y)
        fused = self._fused()
        if fused and reads_by_stalk_dim(transport):
            # laid out (d, N, f), as the SpMM gluing reads it: autograd keeps this one copy, not two
            Y = Y.transpose(0, 1).contiguous().transpose(0, 1)  # (N, d, f) view of a (d, N, f) tensor

        # L_vv Y_v - sum_{e=(u->v)} alpha_e F_v^T F_u Y_u
        if fused:  # saves no per-edge stalk for backward
            aggr = transport_sum(Y, src, edges.ptr, transport, edges.weight)
        else:  # per-edge messages for hooks and explainers
            aggr = self.propagate(edges.index, y=Y, transport=transport, alpha=edges.weight,
                                  dst_ptr=edges.ptr, msg_perm=edges.msg_perm, size=(N, N))
        # In place where autograd allows: each (N, d, f) temporary that does not fit a hole of the heap
        # extends it, and with two layers they were a tenth of the peak resident set at 32k tokens.
        lap = restrict(diag_block, Y).sub_(aggr)  # (N, d, f): the product's backward reads its inputs only
        lap = self._normalize_laplacian(lap, edges)  # (N, d, f)
        if self.act is not None:
            lap = self.act(lap)
        scale = (1.0 + torch.tanh(self.eps)).view(1, d, 1)  # (1, d, 1)
        out = (scale * X).sub_(lap).reshape(N, d * f)  # (N, d * f)
        if not return_energy:
            return out
        return out, self._energy(X, maps_src, maps_dst, edges)

    def _bipartite(self, x_src: Tensor, x_dst: Tensor, edge_index: Tensor, edge_type: OptTensor,
                   edge_weight: OptTensor, return_energy: bool, ptr: OptTensor) -> Tensor | tuple[Tensor, Tensor]:
        r""":meth:`forward` on :obj:`(x_src, x_dst)`: the ``glue_diag`` kernel reads the sources where they are;
        otherwise :meth:`forward` on :math:`[\mathbf{x}_{dst} \,\|\, \mathbf{x}_{src}[\text{sources}]]`
        (a copy of each edge's source, which no edge enters), cut to the destinations' rows."""
        self._check_x(x_src)
        self._check_x(x_dst)
        call = None if return_energy else self._kernel(x_dst, edge_index, edge_type, edge_weight, ptr)
        if call is not None:
            kernel, weights = call
            return kernel(x_dst, edge_index[0], ptr, edge_type, edge_weight, *weights, x_src, self.map_offset)
        N, E = x_dst.size(0), edge_index.size(1)
        local = torch.stack([torch.arange(N, N + E, device=x_dst.device), edge_index[1]])
        ptr = None if ptr is None else torch.cat([ptr, ptr[-1:].expand(E)])
        out = self.forward(torch.cat([x_dst, x_src[edge_index[0]]]), local, edge_type, edge_weight, return_energy,
                           ptr)
        return (out[0][:N], out[1]) if return_energy else out[:N]

    def _kernel(self, x: Tensor, edge_index, edge_type: OptTensor, edge_weight: OptTensor,
                ptr: OptTensor) -> tuple | None:
        r"""The C++ kernel ``glue_diag`` (:mod:`sheafgnn.nn.cpu_kernels`: a step's gluing in one call, not ~40 ops)
        and this layer's weights for it, where it computes what :meth:`forward` does (inference on the CPU, sorted
        typed weighted edges with their :obj:`ptr`, diag maps, no stalk mixing, no normalisation, ELU), else None."""
        if self.map_kind != "diag":  # the kernel computes diag maps only
            return None
        map_out, weight_stalk, act, map_lin, map_type_emb, *weights = cpu_kernels.registered(self, (
            "map_out", "weight_stalk", "act", "map_lin", "map_type_emb",  # checked; then glue_diag's weights
            "map_lin.weight", "map_type_emb.weight", "weight_channel", "eps"))
        inputs = cpu_kernels.kernel_inputs(x, weights[-1].dtype) and isinstance(edge_index, Tensor) and \
            not edge_index.is_sparse and ptr is not None and edge_type is not None and edge_weight is not None
        layer = self.map_kind == "diag" and map_out is None and weight_stalk is None and \
            self.normalize == "none" and type(act) is nn.ELU and act.alpha == 1.0 and \
            type(map_lin) is nn.Linear and type(map_type_emb) is nn.Embedding and self._fused()
        kernel = cpu_kernels.glue_diag() if inputs and layer else None
        return None if kernel is None else (kernel, weights)

    def _fused(self) -> bool:
        r"""Whether :meth:`forward` may skip :meth:`propagate` for the fused
        :func:`~sheafgnn.nn.gluing.transport_sum`: not in explain mode, with
        no PyG hook and the stock :meth:`message` / :meth:`aggregate`."""
        hooks = (self._propagate_forward_pre_hooks, self._propagate_forward_hooks, self._message_forward_pre_hooks,
                 self._message_forward_hooks, self._aggregate_forward_pre_hooks, self._aggregate_forward_hooks)
        cls = type(self)
        return not self.explain and not any(hooks) and cls.message is SheafConv.message and \
            cls.aggregate is SheafConv.aggregate

    def _sorted_edges(self, x: Tensor, edge_index: Tensor | SparseTensor,
                      edge_type: OptTensor, edge_weight: OptTensor,
                      ptr: OptTensor) -> _Edges:
        r"""Checks the edge inputs of :meth:`forward`, folds the explain
        mask into the weights, and sorts the edges by destination."""
        N = x.size(0)
        if isinstance(edge_index, SparseTensor) or is_torch_sparse_tensor(edge_index):
            edge_index, ptr, value = self._edges_from_adj(edge_index, N)
            if edge_weight is None and value is not None:
                edge_weight = value.to(x.dtype)
        elif edge_index.dim() != 2 or edge_index.size(0) != 2:
            raise ValueError(
                f"{self.__class__.__name__}: expected edge_index of shape "
                f"(2, num_edges) (got {tuple(edge_index.shape)})")
        num_edges = edge_index.size(1)
        for name, t in (("edge_type", edge_type), ("edge_weight", edge_weight)):
            if t is not None and t.shape != (num_edges,):
                raise ValueError(
                    f"{self.__class__.__name__}: expected {name} of shape "
                    f"({num_edges},) (got {tuple(t.shape)})")
        if ptr is not None and ptr.shape != (N + 1,):
            raise ValueError(
                f"{self.__class__.__name__}: expected ptr of shape "
                f"({N + 1},) (got {tuple(ptr.shape)})")

        # Explain mode (e.g. GNNExplainer): the edge mask scales alpha, so
        # that it removes an edge's whole contribution (both Laplacian
        # blocks), not only the transported message.
        if self.explain:
            edge_weight = self._explain_weight(edge_weight, num_edges, x.dtype)

        # Sort by destination. Normally the edge inputs are permuted (cheap);
        # with message hooks (e.g. AttentionExplainer), messages stay in the
        # input edge order so that `alpha` lines up with the caller's edges,
        # and are permuted in `aggregate` instead.
        perm = msg_perm = None
        if ptr is None:
            if self._message_forward_hooks or self._message_forward_pre_hooks:
                _, ptr, msg_perm = sort_by_destination(
                    edge_index, num_nodes=N, return_perm=True)
            else:
                edge_index, edge_type, edge_weight, ptr, perm = \
                    sort_by_destination(edge_index, edge_type, edge_weight,
                                        num_nodes=N, return_perm=True)
        return _Edges(edge_index, edge_type, edge_weight, ptr, perm, msg_perm,
                      num_edges)

    def _transport(self, maps_src: Tensor,
                   maps_dst: Tensor) -> tuple[Tensor, Tensor]:
        r"""The transport :math:`F_v^\top F_u` and the diagonal block
        :math:`F_v^\top F_v` of every edge: (num_edges, d) for diag maps,
        else (num_edges, d, d) (orthogonal: the self block is a scalar 1)."""
        if maps_dst.dim() == 2:
            return maps_dst * maps_src, maps_dst * maps_dst  # (num_edges, d) each
        transport = maps_dst.transpose(1, 2) @ maps_src  # (num_edges, d, d)
        # orthogonal: F_v^T F_v = I, a scalar per edge
        self_block = (maps_dst.new_ones(maps_dst.size(0), 1)
                      if self.map_kind == "orthogonal" else
                      maps_dst.transpose(1, 2) @ maps_dst)  # (num_edges, d, d)
        return transport, self_block

    @staticmethod
    def _diagonal_block(self_block: Tensor, edges: _Edges) -> Tensor:
        r""":math:`\mathbf{L}_{vv} = \sum_{e \to v} \alpha_e F_v^\top F_v`,
        (N, d) or (N, d, d)."""
        self_block = weigh(edges.weight, self_block)
        if edges.msg_perm is not None:
            self_block = self_block[edges.msg_perm]
        return segment_sum(self_block, edges.ptr)  # (N, d[, d])

    def _normalize_laplacian(self, lap: Tensor, edges: _Edges) -> Tensor:
        r"""Divides each destination's row by :math:`D_v` (in-edges only)."""
        if self.normalize == "in_degree":
            deg = edges.ptr.diff().clamp(min=1).to(lap.dtype)  # (N,)
            return lap / deg.view(-1, 1, 1)
        if self.normalize == "weight":  # sum of in-edge weights
            if edges.weight is None:
                deg = edges.ptr.diff().to(lap.dtype)  # (N,)
            else:
                w = (edges.weight if edges.msg_perm is None else
                     edges.weight[edges.msg_perm])
                deg = segment_sum(w, edges.ptr)  # (N,)
            return lap / deg.masked_fill(deg == 0, 1.0).view(-1, 1, 1)
        return lap

    @staticmethod
    def _energy(X: Tensor, maps_src: Tensor, maps_dst: Tensor,
                edges: _Edges) -> Tensor:
        r"""Per-edge gluing energy :math:`\| F_v X_v - F_u X_u \|^2`,
        (num_edges,) in the input edge order."""
        src, dst = edges.index
        diff = (restrict(maps_dst, X[dst])
                - restrict(maps_src, X[src]))  # (num_edges, d, f)
        energy = diff.square().sum(dim=(1, 2))  # (num_edges,)
        if edges.perm is not None:  # back to the input edge order
            energy = energy.new_empty(edges.num_edges).index_copy(
                0, edges.perm, energy)
        return energy

    def _explain_weight(self, edge_weight: OptTensor, num_edges: int,
                        dtype: torch.dtype) -> Tensor:
        mask = self._edge_mask
        if mask is None:
            raise ValueError(
                f"{self.__class__.__name__}: explain mode is on but no edge "
                f"mask is set")
        if mask.shape != (num_edges,):
            raise ValueError(
                f"{self.__class__.__name__}: expected an edge mask of shape "
                f"({num_edges},) (got {tuple(mask.shape)})")
        mask = (mask.sigmoid() if self._apply_sigmoid else mask).to(dtype)
        return mask if edge_weight is None else edge_weight * mask

    def explain_message(self, inputs: Tensor, dim_size: int | None) -> Tensor:
        r"""Identity: in explain mode :meth:`forward` folds the edge mask
        into :math:`\alpha_e` (it must scale both Laplacian blocks)."""
        return inputs

    def message(self, y_j: Tensor, transport: Tensor,
                alpha: OptTensor) -> Tensor:
        # (num_edges, d, f): alpha_e F_v^T F_u y_u, the source stalk transported
        return weigh(alpha, restrict(transport, y_j))

    def aggregate(self, inputs: Tensor, index: Tensor, dst_ptr: Tensor,
                  msg_perm: OptTensor = None,
                  dim_size: int | None = None) -> Tensor:
        r"""Sums messages per destination over the CSR pointer
        :obj:`dst_ptr` (:func:`~sheafgnn.nn.segment.segment_sum`:
        :obj:`torch_scatter.segment_csr` or the PyTorch fallback); the number
        of destinations is :obj:`dst_ptr.numel() - 1` (= :obj:`dim_size`)."""
        if msg_perm is not None:  # messages in input order -> sorted
            inputs = inputs[msg_perm]
        return segment_sum(inputs, dst_ptr)  # (N, d, f)

    def __repr__(self) -> str:
        extra = (f", num_edge_types={self.num_edge_types}"
                 if self.num_edge_types != 1 else "")
        return (f"{self.__class__.__name__}({self.in_channels}, "
                f"stalk_dim={self.stalk_dim}, map_kind='{self.map_kind}'"
                f"{extra})")
