#!/usr/bin/env bash
# The twenty-sixth session's device work (issues 15 and 13), three calls on one warm machine. Pass
# OPTLLM_COMMIT as a literal hash (the device's .git is stale).
#   PART=stage  carry .carry1: its part copied to /root/m (the next call must follow within the
#               machine's warm time)
#   PART=train  carry .carry2: the model assembled (device_stage.sh); ONE EAGLE-3 draft (training-time
#               test TTT steps, draft vocabulary 16384, batch 16) trained alone for SECS (300) on the
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
#   DECODE=1 (kernels; forty-second session): after TILE, benchmarks/decode.py's 8b-w4a16 case (--quick) with
#               OPTLLM_W4A16_TILE=1 (batch 64's M = 64 on the tiles) and =0 (the Triton path)
#   TUNE128=1 (kernels; forty-third session): before TILE, benchmarks/tune_w4a16.py --ms TUNE_MS (128; forty-sixth
#               session: any list) (TUNE_S, 200 s) on the 8B
#               shapes; the tile sweep's Triton column then runs its winners (OPTLLM_W4A16_TABLE)
#   TILE_NCU=1 (kernels; forty-second session): after TILE, Nsight Compute on the tiles at o and down, M = TILE_NCU_M
#               (64), configs TILE_NCU_CFGS (4x2x8k4 and its no-dequantization twin)
#   TILE=1 (tests, kernels; forty-first session): after the GPU tests, benchmarks/w4a16_tile.py (the M = 16..256
#               tensor-core tiles against cuBLAS bf16 and the Triton path) at TILE_MS over TILE_CONFIGS
#   PART=kernels  no model, nothing carried: the GPU tests (TESTS), the GEMV sweep and Nsight Compute as in eval;
#               CATCHUP=1 first times the EAGLE draft's eager catch-up (benchmarks/catch_up_cost.py, after the
#               prompt and mid-stream; CU_ARGS replaces its cases, CU_PROFILE the profiled one); DORMANT=1 the
#               decode graph with a draft against without (dormant_cost.py); FIRST=1 a GEMM's first call at a
#               new row count (first_call_cost.py); TESTS=none no tests; NO_MMA=1 no GEMV sweep
#               STREAM=1 first the streaming ceiling (benchmarks/stream_ceiling.py: a pure read of each 8B shape's
#               int4 words, and torch's copy of them)
#   PART=host   no model, nothing carried (thirty-eighth session): host_profile_spec.py on a random SmolLM2 at
#               temperature HOST_TEMP (1), batches HOST_BS (8,64): a dormant draft engine's host time, by function;
#               TESTS (GPU tests) and DORMANT=1 first, HOST_ARGS passed on (--ablate)
#   PART=gen    carry .carry2 (twenty-eighth session; DATA, OPENERS, GEN_SEED below: forty-third): more
#               self-distilled data, GEN_S seconds of chunks
#               (benchmarks/gen_draft_data.py, seeds apart from the nineteenth session's), merged after
#               the nineteenth session's 12288 into /root/d/data_all.jsonl (a later PART=train on the same
#               warm machine trains on it instead), which also comes back as $OUT/data_all.jsonl.gz
#   PART=medusa carry .carry2 (or after a call that assembled the model): a Medusa draft (HEADS, 4) trained
#               SECS (300) on the repo's 12288 sequences into /root/d/medusa, then eval's waves (LOAD) at 0 and 1
#   PART=awq    (thirty-third session) the AWQ target quantized on the GPU (W4 g64), evaluated with each draft
#               of AWQ_DRAFTS (default the float target's: DRAFT carried, or /root/d/e3 from an earlier eval
#               call), temperatures TEMPS (0,1)
#   PART=bs1    (thirty-fourth session) batch 1 over BS1_REPS requests for each NAME:MODEL:DRAFT of RUNS
#   PART=awqdata, then PART=awqtrain (thirty-fourth session): a draft trained on the AWQ target with the
#               float draft's recipe and prompts (the float dataset's prompts answered again by the AWQ
#               target; STEPS, 3981 as .carry-e3 ran) into /root/d/e3awq, back as e3awq.tgz.part*
# SPEC_PROFILE=1 (eval, after BS1_REPS; forty-fourth session): benchmarks/profile_step.py's speculative step graphs at
# SPEC_TREES (20,41) nodes, batches SPEC_PROFILE_BS (1), kernel by kernel, into $OUT/spec_profile
# TIGHT=1 (eval, after LOAD's continuous): that load again at TIGHT_BS with max_model_len 64 below its own
# LOAD: eval's --spec-load, one eval each (none: no load, only the batch-1 run of BS1_REPS) (waves, the default, and/or continuous: "waves continuous")
# DATA (train): a carried folder with data_all.jsonl.gz, trained on instead (.carry-data, 12 MB: with
# .carry2 it passes 64 MiB, so the model is assembled by an earlier call on the warm machine);
# DRAFT (eval): a folder of e3.tgz.part* carried in, unpacked to /root/d/e3 (a fresh machine);
# BS1_REPS (eval): also batch 1 alone over that many timed requests (--spec-reps), for its tau
# LR: train's peak learning rate (train-draft's default 1e-3); TTT (6), LABELS (soft | hard), HOLDOUT (64):
# train-draft's --ttt-steps, --labels, --holdout; TESTS in PART=eval: GPU tests first; NO_MMA=1:
# eval without the GEMV sweep and profile
# TESTS / TESTS_S: the GPU tests' files and time limit (default all of ALL_TESTS, the call's time left);
# DEV_TESTS (unmarked, on CUDA where present) run after them when TESTS is unset, or with DEV=1
source benchmarks/device_preamble.sh
if [ "${PART:-}" = kernels ] || [ "${PART:-}" = host ]; then  # no model: kernels' tests and benchmarks, host
  no_model_env
