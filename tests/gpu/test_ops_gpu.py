"""On a GPU: selection uses the graph-mode decision while a CUDA graph is captured (first: it is short), and
every installed backend of every built-in op matches the reference on every representative shape.
Skipped without CUDA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from autosel import checks, selector  # noqa: E402
from autosel.ops import GROUPS  # noqa: E402
from autosel.platforms import current_platform  # noqa: E402
from autosel.spec import KernelBackend as B  # noqa: E402

SPECS = [spec for group in GROUPS for spec in group.SPECS]
DEFINITIONS = {d.op: d for group in GROUPS for d in group.DEFINITIONS}


def test_graph_capture_uses_the_graph_mode_decision(monkeypatch, tmp_path):
    monkeypatch.setenv("AUTOSEL_BUDGET_S", "10")
    op = "activation.silu_and_mul"
    graph_spec = selector.select_kernel(op, mode="graph")
    eager_spec = selector.select_kernel(op, mode="eager")
    x = torch.randn(8, 2 * 14336, device="cuda", dtype=torch.bfloat16)
    selector.clear_cache()
    eager_fn = selector.get_kernel(op)
    graph = torch.cuda.CUDAGraph()
    captured = {}
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured["fn"] = selector.get_kernel(op)
        captured["out"] = captured["fn"](x)
    graph.replay()
    torch.cuda.synchronize()
    assert captured["fn"] is graph_spec.load()
    assert eager_fn is eager_spec.load()
    expected = next(s for s in SPECS if s.op == op and s.backend == B.TORCH).load()(x)
    assert checks.compare((captured["out"],), (expected,)).ok


def _cases():
    if not torch.cuda.is_available():
        return []
    platform = current_platform()
    return [(spec, shape) for spec in SPECS if spec.backend != B.TORCH and spec.is_available(platform)
            for shape in DEFINITIONS[spec.op].shapes_for(platform)]


@pytest.mark.parametrize("spec, shape", _cases(),
                         ids=lambda v: f"{v.op}-{v.backend.value}" if hasattr(v, "op") else
                         ",".join(f"{k}={x}" for k, x in v.items()))
def test_backend_matches_the_reference(spec, shape):
    definition = DEFINITIONS[spec.op]
    reference = next(s for s in SPECS if s.op == spec.op and s.backend == B.TORCH).load()
    torch.manual_seed(0)
    args = definition.make_inputs(dict(shape), "cuda")
    ref_args, got_args = checks.clone_args(args), checks.clone_args(args)
    expected = checks.outputs_of(reference(*ref_args), ref_args)
    outcome = checks.compare(checks.outputs_of(spec.load()(*got_args), got_args), expected)
    assert outcome.ok, outcome.reason
