r"""Baselines for the Sheaf-State LM: a dense and a local-window causal Transformer.

Both are one class, :class:`CausalTransformer`; ``config.window`` picks the
attention pattern. Positions are encoded with rotary embeddings (RoPE,
Su et al. 2021, "RoFormer"), so there is no position table and no maximum
length: a model trained at 256 tokens runs at 16k.

::

    CausalTransformer
    ├── wte        Embedding(V, C)              idx (B, T) -> x (B, T, C)
    ├── blocks     n_layers x Block             pre-norm, residual
    │   ├── ln_1 -> CausalSelfAttention         (B, T, C) -> (B, T, C)
    │   │     conv (config.conv = k > 0):       ShortConv, causal depthwise over the last k inputs, before q/k/v
    │   │     dense: SDPA(is_causal=True)       O(T^2)
    │   │     local: local_attention(window=w)  O(T * w), blocked
    │   └── ln_2 -> MLP                         (B, T, C) -> (B, T, C)
    ├── ln_f
    └── lm_head    Linear(C, V), tied to wte    (B, T, C) -> logits (B, T, V)

    CausalTransformer.stream(B) -> TransformerStream   generation with a KV cache
        per layer keys/values (B, H, S, D)   dense: S doubles as needed; local: a ring, S = w + chunk - 1
                  conv inputs (B, k - 1, C)  the last k - 1 inputs of the short conv (with config.conv)
        feed(ids) -> logits of the fed positions, the same blocks with attention against the cache

The local variant restricts position t to keys t-w+1..t. It is computed in
blocks of w queries, each attending to the 2w keys of its own and the previous
block through a fixed (w, 2w) band mask, so no (T, T) matrix is ever built.
:func:`band_attention_reference` is the slow, obviously-correct version that
the tests compare it against.

With ``config.conv = k`` every attention layer first runs a short causal
depthwise convolution of width k over its (normed) input, as the attention
baselines of Zoology (Arora et al. 2023) and Based have: position t's
queries, keys and values then also see the inputs at t-1, ..., t-k+1, the
token shift that associative recall needs (a key's position carries "the
token before me"). The model kinds ``dense_conv`` and ``local_conv``
(:mod:`sheafgnn.lm`) are dense and local with ``conv = 3``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sheafgnn.generation import TokenStream


@dataclass
class TransformerConfig:
    """Hyperparameters of :class:`CausalTransformer` (prints itself)."""

    vocab_size: int = 256  # V: number of token ids (256 = byte-level)
    d_model: int = 256  # C: residual stream width
    n_layers: int = 4  # number of pre-norm Transformer blocks
    n_heads: int = 4  # attention heads; head_dim = d_model // n_heads, must be even (RoPE)
    mlp_ratio: int = 4  # MLP hidden width = mlp_ratio * d_model
    dropout: float = 0.0  # dropout on attention weights and residual branches
    window: int | None = None  # None = dense causal; w = attend to the last w tokens (self included)
    rope_base: float = 10000.0  # RoPE frequency base
    bias: bool = False  # biases in Linear and LayerNorm layers
    conv: int = 0  # k > 0: a causal depthwise conv of width k on each attention layer's input (Zoology); 0: none


# ---------------------------------------------------------------------------
# Rotary position embedding
# ---------------------------------------------------------------------------


def rope_at(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """Cosine and sine of the RoPE angles at integer ``positions`` (any shape).

    Each has shape (*positions.shape, head_dim // 2), float32.
    """
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim)
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., D/2)
    return angles.cos(), angles.sin()


def rope_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device) -> tuple[Tensor, Tensor]:
    """Cosine and sine tables for RoPE at positions 0..T-1, each of shape (T, head_dim // 2), float32."""
    return rope_at(torch.arange(seq_len, device=device), head_dim, base)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate channel pairs (i, i + D/2) of ``x`` (B, H, T, D) by the position angle.

    ``cos`` and ``sin`` broadcast against (B, H, T, D/2): (T, D/2) for shared
    positions, (B, 1, T, D/2) for per-sequence positions.
    """
    x1, x2 = x.float().chunk(2, dim=-1)  # (B, H, T, D/2) each
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)  # (B, H, T, D)
    return out.to(x.dtype)


# ---------------------------------------------------------------------------
# Local (sliding-window) attention: blocked fast path and dense reference
# ---------------------------------------------------------------------------


def local_attention(q: Tensor, k: Tensor, v: Tensor, window: int, dropout_p: float = 0.0) -> Tensor:
    r"""Causal sliding-window attention in O(T * w) time and memory.

    Query t attends to keys t-w+1..t. Queries are split into blocks of w; block
    b attends to the keys of blocks b-1 and b (2w keys) under one (w, 2w) band
    mask: local query i may see local key j iff i < j <= i + w.

    Args:
        q, k, v (Tensor): queries, keys and values.
        window (int): the window w >= 1, the current token included.
        dropout_p (float, optional): attention dropout. (default: :obj:`0.0`)

    Shapes:
        - **input:** q, k, v (B, H, T, D)
        - **output:** (B, H, T, D)
    """
    if window < 1:
        raise ValueError(f"local_attention: window must be >= 1 (got {window})")
    B, H, T, D = q.shape
    w = window
    n = -(-T // w)  # number of query blocks, ceil(T / w)
    pad = n * w - T
    # Queries padded at the end (discarded below); keys/values also get w zero rows
    # in front, so block b's "previous block" is defined for b = 0.
    # Blocks are folded into the head axis so SDPA sees 4-D inputs (fused GPU kernels).
    q_blk = F.pad(q, (0, 0, 0, pad)).view(B * H, n, w, D)  # (BH, n, w, D)
    k_pad = F.pad(k, (0, 0, w, pad))  # (B, H, (n+1)w, D)
    v_pad = F.pad(v, (0, 0, w, pad))  # (B, H, (n+1)w, D)
    k_blk = torch.cat([k_pad[:, :, : n * w].reshape(B * H, n, w, D), k_pad[:, :, w:].reshape(B * H, n, w, D)], dim=2)
    v_blk = torch.cat([v_pad[:, :, : n * w].reshape(B * H, n, w, D), v_pad[:, :, w:].reshape(B * H, n, w, D)], dim=2)
    # k_blk, v_blk: (BH, n, 2w, D); key j of block b sits at position (b - 1) * w + j.
    i = torch.arange(w, device=q.device)[:, None]  # (w, 1)
    j = torch.arange(2 * w, device=q.device)[None, :]  # (1, 2w)
    band = (j > i) & (j <= i + w)  # (w, 2w)
    first = j >= w  # block 0 has no previous block: its first w keys are padding
    mask = band.expand(n, w, 2 * w).clone()  # (n, w, 2w), broadcast over BH
    mask[0] &= first
    out = F.scaled_dot_product_attention(q_blk, k_blk, v_blk, attn_mask=mask, dropout_p=dropout_p)  # (BH, n, w, D)
    return out.reshape(B, H, n * w, D)[:, :, :T]  # (B, H, T, D)


def band_attention_reference(q: Tensor, k: Tensor, v: Tensor, window: int | None) -> Tensor:
    """Slow reference: softmax attention under an explicit (T, T) causal band mask.

    ``window=None`` gives dense causal attention. Shapes as in :func:`local_attention`.
    """
    T = q.shape[-2]
    pos = torch.arange(T, device=q.device)
    allowed = pos[None, :] <= pos[:, None]  # (T, T): key <= query
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window  # key > query - w
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, T)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return scores.softmax(dim=-1) @ v  # (B, H, T, D)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


class ShortConv(nn.Module):
    r"""A short causal depthwise convolution over time (Zoology's ``ShortConvolution``):

    .. math::
        \mathbf{y}_t = \mathbf{b} + \sum_{i=0}^{k-1} \mathbf{w}_i \odot \mathbf{x}_{t-i},

    with :math:`\mathbf{x}_{t-i} = 0` before the first position, or, given ``history``, the inputs that
    came before (a stream's).

    Args:
        channels (int): :math:`C`.
        kernel_size (int): :math:`k \geq 1`.

    Shapes:
        - **input:** x (B, T, C), history (B, k - 1, C) (optional)
        - **output:** (B, T, C)
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConv: kernel_size must be >= 1 (got {kernel_size})")
        self.kernel_size = kernel_size
        self.conv = nn.Conv1d(channels, channels, kernel_size, groups=channels)

    def reset_parameters(self) -> None:
        self.conv.reset_parameters()

    def forward(self, x: Tensor, history: Tensor | None = None) -> Tensor:
        if history is None:
            history = x.new_zeros(x.size(0), self.kernel_size - 1, x.size(2))
        full = torch.cat([history, x], 1)  # (B, k - 1 + T, C)
        return self.conv(full.transpose(1, 2)).transpose(1, 2)  # (B, T, C)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.conv.in_channels}, kernel_size={self.kernel_size})"


# attend(q, k, v) -> y, all (B, H, T, D): the attention of one layer; None means causal over the input itself.
Attend = Callable[[Tensor, Tensor, Tensor], Tensor]
# convolve(conv, x) -> y, (B, T, C): the short conv of one layer; None means over the input itself.
Convolve = Callable[[ShortConv, Tensor], Tensor]


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with RoPE; dense or sliding-window; with ``config.conv`` a
    :class:`ShortConv` before the projections.

    ``forward(x, cos, sin, attend, convolve)``: the projections and RoPE are always these;
    ``attend`` replaces the attention over ``x`` itself and ``convolve`` the conv over ``x`` itself
    (a KV cache's, see :class:`TransformerStream`).
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.window = config.window
        self.dropout = config.dropout
        self.conv = ShortConv(config.d_model, config.conv) if config.conv else None
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.d_model, config.d_model, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def attend_self(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal (dense or windowed) attention of the T positions among themselves, (B, H, T, D) each."""
        p = self.dropout if self.training else 0.0
        if self.window is None or self.window >= q.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)  # (B, H, T, D)
        return local_attention(q, k, v, self.window, dropout_p=p)  # (B, H, T, D)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend | None = None,
                convolve: Convolve | None = None) -> Tensor:
        B, T, C = x.shape
        if self.conv is not None:
            x = self.conv(x) if convolve is None else convolve(self.conv, x)  # (B, T, C)
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, C // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (B, H, T, D)
        y = (attend or self.attend_self)(q, k, v)  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise GELU MLP, C -> mlp_ratio * C -> C."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model, bias=config.bias)
        self.proj = nn.Linear(config.mlp_ratio * config.d_model, config.d_model, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend | None = None,
                convolve: Convolve | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cos, sin, attend, convolve)  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class CausalTransformer(nn.Module):
    r"""Decoder-only Transformer baseline, dense or local-window.

    Pre-norm blocks, RoPE, GELU MLP, tied input/output embeddings. With
    ``config.window = None`` attention is dense causal through
    :func:`~torch.nn.functional.scaled_dot_product_attention`; with
    ``config.window = w`` position t sees only t-w+1..t, computed blocked in
    O(T * w) by :func:`local_attention`.

    Args:
        config (TransformerConfig): the hyperparameters.

    Shapes:
        - **input:** token ids (B, T)
        - **output:** logits (B, T, V)
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        c = config
        if c.vocab_size < 1 or c.d_model < 1 or c.n_layers < 1 or c.n_heads < 1:
            raise ValueError(f"CausalTransformer: vocab_size, d_model, n_layers and n_heads must be >= 1 (got {c})")
        if c.d_model % c.n_heads != 0 or (c.d_model // c.n_heads) % 2 != 0:
            raise ValueError(
                "CausalTransformer: d_model must be a multiple of 2 * n_heads so that the head dimension is "
                f"even for RoPE (got d_model={c.d_model}, n_heads={c.n_heads})"
            )
        if c.window is not None and c.window < 1:
            raise ValueError(f"CausalTransformer: window must be None (dense) or >= 1 (got {c.window})")
        if not isinstance(c.conv, int) or c.conv < 0:
            raise ValueError(f"CausalTransformer: conv must be 0 (none) or a kernel width >= 1 (got {c.conv!r})")
        if not 0.0 <= c.dropout < 1.0:
            raise ValueError(f"CausalTransformer: dropout must be in [0, 1) (got {c.dropout})")
        self.config = config
        self.wte = nn.Embedding(c.vocab_size, c.d_model)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.ln_f = nn.LayerNorm(c.d_model, bias=c.bias)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied embeddings
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * n_layers); the short convs
        keep PyTorch's Conv1d init (a width-k depthwise filter at std 0.02 would all but silence q/k/v)."""
        for name, p in self.named_parameters():
            if ".conv." in name:
                continue
            if p.dim() == 1 and name.endswith("weight"):  # LayerNorm gain
                nn.init.ones_(p)
            elif p.dim() == 1:  # biases
                nn.init.zeros_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        for block in self.blocks:
            if block.attn.conv is not None:
                block.attn.conv.reset_parameters()

    def forward(self, idx: Tensor) -> Tensor:
        if idx.dim() != 2:
            raise ValueError(f"CausalTransformer: idx must have shape (B, T) (got {tuple(idx.shape)})")
        T = idx.shape[1]
        cos, sin = rope_cos_sin(T, self.config.d_model // self.config.n_heads, self.config.rope_base, idx.device)
        return self.run(idx, cos, sin)  # (B, T, V)

    def run(self, idx: Tensor, cos: Tensor, sin: Tensor, attend: Callable[[int], Attend] | None = None,
            convolve: Callable[[int], Convolve] | None = None) -> Tensor:
        """The network on ``idx`` with given RoPE tables; ``attend(layer)`` and ``convolve(layer)`` give each
        layer's attention and short conv (default: causal over ``idx`` itself). Shapes: idx (B, T) -> logits
        (B, T, V)."""
        x = self.drop(self.wte(idx))  # (B, T, C)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, None if attend is None else attend(i),
                      None if convolve is None else convolve(i))  # (B, T, C)
        return self.lm_head(self.ln_f(x))  # (B, T, V)

    def stream(self, batch_size: int = 1) -> TransformerStream:
        """A :class:`TransformerStream` (KV cache) of ``batch_size`` sequences for generation.

        Create it after moving the model to its device and dtype, and use
        eval mode (dropout would make the stream differ from the forward).
        """
        return TransformerStream(self, batch_size)

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean next-token cross-entropy; targets equal to -100 are ignored.

        Shapes: idx (B, T), targets (B, T) -> scalar.
        """
        logits = self(idx)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)


# ---------------------------------------------------------------------------
# Streaming generation: a KV cache
# ---------------------------------------------------------------------------


class TransformerStream(TokenStream):
    r"""KV-cache stream of a :class:`CausalTransformer` (see :class:`~sheafgnn.generation.TokenStream`).

    Every layer keeps the keys (RoPE applied at their absolute positions) and
    values of the fed positions in a buffer (B, H, S, D), so a step costs one
    position's projections plus attention over the buffer. With a short conv
    (``config.conv = k``) a layer also keeps the last k - 1 inputs of its conv
    per stream (B, k - 1, C), zero before a stream's first token as in the forward. Slot ``s`` of
    stream ``b`` holds position ``slot_pos[b, s]`` (-1: empty).

    - dense: slot = position; the buffer doubles when full (amortised O(1)
      per token, O(T) memory).
    - local (window w): a ring of ``w + chunk - 1`` slots, slot = position mod
      size, so memory is O(w) however long the stream grows.

    A fed chunk is processed in pieces of at most ``chunk`` tokens (w rounded
    up to 64 for local, 1024 for dense), each through the model's own blocks
    with one masked attention of the piece's queries against the buffer; the
    B streams are padded to the longest piece and masked per stream, so a
    batch gives the logits of the streams run one at a time.

    Args:
        model (CausalTransformer): the model, already on its device and dtype.
        batch_size (int, optional): the number of streams B. (default: :obj:`1`)

    Shapes:
        - **cache:** per layer keys and values (B, H, S, D), positions (B, S)
    """

    def __init__(self, model: CausalTransformer, batch_size: int = 1) -> None:
        super().__init__(batch_size, model.config.vocab_size)
        c = model.config
        self.model = model
        self.window = c.window
        self.chunk = 1024 if c.window is None else max(c.window, 64)
        weight = model.wte.weight
        self.head_dim = c.d_model // c.n_heads  # D
        size = 256 if c.window is None else c.window + self.chunk - 1  # S
        self._keys = [weight.new_zeros(batch_size, c.n_heads, size, self.head_dim) for _ in model.blocks]
        self._values = [torch.zeros_like(k) for k in self._keys]
        self._conv_inputs = [weight.new_zeros(batch_size, c.conv - 1, c.d_model) if c.conv else None
                             for _ in model.blocks]  # (B, k - 1, C) per layer
        self.slot_pos = torch.full((batch_size, size), -1, dtype=torch.long, device=weight.device)  # (B, S)
        self.positions = torch.zeros(batch_size, dtype=torch.long, device=weight.device)  # (B,) tokens cached

    def _grow(self, needed: int) -> None:
        """Dense only: at least ``needed`` slots, doubling (one copy per doubling)."""
        size = self.slot_pos.shape[1]
        if needed <= size:
            return
        new = max(needed, 2 * size)
        for cache in (self._keys, self._values):
            for i, old in enumerate(cache):
                cache[i] = old.new_zeros(*old.shape[:2], new, old.shape[3])
                cache[i][:, :, :size] = old
        slot_pos = self.slot_pos.new_full((self.batch_size, new), -1)
        slot_pos[:, :size] = self.slot_pos
        self.slot_pos = slot_pos

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        ids = [x.to(self.slot_pos.device) for x in ids]
        rows: list[list[Tensor]] = [[] for _ in ids]
        for start in range(0, max(x.numel() for x in ids), self.chunk):
            piece = [x[start : start + self.chunk] for x in ids]
            logits = self._feed_piece(piece)  # (B, N, V)
            for b, x in enumerate(piece):
                rows[b].append(logits[b, : x.numel()])  # (n_b, V)
        return [torch.cat(r) if r else self._keys[0].new_zeros(0, self.vocab_size) for r in rows]

    def _feed_piece(self, ids: list[Tensor]) -> Tensor:
        """One piece (<= chunk ids per stream) through the model against the cache; logits (B, N, V)."""
        device = self.slot_pos.device
        lengths = torch.tensor([x.numel() for x in ids], device=device)  # (B,)
        N = int(lengths.max())
        start = self.positions  # (B,) the first position of the piece
        offset = torch.arange(N, device=device)  # (N,)
        qpos = start[:, None] + offset  # (B, N) absolute positions of the queries
        valid = offset < lengths[:, None]  # (B, N) real (not padding) queries
        if self.window is None:  # dense: slot = position; attend over slots 0..span-1, the positions so far
            span = int((start + lengths).max())
            self._grow(span)
        else:  # local: the whole ring
            span = self.slot_pos.shape[1]
        b_idx, i_idx = valid.nonzero(as_tuple=True)  # (M,), (M,) the real queries
        slot = qpos[b_idx, i_idx] % self.slot_pos.shape[1]  # (M,) dense: the position itself
        self.slot_pos[b_idx, slot] = qpos[b_idx, i_idx]
        kpos = self.slot_pos[:, None, :span]  # (B, 1, span)
        allowed = (kpos >= 0) & (kpos <= qpos[:, :, None])  # (B, N, span): causal
        if self.window is not None:
            allowed &= kpos > qpos[:, :, None] - self.window  # the last w positions only
        allowed |= ~valid[:, :, None]  # padding queries see every slot (no empty softmax; discarded)
        mask = allowed[:, None]  # (B, 1, N, span), broadcast over heads

        def attend(layer: int) -> Attend:
            def step(q: Tensor, k: Tensor, v: Tensor) -> Tensor:  # (B, H, N, D) each
                keys, values = self._keys[layer], self._values[layer]  # (B, H, S, D)
                keys[b_idx, :, slot] = k[b_idx, :, i_idx]  # (M, H, D): write the real positions
                values[b_idx, :, slot] = v[b_idx, :, i_idx]
                return F.scaled_dot_product_attention(q, keys[:, :, :span], values[:, :, :span], attn_mask=mask)
            return step

        def convolve(layer: int) -> Convolve:
            def step(conv: ShortConv, x: Tensor) -> Tensor:  # (B, N, C)
                history = self._conv_inputs[layer]  # (B, k - 1, C)
                # A stream's real inputs come first in its row (padding at the end): its last k - 1 are
                # rows n_b, ..., n_b + k - 2 of [history, x].
                last = lengths[:, None] + torch.arange(history.size(1), device=device)  # (B, k - 1)
                full = torch.cat([history, x], 1)  # (B, k - 1 + N, C)
                self._conv_inputs[layer] = full.gather(1, last[:, :, None].expand(-1, -1, x.size(2)))
                return conv(x, history)
            return step

        idx = torch.zeros(self.batch_size, N, dtype=torch.long, device=device)  # (B, N), padded with id 0
        idx[b_idx, i_idx] = torch.cat(ids)
        cos, sin = rope_at(qpos, self.head_dim, self.model.config.rope_base)  # (B, N, D/2) each
        logits = self.model.run(idx, cos[:, None], sin[:, None], attend, convolve)  # (B, N, V)
        self.positions = start + lengths
        return logits


# ---------------------------------------------------------------------------
# Parameter matching
# ---------------------------------------------------------------------------


def count_parameters(model: nn.Module) -> int:
    """Number of distinct parameter entries (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())


def _count_for(config: TransformerConfig) -> int:
    with torch.device("meta"):  # shapes only, no memory, no init cost
        return count_parameters(CausalTransformer(config))


def match_width(
    target_params: int,
    make_config: Callable[[int], TransformerConfig],
    *,
    multiple_of: int | None = None,
    tolerance: float = 0.1,
) -> TransformerConfig:
    """Pick ``d_model`` so that the model has about ``target_params`` parameters.

    Candidates are multiples of ``multiple_of`` (default: ``2 * n_heads`` of
    ``make_config(64)``, which keeps the head dimension even for RoPE); the
    count grows with ``d_model``, so a bisection finds the candidate closest to
    the target.

    Args:
        target_params (int): the parameter count to match, e.g.
            ``count_parameters(sheaf_model)``.
        make_config (Callable[[int], TransformerConfig]): builds a config from a
            ``d_model``; everything but the width stays fixed.
        multiple_of (int, optional): step of the ``d_model`` grid.
            (default: :obj:`None`)
        tolerance (float, optional): the largest accepted relative error.
            (default: :obj:`0.1`)

    Raises:
        ValueError: if no width comes within ``tolerance`` of the target.
    """
    if target_params < 1:
        raise ValueError(f"match_width: target_params must be >= 1 (got {target_params})")
    step = multiple_of if multiple_of is not None else 2 * make_config(64).n_heads
    if step < 1:
        raise ValueError(f"match_width: multiple_of must be >= 1 (got {step})")
    lo, hi = 1, 1  # in units of step
    while _count_for(make_config(hi * step)) < target_params:
        lo, hi = hi, hi * 2
        if hi * step > 1 << 20:
            raise ValueError(f"match_width: no d_model up to {hi * step} reaches {target_params} parameters")
    while hi - lo > 1:  # invariant: count(lo) < target <= count(hi), unless lo == 1
        mid = (lo + hi) // 2
        if _count_for(make_config(mid * step)) < target_params:
            lo = mid
        else:
            hi = mid
    best = min((make_config(k * step) for k in {lo, hi}), key=lambda c: abs(_count_for(c) - target_params))
    err = abs(_count_for(best) - target_params) / target_params
    if err > tolerance:
        raise ValueError(
            f"match_width: the closest width d_model={best.d_model} has {_count_for(best)} parameters, "
            f"{err:.1%} from the target {target_params} (tolerance {tolerance:.0%}); change n_layers, "
            "vocab_size or multiple_of"
        )
    return best
