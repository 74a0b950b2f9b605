"""autosel.timing on this CPU: what a CUDA-graph sampler keeps alive (torch's CUDA-graph API faked here; the replays
themselves run in tests/gpu)."""

from __future__ import annotations

import contextlib
import gc
import weakref

import pytest

from autosel.timing import graph_sampler

torch = pytest.importorskip("torch")


class _Event:
    def __init__(self, enable_timing=False):
        pass

    def record(self):
        pass

    def synchronize(self):
        pass

    def elapsed_time(self, other):
        return 1.0


class _Graph:
    def replay(self):
        pass


@pytest.fixture
def cuda_graph_api(monkeypatch):
    for name, value in {"Event": _Event, "Stream": lambda: None, "stream": lambda s: contextlib.nullcontext(),
                        "CUDAGraph": _Graph, "graph": lambda g: contextlib.nullcontext(),
                        "synchronize": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)


def test_a_graph_sampler_keeps_what_its_graph_reads_alive_while_it_lives(cuda_graph_api):
    # Used to let go of fn: a plan built for the capture was freed and its buffers reused while the graph still read
    # them (`autosel bench attention-step` on the H200: K/V gathered at garbage slots, a device-side assert).
    class Plan:
        calls = 0

    plan = Plan()
    alive = weakref.ref(plan)

    def step(plan=plan):
        plan.calls += 1

    sample = graph_sampler(step)
    del plan, step
    gc.collect()
    assert alive() is not None and alive().calls > 1  # warmed up and captured
    assert sample() > 0
    del sample
    gc.collect()
    assert alive() is None
