r"""The candidate pools of a learned topology scored against the synthetic language's G*.

Every output node of :class:`~sheafgnn.model.SheafStateLM` scores a pool of
candidate sources (rule, content-addressed and random proposals,
:mod:`sheafgnn.nn.topology`) and keeps the best k. Whether the scorer learned
*where to look* is measured on the pools themselves, against the long-range
dependencies of G* (anchor and entity; the local ones are the token stream's
and ``token reads output``'s)::

    long-range dependency (i, j)  G* edge of type anchor or entity; its destination is output o = j - 1
    positive candidate u of o     token i reaches u within H - 1 hops in the designed site's relation
                                  graph (fixed + rule edges + stream, :func:`~sheafgnn.relations.site_graph`;
                                  u = token i itself counts), so that u -> o completes the relation
                                  (i, j) in H hops; every other candidate of o is negative
    destination AUC               the Mann-Whitney AUC of o's candidate scores, positives against
                                  negatives (ties count half), for an o with >= 2 candidates and both labels
    candidate recall              long-range dependencies realised (:mod:`sheafgnn.relations`, H hops) by
                                  the relation graph that keeps every candidate: the ceiling of any selection

The pools mix two kinds of candidate that one bilinear score compares: tokens
(content and random proposals) and patches (the site's read rules). A patch
that holds token i is a positive too, so the AUC over the whole pool also
measures how the scorer ranks patches against tokens. ``by_source`` splits it:
the AUC among a destination's token candidates only, and among its patch
candidates only; ``source_in_pool`` is the share of scored destinations whose
token candidates hold the dependency's source token i itself.

Only destinations whose next token has a long-range dependency are scored:
elsewhere no candidate is needed, so none is positive.

::

    long_range_targets(data, seq, hops) -> LongRangeTargets     the dependencies and positive (o, u) pairs
    candidate_labels(topology, data, targets)                   destination, score, label and source of each candidate
    destination_auc(score, label, destination)                  AUC per destination, and which counted
    pool_auc(topology, data, targets)                           one block's pools: mean AUC, counts, histogram
    candidate_recall(pools, data, targets, hops)                share of the dependencies the pools realise
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.experiments.synthetic import DEP_TYPES, SyntheticSequence
from sheafgnn.relations import node_offsets, reach_from_tokens, relation_stats, site_graph, topology_graph
from sheafgnn.site.schema import EdgeType

LONG_RANGE_TYPES = ("anchor", "entity")  # G* dependency types that only a gluing edge can realise


@dataclass
class LongRangeTargets:
    """The long-range dependencies of a sequence and the candidates that would realise them.

    Attributes:
        src, dst, dep_type (np.ndarray): (D,) the long-range dependencies (i, j) and their
            :data:`~sheafgnn.experiments.synthetic.DEP_TYPES` index.
        output_dep_type (np.ndarray): (n,) dep type of output o's long-range dependency (that of
            token o + 1), -1 where it has none (not scored).
        output_source (np.ndarray): (n,) the source token i of that dependency, -1 where none.
        positive (np.ndarray): sorted keys ``o * num_nodes + u`` of the positive (destination,
            candidate) pairs, u a relation-graph node id (:func:`~sheafgnn.relations.node_offsets`).
        num_nodes (int): nodes of the relation graph.
    """

    src: np.ndarray
    dst: np.ndarray
    dep_type: np.ndarray
    output_dep_type: np.ndarray
    output_source: np.ndarray
    positive: np.ndarray
    num_nodes: int


def long_range_targets(data: HeteroData, seq: SyntheticSequence, hops: int) -> LongRangeTargets:
    """The long-range dependencies of ``seq`` and the (destination, candidate) pairs that realise
    them within ``hops`` hops on the site ``data`` (see the module docstring)."""
    if hops < 1:
        raise ValueError(f"long_range_targets: hops must be >= 1 (got {hops})")
    wanted = [DEP_TYPES.index(name) for name in LONG_RANGE_TYPES]
    mask = np.isin(seq.dep_type.numpy(), wanted)
    src, dst, dep_type = seq.src.numpy()[mask], seq.dst.numpy()[mask], seq.dep_type.numpy()[mask]
    graph = site_graph(data)
    reach = reach_from_tokens(graph, src, hops - 1).tocoo()  # (D, N): nodes token i reaches in H - 1 hops
    positive = np.unique((dst[reach.row] - 1) * graph.num_nodes + reach.col)
    output_dep_type = np.full(seq.ids.numel(), -1, dtype=np.int64)
    output_dep_type[dst - 1] = dep_type
    output_source = np.full(seq.ids.numel(), -1, dtype=np.int64)
    output_source[dst - 1] = src
    return LongRangeTargets(src, dst, dep_type, output_dep_type, output_source, positive, graph.num_nodes)


def candidate_labels(topology: dict[EdgeType, dict[str, Tensor]], data: HeteroData,
                     targets: LongRangeTargets) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The candidates of the scored destinations, from every output edge type of the pools.

    Args:
        topology (dict): ``SheafStateLM.topology(data, block, candidates=True)``: edge type ->
            {"candidate_index" (2, C), "candidate_score" (C,), ...}.
        data (HeteroData): the site.
        targets (LongRangeTargets): from :func:`long_range_targets` on the same site.

    Returns:
        (destination output o, score, label, source u as a relation-graph node id; tokens are
        ``u < data["token"].num_nodes``) per candidate, each (C_scored,).
    """
    offset, _ = node_offsets(data)
    destination, score, label = [np.zeros(0, dtype=np.int64)], [np.zeros(0)], [np.zeros(0, dtype=bool)]
    source = [np.zeros(0, dtype=np.int64)]
    for (src_type, _, dst_type), entry in topology.items():
        if dst_type != "output":
            continue
        index = entry["candidate_index"].cpu().numpy()  # (2, C)
        keep = targets.output_dep_type[index[1]] >= 0
        o, u = index[1, keep], index[0, keep] + offset[src_type]
        destination.append(o)
        score.append(entry["candidate_score"].float().cpu().numpy()[keep])
        label.append(np.isin(o * targets.num_nodes + u, targets.positive))
        source.append(u)
    return tuple(np.concatenate(x) for x in (destination, score, label, source))


