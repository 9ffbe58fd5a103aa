"""The learned topology: pools larger than what is kept, one competition per destination,
softmax weights with a "nothing" candidate, causal content and random proposals."""
import pytest
import torch

import sheafgnn.nn.pools as pools_module
import sheafgnn.nn.segment as segment_module
import sheafgnn.nn.topology as topology_module
from sheafgnn.model import Extras, SheafStateLM, topology_input
from sheafgnn.nn.pools import pool_dot, pool_read
from sheafgnn.nn.proposals import (
    content_blocks,
    random_proposals,
    summarize_blocks,
    summary_query,
    summary_width,
    top_blocks,
)
from sheafgnn.nn.segment import HAS_TORCH_SCATTER, HAS_TORCH_SPARSE
from sheafgnn.nn.topology import LearnedTopology, TopologyConfig, TopologyInput
from sheafgnn.site import build_site
from sheafgnn.site.flat import FLAT_TYPES, flatten_site
from sheafgnn.site.schema import CONTENT_EDGE, GLUE_EDGES, RANDOM_EDGE

from .conftest import CODE, PROSE, assert_logits_causal, small_model_config


def test_random_proposals_seeded_and_causal():
    position = torch.arange(200)
    start = torch.zeros(200, dtype=torch.long)
    a = random_proposals(position, start, 6, seed=3)
    assert a.shape == (200, 6)
    assert torch.equal(a, random_proposals(position, start, 6, seed=3))  # a pure function of (seed, position)
    assert not torch.equal(a, random_proposals(position, start, 6, seed=4))
    assert ((a >= 0) & (a <= position[:, None])).all()  # past tokens (and the token itself) only
    # the same position draws the same tokens whatever the length of the text or where its graph starts
    assert torch.equal(random_proposals(position[:50], start[:50], 6, seed=3), a[:50])
    assert torch.equal(random_proposals(position[:50], start[:50] + 1000, 6, seed=3), a[:50] + 1000)
    assert len(set(a[150:].flatten().tolist())) > 100  # spread over the past, not a fixed few tokens


def test_content_blocks_pick_the_matching_complete_block():
    B, n, r = 4, 24, 3
    keys = torch.zeros(n, r)
    keys[9] = torch.tensor([0.0, 8.0, 0.0])  # block 2 (tokens 8..11) holds the matching key
    keys[17] = torch.tensor([0.0, 0.0, 8.0])  # block 4 (tokens 16..19): another key
    query = torch.zeros(n, r)
    query[:, 1] = 1.0
    position = torch.arange(n)
    blocks = content_blocks(query, keys, position, torch.zeros(n, dtype=torch.long), B, num_blocks=2)
    assert blocks.shape == (n, 2)
    assert (blocks[:4] == -1).all()  # no complete block before position 4
    assert blocks[5].tolist() == [0, -1]  # one block qualifies (tokens 0..3 end before 5)
    assert (blocks[12:, 0] == 8).all()  # the matching block wins once it is complete (time 11 < 12)
    assert (blocks[:12, 0] != 8).all()  # ... and never before
    # every chosen block ends strictly before its destination
    chosen = blocks >= 0
    assert ((blocks + B - 1)[chosen] < position[:, None].expand_as(blocks)[chosen]).all()


def test_content_blocks_stay_in_their_graph():
    B = 4
    position = torch.cat([torch.arange(10), torch.arange(12)])  # two graphs in one batch
    graph_start = torch.cat([torch.zeros(10, dtype=torch.long), torch.full((12,), 10)])
    keys, query = torch.randn(22, 5), torch.randn(22, 5)
    blocks = content_blocks(query, keys, position, graph_start, B, num_blocks=3)
    chosen = blocks >= 0
    assert (blocks[:10][chosen[:10]] < 10).all() and (blocks[10:][chosen[10:]] >= 10).all()
    assert chosen[10:].sum(1).tolist() == [0] * 4 + [1] * 4 + [2] * 4  # blocks complete before each position


def _selection(model, data, block=0):
    model.eval()
    with torch.no_grad():
        _, infos, site = model._forward(data, Extras(candidates=True))
    return infos[block]["selection"], site


