#!/usr/bin/env bash
# Create .venv-llmc: the peer virtual environment in which benchmarks/peer_llmcompressor.py
# runs llm-compressor's GPTQ and AWQ ("quantize"). It is separate from .venv because
# llm-compressor pins transformers <= 5.17 (ours runs 5.24) and compressed-tensors ==
# its own release; nothing of optllm is installed in it.
#
#   bash benchmarks/peer_llmcompressor.sh            # creates (or completes) .venv-llmc
#   VENV=/elsewhere bash benchmarks/peer_llmcompressor.sh
#
# Pins (the newest that install together here, checked with pip download --no-deps):
#   llmcompressor 0.14.0.1 requires transformers >=5.15.0,<=5.17.0, compressed-tensors ==0.19.0,
#   torch >=2.10,<=2.14.0, datasets >=4.8.4, accelerate >=1.15.0, auto-round <=0.15.1.
#   transformers 5.17.0 is the newest it accepts; compressed-tensors 0.19.0 is the one it pins.
# torch goes in FIRST, alone and pinned to 2.13.0: pip's configuration serves a CPU wheel of
# it from local disk, while a plain "torch" requirement resolved with the rest could fetch a
# multi-GB CUDA build. Later installs see it satisfied and keep it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv-llmc}"
PYTHON="${PYTHON:-python3.11}"

TORCH_PIN="torch==2.13.0"
LLMC_PINS=(
  "llmcompressor==0.14.0.1"
  "transformers==5.17.0"
  "compressed-tensors==0.19.0"
)

if [ ! -x "$VENV/bin/python" ]; then
  echo "creating $VENV with $PYTHON"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip
"${PIP[@]}" install -q "$TORCH_PIN"
"${PIP[@]}" install -q "$TORCH_PIN" "${LLMC_PINS[@]}"

"$VENV/bin/python" - <<'EOF'
import importlib.metadata as md
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
import llmcompressor  # noqa: F401  (fails here, not in the middle of a benchmark)
from llmcompressor.modifiers.quantization import GPTQModifier  # noqa: F401
from llmcompressor.modifiers.awq import AWQModifier  # noqa: F401
print("peer venv ready: " + ", ".join(
    f"{p} {md.version(p)}" for p in ("llmcompressor", "compressed-tensors", "transformers", "torch", "datasets")))
EOF
