"""How hard each split of the embedded corpus is, model-free: bits per byte under a byte 4-gram model.

The 0.1 compare runs showed a ~1.3-nat gap between every model's last training
loss and its validation loss. This measures how much of it is the split
itself: a byte 4-gram model (3 bytes of context, add-0.1 smoothing) is fitted
on the training documents but every tenth, then scores

- the held-out tenth of the training documents (what an unseen training window looks like),
- every validation document, and the validation text as a whole,
- the machine-generated modules the corpus leaves out (``sheafgnn.data.GENERATED_MODULES``).

Writes ``corpus_split.json``. Usage::

    python benchmarks/bench_corpus_split.py [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
from collections import Counter
from pathlib import Path

from sheafgnn.data import GENERATED_MODULES, corpus_documents

CONTEXT = 3  # bytes of context: a 4-gram model
ALPHA = 0.1  # add-alpha smoothing over 256 byte values


class ByteNgram:
    """Counts of (context, next byte) in a text; bits per byte of another text."""

    def __init__(self, text: bytes) -> None:
        self.pairs = Counter(text[i - CONTEXT : i + 1] for i in range(CONTEXT, len(text)))
        self.contexts = Counter(text[i - CONTEXT : i] for i in range(CONTEXT, len(text)))

    def bits_per_byte(self, text: bytes) -> float:
        bits = 0.0
        for i in range(CONTEXT, len(text)):
            p = (self.pairs[text[i - CONTEXT : i + 1]] + ALPHA) / (self.contexts[text[i - CONTEXT : i]] + 256 * ALPHA)
            bits -= math.log2(p)
        return bits / max(1, len(text) - CONTEXT)


def weighted(rows: list[dict]) -> float:
    return sum(r["bits_per_byte"] * r["bytes"] for r in rows) / sum(r["bytes"] for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    train = corpus_documents("mixed", "train")
    model = ByteNgram(b"\n\n".join(text.encode() for i, text in enumerate(train.values()) if i % 10))

    def score(name: str, text: str) -> dict:
        return {"name": name, "bytes": len(text.encode()), "bits_per_byte": model.bits_per_byte(text.encode())}

    held_out = [score(n, text) for i, (n, text) in enumerate(train.items()) if i % 10 == 0]
    validation = [score(n, text) for n, text in corpus_documents("mixed", "validation").items()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    generated = [score(f"code/{p.name}", p.read_text(encoding="utf-8", errors="replace"))
                 for p in sorted(stdlib.glob("*.py")) if p.name.startswith(GENERATED_MODULES)]
    result = {"model": f"byte {CONTEXT + 1}-gram, add-{ALPHA} smoothing, fitted on 9/10 of the training documents",
              "train_held_out": {"bits_per_byte": weighted(held_out), "documents": held_out},
              "validation": {"bits_per_byte": weighted(validation), "documents": validation},
              "generated_modules_left_out": generated}
    for name, rows in (("training documents held out", held_out), ("validation", validation),
                       ("generated modules (left out)", generated)):
        if rows:
            print(f"{name:<30} {weighted(rows):.3f} bits/byte over {sum(r['bytes'] for r in rows):,} bytes")
    for row in validation + generated:
        print(f"  {row['name']:<48} {row['bytes']:>8,} bytes {row['bits_per_byte']:.3f}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "corpus_split.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {out / 'corpus_split.json'}")


if __name__ == "__main__":
    main()
