
import pytest
import torch
from safetensors import safe_open
from torch import nn

from sheafgnn.model import SheafStateLM
from sheafgnn.nn.quant import (
    PackedLinear,
    QuantConfig,
    QuantLinear,
    QuantSheafConv,
    apply_quant,
    dequantize,
    fake_quantize,
    pack_bits,
    pack_int4,
    quantize,
    unpack_bits,
    unpack_int4,
    validate_quant,
)
from sheafgnn.nn.sheaf import SheafConv
from sheafgnn.nn.topology import Selection
from sheafgnn.quantized import QuantizedFileError, export_quantized, load_quantized, model_bytes
from sheafgnn.site import build_site
from sheafgnn.site.flat import flatten_site

from .conftest import CODE, PROSE, assert_logits_causal, small_model_config

MAPS_INT4 = {"maps": "int4", "experts": "int8"}


_config = small_model_config


def _perturb(model: SheafStateLM) -> None:
    """Move every parameter off its init, as training would (zero biases, unit norms ...), by 0.05 N(0, 1); the
    broadcast gate by that in its own units (its parameter is the gate over gluing.gate_scale)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            units = model.config.gluing.gate_scale if name.endswith("broadcast_gate") else 1.0
            p.add_(0.05 / units * torch.randn_like(p))


# --------------------------------------------------------------------------- quantisers


@pytest.mark.parametrize("mode,qmax", [("int8", 127), ("int4", 7)])
def test_quantize_error_within_half_scale(mode, qmax):
    torch.manual_seed(0)
    w = torch.randn(16, 33) * torch.logspace(-3, 1, 16)[:, None]  # channels of very different ranges
    w[3] = 0.0  # an all-zero channel
    codes, scale = quantize(w, mode)
    assert codes.dtype == torch.int8 and codes.shape == w.shape and scale.shape == (16,)
    assert codes.abs().max() <= qmax
    err = (w - dequantize(codes, scale)).abs()  # (16, 33)
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()
    # the largest entry of each (non-zero) channel is on the grid, at +-qmax
    top = w.abs().argmax(1)
    assert (codes.gather(1, top[:, None]).abs().squeeze(1)[w.abs().amax(1) > 0] == qmax).all()
    assert torch.equal(fake_quantize(w, mode), dequantize(codes, scale))
    # per-channel along another axis
    codes_t, scale_t = quantize(w.T, mode, dim=1)
    assert torch.equal(codes_t, codes.T) and torch.equal(scale_t, scale)


def test_ternary_is_twn():
    torch.manual_seed(0)
    w = torch.randn(8, 40)
    codes, scale = quantize(w, "ternary")
    assert set(codes.unique().tolist()) <= {-1, 0, 1}
    delta = 0.7 * w.abs().mean(1, keepdim=True)
    keep = w.abs() > delta
    assert torch.equal(codes, (torch.sign(w) * keep).to(torch.int8))
    assert torch.allclose(scale, (w.abs() * keep).sum(1) / keep.sum(1))
    q = fake_quantize(w, "ternary")
    for row, a in zip(q, scale):
        assert set(row.unique().tolist()) <= {-a.item(), 0.0, a.item()}


@pytest.mark.parametrize("mode", ["int8", "int4", "ternary"])
def test_ste_gradient(mode):
    w = torch.randn(6, 10, requires_grad=True)
    g = torch.randn(6, 10)
    (fake_quantize(w, mode) * g).sum().backward()
    assert w.grad.abs().sum() > 0
    assert torch.equal(w.grad, g)  # absmax scales clip nothing: the STE is the identity


def test_fake_quantize_none_is_identity():
    w = torch.randn(3, 4)
    assert fake_quantize(w, "none") is w


def test_int4_packing_round_trip():
    codes = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 1)  # every nibble value
    for n in (16, 15, 1):
        c = codes[:, :n].contiguous()
        packed = pack_int4(c)
        assert packed.dtype == torch.uint8 and packed.shape == (3, (n + 1) // 2)
        assert torch.equal(unpack_int4(packed, n), c)
    assert pack_int4(torch.tensor([[1, -1]], dtype=torch.int8)).item() == 0xF1  # low nibble first
    two = torch.randint(-2, 2, (5, 13), dtype=torch.int8)
    assert pack_bits(two, 2).shape == (5, 4)
    assert torch.equal(unpack_bits(pack_bits(two, 2), 2, 13), two)
    with pytest.raises(ValueError, match="need 7 bytes per row"):
        unpack_int4(packed.new_zeros(3, 6), 13)


def test_quant_config_validation(full_config):
    assert validate_quant({}) == {"maps": "none", "experts": "none", "map_values": "none"}
    assert validate_quant(MAPS_INT4) == {"maps": "int4", "experts": "int8", "map_values": "int4"}
    assert validate_quant({"maps": "int8", "map_values": None})["map_values"] == "none"
    with pytest.raises(ValueError, match=r"QuantConfig: unknown fields \['map'\]"):
        _config(full_config, quant={"map": "int4"})
    with pytest.raises(ValueError, match=r"QuantConfig.experts must be one of .* \(got 'int3'\)"):
        _config(full_config, quant={"experts": "int3"})
    with pytest.raises(ValueError, match="quant must be a QuantConfig or a mapping"):
        _config(full_config, quant="int8")
    with pytest.raises(ValueError, match="mode must be one of"):
        QuantLinear(4, 4, mode="none")
    with pytest.raises(ValueError, match="backend must be one of"):
        PackedLinear(4, 4, "int8", backend="fast")


# --------------------------------------------------------------------------- layers


def test_quant_linear_shares_parameters():
    torch.manual_seed(0)
    linear = nn.Linear(5, 7)
    q = QuantLinear.from_float(linear, "int4")
    assert q.weight is linear.weight and q.bias is linear.bias
    assert set(q.state_dict()) == {"weight", "bias"}
    assert str(q) == "QuantLinear(in_features=5, out_features=7, bias=True, mode=int4)"
    x = torch.randn(2, 3, 5)
    assert torch.allclose(q(x), nn.functional.linear(x, fake_quantize(linear.weight, "int4"), linear.bias))
    packed = PackedLinear.from_quant(q)
    assert torch.equal(packed(x), q(x))
    assert packed.codes.shape == (7, 3) and packed.codes.dtype == torch.uint8


def test_map_values_quantised_per_edge():
    torch.manual_seed(0)
    conv = SheafConv(16, 4, map_kind="general", num_edge_types=2)
    q = QuantSheafConv.from_float(conv, "int4")
    assert q.map_lin is conv.map_lin and str(q).endswith("map_values='int4')")
    assert set(q.state_dict()) == set(conv.state_dict())
    x = torch.randn(6, 16)
    edge_index = torch.tensor([[0, 1, 2, 3, 0], [1, 2, 3, 4, 5]])
    edge_type = torch.tensor([0, 1, 0, 1, 1])
    f_src, _ = q.restriction_maps(x, edge_index, edge_type)  # (E, d, d)
    ref, _ = conv.restriction_maps(x, edge_index, edge_type)
    scale = ref.abs().amax((1, 2)) / 7  # one scale per edge
    codes = f_src / scale[:, None, None]
    assert torch.allclose(codes, codes.round(), atol=1e-4) and codes.abs().max() <= 7 + 1e-4
    assert ((f_src - ref).abs() <= scale[:, None, None] / 2 + 1e-6).all()
    out = q(x.requires_grad_(), edge_index, edge_type)
    out.sum().backward()
    assert q.map_lin.weight.grad.abs().sum() > 0  # gradient flows through the quantised maps


def test_apply_quant_targets(full_config):
    torch.manual_seed(0)
    fp = SheafStateLM(_config(full_config, num_experts=2))
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, num_experts=2, quant=MAPS_INT4))
    block = model.blocks[0]
    assert isinstance(block.glue, QuantSheafConv) and block.glue.map_values == "int4"
    assert isinstance(block.glue.map_lin, QuantLinear) and block.glue.map_lin.mode == "int4"
    ffn = block.experts.experts[0][1]  # the shared experts, the second of two
    assert isinstance(ffn.fc, QuantLinear) and ffn.proj.mode == "int8"
    assert type(block.experts.routers[0]) is nn.Linear and type(block.topology.query) is nn.Linear
    # the same initial weights and state_dict keys as the float model (checkpoints interchange)
    fp_state, q_state = fp.state_dict(), model.state_dict()
    assert fp_state.keys() == q_state.keys()
    assert all(torch.equal(fp_state[k], q_state[k]) for k in fp_state)
    assert apply_quant(model, MAPS_INT4) is model and model.blocks[0].glue.map_lin.mode == "int4"
    ssm = SheafStateLM(_config(full_config, gluing=False, quant=MAPS_INT4))
    assert isinstance(ssm.blocks[0].experts.experts[0][0].fc, QuantLinear)


def test_post_training_quantisation(tmp_path, full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config))
    _perturb(model)
    float_config = model.config
    apply_quant(model, MAPS_INT4)
    assert validate_quant(model.config.quant) == validate_quant(MAPS_INT4) and float_config.quant == QuantConfig()
    assert isinstance(model.blocks[0].glue.map_lin, QuantLinear)
    model.eval()
    data = build_site(CODE, model.config.site_config)
    loaded = load_quantized(export_quantized(model, tmp_path / "ptq.safetensors"))
    with torch.no_grad():
        assert torch.allclose(loaded(data), model(data), atol=1e-5)
    with pytest.raises(ValueError, match="already quantised"):
        apply_quant(model, {"maps": "int8"})


# --------------------------------------------------------------------------- export / load


@pytest.mark.parametrize("quant", [MAPS_INT4, {"maps": "ternary", "experts": "ternary"}])
def test_export_load_round_trip(tmp_path, full_config, quant):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, map_kind="general", quant=quant))
    _perturb(model)
    model.eval()
    data = build_site(PROSE, model.config.site_config)
    with torch.no_grad():
        expected = model(data)  # the fake-quantised training graph
    path = export_quantized(model, tmp_path / "model.safetensors")
    loaded = load_quantized(path)
    assert not loaded.training and loaded.config == model.config
    assert isinstance(loaded.blocks[1].experts.experts[0][0].fc, PackedLinear)
    with torch.no_grad():
        got = loaded(data)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    sizes = model_bytes(model, path)
    assert sizes == {**model_bytes(loaded), "file_bytes": path.stat().st_size}
    bits = 8 if quant["experts"] == "int8" else 2  # the experts hold most quantised weights
    assert sizes["quantized_packed_bytes"] < sizes["quantized_fp32_bytes"] * (bits + 1) / 32
    assert sizes["packed_bytes"] < sizes["fp32_bytes"]
    # a loaded model exports the same tensors and metadata again
    again = export_quantized(loaded, tmp_path / "again.safetensors")
    files = [safe_open(str(p), framework="pt") for p in (path, again)]
    assert files[0].metadata() == files[1].metadata()
    assert files[0].keys() == files[1].keys()
    assert all(torch.equal(files[0].get_tensor(k), files[1].get_tensor(k)) for k in files[0].keys())


def _recorded_choices(monkeypatch, model: SheafStateLM) -> list[Selection]:
    """The list that each block's learned topology appends its choice to, in the model's forwards from now on."""
    chosen = []

    def recording(choose):
        def forward(*args, **kwargs):
            chosen.append(choose(*args, **kwargs))
            return chosen[-1]
        return forward

    for block in model.blocks:
        monkeypatch.setattr(block.topology, "forward", recording(block.topology.forward))
    return chosen


def _reached_by_flips(exact: list[Selection], approx: list[Selection], time: torch.Tensor,
                      num_tokens: int) -> torch.Tensor:
    """(num_tokens,) bool: the positions whose logits a different top-k choice can move. A destination whose
    kept sources differ moves its own position in the last block; in an earlier block, the next block's scans
    may carry it to every later position."""
    reached = torch.zeros(num_tokens, dtype=torch.bool)
    for block, (a, b) in enumerate(zip(exact, approx)):
        edges_a, edges_b = set(map(tuple, a.edge_index.T.tolist())), set(map(tuple, b.edge_index.T.tolist()))
        for t in sorted({int(time[dst]) for _, dst in edges_a ^ edges_b}):
            reached[t if block == len(exact) - 1 else slice(t, None)] = True
    return reached


def test_int8_backend_is_close(monkeypatch, tmp_path, full_config):
    """Activations quantised: close, not equal. The learned topology's top-k is a discrete choice: a near-tie can
    flip, and the logits its choice reaches move by more than the tolerance (13 of 311 positions here, up to 3.6x
    it). Every such miss is at a position a flipped choice reaches; the others are within the tolerance; and with
    the reference's choices the int8 model is within it everywhere."""
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, quant={"maps": "int8", "experts": "int8"}))
    _perturb(model)
    model.eval()
    data = build_site(CODE, model.config.site_config)
    path = export_quantized(model, tmp_path / "m.safetensors")
    reference, int8 = load_quantized(path), load_quantized(path, backend="int8")
    assert isinstance(int8.blocks[0].glue.map_lin, PackedLinear)
    reference_choices, int8_choices = _recorded_choices(monkeypatch, reference), _recorded_choices(monkeypatch, int8)
    with torch.no_grad():
        exact, approx = reference(data), int8(data)
    tol = 0.05 * exact.std()
    error = (exact - approx).abs().amax(1)  # (num_tokens,)
    miss = error >= tol
    reached = _reached_by_flips(reference_choices, int8_choices, flatten_site(data).time, exact.size(0))
    assert miss.any() and miss.float().mean() <= 0.1, miss.float().mean()  # near-ties flip here, at a few positions
    assert not (miss & ~reached).any(), (miss & ~reached).nonzero().flatten().tolist()
    assert error.max() < 5 * tol, error.max() / tol

    replayed = iter(reference_choices)
    for block in int8.blocks:
        monkeypatch.setattr(block.topology, "forward", lambda *args, **kwargs: next(replayed))
    with torch.no_grad():
        error = (exact - int8(data)).abs().amax(1)
    assert error.max() < tol, error.max() / tol  # the choices explain every miss