def test_weights_sum_to_one_minus_sink(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology_k=5))
    with torch.no_grad():
        for block in model.blocks:
            block.topology.sink.normal_()
    sel, site = _selection(model, build_site(PROSE, model.config.site_config))
    dst = sel.edge_index[1]
    total = torch.zeros(site.num_nodes).index_add_(0, dst, sel.weight)
    exp_sum = torch.zeros(site.num_nodes).index_add_(0, dst, sel.score.exp())
    sink = model.blocks[0].topology.sink[site.node_type].exp()
    has = torch.bincount(dst, minlength=site.num_nodes) > 0
    assert torch.allclose(total[has], (exp_sum / (exp_sum + sink))[has], atol=1e-5)
    assert (total[has] < 1).all()
    # a destination keeps at most k, and every output keeps exactly k (its pool is larger)
    counts = torch.bincount(dst, minlength=site.num_nodes)
    assert counts.max() == 5 and (counts[site.outputs][8:] == 5).all()


def test_sink_can_take_no_message(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config))
    with torch.no_grad():
        model.blocks[0].topology.sink.fill_(30.0)
    sel, _ = _selection(model, build_site(PROSE, model.config.site_config))
    assert sel.weight.max() < 1e-9


def test_sink_threshold_keeps_only_what_outscores_nothing(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology_k=5, sink_threshold=True))
    site_config = model.config.site_config
    topology = model.blocks[0].topology
    torch.manual_seed(0)
    plain = SheafStateLM(small_model_config(full_config, topology_k=5))
    kept_at_init = _selection(model, build_site(PROSE, site_config))[0].edge_index
    assert torch.equal(kept_at_init, _selection(plain, build_site(PROSE, site_config))[0].edge_index)  # sink at -4
    with torch.no_grad():
        topology.sink.fill_(0.05)
    sel, site = _selection(model, build_site(PROSE, site_config))
    pool_index, _, pool_score = sel.candidates
    sink = topology.sink[site.node_type]  # (N,)
    assert (sel.score > sink[sel.edge_index[1]]).all()
    # each destination keeps min(k, its candidates above the sink): the threshold drops some, the top-k others
    above = torch.bincount(pool_index[1][pool_score > sink[pool_index[1]]], minlength=site.num_nodes)
    kept = torch.bincount(sel.edge_index[1], minlength=site.num_nodes)
    assert torch.equal(kept, above.clamp(max=5))
    assert (above > 5).any() and ((above > 0) & (above < 5)).any()
    with torch.no_grad():
        topology.sink.fill_(30.0)
    assert _selection(model, build_site(PROSE, site_config))[0].edge_index.size(1) == 0


