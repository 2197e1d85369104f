"""What a draft buys, for ``optllm eval MODEL... --draft DIR``: per checkpoint, batch size and
temperature, the output tok/s without and with speculative decoding, the speedup, the mean
accepted length tau (tokens a sequence-step emits: accepted draft tokens + 1), the
histogram of accepted lengths and, per depth d, the share of speculative sequence-steps that
accepted at least d draft tokens; under greedy decoding also whether both runs gave the same
tokens. In float32 they must (the CPU tests check it). In bf16 the verify step's logits come from
other kernels and other GEMM shapes than a decode step's, and round differently: where the
target's two best tokens are within a rounding step, the argmax may flip and the outputs part.
So for each sequence that parts, the target's top-2 log-prob margin at the first differing
position is measured (the plain output up to there, scored by the target): margins of a bf16
rounding step (~0.1) are ties, a margin far above that would be a bug.

Prompts are held out from every draft's training: the user turns of the built-in chat
corpus's eval split (stories, letters, advice, role-play, poems, trips: hub/corpus.py), a
family train-draft never sees (it writes its own prompts), rendered with the model's chat
template (plain text when it has none). Each request decodes exactly ``output_len`` tokens
(EOS ignored), all of a batch arriving at once; one warm-up batch, then ``reps`` measured
ones, each run once untimed first when reps > 1 (a GPU's): a prompt length or table width first
seen in a timed batch could still cost a kernel compile, about a second, in a batch of a few
hundred milliseconds. The plain and the speculative engine (the draft's tree under the given policy) are loaded
side by side with the same shape, their KV caches sized to the workload, and their batches
alternate (plain, speculative, plain, ...), so that a drift in time hits both alike.

Each timed batch's pair of runs also gives a speedup of its own (``speedup_pairs``, over every
batch of every order); their standard error of the mean (``speedup_se``) says how far the case's
speedup would move between runs. On the H100 the same cell read 0.95x and 0.99x in two runs of one
machine (thirty-eighth session).

``load="continuous"`` measures a busy server instead of waves: the ``reps`` batches' requests
all arrive at once and at most ``batch size`` run together, so a finished sequence's place goes
to a waiting request. Their output lengths are spread evenly over half to one and a half times
``output_len`` (``spread_lengths``, the same for both engines), as a server's requests are: with
equal lengths the draft-less engine's requests would finish together and be admitted as waves
again, never paying the prefill steps of staggered arrivals that the speculative engine pays
(H200, nineteenth session: 0.43-0.46x at batch 32 and 64 with equal lengths). Its warm-up is
the timed stream itself, run once untimed: the mixed steps (a prefill beside decodes) bring
shapes the waves never run, and a kernel compiled on first sight inside the timed stream costs
about a second. With waves, the
sequences that speculated finish first and the wave's tail runs steps of fewer sequences at
nearly a full step's cost, which a draft-less engine's wave of equal lengths never does (H200,
eighteenth session: at batch 8 the speculative steps won 25% and the run still lost 9%, the
waves' tails a likely part of it, not yet measured apart).
On a GPU each case is then measured twice, the engines built plain first and then speculative first,
and the times summed: the same decode graph replayed up to 12% slower in whichever engine a
process built second (H200, eleventh session), a bias that alternating batches does not remove
(the speculative engine, built second, measured 0.91-0.95x of plain while it hardly speculated).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..errors import UserError
from ..hub.corpus import texts
from ..hub.loader import resolve_model
from ..runtime.config import EngineConfig
from ..runtime.llm import LLM
from ..runtime.loader import checkpoint_kind
from ..runtime.sampling_params import SamplingParams

_USER = ("<|im_start|>user\n", "<|im_end|>")
LOADS = ("waves", "continuous")


def heldout_user_prompts() -> list[str]:
    """The user turns of the chat corpus's eval split, in file order."""
    out = []
    for doc in texts("chat", "eval"):
        start = doc.find(_USER[0])
        if start < 0:
            continue
        start += len(_USER[0])
        end = doc.find(_USER[1], start)
        if end > start:
            out.append(doc[start:end].strip())
    return out


def render_prompts(llm: LLM, count: int, offset: int = 0) -> list[list[int]]:
    """count held-out prompts (cycling, from offset) as token ids for llm's model."""
    users = heldout_user_prompts()
    chat = bool(getattr(llm.tokenizer, "chat_template", None))
    out = []
    for i in range(count):
        u = users[(offset + i) % len(users)]
        out.append(llm.chat_prompt([{"role": "user", "content": u}]) if chat else llm.tokenizer(u)["input_ids"])
    return out


