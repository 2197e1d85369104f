"""Draft training data: prompts (the user's .jsonl, or written by the target itself with the
Magpie method), then the target's own answers to them (self-distillation).

A training sequence is prompt tokens + the target's answer tokens; only the answer tokens
are trained on (``DraftSequence.num_prompt_tokens`` marks the boundary).
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..runtime.llm import LLM, render_chat
from ..runtime.sampling_params import SamplingParams

# A conversation in the chat-template form: [{"role": "user", "content": "..."}, ...]
Conversation = list[dict]
# plain text (no template), a conversation up to the user's turn, or token ids as they are (the
# prompt part of an earlier train-draft dataset.jsonl's sequence: another target answers the same prompts)
Prompt = str | Conversation | tuple[int, ...]

_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
          "bing": "assistant", "bard": "assistant", "system": "system"}
_SENTINEL = "\x00OPTLLM-USER-TURN\x00"


@dataclass
class DraftSequence:
    """token_ids: prompt + answer; the first num_prompt_tokens are the prompt (not trained on)."""

    token_ids: list[int]
    num_prompt_tokens: int

    def to_json(self) -> dict:
        return {"token_ids": self.token_ids, "num_prompt_tokens": self.num_prompt_tokens}

    @staticmethod
    def from_json(d: dict) -> DraftSequence:
        return DraftSequence([int(t) for t in d["token_ids"]], int(d["num_prompt_tokens"]))


def read_prompts(path: str | Path) -> list[Prompt]:
    """Prompts from a .jsonl file: lines {"prompt": "..."} (plain text), ShareGPT-style
    {"conversations": [{"from"|"role": ..., "value"|"content": ...}, ...]} (kept up to the
    first user turn, with any system turn before it: the target writes the answer itself), or
    an earlier train-draft run's dataset.jsonl lines {"token_ids": [...], "num_prompt_tokens": n}
    (the first n ids, as they are: say, the float target's prompts answered again by its
    quantized checkpoint, which shares its tokenizer). UserError naming the line on anything else."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"prompt file {path} not found")
    prompts: list[Prompt] = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{n}: not JSON ({e.msg})") from None
        prompt = _prompt_of(row)
        if prompt is None:
            raise UserError(f'{path}:{n}: expected {{"prompt": "..."}}, {{"conversations": [...]}} with a user turn, '
                            'or {"token_ids": [...], "num_prompt_tokens": n} (a train-draft dataset.jsonl line)')
        prompts.append(prompt)
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def _prompt_of(row) -> Prompt | None:
    if not isinstance(row, dict):
        return None
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        return row["prompt"]
    if "token_ids" in row:
        ids, n = row["token_ids"], row.get("num_prompt_tokens")
        if not (isinstance(ids, list) and type(n) is int and 0 < n <= len(ids)
                and all(type(t) is int and t >= 0 for t in ids[:n])):
            return None
        return tuple(ids[:n])
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list):
        return None
    conv: Conversation = []
    for t in turns:
        if not isinstance(t, dict):
            return None
        role = _ROLES.get(str(t.get("from", t.get("role", ""))).lower())
        content = t.get("value", t.get("content"))
        if role is None or not isinstance(content, str):
            return None
        if role == "assistant":
            break
        conv.append({"role": role, "content": content})
        if role == "user":
            return conv
    return None


