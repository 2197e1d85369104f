#!/usr/bin/env bash
# One device call, H200, jobs side by side (a 135M model leaves the GPU and the 16 cores room):
#  A, B: issue 12's AWQ variants at the default calibration (128 x 512), W4 g64, asymmetric (A) and
#        symmetric (B), each beside RTN of the same grid and plain AWQ: perplexity on every window
#        of each text kind (WINDOWS: at most that many; benchmarks/quality.py, float32).
#        VARIANTS: extra --variant arguments.
#  C:    (TRAIN_S > 0) issue 15's EAGLE draft, trained longer on the float target's own prompts and
#        answers (PROMPTS of them, a TRAIN_S time limit, data generation included) into /root/d/eagle,
#        with padded lengths in buckets of 64 and the step time planned on the probe's median.
# Then (SPEC=1, after A-C, the GPU to itself): the speculative-decoding section of `optllm eval`
# with that draft, greedy, the adaptive policy at batches BS and the fixed one at batch 1.
# The machine is given back 30 s after a call ends: everything that needs the draft is in this call,
# or (DRAFT_OUT=1) the draft comes back as $OUT/draft.tgz.part* (15 MiB pieces) for a later call to
# carry (device_spec_profile.sh). SYMS="" (or GRIDS="") skips the sweeps; GRIDS="4:asym 3:sym ..." picks
# bits and symmetry per job; ALGOS and VARIANTS make them sweeps of any algorithm (GPTQ's grid, say).
# Before: the GGUF staged (.carry1's part in /root/m); carry .carry2. Results: $OUT/* (logs in
# logs.tgz: only a few files come back).
set -uo pipefail
source benchmarks/device_stage.sh
mkdir -p "$OUT/logs"
spec() {  # spec POLICY BATCHES SECONDS
  timeout "$3" python3 -m optllm eval smollm2-135m --device cuda --no-ppl --draft /root/d/eagle \
    --temperatures 0 --batch-sizes "$2" --spec-policy "$1" --out "/root/spec-$1" > "$OUT/logs/spec_$1.log" 2>&1
  cp "/root/spec-$1/report.md" "$OUT/spec_$1.md" 2>/dev/null
}
BITS=${BITS:-4}
Q="python3 benchmarks/quality.py --device cuda --group-size 64 ${WINDOWS:+--max-windows $WINDOWS}"
ALGOS=${ALGOS-rtn,awq}  # "": the variants only
V=(--variant "awq-cs3:awq:awq={clip_shrink: 0.3}" --variant "awq-cs10:awq:awq={clip_shrink: 1.0}"
   --variant "awq-ss5:awq:awq={scale_shrink: 0.5}" --variant "awq-cs5ss5:awq:awq={clip_shrink: 0.5, scale_shrink: 0.5}")
[ -n "${VARIANTS:-}" ] && eval "V=($VARIANTS)"
# GRIDS: the sweeps as BITS:SYMMETRY pairs, one job each (default: BITS with each of SYMS)
GRIDS=${GRIDS-$(for sym in ${SYMS-asym sym}; do printf '%s:%s ' "$BITS" "$sym"; done)}
for grid in $GRIDS; do
  b=${grid%%:*} sym=${grid#*:}
  ( timeout "${SWEEP_S:-480}" $Q --bits "$b" --symmetry "$sym" --out "/root/sweep/w$b-$sym" --algos "$ALGOS" "${V[@]}" \
      > "$OUT/logs/sweep_w${b}_$sym.log" 2>&1
    cp "/root/sweep/w$b-$sym/quality.md" "$OUT/awq_w${b}_$sym.md"; cp "/root/sweep/w$b-$sym/quality.json" "$OUT/awq_w${b}_$sym.json" ) &
done
if [ -n "${TESTS:-}" ]; then  # GPU tests beside the sweeps (no timing in them): TESTS="tests/kernels ..."
  ( timeout "${TESTS_S:-480}" python3 -m pytest -q -p no:cacheprovider -m gpu $TESTS > "$OUT/gpu_tests.log" 2>&1 ) &
fi
if [ "${TRAIN_S:-0}" -gt 0 ]; then
  ( timeout $(( TRAIN_S + 40 )) python3 -m optllm train-draft smollm2-135m --method eagle --out /root/d/eagle \
      --device cuda --num-prompts "${PROMPTS:-4096}" --max-steps "${STEPS:-20000}" --batch-size 16 \
      --time-limit "$TRAIN_S" --overwrite > "$OUT/logs/train_eagle.log" 2>&1
    cp /root/d/eagle/*.json "$OUT/" 2>/dev/null ) &
fi
wait
if [ "${SPEC:-0}" = 1 ] && [ -f /root/d/eagle/config.json ]; then
  spec auto "${BS:-1,8,64}" "${SPEC_S:-150}"
  spec fixed 1 "${SPEC1_S:-70}"
fi
if [ "${DRAFT_OUT:-0}" = 1 ] && [ -f /root/d/eagle/config.json ]; then
  tar czf /tmp/draft.tgz -C /root/d --exclude 'checkpoint-*' eagle && split -b 15m /tmp/draft.tgz "$OUT/draft.tgz.part"
fi
(cd "$OUT" && tar czf logs.tgz logs && rm -rf logs)
tar xzf "$OUT/logs.tgz" -O logs/train_eagle.log 2>/dev/null | grep -v "^step" | tail -12
tail -3 "$OUT/gpu_tests.log" 2>/dev/null
cat "$OUT"/awq_*.md
grep -h "^|" "$OUT"/spec_*.md 2>/dev/null