def test_sink_threshold_trains_straight_through(full_config):
    """In training the candidates below the sink stay with weight exactly 0 (the logits equal evaluation's)
    and a gradient on their scores; in evaluation they are dropped."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology_k=5, sink_threshold=True))
    data = build_site(PROSE, model.config.site_config)
    with torch.no_grad():
        for block in model.blocks:
            block.topology.sink.fill_(0.05)
        logits_eval = model.eval()(data)
    model.train()
    torch.testing.assert_close(model(data), logits_eval)
    _, infos, site = model._forward(data)
    sel = infos[0]["selection"]
    below = sel.score <= model.blocks[0].topology.sink[site.node_type[sel.edge_index[1]]]
    assert below.any() and (sel.weight[below] == 0).all() and (sel.weight[~below] > 0).all()
    assert sel.edge_index.size(1) == _selection(model, data)[0].edge_index.size(1) + int(below.sum())
    # the straight-through gradient, on the competition itself
    topology = LearnedTopology(8, 3, 2, k=3, content_type=1, random_type=2, sink_threshold=True)
    score = torch.tensor([[2.0, -1.0, 0.5, -3.0], [-2.0, -1.5, -1.0, -4.0]], requires_grad=True)
    sink = torch.zeros(2, 1)
    top, pick, weight = topology.compete_dense(score, sink)
    below = top <= 0
    assert below.tolist() == [[False, False, True], [True, True, True]] and (weight[below] == 0).all()
    (weight * torch.arange(1.0, 7.0).view(2, 3)).sum().backward()
    assert (score.grad[1, :3] != 0).all() and score.grad[1, 3] == 0  # below the sink, kept: a gradient
    top_eval, _, weight_eval = topology.eval().compete_dense(score.detach(), sink)
    assert torch.isinf(top_eval[below]).all() and torch.equal(weight_eval, weight.detach())


def test_pools_are_larger_than_what_is_kept(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config))
    data = build_site((PROSE + CODE) * 4, model.config.site_config)
    top = model.topology(data)
    candidates = sum(entry["num_candidates"] for entry in top.values())
    kept = sum(entry["edge_index"].size(1) for entry in top.values())
    assert candidates >= 4 * kept, (candidates, kept)
    assert top[CONTENT_EDGE]["num_candidates"] > 0 and top[RANDOM_EDGE]["num_candidates"] > 0
    # the reported counts are the pools themselves
    sel, _ = _selection(model, data, block=-1)
    pool_types = sel.candidates[1]
    assert torch.equal(torch.bincount(pool_types, minlength=len(GLUE_EDGES)), sel.num_candidates)


def test_scores_are_on_the_gradient_path(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config))
    data = build_site(PROSE, model.config.site_config)
    data["token"].y = torch.roll(data["token"].x, -1)
    model.loss(data).backward()
    topo = model.blocks[0].topology
    for p in (topo.query.weight, topo.key.weight, topo.key_previous.weight, topo.query_norm.weight,
              topo.key_norm.weight, topo.type_bias, topo.sink):
        assert p.grad is not None and p.grad.abs().sum() > 0


@pytest.mark.parametrize("qk_norm", [True, False])
def test_qk_norm_bounds_the_scores(full_config, qk_norm):
    # With QK-norm a query and a key have norm sqrt(r) times their gains (1 at init), so however large the
    # projections grow, |<q, k>| / sqrt(r) <= sqrt(r) (+ the type bias, 0 at init); without it the scores grow with
    # the projections.
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology={"qk_norm": qk_norm}))
    for block in model.blocks:
        for linear in (block.topology.query, block.topology.key, block.topology.key_previous):
            linear.weight.data.mul_(100.0)
    data = build_site(PROSE, model.config.site_config)
    largest = max(float(entry["candidate_score"].abs().max())
                  for top in model.topology(data, block=None, candidates=True) for entry in top.values()
                  if entry["candidate_score"].numel())
    rank = model.config.topology.rank
    assert (largest <= rank**0.5 + 1e-4) == qk_norm, largest


@pytest.mark.parametrize("text,block_summary,sink_threshold",
                         [(PROSE, "mean", False), (CODE, "mean", False), (PROSE, "bounds", False),
                          (CODE, "mean", True)])
def test_causal_with_content_proposals(text, block_summary, sink_threshold, full_config):
    """Every patch type on, content proposals from small blocks so short texts have many."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, proposal_block=4, content_blocks=3, num_experts=2,
                                            block_summary=block_summary, sink_threshold=sink_threshold))
    sel, _ = _selection(model, build_site(text, model.config.site_config))
    assert (sel.edge_type == GLUE_EDGES.index(CONTENT_EDGE)).sum() > 0  # content edges are kept
    assert_logits_causal(model, text, trials=4)


def test_block_bounds_bound_the_best_token_score():
    """The "bounds" summary scores a block at least as high as its best token, and exactly that for a
    block of one token; "mean" scores the mean of its tokens' scores."""
    torch.manual_seed(0)
    keys, query = torch.randn(50, 4, 8), torch.randn(7, 8)  # 50 blocks of 4 tokens, rank 8
    best = torch.einsum("qr,jbr->qjb", query, keys).amax(-1)  # (7, 50)
    bound = summary_query(query, "bounds") @ summarize_blocks(keys, "bounds").T
    assert (bound >= best - 1e-5).all() and (bound > best + 1e-3).any()
    single = summary_query(query, "bounds") @ summarize_blocks(keys[:, :1], "bounds").T
    torch.testing.assert_close(single, query @ keys[:, 0].T)
    mean = summary_query(query, "mean") @ summarize_blocks(keys, "mean").T
    torch.testing.assert_close(mean, torch.einsum("qr,jbr->qjb", query, keys).mean(-1))
    for kind in ("mean", "bounds"):
        assert summarize_blocks(keys, kind).size(-1) == summary_width(8, kind) == summary_query(query, kind).size(-1)