else
  source benchmarks/device_stage.sh
fi
ALL_TESTS="tests/runtime/test_spec_gpu.py tests/runtime/test_cuda_graphs.py
  tests/runtime/test_llm_gpu.py::test_cuda_graphs_equal_eager tests/runtime/test_llm_gpu.py::test_prefill_graphs_equal_eager
  tests/kernels/test_tree_grow.py tests/kernels/test_w4a16_mma.py tests/kernels/test_w4a16_mma_tile.py"
# files whose tests run on CUDA whenever it is there, unmarked (-m gpu would skip them all)
DEV_TESTS="tests/kernels/test_rmsnorm.py tests/runtime/test_spec_features.py tests/kernels/test_sample.py
  tests/kernels/test_fc_scatter.py"
gpu_tests() {  # TESTS (default ALL_TESTS) within TESTS_S seconds (default: the call's time left)
  # shellcheck disable=SC2086
  timeout "${TESTS_S:-$(( $(left) - 20 ))}" python3 -m pytest -q -m gpu -p no:cacheprovider ${TESTS:-$ALL_TESTS} \
    > "$OUT/logs/gpu_tests.log" 2>&1
  echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  # shellcheck disable=SC2086
  [ -n "${TESTS:-}" ] && [ -z "${DEV:-}" ] && return 0  # DEV=1: these too when TESTS names the marked ones
  timeout 120 python3 -m pytest -q -p no:cacheprovider $DEV_TESTS > "$OUT/logs/dev_tests.log" 2>&1
  { echo "cuda tests: $(tail -1 "$OUT/logs/dev_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/dev_tests.log"; }
}
mma_sweep() {
  timeout "$(( $(left) - 90 ))" python3 benchmarks/w4a16_mma.py --shapes qkv,o,gate_up,down --ms "${MS:-1,8,16}" \
    --configs "${CONFIGS:-8x2s,8x2sp,8x2spk2,8x2spk4,16x2sp}" --out "$OUT" > "$OUT/logs/mma.log" 2>&1 \
    || echo "w4a16_mma exited $?"
  grep "^|" "$OUT/logs/mma.log" | head -60
}
tune128() {  # TUNE128=1 (forty-third session): the Triton path's new M = 128 bucket tuned on the 8B shapes (TUNE_S
  # seconds), its winners loaded by the tile sweep after it (OPTLLM_W4A16_TABLE), whose Triton column then runs them
  [ -n "${TUNE128:-}" ] || return 0
  timeout "$(( ${TUNE_S:-200} + 60 ))" python3 benchmarks/tune_w4a16.py --ms "${TUNE_MS:-128}" --budget-s "${TUNE_S:-200}" \
    --out "$OUT" > "$OUT/logs/tune128.log" 2>&1 || echo "tune_w4a16 exited $?"
  grep " M=[0-9]*: \|^    ([0-9]" "$OUT/logs/tune128.log"
  [ -f "$OUT/w4a16_table.json" ] && export OPTLLM_W4A16_TABLE=$OUT/w4a16_table.json
}
tile_bench() {  # TILE=1 (forty-first session): the small-batch tensor-core tiles at TILE_MS over TILE_CONFIGS
  [ -n "${TILE:-}" ] || return 0
  timeout "${TILE_S:-$(( $(left) - 15 ))}" python3 benchmarks/w4a16_tile.py --ms "${TILE_MS:-16,32,64,128,256}" \
    ${TILE_CONFIGS:+--configs "$TILE_CONFIGS"} --table --out "$OUT" > "$OUT/logs/tile.log" 2>&1 || echo "w4a16_tile exited $?"
  grep "^|\|^TILE_TABLE\|^    (\|^}" "$OUT/logs/tile.log" | head -60
}
tile_ncu() {  # TILE_NCU=1 (forty-second session): Nsight Compute on the tiles, o and down at M = 64 in TILE_NCU_CFGS
  [ -n "${TILE_NCU:-}" ] || return 0
  cat > /tmp/ncu_tile.py <<'PY'
import os
import torch
from optllm.benchmarks.w4a16_tile import parse_config
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk
from optllm.kernels import w4a16_mma_tile as tk
for n, k in ((4096, 4096), (4096, 14336)):
    q = torch.randint(-8, 8, (n, k), dtype=torch.int8, device="cuda")
    s = (torch.rand(n, k // 128, device="cuda") * 1e-3).to(torch.bfloat16)
    w = mk.from_w4a16(w4k.prepack_w4a16(q, s, None, 128, dtype=torch.bfloat16))
    x = torch.randn(int(os.environ.get("TILE_NCU_M", "64")), k, device="cuda", dtype=torch.bfloat16)
    for c in os.environ.get("TILE_NCU_CFGS", "4x2x8k4,4x2x8k4a").split(","):
        tk.w4a16_mma_tile(x, w, None, parse_config(c))
torch.cuda.synchronize()
PY
  ncu_profile tile w4a16_mma_tile "--section ComputeWorkloadAnalysis" "|Tensor"
}
ncu_profile() {  # NAME KERNEL_REGEX [EXTRA_SECTIONS] [EXTRA_GREP]: Nsight Compute on python3 /tmp/ncu_NAME.py's
  # kernels matching the regex, the report in $OUT/ncu_NAME.txt, its headline lines printed
  # shellcheck disable=SC2086
  timeout "$(( $(left) - 5 ))" ncu --kernel-name "regex:$2" --section SpeedOfLight --section MemoryWorkloadAnalysis \
    --section WarpStateStats --section Occupancy --section LaunchStats --section InstructionStats \
    --section SchedulerStats ${3:-} python3 "/tmp/ncu_$1.py" > "$OUT/ncu_$1.txt" 2>&1 || echo "ncu exited $?"
  grep -E "$2|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers Per|Executed Ipc A|Issued Warp|No Eligible|Warp Cycles Per Issued|Executed Instructions  ${4:-}" \
    "$OUT/ncu_$1.txt" | head -90
}
probes() {  # CATCHUP=1: the draft's eager catch-up by rows and one profiled (a random SmolLM2-shaped model)
  if [ -n "${CATCHUP:-}" ]; then  # after the prompt and mid-stream (min_tokens 48), greedy and sampled
    # shellcheck disable=SC2086
    timeout 240 python3 benchmarks/catch_up_cost.py ${CU_ARGS:---batches 1,8,32 --lens 32,128 --min-tokens 0,48 --temps 0,1} \
      --profile "${CU_PROFILE:-8,32,48,1}" --out "$OUT" > "$OUT/logs/catch_up.log" 2>&1 || echo "catch_up_cost exited $?"
    grep -v "arn" "$OUT/logs/catch_up.log" | grep -A50 "start-up fit" | head -66
  fi
  if [ -n "${DORMANT:-}" ]; then  # DORMANT=1: the decode graph with and without a draft, replays timed
    timeout 150 python3 benchmarks/dormant_cost.py --profile --out "$OUT" > "$OUT/logs/dormant.log" 2>&1 \
      || echo "dormant_cost exited $?"
    grep -v "arn" "$OUT/logs/dormant.log" | grep -A70 "^| batch" | head -80
  fi
  if [ -n "${FIRST:-}" ]; then  # FIRST=1: a GEMM's first call at a new row count against its second
    timeout 60 python3 benchmarks/first_call_cost.py --out "$OUT" > "$OUT/logs/first_call.log" 2>&1 || echo "first_call exited $?"
    grep "^|\|^torch" "$OUT/logs/first_call.log"
  fi
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
  ncu_profile mma w4a16_mma
}
spec_eval() {  # NAME MODEL DRAFT_DIR, then eval's own arguments (later ones win: --temperatures 0)
  local name=$1 model=$2 draft=$3; shift 3
  timeout "${EVAL_S:-240}" python3 -m optllm eval "$model" --device cuda --no-ppl --draft "$draft" \
    --spec-policy auto --out "/root/spec_$name" --temperatures 0,1 "$@" > "$OUT/logs/spec_$name.log" 2>&1 \
    || echo "eval $name exited $?"
  cp "/root/spec_$name/report.md" "$OUT/spec_$name.md" 2>/dev/null
  cp "/root/spec_$name/report.json" "$OUT/spec_$name.json" 2>/dev/null
  grep "^|" "$OUT/spec_$name.md" | head -14
}
unpack_draft() {  # DRAFT: a carried folder of e3.tgz.part*, unpacked to /root/d/e3
  [ -z "${DRAFT:-}" ] || { mkdir -p /root/d && cat "$DRAFT"/e3.tgz.part* | tar xzf - -C /root/d; }
}
quantize_awq() {  # the AWQ target (W4 g64, 128 x 512 calibration) in /root/awq, unless an earlier call made it
  [ -f /root/awq/config.json ] && return 0
  timeout 150 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 --device cuda \
    --num-samples 128 --seq-len 512 --no-compare --out /root/awq > "$OUT/logs/quantize.log" 2>&1 \
    || { echo "quantize exited $?"; tail -5 "$OUT/logs/quantize.log"; }
}
case "${PART:-}" in
tests) probes; [ "${TESTS:-}" = none ] || gpu_tests; tile_bench ;;
kernels) probes
  [ "${TESTS:-}" = none ] || gpu_tests
  tune128
  tile_bench
  tile_ncu
  if [ -n "${DECODE:-}" ]; then  # DECODE=1 (forty-second session): the 8B W4A16 decode with the tiles (M 17..256) on, then off
    for on in 1 0; do
      OPTLLM_W4A16_TILE=$on timeout "$(( ($(left) - 20) / (on + 1) ))" python3 benchmarks/decode.py --cases 8b-w4a16 \
        --quick --peers none --tag "decode_tile$on" --out "$OUT" > "$OUT/logs/decode_tile$on.log" 2>&1 \
        || echo "decode (tiles $on) exited $?"
      grep "^|" "$OUT/decode_tile$on.md" 2>/dev/null | head -8
    done
  fi
  if [ -n "${STREAM:-}" ]; then  # STREAM=1 (thirty-ninth session): what a pure read of the 8B shapes' words takes
    timeout 150 python3 benchmarks/stream_ceiling.py --out "$OUT" > "$OUT/logs/stream.log" 2>&1 || echo "stream exited $?"
    grep "^|" "$OUT/logs/stream.log"
  fi
  [ -n "${NO_MMA:-}" ] || { mma_sweep; [ -n "${NO_NCU:-}" ] || mma_ncu; } ;;
gen)  # DATA (forty-third session): a carried folder's data_all.jsonl.gz (.carry-data: data-s43's 47057) is the old
  # set instead of the repo's 12288 (with .carry2 it passes 64 MiB: assemble the model in an earlier call);
  # OPENERS=1: the turns start with task openers (gen_draft_data.py --openers builtin); GEN_SEED: the first seed
  old=/root/d/float_data.jsonl
  if [ -n "${DATA:-}" ]; then old=/root/d/prev_data.jsonl; gzip -dc "$DATA"/data_all.jsonl.gz > "$old"
  else gzip -dc .carry-draft/dataset_12288.jsonl.gz > "$old"; fi
  python3 benchmarks/gen_draft_data.py smollm2-135m --device cuda --out /root/d/data_all.jsonl --chunk 2048 \
    --seconds "${GEN_S:-$(( $(left) - 150 ))}" --exclude "$old" --merge --seed "${GEN_SEED:-1000000}" \
    ${OPENERS:+--openers builtin} > "$OUT/logs/gen.log" 2>&1
  echo "gen exited $?"; tail -4 "$OUT/logs/gen.log"
  gzip -c /root/d/data_all.jsonl > "$OUT/data_all.jsonl.gz"; ls -la "$OUT"
  ;;
