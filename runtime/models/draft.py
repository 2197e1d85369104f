"""Draft models the runtime runs for speculative decoding: Medusa heads and the EAGLE layer.

Both read a folder ``optllm train-draft`` writes (config.json + model.safetensors, the
parameter names of the Medusa and EAGLE reference checkpoints) and run beside a target
``LlamaForCausalLM`` whose embedding and LM head they use.

Medusa (``MedusaDraft``): head k reads the target's last hidden state at position t (the one
that sampled x_{t+1}) and proposes x_{t+k+2}; a residual SiLU block then its own LM head.

EAGLE (``EagleDraft``): at position p it reads the target's feature f_p and the embedding of
x_{p+1}, fuses them (fc over [embedding, feature]), runs one decoder layer without input norm
and predicts f_{p+1}, which the target's LM head reads out over x_{p+2}. Its attention keeps
its own paged KV cache -- one more layer beside the target's, addressed by the same block
tables and slots (position p's draft K/V sit in the slot of the target's position p) -- so the
draft attends over the whole context at the cost of one layer. The engine keeps it filled:
every target step runs the draft over the rows it computed (runtime/spec_runner.py), and a
draft tree's scratch rows go to the slots past the context, where the target's verify step
writes next.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

from ...errors import UserError
from ...kernels.rmsnorm import rms_norm_pair
from ...kernels.topk import topk_logprobs
from ..layers.activation import SiluAndMul
from ..layers.attention import Attention, AttentionMetadata
from ..layers.norm import RMSNorm
from ..layers.rotary import RotaryEmbedding

log = logging.getLogger("optllm.runtime")

DRAFT_METHODS = ("medusa", "eagle", "eagle3")


class _ResBlock(nn.Module):
    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + F.silu(self.linear(h))


class MedusaDraft(nn.Module):
    """hidden [B, H] (the target's, at each sequence's last computed position) -> logits
    [B, num_heads, V]: head k over the token k + 2 ahead."""

    method = "medusa"

    def __init__(self, num_heads: int, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.num_heads, self.hidden_size, self.vocab_size = num_heads, hidden_size, vocab_size
        self.medusa_head = nn.ModuleList(
            nn.Sequential(_ResBlock(hidden_size), nn.Linear(hidden_size, vocab_size, bias=False))
            for _ in range(num_heads))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.medusa_head], dim=1)


class _EagleAttention(nn.Module):
    def __init__(self, cfg: dict, max_position: int, device, backend: str) -> None:
        super().__init__()
        h, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_size, self.kv_size = nh * d, nkv * d
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        # the draft's rotary is plain RoPE with the target's base (EAGLE's training): no scaling
        self.rotary_emb = RotaryEmbedding(SimpleNamespace(rope_theta=float(cfg["rope_theta"])), d, max_position,
                                          device, backend)
        self.attn = Attention(nh, nkv, d, d ** -0.5, 0, backend)
        self.register_buffer("qkv_weight", None, persistent=False)  # fuse() sets it (load_draft calls it)

    def fuse(self) -> None:
        """After loading: q / k / v as one matrix (one GEMM a forward instead of three; a
        speculative step runs the draft once per tree level, and its cost is the kernels' count)."""
        self.qkv_weight = torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]).contiguous()

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # views of the fused output, as the target's attention takes them
        q, k, v = F.linear(x, self.qkv_weight).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        attn = self.attn
        if self.rotary_emb.fuses_store(attn.k_cache):  # rotary + KV store in one kernel, as the target's
            q = self.rotary_emb.rotate_and_store(positions, q, k, v, attn.k_cache, attn.v_cache, meta.slot_mapping)
            return self.o_proj(attn(q, None, None, meta))
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(attn(q, k, v, meta))


class _EagleMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, backend: str = "torch") -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.act = SiluAndMul(backend)
        self.register_buffer("gate_up_weight", None, persistent=False)  # fuse() sets it (load_draft calls it)

    def fuse(self) -> None:
        """After loading: gate and up as one matrix, read by the fused SiLU-and-multiply."""
        self.gate_up_weight = torch.cat([self.gate_proj.weight, self.up_proj.weight]).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(F.linear(x, self.gate_up_weight)))


