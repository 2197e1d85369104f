"""How a linear layer stores and applies its weight, by checkpoint scheme.

* DenseMethod: a float weight [N, K] (HF folders, unquantized modules of a checkpoint);
  one-row CUDA calls on the shapes kernels/gemv.py was tuned for run its GEMV, the rest cuBLAS.
* W4A16Method: compressed-tensors int4 (4-bit, group size a multiple of 32 or per
  channel): loads the codes, scales and zero points of each shard, then repacks them once
  into the W4A16 kernels' layout (kernels/w4a16.py) and runs the Triton kernels; with the
  torch backend (CPU) it multiplies by the dequantized weight, the kernels' reference.
* DequantMethod: any other integer checkpoint (3 or 8 bits, other group sizes), or every
  quantized weight when the engine is asked to (quantized_linear="dequant"): dequantized
  once at load, exactly as compressed-tensors / vLLM dequantize ((q - zero) * scale in the
  scale's dtype), then dense.
* FP8Method: compressed-tensors float-quantized W8A8 (E4M3 weights with a per-channel or
  per-tensor scale; input activations per token at run time, or static per tensor): on
  CUDA the FP8 GEMM and its activation quantizer (kernels/fp8.py); with the torch backend
  (CPU) their reference: the activations quantized and dequantized exactly as the kernel's
  quantizer does, times the dequantized weight, in float32. Activation quantization is part
  of the scheme, so "dequant" mode runs FP8 checkpoints this way too (the reference, on any device).
* W8A8Int8Method: compressed-tensors int-quantized W8A8 (int8 weights with a per-channel
  scale; int8 input activations per token at run time, or static per tensor): on CUDA the
  INT8 GEMM with its per-token quantizer (kernels/w8a8_int8.py; static inputs are quantized
  with the checkpoint's input_scale by torch ops, then the same GEMM); with the torch backend
  (CPU) its reference: activations quantized and dequantized exactly as the kernel's quantizer
  does, times w * w_scale formed once in float32 (the GEMM's and vLLM's arithmetic: int32 sums
  scaled in float32); "dequant" mode runs that reference on any device (compressed-tensors'
  decompression, which rounds w * w_scale to the scale's dtype, is a different model).
* NVFP4Method: compressed-tensors nvfp4-pack-quantized (E2M1 weights in groups of 16, E4M3 group
  scales, a float32 global scale; W4A4 with activations quantized per call in groups of 16 under
  a calibrated global scale, or W4A16): on CUDA the NVFP4 GEMM (kernels/nvfp4.py; W4A4: the
  activations quantized and dequantized first, by torch ops, as Hopper has no FP4 tensor cores);
  with the torch backend (CPU) its reference: W4A16 x @ the weight dequantized once in the
  layer's dtype (compressed-tensors' values), W4A4 kernels/nvfp4_format.py's
  nvfp4_w4a4_linear_ref with the weight decoded once. "dequant" mode runs the reference too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...formats.args import QuantArgs
from ...formats.compressed_tensors import matches
from ...formats.grid import dequantize
from ...formats.int_quantized import quantize_static_int8
from ...kernels import w4a16_mma, w4a16_mma_tile
from ...kernels.fp8 import FP8_DTYPE, FP8Weight, fp8_linear, quantize_fp8_ref
from ...kernels.gemv import linear as dense_linear
from ...kernels.nvfp4 import GROUP as NVFP4_GROUP
from ...kernels.nvfp4 import NVFP4Weight, dequantize_nvfp4, nvfp4_linear, prepack_nvfp4
from ...kernels.nvfp4_format import quantize_nvfp4_activations_ref
from ...kernels.w4a16 import W4A16Weight, dequantize_w4a16, prepack_w4a16, w4a16_linear
from ...kernels.w4a16_configs import N_MAJOR_SHAPES
from ...kernels.w8a8_int8 import (
    W8A8Weight,
    int8_code_sums,
    quantize_per_token_int8_azp_ref,
    quantize_per_token_int8_ref,
    w8a8_int8_azp_linear,
    w8a8_int8_gemm,
    w8a8_int8_linear,
)


class DenseMethod:
    def create_weights(self, layer, device) -> None:
        w = torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype, device=device)
        layer.register_param("weight", w, out_dim=0, in_dim=1)

    def process_after_loading(self, layer) -> None:
        pass

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias)  # the decode GEMV on shapes tuned for it, else cuBLAS

    def describe(self, layer) -> str:
        return "dense"


class _QuantizedMethod:
    """Shared loading of integer codes q [N, K] int8, scales [N, K/G], zeros [N, K/G] int8."""

    def __init__(self, args: QuantArgs, scale_dtype: torch.dtype) -> None:
        self.args, self.scale_dtype = args, scale_dtype

    def group_size(self, layer) -> int:
        return self.args.group_size or layer.in_features

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        g = self.group_size(layer)
        if k % g:
            raise ValueError(f"group size {g} does not divide this rank's in_features {k}")
        layer.register_param("qweight", torch.empty(n, k, dtype=torch.int8, device=device), out_dim=0, in_dim=1)
        layer.register_param("scales", torch.empty(n, k // g, dtype=self.scale_dtype, device=device), 0, 1)
        if not self.args.symmetric:
            layer.register_param("zeros", torch.empty(n, k // g, dtype=torch.int8, device=device), 0, 1)

    def _take_codes(self, layer):
        q, s = layer.qweight.data, layer.scales.data
        z = None if self.args.symmetric else layer.zeros.data
        for name in ("qweight", "scales", "zeros"):
            if hasattr(layer, name):
                delattr(layer, name)
        return q, s, z


class DequantMethod(_QuantizedMethod):
    def process_after_loading(self, layer) -> None:
        q, s, z = self._take_codes(layer)
        w = dequantize(q, s, z, layer.dtype)
        layer.register_param("weight", w, out_dim=0, in_dim=1)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)

    def describe(self, layer) -> str:
        return f"int{self.args.num_bits} dequantized at load"


class W4A16Method(_QuantizedMethod):
    """backend "triton": the int4 kernels; "torch": x @ dequantize_w4a16(packed)^T (CPU)."""

    def __init__(self, args: QuantArgs, scale_dtype: torch.dtype, backend: str) -> None:
        super().__init__(args, scale_dtype)
        self.backend = backend
        # the kernels' word layout, chosen per shape at load (kernels/w4a16_configs.N_MAJOR_SHAPES),
        # or for every layer by OPTLLM_W4A16_LAYOUT=n|k (to compare the two end to end)
        self.layout = os.environ.get("OPTLLM_W4A16_LAYOUT", "auto")
        if self.layout not in ("auto", "n", "k"):
            raise ValueError(f"OPTLLM_W4A16_LAYOUT={self.layout!r}: allowed 'n' (N-major words), 'k' (K-major) "
                             "or 'auto' (per shape, the default)")
        # decode rows (M <= 16) on the tensor-core GEMV (kernels/w4a16_mma.py) where it builds;
        # OPTLLM_W4A16_MMA=0 keeps every call on the Triton kernels (to compare the two end to end)
        self.mma = os.environ.get("OPTLLM_W4A16_MMA", "1") != "0"
        # rows 17..256 on the tensor-core tiles (kernels/w4a16_mma_tile.py) at the M its table measured them
        # ahead of the Triton path for the shape (auto); OPTLLM_W4A16_TILE=1: every such M, 0: none (to compare)
        self.tile = os.environ.get("OPTLLM_W4A16_TILE", "auto")
        if self.tile not in ("auto", "0", "1"):
            raise ValueError(f"OPTLLM_W4A16_TILE={self.tile!r}: allowed 'auto' (the measured table, the default), "
                             "'1' (every M of 17..256) or '0' (none)")

    def _n_major(self, layer) -> bool:
        if self.layout == "auto":
            return (layer.out_features, layer.in_features) in N_MAJOR_SHAPES
        return self.layout == "n"

    def process_after_loading(self, layer) -> None:
        q, s, z = self._take_codes(layer)
        w = prepack_w4a16(q, s, z, self.group_size(layer), dtype=layer.dtype, n_major=self._n_major(layer))
        layer.packed_n_major = w.n_major  # decided once, here; every call's weight view reads it
        layer.register_buffer("packed", w.packed)
        layer.register_buffer("packed_scales", w.scales)
        layer.register_buffer("packed_zeros", w.zeros)
        layer.register_buffer("locks", w.locks, persistent=False)  # split-K counters, zero between calls
        if self.backend == "torch":  # the kernels' reference: the same dequantized bits, then a matmul
            layer.register_buffer("dense", dequantize_w4a16(w, layer.dtype), persistent=False)
        layer.mma_weight = None
        if self.backend == "triton" and self.mma and w.packed.is_cuda \
                and w4a16_mma.mma_supported(w.N, w.K, w.group_size, w.scales.dtype) and w4a16_mma.available():
            # a second copy of the int4 words in the fragment layout (0.5 byte a weight): M <= 16 reads it
            layer.mma_weight = w4a16_mma.from_w4a16(w)
            w4a16_mma.prepare(layer.mma_weight, getattr(layer, "bias", None) is not None)
        layer.tile_rows = frozenset()  # the M sent to the tiles
        if layer.mma_weight is not None and self.tile != "0":
            layer.tile_rows = frozenset(range(w4a16_mma_tile.RUNTIME_MIN_M, w4a16_mma_tile.TILE_MAX_M + 1)) \
                if self.tile == "1" else w4a16_mma_tile.route_rows(w.N, w.K)
            w4a16_mma_tile.prepare(layer.mma_weight, layer.tile_rows)

    def weight_view(self, layer) -> W4A16Weight:
        return W4A16Weight(layer.packed, layer.packed_scales, layer.packed_zeros, layer.locks,
                           layer.out_features, layer.in_features, self.group_size(layer), layer.packed_n_major)

    def apply(self, layer, x, bias):
        if self.backend == "torch":
            return F.linear(x, layer.dense, bias)
        if layer.mma_weight is not None and (bias is None or bias.dtype == x.dtype):
            if w4a16_mma.fits(x):
                return w4a16_mma.w4a16_mma_linear(x, layer.mma_weight, bias)
            if x.shape[0] in layer.tile_rows and w4a16_mma_tile.fits(x):
                return w4a16_mma_tile.w4a16_mma_tile_linear(x, layer.mma_weight, bias)
        return w4a16_linear(x, self.weight_view(layer), bias, backend="triton")

    def describe(self, layer) -> str:
        return f"w4a16 g{self.group_size(layer)} ({self.backend})"


class FP8Method:
    """float8_e4m3fn weight [N, K] with a float32 scale per row (a per-tensor checkpoint scale
    is given to each row of its module, so fused shards keep their own); static inputs: one
    input scale, the largest of the fused shards' (as vLLM), else per token."""

    def __init__(self, args: QuantArgs, input_activations: QuantArgs | None, scale_dtype: torch.dtype,
                 backend: str, dequant: bool = False) -> None:
        self.args, self.scale_dtype = args, scale_dtype
        self.backend = "torch" if dequant else backend
        self.static = input_activations is not None and not input_activations.dynamic

    @staticmethod
    def takes(args: QuantArgs) -> bool:
        return args.type == "float" and args.num_bits == 8

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        layer.register_param("qweight", torch.empty(n, k, dtype=FP8_DTYPE, device=device), out_dim=0, in_dim=1)
        # one scale per row: a row-parallel shard keeps all of them (in_dim None)
        layer.register_param("scales", torch.empty(n, 1, dtype=self.scale_dtype, device=device), 0, None)
        if self.static:
            layer.register_param("input_scale", torch.empty(n, dtype=torch.float32, device=device), 0, None)

    def process_after_loading(self, layer) -> None:
        w, s = layer.qweight.data, layer.scales.data.float().reshape(-1)
        xs = layer.input_scale.data.max().reshape(1).float() if self.static else None
        for name in ("qweight", "scales", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_buffer("fp8_weight", w.contiguous())
        layer.register_buffer("fp8_scale", s.contiguous())
        layer.register_buffer("fp8_input_scale", xs)
        if self.backend == "torch":  # the kernels' reference weight: w * w_scale in float32, made once
            layer.register_buffer("dense", w.float() * s.reshape(-1, 1), persistent=False)

    def apply(self, layer, x, bias):
        xs = layer.fp8_input_scale
        if self.backend == "torch":  # = kernels.fp8.fp8_linear_ref, with the weight dequantized once
            k = layer.in_features
            xq, x_scale = quantize_fp8_ref(x.reshape(-1, k), xs)
            y = (xq.float() * x_scale.reshape(-1, 1)) @ layer.dense.t()
            if bias is not None:
                y = y + bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], layer.out_features)
        return fp8_linear(x, FP8Weight(layer.fp8_weight, layer.fp8_scale), xs, bias, backend="triton")

    def describe(self, layer) -> str:
        acts = "static per-tensor" if self.static else "dynamic per-token"
        return f"fp8 w8a8 ({self.args.strategy} weights, {acts} activations, {self.backend})"


