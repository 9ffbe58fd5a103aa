r"""``sheafgnn tasks``: the structured dependency tasks for sheaf, dense, local and ssm.

::

    sheafgnn tasks [--quick] [--out runs/tasks] [--steps 40] [--zoology] ...

    TasksConfig
      for task in (mqar, selective_copying, induction_heads):      generators: experiments.tasks
        matched_options (sheafgnn.lm)      baselines' widths matched to the sheaf model's
                                              parameters for this task's vocabulary (or --equal-width)
        for model in (sheaf, dense, local, ssm):
          train_task     sheafgnn.train's train_step: AdamW, warm-up + cosine, clipping; fresh
                         batches from a generator seeded by `seed`: every model sees the same batches
          evaluate       accuracy on the scored positions of held-out rows (another seed),
                         induction heads at every length of induction_test_lens
          (every eval_every steps also at the training length: the accuracy curve)
      -> out_dir/tasks.json (its "summary": the rows)  tasks.md  curves.png  induction.png
         summary rows merged into --summary FILE (one row per task, length, model, hash rule)

Sizes (defaults; all are flags). MQAR at the issue's CPU size: sequence 256,
16 pairs, vocabulary 512 (``--zoology``: 512, 64, 8192, as in Arora et al.
2023). Selective copying: sequence 256, 16 data tokens, vocabulary 16.
Induction heads: vocabulary 16, trained at 256, tested at 256, 1k, 4k, 16k.
Models: d_model 64 for the sheaf model, 2 layers.

From token sequences to sites
-----------------------------
A task row (T token ids) becomes a site with
:func:`~sheafgnn.site.build_site`, one row at a time, ``data['token'].y`` the
row's targets (IGNORE_INDEX where unscored); rows are batched with PyG. The
task ids are not text, so:

- the byte-rule patch types (``sentence``, ``syntax``, ``instruction``,
  ``topic``, and ``memory``, whose entities are words of bytes) are switched
  off: on synthetic ids they would find sentences and brackets that are not
  there (vocab <= 256, where ids pass for bytes) or wrap ids modulo 256
  (vocab > 256). The default site's other types stay on (:data:`TASK_SITE`:
  ``workspace`` and ``output``; ``local`` and ``retrieval`` on request);
- :class:`TaskTokenizer` maps every id to one neutral byte (``x``, which no
  byte rule reacts to), so the builder's byte stage is defined for any
  vocabulary and finds nothing;
- the hash retrieval rule is **off** by default (``hash_retrieval``): the
  sheaf model must find the key itself, through the content-addressed
  proposals of its learned topology (:mod:`sheafgnn.nn.topology`). With
  ``hash_retrieval=True`` the site adds ``retrieval`` patches: a position
  whose last ``retrieval_key_len`` *ids* occurred before links the token
  after the earlier match to it, exactly the induction / associative-recall
  pattern handed over as a rule. ``retrieval_key_len`` is 1, because in all
  three tasks a key is one token (an MQAR key, the induction trigger). This
  is a setting of the sheaf model's site, stated in the report and in every
  summary row; the tasks themselves are the unmodified generators.

The baselines read token ids only; their sites are built with no patch types
(tokens and outputs).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from torch import Tensor, nn
from torch_geometric.data import Batch
from tqdm import tqdm

from sheafgnn.config import ConfigFile
from sheafgnn.experiments.compare import BASELINE_SITE
from sheafgnn.experiments.report import config_from_args, report_parser, run_report_command, write_report
from sheafgnn.experiments.task_report import figures, markdown, merge_summary, summary_rows
from sheafgnn.experiments.tasks import IGNORE_INDEX, induction_heads, mqar, scattered_recall, selective_copying
from sheafgnn.lm import (
    MODEL_KINDS,
    build_model,
    count_model_parameters,
    matched_options,
    print_parameter_counts,
)
from sheafgnn.memory import tune_cpu
from sheafgnn.model import SheafStateConfig, SheafStateLM
from sheafgnn.optim import cosine_lr, make_optimizer
from sheafgnn.site import SiteConfig, build_site
from sheafgnn.site.schema import CONTENT_EDGE
from sheafgnn.train import resolve_device, train_step

TASKS = ("mqar", "scattered_recall", "selective_copying", "induction_heads")
RECALL_TASKS = ("mqar", "scattered_recall")  # scored per pair; their test lengths keep the training pair density
# The byte-rule patch types, off on task ids (module docstring); the sheaf model's site is the default's without them.
BYTE_RULE_TYPES = ("sentence", "syntax", "instruction", "topic", "memory")
TASK_SITE = {"patch_types": [t for t in SiteConfig().patch_types if t not in BYTE_RULE_TYPES], "retrieval_key_len": 1}
NEUTRAL_BYTE = ord("x")  # what every task id stands for in the builder's byte rules
ZOOLOGY = {"mqar_seq_len": 512, "mqar_pairs": 64, "mqar_vocab": 8192}


class TaskTokenizer:
    """The tokenizer interface :func:`~sheafgnn.site.build_site` needs, for synthetic ids.

    Every id in ``[0, vocab_size)`` is one token of one byte, :data:`NEUTRAL_BYTE`,
    so the byte rules see a run of letters and make no patch; id-based rules
    (local windows, retrieval on id keys, workspace, output) are unaffected.

    Args:
        vocab_size (int): the task's vocabulary.
    """

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < 2:
            raise ValueError(f"TaskTokenizer: vocab_size must be >= 2 (got {vocab_size})")
        self.vocab_size = vocab_size

    def token_bytes(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """(bytes (n,), bytes per token (n,)): one neutral byte per id."""
        return torch.full(ids.shape, NEUTRAL_BYTE, dtype=torch.uint8), torch.ones_like(ids)

    def __repr__(self) -> str:
        return f"TaskTokenizer(vocab_size={self.vocab_size})"


@dataclass
class TasksConfig(ConfigFile):
    """A run of the dependency tasks (``print(config)`` shows every field)."""

    out_dir: str = "runs/tasks"  # tasks.json, tasks.md, induction.png
    models: tuple[str, ...] = ("sheaf", "dense_conv", "dense", "ssm")  # any of sheafgnn.lm.MODEL_KINDS
    tasks: tuple[str, ...] = TASKS  # which of mqar | scattered_recall | selective_copying | induction_heads
    d_model: int = 64  # the sheaf model's width
    n_layers: int = 2  # blocks of every model
    n_heads: int = 2  # attention heads of dense and local
    window: int = 64  # local attention window (tokens)
    equal_width: bool = False  # True: every model at d_model; False: baselines matched to the sheaf parameters
    sheaf: dict = field(default_factory=dict)  # SheafStateConfig fields over the default (sheaf and ssm)
    site: dict = field(default_factory=lambda: dict(TASK_SITE))  # the sheaf model's SiteConfig (module docstring)
    hash_retrieval: bool = False  # sheaf: switch the site's hash retrieval rule on (retrieval patch type)
    steps: int = 40  # optimizer steps per task and model
    batch_size: int = 16  # rows per step
    lr: float = 3e-3  # peak learning rate
    warmup_steps: int = 4  # linear warm-up
    weight_decay: float = 0.1  # AdamW decay on matrices
    grad_clip: float = 1.0  # global gradient-norm clip; 0: none
    seed: int = 0  # init and training batches; test rows use other seeds
    test_examples: int = 64  # held-out rows per task at the training length
    eval_every: int = 0  # also test at the training length every this many steps (0: at the end only)
    stop_accuracy: float = 0.0  # > 0: stop training once a test (every eval_every steps) reaches it (Zoology: 0.99)
    summary: str = ""  # also merge this run's rows into this JSON file (e.g. benchmarks/results/tasks/summary.json)
    mqar_seq_len: int = 256  # MQAR row length
    mqar_pairs: int = 16  # MQAR key-value pairs
    mqar_vocab: int = 512  # MQAR vocabulary (scattered_recall's too)
    mqar_test_lens: tuple[int, ...] = ()  # MQAR also tested at these lengths, with the training pair density
    # (sequence, pairs, steps) of a shorter MQAR trained first, every model alike (a length curriculum); (): none
    mqar_warmup: tuple[int, ...] = ()
    scatter_seq_len: int = 256  # scattered_recall row length
    scatter_pairs: int = 16  # scattered_recall binds (each queried once)
    copy_seq_len: int = 256  # selective copying row length
    copy_tokens: int = 16  # data tokens to copy
    copy_vocab: int = 16  # selective copying vocabulary
    induction_vocab: int = 16  # induction heads vocabulary
    induction_train_len: int = 256  # induction heads training length
    induction_test_lens: tuple[int, ...] = (256, 1024, 4096, 16384)  # induction test lengths
    induction_long_examples: int = 8  # held-out rows at each test length above the training length
    eval_tokens: int = 16384  # tokens per forward pass at test time
    device: str = "cpu"  # cpu | cuda | auto
    num_threads: int = 0  # torch CPU threads; 0: torch's default
    progress: bool = True  # tqdm bars

    def __post_init__(self) -> None:
        self.models, self.tasks = tuple(self.models), tuple(self.tasks)
        self.sheaf = SheafStateConfig.nested(self.sheaf)
        self.induction_test_lens = tuple(sorted(set(self.induction_test_lens)))
        if not self.models or set(self.models) - set(MODEL_KINDS):
            raise ValueError(f"TasksConfig: models must be a non-empty subset of {MODEL_KINDS} (got {self.models})")
        if not self.tasks or set(self.tasks) - set(TASKS):
            raise ValueError(f"TasksConfig: tasks must be a non-empty subset of {TASKS} (got {self.tasks})")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and f.name not in ("seed", "warmup_steps", "num_threads", "eval_every") and value < 1:
                raise ValueError(f"TasksConfig: {f.name} must be a positive integer (got {value!r})")
        if not (self.lr > 0 and self.weight_decay >= 0 and self.grad_clip >= 0):
            raise ValueError(f"TasksConfig: need lr > 0, weight_decay >= 0, grad_clip >= 0 "
                             f"(got {self.lr}, {self.weight_decay}, {self.grad_clip})")
        if not 0 <= self.stop_accuracy <= 1 or (self.stop_accuracy and not self.eval_every):
            raise ValueError(f"TasksConfig: stop_accuracy must lie in [0, 1] and needs eval_every > 0 "
                             f"(got {self.stop_accuracy}, eval_every {self.eval_every})")
        self.mqar_test_lens = tuple(sorted(set(self.mqar_test_lens)))
        if any(n * self.mqar_pairs % self.mqar_seq_len or n < self.mqar_seq_len for n in self.mqar_test_lens):
            raise ValueError(f"TasksConfig: mqar_test_lens must be multiples of mqar_seq_len * k / mqar_pairs at or "
                             f"above mqar_seq_len, so that the pair density holds (got {self.mqar_test_lens})")
        if not self.induction_test_lens or min(self.induction_test_lens) < 3:
            raise ValueError(f"TasksConfig: induction_test_lens must be lengths >= 3 (got {self.induction_test_lens})")
        if self.mqar_warmup and (len(self.mqar_warmup) != 3 or min(self.mqar_warmup) < 1):
            raise ValueError(f"TasksConfig: mqar_warmup must be () or (sequence, pairs, steps) of positive integers "
                             f"(got {self.mqar_warmup})")
        SiteConfig.from_dict(self.sheaf_site)  # validate early

    @property
    def sheaf_site(self) -> dict:
        """The sheaf model's site: ``site`` with the hash retrieval rule switched by ``hash_retrieval``."""
        types = [t for t in self.site.get("patch_types", TASK_SITE["patch_types"]) if t != "retrieval"]
        return {**self.site, "patch_types": types + ["retrieval"] * self.hash_retrieval}

    @classmethod
    def quick(cls, **overrides) -> TasksConfig:
        """A toy preset that runs in seconds (tests, smoke checks)."""
        values = dict(d_model=32, n_layers=1, window=16, sheaf={"ssm": {"headdim": 16}}, steps=2, batch_size=2,
                      warmup_steps=1, test_examples=4,
                      mqar_seq_len=64, mqar_pairs=4, mqar_vocab=64, scatter_seq_len=48, scatter_pairs=4,
                      copy_seq_len=32, copy_tokens=4,
                      induction_train_len=32, induction_test_lens=(32, 128), induction_long_examples=2,
                      progress=False)
        values.update(overrides)
        return cls(**values)


