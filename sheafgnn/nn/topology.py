r"""Learned topology: candidate pools, one competition per destination, softmax weights.

The topology is learned only if the model *chooses*: every destination that
gathers context gets a pool of candidate sources several times larger than
what it keeps, all of its candidates compete together, and the score of a
kept candidate is the logit of the softmax that weighs its message, so the
score is on the gradient path (a softmax over one candidate, or a hard mask,
would pass no gradient)::

    candidates of destination v          score s_e = <q_v, k_u> / sqrt(r) + b_type(e)
                                         q_v = norm_q(W_q x_v), k_u = norm_k(W_k x_u (+ W_k' x_{u-1} for a token u))
                                         (norm: RMSNorm with learned gains, QK-norm; with `qk_norm=False`, none)
      rule proposals    the site's causal edges into v (chains, anchors, links, reads)
      content proposals the tokens of the `content_blocks` best complete blocks before v, and
                        those of v's own block up to v (outputs only; the own block is NSA's window).
                        A block is scored by <q_v, mean of the block's token keys> (NSA / MoBA
                        style), with `block_summary="bounds"` by the upper bound of <q_v, k_u>
                        over the block's tokens u from their channel-wise max and min (Quest),
                        or, with `block_scorer`, by a scorer of its own,
                        <W_bq x_v, kbar_j> / sqrt(r), kbar_j the mean over the block of
                        W_bk x_u + W_bk' x_{u-1}, trained by distillation from the token scores
                        (DSA style, `LearnedTopology.block_distillation`)
      random proposals  `random_proposals` past tokens, a seeded hash of v's position (outputs only)
    keep                the k best of the pool (all types together); with `sink_threshold`, only
                        those that outscore v's "nothing" logit (v may keep none: no message, no edge);
                        in training the others stay with weight 0 and a straight-through gradient
    weight              alpha_e = softmax([s_kept..., s_sink(type of v)])_e
                        the learned "nothing" logit s_sink lets v take no message:
                        sum of alpha over v's kept edges = 1 - alpha_sink(v)

The weights multiply the sheaf transport (:class:`~sheafgnn.nn.sheaf.SheafConv`
with ``edge_weight=alpha`` and ``normalize="none"``).

**Causality.** A candidate's source has ``time <= time[v]``: rule edges are
causal by construction; content blocks are complete before v's position
(block ``j`` of a graph, tokens ``[jB, jB + B)``, qualifies for position
``p`` iff ``jB + B <= p``); random proposals are tokens at positions
``<= p`` of the same graph. The choice of v reads only v's state and its
candidates' states, and the softmax runs over v's own pool.

**Cost.** Rule and random candidates cost O(n) scores. Content proposals
(:mod:`sheafgnn.nn.proposals`) score, for every output, the complete blocks
before it: ``n * n / B`` dot products of rank ``r`` (``2r`` for the bounds),
that is O(n^2 r / B) time, scored and ranked in one pass by a C++ kernel on
the CPU (O(n) memory) or in chunks of rows in PyTorch (O(n + chunk * n / B)
memory); at B = 16, r = 16 this is the same number of
multiply-adds as an (n x n) attention score matrix of width 1, and it is
measured in ``benchmarks/bench_model.py``. The chosen
blocks and the own block give ``(content_blocks + 1) * B`` token candidates per output, O(n).
The block scorer's projections cost O(n D r) and its distillation O(n * content_blocks * r).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch_geometric.utils import softmax as segment_softmax

from sheafgnn.config import ConfigFile
from sheafgnn.nn.pools import pool_dot, pool_read, rule_pools
from sheafgnn.nn.proposals import BLOCK_SUMMARIES, block_summaries, content_blocks, random_proposals, summary_query
from sheafgnn.nn.segment import ptr_from_index, topk_per_group
from sheafgnn.nn.topology_step import TopologyStep

SINK_THRESHOLD_INIT = -4.0  # the "nothing" logit at init under sink_threshold
KEY_PREVIOUS_INITS = ("random", "query")  # how W_k' starts: its own draw, or a copy of W_q


def check_topology(owner: str, k: int, rank: int, content_blocks: int, block_size: int, random_proposals: int,
                   block_summary: str, explore: float, key_previous_init: str) -> None:
    """The arguments :class:`LearnedTopology` takes, checked for it and for :class:`TopologyConfig` (``owner`` names
    the caller in the error)."""
    if block_summary not in BLOCK_SUMMARIES:
        raise ValueError(f"{owner}: block_summary must be one of {BLOCK_SUMMARIES} (got {block_summary!r})")
    if key_previous_init not in KEY_PREVIOUS_INITS:
        raise ValueError(f"{owner}: key_previous_init must be one of {KEY_PREVIOUS_INITS} (got {key_previous_init!r})")
    if k < 1 or rank < 1 or block_size < 1:
        raise ValueError(f"{owner}: k, rank and block_size must be >= 1 (got {k}, {rank}, {block_size})")
    if min(content_blocks, random_proposals, explore) < 0:
        raise ValueError(f"{owner}: content_blocks, random_proposals and explore must be >= 0 "
                         f"(got {content_blocks}, {random_proposals} and {explore})")


@dataclass
class TopologyConfig(ConfigFile):
    """The learned topology of :class:`~sheafgnn.model.SheafStateLM`: its :class:`LearnedTopology` (the candidate
    pools and the competition) and the losses that train the choice."""

    k: int = 8  # candidates kept per destination (all edge types compete together)
    rank: int = 16  # width r of the query/key projections
    # RMSNorm with learned gains on the queries and keys (QK-norm): the scores start bounded by sqrt(r) and grow only
    # as the gains do (MQAR (128, 8) seed 1: 0.996 at 1,200 steps, 0.971 after 3,000 without; docs/results.md)
    qk_norm: bool = True
    # Content-addressed blocks proposed per output (0: off) and tokens per block B: blocks of 4, not 16, so that a
    # query finds its bind's block when few tokens share its summary (MQAR (128, 8): the answer in the pool for 99%
    # of queries, 85% with 2 of 16); 16 of them, not 8, so that it does in every seed (100% at seed 1, where 8 reach
    # 94%; docs/results.md#sixteen-blocks-every-seed-finds-its-answer)
    content_blocks: int = 16
    block_size: int = 4
    # seeded random past tokens proposed per output: off, since text was no better with them (4 of them: -0.027
    # bits per byte off, 1.05M tokens, 2 seeds) and MQAR passes without; docs/results.md#the-lean-default
    random_proposals: int = 0
    # how a content block's token keys are summarised for its score: "mean" (NSA / MoBA) or "bounds" (Quest: the
    # channel-wise max and min, an upper bound of the block's best token score)
    block_summary: str = "bounds"
    block_scorer: bool = False  # content blocks scored by a scorer of their own, trained by block_distillation
    block_loss_weight: float = 1.0  # the block scorer's distillation loss (its only training signal)
    sink_threshold: bool = False  # keep only the candidates that outscore the destination's "nothing" logit
    # Gumbel-top-k in training (0: off): the kept k sampled from softmax(score / explore), so that a candidate ranked
    # just below the k is still kept at times, and gets a gradient
    explore: float = 0.0
    # how the previous-token key projection W_k' starts: "random" (its own draw) or "query" (a copy of W_q, so that
    # the token after an earlier occurrence of v's token starts with a high score: the recall path exists at init).
    # "query": MQAR (512, 32) at lr 1e-3 passes seeds 0, 1 and 2 (0.997 / 0.999 / 1.000 at 1,700 / 1,300 / 1,600
    # steps), where "random" fails seeds 1 and 2 (0.028 / 0.029), and text is level (-0.004, in the spread;
    # docs/results.md#the-previous-token-key-starts-as-the-query)
    key_previous_init: str = "query"
    pool_loss_weight: float = 0.0  # next-token loss read from each block's whole pools (trains the choice; 0: off)
    keep_cost: float = 0.0  # this weight times the expected kept edges per node (sigmoid(s_e - s_sink))

    def __post_init__(self) -> None:
        check_topology("TopologyConfig", self.k, self.rank, self.content_blocks, self.block_size,
                       self.random_proposals, self.block_summary, self.explore, self.key_previous_init)
        if min(self.pool_loss_weight, self.block_loss_weight, self.keep_cost) < 0:
            raise ValueError(f"TopologyConfig: pool_loss_weight, block_loss_weight and keep_cost must be >= 0 "
                             f"(got {self.pool_loss_weight}, {self.block_loss_weight} and {self.keep_cost})")

    def module(self, channels: int, num_edge_types: int, num_node_types: int, content_type: int,
               random_type: int) -> LearnedTopology:
        """The :class:`LearnedTopology` this config describes (the losses are the model's to add)."""
        return LearnedTopology(channels, num_edge_types, num_node_types, self.k, content_type, random_type,
                               rank=self.rank, qk_norm=self.qk_norm, content_blocks=self.content_blocks,
                               block_size=self.block_size, random_proposals=self.random_proposals,
                               block_scorer=self.block_scorer, block_summary=self.block_summary,
                               sink_threshold=self.sink_threshold, explore=self.explore,
                               key_previous_init=self.key_previous_init)


@dataclass
class Selection:
    """What :class:`LearnedTopology` chose: the kept edges, sorted by destination."""

    edge_index: Tensor  # (2, E_kept) global node ids, sorted by destination
    edge_type: Tensor  # (E_kept,) index into the glue edge types
    weight: Tensor  # (E_kept,) softmax weight alpha_e (a destination's sum: 1 - its sink weight)
    score: Tensor  # (E_kept,) the logit s_e
    ptr: Tensor  # (N + 1,) destination CSR pointer of the kept edges
    num_candidates: Tensor  # (num_edge_types,) candidates in the pools, per edge type
    candidates: tuple[Tensor, Tensor, Tensor] | None = None  # pools: (2, C) index, (C,) type, (C,) score
    pool_read: Tensor | None = None  # (num_outputs, D) soft read of every output's whole pool (when asked for)
    block_loss: Tensor | None = None  # () the block scorer's distillation loss (when asked for, with block_scorer)


@dataclass
class TopologyInput:
    """The parts of a flat site the selection reads (see :class:`~sheafgnn.site.flat.FlatSite`)."""

    rule_index: Tensor  # (2, E) rule candidates, sorted by destination
    rule_type: Tensor  # (E,)
    rule_ptr: Tensor  # (N + 1,)
    node_type: Tensor  # (N,) flat node type of every node
    tokens: slice  # the token block of the flat node order
    outputs: slice  # the output block; output i reads token i
    token_pos: Tensor  # (num_tokens,) position in the graph
    token_graph_start: Tensor  # (num_tokens,) global index of the graph's first token


class LearnedTopology(TopologyStep, nn.Module):
    r"""Chooses the gluing edges: pools of candidates, top-k per destination, softmax weights.

    For a candidate :math:`e = (u \to v)` of type :math:`\tau`,

    .. math::
        s_e = \frac{\langle \mathbf{q}_v, \mathbf{k}_u
        \rangle}{\sqrt{r}} + b_\tau, \qquad
        \alpha_e = \frac{\exp s_e}{\exp s_{\varnothing, \kappa(v)} +
        \sum_{e' \in K(v)} \exp s_{e'}} \quad (e \in K(v)),

    with :math:`\mathbf{q}_v = n_q(\mathbf{W}_q \mathbf{x}_v)`, :math:`\mathbf{k}_u = n_k(\mathbf{W}_k
    \mathbf{x}_u)` for a patch and :math:`\mathbf{k}_u = n_k(\mathbf{W}_k \mathbf{x}_u + \mathbf{W}'_k
    \mathbf{x}_{u-1})` for a token (the token before it; zero at a graph's start), :math:`n_q, n_k`
    RMSNorms with learned gains (QK-norm: a score starts within :math:`\pm\sqrt{r}`, so the softmax starts
    soft), where :math:`K(v)` holds the :math:`k` best candidates of :math:`v`'s pool (rule, content and
    random proposals together, see the module docstring)
    and :math:`s_{\varnothing, \kappa}` is a learned "nothing" logit per
    destination node type :math:`\kappa`.

    Args:
        channels (int): node width :math:`D`.
        num_edge_types (int): glue edge types (the rule types, content and random).
        num_node_types (int): flat node types (one sink logit each).
        k (int): candidates kept per destination.
        content_type (int): the edge type of the content proposals (the caller looks it up by name).
        random_type (int): the edge type of the random proposals.
        rank (int, optional): width :math:`r` of the query/key projections. (default: :obj:`16`)
        qk_norm (bool, optional): the RMSNorms :math:`n_q, n_k`; identities if :obj:`False`. (default: :obj:`True`)
        content_blocks (int, optional): blocks proposed per output; 0 switches content
            proposals off. (default: :obj:`16`)
        block_size (int, optional): tokens per content block :math:`B`. (default: :obj:`4`)
        random_proposals (int, optional): random past tokens proposed per output. (default: :obj:`0`)
        seed (int, optional): seed of the random proposals. (default: :obj:`0`)
        block_scorer (bool, optional): score content blocks with a query and keys of their own, trained
            by :meth:`block_distillation`, instead of the token scorer's query against the summary of its
            keys. (default: :obj:`False`)
        block_summary (str, optional): how a block's token keys are summarised for its score,
            :obj:`"mean"` or :obj:`"bounds"` (:func:`summarize_blocks`). (default: :obj:`"bounds"`)
        sink_threshold (bool, optional): keep only candidates with :math:`s_e > s_{\varnothing, \kappa(v)}`
            among the :math:`k` best, so that a destination the "nothing" logit outscores everywhere keeps
            no edge; the weights are those of the softmax over all :math:`k` and the sink, zero for the
            others, which in training stay in the selection with a straight-through gradient
            (:meth:`_straight_through_zero`). (default: :obj:`False`)
        explore (float, optional): in training, choose :math:`K(v)` by :math:`s_e + \tau g_e` with
            :math:`g_e` Gumbel noise and :math:`\tau` = ``explore`` (Gumbel-top-k: a sample of :math:`k`
            without replacement from :math:`\mathrm{softmax}(s / \tau)`); :math:`\alpha_e` stays the softmax of
            the scores. Evaluation and the stream take the top :math:`k`. 0 switches it off. (default: :obj:`0`)
        key_previous_init (str, optional): how :math:`\mathbf{W}'_k` starts: :obj:`"random"` (its own draw) or
            :obj:`"query"` (a copy of :math:`\mathbf{W}_q`; the block scorer's :math:`\mathbf{W}'_{bk}` a copy of
            :math:`\mathbf{W}_{bq}`), so that at init :math:`\langle \mathbf{q}_v, \mathbf{k}_u \rangle` holds
            :math:`\lVert \mathbf{W}_q \mathbf{x}_v \rVert^2` where token :math:`u - 1` is :math:`v`'s token: the
            token after an earlier occurrence of :math:`v`'s own starts ranked high. (default: :obj:`"query"`)

    Shapes:
        - **input:** node features :math:`(N, D)`, a :class:`TopologyInput`
        - **output:** a :class:`Selection` (kept edges, weights, scores, pool sizes)
        - **step** (:mod:`sheafgnn.nn.topology_step`): a stream batch's new nodes :math:`(N, D)`, a
          :class:`~sheafgnn.nn.inference.TopologyDelta` and the block's cache -> the edges into the new nodes
    """

    def __init__(self, channels: int, num_edge_types: int, num_node_types: int, k: int, content_type: int,
                 random_type: int, rank: int = TopologyConfig.rank, qk_norm: bool = TopologyConfig.qk_norm,
                 content_blocks: int = TopologyConfig.content_blocks,
                 block_size: int = TopologyConfig.block_size, random_proposals: int = TopologyConfig.random_proposals,
                 seed: int = 0, block_scorer: bool = TopologyConfig.block_scorer,
                 block_summary: str = TopologyConfig.block_summary,
                 sink_threshold: bool = TopologyConfig.sink_threshold,
                 explore: float = TopologyConfig.explore,
                 key_previous_init: str = TopologyConfig.key_previous_init) -> None:
        # the defaults are TopologyConfig's: one place says what the default topology is
        super().__init__()
        name = self.__class__.__name__
        check_topology(name, k, rank, content_blocks, block_size, random_proposals, block_summary, explore,
                       key_previous_init)
        if not (0 <= content_type < num_edge_types and 0 <= random_type < num_edge_types):
            raise ValueError(f"{name}: content_type and random_type must be edge types in [0, {num_edge_types}) "
                             f"(got {content_type} and {random_type})")
        self.channels, self.num_edge_types, self.k, self.rank, self.qk_norm = channels, num_edge_types, k, rank, qk_norm
        self.content_blocks, self.block_size, self.block_summary = content_blocks, block_size, block_summary
        self.random_proposals, self.seed, self.sink_threshold = random_proposals, seed, sink_threshold
        self.explore, self._noise = explore, None  # the noise's own generator: it leaves the global one alone
        self.key_previous_init = key_previous_init
        self.content_type, self.random_type = content_type, random_type
        self.query = nn.Linear(channels, rank, bias=False)
        self.key = nn.Linear(channels, rank, bias=False)
        self.key_previous = nn.Linear(channels, rank, bias=False)  # a token's key also sees the token before it
        self.query_norm = nn.RMSNorm(rank) if qk_norm else nn.Identity()
        self.key_norm = nn.RMSNorm(rank) if qk_norm else nn.Identity()
        # A block scorer of its own: a block summary averages 16 token keys, and the token scorer's keys, free to
        # score its losers anyhow, can drown the one match in the noise of the other 15 (MQAR at 512 tokens, 32
        # pairs: the chosen blocks held the answer for 67-71% of queries with them, 82-88% with this scorer)
        self.block_scorer = block_scorer and content_blocks > 0
        if self.block_scorer:
            self.block_query = nn.Linear(channels, rank, bias=False)
            self.block_key = nn.Linear(channels, rank, bias=False)
            self.block_key_previous = nn.Linear(channels, rank, bias=False)
        self.type_bias = nn.Parameter(torch.empty(num_edge_types))
        self.sink = nn.Parameter(torch.empty(num_node_types))
        self.random_scores = False  # the random-score ablation (evaluation only)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for layer in (self.query, self.key, self.key_previous, self.query_norm, self.key_norm):
            if hasattr(layer, "reset_parameters"):  # nn.Identity has none
                layer.reset_parameters()
        if self.block_scorer:
            for linear in (self.block_query, self.block_key, self.block_key_previous):
                linear.reset_parameters()
        if self.key_previous_init == "query":  # after the draws above: the other weights are those of "random"
            with torch.no_grad():
                self.key_previous.weight.copy_(self.query.weight)
                if self.block_scorer:
                    self.block_key_previous.weight.copy_(self.block_query.weight)
        nn.init.zeros_(self.type_bias)
        # Under the threshold a destination starts with full-strength messages from its k best (the nothing
        # logit below every score at init; at 0 about half the candidates would be cut from the first step).
        # With it the learned-topology study learned to copy entity values (README); the plain model keeps 0.
        nn.init.constant_(self.sink, SINK_THRESHOLD_INIT if self.sink_threshold else 0.0)

    def score(self, dot: Tensor, edge_type: Tensor) -> Tensor:
        """Scores from the query-key dot products of candidates listed one per row (E,) or of dense pools
        (M, P) (:func:`pool_dot`)."""
        if self.random_scores:  # seeded noise in place of every learned score
            generator = torch.Generator(device=dot.device).manual_seed(self.seed + 1)
            return torch.randn(edge_type.shape, generator=generator, device=dot.device)
        # index_select, not indexing: its backward is an index_add, 3x faster than indexing's accumulating put
        bias = self.type_bias.index_select(0, edge_type.flatten()).view_as(edge_type)
        return dot / math.sqrt(self.rank) + bias

    def compete_sparse(self, score: Tensor, dst: Tensor, sink: Tensor) -> tuple[Tensor, Tensor]:
        """The competition of destinations whose candidates are listed edge by edge.

        Args:
            score (Tensor): (E,) candidate scores, sorted by destination.
            dst (Tensor): (E,) destination of each candidate, in ``[0, num_dst)``.
            sink (Tensor): (num_dst,) each destination's "nothing" logit.

        Returns:
            keep (E,) the k best of each destination, and the softmax weights (E_kept,) of the kept ones.
        """
        keep = topk_per_group(self._ranking(score), dst, self.k)
        num_dst = sink.numel()
        logits = torch.cat([score[keep], sink])
        index = torch.cat([dst[keep], torch.arange(num_dst, device=dst.device)])
        weight = segment_softmax(logits, index, num_nodes=num_dst)[: logits.numel() - num_dst]
        if self.sink_threshold:
            below = score[keep] <= sink[dst[keep]]  # (E_kept,)
            if self.training:
                weight = self._straight_through_zero(weight, below)
            else:
                keep, weight = keep.masked_scatter(keep, ~below), weight[~below]
        return keep, weight

    def _ranking(self, score: Tensor) -> Tensor:
        """What the kept candidates are chosen by: the scores, or in training with ``explore`` the detached
        scores plus ``explore`` times Gumbel noise (-inf stays -inf)."""
        if not (self.training and self.explore):
            return score
        if self._noise is None or self._noise.device != score.device:
            self._noise = torch.Generator(device=score.device).manual_seed(self.seed + 2)
        uniform = torch.rand(score.shape, generator=self._noise, device=score.device, dtype=score.dtype)
        gumbel = -torch.log(-torch.log(uniform.clamp(min=torch.finfo(score.dtype).tiny)))
        return score.detach() + self.explore * gumbel

    def compete_dense(self, score: Tensor, sink: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The competition of destinations whose pools are rows of a dense (M, P) score matrix.

        A stable sort, not topk: equal scores (a token proposed twice) rank by column, deterministically.

        Args:
            score (Tensor): (M, P) candidate scores, -inf at padding.
            sink (Tensor): (M, 1) each destination's "nothing" logit.

        Returns:
            the kept scores (M, k) (-inf where a pool has fewer), their columns (M, k), and
            their softmax weights (M, k) (0 where -inf).
        """
        pick = self._ranking(score.detach()).sort(dim=1, descending=True, stable=True).indices[:, : self.k]  # (M, k)
        top = score.gather(1, pick)
        weight = torch.cat([top, sink], 1).softmax(1)[:, :-1]  # (M, k): -inf -> 0
        if self.sink_threshold:
            below = top <= sink  # (M, k)
            if self.training:
                weight = self._straight_through_zero(weight, below)
            else:  # not kept: -inf, weight 0
                top, weight = top.masked_fill(below, float("-inf")), weight.masked_fill(below, 0.0)
        return top, pick, weight

    @staticmethod
    def _straight_through_zero(weight: Tensor, below: Tensor) -> Tensor:
        """``weight`` with exact zeros where ``below`` and, there, the gradient of ``weight`` itself
        (straight-through, SparseK style): the message of a candidate the "nothing" logit outscores is
        not taken, but the loss still tells its score whether taking it would pay."""
        return torch.where(below, weight - weight.detach(), weight)

    def block_proposals(self, blocks: Tensor) -> tuple[Tensor, Tensor]:
        """(M, m * B) the tokens of every output's chosen blocks ``blocks`` (M, m) (first token of each,
        -1: none), -1 where none, and their edge types (content)."""
        tokens = blocks.unsqueeze(-1) + torch.arange(self.block_size, device=blocks.device)  # (M, m, B)
        tokens = torch.where(blocks.unsqueeze(-1) >= 0, tokens, -1).flatten(1)  # (M, m * B)
        return tokens, torch.full_like(tokens, self.content_type)

    def position_proposals(self, token_pos: Tensor, graph_start: Tensor) -> tuple[Tensor, Tensor]:
        """(M, P1) the proposals that depend only on an output's position ``token_pos`` (M,) in its graph
        (whose first token is ``graph_start`` (M,)), -1: none, and their edge types: the tokens of its
        own block up to itself (NSA's sliding window, so that a match too recent for a complete block
        still has a candidate; type content), then its random tokens. A stream keeps them in a table of
        every position so far, read by every block."""
        sources, num_content = [], 0
        if self.content_blocks:
            recent = (token_pos - token_pos % self.block_size).unsqueeze(1) + torch.arange(
                self.block_size, device=token_pos.device)  # (M, B) positions
            sources.append(torch.where(recent <= token_pos.unsqueeze(1), recent + graph_start.unsqueeze(1), -1))
            num_content = self.block_size
        if self.random_proposals:
            sources.append(random_proposals(token_pos, graph_start, self.random_proposals, self.seed))
        sources = torch.cat(sources, 1) if sources else token_pos.new_zeros(token_pos.size(0), 0)
        types = torch.full_like(sources, self.random_type)
        types[:, :num_content] = self.content_type
        return sources, types

    def _patch_selection(self, q: Tensor, k: Tensor, inp: TopologyInput, return_candidates: bool):
        """Rule candidates into non-output destinations: sparse top-k per destination, softmax with the sink."""
        stop = int(inp.rule_ptr[inp.outputs.start])  # edges into outputs are the sorted tail
        src, dst = inp.rule_index[:, :stop]
        edge_type = inp.rule_type[:stop]
        score = self.score((q[dst] * k[src]).sum(-1), edge_type)  # (E_p,)
        keep, weight = self.compete_sparse(score, dst, self.sink[inp.node_type[: inp.outputs.start]])
        pool = (inp.rule_index[:, :stop], edge_type, score) if return_candidates else None
        return (src[keep], dst[keep], edge_type[keep], weight, score[keep]), pool, edge_type

    def _output_pool(self, block_query: Tensor, block_keys: Tensor,
                     inp: TopologyInput) -> tuple[Tensor, Tensor, Tensor]:
        """(num_out, P) candidate sources of every output (-1: padding), their edge types, and the first
        token of each output's chosen blocks (num_out, content_blocks) (-1: none; the first columns of
        the pool hold their tokens), chosen by ``block_query`` (num_out, r) against the summaries of
        ``block_keys`` (num_tokens, r)."""
        num_out, out0, tok0 = inp.outputs.stop - inp.outputs.start, inp.outputs.start, inp.tokens.start
        start = int(inp.rule_ptr[out0])
        src, dst = inp.rule_index[:, start:]
        rule_sources, rule_types = rule_pools(src, dst - out0, inp.rule_type[start:], num_out)
        graph_start = inp.token_graph_start - tok0
        blocks = torch.full((num_out, self.content_blocks), -1, dtype=torch.long, device=src.device)
        if self.content_blocks:
            blocks = content_blocks(block_query, block_keys, inp.token_pos, graph_start, self.block_size,
                                    self.content_blocks, self.random_scores, self.block_summary)  # (num_out, m)
        far, far_types = self.block_proposals(blocks)  # (num_out, m * B)
        near, near_types = self.position_proposals(inp.token_pos, graph_start)  # (num_out, P1)
        sources = torch.cat([far, near], 1)  # (num_out, P0) token indices
        sources = torch.where(sources >= 0, sources + tok0, -1)
        types = torch.cat([far_types, near_types], 1)
        # Proposals first, rules (whose width depends on the whole batch) last: a candidate's column,
        # and so its rank among equal scores, never depends on other destinations.
        return torch.cat([sources, rule_sources], 1), torch.cat([types, rule_types], 1), blocks

    def _output_selection(self, x: Tensor, q: Tensor, k: Tensor, inp: TopologyInput,
                          return_candidates: bool, return_pool_read: bool, return_block_loss: bool):
        """Every output's pool (rules, content, random) in one dense (num_out, P) competition."""
        out0 = inp.outputs.start
        q_out = q[inp.outputs]  # (num_out, r)
        block_query, block_keys = q_out, k[inp.tokens]  # content_blocks detaches them
        if self.block_scorer:  # recorded for backward only for its distillation loss
            with torch.set_grad_enabled(return_block_loss and torch.is_grad_enabled()):
                block_query = self.block_query(x[inp.outputs])  # (num_out, r)
                tokens = x[inp.tokens]  # (num_tokens, D)
                block_keys = self.block_token_keys(tokens, self._previous(tokens, inp))  # (num_tokens, r)
        sources, types, blocks = self._output_pool(block_query, block_keys, inp)  # (num_out, P) each, (num_out, m)
        sink = self.sink[inp.node_type[inp.outputs]].unsqueeze(1)  # (num_out, 1)
        score, top, src, edge_type, weight = self.compete_pools(q_out, k, sources, types, sink)  # (num_out, P), k each
        kept = torch.isfinite(top)
        dst = torch.arange(out0, out0 + q_out.size(0), device=q.device).unsqueeze(1)  # (num_out, 1)
        kept_edges = (src[kept], dst.expand_as(top)[kept], edge_type[kept], weight[kept], top[kept])
        pool_read = self._pool_read(x, score, sink, sources) if return_pool_read else None
        block_loss = None
        if return_block_loss and self.block_scorer:
            block_loss = self.block_distillation(block_query, block_keys, inp, blocks, score, sink)
        pool, valid = None, sources >= 0  # (num_out, P)
        if return_candidates:
            pool = (torch.stack([sources[valid], dst.expand_as(sources)[valid]]), types[valid], score[valid])
        return kept_edges, pool, types[valid], pool_read, block_loss

    def compete_pools(self, query: Tensor, keys: Tensor, sources: Tensor, types: Tensor,
                      sink: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """The competition of destinations whose pools are rows, scored and then :meth:`compete_dense`: the
        outputs' competition in :meth:`forward` and in :meth:`compete_outputs_reference` (the reference of the
        C++ kernel ``stream_pools``).

        Args:
            query (Tensor): (M, r) the destinations' queries.
            keys (Tensor): (R, r) the keys that the pools index.
            sources (Tensor): (M, P) each destination's candidates, rows of ``keys`` (-1: padding).
            types (Tensor): (M, P) their edge types.
            sink (Tensor): (M, 1) each destination's "nothing" logit.

        Returns:
            the pool scores (M, P) (-inf at padding), and of the ``k`` columns each row keeps: their scores (-inf
            where a pool has fewer), sources, edge types and softmax weights, (M, k) each.
        """
        score = self.score(pool_dot(query, keys, sources.clamp(min=0)), types)  # (M, P)
        score = score.masked_fill(sources < 0, float("-inf"))
        top, pick, weight = self.compete_dense(score, sink)
        return score, top, sources.gather(1, pick), types.gather(1, pick), weight

    def _pool_read(self, x: Tensor, score: Tensor, sink: Tensor, sources: Tensor) -> Tensor:
        r"""(num_out, D) the softmax-weighted read of every output's *whole* pool,
        :math:`\sum_{u \in P(v)} \mathrm{softmax}(s)_u \, \mathrm{sg}(\mathbf{x}_u)`.

        It feeds an auxiliary next-token loss only (``SheafStateConfig.pool_loss_weight``), never the
        model's output: through it every candidate's score gets a gradient, not only the k kept ones
        (a hard top-k passes none to the rest), so the choice learns which candidates carry what the
        prediction needs (the role of NSA's compressed branch). The states are read as they are
        (stop-gradient, no projection): a candidate whose state holds the next token is rewarded from
        the first step. O(n P D) time, computed only when asked for (:func:`pool_read`: the candidate
        states are never kept for backward).
        """
        weight = torch.cat([score, sink], 1).softmax(1)[:, :-1]  # (num_out, P): -inf (padding) -> 0
        return pool_read(weight, x.detach(), sources.clamp(min=0))  # (num_out, D); padding has weight 0

    def block_distillation(self, block_query: Tensor, block_keys: Tensor, inp: TopologyInput, blocks: Tensor,
                           score: Tensor, sink: Tensor) -> Tensor:
        r"""The block scorer's loss: KL from the token competition's choice among each output's chosen
        blocks (a detached teacher, DSA style) to the block scores' softmax over the same blocks.

        .. math::
            t_{vj} \propto \sum_{u \in j} \mathrm{softmax}(\mathrm{sg}([s_{P(v)}, s_\varnothing]))_u, \qquad
            \mathcal{L} = \frac{\sum_v m_v\, \mathrm{KL}(t_v \,\|\, \mathrm{softmax}_j \langle
            \mathbf{W}_{bq} \mathbf{x}_v, \bar{\mathbf{k}}_j \rangle / \sqrt{r})}{\sum_v m_v},

        over the blocks :math:`j` chosen for :math:`v`, where :math:`m_v` is the teacher's weight on all of
        them (a destination whose token scores look elsewhere teaches little). The top-k of blocks passes
        no gradient, so this is the block scorer's only training signal: it learns which blocks hold the
        tokens the token scores pick, and ranks the blocks it has not chosen by the same features. Cost
        O(n * content_blocks * r) on top of the pools.

        Args:
            block_query (Tensor): (num_out, r) the outputs' block queries.
            block_keys (Tensor): (num_tokens, r) the tokens' block keys (:meth:`block_token_keys`).
            inp (TopologyInput): the site.
            blocks (Tensor): (num_out, m) first token of each output's chosen blocks (-1: none); their
                tokens are the first ``m * B`` columns of the pool.
            score (Tensor): (num_out, P) the pool scores (-inf at padding).
            sink (Tensor): (num_out, 1) the "nothing" logits.
        """
        M, m, B = blocks.shape[0], self.content_blocks, self.block_size
        teacher = torch.cat([score, sink], 1).detach().softmax(1)[:, : m * B].reshape(M, m, B).sum(-1)  # (M, m)
        mass = teacher.sum(1)  # (M,)
        chosen = blocks >= 0
        block_start, block_key = block_summaries(block_keys, inp.token_pos, inp.token_graph_start - inp.tokens.start, B,
                                                 self.block_summary)
        if block_start.numel() == 0:
            return score.new_zeros(())
        index = torch.searchsorted(block_start, blocks.clamp(min=0)).clamp(max=block_start.numel() - 1)  # (M, m)
        student = pool_dot(summary_query(block_query, self.block_summary), block_key, index) / math.sqrt(self.rank)
        log_student = student.masked_fill(~chosen, float("-inf")).log_softmax(1)
        target = teacher / mass.clamp(min=1e-12).unsqueeze(1)
        kl = torch.where(chosen & (target > 0), target * (target.clamp(min=1e-12).log() - log_student), 0.0).sum(1)
        counted = chosen.sum(1) >= 2  # a softmax over one block is 1 whatever its score
        weight = torch.where(counted, mass, 0.0)
        return (weight * kl).sum() / weight.sum().clamp(min=1e-12)

    @staticmethod
    def _previous(rows: Tensor, inp: TopologyInput) -> Tensor:
        """(num_tokens, c) the row of the token before each token (zero at a graph's start), from one row
        per token (num_tokens, c)."""
        previous = torch.cat([rows.new_zeros(1, rows.size(1)), rows[:-1]])  # (num_tokens, c)
        return previous.masked_fill((inp.token_pos == 0).unsqueeze(1), 0.0)

    def _keys(self, x: Tensor, inp: TopologyInput) -> Tensor:
        """(N, r) keys; a token's key adds the projection of the token before it, the previous-token
        feature that recall needs: the value after key K is found by matching K. The projection is
        row-wise without bias, so the projected tokens are shifted, not the (num_tokens, D) states
        (which autograd would keep for the projection's backward)."""
        k = self.key(x)  # (N, r)
        k_tok = k[inp.tokens] + self._previous(self.key_previous(x[inp.tokens]), inp)  # (num_tokens, r)
        return torch.cat([k[: inp.tokens.start], k_tok, k[inp.tokens.stop :]])

    def block_token_keys(self, tokens: Tensor, previous: Tensor) -> Tensor:
        """(T, r) the block scorer's keys of tokens with states ``tokens`` (T, D), the token before each
        ``previous`` (T, D) (a block summary is their mean); the full forward and the stream both call it."""
        return self.block_key(tokens) + self.block_key_previous(previous)

    def forward(self, x: Tensor, inp: TopologyInput, return_candidates: bool = False,
                return_pool_read: bool = False, return_block_loss: bool = False) -> Selection:
        q, k = self.query_norm(self.query(x)), self.key_norm(self._keys(x, inp))  # (N, r) each
        patch, patch_pool, patch_types = self._patch_selection(q, k, inp, return_candidates)
        output, output_pool, output_types, pool_read, block_loss = self._output_selection(
            x, q, k, inp, return_candidates, return_pool_read, return_block_loss)
        src, dst, edge_type, weight, score = (torch.cat([a, b]) for a, b in zip(patch, output))
        ptr = ptr_from_index(dst, x.size(0))
        num_candidates = torch.bincount(torch.cat([patch_types, output_types]), minlength=self.num_edge_types)
        candidates = None
        if return_candidates:
            candidates = tuple(torch.cat([a, b], -1) for a, b in zip(patch_pool, output_pool))
        return Selection(torch.stack([src, dst]), edge_type, weight, score, ptr, num_candidates, candidates,
                         pool_read, block_loss)

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}({self.channels}, num_edge_types={self.num_edge_types}, k={self.k}, "
                f"qk_norm={self.qk_norm}, content_blocks={self.content_blocks}, block_size={self.block_size}, "
                f"random_proposals={self.random_proposals}, block_scorer={self.block_scorer}, "
                f"block_summary={self.block_summary!r}, sink_threshold={self.sink_threshold}, explore={self.explore}, "
                f"key_previous_init={self.key_previous_init!r})")
