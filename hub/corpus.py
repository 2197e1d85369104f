"""The built-in text corpus: English prose of the Python documentation shipped with Python.

Every CPython carries the rendered text of its language reference in
``pydoc_data.topics.topics`` (topic name -> plain text, the source of ``help("if")``), so
this corpus exists offline, with no download, on every machine that runs optllm.

Cleaning (light, prose is kept): headings lose their underline, tables, grammar
productions (``::=``), interactive sessions (``>>>``), signatures and other code lines
are dropped; reST emphasis ``*x*``/``**x**`` and footnote marks ``[1]`` are removed;
each remaining paragraph is dedented and its lines joined into one line.

Split: the topics are cut into sections at their headings. A section goes to "eval"
when the first 8 bytes of the SHA-256 of its *title* (salted with ``_SPLIT_SALT``), read
as a big-endian integer, are 0 mod 5, and to "calib" otherwise (about 80/20). Keying on
titles, not on dict order or topic names, makes the split independent of dict order,
and a section keeps its side when Python adds, renames or edits topics around it. Many
topics repeat sections of larger ones (``if`` is a section of ``compound``); each
paragraph is kept once only, at its first occurrence in (topic name, position) order,
so the two parts share no paragraph. The salt was picked once, as the one of 40
candidates whose eval share is closest to 20 % of the characters on CPython 3.10-3.13.

Sizes (documents = sections; tokens: SmolLM2 tokenizer, no special tokens):

=========  ===============================  ==============================
CPython    calib                            eval
=========  ===============================  ==============================
3.10.13    110 docs, 216,736 chars          21 docs, 56,279 chars
3.11.7     144 docs, 219,054 chars, 49,239  24 docs, 58,345 chars, 13,598
           tokens                           tokens (13,644 as one text)
3.12.1     154 docs, 230,416 chars          25 docs, 56,727 chars
3.13.0     157 docs, 232,936 chars          26 docs, 59,748 chars
=========  ===============================  ==============================

Across versions 85-94 % of the 3.11 eval text is found verbatim in the eval part of
3.10/3.12/3.13 and at most 3.3 % in their calib part, so perplexities are comparable
between machines with the same Python minor version and close otherwise.
"""

from __future__ import annotations

import hashlib
import re
import textwrap
from dataclasses import dataclass

SPLITS = ("calib", "eval")
_SPLIT_SALT = "optllm-corpus-v1.20"
_EVAL_BUCKETS = 5  # hash mod 5 == 0 -> eval: one part in five

_UNDERLINE = re.compile(r"^([*=\-^~\"'#+])\1{2,}$")
_RUBRIC = re.compile(r"^-\[ .* \]-$")
_FOOTNOTE_REF = re.compile(r"\s?\[\d+\](?=[\s.,;:)]|$)")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^\s*](?:[^*\n]*?[^\s*])?)\*{1,2}(?![\w*])")
_WORD = re.compile(r"[A-Za-z]{2,}")
_PROSE_END = (".", ":", "?", "!", ";", ",", ")")
_SIGNATURE = re.compile(r"^[\w.]+\(")


@dataclass(frozen=True)
class _Section:
    title: str
    paragraphs: tuple[str, ...]

    def text(self) -> str:
        return "\n\n".join((self.title, *self.paragraphs))


def builtin_texts(split: str) -> list[str]:
    """Documents (one per documentation section) of one part of the built-in corpus.

    split: "calib" (about 80 % of the text, for calibration) or "eval" (held out, for
    perplexity). The order is fixed: topics by name, sections in document order.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}; got {split!r}")
    return [s.text() for s in _sections() if _split_of(s.title) == split]


def builtin_eval_text() -> str:
    """The held-out part as one string: its documents joined with blank lines."""
    return "\n\n".join(builtin_texts("eval"))


def _split_of(title: str) -> str:
    digest = hashlib.sha256(f"{_SPLIT_SALT}/{title}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % _EVAL_BUCKETS == 0 else "calib"


def _sections() -> list[_Section]:
    from pydoc_data.topics import topics

    seen: set[str] = set()  # paragraphs already placed: each goes to one part only
    out = []
    for name in sorted(topics):
        for title, blocks in _split_headings(topics[name]):
            paras = []
            for block in blocks:
                p = _clean_block(block)
                if p is not None and p not in seen:
                    seen.add(p)
                    paras.append(p)
            if paras:
                out.append(_Section(title, tuple(paras)))
    return out


def _split_headings(text: str) -> list[tuple[str, list[str]]]:
    """Cut a topic into (heading title, raw paragraph blocks) at its underlined headings."""
    lines = text.splitlines()
    sections: list[tuple[str, list[str]]] = []
    title, block, blocks = "", [], []
    i = 0
    while i < len(lines):
        line = lines[i]
        nxt = lines[i + 1] if i + 1 < len(lines) else ""
        if line.strip() and not line.startswith(" ") and _UNDERLINE.match(nxt) and len(nxt) >= len(line.rstrip()):
            if block:
                blocks.append("\n".join(block))
            if blocks:
                sections.append((title, blocks))
            title, block, blocks = _inline(line.strip()), [], []
            i += 2
            continue
        if line.strip():
            block.append(line)
        elif block:
            blocks.append("\n".join(block))
            block = []
        i += 1
    if block:
        blocks.append("\n".join(block))
    if blocks:
        sections.append((title, blocks))
    return sections


def _clean_block(block: str) -> str | None:
    """One paragraph block -> one line of prose, or None when it is markup or code."""
    lines = textwrap.dedent(block).splitlines()
    if any(_RUBRIC.match(line.strip()) or _UNDERLINE.match(line.strip()) for line in lines):
        return None  # footnote rubrics, simple-table rules
    if any(line.lstrip().startswith(("+-", "+=", "|")) for line in lines):
        return None  # grid tables
    if any(">>>" in line or "::=" in line for line in lines):
        return None  # interactive sessions, grammar
    text = _inline(" ".join(line.strip() for line in lines))
    if not _is_prose(text):
        return None
    return text


def _inline(text: str) -> str:
    text = _EMPHASIS.sub(r"\1", text)
    text = _FOOTNOTE_REF.sub("", text)
    return re.sub(r"\s+", " ", text).strip()


def _is_prose(text: str) -> bool:
    """Sentences end with punctuation and are mostly letters; code and signatures are not."""
    if _SIGNATURE.match(text) or not text.endswith(_PROSE_END) or len(_WORD.findall(text)) < 4:
        return False
    visible = [c for c in text if not c.isspace()]
    letters = sum(c.isalpha() for c in visible)
    return letters >= 0.7 * len(visible)
