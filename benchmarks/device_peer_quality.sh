#!/usr/bin/env bash
# Issue 12 on the H200 in one device call: llm-compressor's GPTQ / AWQ and ours on the same
# calibration samples, W4 / W3, symmetric and asymmetric, then every checkpoint's perplexity
# on each text kind through our runtime (benchmarks/peer_llmcompressor.py's three steps).
#
# Before: a first call carried .carry1 (mkdir -p /root/m && cp .carry1/*.part00 /root/m/);
# this call carries .carry2 (the GGUF's second part and the gguf wheel), .whl (pydantic,
# fastapi...: the GPU image lacks pydantic, which llm-compressor needs too) and .whl-llmc
# (llmcompressor 0.14.0.1, compressed-tensors 0.19.0, datasets, dill, multiprocess, loguru,
# auto-round: `pip download --no-deps` for cp312, see the device README). The image's
# transformers is 5.17, the newest llm-compressor accepts.
#
# Environment: NS / SL (calibration samples x tokens, default 16 x 256: CI's size; 128 x 512 is
# the default calibration), ALGOS (gptq awq), BITS (4 3), SYMS ("sym asym"), KINDS (default:
# all), WINDOWS (windows of 512 tokens per kind, default 8). Results: $OUT/peer_eval.json and
# the table in the output; quantize logs in $OUT/quantize.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OPTLLM_CACHE=/root/cache
NS=${NS:-16} SL=${SL:-256} WINDOWS=${WINDOWS:-8}
mkdir -p /root/cache/gguf
f=/root/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$f" ] || cat /root/m/*.part00 .carry2/*.part01 > "$f"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry2/whl/*.whl .whl/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-llmc .whl-llmc/*.whl || exit 1
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"  # the repo root is the package
OURS=/tmp/site:$(dirname "$PWD")
PEER=/tmp/site-llmc:/tmp/site  # nothing of optllm on the peer's path
P=/root/peer
log() { echo "== $*" | tee -a "$OUT/quantize.log"; }
PYTHONPATH=$OURS python3 benchmarks/peer_llmcompressor.py prepare --out $P --num-samples "$NS" --seq-len "$SL" \
  2>&1 | tail -3 | tee -a "$OUT/quantize.log" || exit 1
for algo in ${ALGOS:-gptq awq}; do
  for bits in ${BITS:-4 3}; do
    for sym in ${SYMS:-sym asym}; do
      flag=$([ "$sym" = asym ] && echo --asym || echo "")
      oflag=$([ "$sym" = asym ] && echo --asym || echo --sym)
      log "llm-compressor $algo w$bits $sym"
      PYTHONPATH=$PEER timeout 240 python3 benchmarks/peer_llmcompressor.py quantize --algo "$algo" --bits "$bits" \
        --group-size 64 $flag --in $P 2>&1 | grep -v "it/s\]" | tail -4 | tee -a "$OUT/quantize.log"
      log "optllm $algo w$bits $sym"
      PYTHONPATH=$OURS timeout 240 python3 -m optllm quantize smollm2-135m --scheme "w${bits}a16-$algo" \
        --group-size 64 $oflag --num-samples "$NS" --seq-len "$SL" --device cuda --no-compare --overwrite \
        --out "$P/optllm-$algo-w$bits-g64-$sym" 2>&1 | tail -4 | tee -a "$OUT/quantize.log"
    done
  done
  # RTN of each bits / symmetry, the reference every gap is measured against
  if [ "$algo" = gptq ]; then
    for bits in ${BITS:-4 3}; do
      for sym in ${SYMS:-sym asym}; do
        oflag=$([ "$sym" = asym ] && echo --asym || echo --sym)
        PYTHONPATH=$OURS timeout 120 python3 -m optllm quantize smollm2-135m --scheme "w${bits}a16-rtn" \
          --group-size 64 $oflag --device cuda --no-compare --overwrite --out "$P/optllm-rtn-w$bits-g64-$sym" \
          2>&1 | tail -2 | tee -a "$OUT/quantize.log"
      done
    done
  fi
done
PYTHONPATH=$OURS timeout 300 python3 benchmarks/peer_llmcompressor.py eval --dirs $P/float $P/optllm-* $P/llmc-* \
  ${KINDS:+--kinds $KINDS} --max-windows "$WINDOWS" --json "$OUT/peer_eval.json" 2>&1 | grep -v "Loading weights" \
  | tee "$OUT/peer_eval.log"
