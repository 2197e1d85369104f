"""The device side of the engine: the model, its KV cache, CUDA graphs, and one step's run.

``execute(batch)`` prepares the step's inputs on the host, runs the model (a captured CUDA
graph for decode batches, eager otherwise), computes logits only for the rows that need
them, samples on the device, and returns the sampled ids: one host sync per step, at the
end (the ids the scheduler needs). On CPU every kernel is its torch reference.
"""

from __future__ import annotations

import functools
import gc
import os
import time

import torch

from ..errors import UserError
from ..hub.loader import parse_dtype, resolve_device
from ..kernels.paged_attention import default_num_splits, sm_count
from .block_table import BlockTables
from .config import EngineConfig
from .cuda_graphs import DecodeGraphs, ExtendGraphs, VerifyGraphs
from .inference import inference
from .kv_cache import KVCache, KVCacheSpec, cache_dtype
from .layers.attention import AttentionMetadata
from .loader import ModelSource, build_model, init_random_weights, load_weights
from .models.llama import BuildOptions, head_dim_of
from .sampler import Sampler, token_logprobs
from .spec.tree import const_arange, const_full
from .step_inputs import host_batch, packed_to, to_device

_VERIFY_GRAPH_TOKENS = 2048  # the most tree tokens a verify graph takes
_LOGPROB_ROWS = 1024  # prompt-logprob rows whose logits are formed at once
_SAMPLER_RESERVE = 4  # float32 [max_num_seqs, vocab] copies the sampler may hold at once


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return parse_dtype(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, source: ModelSource, max_model_len: int, eos_token_ids: frozenset) -> None:
        self.config, self.max_model_len = config, max_model_len
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        on_cuda = self.device.type == "cuda"
        if on_cuda and self.device.index is not None:
            torch.cuda.set_device(self.device)
        self.backend = config.kernels if config.kernels != "auto" else ("triton" if on_cuda else "torch")
        opt = BuildOptions(self.dtype, self.device, self.backend, quant=source.quant, max_position=max_model_len)
        with torch.inference_mode():
            self.model = build_model(source, opt)
            if config.load_format == "dummy":
                init_random_weights(self.model, config.seed)
            else:
                load_weights(self.model, source.folder)
        draft = None
        if config.draft is not None:  # before sizing the KV cache: its weights, and EAGLE's cache layer
            from .models.draft import load_draft

            with torch.inference_mode():
                draft = load_draft(config.draft, self.model, source.config, source.folder, dtype=self.dtype,
                                   device=self.device, backend=self.backend, max_position=max_model_len)
        hf = source.config
        self.vocab_size = hf.vocab_size
        self.num_kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        kv_dtype = cache_dtype(config.kv_cache_dtype, self.dtype, source.kv_cache)
        self.kv_spec = KVCacheSpec(hf.num_hidden_layers, self.num_kv_heads, head_dim_of(hf), config.block_size,
                                   kv_dtype)
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-max_model_len // config.block_size)
        self.sampler = Sampler(self.vocab_size, eos_token_ids, seed=config.seed)
        self.block_tables = BlockTables(2 * config.max_num_seqs, self.max_blocks_per_seq)
        num_blocks = config.num_kv_blocks or self._blocks_that_fit(draft)
        if num_blocks < self.max_blocks_per_seq:
            raise UserError(f"the KV cache holds {num_blocks * self.block_size} tokens, fewer than "
                            f"max_model_len={max_model_len}; lower --max-model-len or raise the memory given")
        # with a draft: one block more, which no sequence is given (speculative graphs' padding rows
        # write there)
        self._pad_blocks = 1 if draft is not None else 0
        self.kv_cache = KVCache(self.kv_spec, num_blocks + self._pad_blocks, self.device)
        self.kv_cache.bind(self.model.attention_layers())
        # The decode kernel's split count along the sequence, from the batch size and the longest
        # sequence the engine admits (so a CUDA graph and an eager step agree). A partial, not a
        # method: the graphs hold it, and a runner <-> graphs cycle would keep the KV cache and the
        # graphs' memory pool alive after the LLM is dropped (until the next gc run).
        self.decode_splits = functools.partial(default_num_splits, num_kv_heads=self.num_kv_heads,
                                               max_blocks=self.max_blocks_per_seq, block_size=self.block_size,
                                               block_n=self.kv_spec.head_dim, sms=sm_count(self.device))
        self.spec = None
        # a speculative step's eager plain rows ride in its verify forward (config.spec_fuse)
        self.fuse = config.spec_fuse and os.environ.get("OPTLLM_SPEC_FUSE", "1") != "0"
        self.exec_steps, self.exec_ms = 0, 0.0  # steps run and their wall milliseconds (host sync included)
        if draft is not None:
            from .spec_runner import SpecDecoder, SpecOptions

            policy = config.spec_policy if config.spec_policy != "auto" else ("adaptive" if on_cuda else "fixed")
            opts = SpecOptions(config.spec_top_k, config.spec_depth, config.spec_num_draft, config.medusa_choices,
                               policy)
            self.spec = SpecDecoder(self, draft, opts, seed=config.seed)
            self.spec.bind(self.kv_cache.num_blocks)
        self.graphs = self.verify_graphs = self.extend_graphs = None
        if on_cuda and not config.enforce_eager and config.cuda_graph_max_batch > 0:
            self.make_graphs(min(config.max_num_seqs, config.cuda_graph_max_batch))
        if self.spec is not None:
            self.spec.start()  # the adaptive policy's cost profile: measured on the paths steps take

    def make_graphs(self, max_batch: int, eager_stand_in: bool = False, step_graphs: bool = True) -> None:
        """Capture the CUDA graphs (eager_stand_in: their CPU stand-ins, tests): decode steps per
        batch bucket up to max_batch -- with a draft loaded each also stores its rows' features for
        the draft (the sink), inside the graph -- and with a draft, per (batch bucket, tree size),
        the speculative step whole, greedy and temperature-only sampled (SpecStepGraphs;
        step_graphs=False: none), and the verify forward of other sampling steps. Larger trees x
        batches (compute-bound, where launches matter less) run eager, so the token cap bounds
        the graphs' memory."""
        spec = self.spec
        sink = None if spec is None else spec.store.store
        self.graphs = DecodeGraphs(self.model, max_batch, self.max_blocks_per_seq, self.vocab_size, self.device,
                                   self.decode_splits, eager_stand_in=eager_stand_in, sink=sink,
                                   seed=self.config.seed, backend=self.backend)
        tokens = min(self.config.cuda_graph_max_tokens, self.config.max_num_batched_tokens)
        self.extend_graphs = None if tokens < 1 else ExtendGraphs(
            self.model, max_batch, tokens, self.max_blocks_per_seq, self.vocab_size, self.device,
            eager_stand_in=eager_stand_in, sink=sink, seed=self.config.seed, backend=self.backend)
        if spec is None:
            return
        from .spec_runner import SpecStepGraphs

        cap = min(self.config.max_num_batched_tokens, _VERIFY_GRAPH_TOKENS)
        self.verify_graphs = VerifyGraphs(self.model, self.graphs.max_batch, spec.sizes, cap, self.max_blocks_per_seq,
                                          self.device, eager_stand_in=eager_stand_in)
        spec.graphs = None
        if step_graphs:
            spec.graphs = SpecStepGraphs(spec, self.graphs.max_batch, spec.sizes, cap, self.max_blocks_per_seq,
                                         self.num_blocks, eager_stand_in=eager_stand_in)

    @property
    def num_blocks(self) -> int:
        """Blocks the scheduler hands out (the speculative graphs' padding block excluded)."""
        return self.kv_cache.num_blocks - self._pad_blocks

    def linear_methods(self) -> dict[str, int]:
        """How many linear layers run each method ("dense", "w4a16 g64 (triton)", ...)."""
        counts: dict[str, int] = {}
        for mod in self.model.modules():
            if hasattr(mod, "method") and hasattr(mod, "weight_loader"):
                name = mod.method.describe(mod)
                counts[name] = counts.get(name, 0) + 1
        return counts

    # ---- sizing
    def _blocks_that_fit(self, draft) -> int:
        layers = self.kv_spec.num_layers
        # EAGLE's draft layer keeps its own KV beside the target's (one more cache layer)
        extra = 1 if draft is not None and draft.method in ("eagle", "eagle3") else 0
        per_block = self.kv_spec.bytes_per_block() * (layers + extra) // layers
        if draft is not None:  # the draft's feature cache: one row per slot
            per_block += self.block_size * draft.hidden_size * self.dtype.itemsize
        if self.device.type != "cuda":
            return max(1, int(self.config.cpu_kv_cache_gib * 2**30) // per_block)
        gc.collect()  # an engine dropped earlier in this process gives its cache back first
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        activations = self._profile_activations()
        reserve = _SAMPLER_RESERVE * self.config.max_num_seqs * self.vocab_size * 4 + 256 * 2**20
        budget = total * self.config.gpu_memory_utilization - (total - free) - activations - reserve
        if budget < per_block * self.max_blocks_per_seq:
            raise UserError(f"after the weights ({(total - free) / 2**30:.1f} GiB used) and activations "
                            f"({activations / 2**30:.1f} GiB) no room is left for a KV cache of max_model_len="
                            f"{self.max_model_len}; raise --gpu-memory-utilization or lower --max-model-len")
        return int(budget // per_block)

    @torch.inference_mode()
    def _profile_activations(self) -> int:
        """Peak bytes one step of max_num_batched_tokens prompt tokens adds (temporary cache)."""
        from .sampling_params import SamplingParams
        from .sequence import Sequence

        tokens = min(self.config.max_num_batched_tokens, self.max_model_len * self.config.max_num_seqs)
        per_seq = min(tokens, self.max_model_len)
        seqs, counts, block = [], [], 0
        while sum(counts) < tokens:
            n = min(per_seq, tokens - sum(counts))
            s = Sequence("profile", [1] * n, SamplingParams(max_tokens=1))
            nb = -(-n // self.block_size)
            s.block_table = list(range(block, block + nb))
            block += nb
            seqs.append(s)
            counts.append(n)
        tmp = KVCache(self.kv_spec, block, self.device)
        tmp.bind(self.model.attention_layers())
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        tables = BlockTables(len(seqs), max(len(s.block_table) for s in seqs))
        inputs = to_device(host_batch(seqs, counts, self.block_size, tables), self.device, False, None)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        self.model.compute_logits(hidden[inputs.logits_rows])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        for layer in self.model.attention_layers():  # let the temporary cache go
            layer.bind_kv_cache(None, None)
        del tmp, hidden, inputs
        torch.cuda.empty_cache()
        return peak

    # ---- one step
    @inference
    def execute(self, batch) -> list:
        """Run one scheduled step; returns each sequence's sampled token id (None where the
        step does not complete the sequence; for a speculative decode, the list of tokens it
        emitted). Fills seq.output_logprobs / prompt_logprobs for the sequences that asked."""
        t_start = time.perf_counter()
        try:
            if self.spec is None:
                return self._execute(batch.seqs, batch.num_new_tokens, batch.decode_only)
            return self._execute_spec(batch)
        finally:
            self.exec_steps += 1
            self.exec_ms += (time.perf_counter() - t_start) * 1e3

    def _execute_spec(self, batch) -> list:
        if not any(batch.speculate):  # no sequence speculates: the plain step as a draft-less engine runs it
            decode = batch.decode_only
            out = self._plain_part(batch.seqs, batch.num_new_tokens, decode)
            # a pure plain decode step: the engine times it -- one a scan of the policy (plan()), not
            # each step of a plain stretch (the ratio moves slowly; each report cost the host ~2 µs)
            if decode and self.spec.policy is not None and self.spec.scanned:
                self.spec.pending_cost = (1, len(batch.seqs))
            return out
        result: list = [None] * len(batch.seqs)
        plain = [i for i, s in enumerate(batch.speculate) if not s]
        spec = [i for i, s in enumerate(batch.speculate) if s]
        if plain:
            seqs = [batch.seqs[i] for i in plain]
            counts = [batch.num_new_tokens[i] for i in plain]
            decode = all(k == 1 for k in counts) and all(batch.sampling[i] for i in plain)
            if self.fuse and not self._graphed(seqs, counts, decode):
                return self._execute_fused(batch, plain, seqs, counts, spec)
            for i, tok in zip(plain, self._plain_part(seqs, counts, decode)):
                result[i] = tok
            self.spec.stats.split_steps += 1  # (two forwards: the plain rows', then the trees')
        t0 = time.perf_counter()
        for i, toks in zip(spec, self.spec.step([batch.seqs[i] for i in spec])):
            result[i] = toks
        self.spec.stats.spec_ms += (time.perf_counter() - t0) * 1e3
        # a pure speculative step that did not first catch up on the rows of plain steps (a
        # one-off, the longer the longer speculation was off: timed apart, the policy's
        # catch_up; an exploring step after a plain stretch would look like a slow step)
        if self.spec.policy is not None and not plain and not self.spec.last_step_caught_up:
            self.spec.pending_cost = (self.spec.n, len(spec))
        return result

    def _graphed(self, seqs, counts: list[int], decode: bool) -> bool:
        """Whether these rows' plain step replays a graph, decode or extend (else it runs eager)."""
        if decode:
            return self.graphs is not None and len(seqs) <= self.graphs.max_batch
        return (self.extend_graphs is not None and self.extend_graphs.bucket(sum(counts), len(seqs)) is not None
                and all(s.params.prompt_logprobs is None for s in seqs))

    def _execute_fused(self, batch, plain: list[int], pseqs, counts: list[int], spec: list[int]) -> list:
        """A step whose plain rows (prefill chunks; plain decodes without a graph) run eager: the
        speculating sequences' trees are drafted first, then verified in the same target forward
        as the plain rows (their K/V, features and samples as ``_execute`` makes them; the trees'
        rows under their masks, the plain sequences causal), then accepted. One forward where
        the unfused step runs two, the second of them a whole speculative step. pseqs, counts:
        the plain rows' sequences (batch.seqs at ``plain``) and token counts."""
        t0 = time.perf_counter()
        sp, dev = self.spec, self.device
        sseqs = [batch.seqs[i] for i in spec]
        p, b = len(pseqs), len(sseqs)
        hb = host_batch(pseqs, counts, self.block_size, self.block_tables, also=sseqs)
        ids, pos, slots, rows, ctx = packed_to(dev, "q", hb.ids, hb.positions, hb.slots, hb.logits_rows,
                                               [s.num_computed_tokens for s in sseqs])
        seq_lens, cu, tables = packed_to(dev, "i", hb.seq_lens, hb.cu_seqlens, hb.table.reshape(-1))
        tables = tables.view(p + b, hb.table.shape[1])
        prop = sp.propose(sseqs, ctx, tables[p:])
        tree, n, tp = prop.tree, prop.tree.num_nodes, len(hb.ids)
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slots, prop.slots]), block_tables=tables,
            seq_lens=torch.cat([seq_lens, prop.lens]), decode=False,
            cu_seqlens_q=torch.cat([cu, const_arange(b, dev, torch.int32, start=n, step=n) + tp]),
            max_seqlen_q=max(n, hb.max_seqlen_q),
            mask=tree.mask.reshape(-1),  # the plain sequences' offsets -1: causal
            mask_offsets=torch.cat([const_full((p,), -1, torch.int64, dev), const_arange(b, dev, step=n * n)]))
        hidden = self.model(torch.cat([ids, tree.tokens.reshape(-1)]),
                            torch.cat([pos, tree.positions(ctx).reshape(-1)]), meta)
        aux = self.model.model.aux_hidden
        sp.store.store(hidden[:tp], None if aux is None else aux[:tp], slots)  # the plain rows' draft inputs
        if hb.prompt_lp:
            self._prompt_logprobs(pseqs, hidden, hb.prompt_lp, rows)
        k = len(hb.sample)
        # one LM-head GEMM: the plain rows that sample, then every tree node
        logits = self.model.compute_logits(hidden[torch.cat([hb.sample_rows(rows), const_arange(b * n, dev) + tp])])
        tree_logits = logits[k:].view(b, n, -1)
        res = sp.accept(prop, hidden[tp:], None if aux is None else aux[tp:], tree_logits)
        result: list = [None] * len(batch.seqs)
        for i, tok in zip(plain, self._sample(pseqs, hb, logits[:k])):  # its host sync
            result[i] = tok
        for i, toks in zip(spec, sp.emit(prop, res, tree_logits)):
            result[i] = toks
        st = sp.stats
        st.fused_steps += 1
        st.fused_ms += (time.perf_counter() - t0) * 1e3
        return result

    def _plain_part(self, seqs, num_new_tokens, decode: bool) -> list[int | None]:
        """A draft engine's plain sequences of a step, run as a draft-less engine runs them, their
        time and count added to the speculation stats."""
        t0 = time.perf_counter()
        out = self._execute(seqs, num_new_tokens, decode)
        st = self.spec.stats
        st.plain_ms += (time.perf_counter() - t0) * 1e3
        st.plain_parts += 1
        return out

    def _execute(self, seqs, num_new_tokens, decode: bool) -> list[int | None]:
        hb = host_batch(seqs, num_new_tokens, self.block_size, self.block_tables)
        if decode and self._graphed(seqs, num_new_tokens, decode):
            # (with a draft: the rows' features stored inside); the graph's tokens: the argmax of every
            # row (the all-greedy case's tokens), or, where every row samples at a temperature alone,
            # drawn there at each row's (the sampler is not called)
            temps = self.sampler.graph_temperatures(seqs) if len(hb.sample) == len(seqs) else None
            logits, tokens = self.graphs.replay(hb, temps)
            if temps is not None:
                return tokens.tolist()  # the step's one host sync
            return self._sample(seqs, hb, logits, tokens)
        if not decode and self.extend_graphs is not None and self.extend_graphs.fits(hb):
            # prefills, chunks, prefills beside decodes; the tokens drawn as a decode graph's are
            temps = self.sampler.graph_temperatures([seqs[i] for i, _ in hb.sample]) if hb.sample else None
            logits, tokens = self.extend_graphs.replay(hb, temps)
            if temps is not None:
                result: list[int | None] = [None] * len(seqs)
                for (i, _), tok in zip(hb.sample, tokens.tolist()):  # the step's one host sync
                    result[i] = tok
                return result
            return self._sample(seqs, hb, logits, tokens)
        inputs = to_device(hb, self.device, decode, self.decode_splits(len(seqs)) if decode else None)
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta)
        if self.spec is not None:  # the draft's inputs for every row computed
            self.spec.store.store(hidden, self.model.model.aux_hidden, inputs.meta.slot_mapping)
        if hb.prompt_lp:
            self._prompt_logprobs(seqs, hidden, hb.prompt_lp, inputs.logits_rows)
        logits = self.model.compute_logits(hidden[hb.sample_rows(inputs.logits_rows)]) if hb.sample else None
        return self._sample(seqs, hb, logits)

    def _sample(self, seqs, hb, logits, greedy=None) -> list[int | None]:
        """Each sequence's sampled token (None where it does not sample) from the logits of the
        rows that sample (hb.sample's order; greedy: their argmax, computed already); the host sync
        of the step."""
        if not hb.sample:
            return [None] * len(seqs)
        sampling = [seqs[i] for i, _ in hb.sample]
        out = self.sampler(logits, sampling, greedy=greedy)
        ids = out.token_ids.tolist()  # the step's one host sync
        if out.logprobs is not None:
            self._record_logprobs(sampling, ids, out)
        result: list[int | None] = [None] * len(seqs)
        for (i, _), tok in zip(hb.sample, ids):
            result[i] = tok
        return result

    def _record_logprobs(self, seqs, ids, out) -> None:
        lp, top_ids, top_lp = out.logprobs.tolist(), out.topk_ids.tolist(), out.topk_logprobs.tolist()
        for j, seq in enumerate(seqs):
            k = seq.params.logprobs
            if k is None:
                continue
            entry = {ids[j]: lp[j]}
            for t, v in zip(top_ids[j][:k], top_lp[j][:k]):
                entry.setdefault(t, v)
            seq.output_logprobs.append(entry)

    def _prompt_logprobs(self, seqs, hidden, prompt_lp, logits_rows) -> None:
        for i, row0, n, first in prompt_lp:
            seq = seqs[i]
            k = seq.params.prompt_logprobs
            if len(seq.prompt_logprobs) != first + 1:  # a hole or a repeat: the prefix cache's rule broke
                raise RuntimeError(f"{seq!r} holds {len(seq.prompt_logprobs)} prompt log-probs; this step "
                                   f"scores prompt token {first + 1} on")
            for c in range(0, n, _LOGPROB_ROWS):
                m = min(_LOGPROB_ROWS, n - c)
                rows = logits_rows[row0 + c: row0 + c + m]
                targets = seq.token_ids[first + c + 1: first + c + 1 + m]
                lp, _rank, tids, tlp = token_logprobs(self.model.compute_logits(hidden[rows]),
                                                      torch.tensor(targets, device=hidden.device), k)
                lp, tids, tlp = lp.tolist(), tids.tolist(), tlp.tolist()
                for j in range(m):
                    entry = {targets[j]: lp[j]}
                    for t, v in zip(tids[j], tlp[j]):
                        entry.setdefault(t, v)
                    seq.prompt_logprobs.append(entry)
