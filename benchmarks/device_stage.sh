# Sourced by the device scripts that need the real SmolLM2 (device_spec.sh, device_report.sh): the
# staged GGUF assembled (.carry1's part copied to /root/m in an earlier call, .carry2's part here),
# checked, the carried wheels installed to /tmp/site, the environment set, `optllm` importable.
mkdir -p /root/cache/gguf
f=/root/cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
[ -f "$f" ] || cat /root/m/*.part* .carry2/*.part* > "$f"  # the parts in order: part00 (, part01) staged, the last carried
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $f" | sha256sum -c - || exit 1
python3 -m pip install -q --no-index --no-deps --target /tmp/site $(ls .carry2/whl/*.whl .whl/*.whl .whl-ct/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$(dirname "$PWD") OPTLLM_CACHE=/root/cache PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 OPTLLM_COMMIT=${OPTLLM_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo "?")}
ln -sfn "$PWD" "$(dirname "$PWD")/optllm"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name())" | tee "$OUT/versions.txt"
