"""The learned-topology study: training, the pools against G*, weights, the union over blocks, references, plots."""

import json
import shutil

import numpy as np
import pytest
import torch

from sheafgnn.checkpoint import STATE, CheckpointError, latest_checkpoint, read_state
from sheafgnn.experiments import learned_topology as LT
from sheafgnn.experiments import pool_scoring as P
from sheafgnn.experiments import synthetic as Y
from sheafgnn.experiments.learned_model import load_learned_model
from sheafgnn.experiments.learned_report import format_learned, plot_learned, saved_model_routes
from sheafgnn.experiments.learned_routes import next_token_loss
from sheafgnn.experiments.simulation import main_simulate
from sheafgnn.model import SheafStateLM
from sheafgnn.site import SiteConfig, build_site
from sheafgnn.site.schema import CONTENT_EDGE, RANDOM_EDGE

ROWS = {"kept", "weight>0.1", "weight>0.25", "weight>0.5"}


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    return tmp_path_factory.mktemp("learned") / "model"


@pytest.fixture(scope="module")
def learned(saved_model) -> dict:
    torch.set_num_threads(1)
    return LT.run_learned(n_train=2048, n_eval=512, steps=3, window=256, d_model=16, n_layers=2,
                          growth_ns=(256, 512), log_every=1, save_model=saved_model)


def test_saved_model_loads_and_gives_the_study_s_eval_loss(learned, saved_model):
    """--save-model keeps the trained model: loaded back, it scores the evaluation sequence as the study did."""
    model = load_learned_model(saved_model)
    assert model.config.to_dict() == learned["model_config"] and not model.training
    seq = Y.generate(learned["n_eval"], learned["seed"])
    data = LT.sequence_site(seq, SiteConfig.from_dict(learned["site_config"]))
    assert next_token_loss(model, data, seq)["loss"] == pytest.approx(learned["loss_after"]["loss"], abs=1e-6)


