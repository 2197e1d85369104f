"""What the GPU benchmark and tuning scripts share: the Llama-3-8B projection shapes and the
timing method (median GPU time of a CUDA-graph replay, weight copies rotated inside the graph
so that int4 weights do not sit in the 60 MB L2); for the end-to-end scripts, the model
shapes (configs of random-weight folders) and the provenance every result records."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import triton

BW = 4.27e12  # measured device copy bandwidth of the H200, bytes/s


def copy_bandwidth(sizes: tuple = (1 << 28, 1 << 30)) -> float:
    """This GPU's device copy rate, bytes/s, as ../shared/BENCHMARKS.md defines BW (bytes read + written):
    the best over `sizes` (bytes) of a float32 device-to-device copy, median of a CUDA-graph replay; so
    that "% of the floor" on another card (an H100) is against what that card copies. (A 1 GiB uint8 copy
    read 2.44 TB/s on an H100 where float32 copies of 59 MB read 2.88: the element type matters.)"""
    import torch

    best = 0.0
    for nbytes in sizes:
        bufs = [torch.empty(nbytes // 4, dtype=torch.float32, device="cuda") for _ in range(2)]
        us = graph_us(lambda: bufs[1].copy_(bufs[0]), rep=40)
        bufs.clear()
        best = max(best, 2 * nbytes / (us * 1e-6))
    torch.cuda.empty_cache()
    return best

# name -> (K, N) of y = x W^T, W [N, K]: Llama-3-8B's projections, then SmolLM2-135M's (q, k, v fused:
# 9 + 2 x 3 heads of 64; gate and up fused; the tied LM head)
SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "smol_qkv": (576, 960), "smol_o": (576, 576), "smol_gate_up": (576, 3072), "smol_down": (1536, 576),
          "smol_lm_head": (576, 49152)}
ROT = 4  # weight copies per timed call
FLUSH_BYTES = 200 * 2**20  # weights rotated past this many bytes in all are read from HBM, not the 60 MB L2


def flush_copies(nbytes: int) -> int:
    """Weight copies of nbytes each to rotate so that the copies together exceed FLUSH_BYTES (at
    least ROT): SmolLM2's int4 weights are a few hundred kB, and ROT copies of them sit in the L2,
    where a model's 30 layers of weights do not (the sixteenth session's profile: the W4A16 GEMV took
    4.88 µs a call inside the decode graph, against 1.07-1.81x cuBLAS bf16 timed over ROT copies)."""
    return max(ROT, -(-FLUSH_BYTES // max(nbytes, 1)))


def group_size(shape: str) -> int:
    """The int4 group size a shape is benchmarked with: 128 on Llama-3-8B's, 64 on SmolLM2's (what
    its checkpoints use: 576 is not a multiple of 128)."""
    return 64 if shape.startswith("smol_") else 128


def parse_shapes(csv: str) -> list[str]:
    names = csv.split(",")
    bad = [s for s in names if s not in SHAPES]
    if bad:
        raise SystemExit(f"unknown shape(s) {', '.join(bad)}: allowed {', '.join(SHAPES)}")
    return names


def sym_int4(w, group: int):
    """Symmetric int4 codes of w [N, K] by groups of `group` along K (scale = absmax / 7.5, codes
    clamped to [-8, 7]): q int8 [N, K], scales float32 [N, K / group]."""
    import torch

    n, k = w.shape
    s = (w.float().reshape(n, k // group, group).abs().amax(-1) / 7.5).clamp_min(1e-8)
    q = torch.clamp(torch.round(w.float() / s.repeat_interleave(group, 1)), -8, 7).to(torch.int8)
    return q, s


def rel(a, b) -> float:
    """Relative error of a against the reference b (Frobenius norms, in float32)."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def shape_plan(csv: str):
    """(name, K, N, int4 group size) of each shape in the comma list."""
    for name in parse_shapes(csv):
        k, n = SHAPES[name]
        yield name, k, n, group_size(name)


