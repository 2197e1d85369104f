"""Where FP8 / W8A8-INT8 lose perplexity on SmolLM2-135M (issue 14), on the CPU: the HF model with
weights fake-quantized as the runtime forms them (codes x scale in float32), activations quantized
by forward pre-hooks with the runtime's reference quantizers, the same block-by-block calibration
as quant/pipeline.py (16 x 512 built-in tokens), perplexity on the same 8 windows per kind as
`optllm eval --ppl --max-windows 8`. Weights and activations can be quantized apart.

    python benchmarks/fp8_decompose.py float a-fp8-token w-fp8-rtn w-fp8-gptq fp8dyn-rtn

(names from CONFIGS below, or a JSON object with "name"; "a_only", a regex over "layer.name",
limits the activation quantization to the linears it matches; "windows": "all" scores every
window of each kind instead of the first 8); results appended to
fp8_decompose_results.jsonl; docs/bench/fp8_w8a8_cpu.json holds the measured rows."""
import dataclasses
import json
import re
import sys
import time

import torch

from optllm.eval.perplexity import eval_token_stream, perplexity
from optllm.formats.args import QuantArgs
from optllm.formats.float_quantized import FloatQuantizedWeight, fp8_scale, to_e4m3
from optllm.formats.int_quantized import int8_scale, quantize_static_int8
from optllm.hub.architectures import architecture_of
from optllm.hub.loader import load_model
from optllm.kernels.fp8 import quantize_fp8_ref
from optllm.kernels.w8a8_int8 import quantize_per_token_int8_ref
from optllm.quant import smoothquant as sq
from optllm.quant.algorithm import BlockContext, quantize_in_place
from optllm.quant.calib_data import load_calibration
from optllm.quant.fp8 import fp8_quantize_weight, input_absmax
from optllm.quant.gptq import GPTQOptions, gptq_step
from optllm.quant.sequential import advance_block, block_linears, capture_block_inputs, decoder_layers, run_block

torch.manual_seed(0)
OUT = "fp8_decompose_results.jsonl"  # one JSON line per configuration run (in the working folder)
FLOAT = {"docs": 15.3764, "code": 5.5768, "chat": 4.0566}
FLOAT_ALL = {"docs": 15.5922, "code": 8.6035, "chat": 3.8130}  # every window (cfg "windows": "all"), CPU float32
FP8W = QuantArgs(num_bits=8, group_size=None, type="float", strategy="channel")
FP8W_STATIC = dataclasses.replace(FP8W, actorder="static")
INT8W = QuantArgs(num_bits=8, group_size=None, strategy="channel")

model, tok, _ = load_model("smollm2-135m", dtype="float32", device="cpu")
model.eval()
arch = architecture_of(model.config)
layers = decoder_layers(model)
orig = {k: v.clone() for k, v in model.state_dict().items()}
streams = {k: eval_token_stream(tok, k) for k in ("docs", "code", "chat")}
_calib = {}


