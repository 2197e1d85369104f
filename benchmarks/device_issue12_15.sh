#!/usr/bin/env bash
# One device call, H200, jobs side by side (fourteenth session):
#  issue 12 at the default calibration (128 x 512), every window of each text kind, float32
#  (benchmarks/quality.py): W4 sym RTN / GPTQ / AWQ / AWQ joint_clip, W4 asym RTN / GPTQ / AWQ
#  joint_clip, W3 sym and asym RTN / GPTQ -- GPTQ with its current default grid (hmse);
#  the GPU tests (TESTS); issue 15's EAGLE draft trained on the float target (TRAIN_S, data
#  included), returned as $OUT/draft.tgz.part* for device_spec_profile.sh in the next call.
# Before: .carry1's part in /root/m; carry .carry2. Results: $OUT/q_*.md|json, gpu_tests.log, logs.tgz.
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs" /root/sweep /root/d
Q="python3 benchmarks/quality.py --device cuda --group-size 64"
JOINT="awq-joint:awq:awq={joint_clip: true}"
job() {  # job NAME ARGS...: one quality.py run, its table and JSON copied back
  local name=$1; shift
  ( timeout "${SWEEP_S:-500}" $Q --out "/root/sweep/$name" "$@" > "$OUT/logs/sweep_$name.log" 2>&1
    cp "/root/sweep/$name/quality.md" "$OUT/q_$name.md"; cp "/root/sweep/$name/quality.json" "$OUT/q_$name.json" ) &
}
job w4sym --bits 4 --symmetry sym --algos rtn,gptq,awq --variant "$JOINT"
job w4asym --bits 4 --symmetry asym --algos rtn,gptq --variant "$JOINT"
job w3 --bits 3 --symmetry sym,asym --algos rtn,gptq
if [ -n "${TESTS:-}" ]; then
  ( timeout "${TESTS_S:-450}" python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu_tests.log" 2>&1 ) &
fi
if [ "${TRAIN_S:-0}" -gt 0 ]; then
  ( timeout $(( TRAIN_S + 40 )) python3 -m optllm train-draft smollm2-135m --method eagle --out /root/d/eagle \
      --device cuda --num-prompts "${PROMPTS:-4096}" --max-steps 20000 --batch-size 16 \
      --time-limit "$TRAIN_S" --overwrite > "$OUT/logs/train_eagle.log" 2>&1
    cp /root/d/eagle/*.json "$OUT/" 2>/dev/null
    tar czf /tmp/draft.tgz -C /root/d --exclude 'checkpoint-*' eagle && split -b 15m /tmp/draft.tgz "$OUT/draft.tgz.part" ) &
fi
wait
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
tar xzf "$OUT/logs.tgz" -O logs/train_eagle.log 2>/dev/null | grep -v "^step" | tail -6
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
cat "$OUT"/q_*.md
