#!/usr/bin/env bash
# One device call for W4A16 work on the lent H200 (../shared/DEVICE.md): the kernel tests on
# the GPU (PTX dequant paths included), the streaming ceiling (CEILING=1), the tuning sweep at
# decode sizes, then the GEMM table with the sweep's winners (OPTLLM_W4A16_TABLE).
# TESTS / TUNE_MS / TUNE_BUDGET_S / TUNE_ARGS (e.g. --layout n) / GEMM_MS / GEMM_ARGS (e.g.
# --w4-layout n) adjust it (TUNE_MS=none skips the sweep, GEMM_MS=none the table); logs and
# JSON go to $OUT.
set -uo pipefail
export PYTHONPATH=$(dirname "$PWD") PYTHONUNBUFFERED=1
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q ${TESTS:-tests/kernels/test_w4a16.py} -m "not slow" -p no:cacheprovider \
  > "$OUT/pytest_w4a16.log" 2>&1
tail -3 "$OUT/pytest_w4a16.log"
grep -q " failed" "$OUT/pytest_w4a16.log" && { grep -m 20 "FAILED\|Error" "$OUT/pytest_w4a16.log"; exit 1; }
[ "${CEILING:-0}" = 1 ] && python3 benchmarks/stream_ceiling.py --out "$OUT" 2>&1 | tee "$OUT/ceiling.log" | tail -7
if [ "${TUNE_MS:-}" != none ]; then
  python3 benchmarks/tune_w4a16.py --ms "${TUNE_MS:-1,16,64}" --budget-s "${TUNE_BUDGET_S:-300}" \
    ${TUNE_ARGS:-} --out "$OUT" 2>&1 | tee "$OUT/tune.log" | grep -v "^    (" | tail -25
fi
[ "${GEMM_MS:-}" = none ] && exit 0
[ -f "$OUT/w4a16_table.json" ] && export OPTLLM_W4A16_TABLE=$OUT/w4a16_table.json
python3 benchmarks/gemm.py --ms "${GEMM_MS:-1,16,64,256,4096}" ${GEMM_ARGS:-} --out "$OUT" > "$OUT/gemm.log" 2>&1
tail -"${GEMM_TAIL:-22}" "$OUT/gemm.log"
