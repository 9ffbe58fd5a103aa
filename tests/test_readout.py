import pytest
import torch

from sheafgnn.nn.readout import readout_cross_entropy, readout_cross_entropy_reference


def _inputs(M=37, D=6, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    h, weight, bias, embedding = (torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                                  for shape in ((M, D), (D,), (D,), (V, D)))
    target = torch.randint(V, (M,), generator=g)
    target[[3, 8, 30]] = -100  # rows that do not count
    return h, weight, bias, embedding, target


@pytest.mark.parametrize("chunk_rows", [1, 5, 36, 100])  # 100 > M: one chunk, the plain composition
def test_readout_cross_entropy_matches_the_plain_composition(chunk_rows):
    *inputs, target = _inputs()
    fused = readout_cross_entropy(*inputs, target, chunk_rows=chunk_rows)
    plain = readout_cross_entropy_reference(*inputs, target)
    torch.testing.assert_close(fused, plain)
    for a, b in zip(torch.autograd.grad(2.5 * fused, inputs), torch.autograd.grad(2.5 * plain, inputs)):
        torch.testing.assert_close(a, b)
    torch.autograd.gradcheck(lambda *t: readout_cross_entropy(*t, target, chunk_rows=chunk_rows), inputs)


def test_readout_cross_entropy_gradients_only_where_asked_and_no_logits_kept():
    h, weight, bias, embedding, target = _inputs(M=64, V=50)
    frozen = embedding.detach()
    loss = readout_cross_entropy(h, weight, bias, frozen, target, chunk_rows=16)
    grad_h, = torch.autograd.grad(loss, h)
    torch.testing.assert_close(grad_h, torch.autograd.grad(readout_cross_entropy_reference(h, weight, bias, frozen,
                                                                                         target), h)[0])
    # backward keeps the gradients (scaled by 1 / count), no (M, V) logits
    loss = readout_cross_entropy(h, weight, bias, embedding, target, chunk_rows=16)
    kept = loss.grad_fn.saved_tensors
    assert [tuple(t.shape) for t in kept] == [(64, 6), (6,), (6,), (50, 6)]
    torch.testing.assert_close(kept[0], torch.autograd.grad(readout_cross_entropy_reference(h, weight, bias,
                                                                                          embedding, target), h)[0])
    with torch.no_grad():
        torch.testing.assert_close(readout_cross_entropy(h, weight, bias, embedding, target),
                                   readout_cross_entropy_reference(h, weight, bias, embedding, target))


def test_readout_cross_entropy_edge_cases():
    h, weight, bias, embedding, target = _inputs()
    for chunk_rows in (5, 100):  # no row counts: nan, as cross_entropy's mean
        assert torch.isnan(readout_cross_entropy(h, weight, bias, embedding, torch.full_like(target, -100),
                                                 chunk_rows=chunk_rows))
    with pytest.raises(ValueError, match="expected h \\(M, D\\), target \\(M,\\)"):
        readout_cross_entropy(h, weight, bias, embedding, target[:-1])
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        readout_cross_entropy(h, weight, bias, embedding, target, chunk_rows=0)
