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


def launch_times_us(fn, *, samples: int = 15, block_us: float = 1000.0) -> list[float]:
    """Per-call wall time of back-to-back calls: `samples` blocks of about `block_us` each, timed with
    torch.utils.benchmark's Timer.timeit (which waits for the device at both ends of a block).

    Not blocked_autorange: with a device wait in each block it sizes one block to its whole run time
    (its overhead criterion), so it gave one sample per measurement on the H200.
    """
    import torch
    import torch.utils.benchmark as benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    number = max(1, int(block_us * 1e-6 / timer.timeit(number=10).mean))
    return [timer.timeit(number=number).mean * 1e6 for _ in range(samples)]


def slower_view(device_us: list[float], launch_us: list[float]) -> list[float]:
    """Of two views of one eager call, the samples of the one with the larger median.

    An eager call costs the larger of its device time and its host launch time. Events around one call
    after an L2 flush see the device time, and see the launch time only when the host falls behind the
    flush kernel, a race whose outcome changed between two tunes on an H200 (docs/TUNING.md section 7).
    Back-to-back calls timed on the wall clock see the launch time, and the device time only with a warm L2.
    """
    return launch_us if statistics.median(launch_us) > statistics.median(device_us) else device_us


class CpuTimer:
    """torch.utils.benchmark's blocked_autorange, with the thread count the process really uses."""

    method = "cpu:torch.utils.benchmark"

    def __init__(self, min_run_time_s: float = 0.05) -> None:
        self.min_run_time_s = min_run_time_s

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        import torch
        import torch.utils.benchmark as benchmark

        timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
        return [t * 1e6 for t in timer.blocked_autorange(min_run_time=self.min_run_time_s).times]


class CudaEventTimer:
    """An eager call: the slower of its device time (triton.testing.do_bench: events around one call, L2
    flushed before it) and its host launch time (launch_times_us: blocks of back-to-back calls)."""

    method = "cuda:max(do_bench,launch)"

    def __init__(self, warmup_ms: float = 5, rep_ms: float = 25) -> None:
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        from triton.testing import do_bench

        device = [t * 1e3 for t in do_bench(fn, warmup=self.warmup_ms, rep=self.rep_ms, return_mode="all")]
        return slower_view(device, launch_times_us(fn))


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
