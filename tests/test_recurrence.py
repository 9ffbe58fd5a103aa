"""The loss split by the distance to the previous occurrence of a position's n-gram."""

import math

import pytest
import torch
from torch_geometric.loader import DataLoader

from sheafgnn.data import WindowDataset
from sheafgnn.experiments.recurrence import bucket_names, bucket_of, loss_by_distance, previous_ngram_distance
from sheafgnn.lm import build_model
from sheafgnn.site import SiteBuilder, SiteConfig
from sheafgnn.train import evaluate


def brute_force(ids: list[int], n: int) -> list[int]:
    out = []
    for t in range(len(ids)):
        earlier = [s for s in range(n - 1, t) if t >= n - 1 and ids[s - n + 1 : s + 1] == ids[t - n + 1 : t + 1]]
        out.append(t - max(earlier) if earlier else -1)
    return out


@pytest.mark.parametrize("n", [1, 2, 4])
def test_previous_ngram_distance_brute_force(n):
    g = torch.Generator().manual_seed(n)
    for vocab in (2, 3, 50):
        ids = torch.randint(vocab, (200,), generator=g)
        assert previous_ngram_distance(ids, n).tolist() == brute_force(ids.tolist(), n)
    assert previous_ngram_distance(torch.tensor([1, 2]), 4).tolist() == [-1, -1]
    with pytest.raises(ValueError, match="1-D ids"):
        previous_ngram_distance(torch.zeros(2, 2, dtype=torch.long))


def test_buckets():
    assert bucket_names() == ["none", "1-16", "16-128", "128-1024", "1024-8192", ">=8192"]
    assert bucket_of(torch.tensor([-1, 1, 15, 16, 127, 128, 1024, 8191, 8192, 10**6])).tolist() == \
        [0, 1, 1, 2, 2, 3, 4, 4, 5, 5]


def test_loss_by_distance_adds_up_to_the_validation_loss():
    torch.manual_seed(0)
    model = build_model("dense", {"d_model": 16, "n_layers": 1, "n_heads": 2}, 256)
    ids = torch.tensor(list(b"the cat sat on the mat. the cat sat on the hat. " * 6))
    windows = WindowDataset(ids, 64, SiteBuilder(SiteConfig(patch_types=())))
    split = loss_by_distance(model, windows, batch_size=2, num_windows=4, device=torch.device("cpu"))
    assert sum(split[name]["tokens"] for name in bucket_names()) == split["all"]["tokens"] == 4 * 64
    assert split["16-128"]["tokens"] > 0 and split["none"]["tokens"] > 0 and split[">=8192"]["bits_per_token"] is None
    batches = [(b, int((b["token"].y != -100).sum())) for b in DataLoader([windows[i] for i in range(4)], 2)]
    expected = evaluate(model, batches, torch.device("cpu"), False, 1)["val_loss"] / math.log(2)
    assert split["all"]["bits_per_token"] == pytest.approx(expected, rel=1e-6)
