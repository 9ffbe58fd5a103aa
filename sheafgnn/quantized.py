r"""Quantised model files: a :class:`~sheafgnn.model.SheafStateLM` with packed low-bit weights.

The fake-quantised layers themselves live in :mod:`sheafgnn.nn.quant`; this
module writes and reads the inference file of a quantised model. The file
is a safetensors file that is exactly the ``state_dict`` of the packed
model::

    <layer>.codes   int8  (C_out, C_in)            int8
                    uint8 (C_out, ceil(C_in / 2))  int4, two's-complement nibbles, low nibble first
                    uint8 (C_out, ceil(C_in / 4))  ternary, 2-bit fields, lowest bits first
    <layer>.scale   fp32  (C_out,)
    <layer>.bias    fp32  (C_out,)
    <other>         fp32, as in the model's state_dict
    metadata        format, version, config (JSON), layers (JSON), sha256 of all tensor bytes

Loading never unpickles; the loaded model holds
:class:`~sheafgnn.nn.quant.PackedLinear` layers that dequantise their weight
per call (``backend="dequant"``, identical to the fake-quantised training
graph) or run ``torch._int_mm`` on dynamically int8-quantised activations
(``backend="int8"``, approximate: it quantises activations, so measure it
before relying on it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.nn.quant import BACKENDS, QMAX, PackedLinear, QuantLinear, pack_codes, quantize, to_packed

__all__ = ["QuantizedFileError", "export_quantized", "load_quantized", "model_bytes"]

FORMAT = "sheafgnn-quant"
VERSION = 2  # 2: the topology's QK-norm (TopologyConfig.qk_norm), whose weights a version-1 file lacks
_REDO = "; re-export the model with export_quantized"


class QuantizedFileError(ValueError):
    """A quantised model file is missing, corrupt, or not a sheafgnn export."""


def _layer_info(module: QuantLinear | PackedLinear) -> dict:
    return {"mode": module.mode, "in_features": module.in_features, "out_features": module.out_features,
            "bias": module.bias is not None}


def _export_tensors(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, dict]]:
    """The packed state dict (CPU, contiguous, unshared) and the quantised layers' description."""
    state = dict(model.state_dict())
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, QuantLinear):
            codes, scale = quantize(state.pop(f"{name}.weight").detach(), module.mode)
            state[f"{name}.codes"] = pack_codes(codes, module.mode)
            state[f"{name}.scale"] = scale.float()
        elif not isinstance(module, PackedLinear):
            continue
        layers[name] = _layer_info(module)
    tensors = {k: v.detach().cpu().contiguous().clone() for k, v in sorted(state.items())}  # stable order
    return tensors, layers


