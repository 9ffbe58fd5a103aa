"""SiteStream against build_site: the concatenated deltas equal the site of every prefix."""

import random
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode
from torch_geometric.data import HeteroData

from sheafgnn.site import (
    EDGE_TYPES,
    NODE_TYPES,
    PATCH_TYPES,
    BPETokenizer,
    ByteTokenizer,
    SiteConfig,
    SiteStream,
    build_site,
    validate_site,
)

from .conftest import CODE, PROSE


def concat(deltas: list[HeteroData]) -> HeteroData:
    """The site that a list of deltas adds up to (checking each delta's node offsets)."""
    site = deltas[0]
    for delta in deltas[1:]:
        site = extend(site, delta)
    return extend(site, None)


def extend(site: HeteroData, delta: HeteroData | None) -> HeteroData:
    """``site`` (the first delta or a concatenation) followed by ``delta`` (None: no more)."""
    out = HeteroData()
    for t in NODE_TYPES:
        count = site[t].num_nodes
        parts = [site] if delta is None else [site, delta]
        if delta is not None:
            assert delta[t].node_offset == count, f"{t}: node_offset {delta[t].node_offset}, expected {count}"
        assert site[t].get("node_offset", 0) == 0
        for key in site[t].keys():
            if key not in ("node_offset", "num_nodes"):
                out[t][key] = torch.cat([d[t][key] for d in parts])
        out[t].num_nodes = sum(d[t].num_nodes for d in parts)
    for e in EDGE_TYPES:
        out[e].edge_index = torch.cat([d[e].edge_index for d in parts], 1)
    return out


def _by_dst(edge_index: torch.Tensor) -> list[tuple[int, int]]:
    return sorted((d, s) for s, d in edge_index.t().tolist())


def assert_same_site(got: HeteroData, ref: HeteroData, where: str) -> None:
    """Node attributes equal in order (values and dtypes), edges equal as sets."""
    validate_site(got)
    for t in NODE_TYPES:
        assert got[t].num_nodes == ref[t].num_nodes, f"{where}: {t}: {got[t].num_nodes} != {ref[t].num_nodes} nodes"
        for key in ref[t].keys():
            if key == "num_nodes":
                continue
            a, b = got[t][key], ref[t][key]
            assert a.dtype == b.dtype and torch.equal(a, b), f"{where}: {t}.{key}\n{a}\n!=\n{b}"
    for e in EDGE_TYPES:
        a, b = got[e].edge_index, ref[e].edge_index
        assert a.dtype == b.dtype and a.shape[0] == 2
        assert _by_dst(a) == _by_dst(b), f"{where}: {e} edges differ"


def check_stream(ids: torch.Tensor, chunks: list[int], config: SiteConfig, **kwargs) -> SiteStream:
    """Push ``ids`` in ``chunks``; compare with build_site at every push boundary."""
    stream, site, pos = SiteStream(config, **kwargs), None, 0
    for size in chunks:
        delta = stream.push(ids[pos : pos + size])
        site = extend(delta, None) if site is None else extend(site, delta)
        pos = min(pos + size, ids.numel())
        assert stream.num_tokens == pos
        ref = build_site(ids[:pos], config, **kwargs)
        assert_same_site(site, ref, f"prefix {pos}")
        assert stream.num_nodes == {t: ref[t].num_nodes for t in NODE_TYPES}
    assert pos == ids.numel()
    return stream


def random_chunks(n: int, seed: int) -> list[int]:
    rng, chunks = random.Random(seed), []
    while sum(chunks) < n:
        chunks.append(rng.choice([0, 1, 7, 64, rng.randrange(1, 120)]))
    return chunks


@pytest.mark.parametrize("text", [PROSE, CODE], ids=["prose", "code"])
def test_token_by_token_every_prefix(text, full_config):
    ids = ByteTokenizer().encode(text)
    check_stream(ids, [1] * ids.numel(), full_config)


