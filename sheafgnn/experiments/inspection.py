r"""Topology inspection: statistics, the top edges with their text, exports and plots.

A *topology* is what ``SheafStateLM.topology(data)`` returns (its last
block): per glue edge type (:data:`~sheafgnn.site.schema.GLUE_EDGES`: the
site's rule types, the content-addressed ``token matches output`` and the
random ``token explores output``) the kept edges in that type's node indices,
their softmax weights and gluing energies, and how many candidates the type
had in the pools::

    {edge_type: {"edge_index": (2, E_kept) long, "weight": (E_kept,) float in [0, 1],
                 "energy": (E_kept,) float, "num_candidates": int, ...}}

Without a model, :func:`designed_topology` gives the site's rule edges with
weight 1 and energy NaN: the *designed* topology.

::

    main_inspect(model, text, tokenizer, site_config, out_dir)
      '- build_site(text) -> inspect_site(model_or_none, data, tokenizer, out_dir) -> stats
           |- node_stats, edge_stats      kept against candidates, in-degree and weight histograms, energy
           |- top_edges                   highest-weight edges of each type, with the text they join
           |- content_edges               the strongest content-addressed edges, with their text
           |- to_networkx                 -> topology.graphml, topology.json
           |- plot_arcs                   arcs.png: edges over the text, by type and weight
           '- plot_relations              relations.png: token-to-token relations beside dense

Definitions: the *in-degree* of a node for an edge type counts that type's
kept edges into it (nodes with none count as degree 0); the *gluing energy*
of an edge is the model's disagreement of the restriction maps on it (its
definition lives in the model); a *relation* is a token pair (i, j), i < j,
whose token i reaches output j - 1 within ``hops`` hops of the topology's
kept edges, the site's fixed edges (cover, ``token reads output``) and the
token stream (:mod:`sheafgnn.relations`). Text: a patch shows the text it
spans; a token its neighbourhood with the token in brackets ``⟦ ⟧``; an
output the text up to its position (bracketed), and ``next_text`` the token
it predicts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch_geometric.data import HeteroData

from sheafgnn.experiments.report import pyplot, save_figure
from sheafgnn.optional import require
from sheafgnn.relations import dense_relations, relation_matrix, topology_graph
from sheafgnn.site import CANDIDATE_EDGES, NODE_TYPES, ByteTokenizer, SiteConfig, build_site, validate_site
from sheafgnn.site.schema import CONTENT_EDGE, GLUE_EDGES, EdgeType

nx = require("networkx", "sheafgnn inspect")
Topology = dict[EdgeType, dict[str, Tensor]]


def edge_key(edge_type: EdgeType) -> str:
    """``('local', 'next', 'local')`` -> ``'local__next__local'`` (PyG's edge-type string)."""
    return "__".join(edge_type)


# ---------------------------------------------------------------- topologies

def designed_topology(data: HeteroData) -> Topology:
    """The site's rule edges with weight 1 and energy NaN, each its own candidate: the topology as designed."""
    out = {}
    for edge_type in CANDIDATE_EDGES:
        edge_index = data[edge_type].edge_index if edge_type in data.edge_types else torch.zeros(2, 0, dtype=torch.long)
        e = edge_index.size(1)
        out[edge_type] = {"edge_index": edge_index.long(), "weight": torch.ones(e),
                          "energy": torch.full((e,), float("nan")), "num_candidates": e}
    return out


@torch.no_grad()
def model_topology(model, data: HeteroData) -> Topology:
    """``model.topology(data)`` on the model's device, returned detached on the CPU."""
    device = next(model.parameters()).device
    topology = model.topology(data.to(device))
    return {e: {k: v.detach().cpu() if isinstance(v, Tensor) else v for k, v in entry.items()}
            for e, entry in topology.items()}


def check_topology(topology: Topology, data: HeteroData) -> Topology:
    """Check a topology against its site; raise ValueError naming the edge type and the problem."""
    for edge_type, entry in topology.items():
        if edge_type not in GLUE_EDGES:
            raise ValueError(f"inspect: {edge_type} is not a gluing edge type; see GLUE_EDGES")
        missing = {"edge_index", "weight", "energy"} - set(entry)
        if missing:
            raise ValueError(f"inspect: topology[{edge_type}] lacks {sorted(missing)}")
        ei, weight, energy = entry["edge_index"], entry["weight"], entry["energy"]
        if ei.dim() != 2 or ei.size(0) != 2 or weight.shape != (ei.size(1),) or energy.shape != weight.shape:
            raise ValueError(f"inspect: topology[{edge_type}] needs edge_index (2, E), weight (E,), energy (E,); "
                             f"got {tuple(ei.shape)}, {tuple(weight.shape)}, {tuple(energy.shape)}")
        for index, node_type in zip(ei, (edge_type[0], edge_type[2])):
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= data[node_type].num_nodes):
                raise ValueError(f"inspect: topology[{edge_type}] indexes a '{node_type}' node out of range "
                                 f"(the site has {data[node_type].num_nodes})")
        if weight.numel() and (float(weight.min()) < 0 or float(weight.max()) > 1):
            raise ValueError(f"inspect: topology[{edge_type}] has weights outside [0, 1]")
    return topology


