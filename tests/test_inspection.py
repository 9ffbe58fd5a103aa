import json
import math

import networkx as nx
import numpy as np
import pytest
import scipy.sparse as sp
import torch

from sheafgnn.experiments import inspection as I
from sheafgnn.relations import relation_stats, site_graph
from sheafgnn.site import ALL_TEXT_PATCH_TYPES, CANDIDATE_EDGES, NODE_TYPES, ByteTokenizer, SiteConfig, build_site
from sheafgnn.site.schema import CONTENT_EDGE, GLUE_EDGES

from .conftest import PROSE

RECURS = ("memory", "recurs", "memory")


@pytest.fixture(scope="module")
def site():
    return build_site(PROSE, SiteConfig(patch_types=ALL_TEXT_PATCH_TYPES, local_window=8))


def _hand_topology(data) -> I.Topology:
    """The designed topology with three memory edges given hand-made weights and energies."""
    topology = I.designed_topology(data)
    ei = data[RECURS].edge_index[:, :3]
    topology[RECURS] = {"edge_index": ei, "weight": torch.tensor([0.15, 0.95, 0.55]),
                        "energy": torch.tensor([1.0, 2.0, float("nan")])}
    return topology


def test_designed_topology_statistics(site):
    topology = I.designed_topology(site)
    assert set(topology) == set(CANDIDATE_EDGES)
    stats = I.edge_stats(topology, site)
    for edge_type in CANDIDATE_EDGES:
        row = stats[I.edge_key(edge_type)]
        count = site[edge_type].edge_index.size(1)
        assert row["kept"] == row["candidates"] == count
        hist = row["in_degree_hist"]
        assert sum(hist) == site[edge_type[2]].num_nodes  # every destination node, degree 0 included
        assert sum(d * h for d, h in enumerate(hist)) == count
        assert row["weight_hist"] == [0] * 9 + [count]
        assert row["energy_mean"] is None
    nodes = I.node_stats(site)
    assert list(nodes) == list(NODE_TYPES)
    assert nodes["token"] == {"count": site["token"].num_nodes, "mean_span": 1.0}
    assert nodes["local"]["mean_span"] == 8.0


def test_hand_made_topology_statistics_and_top_edges(site):
    topology = _hand_topology(site)
    row = I.edge_stats(topology, site, bins=10)["memory__recurs__memory"]
    assert row["kept"] == 3 and row["kept_fraction"] == pytest.approx(3 / site[RECURS].edge_index.size(1))
    assert row["weight_hist"] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert row["weight_mean"] == pytest.approx(0.55)
    assert row["energy_mean"] == pytest.approx(1.5)  # NaN energies are left out
    top = I.top_edges(topology, site, ByteTokenizer(), k=2)["memory__recurs__memory"]
    assert [r["weight"] for r in top] == pytest.approx([0.95, 0.55])
    assert top[1]["energy"] is None
    raw = PROSE.encode()
    for r in top:
        s0, s1 = r["src_span"]
        assert r["src_text"] == raw[s0:s1].decode().replace("\n", "\\n")
        assert r["src_span"] == site["memory"].span[r["src"]].tolist()
        assert r["dst_span"] == site["memory"].span[r["dst"]].tolist()
        assert r["src_text"].strip(" ,.").lower() == r["dst_text"].strip(" ,.").lower()  # the same entity
    assert "memory__recurs__memory" in I.format_top_edges({"memory__recurs__memory": top})


def test_check_topology_errors(site):
    good = _hand_topology(site)
    with pytest.raises(ValueError, match="not a gluing edge type"):
        I.check_topology({("token", "in", "local"): good[RECURS]}, site)
    bad = dict(good)
    bad[RECURS] = {**good[RECURS], "weight": torch.tensor([0.1, 2.0, 0.5])}
    with pytest.raises(ValueError, match="outside"):
        I.check_topology(bad, site)
    bad[RECURS] = {**good[RECURS], "edge_index": good[RECURS]["edge_index"] + 10_000}
    with pytest.raises(ValueError, match="out of range"):
        I.check_topology(bad, site)
    bad[RECURS] = {"edge_index": good[RECURS]["edge_index"], "weight": torch.ones(2), "energy": torch.ones(2)}
    with pytest.raises(ValueError, match="needs edge_index"):
        I.check_topology(bad, site)
    with pytest.raises(ValueError, match="lacks"):
        I.check_topology({RECURS: {"edge_index": good[RECURS]["edge_index"]}}, site)


def _same(a, b) -> bool:
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or a == b


