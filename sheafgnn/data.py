"""The embedded default corpus and context windows as sites.

No download: the corpus is the English reference documentation that ships
with every CPython (``pydoc_data.topics``) and the standard library's own
top-level Python source as code (without machine-generated modules,
:data:`GENERATED_MODULES`). Documents go to train / validation / test
by a hash of their name (90 / 5 / 5), so the split is the same on every
machine with the same Python version.

::

    corpus_documents('mixed', 'train') -> {name: text}
    load_corpus('mixed', 'train') -> list[str] (the texts)
    scored_batches(batches, tokenizer) -> [(batch, scored target bytes)]  (what evaluation takes)
    train_validation_text(corpus) -> (train text, validation text)
    WindowDataset(text, context, builder)[i] -> HeteroData (a causal site)
    StepSampler(num_windows, batch_size, seed, start_step, rank, world_size)
        the window indices of every step: a pure function of (seed, step)
"""

from __future__ import annotations

import sysconfig
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Sampler
from torch_geometric.data import HeteroData

from sheafgnn.site import SiteBuilder

SPLITS = ("train", "validation", "test")
KINDS = ("docs", "code", "mixed")
HELD_OUT = 0.1  # share of a text-file corpus (its end) held out for validation


def _split_of(name: str) -> str:
    bucket = zlib.crc32(name.encode()) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def _docs() -> dict[str, str]:
    from pydoc_data.topics import topics

    return {f"docs/{key}": text for key, text in topics.items()}


# Machine-generated modules, not source code: _sysconfigdata_* is a dict of build flags and paths.
# It fell in the validation split and was 35% of its bytes, at 5.6 bits/byte under a byte 4-gram model of
# the training text, where every other validation document sits at 2.2-3.1 (as held-out training documents,
# 2.6): most of the train/validation gap of the 0.1 compare runs.
GENERATED_MODULES = ("_sysconfigdata_",)


def _code(max_bytes: int) -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out, total = {}, 0
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith(GENERATED_MODULES):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if total + len(text) > max_bytes:
            break
        out[f"code/{path.name}"] = text
        total += len(text)
    return out


def corpus_documents(kind: str = "mixed", split: str | None = "train",
                     max_code_bytes: int = 2_000_000) -> dict[str, str]:
    """Documents of the embedded corpus by name (``docs/<topic>``, ``code/<module>.py``), in name order.

    A document's split follows a hash of its name (90% train, 5% validation, 5% test), so adding a
    document never moves another one; machine-generated modules (:data:`GENERATED_MODULES`) are left out.

    Args:
        kind (str): ``"docs"`` (pydoc topics), ``"code"`` (stdlib source) or
            ``"mixed"`` (both). (default: :obj:`"mixed"`)
        split (str, optional): ``"train"``, ``"validation"``, ``"test"``, or :obj:`None` for every split.
        max_code_bytes (int): cap on the code read, in sorted file order.
    """
    if kind not in KINDS:
        raise ValueError(f"corpus_documents: kind must be one of {KINDS} (got {kind!r})")
    if split is not None and split not in SPLITS:
        raise ValueError(f"corpus_documents: split must be one of {SPLITS} or None (got {split!r})")
    docs: dict[str, str] = {}
    if kind in ("docs", "mixed"):
        docs.update(_docs())
    if kind in ("code", "mixed"):
        docs.update(_code(max_code_bytes))
    return {name: docs[name] for name in sorted(docs) if split is None or _split_of(name) == split}


def load_corpus(kind: str = "mixed", split: str = "train", max_code_bytes: int = 2_000_000) -> list[str]:
    """The texts of :func:`corpus_documents` for one split, in name order."""
    if split not in SPLITS:
        raise ValueError(f"load_corpus: split must be one of {SPLITS} (got {split!r})")
    return list(corpus_documents(kind, split, max_code_bytes).values())


def corpus_text(kind: str = "mixed", split: str = "train", **kwargs) -> str:
    """The split's documents joined by blank lines."""
    return "\n\n".join(load_corpus(kind, split, **kwargs))


