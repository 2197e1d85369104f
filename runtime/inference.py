"""``inference``: torch.inference_mode for the step's hot path, free when already inside it.

torch's own ``@torch.inference_mode()`` enters a new context at every call, ~1.2 µs of this CPU's
time even when inference mode is on already; a speculative step nested three such calls
(the runner's execute, the decoder's step, the step graph's run). ``LLM.generate`` enters the
mode once around its loop, and these entry points check it with one C call."""

from __future__ import annotations

import functools

import torch


def inference(fn):
    """Run fn under torch.inference_mode: directly when the mode is on (one check), else inside a
    new inference_mode context."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper
