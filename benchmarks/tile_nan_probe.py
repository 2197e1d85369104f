"""Forty-second session: where the tiles' NaN at M >= 128 (benchmarks/w4a16_tile.py) comes from."""
import torch

from optllm.benchmarks.common import sym_int4
from optllm.kernels import w4a16 as w4k
from optllm.kernels import w4a16_mma as mk
from optllm.kernels import w4a16_mma_tile as tk

torch.manual_seed(0)
for n, k in ((4096, 4096), (4096, 14336), (28672, 4096)):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, s = sym_int4(w, 128)
    p = w4k.prepack_w4a16(q, s.to(torch.bfloat16), None, 128, dtype=torch.bfloat16)
    mw = mk.from_w4a16(p)
    for m in (64, 128, 256, 32):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ w4k.dequantize_w4a16(p).t()
        for cfg in (tk.TileConfig(), tk.TileConfig(split_k=2), tk.TileConfig(split_k=8),
                    tk.TileConfig(4, 2, 4, split_k=4)):
            cnt = tk._counters(x.device)
            before = int((cnt != 0).sum())
            y = tk.w4a16_mma_tile(x, mw, None, cfg)
            torch.cuda.synchronize()
            after = int((cnt != 0).sum())
            bad = ~torch.isfinite(y)
            err = ((y.float() - ref).norm() / ref.norm()).item() if not bad.any() else float("nan")
            rows = bad.any(1).nonzero().flatten().tolist()
            cols = bad.any(0).nonzero().flatten().tolist()
            print(f"N={n} K={k} M={m} {cfg.warps}x{cfg.rt}x{cfg.nt}k{cfg.split_k} counters!=0 {before}->{after} "
                  f"nonfinite {int(bad.sum())} rows {rows[:3]}..{rows[-3:] if rows else ''} ({len(rows)}) "
                  f"cols {cols[:2]}..{cols[-2:] if cols else ''} ({len(cols)}) err {err:.2e}", flush=True)
            if bad.any():  # again into y's block filled with 7.0 first: entries the kernel does not write stay 7
                junk = torch.full((m, n), 7.0, device="cuda", dtype=torch.bfloat16)
                del junk
                y3 = tk.w4a16_mma_tile(x, mw, None, cfg)
                torch.cuda.synchronize()
                seven = (y3 == 7.0)
                print("   again: nonfinite", int((~torch.isfinite(y3)).sum()), "sevens", int(seven.sum()),
                      "rows", seven.any(1).nonzero().flatten().tolist()[:4], "cols",
                      seven.any(0).nonzero().flatten().tolist()[:4], "counters!=0", int((cnt != 0).sum()),
                      "max", int(cnt.max()), flush=True)
