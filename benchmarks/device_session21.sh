#!/usr/bin/env bash
# The twenty-first and twenty-second sessions' device work (neither had a device), after staging:
# call A carries .carry1 (`mkdir -p /root/m && cp .carry1/smollm2.gguf.part00 /root/m/`), call B
# carries .carry-d19 (`mkdir -p /root/d && tar xzf .carry-d19/drafts.tgz -C /root/d`), then this
# script with .carry2 carried. Pass OPTLLM_COMMIT as a
# literal hash (the device's .git is stale). PART picks the call (each fits one 600 s call):
#   gputest (issue 15) the GPU tests: the fused speculative step and the speculative engine's other
#            GPU tests (tests/runtime/test_spec_gpu.py), the EAGLE-2 growth replayed in a CUDA graph
#            and the full-vocabulary top-k (-m gpu); then, unmarked (they run on CUDA where present),
#            the extend kernel with causal and tree-masked sequences in one launch and masks over
#            earlier keys, the one-launch greedy acceptance + KV move, the growth, the step slots,
#            the mapped top-k, and the growth kernels' sm_90 builds (no spills)
#   fuse    optllm eval of the float target with the nineteenth session's EAGLE-3 (/root/d/eagle3)
#            under the continuous load at CBS (8,32,64), admit_group 8: fused steps on
#            (OPTLLM_SPEC_FUSE=1, the default) and off, in that order
#   wave    the same draft in waves at BS (1,8,64): the eval's cost table gives each tree size's
#            step time (the twentieth session: 1.89 ms for 20 nodes at batch 1, before the
#            twenty-second session's 491 -> 391 kernels)
#   ttt     an EAGLE-3 draft trained with TTT (7) training-time-test steps for SECS (420) on the
#            nineteenth session's float data (.carry-draft, PROMPTS 4096), into /root/d/e3-ttt
#   ttteval its eval at BS (1,8) beside the nineteenth session's /root/d/eagle3 (waves, greedy); the
#            next call on the same warm machine
# The GEMV work of issue 13 needs no staging: PART=gemv bash benchmarks/device_session20.sh (MS,
# CONFIGS) runs its GPU tests (the persistent form, 9-32-row tiles, the NVRTC build) and benchmark.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs" /root/d
source benchmarks/device_stage.sh
[ -f /root/d/eagle3/config.json ] || [ ! -f .carry-d19/drafts.tgz ] || tar xzf .carry-d19/drafts.tgz -C /root/d

evalspec() {  # evalspec NAME DRAFT ARGS...: optllm eval of the float SmolLM2 with DRAFT, greedy
  local name=$1 draft=$2; shift 2
  timeout "${SPEC_S:-160}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft "$draft" \
    --temperatures 0 --spec-policy auto --out "/root/$name" "$@" > "$OUT/logs/$name.log" 2>&1 \
    || echo "eval $name exited $?"
  cp "/root/$name/report.md" "$OUT/$name.md" 2>/dev/null
  cp "/root/$name/report.json" "$OUT/$name.json" 2>/dev/null
}

case "${PART:-gputest}" in
gputest)
  timeout "${TEST_S:-280}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_spec_gpu.py \
    tests/kernels/test_tree_grow.py tests/kernels/test_topk.py \
    > "$OUT/logs/gpu_tests_fuse.log" 2>&1
  tail -2 "$OUT/logs/gpu_tests_fuse.log"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests_fuse.log"
  # unmarked kernel tests run on CUDA where present: the extend kernel's mixed and wider masks,
  # the one-launch acceptance, the EAGLE-2 growth kernels, the step slots, the mapped top-k
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    tests/kernels/test_spec_accept.py tests/kernels/test_tree_grow.py tests/kernels/test_spec_slots.py \
    tests/kernels/test_topk.py > "$OUT/logs/gpu_tests_accept.log" 2>&1
  tail -2 "$OUT/logs/gpu_tests_accept.log"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests_accept.log"
  ;;
fuse)
  for f in 1 0; do
    OPTLLM_SPEC_FUSE=$f evalspec "spec_cont_fuse$f" /root/d/eagle3 --batch-sizes "${CBS:-8,32,64}" \
      --spec-load continuous --admit-group "${ADMIT:-8}"
  done
  ;;
wave)  # waves at BS: the cost table's per-size step times against the twentieth session's
  evalspec spec_wave /root/d/eagle3 --batch-sizes "${BS:-1,8,64}"
  ;;
ttt)
  T0=$(date +%s)
  gzip -dc .carry-draft/dataset_12288.jsonl.gz | head -n "${PROMPTS:-4096}" > /root/d/float_data.jsonl
  timeout $(( ${SECS:-420} + 60 )) python3 -m optllm train-draft smollm2-135m --method eagle3 --out /root/d/e3-ttt \
    --device cuda --ttt-steps "${TTT:-7}" --draft-vocab "${VOCAB:-16384}" --max-steps 40000 --batch-size 16 \
    --time-limit "${SECS:-420}" --overwrite --dataset /root/d/float_data.jsonl > "$OUT/logs/train_e3-ttt.log" 2>&1
  echo "trained in $(( $(date +%s) - T0 )) s"; grep -v "^step" "$OUT/logs/train_e3-ttt.log" | tail -4
  ;;
ttteval)  # the machine still warm from PART=ttt (its /root/d/e3-ttt)
  [ -f /root/d/e3-ttt/config.json ] && evalspec spec_ttt /root/d/e3-ttt --batch-sizes "${BS:-1,8}"
  [ -f /root/d/eagle3/config.json ] && evalspec spec_ttt_base /root/d/eagle3 --batch-sizes "${BS:-1,8}"
  ;;
*) echo "PART=${PART}: allowed gputest, fuse, wave, ttt, ttteval"; exit 2 ;;
esac
for f in "$OUT"/spec_*.md; do [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -14; }; done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
