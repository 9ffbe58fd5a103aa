import dataclasses

import pytest
import torch

from sheafgnn import baselines
from sheafgnn.baselines import (
    CausalTransformer,
    TransformerConfig,
    band_attention_reference,
    count_parameters,
    local_attention,
    match_width,
)

SMALL = TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2)


def qkv(B: int, H: int, T: int, D: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]


# ---------------------------------------------------------------------------
# Blocked local attention against the explicit (T, T) band mask
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("T,w", [(37, 5), (37, 8), (10, 1), (13, 4), (5, 9), (64, 16), (1, 3)])
def test_local_attention_matches_band_reference(T, w):
    q, k, v = qkv(2, 3, T, 8)
    out = local_attention(q, k, v, w)
    ref = band_attention_reference(q, k, v, w)
    assert out.shape == (2, 3, T, 8)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    g_out = torch.autograd.grad(out, (q, k, v), grad)
    g_ref = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(g_out, g_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_band_reference_without_window_is_causal_sdpa():
    q, k, v = qkv(1, 2, 11, 4)
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(band_attention_reference(q, k, v, None), sdpa)


def test_local_attention_ignores_keys_outside_window():
    T, w, t = 40, 6, 25
    q, k, v = (x.detach() for x in qkv(1, 2, T, 4))
    out = local_attention(q, k, v, w)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, : t - w + 1] += 5.0  # before the window of t
    v2[:, :, : t - w + 1] -= 5.0
    k2[:, :, t + 1 :] += 5.0  # after t
    v2[:, :, t + 1 :] -= 5.0
    out2 = local_attention(q, k2, v2, w)
    torch.testing.assert_close(out[:, :, t], out2[:, :, t])
    assert not torch.allclose(out[:, :, t + 1], out2[:, :, t + 1])


def test_local_attention_long_sequence_runs():
    # 16k tokens: a (T, T) float score matrix would be 1 GiB; the blocked path needs ~16 MB.
    q, k, v = (torch.randn(1, 1, 16384, 8) for _ in range(3))
    out = local_attention(q, k, v, 64)
    assert out.shape == (1, 1, 16384, 8) and torch.isfinite(out).all()


def test_local_attention_rejects_bad_window():
    q, k, v = qkv(1, 1, 4, 2)
    with pytest.raises(ValueError, match="window must be >= 1"):
        local_attention(q, k, v, 0)


# ---------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 4])
def test_forward_shapes_and_loss(window):
    torch.manual_seed(0)
    model = CausalTransformer(dataclasses.replace(SMALL, window=window))
    idx = torch.randint(0, 32, (3, 19))
    logits = model(idx)
    assert logits.shape == (3, 19, 32)
    targets = idx.clone()
    targets[:, :10] = -100
    loss = model.loss(idx, targets)
    assert loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert model.wte.weight.grad is not None
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("window,conv", [(None, 0), (3, 0), (None, 3), (3, 4)])
def test_causality(window, conv):
    torch.manual_seed(0)
    model = CausalTransformer(dataclasses.replace(SMALL, window=window, conv=conv)).double().eval()
    idx = torch.randint(0, 32, (2, 23))
    logits = model(idx)
    for t in (0, 5, 11, 21):
        changed = idx.clone()
        changed[:, t + 1 :] = torch.randint(0, 32, changed[:, t + 1 :].shape)
        new = model(changed)
        torch.testing.assert_close(new[:, : t + 1], logits[:, : t + 1], rtol=1e-10, atol=1e-10)


def test_local_window_covering_sequence_equals_dense():
    torch.manual_seed(0)
    dense = CausalTransformer(SMALL).double().eval()
    local = CausalTransformer(dataclasses.replace(SMALL, window=64)).double().eval()
    local.load_state_dict(dense.state_dict())
    idx = torch.randint(0, 32, (2, 20))
    torch.testing.assert_close(local(idx), dense(idx))
    # and the blocked path itself, with w = T - 1 (one token outside the window only at t = T - 1)
    blocked = CausalTransformer(dataclasses.replace(SMALL, window=19)).double().eval()
    blocked.load_state_dict(dense.state_dict())
    out, ref = blocked(idx), dense(idx)
    torch.testing.assert_close(out[:, :19], ref[:, :19])


def test_local_model_matches_band_masked_model(monkeypatch):
    # Swap the blocked path for the (T, T) reference inside a real model.
    torch.manual_seed(0)
    model = CausalTransformer(dataclasses.replace(SMALL, window=5)).double().eval()
    idx = torch.randint(0, 32, (2, 27))
    out = model(idx)
    monkeypatch.setattr(
        baselines, "local_attention", lambda q, k, v, w, dropout_p=0.0: band_attention_reference(q, k, v, w)
    )
    torch.testing.assert_close(out, model(idx))


