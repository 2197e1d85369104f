"""Prometheus metrics of one server (its own registry, so several apps can live in one process).

Counters: requests by endpoint and status, prompt and generated tokens. Histograms: time to
first token, inter-token latency. Gauges read from the engine when scraped: running and
waiting requests, KV blocks used and free, prefix-cache hit rate; with a draft loaded, the
speculative steps' drafts, draft tokens, accepted tokens, mean accepted length and the
histogram of accepted lengths.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineGauges:
    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        for name, doc, value in (
            ("optllm_num_requests_running", "Sequences running on the engine", s.num_running),
            ("optllm_num_requests_waiting", "Sequences waiting for the engine", s.num_waiting),
            ("optllm_kv_blocks_used", "KV cache blocks held by sequences", s.num_blocks - s.num_free_blocks),
            ("optllm_kv_blocks_free", "KV cache blocks free (cached prefixes included)", s.num_free_blocks),
            ("optllm_prefix_cache_hit_rate", "Prompt tokens served by the prefix cache / tokens looked up",
             s.prefix_cache_hit_rate),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        spec = s.speculation
        if spec is not None:  # a draft is loaded: its counters since start (vLLM's spec_decode_* as counters)
            for name, doc, key in (
                ("optllm_spec_decode_num_drafts", "Sequence-steps that verified a draft tree", "seq_steps"),
                ("optllm_spec_decode_num_draft_tokens", "Draft tokens verified", "drafted"),
                ("optllm_spec_decode_num_accepted_tokens", "Draft tokens accepted", "accepted"),
            ):
                yield CounterMetricFamily(name, doc, value=spec[key])
            yield GaugeMetricFamily("optllm_spec_decode_mean_accepted_length",
                                    "Tokens emitted per speculative sequence-step (accepted + 1), since start",
                                    value=spec["mean_accepted_length"])
            h = CounterMetricFamily("optllm_spec_decode_accepted_length",
                                    "Sequence-steps by draft tokens accepted", labels=["accepted"])
            for k, n in enumerate(spec["histogram"]):
                h.add_metric([str(k)], n)
            yield h


class ServerMetrics:
    def __init__(self, engine) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("optllm_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("optllm_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.generation_tokens = Counter("optllm_generation_tokens", "Tokens generated", registry=self.registry)
        self.ttft = Histogram("optllm_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=_LATENCY, registry=self.registry)
        self.itl = Histogram("optllm_inter_token_latency_seconds", "Time per output token after the first",
                             buckets=_LATENCY, registry=self.registry)
        self.registry.register(_EngineGauges(engine))

    def render(self) -> bytes:
        return generate_latest(self.registry)
