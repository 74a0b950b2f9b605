"""The hot path's cost on this machine, with torch imported: what a bucket dispatcher adds to a call over
calling its winner directly (also behind autosel.by_tokens), and what a warm get_kernel(op) costs. Interleaved
repeats, medians. Kernels here return at once, so the figures are autosel's own cost, not a kernel's.

    autosel bench hot-path                 # writes results/hot_path-<platform>-<date>.json
    autosel bench hot-path --repeats 41
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import timeit
from typing import Callable

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


def run(*, repeats: int = 21, number: int = 20000, on_repeat: Callable[[int], None] = lambda done: None) -> dict:
    """Time every case `repeats` times, interleaved (every case once per repeat); return the result file's body."""
    if repeats < 2:
        raise ValueError(f"repeats={repeats}: give 2 or more (the p10-p90 spread needs two repeats)")
    if number < 1:
        raise ValueError(f"number={number}: give 1 or more calls per timed block")
    previous = os.environ.get("AUTOSEL_DB")
    os.environ["AUTOSEL_DB"] = os.path.join(tempfile.mkdtemp(), "bench.db")  # the user's DB is never touched
    try:
        cases = _cases()
    finally:
        os.environ.pop("AUTOSEL_DB") if previous is None else os.environ.update(AUTOSEL_DB=previous)
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for done in range(repeats):
        for name, fn in cases.items():
            samples[name].append(per_call_ns(fn, number))
        on_repeat(done + 1)
    med = {name: statistics.median(v) for name, v in samples.items()}
    rows = []
    for name, values in samples.items():
        deciles = statistics.quantiles(values, n=10)
        rows.append([name, round(med[name]), f"{deciles[0]:.0f}-{deciles[-1]:.0f}"])
    added = []
    for op in ("rmsnorm", "rope", "mm"):
        direct = next(v for n, v in med.items() if n.startswith("direct") and op in n)
        added += [[name.removeprefix("dispatcher, "), round(via - direct)] for name, via in med.items()
                  if name.startswith("dispatcher") and op in name]
    load = [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else None
    return {"repeats": repeats, "number": number, "python": sys.version.split()[0], "load_average": load,
            "samples_ns": {k: [round(x, 1) for x in v] for k, v in samples.items()},
            "tables": [{"title": f"{repeats} interleaved repeats of {number} calls; medians in ns per call.",
                        "columns": ["case", "ns per call", "p10-p90"], "rows": rows},
                       {"title": "Added by the dispatcher over the direct call of its winner:",
                        "columns": ["dispatcher", "ns per call"], "rows": added}],
            # Host time scales with what else the machine runs: a figure read at a load above its cores is not one.
            "notes": [f"load average over 1, 5 and 15 minutes when it ended: {load}; {os.cpu_count()} CPUs"]}


def _cases() -> dict[str, Callable[[], object]]:
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
    autosel.register_kernel(KernelSpec("bench.single", KernelBackend.TORCH, "autosel.bench.hot_path:noop"))
    selector.get_kernel("bench.single")  # warm
    selector.get_kernel("layernorm.rmsnorm", "torch")
    selector.get_kernel("bench.single", mode="eager")

    return {
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
        "warm get_kernel(op, mode='eager') (no capture check)":
            lambda: selector.get_kernel("bench.single", mode="eager"),
        "the per-call capture check get_kernel made before": old_capture_check,
    }