def test_routes_of_the_saved_model_are_the_study_s(learned, saved_model, tmp_path):
    """simulate --routes-of DIR measures the saved model as the study did, and writes its JSON and plot."""
    result = saved_model_routes(saved_model, learned["n_eval"], learned["seed"])
    assert result["routes"] == learned["routes"]["routes"]
    assert main_simulate(["--routes-of", str(saved_model), "--n", str(learned["n_eval"]), "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "learned_routes.json").read_text())["routes"] == learned["routes"]["routes"]
    assert (tmp_path / "learned_routes.png").stat().st_size > 1000


def test_load_learned_model_refuses_an_empty_or_corrupt_folder(learned, saved_model, tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        load_learned_model(tmp_path)
    corrupt = tmp_path / "corrupt"
    shutil.copytree(saved_model, corrupt)
    step = latest_checkpoint(corrupt)
    state = read_state(step)
    (step / STATE).write_bytes(b"not a state")
    with pytest.raises(CheckpointError, match="corrupt or unreadable"):
        load_learned_model(corrupt)
    del state["model_config"]  # a checkpoint of something else (a training run's has "config")
    torch.save(state, step / STATE)
    with pytest.raises(CheckpointError, match="no readable model config"):
        load_learned_model(corrupt)


def test_run_learned_tiny_has_the_expected_keys(learned):
    for key in ("auc_per_destination", "candidate_recall", "coverage", "waste", "learned", "random_score_loss_delta",
                "loss_random_scores", "routes", "waste_floor", "waste_of_selection", "train", "loss_before",
                "loss_after", "designed", "untrained", "references", "growth", "model_config", "targets"):
        assert key in learned
    assert learned["model_config"]["topology"]["k"] == 2
    assert learned["train"]["steps"] == 3 and len(learned["train"]["curve"]) == 3
    assert set(learned["learned"]) == ROWS
    assert set(learned["references"]) == {"fixed_only", "oracle"}
    for loss in ("loss_before", "loss_after", "loss_random_scores"):
        assert np.isfinite(learned[loss]["loss"])
    delta = learned["random_score_loss_delta"]
    assert np.isfinite(delta) and delta == pytest.approx(learned["loss_random_scores"]["loss"]
                                                         - learned["loss_after"]["loss"])
    rows = [learned["designed"], learned["untrained"]["kept"], *learned["learned"].values(),
            *learned["references"].values()]
    for row in rows:
        assert 0.0 <= row["coverage"] <= 1.0 and 0.0 <= row["waste"] <= 1.0
    assert (learned["coverage"], learned["waste"]) == (learned["learned"]["kept"]["coverage"],
                                                       learned["learned"]["kept"]["waste"])
    assert learned["references"]["oracle"]["coverage"] == 1.0  # the oracle selection realises all of G*
    assert learned["references"]["fixed_only"]["kept_edges"] == 0
    assert learned["growth"]["ns"] == [256, 512] and len(learned["growth"]["kept"]["edges"]) == 2
    assert all(c > 0 for c in learned["growth"]["pools"]["candidates"])
    assert "designed site" in format_learned(learned)


def test_auc_and_candidate_recall_of_a_tiny_run(learned):
    auc = learned["auc_per_destination"]
    assert len(auc["per_block"]) == 2 and auc["destinations"] == sum(b["destinations"] for b in auc["per_block"])
    for block in auc["per_block"]:
        assert 0 < block["destinations"] <= block["eligible"]
        assert sum(block["hist"]) == block["destinations"] and 0.0 <= block["mean"] <= 1.0
        assert 0.0 < block["positive_share"] < 1.0
    assert 0.0 <= auc["mean"] <= 1.0 and learned["untrained"]["auc_per_destination"]["destinations"] > 0
    recall = learned["candidate_recall"]
    assert recall["dependencies"] == learned["deps"]["anchor"] + learned["deps"]["entity"]
    assert all(r <= recall["recall"] + 1e-12 for r in recall["per_block"])  # the union holds every block's pool
    assert recall["proposals_only"] <= recall["recall"] + 1e-12
    for name in P.LONG_RANGE_TYPES:  # the pools hold every rule edge of the site: at least its coverage
        assert recall["by_type"][name] >= learned["designed"]["coverage_by_type"][name] - 1e-12
    assert recall["candidates"] > learned["learned"]["kept"]["kept_edges"]  # pools larger than what is kept


def test_learned_rows_are_monotone_in_the_weight_threshold(learned):
    names = ["kept", "weight>0.1", "weight>0.25", "weight>0.5"]
    for key in ("kept_edges", "edges", "relations", "realised"):
        values = [learned["learned"][name][key] for name in names]
        assert values == sorted(values, reverse=True), key
    # the kept topology never has fewer relations than the fixed edges alone
    kept, fixed = learned["learned"]["kept"], learned["references"]["fixed_only"]
    assert fixed["relations"] <= kept["relations"] and fixed["realised"] <= kept["realised"]


def test_destination_auc_by_hand():
    # destination 1: positives 0.2, 0.8 against negatives 0.8, 0.3 -> (0 + 0 + 0.5 + 1) / 4
    # destination 3: the positive outranks both negatives -> 1; destination 7: no positive; 9: one candidate
    score = np.array([0.8, 0.9, 0.4, 0.2, 0.1, 0.7, 0.3, 0.5, 0.8, 0.6])
    label = np.array([1, 1, 0, 1, 0, 1, 0, 0, 0, 0], dtype=bool)
    group = np.array([1, 3, 7, 1, 3, 9, 1, 3, 1, 7])
    groups, auc, counted = P.destination_auc(score, label, group)
    assert groups.tolist() == [1, 3, 7, 9] and counted.tolist() == [True, True, False, False]
    assert auc[:2] == pytest.approx([0.375, 1.0]) and np.isnan(auc[2:]).all()


def _hand_case():
    """40 tokens, no patches (only the fixed ``token reads output`` and the stream); long-range
    dependencies (0, 20) entity, (5, 30) anchor, (10, 39) anchor and a local one."""
    ids = torch.tensor(list(b"the cat sat on the mat and then it went "))
    dep = {"local": 0, "anchor": 1, "entity": 2}
    src, dst, kind = [0, 5, 38, 10], [20, 30, 39, 39], [dep["entity"], dep["anchor"], dep["local"], dep["anchor"]]
    zeros = torch.zeros(40, dtype=torch.uint8)
    seq = Y.SyntheticSequence(ids, zeros, zeros, torch.full((40,), -1), torch.tensor(src), torch.tensor(dst),
                              torch.tensor(kind), Y.GeneratorConfig())
    return seq, build_site(ids, SiteConfig(patch_types=()))


def test_pool_auc_by_hand():
    seq, data = _hand_case()
    targets = P.long_range_targets(data, seq, hops=3)
    assert np.flatnonzero(targets.output_dep_type >= 0).tolist() == [19, 29, 38]
    # o19 <- 0 (token i itself: positive, 0.9), 3 (0 -> 3 is 3 hops: negative, 0.1);
    # o29 <- 7 (5 -> 6 -> 7: positive, alone: not counted); o38 <- 8 (before i = 10: negative, 0.5),
    # 13 (3 hops: negative, 0.7), 12 (10 -> 11 -> 12: positive, 0.3); o5 has no long-range target
    pools = {CONTENT_EDGE: {"candidate_index": torch.tensor([[0, 7, 8, 3], [19, 29, 38, 19]]),
                            "candidate_score": torch.tensor([0.9, 0.2, 0.5, 0.1])},
             RANDOM_EDGE: {"candidate_index": torch.tensor([[13, 12, 2], [38, 38, 5]]),
                           "candidate_score": torch.tensor([0.7, 0.3, 0.0])}}
    destination, score, label, source = P.candidate_labels(pools, data, targets)
    assert destination.tolist() == [19, 29, 38, 19, 38, 38]
    assert label.tolist() == [True, True, False, False, False, True]
    assert source.tolist() == [0, 7, 8, 3, 13, 12]  # tokens: their own ids
    row = P.pool_auc(pools, data, targets)
    assert row["mean"] == pytest.approx(0.5) and (row["destinations"], row["eligible"]) == (2, 3)
    assert row["by_type"] == {"anchor": pytest.approx(0.0), "entity": pytest.approx(1.0)}
    # every candidate is a token here; only o19's pool holds its source token (0)
    assert row["by_source"] == {"token": {"mean": pytest.approx(0.5), "destinations": 2},
                                "patch": {"mean": None, "destinations": 0}}
    assert row["source_in_pool"] == pytest.approx(1 / 3)
    assert row["positive_share"] == pytest.approx(2 / 5) and sum(row["hist"]) == 2


def test_candidate_recall_by_hand():
    seq, data = _hand_case()
    targets = P.long_range_targets(data, seq, hops=3)
    # (0, 20) through 0 -> o19, (5, 30) through 5 -> 6 -> 7 -> o29; (10, 39) has only 8 and 13 -> o38
    pools = {CONTENT_EDGE: {"edge_index": torch.tensor([[0, 7, 8], [19, 29, 38]])},
             RANDOM_EDGE: {"edge_index": torch.tensor([[13], [38]])}}
    recall = P.candidate_recall(pools, data, targets, hops=3)
    assert recall["recall"] == pytest.approx(2 / 3) and (recall["dependencies"], recall["realised"]) == (3, 2)
    assert recall["by_type"] == {"anchor": pytest.approx(0.5), "entity": pytest.approx(1.0)}
    assert recall["candidates"] == 4
    pools[RANDOM_EDGE] = {"edge_index": torch.tensor([[13, 12], [38, 38]])}  # 10 -> 11 -> 12 -> o38
    assert P.candidate_recall(pools, data, targets, hops=3)["recall"] == 1.0
    assert P.candidate_recall(pools, data, targets, hops=2)["recall"] == pytest.approx(1 / 3)  # only 0 -> o19


def test_threshold_and_union_of_blocks():
    torch.set_num_threads(1)
    topology = {("a", "r", "b"): {"edge_index": torch.tensor([[0, 1, 2], [1, 2, 3]]),
                                  "weight": torch.tensor([0.2, 0.6, 0.95])}}
    assert LT.threshold_topology(topology, None) is topology
    kept = LT.threshold_topology(topology, 0.5)[("a", "r", "b")]
    assert kept["edge_index"].tolist() == [[1, 2], [2, 3]] and kept["weight"].tolist() == pytest.approx([0.6, 0.95])
    model = SheafStateLM(LT.learned_model_config(d_model=16, n_layers=2))
    seq = Y.generate(300, seed=2)
    data = build_site(seq.ids, Y.matched_site_config())
    per_block = LT.block_topologies(model, data, candidates=True)
    union, pools = LT.union_of_blocks(per_block), LT.union_of_blocks(per_block, "candidate_index")
    for topology in per_block:
        for edge_type, entry in topology.items():
            pairs = set(map(tuple, union[edge_type]["edge_index"].T.tolist()))
            assert set(map(tuple, entry["edge_index"].T.tolist())) <= pairs  # every block's edge is in the union
            pool = set(map(tuple, pools[edge_type]["edge_index"].T.tolist()))
            assert pairs <= pool and set(map(tuple, entry["candidate_index"].T.tolist())) <= pool
            lookup = dict(zip(map(tuple, union[edge_type]["edge_index"].T.tolist()),
                              union[edge_type]["weight"].tolist()))
            for pair, weight in zip(map(tuple, entry["edge_index"].T.tolist()), entry["weight"].tolist()):
                assert lookup[pair] >= weight - 1e-6  # the union keeps the largest weight


def test_learned_plot(learned, tmp_path):
    path = tmp_path / "learned.png"
    plot_learned(learned, path)
    assert path.stat().st_size > 1000


def test_waste_floor_and_waste_of_selection_by_hand(learned):
    # 10 fixed relations, 6 realised, 10 dependencies: 90% coverage needs 3 more realised pairs
    assert LT.waste_floor({"relations": 10, "realised": 6}, 10, 0.9) == pytest.approx(1 - 9 / 13)
    assert LT.waste_floor({"relations": 10, "realised": 9}, 10, 0.9) == pytest.approx(1 - 9 / 10)
    fixed = {"relations": 10, "realised": 6}
    assert LT.waste_of_selection({"relations": 20, "realised": 9}, fixed) == pytest.approx(1 - 3 / 10)
    assert LT.waste_of_selection(fixed, fixed) is None
    assert 0.0 <= learned["waste_floor"] <= 1.0 and 0.0 <= learned["waste_of_selection"] <= 1.0
    # the least waste is at most what the kept topology reaches once it covers as much
    assert learned["waste_floor"] <= learned["waste"] or learned["coverage"] < learned["targets"]["coverage"]
