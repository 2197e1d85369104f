"""``train-draft --export vllm``: an EAGLE draft in the layout vLLM and SGLang load as a
speculative model (vLLM ``speculative_config={"method": "eagle", "model": DIR}``; SGLang
``--speculative-algorithm EAGLE --speculative-draft-model-path DIR``).

What that layout is, as their docs and model code describe the EAGLE-1/2 draft for a Llama-family
target (the EAGLE-LLaMA3 checkpoints):
- ``config.json``: a Llama config of one hidden layer (``num_hidden_layers: 1``,
  ``architectures: ["LlamaForCausalLM"]``, ``model_type: "llama"``; the engines wrap it as their
  EAGLE model) with the target's sizes: hidden size, heads, KV heads, head_dim, intermediate
  size, vocabulary, RMSNorm eps, the rotary base (no scaling: ours trains plain RoPE) and
  max_position_embeddings.
- ``model.safetensors``: ``fc.weight`` [H, 2H] (no bias: their fc has none; its input is
  [token embedding, target feature] in that order), ``layers.0.self_attn.{q,k,v,o}_proj.weight``,
  ``layers.0.mlp.{gate,up,down}_proj.weight``, ``layers.0.post_attention_layernorm.weight``. No
  ``input_layernorm`` (layer 0 runs without one) and no final norm (the residual sum is the
  predicted feature). No embedding and no LM head: both engines share the target's.
Our draft has the same computation and names, so the export is a re-labelling: the weights are
copied bit for bit.

EAGLE-3 drafts (--method eagle3) are already in the layout SpecForge writes and vLLM / SGLang load
for ``method: "eagle3"``: ``fc.weight`` [H, 3H], ``midlayer.*`` (q/k/v reading 2H, the
input_layernorm over the token embedding, hidden_norm over the hidden input), ``norm.weight``,
``lm_head.weight`` over the draft vocabulary, ``d2t`` (draft id -> target id offset) and
``t2d``; the config adds ``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size`` and
``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target layers whose inputs it fuses).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import UserError
from ..hub.loader import load_config

EXPORT_FORMATS = ("vllm",)
_LAYER = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")


def vllm_eagle_config(draft_cfg: dict, target_config) -> dict:
    """The config.json of the exported draft (see the module docstring)."""
    c = draft_cfg
    dtype = c.get("dtype", "bfloat16")
    out = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 1,
        "hidden_size": c["hidden_size"],
        "intermediate_size": c["intermediate_size"],
        "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "vocab_size": c["vocab_size"],
        "rms_norm_eps": c["rms_norm_eps"],
        "rope_theta": c["rope_theta"],
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "max_position_embeddings": int(getattr(target_config, "max_position_embeddings", 4096) or 4096),
        "torch_dtype": dtype,
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        v = getattr(target_config, key, None)
        if v is not None:
            out[key] = v
    return out


def vllm_eagle3_config(draft_cfg: dict, target_config) -> dict:
    """config.json of an exported EAGLE-3 draft."""
    out = vllm_eagle_config(draft_cfg, target_config)
    out["architectures"] = ["LlamaForCausalLMEagle3"]
    out["draft_vocab_size"] = int(draft_cfg.get("draft_vocab_size") or draft_cfg["vocab_size"])
    out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(draft_cfg["aux_layers"]),
                           "use_aux_hidden_state": True}
    return out


_EAGLE3 = (["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.input_layernorm.weight",
            "midlayer.hidden_norm.weight", "midlayer.post_attention_layernorm.weight"]
           + [f"midlayer.{m}.weight" for m in _LAYER])


def export_vllm(draft_dir: str | Path, target_folder: str | Path, out_dir: str | Path) -> Path:
    """Write the EAGLE draft in draft_dir (a train-draft output) to out_dir in vLLM's / SGLang's
    layout, atomically (a temp folder renamed into place). UserError (one line) for a Medusa
    draft, a draft whose fc has a bias, or missing files."""
    from safetensors.torch import load_file, save_file

    draft_dir, out_dir = Path(draft_dir), Path(out_dir)
    try:
        cfg = json.loads((draft_dir / "config.json").read_text())
        weights = load_file(str(draft_dir / "model.safetensors"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"--export vllm: cannot read the draft in {draft_dir}: {e}") from None
    method = cfg.get("method")
    if method not in ("eagle", "eagle3"):
        raise UserError(f"--export vllm: the {method!r} draft has no vLLM layout here; allowed: an EAGLE or "
                        "EAGLE-3 draft (--method eagle, eagle3)")
    if "fc.bias" in weights:
        raise UserError("--export vllm: this EAGLE draft's fc has a bias, which vLLM's and SGLang's EAGLE layer "
                        "does not; train it without one (the default)")
    names = (_EAGLE3 if method == "eagle3" else
             ["fc.weight", "layers.0.post_attention_layernorm.weight"] + [f"layers.0.{m}.weight" for m in _LAYER])
    missing = [n for n in names if n not in weights]
    if missing or set(weights) - set(names):
        raise UserError(f"--export vllm: {draft_dir}/model.safetensors is not an {method} draft (missing {missing}, "
                        f"unexpected {sorted(set(weights) - set(names))})")
    target_config = load_config(Path(target_folder))
    config = (vllm_eagle3_config if method == "eagle3" else vllm_eagle_config)(cfg, target_config)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        save_file({n: weights[n].contiguous() for n in names}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
