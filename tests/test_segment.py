"""Segment reductions: both backends against a loop reference."""
import pytest
import torch

from sheafgnn.nn import segment
from sheafgnn.nn.segment import (
    HAS_TORCH_SCATTER,
    gather_segment_mean,
    get_backend,
    index_from_ptr,
    ptr_from_index,
    resolve_backend,
    segment_gather,
    segment_mean,
    segment_sum,
    set_backend,
    sort_by_destination,
    use_backend,
)

BACKENDS = ["torch"] + (["torch_scatter"] if HAS_TORCH_SCATTER else [])
needs_scatter = pytest.mark.needs("torch_scatter")


def loop_reduce(src, ptr, mean):
    rows = []
    for s in range(ptr.numel() - 1):
        part = src[int(ptr[s]):int(ptr[s + 1])]
        if part.size(0) == 0:
            rows.append(src.new_zeros(src.shape[1:]))
        else:
            rows.append(part.mean(0) if mean else part.sum(0))
    if not rows:
        return src.new_zeros((0,) + tuple(src.shape[1:]))
    return torch.stack(rows)


def make_ptr(lengths):
    return torch.tensor([0] + lengths).cumsum(0)


# segment lengths include empty segments at the start, middle and end
LENGTHS = [0, 3, 1, 0, 0, 4, 2, 0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mean", [False, True])
@pytest.mark.parametrize("trailing", [(), (5,), (2, 3)])
def test_matches_loop_reference(backend, mean, trailing):
    torch.manual_seed(0)
    ptr = make_ptr(LENGTHS)
    src = torch.randn((int(ptr[-1]),) + trailing, dtype=torch.double,
                      requires_grad=True)
    fn = segment_mean if mean else segment_sum
    with use_backend(backend):
        out = fn(src, ptr)
    ref = loop_reduce(src, ptr, mean)
    assert out.shape == (len(LENGTHS),) + trailing
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    (grad,) = torch.autograd.grad(out, src, g)
    (grad_ref,) = torch.autograd.grad(ref, src, g)
    torch.testing.assert_close(grad, grad_ref)
    # empty segments reduce to exactly zero
    assert out[0].abs().sum() == 0 and out[-1].abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck(backend):
    ptr = make_ptr([2, 0, 3])
    src = torch.randn(5, 2, dtype=torch.double, requires_grad=True)
    with use_backend(backend):
        assert torch.autograd.gradcheck(lambda s: segment_sum(s, ptr), src)
        assert torch.autograd.gradcheck(lambda s: segment_mean(s, ptr), src)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_is_the_adjoint_of_sum(backend):
    ptr = make_ptr([2, 0, 3, 1, 0])
    src = torch.randn(5, 4, dtype=torch.double, requires_grad=True)
    with use_backend(backend):
        out = segment_gather(src, ptr, 6)  # (6, 4)
        expected = src[index_from_ptr(ptr, 6)]
        assert torch.equal(out, expected)
        rows = torch.randn(6, 4, dtype=torch.double)
        # <gather(src), rows> = <src, sum(rows)>
        torch.testing.assert_close((out * rows).sum(),
                                   (src * segment_sum(rows, ptr)).sum())
        assert torch.autograd.gradcheck(
            lambda s: segment_gather(s, ptr, 6), src)
        assert segment_gather(src, torch.zeros(6, dtype=torch.long),
                              0).shape == (0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_segment_mean_matches_the_loop_and_its_gradient_checks(backend):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 4, dtype=torch.double, generator=g, requires_grad=True)
    ptr = make_ptr(LENGTHS)
    index = torch.randint(0, 9, (int(ptr[-1]),), generator=g)  # rows of x, repeats included
    with use_backend(backend):  # on torch_scatter, the SpMM path when torch-sparse is there
        torch.testing.assert_close(gather_segment_mean(x, index, ptr), loop_reduce(x[index], ptr, mean=True))
        assert torch.autograd.gradcheck(lambda x: gather_segment_mean(x, index, ptr), x)
        empty = gather_segment_mean(x, index[:0], torch.zeros(3, dtype=torch.long))
        assert empty.shape == (2, 4) and not empty.any()


@needs_scatter
def test_backends_agree_random():
    torch.manual_seed(1)
    lengths = torch.randint(0, 4, (50,)).tolist()
    ptr = make_ptr(lengths)
    src = torch.randn(int(ptr[-1]), 7, requires_grad=True)
    for fn in (segment_sum, segment_mean):
        outs, grads = [], []
        for b in ("torch", "torch_scatter"):
            with use_backend(b):
                out = fn(src, ptr)
            outs.append(out)
            grads.append(torch.autograd.grad(out.square().sum(), src)[0])
        torch.testing.assert_close(outs[0], outs[1])
        torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_input(backend):
    with use_backend(backend):
        src = torch.randn(0, 4, requires_grad=True)
        out = segment_sum(src, torch.zeros(4, dtype=torch.long))
        assert out.shape == (3, 4) and out.abs().sum() == 0
        out.sum().backward()
        assert src.grad.shape == (0, 4)
        assert segment_mean(src, torch.zeros(1, dtype=torch.long)).shape \
            == (0, 4)


def test_backend_switch():
    before = get_backend()
    with use_backend("torch"):
        assert get_backend() == "torch" and resolve_backend() == "torch"
    assert get_backend() == before
    with pytest.raises(ValueError, match="must be one of"):
        set_backend("cuda")
    with pytest.raises(RuntimeError), use_backend("torch"):
        raise RuntimeError("boom")
    assert get_backend() == before


def test_torch_scatter_missing_is_clear(monkeypatch):
    monkeypatch.setattr(segment, "HAS_TORCH_SCATTER", False)
    with pytest.raises(ImportError, match="torch_scatter"):
        set_backend("torch_scatter")
    with segment.use_backend("auto"):
        assert segment.resolve_backend() == "torch"


def test_ptr_roundtrip_and_sort():
    index = torch.tensor([0, 0, 2, 2, 2, 4])
    ptr = ptr_from_index(index, 6)
    assert ptr.tolist() == [0, 2, 2, 5, 5, 6, 6]
    assert ptr.dtype == torch.long
    assert torch.equal(index_from_ptr(ptr, 6), index)

    edge_index = torch.tensor([[0, 1, 2, 3, 4], [2, 0, 2, 1, 0]])
    attr = torch.arange(5.0).view(5, 1)
    ei, a, none, ptr, perm = sort_by_destination(
        edge_index, attr, None, num_nodes=4, return_perm=True)
    assert ei.tolist() == [[1, 4, 3, 0, 2], [0, 0, 1, 2, 2]]  # stable
    assert a.view(-1).tolist() == [1, 4, 3, 0, 2]
    assert none is None
    assert ptr.tolist() == [0, 2, 3, 5, 5]
    assert torch.equal(edge_index[:, perm], ei)
    # without perm: (edge_index, ptr)
    assert len(sort_by_destination(edge_index, num_nodes=4)) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_traceable_by_torch_compile(backend):
    ptr = make_ptr([2, 0, 3])
    src = torch.randn(5, 4, requires_grad=True)
    fn = torch.compile(lambda s, p: segment_mean(s, p), backend="eager",
                       fullgraph=True)
    with use_backend(backend):
        out = fn(src, ptr)
    torch.testing.assert_close(out, loop_reduce(src, ptr, mean=True))
