from collections import deque

import numpy as np
import pytest
import torch

from sheafgnn import simulate as S
from sheafgnn.site import SiteConfig, build_site, validate_site


@pytest.fixture(scope="module")
def seq() -> S.SyntheticSequence:
    return S.generate(6000, seed=3)


def _chain_graph(n: int) -> S.RelationGraph:
    """Tokens 0..n-1 (nodes 0..n-1) on a stream chain; token t reads output t (node n + t)."""
    t = np.arange(n)
    edges = np.concatenate([np.stack([t[:-1], t[1:]]), np.stack([t, t + n])], 1)
    return S.RelationGraph(2 * n, edges, t, t + n)


def _reference_relations(graph: S.RelationGraph, hops: int) -> set[tuple[int, int]]:
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
    assert S.dense_relations(n) == n * (n - 1) // 2 == brute
    relations, _, _ = S.relation_stats(S.attention_graph(n), hops=1)
    assert relations == brute


@pytest.mark.parametrize("n,w", [(1, 3), (5, 8), (9, 8), (20, 1), (20, 3), (40, 8)])
def test_window_count_by_brute_force(n, w):
    brute = sum(1 for j in range(n) for i in range(j) if j - i <= w)
    assert S.window_relations(n, w) == brute
    relations, _, _ = S.relation_stats(S.attention_graph(n, window=w), hops=1)
    assert relations == brute


def test_dense_score_at_paper_length_is_analytic():
    seq = S.generate(32768, seed=0)
    row = S.score_dense(seq)
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
    relations, realised, per_dst = S.relation_stats(graph, hops, src, dst)
    assert relations == S.window_relations(n, hops)
    assert realised.tolist() == [bool(d - s <= hops) for s, d in zip(src, dst)]
    assert per_dst.tolist() == [0] + [min(j, hops) for j in range(1, n)]


def test_coverage_and_waste_on_a_hand_checked_graph():
    # tokens 0..3 (nodes 0-3), outputs 0..3 (nodes 4-7), one patch P (node 8) over tokens 0, 1,
    # read by output 2. Relations (H = 2): (0,1) (1,2) (2,3) via token reads; (0,3) (1,3) via P.
    edges = np.array([[0, 1, 2, 3, 0, 1, 8],
                      [4, 5, 6, 7, 8, 8, 6]])
    graph = S.RelationGraph(9, edges, np.arange(4), np.arange(4) + 4, {"hand": 7})
    src, dst, typ = np.array([0, 0, 1]), np.array([1, 2, 3]), np.array([0, 1, 2])
    row = S.score_graph(graph, 2, src, dst, typ)
    assert row["relations"] == 5
    assert row["realised"] == 2  # (0, 1) and (1, 3); (0, 2) needs output 1 to see token 0
    assert row["coverage"] == pytest.approx(2 / 3)
    assert row["waste"] == pytest.approx(1 - 2 / 5)
    assert row["coverage_by_type"] == {"local": 1.0, "anchor": 0.0, "entity": 1.0}
    assert row["edges"] == 7
    one_hop = S.score_graph(graph, 1, src, dst, typ)
    assert one_hop["relations"] == 3 and one_hop["realised"] == 1


def test_relation_stats_match_breadth_first_search_on_a_site():
    small = S.generate(400, seed=1, config=S.GeneratorConfig(section_len=100))
    graph = S.site_graph(build_site(small.ids, SiteConfig(local_window=8)))
    for hops in (1, 2, 3):
        expected = _reference_relations(graph, hops)
        src, dst = small.src.numpy(), small.dst.numpy()
        relations, realised, _ = S.relation_stats(graph, hops, src, dst, chunk=37)
        assert relations == len(expected)
        assert realised.tolist() == [(s, d) in expected for s, d in zip(src.tolist(), dst.tolist())]


def test_chunking_does_not_change_the_result(seq):
    graph = S.site_graph(build_site(seq.ids))
    src, dst = seq.src.numpy(), seq.dst.numpy()
    a = S.relation_stats(graph, 3, src, dst, chunk=1 << 14)
    b = S.relation_stats(graph, 3, src, dst, chunk=333)
    assert a[0] == b[0]
    assert np.array_equal(a[1], b[1]) and np.array_equal(a[2], b[2])


