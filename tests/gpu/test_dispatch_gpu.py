"""On a GPU: a bucket dispatcher built while a CUDA graph is captured is the graph-mode one, and the graph it
was captured into replays each bucket's own kernel. Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from conftest import use_registry  # noqa: E402

from autosel import selector, tuning  # noqa: E402
from autosel.decisions import CandidateResult, Decision, bucket_text  # noqa: E402
from autosel.ops import layernorm  # noqa: E402
from autosel.platforms import current_platform, version_vector  # noqa: E402
from autosel.registry import KernelRegistry  # noqa: E402
from autosel.spec import KernelBackend as B  # noqa: E402

OP = "layernorm.rmsnorm"


def stored(mode, bucket, winner, eligible, platform):
    """A row as `autosel tune` stores it (evidence trimmed)."""
    return Decision(op=OP, mode=mode, bucket=bucket, winner=winner, platform_key=platform.key,
                    versions=version_vector(platform, eligible),
                    candidates=tuple(CandidateResult(s.backend.value, "ok", score=1.0) for s in eligible),
                    margin=0.03, method="stored")


def test_a_dispatcher_captured_in_a_cuda_graph_replays_each_buckets_kernel(monkeypatch):
    monkeypatch.setenv("AUTOSEL_TUNE", "off")  # only the stored rows can answer
    registry = KernelRegistry()
    eligible = [s for s in layernorm.SPECS if s.op == OP and s.backend in (B.TORCH, B.TRITON)]
    for spec in eligible:
        registry.register(spec)
    registry.define(next(d for d in layernorm.DEFINITIONS if d.op == OP))
    use_registry(monkeypatch, registry)
    platform = current_platform()
    db = tuning.database()
    db.record(stored("eager", "*", "torch", eligible, platform), [])
    db.record(stored("graph", "*", "triton", eligible, platform),
              [stored("graph", bucket_text((1, 4096)), "torch", eligible, platform),
               stored("graph", bucket_text((8192, 4096)), "triton", eligible, platform)])
    torch.manual_seed(0)
    small, large = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16), torch.randn(
        6000, 4096, device="cuda", dtype=torch.bfloat16)  # 6000 tokens: bucket (8192, 4096)
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    kernels = {s.backend.value: s.load() for s in eligible}
    assert selector.get_kernel(OP) is kernels["torch"]  # eager: one winner, the plain kernel
    graph, captured = torch.cuda.CUDAGraph(), {}
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        fn = captured["fn"] = selector.get_kernel(OP)
        captured["small"], captured["large"] = fn(small, weight, 1e-6), fn(large, weight, 1e-6)
    small.copy_(torch.randn_like(small))  # new inputs, replayed by the graph
    large.copy_(torch.randn_like(large))
    graph.replay()
    torch.cuda.synchronize()
    assert captured["fn"].table.mode == "graph"
    assert torch.equal(captured["small"], kernels["torch"](small, weight, 1e-6))
    assert torch.equal(captured["large"], kernels["triton"](large, weight, 1e-6))
    assert selector.get_kernel(OP) is kernels["torch"]  # after capture: eager again


def test_a_dispatcher_under_torch_compile_fullgraph_calls_autosels_triton_kernel_as_one_custom_op():
    # autosel's Triton wrapper was traced and compiled again for every token count (fullgraph=True failed at the
    # ninth; flashinfer's calls broke the graph): compiled code calls each as a torch custom op, once per run.
    from autosel.dispatch import BucketTable, dispatcher, token_runs
    from autosel.ops.common import rows_bucket

    definition = next(d for d in layernorm.DEFINITIONS if d.op == OP)
    kernels = {s.backend.value: s.load() for s in layernorm.SPECS if s.op == OP and s.backend in (B.TORCH, B.TRITON)}
    table = BucketTable(OP, "graph", "torch", {(1, 4096): "torch", (4096, 4096): "triton", (16384, 4096): "triton"})
    assert len(token_runs(table, (), (4096,))) == 3
    fn = dispatcher(table, kernels, rows_bucket, 0, {b: definition.traced_kernel(b, k) for b, k in kernels.items()})
    weight = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    for how in (dict(fullgraph=True), dict(mode="reduce-overhead")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        step = torch.compile(lambda x: fn(x, weight, 1e-6) * 1.0, **how)
        for tokens in (1, 5, 100, 3000, 5000, 9000, 3, 12000, 40000, 700, 20000):
            x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
            out = step(x).clone()
            torch.testing.assert_close(out, kernels["torch"](x, weight, 1e-6), rtol=2e-2, atol=2e-2,
                                       msg=f"{how}, {tokens} tokens")
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4, how  # the first count, then per run