class W8A8Int8Method:
    """int8 weight [N, K] with a float32 scale per row; static inputs: one input scale, the
    largest of the fused shards' (as vLLM), else per token. dequant (and the CPU): the torch
    reference of the INT8 GEMM, the weight formed once as int8 code x scale in float32: the
    kernel's (and vLLM's) arithmetic. Not compressed-tensors' decompression, which rounds that
    product to the scale's dtype: a different model (on SmolLM2 W8A8 its perplexity differed by
    up to 0.6% per text kind, docs/BENCHMARKS.md), so not a reference of the kernel."""

    def __init__(self, args: QuantArgs, input_activations: QuantArgs | None, scale_dtype: torch.dtype,
                 backend: str, dequant: bool = False) -> None:
        self.args, self.scale_dtype, self.dequant = args, scale_dtype, dequant
        self.backend = "torch" if dequant else backend
        self.static = input_activations is not None and not input_activations.dynamic
        # dynamic per-token inputs with a zero point (w8a8-int8-asym)
        self.azp = input_activations is not None and not input_activations.symmetric

    @staticmethod
    def takes(args: QuantArgs, input_activations: QuantArgs | None) -> bool:
        if not (args.type == "int" and args.num_bits == 8 and args.symmetric and args.strategy in ("channel", "tensor")
                and input_activations is not None and input_activations.type == "int"
                and input_activations.num_bits == 8):
            return False
        how = (input_activations.strategy, input_activations.dynamic)
        return how in (("token", True), ("tensor", False)) if input_activations.symmetric else how == ("token", True)

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        layer.register_param("qweight", torch.empty(n, k, dtype=torch.int8, device=device), out_dim=0, in_dim=1)
        # one scale per row: a row-parallel shard keeps all of them (in_dim None)
        layer.register_param("scales", torch.empty(n, 1, dtype=self.scale_dtype, device=device), 0, None)
        if self.static:
            layer.register_param("input_scale", torch.empty(n, dtype=torch.float32, device=device), 0, None)

    def process_after_loading(self, layer) -> None:
        w, s = layer.qweight.data, layer.scales.data
        xs = layer.input_scale.data.max().reshape(1).float() if self.static else None
        for name in ("qweight", "scales", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer.register_buffer("int8_weight", w.contiguous())
        layer.register_buffer("int8_scale", s.float().reshape(-1).contiguous())
        layer.register_buffer("int8_input_scale", xs)
        if self.backend == "torch":  # the kernels' reference weight, made once
            layer.register_buffer("dense", w.float() * s.float().reshape(-1, 1), persistent=False)
        elif self.azp:
            layer.register_buffer("int8_code_sums", int8_code_sums(W8A8Weight(layer.int8_weight, layer.int8_scale)),
                                  persistent=False)

    def apply(self, layer, x, bias):
        k, n = layer.in_features, layer.out_features
        xs = layer.int8_input_scale
        x2 = x.reshape(-1, k)
        if self.backend == "torch":  # = kernels.w8a8_int8's references, with the weight dequantized once
            if self.azp:  # w8a8_int8_azp_linear_ref
                xq, x_scale, azp = quantize_per_token_int8_azp_ref(x2)
                xd = (xq.float() - azp) * x_scale
            elif xs is None:  # w8a8_int8_linear_ref
                xq, x_scale = quantize_per_token_int8_ref(x2)
                xd = xq.float() * x_scale
            else:
                xd = quantize_static_int8(x2, xs).float() * xs
            y = xd @ layer.dense.t()
            if bias is not None:
                y = y + bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], n)
        if self.azp:
            return w8a8_int8_azp_linear(x, W8A8Weight(layer.int8_weight, layer.int8_scale), layer.int8_code_sums,
                                        bias, backend="triton")
        if xs is None:
            return w8a8_int8_linear(x, W8A8Weight(layer.int8_weight, layer.int8_scale), bias, backend="triton")
        xq = quantize_static_int8(x2, xs)
        y = w8a8_int8_gemm(xq, xs.expand(xq.shape[0], 1).contiguous(), layer.int8_weight, layer.int8_scale, bias,
                           out_dtype=x.dtype, backend="triton")
        return y.reshape(*x.shape[:-1], n)

    def describe(self, layer) -> str:
        acts = "static per-tensor" if self.static else (
            "dynamic per-token asymmetric" if self.azp else "dynamic per-token")
        how = "dequantized weights, torch" if self.dequant else self.backend
        return f"int8 w8a8 ({self.args.strategy} weights, {acts} activations, {how})"


