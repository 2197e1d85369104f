"""Side-by-side reports: Markdown tables, the same rows as JSON, and PNG plots.

One perplexity column per text kind (rows' ``ppl_by_kind``), each with its change vs the
first model (the baseline); then, when rows carry lm-eval task scores, one column per task
(its main metric) with the same change; then, when rows carry speed, a row per model and
batch size. Plots, each only when its data exists: perplexity per kind (ppl.png), quality
against average bits per weight (quality_bits.png), tok/s against batch size (speed.png),
TTFT and inter-token latency percentiles against batch size (latency.png).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path


def row_kinds(rows: list) -> list[str]:
    """The text kinds of the rows, in the order measured (first seen first)."""
    kinds: dict[str, None] = {}
    for r in rows:
        kinds.update(dict.fromkeys(_by_kind(r)))
    return list(kinds)


def markdown_table(rows: list, baseline: dict[str, float] | float | None = None) -> str:
    """Rows as a Markdown table: per text kind its perplexity and Δ vs the baseline (default:
    the first row; a float is the first kind's), then scored tokens and windows summed over
    kinds, and seconds; below it, the first row's tokens (windows) per kind."""
    kinds = row_kinds(rows)
    if isinstance(baseline, (int, float)):
        baseline = {kinds[0]: float(baseline)} if kinds else {}
    base = baseline if baseline is not None else (_by_kind(rows[0]) if rows else {})
    cols = [c for k in kinds for c in (f"ppl {k}", f"Δ {k}")]
    head = ["model", "scheme", *cols, "tokens", "windows", "s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ppl = _by_kind(r)
        cells = []
        for k in kinds:
            v, b = ppl.get(k), base.get(k)
            cells += [f"{v:.4f}" if v is not None else "–", f"{100 * (v / b - 1):+.2f}%" if v and b else "–"]
        tokens = sum((getattr(r, "tokens_by_kind", None) or {"": r.num_tokens}).values())
        windows = sum((getattr(r, "windows_by_kind", None) or {"": r.num_windows}).values())
        lines.append("| " + " | ".join([r.model, r.kind, *cells, str(tokens), str(windows), f"{r.seconds:.1f}"]) + " |")
    out = "\n".join(lines) + "\n"
    tokens_by_kind = getattr(rows[0], "tokens_by_kind", None) if rows else None
    if tokens_by_kind:
        per = ", ".join(f"{k} {n} ({rows[0].windows_by_kind[k]})" for k, n in tokens_by_kind.items())
        out += f"\nscored tokens (windows) per kind, first model: {per}\n"
    return out


def tasks_table(rows: list) -> str:
    """lm-eval scores: a column per task (its main metric, higher is better unless it is a
    perplexity), Δ vs the first row in points; "" when no row has tasks."""
    tasks: dict[str, str] = {}
    for r in rows:
        for t, (metric, _v) in (getattr(r, "task_main", None) or {}).items():
            tasks.setdefault(t, metric)
    if not tasks:
        return ""
    base = getattr(rows[0], "task_main", None) or {}
    head = ["model", "scheme", *[c for t, m in tasks.items() for c in (f"{t} {m}", "Δ")]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = []
        for t in tasks:
            v = (getattr(r, "task_main", None) or {}).get(t)
            b = base.get(t)
            cells += [f"{v[1]:.4f}" if v else "–", f"{100 * (v[1] - b[1]):+.2f}" if v and b else "–"]
        lines.append("| " + " | ".join([r.model, r.kind, *cells]) + " |")
    return "\n".join(lines) + "\n"


def speed_table(rows: list) -> str:
    """Speed: a row per model and batch size (output tok/s over the whole call, decode tok/s
    from first to last token, TTFT and inter-token latency percentiles in ms, weight GB/s, %
    of the roofline); "" when no row has speed."""
    if not any(getattr(r, "speed", None) for r in rows):
        return ""
    head = ["model", "scheme", "batch", "tok/s", "decode tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms",
            "ITL p99 ms", "weight GB/s", "% roofline"]
    keys = [("tok_s", "{:.1f}"), ("decode_tok_s", "{:.1f}"), ("ttft_p50_ms", "{:.2f}"), ("ttft_p99_ms", "{:.2f}"),
            ("itl_p50_ms", "{:.2f}"), ("itl_p99_ms", "{:.2f}"), ("weight_gb_s", "{:.1f}"), ("roofline_pct", "{:.1f}")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        for s in getattr(r, "speed", None) or []:
            cells = [fmt.format(s[k]) if s.get(k) is not None else "–" for k, fmt in keys]
            lines.append("| " + " | ".join([r.model, r.kind, str(s["batch_size"]), *cells]) + " |")
    return "\n".join(lines) + "\n"


def _batch_cell(s: dict) -> str:
    """A speculation row's batch size, marked when its requests arrived as one stream (at most that
    many running) rather than in waves."""
    return f"{s['batch_size']} (continuous)" if s.get("load") == "continuous" else str(s["batch_size"])


def speculation_table(rows: list) -> str:
    """Speculation: a row per model, temperature and batch size (plain and speculative output
    tok/s, speedup with ± the standard error of its per-batch pairs, tau, the share of
    speculative sequence-steps accepting at least d draft tokens for d = 1..4, speculative steps
    per tree size (n: steps), greedy outputs identical); "" when no row has speculation."""
    if not any(getattr(r, "speculation", None) for r in rows):
        return ""
    head = ["model", "scheme", "temp", "batch", "plain tok/s", "spec tok/s", "speedup", "τ", "≥1", "≥2", "≥3", "≥4",
            "spec steps (tree: steps)", "same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    f = lambda v, fmt: "–" if v is None else fmt.format(v)  # noqa: E731
    for r in rows:
        for s in getattr(r, "speculation", None) or []:
            depth = (list(s.get("accept_at_depth") or []) + [None] * 4)[:4]
            same = _same_tokens(s)
            lines.append("| " + " | ".join([
                r.model, r.kind, f"{s['temperature']:g}", _batch_cell(s), f(s.get("plain_tok_s"), "{:.1f}"),
                f(s.get("spec_tok_s"), "{:.1f}"), _speedup_cell(s), f(s.get("tau"), "{:.2f}"),
                *[f(None if d is None else 100 * d, "{:.0f}%") for d in depth],
                _steps_cell(s), same]) + " |")
    return "\n".join(lines) + "\n"


def _speedup_cell(s: dict) -> str:
    """The speedup, and ± the standard error of its per-batch pairs where there are two or more."""
    if s.get("speedup") is None:
        return "–"
    se = s.get("speedup_se")
    return f"{s['speedup']:.2f}×" + ("" if se is None else f" ±{se:.2f}")


def _steps_cell(s: dict) -> str:
    """Speculative steps per tree size (n: steps), and how many of them the policy explored."""
    cell = ", ".join(f"{n}: {c}" for n, c in (s.get("steps_by_size") or {}).items()) or "–"
    return cell + (f" ({s['explored']} explored)" if s.get("explored") else "")


def speculation_time_table(rows: list) -> str:
    """Where each speculation row's time went, per engine (milliseconds over the timed batches):
    steps, time in the model runner, the rest on the host; the speculative engine's speculative
    parts of steps, its plain parts, its fused steps (plain rows in the verify forward) and how
    many speculative steps first caught the draft up (rows); "" without the data. A plain part
    that ran before a speculative part of the same step is a split step (counted in its cell)."""
    items = [(r, s) for r in rows for s in getattr(r, "speculation", None) or [] if s.get("time")]
    if not items:
        return ""
    head = ["model", "temp", "batch", "plain: steps", "runner ms", "host ms", "spec: steps", "runner ms", "host ms",
            "spec parts (ms)", "plain parts (ms)", "fused steps (ms)", "caught up (rows, ms)",
            "a catch-up's profile ms (measured ratio)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, s in items:
        p, q = s["time"]["plain"], s["time"]["spec"]
        lines.append("| " + " | ".join([
            r.model, f"{s['temperature']:g}", _batch_cell(s), str(p["steps"]), f"{p['runner_ms']:.1f}",
            f"{p['host_ms']:.1f}", str(q["steps"]), f"{q['runner_ms']:.1f}", f"{q['host_ms']:.1f}",
            f"{q['spec_steps']} ({q['spec_part_ms']:.1f})", _plain_parts_cell(q),
            f"{q.get('fused_steps', 0)} ({q.get('fused_ms', 0.0):.1f})",
            f"{q['caught_up_steps']} ({q['catch_up_rows']}, {q.get('catch_up_ms', 0.0):.1f})",
            _catch_up_model_cell(s.get("catch_up_model"), q)]) + " |")
    return "\n".join(lines) + "\n"


def _plain_parts_cell(q: dict) -> str:
    """The speculative engine's plain parts (ms), and how many of them split a speculative step (its
    plain rows' forward before the trees': a whole plain step more)."""
    cell = f"{q['plain_parts']} ({q['plain_part_ms']:.1f}"
    return cell + (f"; {q['split_steps']} split)" if q.get("split_steps") else ")")


def _catch_up_model_cell(m: dict | None, q: dict) -> str:
    """What the policy's start-up profile predicts for the mean catch-up of the row (c0 + c1 * its
    mean rows), and the measured / profiled ratio the catch-ups had moved it to by the case's end."""
    if not m or not q.get("caught_up_steps"):
        return "–"
    rows = q["catch_up_rows"] / q["caught_up_steps"]
    return f"{m['c0_ms'] + m['c1_ms_a_row'] * rows:.2f} (×{m['measured_ratio']:.2f})"


def speculation_intro(rows: list) -> str:
    s = next((s for r in rows for s in getattr(r, "speculation", None) or []), None)
    if s is None:
        return ""
    return (f"Draft `{s['draft']}` ({s['draft_method']}, policy {s['policy']}) on held-out chat prompts (the "
            f"built-in chat corpus's eval family, which no draft trains on), each request decoding exactly "
            f"{s['output_len']} tokens, a batch arriving at once. tok/s: output tokens over the whole call, without "
            "and with the draft (both engines loaded side by side, same shape, their batches alternating); τ: "
            "tokens a speculative sequence-step emits (accepted draft tokens + 1); ≥d: share of speculative "
            "sequence-steps that accepted at least d draft tokens; same tokens: greedy outputs identical with and "
            "without the draft (else how many sequences were, and the largest top-2 log-prob margin of the target "
            "where one parted: a bf16 rounding step, ~0.1, is a tie that other kernels broke the other way).\n\n")


_TIE_MARGIN = 0.5  # a few bf16 rounding steps of logits of magnitude 16..64 (0.125..0.25 each)


def _same_tokens(s: dict) -> str:
    if s.get("identical") is None:
        return "–"
    if s["identical"]:
        return "yes"
    m = s.get("max_divergence_margin")
    if m is None or "seqs" not in s:
        return "**no**"
    n = f"{s['same_seqs']}/{s['seqs']}"
    return f"{n} (ties ≤ {m:.3f})" if m < _TIE_MARGIN else f"**no** ({n}, margin {m:.3f})"


def speed_intro(rows: list) -> str:
    """One paragraph saying how the speed rows were measured (from the first row's first entry)."""
    s = next((s for r in rows for s in getattr(r, "speed", None) or []), None)
    if s is None:
        return ""
    bw = s.get("bandwidth_gb_s")
    roof = (f"the roofline: the time the decode steps need to read the weights and the KV cache once at {bw:.0f} GB/s"
            f", over the time they took" if bw else "no roofline (no bandwidth known for this device)")
    return (f"Each batch: that many requests of {s['prompt_len']} random prompt tokens, all arriving at once, decoded "
            f"greedily to exactly {s['output_len']} tokens; {s['batches']} measured batches per size after a warm-up, "
            f"on {s['device']} in {s['dtype']}, quantized linears on their kernels (as `optllm serve` runs them). "
            "tok/s: output tokens over the whole call (prefill included); decode tok/s: from the first to the last "
            f"token; TTFT: arrival to first token; ITL: between consecutive tokens of a request; {roof}.\n\n")


def write_report(rows: list, out_dir: str | Path, title: str = "optllm eval", comparison: list | None = None,
                 comparison_md: str = "") -> Path:
    """Write report.md, report.json and the plots whose data the rows carry (see the module
    docstring) into out_dir (atomically, via a temp folder); with a comparison against an
    earlier report (eval/compare.py), its table in report.md and its entries in compare.json.
    This process's provenance (eval/provenance.py: date, command, commit, versions, hardware) is
    report.md's last section and report.json's ``provenance`` beside its ``rows``."""
    from .provenance import provenance, provenance_md

    prov = provenance()
    out = Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    intro = ("Perplexity (lower is better) on the held-out split of each text kind; "
             "Δ: change vs the first model.\n\n")
    md = f"# {title}\n"
    if any(r.num_windows for r in rows):
        md += "\n" + intro + markdown_table(rows)
        _plot(rows, tmp / "ppl.png")
        md += "\n![perplexity per text kind](ppl.png)\n"
        bits = {r.model: average_bits(r.model) for r in rows if r.num_windows}
        if any(b is not None for b in bits.values()):
            _plot_quality_bits(rows, bits, tmp / "quality_bits.png")
            md += ("\nPerplexity against average bits per quantized weight (the weights' bits plus their scales' "
                   "and zero points' share; 16 for a float model):\n\n![quality vs bits](quality_bits.png)\n")
    tasks = tasks_table(rows)
    if tasks:
        md += ("\n## lm-eval tasks\n\nEach task's main metric (accuracy-like: higher is better); Δ: points vs the "
               "first model.\n\n" + tasks)
    speed = speed_table(rows)
    if speed:
        _plot_speed(rows, tmp / "speed.png")
        _plot_latency(rows, tmp / "latency.png")
        md += ("\n## Speed\n\n" + speed_intro(rows) + speed + "\n![tok/s against batch size](speed.png)\n\n"
               "![TTFT and ITL percentiles](latency.png)\n")
    spec = speculation_table(rows)
    if spec:
        _plot_acceptance(rows, tmp / "acceptance.png")
        md += ("\n## Speculative decoding\n\n" + speculation_intro(rows) + spec
               + "\n![accepted draft tokens per speculative step](acceptance.png)\n")
        times = speculation_time_table(rows)
        if times:
            md += ("\nWhere the time went (milliseconds summed over the timed batches; runner: the model runner's "
                   "steps, host sync included; host: the rest of the call). Speculative engine: its steps' "
                   "speculative parts (draft catch-up, proposal, verify) and plain parts (prefill chunks, plain "
                   "decodes), and the speculative steps that first ran the draft over rows of earlier plain steps "
                   "(those rows, and the catch-ups' time within the speculative parts); for those, what the "
                   "adaptive policy's start-up profile predicts a catch-up of their mean rows costs, and the "
                   "measured / profiled ratio the catch-ups had moved it to.\n\n" + times)
    if comparison is not None:
        md += "\n## Compared with an earlier run\n\n" + (comparison_md or "No measurement in common.\n")
        (tmp / "compare.json").write_text(json.dumps(comparison, indent=2) + "\n")
    md += "\n" + provenance_md(prov)
    (tmp / "report.md").write_text(md)
    report = {"provenance": prov, "rows": [asdict(r) for r in rows]}
    (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    if out.exists():
        import shutil

        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def average_bits(model: str | Path) -> float | None:
    """Bits per quantized weight of a checkpoint, from its config.json quantization_config:
    num_bits + 16 / group_size for a group's scale (8 / group_size for NVFP4's FP8 scales)
    + num_bits / group_size for its zero point when asymmetric; per-channel or per-tensor
    scales add a negligible share, left out. 16 for a model without a quantization config.
    Several differing weight configs (mixed precision): the average optllm quantize reached,
    from the checkpoint's optllm-report.json (`mixed`; it counts per-channel scales too). None
    when the config cannot be read (never downloads), or several differing weight configs come
    without that report."""
    path = _config_json(model)
    try:
        cfg = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    qc = cfg.get("quantization_config")
    if not qc:
        return 16.0
    weights = [g.get("weights") for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    bits = set()
    for w in weights:
        if not isinstance(w, dict) or not isinstance(w.get("num_bits"), int):
            return None
        n, group = w["num_bits"], w.get("group_size")
        b = float(n)
        if w.get("strategy", "group") in ("group", "tensor_group") and isinstance(group, int) and group > 0:
            scale = 8 if w.get("type") == "float" and n == 4 else 16
            b += scale / group + (0 if w.get("symmetric", True) else n / group)
        bits.add(b)
    if len(bits) == 1:
        return bits.pop()
    return _mixed_bits(path.parent) if bits else None


def _mixed_bits(folder: Path) -> float | None:
    """The average bits a mixed-precision checkpoint's report states (None: no such report)."""
    try:
        report = json.loads((folder / "optllm-report.json").read_text())
        bits = (report.get("mixed") or {}).get("average_bits")
    except (OSError, ValueError, AttributeError):
        return None
    return float(bits) if isinstance(bits, (int, float)) and not isinstance(bits, bool) else None


def _config_json(model: str | Path) -> Path | None:
    """config.json of a model folder, a built-in alias or a hub id already in the local cache."""
    from ..hub.builtin import BUILTIN_MODELS
    from ..hub.loader import resolve_model

    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder / "config.json"
    try:
        if str(model).lower() in BUILTIN_MODELS:
            return resolve_model(model) / "config.json"
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(str(model), "config.json")
    except Exception:  # an id the hub's cache refuses, a conversion that fails: no bits to show
        return None
    return Path(cached) if isinstance(cached, str) else None


def _by_kind(row) -> dict[str, float]:
    return getattr(row, "ppl_by_kind", None) or {"text": row.ppl}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(row) -> str:
    return f"{Path(row.model).name} ({row.kind})"


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)


def _plot_quality_bits(rows: list, bits: dict, path: Path) -> None:
    """One panel per text kind: perplexity against average bits per weight, a point per model."""
    plt = _pyplot()
    kinds = row_kinds([r for r in rows if r.num_windows])
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 3.6), squeeze=False)
    shown = [r for r in rows if r.num_windows and bits.get(r.model) is not None]
    for ax, kind in zip(axes[0], kinds):
        for i, r in enumerate(shown):
            v = _by_kind(r).get(kind)
            if v is None:
                continue
            ax.scatter([bits[r.model]], [v], color=f"C{i % 10}", label=_label(r), zorder=3)
        ax.set_title(kind, fontsize=10)
        ax.set_xlabel("average bits per weight")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("perplexity (lower is better)")
    axes[0][-1].legend(fontsize=7)
    _save(fig, path)


def _speed_series(row, key: str) -> tuple[list[int], list[float]]:
    entries = getattr(row, "speed", None) or []
    return ([s["batch_size"] for s in entries],
            [s[key] if s.get(key) is not None else float("nan") for s in entries])


def _batch_axis(ax, rows) -> None:
    sizes = sorted({s["batch_size"] for r in rows for s in getattr(r, "speed", None) or []})
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 4:
        ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.grid(alpha=0.3)


def _plot_speed(rows: list, path: Path) -> None:
    """Output tok/s and decode tok/s against batch size, a line per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    shown = [r for r in rows if getattr(r, "speed", None)]
    for ax, key, title in zip(axes, ("tok_s", "decode_tok_s"), ("output tok/s (whole call)", "decode tok/s")):
        for i, r in enumerate(shown):
            ax.plot(*_speed_series(r, key), marker="o", color=f"C{i % 10}", label=_label(r))
        ax.set_title(title, fontsize=10)
        _batch_axis(ax, shown)
    axes[0].set_ylabel("tokens / s")
    axes[-1].legend(fontsize=7)
    _save(fig, path)


def _plot_latency(rows: list, path: Path) -> None:
    """TTFT and inter-token latency against batch size: p50 solid, p99 dashed, a colour per model."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    shown = [r for r in rows if getattr(r, "speed", None)]
    for ax, what in zip(axes, ("ttft", "itl")):
        for i, r in enumerate(shown):
            for q, style in (("p50", "-"), ("p99", "--")):
                ax.plot(*_speed_series(r, f"{what}_{q}_ms"), style, marker="o", color=f"C{i % 10}",
                        label=f"{_label(r)} {q}")
        ax.set_title("time to first token" if what == "ttft" else "inter-token latency", fontsize=10)
        ax.set_ylabel("ms")
        _batch_axis(ax, shown)
    axes[-1].legend(fontsize=7)
    _save(fig, path)


def _plot_acceptance(rows: list, path: Path) -> None:
    """Left: the histogram of accepted draft tokens per speculative sequence-step (share of steps),
    a bar group per model at each temperature (batch sizes pooled). Right: speedup against batch
    size, a line per model and temperature."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    shown = [r for r in rows if getattr(r, "speculation", None)]
    series = []
    for r in shown:
        for t in sorted({s["temperature"] for s in r.speculation}):
            ss = [s for s in r.speculation if s["temperature"] == t]
            width = max(len(s["histogram"]) for s in ss)
            hist = [sum(s["histogram"][k] if k < len(s["histogram"]) else 0 for s in ss) for k in range(width)]
            series.append((f"{_label(r)} T={t:g}", hist, ss))
    bar = 0.8 / max(1, len(series))
    for i, (label, hist, ss) in enumerate(series):
        total = sum(hist) or 1
        xs = [k + (i - (len(series) - 1) / 2) * bar for k in range(len(hist))]
        axes[0].bar(xs, [h / total for h in hist], width=bar, color=f"C{i % 10}", label=label)
        sizes = [s["batch_size"] for s in ss]
        axes[1].plot(sizes, [s["speedup"] if s.get("speedup") is not None else float("nan") for s in ss],
                     marker="o", color=f"C{i % 10}", label=label)
    axes[0].set_xlabel("draft tokens accepted in a step")
    axes[0].set_ylabel("share of speculative steps")
    axes[0].legend(fontsize=7)
    axes[1].axhline(1.0, color="grey", lw=0.8)
    axes[1].set_xlabel("batch size")
    axes[1].set_ylabel("speedup over no draft")
    sizes = sorted({s["batch_size"] for _l, _h, ss in series for s in ss})
    if len(sizes) > 1 and sizes[-1] / sizes[0] >= 4:
        axes[1].set_xscale("log", base=2)
    axes[1].set_xticks(sizes, [str(b) for b in sizes])
    axes[1].grid(alpha=0.3)
    _save(fig, path)


def _plot(rows: list, path: Path) -> None:
    """One panel per text kind (their perplexities differ in scale), a bar per model."""
    plt = _pyplot()
    kinds = row_kinds(rows)
    fig, axes = plt.subplots(1, len(kinds), figsize=(len(kinds) * max(3, 1.1 * len(rows) + 1.5), 3.6), squeeze=False)
    labels = [f"{Path(r.model).name}\n{r.kind}" for r in rows]
    for ax, kind in zip(axes[0], kinds):
        values = [_by_kind(r).get(kind, float("nan")) for r in rows]
        ax.bar(range(len(rows)), values, color="#4477aa")
        ax.set_xticks(range(len(rows)), labels, fontsize=7)
        ax.set_title(kind, fontsize=10)
        seen = [v for v in values if v == v]
        ax.set_ylim(min(seen) * 0.95, max(seen) * 1.02)
    axes[0][0].set_ylabel("perplexity (lower is better)")
    _save(fig, path)
