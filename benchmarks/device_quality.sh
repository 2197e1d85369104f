#!/usr/bin/env bash
# On the lent H200 (see ../shared/DEVICE.md): assemble the staged SmolLM2 GGUF, then run
# benchmarks/quality.py (W4 and W3, with the W4A16 kernel check; QUALITY_ARGS adds flags).
# Logs and tables go to $OUT.
set -uo pipefail
mkdir -p /root/cache/gguf
f=/root/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$f" ] || cat /root/m/*.part00 .carry2/*.part01 > "$f"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .carry2/whl/*.whl
export PYTHONPATH=/tmp/site:$(dirname "$PWD") OPTLLM_CACHE=/root/cache PYTHONUNBUFFERED=1
# the repo root is the package: expose it as `optllm`
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
timeout "${QUALITY_TIMEOUT:-420}" python3 benchmarks/quality.py --out /root/q --device cuda --bits "${BITS:-4,3}" --kernels ${QUALITY_ARGS:-} 2>&1 | grep -v "Loading weights" | tee "$OUT/quality.log"
cp /root/q/quality.md /root/q/quality.json "$OUT/" 2>/dev/null