def corpus_ids(n: int, kind: str = "mixed", split: str = "train") -> Tensor:
    """The first ``n`` bytes of :func:`corpus_text` as byte-tokenizer ids (n,), the text repeated as
    often as ``n`` needs (benchmarks at contexts longer than the corpus)."""
    raw = corpus_text(kind, split).encode()
    raw = raw * (n // len(raw) + 1)
    return torch.tensor(list(raw[:n]), dtype=torch.long)


def train_validation_text(corpus: str) -> tuple[str, str]:
    """(train, validation) text of ``corpus``: an embedded kind (:data:`KINDS`) or a UTF-8 text file,
    whose last :data:`HELD_OUT` share is the validation text."""
    if corpus in KINDS:
        return corpus_text(corpus, "train"), corpus_text(corpus, "validation")
    text = Path(corpus).read_text(encoding="utf-8", errors="replace")
    cut = int(len(text) * (1 - HELD_OUT))
    return text[:cut], text[cut:]


def scored_batches(batches: Iterable, tokenizer) -> list[tuple[Any, int]]:
    """(batch, bytes of its scored targets) pairs: what :func:`sheafgnn.train.evaluate` takes to turn nats
    into bits per byte."""
    return [(b, int(tokenizer.token_bytes(b["token"].y[b["token"].y != -100])[1].sum())) for b in batches]


class WindowDataset(Dataset):
    """Non-overlapping context windows of a token stream, each built into a site.

    Item ``i`` holds ``context + 1`` tokens: the site is built on the first
    ``context`` and ``data['token'].y`` holds the next token of each position.

    Args:
        ids (Tensor): the token stream, shape (N,).
        context (int): tokens per window.
        builder (SiteBuilder): turns a window into a ``HeteroData``.
    """

    def __init__(self, ids: Tensor, context: int, builder: SiteBuilder) -> None:
        if ids.dim() != 1:
            raise ValueError(f"WindowDataset: ids must be 1-D, got shape {tuple(ids.shape)}")
        if context < 1 or ids.numel() < context + 1:
            raise ValueError(f"WindowDataset: need more than context={context} tokens (got {ids.numel()})")
        self.ids = ids
        self.context = context
        self.builder = builder

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.context

    def __getitem__(self, i: int) -> HeteroData:
        if not 0 <= i < len(self):
            raise IndexError(f"WindowDataset: index {i} out of range for {len(self)} windows")
        window = self.ids[i * self.context : (i + 1) * self.context + 1]
        data = self.builder(window[:-1])
        data["token"].y = window[1:].clone()
        return data


class StepSampler(Sampler[list[int]]):
    """This rank's window indices for every step from ``start_step`` on (endless).

    Global batch ``s`` is ``perm_e[k * B : (k + 1) * B]`` with ``e, k = divmod(s,
    n // B)`` and ``perm_e`` a permutation seeded by (seed, e); rank r takes the
    r-th of ``world_size`` equal slices. The last ``n % B`` windows of an epoch
    are dropped.
    """

    def __init__(self, num_windows: int, batch_size: int, seed: int, start_step: int = 0,
                 rank: int = 0, world_size: int = 1) -> None:
        if num_windows < batch_size:
            raise ValueError(f"StepSampler: {num_windows} windows are fewer than batch_size={batch_size}; "
                             "use a larger corpus, a shorter context or a smaller batch")
        if batch_size % world_size != 0:
            raise ValueError(f"StepSampler: batch_size={batch_size} must be a multiple of the {world_size} processes")
        self.n, self.batch_size, self.seed, self.start_step = num_windows, batch_size, seed, start_step
        self.rank, self.world_size = rank, world_size

    def permutation(self, epoch: int) -> Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1_000_003 + epoch))

    def __iter__(self):
        per_epoch, local = self.n // self.batch_size, self.batch_size // self.world_size
        step, epoch, perm = self.start_step, -1, None
        while True:
            e, k = divmod(step, per_epoch)
            if e != epoch:
                epoch, perm = e, self.permutation(e)
            start = k * self.batch_size + self.rank * local
            yield perm[start : start + local].tolist()
            step += 1


def site_statistics(graphs: list[HeteroData]) -> dict[str, dict[str, float]]:
    """Per node type and edge type: total count and count per token."""
    tokens = sum(g["token"].num_nodes for g in graphs)
    stats: dict[str, dict[str, float]] = {}
    for key in graphs[0].node_types + graphs[0].edge_types:
        count = sum(g[key].num_nodes if isinstance(key, str) else g[key].num_edges for g in graphs)
        name = key if isinstance(key, str) else "__".join(key)
        stats[name] = {"count": count, "per_token": count / max(tokens, 1)}
    return stats