@pytest.mark.parametrize("chunk", [7, 64, "random"])
@pytest.mark.parametrize("text", [PROSE, CODE], ids=["prose", "code"])
def test_chunks_at_every_boundary(text, chunk, full_config):
    ids = ByteTokenizer().encode(text + text[:150])
    chunks = random_chunks(ids.numel(), seed=len(text)) if chunk == "random" else [chunk] * (ids.numel() // chunk + 1)
    check_stream(ids, chunks, full_config)


@pytest.mark.parametrize("config", [
    SiteConfig(patch_types=("sentence", "instruction", "workspace"), local_window=5, readout_last=3),
    SiteConfig(patch_types=("local", "syntax", "memory", "retrieval"), local_window=4, syntax_max_depth=1,
               syntax_max_span=6, memory_max_len=3, memory_links=3, retrieval_links=0, instruction_cues=()),
], ids=["some-types", "tight-limits"])
def test_other_configs(config):
    ids = ByteTokenizer().encode(PROSE + CODE)
    check_stream(ids, random_chunks(ids.numel(), seed=3), config)


def test_multi_byte_tokens(full_config):
    """BPE ids: rules run on the bytes, spans map to the tokens that hold them."""
    tok = BPETokenizer.train([PROSE, CODE] * 5, vocab_size=300)
    ids = tok.encode(PROSE + CODE + "naïve café. «x» (é)\n")
    assert ids.numel() < len((PROSE + CODE).encode())
    check_stream(ids, [1] * 150 + random_chunks(ids.numel() - 150, seed=5), full_config, tokenizer=tok)


_PIECES = [b"(", b")", b"[", b"]", b"{", b"}", b'"', b"`", b"\n", b"\n\n", b"    ", b"  ", b"\t", b" ",
           b". ", b".", b"!", b"?", b"###", b"Q:", b"ab\n", b"cat", b"dog", b"\xff", b"\xc3", b"\xe9", b"3.14",
           b"(x)", b"[]", b'"q"', b"`a`", b"\n  x\n    y\n z\n", b"\n### do\n", b"\nQ: a b.\n"]
_TEXT = st.lists(st.one_of(st.sampled_from(_PIECES), st.sampled_from(_PIECES), st.binary(max_size=3)),
                 max_size=60).map(b"".join)
_FUZZ_CONFIG = SiteConfig(patch_types=PATCH_TYPES, local_window=3, syntax_max_depth=2, syntax_max_span=16,
                          instruction_cues=("###", "Q:", "ab\n"), anchor_scope=6, topic_links=2,
                          memory_min_len=1, memory_max_len=4, memory_links=2,
                          retrieval_key_len=2, retrieval_links=2, workspace_registers=2, readout_last=2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=_TEXT, chunks=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=20))
def test_fuzz_arbitrary_bytes(raw, chunks, topic_model):
    ids = ByteTokenizer().encode(raw)
    chunks = chunks + [ids.numel()]  # the last push takes whatever is left
    check_stream(ids, chunks, _FUZZ_CONFIG, topic_model=topic_model)


def test_bad_input_leaves_the_stream_unchanged(full_config):
    ids = ByteTokenizer().encode(PROSE)
    stream, deltas = SiteStream(full_config), []
    deltas.append(stream.push(ids[:100]))
    before = (stream.num_tokens, dict(stream.num_nodes))
    with pytest.raises(ValueError, match=r"SiteStream.push: token ids must be 1-D, got shape \(2, 3\)"):
        stream.push(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="SiteStream.push: token ids must be an integer tensor, got torch.float32"):
        stream.push(torch.rand(4))
    with pytest.raises(ValueError, match=r"SiteStream.push: token ids must lie in \[0, 256\) \(got min 1, max 300\)"):
        stream.push(torch.tensor([1, 300]))
    with pytest.raises(ValueError, match="must lie in"):
        stream.push(torch.tensor([-1]))
    with pytest.raises(TypeError, match="SiteStream.push: expected a 1-D LongTensor of token ids, got str"):
        stream.push("more text")
    assert (stream.num_tokens, stream.num_nodes) == before
    empty = stream.push(torch.zeros(0, dtype=torch.long))
    assert all(empty[t].num_nodes == 0 and empty[t].node_offset == before[1][t] for t in NODE_TYPES)
    deltas += [empty, stream.push(ids[100:].int())]  # any integer dtype
    assert_same_site(concat(deltas), build_site(ids, full_config), "after bad pushes")
    assert repr(stream).startswith(f"SiteStream(num_tokens={ids.numel()}, patch_types=[local, ")
    with pytest.raises(TypeError, match="SiteConfig"):
        SiteStream({"local_window": 4})
    with pytest.raises(ValueError, match="instruction cue may end with a newline but not hold one"):
        SiteStream(SiteConfig(instruction_cues=("a\nb",)))


