"""The embedded corpus: splits by document name, no machine-generated modules."""

from sheafgnn import data as D


def test_splits_are_disjoint_and_follow_the_name():
    docs = {**D._docs(), **D._code(2_000_000)}
    for split in D.SPLITS:
        expected = [docs[name] for name in sorted(docs) if D._split_of(name) == split]
        assert D.load_corpus("mixed", split) == expected and expected
    assert sum(len(D.load_corpus("mixed", split)) for split in D.SPLITS) == len(docs)


def test_generated_modules_are_left_out():
    names = list(D._code(10_000_000))
    assert names and not any(name.startswith("code/" + prefix) for name in names for prefix in D.GENERATED_MODULES)
