"""The built-in corpus (hub/corpus.py, hub/data/): three kinds, each a deterministic, disjoint
calib/eval split, read from files that match their README and rebuild to the same bytes."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import re
import sys
from pathlib import Path

import pytest

from optllm.hub import corpus
from optllm.hub.corpus import KINDS, SPLITS, builtin_eval_text, builtin_texts, eval_text, texts

DATA = Path(corpus.__file__).parent / "data"
BUILDER = Path(corpus.__file__).parent.parent / "tools" / "build_corpora.py"
CHAT_HEAD = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# Lower bounds on each split's size, in characters (SmolLM2 tokens are about 1/4 to 1/5 of these).
MIN_CHARS = {("docs", "calib"): 200_000, ("docs", "eval"): 50_000, ("code", "calib"): 500_000,
             ("code", "eval"): 100_000, ("chat", "calib"): 120_000, ("chat", "eval"): 30_000}


def _paragraphs(docs: list[str]) -> set[str]:
    return {p for d in docs for p in d.split("\n\n")[1:]}  # [0] is the section title


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_has_both_splits_in_a_fixed_order(kind):
    calib, ev = texts(kind, "calib"), texts(kind, "eval")
    assert calib == texts(kind, "calib") and ev == texts(kind, "eval")
    for split, docs in (("calib", calib), ("eval", ev)):
        assert sum(map(len, docs)) >= MIN_CHARS[kind, split]
        assert all(isinstance(d, str) and d.strip() for d in docs)
    assert not set(calib) & set(ev)
    share = sum(map(len, ev)) / (sum(map(len, ev)) + sum(map(len, calib)))
    assert 0.1 < share < 0.3
    assert eval_text(kind) == "\n\n".join(ev)
    calib.clear()  # a caller's list: the cached documents are not touched
    assert texts(kind, "calib")


def test_unknown_kind_or_split_names_the_allowed_values():
    with pytest.raises(ValueError, match="docs, code, chat"):
        texts("poetry", "calib")
    with pytest.raises(ValueError, match="calib, eval"):
        texts("docs", "train")
    with pytest.raises(ValueError, match="calib, eval"):
        builtin_texts("train")


def test_builtin_texts_are_the_docs_kind():
    for split in SPLITS:
        assert builtin_texts(split) == texts("docs", split)
    assert builtin_eval_text() == eval_text("docs")


def test_docs_are_prose_and_share_no_paragraph():
    assert not _paragraphs(texts("docs", "calib")) & _paragraphs(texts("docs", "eval"))
    for split in SPLITS:
        text = "".join(texts("docs", split))
        visible = [c for c in text if not c.isspace()]
        assert sum(c.isalpha() for c in visible) / len(visible) > 0.8
        assert ">>>" not in text and "::=" not in text and "+---" not in text and "****" not in text


def test_code_is_python_split_by_module_without_credit_headers():
    import gzip
    import json

    with gzip.open(DATA / "code.jsonl.gz", "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    sides: dict[str, set[str]] = {}
    for r in records:
        sides.setdefault(r["id"].split(":")[0], set()).add(r["split"])
        ast.parse(r["text"])  # every document is whole top-level statements
        comments = [line for line in r["text"].splitlines() if line.lstrip().startswith("#")]
        assert not any(re.search(r"copyright|licen[cs]e", c, re.IGNORECASE) for c in comments), r["id"]
    assert all(len(s) == 1 for s in sides.values())  # a module is on one side only
    assert len(sides) >= 25 and sum(s == {"eval"} for s in sides.values()) >= 4


def test_chat_documents_are_whole_templated_conversations():
    for split in SPLITS:
        for doc in texts("chat", split):
            assert doc.startswith(CHAT_HEAD + "<|im_start|>user\n") and doc.endswith("<|im_end|>\n")
            assert doc.count("<|im_start|>assistant\n") == 1 and doc.count("<|im_end|>") == 3

    def prompts(split):
        return {d.split("<|im_start|>user\n")[1].split("<|im_end|>")[0] for d in texts("chat", split)}

    assert len(prompts("calib")) == len(texts("chat", "calib")) and not prompts("calib") & prompts("eval")


def test_data_files_match_the_readme_hashes():
    readme = (DATA / "README.md").read_text(encoding="utf-8")
    for kind in KINDS:
        digest = hashlib.sha256((DATA / f"{kind}.jsonl.gz").read_bytes()).hexdigest()
        assert re.search(rf"{digest}\s+{kind}\.jsonl\.gz", readme), kind


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="docs and code are CPython 3.11's text")
@pytest.mark.parametrize("kind", ("docs", "code"))
def test_builder_rebuilds_identical_bytes(kind, tmp_path):
    spec = importlib.util.spec_from_file_location("build_corpora", BUILDER)
    builder = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(builder)
    records = builder.docs_records() if kind == "docs" else builder.code_records()
    path = builder.write_records(tmp_path / f"{kind}.jsonl.gz", records)
    assert path.read_bytes() == (DATA / f"{kind}.jsonl.gz").read_bytes()
