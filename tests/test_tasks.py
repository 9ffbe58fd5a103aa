import pytest
import torch

from sheafgnn.experiments.tasks import IGNORE_INDEX, induction_heads, mqar, scattered_recall, selective_copying


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# MQAR
# ---------------------------------------------------------------------------


def check_mqar_row(x: list[int], y: list[int], num_pairs: int, vocab_size: int) -> None:
    """Brute-force scan of one row against the MQAR definition."""
    ctx, half = 2 * num_pairs, vocab_size // 2
    bound = {}
    for i in range(num_pairs):
        key, value = x[2 * i], x[2 * i + 1]
        assert 1 <= key < half and half <= value < vocab_size
        assert key not in bound, "keys must be distinct"
        bound[key] = value
    assert len(set(bound.values())) == num_pairs, "values must be distinct"
    scored = [t for t in range(len(x)) if y[t] != IGNORE_INDEX]
    assert len(scored) == num_pairs
    assert all(t >= ctx and (t - ctx) % 2 == 0 for t in scored)
    assert sorted(x[t] for t in scored) == sorted(bound), "every key queried exactly once"
    for t in scored:
        assert y[t] == bound[x[t]]


@pytest.mark.parametrize("random_non_queries", [False, True])
@pytest.mark.parametrize("seq_len,num_pairs,vocab_size", [(16, 2, 12), (17, 4, 10), (64, 8, 40), (256, 16, 512)])
def test_mqar_labels_brute_force(seq_len, num_pairs, vocab_size, random_non_queries):
    x, y = mqar(8, seq_len, num_pairs, vocab_size, gen(0), random_non_queries=random_non_queries)
    assert x.shape == y.shape == (8, seq_len) and x.dtype == y.dtype == torch.long
    assert x.min() >= 0 and x.max() < vocab_size
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        check_mqar_row(xr, yr, num_pairs, vocab_size)
    if not random_non_queries:  # blanks are 0 exactly where nothing was placed
        placed = torch.zeros_like(x, dtype=torch.bool)
        placed[:, : 2 * num_pairs] = True
        placed |= y != IGNORE_INDEX
        assert ((x == 0) == ~placed).all()


def test_mqar_zoology_example_layout():
    # Zoology's docstring example: vocab 12, 2 pairs, length 16, no noise.
    x, y = mqar(1, 16, 2, 12, gen(3), random_non_queries=False)
    k1, v1, k2, v2 = x[0, :4].tolist()
    assert {k1, k2} <= set(range(1, 6)) and {v1, v2} <= set(range(6, 12))
    scored = (y[0] != IGNORE_INDEX).nonzero().flatten().tolist()
    assert all(t in (4, 6, 8, 10, 12, 14) for t in scored)
    assert {(x[0, t].item(), y[0, t].item()) for t in scored} == {(k1, v1), (k2, v2)}


def test_mqar_power_law_puts_queries_early():
    def mean_query_pos(power_a: float) -> float:
        _, y = mqar(500, 128, 4, 64, gen(1), power_a=power_a)
        return (y != IGNORE_INDEX).nonzero()[:, 1].float().mean().item()

    early, uniform = mean_query_pos(0.01), mean_query_pos(1.0)
    assert early < uniform - 10
    assert abs(uniform - (8 + 2 * (60 - 1) / 2)) < 3  # uniform gaps in [0, 60)


@pytest.mark.parametrize("task,args", [(mqar, (4, 64, 8, 128)), (selective_copying, (4, 64, 8, 16)),
                                       (induction_heads, (4, 256, 16)), (scattered_recall, (4, 64, 8, 128))])