# ---------------------------------------------------------------------------
# Tasks as sites
# ---------------------------------------------------------------------------


@dataclass
class TaskSpec:
    """One task: its vocabulary, training length, test lengths and row sampler."""

    name: str
    vocab_size: int
    train_len: int
    test_lens: tuple[int, ...]
    sample: Callable[[int, int, torch.Generator], tuple[Tensor, Tensor]]  # (rows, length, gen) -> (x, y) (B, T)


def mqar_spec(seq_len: int, pairs: int, vocab: int, test_lens: tuple[int, ...] = ()) -> TaskSpec:
    """MQAR trained at ``seq_len`` with ``pairs`` key-value pairs over ``vocab`` ids, tested there and at
    ``test_lens`` with the same pair density (``n * pairs // seq_len`` pairs at length n)."""
    return TaskSpec("mqar", vocab, seq_len, tuple(sorted({seq_len, *test_lens})),
                    lambda b, n, g: mqar(b, n, n * pairs // seq_len, vocab, g))


def task_specs(config: TasksConfig) -> dict[str, TaskSpec]:
    """The configured tasks, each sampling rows from the unmodified generators of
    :mod:`sheafgnn.experiments.tasks`."""
    c = config
    specs = {
        "mqar": mqar_spec(c.mqar_seq_len, c.mqar_pairs, c.mqar_vocab, c.mqar_test_lens),
        "scattered_recall": TaskSpec("scattered_recall", c.mqar_vocab, c.scatter_seq_len, (c.scatter_seq_len,),
                                     lambda b, n, g: scattered_recall(b, n, c.scatter_pairs, c.mqar_vocab, g)),
        "selective_copying": TaskSpec("selective_copying", c.copy_vocab, c.copy_seq_len, (c.copy_seq_len,),
                                      lambda b, n, g: selective_copying(b, n, c.copy_tokens, c.copy_vocab, g)),
        "induction_heads": TaskSpec("induction_heads", c.induction_vocab, c.induction_train_len,
                                    c.induction_test_lens,
                                    lambda b, n, g: induction_heads(b, n, c.induction_vocab, g)),
    }
    return {name: specs[name] for name in config.tasks}


def warmup_spec(spec: TaskSpec, config: TasksConfig) -> tuple[TaskSpec, int] | None:
    """The shorter task trained before ``spec`` and its steps (``mqar_warmup``), or None."""
    if spec.name != "mqar" or not config.mqar_warmup:
        return None
    length, pairs, steps = config.mqar_warmup
    return mqar_spec(length, pairs, spec.vocab_size), steps


def to_sites(inputs: Tensor, targets: Tensor, site_config: SiteConfig, tokenizer: TaskTokenizer) -> Batch:
    """Rows of task ids (B, T) and their targets (B, T) -> a PyG ``Batch`` of B sites.

    Each row is built with :func:`~sheafgnn.site.build_site` (vectorised
    within the row); ``data['token'].y`` holds the row's targets.
    """
    sites = []
    for x, y in zip(inputs, targets):
        data = build_site(x, site_config, tokenizer=tokenizer)
        data["token"].y = y.clone()
        sites.append(data)
    return Batch.from_data_list(sites)


# ---------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------


def train_task(model: nn.Module, spec: TaskSpec, config: TasksConfig, site_config: SiteConfig,
               desc: str = "", steps: int | None = None) -> dict:
    """Train ``model`` for ``steps`` (default ``config.steps``) on fresh rows of ``spec`` (the same rows
    for every model: seeded by ``config.seed``), warm-up + cosine over those steps.

    With ``stop_accuracy``, training stops at the first test that reaches it (the cosine schedule stays the
    one of ``steps``).

    Returns:
        dict with ``train_loss`` (mean of the last quarter of steps), ``steps`` (trained), ``train_s``
        and ``train_tokens_per_s`` (site building included), and ``curve``: the
        accuracy at the training length every ``eval_every`` steps (time spent
        testing is not counted in ``train_s``).
    """
    device, tokenizer = resolve_device(config.device), TaskTokenizer(spec.vocab_size)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = make_optimizer(model, lr=config.lr, weight_decay=config.weight_decay)
    steps = config.steps if steps is None else steps
    warmup = min(config.warmup_steps, steps)
    losses, curve, testing = [], [], 0.0
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, disable=not config.progress, leave=False, dynamic_ncols=True)
    for step in bar:
        lr = cosine_lr(step, peak_lr=config.lr, total_steps=steps, warmup_steps=warmup, min_lr_ratio=0.1)
        x, y = spec.sample(config.batch_size, spec.train_len, generator)  # (B, T), (B, T)
        result = train_step(model, to_sites(x, y, site_config, tokenizer).to(device), optimizer, lr=lr,
                            grad_clip=config.grad_clip)
        losses.append(result.loss)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
        if config.eval_every and (step + 1) % config.eval_every == 0 and step + 1 < steps:
            tic = time.perf_counter()
            accuracy = evaluate(model, spec, spec.train_len, config.test_examples, config, site_config)["accuracy"]
            curve.append({"step": step + 1, "accuracy": accuracy, "loss": sum(losses[-config.eval_every:])
                          / config.eval_every})
            testing += time.perf_counter() - tic
            if not config.progress:
                print(f"  {desc} step {step + 1}: loss {curve[-1]['loss']:.3f}, accuracy {accuracy:.3f}", flush=True)
            if config.stop_accuracy and accuracy >= config.stop_accuracy:
                break
    elapsed = time.perf_counter() - start - testing
    tail = losses[-max(1, len(losses) // 4):]
    return {"train_loss": sum(tail) / len(tail), "steps": len(losses), "train_s": elapsed, "curve": curve,
            "train_tokens_per_s": len(losses) * config.batch_size * spec.train_len / max(elapsed, 1e-9)}


@torch.no_grad()
def evaluate(model: nn.Module, spec: TaskSpec, length: int, examples: int, config: TasksConfig,
             site_config: SiteConfig) -> dict:
    """Accuracy (argmax == target) over the scored positions of ``examples`` held-out rows of ``length``.

    The rows come from a generator seeded by (seed, length), different from
    the training stream and the same for every model. The accuracy is also
    split by whether the scored position's input id occurred at least twice
    before it in its row (``ambiguous``): in MQAR, a query whose key also
    appeared as noise after its pair, where the token after that earlier
    occurrence is a decoy; in induction heads, a trigger seen more than once. For a sheaf model
    with gluing, on the first batch of rows at the training length (None at other lengths),
    ``kept_per_output`` holds each block's kept gluing edges per output node (all edge types): how
    many messages its selection really takes; and ``answer_coverage`` whether each block's content
    proposals reach the answer (:func:`answer_coverage`).
    """
    device, tokenizer = resolve_device(config.device), TaskTokenizer(spec.vocab_size)
    generator = torch.Generator().manual_seed(config.seed + 1_000_003 * length + 7)
    x, y = spec.sample(examples, length, generator)  # (R, T), (R, T)
    ambiguous = earlier_occurrences(x) >= 2  # (R, T)
    rows = max(1, config.eval_tokens // length)  # rows per forward pass
    model.eval()
    correct = scored = correct_ambiguous = scored_ambiguous = 0
    kept_per_output = coverage = None
    for i in range(0, examples, rows):
        batch = to_sites(x[i : i + rows], y[i : i + rows], site_config, tokenizer).to(device)
        pred = model(batch).argmax(-1)  # (rows * T,)
        target = batch["token"].y
        mask = target != IGNORE_INDEX
        hit = (pred[mask] == target[mask]).cpu()
        if i == 0 and length == spec.train_len and isinstance(model, SheafStateLM) and model.config.glues:
            topologies = model.topology(batch, block=None, candidates=True)
            kept_per_output = [sum(int(e["edge_index"].size(1)) for t, e in top.items() if t[2] == "output")
                               / batch["output"].num_nodes for top in topologies]
            coverage = answer_coverage(topologies, x[i : i + rows], y[i : i + rows], (pred == target).cpu())
        hard = ambiguous[i : i + rows].flatten()[mask.cpu()]
        correct, scored = correct + int(hit.sum()), scored + int(mask.sum())
        correct_ambiguous += int(hit[hard].sum())
        scored_ambiguous += int(hard.sum())
    model.train()
    clear = scored - scored_ambiguous
    return {"accuracy": correct / max(scored, 1), "scored": scored, "rows": examples,
            "accuracy_ambiguous": correct_ambiguous / scored_ambiguous if scored_ambiguous else None,
            "scored_ambiguous": scored_ambiguous,
            "accuracy_unambiguous": (correct - correct_ambiguous) / clear if clear else None,
            "kept_per_output": kept_per_output, "answer_coverage": coverage}


def bind_positions(x: Tensor, y: Tensor) -> Tensor:
    """(R, T) for each scored position t, the latest p < t whose token ``x[p]`` is the answer ``y[t]`` right
    after the query ``x[t]`` (``x[p - 1] == x[t]``): the value of an MQAR bind, the token after an earlier
    induction trigger; -1 where there is none and at unscored positions (O(R T^2) memory)."""
    R, T = x.shape
    previous = torch.cat([x.new_full((R, 1), -1), x[:, :-1]], 1)  # (R, T): x[p - 1]
    match = (previous.unsqueeze(1) == x.unsqueeze(2)) & (x.unsqueeze(1) == y.unsqueeze(2))  # (R, t, p)
    match &= torch.ones(T, T, dtype=torch.bool).tril(-1) & (y != IGNORE_INDEX).unsqueeze(2)  # p < t, t scored
    return torch.where(match, torch.arange(T), -1).amax(2)


def answer_coverage(topologies: list[dict], x: Tensor, y: Tensor, hit: Tensor) -> list[dict]:
    """Per block of a sheaf model, over the scored positions of rows ``x`` (R, T) whose answer sits at an
    earlier position (:func:`bind_positions`): the fraction whose answer token is in the output's pool of
    content proposals (``in_pool``), among the kept content edges (``kept``), the mean weight of that edge (0
    when not kept), and the accuracy (``hit``: (R * T,) prediction == target) with the answer in the pool and out of it.
    A recall task's accuracy can exceed ``in_pool`` only through the other paths (rules, random proposals, the
    ssm); where it falls short of the pool's accuracy, the choice of blocks is what fails."""
    R, T = x.shape
    bind = bind_positions(x, y).flatten()  # (R * T,)
    query = (bind >= 0).nonzero().squeeze(1)  # the outputs whose answer is in their row
    pair, order = torch.sort((torch.div(query, T, rounding_mode="floor") * T + bind[query]) * R * T + query)
    hit = hit[query][order]
    out = []
    for top in topologies:
        edges = {k: v.cpu() for k, v in top[CONTENT_EDGE].items() if isinstance(v, Tensor)}
        pool = torch.isin(pair, edges["candidate_index"][0] * R * T + edges["candidate_index"][1])
        kept = edges["edge_index"][0] * R * T + edges["edge_index"][1]  # (E,) (token, output) ids
        at = torch.searchsorted(pair, kept).clamp(max=max(pair.numel() - 1, 0))
        found = pair[at] == kept if pair.numel() else torch.zeros_like(kept, dtype=torch.bool)
        weight = torch.zeros(pair.numel()).index_put_((at[found],), edges["weight"][found])
        out.append({"answers": int(pair.numel()), "in_pool": _mean(pool), "kept": _mean(weight > 0),
                    "weight": _mean(weight), "accuracy_in_pool": _mean(hit[pool]),
                    "accuracy_out_of_pool": _mean(hit[~pool])})
    return out


def _mean(values: Tensor) -> float | None:
    return float(values.float().mean()) if values.numel() else None


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def earlier_occurrences(x: Tensor) -> Tensor:
    """(R, T) how many times each row's id at t occurred at positions < t of the row (O(R T log T))."""
    order = torch.sort(x, dim=1, stable=True).indices  # (R, T): by id, then position
    ids = x.gather(1, order)
    position = torch.arange(x.size(1)).expand_as(x)
    group_start = torch.ones_like(ids, dtype=torch.bool)
    group_start[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rank = position - torch.where(group_start, position, 0).cummax(1).values  # earlier equal ids
    return torch.empty_like(rank).scatter_(1, order, rank)


def task_options(config: TasksConfig, vocab_size: int) -> tuple[dict[str, dict], dict[str, int]]:
    """``build_model`` options and parameter counts per model for one task's vocabulary.

    The sheaf model is at ``d_model``; the others are matched to its parameter
    count (:func:`~sheafgnn.lm.matched_options`), or, with
    ``equal_width``, all at ``d_model`` too (counts then differ; they are printed).
    """
    sheaf_options = {"d_model": config.d_model, "n_layers": config.n_layers, **config.sheaf}
    if not config.equal_width:
        return matched_options(config.models, sheaf_options, vocab_size, n_heads=config.n_heads,
                               window=config.window, site=config.sheaf_site)
    attention = {"d_model": config.d_model, "n_layers": config.n_layers, "n_heads": config.n_heads}
    options = {k: dict(sheaf_options) if k in ("sheaf", "ssm") else
               {**attention, **({} if k.startswith("dense") else {"window": config.window})} for k in config.models}
    counts = {k: count_model_parameters(k, options[k], vocab_size, config.sheaf_site if k == "sheaf" else None)
              for k in config.models}
    counts["target"] = count_model_parameters("sheaf", sheaf_options, vocab_size, config.sheaf_site)
    return options, counts


def run_task(spec: TaskSpec, config: TasksConfig) -> dict:
    """Match the widths for this task's vocabulary, then train and test every model on it."""
    options, counts = task_options(config, spec.vocab_size)
    print(f"\n== {spec.name}: vocabulary {spec.vocab_size}, train length {spec.train_len}, "
          f"{config.steps} steps of {config.batch_size} rows ==")
    print_parameter_counts(options, counts)
    device = resolve_device(config.device)
    out = {}
    for kind in config.models:
        site = config.sheaf_site if kind == "sheaf" else dict(BASELINE_SITE)
        site_config = SiteConfig.from_dict(site)
        torch.manual_seed(config.seed)
        model = build_model(kind, options[kind], spec.vocab_size, site).to(device)
        result = {"params": counts[kind], "d_model": options[kind]["d_model"]}
        warmup = warmup_spec(spec, config)
        if warmup is not None:  # the shorter task first; its accuracy curve is kept apart
            short, steps = warmup
            result["warmup"] = train_task(model, short, config, site_config, f"{spec.name} {kind} @{short.train_len}",
                                          steps)
            result["warmup"]["accuracy"] = evaluate(model, short, short.train_len, config.test_examples, config,
                                                    site_config)["accuracy"]
        result.update(train_task(model, spec, config, site_config, desc=f"{spec.name} {kind}"))
        accuracy, scored, split = {}, {}, {}
        for length in tqdm(spec.test_lens, desc=f"test {kind}", disable=not config.progress, leave=False):
            examples = config.test_examples if length <= spec.train_len or spec.name in RECALL_TASKS \
                else config.induction_long_examples
            r = evaluate(model, spec, length, examples, config, site_config)
            accuracy[str(length)], scored[str(length)] = r["accuracy"], r["scored"]
            split[str(length)] = {k: r[k] for k in ("accuracy_ambiguous", "scored_ambiguous", "accuracy_unambiguous")}
            if r["kept_per_output"] is not None:
                result["kept_per_output"], result["answer_coverage"] = r["kept_per_output"], r["answer_coverage"]
        result.update(accuracy=accuracy, scored=scored, ambiguity=split)
        if warmup is not None:  # the curriculum's final model on the shorter task too: one model for both
            result["warmup"]["final_accuracy"] = evaluate(model, short, short.train_len, config.test_examples, config,
                                                          site_config)["accuracy"]
        result["curve"].append({"step": result["steps"], "accuracy": accuracy[str(spec.train_len)],
                                "loss": result["train_loss"]})
        print(f"{kind:<6} loss {result['train_loss']:.3f}  accuracy "
              + "  ".join(f"@{n}: {a:.3f}" for n, a in accuracy.items())
              + f"  ({result['train_s']:.0f} s, {result['train_tokens_per_s']:.0f} train tok/s); ambiguous "
              + "  ".join(f"@{n}: {_fraction(r['accuracy_ambiguous'])} of {r['scored_ambiguous']}"
                          for n, r in split.items()))
        for b, c in enumerate(result.get("answer_coverage") or []):
            print(f"  block {b}: answer in the content pool {_fraction(c['in_pool'])}, kept {_fraction(c['kept'])}; "
                  f"accuracy with it there {_fraction(c['accuracy_in_pool'])}, without "
                  f"{_fraction(c['accuracy_out_of_pool'])} ({c['answers']} answers)")
        out[kind] = result
    return {"vocab_size": spec.vocab_size, "train_len": spec.train_len, "test_lens": list(spec.test_lens),
            "models": out}


def run_tasks(config: TasksConfig) -> dict:
    """Every configured task for every configured model; writes the report; returns it as a dict.

    Returns:
        dict with ``config`` and ``tasks``: per task, ``models`` -> per model
        ``params``, ``d_model``, ``train_loss``, ``train_s``, ``train_tokens_per_s``,
        ``accuracy`` and ``scored`` (per test length), plus ``files``.
    """
    print(config)
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    tune_cpu()  # every model alike (sheafgnn.memory)
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tasks = {name: run_task(spec, config) for name, spec in task_specs(config).items()}
    report = {"config": config.to_dict(), "tasks": tasks, "elapsed_s": time.perf_counter() - start,
              "threads": torch.get_num_threads()}
    report["summary"] = summary_rows(report)
    report["files"] = write_report(report, out, "tasks", markdown(report), figures(report))
    if config.summary:
        merge_summary(Path(config.summary), report["summary"])
    print("\n" + markdown(report))
    return report


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def parse_tasks_args(argv: list[str] | None = None) -> TasksConfig:
    """``sheafgnn tasks`` flags -> a :class:`TasksConfig` (``--quick`` starts from the toy preset)."""
    parser = report_parser("sheafgnn tasks", "MQAR, selective copying and induction heads for sheaf, dense, local "
                           "and ssm", TasksConfig, "runs/tasks")
    parser.add_argument("--zoology", action="store_true", help="MQAR at the Zoology sizes: sequence 512, 64 pairs, "
                        "vocabulary 8192 (explicit --mqar-* flags win)")
    parser.add_argument("--equal-width", action="store_true", help="every model at --d-model instead of matching "
                        "the baselines' parameters to the sheaf model")
    TasksConfig.add_arguments(parser, skip=("out_dir", "equal_width", "progress"))
    namespace = parser.parse_args(argv)
    return config_from_args(TasksConfig, namespace, ZOOLOGY if namespace.zoology else None,
                            **({"equal_width": True} if namespace.equal_width else {}))


def main_tasks(argv: list[str] | None = None) -> int:
    """``sheafgnn tasks [flags]``; returns the exit status."""
    return run_report_command(parse_tasks_args, run_tasks, argv)


if __name__ == "__main__":
    sys.exit(main_tasks())
