"""SheafStream: streamed logits equal the full forward's; batches equal single streams; generation."""

import pytest
import torch

from sheafgnn.model import SheafStateLM
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.inference import RowBuffer
from sheafgnn.nn.sheaf import MAP_INITS
from sheafgnn.nn.topology import LearnedTopology
from sheafgnn.site import SiteConfig, build_site
from sheafgnn.site.tokenizer import ByteTokenizer
from sheafgnn.stream import SheafStream

from .conftest import CODE, PROSE, small_model_config


def _model(full_config, seed: int = 0, **kwargs) -> SheafStateLM:
    torch.manual_seed(seed)
    model = SheafStateLM(small_model_config(full_config, **kwargs)).eval()
    with torch.no_grad():  # the sinks, type biases, eps and (map_init identity) the map learner start at zero:
        for name, p in model.named_parameters():  # make every term matter
            if name.endswith(("sink", "type_bias", "eps")) or "map_lin" in name or "map_type_emb" in name:
                p.normal_(0.0, 0.5)
    return model


def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The reference: rebuild the site of the whole prefix and run the full forward."""
    with torch.no_grad():
        return model(build_site(ids, model.config.site_config))


def _streamed(stream, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    return torch.cat([stream.feed(ids[i : i + chunk]) for i in range(0, ids.numel(), chunk)])


@pytest.mark.parametrize("text", [PROSE, CODE], ids=["prose", "code"])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_stream_equals_full_forward(full_config, text, chunk):
    model = _model(full_config)
    ids = torch.tensor(list(text.encode()))
    streamed = _streamed(model.stream(), ids, chunk)
    assert streamed.shape == (ids.numel(), model.config.vocab_size)
    torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shared", [False, True])
def test_stream_equals_full_forward_with_token_residual(full_config, shared):
    model = _model(full_config, token_residual=True, shared_ssm=shared, shared_experts=shared, glue_gate=shared)
    ids = torch.tensor(list((PROSE + CODE).encode()))[:200]
    for chunk in (1, 13):
        streamed = _streamed(model.stream(), ids, chunk)
        torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_the_default_site_streams_as_it_forwards(full_config):
    """The default's own site and proposals (workspace and output patches, no random proposals)."""
    model = _model(full_config, site=SiteConfig().to_dict(), topology={"random_proposals": 0})
    assert model.config.site == SiteConfig()
    ids = torch.tensor(list((PROSE + CODE).encode()))[:300]
    for chunk in (1, 13):
        streamed = _streamed(model.stream(), ids, chunk)
        torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_stream_equals_full_forward_without_projections(full_config):
    """The pool and the broadcast without their linears (``gluing.projections`` false) stream as they forward."""
    model = _model(full_config, gluing={"projections": False})
    assert not any(name.startswith(("pool.", "broadcast.")) for b in model.blocks for name, _ in b.named_parameters())
    ids = torch.tensor(list((PROSE + CODE).encode()))[:200]
    for chunk in (1, 13):
        streamed = _streamed(model.stream(), ids, chunk)
        torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk", [1, 13])
def test_stream_equals_full_forward_with_shared_experts_and_gate(full_config, chunk):
    model = _model(full_config, shared_experts=True, glue_gate=True)
    ids = torch.tensor(list((PROSE + CODE).encode()))[:200]
    streamed = _streamed(model.stream(), ids, chunk)
    torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("map_kind,num_experts,block_scorer,block_summary,sink_threshold",
                         [("orthogonal", 2, False, "mean", False), ("diag", 2, True, "mean", False),
                          ("general", 1, False, "mean", False), ("diag", 1, False, "bounds", False),
                          ("diag", 1, True, "bounds", False), ("diag", 1, False, "mean", True),
                          ("identity", 1, False, "mean", False)])
def test_stream_equals_full_forward_every_map_kind(full_config, map_kind, num_experts, block_scorer, block_summary,
                                                   sink_threshold):
    model = _model(full_config, map_kind=map_kind, num_experts=num_experts, proposal_block=4, content_blocks=3,
                   block_scorer=block_scorer, block_summary=block_summary, sink_threshold=sink_threshold)
    ids = torch.tensor(list((PROSE + CODE).encode()))[:300]
    streamed = _streamed(model.stream(), ids, 13)
    torch.testing.assert_close(streamed, _full_logits(model, ids), atol=1e-4, rtol=1e-4)


# Per map kind, a model with more of the options on: in float64 the stream and the full forward differ by the
# order of their sums only (the chunked scan against the steps), ~1e-14 of the logits.
# diag and orthogonal glue into the outputs (the earlier default, with its pool and broadcast linears), general and
# identity into the tokens (today's).
OUTPUTS = {"token_residual": False, "gluing": {"projections": True}}
FLOAT64_MODELS = {"diag": dict(num_experts=2, block_scorer=True, block_summary="bounds", shared_ssm=False,
                               shared_experts=False, **OUTPUTS),
                  "orthogonal": dict(sink_threshold=True, shared_experts=True, glue_gate=True, **OUTPUTS),
                  "general": dict(num_experts=2, block_summary="mean", shared_ssm=False),
                  "identity": dict(token_residual=True, shared_ssm=True, shared_experts=True)}


