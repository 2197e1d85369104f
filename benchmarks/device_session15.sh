#!/usr/bin/env bash
# The fifteenth session's device work, in two calls after staging (.carry1's part in /root/m):
#   PART=spec  (carry .carry2 and .carry-draft): the GPU tests (kernels, speculative runtime), then
#              issue 15's adaptive policy at batches BS (default 1,8,64), temperatures 0 and 1,
#              with the EAGLE draft in .carry-draft/draft*.tgz.part*
#   PART=host  (TESTS: GPU test paths to run first; TUNE_S: tune W4A16 for SmolLM2's shapes for that
#              many seconds and decode with the winners, instead of what follows) issue 13: host cost per eager call (host_cost.py), the GEMM table at SmolLM2's shapes,
#              and a SmolLM2-shaped W4A16 decode step (decode.py --cases smol-w4a16)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
mkdir -p "$OUT/logs"
if [ "${PART:-spec}" = spec ]; then
  source benchmarks/device_stage.sh
  timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/runtime/test_spec_gpu.py \
    > "$OUT/logs/gpu_tests.log" 2>&1
  tail -3 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  mkdir -p /root/d && cat .carry-draft/draft*.tgz.part* | tar xzf - -C /root/d || exit 1
  ls /root/d
  timeout "${SPEC_S:-330}" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/eagle \
    --temperatures "${TEMPS:-0,1}" --batch-sizes "${BS:-1,8,64}" --spec-policy auto --out /root/spec-auto \
    > "$OUT/logs/spec_auto.log" 2>&1
  cp /root/spec-auto/report.md "$OUT/spec_auto.md" 2>/dev/null; cp /root/spec-auto/report.json "$OUT/spec_auto.json" 2>/dev/null
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  grep -h "^|" "$OUT"/spec_auto.md 2>/dev/null | head -60
else
  export PYTHONPATH=$(dirname "$PWD") OPTLLM_COMMIT=${OPTLLM_COMMIT:-?}
  ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
  if [ -n "${TESTS:-}" ]; then  # GPU tests first, e.g. TESTS="tests/kernels/test_w4a16.py ..."
    timeout "${TEST_TIMEOUT:-200}" python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS > "$OUT/logs/gpu_tests.log" 2>&1
    tail -2 "$OUT/logs/gpu_tests.log"; grep -m 20 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
  fi
  if [ -n "${TUNE_S:-}" ]; then  # W4A16 configs for SmolLM2's shapes, then the decode case with them
    timeout $((TUNE_S + 60)) python3 benchmarks/tune_w4a16.py --shapes smol_qkv,smol_o,smol_gate_up,smol_down,smol_lm_head \
      --ms "${TUNE_MS:-1,16}" --budget-s "$TUNE_S" --out "$OUT" > "$OUT/logs/tune.log" 2>&1 || echo "tune exited $?"
    grep -v "^    (" "$OUT/logs/tune.log" | tail -25
    timeout 150 env OPTLLM_W4A16_TABLE="$OUT/w4a16_table.json" python3 benchmarks/decode.py --cases smol-w4a16 \
      --peers none --quick --tag decode_smol_tuned --out "$OUT" > "$OUT/logs/decode_tuned.log" 2>&1 || echo "decode exited $?"
    grep "^|" "$OUT/decode_smol_tuned.md"
    (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
    exit 0
  fi
  timeout 200 python3 benchmarks/host_cost.py --ms "${HOST_MS:-1}" --out "$OUT" > "$OUT/logs/host_cost.log" 2>&1 || echo "host_cost exited $?"
  timeout 200 python3 benchmarks/gemm.py --shapes smol_qkv,smol_o,smol_gate_up,smol_down,smol_lm_head \
    --ms "${GEMM_MS:-1,16,64,256}" --out /root/gemm_smol > "$OUT/logs/gemm_smol.log" 2>&1 || echo "gemm exited $?"
  cp /root/gemm_smol/gemm.json "$OUT/gemm_smol.json"; cp /root/gemm_smol/gemm.md "$OUT/gemm_smol.md"
  timeout 150 python3 benchmarks/decode.py --cases smol-w4a16,smol --peers none --quick --tag decode_smol --out "$OUT" \
    > "$OUT/logs/decode.log" 2>&1 || echo "decode exited $?"
  (cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
  grep "^|" "$OUT/decode_smol.md"
  cat "$OUT/gemm_smol.md"
  cat "$OUT/host_cost.md"
fi
