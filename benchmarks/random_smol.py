"""A random-weight model of SmolLM2-135M's exact shapes (Llama, hidden 576, 30 layers, 9 / 3 heads,
MLP 1536, vocabulary 49152, tied embeddings) and an EAGLE draft for it, written as HF folders: for
timing the runtime's steps where the real weights do not matter (launch counts, host overhead,
graph replays) without staging the GGUF on the device. The tokenizer is the tests' small BPE one
(ids past it are never decoded: the timing scripts send token ids).

    python benchmarks/random_smol.py OUT [--method eagle3]     # OUT/target, OUT/<method>
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--method", choices=["eagle", "eagle3"], default="eagle",
                    help="eagle: a pass-through EAGLE layer; eagle3: a random EAGLE-3, 16384-token draft vocabulary")
    a = ap.parse_args()
    from conftest import tiny_tokenizer, write_draft
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    target = a.out / "target"
    model.save_pretrained(target)
    tiny_tokenizer().save_pretrained(target)
    if a.method == "eagle":
        write_draft(a.out / "eagle", target, "eagle")
    else:
        write_draft(a.out / "eagle3", target, "eagle3", seed=2, noise=0.3, draft_vocab=16384)
    print(f"wrote {target} and {a.out / a.method}")


if __name__ == "__main__":
    main()