def test_tasks_are_deterministic_per_generator(task, args):
    a, b, c = task(*args, gen(7)), task(*args, gen(7)), task(*args, gen(8))
    assert all(torch.equal(u, v) for u, v in zip(a, b, strict=True))
    assert not torch.equal(a[0], c[0])
    x, y = task(*args)  # the global generator works too
    assert x.shape == y.shape == a[0].shape


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_len=31, num_pairs=8), "seq_len must be at least 4 \\* num_pairs"),
        (dict(seq_len=64, num_pairs=40), "seq_len must be at least 4 \\* num_pairs"),
        (dict(num_pairs=8, vocab_size=17), "vocab_size too small"),
        (dict(num_pairs=0), "num_pairs must be >= 1"),
        (dict(seq_len=0), "seq_len must be >= 1"),
        (dict(power_a=0.0), "power_a must be > 0"),
    ],
)
def test_mqar_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mqar(2, **kwargs)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        mqar(0)


def test_mqar_smallest_valid_vocab():
    x, y = mqar(3, 32, 8, 18, gen(0))  # keys need vocab_size // 2 - 1 >= 8
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        check_mqar_row(xr, yr, 8, 18)


# ---------------------------------------------------------------------------
# Selective copying
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,num_tokens,vocab_size", [(10, 3, 8), (32, 16, 16), (33, 4, 3), (4096, 16, 16)])
def test_selective_copying_brute_force(seq_len, num_tokens, vocab_size):
    x, y = selective_copying(4, seq_len, num_tokens, vocab_size, gen(0))
    assert x.shape == y.shape == (4, seq_len) and x.dtype == y.dtype == torch.long
    marker, out = vocab_size - 1, seq_len - num_tokens
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        data = [tok for tok in xr[:out] if tok != 0]  # scan the data region left to right
        assert len(data) == num_tokens and all(1 <= tok <= vocab_size - 2 for tok in data)
        assert xr[out:] == [marker] * num_tokens
        assert yr[:out] == [IGNORE_INDEX] * out
        assert yr[out:] == data


@pytest.mark.parametrize(
    "args,match",
    [
        ((2, 15, 8, 16), "seq_len must be at least 2 \\* num_tokens"),
        ((2, 16, 8, 2), "vocab_size must be >= 3"),
        ((2, 16, 0, 16), "num_tokens must be >= 1"),
        ((0, 16, 4, 16), "batch_size must be >= 1"),
    ],
)
def test_selective_copying_validation(args, match):
    with pytest.raises(ValueError, match=match):
        selective_copying(*args)


# ---------------------------------------------------------------------------
# Induction heads
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len", [3, 256, 1024, 4096, 16384])
def test_induction_heads_brute_force(seq_len):
    vocab_size = 16
    x, y = induction_heads(4, seq_len, vocab_size, gen(0))
    assert x.shape == y.shape == (4, seq_len) and x.dtype == y.dtype == torch.long
    trigger = vocab_size - 1
    for xr, yr in zip(x.tolist(), y.tolist(), strict=True):
        hits = [t for t, tok in enumerate(xr) if tok == trigger]
        assert len(hits) == 2 and hits[1] == seq_len - 1 and hits[0] <= seq_len - 3
        assert all(0 <= tok < trigger for t, tok in enumerate(xr) if t not in hits)
        assert yr[:-1] == [IGNORE_INDEX] * (seq_len - 1)
        assert yr[-1] == xr[hits[0] + 1]


def test_induction_heads_hand_example():
    # vocab_size=2: the only non-trigger token is 0, so the row is fully determined
    # up to the trigger position.
    x, y = induction_heads(1, 3, 2, gen(0))
    assert x.tolist() == [[1, 0, 1]] and y.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 0]]


def test_induction_heads_trigger_position_covers_range():
    x, _ = induction_heads(2000, 8, 16, gen(2))
    first = (x == 15).int().argmax(dim=1)
    assert set(first.tolist()) == set(range(6))


@pytest.mark.parametrize(
    "args,match",
    [((2, 2, 16), "seq_len must be >= 3"), ((2, 8, 1), "vocab_size must be >= 2"), ((0, 8, 16), "batch_size")],
)
def test_induction_heads_validation(args, match):
    with pytest.raises(ValueError, match=match):
        induction_heads(*args)


