"""Peer comparison: llm-compressor's GPTQ and AWQ on exactly our calibration samples, their
checkpoints' perplexities beside ours on every text kind, all measured by our runtime.

Three subcommands, run with two interpreters (llm-compressor pins transformers <= 5.17, so it
lives in its own virtual environment, .venv-llmc, made by benchmarks/peer_llmcompressor.sh;
nothing of optllm is imported there):

    bash benchmarks/peer_llmcompressor.sh        # once: creates .venv-llmc (pins inside)

    # 1. our venv: the float model exactly as `optllm quantize` loads it (float32, CPU) and the
    #    calibration windows exactly as it cuts them and fits on them (same source, samples,
    #    length, seed, held-out windows: quantize draws num_samples + holdout windows at once)
    .venv/bin/python benchmarks/peer_llmcompressor.py prepare --model smollm2-135m \\
        --out out/peer --num-samples 128 --seq-len 512 [--calib builtin] [--seed 0] [--holdout auto]

    # 2. peer venv: llm-compressor's oneshot on DIR/float with DIR/calib.pt; one checkpoint per
    #    call, written to DIR/llmc-ALGO-wBITS-gGROUP-sym|asym (+ peer.json: times, versions)
    .venv-llmc/bin/python benchmarks/peer_llmcompressor.py quantize --algo gptq --bits 4 \\
        --group-size 64 [--asym] --in out/peer
    .venv-llmc/bin/python benchmarks/peer_llmcompressor.py quantize --algo awq --bits 4 \\
        --group-size 64 --in out/peer
    #    issue 14's activation-quantized peers, llm-compressor's presets (PRESETS below):
    .venv-llmc/bin/python benchmarks/peer_llmcompressor.py quantize --algo fp8-dynamic --in out/peer
    .venv-llmc/bin/python benchmarks/peer_llmcompressor.py quantize --algo w8a8-sq-gptq --in out/peer

    #    (ours, for the same table: the same model, calibration flags and scheme; --asym for
    #    asymmetric, --scheme w4a16-awq for AWQ; --no-compare skips its own RTN comparison)
    .venv/bin/optllm quantize smollm2-135m --scheme w4a16-gptq --group-size 64 --sym \\
        --num-samples 128 --seq-len 512 [--calib builtin --seed 0 --holdout auto] --device cpu \\
        --no-compare --out out/peer/optllm-gptq-w4-g64-sym

    # 3. our venv: perplexity of every folder on the serving runtime, same tokens and windows
    .venv/bin/python benchmarks/peer_llmcompressor.py eval --dirs out/peer/float \\
        out/peer/llmc-* out/peer/optllm-* [--kinds K1 K2] [--seq-len 512 --max-windows N] \\
        --json out/peer/eval.json

eval prints a Markdown table (model, who made it, whether its calibration tokens are the
prepared ones by sha256, perplexity per text kind, its change against the float folder, and
the quantize time: llm-compressor's oneshot call, our report's seconds.quantize; neither
counts loading or saving) and writes it with provenance as JSON. A folder that our runtime
cannot load gets its error (and traceback, in the JSON) instead of a perplexity; the others
still run. Our own checkpoints only count as "same calib tokens" when `optllm quantize`
cut the very tensor that `prepare` saved (same --calib, --num-samples, --seq-len, --seed and
the same corpus and calibration code): their optllm-report.json sha256 says whether it did.

Versions (benchmarks/peer_llmcompressor.sh pins them): llmcompressor 0.14.0.1 (the newest;
it requires transformers >= 5.15, <= 5.17 and compressed-tensors == 0.19.0), transformers
5.17.0, compressed-tensors 0.19.0, torch 2.13.0 (CPU). On a machine without an accelerator,
0.14.0.1's AWQ fails pinning its cached activations ("Cannot access accelerator device when
none is available"); `quantize` makes that pinning a no-op there (it only speeds up
host-to-device copies) and records it in peer.json. Their pack-quantized checkpoints (sym and
asym, zero points packed along the output dim, "actorder": "static" in config.json, tied
embeddings) load in our runtime, and our dequantized weights are bit-equal to
compressed-tensors' own decompression of them.

Matched with `optllm quantize` (defaults of QuantizeConfig):
- calibration samples: the very token tensor (DIR/calib.pt, its sha256 checked again in the
  peer venv and recorded by both sides), as num_samples sequences of seq_len tokens with an
  all-ones attention mask, not shuffled, not re-tokenized (num_calibration_samples = N,
  max_seq_length = L);
- the float model: the same float32 weights (DIR/float is what our loader hands quantize);
- scheme: int weights, num_bits, group strategy with group_size, symmetric or asymmetric
  min-max grid (scale = absmax / ((qmax - qmin) / 2) when symmetric), all Linear layers but
  lm_head (tied to the embeddings: neither side quantizes it);
- GPTQ: dampening 0.01 of the mean Hessian diagonal, act-order "static" (= compressed-tensors
  "weight": columns by decreasing Hessian diagonal, groups kept on their natural columns,
  scales from the original weight, no g_idx; ours: QuantizeConfig.actorder "auto" -> "static"
  for gptq), block size 128, block-by-block calibration whose next block sees the quantized
  block's outputs (their sequential pipeline, propagate_error);
- GPTQ's Hessian, only when ours is told so: llm-compressor uses the paper's
  H = (2/n) Σ x xᵀ; ours by default caps the weight of massive-activation tokens
  (token_cap 16) and shrinks H toward its diagonal (hessian_shrink 0.3). For the same
  algorithm run ours with a recipe holding `token_cap: null` and `hessian_shrink: 0.0`
  (--recipe FILE); with its defaults the table compares ours-as-shipped with theirs;
- AWQ: the same four Llama smoothing pairs (input_layernorm -> q/k/v, v -> o,
  post_attention_layernorm -> gate/up, up -> down; both skip v -> o under grouped-query
  attention, as SmolLM2 has), a 20-point grid with duo scaling, the scale folded into the
  smoothing layer;
- checkpoint dtype: ours stores scales and unquantized tensors in bfloat16; the peer model is
  calibrated in float32 like ours and cast to --dtype (bfloat16) just before saving (the
  stored codes do not change: |q| <= 15, so w / scale moves by < 0.1 of a step).

What cannot be matched (inherent to the two implementations, recorded here, not tuned away):
- GPTQ true-sequential: ours collects each sub-group's Hessians (qkv, o, gate/up, down) with
  the earlier ones already quantized; llm-compressor collects all Hessians of a decoder layer
  in one pass over it (its sequential targets are whole decoder layers).
- GPTQ scales: ours rounds each scale to the checkpoint dtype before choosing codes;
  llm-compressor chooses codes against float32 scales that are rounded when saved.
- AWQ weight clipping: ours searches a per-group clip ratio (AutoAWQ's clip step, max shrink
  0.5, q/k not clipped); llm-compressor's AWQ has no clip search (plain min-max ranges).
- AWQ scale grid: ours always keeps the identity scale (plain RTN) as a candidate and scores
  the grid on at most 2048 sampled calibration tokens; llm-compressor scores all tokens and
  has no identity candidate (α = 0 with duo scaling is 1 / mean|ŵ|, not 1).
- Batching and float summation order (Hessian sums, block forwards) differ, so even an equal
  algorithm would give codes that differ in a few last-bit ties.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

FLOAT_DIR = "float"
CALIB_FILE = "calib.pt"
PREPARE_FILE = "prepare.json"
PEER_FILE = "peer.json"
OUR_REPORT = "optllm-report.json"


def token_hash(input_ids) -> str:
    """SHA-256 of a 2-D id tensor, as optllm.quant.calib_data.token_hash computes it (copied:
    the peer venv does not import optllm; `prepare` checks that the two agree)."""
    import torch

    ids = input_ids.detach().to("cpu", torch.int64).contiguous()
    h = hashlib.sha256(f"{ids.shape[0]}x{ids.shape[1]}:".encode())
    h.update(ids.numpy().astype("<i8", copy=False).tobytes())
    return h.hexdigest()


def _versions(*names: str) -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


# ---------------------------------------------------------------- prepare (our venv)
def cmd_prepare(a: argparse.Namespace) -> None:
    import torch

    from optllm.benchmarks.common import provenance
    from optllm.hub.loader import load_model
    from optllm.quant.calib_data import load_calibration
    from optllm.quant.calib_data import token_hash as optllm_token_hash
    from optllm.quant.config import QuantizeConfig

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # exactly what quant/pipeline.py's quantize() does before calibrating: the float32 model
    # on the CPU, then num_samples + held-out windows drawn in one call, the first
    # num_samples of them fitted on (the held-out ones only measure; llm-compressor gets the
    # fitted ones)
    holdout = a.holdout if a.holdout == "auto" else int(a.holdout)
    cfg = QuantizeConfig(calib=a.calib, num_samples=a.num_samples, seq_len=a.seq_len, seed=a.seed,
                         **({"holdout": holdout} if hasattr(QuantizeConfig, "holdout_windows") else {}))
    n_hold = cfg.holdout_windows() if hasattr(cfg, "holdout_windows") else 0
    model, tokenizer, source = load_model(a.model, dtype="float32", device="cpu")
    t_load = time.perf_counter()
    drawn = load_calibration(tokenizer, cfg.calib, cfg.num_samples + n_hold, cfg.seq_len, cfg.seed,
                             model=model if cfg.calib == "self" else None)
    ids = drawn.input_ids[: cfg.num_samples].to(torch.int64).contiguous()
    sha = optllm_token_hash(ids)
    t_calib = time.perf_counter()
    if token_hash(ids) != sha:
        raise SystemExit("token_hash here disagrees with optllm.quant.calib_data.token_hash: update the copy")

    float_dir = out / FLOAT_DIR
    model.save_pretrained(float_dir)  # safetensors; tied lm_head stays tied
    tokenizer.save_pretrained(float_dir)
    if not list(float_dir.glob("*.safetensors")):
        raise SystemExit(f"{float_dir}: save_pretrained wrote no .safetensors file")
    torch.save({"input_ids": ids, "sha256": sha, "source": drawn.source, "calib": a.calib,
                "num_samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "seed": a.seed,
                "holdout_windows": n_hold, "model": a.model}, out / CALIB_FILE)
    record = {
        "model": a.model, "source_folder": str(source), "float_dir": str(float_dir),
        "float_dtype": "float32",
        "calibration": {"calib": a.calib, "source": drawn.source, "sha256": sha,
                        "num_samples": int(ids.shape[0]), "seq_len": int(ids.shape[1]), "seed": a.seed,
                        "holdout": holdout, "holdout_windows": n_hold},
        "seconds": {"load": t_load - t0, "calibration_data": t_calib - t_load,
                    "save": time.perf_counter() - t_calib},
        "provenance": provenance(),
    }
    _write_json(out / PREPARE_FILE, record)
    print(f"{float_dir}: float32 model + tokenizer")
    print(f"{out / CALIB_FILE}: {ids.shape[0]} x {ids.shape[1]} tokens (+{n_hold} held out, not saved), "
          f"sha256 {sha[:16]}…, {drawn.source}")


# ---------------------------------------------------------------- quantize (peer venv)
def peer_name(algo: str, bits: int, group_size: int, asym: bool) -> str:
    if algo in PRESETS:
        return f"llmc-{algo}"
    return f"llmc-{algo}-w{bits}-g{group_size}-{'asym' if asym else 'sym'}"


# Activation-quantized schemes as llm-compressor's examples make them (its presets; --bits,
# --group-size and --asym do not apply): FP8_DYNAMIC (E4M3 per-channel weights, dynamic
# per-token inputs; no calibration data read) and W8A8 int8 (SmoothQuant, strength 0.8 as its
# example, then GPTQ int8 per-channel weights, dynamic per-token inputs).
PRESETS = ("fp8-dynamic", "w8a8-sq-gptq")


def _config_groups(bits: int, group_size: int, symmetric: bool) -> dict:
    # an explicit scheme (not a preset such as W4A16, which is 4-bit symmetric only)
    return {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                        "weights": {"num_bits": bits, "type": "int", "symmetric": symmetric,
                                    "strategy": "group", "group_size": group_size, "dynamic": False}}}


def build_recipe(algo: str, bits: int, group_size: int, symmetric: bool) -> tuple[list, dict]:
    """The llm-compressor modifiers and a JSON description of their arguments."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    groups = _config_groups(bits, group_size, symmetric)
    ignore = ["lm_head"]
    if algo == "fp8-dynamic":
        args = {"targets": ["Linear"], "scheme": "FP8_DYNAMIC", "ignore": ignore}
        return [QuantizationModifier(**args)], {"QuantizationModifier": args}
    if algo == "w8a8-sq-gptq":
        from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

        sq = {"smoothing_strength": 0.8}
        gq = {"targets": ["Linear"], "scheme": "W8A8", "ignore": ignore}
        return [SmoothQuantModifier(**sq), GPTQModifier(**gq)], {"SmoothQuantModifier": sq, "GPTQModifier": gq}
    if algo == "gptq":
        args = {"config_groups": groups, "ignore": ignore, "dampening_frac": 0.01, "actorder": "static",
                "block_size": 128}
        return [GPTQModifier(**args)], {"GPTQModifier": args}
    try:  # 0.14: AWQ is a transform, followed by the quantizer that it searches scales for
        from llmcompressor.modifiers.transform.awq import AWQModifier
    except ImportError:  # older releases: one modifier that also quantizes
        from llmcompressor.modifiers.awq import AWQModifier

        args = {"config_groups": groups, "ignore": ignore, "duo_scaling": True, "n_grid": 20}
        return [AWQModifier(**args)], {"AWQModifier": args}
    awq_args = {"duo_scaling": True, "n_grid": 20}  # mappings: its defaults for Llama
    q_args = {"config_groups": groups, "ignore": ignore}
    return ([AWQModifier(**awq_args), QuantizationModifier(**q_args)],
            {"AWQModifier": awq_args, "QuantizationModifier": q_args})


