#!/usr/bin/env bash
# The eighteenth session's device work, after staging (.carry1's part in /root/m; carry .carry2 and
# .carry-draft):
#   1. GPU tests TESTS (default: the fused top-k kernel and the speculative step under graphs)
#   2. benchmarks/topk.py: the fused top-k against torch's log_softmax + topk, unless NO_TOPK
#   3. issue 15: the speculative step graphs kernel by kernel (profile_step.py --spec-trees
#      SPEC_TREES), unless NO_SPEC_PROFILE
#   4. issue 15: the adaptive policy end to end (optllm eval --draft, batches BS, temperatures
#      TEMPS, or TEMPS_<run> for one run; SPEC_LOAD waves | continuous), unless NO_SPEC; RUNS=n
#      repeats it (the spread between runs is the noise)
#   5. EXTRA: a command line run last (optional)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs"
source benchmarks/device_stage.sh
if [ -n "${TESTS-tests/kernels/test_topk.py tests/runtime/test_spec_gpu.py}" ]; then
  timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    ${TESTS-tests/kernels/test_topk.py tests/runtime/test_spec_gpu.py} > "$OUT/logs/gpu_tests.log" 2>&1
  tail -2 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
fi
[ -n "${NO_TOPK:-}" ] || timeout 120 python3 benchmarks/topk.py --out "$OUT/topk" > "$OUT/logs/topk.log" 2>&1 || echo "topk exited $?"
mkdir -p /root/d && cat .carry-draft/draft*.tgz.part* | tar xzf - -C /root/d || exit 1
if [ -z "${NO_SPEC_PROFILE:-}" ]; then
  timeout "${PROF_S:-240}" python3 benchmarks/profile_step.py --model smollm2-135m --draft /root/d/eagle \
    --batches "${PROFILE_BS:-1,8,64}" --spec-trees "${SPEC_TREES:-2,5,20}" --rounds 3 --out "$OUT/specprof" \
    > "$OUT/logs/profile_spec.log" 2>&1 || echo "spec profile exited $?"
fi
for r in $(seq 1 "${RUNS:-1}"); do
  [ -n "${NO_SPEC:-}" ] && break
  timeout "${SPEC_S:-200}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/eagle \
    --temperatures "$(eval echo \${TEMPS_$r:-\${TEMPS:-0}})" --batch-sizes "${BS:-1,8,64}" --spec-policy auto --spec-load "${SPEC_LOAD:-waves}" --out /root/spec-auto-$r \
    > "$OUT/logs/spec_auto_$r.log" 2>&1 || echo "spec eval $r exited $?"
  cp /root/spec-auto-$r/report.md "$OUT/spec_auto_$r.md" 2>/dev/null
  cp /root/spec-auto-$r/report.json "$OUT/spec_auto_$r.json" 2>/dev/null
done
[ -z "${EXTRA:-}" ] || eval "$EXTRA"
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
grep "^###" "$OUT"/specprof/profile_step.md 2>/dev/null
grep "^|" "$OUT"/topk/topk.md 2>/dev/null
for f in "$OUT"/spec_auto_*.md; do [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -30; }; done
