"""The paper's simulation: relation counts and hops, the synthetic generator and its G*, the table, the scaling run."""

import json
from collections import deque

import numpy as np
import pytest
import torch

from sheafgnn import relations as R
from sheafgnn.experiments import simulation as S
from sheafgnn.experiments import synthetic as Y
from sheafgnn.site import SiteConfig, build_site, validate_site


@pytest.fixture(scope="module")
def seq() -> Y.SyntheticSequence:
    return Y.generate(6000, seed=3)


def _chain_graph(n: int) -> R.RelationGraph:
    """Tokens 0..n-1 (nodes 0..n-1) on a stream chain; token t reads output t (node n + t)."""
    t = np.arange(n)
    edges = np.concatenate([np.stack([t[:-1], t[1:]]), np.stack([t, t + n])], 1)
    return R.RelationGraph(2 * n, edges, t, t + n)


def _reference_relations(graph: R.RelationGraph, hops: int) -> set[tuple[int, int]]:
    """Breadth-first search backwards from every read node: the obviously correct relation set."""
    incoming: dict[int, list[int]] = {}
    for s, d in graph.edge_index.T.tolist():
        incoming.setdefault(d, []).append(s)
    token_of = {int(node): i for i, node in enumerate(graph.token_node)}
    pairs = set()
    for t in range(graph.num_tokens - 1):
        dist = {int(graph.read_node[t]): 0}
        queue = deque(dist)
        while queue:
            node = queue.popleft()
            if dist[node] == hops:
                continue
            for prev in incoming.get(node, []):
                if prev not in dist:
                    dist[prev] = dist[node] + 1
                    queue.append(prev)
        pairs |= {(token_of[v], t + 1) for v in dist if v in token_of and token_of[v] <= t}
    return pairs


# ------------------------------------------------------------------ relation counts


@pytest.mark.parametrize("n", [1, 2, 3, 7, 20])
def test_dense_count_is_n_choose_2_by_brute_force(n):
    brute = sum(1 for j in range(n) for i in range(j))
    assert R.dense_relations(n) == n * (n - 1) // 2 == brute
    relations, _, _ = R.relation_stats(R.attention_graph(n), hops=1)
    assert relations == brute


@pytest.mark.parametrize("n,w", [(1, 3), (5, 8), (9, 8), (20, 1), (20, 3), (40, 8)])
def test_window_count_by_brute_force(n, w):
    brute = sum(1 for j in range(n) for i in range(j) if j - i <= w)
    assert R.window_relations(n, w) == brute
    relations, _, _ = R.relation_stats(R.attention_graph(n, window=w), hops=1)
    assert relations == brute


def test_dense_score_at_paper_length_is_analytic():
    seq = Y.generate(32768, seed=0)
    row = Y.score_dense(seq)
    assert row["edges"] == row["relations"] == 536_854_528
    assert row["coverage"] == 1.0
    assert row["waste"] == pytest.approx(1 - seq.src.numel() / 536_854_528)


@pytest.mark.parametrize("hops", [1, 2, 3, 5])
def test_hops_on_a_chain(hops):
    # token i reaches output j - 1 in (j - 1 - i) stream steps + 1 read: relation iff j - i <= hops
    n = 12
    graph = _chain_graph(n)
    src = np.array([0, 3, 5, 5, 0])
    dst = np.array([1, 5, 9, 11, 11])  # lags 1, 2, 4, 6, 11
    relations, realised, per_dst = R.relation_stats(graph, hops, src, dst)
    assert relations == R.window_relations(n, hops)
    assert realised.tolist() == [bool(d - s <= hops) for s, d in zip(src, dst)]
    assert per_dst.tolist() == [0] + [min(j, hops) for j in range(1, n)]