def calib(n, s):
    if (n, s) not in _calib:
        hold = max(2, n // 8)
        _calib[(n, s)] = load_calibration(tok, "builtin", n + hold, s, 0).input_ids[:n]
    return _calib[(n, s)]


def fp8_mse(w, sdt, grid=(0.8, 1.25, 46), hdiag=None):
    """per row, the scale multiplier r of absmax/448 minimising sum_k d_k (w - q(w))^2 (d = diag H or 1)."""
    wf = w.float()
    base = wf.abs().amax(1, keepdim=True) / 448.0
    best = torch.full((w.shape[0], 1), float("inf"))
    best_s = fp8_scale(wf.abs().amax(1, keepdim=True), sdt)
    d = torch.ones(w.shape[1]) if hdiag is None else hdiag.float()
    for r in torch.linspace(*grid).tolist() + [1.0]:
        s = (base * r).to(sdt).float()
        q = to_e4m3(wf / s).float() * s
        err = ((wf - q).pow(2) * d).sum(1, keepdim=True)
        better = err < best
        best = torch.where(better, err, best)
        best_s = torch.where(better, s.to(sdt), best_s)
    return FloatQuantizedWeight(q=to_e4m3(wf / best_s.float()), scale=best_s, zero=None, args=FP8W)


def step(ctx, cfg):
    """quantize block in place per cfg; return {name: input_scale or None}"""
    wq = cfg.get("w")  # None / fp8-rtn / fp8-gptq / fp8-mse / fp8-mseh / int8-*
    smooth = cfg.get("smooth")  # alpha float or None
    if smooth is not None:
        maps = sq.block_mappings(ctx.mapping, cfg.get("fold", False), list(ctx.linears))
        amax = sq.channel_absmax(ctx.layer, ctx.inputs, maps)
        if smooth == "search":
            opts = sq.SmoothQuantOptions(alpha="search")
            if cfg["a"].startswith("fp8"):
                alpha, _ = search_alpha_fp8(ctx, maps, amax, cfg)
            else:
                alpha, _ = sq.search_alpha(ctx, maps, amax, opts, cfg["a"] == "int8-static")
        else:
            alpha = smooth
        if alpha is not None:
            sq.smooth_block(ctx.layer, ctx.inputs, maps, alpha, amax)
    g = cfg.get("gptq", {})
    gopts = GPTQOptions(**g)
    res = None
    if wq == "fp8-rtn":
        res = quantize_in_place(ctx, lambda n, w: fp8_quantize_weight(w, FP8W, ctx.scale_dtype))
    elif wq == "fp8-mse":
        res = quantize_in_place(ctx, lambda n, w: fp8_mse(w, ctx.scale_dtype))
    elif wq == "fp8-gptq":
        res = gptq_step(dataclasses.replace(ctx, weights=FP8W_STATIC if cfg.get("actorder", True) else FP8W), gopts)
    elif wq == "int8-rtn":
        res = quantize_in_place(ctx, lambda n, w: sq.int8_rtn(w, INT8W, ctx.scale_dtype))
    elif wq == "int8-gptq":
        res = gptq_step(dataclasses.replace(ctx, weights=dataclasses.replace(INT8W, actorder="static")), gopts)
    elif wq is not None:
        raise ValueError(wq)
    if res is not None:  # as the runtime forms them: codes times scale in float32
        with torch.no_grad():
            for n, qw in res.qweights.items():
                ctx.linears[n].weight.copy_(qw.q.float() * qw.scale.float().reshape(-1, 1))
    a = cfg.get("a")
    if a in ("fp8-static", "int8-static"):
        amax = input_absmax(ctx)
        f = fp8_scale if a == "fp8-static" else int8_scale
        return {n: f(torch.tensor([amax[n]]), ctx.scale_dtype).float() for n in ctx.linears}
    return {n: None for n in ctx.linears}


def fake_act(a, x, scale):
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if a.startswith("fp8-group"):  # dynamic E4M3 per token and group of G inputs (the last group may be short)
        gsz = int(a[len("fp8-group"):])
        parts = [quantize_fp8_ref(c) for c in x2.float().split(gsz, dim=1)]
        y = torch.cat([q.float() * sc for q, sc in parts], 1)
    elif a.startswith("fp8"):
        xq, xs = quantize_fp8_ref(x2, scale)
        y = xq.float() * xs.reshape(-1, 1) if scale is None else xq.float() * xs
    elif a == "int8-token":
        xq, xs = quantize_per_token_int8_ref(x2)
        y = xq.float() * xs
    else:
        y = quantize_static_int8(x2, scale).float() * scale
    return y.to(x.dtype).reshape(shape)


def search_alpha_fp8(ctx, maps, amax, cfg):
    ref = run_block(ctx.layer, ctx.inputs)
    original = {k: v.detach().clone() for k, v in ctx.layer.state_dict().items()}
    best = None
    for alpha in [None] + [i / 10 for i in range(11)]:
        if alpha is not None:
            sq.smooth_block(ctx.layer, ctx.inputs, maps, alpha, amax)
        with torch.no_grad():
            for lin in ctx.linears.values():
                qw = fp8_quantize_weight(lin.weight, FP8W, ctx.scale_dtype)
                lin.weight.copy_(qw.q.float() * qw.scale.float())
        scales = None
        if cfg["a"] == "fp8-static":
            am = input_absmax(ctx)
            scales = {n: fp8_scale(torch.tensor([am[n]]), ctx.scale_dtype).float() for n in ctx.linears}
        def hook(n):
            return lambda m, args: (fake_act(cfg["a"], args[0], None if scales is None else scales[n]),)

        hs = [lin.register_forward_pre_hook(hook(n)) for n, lin in ctx.linears.items()]
        err = sq.token_error(run_block(ctx.layer, ctx.inputs), ref)
        for h in hs:
            h.remove()
        if best is None or err < best[0]:
            best = (err, alpha)
        ctx.layer.load_state_dict(original)
    return best[1], None


def run(name, cfg):
    t0 = time.time()
    model.load_state_dict(orig)
    scales = {}
    if cfg.get("w") or cfg.get("a", "").endswith("static") or cfg.get("smooth") is not None:
        ids = calib(cfg.get("n", 16), cfg.get("s", 512))
        inputs = capture_block_inputs(model, ids, 8, torch.device("cpu"))
        for i, layer in enumerate(layers):
            lins = block_linears(layer, arch.block)
            ref = run_block(layer, inputs)
            ctx = BlockContext(layer, i, lins, arch.block, inputs, FP8W, torch.bfloat16)
            for n, s in step(ctx, cfg).items():
                scales[f"{i}.{n}"] = (lins[n], s)
            advance_block(layer, inputs, ref)
    else:
        for i, layer in enumerate(layers):
            for n, lin in block_linears(layer, arch.block).items():
                scales[f"{i}.{n}"] = (lin, None)
    tq = time.time() - t0
    if cfg.get("w") or cfg.get("smooth") is not None:  # the checkpoint's unquantized tensors are bf16
        with torch.no_grad():
            blin = {id(lin.weight) for lin, _ in scales.values()}
            for p in model.parameters():
                if id(p) not in blin:
                    p.copy_(p.to(torch.bfloat16).float())
    hooks = []
    if cfg.get("a"):
        only = re.compile(cfg.get("a_only", ".*"))  # the linears ("i.name") whose inputs are quantized
        for key, (lin, s) in scales.items():
            if only.fullmatch(key):
                hooks.append(lin.register_forward_pre_hook(lambda m, args, s=s: (fake_act(cfg["a"], args[0], s),)))
    res = {"name": name, "cfg": cfg, "quant_s": round(tq, 1)}
    every = cfg.get("windows") == "all"  # every window of each kind, not the first 8
    for kind, ids in streams.items():
        r = perplexity(model, ids, seq_len=512, max_windows=None if every else 8, batch_size=4)
        res[kind] = r.ppl
        res[kind + "_d%"] = 100 * (r.ppl / (FLOAT_ALL if every else FLOAT)[kind] - 1)
    for h in hooks:
        h.remove()
    res["s"] = round(time.time() - t0, 1)
    print(json.dumps(res), flush=True)
    with open(OUT, "a") as f:
        f.write(json.dumps(res) + "\n")


CONFIGS = {
    "float": {},
    "float-all": {"windows": "all"},
    "a-fp8-token-all": {"a": "fp8-token", "windows": "all"},
    "a-fp8-group64-all": {"a": "fp8-group64", "windows": "all"},
    "w-fp8-rtn": {"w": "fp8-rtn"},
    "a-fp8-token": {"a": "fp8-token"},
    # one kind of linear's inputs at a time (a_only: a regex over "layer.name")
    "a-fp8-token-qkv": {"a": "fp8-token", "a_only": r"\d+\.self_attn\.[qkv]_proj"},
    "a-fp8-token-o": {"a": "fp8-token", "a_only": r"\d+\.self_attn\.o_proj"},
    "a-fp8-token-gateup": {"a": "fp8-token", "a_only": r"\d+\.mlp\.(gate|up)_proj"},
    "a-fp8-token-down": {"a": "fp8-token", "a_only": r"\d+\.mlp\.down_proj"},
    "a-fp8-static": {"a": "fp8-static"},
    "fp8dyn-rtn": {"w": "fp8-rtn", "a": "fp8-token"},
    "fp8static-rtn": {"w": "fp8-rtn", "a": "fp8-static"},
    "w-fp8-gptq": {"w": "fp8-gptq"},
    "fp8dyn-gptq": {"w": "fp8-gptq", "a": "fp8-token"},
    "fp8static-gptq": {"w": "fp8-gptq", "a": "fp8-static"},
    "w-fp8-mse": {"w": "fp8-mse"},
    "w-fp8-gptq-plain": {"w": "fp8-gptq", "gptq": {"token_cap": None, "hessian_shrink": 0.0}},
    "w-fp8-gptq-noshrink": {"w": "fp8-gptq", "gptq": {"hessian_shrink": 0.0}},
    "a-fp8-static-sm0.5": {"a": "fp8-static", "smooth": 0.5},
    "a-fp8-token-sm0.5": {"a": "fp8-token", "smooth": 0.5},
    "fp8static-gptq-sm0.5": {"w": "fp8-gptq", "a": "fp8-static", "smooth": 0.5},
    "fp8static-gptq-smsearch": {"w": "fp8-gptq", "a": "fp8-static", "smooth": "search"},
    "fp8dyn-gptq-smsearch": {"w": "fp8-gptq", "a": "fp8-token", "smooth": "search"},
    "w8a8-int8-rtn": {"w": "int8-rtn", "a": "int8-token", "smooth": 0.5},
    "w8a8-int8-gptq": {"w": "int8-gptq", "a": "int8-token", "smooth": 0.5},
    "w8a8-int8-rtn-search": {"w": "int8-rtn", "a": "int8-token", "smooth": "search"},
    "w8a8-int8-gptq-search": {"w": "int8-gptq", "a": "int8-token", "smooth": "search"},
    "w-int8-rtn": {"w": "int8-rtn"},
    "a-int8-token-sm0.5": {"a": "int8-token", "smooth": 0.5},
}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        if name.startswith("{"):
            d = json.loads(name)
            run(d.pop("name"), d)
        else:
            run(name, CONFIGS[name])
