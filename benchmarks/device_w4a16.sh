#!/usr/bin/env bash
# One device call for W4A16 work on the lent H200 (../shared/DEVICE.md): the kernel tests on
# the GPU (PTX dequant paths included), the tuning sweep at decode sizes, then the GEMM table.
# TESTS / TUNE_MS / TUNE_BUDGET_S / TUNE_ARGS / GEMM_MS adjust it (GEMM_MS=none skips the
# table); logs and JSON go to $OUT.
set -uo pipefail
export PYTHONPATH=$(dirname "$PWD") PYTHONUNBUFFERED=1
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q ${TESTS:-tests/kernels/test_w4a16.py} -m "not slow" -p no:cacheprovider \
  > "$OUT/pytest_w4a16.log" 2>&1
tail -3 "$OUT/pytest_w4a16.log"
grep -q " failed" "$OUT/pytest_w4a16.log" && { grep -m 20 "FAILED\|Error" "$OUT/pytest_w4a16.log"; exit 1; }
python3 benchmarks/tune_w4a16.py --ms "${TUNE_MS:-1,16,64}" --budget-s "${TUNE_BUDGET_S:-300}" \
  ${TUNE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/tune.log" | tail -25
[ "${GEMM_MS:-}" = none ] && exit 0
python3 benchmarks/gemm.py --ms "${GEMM_MS:-1,16,64,256,4096}" --out "$OUT" > "$OUT/gemm.log" 2>&1
tail -22 "$OUT/gemm.log"
