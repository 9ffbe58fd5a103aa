r"""SheafStateLM: the Sheaf-State Language Model, M = (C, J, F, Phi, G, E, R).

Each symbol of M and the code that implements it:

======  ===============================================  =================================================
symbol  meaning                                          file: function or class
======  ===============================================  =================================================
C, J    the site: typed patches and which cover which    sheafgnn/site/builder.py: ``build_site``;
                                                         a file per patch type in sheafgnn/site/patches/
F       stalks: d stalk dims x f channels on each node   sheafgnn/nn/sheaf.py: ``SheafConv``
                                                         (``stalk_dim`` d, ``channels`` f)
Phi     selective SSM along each chain of states         sheafgnn/nn/ssm.py: ``SelectiveSSM``
                                                         (scan in sheafgnn/nn/ssd.py, conv and norm in ssm_kernels.py)
G       sheaf gluing with learned restriction maps       sheafgnn/nn/sheaf.py: ``SheafConv``, along the
        along a learned, competitive topology            edges that sheafgnn/nn/topology.py:
                                                         ``LearnedTopology`` chooses
E       site-aware experts, routed by patch type         sheafgnn/nn/experts.py: ``PatchExperts``
R       readout: output states to next-token logits      sheafgnn/model.py: ``SheafStateLM.readout``; its
                                                         training loss in sheafgnn/nn/readout.py
======  ===============================================  =================================================

The model reads the site flat (:func:`~sheafgnn.site.flat.flatten_site`).
Every node holds a stalk of ``d_model = stalk_dim * channels`` floats (F).
A block is::

    h (N, D)                                      all nodes: tokens, patches, outputs
    |- Phi  token chain:  h_tok   += SSM(norm(h_tok))          (num_tokens, D)
    |- pool:              h_patch += W_pool mean_{cover}(h_tok) segment_csr over the cover
    |- Phi  patch chains: h_chain += SSM(norm(h_chain))        chained types, each chain in time order
    |- read:              h_out   += h_tok                      output t reads token t
    |- choose:            pools (site rules + content + random proposals), top-k per destination,
    |                     softmax weights with a "nothing" logit         LearnedTopology
    |- G    gluing:       h = SheafConv(h, kept edges, weights)
    |- E    experts:      h += PatchExperts(norm(h))           routed by node type
    '- broadcast:         h_tok += W_out h_out                  output t -> token t
    R: logits = norm(h_out) @ W_emb^T                            (num_tokens, V), tied to the token embedding

With ``gluing=False`` a block is Phi on tokens and a token feed-forward only:
the Mamba-style ablation (``ssm`` in the comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch_geometric.data import HeteroData

from sheafgnn.config import ConfigFile
from sheafgnn.memory import tune_cpu_process
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.experts import PatchExperts
from sheafgnn.nn.inference import LayerCache, RowBuffer
from sheafgnn.nn.proposals import BLOCK_SUMMARIES, summary_width
from sheafgnn.nn.quant import apply_quant, validate_quant
from sheafgnn.nn.readout import readout_cross_entropy
from sheafgnn.nn.segment import gather_segment_mean, ptr_from_index
from sheafgnn.nn.sheaf import SheafConv
from sheafgnn.nn.ssm import SelectiveSSM
from sheafgnn.nn.topology import LearnedTopology, Selection, TopologyInput
from sheafgnn.site.builder import validate_site
from sheafgnn.site.flat import FLAT_TYPES, FlatSite, flatten_site
from sheafgnn.site.patches import RULES
from sheafgnn.site.schema import CHAINED_TYPES, GLUE_EDGES, NODE_ATTRIBUTES, NODE_TYPES, SiteConfig
from sheafgnn.stream import SheafStream, StreamDelta


@dataclass(frozen=True)
class Extras:
    """What a forward pass computes beyond the output states (each costs time, and in training memory)."""

    candidates: bool = False  # every destination's whole pool with its scores (model.topology(candidates=True))
    energy: bool = False  # the per-edge gluing energy (model.topology)
    pool_read: bool = False  # the read of every output's whole pool (the pool-read loss, in training)
    block_loss: bool = False  # the block scorer's distillation loss (in training)


@dataclass
class SheafStateConfig(ConfigFile):
    """Hyperparameters of :class:`SheafStateLM`; loads from and saves to YAML/TOML/JSON."""

    vocab_size: int = 256  # tokenizer vocabulary (256: byte tokenizer)
    d_model: int = 128  # stalk width D = stalk_dim * channels
    n_layers: int = 2  # blocks of (Phi, pool, G, E, broadcast)
    stalk_dim: int = 4  # d, the stalk dimension of the sheaf
    map_kind: str = "diag"  # restriction maps: diag | orthogonal | general
    d_state: int = 16  # SSM state size N
    expand: int = 2  # SSM inner width = expand * d_model
    headdim: int = 32  # SSM head dimension P
    chunk_size: int = 64  # SSD chunk length
    expert_mult: int = 2  # expert hidden width = expert_mult * d_model
    num_experts: int = 1  # experts per node type (> 1: top-1 routing + balance loss)
    shared_experts: bool = False  # one set of experts for every node type (the type embeddings still differ)
    glue_gate: bool = False  # h + g * (G(h) - h) with a per-channel g initialised at 0: the model starts as its SSM
    # the token states are the residual stream: each block's outputs start from their tokens, glue, and reach the
    # tokens through the broadcast times a per-channel gate initialised at 0 (then E on tokens and patches); R reads
    # the tokens. At initialisation the model is its SSM exactly.
    token_residual: bool = False
    shared_ssm: bool = False  # the patch chains run the token chain's SSM (its weights; their own norm)
    topology_k: int = 8  # candidates kept per destination (all edge types compete together)
    topology_rank: int = 16  # width r of the topology's query/key projections
    content_blocks: int = 2  # content-addressed blocks proposed per output (0: off)
    proposal_block: int = 16  # tokens per content block B
    random_proposals: int = 4  # seeded random past tokens proposed per output
    # next-token loss read from each block's whole pools (trains the choice; 0: skipped). Off by default: on text it
    # costs 15-25% of training speed and does not pay (ablation.md: -0.060 bits/byte with it off, seed noise 0.031);
    # the dependency tasks and the learned-topology study switch it on
    pool_loss_weight: float = 0.0
    # content blocks scored by a scorer of their own (LearnedTopology block_scorer), trained by distillation from the
    # token scores with this weight (block_distillation: its only signal). Off by default: MQAR (128, 8) learned from
    # session 9's initialisation without it, and from none of five runs with it (README)
    block_scorer: bool = False
    block_loss_weight: float = 1.0
    # how a content block's token keys are summarised for its score: "mean" (NSA / MoBA) or "bounds" (Quest: the
    # channel-wise max and min, an upper bound of the block's best token score; LearnedTopology, summarize_blocks)
    block_summary: str = "mean"
    # keep only the candidates that outscore the destination's "nothing" logit (LearnedTopology sink_threshold): a
    # destination may keep no edge, so the kept topology can be sparser than k per destination
    sink_threshold: bool = False
    # training: this weight times the expected kept edges per node, sum over kept e of sigmoid(s_e - s_sink), so
    # that an edge stays only where its message pays more than it costs. Off: at 0.02 the learned-topology study
    # kept a few hundred edges but learned no long-range dependency, and MQAR (128, 8) stalled at chance (README)
    keep_cost: float = 0.0
    balance_weight: float = 1e-2  # weight of the experts' load-balancing loss
    num_topics: int = 64  # topic ids embedded (ids wrap modulo this)
    gluing: bool = True  # False: Phi + token feed-forward only (the ssm ablation)
    validate_sites: bool = True  # run validate_site (schema + causality) on every input; O(edges)
    checkpoint_blocks: bool = False  # training: recompute each block in backward (torch.utils.checkpoint)
    # training: recompute each SSM's conv, scan and gated norm in backward (SelectiveSSM recompute): 0.73-0.84x
    # dense's peak memory at 32k tokens instead of 0.83-0.90x, for +8-18% step time (bench_model.py, README)
    recompute_ssm: bool = False
    tune_cpu_allocator: bool = True  # construction calls sheafgnn.memory.tune_cpu_process (process-wide settings)
    site: dict = field(default_factory=dict)  # SiteConfig fields for build_site
    quant: dict = field(default_factory=dict)  # QuantVect {maps, experts, map_values}: none|int8|int4|ternary

    def __post_init__(self) -> None:
        if self.d_model % self.stalk_dim != 0:
            raise ValueError(f"SheafStateConfig: stalk_dim must divide d_model "
                             f"(got {self.stalk_dim} and {self.d_model})")
        if min(self.pool_loss_weight, self.block_loss_weight, self.keep_cost) < 0:
            raise ValueError(f"SheafStateConfig: pool_loss_weight, block_loss_weight and keep_cost must be >= 0 "
                             f"(got {self.pool_loss_weight}, {self.block_loss_weight} and {self.keep_cost})")
        if self.topology_k < 1 or self.proposal_block < 1 or min(self.content_blocks, self.random_proposals) < 0:
            raise ValueError(f"SheafStateConfig: need topology_k >= 1, proposal_block >= 1 and content_blocks, "
                             f"random_proposals >= 0 (got {self.topology_k}, {self.proposal_block}, "
                             f"{self.content_blocks}, {self.random_proposals})")
        if self.block_summary not in BLOCK_SUMMARIES:
            raise ValueError(f"SheafStateConfig: block_summary must be one of {BLOCK_SUMMARIES} "
                             f"(got {self.block_summary!r})")
        if self.n_layers < 1 or self.vocab_size < 2:
            raise ValueError(f"SheafStateConfig: need n_layers >= 1 and vocab_size >= 2 "
                             f"(got {self.n_layers} and {self.vocab_size})")
        SiteConfig.from_dict(self.site)  # validate early
        validate_quant(self.quant, "SheafStateConfig.quant")

    @property
    def site_config(self) -> SiteConfig:
        return SiteConfig.from_dict(self.site)


def topology_input(site: FlatSite) -> TopologyInput:
    """What the learned topology reads of a flat site: rule candidates, node types, token positions."""
    return TopologyInput(site.glue_index, site.glue_type, site.glue_ptr, site.node_type, site.tokens,
                         site.outputs, site.token_pos, site.token_graph_start)


class SheafBlock(nn.Module):
    """One block: Phi on tokens and patch chains, pool, G, E, broadcast."""

    def __init__(self, config: SheafStateConfig) -> None:
        super().__init__()
        D = config.d_model
        ssm_args = dict(d_state=config.d_state, expand=config.expand, headdim=config.headdim,
                        chunk_size=config.chunk_size, recompute=config.recompute_ssm)
        self.gluing = config.gluing
        self.norm_token = nn.LayerNorm(D)
        self.phi_token = SelectiveSSM(D, **ssm_args)
        self.norm_expert = nn.LayerNorm(D)
        self.by_type = config.gluing and not config.shared_experts
        self.token_residual = config.gluing and config.token_residual
        num_types = len(FLAT_TYPES) - self.token_residual  # token_residual: the outputs have no expert
        self.experts = PatchExperts(D, num_types if self.by_type else 1, config.expert_mult * D,
                                    config.num_experts)
        if not config.gluing:
            return
        self.pool = nn.Linear(D, D, bias=False)
        self.norm_patch = nn.LayerNorm(D)
        self.phi_patch = self.phi_token if config.shared_ssm else SelectiveSSM(D, **ssm_args)
        self.topology = LearnedTopology(D, len(GLUE_EDGES), len(FLAT_TYPES), config.topology_k,
                                        rank=config.topology_rank, content_blocks=config.content_blocks,
                                        block_size=config.proposal_block, random_proposals=config.random_proposals,
                                        block_scorer=config.block_scorer, block_summary=config.block_summary,
                                        sink_threshold=config.sink_threshold)
        # The softmax weights of the selection already normalise each destination's messages.
        self.glue = SheafConv(D, config.stalk_dim, map_kind=config.map_kind, num_edge_types=len(GLUE_EDGES),
                              normalize="none")
        self.glue_gate = nn.Parameter(torch.zeros(D)) if config.glue_gate else None
        self.broadcast = nn.Linear(D, D, bias=False)
        # ReZero / Flamingo: a gate of one entry per channel, not a zero matrix, which Adam would fill with entries
        # of +-lr at every step (a D x D perturbation of the residual stream from the first steps)
        self.broadcast_gate = nn.Parameter(torch.zeros(D)) if self.token_residual else None

    def forward(self, h: Tensor, site: FlatSite, extras: Extras = Extras()) -> tuple[Tensor, dict]:
        if not self.gluing:
            h_tok = h + self.phi_token(h, site.token_reset, norm=self.norm_token)  # (num_tokens, D)
            update, balance = self.experts(h_tok, [0, h_tok.size(0)], self.norm_expert)
            return h_tok + update, {"balance": balance}
        # Split, not slices: a split's backward is one cat, a slice's zero-fills an (N, D) gradient.
        sizes = [site.tokens.stop, site.patches.stop - site.patches.start, site.outputs.stop - site.outputs.start]
        h_tok, h_patch, h_out = h.split(sizes)  # (num_tokens, D), (num_patches, D), (num_tokens, D)
        # The fused norm keeps its input for backward: a copy of the token rows, not a view that would keep all of h
        h_tok = h_tok + self.phi_token(h_tok.clone(), site.token_reset, norm=self.norm_token)
        # Pool: each patch gets the mean of the token states it covers.
        pooled = gather_segment_mean(h_tok, site.cover_src, site.cover_ptr)  # (num_patches, D)
        h_patch = h_patch + self.pool(pooled)
        num_chained = site.chained.stop - site.chained.start
        h_chain, h_unchained = h_patch.split([num_chained, h_patch.size(0) - num_chained])
        h_chain = h_chain + self.phi_patch(h_chain, site.chain_reset, norm=self.norm_patch)  # Phi along each chain
        # Output t reads token t: its state starts from the token's (the 'token reads output' edge).
        h = torch.cat([h_tok, h_chain, h_unchained, h_tok if self.token_residual else h_out + h_tok])  # (N, D)

        chosen = self.topology(h, topology_input(site), extras.candidates, extras.pool_read,  # sorted by destination
                               extras.block_loss)
        # The per-edge energy is for inspection: in training it would keep two (E, d, f) tensors for backward.
        glued = self.glue(h, chosen.edge_index, chosen.edge_type, chosen.weight, return_energy=extras.energy,
                          ptr=chosen.ptr)
        glued, energy = glued if extras.energy else (glued, None)
        h = self.gate(h, glued)
        if self.token_residual:
            h, balance = self.token_tail(h, site.type_ptr, site.tokens.stop)
            return h, {"balance": balance, "selection": chosen, "energy": energy}

        update, balance = self.experts(h, self.expert_ptr(site.type_ptr), self.norm_expert)
        h_tok, h_patch, h_out = (h + update).split(sizes)
        # broadcast: output t -> token t; the linear keeps a copy of the output rows, not a view of all of h
        h = torch.cat([h_tok + self.broadcast(h_out.clone()), h_patch, h_out])
        return h, {"balance": balance, "selection": chosen, "energy": energy}

    def step(self, h: Tensor, delta: StreamDelta, cache: LayerCache) -> Tensor:
        """:meth:`forward` for the new nodes of a stream batch only, from the cached states of old
        ones (see :mod:`sheafgnn.stream`); returns the new nodes' states (N_new, D)."""
        tok = slice(0, delta.token_ids.numel())
        h_tok = h[tok]  # (T, D)
        y, cache.token_ssm = self.phi_token.continue_chains(h_tok, delta.token_reset, cache.token_ssm,
                                                            delta.token_streams, norm=self.norm_token)
        h_tok = h_tok + y
        if not self.gluing:
            update, _ = self.experts(h_tok, [0, h_tok.size(0)], self.norm_expert)
            return h_tok + update
        patches, out = slice(tok.stop, delta.type_ptr[-2]), delta.block("output")
        first = cache.state.extend(delta.type_ptr[-2])
        cache.state.write(first, h_tok)
        h_patch = h[patches]
        if patches.stop > patches.start:  # most generated tokens close no patch
            h_patch = h_patch + self.pool(gather_segment_mean(cache.state.data, delta.cover_src, delta.cover_ptr))
            num_chained = delta.chain_reset.numel()
            y, cache.chain_ssm = self.phi_patch.continue_chains(h_patch[:num_chained], delta.chain_reset,
                                                                cache.chain_ssm, delta.chain_rows, norm=self.norm_patch)
            h_patch = torch.cat([h_patch[:num_chained] + y, h_patch[num_chained:]])
            cache.state.write(first + tok.stop, h_patch)
        h = torch.cat([h_tok, h_patch, h_tok if self.token_residual else h[out] + h_tok])  # (N, D)

        src, dst, edge_type, weight = self.topology.step(h, delta.topology, cache)
        # Bipartite gluing: the new nodes (destinations) read their sources' cached states in place.
        glued = self.glue((cache.state.data, h), torch.stack([src, dst]), edge_type, weight,
                          ptr=ptr_from_index(dst, h.size(0)))
        if self.token_residual:
            return self.token_tail(self.gate(h, glued), delta.type_ptr, tok.stop)[0]
        return self.step_tail(self.gate(h, glued), delta.type_ptr, tok.stop)

    def token_tail(self, glued: Tensor, type_ptr: list[int], num_tokens: int) -> tuple[Tensor, Tensor]:
        """``token_residual``'s E and broadcast on glued rows (N, D) (tokens first, outputs last): token t gets
        output t's row through ``broadcast`` and its gate, then tokens and patches their experts; the outputs are
        kept as they are (the next block starts them from their tokens again). Returns the rows and the balance
        loss."""
        body, h_out = glued.split([glued.size(0) - num_tokens, num_tokens])  # (N - T, D), (T, D)
        h_tok, h_patch = body.split([num_tokens, body.size(0) - num_tokens])
        body = torch.cat([torch.addcmul(h_tok, self.broadcast_gate, self.broadcast(h_out)), h_patch])
        update, balance = self.experts(body, self.expert_ptr(type_ptr[:-1]), self.norm_expert)
        return torch.cat([body + update, h_out]), balance

    def allocate_inference_cache(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> LayerCache:
        """The empty cache of ``batch_size`` streams (:mod:`sheafgnn.stream`): the token chain's SSM state and, with
        gluing, every node's state and topology keys, the content blocks' summaries and the patch chains' states."""
        token_ssm = self.phi_token.init_state(batch_size, device, dtype)
        if not self.gluing:
            return LayerCache(token_ssm)
        D, rank = self.topology.channels, self.topology.rank
        summary = summary_width(rank, self.topology.block_summary)  # a content block's summary key
        return LayerCache(token_ssm, state=RowBuffer((D,), dtype, device), key=RowBuffer((rank,), dtype, device),
                          block_token_key=RowBuffer((rank,), dtype, device),
                          block_key=RowBuffer((batch_size, summary), dtype, device),
                          chain_ssm=self.phi_patch.init_state(len(CHAINED_TYPES) * batch_size, device, dtype))

    def gate(self, h: Tensor, glued: Tensor) -> Tensor:
        """The gluing's update through the gate: ``h + g * (glued - h)`` (``glued`` without ``glue_gate``)."""
        return glued if self.glue_gate is None else torch.addcmul(h, self.glue_gate, glued - h)

    def expert_ptr(self, type_ptr: list[int]) -> list[int]:
        """The experts' row segments: one per node type, or all rows in one with ``shared_experts``."""
        return type_ptr if self.by_type else [0, type_ptr[-1]]

    def step_tail(self, glued: Tensor, type_ptr: list[int], num_tokens: int) -> Tensor:
        """E and the broadcast on a step's glued rows (N, D) (the tokens first, the outputs last):
        ``glued + E(glued)``, then output t's row through ``broadcast`` added to token t's. In inference on a
        step's few rows one call of the C++ kernel ``block_tail`` (:mod:`sheafgnn.nn.cpu_kernels`); elsewhere,
        and as its reference, the PyTorch ops."""
        type_ptr = self.expert_ptr(type_ptr)
        call = self.experts.fused_call(glued, type_ptr, self.norm_expert)
        broadcast, weight, bias = cpu_kernels.registered(self, ("broadcast", "broadcast.weight", "broadcast.bias"))
        kernel = cpu_kernels.block_tail() if call is not None and type(broadcast) is nn.Linear and bias is None \
            else None
        if kernel is not None:
            return kernel(glued, *call, weight, num_tokens)
        update, _ = self.experts(glued, type_ptr, self.norm_expert)
        h = glued.add_(update)  # in place: the step's own rows (no autograd in a stream)
        h[:num_tokens].add_(self.broadcast(h[h.size(0) - num_tokens :]))  # a view's add_: no write-back of the slice
        return h


class SheafStateLM(nn.Module):
    r"""The Sheaf-State Language Model.

    Args:
        config (SheafStateConfig): hyperparameters.

    Shapes:
        - **input:** a site ``HeteroData`` (or a PyG ``Batch`` of sites) from
          :func:`~sheafgnn.site.build_site`
        - **output:** logits :math:`(\text{num\_tokens}, V)`, one row per position
    """

    def __init__(self, config: SheafStateConfig) -> None:
        super().__init__()
        self.config = config
        D = config.d_model
        self.token_embedding = nn.Embedding(config.vocab_size, D)  # W_emb, tied to the readout R
        self.type_embedding = nn.Embedding(len(FLAT_TYPES), D)  # indexed in the flat order
        # One embedding per node attribute of a patch type (NODE_ATTRIBUTES: topic ids, workspace registers), named
        # for it and registered in the attributes' name order (register, topic: the saved checkpoints' order). An
        # attribute without a bound in the site config (topic ids: the fitted topic model has them) gets num_topics
        # rows, and its ids wrap modulo that.
        rows = {p: RULES[p].attribute_rows(config.site_config) for p in NODE_ATTRIBUTES}
        self.wrapped_attributes = frozenset(p for p, r in rows.items() if r is None)
        for p, name in sorted(NODE_ATTRIBUTES.items(), key=lambda item: item[1]):
            self.add_module(f"{name}_embedding", nn.Embedding(config.num_topics if rows[p] is None else rows[p], D))
        self.blocks = nn.ModuleList(SheafBlock(config) for _ in range(config.n_layers))
        self.norm_out = nn.LayerNorm(D)
        self.reset_parameters()
        if config.tune_cpu_allocator:
            # Linear cost needs it: glibc unmaps every freed buffer over 32 MiB, so each large activation of
            # a long context pays its page faults again on every step (fwd+bwd slope 1.32 instead of 1.05
            # from 4k to 64k tokens, benchmarks/bench_model.py); and oneDNN's cache of a primitive per
            # shape fragments the heap as the sites change (bench_train_memory.py). Process-wide.
            tune_cpu_process()
        apply_quant(self, config.quant)  # fake-quantised maps / experts (sheafgnn.nn.quant); no-op if empty

    def reset_parameters(self) -> None:
        attribute_embeddings = [self.get_submodule(f"{name}_embedding") for name in sorted(NODE_ATTRIBUTES.values())]
        for emb in (self.token_embedding, self.type_embedding, *attribute_embeddings):
            nn.init.normal_(emb.weight, std=0.02)

    def _check(self, data: HeteroData) -> None:
        if not isinstance(data, HeteroData):
            raise ValueError(f"SheafStateLM: expected a site HeteroData from build_site, got {type(data).__name__}")
        missing = [t for t in NODE_TYPES if t not in data.node_types]
        if missing or "x" not in data["token"]:
            raise ValueError(f"SheafStateLM: not a site (missing node types {missing} or token ids); "
                             "build it with sheafgnn.site.build_site")
        if data["token"].num_nodes == 0:
            raise ValueError("SheafStateLM: the site has no tokens")
        x = data["token"].x
        if x.dtype != torch.long or x.dim() != 1:
            raise ValueError(f"SheafStateLM: token ids must be a 1-D LongTensor "
                             f"(got {x.dtype}, shape {tuple(x.shape)})")
        if self.config.validate_sites:
            try:
                validate_site(data)
            except ValueError as err:
                raise ValueError(f"SheafStateLM: the input is not a valid causal site: {err}") from None

    def embed(self, token_ids: Tensor, node_type: Tensor | None, type_ptr: list[int] | None,
              attributes: dict[str, Tensor] | None) -> Tensor:
        """Initial states of flat nodes (FLAT_TYPES order): token ids, the node types and type offsets, and per
        patch type with a node attribute (NODE_ATTRIBUTES) its nodes' attribute; tokens only without gluing
        (then the other arguments are ignored)."""
        if not self.config.gluing:
            return self.token_embedding(token_ids) + self.type_embedding.weight[0]  # (num_tokens, D)
        h = self.type_embedding(node_type)  # (N, D)
        # In place on h's blocks (views): no (N, D) cat, and a generation step's two rows in a few ops.
        h[: token_ids.numel()].add_(self.token_embedding(token_ids))  # the tokens come first (type 0)
        for p, ids in attributes.items():
            # Inference skips an empty block (a stream's step mostly has none); training still runs it, so that
            # the weights get (zero) gradients and the optimizer treats every step alike (as PatchExperts does).
            if ids.numel() or torch.is_grad_enabled():
                i, embedding = FLAT_TYPES.index(p), getattr(self, f"{NODE_ATTRIBUTES[p]}_embedding")
                h[type_ptr[i] : type_ptr[i + 1]].add_(
                    embedding(ids % embedding.num_embeddings if p in self.wrapped_attributes else ids))
        return h  # (N, D)

    def _forward(self, data: HeteroData, extras: Extras = Extras()) -> tuple[Tensor, list[dict], FlatSite]:
        """(output states (num_tokens, D), per-block infos, the flat site); R (:meth:`readout`) is left out.
        The infos hold what ``extras`` asks for (None otherwise)."""
        self._check(data)
        x = data["token"].x
        if x.numel() and int(x.max()) >= self.config.vocab_size:
            raise ValueError(f"SheafStateLM: token id {int(x.max())} >= vocab_size {self.config.vocab_size}")
        site = flatten_site(data)
        attributes = {p: data[p][name] for p, name in NODE_ATTRIBUTES.items()}
        h = self.embed(x, site.node_type, site.type_ptr, attributes)  # (N, D), or (num_tokens, D) without gluing
        infos = []
        recompute = self.config.checkpoint_blocks and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if recompute:  # keep only the block's input for backward; rerun the block there
                h, info = checkpoint(block, h, site, extras, use_reentrant=False)
            else:
                h, info = block(h, site, extras)
            infos.append(info)
        h_out = h[self.read_rows(site)]  # (num_tokens, D)
        return h_out, infos, site

    def read_rows(self, site: FlatSite | StreamDelta) -> slice:
        """The rows of a block's output that R reads: the outputs, or the tokens (``token_residual``, and the ssm
        ablation, whose rows are its tokens)."""
        if not self.config.gluing or self.config.token_residual:
            return slice(0, site.type_ptr[1]) if self.config.gluing else slice(None)
        return site.block("output")

    def readout(self, h_out: Tensor) -> Tensor:
        r"""R: next-token logits from the output states, tied to the token
        embedding :math:`W_{emb}`: :math:`\mathrm{LayerNorm}(h_{out}) W_{emb}^\top`.

        Shapes:
            - **input:** h_out :math:`(\text{num\_tokens}, D)`
            - **output:** logits :math:`(\text{num\_tokens}, V)`
        """
        return self.norm_out(h_out) @ self.token_embedding.weight.T  # (num_tokens, V)

    def readout_loss(self, h_out: Tensor, target: Tensor) -> Tensor:
        """Mean cross-entropy of :meth:`readout` against ``target`` (-100: not counted), differentiated
        in chunks of rows so that backward keeps no (num_tokens, V) logits
        (:func:`~sheafgnn.nn.readout.readout_cross_entropy`)."""
        norm = self.norm_out
        return readout_cross_entropy(h_out, norm.weight, norm.bias, self.token_embedding.weight, target, norm.eps)

    def forward(self, data: HeteroData) -> Tensor:
        return self.readout(self._forward(data)[0])

    def loss(self, data: HeteroData) -> Tensor:
        """Mean next-token cross-entropy over ``data['token'].y`` plus the auxiliary losses: the experts'
        balance and, per block, the next-token loss of the output states plus that block's pool read
        (:meth:`~sheafgnn.nn.topology.LearnedTopology._pool_read`; the states it reads are detached, so
        it trains the choice of edges, not the rest of the model) and the block scorer's distillation
        loss (:meth:`~sheafgnn.nn.topology.LearnedTopology.block_distillation`) and the cost of the kept
        edges (``keep_cost``)."""
        if "y" not in data["token"]:
            raise ValueError("SheafStateLM.loss: the site has no targets data['token'].y")
        c = self.config
        extras = Extras(pool_read=self.training and c.pool_loss_weight > 0,
                        block_loss=self.training and c.block_scorer and c.block_loss_weight > 0)
        h_out, infos, site = self._forward(data, extras)
        y = data["token"].y
        loss = self.readout_loss(h_out, y)
        for block, info in zip(self.blocks, infos):
            loss = loss + c.balance_weight * info["balance"]
            chosen = info.get("selection")
            if chosen is not None and chosen.pool_read is not None:
                loss = loss + c.pool_loss_weight * self.readout_loss(h_out.detach() + chosen.pool_read, y)
            if chosen is not None and chosen.block_loss is not None:
                loss = loss + c.block_loss_weight * chosen.block_loss
            if chosen is not None and self.training and c.keep_cost > 0:
                sink = block.topology.sink[site.node_type[chosen.edge_index[1]]]  # (E_kept,)
                loss = loss + c.keep_cost * torch.sigmoid(chosen.score - sink).sum() / site.num_nodes
        return loss

    @torch.no_grad()
    def topology(self, data: HeteroData, block: int = -1,
                 candidates: bool = False) -> dict[tuple[str, str, str], dict[str, Tensor]]:
        """The learned topology of one block (default: the last), in evaluation mode.

        Returns, per glue edge type (:data:`~sheafgnn.site.schema.GLUE_EDGES`:
        the site's rule types, then the content-addressed ``token matches
        output`` and the random ``token explores output`` proposals), the kept
        edges in that type's node indices::

            {edge_type: {"edge_index": (2, num_kept), "score": (num_kept,), "weight": (num_kept,),
                         "energy": (num_kept,), "num_candidates": int}}

        ``weight`` is the softmax weight of the edge's message (a
        destination's weights sum to one minus its "nothing" weight). With
        ``candidates=True`` each entry also holds the whole pool:
        ``"candidate_index"`` (2, C) and ``"candidate_score"`` (C,).
        """
        if not self.config.gluing:
            raise ValueError("SheafStateLM.topology: this model has gluing switched off (the ssm ablation)")
        was_training = self.training
        self.eval()
        _, infos, site = self._forward(data, Extras(candidates=candidates, energy=True))
        self.train(was_training)
        chosen: Selection = infos[block]["selection"]
        out = {}
        for t, (src_type, rel, dst_type) in enumerate(GLUE_EDGES):
            shift = torch.tensor([[site.block(src_type).start], [site.block(dst_type).start]], device=site.time.device)
            mask = chosen.edge_type == t
            entry = {"edge_index": chosen.edge_index[:, mask] - shift, "score": chosen.score[mask],
                     "weight": chosen.weight[mask], "energy": infos[block]["energy"][mask],
                     "num_candidates": int(chosen.num_candidates[t])}
            if candidates:
                index, types, score = chosen.candidates
                pool = types == t
                entry["candidate_index"], entry["candidate_score"] = index[:, pool] - shift, score[pool]
            out[(src_type, rel, dst_type)] = entry
        return out

    def stream(self, batch_size: int = 1, tokenizer=None) -> SheafStream:
        """A :class:`~sheafgnn.stream.SheafStream` of ``batch_size`` independent streams: ``feed(ids)``
        returns the logits of the fed positions (equal to the full forward's), constant work per token."""
        return SheafStream(self, batch_size, tokenizer)

    @torch.no_grad()
    def generate(self, prompt_ids: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None, tokenizer=None) -> Tensor:
        """``prompt_ids`` (1-D) followed by ``max_new_tokens`` sampled ids, through :meth:`stream`."""
        if prompt_ids.dim() != 1 or prompt_ids.numel() == 0:
            raise ValueError(f"SheafStateLM.generate: prompt_ids must be a non-empty 1-D tensor "
                             f"(got shape {tuple(prompt_ids.shape)})")
        stream = self.stream(tokenizer=tokenizer)
        stream.feed(prompt_ids)
        new = stream.generate(max_new_tokens, temperature=temperature, top_k=top_k, generator=generator)
        return torch.cat([prompt_ids.long().cpu(), new.cpu()])
