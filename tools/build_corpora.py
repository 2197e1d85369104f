"""Rebuild the built-in text corpora, hub/data/{docs,code,chat}.jsonl.gz, and print their sizes.

    .venv/bin/python tools/build_corpora.py [--kinds docs,code,chat] [--out hub/data]

Each file holds one JSON object per line, {"split": "calib" | "eval", "id": ..., "text": ...},
gzip-compressed with mtime 0 and no file name, so the same documents give the same bytes.

- docs: English prose of the Python documentation, ``pydoc_data.topics`` of CPython 3.11
  (cleaned and split as described in ``_docs``). Needs CPython 3.11 to reproduce the file.
- code: Python source of the CPython 3.11 standard library modules in ``CODE_MODULES``, cut
  into documents at top-level ``def``/``class`` statements, license/author header comments
  dropped; a whole module goes to one side. Needs CPython 3.11 as well.
- chat: SmolLM2-135M-Instruct (the built-in model) answering the prompts of
  chat_prompts_calib.txt (calib) and chat_prompts_eval.txt (eval) greedily on the CPU in
  float32 (transformers ``generate``, batches of CHAT_BATCH prompts), each answer cut
  before the third occurrence of any run of LOOP_WORDS words. The same bytes need
  the same torch build and CPU kind: greedy decoding is exact only up to float summation
  order, and a near-tie can go the other way elsewhere.

Sizes are counted with the SmolLM2 tokenizer, no special tokens added (the chat template's
own markers are in the text and count as the special tokens they are).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import io
import json
import re
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

KINDS = ("docs", "code", "chat")
SPLITS = ("calib", "eval")
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "hub" / "data"
PYTHON = (3, 11)  # the docs and code kinds are this CPython's text

# docs ----------------------------------------------------------------------------------
DOCS_SALT = "optllm-corpus-v1.20"  # picked once: eval share closest to 20 % on CPython 3.10-3.13
EVAL_BUCKETS = 5  # hash mod 5 == 0 -> eval: one part in five

_UNDERLINE = re.compile(r"^([*=\-^~\"'#+])\1{2,}$")
_RUBRIC = re.compile(r"^-\[ .* \]-$")
_FOOTNOTE_REF = re.compile(r"\s?\[\d+\](?=[\s.,;:)]|$)")
_EMPHASIS = re.compile(r"(?<![\w*])\*{1,2}([^\s*](?:[^*\n]*?[^\s*])?)\*{1,2}(?![\w*])")
_WORD = re.compile(r"[A-Za-z]{2,}")
_PROSE_END = (".", ":", "?", "!", ";", ",", ")")
_SIGNATURE = re.compile(r"^[\w.]+\(")

# code ----------------------------------------------------------------------------------
# Pure-Python stdlib modules of varied style: text processing, algorithms, numerics, data
# formats, CLI parsing, decorators and metaprogramming, classes and small functions.
CODE_MODULES = (
    "argparse", "bisect", "calendar", "cmd", "colorsys", "configparser", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "fnmatch", "fractions", "functools", "getopt", "gettext", "graphlib",
    "heapq", "html.parser", "json", "json.decoder", "json.encoder", "json.scanner", "json.tool",
    "pprint", "queue", "random", "reprlib", "sched", "shlex", "statistics", "string", "textwrap",
)
# Picked once (--pick-salt): of "optllm-code-v1.{0..39}", the one whose eval share is closest to 20 %
# of the characters (see --pick-salt).
CODE_SALT = "optllm-code-v1.21"
_HEADER_CREDIT = re.compile(r"copyright|licen[cs]e|author|written by|original code by", re.IGNORECASE)

# chat ----------------------------------------------------------------------------------
CHAT_MODEL = "smollm2-135m"
CHAT_MAX_NEW_TOKENS = 300
CHAT_BATCH = 68  # prompts per generate call: 204 calib prompts in three batches
LOOP_WORDS = 8  # an answer ends before the third occurrence of any run of this many words
CHAT_PROMPTS = {"calib": HERE / "chat_prompts_calib.txt", "eval": HERE / "chat_prompts_eval.txt"}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated subset of docs,code,chat")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder for the .jsonl.gz files")
    ap.add_argument("--pick-salt", action="store_true", help="print the code kind's eval share per candidate salt")
    a = ap.parse_args(argv)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad:
        ap.error(f"unknown kind(s) {', '.join(bad)}; allowed: {', '.join(KINDS)}")
    if a.pick_salt:
        _pick_code_salt()
        return
    if kinds != ["chat"] and sys.version_info[:2] != PYTHON:
        ap.error(f"docs and code are CPython {PYTHON[0]}.{PYTHON[1]}'s text; this is {sys.version.split()[0]}")
    tokenizer = _tokenizer()
    a.out.mkdir(parents=True, exist_ok=True)
    for kind in kinds:
        t0 = time.perf_counter()
        records = {"docs": docs_records, "code": code_records, "chat": chat_records}[kind]()
        path = write_records(a.out / f"{kind}.jsonl.gz", records)
        print(f"{kind}: built in {time.perf_counter() - t0:.0f} s")
        print(_size_table(kind, records, tokenizer))
        print(f"sha256 {hashlib.sha256(path.read_bytes()).hexdigest()}  {path.name} ({path.stat().st_size:,} bytes)\n")


def write_records(path: Path, records: list[dict]) -> Path:
    """Deterministic .jsonl.gz: same records, same bytes (mtime 0, no name in the header)."""
    lines = "".join(json.dumps({k: r[k] for k in ("split", "id", "text")}, ensure_ascii=False) + "\n"
                    for r in records)
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, compresslevel=9, mtime=0) as gz:
        gz.write(lines.encode("utf-8"))
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(buf.getvalue())
    tmp.replace(path)
    return path


def _split_of(key: str, salt: str) -> str:
    digest = hashlib.sha256(f"{salt}/{key}".encode()).digest()
    return "eval" if int.from_bytes(digest[:8], "big") % EVAL_BUCKETS == 0 else "calib"


# docs ----------------------------------------------------------------------------------


def docs_records() -> list[dict]:
    """Sections of the Python documentation topics, cleaned to prose.

    Cleaning (light, prose is kept): headings lose their underline, tables, grammar
    productions (``::=``), interactive sessions (``>>>``), signatures and other code lines
    are dropped; reST emphasis and footnote marks ``[1]`` are removed; each remaining
    paragraph is dedented and its lines joined into one line. A document is a section
    (title, blank line, paragraphs separated by blank lines). Split by the salted SHA-256
    of the section *title*; each paragraph is kept once only, at its first occurrence in
    (topic name, position) order, so the two splits share no paragraph.
    """
    from pydoc_data.topics import topics

    seen: set[str] = set()
    out = []
    for name in sorted(topics):
        for k, (title, blocks) in enumerate(_split_headings(topics[name])):
            paras = []
            for block in blocks:
                p = _clean_block(block)
                if p is not None and p not in seen:
                    seen.add(p)
                    paras.append(p)
            if paras:
                out.append({"split": _split_of(title, DOCS_SALT), "id": f"{name}/{k}",
                            "text": "\n\n".join((title, *paras))})
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


# code ----------------------------------------------------------------------------------


def code_records(salt: str = CODE_SALT) -> list[dict]:
    """Every module of CODE_MODULES cut into documents; split by the module's name."""
    out = []
    for module in CODE_MODULES:
        split = _split_of(module, salt)
        for name, text in module_chunks(_module_source(module)):
            out.append({"split": split, "id": f"{module}:{name}", "text": text})
    return out


