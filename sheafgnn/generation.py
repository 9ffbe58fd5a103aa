r"""Streaming generation: one interface for every model.

A model's ``stream(batch_size)`` returns a :class:`TokenStream`. The stream
holds the model's state after the tokens fed so far (a KV cache for the
Transformers, recurrent state for the state-space models), so each new token
costs one step, not a forward pass over the whole text::

    stream = model.stream()                      # batch_size 1
    logits = stream.feed(prompt_ids)             # (len(prompt), V), one row per fed position
    for ids in stream.sample(100, top_k=40):     # (1,) per step, fed back into the stream
        print(tokenizer.decode(ids), end="")

    TokenStream                                  base: validation, sampling, bookkeeping
    ├── feed(ids)        -> logits               checks the input, then calls _feed
    ├── sample(n, ...)   -> Iterator[(B,)]       sample_next on the last logits, fed back
    ├── generate(n, ...) -> (n,) or (B, n)
    └── _feed(ids)       -> list of (n_b, V)     the one method a model's stream implements

This module imports only torch, so every model can build on it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor


def check_sampling(temperature: float, top_k: int | None, where: str = "sample_next") -> None:
    """Raise a ValueError naming ``where`` unless ``temperature > 0`` (finite) and ``top_k`` is None or >= 1."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"{where}: temperature must be a positive finite number (got {temperature!r})")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"{where}: top_k must be None or an integer >= 1 (got {top_k!r})")


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    r"""Sample one token id per row of ``logits``.

    The logits are divided by ``temperature``, all but the ``top_k`` largest
    are dropped, and an id is drawn from the softmax. ``top_k=1`` is the
    argmax (greedy decoding; no randomness is drawn).

    Args:
        logits (Tensor): unnormalised next-token scores.
        temperature (float, optional): > 0; below 1 sharpens, above 1
            flattens the distribution. (default: :obj:`1.0`)
        top_k (int, optional): sample among the ``top_k`` most likely ids
            only (all ids if :obj:`None` or >= V). (default: :obj:`None`)
        generator (torch.Generator, optional): the random source, on the
            logits' device, for reproducible draws. (default: :obj:`None`)

    Shapes:
        - **input:** logits (B, V)
        - **output:** ids (B,), int64
    """
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.shape[1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"sample_next: logits must have shape (B, V) with V >= 1 (got {shape})")
    check_sampling(temperature, top_k, "sample_next")
    if top_k == 1:
        return logits.argmax(dim=-1)  # (B,)
    scores = logits.float() / temperature  # (B, V)
    if top_k is not None and top_k < scores.shape[1]:
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]  # (B, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = scores.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (B,)


