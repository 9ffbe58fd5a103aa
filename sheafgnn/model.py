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

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch_geometric.data import HeteroData

from sheafgnn.config import ConfigFile
from sheafgnn.flat_keys import FLAT_DEFAULTS, nest_flat_keys
from sheafgnn.nn import cpu_kernels
from sheafgnn.nn.experts import ExpertsConfig, PatchExperts
from sheafgnn.nn.inference import LayerCache, RowBuffer
from sheafgnn.nn.proposals import summary_width
from sheafgnn.nn.quant import QuantConfig, apply_quant
from sheafgnn.nn.readout import readout_cross_entropy
from sheafgnn.nn.segment import gather_segment_mean, ptr_from_index
from sheafgnn.nn.sheaf import MAP_INITS, MAP_KINDS, SheafConv
from sheafgnn.nn.ssm import SSMConfig
from sheafgnn.nn.topology import Selection, TopologyConfig, TopologyInput
from sheafgnn.site.builder import validate_site
from sheafgnn.site.flat import FLAT_TYPES, FlatSite, flatten_site
from sheafgnn.site.patches import RULES
from sheafgnn.site.schema import (
    CHAINED_TYPES,
    CONTENT_EDGE,
    GLUE_EDGES,
    NODE_ATTRIBUTES,
    NODE_TYPES,
    RANDOM_EDGE,
    SiteConfig,
)
from sheafgnn.stream import SheafStream, StreamDelta


@dataclass(frozen=True)
class Extras:
    """What a forward pass computes beyond the output states (each costs time, and in training memory)."""

    candidates: bool = False  # every destination's whole pool with its scores (model.topology(candidates=True))
    energy: bool = False  # the per-edge gluing energy (model.topology)
    pool_read: bool = False  # the read of every output's whole pool (the pool-read loss, in training)
    block_loss: bool = False  # the block scorer's distillation loss (in training)


GLUING_MODES = ("tokens", "outputs", "off")


@dataclass
class GluingConfig(ConfigFile):
    """G of :class:`SheafStateLM`: where the gluing's messages go and the sheaf that transports them."""

    # "tokens": the tokens are the residual stream; each block's outputs start from their tokens, glue, and what
    # they gathered reaches the tokens through the broadcast times a per-channel gate g; R reads the tokens.
    # "outputs": the outputs keep their states across blocks, R reads them. "off": the ssm ablation (no patches).
    mode: str = "tokens"
    # "tokens": g = gate_scale * a parameter, from gate_init (docs/results.md#the-gate-that-learns-faster-the-default).
    # 1 since a kept answer (pool weight ~0.05) through a gate of 0.1 did not reach the readout and the scattered
    # layout's seed 1 failed; from 1 it passes in 3 of 3 seeds (docs/results.md#the-gate-from-1-the-default)
    gate_init: float = 1.0
    gate_scale: float = 10.0
    stalk_dim: int = 4  # d, the stalk dimension of the sheaf (d_model = d * channels)
    map_kind: str = "diag"  # restriction maps: diag | orthogonal | general | identity (SheafConv)
    # Where learned maps start: identity (F = I + tanh(h), the learner's last layer at zero) | random (SheafConv's
    # map_init). Identity since recall passed every MQAR size in 3 of 3 seeds with it and text gained 0.306 bits
    # per byte at 1.05M tokens (docs/results.md#diag-maps-that-start-at-the-identity)
    map_init: str = "identity"
    gate: bool = False  # "outputs": h + g * (G(h) - h) with a per-channel g initialised at 0
    # The D x D linears of the pool (token mean -> patch) and the broadcast (output t -> token t). False ("tokens"
    # mode only: its gate scales what the broadcast adds): the mean and the output row enter as they are
    projections: bool = False

    def __post_init__(self) -> None:
        if self.mode not in GLUING_MODES:
            raise ValueError(f"GluingConfig: mode must be one of {GLUING_MODES} (got {self.mode!r})")
        if self.map_kind not in MAP_KINDS or self.stalk_dim < 1:
            raise ValueError(f"GluingConfig: need map_kind in {MAP_KINDS} and stalk_dim >= 1 "
                             f"(got {self.map_kind!r} and {self.stalk_dim})")
        if self.map_init not in MAP_INITS:
            raise ValueError(f"GluingConfig: map_init must be one of {MAP_INITS} (got {self.map_init!r})")
        if not self.gate_scale > 0:
            raise ValueError(f"GluingConfig: gate_scale must be > 0 (got {self.gate_scale})")
        if not self.projections and self.mode == "outputs":
            raise ValueError("GluingConfig: projections false needs mode 'tokens', whose gate scales the broadcast "
                             "(got mode 'outputs')")


