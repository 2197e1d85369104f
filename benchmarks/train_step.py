"""train-draft's optimizer step, timed per phase, for each draft method on one synthetic batch.

    python benchmarks/train_step.py [--target smollm2-135m] [--methods medusa,eagle,eagle3]
        [--batch-size 16] [--seq-len 512] [--steps 10] [--device cuda] [--cpu-time] [--profile]
        [--dataset DATASET.jsonl [--pad-to N]]

The step is train.py's (accelerate, bf16 autocast on CUDA, float32 on the CPU): the frozen target's
features (no grad), the draft's loss, backward, gradient clipping, AdamW. The batch is right-padded
like _collate's: the first quarter of each row a prompt (not trained on), the last eighth of every
other row padding. Reports ms per step (median; CUDA synchronized per phase) as target forward /
draft + loss forward / backward + optimizer (--cpu-time: the CPU seconds of this process instead of
wall time, for a CPU shared with other work), the peak device memory, and with --profile the
profiler's top ops of two steps (CUDA time on CUDA, CPU time otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--methods", default="medusa,eagle,eagle3")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cpu-time", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--dataset", default=None, help="a train-draft dataset.jsonl: time steps over its micro-batches "
                    "as train.py draws them (real, varying lengths) instead of one synthetic batch")
    ap.add_argument("--pad-to", type=int, default=None, help="--dataset: round padded lengths up to a multiple of "
                    "this (default: train.py's own on this device)")
    args = ap.parse_args()

    from accelerate import Accelerator

    from optllm.speculative.methods import DRAFT_METHODS
    from optllm.speculative.target import load_target
    from optllm.speculative.train import DraftConfig

    cuda = args.device.startswith("cuda")
    acc = Accelerator(cpu=not cuda, mixed_precision="bf16" if cuda else "no")
    target, _ = load_target(args.target, "bfloat16" if cuda else "float32", acc.device)
    b, t = args.batch_size, args.seq_len
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (b, t), generator=g)
    attn = torch.ones(b, t, dtype=torch.long)
    attn[1::2, t - t // 8:] = 0
    mask = attn.bool().clone()
    mask[:, : t // 4] = False
    ids, attn, mask = ids.to(acc.device), attn.to(acc.device), mask.to(acc.device)
    batches = [(ids, attn, mask)] * (args.steps + 1)
    if args.dataset:
        from optllm.speculative.data import read_dataset
        from optllm.speculative.train import _PAD_MULTIPLE, _collate, _micro_batch

        seqs = read_dataset(Path(args.dataset))
        pad_to = args.pad_to or (_PAD_MULTIPLE if cuda else 1)
        batches = [_collate(_micro_batch(seqs, i, b, 0), acc.device, pad_to) for i in range(args.steps + 1)]
        t = round(statistics.mean(x[0].shape[1] for x in batches))

    def sync() -> float:
        if cuda:
            torch.cuda.synchronize()
        return time.process_time() if args.cpu_time else time.perf_counter()

    for name in args.methods.split(","):
        method = DRAFT_METHODS[name]
        cfg = DraftConfig(target=args.target, out="unused", method=name)
        draft = method.build(target, cfg.num_heads, cfg)
        opt = torch.optim.AdamW(draft.parameters(), lr=1e-4)
        draft, opt = acc.prepare(draft, opt)

        _step(acc, method, target, draft, opt, batches[0], sync)  # warm-up
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times: list = []
        for batch in batches[1:]:
            times.append(_step(acc, method, target, draft, opt, batch, sync))
        ms = [1e3 * statistics.median(col) for col in zip(*times)]
        peak = f", peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if cuda else ""
        if args.dataset:
            print(f"{name}: per step ms " + " ".join(f"{1e3 * x[0]:.0f}" for x in times), flush=True)
        print(f"{name}: {ms[0]:.1f} ms/step (target fwd {ms[1]:.1f}, draft+loss fwd {ms[2]:.1f}, "
              f"bwd+opt {ms[3]:.1f}) at {b}x{t} on {args.device}{peak}", flush=True)
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            with profile(activities=acts) as p:
                for batch in batches[1:3]:
                    _step(acc, method, target, draft, opt, batch, sync)
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(p.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=50), flush=True)
        del draft, opt
        acc.free_memory()


def _step(acc, method, target, draft, opt, batch, sync) -> tuple[float, float, float, float]:
    """One optimizer step as train.py takes it: (total, target forward, draft + loss forward,
    backward + optimizer) seconds."""
    ids, attn, mask = batch
    t0 = sync()
    hidden = method.features(acc.unwrap_model(draft), target, ids, attn)
    t1 = sync()
    with acc.autocast():
        loss = method.loss(draft, hidden.float(), ids, mask)
    t2 = sync()
    acc.backward(loss)
    acc.clip_grad_norm_(draft.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    t3 = sync()
    return t3 - t0, t1 - t0, t2 - t1, t3 - t2


if __name__ == "__main__":
    main()