def test_planted_future_proposal_is_caught(full_config, monkeypatch):
    """The perturbation check fails when a proposal reads the future."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, validate_sites=False))
    with torch.no_grad():
        for block in model.blocks:
            block.topology.type_bias[block.topology.random_type] = 10.0  # make sure the planted edge is kept

    def future(position, graph_start, count, seed=0):
        last = torch.full((position.numel(), count), position.numel() - 1)
        return graph_start.view(-1, 1) + last  # the last token of the text: the future of every earlier position

    monkeypatch.setattr(topology_module, "random_proposals", future)
    with pytest.raises(AssertionError, match="depend on the future"):
        assert_logits_causal(model, PROSE, trials=2)


def test_random_score_ablation_changes_the_choice(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config))
    data = build_site(PROSE, model.config.site_config)
    learned, _ = _selection(model, data)
    for block in model.blocks:
        block.topology.random_scores = True
    ablated, _ = _selection(model, data)
    assert learned.edge_index.shape != ablated.edge_index.shape or not torch.equal(learned.edge_index,
                                                                                   ablated.edge_index)


def test_topology_input_and_repr(full_config):
    model = SheafStateLM(small_model_config(full_config))
    site = flatten_site(build_site(PROSE, model.config.site_config))
    inp = topology_input(site)
    assert inp.outputs == site.outputs and inp.token_pos.numel() == site.tokens.stop
    topo = model.blocks[0].topology
    assert isinstance(topo, LearnedTopology) and topo.sink.numel() == len(FLAT_TYPES)
    assert str(topo) == (f"LearnedTopology(32, num_edge_types={len(GLUE_EDGES)}, k=8, qk_norm=True, content_blocks=16, "
                         "block_size=4, random_proposals=4, block_scorer=False, block_summary='bounds', "
                         "sink_threshold=False, explore=0.0, key_previous_init='query')")
    with pytest.raises(ValueError, match="block_summary must be one of"):
        LearnedTopology(32, 3, 2, k=1, content_type=1, random_type=2, block_summary="max")
    with pytest.raises(ValueError, match="k, rank and block_size"):
        LearnedTopology(32, 3, 2, k=0, content_type=1, random_type=2)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("graphs", ["one", "several"])
def test_top_blocks_masks_exactly_the_columns_out_of_range(seed, graphs):
    """top_blocks masks only the columns outside [max(first), min(last)); it picks what a full mask picks:
    rows of one graph (consecutive positions: a common first block, the last ones differ by a few), and
    of several graphs (different first blocks; some rows with fewer than m blocks, some with none)."""
    g = torch.Generator().manual_seed(seed)
    R, C, col0, m = 12, 20, 5, 3
    score = torch.randn(R, C, generator=g)
    if graphs == "one":
        first = torch.full((R,), col0)
        last = col0 + C - torch.randint(0, 6, (R,), generator=g)
    else:
        first = torch.randint(col0, col0 + 8, (R,), generator=g)
        last = first + torch.randint(0, 12, (R,), generator=g)
    col = torch.arange(col0, col0 + C)
    ok = (col >= first.unsqueeze(1)) & (col < last.unsqueeze(1))
    top, pick = score.masked_fill(~ok, float("-inf")).topk(C, dim=1)  # every column, best first
    ranked = torch.where(torch.isfinite(top), col0 + pick, -1)
    assert torch.equal(top_blocks(score.clone(), first, last, m, col0), ranked[:, :m])
    if graphs == "one":  # first None: every row from col0, as a stream's one row per stream passes it
        assert torch.equal(top_blocks(score.clone(), None, last, m, col0), ranked[:, :m])
    padded = torch.cat([ranked, ranked.new_full((R, 2), -1)], 1)  # more blocks asked for than there are columns
    assert torch.equal(top_blocks(score.clone(), first, last, C + 2, col0), padded)


SPMM_PATHS = ["torch"] + (["torch_scatter"] if HAS_TORCH_SCATTER and HAS_TORCH_SPARSE else [])  # + torch-sparse


@pytest.mark.parametrize("backend", SPMM_PATHS)
@pytest.mark.parametrize("chunk_elements", [None, 40])
def test_pool_dot_equals_the_gathered_dot_products(monkeypatch, backend, chunk_elements):
    """pool_dot (forward a chunk of rows at a time; backward: the keys gathered again and an index_add,
    or two SpMMs) equals the plain gather-mul-sum in value and gradients (gradcheck in float64), repeated
    sources included."""
    monkeypatch.setattr(segment_module, "_backend", backend)
    if chunk_elements is not None:  # 6 rows of 5 x 4 gathered elements in chunks of 2 rows
        monkeypatch.setattr(pools_module, "POOL_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(0)
    q = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    sources = torch.randint(0, 3, (6, 5))  # many repeats: the gradient of a key must accumulate
    torch.testing.assert_close(pool_dot(q, k, sources), (q.unsqueeze(1) * k[sources]).sum(-1))
    with torch.no_grad():  # one chunk without gradients: a plain bmm; several: the chunked forward
        torch.testing.assert_close(pool_dot(q, k, sources), (q.unsqueeze(1) * k[sources]).sum(-1))
    assert torch.autograd.gradcheck(lambda q, k: pool_dot(q, k, sources), (q, k))
    assert torch.autograd.gradcheck(lambda k: pool_dot(q.detach(), k, sources), (k,))  # grad_k alone
    with pytest.raises(ValueError, match="pool_dot"):
        pool_dot(q, k, sources[:3])


POOL_READ_PATHS = [("torch", 1 << 20), ("torch", 40)]  # one chunk; chunks of one row (P * D = 40)
if HAS_TORCH_SCATTER and HAS_TORCH_SPARSE:
    POOL_READ_PATHS.append(("torch_scatter", 1 << 20))  # torch-sparse's SpMM


@pytest.mark.parametrize("backend,chunk", POOL_READ_PATHS)
def test_pool_read_equals_the_plain_weighted_sum(monkeypatch, backend, chunk):
    """pool_read (candidate states gathered in chunks, again in backward; or one SpMM) equals the plain
    weighted gather-sum in value and in the weights' gradient, and gives the states none; LearnedTopology's
    pool read through it matches the softmax-weighted sum in the scores' and the sink's gradients."""
    monkeypatch.setattr(pools_module, "POOL_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(segment_module, "_backend", backend)
    torch.manual_seed(0)
    x = torch.randn(20, 8, dtype=torch.float64, requires_grad=True)
    sources = torch.randint(0, 20, (6, 5))
    weight = torch.rand(6, 5, dtype=torch.float64, requires_grad=True)
    fused = pool_read(weight, x.detach(), sources)
    plain = (weight.unsqueeze(-1) * x.detach()[sources]).sum(1)
    torch.testing.assert_close(fused, plain)
    grad = torch.randn_like(plain)
    torch.testing.assert_close(torch.autograd.grad(fused, weight, grad)[0], torch.autograd.grad(plain, weight, grad)[0])
    assert torch.autograd.grad(pool_read(weight, x, sources).sum(), x, allow_unused=True) == (None,)
    with pytest.raises(ValueError, match="pool_read"):
        pool_read(weight, x, sources[:, :3])

    topo = LearnedTopology(8, 3, 2, k=2, content_type=1, random_type=2).double()
    sources[1, 3:] = -1  # padding
    score = torch.randn(6, 5, dtype=torch.float64).masked_fill(sources < 0, float("-inf")).requires_grad_()
    sink = torch.randn(6, 1, dtype=torch.float64, requires_grad=True)
    read = topo._pool_read(x, score, sink, sources)
    softmax = torch.cat([score, sink], 1).softmax(1)[:, :-1]
    plain = (softmax.unsqueeze(-1) * x.detach()[sources.clamp(min=0)]).sum(1)
    torch.testing.assert_close(read, plain)
    for a, b in zip(torch.autograd.grad(read, (score, sink), grad), torch.autograd.grad(plain, (score, sink), grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("weight_name, read_name, scorer", [("pool_loss_weight", "pool_read", "query"),
                                                             ("block_loss_weight", "block_loss", "block_query")])
def test_auxiliary_losses_train_the_choice_in_training_only(full_config, weight_name, read_name, scorer):
    """The pool read (an auxiliary loss over every candidate) and the block scorer's distillation reach
    scores the top-k passes no gradient to; only the training loss asks for them, and they never change
    the logits."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology_k=1, block_scorer=True))
    data = build_site(PROSE, model.config.site_config)
    data["token"].y = torch.roll(data["token"].x, -1)
    logits_train = model(data).detach()  # with gradients on, as the next call: the same (fused) ops
    sel, _ = _selection(model, data)  # eval mode
    assert getattr(sel, read_name) is None
    assert torch.allclose(model(data), logits_train)  # the auxiliary loss is not on the output path
    model.train()
    weight = getattr(model.blocks[0].topology, scorer).weight
    setattr(model.config.topology, weight_name, 0.0)
    model.loss(data).backward()
    without = torch.zeros_like(weight) if weight.grad is None else weight.grad.clone()
    model.zero_grad()
    setattr(model.config.topology, weight_name, 1.0)
    model.loss(data).backward()
    assert not torch.allclose(weight.grad, without)  # the auxiliary loss adds a gradient to the scorer
    with pytest.raises(ValueError, match=weight_name):
        small_model_config(full_config, **{weight_name: -1.0})


