"""GPU tests for the paged attention backends (autosel.ops.attention_triton, _flashinfer, _fa3) against the gather +
SDPA reference: ragged batches, length-1 sequences, sequences ending mid-page, shuffled page tables, page sizes 1, 16
and 64, head_dim 64, 128 and 256, bf16 and fp16. A backend that is not installed is skipped; a case its `supports`
declines must be declined with a reason, never run wrong.

flashinfer compiles one module per (dtype, head_dim) and kind at first use, so the cases below keep to bf16 at the
three head dims and fp16 at 128, the variants the benchmark (tools/attention_bench.py) also runs.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from paged_attention_cases import TOL, make_batch, make_q, reference  # noqa: E402

BACKENDS = {"triton": ("autosel.ops.attention_triton", ("triton",)),
            "flashinfer": ("autosel.ops.attention_flashinfer", ("flashinfer",)),
            "fa3": ("autosel.ops.attention_fa3", ("sgl_kernel.flash_attn",))}
LAYOUTS = [(torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 256), (torch.float16, 128)]
# Ragged, with a length-1 sequence, lengths ending mid-page for every page size, and one past 1k tokens so that
# split-KV paths run.
DECODE_LENS = [1, 17, 64, 300, 1100]
# (prefix, new tokens): prefill (prefix 0), a one-token extend, and chunks on prefixes that end mid-page.
EXTEND_CASES = [(0, 1), (0, 77), (13, 1), (100, 64), (517, 200)]


def backend(name: str):
    module, needs = BACKENDS[name]
    for dep in needs:
        pytest.importorskip(dep)
    return importlib.import_module(module)


def run_case(module, plan_cls, *, decode, seq_lens, q_lens, page_size, dtype, head_dim, heads=(32, 8), **plan_kw):
    batch, k_cache, v_cache = make_batch(seq_lens=seq_lens, q_lens=q_lens, page_size=page_size,
                                         num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                                         dtype=dtype, device="cuda")
    reason = module.supports(batch)
    if reason is not None:
        assert isinstance(reason, str) and reason
        pytest.skip(f"declined: {reason}")
    q = make_q(batch, decode=decode)
    plan = plan_cls(batch, **plan_kw)
    out = plan.run(q, k_cache, v_cache)
    expected = reference(q, k_cache, v_cache, batch)
    assert out.shape == q.shape and out.dtype == q.dtype
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    return plan, q, k_cache, v_cache, out


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{str(lay[0])[6:]}-{lay[1]}")
@pytest.mark.parametrize("name", BACKENDS)
def test_decode(name, layout, page_size):
    module = backend(name)
    run_case(module, module.DecodePlan, decode=True, seq_lens=DECODE_LENS, q_lens=None, page_size=page_size,
             dtype=layout[0], head_dim=layout[1])


@pytest.mark.parametrize("heads", [(32, 1), (64, 8), (32, 32)], ids=["mqa", "group8", "mha"])
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_head_layouts(name, heads):
    module = backend(name)
    run_case(module, module.DecodePlan, decode=True, seq_lens=[5, 700], q_lens=None, page_size=16,
             dtype=torch.bfloat16, head_dim=128, heads=heads)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"{str(lay[0])[6:]}-{lay[1]}")
@pytest.mark.parametrize("name", ["flashinfer", "fa3"])
def test_extend(name, layout, page_size):
    module = backend(name)
    q_lens = [n for _, n in EXTEND_CASES]
    seq_lens = [p + n for p, n in EXTEND_CASES]
    run_case(module, module.ExtendPlan, decode=False, seq_lens=seq_lens, q_lens=q_lens, page_size=page_size,
             dtype=layout[0], head_dim=layout[1])


@pytest.mark.parametrize("name", ["triton", "flashinfer"])
def test_decode_plan_replays_in_a_cuda_graph(name):
    module = backend(name)
    kw = {"cuda_graph": True} if name == "flashinfer" else {}
    plan, q, k_cache, v_cache, eager = run_case(module, module.DecodePlan, decode=True, seq_lens=DECODE_LENS,
                                                q_lens=None, page_size=16, dtype=torch.bfloat16, head_dim=128, **kw)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        plan.run(q, k_cache, v_cache)  # warm-up on the capture stream, as torch's graph docs ask
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = plan.run(q, k_cache, v_cache)
    q.copy_(torch.randn_like(q))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, plan.run(q, k_cache, v_cache), rtol=0, atol=0)