class _LargestTensor(TorchFunctionMode):
    """Records the largest tensor that any torch call takes or returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in (*args, *(kwargs or {}).values(), *(out if isinstance(out, (tuple, list)) else (out,))):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


def _traced_pushes(stream: SiteStream, ids: torch.Tensor) -> tuple[int, int, int]:
    """Push ``ids`` one at a time; (Python lines run in sheafgnn.site, largest tensor, topic bytes)."""
    site_dir = str(Path(sys.modules["sheafgnn.site"].__file__).parent)
    lines, topic_bytes = 0, 0
    predict = stream.topic_model.predict

    def spy_predict(texts):
        nonlocal topic_bytes
        topic_bytes += sum(len(t) for t in texts)
        return predict(texts)

    def tracer(frame, event, arg):
        nonlocal lines
        if not frame.f_code.co_filename.startswith(site_dir):
            return None
        if event == "line":
            lines += 1
        return tracer

    stream.topic_model.predict = spy_predict
    mode = _LargestTensor()
    sys.settrace(tracer)
    try:
        with mode:
            for i in range(ids.numel()):
                stream.push(ids[i : i + 1])
    finally:
        sys.settrace(None)
        del stream.topic_model.predict
    return lines, mode.largest, topic_bytes


def test_push_work_does_not_grow_with_context(full_config, topic_model):
    """Pushing the same 64 tokens after 2 and after 34 copies of a text (~23k tokens) runs about
    the same Python lines, touches no tensor larger than the longest patch, and gives the topic
    model only the sentences that closed: a rebuild of the history would fail all three."""
    period = ByteTokenizer().encode(PROSE + CODE)
    results = []
    for copies in (2, 34):  # equal modulo the local window (8): the same windows close
        stream = SiteStream(full_config, topic_model=topic_model)
        for chunk in period.repeat(copies).split(4096):
            stream.push(chunk)
        results.append(_traced_pushes(stream, period[:64]))
        assert stream.num_tokens == period.numel() * copies + 64
    (small_lines, small_tensor, small_topic), (large_lines, large_tensor, large_topic) = results
    print(f"64 pushes after {2 * period.numel()} / {34 * period.numel()} tokens: lines {small_lines} / "
          f"{large_lines}, largest tensor {small_tensor} / {large_tensor}, topic bytes {small_topic} / {large_topic}")
    assert large_lines <= 1.1 * small_lines + 100, (small_lines, large_lines)
    # the largest tensor is the topic model's centroids (4 x 1024), whatever the context
    assert large_tensor == small_tensor <= 4096, (small_tensor, large_tensor)
    assert large_topic == small_topic <= period.numel()  # the sentences that closed, whole


def test_the_work_check_sees_a_rebuild(full_config, topic_model):
    """The check above is not vacuous: a stream that rebuilds the history on each push is caught."""

    class Rebuild(SiteStream):
        def push(self, ids):
            self.history = torch.cat([getattr(self, "history", ids[:0]), ids])
            build_site(self.history, self.config, topic_model=self.topic_model)
            return super().push(ids)

    period = ByteTokenizer().encode(PROSE + CODE)
    stream = Rebuild(full_config, topic_model=topic_model)
    stream.push(period.repeat(20))
    _, largest, topic_bytes = _traced_pushes(stream, period[:2])
    assert largest >= 20 * period.numel() and topic_bytes > 20 * period.numel() // 2
