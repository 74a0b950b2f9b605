"""Probe (device call 17-1, retired after it): after the inline keys and the dropped output view, where autosel's Triton rmsnorm spends its host time per eager call (1 x 4096 bf16): the
whole wrapper, FastLaunch's call with prebuilt arguments, the compiled kernel's run alone, the keys alone,
torch.empty_like, and flashinfer's rmsnorm. Median of 5 runs of 2000 calls each, us per call (wall)."""
import json, statistics, sys, time
import torch
from autosel.ops import triton_kernels as tk, vendor_flashinfer as vf
from autosel.ops.triton_launch import arg_key, args_key, _current_stream
from triton import knobs

x = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16); w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
out = torch.empty_like(x)
tk.rmsnorm(x, w, 1e-6); tk.rmsnorm(x, w, 1e-6)
L = tk._launch_rmsnorm_kernel
(key, kernel), = [(k, v) for k, v in L.compiled.items() if k[2][3] is False]
args = (x, x, w, out, 1, 4096, 4096, 0, 4096, 1e-6); consts = key[2]; warps = key[1]
stream = _current_stream(0)
cases = {
    "wrapper tk.rmsnorm": lambda: tk.rmsnorm(x, w, 1e-6),
    "FastLaunch call": lambda: L((1,), args, consts, warps),
    "kernel.run alone": lambda: kernel.run(1, 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None, *args, *consts),
    "arg keys, inline (args_key)": lambda: (0, warps, consts, args_key(args)),
    "arg keys, one call each (arg_key)": lambda: (0, warps, consts, *map(arg_key, args)),
    "out.view(-1, 4096)": lambda: out.view(-1, 4096),
    "current_device+stream": lambda: _current_stream(torch.cuda.current_device()),
    "torch.empty_like": lambda: torch.empty_like(x),
    "JIT launch": lambda: tk._rmsnorm_kernel[(1,)](*args, *consts, num_warps=warps),
    "flashinfer rmsnorm": lambda: vf.rmsnorm(x, w, 1e-6),
    "torch.add": lambda: torch.add(x, 1),
}
res = {}
for name, f in cases.items():
    runs = []
    for _ in range(5):
        torch.cuda.synchronize(); t = time.perf_counter()
        for _ in range(2000): f()
        runs.append((time.perf_counter() - t) / 2000 * 1e6)
        torch.cuda.synchronize()
    res[name] = statistics.median(runs)
    print(f"{name:24s} {res[name]:6.2f} us", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
