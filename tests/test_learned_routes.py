"""Route cuts of a trained model (sheafgnn.experiments.learned_routes): where the chains restart, that a cut
route carries nothing across a cut while the routes left open do, and the route table."""

import numpy as np
import pytest
import torch
from torch_geometric.data import Batch

from sheafgnn.experiments import learned_routes as R
from sheafgnn.experiments import learned_topology as LT
from sheafgnn.experiments import synthetic as Y
from sheafgnn.model import SheafStateLM
from sheafgnn.site import build_site
from sheafgnn.site.flat import flatten_site
from sheafgnn.site.schema import CHAINED_TYPES, CONTENT_EDGE, GLUE_EDGES

SHORT_SECTIONS = Y.GeneratorConfig(section_len=64)


@pytest.fixture(scope="module")
def sequence():
    seq = Y.generate(600, seed=3, config=SHORT_SECTIONS)
    return seq, build_site(seq.ids, Y.matched_site_config())


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    return SheafStateLM(LT.learned_model_config(d_model=16, n_layers=2)).eval()


def test_section_cuts_are_the_positions_after_the_keys(sequence):
    seq, _ = sequence
    cuts = R.section_cuts(seq)
    assert cuts.numel() >= 4  # sections of ~64 body tokens in 600
    assert torch.equal(cuts, torch.unique(seq.key_pos[seq.key_pos >= 0]) + 1)
    assert (seq.kind[cuts - 1] == Y.Kind.KEY).all()


def test_cut_chains_restarts_each_chain_after_every_cut(sequence):
    seq, data = sequence
    site, cuts = flatten_site(data), R.section_cuts(seq)
    cut = R.cut_chains(data, cuts)
    assert (cut.token_reset >= site.token_reset).all() and (cut.chain_reset >= site.chain_reset).all()
    assert torch.equal(torch.nonzero(cut.token_reset & ~site.token_reset).flatten(), cuts)
    first = 0
    for t in CHAINED_TYPES:
        start, n = data[t].span[:, 0], data[t].num_nodes
        reset = cut.chain_reset[first : first + n].tolist()
        first += n
        if t in ("local", "sentence"):
            assert sum(reset) > sum(site.chain_reset[first - n : first].tolist())  # the cuts added restarts
        last = 0
        for i in range(n):
            last = i if reset[i] else last
            before = cuts[cuts <= start[i]]
            if before.numel():  # nothing since the chain's last restart started before the latest cut
                assert int(start[last : i + 1].min()) >= int(before.max()), (t, i)
    only_token = R.cut_chains(data, cuts, patches=False)
    assert torch.equal(only_token.chain_reset, site.chain_reset)
    with pytest.raises(ValueError, match="one text"):
        batch = Batch.from_data_list([data, data])
        R.cut_chains(batch, cuts)


def _perturbed(data, upto: int):
    """The same site with every token id before ``upto`` changed (the graph is not rebuilt)."""
    perturbed = data.clone()
    perturbed["token"].x = data["token"].x.clone()
    perturbed["token"].x[:upto] = (data["token"].x[:upto] + 7) % 256
    return perturbed


