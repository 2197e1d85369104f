"""More self-distilled data for a draft, within a time limit: the target writes user turns
(Magpie) and answers them on the optllm runtime in chunks, one engine for the whole run, until
--seconds are spent; turns are deduplicated across chunks, and against the prompts of --exclude
(an earlier train-draft dataset.jsonl: sequences whose prompt tokens equal one of its are
dropped). The sequences go to --out in train-draft's dataset.jsonl format (`train-draft
--dataset`), --exclude's first when --merge; a progress line per chunk (tokens a second), a JSON
summary last.

    python benchmarks/gen_draft_data.py smollm2-135m --out /root/d/new.jsonl --seconds 420 \\
        --exclude /root/d/old.jsonl --merge [--openers builtin|FILE]

--openers: the user turns start with task openers, cycled (builtin: speculative.data.TASK_OPENERS; FILE: one a
line), so they spread over kinds of request the target alone rarely writes. Turns that share a run of 8 words
with one of `optllm eval`'s held-out prompts (or hold a shorter one whole) are dropped and counted
(decontaminated), so the speculative evaluation stays on prompts no draft trained on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from optllm.eval.speculation import heldout_user_prompts
from optllm.runtime.llm import LLM
from optllm.speculative.data import (
    answer_prompts,
    distinct_texts,
    magpie_prompts,
    overlaps,
    read_dataset,
    read_openers,
    turn_tokens,
)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, required=True, help="stop starting chunks after this many seconds")
    ap.add_argument("--chunk", type=int, default=4096, help="prompts a chunk")
    ap.add_argument("--max-chunks", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1_000_000, help="the first chunk's sampling seed (train-draft's is 0)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=256)
    ap.add_argument("--exclude", type=Path, default=None)
    ap.add_argument("--merge", action="store_true", help="--exclude's sequences first in --out")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--openers", default=None, help="builtin (TASK_OPENERS) or a file of task openers, one a line")
    a = ap.parse_args(argv)
    if a.chunk < 1 or a.seconds <= 0:
        ap.error("--chunk must be >= 1 and --seconds > 0")
    try:
        openers = read_openers(a.openers) if a.openers is not None else ()
    except ValueError as e:
        ap.error(f"--openers {e}")
    old = read_dataset(a.exclude) if a.exclude is not None else []
    old_prompts = {tuple(s.token_ids[:s.num_prompt_tokens]) for s in old}
    t0 = time.perf_counter()
    llm = LLM(a.target, device=a.device, max_model_len=a.seq_len, max_num_seqs=a.max_num_seqs)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", flush=True)
    seen: set[str] = set()
    heldout = heldout_user_prompts()
    new, chunks, tokens, dropped, contaminated = [], 0, 0, 0, 0
    tmp = a.out.with_name(a.out.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        if a.merge:
            f.writelines(json.dumps(s.to_json()) + "\n" for s in old)
        while chunks < a.max_chunks and time.perf_counter() - t0 < a.seconds:
            t1 = time.perf_counter()
            turns = magpie_prompts(llm, a.chunk, seed=a.seed + chunks * 8 * a.chunk, max_tokens=turn_tokens(a.seq_len),
                                   openers=openers)
            texts = distinct_texts([t[0]["content"] for t in turns], seen)
            hit = overlaps(texts, heldout)
            contaminated += sum(hit)
            texts = [t for t, h in zip(texts, hit) if not h]
            t2 = time.perf_counter()
            seqs = answer_prompts(llm, [[{"role": "user", "content": t}] for t in texts],
                                  max_tokens=a.answer_tokens, temperature=0.0, max_len=a.seq_len)
            kept = [s for s in seqs if tuple(s.token_ids[:s.num_prompt_tokens]) not in old_prompts]
            dropped += len(seqs) - len(kept)
            f.writelines(json.dumps(s.to_json()) + "\n" for s in kept)
            f.flush()
            new += kept
            answer = sum(len(s.token_ids) - s.num_prompt_tokens for s in kept)
            tokens += answer
            chunks += 1
            t3 = time.perf_counter()
            print(f"chunk {chunks}: {len(turns)} turns ({t2 - t1:.1f} s), {len(texts)} new, {len(kept)} sequences, "
                  f"{answer} answer tokens ({t3 - t2:.1f} s, {answer / max(t3 - t2, 1e-9):.0f} tok/s); "
                  f"{len(new)} sequences in {t3 - t0:.0f} s", flush=True)
    tmp.replace(a.out)
    summary = {"chunks": chunks, "new_sequences": len(new), "answer_tokens": tokens, "dropped_as_old": dropped,
               "dropped_as_eval_prompts": contaminated,
               "merged_old": len(old) if a.merge else 0, "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
