#!/usr/bin/env bash
# One device call for the evaluation issue (16)'s real report, on the H200: SmolLM2-135M as the
# built-in alias (staged as device_quality.sh does: .carry1 in an earlier call, .carry2 here),
# quantized on the GPU to W4 g64 AWQ and GPTQ, W8A8-INT8 (SmoothQuant), FP8 and NVFP4, an EAGLE
# draft trained on the float target's own prompts and answers, then one `optllm eval` over all
# six checkpoints: perplexity per text kind, our two offline lm-eval tasks, speed at batch sizes
# 1, 8, 32, 64 and the draft's speedup, tau and acceptance -- report.md / report.json / PNGs,
# packed into $OUT/report.tgz (commit it under docs/report/ and link it from the README).
# Environment: STEPS / PROMPTS (draft training, default 600 / 512), NS (calibration windows, 128),
# DRAFT=/path skips training (an existing draft folder).
set -uo pipefail
source benchmarks/device_stage.sh
run() { echo "+ $*" | tee -a "$OUT/report.log"; "$@" 2>&1 | grep -v "Loading weights" >> "$OUT/report.log"; }
q="--device cuda --num-samples ${NS:-128} --seq-len 512 --no-compare"
run timeout 200 python3 -m optllm quantize smollm2-135m --scheme w4a16-awq --group-size 64 $q --out /root/q/awq
run timeout 200 python3 -m optllm quantize smollm2-135m --scheme w4a16-gptq --group-size 64 $q --out /root/q/gptq
run timeout 200 python3 -m optllm quantize smollm2-135m --scheme w8a8-int8 $q --out /root/q/w8a8
run timeout 200 python3 -m optllm quantize smollm2-135m --scheme fp8 $q --out /root/q/fp8
run timeout 200 python3 -m optllm quantize smollm2-135m --scheme nvfp4 $q --out /root/q/nvfp4
draft=${DRAFT:-/root/d/eagle}
[ -n "${DRAFT:-}" ] || run timeout 240 python3 -m optllm train-draft smollm2-135m --method eagle --out "$draft" \
  --device cuda --num-prompts "${PROMPTS:-512}" --max-steps "${STEPS:-600}"
models="smollm2-135m /root/q/awq /root/q/gptq /root/q/w8a8 /root/q/fp8 /root/q/nvfp4"
run timeout 540 python3 -m optllm eval $models --device cuda --kernels --tasks ppl,optllm_offline --speed \
  --batch-sizes 1,8,32,64 --draft "$draft" --out /root/report
(cd /root && tar czf "$OUT/report.tgz" report)
tail -5 "$OUT/report.log"; grep "^|" /root/report/report.md
