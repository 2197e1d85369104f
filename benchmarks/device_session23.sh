#!/usr/bin/env bash
# The twenty-third session's one device call (no staging: SmolLM2's shapes with random weights and a
# random EAGLE draft, benchmarks/random_smol.py). Carry .carry-old (old.tgz: `git archive` of the
# commit before the host-staged graphs, docs excluded); pass OPTLLM_COMMIT literal.
#   1. the CUDA part of the host staging: a captured upload re-reads the pinned buffer at every replay
#   2. benchmarks/step_wall.py with this tree, then with the old one (same machine, same script): a
#      decode step's wall time, plain and with pinned trees of 5 and 20 nodes, batch 1 and 8, and a
#      prefill step's (32-token prompts: an extend graph here, eager in the old tree)
#   3. GPU tests: graphs equal eager (dense, W4A16; the graph's argmax and the sampler on its logits;
#      prefill graphs bit-equal at an exact bucket, mixed steps' tokens),
#      the speculative engine's (step graphs, sampled graphs, fused steps), the EAGLE-2 growth kernels
#      (-m gpu, then their sm_90 builds unmarked: the n = 128 selection's spill fix)
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 OPTLLM_COMMIT=${OPTLLM_COMMIT:-?}
L=/root/logs  # only 8 files come back: the logs travel as one tar
mkdir -p $L
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
export PYTHONPATH=$(dirname "$PWD")
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
python3 benchmarks/random_smol.py /root/rs > "$L/random_smol.log" 2>&1 || { echo "random_smol failed"; tail -5 "$L/random_smol.log"; }
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_cuda_graphs.py > "$L/gpu_staging.log" 2>&1
echo "staging test: $(tail -1 "$L/gpu_staging.log")"
timeout "${TEST1_S:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_llm_gpu.py::test_cuda_graphs_equal_eager \
  tests/runtime/test_llm_gpu.py::test_prefill_graphs_equal_eager > "$L/gpu_tests_graphs.log" 2>&1
echo "graph tests: $(tail -1 "$L/gpu_tests_graphs.log")"; grep -m 10 "^FAILED\|^ERROR" "$L/gpu_tests_graphs.log"
timeout "${TEST_S:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/runtime/test_spec_gpu.py tests/kernels/test_tree_grow.py \
  > "$L/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$L/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$L/gpu_tests.log"
tar czf "$OUT/logs.tgz" -C /root logs  # (again after each part: a call cut at its limit keeps what was done)
SW="--model /root/rs/target --draft /root/rs/eagle --batches ${BS:-1,8} --trees ${TREES:-5,20} --out $OUT"
timeout "${SW_S:-100}" python3 benchmarks/step_wall.py $SW --tag new > "$L/step_wall_new.log" 2>&1 || echo "step_wall new exited $?"
tar czf "$OUT/logs.tgz" -C /root logs
mkdir -p /tmp/old/optllm && tar xzf .carry-old/old.tgz -C /tmp/old/optllm
PYTHONPATH=/tmp/old timeout "${SW_S:-100}" python3 "$PWD/benchmarks/step_wall.py" $SW --tag old > "$L/step_wall_old.log" 2>&1 || echo "step_wall old exited $?"
tar czf "$OUT/logs.tgz" -C /root logs
for t in new old; do echo "## $t"; cat "$OUT/step_wall_$t.md" 2>/dev/null || tail -5 "$L/step_wall_$t.log"; done
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_tree_grow.py -k "hopper" > "$L/gpu_tests_sm90.log" 2>&1
echo "sm_90 builds: $(tail -1 "$L/gpu_tests_sm90.log")"; grep -m 5 "^FAILED" "$L/gpu_tests_sm90.log"
tar czf "$OUT/logs.tgz" -C /root logs
for t in new old; do echo "## $t"; cat "$OUT/step_wall_$t.md" 2>/dev/null || tail -5 "$L/step_wall_$t.log"; done
