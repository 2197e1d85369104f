"""optllm: compress, draft, serve and measure Hugging Face causal LMs.

``from optllm import LLM, SamplingParams`` gives the serving runtime's Python API; they are
imported on first use, so ``import optllm`` stays light.
"""

__version__ = "0.1.0"

_LAZY = {"LLM": "optllm.runtime.llm", "SamplingParams": "optllm.runtime.sampling_params",
         "AsyncLLMEngine": "optllm.runtime.async_engine", "EngineConfig": "optllm.runtime.config"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'optllm' has no attribute {name!r}")


__all__ = ["LLM", "SamplingParams", "AsyncLLMEngine", "EngineConfig", "__version__"]
