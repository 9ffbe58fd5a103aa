
import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch_geometric.data import Batch

from sheafgnn.memory import (
    HUGE_PAGES_VARIABLE,
    MMAP_THRESHOLD,
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_VARIABLE,
    TRIM_THRESHOLD,
    bound_onednn_cache,
)
from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.nn import experts as experts_module
from sheafgnn.nn.experts import ExpertsConfig, FeedForward, PatchExperts, _LeanFeedForward, feed_forward_reference
from sheafgnn.nn.quant import QuantConfig
from sheafgnn.nn.segment import topk_per_group, use_backend
from sheafgnn.nn.ssm import SSMConfig
from sheafgnn.nn.topology import TopologyConfig
from sheafgnn.site import CANDIDATE_EDGES, SiteConfig, build_site
from sheafgnn.site.schema import GLUE_EDGES

from .conftest import CODE, PROSE, assert_logits_causal, small_model_config

_config = small_model_config


def _with_targets(data):
    ids = data["token"].x
    data["token"].y = torch.cat([ids[1:], ids.new_full((1,), -100)])
    return data


@pytest.mark.parametrize("text", [PROSE, CODE])
@pytest.mark.parametrize("map_kind,projections", [("diag", True), ("orthogonal", True), ("diag", False)])
def test_causal_end_to_end(text, map_kind, projections, full_config):
    """Logits at positions <= t do not depend on text after t (every patch type on; the pool and broadcast with
    and without their linears)."""
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, map_kind=map_kind, num_experts=2, gluing={"projections": projections}))
    assert_logits_causal(model, text, trials=3)


def test_the_default_site_is_causal_end_to_end():
    """The default's own site (workspace and output patches, no random proposals) at a tiny width."""
    torch.manual_seed(0)
    model = SheafStateLM(SheafStateConfig(d_model=32, ssm={"headdim": 16, "chunk_size": 16}))
    assert model.config.site == SiteConfig() and model.config.topology.random_proposals == 0
    assert_logits_causal(model, PROSE + CODE, trials=3)


def test_perturbation_test_can_fail(full_config):
    """The causality check above detects a leak when one is planted (and validation is off)."""
    model = SheafStateLM(_config(full_config, validate_sites=False)).eval()
    site_config = model.config.site_config
    raw = PROSE.encode()
    t = 60
    ga, gb = build_site(raw[: t + 1] + b"aaaa. ", site_config), build_site(raw[: t + 1] + b"zzzz. ", site_config)
    # plant a future edge: the first local window reads the last token
    for g in (ga, gb):
        g["token", "in", "local"].edge_index = torch.cat(
            [g["token", "in", "local"].edge_index, torch.tensor([[g["token"].num_nodes - 1], [0]])], 1)
    assert not torch.allclose(model(ga)[: t + 1], model(gb)[: t + 1], atol=1e-5)


def test_batch_equals_single_graphs(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config)).eval()
    graphs = [build_site(text, model.config.site_config) for text in (PROSE, "ab", CODE)]
    batched = model(Batch.from_data_list(graphs))
    single = torch.cat([model(g) for g in graphs])
    assert torch.allclose(batched, single, atol=1e-5)


@pytest.mark.needs("torch_scatter")
def test_backends_agree(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config))
    data = _with_targets(build_site(PROSE, model.config.site_config))
    grads = []
    for backend in ("torch_scatter", "torch"):
        model.zero_grad()
        with use_backend(backend):
            loss = model.loss(data)
            loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    for a, b in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(a, b, atol=1e-5)


def test_loss_falls(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config))
    data = _with_targets(build_site(PROSE, model.config.site_config))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = model.loss(data)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.6 * losses[0], losses


