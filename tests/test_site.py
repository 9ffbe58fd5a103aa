import random
import re
from dataclasses import dataclass, fields

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch_geometric.loader import DataLoader

from sheafgnn.site import (
    ALL_TEXT_PATCH_TYPES,
    EDGE_TYPES,
    NODE_TYPES,
    PATCH_TYPES,
    BPETokenizer,
    ByteTokenizer,
    PatchType,
    SiteBuilder,
    SiteConfig,
    TopicModel,
    build_site,
    rules,
    validate_site,
)
from sheafgnn.site.flat import FLAT_TYPES
from sheafgnn.site.patches import RULES, PatchRule
from sheafgnn.site.schema import GLUE_EDGES, NODE_ATTRIBUTES, config_bases

from .conftest import CODE, PROSE


def test_patch_types():
    assert [p.value for p in PatchType] == [
        "local", "sentence", "syntax", "instruction", "topic", "memory", "retrieval", "workspace", "output"]
    assert NODE_TYPES == ("token",) + PATCH_TYPES
    assert list(RULES) == list(PATCH_TYPES) and all(rule.name == p for p, rule in RULES.items())


def test_the_registry_keeps_the_schema_order():
    """The model's type embeddings and edge-type ids index FLAT_TYPES and GLUE_EDGES, and saved checkpoints
    with them: the patch types' roles give the orders the schema held before the registry."""
    covered = ["local", "sentence", "syntax", "instruction", "topic", "memory", "retrieval"]
    chained = ["local", "sentence", "syntax", "instruction", "workspace"]
    read = ["token", "local", "sentence", "syntax", "instruction", "topic", "memory", "retrieval", "workspace"]
    links = [("topic", "same_topic", "topic"), ("memory", "recurs", "memory"), ("token", "recalls", "retrieval"),
             ("local", "writes", "workspace")]
    cover, chain = [("token", "in", p) for p in covered], [(p, "next", p) for p in chained]
    anchor = [("instruction", "anchors", "local"), ("instruction", "anchors", "sentence")]
    reads = [(p, "reads", "output") for p in read]
    assert EDGE_TYPES == tuple(cover + chain + anchor + links + reads)
    assert GLUE_EDGES == tuple(chain + anchor + links + reads[1:] + [("token", "matches", "output"),
                                                                     ("token", "explores", "output")])
    assert FLAT_TYPES == ("token", *chained, "topic", "memory", "retrieval", "output")
    assert NODE_ATTRIBUTES == {"topic": "topic", "workspace": "register"}


def test_two_types_cannot_share_a_config_field():
    @dataclass
    class Window:
        local_window: int = 3

    class Lines(PatchRule):
        name, config_fields = "lines", Window

    with pytest.raises(TypeError, match="patch type 'lines' declares the field 'local_window' of 'local'"):
        config_bases({**RULES, "lines": Lines()})


def test_site_config_fields_are_the_patch_types_fields(tmp_path):
    """SiteConfig's fields: patch_types, every type's own (the flat keys of before), extra; files keep loading."""
    assert [f.name for f in fields(SiteConfig)] == [
        "patch_types", "local_window", "syntax_max_span", "syntax_max_depth", "instruction_cues", "anchor_scope",
        "topic_links", "topic_model", "memory_min_len", "memory_max_len", "memory_links", "retrieval_key_len",
        "retrieval_links", "workspace_registers", "readout_last", "extra"]
    path = tmp_path / "site.yaml"
    path.write_text("patch_types: [local, memory]\nlocal_window: 5\ninstruction_cues: ['Q:']\nmemory_max_len: 64\n")
    config = SiteConfig.load(path)
    assert (config.patch_types, config.local_window, config.instruction_cues) == (("local", "memory"), 5, ("Q:",))
    assert SiteConfig.from_dict(config.to_dict()) == config and config.to_dict()["instruction_cues"] == ["Q:"]
    for wrong, message in [({"memory_max_len": 65}, "memory_max_len must be at most 64 (got 65)"),
                           ({"anchor_scope": -1}, "anchor_scope must be a non-negative integer (got -1)"),
                           ({"syntax_max_depth": 1.5}, "syntax_max_depth must be a positive integer (got 1.5)")]:
        with pytest.raises(ValueError, match=re.escape(f"SiteConfig: {message}")):
            SiteConfig(**wrong)


@pytest.mark.parametrize("text", [PROSE, CODE])
def test_schema_and_every_type_used(text, full_config):
    data = validate_site(build_site(text, full_config))
    assert set(data.node_types) == set(NODE_TYPES)
    assert set(data.edge_types) == set(EDGE_TYPES)
    n = len(text.encode())
    assert torch.equal(data["token"].x, ByteTokenizer().encode(text))
    assert torch.equal(data["token"].time, torch.arange(n))
    assert torch.equal(data["output"].time, torch.arange(n))
    for p in PATCH_TYPES:
        span = data[p].span
        assert torch.equal(data[p].time, span[:, 1] - 1)
        assert (data[p].time[1:] >= data[p].time[:-1]).all(), f"{p} not in time order"
    if text is PROSE:
        for p in PATCH_TYPES:
            assert data[p].num_nodes > 0, p
        for e in EDGE_TYPES:
            assert data[e].num_edges > 0, e


