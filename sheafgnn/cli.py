"""The ``sheafgnn`` command.

::

    sheafgnn demo      [--out runs/demo]                   the main demo on the embedded corpus
    sheafgnn build     FILE [--out graph.pt] [--stats]     the site of a text file (sheafgnn.site)
    sheafgnn train     --config FILE [--set KEY=VALUE ...] [--resume]   train a model (sheafgnn.train)
    sheafgnn compare   [...]                               sheaf vs dense, local, ssm (experiments.compare)
    sheafgnn tasks     [...]                               MQAR, selective copying, induction (experiments.task_runner)
    sheafgnn simulate  [...]                               the paper's dependency simulation (experiments.simulation)
    sheafgnn inspect   CHECKPOINT_OR_CONFIG --text FILE    the learned topology on a text
    sheafgnn generate  RUN (--prompt TEXT | --prompt-file FILE) --max-new-tokens N   sample a continuation

Bad input (a missing or unreadable file, invalid YAML, a number out of range, a
run folder without checkpoints) ends in one line on stderr,
``sheafgnn COMMAND: error: ...``, and exit status 2; :func:`main` is the one
place that turns the library's errors into that line.
"""

from __future__ import annotations

import argparse
import codecs
import importlib
import json
import sys
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import torch
import yaml
from torch_geometric.data import HeteroData
from tqdm import tqdm

from sheafgnn.checkpoint import CheckpointError
from sheafgnn.config import ArgumentParser, at_least
from sheafgnn.memory import tune_cpu
from sheafgnn.optional import MissingExtra
from sheafgnn.train import TrainingDiverged

# Subcommands with their own argument parsers: `sheafgnn NAME ARGS` calls module.function(ARGS).
DELEGATED = {
    "train": ("sheafgnn.train", "main_train"),
    "compare": ("sheafgnn.experiments.compare", "main_compare"),
    "tasks": ("sheafgnn.experiments.task_runner", "main_tasks"),
    "simulate": ("sheafgnn.experiments.simulation", "main_simulate"),
}


# What the library raises for bad input or a missing optional dependency; main() reports them in one line
# with exit status 2.
USER_ERRORS = (ValueError, OSError, yaml.YAMLError, CheckpointError, TrainingDiverged, MissingExtra)


def _print_site_statistics(graphs: list[HeteroData]) -> dict[str, dict[str, float]]:
    """Print per-type node and edge counts of ``graphs`` and the edges per token; return the statistics."""
    from sheafgnn.data import site_statistics

    stats = site_statistics(graphs)
    tokens = sum(g["token"].num_nodes for g in graphs)
    print(f"{'type':<44}{'count':>10}{'per token':>12}")
    for name, row in stats.items():
        print(f"{name:<44}{row['count']:>10}{row['per_token']:>12.3f}")
    totals = {"all nodes": sum(g.num_nodes for g in graphs), "all edges": sum(g.num_edges for g in graphs)}
    for name, count in totals.items():
        print(f"{name:<44}{count:>10}{count / max(tokens, 1):>12.3f}")
    return stats


def _site_demo(out: Path, context: int, tokens: int) -> None:
    from sheafgnn.data import corpus_ids
    from sheafgnn.site import SiteConfig, build_site, validate_site

    ids = corpus_ids(tokens, split="validation")
    graphs = [validate_site(build_site(ids[start : start + context], SiteConfig()))
              for start in tqdm(range(0, ids.numel() - context + 1, context), desc="building sites")]
    print(f"\n{len(graphs)} sites of {context} tokens from the validation split (byte tokenizer, the default site)")
    stats = _print_site_statistics(graphs)
    (out / "site_stats.json").write_text(json.dumps(stats, indent=2))


# The long comparison the demo's short one is read against: compare's folders of issue-sized runs, seed<N>/ each.
# A model's run in a later folder replaces its run of the same seed in an earlier one: text_lean/ holds the runs of
# the lean default (workspace and output patches, no random proposals) with the baselines it kept, text_gate/ those of
# the default since its broadcast gate starts at 1 (gluing.gate_init 1) with the baselines it kept,
# text_maps_from_identity/ those of the default before it (its learned maps start at I), text_keyprev/ those of the
# one before with its baselines (and seed 0's ssm, whose runs the changes of default leave as they were: an ssm has
# no maps and no gate), text/ the earlier defaults' (and seed 1's ssm).
LONG_RESULTS = tuple(Path(__file__).resolve().parent.parent / "benchmarks" / "results" / name
                     for name in ("text", "text_keyprev", "text_maps_from_identity", "text_gate",
                                  "text_lean"))