def test_coverage_and_waste_on_a_hand_checked_graph():
    # tokens 0..3 (nodes 0-3), outputs 0..3 (nodes 4-7), one patch P (node 8) over tokens 0, 1,
    # read by output 2. Relations (H = 2): (0,1) (1,2) (2,3) via token reads; (0,3) (1,3) via P.
    edges = np.array([[0, 1, 2, 3, 0, 1, 8],
                      [4, 5, 6, 7, 8, 8, 6]])
    graph = R.RelationGraph(9, edges, np.arange(4), np.arange(4) + 4, {"hand": 7})
    src, dst, typ = np.array([0, 0, 1]), np.array([1, 2, 3]), np.array([0, 1, 2])
    row = R.score_graph(graph, 2, src, dst, typ, Y.DEP_TYPES)
    assert row["relations"] == 5
    assert row["realised"] == 2  # (0, 1) and (1, 3); (0, 2) needs output 1 to see token 0
    assert row["coverage"] == pytest.approx(2 / 3)
    assert row["waste"] == pytest.approx(1 - 2 / 5)
    assert row["coverage_by_type"] == {"local": 1.0, "anchor": 0.0, "entity": 1.0}
    assert row["edges"] == 7
    one_hop = R.score_graph(graph, 1, src, dst, typ, Y.DEP_TYPES)
    assert one_hop["relations"] == 3 and one_hop["realised"] == 1


def test_relation_stats_match_breadth_first_search_on_a_site():
    small = Y.generate(400, seed=1, config=Y.GeneratorConfig(section_len=100))
    graph = R.site_graph(build_site(small.ids, SiteConfig(local_window=8)))
    for hops in (1, 2, 3):
        expected = _reference_relations(graph, hops)
        src, dst = small.src.numpy(), small.dst.numpy()
        relations, realised, _ = R.relation_stats(graph, hops, src, dst, chunk=37)
        assert relations == len(expected)
        assert realised.tolist() == [(s, d) in expected for s, d in zip(src.tolist(), dst.tolist())]


def test_chunking_does_not_change_the_result(seq):
    graph = R.site_graph(build_site(seq.ids))
    src, dst = seq.src.numpy(), seq.dst.numpy()
    a = R.relation_stats(graph, 3, src, dst, chunk=1 << 14)
    b = R.relation_stats(graph, 3, src, dst, chunk=333)
    assert a[0] == b[0]
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_site_graph_has_every_edge_and_the_stream(seq):
    data = build_site(seq.ids)
    graph = R.site_graph(data)
    n = seq.ids.numel()
    assert graph.num_edges == sum(data[e].edge_index.size(1) for e in data.edge_types) + n - 1
    assert graph.edges_by_type["token__stream__token"] == n - 1
    assert R.site_graph(data, stream=False).num_edges == graph.num_edges - (n - 1)
    assert np.array_equal(graph.token_node, np.arange(n))  # tokens come first


# ------------------------------------------------------------------ the generator


def test_generator_is_deterministic_by_seed():
    a, b, c = Y.generate(3000, seed=7), Y.generate(3000, seed=7), Y.generate(3000, seed=8)
    for name in ("ids", "kind", "choice", "key_pos", "src", "dst", "dep_type"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.ids, c.ids)
    other_language = Y.generate(3000, seed=7, config=Y.GeneratorConfig(language_seed=1))
    assert not torch.equal(a.ids, other_language.ids)


def test_dependency_graph_is_well_formed(seq):
    n = seq.ids.numel()
    assert seq.ids.numel() == seq.kind.numel() == n
    assert bool((seq.src < seq.dst).all()) and int(seq.src.min()) >= 0 and int(seq.dst.max()) < n
    keys = seq.src * n + seq.dst
    assert keys.unique().numel() == keys.numel()  # distinct pairs
    body = seq.kind >= Y.Kind.LETTER
    local = seq.dep_type == 0
    # every body token has exactly its two predecessors as local sources, nothing else has any
    assert torch.equal(torch.bincount(seq.dst[local], minlength=n), 2 * body.long())
    assert bool((seq.dst[local] - seq.src[local] <= 2).all())
    # anchors: the anchored tokens, from the section's key; entities: the repeated values
    anchor, entity = seq.dep_type == 1, seq.dep_type == 2
    assert torch.equal(seq.dst[anchor], torch.nonzero(seq.kind == Y.Kind.ANCHORED).squeeze(1))
    assert torch.equal(seq.src[anchor], seq.key_pos[seq.dst[anchor]])
    assert bool((seq.kind[seq.src[anchor]] == Y.Kind.KEY).all())
    assert torch.equal(seq.dst[entity], torch.nonzero(seq.kind == Y.Kind.VALUE_COPY).squeeze(1))
    assert bool((seq.kind[seq.src[entity]] >= Y.Kind.VALUE_NEW).all())


