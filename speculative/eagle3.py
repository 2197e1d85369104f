"""The EAGLE-3 draft and its training-time test (Li et al., 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test").

Three changes from EAGLE (eagle.py):
- Features fused from a low, a middle and a high layer of the target: the residual stream at the
  input of target layers ``aux_layers`` (default 2, L // 2, L - 3, clamped into 1..L-1: HF's
  ``hidden_states[i]``), concatenated [.., 3H] and projected by ``fc`` (3H -> H, no bias).
- The draft layer reads [input_layernorm(embedding of x_{t+1}), hidden_norm(h)] (2H) into its
  attention; h is the fused feature for a position the target computed, or the draft's own
  previous output (its pre-norm residual stream) for a position it drafts. The output goes
  through a final norm and the draft's own LM head, over an optional reduced vocabulary
  (``d2t``: draft id -> target id offset, ``t2d``: which target ids the draft has), initialised
  from the target's LM head rows. Token loss only (no feature regression).
- Training-time test: the draft is unrolled ``ttt_steps`` steps on each sequence, step j feeding
  on its own step j - 1 outputs, as it will at inference. Step j at position t stands for a draft
  at depth j + 1 whose context ends at t - j: its hidden input is step j - 1's output at t - 1, its
  token x_{t+1} (teacher-forced), and it attends to the target-fed (step 0) keys at positions
  <= t - j and to its own chain, step i's key at position t - (j - i) for i = 1..j. It predicts
  x_{t+2}; positions t < j have no context and do not count.

Names follow the EAGLE-3 checkpoints SpecForge writes and vLLM / SGLang load: ``fc.weight``,
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight``, ``d2t``, ``t2d``; the embedding is the target's (not saved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .eagle import MLP, RMSNorm, linear_cross_entropy, rotary, target_layer_args, unwrap

STEP_DECAY = 0.8  # step j's loss weight is STEP_DECAY ** j (normalised)


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high target layers (2, L // 2, L - 3), each clamped into 1..L-1."""
    top = max(1, num_layers - 1)
    return tuple(min(max(i, 1), top) for i in (2, num_layers // 2, num_layers - 3))


class Eagle3Attention(nn.Module):
    """Grouped-query attention whose q/k/v read 2H features; the score and mixing are the
    caller's (plain causal, or the training-time-test pattern)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_theta = rope_theta
        self.q_proj = nn.Linear(2 * hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, 2H] -> q [B, heads, T, d], k, v [B, heads, T, d] (KV heads repeated), roped."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        g = self.num_heads // self.num_kv_heads
        return q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)


class Eagle3Layer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rms_norm_eps: float, rope_theta: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        self.self_attn = Eagle3Attention(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def inputs(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)

    def finish(self, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The pre-norm output: hidden + attention, then + MLP(norm(that))."""
        x = hidden + self.self_attn.o_proj(attn_out)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Draft(nn.Module):
    """aux features [B, T, 3H] (the target's layers aux_layers at t) and next_ids [B, T]
    (x_{t+1}) -> per training-time-test step, logits [B, T, Vd] over x_{t+2} (``ttt``)."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, rms_norm_eps: float, rope_theta: float,
                 aux_layers: tuple[int, ...]) -> None:
        super().__init__()
        vocab_size, hidden_size = lm_head_weight.shape
        if tuple(embed_weight.shape) != (vocab_size, hidden_size):
            raise ValueError(f"embed_weight has shape {tuple(embed_weight.shape)}; allowed: ({vocab_size}, "
                             f"{hidden_size})")
        if len(aux_layers) != 3:
            raise ValueError(f"aux_layers={aux_layers!r}: EAGLE-3 fuses three target layers")
        self.hidden_size, self.vocab_size, self.aux_layers = hidden_size, vocab_size, tuple(int(i) for i in aux_layers)
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size, self.rms_norm_eps, self.rope_theta = intermediate_size, rms_norm_eps, rope_theta
        self.register_buffer("embed_tokens", embed_weight.detach().clone(), persistent=False)
        self.fc = nn.Linear(3 * hidden_size, hidden_size, bias=False)
        self.midlayer = Eagle3Layer(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps,
                                    rope_theta)
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(lm_head_weight)
        self.register_buffer("d2t", torch.zeros(vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(vocab_size, dtype=torch.bool))
        self._target_lm_head = lm_head_weight.detach().clone()
        # the target's LM head rows of the draft's vocabulary, frozen (not saved), made at the first
        # soft-labelled loss: soft labels read the target's next-token distribution over them
        self.register_buffer("target_head", None, persistent=False)
        self.ttt_steps = 3
        self.soft_labels = False

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def _teacher_head(self) -> torch.Tensor:
        """``target_head``: the target's LM head rows of the draft's ids (target id d + d2t[d]), on the
        draft's device; made once (and again after ``set_vocab``)."""
        if self.target_head is None:
            kept = self.d2t.cpu() + torch.arange(self.draft_vocab_size)
            self.target_head = self._target_lm_head[kept].to(self.lm_head.weight.device)
        return self.target_head

    @classmethod
    def from_target(cls, target, aux_layers: tuple[int, ...] | None = None) -> Eagle3Draft:
        return cls(*target_layer_args(target), aux_layers or default_aux_layers(target.config.num_hidden_layers))

    def set_vocab(self, token_ids: torch.Tensor) -> None:
        """Keep only these target token ids (sorted, distinct) in the draft's vocabulary: the LM
        head becomes those rows of the target's, d2t / t2d map between the two."""
        ids = torch.unique(token_ids.long().cpu())
        if ids.numel() < 2 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"draft vocabulary: need >= 2 distinct ids below {self.vocab_size}")
        self.lm_head = nn.Linear(self.hidden_size, ids.numel(), bias=False)
        with torch.no_grad():
            self.lm_head.weight.copy_(self._target_lm_head[ids])
        self.d2t = ids - torch.arange(ids.numel())
        t2d = torch.zeros(self.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d = t2d
        self.target_head = None  # (remade for the new vocabulary when asked for)

    def sizes(self) -> dict:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "draft_vocab_size": self.draft_vocab_size, "num_attention_heads": self.num_attention_heads,
                "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
                "intermediate_size": self.intermediate_size, "rms_norm_eps": self.rms_norm_eps,
                "rope_theta": self.rope_theta, "aux_layers": list(self.aux_layers)}

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, labels: torch.Tensor | None = None,
                counted: torch.Tensor | None = None,
                teacher: torch.Tensor | None = None) -> list[torch.Tensor] | torch.Tensor:
        """The training-time test with this draft's ``ttt_steps`` (what a distributed wrapper calls)."""
        return self.ttt(aux, next_ids, self.ttt_steps, labels, counted, teacher)

    def ttt(self, aux: torch.Tensor, next_ids: torch.Tensor, steps: int, labels: torch.Tensor | None = None,
            counted: torch.Tensor | None = None,
            teacher: torch.Tensor | None = None) -> list[torch.Tensor] | torch.Tensor:
        """The training-time test over one batch: aux [B, T, 3H] at positions 0..T-1 and next_ids
        [B, T] (x_{t+1}); returns each step's logits [B, T, Vd] (position t predicts x_{t+2}).
        With labels [B, T'] (draft ids of x_{t+2}, T' <= T) and counted [B, T'] bool: instead, each
        step j's mean cross-entropy over the counted positions t >= j ([steps]), the LM head read
        at those positions only (linear_cross_entropy: no [B, T, Vd] logits). teacher [B, T', H]:
        the target's last hidden state (after its final norm) whose next-token distribution is the
        label at each position (soft labels: softmax over ``target_head``, the draft's vocabulary
        of the target's LM head), labels then unused."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, t, _ = aux.shape
        dev = aux.device
        pos = torch.arange(t, device=dev)
        if labels is not None:
            rows_b, rows_t = counted.nonzero(as_tuple=True)  # one host sync: how many positions count
            rows_y = labels[rows_b, rows_t]
            soft = None if teacher is None else (teacher[rows_b, rows_t], self._teacher_head())
        emb = F.embedding(next_ids, self.embed_tokens).to(aux.dtype)
        hidden = self.fc(aux)
        scale = self.head_dim ** -0.5
        keys, values, out = [], [], []
        for j in range(steps):
            q, k, v = attn.qkv(layer.inputs(hidden, emb), pos)
            keys.append(k)
            values.append(v)
            s0 = (q @ keys[0].transpose(-1, -2)).float() * scale  # [B, h, T, T]: step-0 keys at s <= t - j
            s0 = s0.masked_fill(pos[None, :] > (pos[:, None] - j), float("-inf"))
            chain, chain_v = [], []
            for i in range(1, j + 1):  # step i's key at t - (j - i): the chain's earlier depths
                shift = j - i
                ki = F.pad(keys[i], (0, 0, shift, 0))[:, :, :t]
                vi = F.pad(values[i], (0, 0, shift, 0))[:, :, :t]
                si = (q * ki).sum(-1, keepdim=True).float() * scale
                chain.append(si.masked_fill((pos < shift)[None, None, :, None], float("-inf")))
                chain_v.append(vi)
            scores = torch.cat([s0, *chain], dim=-1)
            # rows with nothing to see (t < j, no context) get zeros, not NaN; they do not count
            p = torch.nan_to_num(scores.softmax(-1), nan=0.0).to(v.dtype)
            mixed = p[..., :t] @ values[0]
            for i, vi in enumerate(chain_v):
                mixed = mixed + p[..., t + i: t + i + 1] * vi
            o = layer.finish(hidden, mixed.transpose(1, 2).reshape(b, t, -1))
            if labels is None:
                out.append(self.lm_head(self.norm(o)))
            else:
                keep = (rows_t >= j).float()
                out.append(linear_cross_entropy(self.norm(o[rows_b, rows_t]), self.lm_head.weight, rows_y,
                                                keep / keep.sum().clamp(min=1), target=soft))
            hidden = F.pad(o, (0, 0, 1, 0))[:, :t]  # step j + 1 at t reads step j's output at t - 1
        return out if labels is None else torch.stack(out)


def eagle3_features(target, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    aux_layers: tuple[int, ...], with_last: bool = False) -> torch.Tensor:
    """[B, T, 3H]: the target's residual stream at the input of layers aux_layers (HF's
    hidden_states[i]), concatenated. with_last: [B, T, 4H], the target's last hidden state (after
    its final norm: what its LM head reads) after them, for soft labels (``eagle3_loss``)."""
    with torch.no_grad():
        out = target.get_decoder()(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                                    output_hidden_states=True)
    hs = out.hidden_states
    return torch.cat([hs[i] for i in aux_layers] + ([out.last_hidden_state] if with_last else []), dim=-1)


def _split_features(draft: Eagle3Draft, feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(aux [.., 3H], the target's last hidden state [.., H] or None) of ``eagle3_features``' output."""
    h3 = 3 * draft.hidden_size
    if feats.shape[-1] == h3:
        return feats, None
    if feats.shape[-1] != h3 + draft.hidden_size:
        raise ValueError(f"EAGLE-3 features: [.., {h3}] or [.., {h3 + draft.hidden_size}], got {tuple(feats.shape)}")
    return feats[..., :h3], feats[..., h3:]


