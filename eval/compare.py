"""`optllm eval --compare OLD.json`: this run's rows against an earlier report's (its
report.json), each change beyond a noise threshold marked as a regression.

Rows are matched by model (the path or alias as given); what is compared: perplexity per text
kind (higher is worse: a regression past +ppl_tol relative), each lm-eval task's main metric
(lower is worse: past -task_tol absolute, when both runs report the same metric) and output
tok/s per batch size (lower is worse: past -speed_tol relative). Models or measurements only
one side has are left out.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError

PPL_TOL = 0.005  # +0.5% perplexity: beyond the spread of one window set's float arithmetic
TASK_TOL = 0.01  # -1 point of accuracy-like metrics
SPEED_TOL = 0.05  # -5% tok/s: run-to-run spread of the speed measurement


def load_report(path: str | Path) -> list[dict]:
    """The rows of an earlier report.json (UserError naming what is wrong otherwise)."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--compare {p}: no such file; allowed: a report.json written by `optllm eval --out`")
    try:
        rows = json.loads(p.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"--compare {p}: not JSON ({e}); allowed: a report.json written by `optllm eval --out`") \
            from None
    if isinstance(rows, dict):  # {"provenance", "rows"}; a bare list of rows before the provenance was kept
        rows = rows.get("rows")
    if not isinstance(rows, list) or not all(isinstance(r, dict) and "model" in r for r in rows):
        raise UserError(f"--compare {p}: not an optllm eval report (its rows, with a model each)")
    return rows


def compare(rows: list, old: list[dict], ppl_tol: float = PPL_TOL, task_tol: float = TASK_TOL,
            speed_tol: float = SPEED_TOL) -> list[dict]:
    """One entry per measurement both runs have: {model, measure, old, new, change (relative
    for perplexity and speed, absolute for tasks), regression}."""
    by_model = {o["model"]: o for o in old}
    out = []
    for r in rows:
        o = by_model.get(r.model)
        if o is None:
            continue
        for kind, v in (r.ppl_by_kind if r.num_windows else {}).items():
            ov = (o.get("ppl_by_kind") or {}).get(kind)
            if ov and v == v:
                change = v / ov - 1
                out.append(dict(model=r.model, measure=f"ppl {kind}", old=ov, new=v, change=change,
                                regression=change > ppl_tol))
        for task, (metric, v) in (r.task_main or {}).items():
            om = (o.get("task_main") or {}).get(task)
            if om and om[0] == metric:
                change = v - om[1]
                out.append(dict(model=r.model, measure=f"{task} {metric}", old=om[1], new=v, change=change,
                                regression=change < -task_tol))
        old_speed = {s.get("batch_size"): s for s in o.get("speed") or []}
        for s in r.speed or []:
            os_ = old_speed.get(s.get("batch_size"))
            if os_ and os_.get("tok_s") and s.get("tok_s"):
                change = s["tok_s"] / os_["tok_s"] - 1
                out.append(dict(model=r.model, measure=f"tok/s bs={s['batch_size']}", old=os_["tok_s"],
                                new=s["tok_s"], change=change, regression=change < -speed_tol))
    return out


def compare_table(diffs: list[dict], source: str = "") -> str:
    """The comparison as Markdown (regressions in bold), with a count line; "" when empty."""
    if not diffs:
        return ""
    lines = ["| model | measure | before | now | change | |", "|---|---|---|---|---|---|"]
    for d in diffs:
        rel = d["measure"].startswith(("ppl", "tok/s"))  # relative changes; tasks: points
        change = f"{100 * d['change']:+.2f}%" if rel else f"{100 * d['change']:+.2f} pts"
        mark = "**regression**" if d["regression"] else ""
        lines.append(f"| {d['model']} | {d['measure']} | {d['old']:.4f} | {d['new']:.4f} | {change} | {mark} |")
    n = sum(d["regression"] for d in diffs)
    head = (f"Against {source}: " if source else "") + (
        f"{n} regression(s) beyond the noise thresholds (perplexity +{100 * PPL_TOL:g}%, tasks "
        f"-{100 * TASK_TOL:g} points, tok/s -{100 * SPEED_TOL:g}%).\n\n")
    return head + "\n".join(lines) + "\n"