def _sources(seq: Y.SyntheticSequence, dep_type: int) -> torch.Tensor:
    """(n,) the source of each token's dependency of one type (-1 where none)."""
    out = torch.full((seq.ids.numel(),), -1, dtype=torch.long)
    mask = seq.dep_type == dep_type
    out[seq.dst[mask]] = seq.src[mask]
    return out


def test_dependent_tokens_are_functions_of_their_sources(seq):
    """Recompute every body token from its G* sources and its free choice u, independently of the loop."""
    lang = Y.make_language(seq.config)
    x, kind, u = seq.ids.numpy(), seq.kind.numpy(), seq.choice.numpy().astype(np.int64)
    t = np.nonzero(kind >= Y.Kind.LETTER)[0]
    a, b = x[t - 2], x[t - 1]  # the local sources, as G* lists them
    assert np.array_equal(a, x[seq.src[seq.dep_type == 0].numpy()[0::2]])
    key = _sources(seq, 1).numpy()[t]
    prev = _sources(seq, 2).numpy()[t]
    letters, names = np.frombuffer(Y.LETTERS, np.uint8), np.frombuffer(Y.NAME_LETTERS, np.uint8)
    k = kind[t]
    shift = np.where(key >= 0, lang.shift[(x[key] - ord("0")).clip(0, len(lang.shift) - 1)], 0)
    expected = np.select(
        [k == Y.Kind.LETTER, k == Y.Kind.ANCHORED, k == Y.Kind.NAME, k == Y.Kind.VALUE_NEW,
         k == Y.Kind.VALUE_COPY, k == Y.Kind.STOP],
        [letters[lang.letter[a, b, u[t]]], letters[(lang.letter[a, b, u[t]] + shift) % 16],
         names[lang.name[a, b, u[t]]], letters[lang.value[a, b, u[t]]], x[prev], ord(".")],
        default=ord(" "),
    )
    assert np.array_equal(x[t], expected)


def test_tokens_are_determined_by_sources_model_free(seq):
    """Without the tables: equal (kind, source values, u) never give different tokens."""
    x, kind, u = seq.ids.numpy(), seq.kind.numpy(), seq.choice.numpy()
    t = np.nonzero(kind >= Y.Kind.LETTER)[0]
    key, prev = _sources(seq, 1).numpy()[t], _sources(seq, 2).numpy()[t]
    extra = np.where(key >= 0, x[key], np.where(prev >= 0, x[prev], -1))
    context = np.stack([kind[t], x[t - 2], x[t - 1], extra, u[t]], 1)
    _, group = np.unique(context, axis=0, return_inverse=True)
    pairs = np.unique(np.stack([group.ravel(), x[t]], 1), axis=0)
    assert np.unique(pairs[:, 0]).size == pairs.shape[0]


def test_the_key_and_the_earlier_mention_matter(seq):
    lang = Y.make_language(seq.config)
    assert np.unique(lang.shift).size == lang.shift.size and (lang.shift % 16 != 0).all()
    entity = seq.dep_type == 2
    assert torch.equal(seq.ids[seq.src[entity]], seq.ids[seq.dst[entity]])  # a copy of the previous mention
    # the same entity's earlier value is not predictable from its name alone across sequences
    values = {}
    for s in range(6):
        other = Y.generate(3000, seed=s)
        first = torch.nonzero(other.kind == Y.Kind.VALUE_NEW).squeeze(1)
        for p in first.tolist():
            values.setdefault(bytes(other.ids[p - 2: p].tolist()), set()).add(int(other.ids[p]))
    assert max(len(v) for v in values.values()) > 1


