"""End-to-end decode benchmark on the GPU: the optllm runtime against HF transformers.

    python benchmarks/decode.py [--cases smol,8b-bf16,8b-w4a16,serve256] [--quick] [--out DIR]

Cases (greedy, EOS ignored, prompts of 32 random tokens; fresh prompts per repetition):
  smol:     SmolLM2-135M-Instruct's shape, random weights (speed does not depend on the
            values: greedy, EOS ignored), bf16, bs = 1 and 64
  8b-bf16:  a Llama-3-8B-shaped model, random weights, bf16, bs = 1 and 64
  8b-w4a16: the same shape as a W4A16 g128 checkpoint (random int4 codes), bs = 1 and 64
  smol-w4a16: SmolLM2-135M's shape as a W4A16 g64 checkpoint (LM head bf16), bs = 1 and 64
  serve256: 256 requests, prompt and output lengths uniform in [100, 1024] (seed 0), 8B bf16
Peers in the same run (--peers all): HF `generate` with a static cache (transformers compiles
that decode step itself; the first call, compile included, is reported apart) and HF eager
with its dynamic cache, on the same model shape and batch; --peers eager runs HF eager at
bs = 1 only (the static cache's compiles take a minute each). For serve256 HF eager runs the first 64
requests as one left-padded batch (each request counted for its own output length only).
Roofline: bytes a decode step must move (every weight read once -- the embedding table
excepted, unless tied to the LM head -- plus the KV cache of every sequence) / 4.27 TB/s.
tok/s counts generated tokens over the whole call (prefill included, as HF's generate is
timed); "decode tok/s" is ours from the first to the last token. "gpu/step" is the CUDA-graph
replay's GPU time per decode step (CUDA events): wall step time minus it is host time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
import traceback
from pathlib import Path

import torch

from optllm.benchmarks.common import BW, LLAMA3_8B, SMOLLM2, provenance, shape_folder
from optllm.eval.speed import weight_bytes as step_bytes  # what one decode step reads


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------- models
def hf_model(cfg: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "torch_dtype")})
    with torch.device("cuda"):
        m = LlamaForCausalLM(c).to(torch.bfloat16).eval()
    for p in m.parameters():
        p.data.normal_(0, 0.02)
    return m


# ----------------------------------------------------------------------------- timing
def ours_decode(llm, bs, prompt_len, new, reps=3, seed=0):
    from optllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new, min_tokens=new, ignore_eos=True, detokenize=False)
    vocab = llm.engine.runner.vocab_size
    rng = random.Random(seed)
    best = None
    for r in range(reps + 1):  # the first run warms up
        prompts = [[rng.randrange(100, min(vocab, 30000)) for _ in range(prompt_len)] for _ in range(bs)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        row = dict(s=dt, tok_s=bs * new / dt, decode_tok_s=bs * (new - 1) / max(last - first, 1e-9))
        if r and (best is None or row["s"] < best["s"]):
            best = row
    best["gpu_step_us"] = graph_step_us(llm, bs)
    return best


def graph_step_us(llm, bs):
    graphs = llm.engine.runner.graphs
    if graphs is None or graphs.bucket(bs) is None:
        return None
    g = graphs.graphs[graphs.bucket(bs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(20):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return 1000 * start.elapsed_time(end) / 20


def hf_decode(m, bs, prompt_len, new, mode):
    ids = torch.randint(100, 1000, (bs, prompt_len), device="cuda")
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    if mode == "static":
        kw["cache_implementation"] = "static"
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = m.generate(ids, **kw)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        assert out.shape[1] == prompt_len + new
    best = min(times[1:])
    return dict(s=best, tok_s=bs * new / best, first_call_s=times[0])


# ----------------------------------------------------------------------------- cases
def decode_case(name, llm_kw, hf_factory, sizes, quick, rows, peers="all"):
    from optllm import LLM

    llm = LLM(**llm_kw)
    wbytes = step_bytes(llm)
    kv_tok = llm.engine.runner.kv_spec.bytes_per_token()
    for bs, new in sizes:
        ctx = 32 + new / 2
        step = wbytes + bs * ctx * kv_tok
        r = dict(model=name, bs=bs, new=new, engine="optllm")
        try:
            r.update(ours_decode(llm, bs, 32, new))
        except Exception as e:
            r["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
        r["roofline_tok_s"] = bs * BW / step
        r["roofline_pct"] = 100 * r.get("decode_tok_s", 0) / r["roofline_tok_s"]
        r["weight_gb"] = wbytes / 1e9
        rows.append(r)
        log(json.dumps(r))
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    if peers == "none" or hf_factory is None:
        return
    m = hf_factory()
    for mode in ("static", "eager") if peers == "all" else ("eager",):
        for bs, new in sizes:
            if (quick or peers == "eager") and mode == "eager" and bs > 1:
                continue
            r = dict(model=name, bs=bs, new=new, engine=f"hf-{mode}")
            try:
                r.update(hf_decode(m, bs, 32, new, mode))
            except Exception as e:
                r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(r)
            log(json.dumps(r))
    del m
    gc.collect()
    torch.cuda.empty_cache()
    torch._dynamo.reset()


def serve_case(root, rows, quick, peers):
    from optllm import LLM, SamplingParams

    rng = random.Random(0)
    n = 64 if quick else 256
    reqs = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
    prompts = [[rng.randrange(100, 30000) for _ in range(p)] for p, _ in reqs]
    params = [SamplingParams(temperature=0, max_tokens=o, min_tokens=o, ignore_eos=True, detokenize=False)
              for _, o in reqs]
    llm = LLM(shape_folder(root, "llama3-8b-bf16", LLAMA3_8B), load_format="dummy", max_num_seqs=256,
              max_num_batched_tokens=8192, max_model_len=2048)
    runner = llm.engine.runner
    wbytes, kv_tok = step_bytes(llm), runner.kv_spec.bytes_per_token()
    steps = []
    execute = runner.execute

    def counted(batch, execute=execute):
        steps.append(sum(s.num_computed_tokens + k for s, k in zip(batch.seqs, batch.num_new_tokens)))
        return execute(batch)

    llm.generate(prompts[:8], params[:8])  # warm-up
    runner.execute = counted
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    runner.execute = execute
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ideal = sum(wbytes + kv * kv_tok for kv in steps) / BW
    ttft = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outs)
    r = dict(model="llama3-8b-bf16", case=f"{n} requests", engine="optllm", s=dt, tok_s=out_tokens / dt,
             steps=len(steps), step_roofline_pct=100 * ideal / dt, out_tokens=out_tokens,
             ttft_p50=ttft[len(ttft) // 2], ttft_p99=ttft[int(len(ttft) * 0.99)])
    rows.append(r)
    log(json.dumps(r))
    del llm, runner, execute, counted  # every reference to the engine, or its KV cache stays
    gc.collect()
    torch.cuda.empty_cache()
    if peers != "all":
        return
    # HF eager: the first 64 requests as one left-padded batch
    m = hf_model(LLAMA3_8B)
    k = min(64, n)
    plen = max(p for p, _ in reqs[:k])
    ids = torch.zeros(k, plen, dtype=torch.long)
    mask = torch.zeros(k, plen, dtype=torch.long)
    for i, p in enumerate(prompts[:k]):
        ids[i, plen - len(p):] = torch.tensor(p)
        mask[i, plen - len(p):] = 1
    new = max(o for _, o in reqs[:k]) if not quick else 128
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    m.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=new, min_new_tokens=new, do_sample=False,
               pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    useful = sum(min(o, new) for _, o in reqs[:k])
    r = dict(model="llama3-8b-bf16", case=f"first {k} requests, one padded batch", engine="hf-eager", s=dt,
             tok_s=useful / dt, out_tokens=useful)
    rows.append(r)
    log(json.dumps(r))
    del m
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- report
def table(rows) -> str:
    head = ("| model | case | engine | tok/s | decode tok/s | roofline tok/s | % roofline | gpu/step µs | s | note |\n"
            "|---|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        case = r.get("case") or f"bs={r['bs']} new={r['new']}"
        f = lambda k, fmt="{:.1f}": fmt.format(r[k]) if r.get(k) is not None else "–"  # noqa: E731
        pct = f("roofline_pct") if "roofline_pct" in r else f("step_roofline_pct")
        note = r.get("error", "") or (f"first call {r['first_call_s']:.1f} s" if "first_call_s" in r else "")
        lines.append(f"| {r['model']} | {case} | {r['engine']} | {f('tok_s')} | {f('decode_tok_s')} | "
                     f"{f('roofline_tok_s')} | {pct} | {f('gpu_step_us')} | {f('s', '{:.2f}')} | {note} |")
    return head + "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="smol,8b-bf16,8b-w4a16,serve256")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--peers", default="all", choices=("all", "eager", "none"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--root", type=Path, default=Path("/tmp/optllm-bench"))
    ap.add_argument("--tag", default="", help="output file stem (default decode)")
    a = ap.parse_args()
    cases = a.cases.split(",")
    bad = set(cases) - {"smol", "smol-w4a16", "8b-bf16", "8b-w4a16", "serve256"}
    if bad:
        raise SystemExit(f"unknown case(s) {', '.join(sorted(bad))}; allowed: smol, smol-w4a16, 8b-bf16, 8b-w4a16, "
                         "serve256")
    info = provenance()
    log(json.dumps(info))
    rows: list[dict] = []
    new = 64 if a.quick else 128
    for case in cases:
        try:
            if case == "smol":
                folder = shape_folder(a.root, "smollm2-135m-shape", SMOLLM2)
                decode_case("smollm2-135m", dict(model=str(folder), load_format="dummy", max_num_seqs=64,
                                                 max_model_len=2048),
                            lambda: hf_model(SMOLLM2), [(1, new), (64, new)], a.quick, rows, a.peers)
            elif case == "smol-w4a16":  # W4A16 g64 (SmolLM2's 576 is not a multiple of 128), tied LM head bf16
                folder = shape_folder(a.root, "smollm2-135m-w4a16-shape", SMOLLM2, w4a16=True, group=64)
                decode_case("smollm2-135m-w4a16", dict(model=str(folder), load_format="dummy", max_num_seqs=64,
                                                       max_model_len=2048),
                            None, [(1, new), (64, new)], a.quick, rows, "none")
            elif case == "8b-bf16":
                folder = shape_folder(a.root, "llama3-8b-bf16", LLAMA3_8B)
                decode_case("llama3-8b-bf16", dict(model=str(folder), load_format="dummy", max_num_seqs=64,
                                                   max_model_len=2048),
                            lambda: hf_model(LLAMA3_8B), [(1, new), (64, new)], a.quick, rows, a.peers)
            elif case == "8b-w4a16":
                folder = shape_folder(a.root, "llama3-8b-w4a16", LLAMA3_8B, w4a16=True)
                decode_case("llama3-8b-w4a16", dict(model=str(folder), load_format="dummy", max_num_seqs=64,
                                                    max_model_len=2048),
                            None, [(1, new), (64, new)], a.quick, rows, "none")
            else:
                serve_case(a.root, rows, a.quick, a.peers)
        except Exception as e:
            traceback.print_exc()
            rows.append(dict(model=case, case="-", engine="optllm", error=f"{type(e).__name__}: {str(e)[:300]}"))
    a.out.mkdir(parents=True, exist_ok=True)
    tag = a.tag or "decode"
    (a.out / f"{tag}.json").write_text(json.dumps(dict(info=info, rows=rows), indent=1))
    md = "\n".join(f"- {k}: {v}" for k, v in info.items()) + "\n\n" + table(rows)
    (a.out / f"{tag}.md").write_text(md)
    log(md)


if __name__ == "__main__":
    main()
