"""The optional C++ kernels (sheafgnn.nn.cpu_kernels) against their PyTorch references."""
import functools
import shutil
import subprocess
import sys
import warnings

import pytest
import torch
import torch.utils.cpp_extension

from sheafgnn.model import SheafBlock, SheafStateLM
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.experts import FeedForward, PatchExperts, feed_forward_reference
from sheafgnn.nn.proposals import best_blocks, content_blocks, ranked_blocks_reference
from sheafgnn.nn.segment import sort_by_destination
from sheafgnn.nn.sheaf import SheafConv
from sheafgnn.nn.ssm import SelectiveSSM, SSMState
from sheafgnn.site import build_site

from .conftest import CODE, PROSE, small_model_config

needs_kernel = pytest.mark.needs("block_topk")  # skipped where it is not built; CI fails instead (conftest.py)


def _ranges(g: torch.Generator, M: int, J: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row a range [first, last) of blocks: some empty, some wider than k, some past J."""
    first = torch.randint(0, J, (M,), generator=g)
    last = first + torch.randint(0, J + 3, (M,), generator=g)
    return first, last


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 16, 5, 2), (37, 16, 300, 2), (130, 3, 1000, 7), (9, 128, 40, 32)])
def test_block_topk_equals_the_reference(dtype, shape):
    """Random rows, ranges and widths (rank 3 to 128, tiles crossed, k above a range's size): the same blocks
    in the same order as the chunked matmul + topk."""
    M, r, J, k = shape
    g = torch.Generator().manual_seed(M + J)
    query, keys = torch.randn(M, r, generator=g, dtype=dtype), torch.randn(J, r, generator=g, dtype=dtype)
    first, last = _ranges(g, M, J)
    pick = cpu_kernels.block_topk()(query, keys, first, last, k)
    assert pick.dtype == torch.long and pick.shape == (M, k)
    assert torch.equal(pick, ranked_blocks_reference(query, keys, first, last, k))
    size = (last.clamp(max=J) - first).clamp(min=0, max=k)  # blocks each row can have
    assert torch.equal((pick >= 0).sum(1), size)


@needs_kernel
def test_block_topk_ties_and_non_finite_scores():
    """Equal scores rank by block index, the lower first; a non-finite score is never chosen."""
    keys = torch.ones(6, 2)
    keys[4] = 2.0  # the best
    keys[1] = float("-inf")
    query = torch.ones(2, 2)
    pick = cpu_kernels.block_topk()(query, keys, torch.tensor([0, 2]), torch.tensor([6, 4]), 3)
    assert pick.tolist() == [[4, 0, 2], [2, 3, -1]]


@needs_kernel
def test_block_topk_checks_its_input():
    with pytest.raises(RuntimeError, match="expected query"):
        cpu_kernels.block_topk()(torch.randn(3, 4), torch.randn(6, 5), torch.zeros(3, dtype=torch.long),
                   torch.ones(3, dtype=torch.long), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        cpu_kernels.block_topk()(torch.randn(3, 4), torch.randn(6, 4), torch.zeros(3, dtype=torch.long),
                   torch.ones(3, dtype=torch.long), 0)


@needs_kernel
@pytest.mark.parametrize("summary", ["mean", "bounds"])
def test_content_blocks_the_same_with_and_without_the_kernel(monkeypatch, summary):
    """The model's content proposals, two graphs in a batch: the kernel path picks what the PyTorch path picks."""
    g = torch.Generator().manual_seed(0)
    position = torch.cat([torch.arange(300), torch.arange(211)])
    graph_start = torch.cat([torch.zeros(300, dtype=torch.long), torch.full((211,), 300)])
    query, keys = torch.randn(511, 8, generator=g), torch.randn(511, 8, generator=g)
    with_kernel = content_blocks(query, keys, position, graph_start, 4, 3, summary=summary)
    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
    assert cpu_kernels.block_topk() is None
    assert torch.equal(with_kernel, content_blocks(query, keys, position, graph_start, 4, 3, summary=summary))


def test_best_blocks_without_the_kernel(monkeypatch):
    """SHEAFGNN_CPU_KERNELS=0: the PyTorch path, with the same contract (block starts, -1 where fewer)."""
    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
    block_start = torch.tensor([0, 4, 8])
    keys = torch.tensor([[1.0], [3.0], [2.0]])
    out = best_blocks(torch.ones(2, 1), keys, block_start, torch.tensor([0, 0]), torch.tensor([3, 1]), 2)
    assert out.tolist() == [[4, 8], [0, -1]]


# ---------------------------------------------------------------------- #
# the generation step's kernels (csrc/step_kernels.cpp)
# ---------------------------------------------------------------------- #
needs_step_kernels = pytest.mark.needs("step_kernels")


def _random_(module: torch.nn.Module, g: torch.Generator) -> torch.nn.Module:
    """Every parameter drawn at random (no zero biases, no unit norm weights: the kernels must read them all)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return module


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("batch, d_conv, headdim, normed", [(1, 4, 48, True), (5, 2, 16, False), (19, 1, 8, True)])
def test_ssm_step_equals_the_reference(dtype, batch, d_conv, headdim, normed):
    """SelectiveSSM.step through the kernel equals step_reference (random weights and states, chains in
    parallel, every conv width, with and without the caller's norm): outputs and both new states; the old
    states are left as they were."""
    g = torch.Generator().manual_seed(batch)
    ssm = _random_(SelectiveSSM(24, d_state=6, headdim=headdim, d_conv=d_conv), g).to(dtype)
    norm = _random_(torch.nn.LayerNorm(24), g).to(dtype) if normed else None
    x = torch.randn(batch, 24, generator=g, dtype=dtype)
    state = SSMState(*(torch.randn(t.shape, generator=g, dtype=dtype) for t in ssm.init_state(batch, dtype=dtype)))
    before = SSMState(state.conv.clone(), state.ssm.clone())
    with torch.no_grad():
        assert ssm._step_kernel(x, norm) is not None
        y, new = ssm.step(x, state, norm=norm)
        y_ref, new_ref = ssm.step_reference(x if norm is None else norm(x), state)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y, y_ref, **tol)
    torch.testing.assert_close(new.conv, new_ref.conv, **tol)
    torch.testing.assert_close(new.ssm, new_ref.ssm, **tol)
    assert torch.equal(state.conv, before.conv) and torch.equal(state.ssm, before.ssm)


def test_ssm_step_takes_the_reference_with_gradients_or_the_kernel_off(monkeypatch):
    """Gradients (training), another dtype than the weights, or SHEAFGNN_CPU_KERNELS=0: the PyTorch step."""
    ssm = SelectiveSSM(16, d_state=4, headdim=8)
    x = torch.randn(2, 16)
    assert ssm._step_kernel(x, None) is None  # gradients on
    with torch.no_grad():
        assert ssm._step_kernel(x.double(), None) is None
        assert ssm._step_kernel(x, torch.nn.LayerNorm(16, bias=False)) is None  # not an affine norm with bias
        monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
        assert ssm._step_kernel(x, None) is None
        y, _ = ssm.step(x, ssm.init_state(2))
        assert torch.equal(y, ssm.step_reference(x, ssm.init_state(2))[0])


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [1, 3, cpu_kernels.STEP_ROWS])
@pytest.mark.parametrize("normed", [True, False])
def test_feed_forward_kernel_equals_the_reference(dtype, rows, normed):
    """FeedForward in inference on a step's few rows (the kernel) equals feed_forward_reference."""
    g = torch.Generator().manual_seed(rows)
    ffn = _random_(FeedForward(20, 36), g).to(dtype)
    norm = _random_(torch.nn.LayerNorm(20), g).to(dtype) if normed else None
    x = torch.randn(rows, 20, generator=g, dtype=dtype) * 3
    with torch.no_grad():
        assert ffn.kernel(x, norm) is not None
        out = ffn(x, norm)
    norm_args = (norm.weight, norm.bias, norm.eps) if normed else ()
    ref = feed_forward_reference(x, ffn.fc.weight, ffn.fc.bias, ffn.proj.weight, ffn.proj.bias, *norm_args)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)


def test_feed_forward_kernel_only_on_few_rows_without_gradients():
    ffn = FeedForward(8, 16)
    assert ffn.kernel(torch.randn(2, 8), None) is None  # gradients on: the lean autograd function
    with torch.no_grad():
        assert ffn.kernel(torch.randn(cpu_kernels.STEP_ROWS + 1, 8), None) is None  # many rows: MKL's matmuls
        assert ffn.kernel(torch.randn(2, 8, dtype=torch.float64), None) is None  # not the weights' dtype


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("counts", [[1, 0, 0, 1], [0, 3, 0, 0], [2, 1, 0, 5], [4, 4, 4, 4]])
def test_patch_experts_in_one_kernel_call_equal_each_type_by_the_reference(dtype, counts):
    """PatchExperts in inference on a step's few rows (every present type's expert in one kernel call, types
    without rows skipped) equals each type's rows through feed_forward_reference."""
    g = torch.Generator().manual_seed(sum(counts))
    experts = _random_(PatchExperts(12, num_types=4, hidden_channels=20), g).to(dtype)
    norm = _random_(torch.nn.LayerNorm(12), g).to(dtype)
    type_ptr = [0]
    for c in counts:
        type_ptr.append(type_ptr[-1] + c)
    x = torch.randn(type_ptr[-1], 12, generator=g, dtype=dtype) * 3
    with torch.no_grad():
        assert experts.fused_call(x, type_ptr, norm) is not None
        out, balance = experts(x, type_ptr, norm)
    ref = torch.cat([feed_forward_reference(x[type_ptr[t] : type_ptr[t + 1]], e.fc.weight, e.fc.bias, e.proj.weight,
                                            e.proj.bias, norm.weight, norm.bias, norm.eps)
                     for t, (e,) in enumerate(experts.experts)])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)
    assert balance.item() == 0.0


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("counts", [[1, 0, 1], [3, 2, 3], [2, 0, 2]])
def test_block_tail_equals_experts_and_broadcast(monkeypatch, full_config, dtype, counts):
    """SheafBlock.step_tail on a step's rows (tokens, patches, outputs): the block_tail kernel equals the PyTorch
    composition, glued + E(glued) and then output t's row through broadcast added to token t's."""
    g = torch.Generator().manual_seed(sum(counts))
    config = small_model_config(full_config, d_model=16, gluing={"mode": "outputs", "projections": True})
    block = _random_(SheafBlock(config), g).to(dtype)  # step_tail: gluing into the outputs, whose broadcast is a linear
    type_ptr = [0, counts[0]] + [counts[0] + counts[1]] * (block.experts.num_types - 2) + [sum(counts)]
    glued = torch.randn(sum(counts), 16, generator=g, dtype=dtype)
    with torch.no_grad():
        assert block.experts.fused_call(glued, type_ptr, block.norm_expert) is not None
        out = block.step_tail(glued.clone(), type_ptr, counts[0])
        monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
        ref = block.step_tail(glued.clone(), type_ptr, counts[0])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)