@dataclass
class SheafStateConfig(ConfigFile):
    """Hyperparameters of :class:`SheafStateLM`, one group per part of M it builds; loads from and saves to
    YAML/TOML/JSON (``print(config)`` shows every field). The flat keys of earlier versions (``topology_rank``,
    ``map_kind``, ...) still load, with a deprecation warning naming their new place
    (:data:`~sheafgnn.flat_keys.FLAT_KEYS`)."""

    vocab_size: int = 256  # tokenizer vocabulary (256: byte tokenizer)
    d_model: int = 256  # stalk width D = stalk_dim * channels
    n_layers: int = 2  # blocks of (Phi, pool, G, E, broadcast)
    num_topics: int = 64  # topic ids embedded (ids wrap modulo this)
    validate_sites: bool = True  # run validate_site (schema + causality) on every input; O(edges)
    checkpoint_blocks: bool = False  # training: recompute each block in backward (torch.utils.checkpoint)
    ssm: SSMConfig = field(default_factory=SSMConfig)  # Phi
    gluing: GluingConfig = field(default_factory=GluingConfig)  # G and where it enters
    topology: TopologyConfig = field(default_factory=TopologyConfig)  # the candidate pools and the choice
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)  # E
    site: SiteConfig = field(default_factory=SiteConfig)  # (C, J): how text becomes a site
    quant: QuantConfig = field(default_factory=QuantConfig)  # QuantVect

    def __post_init__(self) -> None:
        for name, kind in NESTED.items():  # mappings (from YAML or a caller) become their config
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, kind.from_dict(value))
            elif not isinstance(value, kind):
                raise ValueError(f"SheafStateConfig: {name} must be a {kind.__name__} or a mapping "
                                 f"(got {type(value).__name__})")
        if self.d_model % self.gluing.stalk_dim != 0:
            raise ValueError(f"SheafStateConfig: gluing.stalk_dim must divide d_model "
                             f"(got {self.gluing.stalk_dim} and {self.d_model})")
        if self.n_layers < 1 or self.vocab_size < 2 or self.num_topics < 1:
            raise ValueError(f"SheafStateConfig: need n_layers >= 1, vocab_size >= 2 and num_topics >= 1 "
                             f"(got {self.n_layers}, {self.vocab_size} and {self.num_topics})")

    @classmethod
    def from_dict(cls, values: dict) -> SheafStateConfig:
        """The config of ``values``; flat keys of earlier versions move to their groups (:meth:`nested`)."""
        return super().from_dict(cls.nested(values))

    @staticmethod
    def nested(values: dict) -> dict:
        """``values`` with the flat keys of earlier versions moved to their groups (:func:`nest_flat_keys`) over
        the defaults of those versions (:data:`FLAT_DEFAULTS`), and a :class:`FutureWarning` that names each move."""
        nested, moved = nest_flat_keys(values)
        if moved:  # an earlier version's config: its defaults fill what it does not say
            for group, fields in FLAT_DEFAULTS.items():
                nested[group] = {**fields, **nested.get(group, {})}
            moved.append("unset fields keep the flat layout's defaults (FLAT_DEFAULTS: " + ", ".join(
                f"{group}.{name} {value}" for group, fields in FLAT_DEFAULTS.items() for name, value in fields.items())
                + ")")
            warnings.warn("SheafStateConfig: these flat keys are deprecated and were moved: " + "; ".join(moved),
                          FutureWarning, stacklevel=3)
        return nested

    @property
    def site_config(self) -> SiteConfig:
        return self.site

    @property
    def glues(self) -> bool:
        """Whether the model glues (False: the ssm ablation)."""
        return self.gluing.mode != "off"


NESTED = {"ssm": SSMConfig, "gluing": GluingConfig, "topology": TopologyConfig, "experts": ExpertsConfig,
          "site": SiteConfig, "quant": QuantConfig}


def topology_input(site: FlatSite) -> TopologyInput:
    """What the learned topology reads of a flat site: rule candidates, node types, token positions."""
    return TopologyInput(site.glue_index, site.glue_type, site.glue_ptr, site.node_type, site.tokens,
                         site.outputs, site.token_pos, site.token_graph_start)


