#!/usr/bin/env bash
# Issue 12 on the H200 in one device call: llm-compressor's GPTQ / AWQ and ours on the same
# calibration samples, W4 / W3, symmetric and asymmetric, then every checkpoint's perplexity
# on each text kind through our runtime (benchmarks/peer_llmcompressor.py's steps).
#
# Before: the GGUF staged (benchmarks/device_stage.sh in an earlier call of the same warm machine,
# or .carry2 carried here with .carry1's part in /root/m). This call carries .whl-llmc:
# llmcompressor 0.14.0.1, compressed-tensors 0.19.0, auto-round, py-cpuinfo, loguru, pydantic
# (+ core, annotated-types, typing-inspection), datasets, dill, multiprocess (`pip download
# --no-deps` for cp312, see the device README); the image's transformers is 5.17, the newest
# llm-compressor accepts.
#
# The quantizations run P at a time (default 4: the GPU and 16 cores have room; each is one
# process, its log in $OUT/logs/), the evaluations (CPU, float32, as the CPU tables of
# docs/BENCHMARKS.md) in E parallel groups of 16/E threads, merged into one table.
# Environment: NS / SL (calibration samples x tokens, default 16 x 256: CI's size; 128 x 512 is
# the default calibration), ALGOS (gptq awq), BITS (4 3), SYMS ("sym asym"), PEER (1: also
# llm-compressor's; 0: ours only), KINDS (default: all), WINDOWS (windows of 512 tokens per
# kind; default: every window -- 8 were too few to rank settings by, docs/BENCHMARKS.md), P, E, EVAL_DEV
# (cpu; cuda evaluates on the GPU, with E=1). Results: $OUT/peer_eval.json and the table at the end of the output.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OPTLLM_CACHE=/root/cache
NS=${NS:-16} SL=${SL:-256} WINDOWS=${WINDOWS:-} P=${P:-4} E=${E:-4}
mkdir -p /root/cache/gguf "$OUT/logs"
f=/root/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$f" ] || cat /root/m/*.part00 .carry2/*.part01 > "$f"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c - || exit 1
wheels=$(ls .carry2/whl/*.whl .whl/*.whl 2>/dev/null)  # either folder may be absent
[ "${INSTALL:-1}" = 1 ] && [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile \
  --target /tmp/site $wheels
python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import gguf" || { echo "gguf not installed"; exit 1; }
if [ "${PEER:-1}" = 1 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-llmc .whl-llmc/*.whl || exit 1
fi
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"  # the repo root is the package
OURS=/tmp/site:$(dirname "$PWD")
PEERPATH=/tmp/site-llmc:/tmp/site  # nothing of optllm on the peer's path
R=/root/peer-$NS-$SL
T0=$SECONDS
PYTHONPATH=$OURS python3 benchmarks/peer_llmcompressor.py prepare --out $R --num-samples "$NS" --seq-len "$SL" \
  2>&1 | tail -3 || exit 1

jobs_file=$OUT/jobs.txt; : > "$jobs_file"
for algo in ${ALGOS:-gptq awq}; do
  for bits in ${BITS:-4 3}; do
    for sym in ${SYMS:-sym asym}; do
      flag=$([ "$sym" = asym ] && echo --asym || echo "")
      oflag=$([ "$sym" = asym ] && echo --asym || echo --sym)
      [ "${PEER:-1}" = 1 ] && echo "llmc-$algo-w$bits-$sym|PYTHONPATH=$PEERPATH python3 benchmarks/peer_llmcompressor.py \
quantize --algo $algo --bits $bits --group-size 64 $flag --in $R --overwrite" >> "$jobs_file"
      echo "optllm-$algo-w$bits-$sym|PYTHONPATH=$OURS python3 -m optllm quantize smollm2-135m --scheme w${bits}a16-$algo \
--group-size 64 $oflag --num-samples $NS --seq-len $SL --device ${DEV:-cuda} --no-compare --overwrite \
--out $R/optllm-$algo-w$bits-g64-$sym" >> "$jobs_file"
    done
  done
done
for bits in ${BITS:-4 3}; do  # RTN of each bits / symmetry: the reference every gap is measured against
  for sym in ${SYMS:-sym asym}; do
    oflag=$([ "$sym" = asym ] && echo --asym || echo --sym)
    echo "optllm-rtn-w$bits-$sym|PYTHONPATH=$OURS python3 -m optllm quantize smollm2-135m --scheme w${bits}a16-rtn \
--group-size 64 $oflag --num-samples $NS --seq-len $SL --device ${DEV:-cuda} --no-compare --overwrite --out $R/optllm-rtn-w$bits-g64-$sym" >> "$jobs_file"
  done
done
echo "$(wc -l < "$jobs_file") quantizations, $P at a time"
run_job() {  # NAME|COMMAND
  local name=${1%%|*} cmd=${1#*|} t=$SECONDS
  OMP_NUM_THREADS=4 timeout "${JOB_S:-300}" bash -c "$cmd" > "$OUT/logs/$name.log" 2>&1
  echo "$name: rc $? in $(( SECONDS - t )) s: $(grep -v 'it/s\]\|Loading weights' "$OUT/logs/$name.log" | tail -1 | cut -c1-160)"
}
export -f run_job; export OUT
tr '\n' '\0' < "$jobs_file" | xargs -0 -P "$P" -I{} bash -c 'run_job "$@"' _ {}
echo "quantized in $(( SECONDS - T0 )) s"

dirs=($R/float $R/optllm-* $R/llmc-*)
parts=()
for ((g = 0; g < E; g++)); do
  sel=(); for ((i = g; i < ${#dirs[@]}; i += E)); do [ -d "${dirs[$i]}" ] && sel+=("${dirs[$i]}"); done
  [ ${#sel[@]} -eq 0 ] && continue
  parts+=("$OUT/eval_part$g.json")
  OMP_NUM_THREADS=$(( 16 / E )) PYTHONPATH=$OURS timeout "${EVAL_S:-400}" python3 benchmarks/peer_llmcompressor.py \
    eval --dirs "${sel[@]}" --device "${EVAL_DEV:-cpu}" ${KINDS:+--kinds $KINDS} ${WINDOWS:+--max-windows $WINDOWS} --prepared $R \
    --json "$OUT/eval_part$g.json" > "$OUT/logs/eval_part$g.log" 2>&1 &
done
wait
grep -h "FAILED\|Error" "$OUT"/logs/eval_part*.log | head -20
echo "evaluated; $(( SECONDS - T0 )) s in all"
PYTHONPATH=$OURS python3 benchmarks/peer_llmcompressor.py merge "${parts[@]}" --json "$OUT/peer_eval.json"