def test_patch_experts_fuse_only_one_plain_expert_per_type_in_inference():
    x, type_ptr = torch.randn(3, 8), [0, 2, 3]
    assert PatchExperts(8, 2, 16).fused_call(x, type_ptr, None) is None  # gradients on
    with torch.no_grad():
        assert PatchExperts(8, 2, 16, num_experts=2).fused_call(x, type_ptr, None) is None  # routed experts
        assert PatchExperts(8, 2, 16).fused_call(torch.randn(cpu_kernels.STEP_ROWS + 1, 8), [0, 1, 17], None) is None


def test_registered_follows_every_registration_and_keeps_in_place_changes():
    ffn = FeedForward(4, 6)
    fc, weight = cpu_kernels.registered(ffn, ("fc", "fc.weight"))
    assert fc is ffn.fc and weight is ffn.fc.weight
    ffn.load_state_dict(FeedForward(4, 6).state_dict())  # in place: the same objects, new values
    ffn.double()  # by default .to() swaps the data of the same parameters
    assert cpu_kernels.registered(ffn, ("fc", "fc.weight")) == (fc, weight) and weight.dtype == torch.float64
    ffn.fc.weight = torch.nn.Parameter(torch.zeros(6, 4))  # a new parameter, registered in a submodule
    assert cpu_kernels.registered(ffn, ("fc.weight",))[0] is ffn.fc.weight
    ffn.fc = torch.nn.Linear(4, 6)  # a new submodule
    assert cpu_kernels.registered(ffn, ("fc", "fc.bias")) == (ffn.fc, ffn.fc.bias)
    ffn.fc.bias = None
    assert cpu_kernels.registered(ffn, ("fc.bias",)) == (None,)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:  # .to() then registers nothing: nothing is kept
        ffn.float()
        assert cpu_kernels.registered(ffn, ("fc.weight",))[0] is ffn.fc.weight
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)