def _long_result() -> str:
    """Where the committed 8.4M-token comparison stands, on the mean of its seeds (the models that every
    seed ran), or that it is not in this checkout. The newest folder with runs names the line; a run from an
    earlier folder names its own."""
    from sheafgnn.experiments.compare_report import standing

    runs, tokens = {}, set()  # seed -> model -> (its training row, the folder it came from)
    for folder in LONG_RESULTS:
        for path in sorted(folder.glob("seed*/compare.json")):
            report = json.loads(path.read_text())
            tokens.add(report["config"]["tokens"])
            runs.setdefault(path.parent.name, {}).update(
                {kind: (row, folder.name) for kind, row in report["training"].items()})
    if not runs:
        return f"The 8.4M-token comparison (benchmarks/results/{LONG_RESULTS[-1].name}/) is not in this checkout."
    used = {folder for seed in runs.values() for _, folder in seed.values()}
    newest = next(f.name for f in reversed(LONG_RESULTS) if f.name in used)
    kinds = [k for k in next(iter(runs.values())) if all(k in seed for seed in runs.values())]
    mean = {k: {"val_bpb": sum(seed[k][0]["val_bpb"] for seed in runs.values()) / len(runs)} for k in kinds}
    per_seed = "; ".join(f"{name}: " + ", ".join(f"{k} {row['val_bpb']:.4f}"
                                                 + ("" if folder == newest else f" ({folder}/)")
                                                 for k, (row, folder) in seed.items())
                         for name, seed in runs.items())  # every model a seed ran, the mean's and others
    partial = sorted({k for seed in runs.values() for k in seed} - set(kinds))
    return (f"At {', '.join(f'{t:,}' for t in sorted(tokens))} tokens per model, mean of {len(runs)} seed(s) "
            f"(benchmarks/results/{newest}/): " + standing(mean).replace("at this budget", "there")
            + (f" Not run in every seed, so not in the mean: {', '.join(partial)}." if partial else "")
            + f" By seed: {per_seed}.")


def _demo(args: argparse.Namespace) -> int:
    from sheafgnn.experiments.compare import main_compare
    from sheafgnn.experiments.compare_report import standing

    if args.tokens < args.context:
        raise ValueError(f"--tokens ({args.tokens}) must be at least --context ({args.context}): "
                         "the statistics need one site")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _site_demo(out, args.context, args.tokens)
    print("\ntraining the default sheaf model and its baselines on the same data, then comparing ...")
    # About 2 minutes on 2 CPU cores; later flags (the user's) override these.
    compare_args = ["--out", str(out / "compare"), "--tokens", "65536", "--eval-batches", "4", "--sweep", "1024",
                    "4096", *args.compare_args]
    status = main_compare(compare_args)  # prints the comparison table
    report = json.loads((out / "compare" / "compare.json").read_text())
    verdict = [f"At {report['config']['tokens']:,} tokens per model, the demo's budget: "
               + standing(report["training"]).replace("Ahead at this budget: ", ""), _long_result()]
    (out / "verdict.md").write_text("\n\n".join(verdict) + "\n")
    print("\n" + "\n".join(verdict))
    return status


def _build(args: argparse.Namespace) -> int:
    from sheafgnn.site import ALL_TEXT_PATCH_TYPES, SiteConfig, build_site, validate_site

    config = SiteConfig.load(args.config) if args.config else SiteConfig()
    if args.all_types:
        config = replace(config, patch_types=ALL_TEXT_PATCH_TYPES)
    text = Path(args.file).read_bytes()
    if not text:
        raise ValueError(f"{args.file} is empty: there is no text to build a site of")
    data = validate_site(build_site(text, config))  # byte tokenizer: one token per byte
    tokens = data["token"].num_nodes
    print(f"{args.file}: {tokens:,} tokens -> {data.num_nodes:,} nodes, {data.num_edges:,} edges "
          f"({data.num_edges / tokens:.2f} edges per token)")
    if args.stats:
        _print_site_statistics([data])
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        torch.save(data, args.out)
        print(f"wrote {args.out} (a HeteroData: torch.load({str(args.out)!r}, weights_only=False))")
    return 0


