"""GPU tests for autosel.ops.triton_launch: calls after the first take the direct launch, give the reference's
answer, get a kernel of their own when Triton would specialize differently, and can be captured in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU to launch Triton kernels")

EPS = 1e-6


def _kernels():
    from autosel.ops import triton_kernels

    return triton_kernels


def _ref_rmsnorm(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype) * weight


def _rows(tokens, width, *, offset=0):
    """[tokens, width] bf16 starting `offset` elements into a buffer (offset 1: 2 bytes off 16-byte alignment)."""
    buffer = torch.randn(tokens * width + offset, device="cuda").to(torch.bfloat16)
    return buffer[offset:].view(tokens, width)


def test_repeated_calls_take_the_direct_launch_and_match_the_reference():
    tk = _kernels()
    launcher = tk._launch_rmsnorm_kernel
    assert launcher.enabled
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    tk.rmsnorm(_rows(37, 4096), weight, EPS)
    kept = len(launcher.compiled)
    for _ in range(3):  # new data each time, the same specialization: no new kernel, right answers
        x = _rows(37, 4096)
        torch.testing.assert_close(tk.rmsnorm(x, weight, EPS), _ref_rmsnorm(x, weight), rtol=2e-2, atol=2e-2)
    assert len(launcher.compiled) == kept >= 1


@pytest.mark.parametrize("width, offset", [(4096, 1), (4100, 0), (4100, 1)], ids=["misaligned", "odd", "both"])
def test_a_call_triton_specializes_differently_gets_its_own_kernel(width, offset):
    """After an aligned call at 4096 columns, a misaligned input or a width not divisible by 16 must not run the
    kernel compiled for aligned, divisible arguments (its vector loads would read the wrong addresses)."""
    tk = _kernels()
    launcher = tk._launch_rmsnorm_kernel
    weight = torch.randn(width, device="cuda").to(torch.bfloat16)
    tk.rmsnorm(_rows(37, 4096), weight[:4096].contiguous(), EPS)
    before = set(launcher.compiled)
    for _ in range(2):  # the first compiles (or loads) the kernel, the second launches it directly
        x = _rows(37, width, offset=offset)
        torch.testing.assert_close(tk.rmsnorm(x, weight, EPS), _ref_rmsnorm(x, weight), rtol=2e-2, atol=2e-2)
    assert set(launcher.compiled) - before, "the differently specialized call reused a kept kernel"


def test_direct_launches_are_captured_in_a_cuda_graph():
    tk = _kernels()
    x, residual = _rows(64, 4096), _rows(64, 4096)
    weight = torch.randn(4096, device="cuda").to(torch.bfloat16)
    gate_up = _rows(64, 2 * 14336)
    tk.fused_add_rmsnorm(x.clone(), residual.clone(), weight, EPS)  # compile or load outside the capture
    tk.silu_and_mul(gate_up)
    torch.cuda.synchronize()
    static_x, static_res = x.clone(), residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tk.fused_add_rmsnorm(static_x, static_res, weight, EPS)
        activated = tk.silu_and_mul(gate_up)
    for _ in range(2):
        static_x.copy_(x)
        static_res.copy_(residual)
        graph.replay()
        torch.cuda.synchronize()
        summed = (x.float() + residual.float()).to(torch.bfloat16)
        torch.testing.assert_close(static_res, summed)
        torch.testing.assert_close(static_x, _ref_rmsnorm(summed, weight), rtol=2e-2, atol=2e-2)
        a, b = gate_up.float().chunk(2, dim=-1)
        torch.testing.assert_close(activated, (torch.nn.functional.silu(a) * b).to(torch.bfloat16),
                                   rtol=2e-2, atol=2e-2)