@needs_step_kernels
def test_step_kernels_read_replaced_layers():
    """A layer replaced after a kernel call: the next call reads the new one (equal to the reference)."""
    g = torch.Generator().manual_seed(0)
    ssm, x = _random_(SelectiveSSM(8, d_state=2, headdim=4), g), torch.randn(2, 8, generator=g)
    state = ssm.init_state(2)
    with torch.no_grad():
        ssm.step(x, state)
        ssm.in_proj = _random_(torch.nn.Linear(8, ssm.in_proj.out_features, bias=False), g)
        out, _ = ssm.step(x, state)
        ref, _ = ssm.step_reference(x, state)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@needs_step_kernels
def test_step_kernels_check_their_input():
    stream_pools = cpu_kernels.stream_pools()
    query, keys = torch.randn(2, 4), torch.randn(5, 4)
    types, sink = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2)
    blocks = (False, query, torch.randn(2, 1, 4), torch.zeros(2, dtype=torch.long), torch.full((2,), 2),
              torch.full((8, 1), 7), 1, 4, 0, 0)  # two complete blocks of 4 tokens, one stream: token rows past keys
    with pytest.raises(RuntimeError, match="past the 5 key rows"):
        stream_pools(query, keys, torch.full((2, 3), 5), types, torch.zeros(1), sink, 2, 2.0, *blocks)
    with pytest.raises(RuntimeError, match="a token row past the 5 key rows"):
        stream_pools(query, keys, torch.zeros(2, 3, dtype=torch.long), types, torch.zeros(1), sink, 2, 2.0, *blocks)
    with pytest.raises(RuntimeError, match="expected query"):
        stream_pools(query, keys, torch.zeros(3, 3, dtype=torch.long), types, torch.zeros(1), sink, 2, 2.0, *blocks)
    w = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="a previous row past the 5 cached rows"):
        cpu_kernels.stream_keys()(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([5]), torch.tensor([False]), 1,
                                  w, w, w)
    with pytest.raises(RuntimeError, match="three"):
        cpu_kernels.stream_keys()(torch.randn(2, 4), torch.randn(5, 4), torch.tensor([0]), torch.tensor([True]), 1,
                                  w, w, w.T)
    with pytest.raises(RuntimeError, match="dtype of x"):
        cpu_kernels.feed_forward()(torch.randn(1, 4), [0, 1], torch.empty(0), torch.empty(0), 0.0,
                                   [torch.randn(6, 4).double()], [torch.randn(6)], [torch.randn(4, 6)],
                                   [torch.randn(4)])
    with pytest.raises(RuntimeError, match="ptr must rise"):
        cpu_kernels.feed_forward()(torch.randn(3, 4), [0, 2, 1, 3], torch.empty(0), torch.empty(0), 0.0,
                                   *[[w] * 3 for w in (torch.randn(6, 4), torch.randn(6), torch.randn(4, 6),
                                                       torch.randn(4))])
    with pytest.raises(RuntimeError, match="one set of weights per segment"):
        cpu_kernels.feed_forward()(torch.randn(3, 4), [0, 1, 3], torch.empty(0), torch.empty(0), 0.0,
                                   [torch.randn(6, 4)], [torch.randn(6)], [torch.randn(4, 6)], [torch.randn(4)])
    with pytest.raises(RuntimeError, match="one entry per row"):
        ssm = SelectiveSSM(8, d_state=2, headdim=4)
        state = ssm.init_state(3)
        cpu_kernels.ssm_step()(torch.randn(2, 8), state.conv, state.ssm, ssm.in_proj.weight, ssm.conv_weight,
                               ssm.conv_bias, ssm.dt_bias, ssm.A_log, ssm.D, ssm.norm.weight, 1e-6,
                               ssm.out_proj.weight, torch.empty(0), torch.empty(0), 0.0)


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("N, E", [(3, 8), (40, 200), (5, 0)])
@pytest.mark.parametrize("map_init", ["random", "identity"])
def test_glue_diag_equals_sheafconv(monkeypatch, dtype, N, E, map_init):
    """SheafConv in inference with the model's configuration (diag maps, normalize "none", ELU, sorted typed
    weighted edges with their ptr): the kernel equals the PyTorch layer, nodes without in-edges included, for
    maps of either start (the offset of maps that start at the identity)."""
    g = torch.Generator().manual_seed(N + E)
    conv = _random_(SheafConv(24, 4, map_kind="diag", num_edge_types=5, normalize="none", map_init=map_init),
                    g).to(dtype)
    x = torch.randn(N, 24, generator=g, dtype=dtype)
    edge_index = torch.randint(0, N, (2, E), generator=g)
    edge_index, perm, ptr = sort_by_destination(edge_index, torch.arange(E), num_nodes=N)
    edge_type, weight = torch.randint(0, 5, (E,), generator=g), torch.rand(E, generator=g, dtype=dtype)
    with torch.no_grad():
        assert conv._kernel(x, edge_index, edge_type, weight, ptr) is not None
        out = conv(x, edge_index, edge_type, weight, ptr=ptr)
        monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
        ref = conv(x, edge_index, edge_type, weight, ptr=ptr)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out, ref, **tol)


@needs_step_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_glue_diag_reads_bipartite_sources_in_place(monkeypatch, dtype):
    """SheafConv on (x_src, x_dst) (a stream's cached sources, its new nodes): the kernel, which reads the sources
    in place, equals the PyTorch path on the pair, nodes without in-edges and repeated sources included."""
    g = torch.Generator().manual_seed(7)
    conv = _random_(SheafConv(24, 4, map_kind="diag", num_edge_types=5, normalize="none"), g).to(dtype)
    x_src, x_dst = torch.randn(50, 24, generator=g, dtype=dtype), torch.randn(6, 24, generator=g, dtype=dtype)
    dst = torch.tensor([0, 0, 2, 2, 2, 5, 5, 5, 5])  # sorted; 1, 3, 4 have no in-edges
    edge_index = torch.stack([torch.tensor([3, 49, 7, 7, 0, 12, 3, 40, 41]), dst])
    edge_type, weight = torch.randint(0, 5, (9,), generator=g), torch.rand(9, generator=g, dtype=dtype)
    ptr = torch.tensor([0, 2, 2, 5, 5, 5, 9])
    with pytest.raises(RuntimeError, match="a source past the 50 rows"):
        cpu_kernels.glue_diag()(x_dst, torch.tensor([50]), torch.tensor([0, 1, 1, 1, 1, 1, 1]), edge_type[:1],
                                weight[:1], conv.map_lin.weight, conv.map_type_emb.weight, conv.weight_channel,
                                conv.eps, x_src, 0.0)
    with torch.no_grad():
        assert conv._kernel(x_dst, edge_index, edge_type, weight, ptr) is not None
        out = conv((x_src, x_dst), edge_index, edge_type, weight, ptr=ptr)
        monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
        ref = conv((x_src, x_dst), edge_index, edge_type, weight, ptr=ptr)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    assert out.shape == (6, 24)
    torch.testing.assert_close(out, ref, **tol)


