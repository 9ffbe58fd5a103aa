"""Streaming generation: sample_next, the TokenStream base, and the Transformers' KV cache against the forward."""

import pytest
import torch
from torch import Tensor

from sheafgnn.baselines import CausalTransformer, TransformerConfig
from sheafgnn.generation import TokenStream, sample_next
from sheafgnn.lm import build_model

V = 32
CHUNKS = {"1": [1], "7": [7], "64": [64], "mix": [1, 7, 64, 3, 1, 100, 2]}


def tiny(window: int | None = None, dtype: torch.dtype = torch.float32, seed: int = 0,
         conv: int = 0) -> CausalTransformer:
    torch.manual_seed(seed)
    config = TransformerConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=2, window=window, conv=conv)
    model = CausalTransformer(config).to(dtype).eval()
    with torch.no_grad():  # larger weights than the init, so the logits differ clearly between positions
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(10)
    return model


def full_logits(model: CausalTransformer, ids: Tensor) -> Tensor:
    with torch.no_grad():
        return model(ids[None])[0]  # (T, V)


def feed_in_chunks(stream: TokenStream, ids: Tensor, sizes: list[int]) -> Tensor:
    out, start, i = [], 0, 0
    while start < ids.numel():
        n = sizes[i % len(sizes)]
        out.append(stream.feed(ids[start : start + n]))
        start, i = start + n, i + 1
    return torch.cat(out)


# ---------------------------------------------------------------------------
# The KV cache against the full forward
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("window", [None, 6, 80], ids=["dense", "local6", "local80"])
@pytest.mark.parametrize("chunks", list(CHUNKS), ids=list(CHUNKS))
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)], ids=["f32", "f64"])
@pytest.mark.parametrize("conv", [0, 3], ids=["plain", "conv3"])
def test_stream_logits_equal_the_forward(window, chunks, dtype, atol, conv):
    model = tiny(window, dtype, conv=conv)
    ids = torch.randint(0, V, (300,), generator=torch.Generator().manual_seed(1))
    stream = model.stream()
    got = feed_in_chunks(stream, ids, CHUNKS[chunks])
    assert got.shape == (300, V) and got.dtype == dtype and stream.num_tokens == [300]
    torch.testing.assert_close(got, full_logits(model, ids), rtol=0, atol=atol)


@pytest.mark.parametrize("window", [None, 5])
def test_a_long_prompt_at_once_and_the_cache_size(window):
    """One 1500-token feed (split internally into pieces); local memory stays O(window), dense grows by doubling."""
    model = tiny(window)
    ids = torch.randint(0, V, (1500,), generator=torch.Generator().manual_seed(2))
    stream = model.stream()
    torch.testing.assert_close(stream.feed(ids), full_logits(model, ids), rtol=0, atol=1e-5)
    size = stream.slot_pos.shape[1]
    if window is None:
        assert size == 2048  # 256 -> 1024 (first piece) -> 2048
    else:
        assert size == window + stream.chunk - 1 and stream.chunk == 64
        assert sorted(stream.slot_pos[0].tolist())[-window:] == list(range(1500 - window, 1500))
    assert all(k.shape[2] == size for k in stream._keys)


@pytest.mark.parametrize("window,conv", [(None, 0), (6, 0), (None, 3), (6, 4)])
def test_a_batch_of_streams_equals_the_streams_one_at_a_time(window, conv):
    model = tiny(window, conv=conv)
    g = torch.Generator().manual_seed(3)
    rounds = [[torch.randint(0, V, (n,), generator=g) for n in lengths]
              for lengths in ([5, 0, 40], [17, 9, 1], [0, 70, 2], [1, 1, 1])]
    batch = model.stream(3)
    outs = [batch.feed(r) for r in rounds]
    assert batch.num_tokens == [23, 80, 44]
    for b in range(3):
        ids = torch.cat([r[b] for r in rounds])
        alone = model.stream()
        got = [alone.feed(r[b]) for r in rounds]
        for o, a, r in zip(outs, got, rounds, strict=True):
            assert o[b].shape == (r[b].numel(), V)
            torch.testing.assert_close(o[b], a, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.cat([o[b] for o in outs]), full_logits(model, ids), rtol=0, atol=1e-5)
    # greedy continuation: the batch's and each stream's alone agree
    greedy = batch.generate(6, top_k=1)
    assert greedy.shape == (3, 6)
    for b in range(3):
        alone = model.stream()
        alone.feed(torch.cat([r[b] for r in rounds]))
        assert torch.equal(alone.generate(6, top_k=1), greedy[b])


def test_sequence_lm_streams_through_its_transformer():
    lm = build_model("local", {"d_model": 32, "n_layers": 1, "n_heads": 2, "window": 4}, V).eval()
    stream = lm.stream(2)
    assert stream.batch_size == 2 and stream.window == 4 and stream.model is lm.net


# ---------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------


def test_sample_next_top_k_and_temperature():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, top_k=1), logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=0.5, top_k=1), logits.argmax(-1))
    top3 = logits.topk(3, dim=-1).indices  # (4, 3)
    g = torch.Generator().manual_seed(1)
    draws = torch.stack([sample_next(logits, temperature=5.0, top_k=3, generator=g) for _ in range(200)], 1)
    assert all(set(draws[b].tolist()) == set(top3[b].tolist()) for b in range(4))  # all 3, nothing else
    assert sample_next(logits, top_k=100).shape == (4,)  # top_k >= V: every id
    peaked = torch.full((1, 50), -1e4)
    peaked[0, 7] = 0.0
    assert sample_next(peaked).item() == 7
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a positive finite number"):
            sample_next(logits, temperature=bad)
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="top_k must be None or an integer >= 1"):
            sample_next(logits, top_k=bad)
    with pytest.raises(ValueError, match=r"logits must have shape \(B, V\)"):
        sample_next(logits[0])