def _token_input(lengths: list[int]) -> TopologyInput:
    """A flat node order of tokens then outputs (output i reads token i) for graphs of ``lengths`` tokens;
    only the parts :meth:`LearnedTopology._block_read` reads are real."""
    n = sum(lengths)
    position = torch.cat([torch.arange(m) for m in lengths])
    graph_start = torch.cat([torch.full((m,), s) for m, s in zip(lengths, torch.tensor([0, *lengths]).cumsum(0))])
    node_type = torch.cat([torch.zeros(n, dtype=torch.long), torch.full((n,), FLAT_TYPES.index("output"))])
    empty = torch.zeros(2, 0, dtype=torch.long)
    return TopologyInput(empty, empty[0], torch.zeros(2 * n + 1, dtype=torch.long), node_type, slice(0, n),
                         slice(n, 2 * n), position, graph_start)


def test_block_distillation_by_hand():
    """The block scorer's loss: KL from the token competition's weights summed over each output's chosen
    blocks (detached) to the block scores' softmax over them, weighted by the teacher's mass; its
    gradient reaches the block scorer only."""
    torch.manual_seed(0)
    B, m, lengths = 4, 2, [13, 9]
    inp, n = _token_input(lengths), sum(lengths)
    topo = LearnedTopology(6, 3, len(FLAT_TYPES), k=2, content_type=1, random_type=2, rank=3, content_blocks=m,
                           block_size=B, block_scorer=True, block_summary="mean").double()
    x = torch.randn(2 * n, 6, dtype=torch.float64)
    tokens = x[inp.tokens]
    query, keys = topo.block_query(x[inp.outputs]), topo.block_token_keys(tokens, topo._previous(tokens, inp))
    blocks = content_blocks(query, keys, inp.token_pos, inp.token_graph_start, B, m)  # (n, m)
    score = torch.randn(n, m * B + 3, dtype=torch.float64)
    score[:, : m * B][blocks.repeat_interleave(B, 1) < 0] = float("-inf")  # no tokens where no block
    score.requires_grad_()
    sink = torch.randn(n, 1, dtype=torch.float64)
    loss = topo.block_distillation(query, keys, inp, blocks, score, sink)

    total = weights = 0.0
    for v in range(n):
        chosen = [int(b) for b in blocks[v] if b >= 0]
        if len(chosen) < 2:
            continue
        token_weight = torch.cat([score[v], sink[v]]).softmax(0).detach()
        teacher = torch.stack([token_weight[j * B : j * B + B].sum() for j in range(len(chosen))])
        mass = teacher.sum()
        student = torch.stack([query[v] @ keys[b : b + B].mean(0) for b in chosen]) / 3 ** 0.5
        target = teacher / mass
        total = total + mass * (target * (target.log() - student.log_softmax(0))).sum()
        weights = weights + mass
    assert weights > 0
    torch.testing.assert_close(loss, total / weights)
    params = (topo.block_query.weight, topo.block_key.weight, topo.block_key_previous.weight)
    for a, b in zip(torch.autograd.grad(loss, params, retain_graph=True), torch.autograd.grad(total / weights, params)):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b)
    assert torch.autograd.grad(loss, score, allow_unused=True)[0] is None  # the teacher is detached


