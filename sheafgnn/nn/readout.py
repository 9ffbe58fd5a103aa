r"""R's training loss: next-token cross-entropy of a tied, layer-normed readout, in chunks of rows.

The readout of :class:`~sheafgnn.model.SheafStateLM` is
:math:`\mathrm{logits} = \mathrm{LayerNorm}(\mathbf{h}) \mathbf{W}_{emb}^\top`. Trained as the plain
composition, autograd keeps three tensors per row for backward (the norm's input and output and
the (M, V) log-probabilities: 64 MiB per readout at 32k tokens, and the model reads out up to three
times per step: its output and each block's pool read). Here the loss *and its gradients* are
computed a chunk of rows at a time in forward, and only the gradients are kept (as Liger Kernel's
fused linear cross-entropy does on the GPU)::

    h (M, D), target (M,)     for each chunk of rows:  logits = LayerNorm(h_c) W^T   (m, V)
                                                       loss  += CE(logits, target_c)  summed
                                                       grads += d loss / d (h_c, gamma, beta, W)
    forward -> loss / count   backward -> the kept gradients times the incoming one

Reference: :func:`readout_cross_entropy_reference`. Rows whose target is ``-100`` are skipped, and the
mean is over the rows that count, as in :func:`torch.nn.functional.cross_entropy`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["IGNORE_INDEX", "READOUT_CHUNK_ROWS", "readout_cross_entropy", "readout_cross_entropy_reference"]

IGNORE_INDEX = -100
READOUT_CHUNK_ROWS = 4096  # rows per chunk: a (4096, V) logits block at a time


def readout_cross_entropy_reference(h: Tensor, norm_weight: Tensor, norm_bias: Tensor, embedding: Tensor,
                                    target: Tensor, eps: float = 1e-5) -> Tensor:
    """The plain composition: ``cross_entropy(layer_norm(h) @ embedding.T, target)``."""
    logits = F.layer_norm(h, (h.size(-1),), norm_weight, norm_bias, eps) @ embedding.T  # (M, V)
    return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)


class _ReadoutCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, norm_weight: Tensor, norm_bias: Tensor, embedding: Tensor, target: Tensor,
                eps: float, chunk_rows: int) -> Tensor:
        needs = ctx.needs_input_grad[:4]  # h, norm_weight, norm_bias, embedding
        params = [t.detach().requires_grad_(need) for t, need in zip((norm_weight, norm_bias, embedding), needs[1:])]
        grad_h = torch.zeros_like(h) if needs[0] else None
        grad_params = [torch.zeros_like(t) if need else None for t, need in zip(params, needs[1:])]
        total = h.new_zeros(())
        for r0 in range(0, h.size(0), chunk_rows):
            rows = h[r0 : r0 + chunk_rows].detach().requires_grad_(needs[0])  # (m, D)
            with torch.enable_grad():
                logits = F.layer_norm(rows, (h.size(1),), params[0], params[1], eps) @ params[2].T  # (m, V)
                loss = F.cross_entropy(logits, target[r0 : r0 + chunk_rows], ignore_index=IGNORE_INDEX,
                                       reduction="sum")
            wanted = [t for t, need in zip([rows, *params], needs) if need]
            if wanted:
                grads = list(torch.autograd.grad(loss, wanted))
                if needs[0]:
                    grad_h[r0 : r0 + chunk_rows] = grads.pop(0)
                for g_sum, need in zip(grad_params, needs[1:]):
                    if need:
                        g_sum += grads.pop(0)
            total += loss.detach()
        count = int((target != IGNORE_INDEX).sum())
        scale = 1.0 / count if count else float("nan")  # no row counts: nan, as cross_entropy's mean
        ctx.save_for_backward(*(None if g is None else g * scale for g in (grad_h, *grad_params)))
        return total * scale

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: Tensor):
        return (*(None if g is None else g * grad_loss for g in ctx.saved_tensors), None, None, None)


def readout_cross_entropy(h: Tensor, norm_weight: Tensor, norm_bias: Tensor, embedding: Tensor, target: Tensor,
                          eps: float = 1e-5, chunk_rows: int = READOUT_CHUNK_ROWS) -> Tensor:
    r"""Mean next-token cross-entropy of :math:`\mathrm{LayerNorm}(\mathbf{h}) \mathbf{W}^\top`,
    differentiated in forward a chunk of rows at a time, so that backward keeps only the gradients
    (see the module docstring); equal to :func:`readout_cross_entropy_reference` up to float rounding,
    and that composition itself for at most ``chunk_rows`` rows. Not differentiable twice.

    Args:
        h (Tensor): (M, D) states.
        norm_weight (Tensor): (D,) the LayerNorm's weight.
        norm_bias (Tensor): (D,) its bias.
        embedding (Tensor): (V, D) the tied output embedding.
        target (Tensor): (M,) next-token ids, ``-100`` where a row does not count.
        eps (float, optional): the LayerNorm's epsilon. (default: :obj:`1e-5`)
        chunk_rows (int, optional): rows per chunk. (default: :obj:`4096`)

    Returns:
        the mean loss over the rows that count (a scalar).
    """
    if h.dim() != 2 or target.shape != (h.size(0),) or embedding.dim() != 2 or embedding.size(1) != h.size(1):
        raise ValueError(f"readout_cross_entropy: expected h (M, D), target (M,) and embedding (V, D) "
                         f"(got {tuple(h.shape)}, {tuple(target.shape)} and {tuple(embedding.shape)})")
    if chunk_rows < 1:
        raise ValueError(f"readout_cross_entropy: chunk_rows must be >= 1 (got {chunk_rows})")
    if h.size(0) <= chunk_rows:  # one chunk: what it keeps is small, and the plain composition is faster
        return readout_cross_entropy_reference(h, norm_weight, norm_bias, embedding, target, eps)
    return _ReadoutCrossEntropy.apply(h, norm_weight, norm_bias, embedding, target, eps, chunk_rows)