def _module_source(module: str) -> str:
    base = Path(sysconfig.get_paths()["stdlib"]) / Path(*module.split("."))
    path = base / "__init__.py" if base.is_dir() else base.with_suffix(".py")
    return path.read_text(encoding="utf-8")


def module_chunks(source: str) -> list[tuple[str, str]]:
    """(name, text) per top-level def/class (with its decorators and the comment lines right
    above it; the statements after it up to the next one stay with it), the module header
    (docstring, imports, constants before the first def/class) as "<header>". Comment blocks
    in the header that credit authors or state copyright or license are dropped."""
    lines = source.splitlines(keepends=True)
    starts = []  # (first line index, name)
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
            while first > 0 and lines[first - 1].lstrip().startswith("#") and not lines[first - 1].startswith(" "):
                first -= 1
            starts.append((first, node.name))
    bounds = [0, *(s for s, _ in starts), len(lines)]
    names = ["<header>", *(n for _, n in starts)]
    chunks = []
    for name, a, b in zip(names, bounds, bounds[1:]):
        part = lines[a:b]
        if name == "<header>":
            part = _drop_credit_comments(part)
        text = "".join(part).strip("\n").rstrip()
        if text.strip():
            chunks.append((name, text))
    return chunks


def _drop_credit_comments(lines: list[str]) -> list[str]:
    """Drop each block of consecutive comment lines that names a copyright, license or author."""
    out, block = [], []
    for line in [*lines, ""]:
        if line.lstrip().startswith("#"):
            block.append(line)
            continue
        if block and not any(_HEADER_CREDIT.search(b) for b in block):
            out.extend(block)
        block = []
        out.append(line)
    return out[:-1]


