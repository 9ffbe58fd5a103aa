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

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sheafgnn.config import ConfigFile
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.norm_linear import fusable_norm, layer_norm_stats, norm_grads, renorm


@dataclass
class ExpertsConfig(ConfigFile):
    """E of :class:`~sheafgnn.model.SheafStateLM`: its :class:`PatchExperts` and their balance loss."""

    mult: int = 2  # expert hidden width = mult * d_model
    num_experts: int = 1  # experts per node type (> 1: top-1 routing + balance loss)
    shared: bool = True  # one set of experts for every node type (the type embeddings still differ)
    balance_weight: float = 1e-2  # weight of the experts' load-balancing loss

    def __post_init__(self) -> None:
        if self.mult < 1 or self.num_experts < 1 or self.balance_weight < 0:
            raise ValueError(f"ExpertsConfig: need mult >= 1, num_experts >= 1 and balance_weight >= 0 "
                             f"(got {self.mult}, {self.num_experts} and {self.balance_weight})")


def feed_forward_reference(x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor,
                           proj_bias: Tensor, norm_weight: Tensor | None = None, norm_bias: Tensor | None = None,
                           eps: float = 1e-5) -> Tensor:
    """The plain composition ``proj(gelu(fc(x)))``, after ``layer_norm(x)`` with ``norm_weight`` given;
    autograd keeps ``x``, the normed rows, ``fc(.)`` and ``gelu(fc(.))``."""
    if norm_weight is not None:
        x = F.layer_norm(x, (x.size(-1),), norm_weight, norm_bias, eps)
    return F.linear(F.gelu(F.linear(x, fc_weight, fc_bias)), proj_weight, proj_bias)


FFN_CHUNK_ROWS = 8192  # rows per chunk of _LeanFeedForward: (8192, hidden) temporaries


def _row_chunks(x: Tensor) -> list[slice]:
    return [slice(r0, r0 + FFN_CHUNK_ROWS) for r0 in range(0, x.size(0), FFN_CHUNK_ROWS)]


class _LeanFeedForward(torch.autograd.Function):
    """:func:`feed_forward_reference` that saves its input ``x`` (and the norm's per-row mean and
    ``1/std``) only: the normed rows, ``u = fc(.)`` and ``gelu(u)`` are recomputed in backward (an
    elementwise pass and one matmul). The experts run on every node, so each of those is an (N, D) or
    (N, hidden) tensor per block: 120 MiB per block at 32k tokens, a tenth of the step's live memory.
    Both passes run :data:`FFN_CHUNK_ROWS` rows at a time, so that their (rows, hidden) temporaries stay
    small (each one that fits no hole of the heap extends it)."""

    @staticmethod
    def forward(ctx, x: Tensor, fc_weight: Tensor, fc_bias: Tensor, proj_weight: Tensor, proj_bias: Tensor,
                norm_weight: Tensor | None, norm_bias: Tensor | None, eps: float) -> Tensor:
        xn, mean, rstd = layer_norm_stats(x, norm_weight, norm_bias, eps)  # (n, C), (n, 1), (n, 1)
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, fc_weight, fc_bias, proj_weight)
        out = x.new_empty(x.size(0), proj_weight.size(0))  # (n, C)
        for r in _row_chunks(x):
            torch.addmm(proj_bias, F.gelu(F.linear(xn[r], fc_weight, fc_bias)), proj_weight.t(), out=out[r])
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, mean, rstd, norm_weight, norm_bias, fc_weight, fc_bias, proj_weight = ctx.saved_tensors
        need_x, need_fc_w, need_fc_b, need_proj_w, need_proj_b, need_norm_w, need_norm_b, _ = ctx.needs_input_grad
        normed = norm_weight is not None
        need_xn = need_x or need_norm_w or need_norm_b  # the gradient at the normed rows
        need_u = need_xn or need_fc_w or need_fc_b
        grad_proj_w = torch.zeros_like(proj_weight) if need_proj_w else None  # (C, hidden)
        grad_proj_b = grad_out.sum(0) if need_proj_b else None
        grad_fc_w = torch.zeros_like(fc_weight) if need_fc_w else None  # (hidden, C)
        grad_fc_b = torch.zeros_like(fc_bias) if need_fc_b else None
        grad_xn = torch.empty_like(x) if need_xn else None  # (n, C)
        for r in _row_chunks(x):
            xn = renorm(x[r], mean[r], rstd[r], norm_weight, norm_bias) if normed else x[r]  # (m, C)
            u = F.linear(xn, fc_weight, fc_bias)  # (m, hidden)
            g = grad_out[r]  # (m, C)
            if need_proj_w:
                grad_proj_w.addmm_(g.t(), F.gelu(u))
            if need_u:
                grad_u = torch.ops.aten.gelu_backward(g @ proj_weight, u)  # (m, hidden)
                if need_fc_w:
                    grad_fc_w.addmm_(grad_u.t(), xn)
                if need_fc_b:
                    grad_fc_b += grad_u.sum(0)
                if need_xn:
                    torch.mm(grad_u, fc_weight, out=grad_xn[r])
        grad_x, grad_norm_w, grad_norm_b = grad_xn, None, None
        if normed and need_xn:
            grad_x, grad_norm_w, grad_norm_b = norm_grads(grad_xn, x, mean, rstd, norm_weight, norm_bias,
                                                          [need_x, need_norm_w, need_norm_b])
        return grad_x, grad_fc_w, grad_fc_b, grad_proj_w, grad_proj_b, grad_norm_w, grad_norm_b, None