class NVFP4Method:
    """NVFP4 weight: packed E2M1 codes uint8 [N, K/2], E4M3 scales [N, K/16] and a float32 global
    scale per row (each row gets its module's), run in runs of rows of one global scale: one run
    when fused shards share it, as ours and llm-compressor's checkpoints do (vLLM needs that). W4A4:
    one input global scale, the smallest of the fused shards' (the largest calibrated absmax, so
    nothing saturates; shards of one input agree)."""

    def __init__(self, args: QuantArgs, input_activations: QuantArgs | None, backend: str,
                 dequant: bool = False) -> None:
        self.args, self.w4a4 = args, input_activations is not None
        self.backend = "torch" if dequant else backend
        self.runs: list[tuple[int, int]] = []  # [start, end) rows of one global scale

    @staticmethod
    def takes(args: QuantArgs) -> bool:
        return (args.type, args.num_bits, args.strategy, args.group_size) == ("float", 4, "tensor_group", NVFP4_GROUP)

    def create_weights(self, layer, device) -> None:
        n, k = layer.out_features, layer.in_features
        if k % NVFP4_GROUP:
            raise ValueError(f"NVFP4 groups of {NVFP4_GROUP} do not divide this rank's in_features {k}")
        layer.register_param("qweight", torch.empty(n, k // 2, dtype=torch.uint8, device=device), 0, 1)
        layer.register_param("scales", torch.empty(n, k // NVFP4_GROUP, dtype=torch.float8_e4m3fn, device=device),
                             0, 1)
        layer.register_param("global_scale", torch.empty(n, dtype=torch.float32, device=device), 0, None)
        if self.w4a4:
            layer.register_param("input_global_scale", torch.empty(n, dtype=torch.float32, device=device), 0, None)

    def process_after_loading(self, layer) -> None:
        packed, scales, g = layer.qweight.data, layer.scales.data, layer.global_scale.data
        gx = layer.input_global_scale.data.min().reshape(1) if self.w4a4 else None
        for name in ("qweight", "scales", "global_scale", "input_global_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        edges = [0, *(torch.nonzero(g[1:] != g[:-1]).flatten() + 1).tolist(), g.numel()]
        self.runs = list(zip(edges[:-1], edges[1:]))
        layer.register_buffer("nvfp4_input_global_scale", gx)
        if self.backend == "torch" and self.w4a4:  # the reference's operands: e2m1 * scale, 1 / (gx * g) per row
            layer.register_buffer("dense", dequantize_nvfp4(packed, scales, g.new_ones(1), torch.float32),
                                  persistent=False)
            layer.register_buffer("nvfp4_out_scale", 1.0 / (gx * g), persistent=False)
        elif self.backend == "torch":  # dequantized once in the layer's dtype: compressed-tensors' values
            dense = [dequantize_nvfp4(packed[a:b], scales[a:b], g[a:a + 1], layer.dtype) for a, b in self.runs]
            layer.register_buffer("dense", torch.cat(dense), persistent=False)
        else:
            for i, (a, b) in enumerate(self.runs):
                w = prepack_nvfp4(packed[a:b], scales[a:b], g[a:a + 1])
                layer.register_buffer(f"nvfp4_packed_t{i}", w.packed_t)
                layer.register_buffer(f"nvfp4_scales_t{i}", w.scales_t)
                layer.register_buffer(f"nvfp4_global_scale{i}", w.global_scale)

    def apply(self, layer, x, bias):
        k, n = layer.in_features, layer.out_features
        x2, gx = x.reshape(-1, k), layer.nvfp4_input_global_scale
        if self.backend == "torch" and not self.w4a4:
            return F.linear(x, layer.dense, bias)
        if self.backend == "torch":  # = kernels.nvfp4_format.nvfp4_w4a4_linear_ref, the weight decoded once
            y = (quantize_nvfp4_activations_ref(x2, gx) @ layer.dense.t()) * layer.nvfp4_out_scale
            if bias is not None:
                y = y + bias.float()
            return y.to(x.dtype).reshape(*x.shape[:-1], n)
        if self.w4a4:  # e2m1 * group scale / global: the activations the FP4 GEMM would see, in x's dtype
            x2 = (quantize_nvfp4_activations_ref(x2, gx) / gx).to(x.dtype)
        one = len(self.runs) == 1
        ys = [nvfp4_linear(x2, NVFP4Weight(getattr(layer, f"nvfp4_packed_t{i}"), getattr(layer, f"nvfp4_scales_t{i}"),
                                           getattr(layer, f"nvfp4_global_scale{i}")), bias if one else None)
              for i in range(len(self.runs))]
        y = ys[0] if one else torch.cat(ys, -1) if bias is None else torch.cat(ys, -1) + bias
        return y.reshape(*x.shape[:-1], n)

    def describe(self, layer) -> str:
        acts = "w4a4, activations per 16 at run time" if self.w4a4 else "w4a16"
        return f"nvfp4 {acts} ({self.backend}{f', {len(self.runs)} global scales' if len(self.runs) > 1 else ''})"


def kernel_takes(args: QuantArgs, in_features: int) -> bool:
    """Whether the W4A16 kernels run this weight (else it is dequantized at load)."""
    g = args.group_size or in_features
    return args.num_bits == 4 and in_features % 8 == 0 and in_features % g == 0 and (g % 32 == 0 or g == in_features)


@dataclass(frozen=True)
class QuantSpec:
    """What a compressed-tensors checkpoint says about its linears: the weight args, the
    modules left unquantized (compressed-tensors ``ignore``), the dtype scales are stored
    in, whether to run int4 on the kernels or dequantize everything at load, the format
    whose codec (formats/codec.py) reads the quantized tensors, and the input activations'
    arguments (None: weight-only)."""

    args: QuantArgs
    ignore: tuple[str, ...]
    scale_dtype: torch.dtype
    mode: str = "kernel"
    format: str = "pack-quantized"
    input_activations: QuantArgs | None = None  # None: weight-only

    def is_quantized(self, hf_name: str) -> bool:
        return not matches(hf_name, self.ignore)


def unserved(weights: QuantArgs, input_activations: QuantArgs | None) -> str | None:
    """None when the runtime runs linears quantized so, else why not (one sentence)."""
    if NVFP4Method.takes(weights):
        return None  # weight-only or with NVFP4 activations: the codec admits nothing else
    if FP8Method.takes(weights):
        return None if input_activations is not None else "FP8 weight-only (W8A16) linears are not served yet"
    if weights.type != "int":
        return f"{weights.type} {weights.num_bits}-bit weights are not served yet"
    if W8A8Int8Method.takes(weights, input_activations):
        return None
    if input_activations is not None:
        return f"quantized input activations ({input_activations.type} {input_activations.num_bits}-bit) " \
               "with integer weights are served only as int8 W8A8 (per-token dynamic inputs, symmetric or " \
               "with zero points, or symmetric per-tensor static ones)"
    return None


def linear_method(quant: QuantSpec | None, hf_names: list[str], in_features: int, backend: str):
    """The method of one (possibly fused) linear made of the HF modules ``hf_names``."""
    if quant is None:
        return DenseMethod()
    flags = {quant.is_quantized(n) for n in hf_names}
    if len(flags) != 1:
        raise ValueError(f"{', '.join(hf_names)} are fused into one linear but only some are quantized")
    if not flags.pop():
        return DenseMethod()
    if NVFP4Method.takes(quant.args):
        return NVFP4Method(quant.args, quant.input_activations, backend, dequant=quant.mode == "dequant")
    if FP8Method.takes(quant.args):
        return FP8Method(quant.args, quant.input_activations, quant.scale_dtype, backend,
                         dequant=quant.mode == "dequant")
    if W8A8Int8Method.takes(quant.args, quant.input_activations):
        return W8A8Int8Method(quant.args, quant.input_activations, quant.scale_dtype, backend,
                              dequant=quant.mode == "dequant")
    if quant.mode == "kernel" and kernel_takes(quant.args, in_features):
        return W4A16Method(quant.args, quant.scale_dtype, backend)
    return DequantMethod(quant.args, quant.scale_dtype)
