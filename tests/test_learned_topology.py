"""The learned-topology study: training, thresholds, the union over blocks, references, plots."""

import numpy as np
import pytest
import torch

from sheafgnn.experiments import learned_topology as LT
from sheafgnn.experiments import synthetic as Y
from sheafgnn.site import build_site


@pytest.fixture(scope="module")
def learned() -> dict:
    torch.set_num_threads(1)
    return LT.run_learned(n_train=2048, n_eval=512, steps=3, window=256, d_model=16, n_layers=2,
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
    assert "designed site" in LT.format_learned(learned)


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
    assert LT.threshold_topology(topology, None) is topology
    kept = LT.threshold_topology(topology, 0.5)[("a", "r", "b")]
    assert kept["edge_index"].tolist() == [[1, 2], [2, 3]] and kept["gate"].tolist() == pytest.approx([0.6, 0.95])
    from sheafgnn.model import SheafStateLM

    model = SheafStateLM(LT.learned_model_config(d_model=16, n_layers=2))
    seq = Y.generate(300, seed=2)
    data = build_site(seq.ids, Y.matched_site_config())
    union = LT.learned_topology(model, data)
    for i in range(2):
        for edge_type, entry in model.topology(data, block=i).items():
            pairs = set(map(tuple, union[edge_type]["edge_index"].T.tolist()))
            assert set(map(tuple, entry["edge_index"].T.tolist())) <= pairs  # every block's edge is in the union
            lookup = dict(zip(map(tuple, union[edge_type]["edge_index"].T.tolist()), union[edge_type]["gate"].tolist()))
            for pair, gate in zip(map(tuple, entry["edge_index"].T.tolist()), entry["gate"].tolist()):
                assert lookup[pair] >= gate - 1e-6  # the union keeps the largest gate


def test_learned_plot(learned, tmp_path):
    path = tmp_path / "learned.png"
    LT.plot_learned(learned, path)
    assert path.stat().st_size > 1000


def test_waste_floor_by_hand(learned):
    # 10 fixed relations, 6 realised, 10 dependencies: 90% coverage needs 3 more realised pairs
    assert LT.waste_floor({"relations": 10, "realised": 6}, 10, 0.9) == pytest.approx(1 - 9 / 13)
    assert LT.waste_floor({"relations": 10, "realised": 9}, 10, 0.9) == pytest.approx(1 - 9 / 10)
    floor = learned["waste_floor_at_target_coverage"]
    assert 0.0 <= floor <= 1.0
