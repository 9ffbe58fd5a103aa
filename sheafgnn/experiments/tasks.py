r"""Synthetic dependency tasks: associative recall, selective copying, induction heads.

Each generator is pure and seeded by an optional :class:`torch.Generator`, is
vectorised over the batch (no Python loop per example or per token), and
returns ``(inputs, targets)``, two int64 tensors of shape (B, T). A target is
the token the model must output *at* that position (a causal LM reads it from
its logits at t, having seen inputs[:t+1]); every unscored position holds
:data:`IGNORE_INDEX` (-100), which ``F.cross_entropy`` skips.

- :func:`mqar`: recall the value bound to the key at t (num_pairs scored
  positions per row);
- :func:`scattered_recall`: MQAR with the binds scattered through the row and
  each query at a random distance after its own bind;
- :func:`selective_copying`: output the i-th data token scattered in noise
  (the last num_tokens positions);
- :func:`induction_heads`: output the token that followed the first trigger
  (the last position).
"""

from __future__ import annotations

import torch
from torch import Tensor

IGNORE_INDEX = -100


def _check_positive(fn: str, **values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{fn}: {name} must be >= 1 (got {value})")


def _distinct(batch_size: int, num: int, high: int, generator: torch.Generator | None) -> Tensor:
    """``num`` distinct ints from [0, high) per row, in random order: (B, num)."""
    scores = torch.rand(batch_size, high, generator=generator, dtype=torch.float64)  # (B, high)
    return scores.topk(num, dim=1).indices  # (B, num)


def mqar(
    batch_size: int,
    seq_len: int = 256,
    num_pairs: int = 16,
    vocab_size: int = 512,
    generator: torch.Generator | None = None,
    *,
    power_a: float = 0.01,
    random_non_queries: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Multi-Query Associative Recall (MQAR).

    From Arora et al. 2023, "Zoology: Measuring and Improving Recall in
    Efficient Language Models"; this follows their generator
    ``_mqar`` / ``multiquery_ar`` in HazyResearch/zoology,
    ``zoology/data/associative_recall.py`` (same layout in
    ``zoology/data/multiquery_ar.py``):

    - keys are drawn without replacement from [1, V // 2), values without
      replacement from [V // 2, V); id 0 is reserved as the blank;
    - the row opens with the ``num_pairs`` pairs ``k_1 v_1 k_2 v_2 ...``
      (2 * num_pairs tokens);
    - every key is queried once, in random order: key ``k_i`` is placed at
      ``2 * num_pairs + 2 * g_i``, where the gaps ``g_i`` are distinct, drawn
      from [0, (T - 2 * num_pairs) // 2) with probability proportional to
      ``power_a * (g + 1) ** (power_a - 1)`` (a power law; ``power_a=1`` is
      uniform), so most queries come soon after the pairs;
    - the target at a query position is the value bound to that key;
    - every other input is 0, or, with ``random_non_queries``, a uniform
      random id in [0, V) (as in Zoology, noise may repeat a key; only query
      positions are scored).

    Example (``vocab_size=12, num_pairs=2, seq_len=16, random_non_queries=False``,
    the docstring example of Zoology)::

        inputs:  2    8    4    7    0    0    4    0    0    0    0    0    2    0    0    0
        targets: -100 -100 -100 -100 -100 -100 7    -100 -100 -100 -100 -100 8    -100 -100 -100

    Unlike Zoology, ``seq_len`` may be odd and need not be below ``vocab_size``;
    randomness comes from ``generator`` instead of ``np.random.seed``.

    Args:
        batch_size (int): number of rows B.
        seq_len (int, optional): row length T, at least ``4 * num_pairs``.
            (default: :obj:`256`)
        num_pairs (int, optional): key-value pairs per row, each queried once.
            (default: :obj:`16`)
        vocab_size (int, optional): V, at least ``2 * num_pairs + 2``.
            (default: :obj:`512`)
        generator (torch.Generator, optional): source of randomness.
            (default: :obj:`None`, the global generator)
        power_a (float, optional): power-law exponent of the query gaps,
            > 0. (default: :obj:`0.01`)
        random_non_queries (bool, optional): fill blanks with random ids
            instead of 0. (default: :obj:`True`)

    Shapes:
        - **output:** inputs (B, T), targets (B, T), int64; num_pairs targets
          per row are scored, the rest are -100.
    """
    _check_mqar(batch_size, seq_len, num_pairs, vocab_size, power_a)
    B, T, ctx = batch_size, seq_len, 2 * num_pairs
    half = vocab_size // 2
    keys = _distinct(B, num_pairs, half - 1, generator) + 1  # (B, P) in [1, V/2)
    values = _distinct(B, num_pairs, vocab_size - half, generator) + half  # (B, P) in [V/2, V)
    query_pos = _query_positions(B, T, num_pairs, power_a, generator)  # (B, P)

    inputs = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    inputs[:, 0:ctx:2] = keys
    inputs[:, 1:ctx:2] = values
    inputs.scatter_(1, query_pos, keys)
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    targets.scatter_(1, query_pos, values)
    if random_non_queries:
        noise = torch.randint(vocab_size, (B, T), generator=generator)  # (B, T)
        inputs = torch.where(inputs == 0, noise, inputs)
    return inputs, targets


def _uniform_except(excluded: Tensor, length: int, vocab_size: int, generator: torch.Generator | None) -> Tensor:
    """(B, length) tokens uniform over [0, vocab_size) without each row's distinct ``excluded`` (B, P): the r-th
    token not excluded is r + #{j : e_(j) - j <= r}, with e_(j) the row's excluded tokens sorted."""
    skip = excluded.sort(1).values - torch.arange(excluded.size(1))  # (B, P) non-decreasing
    rank = torch.randint(vocab_size - excluded.size(1), (excluded.size(0), length), generator=generator)
    return rank + torch.searchsorted(skip, rank, right=True)


def scattered_recall(
    batch_size: int,
    seq_len: int = 256,
    num_pairs: int = 16,
    vocab_size: int = 1024,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Associative recall with scattered binds: MQAR's keys, values and scoring in another layout.

    In :func:`mqar` every bind ``k v`` sits at the start of the row and every
    query after all of them, so "read the pairs region" is a rule a model can
    learn without looking up content. Here the row is a random interleaving
    of three kinds of units:

    - ``num_pairs`` binds ``k_i v_i`` (two tokens), keys distinct in
      [1, V // 2), values distinct in [V // 2, V), as in MQAR;
    - ``num_pairs`` queries ``k_i`` (one token), each after its own bind: the
      bind's and the query's places in the order of the ``2 * num_pairs``
      events are the smaller and the larger of two uniform draws, so a query
      may come right after its bind or far later, before or after other binds;
    - ``seq_len - 3 * num_pairs`` filler tokens, uniform over [0, V) without
      the row's keys, spread uniformly between the events. Unlike MQAR's
      noise, a filler never repeats a key: a key followed by a filler in the
      values' half would be a second bind no model can tell from the real
      one (5.4% of the queries at (256, 16), V 1,024, with fillers uniform in
      [0, V): a ceiling near 0.975). Each key occurs at its bind and query.

    The target at a query is its bind's value; every other position is
    :data:`IGNORE_INDEX`.

    Example (``seq_len=12, num_pairs=2``, fillers written ``.``)::

        inputs:  .  k1 v1 .  k2 v2 k2 .  .  k1 .  .
        targets:                   v2       v1

    Args:
        batch_size (int): number of rows B.
        seq_len (int, optional): row length T, at least ``3 * num_pairs``. (default: :obj:`256`)
        num_pairs (int, optional): binds per row, each queried once. (default: :obj:`16`)
        vocab_size (int, optional): V, at least ``2 * num_pairs + 2``. (default: :obj:`1024`)
        generator (torch.Generator, optional): source of randomness.
            (default: :obj:`None`, the global generator)

    Shapes:
        - **output:** inputs (B, T), targets (B, T), int64; num_pairs targets
          per row are scored, the rest are -100.
    """
    _check_positive("scattered_recall", batch_size=batch_size, seq_len=seq_len, num_pairs=num_pairs)
    if 3 * num_pairs > seq_len:
        raise ValueError(f"scattered_recall: seq_len must be at least 3 * num_pairs (a bind of two tokens and a "
                         f"query per pair); got seq_len={seq_len}, num_pairs={num_pairs}")
    if vocab_size // 2 - 1 < num_pairs:
        raise ValueError(f"scattered_recall: vocab_size too small for {num_pairs} distinct keys in "
                         f"[1, vocab_size // 2); need vocab_size >= {2 * num_pairs + 2} (got {vocab_size})")
    B, T, P = batch_size, seq_len, num_pairs
    half = vocab_size // 2
    keys = _distinct(B, P, half - 1, generator) + 1  # (B, P) in [1, V/2)
    values = _distinct(B, P, vocab_size - half, generator) + half  # (B, P) in [V/2, V)
    # The order of the 2P events: pair i binds at the smaller of two uniform draws and is queried at the larger.
    draws = torch.rand(B, P, 2, generator=generator, dtype=torch.float64).sort(-1).values  # (B, P, 2)
    event_time = draws.flatten(1)  # (B, 2P): bind of pair i at 2i, its query at 2i + 1
    order = event_time.argsort(1)  # (B, 2P) events in time order
    is_bind = order % 2 == 0  # (B, 2P)
    pair = order // 2  # (B, 2P)
    # Units: 2P events and F fillers; the events take a random sorted subset of the T - P unit slots.
    fillers = T - 3 * P
    slots = _distinct(B, 2 * P, 2 * P + fillers, generator).sort(1).values  # (B, 2P) unit index of each event
    # A unit's first token: every earlier unit takes one token, and every earlier bind one more.
    binds_before = torch.cumsum(is_bind.long(), 1) - is_bind.long()  # (B, 2P)
    start = slots + binds_before  # (B, 2P) token position of each event
    inputs = _uniform_except(keys, T, vocab_size, generator)  # (B, T) fillers everywhere first
    key_of = keys.gather(1, pair)  # (B, 2P)
    inputs.scatter_(1, start, key_of)
    bind_rows, bind_events = is_bind.nonzero(as_tuple=True)
    inputs[bind_rows, start[bind_rows, bind_events] + 1] = values[bind_rows, pair[bind_rows, bind_events]]
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    query_rows, query_events = (~is_bind).nonzero(as_tuple=True)
    targets[query_rows, start[query_rows, query_events]] = values[query_rows, pair[query_rows, query_events]]
    return inputs, targets


def _check_mqar(batch_size: int, seq_len: int, num_pairs: int, vocab_size: int, power_a: float) -> None:
    _check_positive("mqar", batch_size=batch_size, seq_len=seq_len, num_pairs=num_pairs)
    if 4 * num_pairs > seq_len:
        raise ValueError(
            f"mqar: seq_len must be at least 4 * num_pairs (2 * num_pairs tokens of pairs, then num_pairs "
            f"query slots two apart); got seq_len={seq_len}, num_pairs={num_pairs}"
        )
    if vocab_size // 2 - 1 < num_pairs:
        raise ValueError(
            f"mqar: vocab_size too small for {num_pairs} distinct keys in [1, vocab_size // 2); "
            f"need vocab_size >= {2 * num_pairs + 2} (got {vocab_size})"
        )
    if not power_a > 0:
        raise ValueError(f"mqar: power_a must be > 0 (got {power_a})")


def _query_positions(batch_size: int, seq_len: int, num_pairs: int, power_a: float,
                     generator: torch.Generator | None) -> Tensor:
    """MQAR's query positions (B, P): ``2 * num_pairs + 2 * g`` with distinct gaps g drawn from the
    power law ``power_a * (g + 1) ** (power_a - 1)`` over the query slots."""
    space = (seq_len - 2 * num_pairs) // 2  # number of query slots
    gap = torch.arange(1, space + 1, dtype=torch.float64)  # (S,)
    p = power_a * gap ** (power_a - 1)  # (S,) unnormalised power law
    gaps = torch.multinomial(p.expand(batch_size, space), num_pairs, replacement=False, generator=generator)  # (B, P)
    return 2 * num_pairs + 2 * gaps  # (B, P)


def selective_copying(
    batch_size: int,
    seq_len: int,
    num_tokens: int = 16,
    vocab_size: int = 16,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Selective copying (Gu and Dao 2023, "Mamba", Section 3.1 and Figure 2).

    This is the ``variable=True`` copying task of the S4 repository
    (state-spaces/s4, ``src/dataloaders/datasets/copying.py``,
    ``torch_copying_data``), which the Mamba paper uses, with the model's
    answers laid out as next-token targets:

    - id 0 is noise, id V - 1 is the marker, data tokens are uniform in
      [1, V - 2];
    - the first ``T - num_tokens`` positions are noise with ``num_tokens``
      data tokens at random, distinct positions;
    - the last ``num_tokens`` positions are markers; the target at the i-th
      marker is the i-th data token, in order of position.

    Example (``seq_len=10, num_tokens=3, vocab_size=8``)::

        inputs:  0    5    0    0    2    0    3    7    7    7
        targets: -100 -100 -100 -100 -100 -100 -100 5    2    3

    Args:
        batch_size (int): number of rows B.
        seq_len (int): row length T, at least ``2 * num_tokens``.
        num_tokens (int, optional): data tokens to copy. (default: :obj:`16`)
        vocab_size (int, optional): V, at least 3 (noise, marker, one data
            token). (default: :obj:`16`)
        generator (torch.Generator, optional): source of randomness.
            (default: :obj:`None`, the global generator)

    Shapes:
        - **output:** inputs (B, T), targets (B, T), int64; the last
          num_tokens targets of each row are scored, the rest are -100.
    """
    _check_positive("selective_copying", batch_size=batch_size, seq_len=seq_len, num_tokens=num_tokens)
    if seq_len < 2 * num_tokens:
        raise ValueError(
            f"selective_copying: seq_len must be at least 2 * num_tokens (num_tokens data tokens, then "
            f"num_tokens markers); got seq_len={seq_len}, num_tokens={num_tokens}"
        )
    if vocab_size < 3:
        raise ValueError(
            f"selective_copying: vocab_size must be >= 3 (noise 0, marker V - 1, data tokens between); got {vocab_size}"
        )
    B, T, M = batch_size, seq_len, num_tokens
    tokens = torch.randint(1, vocab_size - 1, (B, M), generator=generator)  # (B, M)
    pos = _distinct(B, M, T - M, generator).sort(dim=1).values  # (B, M) increasing
    inputs = torch.zeros(B, T, dtype=torch.long)  # (B, T)
    inputs.scatter_(1, pos, tokens)
    inputs[:, T - M :] = vocab_size - 1
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    targets[:, T - M :] = tokens
    return inputs, targets


def induction_heads(
    batch_size: int,
    seq_len: int,
    vocab_size: int = 16,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Induction heads (Fu et al. 2023, "H3"; Gu and Dao 2023, "Mamba").

    Follows the generator of H3/Safari (HazyResearch/safari,
    ``src/dataloaders/synthetics.py``, ``generate_induction_head`` with one
    trigger and ``induction_len=1``):

    - id V - 1 is the trigger; every other position holds a uniform random
      token in [0, V - 2], so the trigger appears exactly twice;
    - the first trigger sits at a uniform random position p in [0, T - 3],
      followed by the token X = inputs[p + 1];
    - the last position holds the trigger again, and its target is X.

    Example (``seq_len=8, vocab_size=6``)::

        inputs:  3    5    2    0    1    4    3    5
        targets: -100 -100 -100 -100 -100 -100 -100 2

    Args:
        batch_size (int): number of rows B.
        seq_len (int): row length T, at least 3.
        vocab_size (int, optional): V, at least 2 (the trigger and one
            token). (default: :obj:`16`)
        generator (torch.Generator, optional): source of randomness.
            (default: :obj:`None`, the global generator)

    Shapes:
        - **output:** inputs (B, T), targets (B, T), int64; only the last
          target of each row is scored, the rest are -100.
    """
    _check_positive("induction_heads", batch_size=batch_size, seq_len=seq_len)
    if seq_len < 3:
        raise ValueError(f"induction_heads: seq_len must be >= 3 (trigger, token, trigger); got {seq_len}")
    if vocab_size < 2:
        raise ValueError(f"induction_heads: vocab_size must be >= 2 (trigger V - 1 and a token); got {vocab_size}")
    B, T = batch_size, seq_len
    trigger = vocab_size - 1
    inputs = torch.randint(0, trigger, (B, T), generator=generator)  # (B, T), no trigger yet
    first = torch.randint(0, T - 2, (B, 1), generator=generator)  # (B, 1) in [0, T - 3]
    answer = inputs.gather(1, first + 1)  # (B, 1) the token after the first trigger
    inputs.scatter_(1, first, trigger)
    inputs[:, T - 1] = trigger
    targets = torch.full((B, T), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    targets[:, T - 1 :] = answer
    return inputs, targets