train)
  data=/root/d/data_all.jsonl
  # DATA: a carried folder with data_all.jsonl.gz (.carry-data: the 47057 sequences), in a call of its own
  [ -n "${DATA:-}" ] && gzip -dc "$DATA"/data_all.jsonl.gz > "$data"
  [ -f "$data" ] || { data=/root/d/float_data.jsonl; gzip -dc .carry-draft/dataset_12288.jsonl.gz > "$data"; }
  echo "training on $data: $(wc -l < "$data") sequences"
  init=()
  if [ -n "${INIT:-}" ]; then
    mkdir -p /root/d/init && cat "$INIT"/e3.tgz.part* | tar xzf - -C /root/d/init && init=(--init-from /root/d/init/e3)
  fi
  timeout $(( ${SECS:-300} + 90 )) python3 -m optllm train-draft smollm2-135m --method eagle3 --out /root/d/e3 "${init[@]}" \
    --device cuda --ttt-steps "${TTT:-6}" --labels "${LABELS:-soft}" --holdout "${HOLDOUT:-64}" --draft-vocab 16384 \
    --max-steps 40000 --batch-size 16 \
    --time-limit "${SECS:-300}" --lr "${LR:-1e-3}" --overwrite --dataset "$data" > "$OUT/logs/train_e3.log" 2>&1
  echo "train exited $?"; grep -v "^step" "$OUT/logs/train_e3.log" | tail -5
  (cd /root/d && tar czf - --exclude="checkpoint-*" --exclude=dataset.jsonl e3 | split -b 15M - "$OUT/e3.tgz.part") && ls -la "$OUT"
  [ -n "${INIT:-}" ] || gpu_tests  # with INIT the GPU tests ran in the call before (PART=tests)
  ;;
