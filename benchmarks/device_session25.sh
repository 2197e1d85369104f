#!/usr/bin/env bash
# The twenty-fifth session's device work (issue 15), three calls on one warm machine. Pass
# OPTLLM_COMMIT as a literal hash (the device's .git is stale).
#   PART=stage  carry .carry1: its part copied to /root/m (the next call must follow within the
#               machine's warm time)
#   PART=train  carry .carry2: the model assembled (device_stage.sh); two EAGLE-3 drafts trained
#               side by side on the nineteenth session's self-distilled data (.carry-draft, PROMPTS
#               of its 12288 sequences), SECS each: training-time test 4 steps (the nineteenth
#               session's recipe, whose draft was lost, batch 16) and 7 steps at batch B7 (32), into /root/d/e3-t4, /root/d/e3-t7;
#               meanwhile the GPU tests (speculative engine, step graphs incl. the adaptive policy's
#               in-graph per-size counts, host-staged graphs, prefill graphs, EAGLE-2 growth)
#   PART=eval   optllm eval of the float SmolLM2 with each draft, waves at BS (1,8,32,64), greedy;
#               then temperature 1 and the continuous load (CBS 8,32,64) with the draft of the
#               better batch-1 speedup, while the call's time lasts
#   PART=host   (no staging; carry .carry-old: the tree before this session's host changes,
#               `git archive f97b674`) the speculative engine's GPU tests; benchmarks/generate_host.py
#               (CPU stand-ins: this host's Python speed) on both trees; then, if LIMIT leaves 150 s,
#               the draft engine against the plain one where speculation stays off: optllm eval of
#               a random-weight SmolLM2 with a random EAGLE-3 draft (benchmarks/random_smol.py),
#               temperature 1, BS (1,64), this tree then the old one
source benchmarks/device_preamble.sh
if [ "${PART:-}" = host ]; then
  no_model_env
  mkdir -p /tmp/old/optllm && tar xzf .carry-old/old.tgz -C /tmp/old/optllm
  timeout "${TEST_S:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_spec_gpu.py \
    > "$OUT/logs/gpu_tests_host.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests_host.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests_host.log"
  python3 -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; from conftest import make_tiny_model, \
write_draft; write_draft(Path('/root/hp/D'), make_tiny_model(Path('/root/hp/M')), 'eagle')" > /dev/null 2>&1
  for t in new old; do
    pp=$PYTHONPATH; [ $t = old ] && pp=/tmp/old
    PYTHONPATH=$pp timeout 60 python3 "$PWD/benchmarks/generate_host.py" --model /root/hp/M --draft /root/hp/D \
      --batch 1 --rounds 4 2>&1 | grep "^| [pd]" | sed "s/^/$t /"
  done
  if [ "$(left)" -gt 150 ]; then
    python3 benchmarks/random_smol.py /root/rs --method eagle3 > "$OUT/logs/random_smol.log" 2>&1
    for t in new old; do
      pp=$PYTHONPATH; [ $t = old ] && pp=/tmp/old
      PYTHONPATH=$pp timeout $(( $(left) / 2 )) python3 -m optllm eval /root/rs/target --device cuda --no-ppl \
        --draft /root/rs/eagle3 --spec-policy auto --temperatures 1 --batch-sizes "${BS:-1,64}" --out "/root/host_$t" \
        > "$OUT/logs/host_$t.log" 2>&1 || echo "eval $t exited $?"
      cp "/root/host_$t/report.json" "$OUT/host_$t.json" 2>/dev/null
      grep "^| /root" "/root/host_$t/report.md" 2>/dev/null
    done
  fi
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  exit 0
fi
source benchmarks/device_stage.sh

evalspec() {  # evalspec NAME DRAFT SECONDS ARGS...: optllm eval of the float SmolLM2 with DRAFT
  local name=$1 draft=$2 secs=$3; shift 3
  [ "$secs" -gt 30 ] || { echo "eval $name skipped: ${secs} s left"; return; }
  timeout "$secs" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft "$draft" \
    --spec-policy auto --out "/root/$name" "$@" > "$OUT/logs/$name.log" 2>&1 || echo "eval $name exited $?"
  cp "/root/$name/report.md" "$OUT/$name.md" 2>/dev/null
  cp "/root/$name/report.json" "$OUT/$name.json" 2>/dev/null
}
speedup1() {  # the batch-1 greedy speedup of a report, 0 if none
  python3 - "$1" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"][0]["speculation"]
    print(next(r["speedup"] for r in rows if r["batch_size"] == 1 and r["temperature"] == 0))
except Exception:
    print(0)
PY
}

case "${PART:-}" in
train)
  gzip -dc .carry-draft/dataset_12288.jsonl.gz | head -n "${PROMPTS:-12288}" > /root/d/float_data.jsonl
  for t in 4 7; do  # TTT 7 at batch B7 (32): a step more tokens, if the GPU has room beside the other run
    b=16; [ $t = 7 ] && b=${B7:-32}
    timeout $(( ${SECS:-430} + 60 )) python3 -m optllm train-draft smollm2-135m --method eagle3 --out "/root/d/e3-t$t" \
      --device cuda --ttt-steps "$t" --draft-vocab "${VOCAB:-16384}" --max-steps 40000 --batch-size $b \
      --time-limit "${SECS:-430}" --overwrite --dataset /root/d/float_data.jsonl > "$OUT/logs/train_e3-t$t.log" 2>&1 &
  done
  timeout "${TEST_S:-300}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_spec_gpu.py \
    tests/runtime/test_cuda_graphs.py tests/runtime/test_llm_gpu.py::test_cuda_graphs_equal_eager \
    tests/runtime/test_llm_gpu.py::test_prefill_graphs_equal_eager tests/kernels/test_tree_grow.py \
    > "$OUT/logs/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tree_grow.py -k hopper \
    > "$OUT/logs/gpu_tests_sm90.log" 2>&1
  echo "sm_90 builds: $(tail -1 "$OUT/logs/gpu_tests_sm90.log")"; grep -m 5 "^FAILED" "$OUT/logs/gpu_tests_sm90.log"
  wait
  for t in 4 7; do echo "== e3-t$t"; grep -v "^step" "$OUT/logs/train_e3-t$t.log" | tail -4; done
  ls /root/d
  ;;
eval)
  B=${BS:-1,8,32,64}
  evalspec spec_t4 /root/d/e3-t4 $(( $(left) / 3 )) --temperatures 0 --batch-sizes "$B"
  evalspec spec_t7 /root/d/e3-t7 $(( $(left) / 2 )) --temperatures 0 --batch-sizes "$B"
  s4=$(speedup1 "$OUT/spec_t4.json"); s7=$(speedup1 "$OUT/spec_t7.json")
  best=t7; python3 -c "import sys; sys.exit(0 if float('$s4') > float('$s7') else 1)" && best=t4
  echo "batch-1 greedy speedup: t4 $s4, t7 $s7 -> $best"
  evalspec "spec_${best}_temp1" "/root/d/e3-$best" $(( $(left) / 2 )) --temperatures 1 --batch-sizes "$B"
  evalspec "spec_${best}_cont" "/root/d/e3-$best" "$(left)" --temperatures 0 --batch-sizes "${CBS:-8,32,64}" \
    --spec-load continuous
  ;;
*) echo "PART=${PART:-}: allowed stage, train, eval, host"; exit 2 ;;
esac
for f in "$OUT"/spec_*.md; do [ -f "$f" ] && { echo "== $f"; grep "^|" "$f" | head -12; }; done
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
