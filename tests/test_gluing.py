"""The fused transport_sum against its plain reference: values, gradients, saved memory."""
import pytest
import torch

from sheafgnn.nn.gluing import transport_sum, transport_sum_reference
from sheafgnn.nn.segment import HAS_TORCH_SCATTER, HAS_TORCH_SPARSE, ptr_from_index, use_backend
from sheafgnn.nn.sheaf import SheafConv

BACKENDS = ["torch"] + (["torch_scatter"] if HAS_TORCH_SCATTER else [])
D, F = 3, 5  # stalk dim, channels: E * D * F differs from E * D and E * D * D


def random_graph(seed, num_nodes=12, num_edges=40, dense=True, weighted=True):
    """Destination-sorted edges with empty segments, a heavy destination, repeated
    sources and an isolated node (the last: no in- or out-edges)."""
    gen = torch.Generator().manual_seed(seed)
    dst = torch.randint(0, num_nodes - 1, (num_edges,), generator=gen)
    dst[: num_edges // 4] = 2  # one destination with many in-edges
    dst = dst[dst % 3 != 0].sort().values  # destinations 0, 3, 6, ... get none
    num_edges = dst.numel()
    src = torch.randint(0, 4, (num_edges,), generator=gen)  # sources repeat
    ptr = ptr_from_index(dst, num_nodes)
    shape = (num_edges, D, D) if dense else (num_edges, D)
    Y = torch.randn(num_nodes, D, F, dtype=torch.double, generator=gen)
    transport = torch.randn(shape, dtype=torch.double, generator=gen)
    alpha = (torch.rand(num_edges, dtype=torch.double, generator=gen)
             if weighted else None)
    return Y, src, ptr, transport, alpha


def uses_spmm(backend, dense):
    """Whether transport_sum (no block_rows) takes torch-sparse's SpMM: diagonal maps, compiled backend."""
    return backend == "torch_scatter" and not dense and HAS_TORCH_SPARSE


def leaves(Y, transport, alpha):
    return [t.clone().requires_grad_() if t is not None else None
            for t in (Y, transport, alpha)]


def value_and_grads(fn, Y, src, ptr, transport, alpha, **kw):
    Y, transport, alpha = leaves(Y, transport, alpha)
    out = fn(Y, src, ptr, transport, alpha, **kw)
    inputs = [t for t in (Y, transport, alpha) if t is not None]
    weight = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    return out, torch.autograd.grad((out.sin() * weight).sum(), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_matches_reference(backend, dense, weighted):
    graph = random_graph(0, dense=dense, weighted=weighted)
    with use_backend(backend):
        out, grads = value_and_grads(transport_sum, *graph)
        ref, ref_grads = value_and_grads(transport_sum_reference, *graph)
    assert out.shape == (12, D, F)
    if uses_spmm(backend, dense):  # torch-sparse sums in its own order
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    else:
        assert torch.equal(out, ref)  # same ops in the same order
    assert out[0].abs().max() == 0 and out[-1].abs().max() == 0  # empty segments
    for g, g_ref in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("block_rows", [2, None])  # None: the SpMM path for diagonal maps
def test_gradcheck(backend, dense, weighted, block_rows):
    Y, src, ptr, transport, alpha = random_graph(1, 5, 9, dense, weighted)
    Y, transport, alpha = leaves(Y, transport, alpha)
    inputs = [t for t in (Y, transport, alpha) if t is not None]

    def fn(*args):
        return transport_sum(args[0], src, ptr, args[1],
                             args[2] if weighted else None, block_rows=block_rows)

    with use_backend(backend):
        assert torch.autograd.gradcheck(fn, inputs)


def test_gradgradcheck():
    """Backward is built from differentiable ops (create_graph=True works)."""
    Y, src, ptr, transport, alpha = random_graph(2, 5, 9)
    Y, transport, alpha = leaves(Y, transport, alpha)
    for backend in BACKENDS:
        with use_backend(backend):
            assert torch.autograd.gradgradcheck(
                lambda y, t, a: transport_sum(y, src, ptr, t, a, block_rows=2),
                [Y, transport, alpha])


@pytest.mark.needs("torch_scatter", "torch_sparse")
def test_spmm_refuses_create_graph():
    """torch-sparse's backward is not differentiable: a second derivative through it raises
    instead of coming out as zeros."""
    Y, src, ptr, transport, alpha = random_graph(2, 5, 9, dense=False)
    Y, transport, alpha = leaves(Y, transport, alpha)
    with use_backend("torch_scatter"):
        out = transport_sum(Y, src, ptr, transport, alpha)
        (grad,) = torch.autograd.grad(out.sum(), Y)  # first order works
        with pytest.raises(RuntimeError, match="create_graph=True is not supported"):
            torch.autograd.grad(out.pow(2).sum(), Y, create_graph=True)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_rows", [1, 3, 7])
def test_blocks_change_no_bit(backend, block_rows):
    """Blocks hold whole destinations (one has more in-edges than a block)."""
    graph = random_graph(3)
    with use_backend(backend):
        out, grads = value_and_grads(transport_sum, *graph)
        out_b, grads_b = value_and_grads(transport_sum, *graph,
                                         block_rows=block_rows)
    assert torch.equal(out, out_b)
    for g, g_b in zip(grads, grads_b, strict=True):
        assert torch.equal(g, g_b)


def saved_numels(fn):
    """Element counts of every tensor autograd saves while ``fn`` runs."""
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return numels


@pytest.mark.parametrize("dense", [False, True])
def test_saves_no_per_edge_stalk(dense):
    Y, src, ptr, transport, alpha = random_graph(4, dense=dense)
    Y, transport, alpha = leaves(Y, transport, alpha)
    per_edge_stalk = src.numel() * D * F
    fused = saved_numels(lambda: transport_sum(Y, src, ptr, transport, alpha))
    assert fused and per_edge_stalk not in fused
    ref = saved_numels(
        lambda: transport_sum_reference(Y, src, ptr, transport, alpha))
    assert per_edge_stalk in ref  # the check is not vacuous


@pytest.mark.parametrize("map_kind", ["diag", "orthogonal", "general"])
def test_sheafconv_saves_no_per_edge_stalk(map_kind):
    """SheafConv takes the fused path by default, and PyG's propagate (which
    keeps per-edge messages) when a message hook is registered."""
    torch.manual_seed(0)
    f = 7  # E * d * f differs from E * 2 * map width (<= 2 * d * d = 18)
    conv = SheafConv(D * f, stalk_dim=D, map_kind=map_kind)
    x = torch.randn(10, D * f, requires_grad=True)
    edge_index = torch.randint(0, 10, (2, 30))
    per_edge_stalk = edge_index.size(1) * D * f
    assert per_edge_stalk not in saved_numels(lambda: conv(x, edge_index))
    handle = conv.register_message_forward_hook(lambda *args: None)
    try:
        assert per_edge_stalk in saved_numels(lambda: conv(x, edge_index))
    finally:
        handle.remove()


def test_bipartite_input_equals_the_graph_of_destinations_and_sources():
    """(x_src, x_dst) as in PyG: the destinations' rows of the layer on [x_dst | x_src], edges shifted to the
    source rows; unsorted edges without ptr, gradients, and the energies in edge order."""
    torch.manual_seed(0)
    conv = SheafConv(12, 3, map_kind="general", num_edge_types=3, normalize="in_degree").double()
    x_src = torch.randn(9, 12, dtype=torch.double, requires_grad=True)
    x_dst = torch.randn(4, 12, dtype=torch.double, requires_grad=True)
    edge_index = torch.tensor([[8, 0, 3, 3, 5, 1], [2, 0, 2, 3, 0, 2]])
    edge_type, weight = torch.tensor([0, 2, 1, 1, 0, 2]), torch.rand(6, dtype=torch.double)
    out, energy = conv((x_src, x_dst), edge_index, edge_type, weight, return_energy=True)
    shifted = torch.stack([edge_index[0] + 4, edge_index[1]])
    ref, ref_energy = conv(torch.cat([x_dst, x_src]), shifted, edge_type, weight, return_energy=True)
    torch.testing.assert_close(out, ref[:4])
    torch.testing.assert_close(energy, ref_energy)
    grads = torch.autograd.grad(out.square().sum(), (x_src, x_dst))
    ref_grads = torch.autograd.grad(ref[:4].square().sum(), (x_src, x_dst))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_no_edges_and_bad_shapes():
    Y = torch.randn(4, D, F, requires_grad=True)
    src = torch.empty(0, dtype=torch.long)
    ptr = torch.zeros(5, dtype=torch.long)
    out = transport_sum(Y, src, ptr, torch.empty(0, D))
    assert out.shape == (4, D, F) and out.abs().max() == 0
    out.sum().backward()
    assert Y.grad.abs().max() == 0
    with pytest.raises(ValueError, match="transport_sum: expected Y"):
        transport_sum(Y, src, ptr, torch.empty(0, D + 1))
    with pytest.raises(ValueError, match="block_rows must be >= 1"):
        transport_sum(Y, torch.zeros(1, dtype=torch.long),
                      torch.tensor([0, 1, 1, 1, 1]), torch.ones(1, D),
                      block_rows=0)
