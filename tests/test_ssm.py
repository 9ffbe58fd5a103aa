"""Phi: the chunked SSD scan and the fused kernels against their references, and SelectiveSSM."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sheafgnn.nn import ssd, ssm_kernels
from sheafgnn.nn.norm_linear import norm_linear, norm_linear_reference
from sheafgnn.nn.ssd import ssd_scan, ssd_scan_sequential
from sheafgnn.nn.ssm import SelectiveSSM, SSMState
from sheafgnn.nn.ssm_kernels import chain_conv, chain_conv_reference, gated_rms_norm


def scan_inputs(L, H=3, P=4, N=5, p_reset=0.15, dtype=torch.float64, seed=0):
    """Random scan inputs with random chain starts (reset[0] left random)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, H, P, generator=g, dtype=dtype)
    dt = torch.nn.functional.softplus(torch.randn(L, H, generator=g, dtype=dtype))
    A = -torch.rand(H, generator=g, dtype=dtype) * 2.0 - 0.05
    B = torch.randn(L, N, generator=g, dtype=dtype)
    C = torch.randn(L, N, generator=g, dtype=dtype)
    reset = torch.rand(L, generator=g) < p_reset
    return x, dt, A, B, C, reset


def chain_stream(lengths):
    """reset mask for chains of the given lengths laid end to end."""
    reset = torch.zeros(sum(lengths), dtype=torch.bool)
    reset[torch.tensor([0] + lengths[:-1]).cumsum(0)] = True
    return reset


# ----------------------------------------------------------------------------
# ssd_scan vs ssd_scan_sequential


@pytest.mark.parametrize("L,chunk", [(1, 8), (5, 8), (8, 8), (37, 8), (50, 16), (64, 16)])
@pytest.mark.parametrize("use_reset", [True, False])
@pytest.mark.parametrize("chunks_per_block", [None, 2])
def test_scan_matches_sequential_forward_and_grad(L, chunk, use_reset, chunks_per_block, monkeypatch):
    if chunks_per_block is not None:  # the intra-chunk term in blocks of chunks, the last one short
        monkeypatch.setattr(ssd, "INTRA_BLOCK_ELEMENTS", chunks_per_block * 3 * chunk * chunk)
    torch.manual_seed(0)
    x, dt, A, B, C, reset = scan_inputs(L, seed=L)
    reset = reset if use_reset else None
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C)]

    y, h = ssd_scan(*leaves, reset, chunk, return_final_state=True)
    y_ref, h_ref = ssd_scan_sequential(*ref_leaves, reset, chunk, return_final_state=True)
    assert y.shape == (L, 3, 4) and h.shape == (3, 4, 5)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=1e-8)

    gy, gh = torch.randn_like(y), torch.randn_like(h)
    grads = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), leaves)
    grads_ref = torch.autograd.grad((y_ref * gy).sum() + (h_ref * gh).sum(), ref_leaves)
    for name, got, want in zip(["x", "dt", "A", "B", "C"], grads, grads_ref, strict=True):
        torch.testing.assert_close(got, want, atol=1e-9, rtol=1e-7, msg=name)


