"""Timing one call with the field's tools: torch.utils.benchmark on CPU and for eager CUDA calls,
triton.testing.do_bench_cudagraph for CUDA graph replay."""

from __future__ import annotations

import functools
import logging
import statistics
import time
from typing import Any, Callable, Protocol

from autosel.decisions import Measurement

log = logging.getLogger(__name__)


class Timer(Protocol):
    """Returns per-call times in microseconds for `fn`; backend and shape let a fake timer tell calls apart.

    A timer with a `rotate_bytes` attribute gets an `fn` that cycles through enough copies of the inputs
    to fill that many bytes (the tuner makes them), so calls do not find their inputs in a warm cache.
    A timer with a `host_and_device_us(fn)` method also splits a call into its host and device parts once
    per round (CudaEagerTimer does).
    """

    method: str

    def measure(self, fn: Callable[[], Any], *, backend: str, shape: dict) -> list[float]: ...


def summarize(samples_us: list[float], method: str, rounds: list[list[float]] | None = None,
              splits: list[tuple[float, float]] | None = None) -> Measurement:
    """Median, p20, p80, MAD of all samples; with `rounds` (the samples of each round), each round's median too;
    with `splits` (host and device time per call, from host_and_device_us), the median of each."""
    ordered = sorted(samples_us)
    if len(ordered) == 1:
        p20 = p80 = ordered[0]
    else:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p20, p80 = deciles[1], deciles[7]
    median = statistics.median(ordered)
    return Measurement(median_us=median, p20_us=p20, p80_us=p80, samples=len(ordered), method=method,
                       mad_us=statistics.median(abs(t - median) for t in ordered),
                       round_medians_us=tuple(statistics.median(r) for r in rounds or () if r),
                       host_us=statistics.median(h for h, _ in splits) if splits else None,
                       device_us=statistics.median(d for _, d in splits) if splits else None)


def back_to_back_us(fn, *, samples: int = 15, block_us: float = 1000.0) -> list[float]:
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


def host_and_device_us(fn, *, calls: int = 32) -> tuple[float, float]:
    """An eager call's two costs, per call: the host's (Python, checks, the launch) and the device's.

    `calls` back-to-back calls are issued while a sleep kernel holds the GPU, so the host never waits for
    it: the wall time of issuing them is the host's part. CUDA events around the block, which the GPU
    then runs back to back, give the device's part. A call launched eagerly costs about the larger.
    If the sleep was over before the host had issued every call (the GPU may then have waited for the
    host), the block is timed again behind a sleep twice as long.
    """
    import torch

    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(4):
        fn()
    guess_ms = (time.perf_counter() - began) / 4 * 1e3
    torch.cuda.synchronize()
    for attempt in range(6):
        sleep_ms = 0.2 + 2 * calls * guess_ms * 2 ** attempt
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(int(sleep_ms * _sleep_cycles_per_ms()))
        start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        host_ms = (time.perf_counter() - began) * 1e3
        asleep = not start.query()  # the GPU had not reached the block yet: it never waited for the host
        end.record()
        end.synchronize()
        if asleep:
            break
    return host_ms / calls * 1e3, start.elapsed_time(end) / calls * 1e3


@functools.cache
def _sleep_cycles_per_ms() -> float:
    """torch.cuda._sleep counts clock cycles: about how many make a millisecond here (measured once per
    process, at whatever clock the GPU runs then; host_and_device_us checks the sleep lasted)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    return 1e6 / start.elapsed_time(end)


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


class CudaEagerTimer:
    """An eager call as a model step launches it: blocks of back-to-back calls (back_to_back_us), each call on
    the next of several input copies that together exceed the L2, so every call reads from memory.

    One view of the call: the host's launch time when that is longer (launch-bound shapes), else the device
    time. do_bench (events around one call after an L2 flush) saw the launch time only when the host fell
    behind its flush kernel, a race that moved decisions between two tunes on an H200 (docs/TUNING.md).
    """

    method = "cuda:back-to-back"
    rotate_bytes = 128 << 20  # input copies to cycle through: over twice an H100/H200 L2 (50 MB)

    def __init__(self) -> None:
        import torch

        if not hasattr(torch.cuda, "_sleep"):  # private torch API: without it the eager times stand alone
            log.warning("torch.cuda._sleep is missing in torch %s: eager decisions will not weigh the host's "
                        "speed (docs/TUNING.md section 4)", torch.__version__)
            self.host_and_device_us = None

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        return back_to_back_us(fn)

    def host_and_device_us(self, fn) -> tuple[float, float]:
        """The call's host and device parts, so the tuner can ask whether a win depends on the host's speed."""
        return host_and_device_us(fn)


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
        return CudaGraphTimer() if mode == "graph" else CudaEagerTimer()
    raise ValueError(f"no timer for device {device!r}; autosel times on cpu and cuda (CUDA or ROCm)")


def synchronize(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