def eagle3_loss(draft: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                steps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token loss of the training-time test: per step j, cross-entropy of the logits at positions
    t >= j against x_{t+2} (in the draft's vocabulary) where x_{t+2} is a masked-in token, averaged;
    the steps weighted STEP_DECAY ** j (normalised). Returns (loss, per-step cross-entropies [steps]).
    aux: ``eagle3_features``' [B, T, 3H], or [B, T, 4H] with the target's last hidden state: then
    the label at t is the target's next-token distribution at t + 1 over the draft's vocabulary
    (renormalised; soft labels, as EAGLE's and SpecForge's training take it), x_{t+2} only choosing
    which positions count."""
    base_draft = unwrap(draft)
    steps = base_draft.ttt_steps if steps is None else steps
    aux, last = _split_features(base_draft, aux)
    t = input_ids.shape[1]
    if t < 3:
        zero = aux.new_zeros(()).float() * aux.sum()
        return zero, zero.expand(steps)
    tgt = input_ids[:, 2:]
    labels = _to_draft_ids(base_draft, tgt)
    counted = loss_mask[:, 2:] & base_draft.t2d[tgt]
    args = (aux[:, :-1], input_ids[:, 1:])
    teacher = None if last is None else last[:, 1:-1]  # position t + 1's output: the distribution of x_{t+2}
    ces_t = draft(*args, labels, counted, teacher) if steps == base_draft.ttt_steps else \
        base_draft.ttt(*args, steps, labels, counted, teacher)
    w = torch.tensor([STEP_DECAY ** j for j in range(steps)], device=aux.device)
    return (ces_t * w).sum() / w.sum(), ces_t.detach()


def _to_draft_ids(draft: Eagle3Draft, target_ids: torch.Tensor) -> torch.Tensor:
    """Target ids -> draft ids (0 where the draft lacks the token; such positions do not count)."""
    lookup = torch.zeros(draft.vocab_size, dtype=torch.int64, device=target_ids.device)
    kept = draft.d2t.to(target_ids.device) + torch.arange(draft.draft_vocab_size, device=target_ids.device)
    lookup[kept] = torch.arange(draft.draft_vocab_size, device=target_ids.device)
    return lookup[target_ids]


@torch.no_grad()
def eagle3_accuracy(draft: Eagle3Draft, aux: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                    steps: int | None = None) -> tuple[list[int], list[int]]:
    """Per training-time-test step (depth 1..steps): (top-1 hits, counted positions) of x_{t+2}."""
    draft = unwrap(draft)
    steps = draft.ttt_steps if steps is None else steps
    aux = _split_features(draft, aux)[0]
    t = input_ids.shape[1]
    if t < 3:
        return [0] * steps, [0] * steps
    logits = draft.ttt(aux[:, :-1], input_ids[:, 1:], steps)
    tgt = input_ids[:, 2:]
    pred = [d2t_map(draft, lg[:, : t - 2].argmax(-1)) for lg in logits]
    hits, counts = [], []
    for j, p in enumerate(pred):
        m = loss_mask[:, 2:].clone()
        m[:, :j] = False
        hits.append(int(((p == tgt) & m).sum()))
        counts.append(int(m.sum()))
    return hits, counts


def d2t_map(draft: Eagle3Draft, draft_ids: torch.Tensor) -> torch.Tensor:
    """Draft ids -> target ids."""
    return draft_ids + draft.d2t.to(draft_ids.device)[draft_ids]