def test_scan_saves_only_its_inputs_and_the_chunk_states():
    L, chunk = 192, 16
    leaves = [t.requires_grad_() for t in scan_inputs(L, seed=5)[:5]]  # x (L, 3, 4), dt, A, B, C (L, 5)
    reset = scan_inputs(L, seed=5)[5]
    saved = _saved_elements(lambda: ssd_scan(*leaves, reset, chunk))
    inputs = sum(t.numel() for t in leaves) + L  # and the chain starts
    chunk_states = (L // chunk + 1) * 3 * 4 * 5  # (T, H, P, N), one more where the odd-even scan pads T
    assert saved <= inputs + chunk_states
    # through plain autograd the chunked terms are kept too: several times more
    assert _saved_elements(lambda: ssd._scan_chunks(*leaves, reset, chunk)[0]) > 3 * saved


@pytest.mark.parametrize("pattern", ["every", "chunk_edges", "last", "pairs"])
def test_scan_reset_edge_cases(pattern):
    L, chunk = 33, 8
    x, dt, A, B, C, _ = scan_inputs(L, seed=11)
    reset = torch.zeros(L, dtype=torch.bool)
    if pattern == "every":
        reset[:] = True  # every chain has length 1
    elif pattern == "chunk_edges":
        reset[::chunk] = True
    elif pattern == "last":
        reset[L - 1] = True
    else:
        reset[[7, 8, 15, 16, 17]] = True  # starts right before/at/after chunk edges
    y, h = ssd_scan(x, dt, A, B, C, reset, chunk, return_final_state=True)
    y_ref, h_ref = ssd_scan_sequential(x, dt, A, B, C, reset, return_final_state=True)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(h, h_ref, atol=1e-10, rtol=1e-8)


@settings(max_examples=25, deadline=None)
@given(L=st.integers(1, 40), chunk=st.integers(1, 12), seed=st.integers(0, 2**16),
       p_reset=st.sampled_from([0.0, 0.1, 0.5, 1.0]))
def test_scan_matches_sequential_property(L, chunk, seed, p_reset):
    x, dt, A, B, C, reset = scan_inputs(L, H=2, P=2, N=3, p_reset=p_reset, seed=seed)
    y = ssd_scan(x, dt, A, B, C, reset, chunk)
    y_ref = ssd_scan_sequential(x, dt, A, B, C, reset)
    torch.testing.assert_close(y, y_ref, atol=1e-10, rtol=1e-8)


def test_scan_float32_agrees_to_1e4():
    x, dt, A, B, C, reset = scan_inputs(200, H=2, P=8, N=16, dtype=torch.float32, seed=3)
    y = ssd_scan(x, dt, A, B, C, reset, chunk_size=32)
    y_ref = ssd_scan_sequential(x, dt, A, B, C, reset)
    torch.testing.assert_close(y, y_ref, atol=1e-4, rtol=1e-4)


def test_scan_half_precision_runs_in_float32():
    x, dt, A, B, C, reset = scan_inputs(40, dtype=torch.float32, seed=8)
    y32 = ssd_scan(x, dt, A, B, C, reset, chunk_size=16)
    args = [t.bfloat16() for t in (x, dt, A, B, C)]
    y16 = ssd_scan(*args, reset, chunk_size=16)
    assert y16.dtype == torch.bfloat16
    y_ref = ssd_scan(*[t.float() for t in args], reset, chunk_size=16)
    torch.testing.assert_close(y16.float(), y_ref, atol=0.05, rtol=0.02)
    assert (y16.float() - y32).abs().max() < 0.5


def test_scan_independent_of_chunk_size():
    x, dt, A, B, C, reset = scan_inputs(300, seed=4)
    ys = [ssd_scan(x, dt, A, B, C, reset, chunk_size=q) for q in (1, 3, 16, 64, 512)]
    for y in ys[1:]:
        torch.testing.assert_close(y, ys[0], atol=1e-10, rtol=1e-8)


def test_reset_none_equals_single_chain_mask():
    x, dt, A, B, C, _ = scan_inputs(40, seed=5)
    y_none = ssd_scan(x, dt, A, B, C, None, chunk_size=8)
    all_false = torch.zeros(40, dtype=torch.bool)
    first_only = all_false.clone()
    first_only[0] = True
    torch.testing.assert_close(ssd_scan(x, dt, A, B, C, all_false, 8), y_none)
    torch.testing.assert_close(ssd_scan(x, dt, A, B, C, first_only, 8), y_none)


def test_reset_cuts_the_past_exactly():
    """A chain start at t: y[t:] of that chain ignores everything before t."""
    L, t = 45, 19
    x, dt, A, B, C, _ = scan_inputs(L, seed=6)
    reset = torch.zeros(L, dtype=torch.bool)
    reset[t] = True
    y = ssd_scan(x, dt, A, B, C, reset, chunk_size=8)
    x2, dt2, B2, C2 = x.clone(), dt.clone(), B.clone(), C.clone()
    x2[:t] += 1.0
    dt2[:t] *= 3.0
    B2[:t] -= 2.0
    C2[:t] += 0.5
    y2 = ssd_scan(x2, dt2, A, B2, C2, reset, chunk_size=8)
    assert (y2[:t] - y[:t]).abs().max() > 1e-3
    torch.testing.assert_close(y2[t:], y[t:], atol=1e-12, rtol=0.0)
    # and it equals running the tail as a chain of its own
    y_tail = ssd_scan(x[t:], dt[t:], A, B[t:], C[t:], None, chunk_size=8)
    torch.testing.assert_close(y[t:], y_tail, atol=1e-12, rtol=1e-10)


def test_scan_gradients_finite_under_extreme_decay():
    """Masked log decays (-inf) and underflowing exp must not make NaN grads."""
    x, dt, A, B, C, reset = scan_inputs(70, dtype=torch.float32, p_reset=0.3, seed=7)
    dt = (dt * 200.0).requires_grad_()  # exp(dt * A) underflows to 0
    A = (A * 10.0).requires_grad_()
    leaves = [x.requires_grad_(), dt, A, B.requires_grad_(), C.requires_grad_()]
    y = ssd_scan(*leaves, reset, chunk_size=16)
    grads = torch.autograd.grad(y.sum(), leaves)
    assert torch.isfinite(y).all()
    for g in grads:
        assert torch.isfinite(g).all()


def test_scan_rejects_bad_shapes():
    x, dt, A, B, C, reset = scan_inputs(10)
    with pytest.raises(ValueError, match="dt must have shape"):
        ssd_scan(x, dt[:, :1], A, B, C, reset)
    with pytest.raises(ValueError, match="reset must be a bool"):
        ssd_scan(x, dt, A, B, C, reset.long())
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_scan(x, dt, A, B, C, reset, chunk_size=0)


# ----------------------------------------------------------------------------
# chain_conv and gated_rms_norm vs their plain references


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("with_window", [False, True])
@pytest.mark.parametrize("block_rows", [3, 8192])
def test_chain_conv_matches_its_reference(K, with_window, block_rows, monkeypatch):
    monkeypatch.setattr(ssm_kernels, "CONV_BLOCK_ROWS", block_rows)  # 3: the backward runs in blocks
    g = torch.Generator().manual_seed(8)
    C = 5
    block = SelectiveSSM(8, headdim=8, d_conv=K)
    starts = torch.zeros(13, dtype=torch.bool)
    starts[[0, 4, 5]] = True  # three chains, one of length 1
    pos, num_rows, before = block._layout(starts)
    x, w, b = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
               for shape in ((13, C), (C, K), (C,)))
    window = (torch.randn(before.numel(), C, generator=g, dtype=torch.float64, requires_grad=True)
              if with_window else None)
    args = (x, pos, num_rows, w, b, before, window)
    torch.testing.assert_close(chain_conv(*args), chain_conv_reference(*args))
    torch.autograd.gradcheck(chain_conv, args)
    # no element reads another chain: a change in chain 1 leaves chains 0 and 2 alone
    x2 = x.detach().clone()
    x2[4] += 1.0
    changed = (chain_conv(x2, *args[1:]) - chain_conv(*args)).abs().sum(1) > 0
    assert changed.tolist() == [False] * 4 + [True] + [False] * 8