eval)
  unpack_draft
  [ -z "${TESTS:-}" ] || gpu_tests
  for load in ${LOAD:-waves}; do
    [ "$load" = none ] || spec_eval "$load" smollm2-135m /root/d/e3 --batch-sizes "${BS:-1,8,32,64}" --spec-load "$load"
  done
  if [ -n "${TIGHT:-}" ] && [ -f /root/spec_continuous/report.json ]; then
    # (thirty-third session) the continuous load at the old sizing, max_model_len 64 below the new one:
    # the longer requests end too near it for a tree, so most steps would split (TIGHT_BS: 32,64)
    ml=$(python3 -c "import json; print(json.load(open('/root/spec_continuous/report.json'))['rows'][0]['speculation'][0]['max_model_len'])")
    echo "continuous: max_model_len $ml; tight: $(( ml - 64 ))"
    spec_eval tight smollm2-135m /root/d/e3 --batch-sizes "${TIGHT_BS:-32,64}" --spec-load continuous --spec-max-len $(( ml - 64 ))
  fi
  # BS1_ARGS: runs of it with more of eval's arguments, ";" between runs, named bs1, bs1_2, ... (say
  # ";--spec-depth 7 --spec-tokens 60 --temperatures 0": the default tree, then a deeper one)
  if [ -n "${BS1_REPS:-}" ]; then
    i=0
    IFS=';' read -r -a variants <<< "${BS1_ARGS:-}"
    [ ${#variants[@]} -gt 0 ] || variants=("")
    for v in "${variants[@]}"; do
      i=$(( i + 1 )); name=bs1; [ $i -gt 1 ] && name=bs1_$i
      # shellcheck disable=SC2086
      spec_eval "$name" smollm2-135m /root/d/e3 --batch-sizes 1 --spec-reps "$BS1_REPS" $v
    done
  fi
  if [ -n "${SPEC_PROFILE:-}" ]; then
    # (forty-fourth session) where a speculative step's graph time goes, kernel by kernel, at trees of
    # SPEC_TREES nodes (20,41: the 41-node step profiled 0.36 ms over the 20-node one at batch 1 on the H100)
    timeout "${SPEC_PROFILE_S:-240}" python3 benchmarks/profile_step.py --model smollm2-135m --draft /root/d/e3 \
      --batches "${SPEC_PROFILE_BS:-1}" --spec-trees "${SPEC_TREES:-20,41}" --out "$OUT/spec_profile" \
      > "$OUT/logs/spec_profile.log" 2>&1 || echo "profile_step exited $?"
  fi
  [ -n "${NO_MMA:-}" ] || { mma_sweep; mma_ncu; }
  ;;
medusa)  # (for the thirty-fourth session) issue 15's Medusa draft, trained for SECS (300) on the repo's
  # 12288 self-distilled sequences (.carry-draft, in the checkout), then eval in waves (LOAD; temperatures 0,1)
  gzip -dc .carry-draft/dataset_12288.jsonl.gz > /root/d/float_data.jsonl
  timeout $(( ${SECS:-300} + 90 )) python3 -m optllm train-draft smollm2-135m --method medusa --out /root/d/medusa \
    --device cuda --num-heads "${HEADS:-4}" --holdout "${HOLDOUT:-64}" --max-steps 40000 --batch-size 16 \
    --time-limit "${SECS:-300}" --lr "${LR:-1e-3}" --overwrite --dataset /root/d/float_data.jsonl \
    > "$OUT/logs/train_medusa.log" 2>&1
  echo "train exited $?"; grep -v "^step" "$OUT/logs/train_medusa.log" | tail -5
  for load in ${LOAD:-waves}; do
    spec_eval "medusa_$load" smollm2-135m /root/d/medusa --batch-sizes "${BS:-1,8,32,64}" --spec-load "$load"
  done
  ;;
awq)  # (thirty-third session) the AWQ target (W4 g64, 128 x 512 calibration, quantized on the GPU, or kept
  # from an earlier call) served with each draft of AWQ_DRAFTS (default /root/d/e3: the float target's, DRAFT
  # carried in or left by an eval call), one eval each (spec_awq_<folder>)
  unpack_draft
  quantize_awq
  for d in ${AWQ_DRAFTS:-/root/d/e3}; do
    EVAL_S=${EVAL_S:-300} spec_eval "awq_$(basename "$d")" /root/awq "$d" --temperatures "${TEMPS:-0,1}" \
      --batch-sizes "${BS:-1,8,32,64}"
  done
  ;;
