#!/usr/bin/env bash
# Issue 15 on one H200 with a draft an earlier call trained (device_awq_eagle.sh DRAFT_OUT=1): its
# pieces carried in .carry-draft/draft.tgz.part*. Then
#  1. the speculative-decoding section of `optllm eval` (greedy; the adaptive policy at batches
#     BS, default 1,8,32,64; the fixed policy at batch 1);
#  2. where a speculative step's time goes: benchmarks/profile_spec_off.py at batch 1 and 8 with
#     trees of TREES draft nodes always on, beside plain decoding (kernels and device ms a step).
# Before: .carry1's part in /root/m; carry .carry2 and .carry-draft. Results: $OUT/*.md, logs.tgz.
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs" /root/d
cat .carry-draft/draft.tgz.part* | tar xzf - -C /root/d || exit 1
spec() {  # spec POLICY BATCHES SECONDS [TEMPERATURES]
  timeout "$3" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/eagle \
    --temperatures "${4:-${TEMPS:-0}}" --batch-sizes "$2" --spec-policy "$1" --out "/root/spec-$1" > "$OUT/logs/spec_$1.log" 2>&1
  cp "/root/spec-$1/report.md" "$OUT/spec_$1.md" 2>/dev/null
}
spec auto "${BS:-1,8,32,64}" "${SPEC_S:-200}"
spec fixed "${FIXED_BS:-1}" "${SPEC1_S:-70}" "${FIXED_TEMPS:-}"
for b in ${PROFILE_BS-1 8}; do  # PROFILE_BS="": no profile
  timeout "${PROF_S:-100}" python3 benchmarks/profile_spec_off.py smollm2-135m --draft /root/d/eagle --batch "$b" \
    --trees "${TREES:-40,8}" --profile --steps 30 > "$OUT/logs/profile_bs$b.log" 2>&1
  grep -A 8 "^| engine" "$OUT/logs/profile_bs$b.log" > "$OUT/profile_bs$b.md"
done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
grep -h "^|" "$OUT"/spec_*.md 2>/dev/null
cat "$OUT"/profile_bs*.md