class SheafBlock(nn.Module):
    """One block: Phi on tokens and patch chains, pool, G, E, broadcast."""

    def __init__(self, config: SheafStateConfig) -> None:
        super().__init__()
        D, experts, gluing = config.d_model, config.experts, config.gluing
        self.gluing = config.glues
        self.norm_token = nn.LayerNorm(D)
        self.phi_token = config.ssm.module(D)
        self.norm_expert = nn.LayerNorm(D)
        self.by_type = self.gluing and not experts.shared
        self.token_residual = gluing.mode == "tokens"
        num_types = len(FLAT_TYPES) - self.token_residual  # token_residual: the outputs have no expert
        self.experts = PatchExperts(D, num_types if self.by_type else 1, experts.mult * D, experts.num_experts)
        if not self.gluing:
            return
        self.pool = nn.Linear(D, D, bias=False) if gluing.projections else nn.Identity()
        self.norm_patch = nn.LayerNorm(D)
        self.phi_patch = self.phi_token if config.ssm.shared else config.ssm.module(D)
        self.topology = config.topology.module(D, len(GLUE_EDGES), len(FLAT_TYPES), GLUE_EDGES.index(CONTENT_EDGE),
                                               GLUE_EDGES.index(RANDOM_EDGE))
        # The softmax weights of the selection already normalise each destination's messages.
        self.glue = SheafConv(D, gluing.stalk_dim, map_kind=gluing.map_kind, num_edge_types=len(GLUE_EDGES),
                              normalize="none", map_init=gluing.map_init)
        self.glue_gate = nn.Parameter(torch.zeros(D)) if gluing.gate else None
        self.broadcast = nn.Linear(D, D, bias=False) if gluing.projections else nn.Identity()
        # A gate of one entry per channel (ReZero / Flamingo at gate_init 0), not a matrix: a zero D x D matrix
        # would be filled by Adam with entries of +-lr at every step. The parameter is g / gate_scale.
        self.gate_scale = gluing.gate_scale
        self.broadcast_gate = nn.Parameter(torch.full((D,), gluing.gate_init / gluing.gate_scale)) \
            if self.token_residual else None

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
        what output t gathered, ``h_out - h_tok`` (the output started from its token), through ``broadcast``
        and its gate, then tokens and patches their experts; the outputs are kept as they are (the next block
        starts them from their tokens again). Returns the rows and the balance loss."""
        body, h_out = glued.split([glued.size(0) - num_tokens, num_tokens])  # (N - T, D), (T, D)
        h_tok, h_patch = body.split([num_tokens, body.size(0) - num_tokens])
        gate = self.gate_scale * self.broadcast_gate  # (D,)
        body = torch.cat([torch.addcmul(h_tok, gate, self.broadcast(h_out - h_tok)), h_patch])
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
        apply_quant(self, config.quant)  # fake-quantised maps / experts (sheafgnn.nn.quant); no-op if empty

    @property
    def oldest_checkpoint_format(self) -> int:
        """The oldest checkpoint format whose weights compute here what they did (2: the broadcast's input changed)."""
        return 2 if self.config.gluing.mode == "tokens" else 1

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
        if not self.config.glues:
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
        if self.config.gluing.mode != "outputs":
            return slice(0, site.type_ptr[1]) if self.config.glues else slice(None)
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
        c, balance_weight = self.config.topology, self.config.experts.balance_weight
        extras = Extras(pool_read=self.training and c.pool_loss_weight > 0,
                        block_loss=self.training and c.block_scorer and c.block_loss_weight > 0)
        h_out, infos, site = self._forward(data, extras)
        y = data["token"].y
        loss = self.readout_loss(h_out, y)
        for block, info in zip(self.blocks, infos):
            loss = loss + balance_weight * info["balance"]
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
    def topology(self, data: HeteroData, block: int | None = -1,
                 candidates: bool = False) -> dict[tuple[str, str, str], dict[str, Tensor]] | list[dict]:
        """The learned topology of one block (default: the last; ``None``: a list of every block's, from the one
        forward pass that each needs), in evaluation mode.

        Returns, per glue edge type (:data:`~sheafgnn.site.schema.GLUE_EDGES`: the site's rule types, then the
        content-addressed ``token matches output`` and the random ``token explores output`` proposals), the kept
        edges in that type's node indices::

            {edge_type: {"edge_index": (2, num_kept), "score": (num_kept,), "weight": (num_kept,),
                         "energy": (num_kept,), "num_candidates": int}}

        ``weight`` is the softmax weight of the edge's message (a destination's weights sum to one minus its
        "nothing" weight). With ``candidates=True`` each entry also holds the whole pool: ``"candidate_index"``
        (2, C) and ``"candidate_score"`` (C,).
        """
        if not self.config.glues:
            raise ValueError("SheafStateLM.topology: this model has gluing switched off (the ssm ablation)")
        was_training = self.training
        self.eval()
        _, infos, site = self._forward(data, Extras(candidates=candidates, energy=True))
        self.train(was_training)
        per_block = [{} for _ in infos]
        for t, (src_type, rel, dst_type) in enumerate(GLUE_EDGES):
            shift = torch.tensor([[site.block(src_type).start], [site.block(dst_type).start]], device=site.time.device)
            for info, out in zip(infos, per_block):
                chosen: Selection = info["selection"]
                mask = chosen.edge_type == t
                entry = {"edge_index": chosen.edge_index[:, mask] - shift, "score": chosen.score[mask],
                         "weight": chosen.weight[mask], "energy": info["energy"][mask],
                         "num_candidates": int(chosen.num_candidates[t])}
                if candidates:
                    index, types, score = chosen.candidates
                    pool = types == t
                    entry["candidate_index"], entry["candidate_score"] = index[:, pool] - shift, score[pool]
                out[(src_type, rel, dst_type)] = entry
        return per_block if block is None else per_block[block]

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
