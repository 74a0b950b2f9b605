"""The hot path's cost on this machine, with torch imported: what a bucket dispatcher adds to a call over
calling its winner directly (also behind autosel.by_tokens), and what a warm get_kernel(op) costs. Interleaved repeats, medians, one run.

    python tools/dispatch_bench.py               # table in Markdown (docs/BENCHMARKS.md has one)
    python tools/dispatch_bench.py --repeats 41

Kernels here return at once, so the figures are autosel's own cost, not a kernel's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import timeit

import torch

import autosel
from autosel import selector
from autosel.dispatch import BucketTable, dispatcher
from autosel.ops.common import rows_bucket
from autosel.ops.embeddings import rope_bucket
from autosel.ops.gemm import mm_bucket
from autosel.spec import KernelBackend, KernelSpec


def noop(*args, **kwargs):
    return None


def old_capture_check() -> bool:
    """get_kernel's per-call check before the dispatcher (autosel 9a80d01): asked torch every call."""
    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def per_call_ns(fn, number: int) -> float:
    return timeit.timeit(fn, number=number) / number * 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--number", type=int, default=20000, help="calls per timed block")
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats {args.repeats}: give 2 or more (the p10-p90 spread needs two repeats)")
    if args.number < 1:
        parser.error(f"--number {args.number}: give 1 or more calls per timed block")

    os.environ["AUTOSEL_DB"] = os.path.join(tempfile.mkdtemp(), "bench.db")
    x, w = torch.randn(8, 4096), torch.randn(4096)
    positions, q, k, cache = torch.arange(8), torch.randn(8, 4096), torch.randn(8, 1024), torch.randn(4096, 128)
    a, b = torch.randn(8, 4096), torch.randn(6144, 4096)
    table = BucketTable("bench.op", "eager", "torch", {(8, 4096): "triton", (16384, 4096): "torch"})
    norm = dispatcher(table, {"torch": noop, "triton": noop}, rows_bucket)
    norm_routed = dispatcher(table, {"torch": noop, "triton": noop}, rows_bucket, route_key=0)  # as built in
    rope = dispatcher(BucketTable("bench.rope", "eager", "torch", {(8, 4096, True): "triton",
                                                                   (1, 4096, True): "torch"}),
                      {"torch": noop, "triton": noop}, rope_bucket)
    mm_table = BucketTable("bench.mm", "eager", "torch", {(8, "6144x4096"): "triton", (1, "6144x4096"): "torch"})
    mm = dispatcher(mm_table, {"torch": noop, "triton": noop}, mm_bucket)
    mm_routed = dispatcher(mm_table, {"torch": noop, "triton": noop}, mm_bucket, route_key=(0, 1))  # as built in
    graph_norm = dispatcher(table, {"torch": noop, "triton": noop}, rows_bucket, route_key=0)
    prefill_norm = autosel.by_tokens(norm_routed, graph_norm, 1024)  # eager below 1024 tokens, graph from there
    autosel.register_kernel(KernelSpec("bench.single", KernelBackend.TORCH, "tools.dispatch_bench:noop"))
    sys.modules.setdefault("tools.dispatch_bench", sys.modules[__name__])
    selector.get_kernel("bench.single")  # warm
    selector.get_kernel("layernorm.rmsnorm", "torch")
    selector.get_kernel("bench.single", mode="eager")

    cases = {
        "direct call of the winner (rmsnorm args)": lambda: noop(x, w, 1e-6),
        "dispatcher, rmsnorm bucket (tokens, hidden)": lambda: norm(x, w, 1e-6),
        "dispatcher, rmsnorm routed by x.shape (route_key=0, built in)": lambda: norm_routed(x, w, 1e-6),
        "dispatcher, rmsnorm routed, behind autosel.by_tokens (two dispatchers by token count)":
            lambda: prefill_norm(x, w, 1e-6),
        "direct call of the winner (rope args)": lambda: noop(positions, q, k, 128, cache, True),
        "dispatcher, rope bucket (tokens, q width, neox)": lambda: rope(positions, q, k, 128, cache, True),
        "direct call of the winner (mm args)": lambda: noop(a, b),
        "dispatcher, mm bucket (m, weight)": lambda: mm(a, b),
        "dispatcher, mm routed by (a.shape, b.shape) (route_key=(0, 1), built in)": lambda: mm_routed(a, b),
        "warm get_kernel(op)": lambda: selector.get_kernel("bench.single"),
        "warm get_kernel(op, 'torch')": lambda: selector.get_kernel("layernorm.rmsnorm", "torch"),
        "warm get_kernel(op, mode='eager') (no capture check)": lambda: selector.get_kernel("bench.single", mode="eager"),
        "the per-call capture check get_kernel made before": old_capture_check,
    }
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):  # interleaved: every case once per repeat
        for name, fn in cases.items():
            samples[name].append(per_call_ns(fn, args.number))
    med = {name: statistics.median(v) for name, v in samples.items()}
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, {args.repeats} interleaved repeats of "
          f"{args.number} calls; medians in ns per call\n")
    print("| case | ns per call | p10-p90 |\n|---|---|---|")
    for name, values in samples.items():
        q10, q90 = statistics.quantiles(values, n=10)[0], statistics.quantiles(values, n=10)[-1]
        print(f"| {name} | {med[name]:.0f} | {q10:.0f}-{q90:.0f} |")
    print("\n| added by the dispatcher (over the direct call) | ns per call |\n|---|---|")
    for op in ("rmsnorm", "rope", "mm"):
        direct = next(v for n, v in med.items() if n.startswith("direct") and op in n)
        for name, via in med.items():
            if name.startswith("dispatcher") and op in name:
                print(f"| {name.removeprefix('dispatcher, ')} | {via - direct:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
