"""Peak memory, time and perplexity of each W4A16 algorithm on the built-in model, on the CPU.

    python benchmarks/quant_memory.py [--algos rtn,awq,gptq] [--num-samples 16] [--seq-len 256]
        [--group-size 64] [--blocks N] [--exact-memory] [--awq-scale-tokens all,2048,1024]
        [--ppl] [--json FILE] [--commit REV]
    python benchmarks/quant_memory.py --table FILE   # the table of a JSON it wrote

Each run is `optllm.quant.pipeline.quantize(MODEL, OUT/NAME, QuantizeConfig(...))` in a fresh
process, so that no peak carries over from one algorithm to the next. Inside it the Linux
high-water mark of the resident set (VmHWM) is reset (/proc/self/clear_refs) at the pipeline's
phase boundaries, found by wrapping two functions the pipeline calls: `load_calibration` (the
model is loaded: what follows is calibration and quantization) and `save_quantized`
(calibration is over: what follows is the write). Three peaks come out:

- load: from the start of quantize() to the loaded model;
- calibrate: the calibration and quantization of every block (the figure this script is for);
- write: packing and writing the checkpoint.

The resident set is a blunt measure of what is live. glibc keeps freed blocks below its
(self-raising) mmap threshold for reuse, so two runs of the same code differ by hundreds of
MiB; --exact-memory sets MALLOC_MMAP_THRESHOLD_=131072 in the runs, so that every tensor above
128 KiB is its own mapping, returned when freed, and the peaks repeat to the MiB (the runs are
then ~1.7x slower: take times from runs without it). The calibrate peak also counts the model
growing: its float32 weights are a private memory map of the cached safetensors file, so every
linear rewritten in place (the quantized values the next block must see) becomes a private
copy, and the int8 codes are kept for the writer. --blocks N calibrates only the first N
blocks, where that growth is small and the calibration activations (the same for every block)
dominate. On the CPU the compute device is the host, so `offload` moves nothing here: the
figures show what each algorithm holds at once.

--awq-scale-tokens runs AWQ once per value of AWQOptions.scale_tokens ("all": None). With
--ppl, the float model and every checkpoint are then evaluated with
`evaluate_ppl([MODEL, OUT/...], seq_len=512, max_windows=8, device="cpu")`. Wall and CPU
seconds are those of the quantize() call. The JSON records the provenance (date, versions,
commit, command); --commit records a revision other than the checkout's, for a run whose
package comes from elsewhere (PYTHONPATH).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

_TAG = "QUANT_MEMORY_RESULT "


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def worker(a: argparse.Namespace) -> None:
    """One run in this process; prints one tagged JSON line."""
    from optllm.quant import pipeline
    from optllm.quant.config import QuantizeConfig

    mem: dict[str, int] = {}
    load_calibration, save_quantized = pipeline.load_calibration, pipeline.save_quantized

    def calib_hook(*args, **kwargs):
        mem["load_peak"] = _status_kib("VmHWM") * 1024
        mem["rss_after_load"] = _status_kib("VmRSS") * 1024
        _reset_peak()
        return load_calibration(*args, **kwargs)

    def save_hook(*args, **kwargs):
        mem["calibrate_peak"] = _status_kib("VmHWM") * 1024
        _reset_peak()
        out = save_quantized(*args, **kwargs)
        mem["write_peak"] = _status_kib("VmHWM") * 1024
        return out

    pipeline.load_calibration, pipeline.save_quantized = calib_hook, save_hook
    if a.blocks:
        decoder_layers = pipeline.decoder_layers
        pipeline.decoder_layers = lambda model: decoder_layers(model)[: a.blocks]
    fields = {"scheme": a.worker, "group_size": a.group_size, "num_samples": a.num_samples, "seq_len": a.seq_len,
              "device": "cpu"}
    if a.scale_tokens:
        fields["awq"] = {"scale_tokens": None if a.scale_tokens == "all" else int(a.scale_tokens)}
    cfg = QuantizeConfig.from_dict(fields)
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    rep = pipeline.quantize(a.model, a.dir, cfg, overwrite=True, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    res = {"name": a.dir.name, "scheme": a.worker, "scale_tokens": a.scale_tokens, "dir": str(a.dir),
           "wall_seconds": wall, "cpu_seconds": cpu, "seconds": rep.seconds, "memory_bytes": mem,
           "mean_layer_error": sum(s.rel_error for s in rep.layers) / len(rep.layers),
           "mean_block_error": sum(b.rel_error for b in rep.blocks) / len(rep.blocks)}
    print(_TAG + json.dumps(res), flush=True)


def _mib(b: int) -> str:
    return f"{b / 2**20:.0f}"


def markdown(runs: list[dict], float_ppl: float | None) -> str:
    """The results as a Markdown table (the ppl column when they were measured)."""
    ppl = float_ppl is not None
    cols = ["run", "quantize s", "CPU s", "load peak MiB", "RSS after load MiB", "calibrate peak MiB",
            "calibrate peak − RSS after load MiB", "write peak MiB", "mean block error"] + (["ppl"] if ppl else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in runs:
        m = r["memory_bytes"]
        row = [r.get("name", r["scheme"]), f"{r['wall_seconds']:.1f}", f"{r['cpu_seconds']:.0f}",
               _mib(m["load_peak"]), _mib(m["rss_after_load"]), _mib(m["calibrate_peak"]),
               _mib(m["calibrate_peak"] - m["rss_after_load"]), _mib(m["write_peak"]),
               f"{r['mean_block_error']:.4f}"] + ([f"{r['ppl']:.4f}"] if ppl else [])
        lines.append("| " + " | ".join(row) + " |")
    if ppl:
        lines.append(f"\nfloat model: perplexity {float_ppl:.4f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("out/quant_memory"))
    ap.add_argument("--algos", default="rtn,awq,gptq")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=0,
                    help="calibrate only the first N blocks (0: all): what one block holds is the same for every "
                         "block, and the weights rewritten in place grow the resident set by less")
    ap.add_argument("--exact-memory", action="store_true",
                    help="MALLOC_MMAP_THRESHOLD_=131072 in the runs: repeatable peaks, slower runs")
    ap.add_argument("--awq-scale-tokens", default="",
                    help="comma-separated AWQOptions.scale_tokens values, one AWQ run each (all: None)")
    ap.add_argument("--ppl", action="store_true", help="also evaluate perplexity (512-token windows, 8 windows)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--commit", help="record this commit instead of the checkout's (when PYTHONPATH points at "
                                     "another tree of the package)")
    ap.add_argument("--table", type=Path, help="print the table of a JSON this script wrote, and exit")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--scale-tokens", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.table:
        data = json.loads(a.table.read_text())
        print(json.dumps(data["provenance"]))
        print(markdown(data["runs"], data["float_ppl"]))
        return
    if a.worker:
        worker(a)
        return

    import optllm
    from optllm.benchmarks.common import provenance

    plan = []  # (name, scheme, scale_tokens)
    for algo in a.algos.split(","):
        scheme = f"w{a.bits}a16-{algo}"
        if algo == "awq" and a.awq_scale_tokens:
            plan += [(f"{scheme}-scale_tokens-{v}", scheme, v) for v in a.awq_scale_tokens.split(",")]
        else:
            plan.append((scheme, scheme, ""))
    env = dict(os.environ, **({"MALLOC_MMAP_THRESHOLD_": "131072"} if a.exact_memory else {}))
    a.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for name, scheme, tokens in plan:
        cmd = [sys.executable, __file__, "--worker", scheme, "--dir", str(a.out / name), "--model", a.model,
               "--group-size", str(a.group_size), "--num-samples", str(a.num_samples), "--seq-len", str(a.seq_len),
               "--blocks", str(a.blocks), "--scale-tokens", tokens]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        lines = [x for x in r.stdout.splitlines() if x.startswith(_TAG)]
        if r.returncode != 0 or not lines:
            raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
        runs.append(json.loads(lines[-1][len(_TAG):]))
        m = runs[-1]["memory_bytes"]
        print(f"{name}: {runs[-1]['wall_seconds']:.1f} s ({runs[-1]['cpu_seconds']:.0f} CPU s), "
              f"calibrate peak {_mib(m['calibrate_peak'])} MiB (model loaded: {_mib(m['rss_after_load'])} MiB)",
              flush=True)

    float_ppl = None
    if a.ppl:
        from optllm.eval.evaluate import evaluate_ppl

        rows = evaluate_ppl([a.model] + [r["dir"] for r in runs], seq_len=512, max_windows=8, device="cpu",
                            progress=False)
        float_ppl = rows[0].ppl
        for r, row in zip(runs, rows[1:]):
            r["ppl"] = row.ppl
            r["ppl_tokens"] = row.num_tokens

    info = provenance()
    if a.commit:
        info["commit"] = a.commit
    info["package"] = str(Path(optllm.__file__).parent)
    info["config"] = {"model": a.model, "bits": a.bits, "group_size": a.group_size, "num_samples": a.num_samples,
                      "seq_len": a.seq_len, "device": "cpu", "blocks": a.blocks or "all",
                      "exact_memory": a.exact_memory}
    table = markdown(runs, float_ppl)
    print(json.dumps(info))
    print(table)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"provenance": info, "float_ppl": float_ppl, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
