"""Probe (one device call; retire once its figures are in docs/H200.md): the host and device time per eager call
of flashinfer's public wrappers against autosel's direct calls of the compiled functions behind them
(autosel/ops/vendor_flashinfer.py), beside sgl_kernel, triton and autosel's own eager pick, at Llama-3-8B's
shapes. autosel.timing.host_and_device_us (64 calls behind a sleep kernel), the variants in turn, 11 rounds;
medians, us per call.

    AUTOSEL_TUNE=off python3 tools/vendor_host_probe.py OUT.json
"""
import json
import statistics
import sys

import flashinfer
import torch

import autosel
from autosel.ops import vendor_flashinfer as vf
from autosel.timing import host_and_device_us

dev, bf16 = "cuda", torch.bfloat16


def inputs(tokens):
    x = torch.randn(tokens, 4096, device=dev, dtype=bf16)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=dev) / 128))
    ang = torch.outer(torch.arange(8192, dtype=torch.float32, device=dev), inv)
    return {"x": x, "r": torch.randn_like(x), "w": torch.randn(4096, device=dev, dtype=bf16),
            "a": torch.randn(tokens, 2 * 14336, device=dev, dtype=bf16),
            "pos": torch.randint(0, 8192, (tokens,), device=dev), "q": torch.randn(tokens, 4096, device=dev, dtype=bf16),
            "k": torch.randn(tokens, 1024, device=dev, dtype=bf16), "cache": torch.cat((ang.cos(), ang.sin()), -1)}


PUBLIC = {
    "layernorm.rmsnorm": lambda t: flashinfer.norm.rmsnorm(t["x"], t["w"], 1e-6, enable_pdl=False),
    "layernorm.fused_add_rmsnorm": lambda t: flashinfer.norm.fused_add_rmsnorm(t["x"], t["r"], t["w"], 1e-6,
                                                                                enable_pdl=False),
    "activation.silu_and_mul": lambda t: flashinfer.activation.silu_and_mul(t["a"], enable_pdl=False),
    "embeddings.rope": lambda t: flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        t["pos"], t["q"], t["k"], 128, t["cache"], True),
}
ARGS = {
    "layernorm.rmsnorm": lambda t: (t["x"], t["w"], 1e-6),
    "layernorm.fused_add_rmsnorm": lambda t: (t["x"], t["r"], t["w"], 1e-6),
    "activation.silu_and_mul": lambda t: (t["a"],),
    "embeddings.rope": lambda t: (t["pos"], t["q"], t["k"], 128, t["cache"], True),
}


def cases(tokens):
    t = inputs(tokens)
    out = {}
    for op, public in PUBLIC.items():
        args = ARGS[op](t)
        out[f"{op} flashinfer public"] = lambda public=public: public(t)
        for backend in ("flashinfer", "sgl_kernel", "triton", None):
            fn = autosel.get_kernel(op, backend, mode="eager")
            out[f"{op} {backend or 'autosel eager'}"] = lambda fn=fn, args=args: fn(*args)
    x, a = t["x"], t["a"]
    out["piece torch.empty_like(x)"] = lambda: torch.empty_like(x)
    out["piece x.new_empty(shape)"] = lambda: a.new_empty(a.shape[:-1] + (a.shape[-1] // 2,))
    out["piece torch.empty(shape, device, dtype)"] = lambda: torch.empty(
        a.shape[:-1] + (a.shape[-1] // 2,), device=a.device, dtype=a.dtype)
    out["piece torch.cuda.get_device_capability"] = lambda: torch.cuda.get_device_capability(x.device)
    out["piece q.view(T, -1, 128)"] = lambda: t["q"].view(t["q"].shape[0], -1, 128)
    return out


results = {}
for tokens in (1, 512):
    calls = cases(tokens)
    for fn in calls.values():
        fn()  # first calls: JIT loads, Triton compiles
    torch.cuda.synchronize()
    rounds = {name: [] for name in calls}
    for _ in range(11):
        for name, fn in calls.items():
            rounds[name].append(host_and_device_us(fn, calls=64))
    for name, rs in rounds.items():
        host, device = statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)
        results[f"{tokens} tokens: {name}"] = {"host_us": round(host, 2), "device_us": round(device, 2)}
        print(f"{tokens:4d} tokens  {name:52s} host {host:7.2f}  device {device:7.2f}", flush=True)
json.dump(results, open(sys.argv[1], "w"), indent=1)
