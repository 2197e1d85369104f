"""Which checkpoints vLLM loads: weight-only integer (pack-quantized), FP8 (float-quantized) and
INT8 W8A8 (int-quantized).

What vLLM's source says (read for this file; paths under
vllm/model_executor/layers/quantization/):
- compressed_tensors/compressed_tensors.py, `_is_wNa16_group_channel`: a `pack-quantized`
  weight-only scheme (strategy group or channel, static, no input quantization) goes to
  CompressedTensorsWNA16. Current releases admit asymmetric weights there; older ones also
  required `symmetric`.
- compressed_tensors/schemes/compressed_tensors_wNa16.py: WNA16_SUPPORTED_TYPES_MAP =
  {4: uint4b8, 8: uint8b128}; with zero points WNA16_ZP_SUPPORTED_TYPES_MAP = {4: uint4,
  8: uint8}; the kernel is then picked per GPU (choose_mp_linear_kernel).
- utils/marlin_utils.py (Marlin, the kernel that runs on every supported CUDA GPU):
  MARLIN_SUPPORTED_GROUP_SIZES = [-1, 32, 64, 128]; query_marlin_supported_quant_types
  gives uint4b8 and uint8b128 without zero points, only uint4 with them.
- utils/machete_utils.py (Machete, Hopper only): group sizes -1, 64, 128; zero points for
  uint4 and uint8.
So a checkpoint loads on every GPU when it has 4 or 8 bits, group size 32, 64, 128 or
per-channel, and zero points only at 4 bits (8-bit asymmetric loads only on Hopper, through
Machete, and fails elsewhere). A recent vLLM main branch lists 2-8 bits in
WNA16_SUPPORTED_TYPES_MAP for newer kernels; released versions take 4 and 8, and that is the
rule here. Shape rules (Marlin: a shard's output features % 64, input features % 128) depend
on the model and the tensor-parallel degree, not on these arguments, so they are not judged.

FP8 (``float-quantized``), from compressed_tensors/compressed_tensors.py: the format is an
activation-quantization format (`is_activation_quantization_format`), and `_is_fp8_w8a8`
takes float weights that are symmetric, static and per-tensor or per-channel (recent
releases also per-block), with float input activations that are either dynamic (any
strategy: per token here) or static, symmetric and per-tensor. Such a layer is
CompressedTensorsW8A8Fp8 (schemes/compressed_tensors_w8a8_fp8.py: weight float8_e4m3fn,
weight_scale, input_scale for static inputs; fused QKV / gate-up shards with static inputs
share the largest input_scale) on GPUs of compute capability 8.9 and up (Ada, Hopper); on
older ones (8.0+) vLLM falls back to CompressedTensorsW8A16Fp8 (FP8 Marlin, weight-only:
the input scales are ignored), so the checkpoint still loads.

INT8 W8A8 (``int-quantized``), from compressed_tensors/compressed_tensors.py: `_is_static_tensor_w8a8`
takes 8-bit int weights, static, symmetric, per channel or per tensor, with 8-bit int input
activations static per tensor (symmetric or not); `_is_dynamic_token_w8a8` the same weights
with inputs dynamic per token. Either is CompressedTensorsW8A8Int8
(schemes/compressed_tensors_w8a8_int8.py: weight int8, weight_scale, input_scale for static
inputs, fused shards with static inputs sharing the largest one), on GPUs of compute
capability 7.5 and up (Turing onwards: CUTLASS int8 GEMM).
"""

from __future__ import annotations

from .args import QuantArgs

VLLM_BITS = (4, 8)
VLLM_ZERO_POINT_BITS = (4,)
VLLM_GROUP_SIZES = (32, 64, 128)  # or None: per-channel


def vllm_fp8_incompatibility(weights: QuantArgs, input_activations: QuantArgs | None) -> str | None:
    """None when vLLM loads an FP8 W8A8 checkpoint with these arguments, else why not."""
    if weights.type != "float" or weights.num_bits != 8:
        return f"vLLM's FP8 path takes 8-bit float weights, not {weights.type} {weights.num_bits}-bit ones."
    if weights.strategy not in ("tensor", "channel") or weights.dynamic or not weights.symmetric:
        return "vLLM takes static symmetric FP8 weights per tensor or per channel."
    if input_activations is None or input_activations.dynamic:
        return None
    if input_activations.strategy != "tensor" or not input_activations.symmetric:
        return "vLLM takes static FP8 input activations only per tensor and symmetric."
    return None


def vllm_int8_incompatibility(weights: QuantArgs, input_activations: QuantArgs | None) -> str | None:
    """None when vLLM loads an INT8 W8A8 checkpoint with these arguments, else why not."""
    if weights.type != "int" or weights.num_bits != 8:
        return f"vLLM's INT8 W8A8 path takes 8-bit int weights, not {weights.type} {weights.num_bits}-bit ones."
    if weights.strategy not in ("tensor", "channel") or weights.dynamic or not weights.symmetric:
        return "vLLM takes static symmetric INT8 weights per tensor or per channel."
    if input_activations is None or input_activations.type != "int" or input_activations.num_bits != 8:
        return "vLLM's INT8 W8A8 path takes 8-bit int input activations."
    if input_activations.dynamic:  # symmetric or with zero points (its azp kernels)
        return None if input_activations.strategy == "token" else \
            "vLLM takes dynamic INT8 input activations only per token."
    if not input_activations.symmetric:
        return "optllm writes static INT8 input activations only symmetric."
    if input_activations.strategy != "tensor":
        return "vLLM takes static INT8 input activations only per tensor."
    return None


def vllm_incompatibility(args: QuantArgs) -> str | None:
    """None when vLLM loads a checkpoint quantized with ARGS, else one sentence saying why not."""
    if args.num_bits not in VLLM_BITS:
        return f"vLLM loads 4- and 8-bit integer weights, not {args.num_bits}-bit ones."
    if args.group_size is not None and args.group_size not in VLLM_GROUP_SIZES:
        return f"vLLM takes group sizes 32, 64, 128 or per-channel, not {args.group_size}."
    if not args.symmetric and args.num_bits not in VLLM_ZERO_POINT_BITS:
        return (f"vLLM takes zero points (--asym) with {args.num_bits}-bit weights only on Hopper GPUs "
                f"(elsewhere only with 4-bit ones); use symmetric {args.num_bits}-bit.")
    return None
