"""Checkpoint formats: the compressed-tensors codecs that quant/ writes and runtime/ reads."""