def test_gated_rms_norm_matches_rmsnorm_of_gated():
    g = torch.Generator().manual_seed(9)
    L, C, eps = 7, 6, 1e-6
    y, z, weight = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                    for shape in ((L, C), (L, C), (C,)))
    norm = torch.nn.RMSNorm(C, eps=eps).double()
    with torch.no_grad():
        norm.weight.copy_(weight)
    torch.testing.assert_close(gated_rms_norm(y, z, weight, eps), norm(y * torch.nn.functional.silu(z)))
    torch.autograd.gradcheck(lambda *t: gated_rms_norm(*t, eps), (y, z, weight))
    proj = torch.randn(4, C, generator=g, dtype=torch.float64, requires_grad=True)  # the output projection inside
    torch.testing.assert_close(gated_rms_norm(y, z, weight, eps, proj), norm(y * torch.nn.functional.silu(z)) @ proj.T)
    torch.autograd.gradcheck(lambda y, z, w, p: gated_rms_norm(y, z, w, eps, p), (y, z, weight, proj))
    with torch.inference_mode():  # the plain composition (no autograd function) gives the same values
        gated = norm(y * torch.nn.functional.silu(z))
        torch.testing.assert_close(gated_rms_norm(y, z, weight, eps, proj), gated @ proj.T)
        torch.testing.assert_close(gated_rms_norm(y, z, weight, eps), gated)


# ----------------------------------------------------------------------------
# SelectiveSSM


def make_block(d_model=16, **kwargs):
    torch.manual_seed(0)
    kwargs = {"d_state": 8, "headdim": 8, "chunk_size": 8, **kwargs}
    return SelectiveSSM(d_model, **kwargs).double()


def test_block_shapes_repr_and_init():
    block = SelectiveSSM(64)
    assert str(block) == "SelectiveSSM(64, d_state=16, expand=2, headdim=32, chunk_size=64)"
    assert block.nheads == 4 and block.headdim == 32
    out = block(torch.randn(10, 64))
    assert out.shape == (10, 64)
    dt0 = torch.nn.functional.softplus(block.dt_bias)
    assert (dt0 >= block.dt_min * 0.999).all() and (dt0 <= block.dt_max * 1.001).all()
    A = -torch.exp(block.A_log)
    assert (A <= -1.0 + 1e-6).all() and (A >= -16.0 - 1e-6).all()


@pytest.mark.parametrize("kwargs,match", [
    ({"d_model": 10, "expand": 2, "headdim": 8}, "headdim must divide"),
    ({"d_model": 16, "d_state": 0}, "d_state must be a positive int"),
    ({"d_model": 16, "chunk_size": 0}, "chunk_size must be a positive int"),
    ({"d_model": 16, "d_conv": 0}, "d_conv must be a positive int"),
])
def test_block_invalid_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SelectiveSSM(**kwargs)


def test_block_rejects_bad_input():
    block = make_block()
    with pytest.raises(ValueError, match="x must have shape"):
        block(torch.randn(5, 3, dtype=torch.float64))
    with pytest.raises(ValueError, match="reset must have shape"):
        block(torch.randn(5, 16, dtype=torch.float64), torch.zeros(4, dtype=torch.bool))


@pytest.mark.parametrize("d_conv", [1, 4])
def test_block_causal(d_conv):
    block = make_block(d_conv=d_conv)
    torch.manual_seed(1)
    L = 41
    x = torch.randn(L, 16, dtype=torch.float64)
    reset = torch.rand(L) < 0.1
    out = block(x, reset)
    for t in (0, 7, 8, 23, 39):
        x2 = x.clone()
        x2[t + 1:] += torch.randn(L - t - 1, 16, dtype=torch.float64)
        out2 = block(x2, reset)
        torch.testing.assert_close(out2[:t + 1], out[:t + 1], atol=1e-6, rtol=0.0)


@pytest.mark.parametrize("d_conv", [1, 4])
def test_block_chains_independent(d_conv):
    block = make_block(d_conv=d_conv)
    torch.manual_seed(2)
    lengths = [11, 1, 17, 9]
    reset = chain_stream(lengths)
    x = torch.randn(sum(lengths), 16, dtype=torch.float64)
    out = block(x, reset)
    starts = [0, 11, 12, 29, 38]
    for c in range(len(lengths)):
        lo, hi = starts[c], starts[c + 1]
        x2 = x.clone()
        x2[lo:hi] += 1.0 + torch.randn(hi - lo, 16, dtype=torch.float64)
        out2 = block(x2, reset)
        assert (out2[lo:hi] - out[lo:hi]).abs().max() > 1e-4
        others = torch.ones(len(x), dtype=torch.bool)
        others[lo:hi] = False
        torch.testing.assert_close(out2[others], out[others], atol=1e-6, rtol=0.0)
        # each chain alone gives the same output as inside the stream
        torch.testing.assert_close(block(x[lo:hi]), out[lo:hi], atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("d_conv", [1, 4])
def test_step_matches_forward(d_conv):
    """Stepping a batch of chains equals the flat parallel forward over them."""
    block = make_block(d_conv=d_conv)
    torch.manual_seed(3)
    batch, L = 3, 20
    xs = torch.randn(batch, L, 16, dtype=torch.float64)
    flat = block(xs.reshape(batch * L, 16), chain_stream([L] * batch))
    flat = flat.view(batch, L, 16)
    state = block.init_state(batch, device=xs.device, dtype=xs.dtype)
    assert isinstance(state, SSMState)
    steps = []
    for t in range(L):
        y_t, state = block.step(xs[:, t], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, dim=1), flat, atol=1e-10, rtol=1e-8)


@pytest.mark.parametrize("prefix", [1, 2, 9, 16])
def test_prefill_state_then_step(prefix):
    """forward(..., return_state=True) hands every chain's state over; the last one continues with step."""
    block = make_block()
    torch.manual_seed(4)
    L = 24
    other = torch.randn(7, 16, dtype=torch.float64)  # an earlier chain in the stream
    x = torch.randn(L, 16, dtype=torch.float64)
    full = block(x)
    stream = torch.cat([other, x[:prefix]])
    _, states = block(stream, chain_stream([7, prefix]), return_state=True)
    assert states.ssm.shape == (2, block.nheads, block.headdim, block.d_state)
    state = SSMState(states.conv[1:], states.ssm[1:])
    steps = []
    for t in range(prefix, L):
        y_t, state = block.step(x[t:t + 1], state)
        steps.append(y_t)
    torch.testing.assert_close(torch.cat(steps), full[prefix:], atol=1e-10, rtol=1e-8)


def test_block_gradients_reach_every_parameter():
    block = make_block()
    torch.manual_seed(5)
    x = torch.randn(30, 16, dtype=torch.float64, requires_grad=True)
    block(x, torch.rand(30) < 0.2).square().sum().backward()
    assert torch.isfinite(x.grad).all()
    for name, p in block.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_recompute_gives_the_same_values_and_gradients_and_keeps_less():
    plain, lean = make_block(), make_block(recompute=True)  # the same seeded weights
    torch.manual_seed(5)
    x = torch.randn(90, 16, dtype=torch.float64, requires_grad=True)
    reset, gy = torch.rand(90) < 0.1, torch.randn(90, 16, dtype=torch.float64)
    outs = [block(x, reset) for block in (plain, lean)]
    torch.testing.assert_close(outs[1], outs[0], atol=0, rtol=0)
    grads = [torch.autograd.grad(out, [x, *block.parameters()], gy) for out, block in zip(outs, (plain, lean))]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-10)
    saved = [_saved_elements(lambda block=block: block(x, reset)) for block in (plain, lean)]
    assert saved[1] < saved[0] / 2


