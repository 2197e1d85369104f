"""optllm: compress, draft, serve and measure Hugging Face causal LMs."""

__version__ = "0.1.0"