def test_hand_checked_spans():
    text = "Hi there. (a [b] c) \"q\" x\n"
    data = build_site(text, SiteConfig(patch_types=ALL_TEXT_PATCH_TYPES, local_window=4))
    ids = data["token"].x

    def spans(p):
        return [ByteTokenizer().decode(ids[s:e]) for s, e in data[p].span.tolist()]

    assert spans("sentence") == ["Hi there. "]
    assert sorted(spans("syntax")) == sorted(["[b]", "(a [b] c)", '"q"'])
    assert spans("local") == ["Hi t", "here", ". (a", " [b]", " c) ", '"q" ', "x\n"][:6]
    # words close on the byte after them; "x" is too short
    assert spans("memory") == ["there."]


def test_rules_hand_checked():
    def as_bytes(s):
        return torch.tensor(list(s.encode()), dtype=torch.uint8)

    code = "a\n  b\n    c\n  d\ne\n"
    s, e = rules.indent_blocks(as_bytes(code))
    got = sorted(code[i:j] for i, j in zip(s.tolist(), e.tolist()))
    assert got == sorted(["  b\n    c\n  d\ne", "    c\n  d"])
    s, e = rules.instructions(as_bytes("x\nQ: why?\nok\nUser: hi"), ("Q:", "User:"))
    assert list(zip(s.tolist(), e.tolist())) == [(2, 10)]  # the last line is not closed yet
    s, e, ent = rules.words(as_bytes("cat dog cat cats."), 3, 32)
    assert ent[0] == ent[2] and len(set(ent.tolist())) == 3
    # mismatched and unbalanced brackets pair only what matches
    s, e = rules.brackets(as_bytes(")(a]([x])"), 8)
    assert sorted(zip(s.tolist(), e.tolist())) == [(4, 9), (5, 8)]


def test_retrieval_is_induction_pattern():
    text = "abcXabcY abcZ"
    data = build_site(text, SiteConfig(patch_types=PATCH_TYPES, retrieval_key_len=3, retrieval_links=2))
    ids = data["token"].x
    src, dst = data["token", "recalls", "retrieval"].edge_index
    # retrieval node at the end of the second "abc" recalls "X" (the token after the first)
    pairs = {(ByteTokenizer().decode(ids[data["retrieval"].span[d, 0] : data["retrieval"].span[d, 1]]),
              ByteTokenizer().decode(ids[s : s + 1])) for s, d in zip(src.tolist(), dst.tolist())}
    assert ("abc", "X") in pairs and ("abc", "Y") in pairs


def _subgraph_until(data, t):
    """Nodes with time <= t and the edges among them, as comparable lists."""
    out = {}
    for p in NODE_TYPES:
        keep = data[p].time <= t
        for name in ("x", "span", "topic", "register"):
            if name in data[p]:
                out[(p, name)] = data[p][name][keep].tolist()
    for e in EDGE_TYPES:
        src, dst = data[e].edge_index
        keep = data[e[2]].time[dst] <= t
        out[e] = sorted(zip(src[keep].tolist(), dst[keep].tolist()))
    return out


@pytest.mark.parametrize("text", [PROSE, CODE])
def test_graph_is_causal_under_perturbation(text, full_config):
    rng = random.Random(0)
    suffixes = ["", " The end. (x) ###\n", "\n\n    indented\nQ: more?\n fish cat", "))]]\"\"''\n\n"]
    raw = text.encode()
    for _ in range(12):
        t = rng.randrange(len(raw))
        a, b = rng.sample(suffixes, 2)
        ga = validate_site(build_site(raw[: t + 1] + a.encode(), full_config))
        gb = validate_site(build_site(raw[: t + 1] + b.encode() + raw[t + 1 :], full_config))
        assert _subgraph_until(ga, t) == _subgraph_until(gb, t), f"graph before t={t} depends on the future"


def test_deterministic(full_config):
    a, b = build_site(PROSE, full_config), build_site(PROSE, full_config)
    for key in NODE_TYPES:
        assert torch.equal(a[key].time, b[key].time)
    for key in EDGE_TYPES:
        assert torch.equal(a[key].edge_index, b[key].edge_index)


def test_loader_batch_keeps_all_types(full_config):
    empty_first = build_site("ab", full_config)  # no patches at all
    graphs = [empty_first, build_site(PROSE, full_config), build_site(CODE, full_config)]
    batch = next(iter(DataLoader(graphs, batch_size=3)))
    assert set(batch.node_types) == set(NODE_TYPES)
    assert set(batch.edge_types) == set(EDGE_TYPES)
    validate_site(batch)
    assert batch["token"].num_nodes == sum(g["token"].num_nodes for g in graphs)
    assert batch["memory"].num_nodes == sum(g["memory"].num_nodes for g in graphs)


