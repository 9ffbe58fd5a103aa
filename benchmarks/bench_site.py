"""Throughput of ``build_site`` per patch type and for all together.

Measures tokens per second and edges per token at n = 1k, 32k and 1M tokens
of the embedded corpus (byte tokenizer; windows of n tokens spread over the
same first 1M tokens, averaged), for each patch type on its own and
for all structural types together (every type but ``topic``, whose
scikit-learn model is timed separately as ``topic``), and checks the two
targets of the site-builder issue in the same run:

- all structural types together >= 1M tokens/s at n = 32k;
- edges per token flat (within 10%) from 1k to 1M tokens.

Usage::

    python benchmarks/bench_site.py [--out benchmarks/results] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from sheafgnn.data import corpus_ids, load_corpus
from sheafgnn.site import PATCH_TYPES, SiteConfig, TopicModel, build_site
from sheafgnn.site.rules import split_sentences

SIZES = (1024, 32768, 1 << 20)
STRUCTURAL = tuple(p for p in PATCH_TYPES if p != "topic")


def corpus_windows(n: int, region: int = max(SIZES), count: int = 16) -> list[torch.Tensor]:
    """Windows of n tokens spread evenly over the first ``region`` tokens of the corpus.

    Every size samples the same text: one window covers it at n = region, and
    smaller n average over up to ``count`` windows, so edges per token compare
    like with like rather than one atypical opening passage.
    """
    ids = corpus_ids(region)
    count = max(1, min(count, region // n))
    return [ids[i * (region // count) : i * (region // count) + n] for i in range(count)]


def time_build(windows: list[torch.Tensor], config: SiteConfig, repeats: int,
               topic_model=None) -> tuple[float, int]:
    """Wall time (s) of building every window, best over ``repeats``, and their edges in total."""
    best, edges = float("inf"), 0
    for _ in range(repeats):
        start = time.perf_counter()
        sites = [build_site(ids, config, topic_model=topic_model) for ids in windows]
        best = min(best, time.perf_counter() - start)
        edges = sum(data[e].num_edges for data in sites for e in data.edge_types)
    return best, edges


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(2)

    sentences = [s for doc in load_corpus("mixed", "train") for s in split_sentences(doc)]
    topic_model = TopicModel.fit(sentences, num_topics=16)
    settings = {p: (SiteConfig(patch_types=(p,)), None) for p in PATCH_TYPES}
    settings["topic"] = (SiteConfig(patch_types=("topic",)), topic_model)
    settings["structural"] = (SiteConfig(patch_types=STRUCTURAL), None)
    settings["all"] = (SiteConfig(patch_types=PATCH_TYPES), topic_model)

    rows = []
    for n in SIZES:
        windows = corpus_windows(n)
        tokens = n * len(windows)
        repeats = args.repeats if n <= 32768 else 1
        for name, (config, topic) in settings.items():
            seconds, edges = time_build(windows, config, repeats, topic)
            rows.append({"n": n, "windows": len(windows), "types": name, "seconds": seconds,
                         "tokens_per_s": tokens / seconds, "edges": edges, "edges_per_token": edges / tokens})
            print(f"n={n:>8} x{len(windows):<3} {name:<12} {tokens / seconds / 1e6:8.3f} M tok/s  "
                  f"{edges / tokens:7.3f} edges/token", flush=True)

    def row(n, name):
        return next(r for r in rows if r["n"] == n and r["types"] == name)

    structural_32k = row(32768, "structural")["tokens_per_s"]
    per_token = [row(n, "structural")["edges_per_token"] for n in SIZES]
    spread = (max(per_token) - min(per_token)) / min(per_token)
    targets = {
        "structural_tokens_per_s_32k": structural_32k,
        "target_tokens_per_s_32k": 1e6,
        "tokens_per_s_met": structural_32k >= 1e6,
        "edges_per_token_by_n": dict(zip(map(str, SIZES), per_token)),
        "edges_per_token_spread": spread,
        "edges_per_token_flat_met": spread <= 0.10,
    }
    result = {"machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                          "torch": torch.__version__}, "rows": rows, "targets": targets}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "site.json").write_text(json.dumps(result, indent=2))
    print(f"\nstructural types at n=32k: {structural_32k / 1e6:.3f} M tokens/s (target >= 1.0): "
          f"{'met' if targets['tokens_per_s_met'] else 'MISSED'}")
    print(f"edges per token 1k..1M: {', '.join(f'{v:.3f}' for v in per_token)} (spread {spread:.1%}, "
          f"target <= 10%): {'met' if targets['edges_per_token_flat_met'] else 'MISSED'}")
    print(f"wrote {out / 'site.json'}")


if __name__ == "__main__":
    main()
