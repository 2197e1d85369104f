"""--export vllm: the EAGLE draft in vLLM's / SGLang's layout, read back by a reader written from
that layout's description (a transformers LlamaDecoderLayer built from the exported config, its
input norm skipped, fc without bias over [embedding, feature], no final norm), which must compute
what our draft computes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_float32, write_draft
from safetensors.torch import load_file

from optllm.errors import UserError
from optllm.speculative.eagle import EagleDraft
from optllm.speculative.export import export_vllm


def read_vllm_eagle(folder, target):
    """A reader from the description: returns f(features [1, T, H], next_ids [1, T]) -> [1, T, H]."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 1
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "eager"
    w = load_file(folder / "model.safetensors")
    layer = LlamaDecoderLayer(config, layer_idx=0)
    missing, unexpected = layer.load_state_dict(
        {k.removeprefix("layers.0."): v for k, v in w.items() if k.startswith("layers.0.")}, strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected  # layer 0 runs without it
    layer.input_layernorm = torch.nn.Identity()
    rope = LlamaRotaryEmbedding(config)
    fc = w["fc.weight"]
    embed = target.get_input_embeddings().weight

    def run(features, next_ids):
        h = torch.cat([embed[next_ids], features], dim=-1) @ fc.T
        t = h.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=rope(h, pos))
        return out[0] if isinstance(out, tuple) else out

    return run, cfg, w


def test_exported_draft_computes_what_ours_computes(tiny_llama, tmp_path):
    draft_dir = write_draft(tmp_path / "eagle", tiny_llama, "eagle", seed=5, noise=0.3)
    out = export_vllm(draft_dir, tiny_llama, tmp_path / "vllm")
    target = hf_float32(tiny_llama)
    run, cfg, w = read_vllm_eagle(out, target)
    c = target.config
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"],
            cfg["intermediate_size"]) == (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size,
                                          c.intermediate_size)
    assert cfg["max_position_embeddings"] == c.max_position_embeddings and cfg["rope_scaling"] is None
    assert not any("embed" in k or "lm_head" in k or "norm.weight" == k for k in w)
    ours = load_file(draft_dir / "model.safetensors")
    assert all(torch.equal(w[k], ours[k]) for k in w)  # copied bit for bit
    draft = EagleDraft.from_target(target)
    draft.load_state_dict(ours)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, 11, c.hidden_size, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 11), generator=g)
    with torch.no_grad():
        want, _ = draft(feats, ids)
        got = run(feats, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_export_refuses_what_the_layout_cannot_hold(tiny_llama, tmp_path):
    medusa = write_draft(tmp_path / "medusa", tiny_llama, "medusa")
    with pytest.raises(UserError, match="'medusa' draft has no vLLM layout"):
        export_vllm(medusa, tiny_llama, tmp_path / "m-vllm")
    eagle = write_draft(tmp_path / "eagle", tiny_llama, "eagle")
    target = hf_float32(tiny_llama)
    biased = EagleDraft.from_target(target)
    biased.fc = torch.nn.Linear(2 * biased.hidden_size, biased.hidden_size, bias=True)
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in biased.state_dict().items()}, eagle / "model.safetensors")
    with pytest.raises(UserError, match="fc has a bias"):
        export_vllm(eagle, tiny_llama, tmp_path / "e-vllm")
    assert not (tmp_path / "m-vllm").exists() and not (tmp_path / "e-vllm").exists()
