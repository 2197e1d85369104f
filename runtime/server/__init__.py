"""The OpenAI-compatible HTTP server (`optllm serve`): FastAPI + uvicorn over AsyncLLMEngine."""