def _cpu_workarounds() -> list[str]:
    """Patches llm-compressor needs to run on a machine without an accelerator; returned as
    notes for peer.json. None changes a number, only where a tensor lives."""
    import torch

    notes = []
    if not torch.accelerator.is_available():
        # 0.14.0.1's AWQ pins its cached activations before the grid search (only to speed
        # up host-to-device copies); Tensor.pin_memory() raises "Cannot access accelerator
        # device when none is available" on a CPU-only torch
        from llmcompressor.pipelines.cache import IntermediatesCache

        if hasattr(IntermediatesCache, "pin_memory"):
            IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
            notes.append("IntermediatesCache.pin_memory made a no-op (no accelerator: pinning raises)")
    return notes


def cmd_quantize(a: argparse.Namespace) -> None:
    if "optllm" in sys.modules:
        raise SystemExit("quantize runs in the peer venv, without optllm")
    t0 = time.perf_counter()
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    workarounds = _cpu_workarounds()

    src = Path(a.inp)
    float_dir, calib_path = src / FLOAT_DIR, src / CALIB_FILE
    for p in (float_dir, calib_path):
        if not p.exists():
            raise SystemExit(f"{p} is missing: run `prepare --out {src}` in our venv first")
    out = Path(a.out) if a.out else src / peer_name(a.algo, a.bits, a.group_size, a.asym)
    if out.exists() and any(out.iterdir()) and not a.overwrite:
        raise SystemExit(f"{out} exists; pass --overwrite to replace it")
    calib = torch.load(calib_path, weights_only=True)
    ids = calib["input_ids"]
    if token_hash(ids) != calib["sha256"]:
        raise SystemExit(f"{calib_path}: sha256 of input_ids does not match the recorded one")
    n, seq_len = (int(x) for x in ids.shape)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})

    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(float_dir)
    recipe, recipe_args = build_recipe(a.algo, a.bits, a.group_size, not a.asym)
    t_load = time.perf_counter()
    oneshot_args = {"num_calibration_samples": n, "max_seq_length": seq_len,
                    "shuffle_calibration_samples": False, "batch_size": a.batch_size,
                    "pipeline": "sequential"}
    oneshot(model=model, processor=tokenizer, dataset=ds, recipe=recipe, **oneshot_args)
    t_oneshot = time.perf_counter()
    save_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[a.dtype]
    model.to(save_dtype)  # scales and unquantized tensors, as ours stores them; codes unchanged
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    t_save = time.perf_counter()
    config = json.loads((out / "config.json").read_text())
    record = {
        "tool": "llm-compressor", "algo": a.algo, "bits": a.bits, "group_size": a.group_size,
        "symmetric": not a.asym, "dtype": a.dtype, "recipe": recipe_args, "oneshot": oneshot_args,
        "calibration": {k: calib[k] for k in ("sha256", "source", "calib", "num_samples", "seq_len", "seed")},
        "float_dir": str(float_dir), "out": str(out),
        "seconds": {"load": t_load - t0, "oneshot": t_oneshot - t_load, "save": t_save - t_oneshot,
                    "total": t_save - t0},
        "quantization_config": config.get("quantization_config"),
        "torch_threads": torch.get_num_threads(), "workarounds": workarounds,
        "versions": _versions("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets",
                              "accelerate"),
        "machine": platform.machine(), "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
    }
    _write_json(out / PEER_FILE, record)
    what = a.algo if a.algo in PRESETS else f"{a.algo} W{a.bits} g{a.group_size} {'asym' if a.asym else 'sym'}"
    print(f"{out}: llm-compressor {record['versions']['llmcompressor']} {what}: oneshot {t_oneshot - t_load:.1f} s, "
          f"total {t_save - t0:.1f} s")


