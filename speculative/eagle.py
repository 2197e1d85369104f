"""The EAGLE draft and its loss (Li et al., 2024, "EAGLE: Speculative Sampling Requires
Rethinking Feature Uncertainty").

The draft autoregresses on features, not tokens. At position t it reads the target's feature
f_t (the last hidden state, after the final norm: what the LM head reads; target.last_hidden)
and the embedding of the token one ahead, x_{t+1} (the target's own embedding, frozen), fuses
them with fc: Linear(2H -> H) over [embedding, feature] (EAGLE's order), runs one causal Llama
decoder layer, and predicts f_{t+1}. The target's LM head (frozen) reads the prediction out as
a distribution over x_{t+2}. The layer has no input norm (the fc output goes straight into
attention) and no final norm (the feature it predicts is already normed), and fc has no bias, as
in the EAGLE-LLaMA3 checkpoints and the EAGLE layers vLLM and SGLang run (EAGLE's first Vicuna
checkpoints had one: ``fc_bias=True``, which ``--export vllm`` then refuses).

Parameter names follow EAGLE's checkpoints: ``fc.weight`` (``fc.bias``),
``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
``layers.0.post_attention_layernorm.weight``. The frozen embedding and LM head are buffers
outside the state dict: they are the target's, named by its hash in the draft's config.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

REGRESSION_WEIGHT = 1.0  # EAGLE's weights: SmoothL1 on features + 0.1 x token cross-entropy
CLASSIFICATION_WEIGHT = 0.1


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (the Llama "rotate half" layout) of x [B, heads, T, head_dim] at
    positions [T]."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.to(torch.float32)[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    rot = torch.cat([-x2, x1], -1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention with rotary positions, no biases (Llama)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, rope_theta: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        pos = torch.arange(t, device=x.device)
        q, k = rotary(q, pos, self.rope_theta), rotary(k, pos, self.rope_theta)
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        # the fused kernel (flash / memory-efficient on CUDA): no [B, heads, T, T] scores or mask in memory
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A Llama decoder layer without its input norm (EAGLE's layer 0)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 rms_norm_eps: float, rope_theta: float) -> None:
        super().__init__()
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps)
        self.mlp = MLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x)
        return x + self.mlp(self.post_attention_layernorm(x))


def target_layer_args(target) -> tuple:
    """(embedding, LM head (fp32 CPU copies), heads, KV heads, head_dim, intermediate size, RMSNorm
    eps, rotary base) of the transformers causal LM ``target``: a draft layer sized like it."""
    c = target.config
    rope = getattr(c, "rope_theta", None)
    if rope is None:
        rope = (getattr(c, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return (target.get_input_embeddings().weight.detach().float().cpu(),
            target.get_output_embeddings().weight.detach().float().cpu(),
            c.num_attention_heads, kv, head_dim, c.intermediate_size, float(c.rms_norm_eps), float(rope))


class EagleDraft(nn.Module):
    """features [B, T, H] (f_t) and next_ids [B, T] (x_{t+1}) -> (predicted features [B, T, H]
    (f_{t+1}), logits [B, T, V] over x_{t+2})."""

    def __init__(self, embed_weight: torch.Tensor, lm_head_weight: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int, intermediate_size: int, rms_norm_eps: float, rope_theta: float,
                 fc_bias: bool = False) -> None:
        super().__init__()
        vocab_size, hidden_size = lm_head_weight.shape
        if tuple(embed_weight.shape) != (vocab_size, hidden_size):
            raise ValueError(f"embed_weight has shape {tuple(embed_weight.shape)}; "
                             f"allowed: ({vocab_size}, {hidden_size})")
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.num_attention_heads, self.num_key_value_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.intermediate_size, self.rms_norm_eps, self.rope_theta = intermediate_size, rms_norm_eps, rope_theta
        # frozen and not saved: the target's own tensors
        self.register_buffer("embed_tokens", embed_weight.detach().clone(), persistent=False)
        self.register_buffer("lm_head", lm_head_weight.detach().clone(), persistent=False)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                                                  rms_norm_eps, rope_theta)])

    @classmethod
    def from_target(cls, target) -> EagleDraft:
        """A fresh draft sized like the transformers causal LM `target`, with its embedding and
        LM head (fp32 copies). The rotary base is the target's; any rope scaling is not copied
        (the draft's attention is its own, trained from scratch)."""
        return cls(*target_layer_args(target))

    def sizes(self) -> dict:
        """What a runtime needs to rebuild the layer (config.json)."""
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size,
                "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
                "head_dim": self.head_dim, "intermediate_size": self.intermediate_size,
                "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "fc_bias": self.fc.bias is not None,
                "input_layernorm": False}

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor,
                logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(predicted features, logits); logits None when not asked for (training reads the
        counted positions out itself: eagle_draft_loss)."""
        emb = F.embedding(next_ids, self.embed_tokens).to(features.dtype)
        h = self.fc(torch.cat([emb, features], -1))
        for layer in self.layers:
            h = layer(h)
        return h, (F.linear(h, self.lm_head.to(h.dtype)) if logits else None)


def eagle_inputs(features: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's inputs for a sequence: (features [B, T-1, H] f_0..f_{T-2}, next_ids [B, T-1]
    x_1..x_{T-1}) from the target's features [B, T, H] and input_ids [B, T]."""
    return features[:, :-1], input_ids[:, 1:]


