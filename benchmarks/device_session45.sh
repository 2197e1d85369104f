#!/usr/bin/env bash
# The forty-fifth session's second device call (issue 15): the extend-attention tiles at token-tree sizes, no
# model staged. Pass OPTLLM_COMMIT as a literal hash (the device's .git is stale).
#   1. the attention kernels' GPU tests (the new tree-verify sizes among them);
#   2. benchmarks/extend_tiles.py: the verify forward's attention by tile config, trees 5..81, batches 1/8/64;
#   3. profile_step.py's speculative step graphs (trees of 20 and 41) on a random SmolLM2 and EAGLE-3 draft
#      (the weights do not change a graph's time), with the new rule, then with the old one (BIG_TILE_ROWS 0:
#      every run of more than 64 rows on 128-row tiles) if the call has the time.
source benchmarks/device_preamble.sh
no_model_env
export OUT
timeout "${TESTS_S:-100}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_paged_attention.py \
  tests/kernels/test_tree_attention.py > "$OUT/logs/gpu_tests.log" 2>&1
echo "gpu tests: $(tail -1 "$OUT/logs/gpu_tests.log")"; grep -m 10 "^FAILED\|^ERROR" "$OUT/logs/gpu_tests.log"
timeout "${XS:-110}" python3 benchmarks/extend_tiles.py --trees "${TREES:-5,20,25,41,81}" --batches "${BATCHES:-1,8,64}" \
  --tiles "${XTILES:-128x128w8s3,64x64w4s2,64x64w4s3,32x64w4s2,64x32w4s2}" --out "$OUT" > "$OUT/logs/extend_tiles.log" 2>&1 \
  || echo "extend_tiles exited $?"
grep "^|" "$OUT/logs/extend_tiles.log"
[ "$(left)" -gt 70 ] || exit 0
python3 benchmarks/random_smol.py /tmp/rs --method eagle3 > "$OUT/logs/random_smol.log" 2>&1 || echo "random_smol exited $?"
profile() {  # NAME [BIG_TILE_ROWS]: the step graphs profiled into $OUT/NAME
  timeout "$(( $(left) - 10 ))" python3 - "$1" "${2:-}" <<'PY' > "$OUT/logs/$1.log" 2>&1 || echo "profile $1 exited $?"
import os
import runpy
import sys

from optllm.kernels import extend_attention

name, rows = sys.argv[1], sys.argv[2]
if rows:
    extend_attention.BIG_TILE_ROWS = int(rows)
sys.argv = ["profile_step.py", "--model", "/tmp/rs/target", "--draft", "/tmp/rs/eagle3", "--batches", "1",
            "--spec-trees", "20,41", "--rounds", "3", "--out", f"{os.environ['OUT']}/{name}"]
runpy.run_path("benchmarks/profile_step.py", run_name="__main__")
PY
  python3 benchmarks/profile_summary.py "$OUT/$1/profile_step.json" --name "$1" --kernels _extend_kernel
}
profile spec_profile_new
[ "$(left)" -gt 100 ] && profile spec_profile_old 0