def test_rope_needs_no_length_limit():
    model = CausalTransformer(dataclasses.replace(SMALL, window=16, n_layers=1)).eval()
    with torch.no_grad():
        assert model(torch.randint(0, 32, (1, 4096))).shape == (1, 4096, 32)


@pytest.mark.parametrize(
    "changes,match",
    [
        (dict(d_model=30, n_heads=4), "multiple of 2 \\* n_heads"),
        (dict(d_model=12, n_heads=4), "multiple of 2 \\* n_heads"),
        (dict(window=0), "window must be None"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(n_layers=0), "must be >= 1"),
        (dict(conv=-1), "conv must be 0"),
    ],
)
def test_config_validation(changes, match):
    with pytest.raises(ValueError, match=f"CausalTransformer: .*{match}"):
        CausalTransformer(dataclasses.replace(SMALL, **changes))


def test_config_prints_itself():
    assert str(SMALL).startswith("TransformerConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2,")


# ---------------------------------------------------------------------------
# Parameter counting and width matching
# ---------------------------------------------------------------------------


def test_count_parameters_matches_formula():
    for bias in (False, True):
        cfg = dataclasses.replace(SMALL, bias=bias)
        V, C, L = cfg.vocab_size, cfg.d_model, cfg.n_layers
        per_layer = 12 * C * C + 2 * C  # qkv, proj, 4x MLP; two LayerNorm gains
        if bias:
            per_layer += 3 * C + C + 4 * C + C + 2 * C  # qkv, proj, fc, proj, LayerNorm biases
        final = C * (2 if bias else 1)
        assert count_parameters(CausalTransformer(cfg)) == V * C + L * per_layer + final  # tied: V*C once


def test_short_conv_is_the_causal_depthwise_filter():
    """ShortConv against its definition, y_t = b + sum_i w_i x_{t-i}, with zeros or a given history before t = 0."""
    torch.manual_seed(0)
    conv = baselines.ShortConv(5, 3).double()
    x, history = torch.randn(2, 7, 5, dtype=torch.float64), torch.randn(2, 2, 5, dtype=torch.float64)
    w, b = conv.conv.weight[:, 0], conv.conv.bias  # (C, k): w[:, k - 1] multiplies x_t
    for past in (None, history):
        padded = torch.cat([torch.zeros(2, 2, 5, dtype=torch.float64) if past is None else past, x], 1)
        expected = torch.stack([b + sum(w[:, 2 - i] * padded[:, t + 2 - i] for i in range(3)) for t in range(7)], 1)
        torch.testing.assert_close(conv(x, past), expected)
    assert str(conv) == "ShortConv(5, kernel_size=3)"


def test_conv_models_keep_the_conv_init_and_count_its_parameters():
    model = CausalTransformer(dataclasses.replace(SMALL, conv=3))
    conv = model.blocks[0].attn.conv.conv
    assert conv.weight.abs().max() > 0.1  # PyTorch's Conv1d init (bound 1/sqrt(3)), not GPT-2's std 0.02
    C = SMALL.d_model
    assert count_parameters(model) == count_parameters(CausalTransformer(SMALL)) + SMALL.n_layers * (3 * C + C)


@pytest.mark.parametrize("target", [60_000, 1_234_567, 3_000_000])
def test_match_width_within_ten_percent(target):
    def make(d: int) -> TransformerConfig:
        return TransformerConfig(vocab_size=256, d_model=d, n_layers=4, n_heads=4)

    cfg = match_width(target, make)
    n = count_parameters(CausalTransformer(cfg))
    assert abs(n - target) / target <= 0.1
    assert cfg.d_model % 8 == 0 and (cfg.n_layers, cfg.n_heads, cfg.vocab_size) == (4, 4, 256)


def test_match_width_recovers_exact_width():
    def make(d: int) -> TransformerConfig:
        return TransformerConfig(vocab_size=100, d_model=d, n_layers=3, n_heads=6)

    target = count_parameters(CausalTransformer(make(132)))
    assert match_width(target, make).d_model == 132  # 132 = 11 * (2 * 6)


def test_match_width_rejects_unreachable_target():
    def make(d: int) -> TransformerConfig:
        return TransformerConfig(vocab_size=50_000, d_model=d, n_layers=2, n_heads=2)

    with pytest.raises(ValueError, match="match_width: the closest width"):
        match_width(1_000, make)  # the embedding alone is 200k at d_model=4
    with pytest.raises(ValueError, match="target_params must be >= 1"):
        match_width(0, make)