def user_prefix(tokenizer) -> tuple[str, str]:
    """(text before, text after) the user's message in the chat template: the Magpie prefix
    the target continues, and the end-of-turn marker that stops it. UserError without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the target has no chat template, so it cannot write its own prompts; "
                        "give --prompts FILE.jsonl")
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], tokenize=False,
                                         add_generation_prompt=False)
    if _SENTINEL not in text:
        raise UserError("the target's chat template does not render the user's message; give --prompts FILE.jsonl")
    before, after = text.split(_SENTINEL, 1)
    return before, after.strip().split("\n")[0].strip()


# Task openers for Magpie (``magpie_prompts(openers=TASK_OPENERS)``): the first words of a user turn across the kinds
# of request a chat model serves (questions, explanations, writing, lists, code, advice ...). A model left to write
# from the user prefix alone settles on a few kinds (SmolLM2: mostly "I'm ..." and "What is ..." questions), so a draft
# trained on them has seen little of, for example, the stories a user asks it to write. The role-play openers (last
# five) came after e3-s43's tau per held-out prompt (docs/BENCHMARKS.md, forty-fourth session): role-play and verse
# were the eval's lowest (2.2-3.1 against 3.3-5.1 for advice and opinions), and no opener asked for role-play.
TASK_OPENERS = ("Write", "Write a story", "Write a poem", "Explain", "How do I", "What is", "Why", "Can you",
                "List", "Describe", "Summarize", "Give me", "Help me", "Compare", "Tell me", "Create", "Suggest",
                "I need", "Translate", "Write a Python function",
                "You are a", "Pretend you are", "Role-play as", "Act as", "Imagine you are")


def read_openers(spec: str) -> tuple[str, ...]:
    """--openers: "builtin" (TASK_OPENERS) or a file of openers, one a line (blank lines skipped). ValueError, one
    line, for a missing file or one without an opener."""
    if spec == "builtin":
        return TASK_OPENERS
    path = Path(spec)
    openers = tuple(line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()) \
        if path.is_file() else ()
    if not openers:
        raise ValueError(f"{spec!r}: allowed builtin or a file with one opener a line")
    return openers


def magpie_prompts(llm: LLM, num_prompts: int, seed: int = 0, max_tokens: int = 64, temperature: float = 1.0,
                   max_rounds: int = 4, openers: Sequence[str] = ()) -> list[Conversation]:
    """num_prompts distinct user turns written by the target from its chat template's user
    prefix alone (Magpie), sampled at `temperature` with per-request seeds (deterministic),
    deduplicated (case and surrounding space ignored). Fewer when the model keeps repeating
    itself after max_rounds rounds of sampling. openers: request i's turn starts with
    openers[i % len(openers)] (the prefix then ends with it; the turn is the opener and what the
    model wrote after it), so the turns spread over those kinds of request."""
    tok = llm.tokenizer
    before, end_of_turn = user_prefix(tok)
    starts = list(openers) or [""]
    prefixes = [tok(before + o, add_special_tokens=False)["input_ids"] for o in starts]
    stop_ids = _stop_ids(tok, end_of_turn)
    seen: set[str] = set()
    prompts: list[Conversation] = []
    next_seed = seed
    for _ in range(max_rounds):
        want = num_prompts - len(prompts)
        if want <= 0:
            break
        ask = max(2 * want, 4)  # oversample: some come back empty or repeated
        params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, seed=next_seed + i,
                                 stop=[end_of_turn] if end_of_turn else None, stop_token_ids=stop_ids)
                  for i in range(ask)]
        which = [(next_seed + i) % len(starts) for i in range(ask)]  # the opener by the request's seed
        next_seed += ask
        outs = llm.generate([list(prefixes[w]) for w in which], params)
        texts = [starts[w] + out.outputs[0].text if out.outputs[0].text.strip() else "" for w, out in zip(which, outs)]
        for text in distinct_texts(texts, seen)[:want]:
            prompts.append([{"role": "user", "content": text}])
    return prompts


def turn_tokens(max_len: int) -> int:
    """Tokens a written user turn may take in sequences of max_len: a quarter (most of max_len is
    left to the answer), 4 to 128."""
    return max(4, min(128, max_len // 4))


def distinct_texts(texts: list[str], seen: set[str] | None = None) -> list[str]:
    """texts stripped, without empty ones and repeats (case and runs of whitespace ignored),
    first occurrence kept; `seen` (keys already taken) is updated in place."""
    seen = set() if seen is None else seen
    kept = []
    for text in texts:
        text = text.strip()
        key = " ".join(text.casefold().split())
        if key and key not in seen:
            seen.add(key)
            kept.append(text)
    return kept


def _words(text: str) -> list[str]:
    return "".join(c if c.isalnum() else " " for c in text.casefold()).split()


def overlaps(texts: Sequence[str], references: Sequence[str], n: int = 8) -> list[bool]:
    """For each text, whether it shares a run of n words with one of the references (case and punctuation
    ignored), or holds a whole reference shorter than n words: a written training prompt that would put an
    evaluation prompt into the draft's training data."""
    if n < 1:
        raise ValueError(f"n={n}: allowed n >= 1")
    grams, short = set(), []
    for ref in references:
        w = _words(ref)
        if len(w) < n:
            short.append(" " + " ".join(w) + " ")
        grams.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
    out = []
    for text in texts:
        w = _words(text)
        hit = any(tuple(w[i:i + n]) in grams for i in range(len(w) - n + 1))
        joined = " " + " ".join(w) + " "
        out.append(hit or any(r.strip() and r in joined for r in short))
    return out


