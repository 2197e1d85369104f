#!/usr/bin/env bash
# The forty-sixth session's kernels call (issues 15 and 13), no model needed. Pass OPTLLM_COMMIT as a literal
# hash (the device's .git is stale).
#   1. GPU tests (TESTS, default the attention kernels' and tree growth's: the extend kernel's key splits, the
#      sorted selection), TESTS_S seconds; MARK (default gpu; "gpu or not gpu": the unmarked tests too, on CUDA);
#   2. (unless NO_EXTEND=1) benchmarks/extend_tiles.py: the verify forward's attention at the rule's tiles by key
#      splits (SPLITS), trees TREES, batches BATCHES;
#   3. (unless NO_PROFILE=1) profile_step.py's speculative step graphs (trees of 20 and 41) on a random SmolLM2
#      and EAGLE-3 draft (the weights do not change a graph's time) with the split rule, then with one split (the forty-fifth
#      session's kernel) if the call has the time;
#   4. TUNE=1: benchmarks/tune_w4a16.py --ms TUNE_MS (256) for TUNE_S (120) seconds on the 8B shapes TUNE_SHAPES
#      (all four).
source benchmarks/device_preamble.sh
no_model_env
export OUT
# shellcheck disable=SC2086
timeout "${TESTS_S:-150}" python3 -m pytest -q -m "${MARK:-gpu}" -p no:cacheprovider ${TESTS:-tests/kernels/test_paged_attention.py \
  tests/kernels/test_tree_attention.py tests/kernels/test_tree_grow.py} > "$OUT/logs/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
[ -n "${NO_EXTEND:-}" ] || timeout "${XS:-100}" python3 benchmarks/extend_tiles.py --trees "${TREES:-20,41,81}" --batches "${BATCHES:-1,8,64}" \
  --splits "${SPLITS:-1,2,4,8,16,32}" --tiles "${XTILES:-64x64w4s2}" --out "$OUT" > "$OUT/logs/extend_tiles.log" 2>&1 \
  || echo "extend_tiles exited $?"
grep -s "^|" "$OUT/logs/extend_tiles.log"
profile() {  # NAME [SPLITS]: the step graphs profiled into $OUT/NAME (SPLITS: every extend call's key splits)
  timeout "$(( $(left) - 10 ))" python3 - "$1" "${2:-}" <<'PY' > "$OUT/logs/$1.log" 2>&1 || echo "profile $1 exited $?"
import os
import runpy
import sys

from optllm.kernels import extend_attention

name, splits = sys.argv[1], sys.argv[2]
if splits:
    extend_attention.extend_num_splits = lambda *a, s=int(splits): s
sys.argv = ["profile_step.py", "--model", "/tmp/rs/target", "--draft", "/tmp/rs/eagle3", "--batches", "1",
            "--spec-trees", "20,41", "--rounds", "3", "--out", f"{os.environ['OUT']}/{name}"]
runpy.run_path("benchmarks/profile_step.py", run_name="__main__")
PY
  python3 benchmarks/profile_summary.py "$OUT/$1/profile_step.json" --name "$1" --kernels _extend_kernel,_combine_kernel
}
if [ -z "${NO_PROFILE:-}" ] && [ "$(left)" -gt 120 ]; then
  python3 benchmarks/random_smol.py /tmp/rs --method eagle3 > "$OUT/logs/random_smol.log" 2>&1 || echo "random_smol exited $?"
  profile spec_profile_split
  [ "$(left)" -gt 90 ] && profile spec_profile_one 1
fi
if [ -n "${TUNE:-}" ] && [ "$(left)" -gt 60 ]; then
  ts=$(( $(left) - 45 < ${TUNE_S:-120} ? $(left) - 45 : ${TUNE_S:-120} ))
  timeout "$(( ts + 40 ))" python3 benchmarks/tune_w4a16.py --ms "${TUNE_MS:-256}" --shapes "${TUNE_SHAPES:-qkv,o,gate_up,down}" \
    --budget-s "$ts" --out "$OUT" \
    > "$OUT/logs/tune.log" 2>&1 || echo "tune_w4a16 exited $?"
  grep " M=[0-9]*: \|^    ([0-9]" "$OUT/logs/tune.log"
fi