# ---------------------------------------------------------------- eval (our venv)
def _describe(folder: Path, ref_sha: str | None) -> dict:
    """Who made FOLDER, with what calibration tokens, in how long (from its records)."""
    info: dict = {"made_by": "?", "calib_sha256": None, "quantize_seconds": None}
    if (folder / PEER_FILE).is_file():
        p = json.loads((folder / PEER_FILE).read_text())
        info.update(made_by=f"llm-compressor {p['versions'].get('llmcompressor')} {p['algo']}",
                    calib_sha256=p["calibration"]["sha256"], quantize_seconds=p["seconds"]["oneshot"],
                    peer=p)
    elif (folder / OUR_REPORT).is_file():
        r = json.loads((folder / OUR_REPORT).read_text())
        info.update(made_by=f"optllm {r.get('scheme')}", calib_sha256=(r.get("calibration") or {}).get("sha256"),
                    quantize_seconds=(r.get("seconds") or {}).get("quantize"),
                    optllm={k: r.get(k) for k in ("scheme", "config", "calibration", "seconds")})
    elif not (folder / "config.json").is_file() or "quantization_config" not in json.loads(
            (folder / "config.json").read_text()):
        info["made_by"] = "float"
    if info["calib_sha256"] is None or ref_sha is None:
        info["same_calibration"] = None
    else:
        info["same_calibration"] = info["calib_sha256"] == ref_sha
    return info


