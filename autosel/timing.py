"""Timing one call with the field's tools: torch.utils.benchmark on CPU, do_bench / do_bench_cudagraph on CUDA."""

from __future__ import annotations

import statistics
from typing import Any, Callable, Protocol

from autosel.decisions import Measurement


class Timer(Protocol):
    """Returns per-call times in microseconds for `fn`; backend and shape let a fake timer tell calls apart."""

    method: str

    def measure(self, fn: Callable[[], Any], *, backend: str, shape: dict) -> list[float]: ...


def summarize(samples_us: list[float], method: str, rounds: list[list[float]] | None = None) -> Measurement:
    """Median, p20, p80, MAD of all samples; with `rounds` (the samples of each round), each round's median too."""
    ordered = sorted(samples_us)
    if len(ordered) == 1:
        p20 = p80 = ordered[0]
    else:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p20, p80 = deciles[1], deciles[7]
    median = statistics.median(ordered)
    return Measurement(median_us=median, p20_us=p20, p80_us=p80, samples=len(ordered), method=method,
                       mad_us=statistics.median(abs(t - median) for t in ordered),
                       round_medians_us=tuple(statistics.median(r) for r in rounds or () if r))


class CpuTimer:
    """torch.utils.benchmark's blocked_autorange, with the thread count the process really uses."""

    method = "cpu:torch.utils.benchmark"

    def __init__(self, min_run_time_s: float = 0.05) -> None:
        self.min_run_time_s = min_run_time_s

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        import torch
        import torch.utils.benchmark as benchmark

        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        result = timer.blocked_autorange(min_run_time=self.min_run_time_s)
        return [t * 1e6 for t in result.times]


class CudaEventTimer:
    """Events around many launches after a warm-up, L2 flushed between calls: triton.testing.do_bench."""

    method = "cuda:do_bench"

    def __init__(self, warmup_ms: float = 5, rep_ms: float = 25) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        from triton.testing import do_bench

        return [t * 1e3 for t in do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="all")]


class CudaGraphTimer:
    """Replay from a CUDA graph, as decode steps run, so launch overhead does not pick the winner."""

    method = "cuda:do_bench_cudagraph"

    def __init__(self, rep_ms: float = 10) -> None:
        self.rep_ms = rep_ms

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        from triton.testing import do_bench_cudagraph

        return [t * 1e3 for t in do_bench_cudagraph(fn, rep=self.rep_ms, return_mode="all")]


def timer_for(device: str, mode: str) -> Timer:
    """The timer matching how the kernel will run: `device` is a torch device string, `mode` eager or graph."""
    if device == "cpu":
        return CpuTimer()
    if device == "cuda":
        return CudaGraphTimer() if mode == "graph" else CudaEventTimer()
    raise ValueError(f"no timer for device {device!r}; autosel times on cpu and cuda (CUDA or ROCm)")


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