def test_site_graph_has_every_edge_and_the_stream(seq):
    data = build_site(seq.ids)
    graph = S.site_graph(data)
    n = seq.ids.numel()
    assert graph.num_edges == sum(data[e].edge_index.size(1) for e in data.edge_types) + n - 1
    assert graph.edges_by_type["token__stream__token"] == n - 1
    assert S.site_graph(data, stream=False).num_edges == graph.num_edges - (n - 1)
    assert np.array_equal(graph.token_node, np.arange(n))  # tokens come first


# ------------------------------------------------------------------ the generator


def test_generator_is_deterministic_by_seed():
    a, b, c = S.generate(3000, seed=7), S.generate(3000, seed=7), S.generate(3000, seed=8)
    for name in ("ids", "kind", "choice", "key_pos", "src", "dst", "dep_type"):
        assert torch.equal(getattr(a, name), getattr(b, name))
    assert not torch.equal(a.ids, c.ids)
    other_language = S.generate(3000, seed=7, config=S.GeneratorConfig(language_seed=1))
    assert not torch.equal(a.ids, other_language.ids)


def test_dependency_graph_is_well_formed(seq):
    n = seq.ids.numel()
    assert seq.ids.numel() == seq.kind.numel() == n
    assert bool((seq.src < seq.dst).all()) and int(seq.src.min()) >= 0 and int(seq.dst.max()) < n
    keys = seq.src * n + seq.dst
    assert keys.unique().numel() == keys.numel()  # distinct pairs
    body = seq.kind >= S.Kind.LETTER
    local = seq.dep_type == 0
    # every body token has exactly its two predecessors as local sources, nothing else has any
    assert torch.equal(torch.bincount(seq.dst[local], minlength=n), 2 * body.long())
    assert bool((seq.dst[local] - seq.src[local] <= 2).all())
    # anchors: the anchored tokens, from the section's key; entities: the repeated values
    anchor, entity = seq.dep_type == 1, seq.dep_type == 2
    assert torch.equal(seq.dst[anchor], torch.nonzero(seq.kind == S.Kind.ANCHORED).squeeze(1))
    assert torch.equal(seq.src[anchor], seq.key_pos[seq.dst[anchor]])
    assert bool((seq.kind[seq.src[anchor]] == S.Kind.KEY).all())
    assert torch.equal(seq.dst[entity], torch.nonzero(seq.kind == S.Kind.VALUE_COPY).squeeze(1))
    assert bool((seq.kind[seq.src[entity]] >= S.Kind.VALUE_NEW).all())


def _sources(seq: S.SyntheticSequence, dep_type: int) -> torch.Tensor:
    """(n,) the source of each token's dependency of one type (-1 where none)."""
    out = torch.full((seq.ids.numel(),), -1, dtype=torch.long)
    mask = seq.dep_type == dep_type
    out[seq.dst[mask]] = seq.src[mask]
    return out


def test_dependent_tokens_are_functions_of_their_sources(seq):
    """Recompute every body token from its G* sources and its free choice u, independently of the loop."""
    lang = S.make_language(seq.config)
    x, kind, u = seq.ids.numpy(), seq.kind.numpy(), seq.choice.numpy().astype(np.int64)
    t = np.nonzero(kind >= S.Kind.LETTER)[0]
    a, b = x[t - 2], x[t - 1]  # the local sources, as G* lists them
    assert np.array_equal(a, x[seq.src[seq.dep_type == 0].numpy()[0::2]])
    key = _sources(seq, 1).numpy()[t]
    prev = _sources(seq, 2).numpy()[t]
    letters, names = np.frombuffer(S.LETTERS, np.uint8), np.frombuffer(S.NAME_LETTERS, np.uint8)
    k = kind[t]
    shift = np.where(key >= 0, lang.shift[(x[key] - ord("0")).clip(0, len(lang.shift) - 1)], 0)
    expected = np.select(
        [k == S.Kind.LETTER, k == S.Kind.ANCHORED, k == S.Kind.NAME, k == S.Kind.VALUE_NEW,
         k == S.Kind.VALUE_COPY, k == S.Kind.STOP],
        [letters[lang.letter[a, b, u[t]]], letters[(lang.letter[a, b, u[t]] + shift) % 16],
         names[lang.name[a, b, u[t]]], letters[lang.value[a, b, u[t]]], x[prev], ord(".")],
        default=ord(" "),
    )
    assert np.array_equal(x[t], expected)


