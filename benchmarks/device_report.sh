#!/usr/bin/env bash
# One device call for the evaluation issue (16)'s real report, on the H200: SmolLM2-135M as the
# built-in alias (staged by benchmarks/device_stage.sh: .carry1 in an earlier call, .carry2 here),
# quantized on the GPU to W4 g64 AWQ and GPTQ, W8A8-INT8 (SmoothQuant), FP8 and NVFP4, an EAGLE
# draft trained on the float target's own prompts and answers (or the one device_spec.sh left on the
# machine), then one `optllm eval` over all six checkpoints: perplexity per text kind, our two
# offline lm-eval tasks, speed at batch sizes 1, 8, 32, 64 and the draft's speedup, tau and
# acceptance -- report.md / report.json / PNGs, packed into $OUT/report.tgz (commit it under
# docs/report/ and link it from the README). Then the quantized checkpoints' perplexity through the
# torch references of their kernels (--dequant), beside the kernels' (benchmarks/kernel_vs_ref.py:
# issue 14 part 8's table). Checkpoints already on the machine are reused.
# Environment: SCHEMES (the checkpoints, default "awq gptq w8a8 fp8 nvfp4"), NS (calibration
# windows, 128), TRAIN_S / PROMPTS / STEPS (draft training when none is there), TEMPS (speculation
# temperatures, 0), BS (1,8,64), BUDGET (seconds, 570), PHASE (all | prep: the checkpoints and the
# draft only | eval: the report only, from what an earlier call of the same warm machine left),
# PROFILE (1: after the draft, benchmarks/profile_spec_off.py at batch 64 into $OUT/profile_spec_off.txt).
set -uo pipefail
source benchmarks/device_stage.sh
T0=$SECONDS
BUDGET=${BUDGET:-570}
run() { echo "+ $*" | tee -a "$OUT/report.log"; "$@" 2>&1 | grep -v "Loading weights" >> "$OUT/report.log"; }
step() {
  local t=$1 left=$(( BUDGET - (SECONDS - T0) - 15 )); shift
  if [ "$left" -lt 40 ]; then echo "skipped (budget): $*" | tee -a "$OUT/report.log"; return 1; fi
  [ "$t" -gt "$left" ] && t=$left
  run timeout "$t" "$@"
}
q="--device cuda --num-samples ${NS:-128} --seq-len 512 --no-compare"
quant() {  # quant NAME SCHEME [ARGS...]
  local name=$1 scheme=$2; shift 2
  [ -f "/root/q/$name/config.json" ] || step 120 python3 -m optllm quantize smollm2-135m --scheme "$scheme" $q \
    --out "/root/q/$name" "$@"
}
declare -A SCHEME=([awq]="w4a16-awq --group-size 64" [gptq]="w4a16-gptq --group-size 64" [w8a8]=w8a8-int8 [fp8]=fp8
                    [nvfp4]=nvfp4)
PHASE=${PHASE:-all}
draft=/root/d/eagle
if [ "$PHASE" != eval ]; then
for m in ${SCHEMES:-awq gptq w8a8 fp8 nvfp4}; do quant "$m" ${SCHEME[$m]}; done
[ -f "$draft/config.json" ] || step $(( ${TRAIN_S:-120} + 20 )) python3 -m optllm train-draft smollm2-135m --method eagle \
  --out "$draft" --device cuda --num-prompts "${PROMPTS:-2048}" --max-steps "${STEPS:-2000}" --batch-size 16 \
  --time-limit "${TRAIN_S:-120}" --overwrite
grep -h "ms a step\|training on\|data:\|held-out" "$OUT/report.log" | tail -8
[ "${PROFILE:-0}" = 1 ] && [ -f "$draft/dataset.jsonl" ] && step 60 python3 benchmarks/train_step.py --methods eagle \
  --steps 12 --dataset "$draft/dataset.jsonl" && step 60 python3 benchmarks/train_step.py --methods eagle --steps 6 && \
  grep -A1 "per step ms" "$OUT/report.log"
[ "${PROFILE:-0}" = 1 ] && [ -f "$draft/config.json" ] && step 120 python3 benchmarks/profile_spec_off.py smollm2-135m \
  --draft "$draft" --batch 64 --profile && sed -n '/profile_spec_off/,$p' "$OUT/report.log" > "$OUT/profile_spec_off.txt"
fi
if [ "$PHASE" = prep ]; then echo "elapsed $(( SECONDS - T0 )) s"; ls /root/q /root/d; tail -5 "$OUT/report.log"; exit 0; fi
models="smollm2-135m"
for m in awq gptq w8a8 fp8 nvfp4; do [ -f "/root/q/$m/config.json" ] && models="$models /root/q/$m"; done
dargs=(); [ -f "$draft/config.json" ] && dargs=(--draft "$draft" --temperatures "${TEMPS:-0}")
# eval rewrites its report after each phase: a time limit keeps the finished sections
step "${EVAL_S:-420}" python3 -m optllm eval $models --device cuda --kernels --tasks ppl,optllm_offline --speed \
  --batch-sizes "${BS:-1,8,64}" "${dargs[@]}" --out /root/report
# issue 14 part 8: the quantized checkpoints' perplexity through the torch reference of their kernels
step 150 python3 -m optllm eval ${models#smollm2-135m } --device cuda --dequant --tasks ppl --out /root/ref
[ -f /root/ref/report.json ] && [ -f /root/report/report.json ] && python3 benchmarks/kernel_vs_ref.py \
  /root/report/report.json /root/ref/report.json --out /root/report/kernel_vs_ref.md
(cd /root && tar czf "$OUT/report.tgz" report ref 2>/dev/null)
echo "elapsed $(( SECONDS - T0 )) s"; tail -5 "$OUT/report.log"; grep "^|" /root/report/report.md
cat /root/report/kernel_vs_ref.md 2>/dev/null
