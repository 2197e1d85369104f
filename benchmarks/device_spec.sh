#!/usr/bin/env bash
# One device call for the speculative-decoding issue (15) and the eval report (16), on the H200:
# assemble the staged SmolLM2 GGUF (as device_quality.sh: .carry1 in an earlier call, .carry2
# in this one), run the speculative GPU tests, train EAGLE, EAGLE-3 and Medusa drafts on the target's
# own Magpie prompts and answers, then `optllm eval --draft` for each draft (tok/s without and
# with it, tau, acceptance per depth, greedy identical) at batch sizes 1, 8, 32, 64, temperatures
# 0 and 1, on held-out prompts. AWQ=1 also quantizes the target (W4 g64 AWQ), trains an EAGLE
# draft on it and measures the AWQ target with that draft and with the one trained on the float
# target. Everything lands in $OUT (reports as results.tgz, tables printed last).
# Environment: STEPS (training steps, default 600), PROMPTS (default 512), BS (default 1,8,32,64),
# OUTPUT_LEN (128), POLICY (auto), TESTS=0 skips the tests, AWQ=1.
set -uo pipefail
source benchmarks/device_stage.sh
[ "${TESTS:-1}" = 0 ] || timeout "${TEST_TIMEOUT:-150}" python3 -m pytest -q -p no:cacheprovider -x \
  tests/runtime/test_spec_engine.py tests/runtime/test_spec_policy.py tests/kernels/test_tree_attention.py 2>&1 | tail -5 | tee "$OUT/tests.log"
run() { echo "+ $*" | tee -a "$OUT/spec.log"; "$@" 2>&1 | grep -v "Loading weights" >> "$OUT/spec.log"; }
common="--device cuda --num-prompts ${PROMPTS:-512} --max-steps ${STEPS:-600}"
evalargs="--device cuda --batch-sizes ${BS:-1,8,32,64} --output-len ${OUTPUT_LEN:-128} --spec-policy ${POLICY:-auto}"
run timeout "${TRAIN_TIMEOUT:-240}" python3 -m optllm train-draft smollm2-135m --method eagle --out /root/d/eagle $common
run timeout "${TRAIN_TIMEOUT:-240}" python3 -m optllm train-draft smollm2-135m --method eagle3 --ttt-steps 7 \
  --out /root/d/eagle3 --export vllm $common
run timeout "${TRAIN_TIMEOUT:-240}" python3 -m optllm train-draft smollm2-135m --method medusa --out /root/d/medusa $common
for d in eagle eagle3 medusa; do
  run timeout "${EVAL_TIMEOUT:-300}" python3 -m optllm eval smollm2-135m --draft /root/d/$d $evalargs --out /root/r/$d
done
if [ "${AWQ:-0}" = 1 ]; then
  run timeout 300 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 --out /root/q/awq --device cuda
  run timeout "${TRAIN_TIMEOUT:-240}" python3 -m optllm train-draft /root/q/awq --method eagle --out /root/d/eagle-awq $common
  run timeout "${EVAL_TIMEOUT:-300}" python3 -m optllm eval /root/q/awq --draft /root/d/eagle-awq $evalargs --out /root/r/awq-own
  run timeout "${EVAL_TIMEOUT:-300}" python3 -m optllm eval /root/q/awq --draft /root/d/eagle $evalargs --out /root/r/awq-float
fi
for r in /root/r/*/; do echo "## $(basename "$r")"; grep "^|" "$r/report.md"; done > "$OUT/spec.md" 2>/dev/null
(cd /root && tar czf "$OUT/results.tgz" r d/*/config.json 2>/dev/null)
tail -5 "$OUT/spec.log"; cat "$OUT/spec.md"