def case_prompts(llm: LLM, batch_size: int, reps: int) -> list[list[int]]:
    """A batch size's requests, one warm-up batch and then reps timed ones, from 17 x batch_size in the held-out
    list (apart from the other batch sizes')."""
    return render_prompts(llm, batch_size * (reps + 1), offset=17 * batch_size)


def _batch(llm: LLM, prompts, params) -> tuple[float, int, list[list[int]]]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    ids = [o.outputs[0].token_ids for o in outs]
    return seconds, sum(len(i) for i in ids), ids


# counters summed over a case's batches: the speculative engine's, and where each engine's time went
_SUMMED = ("seq_steps", "drafted", "accepted", "steps", "spec_ms", "plain_ms", "plain_parts", "fused_steps",
           "fused_ms", "caught_up_steps", "catch_up_rows", "catch_up_ms", "explored", "split_steps")


def _spec_counts(llm: LLM) -> dict:
    st = llm.engine.stats().speculation
    return {k: st[k] for k in _SUMMED} | {"histogram": list(st["histogram"]),
                                          "steps_by_size": dict(st["steps_by_size"])}


def _delta(after: dict, before: dict) -> dict:
    h = [a - (before["histogram"][i] if i < len(before["histogram"]) else 0) for i, a in enumerate(after["histogram"])]
    sizes = {n: c - before["steps_by_size"].get(n, 0) for n, c in after["steps_by_size"].items()}
    return {k: after[k] - before[k] for k in _SUMMED} | {
        "histogram": h, "steps_by_size": {n: c for n, c in sorted(sizes.items()) if c}}


