"""Check on a GPU machine which flashinfer / sgl_kernel ops import, compile and match plain torch.

Run on the GPU machine after the preamble of tools/fetch_gpu_packages.sh:

    . .gpu/activate.sh && PYTHONUNBUFFERED=1 python3 tools/gpu_vendor_probe.py --out $OUT/gpu_vendor_probe.json

It never raises on a failing vendor op: every step records its outcome (or its error text) in the
JSON, so one device call answers every question. Standalone on purpose (no autosel import), so it
can run before the package does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import ctypes
import glob
import gzip
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.nn.functional as F

EPS = 1e-6
RESULT: dict[str, Any] = {}
OUT_PATH = "gpu_vendor_probe.json"


def log(msg: str) -> None:
    print(f"[probe {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save() -> None:
    with open(OUT_PATH, "w") as f:
        json.dump(RESULT, f, indent=1, default=str)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:600]}"


def step(name: str, fn: Callable[[], Any]) -> Any:
    """Run fn, store its value (or error) under RESULT[name]; save after each step."""
    t0 = time.perf_counter()
    try:
        value = fn()
        RESULT[name] = {"ok": True, "s": round(time.perf_counter() - t0, 3), "value": value}
    except BaseException as e:  # noqa: BLE001 - a failing vendor op is data, not a crash
        value = None
        RESULT[name] = {"ok": False, "s": round(time.perf_counter() - t0, 3), "error": error_text(e),
                        "trace": traceback.format_exc()[-1500:]}
    log(f"{name}: {'ok' if RESULT[name]['ok'] else RESULT[name]['error']}")
    save()
    return value


# ---------------------------------------------------------------- references (plain torch, fp32)
def ref_rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


def ref_fused_add_rmsnorm(x, r, w, eps):
    r_new = (x.float() + r.float()).to(x.dtype)
    return ref_rmsnorm(r_new, w, eps), r_new


def ref_act_and_mul(x, act):
    d = x.shape[-1] // 2
    return (act(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)


def ref_rope(positions, q, k, head_size, cache, is_neox):
    rot = cache.shape[-1]
    cos, sin = cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def apply(x):
        t = x.shape[0]
        xf = x.view(t, -1, head_size).float()
        xr, xp = xf[..., :rot], xf[..., rot:]
        if is_neox:
            x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
            o = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)
        else:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
            o = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)
        return torch.cat([o, xp], -1).reshape(t, -1).to(x.dtype)

    return apply(q), apply(k)


def err(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    d = (a.float() - b.float()).abs()
    return {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
            "ref_max_abs": float(b.float().abs().max())}


def median_us(fn: Callable[[], Any], iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000)
    times.sort()
    return round(times[len(times) // 2], 2)


# ---------------------------------------------------------------- op checks (canonical calls)
DT = torch.bfloat16
NORM_SHAPES = [(3, 4096), (256, 5120)]
ACT_SHAPES = [(3, 2 * 4096), (256, 2 * 14336)]
# (tokens, nq, nk, head_size, rotary_dim, is_neox)
ROPE_CASES = [(5, 32, 8, 128, 128, True), (128, 32, 8, 128, 128, False),
              (64, 16, 4, 128, 64, True)]
MAX_POS = 4096


def cos_sin_cache(rotary_dim: int) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device="cuda").float() / rotary_dim))
    f = torch.outer(torch.arange(MAX_POS, device="cuda").float(), inv)
    return torch.cat([f.cos(), f.sin()], -1).contiguous()  # float32 [max_pos, rotary_dim]


def check_rmsnorm(fn) -> dict:
    out = {}
    for t, h in NORM_SHAPES:
        x = torch.randn(t, h, device="cuda", dtype=DT)
        w = torch.randn(h, device="cuda", dtype=DT)
        e = err(fn(x, w, EPS), ref_rmsnorm(x, w, EPS))
        out[f"{t}x{h}"] = {**e, "pass": e["max_abs"] <= 0.02 * max(1.0, e["ref_max_abs"])}
    x = torch.randn(*NORM_SHAPES[-1], device="cuda", dtype=DT)
    w = torch.randn(NORM_SHAPES[-1][1], device="cuda", dtype=DT)
    out["median_us_" + "x".join(map(str, NORM_SHAPES[-1]))] = median_us(lambda: fn(x, w, EPS))
    return out


def check_fused_add_rmsnorm(fn) -> dict:
    out = {}
    for t, h in NORM_SHAPES:
        x = torch.randn(t, h, device="cuda", dtype=DT)
        r = torch.randn(t, h, device="cuda", dtype=DT)
        w = torch.randn(h, device="cuda", dtype=DT)
        want_x, want_r = ref_fused_add_rmsnorm(x, r, w, EPS)
        ret = fn(x, r, w, EPS)
        ex, er = err(x, want_x), err(r, want_r)
        out[f"{t}x{h}"] = {"x": ex, "residual": er, "returned_none": ret is None,
                           "pass": ex["max_abs"] <= 0.03 * max(1.0, ex["ref_max_abs"])
                           and er["max_abs"] <= 0.02 * max(1.0, er["ref_max_abs"])}
    x = torch.randn(*NORM_SHAPES[-1], device="cuda", dtype=DT)
    r = torch.randn(*NORM_SHAPES[-1], device="cuda", dtype=DT)
    w = torch.randn(NORM_SHAPES[-1][1], device="cuda", dtype=DT)
    out["median_us_" + "x".join(map(str, NORM_SHAPES[-1]))] = median_us(lambda: fn(x, r, w, EPS))
    return out


def gelu_erf(v):
    return F.gelu(v, approximate="none")


def gelu_tanh(v):
    return F.gelu(v, approximate="tanh")


def check_act(fn, act) -> dict:
    out = {}
    for t, h2 in ACT_SHAPES:
        x = torch.randn(t, h2, device="cuda", dtype=DT)
        e = err(fn(x), ref_act_and_mul(x, act))
        out[f"{t}x{h2}"] = {**e, "pass": e["max_abs"] <= 0.02 * max(1.0, e["ref_max_abs"])}
    if act in (gelu_erf, gelu_tanh):
        # bf16 rounding hides erf-vs-tanh; fp16 inputs where the two differ most tell them apart.
        x = (torch.rand(64, 2 * 4096, device="cuda") * 6 - 3).half()
        x[:, 4096:] = 1.0
        y = fn(x)
        out["fp16_mean_abs_vs_erf"] = float((y.float() - ref_act_and_mul(x, gelu_erf).float()).abs().mean())
        out["fp16_mean_abs_vs_tanh"] = float((y.float() - ref_act_and_mul(x, gelu_tanh).float()).abs().mean())
        out["is_erf_gelu"] = out["fp16_mean_abs_vs_erf"] < out["fp16_mean_abs_vs_tanh"]
    x = torch.randn(*ACT_SHAPES[-1], device="cuda", dtype=DT)
    out["median_us_" + "x".join(map(str, ACT_SHAPES[-1]))] = median_us(lambda: fn(x))
    return out


def check_rope(fn, cache_dtype=torch.float32) -> dict:
    out = {}
    for t, nq, nk, hs, rot, neox in ROPE_CASES:
        cache = cos_sin_cache(rot).to(cache_dtype)
        pos = torch.randint(0, MAX_POS, (t,), device="cuda", dtype=torch.int64)
        q = torch.randn(t, nq * hs, device="cuda", dtype=DT)
        k = torch.randn(t, nk * hs, device="cuda", dtype=DT)
        want_q, want_k = ref_rope(pos, q, k, hs, cache.float(), neox)
        ret = fn(pos, q, k, hs, cache, neox)
        eq, ek = err(q, want_q), err(k, want_k)
        out[f"t{t}_nq{nq}_nk{nk}_hs{hs}_rot{rot}_neox{int(neox)}"] = {
            "q": eq, "k": ek, "returned_none": ret is None,
            "pass": max(eq["max_abs"], ek["max_abs"]) <= 0.03 * max(1.0, eq["ref_max_abs"])}
    t, nq, nk, hs, rot, neox = 256, 32, 8, 128, 128, True
    cache = cos_sin_cache(rot).to(cache_dtype)
    pos = torch.randint(0, MAX_POS, (t,), device="cuda", dtype=torch.int64)
    q = torch.randn(t, nq * hs, device="cuda", dtype=DT)
    k = torch.randn(t, nk * hs, device="cuda", dtype=DT)
    out["median_us_t256_nq32_nk8_hs128"] = median_us(lambda: fn(pos, q, k, hs, cache, neox))
    return out


def check_all(prefix: str, ops: dict[str, Callable]) -> None:
    for op, fn in ops.items():
        name = f"{prefix}.{op}"
        if op.endswith("rmsnorm") and "fused" not in op:
            step(name, lambda fn=fn: check_rmsnorm(fn))
        elif "fused_add_rmsnorm" in op:
            step(name, lambda fn=fn: check_fused_add_rmsnorm(fn))
        elif op == "silu_and_mul":
            step(name, lambda fn=fn: check_act(fn, F.silu))
        elif op == "gelu_and_mul":
            step(name, lambda fn=fn: check_act(fn, gelu_erf))
        elif op == "gelu_tanh_and_mul":
            step(name, lambda fn=fn: check_act(fn, gelu_tanh))
        elif op.startswith("rope"):
            step(name, lambda fn=fn: check_rope(fn))
            if not RESULT[name]["ok"]:
                step(name + ".cache_in_query_dtype", lambda fn=fn: check_rope(fn, DT))


# ---------------------------------------------------------------- flashinfer JIT
JIT_MODULES = {
    "norm": "from flashinfer.jit.norm import gen_norm_module as g; spec = g()",
    "rope": "from flashinfer.jit.rope import gen_rope_module as g; spec = g()",
    "silu_and_mul": "from flashinfer.jit.activation import gen_act_and_mul_module as g; spec = g('silu')",
    "gelu_and_mul": "from flashinfer.jit.activation import gen_act_and_mul_module as g; spec = g('gelu')",
    "gelu_tanh_and_mul": "from flashinfer.jit.activation import gen_act_and_mul_module as g; spec = g('gelu_tanh')",
}
BUILD_SNIPPET = """
import json, time
t0 = time.perf_counter()
{make}
t1 = time.perf_counter()
aot = bool(spec.is_aot)
spec.build_and_load()
t2 = time.perf_counter()
print("PROBE_JSON" + json.dumps({{"spec_s": round(t1 - t0, 2), "build_and_load_s": round(t2 - t1, 2),
      "aot": aot, "so": str(spec.get_library_path()) if not aot else str(spec.aot_artifacts[0].path)}}))
"""


def build_one(name: str, timeout_s: float) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-c", BUILD_SNIPPET.format(make=JIT_MODULES[name])],
                           capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"timeout after {timeout_s}s", "wall_s": round(time.perf_counter() - t0, 1)}
    info: dict[str, Any] = {"ok": p.returncode == 0, "rc": p.returncode,
                            "wall_s": round(time.perf_counter() - t0, 1)}
    for line in p.stdout.splitlines():
        if line.startswith("PROBE_JSON"):
            info.update(json.loads(line[len("PROBE_JSON"):]))
    if p.returncode != 0:
        info["stderr_tail"] = (p.stderr or "")[-3000:]
    return info


def build_jit(timeout_s: float, parallel: bool) -> dict:
    names = list(JIT_MODULES)
    t0 = time.perf_counter()
    if parallel:
        with concurrent.futures.ThreadPoolExecutor(len(names)) as ex:
            futs = {n: ex.submit(build_one, n, timeout_s) for n in names}
            out = {n: f.result() for n, f in futs.items()}
    else:
        out = {n: build_one(n, timeout_s) for n in names}
    out["_total_wall_s"] = round(time.perf_counter() - t0, 1)
    out["_parallel"] = parallel
    return out


# ---------------------------------------------------------------- environment / ABI evidence
def env_info() -> dict:
    info: dict[str, Any] = {
        "python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0), "capability": torch.cuda.get_device_capability(0),
        "torch_has_dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
        or hasattr(torch.Tensor, "__c_dlpack_exchange_api__"),
        "nvcc_which": shutil.which("nvcc"), "CUDA_HOME": os.environ.get("CUDA_HOME"),
        "nproc": os.cpu_count(),
    }
    for cmd in (["nvcc", "--version"], ["/usr/local/cuda/bin/nvcc", "--version"]):
        try:
            info["nvcc_version"] = subprocess.run(cmd, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            break
        except Exception:  # noqa: BLE001
            continue
    for mod in ("cuda.bindings", "tvm_ffi", "ninja", "einops", "pynvml"):
        try:
            m = __import__(mod, fromlist=["_"])
            info[f"have_{mod}"] = getattr(m, "__version__", True)
        except Exception as e:  # noqa: BLE001
            info[f"have_{mod}"] = error_text(e)
    return info


def old_sgl_abi(undef_path: str) -> dict:
    """Which torch C++ symbols the old sgl-kernel wheel imports are missing from this torch."""
    with gzip.open(undef_path, "rt") as f:
        wanted = [s.strip() for s in f if s.strip()]
    libdir = os.path.join(os.path.dirname(torch.__file__), "lib")
    libs = [ctypes.CDLL(p) for p in sorted(glob.glob(os.path.join(libdir, "lib*.so*")))
            if any(k in p for k in ("libc10", "libtorch"))]
    missing = [s for s in wanted if not any(hasattr(lib, s) for lib in libs)]
    return {"wanted": len(wanted), "missing": len(missing), "missing_examples": missing[:8]}


def preload_cuda_libs() -> dict:
    """Load the CUDA 13 libraries sgl_kernel's common_ops.abi3.so links by soname, if the loader
    cannot find them itself (pip CUDA wheels live under site-packages/nvidia/, off the default path)."""
    done = {}
    for soname in ("libnvrtc.so.13", "libcublas.so.13", "libcublasLt.so.13", "libcudart.so.13"):
        try:
            ctypes.CDLL(soname, mode=ctypes.RTLD_GLOBAL)
            done[soname] = "found by loader"
            continue
        except OSError:
            pass
        roots = {os.path.dirname(os.path.dirname(torch.__file__))} | set(sys.path)
        hits = sorted(h for r in roots if os.path.isdir(r)
                      for h in glob.glob(os.path.join(r, "nvidia", "**", soname + "*"), recursive=True))
        hits += sorted(glob.glob(f"/usr/local/cuda*/lib*/{soname}*"))
        for h in hits:
            try:
                ctypes.CDLL(h, mode=ctypes.RTLD_GLOBAL)
                done[soname] = h
                break
            except OSError as e:
                done[soname] = error_text(e)
        done.setdefault(soname, "not found")
    return done


def summarize(entry: dict) -> bool:
    """A step passes if it ran and every check (or JIT module) inside it passed."""
    value = entry.get("value")
    checks = value.values() if isinstance(value, dict) else []
    return bool(entry["ok"]) and all(c.get("pass", c.get("ok", True)) for c in checks if isinstance(c, dict))


# ---------------------------------------------------------------- main
def main() -> None:
    global OUT_PATH
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "gpu_vendor_probe.json"))
    ap.add_argument("--jit-timeout-s", type=float, default=300)
    ap.add_argument("--sequential-jit", action="store_true", help="build modules one by one (exact per-op times)")
    ap.add_argument("--cache-tar", default="", help="write the built flashinfer JIT modules (.so) here as .tar.gz")
    ap.add_argument("--jit-only", action="store_true", help="only import flashinfer and build/load its JIT modules")
    args = ap.parse_args()
    OUT_PATH = args.out
    RESULT["argv"] = sys.argv
    step("env", env_info)

    # flashinfer: import, JIT builds (in subprocesses, so a hung nvcc cannot stop the probe), ops.
    fi = step("flashinfer.import", lambda: __import__("flashinfer").__version__)
    if fi is not None:
        step("flashinfer.jit_build", lambda: build_jit(args.jit_timeout_s, not args.sequential_jit))
        if args.jit_only:
            return
        import flashinfer.activation as fa
        import flashinfer.norm as fn
        import flashinfer.rope as fr
        check_all("flashinfer", {
            "rmsnorm": lambda x, w, eps: fn.rmsnorm(x, w, eps),
            "fused_add_rmsnorm": lambda x, r, w, eps: fn.fused_add_rmsnorm(x, r, w, eps),
            "silu_and_mul": lambda x: fa.silu_and_mul(x),
            "gelu_and_mul": lambda x: fa.gelu_and_mul(x),
            "gelu_tanh_and_mul": lambda x: fa.gelu_tanh_and_mul(x),
            "rope": fr.apply_rope_with_cos_sin_cache_inplace,
        })
        if args.cache_tar:
            from flashinfer.jit import env as jit_env
            ws = str(jit_env.FLASHINFER_WORKSPACE_DIR)

            def tar_cache():
                # Only the loadable modules: they are what FLASHINFER_AOT_DIR reuse needs.
                sos = sorted(glob.glob(os.path.join(ws, "cached_ops", "*", "*.so")))
                with tarfile.open(args.cache_tar, "w:gz") as t:
                    for so in sos:
                        t.add(so, arcname=os.path.relpath(so, ws))
                return {"workspace": ws, "bytes": os.path.getsize(args.cache_tar),
                        "so_bytes": {os.path.basename(so): os.path.getsize(so) for so in sos}}
            step("flashinfer.jit_cache_tar", tar_cache)

    # sgl_kernel (sglang-kernel 0.4.5): its public rmsnorm/fused_add_rmsnorm delegate to
    # flashinfer.norm when flashinfer imports, so the _internal functions are checked as well.
    step("preload_cuda_libs", preload_cuda_libs)
    sk = step("sgl_kernel.import", lambda: __import__("sgl_kernel").__version__)
    if sk is not None:
        import sgl_kernel
        import sgl_kernel.elementwise as se
        step("sgl_kernel.schemas", lambda: {n: str(getattr(torch.ops.sgl_kernel, n).default._schema)
                                            for n in ("rmsnorm", "fused_add_rmsnorm", "silu_and_mul",
                                                      "gelu_and_mul", "rotary_embedding")})
        check_all("sgl_kernel", {
            "rmsnorm": lambda x, w, eps: sgl_kernel.rmsnorm(x, w, eps),
            "internal_rmsnorm": lambda x, w, eps: se._rmsnorm_internal(x, w, eps, None, None),
            "fused_add_rmsnorm": lambda x, r, w, eps: sgl_kernel.fused_add_rmsnorm(x, r, w, eps),
            "internal_fused_add_rmsnorm": lambda x, r, w, eps: se._fused_add_rmsnorm_internal(x, r, w, eps, None),
            "silu_and_mul": lambda x: sgl_kernel.silu_and_mul(x),
            "gelu_and_mul": lambda x: sgl_kernel.gelu_and_mul(x),
            "gelu_tanh_and_mul": lambda x: sgl_kernel.gelu_tanh_and_mul(x),
            "rope_rotary_embedding": sgl_kernel.rotary_embedding,
        })

    undef = sorted(glob.glob(".gpu/sgl_kernel-*.undef.txt.gz"))
    if undef:
        step("old_sgl_kernel_abi", lambda: old_sgl_abi(undef[0]))
    RESULT["summary"] = {k: summarize(v) for k, v in RESULT.items() if isinstance(v, dict) and "ok" in v}
    save()
    log("summary: " + json.dumps(RESULT["summary"]))


if __name__ == "__main__":
    main()
