"""The runtime's checkpoint loader: labels, and one clear error for a checkpoint that does not
match its config (missing, extra or mis-shaped tensors, an unsupported rope)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from optllm import LLM
from optllm.errors import UserError
from optllm.runtime.loader import checkpoint_kind


def copy(folder, tmp_path):
    out = tmp_path / "m"
    shutil.copytree(folder, out)
    return out


def edit_weights(folder, fn):
    f = folder / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f, metadata={"format": "pt"})


def test_checkpoint_kind_names_a_dequantized_gguf(tiny_llama, tmp_path):
    m = copy(tiny_llama, tmp_path)
    assert checkpoint_kind(m) == "float"
    (m / "optllm-source.json").write_text(json.dumps({"gguf": "/x/SmolLM2-135M-Instruct.Q4_1.gguf"}))
    assert checkpoint_kind(m) == "float (dequantized Q4_1 GGUF)"


@pytest.mark.parametrize("change, message", [
    (lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"), "lacks 1 tensors"),
    (lambda sd: sd.__setitem__("model.layers.0.extra.weight", torch.zeros(3)), "has no place"),
    (lambda sd: sd.__setitem__("model.layers.0.self_attn.o_proj.weight", torch.zeros(64, 60)), "does not match"),
])
def test_a_checkpoint_that_does_not_match_is_one_clear_error(tiny_llama, tmp_path, change, message):
    m = copy(tiny_llama, tmp_path)
    edit_weights(m, change)
    with pytest.raises(UserError, match=message):
        LLM(m, device="cpu")


def test_rope_that_changes_with_length_is_refused(tiny_llama, tmp_path):
    m = copy(tiny_llama, tmp_path)
    cfg = json.loads((m / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    cfg.pop("rope_scaling", None)
    (m / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError, match="rope_type 'dynamic' is not supported"):
        LLM(m, device="cpu")


def test_llama3_and_yarn_rope_follow_hf(tiny_llama, tmp_path):
    """Scaled rotary variants: the runtime's prompt log-probs equal HF's (float32, 1e-4)."""
    from transformers import AutoModelForCausalLM

    from optllm import SamplingParams

    ids = list(range(3, 60))
    for rope in ({"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                 {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 128},
                 {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}):
        m = tmp_path / rope["rope_type"]
        shutil.copytree(tiny_llama, m)
        cfg = json.loads((m / "config.json").read_text())
        cfg["rope_parameters"] = rope
        cfg.pop("rope_scaling", None)
        (m / "config.json").write_text(json.dumps(cfg))
        hf = AutoModelForCausalLM.from_pretrained(m, dtype=torch.float32).eval()
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)
        out = LLM(m, device="cpu").generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        diff = max(abs(out.prompt_logprobs[p][ids[p]] - float(ref[p - 1, ids[p]])) for p in range(1, len(ids)))
        assert diff < 1e-4, (rope["rope_type"], diff)