def _ref_calibration(dirs: list[Path], prepared: str | None) -> tuple[Path | None, dict | None]:
    cands = [Path(prepared)] if prepared else list(dict.fromkeys(d.parent for d in dirs))
    for c in cands:
        if (c / PREPARE_FILE).is_file():
            return c, json.loads((c / PREPARE_FILE).read_text())
    return None, None


def cmd_eval(a: argparse.Namespace) -> None:
    import inspect

    from optllm.benchmarks.common import provenance
    from optllm.eval.evaluate import evaluate_ppl

    dirs = [Path(d) for d in a.dirs]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise SystemExit(f"not a folder: {', '.join(missing)}")
    prep_dir, prep = _ref_calibration(dirs, a.prepared)
    ref_sha = prep["calibration"]["sha256"] if prep else None

    kw = {"seq_len": a.seq_len, "max_windows": a.max_windows, "device": a.device, "dtype": a.dtype,
          "progress": False}
    if a.kinds:
        if "kinds" not in inspect.signature(evaluate_ppl).parameters:
            raise SystemExit("--kinds: this optllm's evaluate_ppl has no kinds= argument yet")
        kw["kinds"] = a.kinds

    results = []
    for d in dirs:
        info = {"model": d.name, "dir": str(d), **_describe(d, ref_sha)}
        t0 = time.perf_counter()
        try:
            (row,) = evaluate_ppl([str(d)], **kw)
        except Exception as e:  # a checkpoint our runtime cannot load: record why, go on
            info.update(error=f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}",
                        traceback=traceback.format_exc(), seconds=time.perf_counter() - t0)
            print(f"{d}: FAILED: {info['error']}", file=sys.stderr, flush=True)
            results.append(info)
            continue
        by_kind = getattr(row, "ppl_by_kind", None)
        info.update(kind=row.kind, ppl=row.ppl, nll=row.nll, num_tokens=row.num_tokens,
                    num_windows=row.num_windows, seconds=row.seconds,
                    ppl_by_kind=dict(by_kind) if by_kind else None)
        shown = info["ppl_by_kind"] or {"ppl": row.ppl}
        print(f"{d}: " + ", ".join(f"{k} {v:.4f}" for k, v in shown.items()) + f" ({row.seconds:.1f} s)",
              flush=True)
        results.append(info)

    table = markdown_table(results)
    record = {"provenance": provenance(), "prepared": str(prep_dir) if prep_dir else None,
              "calibration": prep["calibration"] if prep else None,
              "eval": {k: v for k, v in kw.items() if k != "progress"}, "rows": results, "table": table}
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        _write_json(Path(a.json), record)
    print()
    print(table)


