"""A draft level's ranking of the vocabulary: kernels/topk.py (two launches, the logits read once)
against torch's log_softmax in float32 + topk, the path it replaced, on SmolLM2's 49152 words.

Rows are what an EAGLE-2 tree ranks a level: batch x top_k frontier nodes (8 a sequence). Each
cell: median µs of a CUDA-graph replay (graph_us), and the floor of reading the bf16 logits
once at the measured copy bandwidth.

    python benchmarks/topk.py [--rows 1,8,64,512] [--vocab 49152] [--k 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import BW, graph_us, provenance  # noqa: E402

from optllm.kernels.topk import topk_logprobs, topk_logprobs_ref  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,64,512")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/topk.py needs a CUDA GPU")
    rows_list = [int(r) for r in a.rows.split(",")]
    table = []
    for rows in rows_list:
        x = torch.randn(rows, a.vocab, device="cuda", dtype=torch.bfloat16) * 3
        ours = graph_us(lambda: topk_logprobs(x, a.k, "triton"))
        ref = graph_us(lambda: topk_logprobs_ref(x, a.k))
        floor = rows * a.vocab * 2 / BW * 1e6
        table.append(dict(rows=rows, ours_us=round(ours, 2), torch_us=round(ref, 2), speedup=round(ref / ours, 2),
                          floor_us=round(floor, 2), pct_floor=round(100 * floor / ours, 1)))
        print(f"rows {rows}: ours {ours:.2f} us, torch {ref:.2f} us", flush=True)
    md = ["| rows | ours µs | torch log_softmax + topk µs | × | read floor µs | % floor |", "|---|---|---|---|---|---|"]
    md += [f"| {t['rows']} | {t['ours_us']} | {t['torch_us']} | {t['speedup']} | {t['floor_us']} | {t['pct_floor']} |"
           for t in table]
    prov = provenance()
    text = "\n".join([f"- {k}: {v}" for k, v in prov.items()] + ["", *md])
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "topk.md").write_text(text + "\n")
        (a.out / "topk.json").write_text(json.dumps(dict(provenance=prov, vocab=a.vocab, k=a.k, rows=table), indent=1))


if __name__ == "__main__":
    main()
