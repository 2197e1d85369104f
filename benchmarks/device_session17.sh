#!/usr/bin/env bash
# The seventeenth session's device work, after staging (.carry1's part in /root/m; carry .carry2 and
# .carry-draft):
#   1. GPU tests TESTS (default: the W4A16 kernels, whose built-in table changed in 6443f27)
#   2. issue 15: a draft engine's decode graph against draft-less ones, kernel by kernel
#      (profile_step.py --model --draft), unless NO_DRAFT_PROFILE
#   3. issue 13: gemm.py on the 8B shapes with the weights read from HBM (--l2 flush), W4A16 against
#      cuBLAS bf16 and tinygemm, at M = GEMM_MS, unless NO_GEMM
#   4. EXTRA: a command line run last (optional)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs"
source benchmarks/device_stage.sh
if [ -n "${TESTS-tests/kernels/test_w4a16.py}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS-tests/kernels/test_w4a16.py} \
    > "$OUT/logs/gpu_tests.log" 2>&1
  tail -2 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
fi
mkdir -p /root/d && cat .carry-draft/draft*.tgz.part* | tar xzf - -C /root/d || exit 1
if [ -z "${NO_DRAFT_PROFILE:-}" ]; then
  timeout "${PROF_S:-200}" python3 benchmarks/profile_step.py --model smollm2-135m --draft /root/d/eagle \
    --batches "${PROFILE_BS:-1,8,64}" --out "$OUT/draft_profile" > "$OUT/logs/profile_draft.log" 2>&1 || echo "draft profile exited $?"
fi
if [ -z "${NO_GEMM:-}" ]; then
  timeout "${GEMM_S:-150}" python3 benchmarks/gemm.py --shapes qkv,o,gate_up,down --ms "${GEMM_MS:-1,16,64,256}" \
    --ops cublas_bf16,tinygemm_int4,ours_w4a16 --l2 flush --no-eager --out "$OUT/gemm" > "$OUT/logs/gemm.log" 2>&1 || echo "gemm exited $?"
fi
[ -z "${EXTRA:-}" ] || eval "$EXTRA"
grep "graph .* us (rounds" "$OUT/logs/profile_draft.log" 2>/dev/null
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
grep "^###" "$OUT"/draft_profile/profile_step.md 2>/dev/null
grep "^|" "$OUT"/gemm/*.md 2>/dev/null | head -24