# ---------------------------------------------------------------------------
# Scattered recall
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("seq_len,num_pairs,vocab_size", [(48, 4, 64), (256, 16, 1024), (24, 8, 18), (3, 1, 4)])
def test_scattered_recall_brute_force(seq_len, num_pairs, vocab_size):
    """Every row: distinct keys and values in their halves; each key occurs twice, at its bind (right before its
    target value) and at its query, so no query has a second candidate bind; exactly num_pairs scored
    positions."""
    x, y = scattered_recall(32, seq_len, num_pairs, vocab_size, gen(0))
    assert x.shape == y.shape == (32, seq_len) and x.dtype == y.dtype == torch.long
    assert 0 <= int(x.min()) and int(x.max()) < vocab_size
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        queries = [t for t, v in enumerate(row_y) if v != IGNORE_INDEX]
        assert len(queries) == num_pairs
        keys = [row_x[t] for t in queries]
        values = [row_y[t] for t in queries]
        assert len(set(keys)) == num_pairs and all(1 <= k < vocab_size // 2 for k in keys)
        assert len(set(values)) == num_pairs and all(vocab_size // 2 <= v < vocab_size for v in values)
        for t, key, value in zip(queries, keys, values):
            occurrences = [s for s in range(seq_len) if row_x[s] == key]
            assert len(occurrences) == 2 and occurrences[1] == t, (row_x, t)  # no filler repeats a key
            assert row_x[occurrences[0] + 1] == value and occurrences[0] + 1 not in queries  # its bind k v


def test_scattered_recall_fillers_are_uniform_over_the_tokens_that_are_not_keys():
    """Each filler's rank among its row's non-key tokens is uniform: every one of the V - P is drawn about as
    often (the keys change from row to row, so a slip in the skipping would bunch ranks up)."""
    vocab_size, num_pairs = 12, 5
    x, y = scattered_recall(4000, 40, num_pairs, vocab_size, gen(3))
    counts = torch.zeros(vocab_size - num_pairs)
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        keys = {v for v, target in zip(row_x, row_y) if target != IGNORE_INDEX}
        rank = {token: r for r, token in enumerate(t for t in range(vocab_size) if t not in keys)}
        bound = {row_x.index(key) + 1 for key in keys}  # each bind's value
        filler = [t for i, t in enumerate(row_x) if t not in keys and i not in bound]
        counts += torch.bincount(torch.tensor([rank[t] for t in filler]), minlength=len(counts))
    assert (counts - counts.mean()).abs().max() < 0.05 * counts.mean()


def test_scattered_recall_scatters_binds_and_query_distances():
    """Unlike MQAR, binds are not all at the start, and a query may come right after its bind or far later."""
    def binds_and_distances(x, y):
        last_bind, distances = [], []
        for row_x, row_y in zip(x.tolist(), y.tolist()):
            values = [(t, v) for t, v in enumerate(row_y) if v != IGNORE_INDEX]
            value_at = [min(s for s in range(1, t) if row_x[s - 1 : s + 1] == [row_x[t], v])
                        for t, v in values]  # where each value was bound after its key
            last_bind.append(max(value_at) - 1)
            distances += [t - s for (t, _), s in zip(values, value_at)]
        return last_bind, distances

    last_bind, distances = binds_and_distances(*scattered_recall(50, 256, 16, 1024, gen(1)))
    mqar_last_bind, _ = binds_and_distances(*mqar(50, 256, 16, 1024, gen(1)))
    assert max(mqar_last_bind) == 30 and sum(last_bind) / len(last_bind) > 128  # MQAR binds at 0..31 only
    assert min(distances) == 1 and max(distances) > 128  # a query right after its value, and far ones


def test_scattered_recall_validation():
    with pytest.raises(ValueError, match="at least 3 \\* num_pairs"):
        scattered_recall(2, 23, 8, 64)
    with pytest.raises(ValueError, match="vocab_size too small"):
        scattered_recall(2, 64, 8, 17)
