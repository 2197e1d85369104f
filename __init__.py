"""optllm: compress, draft, serve and measure Hugging Face causal LMs.

``from optllm import LLM, SamplingParams`` gives the serving runtime's Python API; they are
imported on first use, so ``import optllm`` stays light.
"""

import os as _os
import sys as _sys

__version__ = "0.1.0"

# This checkout is the package itself. Where its folder is on sys.path (`python -m ...` run from
# its root puts the current folder first), its subpackages are also top-level modules and shadow
# installed ones of the same name: `kernels`, which transformers >= 5.25 imports from the HF
# `kernels` distribution, got ours. Nothing imports them that way, so that entry is dropped.
_ROOT = _os.path.realpath(_os.path.dirname(__file__))
_sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != _ROOT]

_LAZY = {"LLM": "optllm.runtime.llm", "SamplingParams": "optllm.runtime.sampling_params",
         "AsyncLLMEngine": "optllm.runtime.async_engine", "EngineConfig": "optllm.runtime.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "AsyncLLMEngine", "EngineConfig", "__version__"]