def test_keep_cost_is_the_expected_kept_edges_per_node(full_config):
    """The loss with keep_cost c is the loss without it plus c * sum over every block's kept edges of
    sigmoid(s_e - s_sink) / nodes, in training; its gradient raises the sinks."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, keep_cost=0.5, sink_threshold=True)).train()
    data = build_site(PROSE, model.config.site_config)
    data["token"].y = torch.roll(data["token"].x, -1)
    with_cost = model.loss(data)
    sinks = [block.topology.sink for block in model.blocks]
    sink_grad = torch.autograd.grad(with_cost, sinks)
    model.config.topology.keep_cost = 0.0
    plain = model.loss(data)
    expected = 0.0
    _, infos, site = model._forward(data)
    for block, info in zip(model.blocks, infos):
        sel = info["selection"]
        expected += torch.sigmoid(sel.score - block.topology.sink[site.node_type[sel.edge_index[1]]]).sum()
    torch.testing.assert_close(with_cost - plain, 0.5 * expected / site.num_nodes)
    plain_grad = torch.autograd.grad(model.loss(data), sinks)
    assert all((a - b).sum() < 0 for a, b in zip(sink_grad, plain_grad))  # descent raises the sinks
    with pytest.raises(ValueError, match="keep_cost"):
        small_model_config(full_config, keep_cost=-1.0)


def test_explore_samples_the_kept_set_in_training_only():
    """Gumbel-top-k: in training the kept k are a sample from softmax(score / explore) without replacement, their
    weights the softmax of the true scores; evaluation keeps the top k; the global generator is left alone."""
    topo = LearnedTopology(8, 3, 2, k=2, content_type=1, random_type=2, explore=2.0)
    score = torch.randn(256, 6).masked_fill(torch.arange(6) == 5, float("-inf")).requires_grad_()  # col 5: padding
    sink = torch.zeros(256, 1)
    plain = LearnedTopology(8, 3, 2, k=2, content_type=1, random_type=2)
    for a, b in zip(topo.eval().compete_dense(score, sink), plain.compete_dense(score, sink)):
        assert torch.equal(a, b)  # evaluation: the top k, no noise
    topo.train()
    rng = torch.get_rng_state()
    top, pick, weight = topo.compete_dense(score, sink)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(top, score.gather(1, pick)) and not (pick == 5).any()  # true scores, never the padding
    torch.testing.assert_close(weight, torch.cat([top, sink], 1).softmax(1)[:, :-1])
    assert (pick != score.topk(2).indices).any(1).float().mean() > 0.3  # the sample often leaves the top 2
    weight.sum().backward()
    kept = torch.zeros_like(score, dtype=torch.bool).scatter_(1, pick, True)
    assert (score.grad[~kept] == 0).all() and (score.grad[kept] != 0).all()
    # the first pick is distributed as softmax(score / explore) (Gumbel-max)
    row = torch.tensor([[2.0, 0.0, -2.0, float("-inf")]]).expand(20000, 4)
    first = topo.compete_dense(row, torch.zeros(20000, 1))[1][:, 0]
    torch.testing.assert_close(torch.bincount(first, minlength=4).float() / 20000, (row[0] / 2.0).softmax(0),
                               atol=0.015, rtol=0)
    # the listed competition samples the same way: k per destination, weights from the true scores
    dst = torch.arange(64).repeat_interleave(5)
    edge_score = torch.randn(320)
    keep, edge_weight = topo.compete_sparse(edge_score, dst, torch.zeros(64))
    assert torch.equal(torch.bincount(dst[keep], minlength=64), torch.full((64,), 2))
    assert (keep != plain.compete_sparse(edge_score, dst, torch.zeros(64))[0]).any()
    kept_dst, kept_score = dst[keep], edge_score[keep]
    logits = torch.cat([kept_score, torch.zeros(64)])
    expected = logits.exp() / torch.zeros(64).index_add(0, torch.cat([kept_dst, torch.arange(64)]), logits.exp())[
        torch.cat([kept_dst, torch.arange(64)])]
    torch.testing.assert_close(edge_weight, expected[:128])
    with pytest.raises(ValueError, match="explore must be >= 0"):
        LearnedTopology(8, 3, 2, k=2, content_type=1, random_type=2, explore=-1.0)
    with pytest.raises(ValueError, match="explore must be >= 0"):
        TopologyConfig(explore=-1.0)


def test_key_previous_init_query_ranks_the_token_after_a_match_high():
    """key_previous_init="query": W_k' starts as a copy of W_q (the block scorer's too) and every other weight as
    under "random"; so at init the key of a token whose predecessor is v's token scores high against v's query,
    where under "random" it scores as any other."""
    def build(init: str) -> LearnedTopology:
        torch.manual_seed(0)
        return LearnedTopology(32, 3, 2, k=2, content_type=1, random_type=2, block_scorer=True,
                               key_previous_init=init)

    random_init, query_init = build("random"), build("query")
    assert torch.equal(query_init.key_previous.weight, query_init.query.weight)
    assert torch.equal(query_init.block_key_previous.weight, query_init.block_query.weight)
    assert not torch.equal(random_init.key_previous.weight, random_init.query.weight)
    for name in ("query", "key", "block_query", "block_key"):  # the draws are those of "random"
        assert torch.equal(getattr(query_init, name).weight, getattr(random_init, name).weight)
    query_init.key_previous.weight.data.zero_()
    query_init.reset_parameters()  # ties again
    assert torch.equal(query_init.key_previous.weight, query_init.query.weight)

    x, x_before = torch.randn(2, 256, 32).unbind(0)  # (256, D): a destination v and a token u after u - 1
    def scores(topo: LearnedTopology, previous: torch.Tensor) -> torch.Tensor:
        q = topo.query_norm(topo.query(x))
        k = topo.key_norm(topo.key(x_before) + topo.key_previous(previous))
        return (q * k).sum(-1) / topo.rank ** 0.5  # (256,)
    with torch.no_grad():  # u - 1 is v's token, or another's; a score lies within +-sqrt(r) = +-4
        gain = {init: scores(topo, x) - scores(topo, x.roll(1, 0)) for init, topo in
                (("random", random_init), ("query", query_init))}
    assert gain["query"].mean() > 2.0 and (gain["query"] > 0).float().mean() > 0.95
    assert gain["random"].mean().abs() < 0.5 and 0.2 < (gain["random"] > 0).float().mean() < 0.8  # a coin flip
    with pytest.raises(ValueError, match="key_previous_init must be one of"):
        LearnedTopology(8, 3, 2, k=2, content_type=1, random_type=2, key_previous_init="key")
    with pytest.raises(ValueError, match="key_previous_init must be one of"):
        TopologyConfig(key_previous_init="copy")


def test_explore_keeps_only_pool_members(full_config):
    """In training with explore the kept edges are still members of each destination's (causal) pool."""
    torch.manual_seed(0)
    model = SheafStateLM(small_model_config(full_config, topology={"explore": 1.0})).train()
    data = build_site((PROSE + CODE) * 2, model.config.site_config)
    assert model.blocks[0].topology.explore == 1.0
    _, infos, _ = model._forward(data, Extras(candidates=True))
    for info in infos:
        sel = info["selection"]
        pool = set(map(tuple, sel.candidates[0].t().tolist()))
        assert set(map(tuple, sel.edge_index.t().tolist())) <= pool
    top_k = _selection(model, data)[0].edge_index  # evaluation: the top k
    assert set(map(tuple, top_k.t().tolist())) != set(map(tuple, infos[0]["selection"].edge_index.t().tolist()))
    model.train()
    model(data).logsumexp(-1).mean().backward()  # the sampled selection trains like the top k
    assert all(p.grad is not None for p in model.blocks[0].topology.query.parameters())
