#!/usr/bin/env python3
"""Probe (stop 15): do the vendors' PDL launches (programmatic dependent launch, on by default on sm_90 in
flashinfer's norms and activations and in autosel's sgl-kernel norm adapters) make back-to-back graph replays
of one kernel read faster than that kernel runs between other kernels? Each op/variant is timed by autosel's
CudaGraphTimer twice: alone (the tuner's graph method) and after a non-PDL neighbour (a small torch GEMM), the
neighbour's own time taken off. Prints both, over the best variant of each context.

    python3 tools/pdl_probe.py OUT.json   # on the GPU, after . tools/gpu_env.sh (docs/H200.md "PDL"; then retired)
"""
import json, statistics, sys
import torch
import flashinfer, sgl_kernel
from autosel.ops import triton_kernels as tk
from autosel.timing import CudaGraphTimer, measure_together

EPS = 1e-6
torch.manual_seed(0)
A = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
W = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
O = torch.empty(64, 2048, device="cuda", dtype=torch.bfloat16)
neighbour = lambda: torch.mm(A, W, out=O)

def variants(op, t):
    if op == "silu":
        x = torch.randn(t, 2 * 14336, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(t, 14336, device="cuda", dtype=torch.bfloat16)
        return {"flashinfer_pdl": lambda: flashinfer.activation.silu_and_mul(x, out, enable_pdl=True),
                "flashinfer_nopdl": lambda: flashinfer.activation.silu_and_mul(x, out, enable_pdl=False),
                "sgl_kernel": lambda: torch.ops.sgl_kernel.silu_and_mul.default(out, x),
                "triton": lambda: tk.silu_and_mul(x)}
    x = torch.randn(t, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    if op == "rmsnorm":
        out = torch.empty_like(x)
        return {"flashinfer_pdl": lambda: flashinfer.norm.rmsnorm(x, w, EPS, out=out, enable_pdl=True),
                "flashinfer_nopdl": lambda: flashinfer.norm.rmsnorm(x, w, EPS, out=out, enable_pdl=False),
                "sgl_pdl": lambda: torch.ops.sgl_kernel.rmsnorm.default(out, x, w, EPS, True),
                "sgl_nopdl": lambda: torch.ops.sgl_kernel.rmsnorm.default(out, x, w, EPS, False),
                "triton": lambda: tk.rmsnorm(x, w, EPS)}
    r = torch.randn_like(x)
    return {"flashinfer_pdl": lambda: flashinfer.norm.fused_add_rmsnorm(x, r, w, EPS, enable_pdl=True),
            "flashinfer_nopdl": lambda: flashinfer.norm.fused_add_rmsnorm(x, r, w, EPS, enable_pdl=False),
            "sgl_pdl": lambda: torch.ops.sgl_kernel.fused_add_rmsnorm.default(x, r, w, EPS, True),
            "sgl_nopdl": lambda: torch.ops.sgl_kernel.fused_add_rmsnorm.default(x, r, w, EPS, False),
            "triton": lambda: tk.fused_add_rmsnorm(x, r, w, EPS)}

def medians(calls):
    out = {}
    for _ in range(3):
        times, failed = measure_together(CudaGraphTimer(), calls, shape={})
        assert not failed, failed
        for k, v in times.items():
            out.setdefault(k, []).append(statistics.median(v))
    return {k: statistics.median(v) for k, v in out.items()}

result = {}
for op in ("silu", "rmsnorm", "fused"):
    for t in (1, 8, 64, 600):
        vs = variants(op, t)
        alone = medians(vs)
        calls = {"neighbour": neighbour, **{k: (lambda f: lambda: (neighbour(), f()))(f) for k, f in vs.items()}}
        ctx = medians(calls)
        paired = {k: ctx[k] - ctx["neighbour"] for k in vs}
        result[f"{op} {t}"] = {"alone": alone, "after_neighbour": paired, "neighbour": ctx["neighbour"]}
        ba, bp = min(alone.values()), min(paired.values())
        print(f"{op:8s} {t:4d} alone: " + " ".join(f"{k}={v:.2f}({v / ba:.2f})" for k, v in alone.items()), flush=True)
        print(f"{op:8s} {t:4d} after: " + " ".join(f"{k}={v:.2f}({v / bp:.2f})" for k, v in paired.items())
              + f" neighbour={ctx['neighbour']:.2f}", flush=True)
json.dump(result, open(sys.argv[1], "w"), indent=1)