@pytest.mark.parametrize("kernels", [pytest.param("1", marks=pytest.mark.needs("step_kernels"), id="kernels"),
                                     pytest.param("0", id="pytorch")])
@pytest.mark.parametrize("map_kind", sorted(FLOAT64_MODELS))
def test_stream_equals_full_forward_in_float64(monkeypatch, full_config, map_kind, kernels):
    """Streamed logits (a token at a time, pieces of 7 and 64) equal the full forward's to 1e-10 in float64, with
    the C++ step kernels and without them (SHEAFGNN_CPU_KERNELS=0: every step runs its PyTorch reference)."""
    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", kernels)
    assert (cpu_kernels.stream_pools() is None) == (kernels == "0")
    model = _model(full_config, map_kind=map_kind, proposal_block=4, content_blocks=3,
                   **FLOAT64_MODELS[map_kind]).double()
    ids = torch.tensor(list((PROSE + CODE).encode()))[:300]
    full = _full_logits(model, ids)
    for chunk in (1, 7, 64):
        torch.testing.assert_close(_streamed(model.stream(), ids, chunk), full, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kernels", [pytest.param("1", marks=pytest.mark.needs("step_kernels"), id="kernels"),
                                     pytest.param("0", id="pytorch")])
@pytest.mark.parametrize("map_init", MAP_INITS)
def test_stream_equals_full_forward_from_either_map_start(monkeypatch, full_config, map_init, kernels):
    """Diag maps from either start (gluing.map_init: I + tanh(h), or tanh(h)), their learner moved away from its
    start so that the offset and the learned part both count: the stream equals the full forward in float64, with
    the glue_diag kernel and without it."""
    monkeypatch.setenv("SHEAFGNN_CPU_KERNELS", kernels)
    model = _model(full_config, proposal_block=4, content_blocks=3, gluing={"map_init": map_init}).double()
    ids = torch.tensor(list((PROSE + CODE).encode()))[:300]
    full = _full_logits(model, ids)
    for chunk in (1, 7):
        torch.testing.assert_close(_streamed(model.stream(), ids, chunk), full, atol=1e-10, rtol=0)


@pytest.mark.needs("step_kernels")
@pytest.mark.parametrize("block_summary,sink_threshold", [("mean", False), ("bounds", True)])
def test_compete_outputs_kernel_equals_the_reference(monkeypatch, full_config, block_summary, sink_threshold):
    """Every output competition of a batch of streams (prompts of different lengths, fed in pieces, then
    generated tokens): the kernel keeps the candidates that the PyTorch composition keeps, with the same weights."""
    model = _model(full_config, proposal_block=4, content_blocks=3, block_summary=block_summary,
                   sink_threshold=sink_threshold)
    checked = []

    compete_outputs = LearnedTopology.compete_outputs

    def both(topology, query, block_query, sink, delta, cache):
        kept = compete_outputs(topology, query, block_query, sink, delta, cache)
        reference = topology.compete_outputs_reference(query, block_query, sink, delta, cache)
        assert all(torch.equal(a, b) for a, b in zip(kept[:3], reference[:3]))  # sources, destinations, types
        torch.testing.assert_close(kept[3], reference[3])
        checked.append(cache.block_key.size)  # content blocks cached so far
        return kept

    monkeypatch.setattr(LearnedTopology, "compete_outputs", both)
    ids = torch.tensor(list((PROSE + CODE).encode()))
    stream = model.stream(batch_size=2)
    stream.feed([ids[:90], ids[:41]])
    stream.feed([ids[90:97], ids[41:42]])
    stream.generate(5, generator=torch.Generator().manual_seed(0))
    assert len(checked) == 7 * len(model.blocks) and min(checked) > 0



