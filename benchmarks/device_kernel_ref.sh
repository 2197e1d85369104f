#!/usr/bin/env bash
# Issue 14 part 8 on one H200: for each activation-quantized scheme (SCHEMES), a 16 x 512
# SmolLM2 checkpoint's perplexity on every window of each text kind through its kernels, beside
# its torch reference and beside the reference with the embedding perturbed by 1e-6
# (benchmarks/ref_noise_floor.py: the noise activation rounding alone makes), float32; each
# scheme's linears kernel vs reference on the same inputs (kernel_vs_ref_layers.py); the FP8 GPU
# tests; FP8 GEMM speed with promoted (default) and fast accumulation beside torch._scaled_mm.
# Before: .carry1's part in /root/m; carry .carry2. Results: $OUT/summary.md (appended as each
# part ends: a call cut short still returns what finished), $OUT/all.tgz (the logs).
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs"
for scheme in ${SCHEMES:-w8a8-int8 fp8-dynamic nvfp4}; do
  timeout 90 python3 -m optllm quantize smollm2-135m --scheme "$scheme" --num-samples 16 --seq-len 512 \
    --device cuda --no-compare --overwrite --out "/root/$scheme" > "$OUT/logs/${scheme}_quantize.log" 2>&1 || continue
  timeout "${FLOOR_S:-150}" python3 benchmarks/ref_noise_floor.py "/root/$scheme" --device cuda \
    --json "$OUT/logs/floor_$scheme.json" > "$OUT/logs/floor_$scheme.log" 2>&1
  grep -h "^|\|window(s)" "$OUT/logs/floor_$scheme.log" >> "$OUT/summary.md"
  if [[ " ${LAYERS:-fp8-dynamic} " == *" $scheme "* ]]; then
    timeout 90 python3 benchmarks/kernel_vs_ref_layers.py "/root/$scheme" --device cuda --dtype float32 --top 6 \
      > "$OUT/logs/layers_$scheme.txt" 2>&1
    grep -h "^| model\|^end to end\|median rel" "$OUT/logs/layers_$scheme.txt" >> "$OUT/summary.md"
  fi
done
timeout 120 python3 -m pytest -q -m gpu tests/kernels/test_fp8.py -p no:cacheprovider > "$OUT/logs/gpu_tests_fp8.log" 2>&1
echo "pytest -m gpu tests/kernels/test_fp8.py: rc $?" >> "$OUT/logs/gpu_tests_fp8.log"
tail -2 "$OUT/logs/gpu_tests_fp8.log" >> "$OUT/summary.md"
G="python3 benchmarks/gemm.py --ms ${GEMM_MS:-256,4096} --ops cublas_bf16,ours_fp8,ours_fp8_gemm,torch_scaled_mm --no-eager"
mkdir -p /root/g0 /root/g1
timeout 120 $G --out /root/g0 > "$OUT/logs/gemm_fp8_promoted.log" 2>&1
echo "FP8 promoted (default):" >> "$OUT/summary.md"; grep -h "^| [a-z_]* [0-9]" /root/g0/gemm.md >> "$OUT/summary.md"
OPTLLM_FP8_FAST_ACCUM=1 timeout 120 $G --out /root/g1 > "$OUT/logs/gemm_fp8_fast.log" 2>&1
echo "FP8 fast accumulation:" >> "$OUT/summary.md"; grep -h "^| [a-z_]* [0-9]" /root/g1/gemm.md | head -8 >> "$OUT/summary.md"
cp /root/g0/gemm.json "$OUT/logs/gemm_promoted.json"; cp /root/g1/gemm.json "$OUT/logs/gemm_fast.json"
(cd "$OUT" && tar czf all.tgz logs && rm -rf logs)
cat "$OUT/summary.md"