def load_model(path: str | Path):
    """A model from a training run (its out_dir or a checkpoint step folder) or an untrained one
    from a SheafStateConfig or a sheaf TrainConfig file (.yaml, .toml, .json). Returns ``(model, tokenizer)``."""
    from sheafgnn import checkpoint as ckpt
    from sheafgnn.lm import build_model
    from sheafgnn.model import SheafStateConfig, SheafStateLM
    from sheafgnn.site import ByteTokenizer
    from sheafgnn.train import TrainConfig, load_tokenizer

    path = Path(path)
    if path.is_file():
        torch.manual_seed(0)
        try:
            return SheafStateLM(SheafStateConfig.load(path)).eval(), ByteTokenizer()
        except ValueError as err:  # not a SheafStateConfig: a training config (configs/sheaf.yaml)?
            try:
                config = TrainConfig.load(path)
            except ValueError:
                raise err from None
        if config.model != "sheaf" or config.tokenizer != "byte":
            raise ValueError(f"{path}: an untrained model needs a sheaf model on the byte tokenizer "
                             f"(got model {config.model!r}, tokenizer {config.tokenizer!r}); pass a trained run")
        return build_model("sheaf", config.model_config, 256, config.site).eval(), ByteTokenizer()
    if not path.is_dir():
        raise ValueError(f"no checkpoint folder or config file at {path}")
    step = path
    if not (step / ckpt.STATE).is_file():
        step = ckpt.latest_checkpoint(path / "checkpoints") or ckpt.latest_checkpoint(path)
    if step is None:
        raise ValueError(f"{path} holds no checkpoint (expected OUT_DIR, OUT_DIR/checkpoints or a step folder)")
    try:
        state = ckpt.read_state(step)
        config = TrainConfig.from_dict(state["config"])
    except Exception as err:
        raise ValueError(f"checkpoint {step} is unreadable ({type(err).__name__}: {err})") from None
    tokenizer = load_tokenizer(config)
    model = build_model(config.model, state["model_config"], tokenizer.vocab_size, config.site)
    ckpt.load_checkpoint(step, model)
    return model.eval(), tokenizer


def _inspect(args: argparse.Namespace) -> int:
    from sheafgnn.experiments.inspection import main_inspect

    text = Path(args.text).read_bytes()[: args.max_bytes]
    model, tokenizer = load_model(args.model)
    main_inspect(model, text, tokenizer, out_dir=args.out, hops=args.hops, top_k=args.top_k)
    return 0


def write_tokens(steps: Iterable[torch.Tensor], tokenizer, out: TextIO) -> None:
    """Write each step's token (ids (1,)) to ``out`` as soon as it arrives, flushed.

    The tokens' bytes go through one incremental UTF-8 decoder (invalid bytes
    become U+FFFD), so a character split across tokens prints whole.
    """
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for ids in steps:
        data, _ = tokenizer.token_bytes(ids.cpu())  # (bytes,), (1,)
        out.write(decoder.decode(bytes(data.tolist())))
        out.flush()
    out.write(decoder.decode(b"", final=True))
    out.flush()


def _positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _generate(args: argparse.Namespace) -> int:
    text = args.prompt.encode("utf-8", errors="surrogateescape") if args.prompt is not None \
        else Path(args.prompt_file).read_bytes()
    if not text:
        raise ValueError(f"the prompt {'file ' + args.prompt_file + ' ' if args.prompt is None else ''}is empty; "
                         "generation needs at least one token to start from")
    from sheafgnn.model import SheafStateLM

    model, tokenizer = load_model(args.run)
    ids = tokenizer.encode(text)  # (n,)
    # The sheaf model's site rules read the bytes of its tokens: its stream needs the run's tokenizer.
    stream = model.stream(tokenizer=tokenizer) if isinstance(model, SheafStateLM) else model.stream()
    if ids.numel() == 0:
        raise ValueError("the prompt encodes to no tokens; give a longer prompt")
    if int(ids.max()) >= stream.vocab_size:
        raise ValueError(f"the prompt encodes to id {int(ids.max())}, outside the model's {stream.vocab_size} ids; "
                         "the run's tokenizer does not match its model")
    limit = stream.max_tokens
    if limit is not None and ids.numel() + args.max_new_tokens > limit:
        raise ValueError(f"the prompt ({ids.numel()} tokens) plus --max-new-tokens {args.max_new_tokens} exceeds "
                         f"the model's limit of {limit} tokens; shorten the prompt or generate fewer tokens")
    generator = torch.Generator().manual_seed(args.seed) if args.seed is not None else None
    sys.stdout.write(text.decode("utf-8", errors="replace"))
    sys.stdout.flush()
    stream.feed(ids)
    steps = stream.sample(args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, generator=generator)
    write_tokens(steps, tokenizer, sys.stdout)
    sys.stdout.write("\n")
    return 0


