"""Calibration data: token windows [num_samples, seq_len] from one of several sources.

Sources (``--calib``):

- ``"builtin"`` (default): a mixture of the calibration splits of the built-in corpus's
  three kinds (hub/corpus.py): prose of the Python docs, Python source, and chat
  conversations of SmolLM2. The windows are shared out in fixed proportions,
  ``BUILTIN_SHARES`` (docs 40 %, code 30 %, chat 30 % of ``num_samples``, largest
  remainder rounding: 128 -> 51 + 39 + 38; every kind gets one when num_samples >= 3),
  each kind's windows are cut from its own token stream as below, and the windows of all
  kinds are then put in one seeded random order;
- ``"docs"``, ``"code"`` or ``"chat"``: one kind of the built-in corpus, its calibration
  split;
- a local file: ``.txt`` (the whole file is one document; blank lines stay text),
  ``.jsonl`` (a ``"text"`` field per line) or ``.parquet`` (a ``"text"`` column), the
  last two read through ``datasets``;
- ``"self"``: data-free calibration, text the model writes itself from our seed prompts;
- anything else: a hub dataset id, ``NAME`` or ``NAME:CONFIG`` (e.g.
  ``wikitext:wikitext-2-raw-v1``), split "train", when the hub is reachable. With
  ``HF_HUB_OFFLINE=1`` datasets already in the local cache are used.

Documents are tokenized without special tokens and concatenated with EOS after each (in
a seeded random document order); ``num_samples`` windows of ``seq_len`` tokens are cut at
seeded random, non-overlapping positions (overlapping, with a warning, only when the
stream is too short), so the same (tokenizer, source, num_samples, seq_len, seed) always
gives the same tensor; its ``sha256`` goes into reports. The built-in calibration splits
share no text with the held-out splits that ``optllm eval`` measures.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import torch

from ..errors import UserError
from ..hub.corpus import KINDS, texts

log = logging.getLogger(__name__)

FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_HUB_PROBE_TIMEOUT_S = 3.0
_TOKENIZE_BATCH = 256  # documents per tokenizer call
_BUDGET_FACTOR = 4  # tokenize until the stream is this many times the tokens needed
_SELF_TEMPERATURE = 0.9
_SELF_TOP_P = 0.95
_SELF_MAX_BATCH = 32
_SELF_MAX_NEW_TOKENS = 1024
# "builtin": share of the windows per kind of the built-in corpus (prose first: the
# register most users serve; code and chat widen the activations a scale is fitted on).
BUILTIN_SHARES = (("docs", 0.4), ("code", 0.3), ("chat", 0.3))

# Seed prompts for "self": varied registers, so the activations cover more than one style.
SELF_PROMPTS = (
    "Explain how a refrigerator keeps food cold, step by step.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Write a Python function that merges two sorted lists, and explain how it works.",
    "List ten practical tips for learning a new language as an adult.",
    "Write a dialogue between a customer and a baker about a birthday cake order.",
    "Summarize the causes and consequences of the Industrial Revolution.",
    "Describe the water cycle to a ten-year-old.",
    "Write a polite email asking a colleague to review a report by Friday.",
    "What are the differences between a virus and a bacterium?",
    "Write a poem about autumn in a small mountain village.",
    "Give a recipe for a simple vegetable soup with quantities and steps.",
    "Explain what a hash table is and when you would use one, with a small example in JavaScript.",
    "Argue for and against working from home, in two balanced paragraphs.",
    "Describe a busy train station at rush hour from the point of view of a pigeon.",
    "Solve this step by step: a train travels 180 km in 2.5 hours. What is its average speed?",
    "Write a SQL query that finds the five customers with the highest total orders, and explain it.",
)


@dataclass(frozen=True)
class CalibrationData:
    """Calibration token windows.

    input_ids: LongTensor [num_samples, seq_len] (CPU).
    source: a one-line description of where the tokens came from.
    sha256: hex SHA-256 of b"{num_samples}x{seq_len}:" followed by the ids as little-endian
        int64 in row-major order.
    """

    input_ids: torch.Tensor
    source: str
    sha256: str


def load_calibration(
    tokenizer,
    source: str = "builtin",
    num_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    model=None,
) -> CalibrationData:
    """Token windows for calibration: ``input_ids`` [num_samples, seq_len] int64.

    tokenizer: a transformers tokenizer. source: see the module docstring. seed drives
    the document order, the window positions and (for "self") the sampling. model: the
    causal LM, needed for source="self" only.
    """
    if not isinstance(num_samples, int) or num_samples < 1:
        raise UserError(f"num_samples must be an integer >= 1; got {num_samples!r}")
    if not isinstance(seq_len, int) or seq_len < 8:
        raise UserError(f"seq_len must be an integer >= 8; got {seq_len!r}")
    gen = torch.Generator().manual_seed(seed)
    needed = num_samples * seq_len
    if source == "builtin":
        ids, desc = _builtin_mixture(tokenizer, num_samples, seq_len, gen)
        return CalibrationData(input_ids=ids, source=desc, sha256=token_hash(ids))
    if source == "self":
        if model is None:
            raise UserError('calibration source "self" needs the model (model=...) to generate text')
        stream, desc = _self_stream(model, tokenizer, needed, seq_len, seed)
    else:
        docs, desc = _documents(source)
        stream = _token_stream(tokenizer, docs, gen, budget=_BUDGET_FACTOR * needed)
    ids = _windows(stream, num_samples, seq_len, gen, desc)
    return CalibrationData(input_ids=ids, source=desc, sha256=token_hash(ids))


def builtin_counts(num_samples: int) -> dict[str, int]:
    """Windows per kind for "builtin": BUILTIN_SHARES of num_samples, floors first, then one
    more window each to the kinds with the largest remainders (ties: BUILTIN_SHARES order)."""
    exact = {kind: share * num_samples for kind, share in BUILTIN_SHARES}
    counts = {kind: math.floor(x) for kind, x in exact.items()}
    by_remainder = sorted(exact, key=lambda k: counts[k] - exact[k])  # stable: ties keep the order
    for kind in by_remainder[: num_samples - sum(counts.values())]:
        counts[kind] += 1
    return counts


def _builtin_mixture(tokenizer, num_samples: int, seq_len: int, gen: torch.Generator):
    """The "builtin" windows: each kind's share cut from its own calib stream, then shuffled."""
    counts = builtin_counts(num_samples)
    parts = []
    for kind, n in counts.items():
        if n:
            docs = texts(kind, "calib")
            stream = _token_stream(tokenizer, docs, gen, budget=_BUDGET_FACTOR * n * seq_len)
            parts.append(_windows(stream, n, seq_len, gen, f"builtin {kind}, calib split"))
    ids = torch.cat(parts)[torch.randperm(num_samples, generator=gen)]
    shares = " + ".join(f"{kind} {n}" for kind, n in counts.items())
    desc = (f"builtin: mixture of the built-in corpus's calib splits (hub/data), windows {shares} "
            f"({'/'.join(f'{round(100 * s)}' for _, s in BUILTIN_SHARES)} % of {num_samples})")
    return ids, desc


