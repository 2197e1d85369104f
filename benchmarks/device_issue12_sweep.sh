#!/usr/bin/env bash
# One device call, four jobs side by side on one H200 (the GPU and 16 cores have room):
#  A, B: issue 12's variants at the default calibration (128 x 512), W4 g64 asymmetric (the new
#        default), each with RTN of the same grid, perplexity on every window of each text
#        kind (WINDOWS: at most that many; benchmarks/quality.py on the GPU, float32);
#        A: AWQ's scale-search sample and grid, B: GPTQ's Hessian shrink, token cap and damping;
#  C:    pytest -m gpu (the kernels and CUDA paths);
#  D:    issue 15's training-step diagnosis: a small self-generated dataset, then
#        benchmarks/train_step.py on its real micro-batches against one synthetic batch.
# Before: the GGUF staged (.carry1's part in /root/m); carry .carry2. Results: $OUT/*.
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs"
Q="python3 benchmarks/quality.py --device cuda --bits 4 --symmetry asym --group-size 64 ${WINDOWS:+--max-windows $WINDOWS}"
( timeout ${SWEEP_S:-420} $Q --out /root/sweep/awq --algos rtn,awq \
    --variant "awq-alltok:awq:awq={scale_tokens: null}" --variant "awq-8k:awq:awq={scale_tokens: 8192}" \
    --variant "awq-grid40:awq:awq={n_grid: 40}" > "$OUT/logs/sweep_awq.log" 2>&1;
  cp /root/sweep/awq/quality.md "$OUT/sweep_awq.md"; cp /root/sweep/awq/quality.json "$OUT/sweep_awq.json" ) &
( timeout ${SWEEP_S:-420} $Q --out /root/sweep/gptq --algos rtn,gptq \
    --variant "gptq-shrink5:gptq:hessian_shrink=0.5" --variant "gptq-cap4:gptq:token_cap=4" \
    --variant "gptq-damp1:gptq:dampening=0.1" > "$OUT/logs/sweep_gptq.log" 2>&1;
  cp /root/sweep/gptq/quality.md "$OUT/sweep_gptq.md"; cp /root/sweep/gptq/quality.json "$OUT/sweep_gptq.json" ) &
( timeout ${TEST_S:-420} python3 -m pytest -q -m gpu tests -x -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1;
  echo "pytest -m gpu: rc $?" >> "$OUT/gpu_tests.log" ) &
( timeout 300 python3 -m optllm train-draft smollm2-135m --method eagle --out /root/d/small --device cuda \
    --num-prompts 256 --max-steps 12 --batch-size 16 --overwrite > "$OUT/logs/train_small.log" 2>&1;
  timeout 120 python3 benchmarks/train_step.py --methods eagle --steps 12 --dataset /root/d/small/dataset.jsonl \
    > "$OUT/train_step.txt" 2>&1;
  timeout 60 python3 benchmarks/train_step.py --methods eagle --steps 5 >> "$OUT/train_step.txt" 2>&1 ) &
wait
grep -h "ms a step\|per step ms\|ms/step" "$OUT/logs/train_small.log" "$OUT/train_step.txt"
tail -3 "$OUT/gpu_tests.log"
cat "$OUT"/sweep_*.md