def _digest(tensors: dict[str, Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key].contiguous()
        h.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def export_quantized(model: nn.Module, path: str | os.PathLike) -> Path:
    """Write ``model`` (a :class:`~sheafgnn.model.SheafStateLM`) with packed low-bit weights.

    Quantised layers (:class:`~sheafgnn.nn.quant.QuantLinear` or
    :class:`~sheafgnn.nn.quant.PackedLinear`) go out as packed codes and fp32
    scales, everything else as in the ``state_dict``; the config, the layer
    list and a SHA-256 of the tensor bytes go into the safetensors metadata.
    The file is written to ``path.tmp`` and renamed.

    Returns:
        The path written.
    """
    config = getattr(model, "config", None)
    if not hasattr(config, "to_dict"):
        raise ValueError(f"export_quantized: expected a SheafStateLM (a model with a config), "
                         f"got {type(model).__name__}")
    tensors, layers = _export_tensors(model)
    metadata = {"format": FORMAT, "version": str(VERSION), "model": type(model).__name__,
                "config": json.dumps(config.to_dict()), "layers": json.dumps(layers), "sha256": _digest(tensors)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


def _read_export(path: Path) -> tuple[dict[str, str], dict[str, Tensor]]:
    """The metadata and tensors of an export, checked for format, version and SHA-256."""
    if not path.is_file():
        raise QuantizedFileError(f"load_quantized: no file at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            meta = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except Exception as err:  # SafetensorError, OSError: truncated, garbage, unreadable
        raise QuantizedFileError(f"load_quantized: {path} is not a readable safetensors file "
                                 f"({type(err).__name__}: {err}){_REDO}") from None
    if meta.get("format") != FORMAT:
        raise QuantizedFileError(f"load_quantized: {path} is not a sheafgnn quantised export "
                                 f"(metadata format {meta.get('format')!r}, expected {FORMAT!r})")
    if meta.get("version") != str(VERSION):
        raise QuantizedFileError(f"load_quantized: {path} has format version {meta.get('version')!r}; "
                                 f"this sheafgnn reads version {VERSION}")
    if _digest(tensors) != meta.get("sha256"):
        raise QuantizedFileError(f"load_quantized: {path} is corrupt: its tensors do not match the SHA-256 "
                                 f"recorded at export{_REDO}")
    return meta, tensors


def _packed_model(path: Path, meta: dict[str, str], backend: str) -> SheafStateLM:
    """The packed model that the recorded config builds, checked against the recorded layer list."""
    try:
        config = SheafStateConfig.from_dict(json.loads(meta["config"]))
        layers = json.loads(meta["layers"])
    except (KeyError, TypeError, ValueError) as err:
        raise QuantizedFileError(f"load_quantized: {path} has an invalid config or layer list ({err}){_REDO}") from None
    with torch.random.fork_rng(devices=[]):
        model = SheafStateLM(config)
    to_packed(model, backend)
    found = {name: _layer_info(m) for name, m in model.named_modules() if isinstance(m, PackedLinear)}
    if found != layers:
        raise QuantizedFileError(f"load_quantized: {path} lists quantised layers that its config does not "
                                 f"build ({len(layers)} in the file, {len(found)} in the model){_REDO}")
    return model


def _load_tensors(path: Path, model: SheafStateLM, tensors: dict[str, Tensor]) -> None:
    """Load ``tensors`` into ``model`` if every key, shape, dtype, code and scale fits."""
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(tensors)), sorted(set(tensors) - set(expected))
    bad = [f"{k}: {tuple(tensors[k].shape)} {tensors[k].dtype}, expected {tuple(v.shape)} {v.dtype}"
           for k, v in expected.items()
           if k in tensors and (tensors[k].shape != v.shape or tensors[k].dtype != v.dtype)]
    if missing or unexpected or bad:
        raise QuantizedFileError(f"load_quantized: {path} does not fit its config: missing {missing[:5]}, "
                                 f"unexpected {unexpected[:5]}, mismatched {bad[:5]}{_REDO}")
    model.load_state_dict(tensors, strict=True)
    for name, m in model.named_modules():
        if isinstance(m, PackedLinear):
            if m.codes.numel() and int(m.int_codes().abs().max()) > QMAX[m.mode]:
                raise QuantizedFileError(f"load_quantized: {path}: codes of {name} lie outside the "
                                         f"{m.mode} range [-{QMAX[m.mode]}, {QMAX[m.mode]}]{_REDO}")
            if not (torch.isfinite(m.scale).all() and (m.scale > 0).all()):
                raise QuantizedFileError(f"load_quantized: {path}: scales of {name} are not finite and "
                                         f"positive{_REDO}")


def load_quantized(path: str | os.PathLike, backend: str = "dequant",
                   device: torch.device | str = "cpu") -> SheafStateLM:
    """Load a file from :func:`export_quantized` as an eval-mode :class:`~sheafgnn.model.SheafStateLM`.

    The model holds :class:`~sheafgnn.nn.quant.PackedLinear` layers (packed
    codes in memory; see there for ``backend``). Only safetensors is read,
    nothing is unpickled.

    Raises:
        QuantizedFileError: the file is missing, unreadable, truncated, not a
            sheafgnn export, fails its SHA-256, or its tensors do not fit the
            model its config describes.
    """
    if backend not in BACKENDS:
        raise ValueError(f"load_quantized: backend must be one of {list(BACKENDS)} (got {backend!r})")
    path = Path(path)
    meta, tensors = _read_export(path)
    model = _packed_model(path, meta, backend)
    _load_tensors(path, model, tensors)
    return model.to(device).eval()


def model_bytes(model: nn.Module, path: str | os.PathLike | None = None) -> dict[str, int]:
    """Bytes of ``model`` in fp32 and packed, as :func:`export_quantized` writes it.

    Returns:
        ``params`` (numbers in the state dict, quantised weights counted
        unpacked), ``fp32_bytes`` (every float at 4 bytes), ``packed_bytes``
        (tensor bytes of the export), ``quantized_fp32_bytes`` and
        ``quantized_packed_bytes`` (the quantised weights alone: codes and
        scales vs fp32), and ``file_bytes`` (size of ``path``, metadata
        included) when ``path`` is given.
    """
    tensors, layers = _export_tensors(model)
    layer_keys = {f"{name}.{part}" for name in layers for part in ("codes", "scale")}
    q_fp32 = sum(4 * v["in_features"] * v["out_features"] for v in layers.values())
    q_packed = sum(tensors[k].numel() * tensors[k].element_size() for k in layer_keys)
    others = {k: t for k, t in tensors.items() if k not in layer_keys}
    out = {
        "params": sum(t.numel() for t in others.values()) + q_fp32 // 4,
        "fp32_bytes": sum(t.numel() * (4 if t.is_floating_point() else t.element_size()) for t in others.values())
        + q_fp32,
        "packed_bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
        "quantized_fp32_bytes": q_fp32,
        "quantized_packed_bytes": q_packed,
    }
    if path is not None:
        out["file_bytes"] = os.path.getsize(path)
    return out
