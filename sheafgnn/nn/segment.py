r"""Segment reductions over a destination-sorted CSR: the hot path of G.

Every reduction in sheafgnn that pools "many rows into one" (messages into
their destination node, tokens into their patch) runs over rows that are
sorted by their target and described by a CSR pointer ``ptr``::

    src  (num_rows, *)  rows, sorted by target segment
    ptr  (S + 1,)       ptr[0] = 0, ptr[-1] = num_rows, ptr[s]:ptr[s+1] = rows of s
    out  (S, *)         one reduced row per segment (0 for an empty segment)

Two backends give identical results (up to float summation order):

- ``"torch_scatter"``: :func:`torch_scatter.segment_csr` (fast, deterministic).
- ``"torch"``: pure PyTorch; ``ptr`` is expanded to a row -> segment index
  with :func:`torch.repeat_interleave` (explicit ``output_size``, no host
  sync) and rows are summed with :func:`torch.Tensor.index_add` (works on
  every device and dtype, differentiable twice).

``"auto"`` (the default) picks ``"torch_scatter"`` when it imports. The
compiled backend also runs torch-sparse's CSR SpMM where a sum of weighted
gathered rows is wanted, when torch-sparse imports (:func:`use_spmm`). Inside
:func:`torch.compile` the ``"torch"`` path is traced whatever the setting. The
environment variable ``SHEAFGNN_SEGMENT_BACKEND`` sets the starting choice;
:func:`set_backend` / :func:`use_backend` change it at run time.

``segment_gather`` is the adjoint of ``segment_sum``: it repeats row ``s`` of
a ``(S, *)`` tensor once per row of segment ``s``
(:func:`torch_scatter.gather_csr`, or :func:`torch.repeat_interleave`).

``segment_mean`` is ``segment_sum`` divided by the clamped segment length on
both backends (so an empty segment gives 0, and no backend-specific mean
kernel is involved).

``topk_per_group`` keeps the ``k`` highest of each group's rows (a sort, no backend): the competition of
:class:`~sheafgnn.nn.topology.LearnedTopology` over candidates listed edge by edge.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import Tensor

try:  # optional compiled extension
    import torch_scatter as _torch_scatter

    HAS_TORCH_SCATTER = True
except (ImportError, OSError):  # OSError: a wheel built for another torch
    _torch_scatter = None
    HAS_TORCH_SCATTER = False

try:  # optional compiled extension: registers torch.ops.torch_sparse (its CSR SpMM)
    import torch_sparse  # noqa: F401

    HAS_TORCH_SPARSE = True
except (ImportError, OSError):
    HAS_TORCH_SPARSE = False

__all__ = [
    "BACKENDS",
    "HAS_TORCH_SCATTER",
    "HAS_TORCH_SPARSE",
    "csr_transpose",
    "gather_segment_mean",
    "get_backend",
    "index_from_ptr",
    "ptr_from_index",
    "resolve_backend",
    "segment_gather",
    "segment_mean",
    "segment_sum",
    "set_backend",
    "sort_by_destination",
    "use_backend",
    "use_spmm",
]

BACKENDS = ("auto", "torch_scatter", "torch")

_backend = "auto"


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(
            f"segment backend must be one of {BACKENDS} (got {name!r})")
    if name == "torch_scatter" and not HAS_TORCH_SCATTER:
        raise ImportError(
            "segment backend 'torch_scatter' was requested but the "
            "'torch_scatter' package is not importable; install "
            "torch-scatter built for this torch version, or use "
            "set_backend('torch') / set_backend('auto')")
    return name


def set_backend(name: str) -> None:
    r"""Sets the segment-reduction backend for the whole process.

    Args:
        name (str): :obj:`"auto"` (torch-scatter when importable, else pure
            PyTorch), :obj:`"torch_scatter"` or :obj:`"torch"`.

    Raises:
        ValueError: for an unknown name.
        ImportError: for :obj:`"torch_scatter"` when it is not installed.
    """
    global _backend
    _backend = _check_backend(name)


def get_backend() -> str:
    r"""Returns the backend as set (:obj:`"auto"`, :obj:`"torch_scatter"` or
    :obj:`"torch"`); see :func:`resolve_backend` for the one that runs."""
    return _backend


def resolve_backend() -> str:
    r"""Returns the backend that actually runs: :obj:`"torch_scatter"` or
    :obj:`"torch"`. Under :func:`torch.compile` tracing it is always
    :obj:`"torch"` (torch-scatter's ops have no fake-tensor kernels)."""
    if torch.compiler.is_compiling():
        return "torch"
    if _backend == "auto":
        return "torch_scatter" if HAS_TORCH_SCATTER else "torch"
    return _backend


def use_spmm() -> bool:
    r"""Whether the compiled backend also runs torch-sparse's CSR SpMM (sums of weighted
    gathered rows: diagonal-map gluing, the pool read) instead of the pure-PyTorch gather-and-sum:
    torch-sparse is installed and :func:`resolve_backend` is :obj:`"torch_scatter"`."""
    return HAS_TORCH_SPARSE and resolve_backend() == "torch_scatter"


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[str]:
    r"""Context manager that switches the backend and restores the previous
    one on exit (also on error)::

        with use_backend("torch"):
            out = segment_sum(src, ptr)
    """
    global _backend
    previous = _backend
    set_backend(name)
    try:
        yield name
    finally:
        _backend = previous


_env_backend = os.environ.get("SHEAFGNN_SEGMENT_BACKEND")
if _env_backend:
    set_backend(_env_backend)


# --------------------------------------------------------------------------- #
# index <-> ptr
# --------------------------------------------------------------------------- #
def ptr_from_index(index: Tensor, size: int) -> Tensor:
    r"""Converts a sorted segment index to a CSR pointer.

    Args:
        index (torch.Tensor): sorted segment id of every row, shape
            :math:`(\text{num\_rows},)`, values in :math:`[0, \text{size})`.
        size (int): number of segments :math:`S` (explicit: no host sync).

    Returns:
        :obj:`ptr` of shape :math:`(S + 1,)`, dtype :obj:`torch.long`.
    """
    if index.dim() != 1:
        raise ValueError(
            f"ptr_from_index: index must be 1-D (got shape "
            f"{tuple(index.shape)})")
    return torch._convert_indices_from_coo_to_csr(
        index.long(), int(size), out_int32=False)


def index_from_ptr(ptr: Tensor, num_items: int) -> Tensor:
    r"""Expands a CSR pointer :math:`(S + 1,)` to the segment id of every row
    :math:`(\text{num\_items},)`, with :obj:`num_items` passed explicitly so that
    no host sync is needed."""
    num_segments = ptr.numel() - 1
    seg = torch.arange(num_segments, device=ptr.device)  # (S,)
    return torch.repeat_interleave(seg, ptr.diff(), output_size=num_items)


def csr_transpose(col: Tensor, num_cols: int) -> tuple[Tensor, Tensor]:
    r"""The column-major order of a CSR matrix's entries, as torch-sparse's SpMM backward reads it:
    ``csr2csc`` (the entries sorted by column, stably) and the column pointer ``colptr``
    :math:`(\text{num\_cols} + 1,)`.

    Args:
        col (torch.Tensor): column of every entry, in row-major order :math:`(\text{nnz},)`.
        num_cols (int): number of columns (explicit: no host sync).
    """
    csr2csc = torch.argsort(col, stable=True)  # (nnz,)
    return csr2csc, ptr_from_index(col[csr2csc], num_cols)


def sort_by_destination(
    edge_index: Tensor,
    *edge_attrs: Tensor | None,
    num_nodes: int,
    return_perm: bool = False,
) -> tuple:
    r"""Sorts edges by destination (``edge_index[1]``), stably, and builds
    the destination CSR pointer.

    Args:
        edge_index (torch.Tensor): :math:`(2, |\mathcal{E}|)`.
        *edge_attrs (torch.Tensor or None): per-edge tensors :math:`(|\mathcal{E}|, *)`
            permuted along dim 0 the same way; :obj:`None` passes through.
        num_nodes (int): number of destination nodes :math:`N`.
        return_perm (bool, optional): also return the permutation
            :math:`(|\mathcal{E}|,)` so that ``sorted = original[perm]``; the original
            order of a per-edge result ``y`` is ``y.new_empty(...)
            .index_copy_(0, perm, y)`` (default: :obj:`False`)

    Returns:
        ``(edge_index, *edge_attrs, ptr)`` (``ptr``: :math:`(N + 1,)`), or
        ``(edge_index, *edge_attrs, ptr, perm)`` with :obj:`return_perm`.
    """
    if edge_index.dim() != 2 or edge_index.size(0) != 2:
        raise ValueError(
            f"sort_by_destination: edge_index must have shape (2, num_edges) "
            f"(got {tuple(edge_index.shape)})")
    dst = edge_index[1]  # (num_edges,)
    dst_sorted, perm = torch.sort(dst, stable=True)  # (num_edges,), (num_edges,)
    out = [edge_index[:, perm]]
    for attr in edge_attrs:
        out.append(None if attr is None else attr[perm])
    out.append(ptr_from_index(dst_sorted, num_nodes))  # (N + 1,)
    if return_perm:
        out.append(perm)
    return tuple(out)


# --------------------------------------------------------------------------- #
# reductions
# --------------------------------------------------------------------------- #
def _check(src: Tensor, ptr: Tensor) -> None:
    if ptr.dim() != 1:
        raise ValueError(
            f"segment: ptr must be 1-D (got shape {tuple(ptr.shape)})")
    if src.dim() == 0:
        raise ValueError("segment: src must have at least one dimension")


def segment_sum(src: Tensor, ptr: Tensor) -> Tensor:
    r"""Sums the rows of :obj:`src` within each CSR segment.

    Args:
        src (torch.Tensor): :math:`(\text{num\_rows}, *)`, rows sorted by segment.
        ptr (torch.Tensor): :math:`(S + 1,)`, :obj:`ptr[0] = 0`,
            :obj:`ptr[-1] = num_rows`.

    Returns:
        :math:`(S, *)`; an empty segment gives zeros.
    """
    _check(src, ptr)
    num_segments = ptr.numel() - 1
    # no rows: always the torch path (cheap, and keeps autograd wired)
    if resolve_backend() == "torch_scatter" and src.size(0) > 0:
        return _torch_scatter.segment_csr(src, ptr.long(), reduce="sum")
    index = index_from_ptr(ptr, src.size(0))  # (num_rows,)
    out = src.new_zeros((num_segments,) + tuple(src.shape[1:]))  # (S, *)
    return out.index_add(0, index, src)


def segment_mean(src: Tensor, ptr: Tensor) -> Tensor:
    r"""Averages the rows of :obj:`src` within each CSR segment.

    Args:
        src (torch.Tensor): :math:`(\text{num\_rows}, *)`, rows sorted by segment.
        ptr (torch.Tensor): :math:`(S + 1,)`.

    Returns:
        :math:`(S, *)`; an empty segment gives zeros.
    """
    total = segment_sum(src, ptr)  # (S, *)
    count = ptr.diff().clamp_(min=1).to(total.dtype)  # (S,)
    return total / count.view((-1,) + (1,) * (total.dim() - 1))


def gather_segment_mean(x: Tensor, index: Tensor, ptr: Tensor) -> Tensor:
    r"""``segment_mean(x[index], ptr)``: the mean of the rows :obj:`x[index[ptr[s]:ptr[s + 1]]]` of
    every segment :math:`s` (0 for an empty one).

    Where torch-sparse runs (:func:`use_spmm`) it is one CSR SpMM, whose backward is the transposed
    SpMM: the gathered :math:`(\text{num\_rows}, F)` rows are never made, in either pass (through
    :func:`segment_mean`, the step kept none but made two: the gather and, in backward, the
    gradient repeated per row).

    Shapes:
        - **input:** x (M, F), index (num_rows,) rows of x, ptr (S + 1,)
        - **output:** (S, F)
    """
    _check(x, ptr)
    if not (use_spmm() and x.dim() == 2 and index.numel() > 0):
        return segment_mean(x.index_select(0, index), ptr)
    row = colptr = csr2csc = None
    if x.requires_grad:  # the transposed matrix: the rows in column order
        row = index_from_ptr(ptr, index.numel())  # (num_rows,)
        csr2csc, colptr = csr_transpose(index, x.size(0))  # (num_rows,), (M + 1,)
    total = torch.ops.torch_sparse.spmm_sum(row, ptr, index, None, colptr, csr2csc, x)  # (S, F)
    return total / ptr.diff().clamp(min=1).to(total.dtype).unsqueeze(1)


def segment_gather(src: Tensor, ptr: Tensor, num_rows: int) -> Tensor:
    r"""Repeats every segment's row over the rows of that segment: the
    adjoint of :func:`segment_sum` (``out[i] = src[s]`` for
    ``ptr[s] <= i < ptr[s + 1]``).

    Args:
        src (torch.Tensor): :math:`(S, *)`, one row per segment.
        ptr (torch.Tensor): :math:`(S + 1,)`, :obj:`ptr[0] = 0`.
        num_rows (int): :obj:`ptr[-1]`, passed explicitly (no host sync).

    Returns:
        :math:`(\text{num\_rows}, *)`.
    """
    _check(src, ptr)
    if resolve_backend() == "torch_scatter" and num_rows > 0:
        return _torch_scatter.gather_csr(src, ptr.long())
    return torch.repeat_interleave(src, ptr.diff(), dim=0,
                                   output_size=num_rows)


def topk_per_group(score: Tensor, group: Tensor, k: int) -> Tensor:
    """Mask of the ``k`` highest scores within each group (ties: lower index first).

    Args:
        score (Tensor): (E,) scores.
        group (Tensor): (E,) group ids (e.g. destinations).
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
