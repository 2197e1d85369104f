#!/usr/bin/env bash
# One device call for the runtime issue: GPU tests of the runtime and its kernels, then
# benchmarks/decode.py case by case (each under its own time limit, so one slow case cannot
# take the others' results with it). Everything lands in $OUT; the tables print last.
# Usage (on the H200): bash benchmarks/device_runtime.sh [decode.py args...]
# Environment: CASES (default "smol 8b-bf16 8b-w4a16 serve256"), TESTS=0 skips the GPU tests,
# TIMEOUT_<case> (e.g. TIMEOUT_8b_bf16=250) or CASE_TIMEOUT per case, SERVE=0 skips serve.py,
# TUNE_GEMV=1 runs tune_gemv.py (GEMV_SHAPES, default 8b). Wheels in .whl/ (the server's
# fastapi / uvicorn / pydantic, which the GPU image lacks) are installed to /tmp/site first.
# $OUT keeps at most 8 files: everything is packed into results.tgz, the tables stay beside it.
set -uo pipefail
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
# the repo root is the package: expose it as `optllm`
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
export PYTHONPATH=$(dirname "$PWD")${PYTHONPATH:+:$PYTHONPATH}
export OPTLLM_COMMIT=${OPTLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())"
[ "${TESTS:-1}" = 0 ] || timeout "${TEST_TIMEOUT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider \
  ${TEST_PATHS:-tests/kernels/test_paged_attention.py tests/kernels/test_rmsnorm.py tests/kernels/test_rotary.py \
  tests/kernels/test_activation.py tests/kernels/test_gemv.py tests/kernels/test_fp8.py tests/runtime tests/quant/test_fp8_scheme.py} 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
# the dense decode GEMV against cuBLAS at M = 1 (fills kernels/gemv.py's table): TUNE_GEMV=1; the
# cases below then run with the table it found (OPTLLM_GEMV_TABLE)
if [ "${TUNE_GEMV:-0}" = 1 ]; then
  timeout "${GEMV_TIMEOUT:-300}" python3 benchmarks/tune_gemv.py --shapes "${GEMV_SHAPES:-8b}" --out "$OUT" >> "$OUT/decode.log" 2>&1 \
    || echo "tune_gemv exited $?" | tee -a "$OUT/decode.log"
  cat "$OUT/tune_gemv.md" 2>/dev/null
  [ -f "$OUT/gemv_configs.json" ] && export OPTLLM_GEMV_TABLE="$OUT/gemv_configs.json"
fi
for case in ${CASES:-smol 8b-bf16 8b-w4a16 serve256}; do
  limit=TIMEOUT_${case//-/_}
  timeout "${!limit:-${CASE_TIMEOUT:-120}}" python3 benchmarks/decode.py --cases "$case" --tag "decode-$case" --out "$OUT" "$@" \
    >> "$OUT/decode.log" 2>&1 || echo "case $case exited $?" | tee -a "$OUT/decode.log"
done
# the server's overhead on the serve256 requests (64 concurrent streaming clients)
if [ -n "${SERVE:-1}" ] && [ "${SERVE:-1}" != 0 ]; then
  timeout "${SERVE_TIMEOUT:-240}" python3 benchmarks/serve.py --out "$OUT" >> "$OUT/decode.log" 2>&1 \
    || echo "serve benchmark exited $?" | tee -a "$OUT/decode.log"
  cat "$OUT/serve.md" 2>/dev/null
fi
# one table (the per-case .json files keep every number)
{ head -8 "$OUT"/decode-*.md 2>/dev/null | grep "^- " | sort -u; echo; cat "$OUT"/decode-*.md 2>/dev/null | grep "^|" | awk '!seen[$0]++'; } > "$OUT/decode.md"
rm -f "$OUT"/decode-*.md
cat "$OUT/decode.md"
(cd "$OUT" && tar czf results.tgz --exclude results.tgz . 2>/dev/null && find . -type f ! -name results.tgz ! -name '*.md' -delete)
ls -la "$OUT"