def test_site_builder_transform(full_config):
    builder = SiteBuilder(full_config)
    assert "SiteBuilder(patch_types=[local" in str(builder)
    from_text = builder(PROSE)
    from_ids = builder(ByteTokenizer().encode(PROSE))
    assert torch.equal(from_text["syntax"].span, from_ids["syntax"].span)


def test_switching_types_off():
    data = validate_site(build_site(PROSE, SiteConfig(patch_types=("local",))))
    assert data["local"].num_nodes > 0 and data["sentence"].num_nodes == 0
    assert data["output"].num_nodes == len(PROSE.encode())
    with pytest.raises(ValueError, match="unknown patch types"):
        SiteConfig(patch_types=("locale",))
    with pytest.raises(ValueError, match="local_window must be a positive integer"):
        SiteConfig(local_window=0)
    assert SiteConfig.from_dict(SiteConfig(local_window=5).to_dict()).local_window == 5


@pytest.mark.parametrize("text", ["", "   \n\t ", b"\xff\xfe\x80 bad \xc3( utf8. \xed\xa0\x80", "é" * 50])
def test_odd_inputs_give_valid_graphs(text, full_config):
    data = validate_site(build_site(text, full_config))
    n = len(text) if isinstance(text, bytes) else len(text.encode())
    assert data["token"].num_nodes == n


def test_bad_arguments():
    with pytest.raises(TypeError, match="expected text"):
        build_site(12345)
    with pytest.raises(TypeError, match="integer tensor"):
        build_site(torch.rand(10))
    with pytest.raises(ValueError, match="1-D"):
        build_site(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"must lie in \[0, 256\)"):
        build_site(torch.tensor([1, 300]))
    with pytest.raises(TypeError, match="SiteConfig"):
        build_site("abc", {"local_window": 4})


def test_validate_site_names_the_problem(full_config):
    data = build_site(PROSE, full_config)
    edge_index = data["local", "next", "local"].edge_index
    data["local", "next", "local"].edge_index = edge_index.flip(0)
    with pytest.raises(ValueError, match=r"\('local', 'next', 'local'\) is not causal: edge 1 -> 0"):
        validate_site(data)
    data = build_site(PROSE, full_config)
    del data["memory", "recurs", "memory"]
    with pytest.raises(ValueError, match="edge type .*recurs.* is missing"):
        validate_site(data)


@pytest.mark.slow
def test_one_million_tokens():
    text = (PROSE + CODE) * (1_000_000 // len((PROSE + CODE).encode()) + 1)
    data = build_site(text[:1_000_000], SiteConfig(patch_types=PATCH_TYPES))
    assert data["token"].num_nodes == 1_000_000
    validate_site(data)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=300), st.integers(min_value=1, max_value=6))
def test_fuzz_arbitrary_bytes(raw, window):
    config = SiteConfig(patch_types=PATCH_TYPES, local_window=window, retrieval_key_len=2, memory_min_len=1)
    data = validate_site(build_site(raw, config))
    assert data["token"].num_nodes == len(raw)


def test_bpe_tokenizer_round_trip(tmp_path):
    tok = BPETokenizer.train([PROSE, CODE] * 5, vocab_size=300)
    path = tmp_path / "bpe.json"
    tok.save(path)
    loaded = BPETokenizer.load(path)
    ids = loaded.encode(PROSE)
    assert loaded.decode(ids) == PROSE
    assert ids.numel() < len(PROSE.encode())
    config = SiteConfig(patch_types=ALL_TEXT_PATCH_TYPES, local_window=4)
    data = validate_site(build_site(ids, config, tokenizer=loaded))
    # byte spans map onto token spans: the first sentence ends where its bytes end
    first = data["sentence"].span[0]
    assert loaded.decode(ids[first[0] : first[1]]).startswith("### Instruction")
    with pytest.raises(ValueError, match="could not load a BPE tokenizer"):
        BPETokenizer.load(tmp_path / "missing.json")


def test_byte_tokenizer_any_bytes():
    tok = ByteTokenizer()
    raw = bytes(range(256))
    assert tok.encode(raw).tolist() == list(range(256))
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.decode(tok.encode(b"\xff")) == "\ufffd"
    with pytest.raises(TypeError, match="expected text as str or bytes"):
        tok.encode(3)
    with pytest.raises(ValueError, match="token ids must be integers"):
        tok.decode([300])


def test_topic_model_save_load(tmp_path, topic_model):
    path = tmp_path / "t.safetensors"
    topic_model.save(path)
    loaded = TopicModel.load(path)
    sentences = ["The cat sat on the mat. ", "def f(x): return x", "fish fish fish. "]
    assert torch.equal(loaded.predict(sentences), topic_model.predict(sentences))
    # a sentence's topic depends on that sentence alone
    assert loaded.predict(sentences)[0] == loaded.predict(sentences[:1])[0]
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="could not load a TopicModel"):
        TopicModel.load(tmp_path / "bad.safetensors")
