"""Where an eager call of autosel's Triton rmsnorm spends its host time on a GPU machine: the whole
wrapper, the bare @triton.jit launch with the same arguments, a one-argument Triton kernel, one torch op,
and flashinfer's rmsnorm, each split into host and device parts (autosel.timing.host_and_device_us).

    python tools/launch_probe.py [--tokens 1] [--hidden 4096] [--repeat 5]   # on the GPU machine
    python tools/launch_probe.py --stub     # anywhere: the wrappers' own host time, launches stubbed out

Prints one line per call: the median over --repeat splits of its host and device time per call; with
--stub, the host time of each Triton wrapper with its kernel launch replaced by a no-op, and of the
host-side helpers a wrapper may call (timeit on CPU tensors).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import triton
import triton.language as tl


@triton.jit
def one_arg(x_ptr):
    tl.store(x_ptr + tl.program_id(0), 1.0)


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def stubbed(tokens: int, hidden: int) -> None:
    import timeit

    import torch

    from autosel.ops import triton_kernels as tk

    def us(fn, number: int = 20000) -> float:
        return timeit.timeit(fn, number=number) / number * 1e6

    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    w, residual, gated = torch.ones(hidden, dtype=torch.bfloat16), torch.randn_like(x), torch.cat([x, x], -1)
    for name in ("_rmsnorm_kernel", "_act_and_mul_kernel"):
        setattr(tk, name, _NoLaunch())
    print(f"tokens={tokens} hidden={hidden}; host us per call, kernel launches stubbed out")
    for name, fn in {"rmsnorm wrapper": lambda: tk.rmsnorm(x, w, 1e-6),
                     "fused_add_rmsnorm wrapper": lambda: tk.fused_add_rmsnorm(x, residual, w, 1e-6),
                     "silu_and_mul wrapper": lambda: tk.silu_and_mul(gated),
                     "triton.next_power_of_2": lambda: triton.next_power_of_2(hidden),
                     "triton.cdiv": lambda: triton.cdiv(tokens, 4),
                     "torch.empty(shape, dtype=, device=)": lambda: torch.empty(x.shape, dtype=x.dtype,
                                                                                 device=x.device),
                     "torch.empty_like": lambda: torch.empty_like(x)}.items():
        print(f"{name:45s} host {us(fn):7.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--stub", action="store_true", help="time the wrappers with their launches stubbed out")
    args = parser.parse_args()
    if args.stub:
        stubbed(args.tokens, args.hidden)
        return 0

    import torch

    from autosel.ops import triton_kernels as tk
    from autosel.timing import host_and_device_us

    x = torch.randn(args.tokens, args.hidden, device="cuda", dtype=torch.bfloat16)
    w = torch.ones(args.hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    block_n = triton.next_power_of_2(args.hidden)
    block_m = min(max(1, tk._TARGET_TILE // block_n), triton.next_power_of_2(args.tokens))
    grid = (triton.cdiv(args.tokens, block_m),)
    warps = tk._num_warps(block_m * block_n)
    small = torch.zeros(1, device="cuda")
    calls = {
        "autosel triton rmsnorm (whole wrapper)": lambda: tk.rmsnorm(x, w, 1e-6),
        "bare @triton.jit launch, same arguments": lambda: tk._rmsnorm_kernel[grid](
            x, x, w, out, args.tokens, args.hidden, x.stride(0), 0, out.stride(0), 1e-6,
            BLOCK_M=block_m, BLOCK_N=block_n, ONE_PASS=True, ADD_RESIDUAL=False, num_warps=warps),
        "one-argument @triton.jit kernel": lambda: one_arg[(1,)](small),
        "torch.add (one ATen op)": lambda: torch.add(small, 1),
        "torch.empty_like (allocation)": lambda: torch.empty_like(x),
    }
    try:
        import flashinfer

        calls["flashinfer.norm.rmsnorm"] = lambda: flashinfer.norm.rmsnorm(x, w, 1e-6)
    except Exception as exc:  # not installed here: say so and time the rest
        print(f"flashinfer: not timed ({type(exc).__name__}: {exc})")
    print(f"tokens={args.tokens} hidden={args.hidden}; host / device us per call, median of {args.repeat}")
    for name, fn in calls.items():
        for _ in range(3):
            fn()
        splits = [host_and_device_us(fn) for _ in range(args.repeat)]
        host = statistics.median(h for h, _ in splits)
        device = statistics.median(d for _, d in splits)
        print(f"{name:45s} host {host:7.1f}  device {device:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