def test_topology_contract(full_config):
    k = 3
    model = SheafStateLM(_config(full_config, topology_k=k))
    data = build_site(PROSE, model.config.site_config)
    topology = model.topology(data)
    assert set(topology) == set(GLUE_EDGES)
    kept_per_destination = {}
    for edge_type, out in topology.items():
        src_type, _, dst_type = edge_type
        index = out["edge_index"]
        num = index.shape[1]
        assert index.shape[0] == 2 and out["score"].shape == out["weight"].shape == out["energy"].shape == (num,)
        assert ((out["weight"] > 0) & (out["weight"] < 1)).all()
        assert (out["energy"] >= 0).all()
        assert out["num_candidates"] >= num
        if edge_type in CANDIDATE_EDGES:  # kept rule edges are edges of the site
            site_edges = set(map(tuple, data[edge_type].edge_index.T.tolist()))
            assert set(map(tuple, index.T.tolist())) <= site_edges
        for d in index[1].tolist():
            kept_per_destination[(dst_type, d)] = kept_per_destination.get((dst_type, d), 0) + 1
        assert (data[src_type].time[index[0]] <= data[dst_type].time[index[1]]).all()
    # all edge types of a destination compete for one budget of k
    assert max(kept_per_destination.values()) == k
    # block=None: every block's topology from one forward pass, each the one that block=b returns
    every_block = model.topology(data, block=None, candidates=True)
    assert len(every_block) == len(model.blocks) >= 2
    for b, topology in enumerate(every_block):
        alone = model.topology(data, block=b, candidates=True)
        assert set(topology) == set(alone)
        for edge_type, out in topology.items():
            for key, value in out.items():
                other = alone[edge_type][key]
                assert torch.equal(value, other) if torch.is_tensor(value) else value == other


def test_topk_per_group():
    score = torch.tensor([0.1, 0.9, 0.5, 0.3, 0.7, 0.2])
    group = torch.tensor([0, 0, 0, 1, 1, 2])
    assert topk_per_group(score, group, 2).tolist() == [False, True, True, True, True, True]
    assert topk_per_group(score, group, 1).tolist() == [False, True, False, False, True, True]


def test_experts_routing_and_balance():
    torch.manual_seed(0)
    experts = PatchExperts(8, num_types=2, hidden_channels=16, num_experts=3)
    x = torch.randn(10, 8)
    out, balance = experts(x, [0, 4, 10])
    assert out.shape == (10, 8) and balance > 0
    # each type's slice goes through that type's experts only
    part, _ = experts._route(1, x[4:], None)
    assert torch.allclose(out[4:], part)
    with pytest.raises(ValueError, match="type_ptr must have 3 entries"):
        experts(x, [0, 10])
    with pytest.raises(ValueError, match="from 0 to x.size"):
        experts(x, [0, 4, 9])  # must cover x


@pytest.mark.parametrize("num_experts", [1, 3])
def test_experts_normalise_with_the_callers_norm(num_experts):
    torch.manual_seed(0)
    experts, norm = PatchExperts(8, num_types=2, hidden_channels=16, num_experts=num_experts), torch.nn.LayerNorm(8)
    torch.nn.init.normal_(norm.weight)
    x = torch.randn(10, 8, requires_grad=True)
    fused, _ = experts(x, [0, 4, 10], norm)
    plain, _ = experts(norm(x), [0, 4, 10])
    torch.testing.assert_close(fused, plain)
    grad = torch.randn(10, 8)
    wrt = [x, norm.weight, norm.bias, *experts.parameters()]
    for a, b in zip(torch.autograd.grad(fused, wrt, grad), torch.autograd.grad(plain, wrt, grad)):
        torch.testing.assert_close(a, b)


