"""Probe (device call 16-2): autosel's Triton norms and activations launched through JITFunction.run (FastLaunch off) and
directly (FastLaunch on), beside flashinfer and sgl-kernel: eager back-to-back times on rotating copies (the
tuner's CudaEagerTimer) and the host/device split per call (timing.host_and_device_us)."""
import json, statistics, sys
import torch
from autosel import checks
from autosel.ops import triton_kernels as tk, vendor_flashinfer as vf, vendor as vs
from autosel.timing import CudaEagerTimer, host_and_device_us, measure_together

EPS = 1e-6
launchers = [tk._launch_rmsnorm_kernel, tk._launch_act_and_mul, tk._launch_rope]

def jit_path(fn):
    def call(*a):
        for l in launchers: l.enabled = False
        try:
            return fn(*a)
        finally:
            for l in launchers: l.enabled = True
    return call

cases = []
for t, n in ((1, 4096), (64, 4096), (600, 2304), (2900, 2304), (11000, 2880), (4096, 4096), (8192, 7168)):
    x = torch.randn(t, n, device="cuda", dtype=torch.bfloat16); w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    cases.append((f"rmsnorm {t}x{n}", (x, w, EPS), {"triton_fast": tk.rmsnorm, "triton_jit": jit_path(tk.rmsnorm),
                  "flashinfer": vf.rmsnorm, "sgl_kernel": vs.sgl_rmsnorm}))
    cases.append((f"fused {t}x{n}", (x, torch.randn_like(x), w, EPS), {"triton_fast": tk.fused_add_rmsnorm,
                  "triton_jit": jit_path(tk.fused_add_rmsnorm), "flashinfer": vf.fused_add_rmsnorm,
                  "sgl_kernel": vs.sgl_fused_add_rmsnorm}))
for t, d in ((1, 14336), (512, 28672), (4096, 14336)):
    x = torch.randn(t, 2 * d, device="cuda", dtype=torch.bfloat16)
    cases.append((f"silu {t}x{d}", (x,), {"triton_fast": tk.silu_and_mul, "triton_jit": jit_path(tk.silu_and_mul),
                  "flashinfer": vf.silu_and_mul}))
out = {}
timer = CudaEagerTimer()
for name, args, fns in cases:
    for f in fns.values():
        f(*args)  # compile / load, then the direct path's first kept kernel
    meds, splits = {}, {}
    for rnd in range(3):
        calls = {k: checks.rotating_call(f, args, timer.rotate_bytes) for k, f in fns.items()}
        times, failed = measure_together(timer, calls, shape={})
        for k, e in failed.items(): print(name, k, "FAILED", e, flush=True)
        for k, ts in times.items(): meds.setdefault(k, []).append(statistics.median(ts))
        for k, c in calls.items(): splits.setdefault(k, []).append(host_and_device_us(c))
        del calls
    med = {k: statistics.median(v) for k, v in meds.items()}
    host = {k: statistics.median(h for h, _ in v) for k, v in splits.items()}
    dev = {k: statistics.median(d for _, d in v) for k, v in splits.items()}
    out[name] = {"eager_us": med, "host_us": host, "device_us": dev}
    best = min(med.values())
    print(f"{name:18s} " + " ".join(f"{k}={med[k]:.1f}({med[k]/best:.2f};h{host[k]:.1f}/d{dev[k]:.1f})" for k in med), flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
