"""Timing calls with the field's tools: torch.utils.benchmark's Timer on CPU and for eager CUDA calls, CUDA graph
replay timed with events as triton.testing.do_bench_cudagraph does. The candidates of one shape are timed
together, block by block in turn (measure_together), so what the machine does meanwhile falls on all alike."""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from typing import Any, Callable, Protocol

from autosel.decisions import Measurement

log = logging.getLogger(__name__)

Sampler = Callable[[], float]  # times one block of calls, returns microseconds per call
ACTIVATIONS_WRITTEN = "activations written"  # graph timing's method suffix where the op's activations were written


class Timer(Protocol):
    """Times calls: `measure(fn)` returns per-call times in microseconds for `fn`; backend and shape let a fake
    timer tell calls apart.

    A SamplingTimer (every real timer is one) is measured together with the other candidates, block by
    block in turn (measure_together).
    A timer with a `rotate_bytes` attribute gets an `fn` that cycles through enough copies of the inputs
    to fill that many bytes (the tuner makes them), so calls do not find their inputs in a warm cache.
    A timer with a `host_and_device_us(fn)` method also splits a call into its host and device parts once
    per round (CudaEagerTimer does).
    """

    method: str

    def measure(self, fn: Callable[[], Any], *, backend: str, shape: dict) -> list[float]: ...


def measure_together(timer: Timer, calls: dict[str, Callable[[], Any]], *,
                     shape: dict) -> tuple[dict[str, list[float]], dict[str, BaseException]]:
    """Per-call times (us) of each call, and the exception of each call that raised (the others go on).

    With a sampling timer, the calls take turns block by block (A B C, B C A, ...) and the drift common to
    a block is taken out (common_drift_removed); otherwise (tests' fake timers) each is measured in turn.
    """
    times: dict[str, list[float]] = {}
    failed: dict[str, BaseException] = {}
    if not isinstance(timer, SamplingTimer):
        for backend, fn in calls.items():
            try:
                times[backend] = timer.measure(fn, backend=backend, shape=shape)
            except (Exception, SystemExit) as exc:  # a kernel calling sys.exit is a failed candidate
                failed[backend] = exc
        return times, failed
    samplers: dict[str, Sampler] = {}
    for backend, fn in calls.items():
        try:
            samplers[backend] = timer.sampler(fn)
        except (Exception, SystemExit) as exc:
            failed[backend] = exc
    began = time.perf_counter()
    for block in range(timer.blocks):
        if block >= timer.min_blocks and time.perf_counter() - began > timer.run_s * len(samplers):
            break  # slow calls: fewer blocks, so a turn stays near run_s per candidate
        turn = list(samplers)
        shift = block % len(turn) if turn else 0
        for backend in turn[shift:] + turn[:shift]:
            try:
                times.setdefault(backend, []).append(samplers[backend]())
            except (Exception, SystemExit) as exc:  # a kernel calling sys.exit is a failed candidate
                failed[backend] = exc
                del samplers[backend]
                times.pop(backend, None)
    return dict(zip(times, common_drift_removed(list(times.values())))), failed


def common_drift_removed(times: list[list[float]]) -> list[list[float]]:
    """Block k of every candidate, measured close in time, scaled by G / g_k: g_k is the geometric mean of the
    candidates' block k, G the median g_k. What the machine did during block k (a clock change, a busy
    neighbour) falls on every candidate alike and is taken out; each candidate's differences stay. With two
    candidates, the ratio of their medians is then the median of their paired ratios (an odd block count).
    On this project's 2-core CPU that steadied a ratio of two candidates 6-fold (docs/TUNING.md section 2).
    """
    if len(times) < 2:
        return times
    blocks = min(len(t) for t in times)
    means = [math.exp(statistics.fmean(math.log(t[k]) for t in times)) for k in range(blocks)]
    typical = statistics.median(means)
    return [[t[k] * typical / means[k] for k in range(blocks)] for t in times]


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


def block_sampler(fn, *, block_us: float = 1000.0) -> Sampler:
    """Times blocks of back-to-back calls of about `block_us` each with torch.utils.benchmark's Timer.timeit
    (which waits for the device at both ends of a block); sizing the block is the warm-up.

    Not blocked_autorange: with a device wait in each block it sizes one block to its whole run time
    (its overhead criterion), so it gave one sample per measurement on the H200.
    """
    import torch
    import torch.utils.benchmark as benchmark

    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    number = max(1, int(block_us * 1e-6 / timer.timeit(number=10).mean))
    return lambda: timer.timeit(number=number).mean * 1e6


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


class SamplingTimer:
    """A timer made of a Sampler: `blocks` samples per candidate, fewer (but `min_blocks`) where that would
    take over `run_s` seconds per candidate. measure(fn) times fn alone; measure_together interleaves."""

    blocks: int
    min_blocks = 5
    run_s = math.inf

    def sampler(self, fn) -> Sampler:
        raise NotImplementedError

    def measure(self, fn, *, backend: str = "", shape: dict | None = None) -> list[float]:
        times, failed = measure_together(self, {backend: fn}, shape=shape or {})
        if failed:
            raise failed[backend]
        return times[backend]