def _add_generate(sub) -> None:
    generate = sub.add_parser("generate", help="sample a continuation of a prompt, printed as it is produced")
    generate.add_argument("run", help="a training out_dir, a checkpoint step folder, or a SheafStateConfig file")
    prompt = generate.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text")
    prompt.add_argument("--prompt-file", help="a file whose contents are the prompt")
    generate.add_argument("--max-new-tokens", type=at_least(1), required=True, help="tokens to sample")
    generate.add_argument("--temperature", type=_positive_float, default=1.0,
                          help="softmax temperature > 0 (default: 1.0)")
    generate.add_argument("--top-k", type=at_least(1), default=None,
                          help="sample among the k most likely tokens (default: all; 1 = greedy)")
    generate.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: unseeded)")
    generate.set_defaults(func=_generate)


def _parser() -> ArgumentParser:
    parser = ArgumentParser(prog="sheafgnn", description=__doc__.split("\n")[0],
                            epilog="also: " + ", ".join(f"sheafgnn {name} --help" for name in DELEGATED))
    names = ",".join(("demo", "build", "inspect", "generate", *DELEGATED))
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + names + "}")
    demo = sub.add_parser("demo", help="the main demo on the embedded corpus (other flags go to `sheafgnn compare`)")
    demo.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    demo.add_argument("--context", type=at_least(2), default=1024,
                      help="tokens per site for the statistics (default: 1024)")
    demo.add_argument("--tokens", type=at_least(2), default=8192,
                      help="corpus tokens for the statistics (default: 8192)")
    demo.set_defaults(func=_demo)
    build = sub.add_parser("build", help="build, validate and optionally save the site of a text file")
    build.add_argument("file", help="a text file (read as bytes: one token per byte)")
    build.add_argument("--out", help="save the site (a PyG HeteroData) here with torch.save")
    build.add_argument("--stats", action="store_true", help="print per-type node and edge counts, per token")
    build.add_argument("--config", help="a SiteConfig as YAML, TOML or JSON (default: SiteConfig())")
    build.add_argument("--all-types", action="store_true",
                       help="every patch type of text (ALL_TEXT_PATCH_TYPES), not only the default model's")
    build.set_defaults(func=_build)
    inspect = sub.add_parser("inspect", help="statistics, exports and plots of a model's topology on a text")
    inspect.add_argument("model", help="a training out_dir, a checkpoint step folder, or a SheafStateConfig file")
    inspect.add_argument("--text", required=True, help="a text file")
    inspect.add_argument("--out", default="runs/inspect", help="output folder (default: runs/inspect)")
    inspect.add_argument("--hops", type=at_least(1), default=3, help="hops of the relation matrix (default: 3)")
    inspect.add_argument("--top-k", type=at_least(1), default=5, help="top edges listed per type (default: 5)")
    inspect.add_argument("--max-bytes", type=at_least(1), default=4096,
                         help="bytes of the text read (default: 4096)")
    inspect.set_defaults(func=_inspect)
    _add_generate(sub)
    return parser


def _one_line(err: BaseException) -> str:
    """The error's message on one line (an OSError as 'what: file')."""
    if isinstance(err, OSError) and err.strerror:
        text = f"{err.strerror}: {err.filename}" if err.filename else err.strerror
    else:
        text = str(err) or type(err).__name__
    return " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    """Run ``sheafgnn ARGV``; return the exit status (2 and one line on stderr for bad input)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv else ""
    tune_cpu()  # process-wide allocator settings that change no result (sheafgnn.memory)
    try:
        if command in DELEGATED:
            module, function = DELEGATED[command]
            return getattr(importlib.import_module(module), function)(argv[1:])
        parser = _parser()
        args, extra = parser.parse_known_args(argv)
        if args.command == "demo":
            args.compare_args = extra
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except USER_ERRORS as err:
        print(f"sheafgnn {command}: error: {_one_line(err)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
