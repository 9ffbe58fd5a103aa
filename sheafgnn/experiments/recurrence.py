"""Where a language model gains: its loss by the distance to the previous occurrence of the context's n-gram.

A position whose last n tokens occurred before in its window can be predicted by copying what followed that
earlier occurrence (an induction head, a content-addressed gluing edge); one whose n-gram is new cannot. Text
and code repeat names and phrases far apart, so splitting the validation loss by that distance shows which
positions a model's long-range mechanism serves::

    ids (T,) --previous_ngram_distance--> distance (T,): t - t' for the latest t' < t with
                                          ids[t'-n+1 .. t'] == ids[t-n+1 .. t], -1 if none
    per-token loss of predicting ids[t + 1] --bucketed by distance--> bits per token per bucket

Buckets: ``none`` (no earlier occurrence), then ``[lo, hi)`` for consecutive edges of
:data:`DISTANCE_EDGES` (the last open-ended).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch_geometric.loader import DataLoader

DISTANCE_EDGES = (1, 16, 128, 1024, 8192)


def previous_ngram_distance(ids: Tensor, n: int = 4) -> Tensor:
    """(T,) for each position t the distance to the latest earlier end t' < t of the same n-gram
    ``ids[t-n+1 .. t]`` in ``ids`` (1-D), or -1 (no earlier occurrence, or t < n - 1). O(T log T)."""
    if ids.dim() != 1 or n < 1:
        raise ValueError(f"previous_ngram_distance: need 1-D ids and n >= 1 (got shape {tuple(ids.shape)}, n={n})")
    T = ids.numel()
    out = torch.full((T,), -1, dtype=torch.long)
    if T < n:
        return out
    grams = ids.long().unfold(0, n, 1)  # (T - n + 1, n): the n-gram ending at n - 1 + i
    _, key = torch.unique(grams, dim=0, return_inverse=True)  # (T - n + 1,) equal n-grams, equal keys
    order = torch.argsort(key, stable=True)  # by key, then position
    same = key[order[1:]] == key[order[:-1]]  # (T - n,) consecutive in the sorted order: an earlier occurrence
    later, earlier = order[1:][same], order[:-1][same]
    out[later + n - 1] = later - earlier
    return out


def bucket_names() -> list[str]:
    edges = DISTANCE_EDGES
    return ["none"] + [f"{lo}-{hi}" for lo, hi in zip(edges, edges[1:])] + [f">={edges[-1]}"]


def bucket_of(distance: Tensor) -> Tensor:
    """(T,) the bucket index of each distance (0: none; then one per range of :data:`DISTANCE_EDGES`)."""
    return torch.where(distance < 0, 0, torch.bucketize(distance, torch.tensor(DISTANCE_EDGES), right=True))


@torch.no_grad()
def loss_by_distance(model: nn.Module, windows, batch_size: int, num_windows: int, device: torch.device,
                     n: int = 4) -> dict[str, dict]:
    """Bits per token of ``model`` on the first ``num_windows`` of ``windows`` (a
    :class:`~sheafgnn.data.WindowDataset`), split by :func:`previous_ngram_distance` of each predicting position
    within its window: ``{bucket: {"tokens": int, "bits_per_token": float | None}}``, plus ``"all"``."""
    model.eval()
    names = bucket_names()
    nats = torch.zeros(len(names), dtype=torch.float64)
    counts = torch.zeros(len(names), dtype=torch.long)
    loader = DataLoader([windows[i] for i in range(min(num_windows, len(windows)))], batch_size=batch_size)
    for batch in loader:
        logits = model(batch.to(device))  # (num_tokens, V)
        y = batch["token"].y
        loss = nn.functional.cross_entropy(logits.float(), y, ignore_index=-100, reduction="none").cpu()
        ids, ptr = batch["token"].x.cpu(), batch["token"].ptr.tolist()
        distance = torch.cat([previous_ngram_distance(ids[a:b], n) for a, b in zip(ptr, ptr[1:])])
        scored = (y != -100).cpu()
        bucket = bucket_of(distance)[scored]
        nats.index_add_(0, bucket, loss[scored].double())
        counts.index_add_(0, bucket, torch.ones_like(bucket))
    model.train()
    out = {name: {"tokens": int(c), "bits_per_token": float(v) / math.log(2) / int(c) if c else None}
           for name, v, c in zip(names, nats, counts)}
    out["all"] = {"tokens": int(counts.sum()), "bits_per_token": float(nats.sum()) / math.log(2) / int(counts.sum())}
    return out
