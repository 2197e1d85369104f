#!/usr/bin/env bash
# The twentieth session's device work (issue 15), after staging (.carry1's part in /root/m; carry
# .carry2). The drafts of the nineteenth session come from an earlier call that carried
# .carry-d19 (drafts.tgz unpacked to /root/d). PART picks the call:
#   awq   1. GPU tests TESTS in the background (default: the runtime kernels' direct launch, the
#            speculative step under graphs); the log is kept in /root/d for the next call
#         2. the AWQ target (W4 g64, 128 x 512 calibration) quantized on the GPU into /root/awq
#         3. an EAGLE-3 draft trained on the AWQ target itself: PROMPTS Magpie prompts it writes
#            and answers (self-distilled, hidden states of its dequantized weights), into
#            /root/d/e3-awq
#         4. as soon as that run's data is written, beside it on the GPU: an EAGLE-3 draft on the
#            float target's own prompts and answers (the first PROMPTS of the nineteenth
#            session's 12288, .carry-draft), into /root/d/e3-float; both train until the same
#            deadline, so each gets the same training time after its data
#   eval  1. optllm eval of the AWQ target with each of the two drafts (BS, waves, temperature 0)
#         2. the float target with the nineteenth session's EAGLE-3 (/root/d/eagle3) under the
#            continuous load (spread lengths) at admit_group 1 and ADMIT (both engines admit
#            waiting requests in groups), then at ADMIT with the runtime kernels' direct launch
#            (only if the awq call's GPU tests passed)
#   gemv  (issue 13; no model, no staging) the tensor-core W4A16 GEMV's GPU tests, then
#         benchmarks/w4a16_mma.py (SHAPES, MS, CONFIGS) beside the Triton path, cuBLAS and tinygemm
#   gemv2 (issue 13) the GPU tests of the GEMV inside the runtime, then benchmarks/decode.py's W4A16
#         cases (SmolLM2 g64, 8B g128, random weights) with the GEMV (OPTLLM_W4A16_MMA=1) and
#         without, then w4a16_mma.py as in gemv
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs" /root/d
if [ "${PART:-awq}" = gemv ] || [ "${PART:-awq}" = gemv2 ]; then
  export PYTHONPATH=$(dirname "$PWD") OPTLLM_COMMIT=${OPTLLM_COMMIT:-?}
  ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"
  if [ "$PART" = gemv2 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_linear.py tests/runtime/test_llm_gpu.py \
      -k "w4a16 or tensor_core" > "$OUT/logs/gpu_tests_runtime.log" 2>&1
    tail -2 "$OUT/logs/gpu_tests_runtime.log"; grep -m 5 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests_runtime.log"
    for mma in 1 0; do
      OPTLLM_W4A16_MMA=$mma timeout "${DECODE_S:-150}" python3 benchmarks/decode.py --cases "${CASES:-smol-w4a16,8b-w4a16}" \
        --peers none --quick --tag "decode_mma$mma" --out "$OUT" > "$OUT/logs/decode_mma$mma.log" 2>&1 \
        || { echo "decode mma=$mma exited $?"; tail -5 "$OUT/logs/decode_mma$mma.log"; }
      grep "^|" "$OUT/decode_mma$mma.md" 2>/dev/null | head -8
    done
  fi
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider -x tests/kernels/test_w4a16_mma.py ${TESTS:-} \
    > "$OUT/logs/gpu_tests_mma.log" 2>&1
  tail -3 "$OUT/logs/gpu_tests_mma.log"; grep -m 5 -B 30 "^E " "$OUT/logs/gpu_tests_mma.log" | head -60
  timeout "${BENCH_S:-400}" python3 benchmarks/w4a16_mma.py ${SHAPES:+--shapes $SHAPES} ${MS:+--ms $MS} \
    ${CONFIGS:+--configs $CONFIGS} --out "$OUT" > "$OUT/logs/w4a16_mma.log" 2>&1 || tail -20 "$OUT/logs/w4a16_mma.log"
  cat "$OUT/w4a16_mma.md" 2>/dev/null
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  exit 0
fi
source benchmarks/device_stage.sh
[ -f /root/d/eagle3/config.json ] || [ ! -f .carry-d19/drafts.tgz ] || tar xzf .carry-d19/drafts.tgz -C /root/d

train() {  # train TARGET NAME SECONDS ARGS...: EAGLE-3, TTT 4, draft vocabulary 16384
  local src=$1 name=$2 secs=$3; shift 3
  timeout $(( secs + 40 )) python3 -m optllm train-draft "$src" --method eagle3 --out "/root/d/$name" --device cuda \
    --ttt-steps "${TTT:-4}" --draft-vocab "${VOCAB:-16384}" --max-steps 40000 --batch-size 16 --time-limit "$secs" \
    --overwrite "$@" > "$OUT/logs/train_$name.log" 2>&1
}

if [ "${PART:-awq}" = awq ]; then
  T0=$(date +%s)
  BUDGET=${BUDGET:-540}  # seconds from here until both drafts are saved
  TESTS=${TESTS-tests/kernels/test_direct_launch.py tests/runtime/test_spec_gpu.py}
  if [ -n "$TESTS" ]; then
    ( timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > /root/d/gpu_tests.log 2>&1 ) &
  fi
  timeout 150 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 --device cuda \
    --num-samples 128 --seq-len 512 --no-compare --out /root/awq > "$OUT/logs/quantize.log" 2>&1 \
    || { tail -5 "$OUT/logs/quantize.log"; exit 1; }
  echo "quantized in $(( $(date +%s) - T0 )) s"
  ( train /root/awq e3-awq $(( BUDGET - ($(date +%s) - T0) )) --num-prompts "${PROMPTS:-4096}" ) &
  data=/root/d/.e3-awq.partial/dataset.jsonl
  while [ ! -s "$data" ] && [ $(( $(date +%s) - T0 )) -lt $(( BUDGET - 120 )) ]; do sleep 2; done
  sleep 3  # written in one call; let it finish
  left=$(( BUDGET - ($(date +%s) - T0) ))
  echo "AWQ data written $(( $(date +%s) - T0 )) s in ($(wc -l < "$data" 2>/dev/null) sequences); $left s left"
  gzip -dc .carry-draft/dataset_12288.jsonl.gz | head -n "${PROMPTS:-4096}" > /root/d/float_data.jsonl
  [ "$left" -gt 100 ] && ( train smollm2-135m e3-float "$left" --dataset /root/d/float_data.jsonl ) &
  wait
  cp /root/d/gpu_tests.log "$OUT/logs/" 2>/dev/null
  tail -2 /root/d/gpu_tests.log 2>/dev/null; grep -m 20 "^FAILED\|^ERROR" /root/d/gpu_tests.log
  for m in e3-awq e3-float; do
    echo "== train $m"; grep -v "^step" "$OUT/logs/train_$m.log" | tail -5; grep "^step" "$OUT/logs/train_$m.log" | tail -1
  done
else
  for t in awq float; do
    [ -f "/root/d/e3-$t/config.json" ] || { echo "no draft /root/d/e3-$t"; continue; }
    timeout "${SPEC_S:-150}" python3 -m optllm eval /root/awq --device cuda --no-ppl --draft "/root/d/e3-$t" \
      --temperatures 0 --batch-sizes "${BS:-1,8,32,64}" --spec-policy auto --out "/root/spec-awq-$t" \
      > "$OUT/logs/spec_awq_$t.log" 2>&1 || echo "spec eval awq/$t exited $?"
    cp "/root/spec-awq-$t/report.md" "$OUT/spec_awq_draft_$t.md" 2>/dev/null
    cp "/root/spec-awq-$t/report.json" "$OUT/spec_awq_draft_$t.json" 2>/dev/null
  done
  runs="1:0 ${ADMIT:-8}:0"
  tail -1 /root/d/gpu_tests.log 2>/dev/null | grep -q " passed" && ! grep -q "failed\|error" <(tail -1 /root/d/gpu_tests.log) \
    && runs="$runs ${ADMIT:-8}:1"
  for r in $runs; do
    a=${r%%:*}; d=${r##*:}
    [ -f /root/d/eagle3/config.json ] || { echo "no draft /root/d/eagle3"; break; }
    OPTLLM_RUNTIME_DIRECT_LAUNCH=$d timeout "${SPEC_S:-150}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl \
      --draft /root/d/eagle3 --temperatures 0 --batch-sizes "${CBS:-8,32,64}" --spec-policy auto --spec-load continuous \
      --admit-group "$a" --out "/root/spec-cont-a$a-d$d" > "$OUT/logs/spec_cont_a$a-d$d.log" 2>&1 \
      || echo "continuous eval admit $a direct $d exited $?"
    cp "/root/spec-cont-a$a-d$d/report.md" "$OUT/spec_cont_admit${a}_direct$d.md" 2>/dev/null
    cp "/root/spec-cont-a$a-d$d/report.json" "$OUT/spec_cont_admit${a}_direct$d.json" 2>/dev/null
  done
  for f in "$OUT"/spec_*.md; do [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -14; }; done
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