def _pick_code_salt(candidates: int = 40) -> None:
    best = None
    for i in range(candidates):
        salt = f"optllm-code-v1.{i}"
        chars = {s: 0 for s in SPLITS}
        for r in code_records(salt):
            chars[r["split"]] += len(r["text"])
        share = chars["eval"] / sum(chars.values())
        print(f"{salt}: eval {100 * share:.1f} % of {sum(chars.values()):,} chars")
        if best is None or abs(share - 0.2) < abs(best[1] - 0.2):
            best = (salt, share)
    print(f"closest to 20 %: {best[0]} ({100 * best[1]:.1f} %)")


# chat ----------------------------------------------------------------------------------


def chat_prompts(split: str) -> list[str]:
    lines = CHAT_PROMPTS[split].read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def chat_records() -> list[dict]:
    """The built-in model's greedy answers, rendered with its chat template (default system
    message, user prompt, assistant answer), each answer cut where it starts looping
    (``cut_loop``).

    Generation runs in transformers (``generate``, greedy, float32, CPU) on batches of
    CHAT_BATCH prompts in file order, left-padded: the runtime's CPU path attends with a
    per-sequence reference loop, about a minute per decode step of 200 sequences on a
    2-core machine, where transformers' batched attention takes a few seconds.
    """
    import torch

    from optllm.hub.loader import load_model

    model, tok, _ = load_model(CHAT_MODEL, dtype="float32", device="cpu")
    tok.padding_side = "left"
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    out = []
    for split in SPLITS:
        prompts = chat_prompts(split)
        t0, answers = time.perf_counter(), []
        for b in range(0, len(prompts), CHAT_BATCH):
            chunk = [[{"role": "user", "content": p}] for p in prompts[b : b + CHAT_BATCH]]
            rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chunk]
            enc = tok(rendered, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                gen = model.generate(**enc, do_sample=False, max_new_tokens=CHAT_MAX_NEW_TOKENS, pad_token_id=pad)
            for row in gen[:, enc["input_ids"].shape[1] :].tolist():
                answers.append(row[: row.index(eos)] if eos in row else row)
            print(f"chat {split}: {len(answers)}/{len(prompts)} answers, {time.perf_counter() - t0:.0f} s", flush=True)
        cut = sum(len(a) >= CHAT_MAX_NEW_TOKENS for a in answers)
        print(f"chat {split}: {cut} of {len(answers)} answers stopped at {CHAT_MAX_NEW_TOKENS} tokens")
        texts = [tok.decode(ids, skip_special_tokens=True).strip() for ids in answers]
        out += chat_split_records(tok, split, prompts, texts)
    return out


def chat_split_records(tokenizer, split: str, prompts: list[str], answers: list[str]) -> list[dict]:
    """One record per (prompt, answer): the answer cut where it starts looping, rendered."""
    out, looped = [], 0
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        kept = cut_loop(answer)
        looped += kept != answer
        conv = [{"role": "user", "content": prompt}, {"role": "assistant", "content": kept}]
        text = tokenizer.apply_chat_template(conv, tokenize=False)
        out.append({"split": split, "id": f"{split}/{i:03d}", "text": text})
    print(f"chat {split}: {looped} of {len(answers)} answers cut where they loop")
    return out


def cut_loop(answer: str, n: int = LOOP_WORDS) -> str:
    """The answer up to the third occurrence of any run of n words (whitespace-separated),
    trailing whitespace removed: greedy decoding of a small model falls into loops ("They
    had been working tirelessly. They had been working tirelessly. ..."), text that tells
    nothing about a model but that it loops. Two occurrences are kept: repeating a phrase
    once is ordinary text."""
    words = list(re.finditer(r"\S+", answer))
    seen: dict[tuple[str, ...], int] = {}
    for i in range(len(words) - n + 1):
        run = tuple(w.group() for w in words[i : i + n])
        seen[run] = seen.get(run, 0) + 1
        if seen[run] > 2:
            return answer[: words[i].start()].rstrip()
    return answer


# sizes ---------------------------------------------------------------------------------


def _tokenizer():
    from transformers import AutoTokenizer

    from optllm.hub.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(CHAT_MODEL))


def _size_table(kind: str, records: list[dict], tokenizer) -> str:
    rows = ["| kind | split | documents | characters | tokens | eval text tokens |", "|---|---|---|---|---|---|"]
    for split in SPLITS:
        texts = [r["text"] for r in records if r["split"] == split]
        tokens = sum(len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"])
        joined = len(tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]) if split == "eval" else ""
        rows.append(f"| {kind} | {split} | {len(texts)} | {sum(map(len, texts)):,} | {tokens:,} | "
                    f"{joined if joined == '' else f'{joined:,}'} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
