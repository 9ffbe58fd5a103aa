r"""QuantVect: low-bit restriction maps and expert weights.

Symmetric per-output-channel quantisation of a weight :math:`W \in
\mathbb{R}^{C_{out} \times C_{in}}` to :math:`b` bits, one scale per row
(output channel) :math:`c`::

    q_max = 2^(b-1) - 1                     127 (int8), 7 (int4); the code -2^(b-1) is unused
    s_c   = max_j |W_cj| / q_max            (C_out,)  absmax scale, no gradient
    Q_cj  = clamp(round(W_cj / s_c), -q_max, q_max)   integer codes
    W^_cj = s_c Q_cj                        |W_cj - W^_cj| <= s_c / 2

Ternary (TWN, Li & Liu 2016, "Ternary Weight Networks")::

    Delta_c = 0.7 mean_j |W_cj|             threshold
    Q_cj    = sign(W_cj) 1[|W_cj| > Delta_c]                  in {-1, 0, +1}
    s_c     = mean_{j : |W_cj| > Delta_c} |W_cj|              the L2-optimal scale for that mask

Training runs on fake-quantised weights :math:`\hat W` with the
straight-through estimator (Bengio et al. 2013), clipped as in standard QAT
(``torch.ao`` ``FakeQuantize``):
:math:`\partial L / \partial W = \partial L / \partial \hat W \cdot
\mathbb{1}[|W / s| \le q_{max}]`. With absmax scales nothing lies outside the
range, so the mask is all ones and the gradient is the identity; ternary uses
the plain identity STE of TWN.

What ``quant`` switches on (config ``quant: {maps: int4, experts: int8}``;
values ``none | int8 | int4 | ternary``)::

    SheafStateLM
    '- blocks[l]
       |- glue: SheafConv -> QuantSheafConv      (map_values != none)
       |  |- map_lin: Linear (D -> 2H)  -> QuantLinear      maps       per output channel
       |  |- map_out: Linear (H -> P)   -> QuantLinear      maps       (MLP map learner only)
       |  |- map_type_emb: Embedding    stays fp32: an additive bias of the learner
       |  '- produced maps F_{u<=e}, F_{v<=e}  (num_edges, d) or (num_edges, d, d)
       |                                fake-quantised per edge and side  map_values (default: = maps)
       '- experts: PatchExperts
          |- experts[t][i]: FeedForward
          |  |- fc:   Linear (D -> hidden) -> QuantLinear   experts
          |  '- proj: Linear (hidden -> D) -> QuantLinear   experts
          '- routers: Linear                stays fp32 (a top-1 decision, tiny)

Everything else (embeddings and the tied readout, SSMs, norms, the topology
scorer, pool and broadcast) and every activation stays fp32. The produced
restriction maps are activation-like (a function of the input): they are
quantised at run time, per edge, with the same rule (one scale per edge and
side, the channel axis being the edge), so each edge's map is still a
function of that edge alone and causality is untouched. They are quantised
only when ``quant`` asks (``map_values``, which defaults to ``maps``).

For inference, :func:`to_packed` swaps every :class:`QuantLinear` for a
:class:`PackedLinear` that stores the packed codes; the file format that
holds such a model is in :mod:`sheafgnn.quantized` (``export_quantized``,
``load_quantized``).
"""

from __future__ import annotations

from dataclasses import dataclass, is_dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sheafgnn.config import ConfigFile
from sheafgnn.nn.experts import FeedForward
from sheafgnn.nn.sheaf import SheafConv

__all__ = [
    "QUANT_MODES", "QUANT_TARGETS", "PackedLinear", "QuantConfig", "QuantLinear", "QuantSheafConv", "apply_quant",
    "dequantize", "fake_quantize", "pack_bits", "pack_codes", "pack_int4", "quantize", "to_packed",
    "unpack_bits", "unpack_codes", "unpack_int4", "validate_quant",
]

