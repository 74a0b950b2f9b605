#!/usr/bin/env python3
"""The Triton rmsnorm at 4, 8 and 16 warps (one padded block per row) and as a chunked two-pass loop, beside
flashinfer and sgl-kernel, on the H200: graph replay at every shape, eager rotation at 2900 and 9000 tokens.
Served one finding (docs/H200.md, "The Triton rmsnorm's warps", device call 15-2), then retired.

    python3 tools/rmsnorm_warps_probe.py OUT.json     # on the GPU, after . tools/gpu_env.sh
"""
import json, statistics, sys, itertools
import torch
from autosel import checks
from autosel.ops import triton_kernels as tk
from autosel.timing import CudaEagerTimer, CudaGraphTimer, measure_together
import flashinfer, sgl_kernel

EPS = 1e-6
def launch(x, r, w, block_n, warps, one_pass=True):
    n_rows, n_cols = x.shape
    out = x if r is not None else torch.empty_like(x)
    tk._rmsnorm_kernel[(n_rows,)](
        x, r if r is not None else x, w, out, n_rows, n_cols, x.stride(0),
        r.stride(0) if r is not None else 0, x.stride(0), EPS, BLOCK_M=1, BLOCK_N=block_n,
        ONE_PASS=one_pass, ADD_RESIDUAL=r is not None, num_warps=warps)
    return out

def variants(n, fused):
    np2 = tk.next_power_of_2(n)
    v = {}
    for w in (4, 8, 16):
        v[f"pad_w{w}"] = (lambda w: lambda x, r, wt: launch(x, r if fused else None, wt, np2, w))(w)
    for c, w in ((512, 2), (1024, 4), (2048, 8)):
        v[f"loop{c}_w{w}"] = (lambda c, w: lambda x, r, wt: launch(x, r if fused else None, wt, c, w, one_pass=False))(c, w)
    if fused:
        v["flashinfer"] = lambda x, r, wt: flashinfer.norm.fused_add_rmsnorm(x, r, wt, EPS)
        v["sgl_kernel"] = lambda x, r, wt: sgl_kernel.fused_add_rmsnorm(x, r, wt, EPS)
    else:
        v["flashinfer"] = lambda x, r, wt: flashinfer.norm.rmsnorm(x, wt, EPS)
        v["sgl_kernel"] = lambda x, r, wt: sgl_kernel.rmsnorm(x, wt, EPS)
    return v

out = {}
for fused, n, t in itertools.product((False, True), (2304, 3840, 4096, 5376, 8192), (1, 64, 600, 2900, 9000)):
    torch.manual_seed(0)
    x = torch.randn(t, n, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(t, n, device="cuda", dtype=torch.bfloat16) if fused else None
    wt = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    vs = variants(n, fused)
    if not fused:  # every Triton variant against the fp32 reference
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + EPS) * wt.float()).bfloat16()
        for name, f in vs.items():
            if name.startswith(("pad", "loop")):
                assert torch.allclose(f(x, r, wt).float(), ref.float(), rtol=2e-2, atol=2e-2), (n, t, name)
    key = f"{'fused' if fused else 'rmsnorm'} {t}x{n}"
    for mode, timer in (("graph", CudaGraphTimer(replay_ms=2.5)), ("eager", CudaEagerTimer())):
        if mode == "eager" and t < 2900:
            continue
        rot = getattr(timer, "rotate_bytes", 0)
        meds = {}
        for rnd in range(2):
            args = (x, r if r is not None else x, wt)
            calls = {k: checks.rotating_call(f, args, rot) for k, f in vs.items()}
            times, failed = measure_together(timer, calls, shape={})
            for k, e in failed.items(): print(key, mode, k, "FAILED", e, flush=True)
            for k, ts in times.items(): meds.setdefault(k, []).append(statistics.median(ts))
            del calls
        med = {k: statistics.median(v) for k, v in meds.items()}
        best = min(med.values())
        out[f"{key} {mode}"] = med
        print(f"{key:20s} {mode:5s} " + " ".join(f"{k}={v:.2f}({v/best:.2f})" for k, v in med.items()), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