class TokenStream:
    r"""Base of every model's stream: feed token ids, get the logits of the fed positions; sample.

    A stream holds ``batch_size`` independent token sequences. :meth:`feed`
    appends ids to each (the streams may grow by different amounts) and
    returns the logits at every fed position, equal to the model's full
    forward pass on the whole sequence at those positions. :meth:`sample`
    draws the next id of every stream from its last logits and feeds it back.

    A subclass implements only :meth:`_feed`; this class validates the input
    (before any state changes, so a bad call leaves the stream usable), runs
    under :func:`torch.inference_mode`, counts the tokens and keeps the last logits.

    Args:
        batch_size (int): the number of streams B >= 1.
        vocab_size (int): the number of token ids V >= 1; ids lie in [0, V).

    Shapes:
        - **feed input:** ids (n,) for ``batch_size`` 1, else B tensors (n_b,)
        - **feed output:** logits (n, V), else a list of B tensors (n_b, V)
        - **sample:** ids (B,) per step

    A subclass whose model can take only so many tokens sets
    :attr:`max_tokens`; :meth:`feed` and :meth:`sample` then refuse to go past it.
    A long feed is run in pieces of at most :attr:`feed_tokens` tokens over all
    streams (``feed_tokens // B`` per stream): the logits are the same, and the
    memory of one feed stays bounded (16 prompts of 32k tokens at once would be a
    forward pass over 512k tokens).
    """

    max_tokens: int | None = None  # the most tokens one stream can hold (None: no limit); feed checks it
    feed_tokens: int = 16384  # the most tokens (all streams together) one _feed call takes; feed splits longer ones

    def __init__(self, batch_size: int, vocab_size: int) -> None:
        for name, value in (("batch_size", batch_size), ("vocab_size", vocab_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{type(self).__name__}: {name} must be an integer >= 1 (got {value!r})")
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.num_tokens = [0] * batch_size  # tokens fed so far, per stream
        self._last: list[Tensor | None] = [None] * batch_size  # each stream's last logits row (V,)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(batch_size={self.batch_size}, num_tokens={self.num_tokens})"

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        """Advance every stream by its ids and return their logits (the one method to implement).

        Called under :func:`torch.inference_mode` with validated input: B 1-D int64
        tensors of ids in [0, V), possibly empty, on the caller's device.
        ``self.num_tokens`` still holds the counts before this call. Must
        return B tensors of shape (n_b, V).
        """
        raise NotImplementedError(f"{type(self).__name__} must implement _feed")

    def _check(self, ids: Tensor | Sequence[Tensor]) -> list[Tensor]:
        """``ids`` as B validated 1-D int64 tensors; raises TypeError / ValueError, changes nothing."""
        B, name = self.batch_size, type(self).__name__
        if isinstance(ids, Tensor):
            if B != 1:
                raise TypeError(f"{name}.feed: a stream of batch_size {B} takes a sequence of {B} 1-D id "
                                f"tensors, one per stream (got one tensor of shape {tuple(ids.shape)})")
            ids = [ids]
        elif not isinstance(ids, Sequence) or isinstance(ids, (str, bytes)):
            raise TypeError(f"{name}.feed: ids must be a 1-D integer tensor or a sequence of {B} of them "
                            f"(got {type(ids).__name__})")
        if len(ids) != B:
            raise ValueError(f"{name}.feed: expected {B} id tensors, one per stream (got {len(ids)})")
        out = []
        for b, x in enumerate(ids):
            where = f"{name}.feed: ids" + (f"[{b}]" if B > 1 else "")
            if not isinstance(x, Tensor):
                raise TypeError(f"{where} must be a 1-D integer tensor (got {type(x).__name__})")
            if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
                raise TypeError(f"{where} must have an integer dtype (got {x.dtype}); token ids are integers")
            if x.dim() != 1:
                raise ValueError(f"{where} must be 1-D (got shape {tuple(x.shape)}); pass one tensor per stream")
            if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.vocab_size):
                raise ValueError(f"{where} must lie in [0, {self.vocab_size}) (got values from {int(x.min())} "
                                 f"to {int(x.max())})")
            if self.max_tokens is not None and self.num_tokens[b] + x.numel() > self.max_tokens:
                raise ValueError(f"{where}: {self.num_tokens[b]} + {x.numel()} tokens exceed the stream's limit of "
                                 f"{self.max_tokens} tokens")
            out.append(x.long())
        return out

    def _advance(self, ids: list[Tensor]) -> list[Tensor]:
        """Run the validated ``ids`` through :meth:`_feed` in pieces of at most :attr:`feed_tokens`
        tokens; update counts and last logits."""
        piece = max(1, self.feed_tokens // self.batch_size)  # tokens per stream per _feed call
        longest = max(x.numel() for x in ids)
        if longest > piece:
            pieces = [self._advance([x[start : start + piece] for x in ids]) for start in range(0, longest, piece)]
            return [torch.cat(rows) for rows in zip(*pieces, strict=True)]
        with torch.inference_mode():
            logits = self._feed(ids)
        for b, (x, rows) in enumerate(zip(ids, logits, strict=True)):
            if rows.shape != (x.numel(), self.vocab_size):
                raise RuntimeError(f"{type(self).__name__}._feed returned logits of shape {tuple(rows.shape)} "
                                   f"for {x.numel()} ids of stream {b} (expected ({x.numel()}, {self.vocab_size}))")
            if x.numel():
                self._last[b] = rows[-1]
                self.num_tokens[b] += x.numel()
        return logits

    def feed(self, ids: Tensor | Sequence[Tensor]) -> Tensor | list[Tensor]:
        """Append ``ids`` to the streams; return the logits at the fed positions.

        Args:
            ids (Tensor or Sequence[Tensor]): a 1-D integer tensor (``batch_size``
                1), or a sequence of ``batch_size`` of them (lengths may differ
                and may be 0).

        Returns:
            logits (n, V) for a single tensor, else a list of B tensors (n_b, V).

        Raises:
            TypeError, ValueError: for input of the wrong type, dtype, shape,
                number of streams, or ids outside [0, V); the stream is unchanged.
        """
        single = isinstance(ids, Tensor)
        logits = self._advance(self._check(ids))
        return logits[0] if single else logits

    def sample(self, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
               generator: torch.Generator | None = None) -> Iterator[Tensor]:
        """Sample ``max_new_tokens`` ids per stream, each fed back before it is yielded.

        The arguments are checked at once (not at the first step); every
        stream must have been fed at least one token. If the caller stops
        early, the stream holds exactly the ids yielded so far.

        Args:
            max_new_tokens (int): steps, >= 0.
            temperature, top_k, generator: as in :func:`sample_next`.

        Returns:
            an iterator of ids (B,), one per step.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"{type(self).__name__}.sample: max_new_tokens must be an integer >= 0 "
                             f"(got {max_new_tokens!r})")
        if self.max_tokens is not None and max(self.num_tokens) + max_new_tokens > self.max_tokens:
            raise ValueError(f"{type(self).__name__}.sample: {max(self.num_tokens)} + {max_new_tokens} tokens exceed "
                             f"the stream's limit of {self.max_tokens} tokens")
        empty = [b for b, n in enumerate(self.num_tokens) if n == 0]
        if empty:
            raise ValueError(f"{type(self).__name__}.sample: stream(s) {empty} have no tokens yet; feed a prompt "
                             "of at least one token first")
        check_sampling(temperature, top_k, f"{type(self).__name__}.sample")
        return self._sample(max_new_tokens, temperature, top_k, generator)

    def _sample(self, steps: int, temperature: float, top_k: int | None,
                generator: torch.Generator | None) -> Iterator[Tensor]:
        for _ in range(steps):
            ids = sample_next(torch.stack(self._last), temperature, top_k, generator)  # (B,)
            self._advance(list(ids[:, None]))  # B tensors (1,)
            yield ids

    def generate(self, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None) -> Tensor:
        """The ids of :meth:`sample`, collected: (max_new_tokens,) for ``batch_size`` 1, else (B, max_new_tokens)."""
        steps = list(self.sample(max_new_tokens, temperature, top_k, generator))
        device = self._last[0].device
        out = torch.stack(steps, dim=1) if steps else torch.empty(self.batch_size, 0, dtype=torch.long, device=device)
        return out[0] if self.batch_size == 1 else out  # (n,) or (B, n)