QUANT_MODES = ("none", "int8", "int4", "ternary")
QUANT_TARGETS = ("maps", "experts", "map_values")
QMAX = {"int8": 127, "int4": 7, "ternary": 1}  # largest code magnitude
BITS = {"int8": 8, "int4": 4, "ternary": 2}  # stored bits per weight
BACKENDS = ("dequant", "int8")  # how a PackedLinear computes


# ---------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------


@dataclass
class QuantConfig(ConfigFile):
    """QuantVect of a :class:`~sheafgnn.model.SheafStateLM`: the fake quantisation (:func:`apply_quant`) of its
    restriction maps and its experts, each one of :data:`QUANT_MODES`."""

    maps: str = "none"  # the restriction maps' map learners
    experts: str = "none"  # the experts' feed-forward layers
    map_values: str | None = None  # the maps' values after the learner; None: as maps

    def __post_init__(self) -> None:
        validate_quant(self, "QuantConfig")

    def given(self) -> dict[str, str]:
        """The modes set (map_values left out while it follows maps), as :func:`validate_quant` reads them."""
        return {k: v for k, v in self.to_dict().items() if v is not None}


def validate_quant(quant: dict | QuantConfig, name: str = "quant") -> dict[str, str]:
    """Check a ``quant`` mapping (or :class:`QuantConfig`) and return it resolved: ``{maps, experts, map_values}``.

    Missing keys are ``"none"``, except ``map_values``, which follows ``maps``;
    ``None`` (YAML ``null``) means ``"none"``.

    Raises:
        ValueError: not a mapping, an unknown key, or an unknown mode.
    """
    if isinstance(quant, QuantConfig):
        quant = quant.given()
    if not isinstance(quant, dict):
        raise ValueError(f"{name} must be a mapping like {{'maps': 'int4', 'experts': 'int8'}} "
                         f"(got {type(quant).__name__})")
    unknown = sorted(str(k) for k in quant if k not in QUANT_TARGETS)
    if unknown:
        raise ValueError(f"{name}: unknown keys {unknown}; the keys are {list(QUANT_TARGETS)}")
    out = {}
    for key in QUANT_TARGETS:
        mode = quant.get(key, out.get("maps", "none") if key == "map_values" else "none")
        mode = "none" if mode is None else mode
        if not isinstance(mode, str) or mode not in QUANT_MODES:
            raise ValueError(f"{name}.{key} must be one of {list(QUANT_MODES)} (got {mode!r})")
        out[key] = mode
    return out


def _check_mode(mode: str, owner: str) -> None:
    if mode not in QMAX:
        raise ValueError(f"{owner}: mode must be one of {list(QMAX)} (got {mode!r})")


# ---------------------------------------------------------------------------
# Quantise, dequantise, fake-quantise
# ---------------------------------------------------------------------------


def _channel_view(t: Tensor, ndim: int, dim: int) -> Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return t.reshape(shape)


def _codes_and_scale(w: Tensor, mode: str, dim: int) -> tuple[Tensor, Tensor]:
    """Float codes (exact integers, shape of ``w``) and the keepdim scale; no gradient."""
    if w.dim() < 2:
        raise ValueError(f"quantize: expected a tensor with >= 2 dims, channels along dim {dim} "
                         f"(got shape {tuple(w.shape)})")
    w = w.detach()
    dims = [i for i in range(w.dim()) if i != dim % w.dim()]
    a = w.abs()
    tiny = torch.finfo(w.dtype).tiny
    if mode == "ternary":
        keep = a > 0.7 * a.mean(dims, keepdim=True)  # |w| > Delta_c
        scale = (a * keep).sum(dims, keepdim=True) / keep.sum(dims, keepdim=True).clamp_min(1)
        return torch.sign(w) * keep, scale.clamp_min(tiny)
    qmax = QMAX[mode]
    scale = (a.amax(dims, keepdim=True) / qmax).clamp_min(tiny)  # s_c
    return torch.round(w / scale).clamp_(-qmax, qmax), scale