bs1)  # (thirty-fourth session) batch 1 alone over BS1_REPS (24) requests, temperatures TEMPS (0,1), for each
  # NAME:MODEL:DRAFT of RUNS (folders left on the machine by earlier calls): spec_bs1_NAME; BS1_EXTRA (forty-seventh
  # session): more of eval's arguments for every run ("--spec-policy fixed")
  for r in ${RUNS:?RUNS: NAME:MODEL:DRAFT ...}; do
    IFS=: read -r name model draft <<< "$r"
    # shellcheck disable=SC2086
    spec_eval "bs1_$name" "$model" "$draft" --batch-sizes 1 --spec-reps "${BS1_REPS:-24}" --temperatures "${TEMPS:-0,1}" \
      ${BS1_EXTRA:-}
  done
  ;;
awqdata)  # (thirty-fourth session) the AWQ target quantized, then the float draft's 12288 prompts (its
  # dataset's prompt parts, as token ids) answered again by it, greedy: /root/d/awqdata/dataset.jsonl
  # (train-draft --prompts, one step trained and thrown away); TESTS: GPU tests after it
  quantize_awq
  gzip -dc .carry-draft/dataset_12288.jsonl.gz > /root/d/float_data.jsonl
  timeout 300 python3 -m optllm train-draft /root/awq --method eagle3 --out /root/d/awqdata --device cuda \
    --draft-vocab 16384 --max-steps 1 --holdout 64 --overwrite --prompts /root/d/float_data.jsonl \
    --num-prompts 12288 > "$OUT/logs/awqdata.log" 2>&1
  echo "awqdata exited $?"; grep -v "^step" "$OUT/logs/awqdata.log" | tail -4
  wc -l /root/d/awqdata/dataset.jsonl
  [ -z "${TESTS:-}" ] || gpu_tests
  ;;
