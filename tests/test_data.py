"""The embedded corpus: splits by document name, no machine-generated modules."""

import pytest

from sheafgnn import data as D


def test_splits_partition_the_documents():
    every = D.corpus_documents("mixed", split=None)
    by_split = {split: D.corpus_documents("mixed", split) for split in D.SPLITS}
    assert all(by_split.values())
    assert sorted(name for docs in by_split.values() for name in docs) == sorted(every)
    for split, docs in by_split.items():
        assert D.load_corpus("mixed", split) == list(docs.values())


def test_split_follows_the_name_only():
    # a document's split does not depend on which others are read: the code-only and mixed corpora agree
    code = D.corpus_documents("code", "validation")
    mixed = D.corpus_documents("mixed", "validation")
    assert code and all(mixed[name] == text for name, text in code.items())


def test_generated_modules_are_left_out():
    names = list(D.corpus_documents("code", split=None, max_code_bytes=10_000_000))
    assert names and not any(name.startswith("code/" + prefix) for name in names for prefix in D.GENERATED_MODULES)


def test_bad_split_or_kind_is_refused():
    with pytest.raises(ValueError, match="split"):
        D.corpus_documents("mixed", "dev")
    with pytest.raises(ValueError, match="kind"):
        D.load_corpus("prose", "train")
