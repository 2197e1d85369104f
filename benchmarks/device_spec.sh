#!/usr/bin/env bash
# One device call for the speculative-decoding issue (15), on the H200: assemble the staged
# SmolLM2 GGUF (benchmarks/device_stage.sh: .carry1 in an earlier call, .carry2 in this one), train
# EAGLE and Medusa drafts on the target's own Magpie prompts and answers, then `optllm eval --draft`
# for each (tok/s without and with it, tau, acceptance per depth, greedy identical) at batch sizes
# 1, 8, 32, 64, temperatures 0 and 1, on held-out prompts; then the AWQ target (W4 g64) with an EAGLE
# draft trained on it and with the one trained on the float target; then EAGLE-3 (7 training-time-
# test steps, exported for vLLM). Steps run in that order under one deadline (BUDGET seconds, default
# 560): a step that no longer fits is skipped and said so; drafts and checkpoints already on the
# machine (an earlier call) are reused. Everything lands in $OUT (reports as results.tgz, tables last).
# Environment: PHASES (below), STEPS (training steps, default 4000), PROMPTS (default 2048),
# TRAIN_EAGLE_S / TRAIN_MEDUSA_S (seconds per training run, 200 / 80), BS (default 1,8,32,64),
# AWQ_BS (1,8), EVAL_S (150), OUTPUT_LEN (128), POLICY (auto), TESTS=1 runs the speculative GPU tests
# first, BUDGET.
# Wheels: .whl-ct/ (or .whl/) must hold compressed-tensors (and its needs missing on the GPU image) for the AWQ
# rows: train-draft loads a quantized target through transformers, which needs that package.
set -uo pipefail
source benchmarks/device_stage.sh
T0=$SECONDS
BUDGET=${BUDGET:-560}
run() { echo "+ $*" | tee -a "$OUT/spec.log"; "$@" 2>&1 | grep -v "Loading weights" >> "$OUT/spec.log"; }
# step SECONDS CMD...: CMD under a timeout of SECONDS, cut to what is left of the budget; skipped
# when less than 40 s are left.
step() {
  local t=$1 left=$(( BUDGET - (SECONDS - T0) - 15 )); shift
  if [ "$left" -lt 40 ]; then echo "skipped (budget): $*" | tee -a "$OUT/spec.log"; return 1; fi
  [ "$t" -gt "$left" ] && t=$left
  run timeout "$t" "$@"
}
[ "${TESTS:-0}" = 0 ] || step 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/runtime/test_spec_gpu.py
train() {  # train NAME TARGET METHOD SECONDS [ARGS...]
  local name=$1 target=$2 method=$3 secs=$4; shift 4
  [ -f "/root/d/$name/config.json" ] && return 0
  step $(( secs + 20 )) python3 -m optllm train-draft "$target" --method "$method" --out "/root/d/$name" \
    --device cuda --num-prompts "${PROMPTS:-2048}" --max-steps "${STEPS:-4000}" --batch-size 16 \
    --time-limit "$secs" --overwrite "$@"
}
evaluate() {  # evaluate NAME TARGET DRAFT [BATCH SIZES]
  [ -f "/root/d/$3/config.json" ] || { echo "no draft $3: skipping $1" | tee -a "$OUT/spec.log"; return 1; }
  step "${EVAL_S:-150}" python3 -m optllm eval "$2" --draft "/root/d/$3" --device cuda --batch-sizes "${4:-${BS:-1,8,32,64}}" \
    --output-len "${OUTPUT_LEN:-128}" --spec-policy "${POLICY:-auto}" --out "/root/r/$1"
}
# PHASES (default "float awq eagle3"): float = EAGLE and Medusa on the float target; awq = the AWQ
# target with a draft trained on it and with the float target's; eagle3 = EAGLE-3 for vLLM.
for phase in ${PHASES:-float awq eagle3}; do
  case $phase in
  float)
    train eagle smollm2-135m eagle "${TRAIN_EAGLE_S:-200}" && evaluate eagle smollm2-135m eagle
    train medusa smollm2-135m medusa "${TRAIN_MEDUSA_S:-80}" && evaluate medusa smollm2-135m medusa ;;
  awq)
    [ -f /root/q/awq/config.json ] || step 150 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq \
      --group-size 64 --out /root/q/awq --device cuda --no-compare
    train eagle-awq /root/q/awq eagle "${TRAIN_EAGLE_S:-200}" && evaluate awq-own /root/q/awq eagle-awq "${AWQ_BS:-1,8}"
    evaluate awq-float /root/q/awq eagle "${AWQ_BS:-1,8}" ;;
  eagle3)
    train eagle3 smollm2-135m eagle3 "${TRAIN_EAGLE_S:-200}" --ttt-steps 7 --export vllm \
      && evaluate eagle3 smollm2-135m eagle3 ;;
  esac
done
for r in /root/r/*/; do echo "## $(basename "$r")"; grep "^|" "$r/report.md"; done > "$OUT/spec.md" 2>/dev/null
grep -h "held-out top-1\|time limit\|trained " "$OUT/spec.log" | tail -20 > "$OUT/train_tail.log"
(cd /root && tar czf "$OUT/results.tgz" r d/*/config.json d/*/train_log.json 2>/dev/null)
echo "elapsed $(( SECONDS - T0 )) s"; tail -3 "$OUT/spec.log"; cat "$OUT/train_tail.log" "$OUT/spec.md"
