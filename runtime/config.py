"""Engine and scheduler configuration, validated on construction (ValueError naming the field)."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "fp8")
QUANTIZED_LINEAR = ("kernel", "dequant")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# the most nodes an EAGLE-2 tree may have: kernels/tree_grow.MAX_NODES (not imported: this module
# stays free of torch; tests/runtime/test_spec_tree.py holds the two equal)
TREE_MAX_NODES = 128
KERNELS = ("auto", "triton", "torch")
LOAD_FORMATS = ("auto", "dummy")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_num_seqs: sequences running at once. max_num_batched_tokens: tokens one step
    computes (prompt chunks + decodes). max_model_len: prompt + output tokens of one
    sequence. block_size: tokens per KV block. enable_prefix_caching: reuse full KV blocks
    of identical prefixes. admit_group: while sequences decode and requests wait, admit only
    once min(admit_group, waiting) of them fit at once, or a place has stood empty for
    admit_max_wait steps (1: admit as soon as a place frees). Each admission makes a step mixed
    (prefill + decodes), which runs eagerly instead of as a CUDA-graph decode: under a full
    server's staggered arrivals at batch 64, 110 of 468 steps (benchmarks/admission_steps.py;
    27 with admit_group 8), for a few steps' longer wait to the first token."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    max_model_len: int = 4096
    block_size: int = 16
    enable_prefix_caching: bool = True
    admit_group: int = 1
    admit_max_wait: int = 8

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "admit_group", "admit_max_wait"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 1")
        if self.block_size not in (8, 16, 32, 64):
            raise ValueError(f"block_size={self.block_size!r} is not allowed; allowed: 8, 16, 32, 64")


@dataclass(frozen=True)
class EngineConfig:
    """How the engine loads and runs a model.

    model: HF folder, built-in alias, or an optllm checkpoint. device: "auto" (cuda if
    available), "cpu", "cuda[:N]". dtype: compute dtype; "auto" = bfloat16 on CUDA,
    float32 on CPU. max_model_len: None = the model's max_position_embeddings.
    gpu_memory_utilization: share of the GPU's memory the engine may hold in all (weights,
    activations, KV cache); the KV cache gets what is left. num_kv_blocks: a fixed number
    of KV blocks instead (tests, benchmarks). kv_cache_dtype: "auto" (= dtype) or "fp8"
    (E4M3 with a scale per token and head). enforce_eager: no CUDA graphs.
    cuda_graph_max_batch: largest decode batch captured in a graph (bigger ones run eager); also
    the most sequences of a prefill or mixed step's graph. cuda_graph_max_tokens: the most tokens of
    a prefill or mixed (prefill + decode) step that replays a graph (0: those steps run eager; longer
    ones do: compute-bound, where the host's launches matter less).
    quantized_linear: "kernel" runs W4A16 checkpoints on the int4 kernels (their torch
    reference on CPU); "dequant" dequantizes every quantized weight at load.
    cpu_kv_cache_gib: KV cache size on CPU when num_kv_blocks is not given.
    kernels: "auto" (Triton on CUDA, the torch references on CPU), "triton" (also on CPU,
    under TRITON_INTERPRET=1: slow, for tests), "torch".
    load_format: "auto" reads the checkpoint's weights; "dummy" fills the model's shape with
    random weights (benchmarks: speed does not depend on the values; vLLM's name for it).
    admit_group: the scheduler's (SchedulerConfig): admissions grouped while sequences decode.
    8 by default: under a continuous load of staggered arrivals the plain engine on the H200 ran
    1.16x / 1.46x / 1.73x the tokens/s of admit_group 1 at batch 8 / 32 / 64 (docs/BENCHMARKS.md,
    twentieth session); a request waits at most admit_max_wait (8) decode steps longer.
    draft: a folder `optllm train-draft` wrote (Medusa or EAGLE): speculative decoding with
    it (None: off). spec_top_k / spec_depth / spec_num_draft: the EAGLE-2 dynamic tree (top-k
    children per expanded node, longest path, nodes besides the root); medusa_choices: the
    static tree of a Medusa draft (paths of top-k ranks; None: the built-in one). spec_policy:
    "adaptive" (a tree size per step, down to none, from acceptance and a start-up cost
    profile), "fixed" (the whole tree at every eligible decode), "auto" (adaptive on CUDA).
    spec_fuse: a step whose speculating sequences share it with rows that run eager anyway
    (prefill chunks: admissions) verifies the trees in the same target forward as those rows
    (one forward instead of two); False: the plain rows' forward first, then the speculative
    step's (OPTLLM_SPEC_FUSE=0 also turns it off, to compare the two end to end).
    """

    model: str
    device: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 4096
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enforce_eager: bool = False
    cuda_graph_max_batch: int = 256
    cuda_graph_max_tokens: int = 512
    quantized_linear: str = "kernel"
    cpu_kv_cache_gib: float = 1.0
    kernels: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    draft: str | None = None
    spec_top_k: int = 8
    spec_depth: int = 5  # the H200 with SmolLM2's EAGLE draft: 1.49x at batch 1, 1.11-1.26x at 6
    spec_num_draft: int = 40
    medusa_choices: tuple | None = None
    spec_policy: str = "auto"
    spec_fuse: bool = True
    admit_group: int = 8

    @classmethod
    def kv_blocks_for(cls, num_seqs: int, max_len: int) -> int:
        """KV blocks (of the default block size) that num_seqs sequences of up to max_len tokens
        need at once, with a block each for a lookahead past a block's end and a few spare: a
        cache sized to a workload instead of a share of the GPU's memory, so engines fit side by
        side (evaluations, benchmarks)."""
        return num_seqs * (-(-max_len // cls.block_size) + 1) + 16

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not allowed; allowed: {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} is not allowed; allowed: "
                             f"{', '.join(KV_CACHE_DTYPES)}")
        if self.quantized_linear not in QUANTIZED_LINEAR:
            raise ValueError(f"quantized_linear={self.quantized_linear!r} is not allowed; allowed: "
                             f"{', '.join(QUANTIZED_LINEAR)}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format={self.load_format!r} is not allowed; allowed: {', '.join(LOAD_FORMATS)}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels={self.kernels!r} is not allowed; allowed: {', '.join(KERNELS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} is not allowed; "
                             "allowed: a number in (0, 1]")
        for name in ("max_model_len", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 1 or None")
        for name in ("cuda_graph_max_batch", "cuda_graph_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 0")
        if not self.device or not (self.device in ("auto", "cpu") or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r} is not allowed; allowed: auto, cpu, cuda, cuda:N")
        if self.spec_policy not in ("auto", "adaptive", "fixed"):
            raise ValueError(f"spec_policy={self.spec_policy!r} is not allowed; allowed: auto, adaptive, fixed")
        for name in ("spec_top_k", "spec_depth", "spec_num_draft"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} is not allowed; allowed: an integer >= 1")
        most = min(1 + self.spec_top_k + (self.spec_depth - 1) * self.spec_top_k ** 2, TREE_MAX_NODES) - 1
        if self.spec_num_draft > most:
            raise ValueError(f"spec_num_draft={self.spec_num_draft} is not allowed; allowed: at most {most} (the "
                             f"candidates spec_top_k={self.spec_top_k} and spec_depth={self.spec_depth} produce, "
                             f"{TREE_MAX_NODES - 1} at most)")
        # the scheduler's own checks, early
        self.scheduler_config(self.max_model_len or 1)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=max_model_len,
            block_size=self.block_size,
            enable_prefix_caching=self.enable_prefix_caching,
            admit_group=self.admit_group,
        )