@pytest.mark.needs("step_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_queries_and_keys_kernel_equals_the_reference(monkeypatch, full_config, dtype):
    """The topology's queries and keys of every delta of a batch of streams (a first feed of a few tokens, from
    position 0; a prompt; pieces; generated tokens): the kernel gives the PyTorch composition's."""
    model = _model(full_config).to(dtype)
    kernel_calls = []

    queries_and_keys = LearnedTopology.queries_and_keys

    def both(topology, h, delta, cache):
        kept = queries_and_keys(topology, h, delta, cache)
        reference = topology.queries_and_keys_reference(h, delta, cache)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(kept, reference, **tol)
        kernel_calls.append(h.size(0) <= cpu_kernels.STEP_ROWS * delta.num_streams)
        return kept

    monkeypatch.setattr(LearnedTopology, "queries_and_keys", both)
    ids = torch.tensor(list((PROSE + CODE).encode()))
    stream = model.stream(batch_size=2)
    for a, b in ((0, 3), (3, 90), (90, 97)):
        stream.feed([ids[a:b], ids[a // 3 : b // 3]])
    stream.generate(5, generator=torch.Generator().manual_seed(0))
    # the kernel: the first feed and the 5 generated tokens; the prompt and the last piece (with its patches, over
    # STEP_ROWS rows a stream) run the reference only
    assert kernel_calls == [True] * 2 + [False] * 4 + [True] * 10

def test_stream_of_the_ssm_ablation(full_config):
    model = _model(full_config, gluing=False)
    ids = torch.tensor(list(CODE.encode()))
    torch.testing.assert_close(_streamed(model.stream(), ids, 5), _full_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_batch_of_streams_equals_streams_one_at_a_time(full_config):
    model = _model(full_config)
    texts = [torch.tensor(list(t.encode()))[:n] for t, n in ((PROSE, 150), (CODE, 90), (PROSE[40:], 200))]
    batch = model.stream(batch_size=3)
    fed = [[] for _ in texts]
    # Streams advance by different amounts; sizes of 1 at steps 3 and 6 feed one token to every stream
    # (generation: one query per stream), the last steps one token to all streams but one.
    steps = [[size + b * (step % 3) for b in range(3)] for step, size in enumerate((17, 1, 40, 1, 64, 3, 1, 0))]
    steps += [[int(b != k) for b in range(3)] for k in range(3)] + [[200] * 3]
    for sizes in steps:
        chunks = [t[sum(len(c) for c in f) :][:size] for size, t, f in zip(sizes, texts, fed)]
        for b, logits in enumerate(batch.feed(chunks)):
            assert logits.shape == (chunks[b].numel(), model.config.vocab_size)
            fed[b].append(logits)
    for t, f in zip(texts, fed):
        single = _streamed(model.stream(), t, 11)
        torch.testing.assert_close(torch.cat(f), single, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(single, _full_logits(model, t), atol=1e-4, rtol=1e-4)


def test_generate_follows_the_rebuilt_model(full_config):
    """generate() samples through the stream; the logits along what it produced equal the rebuilt forward's."""
    model = _model(full_config)
    prompt = torch.tensor(list(b"The cat sat on the mat. "))
    out = model.generate(prompt, max_new_tokens=20, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (prompt.numel() + 20,) and torch.equal(out[: prompt.numel()], prompt)
    again = model.generate(prompt, max_new_tokens=20, top_k=5, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    stream = model.stream()
    torch.testing.assert_close(_streamed(stream, out, 1), _full_logits(model, out), atol=1e-4, rtol=1e-4)
    greedy = model.generate(prompt, max_new_tokens=8, top_k=1)
    for t in range(prompt.numel(), greedy.numel()):  # top-k 1 is the rebuilt model's argmax
        assert int(greedy[t]) == int(_full_logits(model, greedy[:t])[-1].argmax())
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.generate(torch.zeros(0, dtype=torch.long), 3)


def test_stream_refuses_the_random_score_ablation(full_config):
    model = _model(full_config)
    model.blocks[0].topology.random_scores = True
    with pytest.raises(ValueError, match="not streamable"):
        model.stream()


def test_stream_refuses_a_tokenizer_smaller_than_the_vocabulary(full_config):
    """The sites read every id the model may sample: a tokenizer that knows fewer is refused up front."""
    class Small(ByteTokenizer):
        vocab_size = 100

    with pytest.raises(ValueError, match="knows 100 ids"):
        SheafStream(_model(full_config), tokenizer=Small())


def test_bad_feed_loses_nothing(full_config):
    model = _model(full_config)
    ids = torch.tensor(list(PROSE.encode()))[:60]
    stream = model.stream()
    first = stream.feed(ids[:30])
    for bad in (ids.view(2, 30), ids.float(), torch.tensor([300])):
        with pytest.raises((ValueError, TypeError)):
            stream.feed(bad)
    rest = stream.feed(ids[30:])
    torch.testing.assert_close(torch.cat([first, rest]), _full_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_a_long_feed_split_into_pieces_equals_the_forward(full_config):
    model = _model(full_config)
    ids = torch.tensor(list(PROSE.encode()))
    stream = model.stream(batch_size=2)
    stream.feed_tokens = 46  # 23 tokens per stream per piece
    logits = stream.feed([ids, ids[:50]])
    torch.testing.assert_close(logits[0], _full_logits(model, ids), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], _full_logits(model, ids[:50]), atol=1e-4, rtol=1e-4)


def test_row_buffer_grows_and_keeps_its_rows():
    """RowBuffer: extend returns the first new row, growth (past the 16 initial rows, and by more than a
    doubling) keeps every row written, write fills the rows it is given."""
    buffer = RowBuffer((3,), torch.float32)
    rows = torch.arange(60, dtype=torch.float32).view(20, 3)
    assert buffer.extend(5) == 0
    buffer.write(0, rows[:5])
    assert buffer.extend(15) == 5  # 20 rows: past the initial 16
    buffer.write(5, rows[5:])
    assert buffer.extend(100) == 20  # more than a doubling at once
    buffer.write(20, torch.ones(100, 3))
    assert buffer.size == 120 and buffer.data.shape == (120, 3)
    assert torch.equal(buffer.data[:20], rows) and torch.equal(buffer.data[20:], torch.ones(100, 3))
    buffer.grow_to(50)  # already more: unchanged
    assert buffer.size == 120
