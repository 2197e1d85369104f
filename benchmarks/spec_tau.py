"""The mean accepted length tau of a draft under greedy decoding, per EAGLE tree shape and
prompt set, with no timing: under greedy acceptance which draft tokens a step accepts depends on
the two models and the tree, not on the device (up to the rounding of the compute dtype), so the
CPU can say what a tree of another depth, width or size would accept before a GPU times it.

    python benchmarks/spec_tau.py --draft DIR [--model smollm2-135m] [--trees d5k8n40,d6k8n60]
        [--sets eval,holdout] [--num 24] [--output-len 128] [--data data_all.jsonl.gz --skip 12288]
        [--device cpu] [--dtype auto] [--out DIR]

A tree dDkKnN is ``spec_depth`` D, ``spec_top_k`` K, ``spec_num_draft`` N (a tree of N + 1
nodes), verified whole at every step (``spec_policy="fixed"``). Prompt sets:
- eval: the held-out chat prompts `optllm eval --draft` measures at batch 1 (the same 24 at the
  same offset, so tau here is that row's under a fixed tree);
- holdout: the user turns of the draft's own data that its training held out (``--data``: a
  train-draft dataset, split as train-draft splits it, ``--holdout`` and ``--seed`` as trained),
  those at index >= ``--skip`` only (the part of the file earlier drafts, which this one was
  initialised from, never saw). Their tau against eval's says how much of the gap between the
  draft's held-out top-1 and its acceptance in service is the prompts' kind.

Per set and tree: tau, the share of sequence-steps that accepted >= d draft tokens, and the
acceptance at depth d given depth d - 1 (the draft's conditional hit rate along the path).

--depth-penalties P1,P2,...: each tree also with every draft log-probability lowered by P (a node at
depth d scores its path's log-probability - d P). A level's frontier is chosen among candidates of
one depth, so only the final choice of the tree's nodes across depths moves: P > 0 keeps shallower
nodes, as a draft whose probabilities overstate its deeper hits would want.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import time
from pathlib import Path

from optllm.benchmarks.common import provenance, write_results
from optllm.eval.speculation import case_prompts
from optllm.runtime.llm import LLM
from optllm.runtime.sampling_params import SamplingParams
from optllm.speculative.data import DraftSequence
from optllm.speculative.train import _split

_TREE = re.compile(r"d(\d+)k(\d+)n(\d+)")


def parse_tree(text: str) -> dict:
    m = _TREE.fullmatch(text)
    if m is None:
        raise SystemExit(f"--trees: {text!r} is not a tree; allowed: dDkKnN (depth D, top-k K, N draft tokens), "
                         "e.g. d5k8n40")
    d, k, n = map(int, m.groups())
    return dict(spec_depth=d, spec_top_k=k, spec_num_draft=n)


def holdout_prompts(path: Path, holdout: int, seed: int, skip: int, num: int) -> list[list[int]]:
    """The prompts (token ids) of the sequences train-draft held out of `path` (its own split,
    ``speculative.train._split``), those at file index >= skip, at most num."""
    with (gzip.open(path, "rt") if path.suffix == ".gz" else path.open()) as f:
        seqs = [DraftSequence.from_json(json.loads(line)) for line in f if line.strip()]
    # the split's held sequences are the file's own objects: their indices by identity
    index = {id(s): i for i, s in enumerate(seqs)}
    _, held = _split(seqs, holdout, seed)
    return [s.token_ids[:s.num_prompt_tokens] for s in held if index[id(s)] >= skip][:num]


def penalize_depth(llm: LLM, penalty: float) -> None:
    """The engine's draft from now on returns its log-probabilities lowered by penalty (see the module
    docstring); 0 restores them."""
    draft = llm.engine.runner.spec.draft
    for name in ("ranked", "forward_ranked"):
        draft.__dict__.pop(name, None)
    if not penalty:
        return
    ranked, forward_ranked = draft.ranked, draft.forward_ranked
    draft.ranked = lambda out, k: (lambda lp, ids: (lp - penalty, ids))(*ranked(out, k))
    draft.forward_ranked = lambda *a: (lambda out, lp, ids: (out, lp - penalty, ids))(*forward_ranked(*a))


def _first_words(llm: LLM, prompt: list[int], words: int = 8) -> str:
    """The user turn's first words (after the chat template's last user prefix)."""
    text = llm.tokenizer.decode(prompt)
    turn = text.rsplit("user\n", 1)[-1]
    return " ".join(turn.split()[:words])


def measure(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    before = llm.engine.stats().speculation
    h0, acc0, steps0 = list(before["histogram"]), before["accepted"], before["seq_steps"]
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False),
                 use_tqdm=False)
    seconds = time.perf_counter() - t0
    st = llm.engine.stats().speculation
    hist = [c - (h0[i] if i < len(h0) else 0) for i, c in enumerate(st["histogram"])]
    steps, acc = st["seq_steps"] - steps0, st["accepted"] - acc0
    at_least = [sum(hist[d:]) / steps for d in range(1, len(hist))] if steps else []
    given = [a / b if b else None for a, b in zip(at_least, [1.0] + at_least)]
    return dict(tau=(acc + steps) / steps if steps else None, seq_steps=steps, histogram=hist, at_least=at_least,
                given_previous=given, seconds=seconds)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--trees", default="d5k8n40")
    ap.add_argument("--sets", default="eval")
    ap.add_argument("--num", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--data", type=Path, help="holdout: the draft's training data (.jsonl or .jsonl.gz)")
    ap.add_argument("--holdout", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--batch", type=int, default=8, help="sequences decoded together (tau does not depend on it)")
    ap.add_argument("--max-len", type=int, default=1024, help="the engine's max_model_len")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--depth-penalties", default="0", help="comma-separated log-prob penalties a depth")
    ap.add_argument("--per-prompt", action="store_true", help="also each prompt's own tau (its first words beside it)")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    trees = {t: parse_tree(t) for t in a.trees.split(",")}
    sets = a.sets.split(",")
    try:
        penalties = [float(p) for p in a.depth_penalties.split(",")]
    except ValueError:
        raise SystemExit(f"--depth-penalties: {a.depth_penalties!r}; allowed: comma-separated numbers") from None
    if bad := [s for s in sets if s not in ("eval", "holdout")]:
        raise SystemExit(f"--sets: {bad} not allowed; allowed: eval, holdout")
    if "holdout" in sets and a.data is None:
        raise SystemExit("--sets holdout needs --data (the draft's training data)")
    rows = []
    # token ids, the same for every tree's engine (one model): the data file read once
    prompts = {"holdout": holdout_prompts(a.data, a.holdout, a.seed, a.skip, a.num)} if "holdout" in sets else {}
    for name, opts in trees.items():
        llm = LLM(a.model, device=a.device, dtype=a.dtype, draft=a.draft, spec_policy="fixed", max_num_seqs=a.batch,
                  max_model_len=a.max_len, enable_prefix_caching=False, **opts)
        if "eval" in sets and "eval" not in prompts:
            prompts["eval"] = case_prompts(llm, 1, a.num)[1:]  # eval's timed requests at batch 1 (after its warm-up)
        for pen in penalties:
            penalize_depth(llm, pen)
            label = name if not pen else f"{name} -{pen:g}/depth"
            for s in sets:
                r = measure(llm, prompts[s], a.output_len)
                if a.per_prompt:
                    r["per_prompt"] = [dict(words=_first_words(llm, p), tau=measure(llm, [p], a.output_len)["tau"])
                                       for p in prompts[s]]
                rows.append(dict(tree=label, set=s, prompts=len(prompts[s]), depth_penalty=pen, **opts, **r))
                print(f"{label} {s}: tau {r['tau']:.3f} over {r['seq_steps']} steps "
                      f"({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        del llm
    depth = max(len(r["at_least"]) for r in rows)
    head = ("| tree | prompts | tau | " + " | ".join(f">= {d}" for d in range(1, depth + 1)) + " | "
            + " | ".join(f"{d} given {d - 1}" for d in range(2, depth + 1)) + " |")
    lines = [head, "|" + "---|" * (3 + 2 * depth - 1)]
    for r in rows:
        pct = [f"{x:.0%}" for x in r["at_least"]] + [""] * (depth - len(r["at_least"]))
        cond = [f"{x:.2f}" if x is not None else "" for x in r["given_previous"][1:]]
        cond += [""] * (depth - 1 - len(cond))
        lines.append(f"| {r['tree']} | {r['set']} ({r['prompts']}) | {r['tau']:.2f} | " + " | ".join(pct) + " | "
                     + " | ".join(cond) + " |")
    for r in rows:
        if "per_prompt" in r:
            lines += [f"\n{r['tree']}, {r['set']}, each prompt alone:\n", "| tau | prompt |", "|---|---|"]
            lines += [f"| {p['tau']:.2f} | {p['words']} |" for p in sorted(r["per_prompt"], key=lambda p: p["tau"])]
    table = "\n".join(lines)
    print(table)
    write_results(a.out, "spec_tau", table, {"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                            "provenance": provenance()})
    return rows


if __name__ == "__main__":
    main()