def spans(data: HeteroData, node_type: str) -> Tensor:
    """(num_nodes, 2) token span [start, end) of each node; a token t spans [t, t + 1)."""
    if node_type == "token":
        pos = torch.arange(data["token"].num_nodes)
        return torch.stack([pos, pos + 1], 1)
    return data[node_type].span


def _nan_to_none(value: float) -> float | None:
    return None if value is None or math.isnan(value) else float(value)


# ---------------------------------------------------------------- statistics

def node_stats(data: HeteroData) -> dict[str, dict]:
    """Per node type: ``count`` and ``mean_span`` (tokens per node)."""
    out = {}
    for node_type in NODE_TYPES:
        s = spans(data, node_type)
        length = (s[:, 1] - s[:, 0]).double()
        out[node_type] = {"count": int(s.size(0)), "mean_span": float(length.mean()) if length.numel() else None}
    return out


def edge_stats(topology: Topology, data: HeteroData, bins: int = 10) -> dict[str, dict]:
    """Per edge type: candidates in the pools, kept edges, in-degree and weight histograms, mean energy.

    The candidates are the entry's ``num_candidates`` (the model's pools), else
    the site's edges of that type.

    Returns:
        dict keyed by :func:`edge_key`: ``candidates``, ``kept``, ``kept_fraction``,
        ``in_degree_hist`` (entry d = destination nodes with in-degree d),
        ``mean_in_degree``, ``max_in_degree``, ``weight_hist`` (``bins`` counts over
        [0, 1]), ``weight_mean`` and ``energy_mean`` (None when undefined).
    """
    out = {}
    for edge_type, entry in topology.items():
        ei, weight, energy = entry["edge_index"], entry["weight"].double(), entry["energy"].double()
        num_dst = data[edge_type[2]].num_nodes
        degree = torch.bincount(ei[1], minlength=num_dst) if num_dst else torch.zeros(0, dtype=torch.long)
        in_site = data[edge_type].edge_index.size(1) if edge_type in data.edge_types else 0
        candidates = int(entry.get("num_candidates", in_site))
        finite = energy[~torch.isnan(energy)]
        out[edge_key(edge_type)] = {
            "candidates": int(candidates),
            "kept": int(ei.size(1)),
            "kept_fraction": ei.size(1) / candidates if candidates else None,
            "in_degree_hist": torch.bincount(degree).tolist() if degree.numel() else [],
            "mean_in_degree": float(degree.double().mean()) if degree.numel() else None,
            "max_in_degree": int(degree.max()) if degree.numel() else 0,
            "weight_hist": np.histogram(weight.numpy(), bins=bins, range=(0.0, 1.0))[0].tolist(),
            "weight_mean": float(weight.mean()) if weight.numel() else None,
            "energy_mean": float(finite.mean()) if finite.numel() else None,
        }
    return out


def _escape(text: str) -> str:
    return text.replace("\n", "\\n").replace("\t", "\\t")


def _snippet(text: str, max_chars: int) -> str:
    text = _escape(text)
    return text if len(text) <= max_chars else text[: max_chars // 2 - 1] + "..." + text[-(max_chars // 2 - 2):]


def node_text(ids: Tensor, tokenizer, node_type: str, span: list[int], max_chars: int = 48) -> str:
    """The text of a node: a patch's span; a token's neighbourhood (``max_chars // 3`` tokens each
    side, the token in ``⟦ ⟧``); an output's preceding ``2 * max_chars // 3`` tokens and its own
    position in ``⟦ ⟧`` (what it has read)."""
    start, end = span
    decode = lambda a, b: _escape(tokenizer.decode(ids[max(a, 0) : b]))
    if node_type == "token":
        width = max_chars // 3
        return f"{decode(start - width, start)}⟦{decode(start, end)}⟧{decode(end, end + width)}"
    if node_type == "output":
        return f"{decode(end - 1 - 2 * max_chars // 3, end - 1)}⟦{decode(end - 1, end)}⟧"
    return _snippet(tokenizer.decode(ids[start:end]), max_chars)


def top_edges(topology: Topology, data: HeteroData, tokenizer=None, k: int = 5,
              max_chars: int = 48) -> dict[str, list[dict]]:
    """The ``k`` highest-weight edges of each type, with the token spans and text they join.

    Ties keep the topology's edge order. Each entry: ``src``, ``dst`` (node
    indices), ``weight``, ``score`` (None without scores), ``energy``,
    ``src_span``, ``dst_span``, ``src_text``, ``dst_text`` (:func:`node_text`)
    and, into an output, ``next_text``: the token it predicts ("" at the end).
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    ids = data["token"].x
    out = {}
    for edge_type, entry in topology.items():
        ei, weight, energy, score = entry["edge_index"], entry["weight"], entry["energy"], entry.get("score")
        order = torch.sort(weight, descending=True, stable=True).indices[:k]
        src_spans, dst_spans = spans(data, edge_type[0]), spans(data, edge_type[2])
        rows = []
        for e in order.tolist():
            s, d = int(ei[0, e]), int(ei[1, e])
            src_span, dst_span = src_spans[s].tolist(), dst_spans[d].tolist()
            row = {"src": s, "dst": d, "weight": float(weight[e]),
                   "score": None if score is None else float(score[e]), "energy": _nan_to_none(float(energy[e])),
                   "src_span": src_span, "dst_span": dst_span,
                   "src_text": node_text(ids, tokenizer, edge_type[0], src_span, max_chars),
                   "dst_text": node_text(ids, tokenizer, edge_type[2], dst_span, max_chars)}
            if edge_type[2] == "output":
                row["next_text"] = _escape(tokenizer.decode(ids[dst_span[1] : dst_span[1] + 1]))
            rows.append(row)
        out[edge_key(edge_type)] = rows
    return out


def content_edges(topology: Topology, data: HeteroData, tokenizer=None, k: int = 10) -> list[dict]:
    """The ``k`` strongest content-addressed edges (``token matches output``, highest weight) with
    their text (:func:`top_edges`' rows); [] when the topology has none."""
    if CONTENT_EDGE not in topology:
        return []
    return top_edges({CONTENT_EDGE: topology[CONTENT_EDGE]}, data, tokenizer, k)[edge_key(CONTENT_EDGE)]


def _format_edge(r: dict) -> str:
    energy = "nan" if r["energy"] is None else f"{r['energy']:.3g}"
    score = "" if r.get("score") is None else f"  score {r['score']:+.3f}"
    after = f" -> {r['next_text']!r}" if "next_text" in r else ""
    return (f"  weight {r['weight']:.3f}{score}  energy {energy:>7}  [{r['src_span'][0]}, {r['src_span'][1]}) "
            f"{r['src_text']!r}  ->  [{r['dst_span'][0]}, {r['dst_span'][1]}) {r['dst_text']!r}{after}")


def format_top_edges(top: dict[str, list[dict]]) -> str:
    """The top edges as text, one block per edge type with edges."""
    lines = []
    for key, rows in top.items():
        if rows:
            lines += [key, *map(_format_edge, rows)]
    return "\n".join(lines)


# ---------------------------------------------------------------- exports

_BAD_XML = {c: "\ufffd" for c in range(32) if c not in (9, 10, 13)}


def to_networkx(topology: Topology, data: HeteroData, tokenizer=None, fixed: bool = False,
                text: bool = True) -> nx.MultiDiGraph:
    """The topology as a networkx multigraph with every node of the site.

    Node ids are ``"type:index"``; node attributes ``type``, ``index``, ``time``,
    ``span_start``, ``span_end`` (and ``text``, the decoded span). Edges are
    keyed by :func:`edge_key` with attributes ``type``, ``weight``, ``energy``
    and ``learned`` (False for the site's fixed edges, which ``fixed=True``
    adds with weight 1 and energy NaN).
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    ids = data["token"].x
    graph = nx.MultiDiGraph()
    for node_type in NODE_TYPES:
        s = spans(data, node_type).tolist()
        time = data[node_type].time.tolist()
        for i, (start, end) in enumerate(s):
            attrs = {"type": node_type, "index": i, "time": time[i], "span_start": start, "span_end": end}
            if text:
                attrs["text"] = tokenizer.decode(ids[start:end]).translate(_BAD_XML)
            graph.add_node(f"{node_type}:{i}", **attrs)
    entries = [(e, entry, True) for e, entry in topology.items()]
    if fixed:
        for e in data.edge_types:
            if e not in CANDIDATE_EDGES:
                count = data[e].edge_index.size(1)
                entry = {"edge_index": data[e].edge_index, "weight": torch.ones(count),
                         "energy": torch.full((count,), float("nan"))}
                entries.append((e, entry, False))
    for (src_type, rel, dst_type), entry, learned in entries:
        key = edge_key((src_type, rel, dst_type))
        for (s, d), w, en in zip(entry["edge_index"].t().tolist(), entry["weight"].tolist(),
                                 entry["energy"].tolist()):
            graph.add_edge(f"{src_type}:{s}", f"{dst_type}:{d}", key=key, type=key, weight=float(w),
                           energy=float(en), learned=learned)
    return graph


def write_graphml(graph: nx.MultiDiGraph, path) -> None:
    nx.write_graphml(graph, path)


def read_graphml(path) -> nx.MultiDiGraph:
    return nx.read_graphml(path, edge_key_type=str, force_multigraph=True)


def write_json(graph: nx.MultiDiGraph, path) -> None:
    """networkx node-link JSON (``nodes``, ``edges``); NaN energies become null."""
    payload = nx.node_link_data(graph, edges="edges")
    for edge in payload["edges"]:
        edge["energy"] = _nan_to_none(edge["energy"])
    Path(path).write_text(json.dumps(payload, allow_nan=False))


def read_json(path) -> nx.MultiDiGraph:
    """Read :func:`write_json` back (null energies become NaN)."""
    payload = json.loads(Path(path).read_text())
    for edge in payload["edges"]:
        edge["energy"] = float("nan") if edge["energy"] is None else edge["energy"]
    return nx.node_link_graph(payload, directed=True, multigraph=True, edges="edges")


# ---------------------------------------------------------------- plots

def _midpoints(data: HeteroData, node_type: str) -> np.ndarray:
    s = spans(data, node_type).double()
    return ((s[:, 0] + s[:, 1] - 1) / 2).numpy()


def _arcs(x0: np.ndarray, x1: np.ndarray, sign: float, points: int = 16) -> np.ndarray:
    """(E, points, 2) half-ellipse polylines from x0 to x1, height half the distance, above (+) or below (-)."""
    theta = np.linspace(0, np.pi, points)
    centre, radius = (x0 + x1) / 2, (x1 - x0) / 2
    xs = centre[:, None] - radius[:, None] * np.cos(theta)
    ys = sign * np.abs(radius)[:, None] * np.sin(theta)
    return np.stack([xs, ys], -1)


def plot_arcs(topology: Topology, data: HeteroData, path, tokenizer=None, max_arcs: int = 20000,
              title: str | None = None) -> None:
    """Arc diagram over the text: each edge an arc between its endpoints' span midpoints.

    Edges between patches arc above the axis, edges into outputs (reads,
    content-addressed and random) below; colour is the edge type, opacity and
    width the weight. At most ``max_arcs`` arcs per side (the heaviest) are
    drawn. Texts of at most 160 tokens are written along the axis.
    """
    plt = pyplot()
    from matplotlib.collections import LineCollection  # after pyplot(), which says what to install without it

    n = data["token"].num_nodes
    fig, ax = plt.subplots(figsize=(min(24, 8 + n / 40), 6), dpi=120)
    colours = plt.get_cmap("tab20")
    span = 1.0
    for side in (1.0, -1.0):
        types = [(e, entry) for e, entry in topology.items()
                 if (e[2] == "output") == (side < 0) and entry["weight"].numel()]
        types.sort(key=lambda item: -item[1]["weight"].numel())  # the densest types first, under the rest
        segments, rgba, widths, handles = [], [], [], []
        for edge_type, entry in types:
            c = colours(GLUE_EDGES.index(edge_type) % 20)
            ei, weight = entry["edge_index"].numpy(), entry["weight"].double().numpy()
            x0, x1 = _midpoints(data, edge_type[0])[ei[0]], _midpoints(data, edge_type[2])[ei[1]]
            fade = min(1.0, max(0.05, 150 / weight.size))  # many arcs of one type: fainter each
            segments.append(_arcs(x0, x1, side))
            rgba.append(np.column_stack([np.tile(c[:3], (weight.size, 1)), (0.1 + 0.8 * weight) * fade]))
            widths.append(0.3 + 1.5 * weight)
            handles.append(plt.Line2D([], [], color=c, lw=2, label=f"{edge_key(edge_type)} ({weight.size:,})"))
        if not segments:
            continue
        seg, col, lw = np.concatenate(segments), np.concatenate(rgba), np.concatenate(widths)
        if seg.shape[0] > max_arcs:
            keep = np.sort(np.argsort(-lw, kind="stable")[:max_arcs])  # the heaviest, in drawing order
            seg, col, lw = seg[keep], col[keep], lw[keep]
        ax.add_collection(LineCollection(seg, colors=col, linewidths=lw))
        span = max(span, float(np.abs(seg[..., 1]).max()))
        legend = ax.legend(handles=handles, fontsize=7, ncol=2, title="between patches (above)" if side > 0 else
                           "into outputs (below)", title_fontsize=7, loc="upper right" if side > 0 else "lower right")
        ax.add_artist(legend)
    ax.set_xlim(-1, n)
    ax.set_ylim(-span * 1.05, span * 1.05)
    ax.axhline(0, color="black", lw=0.5)
    if n <= 160:
        tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
        labels = [tokenizer.decode(data["token"].x[t:t + 1]).replace("\n", "⏎").replace(" ", "·") for t in range(n)]
        ax.set_xticks(range(n), labels, fontsize=6, family="monospace")
    ax.set_yticks([])
    ax.set_xlabel("token position")
    ax.set_title(title or "Topology over the text (colour: edge type; opacity and width: weight)")
    save_figure(fig, path)


def _density(matrix, n: int, bins: int) -> np.ndarray:
    """(b, b) fraction of token pairs in each block that are relations (b = min(n, bins))."""
    b = min(n, bins)
    edges = np.arange(b + 1) * n // b
    size = np.diff(edges).astype(float)
    coo = matrix.tocoo()
    block = np.zeros((b, b))
    of = lambda index: np.searchsorted(edges, index, side="right") - 1
    np.add.at(block, (of(coo.row), of(coo.col)), 1.0)
    return block / np.outer(size, size)


def plot_relations(topology: Topology, data: HeteroData, path, hops: int = 3, bins: int = 512) -> dict:
    """The token-to-token relation matrix of the topology beside the dense causal triangle.

    Rows are the predicted token j, columns the source token i. Each pixel is
    the fraction of its block's pairs that are relations (log scale when
    blocks hold more than one pair).

    Returns:
        dict: ``hops``, ``relations``, ``dense``, ``fraction_of_dense``, ``per_token``.
    """
    plt = pyplot()
    from matplotlib.colors import LogNorm, Normalize  # after pyplot(), which says what to install without it

    n = data["token"].num_nodes
    matrix = relation_matrix(topology_graph(topology, data), hops)
    dense = dense_relations(n)
    stats = {"hops": hops, "relations": int(matrix.nnz), "dense": dense,
             "fraction_of_dense": matrix.nnz / dense if dense else None,
             "per_token": matrix.nnz / max(n - 1, 1)}
    if n < 2:
        return stats
    triangle = np.tril(np.ones((n, n)), -1) if n <= bins else _triangle_density(n, bins)
    site = _density(matrix, n, bins)
    norm = Normalize(0, 1) if n <= bins else LogNorm(vmin=max(site[site > 0].min(initial=1.0), 1e-6), vmax=1)
    fig, axes = plt.subplots(1, 2, figsize=(11, 5), dpi=120, layout="constrained")
    for ax, image, label in ((axes[0], site, f"topology, H = {hops}: {matrix.nnz:,} relations "
                              f"({100 * stats['fraction_of_dense']:.2f}% of dense)"),
                             (axes[1], triangle, f"dense causal: n(n-1)/2 = {dense:,}")):
        shown = np.ma.masked_where(image <= 0, image)
        im = ax.imshow(shown, cmap="viridis", norm=norm, extent=(0, n, n, 0), interpolation="nearest")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("source token i")
        ax.set_ylabel("predicted token j")
        ax.set_facecolor("white")
    fig.colorbar(im, ax=axes, shrink=0.9, label="fraction of pairs that are relations")
    fig.savefig(path)
    plt.close(fig)
    return stats


def _triangle_density(n: int, bins: int) -> np.ndarray:
    """:func:`_density` of the dense causal triangle, analytically (O(n * bins), nothing materialised)."""
    b = min(n, bins)
    edges = np.arange(b + 1) * n // b
    size = np.diff(edges)
    below = np.clip(np.arange(n)[:, None] - edges[None, :-1], 0, size[None, :])  # (n, b) pairs i < j per block
    block = np.add.reduceat(below, edges[:-1], axis=0).astype(float)  # (b, b)
    return block / np.outer(size, size)


# ---------------------------------------------------------------- entry points

def inspect_site(model_or_none, data: HeteroData, tokenizer, out_dir, hops: int = 3, top_k: int = 5,
                 content_k: int = 10) -> dict:
    """Inspect the topology of a model (or the designed site) on one site; write every output.

    Writes to ``out_dir``: ``stats.json``, ``top_edges.txt``, ``topology.graphml``,
    ``topology.json``, ``arcs.png`` and ``relations.png``.

    Args:
        model_or_none: a model with ``topology(data)`` (``SheafStateLM``), or None
            for the designed topology (the site's rule edges, weight 1, energy NaN).
        data (HeteroData): the site.
        tokenizer: decodes token ids (None: :class:`ByteTokenizer`).
        out_dir: folder, created if need be.
        hops (int): H for the relation matrix (default: :obj:`3`).
        top_k (int): edges listed per type (default: :obj:`5`).
        content_k (int): content-addressed edges listed (default: :obj:`10`).

    Returns:
        dict: ``source``, ``num_tokens``, ``nodes``, ``edges`` (:func:`edge_stats`), ``totals``,
        ``relations``, ``top_edges``, ``content_edges`` (:func:`content_edges`) and ``files``.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if model_or_none is None:
        topology, source = designed_topology(data), "designed"
    else:
        topology, source = model_topology(model_or_none, data), "model"
    data = data.cpu()
    check_topology(topology, data)
    edges = edge_stats(topology, data)
    kept = sum(row["kept"] for row in edges.values())
    candidates = sum(row["candidates"] for row in edges.values())
    n = data["token"].num_nodes
    stats = {
        "source": source,
        "num_tokens": n,
        "nodes": node_stats(data),
        "edges": edges,
        "totals": {"kept": kept, "candidates": candidates, "kept_per_token": kept / max(n, 1)},
        "top_edges": top_edges(topology, data, tokenizer, top_k),
        "content_edges": content_edges(topology, data, tokenizer, content_k),
        "files": {name: str(out / name) for name in ("stats.json", "top_edges.txt", "topology.graphml",
                                                      "topology.json", "arcs.png", "relations.png")},
    }
    graph = to_networkx(topology, data, tokenizer)
    write_graphml(graph, out / "topology.graphml")
    write_json(graph, out / "topology.json")
    plot_arcs(topology, data, out / "arcs.png", tokenizer,
              title=f"{source} topology over {n} tokens (colour: edge type; opacity and width: weight)")
    stats["relations"] = plot_relations(topology, data, out / "relations.png", hops)
    (out / "top_edges.txt").write_text(format_top_edges(stats["top_edges"]) + "\n")
    (out / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def format_summary(stats: dict) -> str:
    """Per edge type candidates against kept edges, mean weight, in-degree and energy; then the
    strongest content-addressed edges with their text."""
    lines = [f"{stats['source']} topology, {stats['num_tokens']} tokens: {stats['totals']['kept']:,} kept of "
             f"{stats['totals']['candidates']:,} candidate edges ({stats['totals']['kept_per_token']:.2f} per token); "
             f"{stats['relations']['relations']:,} relations at H = {stats['relations']['hops']} "
             f"({100 * (stats['relations']['fraction_of_dense'] or 0):.2f}% of dense)",
             f"{'edge type':<36}{'cand.':>9}{'kept':>8}{'weight':>8}{'deg mean':>10}{'deg max':>9}{'energy':>9}"]
    for key, row in stats["edges"].items():
        if not row["candidates"] and not row["kept"]:
            continue
        fmt = lambda v, spec: "-" if v is None else format(v, spec)
        lines.append(f"{key:<36}{row['candidates']:>9}{row['kept']:>8}{fmt(row['weight_mean'], '.3f'):>8}"
                     f"{fmt(row['mean_in_degree'], '.2f'):>10}{row['max_in_degree']:>9}"
                     f"{fmt(row['energy_mean'], '.3g'):>9}")
    if stats["content_edges"]:
        lines += ["", f"strongest content-addressed edges ({edge_key(CONTENT_EDGE)}):",
                  *map(_format_edge, stats["content_edges"])]
    return "\n".join(lines)


def main_inspect(model, text: str | bytes, tokenizer=None, site_config: SiteConfig | None = None,
                 out_dir="runs/inspect", hops: int = 3, top_k: int = 5, verbose: bool = True) -> dict:
    """Build the site of ``text`` and inspect ``model``'s topology on it (or the designed one).

    The entry point of ``sheafgnn inspect``. The site rules come from
    ``site_config``, else the model's ``config.site_config``, else the defaults.

    Returns:
        the statistics of :func:`inspect_site`.
    """
    tokenizer = tokenizer if tokenizer is not None else ByteTokenizer()
    if site_config is None and model is not None and hasattr(getattr(model, "config", None), "site_config"):
        site_config = model.config.site_config
    data = validate_site(build_site(text, site_config, tokenizer=tokenizer))
    if data["token"].num_nodes < 2:
        raise ValueError("main_inspect: the text must hold at least 2 tokens")
    stats = inspect_site(model, data, tokenizer, out_dir, hops, top_k)
    if verbose:
        print(format_summary(stats))
        print()
        print(format_top_edges(stats["top_edges"]))
        print(f"\nwrote {', '.join(stats['files'].values())}")
    return stats