class FeedForward(nn.Module):
    """Linear -> GELU -> Linear, ``channels -> hidden -> channels``, optionally after a LayerNorm
    that its caller owns (``forward(x, norm)``).

    In training (plain :class:`~torch.nn.Linear` layers, gradients on) it runs as one autograd
    function that keeps ``x`` only and recomputes the rest in backward (:class:`_LeanFeedForward`).
    Inference on the few rows of a generation step (at most :data:`~sheafgnn.nn.cpu_kernels.STEP_ROWS`, on
    the CPU) is one call of the C++ kernel ``feed_forward`` (:mod:`sheafgnn.nn.cpu_kernels`: 14 us a row
    against 42 us for the ops); quantised layers (:mod:`sheafgnn.nn.quant`) and other inference run the plain
    composition.
    """

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.fc = nn.Linear(channels, hidden)
        self.proj = nn.Linear(hidden, channels)

    def forward(self, x: Tensor, norm: nn.LayerNorm | None = None) -> Tensor:
        fc, proj = self.fc, self.proj
        if torch.is_grad_enabled() and self.plain(norm):
            args = (None, None, 0.0) if norm is None else (norm.weight, norm.bias, norm.eps)
            return _LeanFeedForward.apply(x, fc.weight, fc.bias, proj.weight, proj.bias, *args)
        call = self.kernel(x, norm)
        if call is not None:
            x_norm, weights = call
            return cpu_kernels.feed_forward()(x, [0, x.size(0)], *x_norm, *weights)
        return proj(F.gelu(fc(x if norm is None else norm(x))))

    def plain(self, norm: nn.LayerNorm | None) -> bool:
        """Plain :class:`~torch.nn.Linear` layers (not quantised) and a norm the fused paths compute."""
        return type(self.fc) is nn.Linear and type(self.proj) is nn.Linear and (norm is None or fusable_norm(norm))

    def kernel(self, x: Tensor, norm: nn.LayerNorm | None) -> tuple | None:
        """The ``feed_forward`` kernel's arguments for the few rows ``x`` of an inference step
        (:func:`feed_forward_call` of this block), else None."""
        return feed_forward_call(x, norm, [cpu_kernels.registered(self, _BLOCK)])


# What the feed_forward kernel reads of a FeedForward: its layers (to check), then their weights and biases.
_BLOCK = ("fc", "proj", "fc.weight", "fc.bias", "proj.weight", "proj.bias")


def feed_forward_call(x: Tensor, norm: nn.LayerNorm | None, blocks: list[tuple]) -> tuple | None:
    """The ``feed_forward`` kernel's arguments after ``x`` and its row segments: ``norm``'s
    (:func:`~sheafgnn.nn.cpu_kernels.norm_arguments`) and the weights of ``blocks`` (per :class:`FeedForward`:
    its ``_BLOCK`` objects) as lists of fc weights, fc biases, proj weights and proj biases, one entry a
    segment; or None where the kernel does not compute what the blocks do: more than a step's rows,
    gradients, not the CPU or float32/64 in the weights' dtype, quantised layers, a norm other than an
    affine LayerNorm, or no kernel built."""
    x_norm = cpu_kernels.norm_arguments(x, norm)
    if x.size(0) > cpu_kernels.STEP_ROWS or x_norm is None or \
            any(type(block[0]) is not nn.Linear or type(block[1]) is not nn.Linear for block in blocks) or \
            not cpu_kernels.kernel_inputs(x, blocks[0][2].dtype) or cpu_kernels.feed_forward() is None:
        return None
    return x_norm, [list(w) for w in zip(*(block[2:] for block in blocks))]


