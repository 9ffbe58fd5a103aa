"""sheafgnn tasks: task rows as sites, retrieval on id keys, scoring, the report, a toy run end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from sheafgnn.experiments import task_runner
from sheafgnn.experiments.compare import BASELINE_SITE
from sheafgnn.experiments.task_report import shortfalls
from sheafgnn.experiments.task_runner import (
    TASK_SITE,
    TasksConfig,
    TaskSpec,
    TaskTokenizer,
    answer_coverage,
    bind_positions,
    earlier_occurrences,
    evaluate,
    main_tasks,
    parse_tasks_args,
    run_tasks,
    task_options,
    task_specs,
    to_sites,
    train_task,
)
from sheafgnn.experiments.tasks import IGNORE_INDEX, induction_heads, mqar
from sheafgnn.lm import build_model
from sheafgnn.site import SiteConfig, build_site, validate_site
from sheafgnn.site.schema import CONTENT_EDGE

RECALLS = ("token", "recalls", "retrieval")


def test_task_tokenizer_sites_for_any_vocabulary():
    site = SiteConfig.from_dict(TasksConfig(hash_retrieval=True).sheaf_site)
    x, y = mqar(2, 64, 4, 1000, torch.Generator().manual_seed(0))  # ids up to 999: not bytes
    batch = to_sites(x, y, site, TaskTokenizer(1000))
    assert batch.num_graphs == 2 and torch.equal(batch["token"].x, x.flatten())
    assert torch.equal(batch["token"].y, y.flatten())
    for node_type in ("sentence", "syntax", "instruction", "topic", "memory"):
        assert batch[node_type].num_nodes == 0, node_type
    registers = 2 * (64 // site.local_window) * site.workspace_registers
    assert batch["workspace"].num_nodes == registers and batch["retrieval"].num_nodes > 0
    validate_site(batch)
    no_hash = to_sites(x, y, SiteConfig.from_dict(TASK_SITE), TaskTokenizer(1000))  # the default: rule off
    assert no_hash["retrieval"].num_nodes == 0 and no_hash["workspace"].num_nodes == registers
    with pytest.raises(ValueError, match=r"lie in \[0, 1000\)"):
        build_site(torch.tensor([1000]), site, tokenizer=TaskTokenizer(1000))


def test_retrieval_links_the_answer_to_the_query():
    """The hand-checked MQAR row of the generator's docstring, and an induction row."""
    site = SiteConfig.from_dict(TasksConfig(hash_retrieval=True).sheaf_site)
    x = torch.tensor([2, 8, 4, 7, 0, 0, 4, 0, 0, 0, 0, 0, 2, 0, 0, 0])  # key 4 queried at 6, key 2 at 12
    data = build_site(x, site, tokenizer=TaskTokenizer(12))
    src, dst = data[RECALLS].edge_index
    retrieval_end = data["retrieval"].span[:, 1] - 1  # the position each retrieval node sits at
    links = {(int(s), int(retrieval_end[d])) for s, d in zip(src, dst)}
    assert (3, 6) in links  # value 7 (after key 4 at 2) -> the query of key 4 at 6
    assert (1, 12) in links  # value 8 (after key 2 at 0) -> the query of key 2 at 12

    x, y = induction_heads(1, 40, 16, torch.Generator().manual_seed(3))
    first = int((x[0, :-1] == 15).nonzero())
    data = build_site(x[0], site, tokenizer=TaskTokenizer(16))
    src, dst = data[RECALLS].edge_index
    last = (data["retrieval"].span[:, 1] - 1 == 39).nonzero().squeeze()
    assert first + 1 in src[dst == last].tolist() and int(x[0, first + 1]) == int(y[0, -1])