class _EagleLayer(nn.Module):
    def __init__(self, cfg: dict, max_position: int, dtype, device, backend: str) -> None:
        super().__init__()
        self.self_attn = _EagleAttention(cfg, max_position, device, backend)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], float(cfg["rms_norm_eps"]), dtype, device,
                                                backend)
        self.mlp = _EagleMLP(cfg["hidden_size"], cfg["intermediate_size"], backend)

    def forward(self, positions, x, meta):
        # the residual add inside the norm's launch (the same rounding: one of the sum, in x's dtype)
        normed, x = self.post_attention_layernorm(self.self_attn(positions, x, meta), x)
        return x + self.mlp(normed)


class EagleDraft(nn.Module):
    """forward(features [T, H] (f_p), next_ids [T] (x_{p+1}), positions [T] (p), meta) ->
    predicted features [T, H] (f_{p+1}); the draft's K/V of each row go to meta.slot_mapping
    in its own cache layer. ``embed`` / ``logits``: the target's embedding and LM head."""

    method = "eagle"

    def __init__(self, cfg: dict, target, max_position: int, dtype, device, backend: str) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.hidden_size, self.vocab_size = h, cfg["vocab_size"]
        self.num_kv_heads, self.head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
        self.fc = nn.Linear(2 * h, h, bias=bool(cfg.get("fc_bias", False)))
        self.layers = nn.ModuleList([_EagleLayer(cfg, max_position, dtype, device, backend)])
        self.backend = backend
        self._target = [target]  # not a submodule: the target's weights are not the draft's

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        target = self._target[0]
        emb = target.model.embed_tokens(next_ids).to(features.dtype)
        x = self.fc(torch.cat([emb, features], dim=-1))
        for layer in self.layers:
            x = layer(positions, x, meta)
        return x

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.layers]

    def context_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        """The draft's input for rows the target computed: its last hidden state."""
        return hidden

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary of a draft output: the target's LM head."""
        return self._target[0].compute_logits(out)

    def ranked(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k most likely next tokens of draft outputs out [..., H]: (log-probs float32 [..., k]
        descending, clamped to <= 0; target ids int64 [..., k]), the logits read once
        (kernels/topk.py)."""
        return topk_logprobs(self.logits(out), k, self.backend)

    def forward_ranked(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(forward's outputs, then ``ranked`` of them): a tree level of the proposal."""
        out = self(features, next_ids, positions, meta)
        return (out, *self.ranked(out, k))


class _Eagle3Attention(_EagleAttention):
    """q / k / v read the 2H of [normed embedding, normed hidden]."""

    def __init__(self, cfg: dict, max_position: int, device, backend: str) -> None:
        super().__init__(cfg, max_position, device, backend)
        h, nh, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.q_proj = nn.Linear(2 * h, nh * d, bias=False)
        self.k_proj = nn.Linear(2 * h, nkv * d, bias=False)
        self.v_proj = nn.Linear(2 * h, nkv * d, bias=False)


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: dict, max_position: int, dtype, device, backend: str) -> None:
        super().__init__()
        h, eps = cfg["hidden_size"], float(cfg["rms_norm_eps"])
        self.input_layernorm = RMSNorm(h, eps, dtype, device, backend)
        self.hidden_norm = RMSNorm(h, eps, dtype, device, backend)
        self.self_attn = _Eagle3Attention(cfg, max_position, device, backend)
        self.post_attention_layernorm = RMSNorm(h, eps, dtype, device, backend)
        self.mlp = _EagleMLP(h, cfg["intermediate_size"], backend)

    def inputs(self, embed, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[T, 2H]: the normed embedding of ids (the target's embedding) beside the normed
        features: one launch (kernels/rmsnorm.rms_norm_pair) where the embedding is one shard."""
        if embed.ctx.world_size != 1 or self.input_layernorm.eps != self.hidden_norm.eps:
            return torch.cat([self.input_layernorm(embed(ids).to(hidden.dtype)), self.hidden_norm(hidden)], dim=-1)
        return rms_norm_pair(embed.weight, self.input_layernorm.weight, hidden, self.hidden_norm.weight,
                             self.hidden_norm.eps, ids, backend=self.input_layernorm.backend)

    def forward(self, positions, hidden, x, meta, final_norm: RMSNorm | None = None):
        """x: ``inputs``' [normed embedding, normed hidden]. final_norm: also the output through it,
        (final_norm(out), out), the residual add in the norm's launch (one kernel less)."""
        normed, x = self.post_attention_layernorm(self.self_attn(positions, x, meta), hidden)
        if final_norm is not None:
            return final_norm(self.mlp(normed), x)
        return x + self.mlp(normed)


class Eagle3Draft(nn.Module):
    """EAGLE-3 (speculative/eagle3.py): forward(features [T, H] -- fc of the target's three layers
    for rows the target computed, the draft's own output for drafted rows --, next_ids [T],
    positions [T], meta) -> its pre-norm outputs [T, H]; ``logits`` reads them out through its
    norm and LM head over its vocabulary, placed in the target's (-inf for ids it lacks)."""

    method = "eagle3"

    def __init__(self, cfg: dict, target, max_position: int, dtype, device, backend: str) -> None:
        super().__init__()
        h = cfg["hidden_size"]
        self.hidden_size, self.vocab_size = h, cfg["vocab_size"]
        self.draft_vocab_size = int(cfg.get("draft_vocab_size") or self.vocab_size)
        self.num_kv_heads, self.head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
        self.aux_layers = tuple(int(i) for i in cfg["aux_layers"])
        self.fc = nn.Linear(3 * h, h, bias=False)
        self.midlayer = _Eagle3Layer(cfg, max_position, dtype, device, backend)
        self.norm = RMSNorm(h, float(cfg["rms_norm_eps"]), dtype, device, backend)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64, device=device))
        self.target_ids, self.identity = None, True
        self.backend = backend
        self._target = [target]

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.midlayer.inputs(self._target[0].model.embed_tokens, next_ids, features)
        return self.midlayer(positions, features, x, meta)

    def attention_layers(self) -> list[Attention]:
        return [self.midlayer.self_attn.attn]

    def context_features(self, hidden: torch.Tensor, aux: torch.Tensor | None) -> torch.Tensor:
        if aux is None:
            raise RuntimeError("an EAGLE-3 draft needs the target's auxiliary hidden states")
        return self.fc(aux.to(self.fc.weight.dtype))

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        small = self.lm_head(self.norm(out))
        if self.identity:
            return small
        full = small.new_full((small.shape[0], self.vocab_size), float("-inf"))
        full[:, self.target_ids] = small
        return full

    def ranked(self, out: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """As EagleDraft.ranked: over the draft's own vocabulary, its ids mapped to the target's
        (the log-softmax over the target's vocabulary with -inf elsewhere is the same)."""
        return self._ranked_normed(self.norm(out), k)

    def _ranked_normed(self, normed: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return topk_logprobs(self.lm_head(normed), k, self.backend, id_map=None if self.identity else self.target_ids)

    def forward_ranked(self, features: torch.Tensor, next_ids: torch.Tensor, positions: torch.Tensor,
                       meta: AttentionMetadata, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(forward's outputs, then ``ranked`` of them): a tree level of the proposal, the layer's
        last residual add inside the final norm's launch."""
        x = self.midlayer.inputs(self._target[0].model.embed_tokens, next_ids, features)
        normed, out = self.midlayer(positions, features, x, meta, final_norm=self.norm)
        return (out, *self._ranked_normed(normed, k))

    def set_d2t(self, d2t: torch.Tensor) -> None:
        """The draft-to-target id offsets (target id = draft id + d2t[draft id])."""
        self.d2t.copy_(d2t.to(torch.int64))
        self.target_ids = self.d2t + torch.arange(self.draft_vocab_size, device=self.d2t.device)
        self.identity = self.draft_vocab_size == self.vocab_size and not bool(self.d2t.any())


def read_draft_json(folder: str | Path, flag: str = "--draft") -> dict:
    """A draft folder's config.json (train-draft's OUT: config.json beside model.safetensors) as a
    dict; UserError, naming the option `flag` that gave the folder, otherwise."""
    folder = Path(folder)
    path = folder / "config.json"
    if not path.is_file() or not (folder / "model.safetensors").is_file():
        raise UserError(f"{flag} {folder}: not a draft folder (needs config.json and model.safetensors, as "
                        "`optllm train-draft` writes)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{flag} {folder}: config.json is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{flag} {folder}: config.json is not a JSON object")
    return cfg


def read_draft_config(folder: str | Path) -> dict:
    """The draft folder's config.json, checked for what the runtime needs; UserError otherwise."""
    cfg = read_draft_json(folder)
    method = cfg.get("method")
    if method not in DRAFT_METHODS:
        raise UserError(f"--draft {folder}: method {method!r} is not supported; supported: {', '.join(DRAFT_METHODS)}")
    if method in ("eagle", "eagle3") and int(cfg.get("num_layers", 1)) != 1:
        raise UserError(f"--draft {folder}: an EAGLE draft of {cfg.get('num_layers')} layers; supported: 1")
    return cfg


def load_draft(folder: str | Path, target, target_config, target_folder: Path | None, *, dtype: torch.dtype,
               device: torch.device, backend: str, max_position: int) -> MedusaDraft | EagleDraft:
    """The draft in ``folder`` for ``target`` (our LlamaForCausalLM), its weights loaded and
    cast to dtype. UserError when its sizes do not fit the target; a warning when it was trained
    for another target (by the hash train-draft recorded)."""
    from safetensors.torch import load_file

    cfg = read_draft_config(folder)
    h, v = target_config.hidden_size, target_config.vocab_size
    if cfg.get("hidden_size") != h or cfg.get("vocab_size") != v:
        raise UserError(f"--draft {folder}: hidden_size={cfg.get('hidden_size')}, vocab_size={cfg.get('vocab_size')}; "
                        f"the target has {h} and {v}")
    want = (cfg.get("target") or {}).get("sha256")
    if want and target_folder is not None:
        from ...hub.identity import target_identities

        try:
            ids = target_identities(target_folder)
            have = None if want in ids else ids[0]
        except (UserError, OSError):
            have = None
        if have is not None:
            log.warning("the draft in %s was trained for another target (%s, sha256 %s...); this one is %s... "
                        "-- it runs, but expect fewer accepted tokens", folder,
                        (cfg.get("target") or {}).get("model"), want[:12], have[:12])
    if cfg["method"] == "medusa":
        draft = MedusaDraft(int(cfg["num_heads"]), h, v)
    elif cfg["method"] == "eagle":
        draft = EagleDraft(cfg, target, max_position, dtype, device, backend)
    else:
        layers = target_config.num_hidden_layers
        aux = cfg.get("aux_layers") or []
        if len(aux) != 3 or any(not 0 <= int(i) < layers for i in aux):
            raise UserError(f"--draft {folder}: aux_layers={aux!r}; an EAGLE-3 draft reads three of the target's "
                            f"{layers} layers (0..{layers - 1})")
        draft = Eagle3Draft(cfg, target, max_position, dtype, device, backend)
        target.model.aux_layer_ids = draft.aux_layers
    state = load_file(str(Path(folder) / "model.safetensors"))
    if cfg["method"] == "eagle3":
        d2t = state.pop("d2t", None)
        state.pop("t2d", None)
        if d2t is None or tuple(d2t.shape) != (draft.draft_vocab_size,):
            raise UserError(f"--draft {folder}: an EAGLE-3 draft needs d2t [{draft.draft_vocab_size}]")
        if int(d2t.min()) < 0 or int((d2t + torch.arange(d2t.numel())).max()) >= v:
            raise UserError(f"--draft {folder}: d2t maps draft ids outside the target's vocabulary")
        draft.set_d2t(d2t.to(device))
    params = dict(draft.named_parameters())
    missing = sorted(set(params) - set(state))
    extra = sorted(set(state) - set(params))
    if missing or extra:
        raise UserError(f"--draft {folder}: model.safetensors does not match a {cfg['method']} draft "
                        f"(missing {missing[:4]}, unexpected {extra[:4]})")
    with torch.no_grad():
        for name, p in params.items():
            if tuple(state[name].shape) != tuple(p.shape):
                raise UserError(f"--draft {folder}: {name} has shape {tuple(state[name].shape)}; "
                                f"expected {tuple(p.shape)}")
            p.data = state[name].to(device=device, dtype=dtype)
    draft.requires_grad_(False).eval()
    draft = draft.to(device)
    # the held-out top-1 accuracy training measured (per step ahead): the adaptive policy's prior
    draft.heldout_top1 = list((cfg.get("training") or {}).get("heldout_top1") or [])
    for mod in draft.modules():
        if isinstance(mod, (_EagleAttention, _EagleMLP)):
            mod.fuse()
    return draft