def cmd_merge(a: argparse.Namespace) -> None:
    """Several eval JSONs (parallel evals over parts of the folders) as one: rows in the order
    given, the float folder's first (its row is what every "Δ vs float" reads)."""
    parts = [json.loads(Path(f).read_text()) for f in a.parts]
    rows = [r for p in parts for r in p["rows"]]
    rows.sort(key=lambda r: r.get("made_by") != "float")
    record = {**parts[0], "rows": rows, "merged_from": [str(f) for f in a.parts]}
    record["table"] = markdown_table(rows)
    _write_json(Path(a.json), record)
    print(record["table"])


def markdown_table(results: list[dict]) -> str:
    kinds: list[str] = []
    for r in results:
        for k in r.get("ppl_by_kind") or {}:
            if k not in kinds:
                kinds.append(k)
    cols = kinds or ["ppl"]
    float_row = next((r for r in results if r["made_by"] == "float" and "error" not in r), None)
    head = ["model", "made by", "same calib tokens", *[f"ppl {k}" if kinds else "ppl" for k in cols],
            "Δ vs float" if float_row else None, "quantize s"]
    head = [h for h in head if h is not None]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def ppls(r: dict) -> dict:
        return r.get("ppl_by_kind") or ({"ppl": r["ppl"]} if "ppl" in r else {})

    for r in results:
        same = {True: "yes", False: "NO", None: "–"}[r.get("same_calibration")]
        qs = "–" if r.get("quantize_seconds") is None else f"{r['quantize_seconds']:.1f}"
        if "error" in r:
            cells = [f"load failed: {r['error']}"] + [""] * (len(cols) - 1)
            delta = ["–"] if float_row else []
        else:
            p = ppls(r)
            cells = [f"{p[k]:.4f}" if k in p else "–" for k in cols]
            delta = []
            if float_row is r:
                delta = ["–"]
            elif float_row:
                fp = ppls(float_row)
                d = [f"{100 * (p[k] / fp[k] - 1):+.1f}%" for k in cols if k in p and k in fp]
                delta = [" / ".join(d) if d else "–"]
        lines.append("| " + " | ".join([r["model"], r["made_by"], same, *cells, *delta, qs]) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("prepare", help="(our venv) float model + calibration tokens")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--out", required=True)
    p.add_argument("--num-samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--calib", default="builtin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--holdout", default="auto", help="as `optllm quantize --holdout` (auto or a number of "
                   "windows): it changes which windows are drawn, so pass both the same [default auto]")

    q = sub.add_parser("quantize", help="(peer venv) llm-compressor GPTQ / AWQ on the prepared folder")
    q.add_argument("--algo", choices=("gptq", "awq", *PRESETS), required=True)
    q.add_argument("--bits", type=int, choices=(4, 3), default=4)
    q.add_argument("--group-size", type=int, default=64)
    q.add_argument("--asym", action="store_true", help="asymmetric grid with zero points [default sym]")
    q.add_argument("--in", dest="inp", required=True, help="the folder `prepare` wrote")
    q.add_argument("--out", default=None, help="[default IN/llmc-ALGO-wBITS-gGROUP-sym|asym]")
    q.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16",
                   help="checkpoint dtype of scales and unquantized tensors [default bfloat16, as ours]")
    q.add_argument("--batch-size", type=int, default=1, help="calibration batch size (llm-compressor's default 1)")
    q.add_argument("--overwrite", action="store_true")

    e = sub.add_parser("eval", help="(our venv) perplexity of each folder on our runtime")
    e.add_argument("--dirs", nargs="+", required=True)
    e.add_argument("--kinds", nargs="+", default=None, help="text kinds [default: evaluate_ppl's]")
    e.add_argument("--seq-len", type=int, default=512)
    e.add_argument("--max-windows", type=int, default=None)
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu", help="cpu (the CPU tables' numbers) or cuda (float32 through our "
                   "kernels, minutes faster on every window; not bit-equal to cpu, so compare within one device)")
    e.add_argument("--prepared", default=None, help="the prepare folder [default: a parent of --dirs with "
                                                    f"{PREPARE_FILE}]")
    e.add_argument("--json", default=None)

    m = sub.add_parser("merge", help="several eval JSONs as one table")
    m.add_argument("parts", nargs="+")
    m.add_argument("--json", required=True)

    a = ap.parse_args(argv)
    if a.cmd in ("prepare", "eval"):
        try:
            import optllm  # noqa: F401
        except ImportError:
            raise SystemExit(f"{a.cmd} runs in optllm's venv: .venv/bin/python {sys.argv[0]} {a.cmd} ...") from None
    {"prepare": cmd_prepare, "quantize": cmd_quantize, "eval": cmd_eval, "merge": cmd_merge}[a.cmd](a)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
