"""The optional C++ kernels (sheafgnn.nn.cpu_kernels) against their PyTorch references."""
import pytest
import torch

from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.proposals import best_blocks, content_blocks, ranked_blocks_reference

block_topk = cpu_kernels.block_topk()
needs_kernel = pytest.mark.skipif(block_topk is None, reason="the block_topk kernel is disabled or could not be built")


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
    pick = block_topk(query, keys, first, last, k)
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
    pick = block_topk(query, keys, torch.tensor([0, 2]), torch.tensor([6, 4]), 3)
    assert pick.tolist() == [[4, 0, 2], [2, 3, -1]]


@needs_kernel
def test_block_topk_checks_its_input():
    with pytest.raises(RuntimeError, match="expected query"):
        block_topk(torch.randn(3, 4), torch.randn(6, 5), torch.zeros(3, dtype=torch.long),
                   torch.ones(3, dtype=torch.long), 2)
    with pytest.raises(RuntimeError, match="k must be"):
        block_topk(torch.randn(3, 4), torch.randn(6, 4), torch.zeros(3, dtype=torch.long),
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