def test_tokens_are_determined_by_sources_model_free(seq):
    """Without the tables: equal (kind, source values, u) never give different tokens."""
    x, kind, u = seq.ids.numpy(), seq.kind.numpy(), seq.choice.numpy()
    t = np.nonzero(kind >= S.Kind.LETTER)[0]
    key, prev = _sources(seq, 1).numpy()[t], _sources(seq, 2).numpy()[t]
    extra = np.where(key >= 0, x[key], np.where(prev >= 0, x[prev], -1))
    context = np.stack([kind[t], x[t - 2], x[t - 1], extra, u[t]], 1)
    _, group = np.unique(context, axis=0, return_inverse=True)
    pairs = np.unique(np.stack([group.ravel(), x[t]], 1), axis=0)
    assert np.unique(pairs[:, 0]).size == pairs.shape[0]


def test_the_key_and_the_earlier_mention_matter(seq):
    lang = S.make_language(seq.config)
    assert np.unique(lang.shift).size == lang.shift.size and (lang.shift % 16 != 0).all()
    entity = seq.dep_type == 2
    assert torch.equal(seq.ids[seq.src[entity]], seq.ids[seq.dst[entity]])  # a copy of the previous mention
    # the same entity's earlier value is not predictable from its name alone across sequences
    values = {}
    for s in range(6):
        other = S.generate(3000, seed=s)
        first = torch.nonzero(other.kind == S.Kind.VALUE_NEW).squeeze(1)
        for p in first.tolist():
            values.setdefault(bytes(other.ids[p - 2: p].tolist()), set()).add(int(other.ids[p]))
    assert max(len(v) for v in values.values()) > 1


def test_default_density_is_the_papers():
    seq = S.generate(32768, seed=0)
    counts = seq.dep_counts()
    assert 64_000 <= counts["total"] <= 70_000  # the paper: about 67k
    long_range = (counts["anchor"] + counts["entity"]) / counts["total"]
    assert 0.02 <= long_range <= 0.05  # "a few percent"


def test_the_site_sees_the_structure(seq):
    data = validate_site(build_site(seq.ids))
    n_sections = int((seq.kind == S.Kind.KEY).sum())
    assert data["instruction"].num_nodes == n_sections
    assert data["sentence"].num_nodes >= int((seq.kind == S.Kind.STOP).sum())
    # every repeated entity value is recalled, by the retrieval node just before it, from the earlier value
    entity = seq.dep_type == 2
    recalls = data["token", "recalls", "retrieval"].edge_index
    recall_pairs = set(zip(recalls[0].tolist(), data["retrieval"].time[recalls[1]].tolist()))
    assert all((s, d - 1) in recall_pairs for s, d in zip(seq.src[entity].tolist(), seq.dst[entity].tolist()))
    # and the mention words recur in memory
    assert data["memory", "recurs", "memory"].edge_index.size(1) >= int(entity.sum())


# ------------------------------------------------------------------ experiments


def test_run_table_small():
    result = S.run_table(n=4096, seed=0, extra_sites={"matched": S.matched_site_config()})
    rows = result["topologies"]
    assert set(rows) == {"dense", "local", "sheaf", "matched"}
    assert rows["dense"]["coverage"] == 1.0 and rows["dense"]["edges"] == 4096 * 4095 // 2
    assert 0.9 < rows["local"]["coverage"] < 1.0
    assert rows["local"]["relations"] == S.window_relations(4096, 8)
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
        S.GeneratorConfig(num_keys=11)
    with pytest.raises(ValueError, match="mention_rate"):
        S.GeneratorConfig(mention_rate=1.5)
    with pytest.raises(ValueError, match="n must be"):
        S.generate(3)
    with pytest.raises(ValueError, match="hops"):
        S.relation_stats(_chain_graph(4), 0)


# ------------------------------------------------------------------ the learned topology