def test_glue_diag_only_for_the_configuration_it_computes():
    x, edge_index = torch.randn(4, 8), torch.tensor([[0, 1], [2, 3]])
    args = (x, edge_index, torch.zeros(2, dtype=torch.long), torch.ones(2), torch.tensor([0, 0, 0, 1, 2]))
    with torch.no_grad():
        for conv in (SheafConv(8, 2, map_kind="general"), SheafConv(8, 2, normalize="in_degree"),
                     SheafConv(8, 2, stalk_mixing=True), SheafConv(8, 2, act="relu"),
                     SheafConv(8, 2, map_hidden_channels=4)):
            assert conv._kernel(*args) is None
        conv = SheafConv(8, 2, normalize="none")
        assert conv._kernel(x, edge_index, None, *args[3:]) is None  # untyped edges
        assert conv._kernel(*args[:4], None) is None  # not sorted by the caller
    assert conv._kernel(*args) is None  # gradients on


# ---------------------------------------------------------------------- #
# a machine where the kernels cannot be built
# ---------------------------------------------------------------------- #
def _forward_and_stream(model: SheafStateLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The full forward's logits and those of a stream fed one token at a time (the step kernels' rows)."""
    with torch.no_grad():
        stream = model.stream()
        return model(build_site(ids, model.config.site_config)), torch.cat([stream.feed(i.view(1)) for i in ids])


def test_a_failed_kernel_build_warns_once_and_changes_no_logit(monkeypatch, full_config):
    """torch.utils.cpp_extension.load_inline raises for every source (no compiler): one warning in all, whatever the
    number of sources and calls, and the forward (content proposals: block_topk) and a stream (every step
    kernel) give exactly the logits of the PyTorch paths (SHEAFGNN_CPU_KERNELS=0)."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, map_kind="diag", proposal_block=4, content_blocks=3)).eval()
    ids = torch.tensor(list((PROSE + CODE).encode()))[:120]
    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "0")
    reference = _forward_and_stream(model, ids)

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", "1")
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    # Empty caches for this test; monkeypatch puts back the cached function with the kernels built so far.
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))
    monkeypatch.setattr(cpu_kernels, "_failed", [])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fallback = _forward_and_stream(model, ids)
        assert cpu_kernels.ssm_step() is None and cpu_kernels.block_topk() is None
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "could not be built (RuntimeError: Error building extension: c++: command " \
        "not found); using the PyTorch paths" in messages[0] and "pip install 'sheafgnn[kernels]'" in messages[0]
    assert sorted(cpu_kernels._failed) == ["block_topk", "step_kernels"]  # both sources were tried, once each
    assert all(torch.equal(a, b) for a, b in zip(fallback, reference))


