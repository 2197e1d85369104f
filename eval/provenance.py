"""Where a report's numbers came from: date, command, code, versions and hardware, as
report.md's last section and report.json's ``provenance``."""

from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

PACKAGES = ("torch", "triton", "transformers", "lm_eval", "accelerate", "safetensors")


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), *args], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def commit() -> str:
    """$OPTLLM_COMMIT when set (a copy of the tree whose .git is stale or absent), else the
    package checkout's HEAD, "+dirty" when it has uncommitted changes; "?" outside a checkout."""
    c = os.environ.get("OPTLLM_COMMIT", "")
    if not c:
        c = _git("rev-parse", "--short", "HEAD")
        if c and _git("status", "--porcelain", "--untracked-files=no"):
            c += "+dirty"
    return c or "?"


def command(argv: list[str] | None = None) -> str:
    """The command line as a user would type it again (``optllm ...`` for the CLI)."""
    argv = list(sys.argv if argv is None else argv)
    head = Path(argv[0]).name if argv else ""
    if head in ("optllm", "__main__.py", "-m"):
        return shlex.join(["optllm", *argv[1:]])
    return shlex.join([Path(sys.executable).name, *argv])


def hardware() -> str:
    import torch

    cpu = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name()} (CUDA {torch.version.cuda}); {cpu}"
    return cpu


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in ("optllm", *PACKAGES):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    import torch  # the running one (a site folder on the path may differ from the installed metadata)

    out["torch"] = torch.__version__
    return out


def provenance(argv: list[str] | None = None) -> dict:
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "command": command(argv),
            "commit": commit(), "hardware": hardware(), "versions": versions()}


def provenance_md(p: dict) -> str:
    lines = ["## Provenance", "", f"- date: {p['date']}", f"- command: `{p['command']}`",
             f"- code: optllm {p['versions'].get('optllm', '?')}, commit {p['commit']}",
             f"- hardware: {p['hardware']}",
             "- versions: " + ", ".join(f"{k} {v}" for k, v in p["versions"].items() if k != "optllm")]
    return "\n".join(lines) + "\n"