def token_hash(input_ids: torch.Tensor) -> str:
    """SHA-256 (hex) of a 2-D id tensor: shape prefix plus little-endian int64 bytes."""
    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(f"{ids.shape[0]}x{ids.shape[1]}:".encode())
    h.update(ids.numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


def _documents(source: str):
    """(sequence of document strings, description) for every source but "self"."""
    if source in KINDS:
        docs = texts(source, "calib")
        return docs, f"builtin {source}: calib split of the built-in corpus (hub/data), {len(docs)} docs"
    path = Path(source).expanduser()
    if path.suffix.lower() in FILE_SUFFIXES:
        if not path.is_file():
            raise UserError(f"calibration file {source!r} does not exist")
        return _file_documents(path)
    if path.exists():
        raise UserError(
            f"calibration file {source!r} has an unsupported type; allowed: {', '.join(FILE_SUFFIXES)}"
        )
    return _hub_documents(source)


def _file_documents(path: Path):
    suffix = path.suffix.lower()
    if suffix == ".txt":
        text = path.read_text(encoding="utf-8")
        if not text.strip():
            raise UserError(f"calibration file {path} is empty")
        return [text], f"file: {path.resolve()} (txt, 1 document)"
    import datasets

    builder = "json" if suffix == ".jsonl" else "parquet"
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # malformed JSON lines, not a parquet file: the user's file
        raise UserError(f"cannot read calibration file {path}: {_first_line(e)}") from None
    return _text_column(ds, str(path)), f"file: {path.resolve()} ({suffix[1:]}, {len(ds)} rows)"


def _hub_documents(source: str):
    name, _, config = source.partition(":")
    offline = _hub_offline()
    if not offline and not _hub_reachable():
        raise UserError(_not_found(source, "the hub is unreachable"))
    import datasets

    try:
        ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
        column_names = ds.column_names or list(next(iter(ds)).keys())
    except Exception as e:  # unknown name, offline without cache, auth, missing config
        raise UserError(_not_found(source, _first_line(e))) from None
    if "text" not in column_names:
        raise UserError(f"hub dataset {source!r} has no 'text' field; fields: {', '.join(column_names)}")
    rows = (row["text"] for row in ds)
    return rows, f"hub: {source} (train split, streamed{', offline cache' if offline else ''})"


def _not_found(source: str, why: str) -> str:
    return (
        f"calibration source {source!r} is not a local {'/'.join(FILE_SUFFIXES)} file, not one of "
        f"builtin, {', '.join(KINDS)}, self, and could not be loaded from the Hugging Face hub ({why})"
    )


def _hub_offline() -> bool:
    import datasets

    env = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return env or bool(getattr(datasets.config, "HF_HUB_OFFLINE", False))


def _hub_reachable() -> bool:
    """One TCP connect to the hub endpoint: datasets itself retries for ~30 s when offline."""
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=_HUB_PROBE_TIMEOUT_S):
            return True
    except OSError:
        return False


