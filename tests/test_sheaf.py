"""SheafConv against a dense sheaf-Laplacian reference built with loops."""
import pytest
import torch
import torch.nn.functional as F
import torch_geometric
from hypothesis import given, settings
from hypothesis import strategies as st
from torch_geometric.data import Data

from sheafgnn.nn.restriction import maps_from_learner
from sheafgnn.nn.segment import (
    HAS_TORCH_SCATTER,
    ptr_from_index,
    sort_by_destination,
    use_backend,
)
from sheafgnn.nn.sheaf import SheafConv

BACKENDS = ["torch"] + (["torch_scatter"] if HAS_TORCH_SCATTER else [])
MAP_KINDS = ["diag", "orthogonal", "general", "identity"]

# 6 nodes, unsorted, with a self-loop (3->3), a multi-edge (0->2 twice),
# node 0 without in-edges, and time order src <= dst everywhere.
EDGE_INDEX = torch.tensor([[2, 0, 1, 3, 0, 4, 0, 2],
                           [5, 2, 2, 3, 2, 5, 1, 4]])
EDGE_TYPE = torch.tensor([1, 0, 2, 1, 0, 2, 1, 0])
N = 6


def reference(conv, x, edge_index, edge_type=None, edge_weight=None):
    r"""Dense block sheaf Laplacian row operator, assembled edge by edge."""
    d, f = conv.stalk_dim, conv.channels
    n, num_edges = x.size(0), edge_index.size(1)
    f_src, f_dst = conv.restriction_maps(x, edge_index, edge_type)
    w = (torch.ones(num_edges, dtype=x.dtype) if edge_weight is None
         else edge_weight)
    lap = x.new_zeros(n * d, n * d)
    deg = [x.new_zeros(()) for _ in range(n)]
    for e in range(num_edges):
        u, v = int(edge_index[0, e]), int(edge_index[1, e])
        vs, us = slice(v * d, (v + 1) * d), slice(u * d, (u + 1) * d)
        fv, fu = f_dst[e], f_src[e]
        lap[vs, vs] = lap[vs, vs] + w[e] * fv.T @ fv
        lap[vs, us] = lap[vs, us] - w[e] * fv.T @ fu
        deg[v] = deg[v] + (w[e] if conv.normalize == "weight" else 1.0)
    if conv.normalize != "none":
        scale = torch.stack([dv if float(dv.detach()) != 0 else dv + 1
                         for dv in deg])
        lap = lap / scale.repeat_interleave(d).view(-1, 1)
    w2 = (torch.eye(d, dtype=x.dtype) if conv.weight_stalk is None
          else conv.weight_stalk)
    xs = x.view(n * d, f)  # (N d, f): stalks stacked
    ys = torch.kron(torch.eye(n, dtype=x.dtype), w2) @ xs @ conv.weight_channel
    eps = (1 + torch.tanh(conv.eps)).repeat(n).view(-1, 1)
    out = (eps * xs - conv.act(lap @ ys)).view(n, d * f)
    energy = torch.stack([
        (f_dst[e] @ xs[int(edge_index[1, e]) * d:][:d]
         - f_src[e] @ xs[int(edge_index[0, e]) * d:][:d]).square().sum()
        for e in range(num_edges)] or [x.new_zeros(())])[:num_edges]
    return out, energy


def make_conv(map_kind, **kw):
    torch.manual_seed(0)
    conv = SheafConv(6, stalk_dim=3, map_kind=map_kind, num_edge_types=3,
                     **kw).double()
    with torch.no_grad():  # non-trivial residual scale and mixing
        conv.eps.uniform_(-0.5, 0.5)
        if conv.weight_stalk is not None:
            conv.weight_stalk.add_(0.3 * torch.randn(3, 3))
    return conv