def _saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("with_norm", [False, True])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_lean_feed_forward_matches_plain_composition(with_norm, chunk_rows, monkeypatch):
    if chunk_rows is not None:  # 7 rows in chunks of 3, the last one short
        monkeypatch.setattr(experts_module, "FFN_CHUNK_ROWS", chunk_rows)
    torch.manual_seed(0)
    ffn = FeedForward(6, 10).double()
    norm = torch.nn.LayerNorm(6).double() if with_norm else None
    if norm is not None:  # not the identity init, so that the norm's gradients are checked too
        torch.nn.init.normal_(norm.weight)
        torch.nn.init.normal_(norm.bias)
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    norm_args = (norm.weight, norm.bias, norm.eps) if norm is not None else (None, None, 0.0)
    inputs = (x, ffn.fc.weight, ffn.fc.bias, ffn.proj.weight, ffn.proj.bias, *norm_args)
    differentiable = [t for t in inputs if isinstance(t, torch.Tensor)]
    grad = torch.randn(7, 6, dtype=torch.float64)
    lean, plain = ffn(x, norm), feed_forward_reference(*inputs)
    torch.testing.assert_close(lean, plain)
    for a, b in zip(torch.autograd.grad(lean, differentiable, grad), torch.autograd.grad(plain, differentiable, grad)):
        torch.testing.assert_close(a, b)
    torch.autograd.gradcheck(_LeanFeedForward.apply, inputs)
    # it keeps x (and the norm's per-row statistics), not the normed rows, fc(.) or gelu(fc(.))
    x = torch.randn(50, 6, dtype=torch.float64, requires_grad=True)
    weights = [ffn.fc.weight, ffn.fc.bias, ffn.proj.weight, *differentiable[5:]]
    kept = _saved_bytes(lambda: ffn(x, norm)) - sum(w.numel() * 8 for w in weights)
    assert kept == 50 * 6 * 8 + (2 * 50 * 8 if with_norm else 0)
    with torch.no_grad():  # inference takes the plain path
        torch.testing.assert_close(ffn(x, norm), feed_forward_reference(x, *inputs[1:]))


def test_ssm_ablation_has_no_gluing(full_config):
    model = SheafStateLM(_config(full_config, gluing=False))
    data = _with_targets(build_site(PROSE, model.config.site_config))
    assert model(data).shape == (data["token"].num_nodes, 256)
    assert not any("glue" in name for name, _ in model.named_parameters())
    with pytest.raises(ValueError, match="gluing switched off"):
        model.topology(data)


@pytest.mark.closed_gates
@pytest.mark.parametrize("shared", [False, True])
def test_token_residual_starts_as_its_ssm(full_config, shared):
    """With token_residual and the broadcast's gate at zero (gluing.gate_init 0) the sheaf model at initialisation
    computes what its ssm ablation computes: given the ssm's weights for the shared parts, the logits are equal;
    a causal model too."""
    torch.manual_seed(0)
    options = dict(token_residual=True, shared_experts=shared, shared_ssm=shared)
    sheaf = SheafStateLM(_config(full_config, **options, gluing={"gate_init": 0.0})).double().eval()
    ssm = SheafStateLM(_config(full_config, **options, gluing=False)).double().eval()
    state = sheaf.state_dict()
    for name, value in ssm.state_dict().items():
        if name.startswith("blocks.") and ".experts.experts.0." in name:  # the ssm's one expert: the tokens'
            state[name.replace(".experts.experts.0.", ".experts.experts.0.")].copy_(value)
        elif name in state and state[name].shape == value.shape:
            state[name].copy_(value)
    data = build_site(PROSE, sheaf.config.site_config)
    torch.testing.assert_close(sheaf(data), ssm(data), rtol=1e-12, atol=1e-12)
    with torch.no_grad():
        for block in sheaf.blocks:
            block.broadcast_gate.normal_(0.0, 0.1)
    assert not torch.allclose(sheaf(data), ssm(data), atol=1e-6)  # the gluing reaches the logits through it
    assert_logits_causal(sheaf, CODE, trials=2, atol=1e-8)


@pytest.mark.closed_gates
def test_broadcast_gate_starts_at_gate_init_and_moves_gate_scale_times_faster(full_config):
    """The gate is gate_scale times its parameter: it starts at gate_init, and one Adam step (which moves the
    parameter by about lr) moves it by about gate_scale * lr."""
    lr, gluing = 1e-3, {"gate_init": 0.1, "gate_scale": 10.0}
    model = SheafStateLM(_config(full_config, token_residual=True, gluing=gluing))
    block = model.blocks[0]
    torch.testing.assert_close(block.gate_scale * block.broadcast_gate, torch.full_like(block.broadcast_gate, 0.1))
    before = block.gate_scale * block.broadcast_gate.detach().clone()
    optimizer = torch.optim.Adam([block.broadcast_gate], lr=lr)
    data = _with_targets(build_site(PROSE, model.config.site_config))
    loss = torch.nn.functional.cross_entropy(model(data), data["token"].y)
    loss.backward()
    optimizer.step()
    moved = (block.gate_scale * block.broadcast_gate.detach() - before).abs()
    torch.testing.assert_close(moved[moved > 0], torch.full_like(moved[moved > 0], 10 * lr), rtol=1e-3, atol=0)
    assert (moved > 0).float().mean() > 0.9  # nearly every channel has a gradient
    with pytest.raises(ValueError, match="gate_scale must be > 0"):
        SheafStateConfig(gluing={"gate_scale": 0.0})


