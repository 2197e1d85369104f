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


CODECS: Registry[FormatCodec] = Registry("checkpoint format", builtins=("optllm.formats.pack_quantized",
                                                                 "optllm.formats.float_quantized",
                                                                 "optllm.formats.int_quantized"))


def register_codec(codec: FormatCodec, replace: bool = False) -> FormatCodec:
    return CODECS.register(codec.name, codec, replace=replace)


def get_codec(name: str) -> FormatCodec:
    """The codec of format NAME; UserError listing the registered formats otherwise."""
    return CODECS.get(name)


def quantized_tensor_names() -> set[str]:
    """Every tensor name some registered format gives a quantized linear."""
    return {t for codec in CODECS.values() for t in codec.tensor_names}