def _saved_elements(fn) -> int:
    """Elements of the distinct storages autograd saves while ``fn`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


CHAIN_LENGTHS = [1, 2, 3, 7, 70, 130]  # below d_conv - 1, across chunk boundaries


def _split_chains(lengths, cut):
    """Each chain cut in two at ``cut(length)`` (at least one element on each side)."""
    heads = [max(1, min(n - 1, cut(n))) if n > 1 else 1 for n in lengths]
    return heads, [n - h for n, h in zip(lengths, heads)]


def _take(x, lengths, parts):
    """Rows of the flat stream ``x`` of chains ``lengths``: part 0 or 1 of each chain, concatenated."""
    out, start = [], 0
    for n, (a, b) in zip(lengths, parts):
        out.append(x[start + a : start + b])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("cut", [lambda n: 1, lambda n: n // 2, lambda n: n - 1, lambda n: 65])
def test_chains_continue_from_given_states(cut):
    """Scanning the first part of every chain with return_state, then the rest from those states,
    equals scanning the whole stream: outputs and final states (float64)."""
    block = make_block()
    torch.manual_seed(6)
    lengths = [n for n in CHAIN_LENGTHS if n > 1]
    heads, tails = _split_chains(lengths, cut)
    x = torch.randn(sum(lengths), 16, dtype=torch.float64)
    full, final = block(x, chain_stream(lengths), return_state=True)
    first = _take(x, lengths, [(0, h) for h in heads])
    rest = _take(x, lengths, [(h, n) for h, n in zip(heads, lengths)])
    y1, mid = block(first, chain_stream(heads), return_state=True)
    y2, end = block(rest, chain_stream(tails), state=mid, return_state=True)
    torch.testing.assert_close(_take(full, lengths, [(0, h) for h in heads]), y1, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(_take(full, lengths, [(h, n) for h, n in zip(heads, lengths)]), y2,
                               atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(end.ssm, final.ssm, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(end.conv, final.conv, atol=1e-12, rtol=0)


def test_chains_from_states_equal_step_loop_and_separate_calls():
    block = make_block()
    torch.manual_seed(7)
    lengths = CHAIN_LENGTHS
    x = torch.randn(sum(lengths), 16, dtype=torch.float64)
    _, state = block(torch.randn(len(lengths) * 5, 16, dtype=torch.float64), chain_stream([5] * len(lengths)),
                     return_state=True)  # a different state per chain
    y, end = block(x, chain_stream(lengths), state=state, return_state=True)
    start = 0
    for c, n in enumerate(lengths):
        one = SSMState(state.conv[c : c + 1], state.ssm[c : c + 1])
        alone, alone_end = block(x[start : start + n], state=one, return_state=True)
        torch.testing.assert_close(y[start : start + n], alone, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(end.ssm[c : c + 1], alone_end.ssm, atol=1e-10, rtol=1e-8)
        steps = []
        for t in range(n):
            y_t, one = block.step(x[start + t : start + t + 1], one)
            steps.append(y_t)
        torch.testing.assert_close(torch.cat(steps), alone, atol=1e-10, rtol=1e-8)
        torch.testing.assert_close(one.conv, alone_end.conv, atol=1e-12, rtol=0)
        start += n


def test_gradients_reach_the_input_and_the_state():
    block = make_block()
    torch.manual_seed(8)
    x = torch.randn(9, 16, dtype=torch.float64, requires_grad=True)
    _, state = block(torch.randn(6, 16, dtype=torch.float64), chain_stream([3, 3]), return_state=True)
    ssm = state.ssm.detach().clone().requires_grad_(True)
    y, _ = block(x, chain_stream([4, 5]), state=SSMState(state.conv, ssm), return_state=True)
    y.square().sum().backward()
    assert torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    assert ssm.grad.abs().sum() > 0


def test_bad_state_shapes():
    block = make_block()
    x = torch.randn(5, 16, dtype=torch.float64)
    state = block.init_state(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="one entry per chain"):
        block(x, chain_stream([2, 3]), state=state)
    with pytest.raises(ValueError, match="one entry per chain"):
        block(x, state=SSMState(state.conv[:1, :1], state.ssm[:1]))


def test_norm_linear_matches_the_composition_and_keeps_no_normed_rows():
    torch.manual_seed(0)
    norm, linear = torch.nn.LayerNorm(6).double(), torch.nn.Linear(6, 9).double()
    torch.nn.init.normal_(norm.weight)  # not the identity init, so that the norm's gradients are checked too
    torch.nn.init.normal_(norm.bias)
    x = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    fused, plain = norm_linear(x, norm, linear), norm_linear_reference(x, norm, linear)
    torch.testing.assert_close(fused, plain)
    wrt, grad = [x, *norm.parameters(), *linear.parameters()], torch.randn(11, 9, dtype=torch.float64)
    for a, b in zip(torch.autograd.grad(fused, wrt, grad), torch.autograd.grad(plain, wrt, grad), strict=True):
        torch.testing.assert_close(a, b)
    torch.autograd.gradcheck(lambda *t: norm_linear(t[0], norm, linear), (x,))
    weights = sum(p.numel() for p in [norm.weight, norm.bias, linear.weight])
    assert _saved_elements(lambda: norm_linear(x, norm, linear)) == x.numel() + 2 * 11 + weights  # x, mean, 1/std
    assert _saved_elements(lambda: norm_linear_reference(x, norm, linear)) > x.numel() * 2


def test_ssm_with_the_callers_norm_equals_the_normed_input():
    block, norm = make_block(), torch.nn.LayerNorm(16).double()
    torch.nn.init.normal_(norm.weight)
    torch.manual_seed(5)
    x = torch.randn(40, 16, dtype=torch.float64, requires_grad=True)
    reset = torch.rand(40) < 0.1
    fused, plain = block(x, reset, norm=norm), block(norm(x), reset)
    torch.testing.assert_close(fused, plain)
    wrt = [x, *norm.parameters(), *block.parameters()]
    for a, b in zip(torch.autograd.grad(fused.sum(), wrt), torch.autograd.grad(plain.sum(), wrt), strict=True):
        torch.testing.assert_close(a, b)