@functools.cache
def _expert_paths(types: tuple[int, ...]) -> tuple[str, ...]:
    """The ``_BLOCK`` paths of the first expert of each of ``types`` in PatchExperts (for cpu_kernels.registered)."""
    return tuple(f"experts.{t}.0.{name}" for t in types for name in _BLOCK)


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

    The caller's LayerNorm ``norm`` (``forward(x, type_ptr, norm)``), if given, normalises the rows
    first; with one expert per type it runs inside each expert's fused function
    (:class:`FeedForward`), which then keeps no normed copy of the (N, D) rows for backward.

    Shapes:
        - **input:** node features :math:`(N, D)`, type pointer
          :math:`(\text{num\_types} + 1)` as a list of ints, a LayerNorm (optional)
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

    def _route(self, t: int, x: Tensor, norm: nn.LayerNorm | None) -> tuple[Tensor, Tensor | None]:
        """Type ``t``'s experts on its rows, and their load-balancing loss (None: nothing to balance)."""
        experts = self.experts[t]
        if self.routers is None or x.size(0) == 0:  # one expert, or an empty type: no load to balance
            return experts[0](x, norm), None
        x = x if norm is None else norm(x)  # the router reads the normed rows too
        probs = self.routers[t](x).softmax(-1)  # (n, k)
        weight, choice = probs.max(-1)  # (n,), (n,)
        out = torch.zeros_like(x)
        for i, expert in enumerate(experts):  # a loop per expert
            rows = torch.nonzero(choice == i).squeeze(1)
            out = out.index_add(0, rows, weight[rows, None] * expert(x[rows]))
        fraction = F.one_hot(choice, self.num_experts).float().mean(0)  # f_i
        balance = self.num_experts * (fraction * probs.mean(0)).sum()
        return out, balance

    def forward(self, x: Tensor, type_ptr: list[int], norm: nn.LayerNorm | None = None) -> tuple[Tensor, Tensor]:
        if len(type_ptr) != self.num_types + 1 or type_ptr[0] != 0 or type_ptr[-1] != x.size(0):
            raise ValueError(f"PatchExperts: type_ptr must have {self.num_types + 1} entries from 0 to "
                             f"x.size(0) = {x.size(0)} (got {list(type_ptr)})")
        call = self.fused_call(x, type_ptr, norm)
        if call is not None:
            return cpu_kernels.feed_forward()(x, *call), x.new_zeros(())
        outs, losses = [], []
        if torch.is_grad_enabled():
            # A split, not slices: its backward is one cat, where each slice's would zero-fill x's gradient. A type
            # without nodes still runs, so that its weights get (zero) gradients and every step is alike.
            blocks = enumerate(x.split([type_ptr[t + 1] - type_ptr[t] for t in range(self.num_types)]))
        else:  # inference: the types with nodes only (a stream's step has two of ten)
            blocks = [(t, x[type_ptr[t] : type_ptr[t + 1]]) for t in range(self.num_types)
                      if type_ptr[t + 1] > type_ptr[t]]
        for t, block in blocks:  # a loop per node type
            out, loss = self._route(t, block, norm)
            outs.append(out)
            if loss is not None:
                losses.append(loss)
        balance = torch.stack(losses).sum() / self.num_types if losses else x.new_zeros(())
        return (torch.cat(outs) if outs else torch.zeros_like(x)), balance

    def fused_call(self, x: Tensor, type_ptr: list[int], norm: nn.LayerNorm | None) -> tuple | None:
        """Inference on a step's few rows with one expert per type: the ``feed_forward`` kernel's arguments after
        ``x`` that run every present type's expert in one call (one module call and slice per type fewer):
        the row segments, then :func:`feed_forward_call`'s, flat; None where :meth:`FeedForward.kernel` would not
        run."""
        if self.routers is not None or torch.is_grad_enabled():
            return None
        present = tuple(t for t in range(self.num_types) if type_ptr[t + 1] > type_ptr[t])
        found, size = cpu_kernels.registered(self, _expert_paths(present)), len(_BLOCK)
        call = feed_forward_call(x, norm, [found[i : i + size] for i in range(0, len(found), size)]) if present \
            else None
        if call is None:
            return None
        x_norm, weights = call
        return [type_ptr[t] for t in present] + [type_ptr[-1]], *x_norm, *weights

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, num_types={self.num_types}, "
                f"hidden_channels={self.hidden_channels}, num_experts={self.num_experts})")