def graph_us(fn, rep: int = 20) -> float:
    """Median µs of one replay of fn captured in a CUDA graph. triton's do_bench_cudagraph runs fn on a stream
    of its own at once, so the current stream's work is waited for first: calls of fn made before (a warm-up)
    would otherwise overlap its first ones, and kernels that share per-device state (the W4A16 tiles' split-K
    counters and workspace) race (forty-second session: wrong and NaN results on later calls)."""
    import torch

    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def replay_us(graph, reps: int = 200, warmup: int = 0) -> tuple[float, float]:
    """Median µs of a captured CUDA graph's replay(): its host time alone, and replay() +
    synchronize() (the GPU idle before each), over reps replays after warmup more."""
    import statistics

    import torch

    host, full = [], []
    for i in range(warmup + reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        graph.replay()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= warmup:
            host.append((t1 - t0) * 1e6)
            full.append((t2 - t0) * 1e6)
    return statistics.median(host), statistics.median(full)


def eager_stream_us(op, copies: int, calls: int = 400, rep: int = 7) -> float:
    """µs per call of eager op(0), op(1), ..., op(copies - 1), op(0), ... issued back to back, `calls`
    calls between two synchronisations, median of `rep` such runs after a warm-up one: what a call
    costs a caller that launches outside a graph -- its host time where that is the longer, else its
    GPU time and the launch gaps -- over weight copies rotated past the L2 (triton's do_bench times one
    call between two events after flushing the L2, which adds the events' own gap and a cold start)."""
    import statistics

    import torch

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    per_run = []
    for r in range(rep + 1):
        sync()
        t0 = time.perf_counter()
        for c in range(calls):
            op(c % copies)
        sync()
        if r:
            per_run.append((time.perf_counter() - t0) * 1e6 / calls)
    return statistics.median(per_run)


def rotated_us(op, rep: int = 20, copies: int = ROT) -> float:
    """µs per call of op(i), timed as one graph of op(0) .. op(copies - 1) divided by copies."""
    fn = lambda: [op(i) for i in range(copies)]  # noqa: E731
    fn()
    return graph_us(fn, rep) / copies


def why(e: Exception, width: int = 100) -> str:
    """An exception in one line for a results row: its type and its message's first line, cut at width."""
    return f"{type(e).__name__}: {str(e).splitlines()[0][:width]}"


def time_rotated(r: dict, ops: dict, copies: int, rep: int = 40) -> None:
    """r[name] = rotated_us of each op(i) of ops, or None and r[name + "_why"] where it raises (a kernel or
    peer that does not take the shape)."""
    for name, op in ops.items():
        try:
            r[name] = rotated_us(op, rep, copies)
        except Exception as e:
            r[name] = None
            r[name + "_why"] = why(e)


# ---- end-to-end: model shapes for random-weight runs (load_format="dummy")
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rope_theta=500000.0,
                 rms_norm_eps=1e-5, tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                 model_type="llama", torch_dtype="bfloat16", hidden_act="silu")
SMOLLM2 = dict(LLAMA3_8B, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
               rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, rope_theta=100000.0)


def shape_folder(root: Path, name: str, cfg: dict, w4a16: bool = False, group: int = 128) -> Path:
    """A config-only folder with a word-level tokenizer over the whole vocabulary (token i is
    the word "w<i>"; decoding joins words with spaces), so detokenizing costs what it costs
    with a real vocabulary: every token adds text."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg)
    if w4a16:
        from optllm.formats.args import QuantArgs
        from optllm.formats.compressed_tensors import quantization_config

        cfg["quantization_config"] = quantization_config(QuantArgs(4, group, True), ["Linear"], ["lm_head"])
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, cfg["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(folder)
    return folder


def provenance() -> dict:
    """date, GPU, versions, commit ($OPTLLM_COMMIT when set: the device machine's copy of the
    tree carries a stale .git; else HEAD, with "+dirty" when the tree has uncommitted
    changes), and the command."""
    import torch
    import transformers

    from optllm.eval.provenance import commit

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return dict(date=time.strftime("%Y-%m-%d"), gpu=gpu, torch=torch.__version__, triton=triton.__version__,
                transformers=transformers.__version__, commit=commit(),
                command=" ".join(sys.argv))


def write_results(out: str | Path | None, name: str, table: str, payload: dict) -> None:
    """OUT/NAME.md (the table) and OUT/NAME.json (payload), OUT made if needed; nothing when out is None."""
    if out is None:
        return
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(table + "\n")
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


def stub_graph_replays(llm) -> None:
    """Every graph replay of llm's runner (decode and its feature store, extend, speculative) does
    nothing from now on: the host-time scripts' CPU engines, whose graphs are eager stand-ins, then
    time host code alone."""
    r = llm.engine.runner
    groups = [r.graphs.graphs, r.graphs.stores]
    if r.extend_graphs is not None:
        groups.append(r.extend_graphs.graphs)
    if r.spec is not None and r.spec.graphs is not None:
        groups.append(r.spec.graphs.graphs)
    for g in groups:
        for x in g.values():
            x.replay = lambda: None


def ensure_random_smol(root: Path, method: str = "eagle3") -> None:
    """benchmarks/random_smol.py's folders under root (target, and the draft of `method`), made once."""
    if not (root / "target").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("random_smol.py")), str(root), "--method", method],
                       check=True)
