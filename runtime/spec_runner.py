"""Speculative decoding inside the model runner: draft a token tree per sequence, verify every
tree in one target forward under the tree mask over the paged KV, accept, and move the
accepted path's KV into place.

The engine's step splits its decodes in two: sequences that can speculate (``eligible``) go
through ``SpecDecoder.step``; the rest (prefill chunks, requests with penalties or a seed,
those still inside min_tokens or too near max_model_len) run the ordinary step, after which
``observe`` brings the draft's state up to date from the rows that step computed.

Per sequence with c = num_computed_tokens and root x_c (its last, sampled token):
- the draft state ``seq.spec_state`` [H]: Medusa, the target's hidden state at c - 1 (the
  row that sampled x_c); EAGLE, the draft's predicted feature at c (its output on (f_{c-1},
  x_c)), its KV cache filled for every position < c.
- propose: Medusa, the heads' top-k over the static tree's choices; EAGLE-2, a dynamic tree
  grown ``depth - 1`` times from the top_k best frontier nodes (tree.py), each expansion one
  draft forward over the frontier nodes so far under their ancestor mask, their K/V in the
  draft's scratch slots c + row.
- verify: the target over the N tree nodes at positions c + depth, K/V to slots c + i,
  logits at every node; acceptance greedy (every row greedy) or by rejection sampling over the
  tree (lossless, acceptance.py); the accepted path's KV moved to c .. c + k (kv_compact.py).
- the sequence gains k accepted draft tokens and one token of the target's: k + 1 tokens of
  KV computed (root + accepted nodes); the draft catches up on those rows (EAGLE: one draft
  forward over them; Medusa: the hidden state at the last accepted node).
Blocks: the scheduler allocates ``lookahead`` slots past the root for an eligible decode;
what rejected nodes wrote past the new length is never read and is overwritten next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import KVCache, KVCacheSpec
from .layers.attention import AttentionMetadata
from .sampler import token_logprobs
from .sampling_params import GREEDY_EPS, SamplingParams
from .spec.acceptance import accepted_per_size, greedy_accept, rejection_accept, target_probs
from .spec.kv_compact import accepted_kv_slots, move_kv_slots
from .spec.tree import DynamicTreeBuilder, StaticTree
from .step_inputs import HostBatch

# Medusa's tree when none is given: ranks of the heads' top-k along each path, widest near the
# root (where acceptance is likeliest), cut to the heads the draft has.
DEFAULT_MEDUSA_CHOICES = (
    (0,), (1,), (2,), (3,),
    (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0),
    (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0),
    (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0),
)


@dataclass(frozen=True)
class SpecOptions:
    """EAGLE: top_k children per expanded node, depth (draft tokens along a path at most),
    num_draft (tree nodes besides the root). Medusa: choices (None: DEFAULT_MEDUSA_CHOICES cut
    to the draft's heads). policy: "fixed" (every eligible decode verifies the whole tree) or
    "adaptive" (spec/policy.py: a tree size per step, down to none, from the sequences'
    acceptance and a cost profile measured at start-up)."""

    top_k: int = 8
    depth: int = 6
    num_draft: int = 40
    medusa_choices: tuple | None = None
    policy: str = "fixed"


@dataclass
class SpecStats:
    """Counters over the engine's life: speculative steps and sequence-steps, draft tokens
    proposed and accepted, and how many sequence-steps accepted k draft tokens (index k)."""

    steps: int = 0
    seq_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    histogram: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """tau: tokens emitted per sequence-step (accepted draft tokens + the target's own)."""
        return (self.accepted + self.seq_steps) / self.seq_steps if self.seq_steps else 0.0

    def as_dict(self) -> dict:
        return {"steps": self.steps, "seq_steps": self.seq_steps, "drafted": self.drafted, "accepted": self.accepted,
                "mean_accepted_length": self.mean_accepted_length, "histogram": list(self.histogram)}


_GREEDY = SamplingParams(temperature=0)


class SpecDecoder:
    """The speculative half of a ModelRunner: ``runner`` gives the target model, its KV cache,
    block size, block tables, device and max_model_len."""

    def __init__(self, runner, draft, options: SpecOptions, seed: int = 0) -> None:
        self.runner, self.draft, self.options = runner, draft, options
        self.model = runner.model
        self.device = runner.device
        self.block_size = runner.block_size
        self.eagle = draft.method in ("eagle", "eagle3")  # a draft layer with its own KV; EAGLE-2 trees
        self.stats = SpecStats()
        self.verify_aux = None  # the last verify forward's auxiliary hidden states (EAGLE-3)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        if options.policy not in ("fixed", "adaptive"):
            raise ValueError(f"policy={options.policy!r} is not allowed; allowed: fixed, adaptive")
        if self.eagle:
            o = options
            DynamicTreeBuilder(torch.zeros(1, dtype=torch.int64), torch.zeros(1, max(o.top_k, 1)), top_k=o.top_k,
                               depth=o.depth, num_draft=o.num_draft)  # checks the options now
            self.num_nodes = o.num_draft + 1
            self.scratch = (o.depth - 1) * o.top_k
            spec = runner.kv_spec
            self.draft_kv = KVCache(KVCacheSpec(1, draft.num_kv_heads, draft.head_dim, spec.block_size, spec.dtype),
                                    runner.num_blocks, self.device)
            self.draft_kv.bind(draft.attention_layers())
        else:
            choices = options.medusa_choices or tuple(c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= draft.num_heads)
            full = StaticTree.from_choices(choices)
            if full.num_heads > draft.num_heads:
                raise ValueError(f"medusa_choices reach depth {full.num_heads}; the draft has "
                                 f"{draft.num_heads} heads")
            self.num_nodes = full.tree.size
            # its first n nodes are a tree too (parents precede children): the smaller sizes
            self.trees = {n: StaticTree.from_choices(full.choices[1:n]) for n in range(2, self.num_nodes + 1)}
            self.scratch = 0
        # the tree sizes a step may verify: the whole tree and, adaptively, about halves of it
        self.sizes = sorted({self.num_nodes} | ({max(2, self.num_nodes >> i) for i in range(1, 5)}
                                                if options.policy == "adaptive" else set()))
        self.n = self.num_nodes  # this step's tree size (plan() sets it)
        self.policy = None
        self.adaptive = options.policy == "adaptive"

    def start(self) -> None:
        """Once the runner is complete (its decode graphs captured): the adaptive policy, with
        the cost profile measured on the paths the steps will take."""
        if self.adaptive and self.policy is None:
            from .spec.policy import AdaptivePolicy

            self.policy = AdaptivePolicy(self.sizes, self.measure())

    @property
    def lookahead(self) -> int:
        """Slots past the root this step's speculative decodes write (tree nodes; EAGLE's scratch rows)."""
        return max(self.n, self.scratch) - 1

    def plan(self, running) -> int:
        """Called by the scheduler before it schedules a step: picks this step's tree size from
        the running sequences that would speculate; returns the lookahead (0: no speculation)."""
        if self.policy is None:
            self.n = self.num_nodes
            return self.lookahead
        ids = [s.seq_id for s in running if s.num_uncomputed_tokens == 1 and self.eligible(s)]
        pol = self.policy
        if len(pol._seq) > 2 * len(running) + 64:  # forget the sequences that left
            live = {s.seq_id for s in running}
            for sid in [k for k in pol._seq if k not in live]:
                pol.forget(sid)
        self.n = pol.choose(ids, self.runner.config.max_num_batched_tokens)
        return self.lookahead if self.n > 1 else 0

    # ---- the start-up cost profile
    @torch.inference_mode()
    def measure(self, batches: list[int] | None = None, repeats: int = 2):
        """The policy's CostTable: milliseconds of a plain decode step (n = 1) and of a
        speculative step of each menu size (draft proposal, verify, acceptance, KV move, and
        EAGLE's catch-up over two rows a sequence), for batch sizes up to max_num_seqs whose
        B * n fits the step budget, on the engine's own KV cache before any request (blocks
        from 0, contexts of 32 tokens, random draft states). One warm-up run each (kernel
        compilation), then the best of ``repeats``."""
        import time

        from .spec.policy import CostTable

        cfg, dev, bs = self.runner.config, self.device, self.block_size
        ctx_len = 32
        if batches is None:
            batches, b = [], 1
            while b < cfg.max_num_seqs:
                batches.append(b)
                b *= 2
            batches.append(cfg.max_num_seqs)
        per_row = -(-(ctx_len + max(self.num_nodes, self.scratch + 1)) // bs)
        batches = [b for b in batches if b * per_row <= self.runner.num_blocks] or [1]
        h = self.draft.hidden_size
        gen = torch.Generator(device=dev).manual_seed(0)

        def sync():
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        graphs = self.runner.graphs

        def one(n: int, b: int) -> None:
            tables = torch.arange(b * per_row, device=dev, dtype=torch.int32).view(b, per_row)
            ctx = torch.full((b,), ctx_len, dtype=torch.int64, device=dev)
            if n == 1:  # an ordinary decode step as the runner runs it: a graph replay when one fits
                pos = ctx.clone()
                slots = tables.long()[:, ctx_len // bs] * bs + ctx_len % bs
                if graphs is not None and b <= graphs.max_batch:
                    hb = HostBatch([0] * b, [ctx_len] * b, slots.tolist(), [ctx_len + 1] * b, None,
                                   tables.cpu().numpy(), list(range(b)), [(i, i) for i in range(b)], [])
                    logits = graphs.replay(hb)
                    hidden, pos, meta = graphs.step_outputs()
                else:
                    meta = AttentionMetadata(slot_mapping=slots, block_tables=tables,
                                             seq_lens=(ctx + 1).to(torch.int32), decode=True,
                                             num_splits=self.runner.decode_splits(b))
                    hidden = self.model(torch.zeros(b, dtype=torch.int64, device=dev), pos, meta)
                    logits = self.model.compute_logits(hidden)
                logits.argmax(dim=-1).tolist()
                if self.eagle:  # observe(): the draft over the step's rows
                    feats = self.draft.context_features(hidden, self.model.model.aux_hidden)
                    self.draft(feats, torch.zeros(b, dtype=torch.int64, device=dev), pos, meta)
                return
            states = torch.randn(b, h, generator=gen, device=dev).to(self.runner.dtype)
            roots = torch.zeros(b, dtype=torch.int64, device=dev)
            _, hidden, _, res, _ = self._draft_and_verify(roots, states, ctx, tables, [_GREEDY] * b, n)
            res.num_accepted.tolist()
            if self.eagle:
                rows = torch.arange(2 * b, device=dev)
                pos = ctx.repeat_interleave(2) + rows % 2
                slots = tables.long()[rows // 2, pos // bs] * bs + pos % bs
                meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=(ctx + 2).to(torch.int32),
                                         decode=False, cu_seqlens_q=(torch.arange(b + 1, device=dev) * 2).to(
                                             torch.int32), max_seqlen_q=2)
                self.draft(hidden[:2 * b], torch.zeros(2 * b, dtype=torch.int64, device=dev), pos, meta)
            sync()

        ms: dict[int, list[float]] = {}
        for n in [1, *self.sizes]:
            row = []
            for b in batches:
                if n > 1 and b * n > cfg.max_num_batched_tokens:
                    row.append(row[-1] * 2 if row else 1e9)  # never scheduled: priced out
                    continue
                one(n, b)
                best = float("inf")
                for _ in range(repeats):
                    sync()
                    t0 = time.perf_counter()
                    one(n, b)
                    best = min(best, (time.perf_counter() - t0) * 1e3)
                row.append(max(best, 1e-3))
            ms[n] = row
        self.cost_table = CostTable(batches, ms)
        return self.cost_table

    # ---- which sequences speculate
    def eligible(self, seq) -> bool:
        """Whether the sequence's next decode can be a speculative step."""
        p = seq.params
        return (getattr(seq, "spec_state", None) is not None and not p.uses_penalties
                and (p.seed is None or p.temperature < GREEDY_EPS)
                and seq.num_output_tokens >= p.min_tokens
                and seq.num_tokens + max(self.num_nodes, self.scratch) - 1 <= self.runner.max_model_len)

    # ---- the ordinary step's rows
    @torch.inference_mode()
    def observe(self, seqs, num_new_tokens, inputs, hidden: torch.Tensor, sampled: list) -> None:
        """After an ordinary step: hidden [T, H] of its rows (seqs[i]'s rows in order, its
        tokens [num_computed_tokens, + num_new_tokens[i])), sampled[i] the token it sampled
        or None. Sets the sampling sequences' draft state; EAGLE also runs the draft over
        every row (its KV for those positions)."""
        if not self.eagle:
            if inputs.sample:
                rows = inputs.logits_rows[[r for _, r in inputs.sample]]
                for (i, _), h in zip(inputs.sample, hidden[rows]):
                    seqs[i].spec_state = h
            return
        next_ids, last_rows, row = [], [], 0
        for seq, k, tok in zip(seqs, num_new_tokens, sampled):
            start = seq.num_computed_tokens
            nxt = seq.token_ids[start + 1: start + k + 1]
            if len(nxt) < k:  # the last row's next token is the one just sampled
                nxt = nxt + [tok]
            next_ids += nxt
            row += k
            last_rows.append(row - 1)
        ids = torch.tensor(next_ids, dtype=torch.int64, device=self.device)
        feats = self.draft.context_features(hidden, self.model.model.aux_hidden)
        pred = self.draft(feats, ids, inputs.positions, inputs.meta)
        for seq, tok, r in zip(seqs, sampled, last_rows):
            if tok is not None:
                seq.spec_state = pred[r]

    # ---- the speculative step
    @torch.inference_mode()
    def step(self, seqs) -> list[list[int]]:
        """One speculative step for sequences that are all eligible decodes (their blocks cover
        num_computed_tokens + lookahead); returns each one's new tokens (accepted + 1)."""
        dev = self.device
        bsz = len(seqs)
        ctx = torch.tensor([s.num_computed_tokens for s in seqs], dtype=torch.int64, device=dev)
        width = max(len(s.block_table) for s in seqs)
        tables = torch.from_numpy(self.runner.block_tables.gather(seqs, width)).to(dev)
        roots = torch.tensor([s.last_token_id for s in seqs], dtype=torch.int64, device=dev)
        states = torch.stack([s.spec_state for s in seqs])
        params = [s.params for s in seqs]
        tree, hidden, logits, res, ranks = self._draft_and_verify(roots, states, ctx, tables, params, self.n)
        n = tree.num_nodes
        num_acc = res.num_accepted.tolist()  # the step's host sync
        tokens = res.tokens.tolist()
        out = [tokens[b][:num_acc[b] + 1] for b in range(bsz)]
        if self.policy is not None:
            self._observe_sizes(seqs, res, ranks, n)
        rows = torch.arange(bsz, device=dev)[:, None] * n + res.accepted.clamp_min(0)  # [B, N] hidden rows on the path
        self._record_logprobs(seqs, out, logits.view(bsz * n, -1), rows)
        if self.eagle:
            self._catch_up(seqs, out, hidden, rows, ctx, tables)
        else:
            last = rows.gather(1, res.num_accepted[:, None])[:, 0]
            for s, h in zip(seqs, hidden[last]):
                s.spec_state = h
        st = self.stats
        st.steps += 1
        st.seq_steps += bsz
        st.drafted += bsz * (n - 1)
        st.accepted += sum(num_acc)
        for k in num_acc:
            if k >= len(st.histogram):
                st.histogram.extend([0] * (k + 1 - len(st.histogram)))
            st.histogram[k] += 1
        return out

    def _draft_and_verify(self, roots, states, ctx, tables, params, n):
        """Propose trees of n nodes, verify them in one target forward, accept, and move the
        accepted KV into place. Returns (tree, hidden [B * N, H], logits [B, N, V], the
        AcceptResult, each node's rank int64 [B, N]: the trees of the first m ranks are the
        smaller trees of the menu)."""
        dev, bs = self.device, self.block_size
        bsz = roots.shape[0]
        if self.eagle:
            tree, ranks = self._propose_eagle(roots, states, ctx, tables, n)
        else:
            tree = self._propose_medusa(roots, states, n)
            ranks = torch.arange(tree.num_nodes, device=dev).expand(bsz, -1)
        n = tree.num_nodes
        # verify: every node at once, K/V to slots c + i, positions c + depth
        pos = ctx[:, None] + torch.arange(n, device=dev)[None, :]
        slots = (tables.long().gather(1, pos // bs) * bs + pos % bs).reshape(-1)
        graphs = self.runner.verify_graphs
        hidden = None if graphs is None else graphs.run(tree.tokens, tree.positions(ctx), slots, tables,
                                                         (ctx + n).to(torch.int32), tree.mask)
        if hidden is None:
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=tables, seq_lens=(ctx + n).to(torch.int32), decode=False,
                cu_seqlens_q=(torch.arange(bsz + 1, device=dev) * n).to(torch.int32), max_seqlen_q=n,
                mask=tree.mask.reshape(-1), mask_offsets=torch.arange(bsz, device=dev) * (n * n))
            hidden = self.model(tree.tokens.reshape(-1), tree.positions(ctx).reshape(-1), meta)
        # (from a graph: its own outputs, used up within this step)
        self.verify_aux = self.model.model.aux_hidden  # EAGLE-3: the accepted rows' fused features come from it
        logits = self.model.compute_logits(hidden).view(bsz, n, -1)
        if all(p.temperature < GREEDY_EPS for p in params):
            res = greedy_accept(tree, logits.argmax(dim=-1))
        else:
            res = rejection_accept(tree, target_probs(logits, params), None, generator=self.generator)
        kv = self.runner.kv_cache
        src, dst = accepted_kv_slots(tables, ctx, res.accepted, bs)
        move_kv_slots([kv.k, kv.v, kv.k_scale, kv.v_scale], src, dst)
        return tree, hidden, logits, res, ranks

    def _observe_sizes(self, seqs, res, ranks, n) -> None:
        """The policy's per-size acceptance: under each menu size m <= n, the accepted path cut at
        its first node of rank >= m (exact under greedy acceptance)."""
        sizes = [m for m in self.sizes if m <= n]
        for s, row in zip(seqs, accepted_per_size(res.accepted, ranks, sizes).tolist()):
            self.policy.observe(s.seq_id, dict(zip(sizes, row)))

    def _propose_medusa(self, roots: torch.Tensor, states: torch.Tensor, n: int):
        tree = self.trees[n]
        logits = self.draft(states)  # [B, heads, V]
        topk = torch.topk(logits.float(), tree.top_k, dim=-1).indices
        return tree.batch(roots, topk)

    def _propose_eagle(self, roots, states, ctx, tables, n):
        o, dev, bs = self.options, self.device, self.block_size
        bsz, k = roots.shape[0], o.top_k
        root_lp = torch.log_softmax(self.draft.logits(states).float(), dim=-1)
        builder = DynamicTreeBuilder(roots, root_lp, top_k=k, depth=o.depth, num_draft=n - 1)
        feats_in, toks, masks = [], [], None
        prev_nodes, prev_out = None, None
        for d in range(1, o.depth):
            front = builder.frontier  # [B, k] pool indices, all at depth d
            tok = builder.frontier_tokens
            if d == 1:
                parent_feat = states[:, None, :].expand(bsz, k, states.shape[-1])
                parent_row = None
            else:
                par = builder.pool_parents.gather(1, front)  # [B, k]: nodes of the previous frontier
                j = (par[:, :, None] == prev_nodes[:, None, :]).float().argmax(dim=-1)  # their index there
                parent_feat = prev_out.gather(1, j[:, :, None].expand(bsz, k, prev_out.shape[-1]))
                parent_row = (d - 2) * k + j
            feats_in.append(parent_feat)
            toks.append(tok)
            m = d * k
            # ancestor-or-self mask over the rows so far (row r = frontier node r % k of depth r // k + 1)
            new = torch.zeros(bsz, m, m, dtype=torch.bool, device=dev)
            if masks is not None:
                new[:, :m - k, :m - k] = masks
                new[:, m - k:, :m - k] = masks.gather(1, parent_row[:, :, None].expand(bsz, k, m - k))
            new[:, torch.arange(m - k, m), torch.arange(m - k, m)] = True
            masks = new
            rows_pos = ctx[:, None] + torch.arange(m, device=dev)[None, :]
            slots = (tables.long().gather(1, rows_pos // bs) * bs + rows_pos % bs).reshape(-1)
            positions = (ctx[:, None] + torch.arange(d, device=dev).repeat_interleave(k)[None, :]).reshape(-1)
            meta = AttentionMetadata(
                slot_mapping=slots, block_tables=tables, seq_lens=(ctx + m).to(torch.int32), decode=False,
                cu_seqlens_q=(torch.arange(bsz + 1, device=dev) * m).to(torch.int32), max_seqlen_q=m,
                mask=masks.reshape(-1), mask_offsets=torch.arange(bsz, device=dev) * (m * m))
            f = torch.cat(feats_in, dim=1).reshape(bsz * m, -1)
            ids = torch.cat(toks, dim=1).reshape(-1)
            out = self.draft(f, ids, positions, meta).view(bsz, m, -1)[:, m - k:]
            lp = torch.log_softmax(self.draft.logits(out.reshape(bsz * k, -1)).float(), dim=-1)
            builder.expand(lp.view(bsz, k, -1))
            prev_nodes, prev_out = front, out
        tree = builder.build()
        # rank of each kept node by score, as build() chose them (stable, descending)
        order = torch.sort(builder.kept_scores, dim=1, descending=True, stable=True).indices
        return tree, torch.argsort(order, dim=1)

    def _catch_up(self, seqs, out, hidden, rows, ctx, tables) -> None:
        """EAGLE: the draft over the accepted rows (positions c .. c + k, each with the next
        emitted token), its KV in place of the scratch; the last row is the new state."""
        dev, bs = self.device, self.block_size
        lens = [len(o) for o in out]
        sel = torch.cat([rows[b, :lens[b]] for b in range(len(seqs))])
        aux = self.verify_aux
        feats = self.draft.context_features(hidden[sel], None if aux is None else aux[sel])
        ids = torch.tensor([t for o in out for t in o], dtype=torch.int64, device=dev)
        offs = torch.tensor([i for n_ in lens for i in range(n_)], dtype=torch.int64, device=dev)
        which = torch.tensor([b for b, n_ in enumerate(lens) for _ in range(n_)], dtype=torch.int64, device=dev)
        pos = ctx[which] + offs
        slots = tables.long()[which, pos // bs] * bs + pos % bs
        cu = [0]
        for n_ in lens:
            cu.append(cu[-1] + n_)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, seq_lens=(ctx + torch.tensor(
            lens, device=dev)).to(torch.int32), decode=False, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32,
                                                                                          device=dev),
            max_seqlen_q=max(lens))
        pred = self.draft(feats, ids, pos, meta)
        for s, e in zip(seqs, cu[1:]):
            s.spec_state = pred[e - 1]

    def _record_logprobs(self, seqs, out, logits, rows) -> None:
        """Raw log-probabilities of the emitted tokens, from the target's logits at the path's
        nodes (node i of the path scores emitted token i), for sequences that asked."""
        for b, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            m = len(out[b])
            targets = torch.tensor(out[b], dtype=torch.int64, device=logits.device)
            lp, _rank, tids, tlp = token_logprobs(logits[rows[b, :m]], targets, k)
            lp, tids, tlp = lp.tolist(), tids.tolist(), tlp.tolist()
            for j in range(m):
                entry = {out[b][j]: lp[j]}
                for t, v in zip(tids[j], tlp[j]):
                    entry.setdefault(t, v)
                seq.output_logprobs.append(entry)