def spread_lengths(n: int, mean: int) -> list[int]:
    """n output lengths evenly spread over [mean / 2, 3 mean / 2] (at least 1), in a fixed
    shuffled order: a continuous load's requests, the same for both engines."""
    lo, hi = max(1, mean // 2), max(1, (3 * mean) // 2)
    lengths = [lo + (hi - lo) * i // max(1, n - 1) for i in range(n)]
    random.Random(0).shuffle(lengths)
    return lengths


@contextlib.contextmanager
def _running_at_most(engines: dict, n: int):
    """Each engine's scheduler runs at most n sequences at once while inside."""
    saved = {k: llm.engine.scheduler.config for k, llm in engines.items()}
    try:
        for k, llm in engines.items():
            llm.engine.scheduler.config = dataclasses.replace(saved[k], max_num_seqs=n)
        yield
    finally:
        for k, llm in engines.items():
            llm.engine.scheduler.config = saved[k]


def _exec(llm: LLM) -> tuple[int, float]:
    """The engine's steps run so far and their wall milliseconds in the model runner."""
    r = llm.engine.runner
    return r.exec_steps, r.exec_ms


def _engine_args(batch_sizes, output_len, device, dtype, max_prompt, max_len: int | None = None) -> dict:
    """Both engines' shape; on a GPU a KV cache of the blocks the largest batch needs (room for
    the speculative lookahead included), so that the two fit side by side. output_len: the longest
    request's; max_len (None: the longest prompt + output_len + 64, room for a tree of 41 nodes
    to the end)."""
    max_len = max_len or max_prompt + output_len + 64
    # no prefix caching: a timed batch repeats its warm-up's prompts and must prefill them again
    args = dict(device=device, dtype=dtype, quantized_linear="kernel", max_num_seqs=max(batch_sizes),
                max_model_len=max_len, enable_prefix_caching=False)
    if str(device).startswith("cuda"):
        args["num_kv_blocks"] = EngineConfig.kv_blocks_for(max(batch_sizes), max_len)
    return args


def measure_speculation(model: str, draft: str, batch_sizes: Sequence[int], output_len: int, device: str = "cpu",
                        dtype: str = "auto", temperatures: Sequence[float] = (0.0, 1.0), reps: int = 1,
                        policy: str = "auto", spec_options: dict | None = None, progress: bool = False,
                        both_orders: bool | None = None, load: str = "waves", admit_group: int = 8,
                        max_model_len: int | None = None) -> list[dict]:
    """One row per (temperature, batch size): plain_tok_s, spec_tok_s, speedup, tau, histogram,
    accept_at_depth, identical (greedy) and the counts behind them (see the module docstring).
    load: "waves" (each batch's requests together, the next batch after) or "continuous" (all
    requests at once, at most batch size running).
    both_orders (None: on a GPU): every case measured twice, the engines built plain first, then
    speculative first, their times summed (the module docstring says why)."""
    if both_orders is None:
        both_orders = str(device).startswith("cuda")
    if not Path(draft).is_dir():
        raise UserError(f"--draft {draft}: not a folder")
    for t in temperatures:
        if not t >= 0:
            raise UserError(f"temperature {t!r} is not allowed; allowed: a number >= 0")
    if load not in LOADS:
        raise UserError(f"load {load!r} is not allowed; allowed: {', '.join(LOADS)}")
    plain = LLM(str(model), **_engine_args(batch_sizes, output_len, device, dtype, 1))
    prompts = {bs: case_prompts(plain, bs, reps) for bs in batch_sizes}
    longest = max(len(p) for ps in prompts.values() for p in ps)
    del plain
    _free()
    cases = [(t, bs) for t in temperatures for bs in batch_sizes]
    results: dict[tuple, dict] = {(t, bs): {} for t, bs in cases}
    orders = [("plain", "spec"), ("spec", "plain")] if both_orders else [("plain", "spec")]
    bar = _bar(len(cases) * len(orders)) if progress else None
    # the longest request: a continuous load's lengths reach 1.5x output_len. (Sized for output_len, the
    # longer third of them ran their last ~40 tokens too near max_model_len for a tree, plain beside
    # the others' trees: split steps in most steps of an H100 run at batch 64)
    most = max(spread_lengths(max(batch_sizes) * reps, output_len)) if load == "continuous" else output_len
    if max_model_len is not None and max_model_len < longest + most:
        raise UserError(f"--spec-max-len {max_model_len} is not allowed: the longest prompt ({longest} tokens) and "
                        f"output ({most}) need {longest + most}")
    args = _engine_args(batch_sizes, most, device, dtype, longest, max_model_len) | {"admit_group": admit_group}
    build = {"plain": lambda: LLM(str(model), **args),
             "spec": lambda: LLM(str(model), **args, draft=str(draft), spec_policy=policy, **(spec_options or {}))}
    try:
        for order in orders:
            engines = {}
            try:
                for label in order:
                    engines[label] = build[label]()
                _measure_pass(engines, cases, prompts, reps, output_len, results, bar, load)
            finally:
                engines.clear()
                _free()
    finally:
        if bar is not None:
            bar.close()
    rows = []
    for t, bs in cases:
        r = results[(t, bs)]
        for label in ("plain", "spec"):
            sec = r[f"{label}_seconds"]
            r[f"{label}_tok_s"] = r[f"{label}_tokens"] / sec if sec > 0 else None
        c = r["counts"]
        steps, hist = c["seq_steps"], c["histogram"]
        at_depth = [sum(hist[d:]) / steps if steps else None for d in range(1, len(hist))]
        rows.append(dict(
            batch_size=bs, temperature=t, output_len=output_len, requests=bs * reps, load=load, admit_group=admit_group,
            max_model_len=args["max_model_len"],
            output_lens=spread_lengths(bs * reps, output_len) if load == "continuous" else None,
            plain_tok_s=r["plain_tok_s"], spec_tok_s=r["spec_tok_s"],
            speedup=r["spec_tok_s"] / r["plain_tok_s"] if r["plain_tok_s"] and r["spec_tok_s"] else None,
            speedup_pairs=r.get("pairs", []), speedup_se=pair_se(r.get("pairs", [])),
            tau=(c["accepted"] + steps) / steps if steps else None, spec_seq_steps=steps, drafted=c["drafted"],
            accepted=c["accepted"], histogram=hist, accept_at_depth=at_depth, steps_by_size=c["steps_by_size"],
            explored=c["explored"],
            identical=(r["plain_ids"] == r["spec_ids"]) if t == 0 else None, cost_ms=r.get("cost_ms"),
            cost_sampled_ms=r.get("cost_sampled_ms"), catch_up_model=r.get("catch_up_model"),
            policy_state=r.get("policy_state"), time=_time_split(r, c),
            **(_identity(r["margins"]) if t == 0 else {}),
        ))
    return rows


def pair_se(ratios: Sequence[float]) -> float | None:
    """The standard error of the mean of a case's per-batch speedups (each timed batch's spec tok/s
    over the plain engine's for the same requests, alternating): the run's own noise, against
    which a speedup of 0.97x or 0.99x is read. None below two batches."""
    n = len(ratios)
    if n < 2:
        return None
    mean = sum(ratios) / n
    return (sum((x - mean) ** 2 for x in ratios) / (n - 1) / n) ** 0.5


def _time_split(r: dict, c: dict) -> dict:
    """Where each engine's measured seconds went (milliseconds summed over the timed batches):
    steps, their time in the model runner (host sync included) and the rest (scheduling, output
    bookkeeping: the host's); for the speculative engine also its speculative parts of steps
    (catch-ups of the draft included), its plain parts, its fused steps (plain rows verified in
    the speculative rows' forward: whole steps), and the catch-ups' counts."""
    out = {}
    for label in ("plain", "spec"):
        total = 1e3 * r[f"{label}_seconds"]
        out[label] = {"steps": r.get(f"{label}_steps", 0), "total_ms": total,
                      "runner_ms": r.get(f"{label}_exec_ms", 0.0), "host_ms": total - r.get(f"{label}_exec_ms", 0.0)}
    out["spec"] |= {"spec_steps": c["steps"], "spec_part_ms": c["spec_ms"], "plain_parts": c["plain_parts"],
                    "plain_part_ms": c["plain_ms"], "split_steps": c["split_steps"],
                    "fused_steps": c["fused_steps"], "fused_ms": c["fused_ms"],
                    "caught_up_steps": c["caught_up_steps"],
                    "catch_up_rows": c["catch_up_rows"], "catch_up_ms": c["catch_up_ms"]}
    return out


def _measure_pass(engines: dict, cases, prompts, reps: int, output_len: int, results: dict, bar,
                  load: str = "waves") -> None:
    """Every case on one pair of engines (built in the order of ``engines``), added into results:
    seconds and tokens per engine summed over passes, the first pass's token ids, the counts.
    load "continuous": the timed batches run as one stream of requests, bs at a time."""
    spec = engines["spec"].engine.runner.spec
    table = getattr(spec, "cost_table", None)  # the adaptive policy's start-up profile
    for t, bs in cases:
        params = SamplingParams(temperature=t, max_tokens=output_len, ignore_eos=True, detokenize=False)
        batches = [prompts[bs][r * bs:(r + 1) * bs] for r in range(reps + 1)]
        timed = batches[1:] if load == "waves" else [[p for b in batches[1:] for p in b]]
        timed_params = params if load == "waves" else [
            dataclasses.replace(params, max_tokens=n) for n in spread_lengths(len(timed[0]), output_len)]
        for llm in engines.values():  # warm-up
            if load == "waves":
                for b in batches if reps > 1 else batches[:1]:
                    _batch(llm, b, params)
            else:  # the timed stream itself: its mixed steps' shapes (kernel compiles) come first here
                with _running_at_most({"one": llm}, bs):
                    _batch(llm, timed[0], timed_params)
        before = _spec_counts(engines["spec"])
        r = results[(t, bs)]
        first = "plain_ids" not in r
        ids: dict[str, list] = {"plain": [], "spec": []}
        with _running_at_most(engines, bs) if load == "continuous" else contextlib.nullcontext():
            for b in timed:  # alternating, so that a drift hits both alike
                rate = {}
                for label, llm in engines.items():
                    steps0, ms0 = _exec(llm)
                    sec, n, out = _batch(llm, b, timed_params)
                    steps1, ms1 = _exec(llm)
                    r[f"{label}_seconds"] = r.get(f"{label}_seconds", 0.0) + sec
                    r[f"{label}_tokens"] = r.get(f"{label}_tokens", 0) + n
                    r[f"{label}_steps"] = r.get(f"{label}_steps", 0) + steps1 - steps0
                    r[f"{label}_exec_ms"] = r.get(f"{label}_exec_ms", 0.0) + ms1 - ms0
                    ids[label] += out
                    rate[label] = n / sec if sec > 0 else None
                if rate["plain"] and rate["spec"]:  # this batch's pair (its spread: speedup_se)
                    r.setdefault("pairs", []).append(rate["spec"] / rate["plain"])
        delta = _delta(_spec_counts(engines["spec"]), before)
        if first:
            for label in ids:
                r[f"{label}_ids"] = ids[label]
            r["counts"] = delta
            r["cost_ms"] = None if table is None else {"batches": table.batches, "ms": table.ms}
            pol = spec.policy
            # the catch-up's start-up fit and how far the case's measured catch-ups moved it
            r["catch_up_model"] = None if pol is None or pol.catch_up is None else {
                "c0_ms": pol.catch_up[0], "c1_ms_a_row": pol.catch_up[1], "measured_ratio": pol.catch_up_ratio}
            # what the policy had learnt by the end of the case (its estimates and cost ratios: why it
            # chose what it chose), and the sampled steps' own start-up profile
            r["policy_state"] = None if pol is None else pol.snapshot()
            sampled_table = getattr(spec, "cost_table_sampled", None)
            r["cost_sampled_ms"] = None if sampled_table is None else {"batches": sampled_table.batches,
                                                                       "ms": sampled_table.ms}
            if t == 0:
                r["margins"] = _divergence_margins(engines["spec"], [p for b in batches[1:] for p in b],
                                                   r["plain_ids"], r["spec_ids"])
        else:  # a later pass: its counts join the first's
            c = r["counts"]
            for k in _SUMMED:
                c[k] += delta[k]
            h = c["histogram"]
            for i, v in enumerate(delta["histogram"]):
                if i >= len(h):
                    h.append(0)
                h[i] += v
            for size, v in delta["steps_by_size"].items():
                c["steps_by_size"][size] = c["steps_by_size"].get(size, 0) + v
        if bar is not None:
            bar.update(1)


def _divergence_margins(llm: LLM, prompts, plain_ids, spec_ids) -> list[float | None]:
    """Per sequence: None where both runs gave the same tokens, else the target's top-2 log-prob
    margin at the first position where they part (prompt + the common part, scored once)."""
    firsts = [next((j for j, (a, b) in enumerate(zip(x, y)) if a != b), min(len(x), len(y))) if x != y else None
              for x, y in zip(plain_ids, spec_ids)]
    todo = [(i, list(p) + plain_ids[i][:j]) for i, (p, j) in enumerate(zip(prompts, firsts)) if j is not None]
    out: list[float | None] = [None] * len(prompts)
    if not todo:
        return out
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=2, detokenize=False)
    for (i, _), o in zip(todo, llm.generate([p for _, p in todo], params)):
        top = sorted(o.outputs[0].logprobs[0].values(), reverse=True)
        out[i] = top[0] - top[1] if len(top) > 1 else float("inf")
    return out


def _identity(margins: list[float | None]) -> dict:
    """same_seqs / seqs, and the largest top-2 margin where a sequence parted (None: none did)."""
    parted = [m for m in margins if m is not None]
    return dict(same_seqs=len(margins) - len(parted), seqs=len(margins),
                max_divergence_margin=max(parted) if parted else None)


def evaluate_speculation(models: Sequence[str], draft: str, batch_sizes: Sequence[int], output_len: int,
                         device: str = "cpu", dtype: str = "auto", temperatures: Sequence[float] = (0.0, 1.0),
                         reps: int = 1, policy: str = "auto", spec_options: dict | None = None,
                         progress: bool = True, on_model: Callable[[list[dict]], None] | None = None,
                         load: str = "waves", admit_group: int = 8, max_model_len: int | None = None) -> list[dict]:
    """measure_speculation for each model with the one draft: [{"speculation": rows, "scheme",
    "seconds"}], as eval's other measurements return them. on_model(results so far) runs after
    each model but the last (eval rewrites its partial report there). max_model_len: both engines'
    (None: room for the longest request and a tree of 41 nodes)."""
    from ..runtime.models.draft import read_draft_config

    method = read_draft_config(draft)["method"]  # a bad folder is one line before anything loads
    out = []
    for name in models:
        t0 = time.perf_counter()
        rows = measure_speculation(name, draft, batch_sizes, output_len, device, dtype, temperatures, reps, policy,
                                   spec_options, progress, load=load, admit_group=admit_group,
                                   max_model_len=max_model_len)
        for r in rows:
            r.update(draft=str(draft), draft_method=method, policy=policy, spec_options=dict(spec_options or {}))
        out.append(dict(speculation=rows, scheme=checkpoint_kind(resolve_model(name)),
                        seconds=time.perf_counter() - t0))
        if on_model is not None and len(out) < len(models):
            on_model(list(out))
    return out


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="speculation", unit="run")
