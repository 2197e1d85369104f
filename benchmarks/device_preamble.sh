# Sourced first by the device scripts that stage the real SmolLM2 (device_session25.sh,
# device_session26.sh): the environment, left() (seconds of the call's LIMIT, 570, still to go),
# PART=stage (.carry1's part copied to /root/m; the call ends there: the next, carrying .carry2,
# must follow within the machine's warm time), the output folders; no_model_env: `optllm` importable
# and the versions printed (and written to $OUT/versions.txt) for the parts that stage no model (call it
# in this shell, not in a pipe: its exports must stay).
set -uo pipefail
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
T0=$(date +%s)
left() { echo $(( ${LIMIT:-570} - ($(date +%s) - T0) )); }
if [ "${PART:-}" = stage ]; then  # each carried .carry1* folder's parts (the fortieth session splits the GGUF
  # in three: .carry1a and .carry1b in two stage calls, the last part in .carry2: the tree, 16.8 MB, and a 50 MB part were refused)
  mkdir -p /root/m && cp .carry1*/*.part* /root/m/ && ls -la /root/m && nvidia-smi -L
  exit 0
fi
mkdir -p "$OUT/logs" /root/d
no_model_env() {
  export PYTHONPATH=$(dirname "$PWD") OPTLLM_COMMIT=${OPTLLM_COMMIT:-?}
  ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
  python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" \
    | tee "$OUT/versions.txt"
}
