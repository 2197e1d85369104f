"""The built-in corpus (hub/corpus.py): a deterministic, disjoint, prose-only calib/eval split."""

from __future__ import annotations

import pytest

from optllm.hub import corpus
from optllm.hub.corpus import builtin_eval_text, builtin_texts


def _paragraphs(docs: list[str]) -> set[str]:
    return {p for d in docs for p in d.split("\n\n")[1:]}  # [0] is the section title


def test_corpus_split_is_deterministic_disjoint_and_about_80_20():
    calib, ev = builtin_texts("calib"), builtin_texts("eval")
    assert calib == builtin_texts("calib") and ev == builtin_texts("eval")
    assert calib and ev
    assert not _paragraphs(calib) & _paragraphs(ev)
    share = sum(map(len, ev)) / (sum(map(len, ev)) + sum(map(len, calib)))
    assert 0.1 < share < 0.3
    assert builtin_eval_text() == "\n\n".join(ev)
    with pytest.raises(ValueError, match="split"):
        builtin_texts("train")


def test_corpus_is_mostly_prose():
    for split in corpus.SPLITS:
        text = "".join(builtin_texts(split))
        visible = [c for c in text if not c.isspace()]
        assert sum(c.isalpha() for c in visible) / len(visible) > 0.8
        assert ">>>" not in text and "::=" not in text and "+---" not in text and "****" not in text


def test_corpus_split_ignores_dict_order(monkeypatch):
    import pydoc_data.topics

    expect = {s: builtin_texts(s) for s in corpus.SPLITS}
    reordered = dict(reversed(list(pydoc_data.topics.topics.items())))
    monkeypatch.setattr(pydoc_data.topics, "topics", reordered)
    assert {s: builtin_texts(s) for s in corpus.SPLITS} == expect
