#!/usr/bin/env bash
# The twenty-sixth session's device work (issues 15 and 13), three calls on one warm machine. Pass
# OPTLLM_COMMIT as a literal hash (the device's .git is stale).
#   PART=stage  carry .carry1: its part copied to /root/m (the next call must follow within the
#               machine's warm time)
#   PART=train  carry .carry2: the model assembled (device_stage.sh); ONE EAGLE-3 draft (training-time
#               test 4 steps, draft vocabulary 16384, batch 16) trained alone for SECS (300) on the
#               nineteenth session's self-distilled data into /root/d/e3 (a second job beside it cuts
#               its steps to a quarter: the step is host-bound); then the GPU tests (speculative
#               engine, step graphs, prefill graphs, EAGLE-2 growth, the tensor-core GEMV's variants);
#               the draft comes back as $OUT/e3.tgz.part* (16 MiB a file)
#               With INIT=DIR (a folder of e3.tgz.part* an earlier call brought back, carried in by a
#               later call), the draft unpacked there starts the training (--init-from)
#   PART=tests  carry .carry2: the model assembled, the GPU tests alone (no training): the middle call
#               when the third carries .carry-e3 (.carry2 and the draft together pass the 64 MiB limit)
#   PART=eval   optllm eval of the float SmolLM2 with /root/d/e3, waves at BS (1,8,32,64), temperature
#               0 and 1, adaptive policy; then issue 13: benchmarks/w4a16_mma.py on the 8B shapes at
#               M = 1, 8, 16 over CONFIGS (split-K `kS` or not, 8 or 16 warps; the scale prefetch, `f`,
#               ran at d8c07ca and was removed after it lost, so `f` configs need that commit), then Nsight
#               Compute on the GEMV at gate_up and down, M = 1, in the runtime's config or each of NCU_CFGS
#               (SOL, memory, warp stalls, instruction statistics)
#   PART=kernels  no model, nothing carried: the GPU tests (TESTS), the GEMV sweep and Nsight Compute as in eval
# LOAD: eval's --spec-load (waves, the default, or continuous)
# TESTS / TESTS_S: the GPU tests' files and time limit (default all of ALL_TESTS, the call's time left)
source benchmarks/device_preamble.sh
if [ "${PART:-}" = kernels ]; then  # no model: the kernels' tests and benchmarks
  no_model_env
else
  source benchmarks/device_stage.sh
fi
ALL_TESTS="tests/runtime/test_spec_gpu.py tests/runtime/test_cuda_graphs.py
  tests/runtime/test_llm_gpu.py::test_cuda_graphs_equal_eager tests/runtime/test_llm_gpu.py::test_prefill_graphs_equal_eager
  tests/kernels/test_tree_grow.py tests/kernels/test_w4a16_mma.py"
gpu_tests() {  # TESTS (default ALL_TESTS) within TESTS_S seconds (default: the call's time left)
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-$(( $(left) - 20 ))}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-$ALL_TESTS} \
    > "$OUT/logs/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
}
mma_sweep() {
  timeout "$(( $(left) - 90 ))" python3 benchmarks/w4a16_mma.py --shapes qkv,o,gate_up,down --ms "${MS:-1,8,16}" \
    --configs "${CONFIGS:-8x2s,8x2sp,8x2spk2,8x2spk4,16x2sp}" --out "$OUT" > "$OUT/logs/mma.log" 2>&1 \
    || echo "w4a16_mma exited $?"
  grep "^|" "$OUT/logs/mma.log" | head -60
}
mma_ncu() {
  cat > /tmp/ncu_mma.py <<'PY'
import os
import torch
from optllm.benchmarks.w4a16_mma import parse_config
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk
for n, k in ((28672, 4096), (4096, 14336)):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    s = (torch.rand(n, k // 128, device="cuda") * 1e-3).to(torch.bfloat16)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, None, 128, dtype=torch.bfloat16))
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    for c in [parse_config(c) for c in os.environ.get("NCU_CFGS", "").split(",") if c] or [None]:
        mk.w4a16_mma_gemv(x, w, None, c)
torch.cuda.synchronize()
PY
  timeout "$(( $(left) - 5 ))" ncu --kernel-name regex:w4a16_mma --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
    --section SchedulerStats python3 /tmp/ncu_mma.py > "$OUT/ncu_mma.txt" 2>&1 || echo "ncu exited $?"
  grep -E "w4a16_mma|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issued Warp|No Eligible|Warp Cycles Per Issued|Executed Instructions  " "$OUT/ncu_mma.txt" | head -90
}
case "${PART:-}" in
tests) gpu_tests ;;
kernels) gpu_tests; mma_sweep; mma_ncu ;;
train)
  gzip -dc .carry-draft/dataset_12288.jsonl.gz > /root/d/float_data.jsonl
  init=()
  if [ -n "${INIT:-}" ]; then
    mkdir -p /root/d/init && cat "$INIT"/e3.tgz.part* | tar xzf - -C /root/d/init && init=(--init-from /root/d/init/e3)
  fi
  timeout $(( ${SECS:-300} + 90 )) python3 -m optllm train-draft smollm2-135m --method eagle3 --out /root/d/e3 "${init[@]}" \
    --device cuda --ttt-steps 4 --draft-vocab 16384 --max-steps 40000 --batch-size 16 \
    --time-limit "${SECS:-300}" --overwrite --dataset /root/d/float_data.jsonl > "$OUT/logs/train_e3.log" 2>&1
  echo "train exited $?"; grep -v "^step" "$OUT/logs/train_e3.log" | tail -5
  (cd /root/d && tar czf - --exclude="checkpoint-*" --exclude=dataset.jsonl e3 | split -b 15M - "$OUT/e3.tgz.part") && ls -la "$OUT"
  [ -n "${INIT:-}" ] || gpu_tests  # with INIT the GPU tests ran in the call before (PART=tests)
  ;;
eval)
  timeout "${EVAL_S:-240}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/e3 \
    --spec-policy auto --out /root/spec --temperatures 0,1 --batch-sizes "${BS:-1,8,32,64}" --spec-load "${LOAD:-waves}" \
    > "$OUT/logs/spec.log" 2>&1 || echo "eval exited $?"
  cp /root/spec/report.md "$OUT/spec.md" 2>/dev/null; cp /root/spec/report.json "$OUT/spec.json" 2>/dev/null
  grep "^|" "$OUT/spec.md" | head -14
  mma_sweep
  mma_ncu
  ;;
*) echo "PART=${PART:-}: allowed stage, tests, train, eval, kernels"; exit 2 ;;
esac
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
