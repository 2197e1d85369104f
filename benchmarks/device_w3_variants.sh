#!/usr/bin/env bash
# Issue 12 work and the GPU tests on one H200, the jobs JOBS names (default "w3 gptq tests"), one after
# another: each of our runtime engines takes most of the GPU's memory (gpu_memory_utilization),
# so engines side by side fail (a first version ran them in parallel: every engine job but one
# died for memory). All three take more than one call's 600 s: pick two per call.
#  A: issue 12's W3 g64 rows at the default calibration (128 x 512), ours and llm-compressor's,
#     sym and asym, perplexity on every window of each text kind (device_peer_quality.sh, GPU eval);
#  B: GPTQ W4 g64 asym variants on every window at 128 x 512 (the Hessian shrink; chat was the
#     kind below 50% of RTN's gap), benchmarks/quality.py on the GPU, float32;
#  C: pytest -m gpu on tests/kernels and tests/runtime.
# (Issue 14 part 8's kernels against their references: device_kernel_ref.sh.)
# Before: .carry1's part in /root/m (an earlier call); carry .carry2 and .whl-llmc.
# Results: $OUT/all.tgz (every log and JSON) and the tables at the end of the output.
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs" "$OUT/w3"
has() { [[ " ${JOBS:-w3 gptq tests} " == *" $1 "* ]]; }
if has w3; then
  OUT=$OUT/w3 INSTALL=0 NS=128 SL=512 BITS=3 P=5 EVAL_DEV=cuda E=1 JOB_S=300 EVAL_S=150 \
    timeout ${PEER_S:-400} bash benchmarks/device_peer_quality.sh > "$OUT/logs/w3_run.log" 2>&1
fi
if has gptq; then
  timeout ${SWEEP_S:-400} python3 benchmarks/quality.py --device cuda --bits 4 --symmetry asym --group-size 64 \
    --out /root/sweep/gptq --algos rtn,gptq --variant "gptq-shrink5:gptq:hessian_shrink=0.5" \
    --variant "gptq-shrink7:gptq:hessian_shrink=0.7" --variant "gptq-shrink0:gptq:hessian_shrink=0.0" \
    > "$OUT/logs/sweep_gptq.log" 2>&1
  cp /root/sweep/gptq/quality.md "$OUT/sweep_gptq.md"; cp /root/sweep/gptq/quality.json "$OUT/sweep_gptq.json"
fi
if has tests; then
  timeout ${TEST_S:-330} python3 -m pytest -q -m gpu tests/kernels tests/runtime -p no:cacheprovider \
    > "$OUT/gpu_tests.log" 2>&1; echo "pytest -m gpu: rc $?" >> "$OUT/gpu_tests.log"
fi
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
cat "$OUT/sweep_gptq.md" 2>/dev/null
grep -A 14 "^| model" "$OUT/logs/w3_run.log" 2>/dev/null
cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -delete && mv /tmp/all.tgz "$OUT/all.tgz"