def _logits_after(model, data, cut_at: int, site=None, dropped=()) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits at positions >= cut_at, on ``data`` and with every token before cut_at changed."""
    with torch.no_grad(), R.cut_routes(model, site, dropped):
        return model(data)[cut_at:], model(_perturbed(data, cut_at))[cut_at:]


def test_a_cut_route_carries_nothing_across_the_cut_and_an_open_one_does(model, sequence):
    """Chains cut and every gluing edge dropped: no position after the cut sees a token before it. Leave
    either route open and it does (so the cut is what closes it)."""
    _, data = sequence
    cut_at = 300
    all_glue = list(range(len(GLUE_EDGES)))
    chains_cut = R.cut_chains(data, torch.tensor([cut_at]))
    a, b = _logits_after(model, data, cut_at, chains_cut, all_glue)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for site, dropped in ((None, all_glue), (chains_cut, [])):
        a, b = _logits_after(model, data, cut_at, site, dropped)
        assert (a - b).abs().max() > 1e-3


def test_a_cover_cut_leaves_the_patches_blind_to_the_tokens(model, sequence):
    _, data = sequence
    patches = flatten_site(data).patches
    seen = []
    hook = model.blocks[0].glue.register_forward_pre_hook(lambda glue, args: seen.append(args[0][patches]))
    try:
        for cover in (False, True):
            seen.clear()
            with torch.no_grad(), R.cut_routes(model, cover=cover):
                model(data), model(_perturbed(data, data["token"].num_nodes))
            assert torch.allclose(seen[0], seen[1]) == (not cover)
    finally:
        hook.remove()


def test_cut_routes_removes_its_hooks(model, sequence):
    seq, data = sequence
    before = R.next_token_loss(model, data, seq)["loss"]
    with R.cut_routes(model, R.cut_chains(data, R.section_cuts(seq)), [0, 1], cover=False):
        assert R.next_token_loss(model, data, seq)["loss"] != before
    assert all(not b._forward_pre_hooks and not b.topology._forward_hooks and not b.pool._forward_hooks
               for b in model.blocks)
    assert R.next_token_loss(model, data, seq)["loss"] == before


def test_route_losses_table_and_plot(model, sequence, tmp_path):
    seq, data = sequence
    result = R.route_losses(model, data, seq)
    routes = result["routes"]
    assert result["cuts"] == R.section_cuts(seq).numel()
    assert list(routes)[:6] == ["none", "token chain", "patch chains", "chains", "cover", "gluing"]
    used = [" ".join(GLUE_EDGES[i]) for i in R.glue_types_in_use(model, data)]
    assert list(routes)[6:] == used and "token matches output" in used and "local next local" in used
    assert len(result["value_copy_sources"]) == len(model.blocks)
    assert routes["none"] == R.next_token_loss(model, data, seq)
    assert all(np.isfinite(row["loss"]) for row in routes.values())
    assert all(routes[name]["loss"] != routes["none"]["loss"] for name in ("chains", "cover", "gluing"))
    text = R.format_routes(result)
    assert "patch chains" in text and "anchored" in text
    path = tmp_path / "routes.png"
    R.plot_routes(result, path)
    assert path.stat().st_size > 1000
    ssm = SheafStateLM(LT.learned_model_config(d_model=16).with_overrides(["gluing=false"]))
    with pytest.raises(ValueError, match="gluing switched off"):
        R.route_losses(ssm, data, seq)


def test_random_score_loss_restores_the_scorer(model, sequence):
    seq, data = sequence
    trained = R.next_token_loss(model, data, seq)
    random = R.random_score_loss(model, data, seq)
    assert np.isfinite(random["loss"]) and random["loss"] != trained["loss"]
    assert not any(block.topology.random_scores for block in model.blocks)
    assert R.next_token_loss(model, data, seq)["loss"] == trained["loss"]


def test_run_learned_with_the_chains_cut_at_the_keys():
    """--cut-chains trains and evaluates on cut sites: the eval loss is the 'none' route's, and cutting the
    chains again at the same keys changes nothing."""
    torch.set_num_threads(1)
    result = LT.run_learned(n_train=1024, n_eval=512, steps=2, window=256, d_model=16, growth_ns=(256, 512),
                            config=SHORT_SECTIONS, cut_chains_at_keys=True)
    assert result["cut_chains_at_keys"] and result["routes"]["cuts"] >= 4
    routes = result["routes"]["routes"]
    assert routes["none"] == result["loss_after"] == routes["chains"] == routes["token chain"]
    seqs = [Y.generate(257, seed=s, config=SHORT_SECTIONS) for s in (1, 2)]
    with pytest.raises(ValueError, match="cuts need batch 1"):
        LT.train_learned(SheafStateLM(LT.learned_model_config(d_model=16)), [s.ids for s in seqs],
                         Y.matched_site_config(), steps=1, window=256, batch=2,
                         cuts=[R.section_cuts(s) for s in seqs])


def test_anchored_ordinal_counts_the_anchored_letters_of_each_section(sequence):
    seq, _ = sequence
    ordinal = R.anchored_ordinal(seq)
    anchored = seq.kind == Y.Kind.ANCHORED
    assert ((ordinal >= 0) == anchored).all()
    keys = seq.key_pos[anchored]
    for key in torch.unique(keys):  # 0, 1, 2, ... in each section, in order
        assert torch.equal(ordinal[anchored][keys == key], torch.arange(int((keys == key).sum())))



def test_next_token_loss_splits_the_anchored_letters_by_ordinal(model, sequence):
    seq, data = sequence
    row = R.next_token_loss(model, data, seq)
    assert list(row["anchored_by_ordinal"]) == list(R.ORDINAL_GROUPS)
    first = R.anchored_ordinal(seq)[1:] == 0  # targets that are a section's first anchored letter
    with torch.no_grad():
        ce = torch.nn.functional.cross_entropy(model(data)[:-1], seq.ids[1:], reduction="none")
    assert row["anchored_by_ordinal"]["1st"] == pytest.approx(float(ce[first].mean()), rel=1e-6)


def test_value_copy_sources_classify_each_copy_by_its_strongest_content_edge(model, sequence):
    seq, data = sequence
    entity = seq.dep_type == Y.DEP_TYPES.index("entity")
    assert entity.sum() >= 3
    counts = R.value_copy_sources(model, data, seq)
    assert len(counts) == len(model.blocks)
    for b, row in enumerate(counts):
        assert sum(row.values()) == int(entity.sum())
        edges = model.topology(data, block=b)[CONTENT_EDGE]  # the strongest edge by brute force
        best = {}
        for s, t, w in zip(*edges["edge_index"].tolist(), edges["weight"].tolist()):
            if t not in best or w > best[t][1]:
                best[t] = (s, w)
        listed = sum(best.get(d - 1, (-1,))[0] == s for s, d in zip(seq.src[entity].tolist(), seq.dst[entity].tolist()))
        none = sum(d - 1 not in best for d in seq.dst[entity].tolist())
        assert (row["listed"], row["none"]) == (listed, none)