@pytest.mark.parametrize("window", [None, 6])
def test_generate_is_reproducible_with_a_seeded_generator(window):
    model = tiny(window)
    prompt = torch.tensor([1, 2, 3, 4])

    def run(seed: int, batch: int = 1) -> Tensor:
        stream = model.stream(batch)
        stream.feed(prompt if batch == 1 else [prompt] * batch)
        return stream.generate(20, temperature=1.5, top_k=10, generator=torch.Generator().manual_seed(seed))

    a, b = run(0), run(0)
    assert a.shape == (20,) and a.dtype == torch.long and torch.equal(a, b)
    assert not torch.equal(run(0), run(1))
    assert run(0, batch=3).shape == (3, 20)
    # the sampled ids were fed back: the stream's logits are the forward's on prompt + ids
    stream = model.stream()
    stream.feed(prompt)
    ids = torch.cat([step for step in stream.sample(8, generator=torch.Generator().manual_seed(0))])
    assert stream.num_tokens == [12]
    torch.testing.assert_close(stream._last[0], full_logits(model, torch.cat([prompt, ids]))[-1],
                               rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------
# Bad input: clear errors, the stream unchanged
# ---------------------------------------------------------------------------


def test_bad_input_raises_and_leaves_the_stream_usable():
    model = tiny(6)
    stream, batch = model.stream(), model.stream(3)
    with pytest.raises(ValueError, match="have no tokens yet; feed a prompt"):
        stream.sample(3)
    with pytest.raises(ValueError, match=r"stream\(s\) \[1\] have no tokens yet"):
        batch.feed([torch.tensor([1]), torch.tensor([], dtype=torch.long), torch.tensor([2])])
        batch.generate(2)
    bad_feeds = [
        (torch.tensor([[1, 2]]), ValueError, r"ids must be 1-D \(got shape \(1, 2\)\)"),
        (torch.tensor([1.0, 2.0]), TypeError, "must have an integer dtype"),
        (torch.tensor([True]), TypeError, "must have an integer dtype"),
        (torch.tensor([1, V]), ValueError, rf"must lie in \[0, {V}\) \(got values from 1 to {V}\)"),
        (torch.tensor([-1, 3]), ValueError, "got values from -1 to 3"),
        ([torch.tensor([1]), torch.tensor([2])], ValueError, r"expected 1 id tensors, one per stream \(got 2\)"),
        ([[1, 2]], TypeError, r"ids must be a 1-D integer tensor \(got list\)"),
        ("abc", TypeError, "got str"),
    ]
    for ids, error, message in bad_feeds:
        with pytest.raises(error, match=message):
            stream.feed(ids)
        assert stream.num_tokens == [0]
    with pytest.raises(TypeError, match="batch_size 3 takes a sequence of 3 1-D id tensors"):
        batch.feed(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"ids\[2\] must lie in"):
        batch.feed([torch.tensor([1]), torch.tensor([2]), torch.tensor([99])])
    assert batch.num_tokens == [1, 0, 1]
    prompt = torch.tensor([3, 1, 4, 1, 5])
    stream.feed(prompt)
    for kwargs, message in [({"temperature": 0}, "temperature must be"), ({"top_k": 0}, "top_k must be"),
                            ({"max_new_tokens": -1}, "max_new_tokens must be an integer >= 0")]:
        with pytest.raises(ValueError, match=message):
            stream.sample(**{"max_new_tokens": 2, **kwargs})
    assert stream.num_tokens == [5]
    expected = full_logits(model, torch.tensor([3, 1, 4, 1, 5, 9, 2]))[5:]
    torch.testing.assert_close(stream.feed(torch.tensor([9, 2])), expected, rtol=0, atol=1e-5)
    assert stream.generate(0).shape == (0,)
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
        model.stream(0)


class BigramStream(TokenStream):
    """A subclass that implements only _feed: logits = one-hot of (id + 1) mod V."""

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        return [torch.nn.functional.one_hot((x + 1) % self.vocab_size, self.vocab_size).float() * 50 for x in ids]


def test_a_subclass_only_implements_feed():
    stream = BigramStream(2, 10)
    out = stream.feed([torch.tensor([3]), torch.tensor([8, 9])])
    assert [o.shape for o in out] == [(1, 10), (2, 10)]
    assert stream.generate(4).tolist() == [[4, 5, 6, 7], [0, 1, 2, 3]]
    assert stream.num_tokens == [5, 6] and repr(stream) == "BigramStream(batch_size=2, num_tokens=[5, 6])"
    with pytest.raises(NotImplementedError, match="must implement _feed"):
        TokenStream(1, 4).feed(torch.tensor([1]))


class CountingStream(BigramStream):
    """BigramStream that records the ids of every _feed call."""

    def _feed(self, ids: list[Tensor]) -> list[Tensor]:
        self.calls.append([x.tolist() for x in ids])
        return super()._feed(ids)


def test_a_long_feed_runs_in_pieces_of_feed_tokens():
    stream = CountingStream(2, 10)
    stream.calls, stream.feed_tokens = [], 6  # 3 tokens per stream per _feed call
    ids = [torch.arange(8) % 10, torch.tensor([5, 6])]
    out = stream.feed(ids)
    assert stream.calls == [[[0, 1, 2], [5, 6]], [[3, 4, 5], []], [[6, 7], []]]
    assert [o.shape for o in out] == [(8, 10), (2, 10)] and stream.num_tokens == [8, 2]
    whole = BigramStream(2, 10).feed(ids)
    assert all(torch.equal(a, b) for a, b in zip(out, whole))
