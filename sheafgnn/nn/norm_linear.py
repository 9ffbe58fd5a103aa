r"""A LayerNorm fused into the linear layer that reads it, for training memory.

Trained as the plain composition ``linear(norm(x))``, autograd keeps two rows
per input row: the norm's input and its output (the linear's input). Fused,
it keeps the input and the norm's per-row mean and :math:`1/\sigma` only, and
rebuilds the normed rows in backward (an elementwise pass)::

    x (n, C) -> LayerNorm -> xn (n, C) -> xn W^T + b (n, out)
    saved: x, mean (n, 1), rstd (n, 1)          rebuilt in backward: xn

Used before each SSM's input projection (:class:`~sheafgnn.nn.ssm.SelectiveSSM`)
and inside the experts' feed-forward (:class:`~sheafgnn.nn.experts.FeedForward`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["fusable_norm", "layer_norm_stats", "norm_grads", "norm_linear", "norm_linear_reference", "renorm"]


def layer_norm_stats(x: Tensor, weight: Tensor | None, bias: Tensor | None,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """(layer_norm(x), per-row mean, per-row 1/std), each (n, C) or (n, 1); ``x`` and empty statistics
    without a norm (``weight`` None)."""
    if weight is None:
        return x, x.new_empty(0), x.new_empty(0)
    return torch.native_layer_norm(x, [x.size(1)], weight, bias, eps)


def renorm(x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor) -> Tensor:
    """The normed rows again from the statistics of :func:`layer_norm_stats`: (n, C)."""
    return (x - mean).mul_(rstd).mul_(weight).add_(bias)


def norm_grads(grad_xn: Tensor, x: Tensor, mean: Tensor, rstd: Tensor, weight: Tensor, bias: Tensor,
               needs: list[bool]) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(grad_x, grad_weight, grad_bias) of a LayerNorm from the gradient at its output; ``needs`` says which."""
    return torch.ops.aten.native_layer_norm_backward(grad_xn, x, [x.size(1)], mean, rstd, weight, bias, needs)


class _NormLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, norm_weight: Tensor, norm_bias: Tensor, eps: float, weight: Tensor,
                bias: Tensor | None) -> Tensor:
        xn, mean, rstd = layer_norm_stats(x, norm_weight, norm_bias, eps)  # (n, C), (n, 1), (n, 1)
        ctx.save_for_backward(x, mean, rstd, norm_weight, norm_bias, weight)
        ctx.has_bias = bias is not None
        return F.linear(xn, weight, bias)  # (n, out)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        x, mean, rstd, norm_weight, norm_bias, weight = ctx.saved_tensors
        need_x, need_nw, need_nb, _, need_w, need_b = ctx.needs_input_grad
        grad_w = grad_b = grad_x = grad_nw = grad_nb = None
        if need_w:
            grad_w = grad_out.t() @ renorm(x, mean, rstd, norm_weight, norm_bias)  # (out, C)
        if need_b and ctx.has_bias:
            grad_b = grad_out.sum(0)
        if need_x or need_nw or need_nb:
            grad_x, grad_nw, grad_nb = norm_grads(grad_out @ weight, x, mean, rstd, norm_weight, norm_bias,
                                                  [need_x, need_nw, need_nb])
        return grad_x, grad_nw, grad_nb, None, grad_w, grad_b


def fusable_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is what the fused functions rebuild: an affine :class:`~torch.nn.LayerNorm` with bias."""
    return type(norm) is nn.LayerNorm and norm.elementwise_affine and norm.bias is not None


def norm_linear_reference(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    """The plain composition ``linear(norm(x))``."""
    return linear(norm(x))


def norm_linear(x: Tensor, norm: nn.LayerNorm, linear: nn.Linear) -> Tensor:
    r"""``linear(norm(x))`` that keeps ``x`` and the norm's statistics for backward, not the normed rows
    (see the module docstring); the plain composition without gradients, and for modules other than an
    affine :class:`~torch.nn.LayerNorm` with bias and a plain :class:`~torch.nn.Linear`.

    Shapes:
        - **input:** x (n, C)
        - **output:** (n, out)
    """
    if not (type(linear) is nn.Linear and fusable_norm(norm) and x.dim() == 2 and torch.is_grad_enabled()):
        return norm_linear_reference(x, norm, linear)
    return _NormLinear.apply(x, norm.weight, norm.bias, norm.eps, linear.weight, linear.bias)