def _text_column(ds, where: str) -> list[str]:
    if "text" not in ds.column_names:
        raise UserError(f"{where} has no 'text' field; fields found: {', '.join(ds.column_names) or 'none'}")
    return [t for t in ds["text"] if isinstance(t, str) and t.strip()]


def _token_stream(tokenizer, docs, gen: torch.Generator, budget: int) -> torch.Tensor:
    """Shuffle (when the documents are a list) and tokenize until ``budget`` tokens.

    Returns a 1-D int64 tensor: document tokens, each followed by EOS.
    """
    eos = tokenizer.eos_token_id
    if eos is None:
        log.warning("tokenizer has no EOS token; calibration documents are concatenated without a separator")
    if isinstance(docs, list):
        docs = [docs[i] for i in torch.randperm(len(docs), generator=gen).tolist()]
    parts: list[torch.Tensor] = []
    total = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal total
        enc = tokenizer(batch, add_special_tokens=False, verbose=False)["input_ids"]
        for ids in enc:
            if eos is not None:
                ids = [*ids, eos]
            parts.append(torch.tensor(ids, dtype=torch.int64))
            total += len(ids)
        batch.clear()

    for doc in docs:
        if isinstance(doc, str) and doc.strip():
            batch.append(doc)
        if len(batch) == _TOKENIZE_BATCH:
            flush()
            if total >= budget:
                break
    if batch:
        flush()
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def _windows(stream: torch.Tensor, n: int, s: int, gen: torch.Generator, desc: str) -> torch.Tensor:
    """n windows of s tokens from a 1-D stream, at seeded random positions -> [n, s]."""
    length = stream.numel()
    if length < s:
        raise UserError(f"calibration source ({desc}) has {length} tokens, fewer than seq_len={s}")
    slack = length - n * s
    if slack >= 0:
        # Random non-overlapping placement: sorted offsets into the slack, one window after another.
        offsets = torch.sort(torch.randint(0, slack + 1, (n,), generator=gen)).values
        starts = offsets + torch.arange(n) * s
        starts = starts[torch.randperm(n, generator=gen)]
    else:
        positions = length - s + 1
        log.warning(
            "calibration source has %d tokens, fewer than num_samples x seq_len = %d; windows overlap",
            length,
            n * s,
        )
        if n <= positions:
            starts = torch.randperm(positions, generator=gen)[:n]
        else:
            starts = torch.randint(0, positions, (n,), generator=gen)
    return torch.stack([stream[i : i + s] for i in starts.tolist()])


def _self_stream(model, tokenizer, needed: int, seq_len: int, seed: int):
    """Data-free calibration: sample text from the model itself -> (1-D token stream, desc).

    Each sample is its chat-formatted prompt plus what the model wrote, cut at EOS and
    followed by EOS. Sampling runs under a forked RNG seeded with ``seed``.
    """
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos if eos is not None else 0)
    prompts = [_encode_prompt(tokenizer, p) for p in SELF_PROMPTS]
    new_tokens = min(_SELF_MAX_NEW_TOKENS, max(64, seq_len))
    batch = max(1, min(_SELF_MAX_BATCH, math.ceil(needed / new_tokens)))
    max_rounds = 4 * math.ceil(needed / (batch * new_tokens)) + 4  # EOS-happy models stop early
    device = next(model.parameters()).device
    parts: list[torch.Tensor] = []
    total, k = 0, 0
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    with torch.random.fork_rng(devices=devices), torch.inference_mode():
        torch.manual_seed(seed)
        for _ in range(max_rounds):
            if total >= needed:
                break
            chunk = [prompts[(k + i) % len(prompts)] for i in range(batch)]
            k += batch
            ids, mask = _left_pad(chunk, pad)
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                do_sample=True,
                temperature=_SELF_TEMPERATURE,
                top_p=_SELF_TOP_P,
                top_k=0,
                max_new_tokens=new_tokens,
                pad_token_id=pad,
            ).cpu()
            for prompt, row in zip(chunk, out[:, ids.shape[1] :]):
                new = row.tolist()
                if eos is not None and eos in new:
                    new = new[: new.index(eos)]
                seq = [*prompt, *new] + ([eos] if eos is not None else [])
                parts.append(torch.tensor(seq, dtype=torch.int64))
                total += len(seq)
    desc = (
        f"self: text generated by the model from {len(SELF_PROMPTS)} seed prompts "
        f"(temperature {_SELF_TEMPERATURE}, top_p {_SELF_TOP_P}, seed {seed}, {total} tokens)"
    )
    return torch.cat(parts), desc


def _encode_prompt(tokenizer, prompt: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


def _left_pad(seqs: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad so every prompt ends at the last column, where generation continues."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.int64)
        mask[i, width - len(s) :] = 1
    return ids, mask


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"
