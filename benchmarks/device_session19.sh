#!/usr/bin/env bash
# The nineteenth session's device work (issue 15), after staging (.carry1's part in /root/m; carry
# .carry2). PART picks the call:
#   train  1. GPU tests TESTS in the background (default: the one-launch tree structure, the fused
#             top-k, the speculative step under graphs)
#          2. EAGLE trained on PROMPTS of the float target's own prompts and answers (Magpie,
#             self-distilled) into /root/d/eagle-new, TRAIN_S seconds, data generation included
#          3. as soon as that run's dataset.jsonl is written: EAGLE-3 (training-time test TTT steps,
#             a draft vocabulary of VOCAB tokens) on the same sequences (--dataset) into
#             /root/d/eagle3, beside it on the GPU, until the same deadline
#          4. both drafts and the dataset back through $OUT in 15 MiB pieces
#          DATASET=FILE.jsonl.gz instead: no data generation; both methods train on it into
#          /root/d/eagle-d and /root/d/eagle3-d
#   awq    the AWQ target with an EAGLE-3 draft trained on itself against one trained on the float
#          target (the block below says how)
#   eval   optllm eval --draft for each of DRAFTS (folders under /root/d), batches BS,
#          temperatures TEMPS, SPEC_LOAD waves |
#          continuous (requests of spread lengths, eval/speculation.py); /root/d from the train call
#          on a machine still warm, else the drafts carried in .carry-d19/drafts.tgz
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs" /root/d
source benchmarks/device_stage.sh
# the sixteenth session's draft, where a checkout still has it (it left the repo in the nineteenth)
[ -f /root/d/eagle/config.json ] || ! ls .carry-draft/draft*.tgz.part* >/dev/null 2>&1 \
  || cat .carry-draft/draft*.tgz.part* | tar xzf - -C /root/d
# a fresh machine: this session's drafts, carried back in .carry-d19 (eagle3, eagle-12k)
[ -f /root/d/eagle3/config.json ] || [ ! -f .carry-d19/drafts.tgz ] || tar xzf .carry-d19/drafts.tgz -C /root/d
if [ "${PART:-train}" = awq ]; then
  # issue 15's comparison: the AWQ target (W4 g64, 128 x 512 calibration, quantized here) served
  # with an EAGLE-3 draft trained on itself (its own Magpie prompts and answers, features of its
  # dequantized weights) against one trained on the float target the same way; PROMPTS each,
  # TRAIN_S each, side by side; then optllm eval of the AWQ target with each draft (BS, TEMPS)
  timeout 150 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 --device cuda \
    --num-samples 128 --seq-len 512 --no-compare --out /root/awq > "$OUT/logs/quantize.log" 2>&1 || exit 1
  for t in awq float; do
    src=/root/awq; [ $t = float ] && src=smollm2-135m
    ( timeout $(( ${TRAIN_S:-300} + 30 )) python3 -m optllm train-draft $src --method eagle3 --out /root/d/e3-$t \
        --device cuda --num-prompts "${PROMPTS:-4096}" --ttt-steps "${TTT:-4}" --draft-vocab "${VOCAB:-16384}" \
        --max-steps 40000 --batch-size 16 --time-limit "${TRAIN_S:-300}" --overwrite > "$OUT/logs/train_e3_$t.log" 2>&1 ) &
  done
  wait
  for t in awq float; do
    echo "== train on $t"; grep -v "^step" "$OUT/logs/train_e3_$t.log" | tail -3
    timeout "${SPEC_S:-120}" python3 -m optllm eval /root/awq --device cuda --no-ppl --draft /root/d/e3-$t \
      --temperatures "${TEMPS:-0}" --batch-sizes "${BS:-1,8,32,64}" --spec-policy auto --out /root/spec-awq-$t \
      > "$OUT/logs/spec_awq_$t.log" 2>&1 || echo "spec eval $t exited $?"
    cp /root/spec-awq-$t/report.md "$OUT/spec_awq_draft_$t.md" 2>/dev/null
    grep "^|" "$OUT/spec_awq_draft_$t.md" 2>/dev/null | head -8
  done