def test_generate(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config))
    prompt = torch.tensor(list(b"The cat "))
    out = model.generate(prompt, max_new_tokens=5, top_k=10)
    assert out.shape == (13,) and torch.equal(out[:8], prompt)
    with pytest.raises(ValueError, match="non-empty 1-D"):
        model.generate(torch.zeros(0, dtype=torch.long), 3)


def test_bad_input(full_config):
    model = SheafStateLM(_config(full_config))
    with pytest.raises(ValueError, match="stalk_dim must divide d_model"):
        SheafStateConfig(d_model=30, gluing={"stalk_dim": 4})
    with pytest.raises(ValueError, match="expected a site HeteroData"):
        model(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="no tokens"):
        model(build_site(""))
    data = build_site(PROSE)
    del data["memory"]
    with pytest.raises(ValueError, match=r"missing node types \['memory'\]"):
        model(data)
    big = build_site(PROSE)
    small = SheafStateLM(_config(full_config, vocab_size=50))
    with pytest.raises(ValueError, match="vocab_size 50"):
        small(big)
    with pytest.raises(ValueError, match="no targets"):
        model.loss(build_site(PROSE))
    leaky = build_site(PROSE, full_config)
    leaky["local", "next", "local"].edge_index = leaky["local", "next", "local"].edge_index.flip(0)
    with pytest.raises(ValueError, match=r"not a valid causal site: .*'local', 'next', 'local'\) is not causal"):
        model(leaky)


def test_config_round_trip(tmp_path, full_config):
    config = _config(full_config, map_kind="general")
    for suffix in (".yaml", ".json"):
        path = tmp_path / f"c{suffix}"
        if suffix == ".yaml":
            config.save(path)
        else:
            import json
            path.write_text(json.dumps(config.to_dict()))
        assert SheafStateConfig.load(path) == config
    path = tmp_path / "c.toml"
    path.write_text('d_model = 48\n[gluing]\nstalk_dim = 3\n[site]\nlocal_window = 4\n')
    loaded = SheafStateConfig.load(path)
    assert loaded.d_model == 48 and loaded.gluing.stalk_dim == 3 and loaded.site_config.local_window == 4
    with pytest.raises(ValueError, match="unknown fields"):
        SheafStateConfig.from_dict({"d_modle": 3})
    with pytest.raises(ValueError, match="TopologyConfig: unknown fields \\['rnak'\\]"):
        SheafStateConfig.from_dict({"topology": {"rnak": 3}})
    assert "d_model=32" in repr(config)
    assert config.with_overrides(["topology.rank=64"]).topology.rank == 64


def test_the_config_has_a_group_per_part():
    """SheafStateConfig composes the configs of the modules that build from them (its size: test_layout)."""
    config = SheafStateConfig()
    assert (type(config.ssm), type(config.topology), type(config.experts), type(config.quant), type(config.site)) \
        == (SSMConfig, TopologyConfig, ExpertsConfig, QuantConfig, SiteConfig)
    with pytest.raises(ValueError, match="TopologyConfig: k, rank and block_size must be >= 1"):
        SheafStateConfig(topology={"rank": 0})
    with pytest.raises(ValueError, match="GluingConfig: mode must be one of"):
        SheafStateConfig(gluing={"mode": "both"})
    with pytest.raises(ValueError, match="GluingConfig: projections false needs mode 'tokens'"):
        SheafStateConfig(gluing={"mode": "outputs", "projections": False})
    with pytest.raises(ValueError, match="GluingConfig: map_init must be one of"):
        SheafStateConfig(gluing={"map_init": "zeros"})