def test_default_density_is_the_papers():
    seq = Y.generate(32768, seed=0)
    counts = seq.dep_counts()
    assert 64_000 <= counts["total"] <= 70_000  # the paper: about 67k
    long_range = (counts["anchor"] + counts["entity"]) / counts["total"]
    assert 0.02 <= long_range <= 0.05  # "a few percent"


def test_the_site_sees_the_structure(seq):
    data = validate_site(build_site(seq.ids, S.designed_site()))
    n_sections = int((seq.kind == Y.Kind.KEY).sum())
    assert data["instruction"].num_nodes == n_sections
    assert data["sentence"].num_nodes >= int((seq.kind == Y.Kind.STOP).sum())
    # every repeated entity value is recalled, by the retrieval node just before it, from the earlier value
    entity = seq.dep_type == 2
    recalls = data["token", "recalls", "retrieval"].edge_index
    recall_pairs = set(zip(recalls[0].tolist(), data["retrieval"].time[recalls[1]].tolist()))
    assert all((s, d - 1) in recall_pairs for s, d in zip(seq.src[entity].tolist(), seq.dst[entity].tolist()))
    # and the mention words recur in memory
    assert data["memory", "recurs", "memory"].edge_index.size(1) >= int(entity.sum())


# ------------------------------------------------------------------ experiments


def test_run_table_small():
    result = S.run_table(n=4096, seed=0, extra_sites={"matched": Y.matched_site_config()})
    rows = result["topologies"]
    assert set(rows) == {"dense", "local", "sheaf", "matched"}
    assert rows["dense"]["coverage"] == 1.0 and rows["dense"]["edges"] == 4096 * 4095 // 2
    assert 0.9 < rows["local"]["coverage"] < 1.0
    assert rows["local"]["relations"] == R.window_relations(4096, 8)
    assert rows["sheaf"]["coverage"] == 1.0
    assert rows["sheaf"]["relations"] < rows["dense"]["relations"]
    assert rows["matched"]["edges"] < rows["sheaf"]["edges"]
    for row in rows.values():
        assert 0.0 <= row["waste"] <= 1.0
    assert "sheaf" in S.format_table(result)


def test_run_scaling_and_plot(tmp_path):
    result = S.run_scaling(ns=(256, 512, 1024), relations_up_to=512)
    assert result["dense"]["edges"] == [256 * 255 // 2, 512 * 511 // 2, 1024 * 1023 // 2]
    assert result["dense"]["slope"] == pytest.approx(2.0, abs=0.01)
    assert result["sheaf"]["relations"][-1] is None and result["sheaf"]["relations"][0] > 0
    path = tmp_path / "scaling.png"
    S.plot_scaling(result, path)
    assert path.stat().st_size > 1000


def test_config_errors():
    with pytest.raises(ValueError, match="num_keys"):
        Y.GeneratorConfig(num_keys=11)
    with pytest.raises(ValueError, match="mention_rate"):
        Y.GeneratorConfig(mention_rate=1.5)
    with pytest.raises(ValueError, match="n must be"):
        Y.generate(3)
    with pytest.raises(ValueError, match="hops"):
        R.relation_stats(_chain_graph(4), 0)


def test_simulate_writes_under_runs_unless_told(tmp_path, capsys):
    assert S.parse_simulate_args([]).out == "runs/simulate"  # never the committed benchmarks/results by default
    assert S.main_simulate(["--n", "1024", "--max-log2", "11", "--out", str(tmp_path)]) == 0
    for name in ("simulate_table.json", "simulate_scaling.json", "simulate_scaling.png"):
        assert (tmp_path / name).is_file()
    table = json.loads((tmp_path / "simulate_table.json").read_text())
    assert table["paper"] == Y.PAPER and "sheaf (matched)" in table["topologies"]
    assert "paper: cov." in capsys.readouterr().out