def test_load_rejects_bad_files(tmp_path, full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, quant=MAPS_INT4))
    path = export_quantized(model, tmp_path / "good.safetensors")
    raw = path.read_bytes()
    with pytest.raises(QuantizedFileError, match="no file at"):
        load_quantized(tmp_path / "missing.safetensors")
    bad = tmp_path / "bad.safetensors"
    for _kind, content, message in [
        ("truncated", raw[: len(raw) // 2], "not a readable safetensors file"),
        ("garbage", b"\x00" * 64, "not a readable safetensors file"),
        ("bit flip", raw[:-10] + bytes([raw[-10] ^ 0xFF]) + raw[-9:], "is corrupt"),
    ]:
        bad.write_bytes(content)
        with pytest.raises(QuantizedFileError, match=message):
            load_quantized(bad)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(bad), metadata={"format": "other"})
    with pytest.raises(QuantizedFileError, match="not a sheafgnn quantised export"):
        load_quantized(bad)
    with pytest.raises(ValueError, match="expected a SheafStateLM"):
        export_quantized(nn.Linear(2, 2), bad)


# --------------------------------------------------------------------------- causality, training


def test_causal_with_quantisation(full_config):
    """Logits at positions <= t do not depend on text after t, with maps and experts quantised.

    In float64: rounding to int4 turns a last-bit difference between two BLAS
    kernels (chosen by the number of rows) into a whole quantisation step, so
    float32 would flag rounding noise as a leak now and then; float64 makes
    that noise ~1e-16 and a flipped rounding vanishingly rare.
    """
    torch.manual_seed(0)
    config = _config(full_config, map_kind="general", num_experts=2,
                     quant={"maps": "int4", "experts": "int8", "map_values": "int4"})
    assert_logits_causal(SheafStateLM(config).double(), PROSE, trials=2)

def test_quantised_model_trains(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, n_layers=1, quant={"maps": "int4", "experts": "ternary"}))
    data = build_site(PROSE[:200], model.config.site_config)
    ids = data["token"].x
    data["token"].y = torch.cat([ids[1:], ids.new_full((1,), -100)])
    loss = model.loss(data)
    loss.backward()
    block = model.blocks[0]
    for p in (block.glue.map_lin.weight, block.experts.experts[-1][0].fc.weight):  # output experts
        assert p.grad is not None and p.grad.abs().sum() > 0