elif [ "${PART:-train}" = train ] && [ -f "${DATASET:-}" ]; then
  # the data of an earlier run (DATASET=.carry-draft/dataset_12288.jsonl.gz: this session's 12288
  # prompts, 420 s of generation saved): EAGLE and EAGLE-3 side by side on it, TRAIN_S each
  gzip -dc "$DATASET" > /root/d/dataset.jsonl
  for m in eagle eagle3; do
    extra=""; [ $m = eagle3 ] && extra="--ttt-steps ${TTT:-4} ${VOCAB:+--draft-vocab $VOCAB}"
    ( timeout $(( ${TRAIN_S:-500} + 30 )) python3 -m optllm train-draft smollm2-135m --method $m --out /root/d/$m-d \
        --device cuda --dataset /root/d/dataset.jsonl $extra --max-steps 40000 --batch-size 16 \
        --time-limit "${TRAIN_S:-500}" --overwrite > "$OUT/logs/train_$m.log" 2>&1 ) &
  done
  wait
  for m in eagle eagle3; do echo "== train $m"; grep -v "^step" "$OUT/logs/train_$m.log" | tail -3; done
elif [ "${PART:-train}" = train ]; then
  T0=$(date +%s)
  TRAIN_S=${TRAIN_S:-520}
  TESTS=${TESTS-tests/kernels/test_tree_grow.py tests/kernels/test_topk.py tests/runtime/test_spec_gpu.py}
  if [ -n "$TESTS" ]; then
    ( timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$OUT/logs/gpu_tests.log" 2>&1 ) &
  fi
  ( timeout $(( TRAIN_S + 30 )) python3 -m optllm train-draft smollm2-135m --method eagle --out /root/d/eagle-new \
      --device cuda --num-prompts "${PROMPTS:-12288}" --max-steps 40000 --batch-size 16 \
      --time-limit "$TRAIN_S" --overwrite > "$OUT/logs/train_eagle.log" 2>&1 ) &
  data=/root/d/.eagle-new.partial/dataset.jsonl
  while [ ! -s "$data" ] && [ $(( $(date +%s) - T0 )) -lt $(( TRAIN_S - 120 )) ]; do sleep 2; done
  sleep 3  # written in one call; let it finish
  left=$(( TRAIN_S - ($(date +%s) - T0) ))
  if [ -s "$data" ] && [ "$left" -gt 100 ]; then
    cp "$data" /root/d/dataset.jsonl
    echo "EAGLE-3 starts $(( $(date +%s) - T0 )) s in, $left s left"
    ( timeout $(( left + 30 )) python3 -m optllm train-draft smollm2-135m --method eagle3 --out /root/d/eagle3 \
        --device cuda --dataset /root/d/dataset.jsonl --ttt-steps "${TTT:-4}" ${VOCAB:+--draft-vocab $VOCAB} \
        --max-steps 40000 --batch-size 16 --time-limit "$left" --overwrite > "$OUT/logs/train_eagle3.log" 2>&1 ) &
  fi
  wait
  tail -2 "$OUT/logs/gpu_tests.log" 2>/dev/null; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  for m in eagle eagle3; do
    echo "== train $m"; grep -v "^step" "$OUT/logs/train_$m.log" | tail -6; grep "^step" "$OUT/logs/train_$m.log" | tail -2
  done
  (cd /root/d && tar czf /tmp/drafts.tgz --exclude 'checkpoint-*' --exclude dataset.jsonl eagle-new eagle3 2>/dev/null)
  split -b 15m /tmp/drafts.tgz "$OUT/drafts.tgz.part"
  gzip -c /root/d/dataset.jsonl > /tmp/dataset.jsonl.gz 2>/dev/null && split -b 15m /tmp/dataset.jsonl.gz "$OUT/dataset.jsonl.gz.part"
else
  for d in ${DRAFTS:-eagle3-d eagle-d}; do
    [ -f "/root/d/$d/config.json" ] || { echo "no draft /root/d/$d"; continue; }
    timeout "${SPEC_S:-200}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft "/root/d/$d" \
      --temperatures "${TEMPS:-0}" --batch-sizes "${BS:-1,8,32,64}" --spec-policy auto --spec-load "${SPEC_LOAD:-waves}" \
      --out "/root/spec-$d" > "$OUT/logs/spec_$d.log" 2>&1 || echo "spec eval $d exited $?"
    cp "/root/spec-$d/report.md" "$OUT/spec_$d.md" 2>/dev/null
    cp "/root/spec-$d/report.json" "$OUT/spec_$d.json" 2>/dev/null
  done
  [ -z "${EXTRA:-}" ] || eval "$EXTRA"
  for f in "$OUT"/spec_*.md; do [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -24; }; done
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
