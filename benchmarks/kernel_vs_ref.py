"""Issue 14 part 8's table: each checkpoint's perplexity through its kernels (report A, `optllm
eval --kernels`) beside the same checkpoint through the torch reference of those kernels
(report B, `optllm eval --dequant`: W4A16 dequantized, W8A8 / FP8 / NVFP4 their activation
quantizers and the weight formed once in float32), per text kind, with the relative difference.

    python benchmarks/kernel_vs_ref.py KERNEL/report.json REF/report.json [--out table.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def table(kernel_rows: list[dict], ref_rows: list[dict], bound: float = 0.001) -> tuple[str, bool]:
    ref = {r["model"]: r for r in ref_rows}
    kinds = next(iter(ref.values()))["ppl_by_kind"].keys() if ref else ()
    lines = ["| model | scheme | " + " | ".join(f"{k} kernel / ref (Δ)" for k in kinds) + " |",
             "|---|---|" + "---|" * len(kinds)]
    ok = True
    for r in kernel_rows:
        b = ref.get(r["model"])
        if b is None or not r.get("ppl_by_kind"):
            continue
        cells = []
        for k in kinds:
            a, c = r["ppl_by_kind"][k], b["ppl_by_kind"][k]
            d = a / c - 1
            ok &= abs(d) <= bound
            cells.append(f"{a:.3f} / {c:.3f} ({d * 100:+.3f}%)")
        lines.append(f"| {r['model']} | {r['kind']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n", ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", type=Path)
    p.add_argument("ref", type=Path)
    p.add_argument("--out", type=Path)
    p.add_argument("--bound", type=float, default=0.001, help="relative difference allowed (0.1%%)")
    a = p.parse_args()
    def rows(path):  # {"provenance", "rows"}, or a bare list of rows (reports written before the provenance)
        data = json.loads(path.read_text())
        return data["rows"] if isinstance(data, dict) else data

    text, ok = table(rows(a.kernel), rows(a.ref), a.bound)
    text += f"\nevery row within {a.bound * 100:.2f}%: {'yes' if ok else 'NO'}\n"
    if a.out:
        a.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
