"""How far apart two perplexities of one activation-quantized checkpoint may be for reasons that
are not the kernels (issue 14 part 8): the torch reference (`--dequant`), the same reference with
the embedding table multiplied by (1 + eps * N(0, 1)) per element (eps = 1e-6: float32 rounding
noise, far below any quantization error), and, on CUDA, the Triton kernels, on the same windows
of every text kind, with each pair's relative difference.

Activation quantizers round: an input that moves by one float32 ulp can move a quantized value
by a whole step, and such flips compound over the layers. Where the perturbed reference moves
as far from the reference as the kernels do, a kernel-vs-reference gap of that size is this
noise, not a kernel defect (kernel_vs_ref_layers.py checks each linear on the same input).

    python benchmarks/ref_noise_floor.py CKPT [--device cuda] [--dtype float32] [--max-windows N]
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path

import torch


def perplexities(model: str, linear: str, eps: float, args) -> dict[str, float]:
    from optllm import LLM
    from optllm.eval.evaluate import _sources
    from optllm.eval.perplexity import perplexity, token_stream

    llm = LLM(model, device=args.device, dtype=args.dtype, quantized_linear=linear, max_model_len=args.seq_len,
              max_num_seqs=64, enforce_eager=True)
    if eps:
        emb = llm.engine.runner.model.model.embed_tokens.weight
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        with torch.inference_mode():  # the loader made the weights inference tensors
            noise = torch.randn(emb.shape, generator=g, dtype=torch.float32).to(emb.device)
            emb.mul_((1 + eps * noise).to(emb.dtype))
    out = {}
    for kind, body in _sources(None, None, None).items():
        ids = token_stream(llm.tokenizer, body)
        out[kind] = perplexity(llm, ids, seq_len=args.seq_len, max_windows=args.max_windows).ppl
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--eps", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=None, help="per kind (default: every window)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    runs = {"reference": ("dequant", 0.0), f"reference, embedding x (1 + {args.eps:g} N(0,1))": ("dequant", args.eps)}
    if args.device.startswith("cuda"):
        runs["kernels"] = ("kernel", 0.0)
    ppl = {label: perplexities(args.model, linear, eps, args) for label, (linear, eps) in runs.items()}
    ref = ppl["reference"]
    print(f"{args.model}, {args.device} {args.dtype}, {args.max_windows or 'every'} window(s) of {args.seq_len}")
    print("| run | " + " | ".join(f"{k} ppl (vs reference)" for k in ref) + " |")
    print("|---|" + "---|" * len(ref))
    for label, row in ppl.items():
        cells = [f"{v:.4f} ({(v / ref[k] - 1) * 100:+.3f}%)" for k, v in row.items()]
        print(f"| {label} | " + " | ".join(cells) + " |")
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "device": args.device, "dtype": args.dtype,
                                         "eps": args.eps, "max_windows": args.max_windows, "ppl": ppl}, indent=1))


if __name__ == "__main__":
    main()
