"""The built-in text corpus: three kinds of text, shipped with optllm as data files.

Every machine reads the same files (hub/data/{kind}.jsonl.gz), so it gets the same
documents and, with one tokenizer, the same tokens. Each kind has a calibration split
("calib", for ``--calib builtin``) and a held-out split ("eval", for ``optllm eval --ppl``).

- ``docs``: English prose of the Python documentation (the language reference topics of
  CPython 3.11.7, ``pydoc_data.topics``), cleaned to paragraphs of prose; one document per
  section. Split by a salted SHA-256 of the section *title*; no paragraph is in both.
- ``code``: Python source of 33 pure-Python CPython 3.11.7 standard library modules
  (argparse, difflib, json, statistics, textwrap, ...), license/author comments dropped;
  one document per top-level def/class, plus the module header. Split by a salted SHA-256
  of the *module name*, so a whole module is on one side.
- ``chat``: conversations of the built-in model, SmolLM2-135M-Instruct, answering prompts
  greedily (at most 300 new tokens, cut where the answer starts looping), rendered with
  its chat template (default system message, user prompt, answer). calib: 204
  informational and how-to questions; eval: 62 prompts of another family (stories,
  letters, advice, role-play, poems, trips).

Each kind's eval split holds about a fifth of its characters (docs 21 %, code 20 %, chat
20 %). Sizes (tokens: SmolLM2 tokenizer, no special tokens added, summed over documents):

=====  =======================================  =======================================
kind   calib                                    eval
=====  =======================================  =======================================
docs   144 docs, 219,054 chars, 49,239 tokens   24 docs, 58,345 chars, 13,598 tokens
code   271 docs, 615,247 chars, 154,152 tokens  121 docs, 150,556 chars, 38,839 tokens
chat   204 docs, 227,157 chars, 47,442 tokens   62 docs, 55,569 chars, 12,604 tokens
=====  =======================================  =======================================

Provenance, licenses, file hashes and how to rebuild: hub/data/README.md and
tools/build_corpora.py (which holds the cleaning, chunking and prompts; this module only
reads the files).
"""

from __future__ import annotations

import functools
import gzip
import json
from importlib import resources

KINDS = ("docs", "code", "chat")
SPLITS = ("calib", "eval")


def texts(kind: str, split: str) -> list[str]:
    """The documents of one split of one kind, in the file's fixed order.

    kind: one of KINDS; split: "calib" (calibration) or "eval" (held out). ValueError on
    anything else.
    """
    _check(kind, split)
    return list(_documents(kind)[split])


def eval_text(kind: str) -> str:
    """The held-out split of ``kind`` as one string: its documents joined by blank lines."""
    return "\n\n".join(texts(kind, "eval"))


def builtin_texts(split: str) -> list[str]:
    """The docs kind's documents (``texts("docs", split)``): the built-in corpus before kinds."""
    return texts("docs", split)


def builtin_eval_text() -> str:
    """The docs kind's held-out text (``eval_text("docs")``)."""
    return eval_text("docs")


def _check(kind: str, split: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown text kind {kind!r}; allowed: {', '.join(KINDS)}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")


@functools.lru_cache(maxsize=None)
def _documents(kind: str) -> dict[str, tuple[str, ...]]:
    """{split: documents} read once from data/{kind}.jsonl.gz (tuples: the cache is read-only)."""
    ref = resources.files(__package__) / "data" / f"{kind}.jsonl.gz"
    try:
        with ref.open("rb") as f, gzip.open(f, "rt", encoding="utf-8") as lines:
            records = [json.loads(line) for line in lines if line.strip()]
    except FileNotFoundError:
        raise FileNotFoundError(
            f"the built-in corpus file hub/data/{kind}.jsonl.gz is missing from the optllm installation"
        ) from None
    out: dict[str, list[str]] = {s: [] for s in SPLITS}
    for r in records:
        out[r["split"]].append(r["text"])
    return {s: tuple(docs) for s, docs in out.items()}
