r"""Which route of a trained model carries a dependency: its evaluation loss with one route cut at a time.

A :class:`~sheafgnn.model.SheafStateLM` can carry a token's information
forward along two kinds of route: the **chains** (Phi, the selective SSM that
runs along the token stream and along each chained patch type, carrying a
state from one node to the next) and the **gluing** (the edges the learned
topology keeps, each of a glue type). The learned-topology study's
coverage counts only the second; a model may learn by the first. This
module measures which one a dependency takes, on the synthetic language's
evaluation sequence (:mod:`sheafgnn.experiments.synthetic`), by cutting one
route at evaluation and reading the next-token loss by target kind:

- ``token chain``: the token SSM restarts at the token after each section's
  key (:func:`section_cuts`), so its state never holds a key across the cut;
- ``patch chains``: every patch chain restarts at its first patch after the
  cut whose predecessor started before it (a patch that covers the key still
  pools it; its successors do not inherit it);
- ``chains``: both;
- ``cover``: no patch pools its tokens (the cover edges, which the study
  counts as fixed, cut);
- ``gluing``: every kept edge carries no message (weight 0);
- ``src rel dst``: the kept edges of that glue type carry no message.

A route is *needed* by a target kind when cutting it raises that kind's loss;
the anchored letters' floor is 1.39 nats (knowing the key) and their uniform
loss 2.77. The cuts are forward hooks: the model's weights and code are
untouched, and the hooks are removed after each route.

::

    next_token_loss(model, data, seq)          eval loss: overall, by target kind, long-range targets
    random_score_loss(model, data, seq)        the same with every block's scores seeded noise
    section_cuts(seq) -> (S,)                  the position after each section key
    cut_chains(data, cuts) -> FlatSite         the flat site with its chains restarted at the cuts
    cut_routes(model, site, dropped)           context: blocks run on ``site``, glue types ``dropped`` carry nothing
    route_losses(model, data, seq) -> dict     every route cut in turn (learned_topology.json "routes")
    value_copy_sources(model, data, seq)       per block: which value the strongest content edge of a copy reads
    format_routes(routes), plot_routes(routes, path)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.experiments.report import pyplot, save_figure
from sheafgnn.experiments.synthetic import DEP_TYPES, LETTERS, GeneratorConfig, Kind, SyntheticSequence
from sheafgnn.model import SheafStateLM
from sheafgnn.site.flat import FlatSite, flatten_site
from sheafgnn.site.schema import CANDIDATE_EDGES, CHAINED_TYPES, CONTENT_EDGE, GLUE_EDGES, RANDOM_EDGE

LONG_RANGE_KINDS = (Kind.ANCHORED, Kind.VALUE_COPY)  # target kinds whose G* has a long-range source
# Ordinals of an anchored letter in its section, grouped: the first follows the key closely, the later ones can
# also infer the key's shift from the section's earlier anchored letters, a route G* does not list.
ORDINAL_GROUPS = {"1st": (0, 0), "2nd": (1, 1), "3rd-5th": (2, 4), "6th-10th": (5, 9), "11th+": (10, math.inf)}
CHAIN_ROUTES = {"token chain": (True, False), "patch chains": (False, True), "chains": (True, True)}
# In nats: the key known, the letter is one of ``branching`` (T[a, b, u] for each free u); unknown, any of 16.
ANCHORED_FLOOR, ANCHORED_UNIFORM = math.log(GeneratorConfig().branching), math.log(len(LETTERS))


@torch.no_grad()
def next_token_loss(model, data: HeteroData, seq: SyntheticSequence) -> dict:
    """Next-token cross-entropy (nats) of ``model`` on ``data`` (eval mode), overall and by target kind."""
    was_training = model.training
    model.eval()
    logits = model(data)  # (n, V)
    model.train(was_training)
    ce = F.cross_entropy(logits[:-1].float(), seq.ids[1:], reduction="none")  # (n - 1,)
    target_kind = seq.kind[1:].long()
    by_kind = {}
    for k, name in enumerate(Kind.NAMES):
        mask = target_kind == k
        if mask.any():
            by_kind[name] = float(ce[mask].mean())
    long_range = torch.isin(target_kind, torch.tensor(LONG_RANGE_KINDS))
    ordinal = anchored_ordinal(seq)[1:]  # of each target
    by_ordinal = {}
    for name, (lo, hi) in ORDINAL_GROUPS.items():
        mask = (ordinal >= lo) & (ordinal <= hi)
        by_ordinal[name] = float(ce[mask].mean()) if mask.any() else None
    return {"loss": float(ce.mean()), "by_target_kind": by_kind,
            "long_range": float(ce[long_range].mean()) if long_range.any() else None,
            "anchored_by_ordinal": by_ordinal}


def anchored_ordinal(seq: SyntheticSequence) -> Tensor:
    """(n,) for every anchored token its ordinal among the anchored tokens of its section (0: the first
    sentence's), -1 for every other token."""
    anchored = torch.nonzero(seq.kind == Kind.ANCHORED).flatten()  # (A,)
    key = seq.key_pos[anchored]
    index = torch.arange(anchored.numel())
    first = torch.ones(anchored.numel(), dtype=torch.bool)
    first[1:] = key[1:] != key[:-1]  # a new section's first anchored token
    group_start = torch.where(first, index, 0).cummax(0).values
    out = torch.full_like(seq.ids, -1)
    out[anchored] = index - group_start
    return out


def random_score_loss(model: SheafStateLM, data: HeteroData, seq: SyntheticSequence) -> dict:
    """:func:`next_token_loss` with every block's topology scores replaced by seeded noise (the
    random-score ablation, ``LearnedTopology.random_scores``); the model is left as it was."""
    for block in model.blocks:
        block.topology.random_scores = True
    try:
        return next_token_loss(model, data, seq)
    finally:
        for block in model.blocks:
            block.topology.random_scores = False


def section_cuts(seq: SyntheticSequence) -> Tensor:
    """(S,) sorted: the position right after each section's key (a cut chain restarts there)."""
    keys = torch.unique(seq.key_pos[seq.key_pos >= 0])
    return keys[keys + 1 < seq.ids.numel()] + 1


def _crosses(start: Tensor, cuts: Tensor) -> Tensor:
    """(n,) True where a chain of nodes starting at ``start`` (n,), in chain order, steps over a cut c:
    its predecessor starts before c and it does not. Restarting there, no state reaches a node that
    starts at or after c from one that started before it (by induction along the chain)."""
    out = torch.zeros(start.numel(), dtype=torch.bool, device=start.device)
    if start.numel() > 1:
        before = torch.searchsorted(cuts, start[:-1], right=True)  # cuts <= the predecessor's start
        upto = torch.searchsorted(cuts, start[1:], right=True)  # cuts <= the node's start
        out[1:] = upto > before
    return out


def cut_chains(data: HeteroData, cuts: Tensor, token: bool = True, patches: bool = True,
               site: FlatSite | None = None) -> FlatSite:
    """The flat site of ``data`` with its chains restarted at the token positions ``cuts``.

    Args:
        data (HeteroData): the site of one text (its patches' ``span`` give where they start).
        cuts (Tensor): (S,) token positions; no chain state crosses from before one to after it.
        token, patches (bool): cut the token chain, the patch chains.
        site (FlatSite, optional): the flat site of ``data`` to cut further (default: ``flatten_site(data)``).
    """
    site = site if site is not None else flatten_site(data)
    if not bool((site.token_pos == torch.arange(site.token_pos.numel(), device=site.token_pos.device)).all()):
        raise ValueError("cut_chains: expected the site of one text, not a batch")
    cuts = torch.sort(cuts.to(site.token_pos.device)).values
    token_reset, chain_reset = site.token_reset, site.chain_reset
    if token:
        token_reset = token_reset | _crosses(site.token_pos, cuts)
    if patches:
        # chain_reset lists the chained types' nodes in CHAINED_TYPES order, each type one chain per graph
        chain_reset = chain_reset | torch.cat([_crosses(data[t].span[:, 0].contiguous(), cuts) for t in CHAINED_TYPES])
    return dataclasses.replace(site, token_reset=token_reset, chain_reset=chain_reset)


@contextmanager
def cut_routes(model: SheafStateLM, site: FlatSite | None = None, dropped: Sequence[int] = (),
               cover: bool = True) -> Iterator[None]:
    """Within the context, every block of ``model`` runs on ``site`` (a flat site of the data the model is
    given, e.g. from :func:`cut_chains`), the kept edges of the glue types ``dropped`` (indices into
    :data:`~sheafgnn.site.schema.GLUE_EDGES`) carry no message and, with ``cover=False``, no patch pools
    its tokens (every cover edge cut). Forward hooks, removed on exit; contexts nest (the innermost site
    wins)."""
    handles = []
    drop = torch.tensor(list(dropped), dtype=torch.long)

    def use_site(block, args):
        return (args[0], site, *args[2:])

    def zero_dropped(topology, args, chosen):
        keep = ~torch.isin(chosen.edge_type, drop.to(chosen.edge_type.device))
        return dataclasses.replace(chosen, weight=chosen.weight * keep)

    try:
        for block in model.blocks:
            if site is not None:
                handles.append(block.register_forward_pre_hook(use_site))
            if drop.numel():
                handles.append(block.topology.register_forward_hook(zero_dropped))
            if not cover:
                handles.append(block.pool.register_forward_hook(lambda pool, args, out: torch.zeros_like(out)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def glue_types_in_use(model: SheafStateLM, data: HeteroData) -> list[int]:
    """Indices of the glue types with candidates on ``data``: the site's rule types that have edges, and the
    content and random proposals where the model makes them."""
    c = model.config.topology
    used = [i for i, t in enumerate(CANDIDATE_EDGES) if t in data.edge_types and data[t].edge_index.size(1) > 0]
    used += [GLUE_EDGES.index(CONTENT_EDGE)] if c.content_blocks > 0 else []
    used += [GLUE_EDGES.index(RANDOM_EDGE)] if c.random_proposals > 0 else []
    return used


def route_losses(model: SheafStateLM, data: HeteroData, seq: SyntheticSequence, site: FlatSite | None = None) -> dict:
    """:func:`next_token_loss` of ``model`` with each route cut in turn (module docstring).

    Args:
        site (FlatSite, optional): the flat site of ``data`` that the model runs on when nothing is cut, and
            that every cut starts from (default: ``flatten_site(data)``; a model trained with its chains cut
            is measured from its own cut site).

    Returns:
        ``{"cuts": S, "routes": {name: next_token_loss row}, "value_copy_sources": per block}``
        (:func:`value_copy_sources`); route names ``"none"`` (nothing cut),
        ``"token chain"``, ``"patch chains"``, ``"chains"``, ``"cover"``, ``"gluing"``, then ``"src rel dst"``
        for every glue type in use (:func:`glue_types_in_use`).
    """
    if not model.config.glues:
        raise ValueError("route_losses: this model has gluing switched off (the ssm ablation)")
    cuts = section_cuts(seq)
    site = site if site is not None else flatten_site(data)
    used = glue_types_in_use(model, data)
    runs = {"none": {"site": site}}  # cut_routes' arguments of each route
    for name, (token, patches) in CHAIN_ROUTES.items():
        runs[name] = {"site": cut_chains(data, cuts, token, patches, site=site)}
    runs["cover"] = {"site": site, "cover": False}
    runs["gluing"] = {"site": site, "dropped": range(len(GLUE_EDGES))}
    runs.update({" ".join(GLUE_EDGES[i]): {"site": site, "dropped": [i]} for i in used})
    routes = {}
    for name, cut in runs.items():
        with cut_routes(model, **cut):
            routes[name] = next_token_loss(model, data, seq)
    with cut_routes(model, site):
        sources = value_copy_sources(model, data, seq)
    return {"cuts": int(cuts.numel()), "routes": routes, "value_copy_sources": sources}


def value_copy_sources(model: SheafStateLM, data: HeteroData, seq: SyntheticSequence) -> list[dict]:
    """Per block, what the strongest kept content-addressed edge into each value-copy output reads (the
    output before a copied value): ``"listed"``, G*'s source (the previous mention's value); ``"earlier
    mention"``, an older mention's value of the same entity (the same value: G* lists only one source);
    ``"other"``; or ``"none"`` (no content edge kept). Counts of outputs."""
    entity = seq.dep_type == DEP_TYPES.index("entity")
    src, dst = seq.src[entity].tolist(), seq.dst[entity].tolist()  # each copy from the previous mention's value
    first: dict[int, int] = {}  # value position -> the entity's first value position
    for s, d in sorted(zip(src, dst), key=lambda p: p[1]):
        first[d] = first.get(s, s)
    out = []
    for topology in model.topology(data, block=None):
        edges = topology[CONTENT_EDGE]
        ei, weight = edges["edge_index"], edges["weight"]
        order = torch.argsort(weight, stable=True)
        order = order[torch.argsort(ei[1, order], stable=True)]  # by output, then weight: the last is the strongest
        out_of, src_of = ei[1, order], ei[0, order]
        last = torch.ones_like(out_of, dtype=torch.bool)
        last[:-1] = out_of[1:] != out_of[:-1]
        strongest = torch.full((seq.ids.numel(),), -1, dtype=torch.long)
        strongest[out_of[last]] = src_of[last]
        counts = {"listed": 0, "earlier mention": 0, "other": 0, "none": 0}
        for s, d in zip(src, dst):
            k = int(strongest[d - 1])
            kind = ("none" if k < 0 else "listed" if k == s else
                    "earlier mention" if first.get(k, k) == first.get(s, s) else "other")
            counts[kind] += 1
        out.append(counts)
    return out


def _kind_loss(row: dict, kind: int) -> float | None:
    return row["by_target_kind"].get(Kind.NAMES[kind])


def format_routes(result: dict) -> str:
    """The route table: loss overall and of the long-range target kinds, with each route cut."""
    kinds = [Kind.NAMES[k] for k in LONG_RANGE_KINDS]
    num = lambda v: "-" if v is None else f"{v:.3f}"
    lines = [f"routes (eval loss in nats with one route cut; {result['cuts']} section cuts; anchored: knowing the "
             f"key {ANCHORED_FLOOR:.2f}, uniform {ANCHORED_UNIFORM:.2f}; then the anchored letters by their "
             "ordinal in the section)",
             f"{'cut':<34}{'loss':>8}" + "".join(f"{k:>12}" for k in kinds)
             + "".join(f"{k:>10}" for k in ORDINAL_GROUPS)]
    for name, row in result["routes"].items():
        lines.append(f"{name:<34}{row['loss']:>8.3f}"
                     + "".join(f"{num(_kind_loss(row, k)):>12}" for k in LONG_RANGE_KINDS)
                     + "".join(f"{num(row['anchored_by_ordinal'][k]):>10}" for k in ORDINAL_GROUPS))
    for b, counts in enumerate(result.get("value_copy_sources", [])):
        lines.append(f"block {b}: the strongest content edge of a value-copy output reads " +
                     ", ".join(f"{name} {n:,}" for name, n in counts.items()))
    return "\n".join(lines)


def plot_routes(result: dict, path: str | Path) -> None:
    """Horizontal bars: how much each cut raises the long-range kinds' loss (the cut's loss beside each bar)."""
    plt = pyplot()
    names = list(result["routes"])[1:]
    fig, axes = plt.subplots(1, len(LONG_RANGE_KINDS), figsize=(12, 0.32 * len(names) + 1.6), sharey=True)
    for ax, kind in zip(axes, LONG_RANGE_KINDS):
        base = _kind_loss(result["routes"]["none"], kind) or 0.0
        values = [_kind_loss(result["routes"][n], kind) or 0.0 for n in names]
        ax.barh(range(len(names)), [v - base for v in values], color="tab:blue")
        for y, v in enumerate(values):
            ax.annotate(f"{v:.2f}", (max(v - base, 0.0), y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax.axvline(0.0, color="black", lw=0.8)
        if kind == Kind.ANCHORED:
            ax.axvline(ANCHORED_UNIFORM - base, color="tab:red", lw=0.8, ls="--", label="up to uniform")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_title(f"{Kind.NAMES[kind]} targets: {base:.3f} nats with nothing cut")
        ax.set_xlabel("loss increase with the route cut (nats)")
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle(f"Which route carries a long-range dependency ({result['cuts']} sections)")
    save_figure(fig, Path(path), dpi=120)