class Oracle(nn.Module):
    """Logits that put all mass on the target (or on 0 where unscored)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, batch):
        y = batch["token"].y.clamp(min=0)
        return nn.functional.one_hot(y, self.vocab_size).float()


def test_evaluate_scores_only_scored_positions():
    config = TasksConfig.quick()
    spec = TaskSpec("mqar", 64, 64, (64,), lambda b, n, g: mqar(b, n, 4, 64, g))
    site = SiteConfig.from_dict({"patch_types": []})
    result = evaluate(Oracle(64), spec, 64, 6, config, site)
    x, y = spec.sample(6, 64, torch.Generator().manual_seed(config.seed + 1_000_003 * 64 + 7))  # evaluate's rows
    ambiguous = int((earlier_occurrences(x)[y != IGNORE_INDEX] >= 2).sum())
    assert result == {"accuracy": 1.0, "scored": 6 * 4, "rows": 6, "accuracy_ambiguous": 1.0 if ambiguous else None,
                      "scored_ambiguous": ambiguous, "accuracy_unambiguous": 1.0, "kept_per_output": None,
                      "answer_coverage": None}
    wrong = Oracle(64)
    wrong.forward = lambda batch: nn.functional.one_hot(torch.zeros_like(batch["token"].y), 64).float()
    assert evaluate(wrong, spec, 64, 6, config, site)["accuracy"] == 0.0  # values are never id 0


def test_task_options_and_equal_width():
    options, counts = task_options(TasksConfig(models=("sheaf", "dense_conv", "dense", "local", "local_conv", "ssm")),
                                   512)
    for kind in ("dense_conv", "dense", "local", "local_conv", "ssm"):
        assert abs(counts[kind] / counts["target"] - 1) <= 0.1
    assert counts["dense_conv"] > counts["dense"] and options["dense_conv"]["d_model"] <= options["dense"]["d_model"]
    options, counts = task_options(TasksConfig(equal_width=True, models=("sheaf", "dense_conv", "local")), 512)
    assert {o["d_model"] for o in options.values()} == {64} and options["local"]["window"] == 64


def test_parse_args_and_shortfalls():
    config = parse_tasks_args(["--zoology", "--mqar-pairs", "32", "--models", "sheaf", "dense", "--induction-test-lens",
                               "1024", "256", "--equal-width", "--out", "x"])
    assert (config.mqar_seq_len, config.mqar_pairs, config.mqar_vocab) == (512, 32, 8192)
    assert config.models == ("sheaf", "dense") and config.induction_test_lens == (256, 1024) and config.equal_width
    assert parse_tasks_args(["--quick"]).steps == 2
    with pytest.raises(ValueError, match="tasks must be"):
        main_tasks(["--tasks", "sorting"])  # sheafgnn.cli.main reports it in one line (test_cli)
    models = {"dense": {"accuracy": {"256": 1.0}}, "sheaf": {"accuracy": {"256": 0.995}},
              "ssm": {"accuracy": {"256": 0.4}}}
    report = {"tasks": {"mqar": {"test_lens": [256], "models": models}}}
    assert shortfalls(report) == ["- MQAR: ssm 0.400 vs dense 1.000"]


def test_run_tasks_quick(tmp_path):
    config = TasksConfig.quick(out_dir=str(tmp_path), steps=1, num_threads=1)
    report = run_tasks(config)
    assert set(report["tasks"]) == {"mqar", "scattered_recall", "selective_copying", "induction_heads"}
    for task, r in report["tasks"].items():
        assert set(r["models"]) == {"sheaf", "dense_conv", "dense", "ssm"}
        for kind, m in r["models"].items():
            assert set(m["accuracy"]) == {str(n) for n in r["test_lens"]}, (task, kind)
            assert all(0.0 <= a <= 1.0 for a in m["accuracy"].values()) and m["train_loss"] > 0
            for length, split in m["ambiguity"].items():  # the split adds up to the whole
                whole, ambiguous = m["accuracy"][length] * m["scored"][length], split["scored_ambiguous"]
                parts = (split["accuracy_ambiguous"] or 0.0) * ambiguous
                parts += (split["accuracy_unambiguous"] or 0.0) * (m["scored"][length] - ambiguous)
                assert parts == pytest.approx(whole)
    assert report["tasks"]["induction_heads"]["models"]["sheaf"]["scored"] == {"32": 4, "128": 2}
    for name in ("tasks.json", "tasks.md", "induction.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "tasks.json").read_text())["config"]["steps"] == 1
    assert "| sheaf |" in (tmp_path / "tasks.md").read_text()
    assert IGNORE_INDEX == -100


def test_curve_and_summary_rows(tmp_path):
    """eval_every records the accuracy curve; summary rows name task, length, model and the hash rule,
    and --summary merges them into one file (a rerun replaces its rows, other rows stay)."""
    summary = tmp_path / "summary.json"
    config = TasksConfig.quick(out_dir=str(tmp_path / "a"), steps=4, eval_every=2, num_threads=1,
                               tasks=("mqar", "induction_heads"), models=("sheaf", "dense"), summary=str(summary))
    report = run_tasks(config)
    curve = report["tasks"]["mqar"]["models"]["sheaf"]["curve"]
    assert [p["step"] for p in curve] == [2, 4] and all(0 <= p["accuracy"] <= 1 for p in curve)
    rows = json.loads(summary.read_text())
    assert rows == json.loads((tmp_path / "a" / "tasks.json").read_text())["summary"]
    assert len(rows) == 2 * 1 + 2 * 2  # mqar at its length, induction at two lengths, for two models
    mqar_sheaf = next(r for r in rows if r["task"] == "mqar" and r["model"] == "sheaf")
    assert mqar_sheaf == {"task": "mqar", "seq_len": 64, "train_len": 64, "pairs": 4, "vocab": 64, "model": "sheaf",
                          "hash_retrieval": False, "topology_rank": 16, "topology_k": 8, "content_blocks": 16,
                          "proposal_block": 4, "pool_loss_weight": 0.0, "block_scorer": False,
                          "block_summary": "bounds", "sink_threshold": False, "keep_cost": 0.0, "map_kind": "diag",
                          "warmup": None, "lr": config.lr, "seed": 0, "accuracy": curve[-1]["accuracy"],
                          "steps": 4, "tokens": 4 * 2 * 64, "seconds": mqar_sheaf["seconds"]}
    kept = report["tasks"]["mqar"]["models"]["sheaf"]["kept_per_output"]  # per block, at most topology_k
    assert len(kept) == config.n_layers and all(0 < k <= 8 for k in kept) and "kept_per_output" not in \
        report["tasks"]["mqar"]["models"]["dense"]
    coverage = report["tasks"]["mqar"]["models"]["sheaf"]["answer_coverage"]  # per block
    assert len(coverage) == config.n_layers and all(c["answers"] > 0 and 0 <= c["kept"] <= c["in_pool"] <= 1
                                                    for c in coverage)
    assert (tmp_path / "a" / "curves.png").stat().st_size > 0
    run_tasks(TasksConfig.quick(out_dir=str(tmp_path / "b"), steps=1, num_threads=1, tasks=("mqar",),
                                models=("sheaf",), hash_retrieval=True, summary=str(summary)))
    rows = json.loads(summary.read_text())
    assert len(rows) == 7 and {r["hash_retrieval"] for r in rows if r["model"] == "sheaf"} == {True, False}


def test_stop_accuracy_ends_training_at_the_first_test_that_reaches_it(monkeypatch):
    """Training stops at the first test that reaches stop_accuracy, and counts the steps it trained."""
    config = TasksConfig.quick(steps=8, eval_every=2, stop_accuracy=0.99, tasks=("mqar",))
    spec = task_specs(config)["mqar"]
    model = build_model("dense", {"d_model": 16, "n_layers": 1, "n_heads": 2}, spec.vocab_size)
    tests = iter([0.5, 0.995, 1.0])
    monkeypatch.setattr(task_runner, "evaluate", lambda *args: {"accuracy": next(tests)})
    result = train_task(model, spec, config, SiteConfig.from_dict(BASELINE_SITE))
    assert result["steps"] == 4 and [p["step"] for p in result["curve"]] == [2, 4]
    with pytest.raises(ValueError, match="needs eval_every"):
        TasksConfig.quick(stop_accuracy=0.99)


def test_mqar_test_lengths_keep_the_pair_density():
    config = TasksConfig.quick(tasks=("mqar",), mqar_test_lens=(256, 128))
    spec = task_specs(config)["mqar"]
    assert spec.test_lens == (64, 128, 256)
    x, y = spec.sample(3, 256, torch.Generator().manual_seed(0))
    assert x.shape == (3, 256) and ((y != IGNORE_INDEX).sum(1) == 16).all()  # 4 pairs per 64 tokens
    with pytest.raises(ValueError, match="pair density"):
        TasksConfig.quick(mqar_test_lens=(100,))


def test_mqar_warmup_trains_the_shorter_task_first(tmp_path):
    """mqar_warmup: every model trains (sequence, pairs, steps) of a shorter MQAR first; the summary
    counts its steps, tokens and time in, names it, and scores the final model on the warm-up task too."""
    config = TasksConfig.quick(out_dir=str(tmp_path), steps=2, num_threads=1, tasks=("mqar",), models=("sheaf", "ssm"),
                               mqar_warmup=(32, 2, 3))
    report = run_tasks(config)
    for kind, m in report["tasks"]["mqar"]["models"].items():
        assert 0.0 <= m["warmup"]["accuracy"] <= 1.0 and m["warmup"]["train_s"] > 0, kind
        assert 0.0 <= m["warmup"]["final_accuracy"] <= 1.0, kind
    assert sorted((r["model"], r["seq_len"], r["pairs"]) for r in report["summary"]) == [
        ("sheaf", 32, 2), ("sheaf", 64, 4), ("ssm", 32, 2), ("ssm", 64, 4)]
    for row in report["summary"]:
        m = report["tasks"]["mqar"]["models"][row["model"]]
        expected = m["warmup"]["final_accuracy"] if row["seq_len"] == 32 else m["accuracy"]["64"]
        assert row["accuracy"] == expected and row["train_len"] == 64
        assert row["warmup"] == [32, 2, 3] and row["steps"] == 2 + 3
        assert row["tokens"] == (2 * 64 + 3 * 32) * 2
        assert row["seconds"] == pytest.approx(m["train_s"] + m["warmup"]["train_s"])
    for bad in ((32, 2), (32, 0, 3)):
        with pytest.raises(ValueError, match="mqar_warmup"):
            TasksConfig.quick(mqar_warmup=bad)


def test_earlier_occurrences_counts_equal_ids_before_each_position():
    x = torch.randint(0, 5, (3, 40), generator=torch.Generator().manual_seed(0))
    expected = torch.tensor([[int((row[:t] == row[t]).sum()) for t in range(row.numel())] for row in x])
    assert torch.equal(earlier_occurrences(x), expected)
    # MQAR: a query key that also appears as noise after the pairs is seen twice before its query
    x, y = mqar(64, 128, 8, 256, generator=torch.Generator().manual_seed(1))
    counts = earlier_occurrences(x)[y != IGNORE_INDEX]
    assert counts.min() >= 1 and 0 < (counts >= 2).float().mean() < 0.5


def test_bind_positions_find_the_latest_answer_after_the_query_key():
    """Zoology's docstring row: key 4 binds 7 at position 3, key 2 binds 8 at 1; a later decoy bind of 2 wins
    for a query after it, and an unscored position or an answer never bound gets -1."""
    x = torch.tensor([[2, 8, 4, 7, 0, 0, 4, 0, 0, 0, 0, 0, 2, 2, 8, 2]])
    y = torch.full_like(x, IGNORE_INDEX)
    y[0, 6], y[0, 12], y[0, 15], y[0, 9] = 7, 8, 8, 5
    expected = torch.full_like(x, -1)
    expected[0, 6], expected[0, 12], expected[0, 15] = 3, 1, 14
    assert torch.equal(bind_positions(x, y), expected)


def test_answer_coverage_splits_the_answers_by_the_content_pool():
    """Two rows of 4, one answer each (bind at 1, query at 3): row 0's answer is in its pool and kept with weight
    0.6, row 1's is neither; the accuracy splits by the pool."""
    x = torch.tensor([[5, 6, 0, 5], [7, 8, 0, 7]])
    y = torch.full_like(x, IGNORE_INDEX)
    y[:, 3] = torch.tensor([6, 8])
    hit = torch.zeros(8, dtype=torch.bool)
    hit[3] = True  # row 0's answer right, row 1's wrong
    content = {"candidate_index": torch.tensor([[1, 0, 4], [3, 3, 7]]), "edge_index": torch.tensor([[0, 1], [3, 3]]),
               "weight": torch.tensor([0.4, 0.6])}
    (block,) = answer_coverage([{CONTENT_EDGE: content}], x, y, hit)
    assert block == {"answers": 2, "in_pool": 0.5, "kept": 0.5, "weight": pytest.approx(0.3),
                     "accuracy_in_pool": 1.0, "accuracy_out_of_pool": 0.0}