def test_flat_keys_of_earlier_versions_load_with_a_deprecation_warning():
    flat = {"d_model": 32, "topology_rank": 64, "proposal_block": 4, "map_kind": "general", "headdim": 16,
            "gluing": True, "token_residual": True, "tune_cpu_allocator": True, "site": {"local_window": 8}}
    with pytest.warns(FutureWarning, match="topology_rank -> topology.rank.*proposal_block -> topology.block_size"):
        config = SheafStateConfig.from_dict(flat)
    assert config == SheafStateConfig(d_model=32, topology={"rank": 64, "block_size": 4, "content_blocks": 2,
                                                            "block_summary": "mean", "random_proposals": 4},
                                      ssm={"headdim": 16, "shared": False}, experts={"shared": False},
                                      gluing={"map_kind": "general", "mode": "tokens", "projections": True,
                                              "map_init": "random"}, site={"local_window": 8})
    with pytest.warns(FutureWarning, match="flat layout's defaults"):  # where a flat config is silent: its defaults
        legacy = SheafStateConfig.from_dict({"topology_rank": 16})
    assert (legacy.gluing.mode, legacy.gluing.projections, legacy.gluing.map_init, legacy.ssm.shared,
            legacy.experts.shared) == ("outputs", True, "random", False, False)
    assert (legacy.topology.content_blocks, legacy.topology.block_size, legacy.topology.block_summary) \
        == (2, 16, "mean")
    assert SheafStateConfig.from_dict({"topology": {"rank": 16}}).gluing.mode == SheafStateConfig().gluing.mode
    with pytest.warns(FutureWarning, match="gluing.mode: off"):
        assert SheafStateConfig.from_dict({"gluing": False}).gluing.mode == "off"


@pytest.mark.parametrize("mode", ["tokens", "outputs"])
def test_a_checkpoint_whose_weights_compute_otherwise_is_refused(full_config, tmp_path, mode):
    """Before format 2 the gluing into the tokens added ``g * h_out``: such a checkpoint is refused by a model that
    glues into the tokens, and loads into one that glues into the outputs, which computes as it did."""
    from sheafgnn.checkpoint import CheckpointError, load_checkpoint, save_checkpoint

    gluing = {"mode": mode, "projections": mode == "outputs"}
    step = save_checkpoint(tmp_path, 1, SheafStateLM(small_model_config(full_config, gluing=gluing)), {})
    state = torch.load(step / "state.pt", weights_only=True)
    torch.save({**state, "format": 1}, step / "state.pt")
    model = SheafStateLM(small_model_config(full_config, gluing=gluing))
    if mode == "tokens":
        with pytest.raises(CheckpointError, match="format 1: it was written by a version whose SheafStateLM computed"):
            load_checkpoint(step, model)
    else:
        assert load_checkpoint(step, model)["format"] == 1


@pytest.mark.parametrize("fmt", [3, 4])
def test_a_checkpoint_of_an_earlier_format_keeps_the_defaults_of_its_time(full_config, tmp_path, fmt):
    """A sheaf model config saved before format 3 predates topology.qk_norm (its weights have no norms), one saved
    before format 4 predates the maps' start at the identity: read_state gives the field its value of that time
    where the config is silent; from that format on, silence means today's default."""
    from sheafgnn.checkpoint import FORMAT, SILENT_BEFORE, load_checkpoint, read_state, save_checkpoint

    group, name, value = SILENT_BEFORE[fmt]
    config = small_model_config(full_config, **{group: {name: value}})
    saved = config.to_dict()
    del saved[group][name]
    step = save_checkpoint(tmp_path, 1, SheafStateLM(config), {"model_config": saved})
    assert name not in read_state(step)["model_config"][group] and FORMAT == 4
    torch.save({**torch.load(step / "state.pt", weights_only=True), "format": fmt - 1}, step / "state.pt")
    state = read_state(step)
    model = SheafStateLM(SheafStateConfig.from_dict(state["model_config"]))
    assert model.config == config and getattr(getattr(SheafStateConfig(), group), name) != value
    load_checkpoint(step, model)