def quantize(w: Tensor, mode: str, dim: int = 0) -> tuple[Tensor, Tensor]:
    r"""Symmetric per-channel quantisation (see the module docstring).

    Args:
        w (torch.Tensor): weights, channels along :obj:`dim`, at least 2-D.
        mode (str): :obj:`"int8"`, :obj:`"int4"` or :obj:`"ternary"`.
        dim (int, optional): the channel axis. (default: :obj:`0`)

    Returns:
        int8 codes (shape of :obj:`w`, in :math:`[-q_{max}, q_{max}]`) and
        scales :math:`(C,)` in the dtype of :obj:`w`.
    """
    _check_mode(mode, "quantize")
    codes, scale = _codes_and_scale(w, mode, dim)
    return codes.to(torch.int8), scale.reshape(-1)


def dequantize(codes: Tensor, scale: Tensor, dim: int = 0) -> Tensor:
    """``codes * scale`` with one scale per channel along ``dim``."""
    return codes.to(scale.dtype) * _channel_view(scale, codes.dim(), dim % codes.dim())


def fake_quantize(w: Tensor, mode: str, dim: int = 0) -> Tensor:
    r"""Quantise-dequantise :math:`\hat W = s \, Q(W)` with a straight-through gradient.

    Forward: exactly :func:`dequantize` of :func:`quantize`. Backward:
    :math:`\partial L/\partial W = \partial L/\partial \hat W \cdot
    \mathbb{1}[|W| \le q_{max} s]` (int8, int4; all ones for absmax
    scales), the identity for ternary. Scales carry no gradient.
    :obj:`mode="none"` returns :obj:`w` itself.
    """
    if mode == "none":
        return w
    _check_mode(mode, "fake_quantize")
    codes, scale = _codes_and_scale(w, mode, dim)
    q = codes * scale  # (shape of w)
    # forward: exactly q; backward: the identity (ternary) or masked to the clipping range
    if mode == "ternary":
        return q + (w - w.detach())
    inside = w.detach().abs() <= QMAX[mode] * scale  # clipped STE
    return q + (w - w.detach()) * inside


# ---------------------------------------------------------------------------
# Bit packing
# ---------------------------------------------------------------------------


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    r"""Packs signed codes in :math:`[-2^{b-1}, 2^{b-1} - 1]` along the last dim.

    Element :math:`j` goes, as a :math:`b`-bit two's-complement field, to
    bits :math:`b (j \bmod k)` of byte :math:`\lfloor j / k \rfloor`,
    :math:`k = 8 / b` (for int4: the low nibble holds the even element).
    The last byte is zero-padded.

    Shapes: ``(..., n)`` integer -> ``(..., ceil(n / k))`` uint8.
    """
    if bits not in (2, 4):
        raise ValueError(f"pack_bits: bits must be 2 or 4 (got {bits})")
    k = 8 // bits
    n = codes.size(-1)
    fields = codes.to(torch.int32) & ((1 << bits) - 1)  # (..., n) two's complement fields
    pad = (-n) % k
    if pad:
        fields = torch.cat([fields, fields.new_zeros(*fields.shape[:-1], pad)], dim=-1)
    fields = fields.reshape(*fields.shape[:-1], -1, k)  # (..., m, k)
    shifts = torch.arange(k, device=codes.device, dtype=torch.int32) * bits
    return (fields << shifts).sum(-1).to(torch.uint8)  # disjoint fields: sum == or


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: ``(..., ceil(n / k))`` uint8 -> ``(..., n)`` int8."""
    if bits not in (2, 4):
        raise ValueError(f"unpack_bits: bits must be 2 or 4 (got {bits})")
    k = 8 // bits
    if packed.size(-1) != -(-n // k):
        raise ValueError(f"unpack_bits: {n} values of {bits} bits need {-(-n // k)} bytes per row "
                         f"(got {packed.size(-1)})")
    shifts = torch.arange(k, device=packed.device, dtype=torch.int32) * bits
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (..., m, k)
    signed = fields - ((fields >> (bits - 1)) << bits)  # sign-extend
    return signed.flatten(-2)[..., :n].to(torch.int8)


def pack_int4(codes: Tensor) -> Tensor:
    """Two int4 codes per byte, low nibble first: ``(..., n)`` -> ``(..., ceil(n / 2))`` uint8."""
    return pack_bits(codes, 4)


def unpack_int4(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_int4`: ``(..., ceil(n / 2))`` uint8 -> ``(..., n)`` int8."""
    return unpack_bits(packed, 4, n)