class CpuTimer(SamplingTimer):
    """Blocks of about a millisecond of back-to-back calls (block_sampler), with the thread count the process
    really uses. Short blocks taken in turn with the other candidates: the noise of a shared CPU comes in
    bursts longer than a block, so common_drift_removed can take it out."""

    method = "cpu:torch.utils.benchmark"
    run_s = 0.05  # per candidate and round, as blocked_autorange(min_run_time=0.05) took before

    def __init__(self, blocks: int = 50) -> None:
        self.blocks = blocks

    def sampler(self, fn) -> Sampler:
        return block_sampler(fn)


class CudaEagerTimer(SamplingTimer):
    """An eager call as a model step launches it: blocks of back-to-back calls (block_sampler), each call on
    the next of several input copies that together exceed the L2, so every call reads from memory.

    One view of the call: the host's launch time when that is longer (launch-bound shapes), else the device
    time. do_bench (events around one call after an L2 flush) saw the launch time only when the host fell
    behind its flush kernel, a race that moved decisions between two tunes on an H200 (docs/TUNING.md).
    """

    method = "cuda:back-to-back"
    rotate_bytes = 128 << 20  # input copies to cycle through: over twice an H100/H200 L2 (50 MB)
    blocks = 15

    def __init__(self) -> None:
        import torch

        if not hasattr(torch.cuda, "_sleep"):  # private torch API: without it the eager times stand alone
            log.warning("torch.cuda._sleep is missing in torch %s: eager decisions will not weigh the host's "
                        "speed (docs/TUNING.md section 4)", torch.__version__)
            self.host_and_device_us = None

    def sampler(self, fn) -> Sampler:
        return block_sampler(fn)

    def host_and_device_us(self, fn) -> tuple[float, float]:
        """The call's host and device parts, so the tuner can ask whether a win depends on the host's speed."""
        return host_and_device_us(fn)


def graph_sampler(fn, *, replay_ms: float = 2.5) -> Sampler:
    """Replays of one CUDA graph of back-to-back calls, timed with events: triton.testing.do_bench_cudagraph's
    method (warm-up, 5 eager calls to size the graph to about `replay_ms`, capture on a side stream), with the
    graph kept so that replays can take turns with other candidates' (do_bench_cudagraph replays only its
    own, ten times in a row)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(torch.cuda.Stream()):
        fn()
        start.record()
        for _ in range(5):
            fn()
        end.record()
        torch.cuda.synchronize()
        calls = max(1, int(replay_ms / max(start.elapsed_time(end) / 5, 1e-3)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
    torch.cuda.synchronize()

    def sample() -> float:
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / calls * 1e3

    # The graph's kernels read what fn holds (a plan's index buffers) by address, so the sampler holds fn. A caller
    # that kept only the sampler (`autosel bench attention-step`) had those buffers freed and reused by the next
    # backend's plan, and the replay gathered K/V at garbage slots: a device-side assert on the H200.
    sample.replayed = fn  # type: ignore[attr-defined]
    return sample


class CudaGraphTimer(SamplingTimer):
    """Replay from a CUDA graph, as decode steps run, so launch overhead does not pick the winner. The tuner has
    each replayed call write the op's activations first (writes_activations, OpDefinition.activations) and takes
    the writes' own replays off: replaying the call on inputs left as it left them put a gated activation whose
    input and output fill the L2 1.07-1.27x behind where a model's MLP has it ahead (commit 49a3813)."""

    method = f"cuda:graph-replay, {ACTIVATIONS_WRITTEN}"
    writes_activations = True
    # An op's weights (OpDefinition.weights) cycled through copies that exceed the L2 (50 MB on the H100/H200), as
    # a model step reads each layer's weights from memory (docs/TUNING.md section 2).
    weight_bytes = 128 << 20
    blocks = 10

    def __init__(self, replay_ms: float = 2.5) -> None:
        """replay_ms: each sample replays about this long. 2.5 ms, not do_bench_cudagraph's 10: waiting on
        replays was 39 s of a 179 s whole-library tune on the H200 at 10 ms (cProfile), 16 s of a 67 s one
        at 5 ms (py-spy); decisions still repeat at 2.5 ms (commit 0d49228)."""
        self.replay_ms = replay_ms

    def sampler(self, fn) -> Sampler:
        return graph_sampler(fn, replay_ms=self.replay_ms)


def reads_weights(timer) -> bool:
    """Whether the tuner gives each call timed by `timer` (an instance or its class) the next of its own copies of
    the op's weights (OpDefinition.weights): graph replays, which also write the activations first."""
    return bool(getattr(timer, "writes_activations", False) and getattr(timer, "weight_bytes", 0))


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
