"""Speculative decoding in the runtime: token trees (tree.py), their verification by the
target (acceptance.py) and the KV bookkeeping after it (kv_compact.py). The tree attention
kernel itself is kernels/tree_attention.py; nothing here imports Triton or the kernels. What
runs a speculative step with the model and the draft is runtime/spec_runner.py."""