def grads(out, energy, inputs):
    g = torch.autograd.grad(out.sin().sum() + energy.cos().sum(), inputs,
                            allow_unused=True)
    return [torch.zeros_like(i) if gi is None else gi
            for gi, i in zip(g, inputs, strict=True)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("map_kind", MAP_KINDS)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("options", [
    {},
    {"stalk_mixing": True, "map_hidden_channels": 5, "normalize": "weight"},
    {"normalize": "none", "act": "tanh"},
])
def test_matches_dense_reference(backend, map_kind, weighted, options):
    conv = make_conv(map_kind, **options)
    x = torch.randn(N, 6, dtype=torch.double, requires_grad=True)
    w = (torch.rand(EDGE_INDEX.size(1), dtype=torch.double,
                    requires_grad=True) if weighted else None)
    inputs = [x] + ([w] if weighted else []) + list(conv.parameters())
    with use_backend(backend):
        out, energy = conv(x, EDGE_INDEX, EDGE_TYPE, w, return_energy=True)
    ref_out, ref_energy = reference(conv, x, EDGE_INDEX, EDGE_TYPE, w)
    assert out.shape == (N, 6) and energy.shape == (EDGE_INDEX.size(1),)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(energy, ref_energy)
    for g, g_ref in zip(grads(out, energy, inputs),
                        grads(ref_out, ref_energy, inputs), strict=True):
        torch.testing.assert_close(g, g_ref)


def test_map_learner_is_linear_on_concatenation():
    conv = make_conv("general")
    x = torch.randn(N, 6, dtype=torch.double)
    f_src, f_dst = conv.restriction_maps(x, EDGE_INDEX, EDGE_TYPE)
    h = conv.num_map_params
    w_a, w_b = conv.map_lin.weight[:h], conv.map_lin.weight[h:]  # (P, C)
    w_cat = torch.cat([w_a, w_b, conv.map_type_emb.weight.T], dim=1)
    onehot = F.one_hot(EDGE_TYPE, 3).double()
    u, v = x[EDGE_INDEX[0]], x[EDGE_INDEX[1]]
    expect_src = torch.tanh(torch.cat([u, v, onehot], 1) @ w_cat.T)
    expect_dst = torch.tanh(torch.cat([v, u, onehot], 1) @ w_cat.T)
    torch.testing.assert_close(f_src, expect_src.view(-1, 3, 3))
    torch.testing.assert_close(f_dst, expect_dst.view(-1, 3, 3))


def test_repr_and_shapes():
    conv = SheafConv(64, stalk_dim=4, map_kind="diag")
    assert str(conv) == "SheafConv(64, stalk_dim=4, map_kind='diag')"
    assert str(SheafConv(8, 2, "orthogonal", num_edge_types=3)) == \
        "SheafConv(8, stalk_dim=2, map_kind='orthogonal', num_edge_types=3)"
    out = conv(torch.randn(N, 64), EDGE_INDEX)
    assert out.shape == (N, 64)
    f_src, f_dst = conv.restriction_maps(torch.randn(N, 64), EDGE_INDEX)
    assert f_src.shape == f_dst.shape == (EDGE_INDEX.size(1), 4, 4)


def test_value_errors():
    with pytest.raises(ValueError, match=r"SheafConv: stalk_dim must divide "
                                         r"in_channels \(got 3 and 64\)"):
        SheafConv(64, stalk_dim=3)
    with pytest.raises(ValueError, match="SheafConv: map_kind"):
        SheafConv(8, 2, map_kind="skew")
    with pytest.raises(ValueError, match="SheafConv: normalize"):
        SheafConv(8, 2, normalize="sym")
    conv = SheafConv(8, 2)
    with pytest.raises(ValueError, match="SheafConv: expected x of shape"):
        conv(torch.randn(N, 6), EDGE_INDEX)
    with pytest.raises(ValueError, match="edge_weight of shape"):
        conv(torch.randn(N, 8), EDGE_INDEX, edge_weight=torch.ones(3))
    with pytest.raises(ValueError, match="edge_index of shape"):
        conv(torch.randn(N, 8), EDGE_INDEX.T)


@pytest.mark.parametrize("map_kind", MAP_KINDS)
def test_causality(map_kind):
    torch.manual_seed(1)
    n = 12  # a random causal DAG: edges go from earlier to later nodes
    src = torch.randint(0, n, (30,))
    dst = torch.randint(0, n, (30,))
    edge_index = torch.stack([torch.minimum(src, dst),
                              torch.maximum(src, dst)])
    edge_type = torch.randint(0, 2, (30,))
    convs = [SheafConv(8, 2, map_kind, num_edge_types=2) for _ in range(2)]

    def run(x, ei, et):
        for conv in convs:
            x = conv(x, ei, et)
        return x

    x = torch.randn(n, 8)
    out = run(x, edge_index, edge_type)
    t = 6
    # change the "future" (nodes after t) and add future edges, including
    # out-edges of past sources (a source-degree normaliser would leak them)
    x2 = x.clone()
    x2[t + 1:] = torch.randn(n - t - 1, 8)
    extra = torch.tensor([[0, 2, 5, 7], [8, 9, 11, 10]])
    ei2 = torch.cat([edge_index, extra], 1)
    et2 = torch.cat([edge_type, torch.tensor([0, 1, 1, 0])])
    out2 = run(x2, ei2, et2)
    torch.testing.assert_close(out[:t + 1], out2[:t + 1])
    # and a node only depends on the sources of its in-edges
    v = int(dst[0].max(src[0]))
    ancestors, frontier = {v}, {v}
    while frontier:
        frontier = {int(s) for s, d_ in edge_index.T.tolist()
                    if d_ in frontier} - ancestors
        ancestors |= frontier
    others = [i for i in range(n) if i not in ancestors]
    if others:
        x3 = x.clone()
        x3[others] += 1.0
        torch.testing.assert_close(run(x3, edge_index, edge_type)[v], out[v])


def test_orthogonal_maps_are_orthogonal():
    conv = SheafConv(12, stalk_dim=4, map_kind="orthogonal",
                     num_edge_types=3, map_hidden_channels=8).double()
    x = 3 * torch.randn(N, 12, dtype=torch.double)
    f_src, f_dst = conv.restriction_maps(x, EDGE_INDEX, EDGE_TYPE)
    eye = torch.eye(4, dtype=torch.double).expand_as(f_src)
    for m in (f_src, f_dst):
        torch.testing.assert_close(m.transpose(1, 2) @ m, eye)
        torch.testing.assert_close(torch.linalg.det(m),
                                   torch.ones(m.size(0), dtype=torch.double))
    # d == 1: the only orthogonal map is the identity
    conv1 = SheafConv(3, stalk_dim=1, map_kind="orthogonal")
    f1, _ = conv1.restriction_maps(torch.randn(N, 3), EDGE_INDEX)
    assert torch.equal(f1, torch.ones(EDGE_INDEX.size(1), 1, 1))


def test_identity_maps_learn_nothing():
    """map_kind='identity': F = I on every edge, no map learner (the ablation of learned restriction maps)."""
    conv = SheafConv(12, stalk_dim=4, map_kind="identity", num_edge_types=3)
    assert conv.map_lin is None and conv.map_type_emb is None
    assert {name for name, _ in conv.named_parameters()} == {"weight_channel", "eps"}
    f_src, f_dst = conv.restriction_maps(torch.randn(N, 12), EDGE_INDEX, EDGE_TYPE)
    assert torch.equal(f_src, torch.eye(4).expand(EDGE_INDEX.size(1), 4, 4)) and torch.equal(f_src, f_dst)


@pytest.mark.parametrize("map_kind", ["diag", "general", "orthogonal"])
@pytest.mark.parametrize("hidden", [None, 8])
def test_maps_from_identity_start_as_identity_maps_and_learn(map_kind, hidden):
    """map_init='identity': at the start every learned map is I, so the layer equals the identity-map layer with
    the same weights; and the learner's gradient is not zero, so the maps move from there."""
    torch.manual_seed(0)
    conv = SheafConv(12, stalk_dim=4, map_kind=map_kind, num_edge_types=3, map_hidden_channels=hidden,
                     map_init="identity")
    fixed = SheafConv(12, stalk_dim=4, map_kind="identity", num_edge_types=3)
    fixed.load_state_dict({k: v for k, v in conv.state_dict().items() if k in ("weight_channel", "eps")})
    x = torch.randn(N, 12)
    f_src, f_dst = conv.restriction_maps(x, EDGE_INDEX, EDGE_TYPE)
    eye = torch.eye(4).expand_as(f_src)  # restriction_maps gives diag maps as matrices too
    torch.testing.assert_close(f_src, eye)
    torch.testing.assert_close(f_dst, eye)
    out = conv(x, EDGE_INDEX, EDGE_TYPE)
    torch.testing.assert_close(out, fixed(x, EDGE_INDEX, EDGE_TYPE))
    out.square().sum().backward()
    learner = conv.map_out.weight if hidden else conv.map_lin.weight
    assert learner.grad.abs().sum() > 0


def test_map_init_must_be_known():
    with pytest.raises(ValueError, match="map_init must be one of"):
        SheafConv(12, stalk_dim=4, map_init="zeros")


@pytest.mark.parametrize("kind, width", [("diag", 4), ("general", 16), ("orthogonal", 6)])
def test_maps_from_learner_start_at_the_identity_and_keep_their_kind(kind, width):
    eye = torch.eye(4).expand(3, 4, 4)
    offset = 0.0 if kind == "orthogonal" else 1.0  # Cayley(0) is I without one
    start = maps_from_learner(torch.zeros(3, width), kind, 4, offset)
    torch.testing.assert_close(torch.diag_embed(start) if kind == "diag" else start, eye)
    maps = maps_from_learner(torch.randn(3, width, dtype=torch.float64), kind, 4)
    if kind == "orthogonal":
        torch.testing.assert_close(maps @ maps.transpose(1, 2), eye.double())
    else:
        assert maps.abs().max() < 1  # tanh
    with pytest.raises(ValueError, match="no learned maps of kind 'identity'"):
        maps_from_learner(torch.zeros(3, 4), "identity", 4)


def test_energy_zero_on_global_section():
    conv = SheafConv(6, stalk_dim=3, map_kind="orthogonal")
    with torch.no_grad():  # identity restriction maps
        conv.map_lin.weight.zero_()
        conv.map_type_emb.weight.zero_()
    x = torch.randn(1, 6).expand(N, 6).contiguous()  # equal stalks
    out, energy = conv(x, EDGE_INDEX, return_energy=True)
    assert energy.abs().max() < 1e-6
    torch.testing.assert_close(out, x)  # no disagreement: nothing diffuses
    _, energy = conv(torch.randn(N, 6), EDGE_INDEX, return_energy=True)
    assert energy[EDGE_INDEX[0] != EDGE_INDEX[1]].min() > 0


@pytest.mark.filterwarnings("ignore:Sparse")
@pytest.mark.parametrize("backend", BACKENDS)
def test_input_formats_agree(backend):
    conv = make_conv("general", stalk_mixing=True)
    x = torch.randn(N, 6, dtype=torch.double)
    w = torch.rand(EDGE_INDEX.size(1), dtype=torch.double)
    with use_backend(backend):
        out, energy = conv(x, EDGE_INDEX, EDGE_TYPE, w, return_energy=True)
        # pre-sorted edges with ptr: no sort inside
        ei, et, ws, ptr, perm = sort_by_destination(
            EDGE_INDEX, EDGE_TYPE, w, num_nodes=N, return_perm=True)
        out_s, energy_s = conv(x, ei, et, ws, return_energy=True, ptr=ptr)
        torch.testing.assert_close(out_s, out)
        torch.testing.assert_close(energy_s, energy[perm])
        # transposed sparse adjacency (rows = destinations), values = weight
        dedup = torch.ones(EDGE_INDEX.size(1), dtype=torch.bool)
        dedup[4] = False  # drop the duplicate 0->2 edge for sparse formats
        ei_u, et_u, w_u = EDGE_INDEX[:, dedup], EDGE_TYPE[dedup], w[dedup]
        ref = conv(x, ei_u, et_u, w_u)
        adj = torch.sparse_coo_tensor(ei_u.flip(0), w_u, (N, N)).coalesce()
        order = adj.indices()[0] * N + adj.indices()[1]
        et_sorted = et_u[torch.argsort(ei_u[1] * N + ei_u[0])]
        assert torch.equal(order.sort().values, order)
        torch.testing.assert_close(conv(x, adj, et_sorted), ref)
        torch.testing.assert_close(conv(x, adj.to_sparse_csr(), et_sorted),
                                   ref)
        if torch_geometric.typing.WITH_TORCH_SPARSE:
            from torch_sparse import SparseTensor
            adj_t = SparseTensor(row=ei_u[1], col=ei_u[0], value=w_u,
                                 sparse_sizes=(N, N))
            torch.testing.assert_close(conv(x, adj_t, et_sorted), ref)


def test_explainer_alignment_with_unsorted_edges():
    conv = make_conv("diag")
    x = torch.randn(N, 6, dtype=torch.double)
    w = torch.rand(EDGE_INDEX.size(1), dtype=torch.double)
    seen = []
    handle = conv.register_message_forward_hook(
        lambda mod, msg_kwargs, out: seen.append(msg_kwargs[0]["alpha"]))
    out = conv(x, EDGE_INDEX, EDGE_TYPE, w)
    handle.remove()
    assert torch.equal(seen[0], w)  # alpha in the caller's edge order
    torch.testing.assert_close(out, conv(x, EDGE_INDEX, EDGE_TYPE, w))
    # PyG explain mode: the edge mask multiplies message e of the caller
    conv.explain = True
    conv._edge_mask = torch.logit(w)
    try:
        out_mask = conv(x, EDGE_INDEX, EDGE_TYPE)
    finally:
        conv.explain = False
        conv._edge_mask = None
    torch.testing.assert_close(out_mask, out)


def test_pyg_sequential_on_data():
    torch.manual_seed(0)
    data = Data(x=torch.randn(N, 8), edge_index=EDGE_INDEX,
                edge_type=EDGE_TYPE % 2)
    model = torch_geometric.nn.Sequential("x, edge_index, edge_type", [
        (SheafConv(8, 2, "orthogonal", num_edge_types=2),
         "x, edge_index, edge_type -> x"),
        torch.nn.LayerNorm(8),
        (SheafConv(8, 4, "general", num_edge_types=2),
         "x, edge_index, edge_type -> x"),
        torch.nn.Linear(8, 3),
    ])
    out = model(data.x, data.edge_index, data.edge_type)
    assert out.shape == (N, 3)
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_empty_graph():
    conv = SheafConv(6, stalk_dim=3, map_kind="orthogonal")
    x = torch.randn(N, 6)
    out, energy = conv(x, torch.empty(2, 0, dtype=torch.long),
                       return_energy=True)
    torch.testing.assert_close(out, x)  # eps = 0: identity without edges
    assert energy.shape == (0,)
    ptr = ptr_from_index(torch.empty(0, dtype=torch.long), N)
    assert conv(x, torch.empty(2, 0, dtype=torch.long), ptr=ptr).shape == \
        (N, 6)


@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 6), num_edges=st.integers(0, 10),
       map_kind=st.sampled_from(MAP_KINDS),
       normalize=st.sampled_from(["in_degree", "weight", "none"]),
       seed=st.integers(0, 2**16))
def test_random_graphs_match_reference(n, num_edges, map_kind, normalize,
                                       seed):
    gen = torch.Generator().manual_seed(seed)
    edge_index = torch.randint(0, n, (2, num_edges), generator=gen)
    edge_type = torch.randint(0, 3, (num_edges,), generator=gen)
    # weights include exact zeros (a node whose in-weights sum to 0)
    w = torch.randint(0, 3, (num_edges,), generator=gen).double() / 2
    conv = make_conv(map_kind, normalize=normalize)
    x = torch.randn(n, 6, dtype=torch.double, generator=gen)
    for backend in BACKENDS:
        with use_backend(backend):
            out, energy = conv(x, edge_index, edge_type, w,
                               return_energy=True)
        ref_out, ref_energy = reference(conv, x, edge_index, edge_type, w)
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(energy, ref_energy)