@pytest.fixture(scope="module")
def learned() -> dict:
    torch.set_num_threads(1)
    return S.run_learned(n_train=2048, n_eval=512, steps=3, window=256, d_model=16, n_layers=2,
                         growth_ns=(256, 512), sweep=(0.0, 0.5, 0.95), log_every=1)


def test_run_learned_tiny_has_the_expected_keys(learned):
    for key in ("train", "loss_before", "loss_after", "designed", "untrained", "learned", "references",
                "sweep", "gates", "growth", "model_config"):
        assert key in learned
    assert learned["train"]["steps"] == 3 and len(learned["train"]["curve"]) == 3
    assert set(learned["learned"]) == {"top-k", "gate>0.5", "gate>0.7", "gate>0.9"}
    assert set(learned["references"]) == {"fixed_only", "oracle"}
    assert np.isfinite(learned["loss_before"]["loss"]) and np.isfinite(learned["loss_after"]["loss"])
    rows = [learned["designed"], *learned["learned"].values(), *learned["references"].values()]
    for row in rows:
        assert 0.0 <= row["coverage"] <= 1.0 and 0.0 <= row["waste"] <= 1.0
    assert learned["references"]["oracle"]["coverage"] == 1.0  # the oracle gating realises all of G*
    assert learned["references"]["fixed_only"]["candidate_edges"] == 0
    assert learned["growth"]["ns"] == [256, 512] and len(learned["growth"]["top-k"]["edges"]) == 2
    assert "designed site" in S.format_learned(learned)


def test_learned_thresholds_are_monotone(learned):
    names = ["top-k", "gate>0.5", "gate>0.7", "gate>0.9"]
    for key in ("candidate_edges", "edges", "relations", "realised"):
        values = [learned["learned"][name][key] for name in names]
        assert values == sorted(values, reverse=True), key
    sweep = learned["sweep"]
    assert [r["candidate_edges"] for r in sweep] == sorted((r["candidate_edges"] for r in sweep), reverse=True)
    # the top-k topology never has fewer relations than the fixed edges alone, nor more than the whole site
    top = learned["learned"]["top-k"]
    assert learned["references"]["fixed_only"]["relations"] <= top["relations"] <= learned["designed"]["relations"]


def test_threshold_and_union_of_blocks():
    torch.set_num_threads(1)
    topology = {("a", "r", "b"): {"edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]]),
                                  "gate": torch.tensor([0.2, 0.6, 0.95])}}
    assert S.threshold_topology(topology, None) is topology
    kept = S.threshold_topology(topology, 0.5)[("a", "r", "b")]
    assert kept["edge_index"].tolist() == [[1, 2], [2, 3]] and kept["gate"].tolist() == pytest.approx([0.6, 0.95])
    from sheafgnn.model import SheafStateLM

    model = SheafStateLM(S.learned_model_config(d_model=16, n_layers=2))
    seq = S.generate(300, seed=2)
    data = build_site(seq.ids, S.matched_site_config())
    union = S.learned_topology(model, data)
    for i in range(2):
        for edge_type, entry in model.topology(data, block=i).items():
            pairs = set(map(tuple, union[edge_type]["edge_index"].T.tolist()))
            assert set(map(tuple, entry["edge_index"].T.tolist())) <= pairs  # every block's edge is in the union
            lookup = dict(zip(map(tuple, union[edge_type]["edge_index"].T.tolist()), union[edge_type]["gate"].tolist()))
            for pair, gate in zip(map(tuple, entry["edge_index"].T.tolist()), entry["gate"].tolist()):
                assert lookup[pair] >= gate - 1e-6  # the union keeps the largest gate


def test_learned_plot(learned, tmp_path):
    path = tmp_path / "learned.png"
    S.plot_learned(learned, path)
    assert path.stat().st_size > 1000


def test_waste_floor_by_hand(learned):
    # 10 fixed relations, 6 realised, 10 dependencies: 90% coverage needs 3 more realised pairs
    assert S.waste_floor({"relations": 10, "realised": 6}, 10, 0.9) == pytest.approx(1 - 9 / 13)
    assert S.waste_floor({"relations": 10, "realised": 9}, 10, 0.9) == pytest.approx(1 - 9 / 10)
    floor = learned["waste_floor_at_target_coverage"]
    assert 0.0 <= floor <= 1.0