def test_a_checkpoint_saved_with_flat_keys_loads():
    """A committed checkpoint whose config predates the groups (benchmarks/results/learned_topology_d64/model,
    flat keys) loads with its weights and runs."""
    from sheafgnn.experiments.learned_model import load_learned_model

    folder = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "learned_topology_d64" / "model"
    with pytest.warns(FutureWarning, match="topology_rank -> topology.rank"):
        model = load_learned_model(folder)
    assert model.config.topology.rank == 64 and model.config.gluing.mode == "outputs"
    assert model.config.gluing.map_init == "random"  # FLAT_DEFAULTS: the flat layout predates the maps' start at I
    with torch.no_grad():
        assert torch.isfinite(model(build_site("The cat sat.", model.config.site_config))).all()


@pytest.mark.slow
def test_torch_compile_runs(full_config):
    torch.manual_seed(0)
    model = SheafStateLM(_config(full_config, n_layers=1))  # one block: tracing cost grows with depth
    data = _with_targets(build_site(PROSE, model.config.site_config))
    # aot_eager: Dynamo traces the whole model and AOTAutograd builds the joint graph,
    # without Inductor's C++ code generation (minutes on a 2-core CPU).
    compiled = torch.compile(model, backend="aot_eager", dynamic=False)
    expected = model(data)
    assert torch.allclose(compiled(data), expected, atol=1e-4)


def test_checkpoint_blocks_gives_the_same_loss_and_gradients(full_config):
    """Recomputing each block in backward changes memory, not the numbers."""
    data = build_site(PROSE, full_config)
    data["token"].y = torch.roll(data["token"].x, -1)
    grads = []
    for flag in (False, True):
        torch.manual_seed(0)
        model = SheafStateLM(_config(full_config, checkpoint_blocks=flag))
        loss = model.loss(data)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (loss_a, grad_a), (loss_b, grad_b) = grads
    torch.testing.assert_close(loss_a, loss_b, atol=0, rtol=0)
    assert len(grad_a) == len(grad_b)
    for a, b in zip(grad_a, grad_b):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_allocator_thresholds_fit_a_c_int():
    """mallopt takes a C int and ctypes masks larger values silently (1 << 34 arrived as 0)."""
    for value in (MMAP_THRESHOLD, TRIM_THRESHOLD):
        assert ctypes.c_int(value).value == value > 0


def test_onednn_cache_is_bounded_unless_the_user_sized_it(monkeypatch):
    monkeypatch.delenv(ONEDNN_CACHE_VARIABLE, raising=False)
    assert bound_onednn_cache() and os.environ[ONEDNN_CACHE_VARIABLE] == str(ONEDNN_CACHE_CAPACITY)
    monkeypatch.setenv(ONEDNN_CACHE_VARIABLE, "7")
    assert not bound_onednn_cache() and os.environ[ONEDNN_CACHE_VARIABLE] == "7"


def test_a_model_changes_no_process_setting_and_tune_cpu_does(monkeypatch):
    """Building a model leaves the process alone; sheafgnn.tune_cpu() (the CLI's and the benchmarks' call) sets
    glibc's thresholds and oneDNN's cache bound."""
    import sheafgnn
    from sheafgnn import memory

    calls = []
    monkeypatch.setattr(memory, "keep_freed_memory", lambda: calls.append("glibc") or True)
    monkeypatch.setattr(memory, "bound_onednn_cache", lambda: calls.append("onednn") or True)
    monkeypatch.setattr(memory, "huge_pages_on", lambda: calls.append("huge pages") or True)
    SheafStateLM(SheafStateConfig(d_model=16, n_layers=1))
    assert calls == []
    assert sheafgnn.tune_cpu() == {"glibc": True, "onednn_cache": True, "huge_pages": True}
    assert calls == ["glibc", "onednn", "huge pages"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PyTorch's huge pages are Linux only")
@pytest.mark.parametrize("setup, on", [("", True), ("import torch_geometric", False),
                                       ("import os; os.environ['THP_MEM_ALLOC_ENABLE'] = '0'", False)])
def test_importing_the_package_puts_large_tensors_on_huge_pages(setup, on):
    """PyTorch reads THP_MEM_ALLOC_ENABLE at its first CPU allocation: ``import sheafgnn`` sets it first, and
    it stays off where the process allocated before (importing torch_geometric does) or the user said 0."""
    code = f"{setup}\nimport sheafgnn\nfrom sheafgnn.memory import huge_pages_on\nprint(huge_pages_on())"
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_VARIABLE}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert done.stdout.split() == [str(on)]