@pytest.mark.parametrize("fmt", ["graphml", "json"])
def test_export_round_trip(site, tmp_path, fmt):
    topology = _hand_topology(site)
    graph = I.to_networkx(topology, site, fixed=True)
    path = tmp_path / f"topology.{fmt}"
    if fmt == "graphml":
        I.write_graphml(graph, path)
        back = nx.read_graphml(path, edge_key_type=str, force_multigraph=True)  # plain networkx reads it
    else:
        I.write_json(graph, path)
        json.loads(path.read_text())  # strict JSON (no NaN)
        back = I.read_json(path)
    assert back.number_of_nodes() == sum(site[t].num_nodes for t in NODE_TYPES)
    assert back.number_of_edges() == graph.number_of_edges() == sum(site[e].edge_index.size(1)
                                                                      for e in site.edge_types) - \
        site[RECURS].edge_index.size(1) + 3
    node = back.nodes["local:2"]
    assert (node["type"], node["time"], node["span_start"], node["span_end"]) == ("local", 23, 16, 24)
    assert node["text"] == PROSE[16:24]
    for u, v, key, attrs in graph.edges(keys=True, data=True):
        other = back.edges[u, v, key]
        for name in ("type", "weight", "energy", "learned"):
            assert _same(other[name], attrs[name]), (u, v, key, name)
    memory = [(u, v, d) for u, v, d in back.edges(data=True) if d["type"] == "memory__recurs__memory"]
    assert sorted(d["weight"] for _, _, d in memory) == pytest.approx([0.15, 0.55, 0.95])


def test_triangle_density_is_exact():
    n, bins = 37, 8
    rows, cols = np.tril_indices(n, -1)
    brute = I._density(sp.csr_matrix((np.ones(rows.size), (rows, cols)), shape=(n, n)), n, bins)
    assert np.allclose(I._triangle_density(n, bins), brute)
    assert np.allclose(I._triangle_density(n, n), np.tril(np.ones((n, n)), -1))


def test_inspect_site_designed(site, tmp_path):
    stats = I.inspect_site(None, site, ByteTokenizer(), tmp_path / "out", hops=3, top_k=3)
    assert stats["source"] == "designed"
    for path in stats["files"].values():
        assert (tmp_path / "out" / path.split("/")[-1]).stat().st_size > 0
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["num_tokens"] == site["token"].num_nodes
    # the designed topology's relations are the site's (every edge, plus the stream)
    assert stats["relations"]["relations"] == relation_stats(site_graph(site), 3)[0]
    assert stats["totals"]["kept"] == stats["totals"]["candidates"]
    assert all(len(rows) <= 3 for rows in stats["top_edges"].values())
    assert "designed topology" in I.format_summary(stats)


def test_main_inspect_untrained_model(tmp_path, capsys):
    from sheafgnn.model import SheafStateConfig, SheafStateLM

    torch.manual_seed(0)
    config = SheafStateConfig(d_model=32, n_layers=1, ssm={"headdim": 16, "d_state": 8}, topology={"k": 4},
                              site={"local_window": 8})
    model = SheafStateLM(config)
    stats = I.main_inspect(model, PROSE, out_dir=tmp_path, verbose=True)
    assert stats["source"] == "model"
    assert set(stats["edges"]) == {I.edge_key(e) for e in GLUE_EDGES}  # every glue type, proposals included
    for row in stats["edges"].values():
        assert row["kept"] <= row["candidates"]
        if row["kept"]:
            assert 0.0 <= row["weight_mean"] <= 1.0
    content = stats["edges"][I.edge_key(CONTENT_EDGE)]
    assert 0 < content["kept"] < content["candidates"]  # the pools are larger than what is kept
    assert stats["totals"]["kept"] < stats["totals"]["candidates"]
    assert (tmp_path / "arcs.png").stat().st_size > 0
    assert stats["relations"]["relations"] <= stats["relations"]["dense"]
    printed = capsys.readouterr().out
    assert "strongest content-addressed edges" in printed and "token__matches__output" in printed


def test_content_edges_are_listed_with_their_text(tmp_path):
    from sheafgnn.model import SheafStateConfig, SheafStateLM

    torch.manual_seed(0)
    model = SheafStateLM(SheafStateConfig(d_model=32, n_layers=1, ssm={"headdim": 16, "d_state": 8},
                                          topology={"k": 4}, site={"local_window": 8}))
    stats = I.main_inspect(model, PROSE, out_dir=tmp_path, verbose=False)
    rows = stats["content_edges"]
    assert 0 < len(rows) <= 10
    assert [r["weight"] for r in rows] == sorted((r["weight"] for r in rows), reverse=True)  # strongest first
    raw = PROSE.encode()
    for r in rows:
        s, d = r["src"], r["dst"]
        assert s <= d and r["src_span"] == [s, s + 1] and r["dst_span"] == [d, d + 1]  # causal: token s -> output d
        assert r["score"] is not None and 0.0 < r["weight"] <= 1.0
        left, rest = r["src_text"].split("⟦")
        token, right = rest.split("⟧")
        assert token == raw[s : s + 1].decode().replace("\n", "\\n")
        assert raw[max(s - 16, 0) : s].decode().replace("\n", "\\n") == left
        assert r["dst_text"].endswith("⟦" + raw[d : d + 1].decode().replace("\n", "\\n") + "⟧")
        assert r["next_text"] == raw[d + 1 : d + 2].decode().replace("\n", "\\n")
    written = json.loads((tmp_path / "stats.json").read_text())
    assert written["content_edges"] == rows
    assert "strongest content-addressed edges" in I.format_summary(stats)


def test_main_inspect_refuses_a_one_token_text(tmp_path):
    with pytest.raises(ValueError, match="at least 2 tokens"):
        I.main_inspect(None, "a", out_dir=tmp_path, verbose=False)
