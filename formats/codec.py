"""Checkpoint formats: one codec per compressed-tensors ``format``, registered by its name.

A codec says how the quantized linears of its format are stored: which tensors each linear
gets (``weight_packed``, ``weight_scale``...), how a QuantizedWeight becomes those tensors and
back, which quantization arguments it can hold, and its config group in ``config.json``'s
``quantization_config``. compressed_tensors.py writes and reads folders through the codec the
checkpoint's ``format`` names; quant/ writes with the scheme's format, runtime/ reads with the
checkpoint's. A new format is one module that subclasses FormatCodec and registers itself
(and is named in CODECS' built-ins, so a lookup imports it).
"""

from __future__ import annotations

import torch

from ..registry import Registry
from .args import QuantArgs
from .qweight import QuantizedWeight


class FormatCodec:
    """One compressed-tensors format. Subclasses set ``name`` and ``tensor_names`` and
    implement encode / decode (and check, for the arguments they cannot hold)."""

    name: str = ""
    # the tensors of one quantized linear X, as X.<name>; the first marks X as quantized
    tensor_names: tuple[str, ...] = ()

    def check(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> None:
        """ValueError (one sentence) when this format cannot hold these arguments."""

    def required(self, weights: QuantArgs) -> set[str]:
        """The tensor names decode needs (default: all of them)."""
        return set(self.tensor_names)

    def activation_tensors(self, input_activations: QuantArgs | None) -> set[str]:
        """The tensor names a quantized linear also holds for its input activations (a static
        scale), which decode needs too (default: none)."""
        return set()

    def encode(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """A quantized linear's tensors by tensor name (without the module prefix)."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> QuantizedWeight:
        """Inverse of encode; ValueError when a tensor is missing or malformed."""
        raise NotImplementedError

    def config_group(self, targets: list[str], weights: QuantArgs, input_activations: QuantArgs | None) -> dict:
        """One entry of ``quantization_config.config_groups``."""
        return {
            "targets": targets,
            "weights": weights.to_compressed_tensors(),
            "input_activations": None if input_activations is None else input_activations.to_compressed_tensors(),
            "output_activations": None,
            "format": self.name,
        }

    def vllm_incompatibility(self, weights: QuantArgs, input_activations: QuantArgs | None = None) -> str | None:
        """None when vLLM loads a checkpoint of this format with these arguments, else why not."""
        return f"vLLM has no reader for the {self.name!r} format."


class StaticInputScaleCodec(FormatCodec):
    """A format whose quantized linears also hold one calibrated per-tensor value for their
    input activations unless those are wholly dynamic (``dynamic: true``): float-quantized's
    and int-quantized's ``input_scale``, or nvfp4-pack-quantized's ``input_global_scale`` (the
    ``input_tensor``). The QuantizedWeight carries it as the attribute of that name (None:
    none stored). encode / decode add and check it around the subclass's weight tensors
    (encode_weight / decode_weight), which are every tensor name but ``input_tensor``."""

    input_tensor = "input_scale"

    @staticmethod
    def calibrated(input_activations: QuantArgs | None) -> bool:
        """Whether these input activations store a value: given and not wholly dynamic (static,
        or NVFP4's "local": dynamic group scales under a calibrated global scale)."""
        return input_activations is not None and input_activations.dynamic is not True

    def required(self, weights: QuantArgs) -> set[str]:
        return set(self.tensor_names) - {self.input_tensor}

    def activation_tensors(self, input_activations: QuantArgs | None) -> set[str]:
        return {self.input_tensor} if self.calibrated(input_activations) else set()

    def encode_weight(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        """The weight's tensors by tensor name (everything but the input value)."""
        raise NotImplementedError

    def decode_weight(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> QuantizedWeight:
        """The QuantizedWeight of the weight's tensors (all present); ValueError when malformed."""
        raise NotImplementedError

    def encode(self, qw: QuantizedWeight) -> dict[str, torch.Tensor]:
        parts = self.encode_weight(qw)
        value = getattr(qw, self.input_tensor, None)
        if value is not None:
            parts[self.input_tensor] = value.reshape(1).contiguous()
        return parts

    def decode(self, parts: dict[str, torch.Tensor], weights: QuantArgs) -> QuantizedWeight:
        missing = sorted(self.required(weights) - parts.keys())
        if missing:
            raise ValueError(f"checkpoint lacks {missing[0]}")
        qw = self.decode_weight(parts, weights)
        value = parts.get(self.input_tensor)
        if value is not None and (value.numel() != 1 or not value.is_floating_point()):
            raise ValueError(f"{self.input_tensor} {value.dtype} {tuple(value.shape)} must be one float "
                             "(per tensor)")
        setattr(qw, self.input_tensor, value)
        return qw

    def config_group(self, targets: list[str], weights: QuantArgs, input_activations: QuantArgs | None) -> dict:
        group = super().config_group(targets, weights, input_activations)
        if self.calibrated(input_activations):
            # a running absmax over every calibration batch (what quant/ measures), the observer
            # compressed-tensors' presets name so; readers ignore it
            group["input_activations"]["observer"] = "static_minmax"
        return group


CODECS: Registry[FormatCodec] = Registry("checkpoint format", builtins=("optllm.formats.pack_quantized",
                                                                 "optllm.formats.float_quantized",
                                                                 "optllm.formats.int_quantized",
                                                                 "optllm.formats.nvfp4_quantized"))


def register_codec(codec: FormatCodec, replace: bool = False) -> FormatCodec:
    return CODECS.register(codec.name, codec, replace=replace)


def get_codec(name: str) -> FormatCodec:
    """The codec of format NAME; UserError listing the registered formats otherwise."""
    return CODECS.get(name)


def quantized_tensor_names() -> set[str]:
    """Every tensor name some registered format gives a quantized linear."""
    return {t for codec in CODECS.values() for t in codec.tensor_names}