awqtrain)  # (thirty-fourth session) an EAGLE-3 draft for the AWQ target on /root/d/awqdata's sequences, with
  # the float draft's recipe (.carry-e3: 3981 steps of batch 16, TTT 6, soft labels, draft vocabulary 16384,
  # peak lr 1e-3, holdout 64): /root/d/e3awq, back as $OUT/e3awq.tgz.part*
  timeout $(( $(left) - 20 )) python3 -m optllm train-draft /root/awq --method eagle3 --out /root/d/e3awq \
    --device cuda --ttt-steps 6 --labels soft --holdout 64 --draft-vocab 16384 --max-steps "${STEPS:-3981}" \
    --batch-size 16 --lr 1e-3 --overwrite --dataset /root/d/awqdata/dataset.jsonl > "$OUT/logs/train_e3awq.log" 2>&1
  echo "train exited $?"; grep -v "^step" "$OUT/logs/train_e3awq.log" | tail -5
  (cd /root/d && tar czf - --exclude="checkpoint-*" --exclude=dataset.jsonl e3awq | split -b 15M - "$OUT/e3awq.tgz.part") \
    && ls -la "$OUT"
  ;;
host)  # (thirty-eighth session) a random SmolLM2-shaped target and EAGLE-3 draft (no staging): host_profile_spec.py,
  # plain engine against the draft engine with speculation pinned off, at HOST_TEMP (1) over HOST_BS (8,64): the
  # whole generate's time a step, the runner's, cProfile's functions that differ most, host syncs; first the
  # GPU tests (TESTS) and probes (DORMANT=1); HOST_ARGS: more of the script's arguments (--ablate)
  [ -z "${TESTS:-}" ] || [ "${TESTS:-}" = none ] || gpu_tests
  probes
  timeout 90 python3 benchmarks/random_smol.py /root/rs --method eagle3 > "$OUT/logs/random_smol.log" 2>&1 \
    || { echo "random_smol exited $?"; tail -3 "$OUT/logs/random_smol.log"; }
  # shellcheck disable=SC2086
  timeout "$(( $(left) - 10 ))" python3 benchmarks/host_profile_spec.py --model /root/rs/target --draft /root/rs/eagle3 \
    --batches "${HOST_BS:-8,64}" --temperature "${HOST_TEMP:-1}" --rounds 5 ${HOST_ARGS:-} --out "$OUT" > "$OUT/logs/host.log" 2>&1 \
    || echo "host_profile_spec exited $?"
  grep -v "arn" "$OUT/host_profile_spec.md" 2>/dev/null | grep -A30 "^### batch" | head -80
  ;;
*) echo "PART=${PART:-}: allowed stage, tests, gen, train, eval, kernels, host, awq, bs1, awqdata, awqtrain, medusa"; exit 2 ;;
esac
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
# at most 8 files come back from $OUT: past that, the JSON reports travel as one archive (PART=bs1 with
# four runs wrote 8 reports, and two files stayed behind)
[ "$(ls "$OUT" | wc -l)" -le 8 ] || (cd "$OUT" && tar czf json.tgz ./*.json && rm ./*.json)