def _stop_ids(tokenizer, end_of_turn: str) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if end_of_turn:
        t = tokenizer.convert_tokens_to_ids(end_of_turn)
        if isinstance(t, int) and t != tokenizer.unk_token_id and t is not None:
            ids.add(t)
    return sorted(ids)


def answer_prompts(llm: LLM, prompts: list[Prompt], max_tokens: int = 256, temperature: float = 0.0,
                   seed: int = 0, max_len: int | None = None) -> list[DraftSequence]:
    """The target answers every prompt in one batched call (conversations through its chat
    template, plain strings as they are, token-id tuples as given); each sequence is the
    prompt's tokens + the answer's, cut to max_len tokens. Prompts that leave no room for an
    answer are dropped. A token id outside the target's vocabulary is one UserError."""
    tok = llm.tokenizer
    ids: list[list[int]] = []
    for p in prompts:
        if isinstance(p, str):
            ids.append(list(tok(p)["input_ids"]))
        elif isinstance(p, tuple):  # token ids (an earlier dataset's prompt part)
            vocab = llm.engine.runner.vocab_size
            if max(p) >= vocab:
                raise UserError(f"prompt {len(ids) + 1} has token id {max(p)}, past this target's vocabulary of "
                                f"{vocab}: token-id prompts must come from a target with the same tokenizer")
            ids.append(list(p))
        else:
            try:
                ids.append(render_chat(tok, p))
            except ValueError as e:
                raise UserError(str(e)) from None
    keep = [i for i, x in enumerate(ids) if max_len is None or len(x) < max_len]
    params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed + i) for i in keep]
    if not keep:
        return []
    outs = llm.generate([ids[i] for i in keep], params)
    seqs = []
    for i, out in zip(keep, outs):
        answer = list(out.outputs[0].token_ids)
        full = (ids[i] + answer)[:max_len] if max_len else ids[i] + answer
        if len(full) > len(ids[i]):
            seqs.append(DraftSequence(full, len(ids[i])))
    return seqs


def build_dataset(target: str, num_prompts: int, prompts_file: str | Path | None = None, seed: int = 0,
                  device: str = "auto", max_len: int = 512, answer_tokens: int = 256,
                  answer_temperature: float = 0.0, log: Callable[[str], None] = print, openers: Sequence[str] = (),
                  exclude: Sequence[str] = ()) -> list[DraftSequence]:
    """Self-distillation data for TARGET: prompts (from prompts_file, else Magpie) answered
    by the target on the optllm runtime. num_prompts bounds the prompts either way. Magpie only:
    openers start the written turns (magpie_prompts), and a written turn that overlaps one of
    exclude (``overlaps``) is dropped."""
    file_prompts = read_prompts(prompts_file)[:num_prompts] if prompts_file is not None else None
    llm = LLM(target, device=device, max_model_len=max_len)
    try:
        if file_prompts is None:
            written = magpie_prompts(llm, num_prompts, seed=seed, max_tokens=turn_tokens(max_len), openers=openers)
            hit = overlaps([c[0]["content"] for c in written], exclude)
            prompts: list[Prompt] = [c for c, h in zip(written, hit) if not h]
            log(f"data: the target wrote {len(written)} distinct prompts (Magpie"
                + (f", {len(openers)} task openers" if openers else "") + ")"
                + (f"; {sum(hit)} dropped as overlapping an evaluation prompt" if any(hit) else ""))
        else:
            prompts = file_prompts
            log(f"data: {len(prompts)} prompts from {prompts_file}")
        if not prompts:
            raise UserError("no prompts to train on")
        seqs = answer_prompts(llm, prompts, max_tokens=answer_tokens, temperature=answer_temperature, seed=seed,
                              max_len=max_len)
    finally:
        # the engine's KV cache takes most of the GPU: give it back before training starts (a
        # reference cycle would keep it until the next gc run)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    if not seqs:
        raise UserError(f"no training sequences: every prompt is at least --seq-len ({max_len}) tokens long")
    log(f"data: {len(seqs)} sequences, {sum(len(s.token_ids) - s.num_prompt_tokens for s in seqs)} answer tokens")
    return seqs


def write_dataset(seqs: list[DraftSequence], path: Path) -> None:
    path.write_text("".join(json.dumps(s.to_json()) + "\n" for s in seqs), encoding="utf-8")


def read_dataset(path: Path) -> list[DraftSequence]:
    return [DraftSequence.from_json(json.loads(line)) for line in path.read_text(encoding="utf-8").splitlines()
            if line.strip()]
