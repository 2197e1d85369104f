"""--export vllm: the EAGLE draft in vLLM's / SGLang's layout, read back by a reader written from
that layout's description (a transformers LlamaDecoderLayer built from the exported config, its
input norm skipped, fc without bias over [embedding, feature], no final norm), which must compute
what our draft computes."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_float32, read_eagle3, write_draft
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


def test_exported_eagle3_draft_reads_back(tiny_llama, tmp_path):
    """The EAGLE-3 layout read by a reader written from its description (norms over the embedding
    and the hidden input, q/k/v over their 2H concatenation, residual from the hidden input, MLP,
    final norm, LM head over the draft vocabulary placed at target ids d2t + i) computes what our
    training module computes at step 0."""

    draft_dir = write_draft(tmp_path / "e3", tiny_llama, "eagle3", seed=4, noise=0.3, draft_vocab=100)
    out = export_vllm(draft_dir, tiny_llama, tmp_path / "vllm")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 100
    aux_ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    w = load_file(out / "model.safetensors")
    target = hf_float32(tiny_llama)
    c = target.config
    h, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]

    def norm(x, name):
        return w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, pos):
        inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
        ang = pos[:, None].float() * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        return x * cos + torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1) * sin

    def run(aux, ids):  # aux [T, 3H] at positions 0..T-1, ids [T] = x_{t+1}
        t = aux.shape[0]
        g = aux @ w["fc.weight"].T
        x = torch.cat([norm(target.get_input_embeddings().weight[ids], "midlayer.input_layernorm.weight"),
                       norm(g, "midlayer.hidden_norm.weight")], -1)
        pos = torch.arange(t)
        q = rope((x @ w["midlayer.self_attn.q_proj.weight"].T).view(t, nh, d).transpose(0, 1), pos)
        k = rope((x @ w["midlayer.self_attn.k_proj.weight"].T).view(t, nkv, d).transpose(0, 1), pos)
        v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(t, nkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(nh // nkv, 0), v.repeat_interleave(nh // nkv, 0)
        s = (q @ k.transpose(-1, -2)) / d ** 0.5 + torch.full((t, t), float("-inf")).triu(1)
        a = (s.softmax(-1) @ v).transpose(0, 1).reshape(t, nh * d) @ w["midlayer.self_attn.o_proj.weight"].T
        r = g + a
        m = norm(r, "midlayer.post_attention_layernorm.weight")
        gate, up = m @ w["midlayer.mlp.gate_proj.weight"].T, m @ w["midlayer.mlp.up_proj.weight"].T
        m = (torch.nn.functional.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
        small = norm(r + m, "norm.weight") @ w["lm_head.weight"].T
        full = torch.full((t, c.vocab_size), float("-inf"))
        full[:, w["d2t"] + torch.arange(small.shape[1])] = small
        return full

    ref = read_eagle3(draft_dir, target, 100, tuple(aux_ids))
    g = torch.Generator().manual_seed(1)
    aux = torch.randn(1, 9, 3 * h, generator=g)
    ids = torch.randint(0, c.vocab_size, (1, 9), generator=g)
    with torch.no_grad():
        want = ref.ttt(aux, ids, 1)[0][0]
        got = run(aux[0], ids[0])
    kept = w["d2t"] + torch.arange(100)
    torch.testing.assert_close(got[:, kept], want, rtol=1e-4, atol=1e-4)
    assert torch.isinf(got).sum() == 9 * (c.vocab_size - 100)
