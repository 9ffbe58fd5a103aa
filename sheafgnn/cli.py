"""The ``sheafgnn`` command.

::

    sheafgnn demo [--out runs/demo]     build sites from the embedded corpus, print statistics
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm


def _demo(args: argparse.Namespace) -> None:
    from sheafgnn.data import corpus_text, load_corpus, site_statistics
    from sheafgnn.site import ByteTokenizer, SiteConfig, TopicModel, build_site, validate_site
    from sheafgnn.site.rules import split_sentences

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print("fitting the topic model on the training split ...")
    sentences = [s for doc in load_corpus("mixed", "train") for s in split_sentences(doc)]
    topic_model = TopicModel.fit(sentences, num_topics=16)
    topic_model.save(out / "topics.safetensors")
    config = SiteConfig(topic_model=str(out / "topics.safetensors"))
    ids = ByteTokenizer().encode(corpus_text("mixed", "validation"))
    context = args.context
    graphs = []
    for start in tqdm(range(0, min(ids.numel(), args.tokens) - context + 1, context), desc="building sites"):
        graphs.append(validate_site(build_site(ids[start : start + context], config)))
    stats = site_statistics(graphs)
    print(f"\n{len(graphs)} sites of {context} tokens from the validation split (byte tokenizer)")
    print(f"{'type':<44}{'count':>10}{'per token':>12}")
    for name, row in stats.items():
        print(f"{name:<44}{row['count']:>10}{row['per_token']:>12.3f}")
    (out / "site_stats.json").write_text(json.dumps(stats, indent=2))
    print(f"\nwrote {out / 'site_stats.json'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sheafgnn", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="the main demo on the embedded corpus")
    demo.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    demo.add_argument("--context", type=int, default=1024, help="tokens per site (default: 1024)")
    demo.add_argument("--tokens", type=int, default=65536, help="tokens of the corpus to build (default: 65536)")
    demo.set_defaults(func=_demo)
    args = parser.parse_args(argv)
    args.func(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
