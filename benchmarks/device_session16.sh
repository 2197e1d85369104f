#!/usr/bin/env bash
# The sixteenth session's device work, after staging (.carry1's part in /root/m):
#   PART=spec  (carry .carry2 and .carry-draft): issue 15's adaptive policy at batches BS (1,8,64),
#              temperatures TEMPS (0,1), with where each engine's time went (eval's new time split);
#              then issue 13's kernel-level profile of SmolLM2-shaped decode steps (profile_step.py)
#   PART=tune  (no staging): W4A16 configs for SmolLM2's shapes at M = TUNE_MS (1) with the weights
#              read from HBM (tune_w4a16.py --l2 flush, TUNE_S seconds), then profile_step.py's
#              SmolLM2-shaped decode graphs at batch 1 with the winners
#   PART=awq   (right after, same machine): issue 12's AWQ with clip_expand at the default
#              calibration (128 x 512), W4 and W3 symmetric; then the GPU tests
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs"
if [ "${PART:-spec}" = tune ]; then  # no model staged: SmolLM2-shaped random weights only
  export PYTHONPATH=$(dirname "$PWD") OPTLLM_COMMIT=${OPTLLM_COMMIT:-?}
  ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
  timeout $((TUNE_S + 60)) python3 benchmarks/tune_w4a16.py --shapes smol_qkv,smol_o,smol_gate_up,smol_down \
    --ms "${TUNE_MS:-1}" --budget-s "$TUNE_S" --out "$OUT" > "$OUT/logs/tune.log" 2>&1 || echo "tune exited $?"
  grep -v "^    (" "$OUT/logs/tune.log" | tail -12
  OPTLLM_W4A16_TABLE="$OUT/w4a16_table.json" timeout "${PROF_S:-150}" python3 benchmarks/profile_step.py \
    --cases smol,smol-w4a16 --batches 1 --out "$OUT" > "$OUT/logs/profile_step.log" 2>&1 || echo "profile exited $?"
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  grep "^###\|^| [a-zA-Z]" "$OUT/profile_step.md" | grep -v "^| \`" | head -30
  exit 0
fi
source benchmarks/device_stage.sh
if [ "${PART:-spec}" = spec ]; then
  if [ -n "${TESTS:-}" ]; then  # GPU tests first
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$OUT/logs/gpu_tests.log" 2>&1
    tail -2 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  fi
  mkdir -p /root/d && cat .carry-draft/draft*.tgz.part* | tar xzf - -C /root/d || exit 1
  [ -n "${NO_SPEC:-}" ] || timeout "${SPEC_S:-330}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/eagle \
    --temperatures "${TEMPS:-0,1}" --batch-sizes "${BS:-1,8,64}" --spec-policy auto --out /root/spec-auto \
    > "$OUT/logs/spec_auto.log" 2>&1 || echo "spec eval exited $?"
  cp /root/spec-auto/report.md "$OUT/spec_auto.md" 2>/dev/null; cp /root/spec-auto/report.json "$OUT/spec_auto.json" 2>/dev/null
  if [ -n "${DRAFT_PROFILE:-}" ]; then  # a draft engine's decode graph against draft-less ones
    timeout "${PROF_S:-200}" python3 benchmarks/profile_step.py --model smollm2-135m --draft /root/d/eagle \
      --batches "${PROFILE_BS:-1,8,64}" --out "$OUT/draft_profile" > "$OUT/logs/profile_draft.log" 2>&1 || echo "draft profile exited $?"
    grep "graph" "$OUT/logs/profile_draft.log" | grep -v Warn | head -20
  fi
  if [ -n "${TUNE_S:-}" ]; then  # W4A16 configs for SmolLM2's shapes, weights read from HBM; decode + profile with them
    timeout $((TUNE_S + 60)) python3 benchmarks/tune_w4a16.py --shapes smol_qkv,smol_o,smol_gate_up,smol_down \
      --ms "${TUNE_MS:-1}" --budget-s "$TUNE_S" --out "$OUT" > "$OUT/logs/tune.log" 2>&1 || echo "tune exited $?"
    grep -v "^    (" "$OUT/logs/tune.log" | tail -12
    export OPTLLM_W4A16_TABLE="$OUT/w4a16_table.json"
  fi
  [ -n "${NO_PROFILE:-}" ] || timeout "${PROF_S:-150}" python3 benchmarks/profile_step.py --cases smol,smol-w4a16 --batches 1,64 --out "$OUT" \
    > "$OUT/logs/profile_step.log" 2>&1 || echo "profile exited $?"
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  grep "^###\|^| [a-zA-Z]" "$OUT/profile_step.md" | grep -v "^| \`" | head -60
  grep -h "^|" "$OUT"/spec_auto.md 2>/dev/null | head -40
else
  timeout "${AWQ_S:-230}" python3 benchmarks/quality.py --device cuda --num-samples 128 --seq-len 512 --bits "${BITS:-4,3}" \
    --symmetry sym --algos "${ALGOS:-}" --variant "awq-exp:awq:awq={clip_expand: true}" --out /root/q \
    > "$OUT/logs/quality.log" 2>&1 || echo "quality exited $?"
  cp /root/q/*.md /root/q/*.json "$OUT/" 2>/dev/null
  grep "^|" "$OUT"/*.md | head -20
  timeout "${TEST_TIMEOUT:-290}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-tests/kernels tests/runtime/test_spec_gpu.py} \
    > "$OUT/logs/gpu_tests.log" 2>&1
  tail -3 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
fi
