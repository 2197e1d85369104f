"""What `optllm quantize` shows after writing a checkpoint: its perplexity on every built-in
text kind's held-out split, beside the float model's and RTN's of the same bits and symmetry
(and, with --compare-symmetry, beside the same algorithm and RTN with the other symmetry), so
a user sees at once whether the algorithm helped on text it did not see.

It lives here because it joins quant/ (the RTN and other-symmetry checkpoints) and eval/ (the
perplexities), which do not import each other. RTN's weights do not depend on calibration
data, so its checkpoints are made with a token-sized calibration set; the comparison
checkpoints go to a temporary folder that is removed afterwards.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path

from ..quant.pipeline import REPORT_NAME  # the checkpoint's report file (formats/ names it)


@dataclasses.dataclass
class Comparison:
    kinds: list[str]
    windows: int
    rows: list[dict]  # {"label", "scheme", "symmetric", "ppl": {kind: ppl}, "gap_closed": {kind: %} | None}

    def to_dict(self) -> dict:
        return {"kinds": self.kinds, "max_windows_per_kind": self.windows, "rows": self.rows}


def compare_checkpoint(model: str, out: Path, config, *, other_symmetry: bool, max_windows: int, device: str,
                       progress: bool = True) -> Comparison:
    """Evaluate OUT (quantized from MODEL with `config`) beside the float model and RTN (of
    the same integer grid; a scheme whose algorithm has no RTN counterpart, e.g. FP8, only
    beside the float model)."""
    from ..eval.evaluate import evaluate_ppl
    from ..quant.algorithm import get_algorithm
    from ..quant.pipeline import quantize

    scheme = config.quant_scheme()
    algo = scheme.algorithm
    bits = scheme.weights.num_bits
    symmetric = scheme.weights.symmetric  # the run's, or the scheme's own
    plan = [("rtn", symmetric)]  # (algorithm, symmetric) of the extra checkpoints
    if other_symmetry:
        plan += [(algo, not symmetric), ("rtn", not symmetric)]
    plan = [p for p in plan if p != (algo, symmetric)]
    if not get_algorithm(algo).rtn_baseline:
        plan = []
    tmp = Path(tempfile.mkdtemp(prefix=".optllm-compare-", dir=out.parent))
    try:
        extra = []
        for a, sym in plan:
            fields = {**config.to_dict(), "scheme": f"w{bits}a16-{a}", "symmetric": sym}
            if a == "rtn":  # weights independent of the data: the smallest calibration will do (and no
                # calibrated KV cache, whose scales 8 tokens would set)
                fields.update(num_samples=1, seq_len=8, holdout=0, fallback_rtn=False, kv_cache=None)
            cfg = type(config).from_dict({**fields, "awq": config.awq})
            folder = tmp / f"{a}-{'sym' if sym else 'asym'}"
            if progress:
                print(f"comparison checkpoint: w{bits}a16-{a} {'symmetric' if sym else 'asymmetric'}", flush=True)
            quantize(model, folder, cfg, progress=False)
            extra.append((a, sym, folder))
        models = [model, str(out)] + [str(f) for _a, _s, f in extra]
        rows = evaluate_ppl(models, max_windows=max_windows, device=device, progress=False)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    kinds = list(rows[0].ppl_by_kind)
    labels = [("float", None, None), (f"{scheme.name} (this checkpoint)", algo, symmetric)]
    labels += [(f"w{bits}a16-{a}", a, s) for a, s, _f in extra]
    table = []
    for (label, a, sym), row in zip(labels, rows):
        table.append({"label": label, "algorithm": a, "symmetric": sym, "ppl": dict(row.ppl_by_kind)})
    fp = table[0]["ppl"]
    for r in table[1:]:
        rtn = next((x for x in table if x["algorithm"] == "rtn" and x["symmetric"] == r["symmetric"]), None)
        if r["algorithm"] != "rtn" and rtn is not None:
            r["gap_closed"] = {k: 100 * (rtn["ppl"][k] - r["ppl"][k]) / (rtn["ppl"][k] - fp[k])
                               if rtn["ppl"][k] != fp[k] else None for k in kinds}
    return Comparison(kinds=kinds, windows=max_windows, rows=table)


def markdown(comp: Comparison) -> str:
    head = "| checkpoint | symmetry | " + " | ".join(f"{k} ppl" for k in comp.kinds) + " |"
    lines = [head, "|---|---|" + "---|" * len(comp.kinds)]
    for r in comp.rows:
        sym = "–" if r["symmetric"] is None else ("sym" if r["symmetric"] else "asym")
        cells = []
        for k in comp.kinds:
            closed = (r.get("gap_closed") or {}).get(k)
            cells.append(f"{r['ppl'][k]:.3f}" + ("" if closed is None else f" ({closed:+.0f}% of RTN's gap)"))
        lines.append(f"| {r['label']} | {sym} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def record(out: Path, comp: Comparison) -> None:
    """Add the comparison to OUT/optllm-report.json (written beside it, then renamed over it)."""
    path = out / REPORT_NAME
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["comparison"] = comp.to_dict()
    fd, tmp = tempfile.mkstemp(dir=out, prefix=".optllm-report-")
    with os.fdopen(fd, "w") as f:
        json.dump(report, f, indent=2)
    os.chmod(tmp, path.stat().st_mode if path.exists() else 0o644)
    os.replace(tmp, path)
