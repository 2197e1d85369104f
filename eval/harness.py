"""lm-eval tasks over the runtime, for ``optllm eval --tasks``: every model on the same tasks,
documents and few-shot examples, scored by lm-eval's own ``simple_evaluate`` through
``OptllmLM`` (eval/lm_eval_model.py).

Task names are lm-eval's (a task, a group or a tag: ``arc_easy``, ``optllm_offline``), looked
up in optllm's own task folder, the folders given as include paths, and -- only when a name is
found in none of those -- lm-eval's built-in task index (a few seconds to build; its tasks need
their datasets, which a machine without the Hugging Face hub cannot download).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError

# the metric a row shows per task when it reports several (lm-eval's names, filter stripped)
_MAIN_METRICS = ("acc_norm", "acc", "exact_match", "f1", "bleu", "word_perplexity")


def parse_tasks(tasks: str | Sequence[str] | None) -> tuple[bool, list[str]]:
    """(ppl asked for, lm-eval task names) from a comma-separated string or a sequence; "ppl"
    stands for the built-in perplexity measurement."""
    if tasks is None:
        return False, []
    items = [t.strip() for t in (tasks.split(",") if isinstance(tasks, str) else tasks)]
    if any(not t for t in items):
        raise UserError(f"--tasks {','.join(items)!r}: an empty task name; allowed: comma-separated lm-eval "
                        "task names, tags or groups, and ppl")
    names = list(dict.fromkeys(t for t in items if t != "ppl"))
    return "ppl" in items, names


def task_manager(names: Sequence[str], include_path: Sequence[str | Path] = ()):
    """A TaskManager that knows every name (UserError naming the unknown ones otherwise)."""
    from .tasks import task_manager as optllm_tasks

    for p in include_path:
        if not Path(p).is_dir():
            raise UserError(f"--include-path {p}: not a folder; allowed: a folder of lm-eval task YAML files")
    tm = optllm_tasks(include_path)
    if _unknown(tm, names):
        tm = optllm_tasks(include_path, include_defaults=True)
    missing = _unknown(tm, names)
    if missing:
        raise UserError(f"--tasks: unknown task(s) {', '.join(missing)}; allowed: lm-eval task names, groups or "
                        f"tags (optllm's own: optllm_mc, optllm_gen, tag optllm_offline), or folders of task YAML "
                        f"files given with --include-path")
    return tm


def _unknown(tm, names: Sequence[str]) -> list[str]:
    known = set(tm.all_tasks)
    return [n for n in names if n not in known]


def evaluate_tasks(models: Sequence[str], names: Sequence[str], include_path: Sequence[str | Path] = (),
                   limit: int | float | None = None, num_fewshot: int | None = None, device: str = "cpu",
                   dtype: str = "float32", max_model_len: int | None = None, batch_size: int | None = None,
                   seed: int = 0, log_samples: bool = False) -> list[dict]:
    """lm-eval results per model, in order: {"tasks": {task: {metric: value}}, "main":
    {task: (metric, value)}, "n_samples": {task: documents}, "versions": {...}, "scheme": the
    checkpoint's, "seconds": load and every task}."""
    import lm_eval

    from .lm_eval_model import OptllmLM

    if limit is not None and (limit <= 0 or (isinstance(limit, float) and limit > 1)):
        raise UserError(f"--limit {limit}: allowed: a number of documents >= 1 per task")
    tm = task_manager(names, include_path)
    out = []
    for model in models:
        t0 = time.perf_counter()
        seconds = lambda: time.perf_counter() - t0  # noqa: E731
        lm = OptllmLM(model, device=device, dtype=dtype, max_model_len=max_model_len, batch_size=batch_size)
        res = lm_eval.simple_evaluate(model=lm, tasks=list(names), task_manager=tm, limit=limit,
                                      num_fewshot=num_fewshot, log_samples=log_samples, random_seed=seed,
                                      numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed)
        from .evaluate import checkpoint_kind

        out.append(dict(summarize(res), scheme=checkpoint_kind(lm.llm.engine.source.folder), seconds=seconds()))
        del lm
        gc.collect()
    return out


def summarize(res: dict) -> dict:
    """lm-eval's results dict -> per task {metric: value} (filters joined into the name when not
    lm-eval's default "none", standard errors left out) and one main metric per task."""
    tasks: dict[str, dict[str, float]] = {}
    for task, metrics in res.get("results", {}).items():
        vals = {}
        for key, v in metrics.items():
            if key == "alias" or "_stderr" in key or not isinstance(v, (int, float)):
                continue
            metric, _, flt = key.partition(",")
            vals[metric if flt in ("", "none") else f"{metric} ({flt})"] = float(v)
        if vals:
            tasks[task] = vals
    main = {}
    for task, vals in tasks.items():
        pick = next((m for base in _MAIN_METRICS for m in vals if m == base or m.startswith(base + " (")), None)
        pick = pick or next(iter(vals))
        main[task] = (pick, vals[pick])
    n = {t: int(v.get("effective", v.get("original", 0))) if isinstance(v, dict) else int(v)
         for t, v in res.get("n-samples", {}).items()}
    return dict(tasks=tasks, main=main, n_samples=n, versions=dict(res.get("versions", {})))