def pack_codes(codes: Tensor, mode: str) -> Tensor:
    """int8 codes as stored: int8 as is, int4 and ternary packed along the last dim (:func:`pack_bits`)."""
    return codes.to(torch.int8) if mode == "int8" else pack_bits(codes, BITS[mode])


def unpack_codes(stored: Tensor, mode: str, n: int) -> Tensor:
    """Inverse of :func:`pack_codes`: ``n`` int8 codes per row."""
    return stored if mode == "int8" else unpack_bits(stored, BITS[mode], n)


def _stored_shape(mode: str, out_features: int, in_features: int) -> tuple[tuple[int, int], torch.dtype]:
    if mode == "int8":
        return (out_features, in_features), torch.int8
    k = 8 // BITS[mode]
    return (out_features, -(-in_features // k)), torch.uint8


# ---------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------


class QuantLinear(nn.Linear):
    r"""A linear layer with a fake-quantised weight, for quantisation-aware training.

    .. math::
        \mathbf{y} = \mathbf{x} \hat{\mathbf{W}}^\top + \mathbf{b}, \qquad
        \hat{\mathbf{W}}_{c,:} = s_c \, Q(\mathbf{W}_{c,:})

    with one scale :math:`s_c` per output channel (:func:`fake_quantize`,
    straight-through gradient). The bias and the activations stay float. The
    ``state_dict`` is that of :class:`torch.nn.Linear` (``weight``, ``bias``),
    so a float checkpoint loads into a quantised model and back.

    Args:
        in_features (int): input width.
        out_features (int): output width.
        bias (bool, optional): learn a bias. (default: :obj:`True`)
        mode (str, optional): :obj:`"int8"`, :obj:`"int4"` or
            :obj:`"ternary"`. (default: :obj:`"int8"`)

    Shapes:
        - **input:** :math:`(*, C_{in})`
        - **output:** :math:`(*, C_{out})`
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, mode: str = "int8",
                 device=None, dtype=None) -> None:
        _check_mode(mode, "QuantLinear")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.mode = mode

    @classmethod
    def from_float(cls, linear: nn.Linear, mode: str) -> QuantLinear:
        """Wraps ``linear``'s own parameters (shared, not copied; no RNG use)."""
        _check_mode(mode, "QuantLinear.from_float")
        q = cls.__new__(cls)
        nn.Module.__init__(q)
        q.in_features, q.out_features, q.mode = linear.in_features, linear.out_features, mode
        q.register_parameter("weight", linear.weight)
        q.register_parameter("bias", linear.bias)
        return q

    def quantized_weight(self) -> Tensor:
        return fake_quantize(self.weight, self.mode)  # (C_out, C_in)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.quantized_weight(), self.bias)  # (*, C_out)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode}"


class PackedLinear(nn.Module):
    r"""An inference-only linear layer that stores packed low-bit weights.

    Holds ``codes`` (int8 ``(C_out, C_in)``, or uint8 with two int4 or four
    ternary codes per byte), ``scale`` :math:`(C_{out},)` and ``bias``.

    - :obj:`backend="dequant"`: :math:`\mathbf{y} = \mathbf{x} (s \odot
      Q)^\top + \mathbf{b}`, the weight dequantised per call; equal to
      :class:`QuantLinear` on the same weights.
    - :obj:`backend="int8"`: dynamic symmetric per-row int8 activations,
      :math:`\mathbf{x}_r \approx t_r \mathbf{X}^{q}_r`, then
      ``torch._int_mm``: :math:`\mathbf{y}_{rc} = t_r s_c
      \sum_j X^{q}_{rj} Q_{cj} + b_c`. Approximate (quantises activations).

    Shapes:
        - **input:** :math:`(*, C_{in})`
        - **output:** :math:`(*, C_{out})`
    """

    def __init__(self, in_features: int, out_features: int, mode: str, bias: bool = True,
                 backend: str = "dequant") -> None:
        super().__init__()
        _check_mode(mode, "PackedLinear")
        if backend not in BACKENDS:
            raise ValueError(f"PackedLinear: backend must be one of {list(BACKENDS)} (got {backend!r})")
        self.in_features, self.out_features, self.mode, self.backend = in_features, out_features, mode, backend
        shape, dtype = _stored_shape(mode, out_features, in_features)
        self.register_buffer("codes", torch.zeros(shape, dtype=dtype))
        self.register_buffer("scale", torch.ones(out_features))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_quant(cls, layer: QuantLinear, backend: str = "dequant") -> PackedLinear:
        """Packs the current weight of ``layer``."""
        out = cls(layer.in_features, layer.out_features, layer.mode, layer.bias is not None, backend)
        codes, scale = quantize(layer.weight.detach(), layer.mode)
        out.codes = pack_codes(codes, layer.mode).to(layer.weight.device)
        out.scale = scale.float()
        if layer.bias is not None:
            out.bias = nn.Parameter(layer.bias.detach().float().clone(), requires_grad=False)
        return out

    def int_codes(self) -> Tensor:
        """The codes as int8, ``(C_out, C_in)``."""
        return unpack_codes(self.codes, self.mode, self.in_features)

    @property
    def weight(self) -> Tensor:
        """The dequantised weight ``(C_out, C_in)``."""
        return dequantize(self.int_codes(), self.scale)

    def forward(self, x: Tensor) -> Tensor:
        if self.backend == "dequant":
            return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).float()  # (n, C_in)
        if x2.size(0) == 0:
            return x.new_zeros(*shape[:-1], self.out_features)
        t = (x2.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # (n, 1)
        xq = torch.round(x2 / t).clamp_(-127, 127).to(torch.int8)  # (n, C_in)
        acc = torch._int_mm(xq, self.int_codes().t())  # (n, C_out) int32
        y = acc.float() * t * self.scale  # (n, C_out)
        if self.bias is not None:
            y = y + self.bias
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, mode={self.mode}, backend={self.backend}")


class QuantSheafConv(SheafConv):
    r""":class:`~sheafgnn.nn.sheaf.SheafConv` whose produced restriction maps
    are fake-quantised per edge.

    .. math::
        \hat{\mathbf{F}}_{u \trianglelefteq e} = s_e \,
        Q(\mathbf{F}_{u \trianglelefteq e}), \qquad
        s_e = \max_{ij} |(\mathbf{F}_{u \trianglelefteq e})_{ij}| / q_{max}

    (and likewise for :math:`\mathbf{F}_{v \trianglelefteq e}`), with a
    straight-through gradient. The maps of :obj:`"diag"` and
    :obj:`"general"` lie in :math:`(-1, 1)` (tanh), so a per-edge scale loses
    little; quantised :obj:`"orthogonal"` maps are only approximately
    orthogonal, while the layer keeps using :math:`\mathbf{F}^\top
    \mathbf{F} = \mathbf{I}` for the diagonal block. Each edge's scale depends
    on that edge's maps only, so the layer stays causal.

    Args:
        *args, **kwargs: as for :class:`~sheafgnn.nn.sheaf.SheafConv`.
        map_values (str, optional): :obj:`"int8"`, :obj:`"int4"` or
            :obj:`"ternary"`. (default: :obj:`"int4"`)
    """

    def __init__(self, *args, map_values: str = "int4", **kwargs) -> None:
        _check_mode(map_values, "QuantSheafConv")
        super().__init__(*args, **kwargs)
        self.map_values = map_values

    @classmethod
    def from_float(cls, conv: SheafConv, map_values: str) -> QuantSheafConv:
        """The same layer with quantised maps; shares ``conv``'s parameters and submodules."""
        with torch.random.fork_rng(devices=[]):  # the throwaway init must not move the global RNG
            q = cls(conv.in_channels, conv.stalk_dim, map_kind=conv.map_kind, num_edge_types=conv.num_edge_types,
                    map_hidden_channels=conv.map_hidden_channels, stalk_mixing=conv.stalk_mixing,
                    normalize=conv.normalize, act=conv.act, map_init=conv.map_init, map_values=map_values)
        q._parameters, q._buffers, q._modules = conv._parameters, conv._buffers, conv._modules
        q._non_persistent_buffers_set = set(conv._non_persistent_buffers_set)
        q.train(conv.training)
        return q

    def _maps(self, x: Tensor, src: Tensor, dst: Tensor, edge_type: Tensor | None) -> tuple[Tensor, Tensor]:
        f_src, f_dst = super()._maps(x, src, dst, edge_type)  # (num_edges, d) or (num_edges, d, d) each
        return fake_quantize(f_src, self.map_values), fake_quantize(f_dst, self.map_values)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", map_values='{self.map_values}')"


# ---------------------------------------------------------------------------
# Whole models
# ---------------------------------------------------------------------------


def apply_quant(model: nn.Module, quant: dict | QuantConfig) -> nn.Module:
    """Switch on fake quantisation in ``model`` in place (see the module docstring); returns it.

    Parameters are shared, not copied, and the global RNG is untouched, so a
    model built with ``quant`` starts from the same weights as without, and
    float ``state_dict`` keys are unchanged. Idempotent. On a float
    :class:`~sheafgnn.model.SheafStateLM` (post-training quantisation) it
    also replaces ``model.config`` by a copy with ``quant`` set, so that
    :func:`sheafgnn.quantized.export_quantized` records it.

    Raises:
        ValueError: ``quant`` is invalid, or the model is already quantised
            differently (build a fresh model instead).
    """
    q = validate_quant(quant)
    config = getattr(model, "config", None)
    if is_dataclass(config) and hasattr(config, "quant"):
        current = validate_quant(config.quant)
        if current != q:
            if any(mode != "none" for mode in current.values()):
                raise ValueError(f"apply_quant: the model is already quantised with {config.quant}; build a "
                                 f"fresh model with quant={quant} (or load a float checkpoint into one)")
            model.config = replace(config, quant=QuantConfig(**q))
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, SheafConv):
                if q["map_values"] != "none" and not isinstance(child, QuantSheafConv):
                    child = QuantSheafConv.from_float(child, q["map_values"])
                    setattr(parent, name, child)
                targets, mode = ("map_lin", "map_out"), q["maps"]
            elif isinstance(child, FeedForward):
                targets, mode = ("fc", "proj"), q["experts"]
            else:
                continue
            if mode == "none":
                continue
            for attr in targets:
                layer = getattr(child, attr)
                if type(layer) is nn.Linear:
                    setattr(child, attr, QuantLinear.from_float(layer, mode))
    return model


def to_packed(model: nn.Module, backend: str = "dequant") -> nn.Module:
    """Replace every :class:`QuantLinear` by a :class:`PackedLinear` of its current weight (in place)."""
    if backend not in BACKENDS:
        raise ValueError(f"to_packed: backend must be one of {list(BACKENDS)} (got {backend!r})")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                setattr(parent, name, PackedLinear.from_quant(child, backend))
            elif isinstance(child, PackedLinear):
                child.backend = backend
    return model
