"""The torch_compile backend: the torch implementations under torch.compile with dynamic shapes.

dynamic=True keeps one graph across token counts instead of recompiling per shape until the recompile limit.
Rope is compiled with torch.compile's default instead (automatic dynamic: the first shape static, then each
dimension that changes made dynamic, head_size kept a constant): with every size and head_size symbolic its
compiles cost 20-35% more, all in sympy, and they were the largest check of a warm tune on the H200 (commit 8e2f5b6).
"""

from __future__ import annotations

import torch

from autosel.ops import torch_impl
from autosel.ops.common import pin_triton_cache_dir

pin_triton_cache_dir()

rmsnorm = torch.compile(torch_impl.rmsnorm, dynamic=True)


def _add_rmsnorm_into_residual(x, residual, weight, eps):
    summed = x.float() + residual.float()
    residual.copy_(summed)
    return summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


_add_rmsnorm_compiled = torch.compile(_add_rmsnorm_into_residual, dynamic=True)


def fused_add_rmsnorm(x, residual, weight, eps) -> None:
    # Inductor (torch 2.13, CPU) fails with "KeyError: 'buf1'" on a graph that writes both inputs around a
    # reduction, so the graph writes the residual and x is written back by one extra copy outside it.
    torch_impl.check_fused_add_rmsnorm(x, residual, weight)  # outside the graph: the torch backend's errors
    x.copy_(_add_rmsnorm_compiled(x, residual, weight, eps))


silu_and_mul = torch.compile(torch_impl.silu_and_mul, dynamic=True)
gelu_and_mul = torch.compile(torch_impl.gelu_and_mul, dynamic=True)
rope = torch.compile(torch_impl.rope)
mm = torch.compile(torch_impl.mm, dynamic=True)