def destination_auc(score: np.ndarray, label: np.ndarray,
                    destination: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The Mann-Whitney AUC of the scores of each destination's candidates, ties counted half.

    AUC = P(score of a positive > score of a negative), from mid-ranks within
    the destination: (rank sum of the positives - P (P + 1) / 2) / (P N).

    Args:
        score (np.ndarray): (C,) candidate scores.
        label (np.ndarray): (C,) bool, positive candidates.
        destination (np.ndarray): (C,) destination of each candidate.

    Returns:
        (destinations (G,) sorted, auc (G,) NaN where not counted, counted (G,) bool: at least
        2 candidates, a positive and a negative).
    """
    order = np.lexsort((score, destination))  # by destination, then score
    group, value, positive = destination[order], score[order], label[order].astype(float)
    index = np.arange(group.size)
    group_start = np.r_[True, group[1:] != group[:-1]]
    tie_start = group_start | np.r_[True, value[1:] != value[:-1]]
    first_in_group = np.maximum.accumulate(np.where(group_start, index, 0))
    first_in_tie = np.maximum.accumulate(np.where(tie_start, index, 0))
    tie = np.cumsum(tie_start) - 1
    rank = first_in_tie - first_in_group + (np.bincount(tie)[tie] + 1) / 2  # 1-based mid-rank in the group
    groups, inverse = np.unique(group, return_inverse=True)
    num_pos = np.bincount(inverse, weights=positive, minlength=groups.size)
    num_neg = np.bincount(inverse, minlength=groups.size) - num_pos
    rank_sum = np.bincount(inverse, weights=rank * positive, minlength=groups.size)
    counted = (num_pos > 0) & (num_neg > 0)  # both labels: at least 2 candidates
    auc = np.full(groups.size, np.nan)
    auc[counted] = ((rank_sum - num_pos * (num_pos + 1) / 2) / np.maximum(num_pos * num_neg, 1))[counted]
    return groups, auc, counted


def pool_auc(topology: dict[EdgeType, dict[str, Tensor]], data: HeteroData, targets: LongRangeTargets,
             bins: int = 20) -> dict:
    """The per-destination AUC of one block's candidate scores, averaged over the counted destinations.

    Returns:
        dict: ``mean`` (None if no destination counted), ``destinations`` (counted), ``eligible``
        (outputs whose next token has a long-range dependency), ``by_type`` (dep type -> mean),
        ``by_source`` ({"token", "patch"} -> {"mean", "destinations"}: the AUC among one kind of
        candidate only), ``source_in_pool`` (share of the eligible outputs whose token candidates
        hold the dependency's source token), ``positive_share`` (positives among the counted
        destinations' candidates) and ``hist`` (``bins`` counts of the per-destination AUCs over [0, 1]).
    """
    destination, score, label, source = candidate_labels(topology, data, targets)
    groups, auc, counted = destination_auc(score, label, destination)
    kinds = targets.output_dep_type[groups]
    mean = lambda values: float(values.mean()) if values.size else None
    scored = np.isin(destination, groups[counted])
    is_token = source < data["token"].num_nodes
    by_source = {}
    for name, mask in (("token", is_token), ("patch", ~is_token)):
        _, kind_auc, kind_counted = destination_auc(score[mask], label[mask], destination[mask])
        by_source[name] = {"mean": mean(kind_auc[kind_counted]), "destinations": int(kind_counted.sum())}
    eligible = np.flatnonzero(targets.output_dep_type >= 0)
    holds_source = np.unique(destination[is_token & (source == targets.output_source[destination])])
    return {"mean": mean(auc[counted]), "destinations": int(counted.sum()), "eligible": int(eligible.size),
            "by_type": {name: mean(auc[counted & (kinds == DEP_TYPES.index(name))]) for name in LONG_RANGE_TYPES},
            "by_source": by_source,
            "source_in_pool": holds_source.size / eligible.size if eligible.size else None,
            "positive_share": mean(label[scored].astype(float)),
            "hist": np.histogram(auc[counted], bins=bins, range=(0.0, 1.0))[0].tolist()}


def candidate_recall(pools: dict[EdgeType, dict[str, Tensor]], data: HeteroData, targets: LongRangeTargets,
                     hops: int) -> dict:
    """Share of the long-range dependencies realised when every candidate of the pools is kept.

    Args:
        pools (dict): edge type -> {"edge_index": (2, C)}, the candidates in the type's node indices
            (the site's fixed edges and the stream are added, :func:`~sheafgnn.relations.topology_graph`).
        data (HeteroData): the site.
        targets (LongRangeTargets): the dependencies (:func:`long_range_targets`).
        hops (int): H.

    Returns:
        dict: ``recall``, ``dependencies``, ``realised``, ``by_type`` (dep type -> recall) and the
        pool graph's ``relations`` and ``candidates`` (edges).
    """
    relations, realised, _ = relation_stats(topology_graph(pools, data), hops, targets.src, targets.dst)
    by_type = {}
    for name in LONG_RANGE_TYPES:
        mask = targets.dep_type == DEP_TYPES.index(name)
        by_type[name] = float(realised[mask].mean()) if mask.any() else None
    return {"recall": float(realised.mean()) if realised.size else None, "dependencies": int(realised.size),
            "realised": int(realised.sum()), "by_type": by_type, "relations": int(relations),
            "candidates": int(sum(entry["edge_index"].size(1) for entry in pools.values()))}
