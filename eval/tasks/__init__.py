"""optllm's own lm-eval tasks (lm-eval's local task format: YAML + JSON lines), shipped with
the package so lm-eval always has something to run offline.

    optllm_mc   multiple choice, 42 questions (acc, acc_norm)
    optllm_gen  generation, 32 questions (exact_match, strict-match and first-word filters)

Both carry the tag ``optllm_offline``. ``task_manager()`` gives an lm-eval TaskManager that
knows them; ``builtin_task_dir()`` is the folder, for any TaskManager's include_path.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

BUILTIN_TASKS = ("optllm_mc", "optllm_gen")
TAG = "optllm_offline"


def builtin_task_dir() -> Path:
    """The folder holding the YAML files and data of optllm's own tasks."""
    return Path(__file__).resolve().parent


def task_manager(include_path: str | Path | Sequence[str | Path] = (), include_defaults: bool = False):
    """An lm_eval TaskManager that knows optllm's tasks, plus any task folders in include_path.
    include_defaults: also index lm-eval's own tasks (thousands of files: a few seconds)."""
    from lm_eval.tasks import TaskManager

    extra = [include_path] if isinstance(include_path, (str, Path)) else list(include_path)
    return TaskManager(include_path=[str(builtin_task_dir()), *map(str, extra)], include_defaults=include_defaults)
