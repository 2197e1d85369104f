"""Where a quantized checkpoint's kernels part from their torch reference, layer by layer (issue 14
part 8: perplexity through the kernels must equal the reference path within 0.1%).

    python benchmarks/kernel_vs_ref_layers.py CKPT [--device cuda] [--dtype float32] [--tokens 512]

Two engines on the same checkpoint, quantized_linear="kernel" (the Triton kernels on CUDA) and
"dequant" (each method's torch reference). One prompt (the first TOKENS tokens of the built-in docs
evaluation text) runs through the reference engine with every linear's input captured; each
kernel-engine linear is then applied to exactly its reference twin's input, so a row measures that
layer's kernel alone, not the error it inherited. Prints per linear the relative difference
‖y_kernel − y_ref‖ / ‖y_ref‖ and the largest element difference over the largest |y_ref|, worst
first, then the prompt's last-position logits difference end to end.
"""

from __future__ import annotations

import argparse

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()

    from optllm import LLM, SamplingParams
    from optllm.hub.corpus import eval_text
    from optllm.runtime.layers.linear import LinearBase

    # two engines in one process: each gets a KV cache just big enough for the prompt (the memory
    # check of a second engine sized by gpu_memory_utilization counts the first one's cache as used)
    kw = dict(device=a.device, dtype=a.dtype, enforce_eager=True, max_model_len=a.tokens + 16,
              num_kv_blocks=a.tokens // 16 + 4)
    ref = LLM(a.model, quantized_linear="dequant", **kw)
    ker = LLM(a.model, quantized_linear="kernel", **kw)
    ids = ref.tokenizer(eval_text("docs"))["input_ids"][: a.tokens]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20, detokenize=False)

    ref_model, ker_model = ref.engine.runner.model, ker.engine.runner.model
    linears = {n: m for n, m in ref_model.named_modules() if isinstance(m, LinearBase)}
    twins = dict(ker_model.named_modules())
    captured: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def hook(name):
        def run(mod, args, out):
            if name not in captured:  # the prompt's prefill: the first call
                captured[name] = (args[0].detach().clone(), out.detach().clone())
        return run

    handles = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    out_ref = ref.generate([ids], params)[0].outputs[0]
    for h in handles:
        h.remove()
    rows = []
    with torch.no_grad():
        for name, (x, y_ref) in captured.items():
            twin = twins[name]
            y = twin(x).float()
            yr = y_ref.float()
            rel = float((y - yr).norm() / yr.norm().clamp_min(1e-30))
            peak = float((y - yr).abs().max() / yr.abs().max().clamp_min(1e-30))
            rows.append((rel, peak, name, twin.method.describe(twin) if hasattr(twin.method, "describe") else ""))
    rows.sort(reverse=True)
    print(f"{len(rows)} linears, {len(ids)} prompt tokens, {a.device} {a.dtype}")
    print("| linear | method | rel. diff | max diff / max |y_ref| |")
    print("|---|---|---|---|")
    for rel, peak, name, desc in rows[: a.top]:
        print(f"| {name} | {desc} | {rel:.2e} | {peak:.2e} |")
    med = sorted(r[0] for r in rows)[len(rows) // 2] if rows else float("nan")
    print(f"median rel. diff over all linears: {med:.2e}")
    out_ker = ker.generate([ids], params)[0].outputs[0]
    lp_r, lp_k = out_ref.logprobs[0], out_ker.logprobs[0]
    common = set(lp_r) & set(lp_k)
    worst = max((abs(lp_r[t] - lp_k[t]) for t in common), default=float("nan"))
    print(f"end to end, next-token top-20 log-probs: {len(common)} tokens in both, largest |difference| {worst:.2e}; "
          f"greedy token {out_ref.token_ids[0]} (ref) vs {out_ker.token_ids[0]} (kernels)")


if __name__ == "__main__":
    main()