def test_the_build_names_no_path_of_the_checkout(monkeypatch, tmp_path):
    """ninja rebuilds when a compile command changes: the extension's name and its one source are the sources'
    text (local headers inlined), the same from any checkout, and a changed text gets another name."""
    calls = []
    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(cpu_kernels, "_load", functools.cache(cpu_kernels._load.__wrapped__))
    copy = tmp_path / "csrc"
    shutil.copytree(cpu_kernels._SOURCES, copy)
    for sources in (cpu_kernels._SOURCES, copy):
        monkeypatch.setattr(cpu_kernels, "_SOURCES", sources)
        cpu_kernels._load.cache_clear()
        cpu_kernels._load("block_topk")
    (copy / "top_list.h").write_text((copy / "top_list.h").read_text() + "\n// changed\n")
    cpu_kernels._load.cache_clear()
    cpu_kernels._load("block_topk")
    (here, there, changed) = calls
    assert here == there and changed["name"] != here["name"]
    assert '#include "' not in here["cpp_sources"][0] and "// changed" in changed["cpp_sources"][0]
    assert not any(str(tmp_path) in str(value) or "csrc" in str(value) for value in here.values())


def test_importing_the_kernels_installs_no_hook():
    """torch.nn's registration hooks are process-wide: a fresh interpreter that imports sheafgnn and builds a model
    has none of ours until a kernel caller first reads its layer's parameters (cpu_kernels.registered)."""
    code = ("import torch.nn.modules.module as m\nimport sheafgnn\nfrom sheafgnn.nn import cpu_kernels\n"
            "sheafgnn.SheafStateLM(sheafgnn.SheafStateConfig(d_model=16, n_layers=1))\n"
            "before = len(m._global_parameter_registration_hooks)\n"
            "cpu_kernels.registered(torch.nn.Linear(2, 2), ('weight',))\n"
            "print(before, len(m._global_parameter_registration_hooks))\n")
    out = subprocess.run([sys.executable, "-c", "import torch\n" + code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["0", "1"]