def eagle_loss(pred: torch.Tensor, logits: torch.Tensor, features: torch.Tensor, input_ids: torch.Tensor,
               loss_mask: torch.Tensor, w_reg: float = REGRESSION_WEIGHT,
               w_cls: float = CLASSIFICATION_WEIGHT,
               lm_head: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE's loss on the draft's outputs for eagle_inputs(features, input_ids).

    pred [B, T-1, H] and logits [B, T-1, V]: at draft position t, the predicted f_{t+1} and the
    logits for x_{t+2}; features [B, T, H] the target's; input_ids [B, T]; loss_mask [B, T] bool,
    True on the tokens to learn (answer tokens, not padding). A position t counts when x_{t+2}
    is in the mask (t <= T-3). Returns (w_reg * regression + w_cls * cross-entropy, [regression,
    cross-entropy]): regression the SmoothL1 of pred vs f_{t+1}, averaged over the hidden size,
    then over counted positions; cross-entropy of logits vs x_{t+2}, averaged over them (0 when
    no position counts). lm_head [V, H] (soft labels, the paper's): the cross-entropy against
    p_{t+2} = softmax(f_{t+1} @ lm_head.T), the target's own distribution, instead of x_{t+2}.
    """
    t = input_ids.shape[1]
    if t < 3:
        zero = pred.new_zeros(()).float() * pred.sum()
        return zero, torch.stack([zero, zero])
    mask = loss_mask[:, 2:].float()
    n = mask.sum().clamp(min=1)
    reg = F.smooth_l1_loss(pred[:, : t - 2].float(), features[:, 1: t - 1].float(), reduction="none").mean(-1)
    lg = logits[:, : t - 2].float()
    if lm_head is None:
        ce = F.cross_entropy(lg.reshape(-1, lg.shape[-1]), input_ids[:, 2:].reshape(-1), reduction="none")
    else:
        p = torch.softmax(features[:, 1: t - 1].float() @ lm_head.float().T, dim=-1)
        ce = -(p * torch.log_softmax(lg, dim=-1)).sum(-1).reshape(-1)
    reg = (reg * mask).sum() / n
    ce = (ce * mask.reshape(-1)).sum() / n
    return w_reg * reg + w_cls * ce, torch.stack([reg, ce])


def eagle_draft_loss(draft: nn.Module, features: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                     w_reg: float = REGRESSION_WEIGHT, w_cls: float = CLASSIFICATION_WEIGHT,
                     soft: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """eagle_loss(*draft(*eagle_inputs(features, input_ids)), features, input_ids, loss_mask) (same
    value and gradients) without the logits of every position: the frozen LM head reads only the
    positions that count, a chunk of rows at a time (linear_cross_entropy), so no [B, T, V] logits,
    float32 copies or log-softmax are kept for the backward pass. ``draft`` may be a distributed
    wrapper of an EagleDraft (its forward is what runs). soft: eagle_loss's soft labels (lm_head =
    the draft's frozen LM head, the target's), the teacher's rows made chunk by chunk too."""
    pred, _ = draft(*eagle_inputs(features, input_ids), logits=False)
    t = input_ids.shape[1]
    if t < 3:
        zero = pred.new_zeros(()).float() * pred.sum()
        return zero, torch.stack([zero, zero])
    mask = loss_mask[:, 2:]
    rows = pred[:, : t - 2][mask]  # the counted positions (one host sync: their number)
    n = max(rows.shape[0], 1)
    reg = F.smooth_l1_loss(rows.float(), features[:, 1: t - 1][mask].float(), reduction="none").mean(-1).sum() / n
    head = unwrap(draft).lm_head
    teacher = (features[:, 1: t - 1][mask], head) if soft else None  # f_{t+1} through the target's head
    ce = linear_cross_entropy(rows, head, input_ids[:, 2:][mask], 1.0 / n, target=teacher)
    return w_reg * reg + w_cls * ce, torch.stack([reg, ce])


CE_CHUNK_ELEMENTS = 1 << 26  # logits a chunk of linear_cross_entropy holds at once (256 MiB in float32)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None,
                         scale: float | torch.Tensor = 1.0,
                         target: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """sum_i scale_i * CE(hidden_i @ weight.T, labels_i) for hidden [N, H], weight [V, H] (an LM head),
    labels [N], scale a number or [N] (constant weights): the logits in the dtype F.linear computes in
    here (autocast's under autocast), the log-softmax in float32, as F.cross_entropy over
    (hidden @ weight.T).float() would. The logits are made a chunk of rows at a time and the
    gradients (hidden's; weight's when it requires grad) computed with them, so nothing [N, V]
    outlives its chunk: the GEMMs autograd would run (no recomputation), a fraction of the memory.

    target = (target_hidden [N, Ht], target_weight [V, Ht]) (labels unused): soft labels instead, the
    distribution p_i = softmax(target_hidden_i @ target_weight.T) (float32), made chunk by chunk the
    same way: sum_i scale_i * (logsumexp(z_i) - p_i . z_i), the cross-entropy against p_i (a
    teacher's next-token distribution, EAGLE's training target); its gradient scale (softmax - p)."""
    return _LinearCrossEntropy.apply(hidden, weight, labels, scale, target)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, scale, target=None):
        n, v = hidden.shape[0], weight.shape[0]
        dtype = F.linear(hidden[:1], weight[:1]).dtype  # the compute dtype (autocast's when on)
        w = weight.detach().to(dtype)
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None  # every row is written below
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        if target is not None:
            t_hidden, t_weight = target
            if t_hidden.shape[0] != n or t_weight.shape[0] != v or t_hidden.shape[1] != t_weight.shape[1]:
                raise ValueError(f"target: hidden [{n}, H'] and weight [{v}, H'], got {tuple(t_hidden.shape)} and "
                                 f"{tuple(t_weight.shape)}")
            t_w = t_weight.detach().to(dtype)
        step = max(1, CE_CHUNK_ELEMENTS // v)
        for s in range(0, n, step):
            h = hidden[s: s + step].to(dtype)
            sc = scale[s: s + step, None].float() if torch.is_tensor(scale) else float(scale)
            logits = F.linear(h, w).float()
            lse = torch.logsumexp(logits, -1, keepdim=True)
            if target is None:
                y = labels[s: s + step, None]
                total += ((lse - logits.gather(1, y)) * sc).sum()
            else:  # the teacher's distribution over the same columns, in float32
                p = F.linear(t_hidden[s: s + step].detach().to(dtype), t_w).float().softmax(-1)
                total += ((lse - (p * logits).sum(-1, keepdim=True)) * sc).sum()
            if want_h or want_w:  # d(scale * CE)/d(logits) = scale * (softmax - one_hot(label) or p)
                g = logits.sub_(lse).exp_()
                if target is None:
                    g.scatter_add_(1, y, torch.full(y.shape, -1.0, dtype=g.dtype, device=g.device))
                else:
                    g.sub_(p)
                g = g.mul_(sc).to(dtype)
                if want_h:
                    grad_h[s: s + step] = g @ w
                if want_w and dtype == torch.float32:
                    grad_w.addmm_(g.T, h)
                elif want_w:
                    grad_w.add_((g.T @ h).float())
        # kept on ctx, not saved for backward: they are neither inputs nor outputs, and backward
        # scales them in place (a graph kept for a second backward would be wrong: refused there)
        ctx.grads, ctx.weight_dtype = (grad_h, grad_w), weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.grads is None:
            raise RuntimeError("linear_cross_entropy: its backward runs once (no retain_graph)")
        grad_h, grad_w = ctx.grads
        ctx.grads = None
        return (grad_h.mul_(grad_out.to(grad_h.dtype)) if grad_h is not None else None,
                grad_w.mul_(grad_out).to(ctx.weight_dtype) if grad_w is not None else None, None, None, None)


def unwrap(draft: nn.Module) -> nn.Module:
    """The draft a distributed wrapper (DistributedDataParallel's ``module``) wraps, else itself."""
    return getattr(draft, "module", draft)


@torch.no_grad()
def eagle_accuracy(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor) -> tuple[int, int]:
    """(top-1 hits, counted positions) of the draft's next-token prediction x_{t+2} (depth 1:
    the acceptance proxy), shapes as in eagle_loss."""
    t = input_ids.shape[1]
    if t < 3:
        return 0, 0
    pred = logits[:, : t - 2].argmax(-1)
    mask = loss_mask[:, 2:]
    return int(((pred == input_ids[:, 2:]) & mask).sum()), int(mask.sum())
