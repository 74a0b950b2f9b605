"""The torch_compile backend: the torch implementations under torch.compile with dynamic shapes.

dynamic=True keeps one graph across token counts instead of recompiling per shape until the recompile limit.
"""

from __future__ import annotations

import torch

from autosel.ops import torch_impl

rmsnorm = torch.compile(torch_impl.rmsnorm, dynamic=True)
fused_add_rmsnorm = torch.compile(torch_impl.fused_add_rmsnorm, dynamic=True)
silu_and_mul = torch.compile(torch_impl.silu_and_mul, dynamic=True)
gelu_and_mul = torch.compile(torch_impl.gelu_and_mul, dynamic=True)
rope = torch.compile(torch_impl.rope, dynamic=True)
mm = torch.compile(torch_impl.mm, dynamic=True)
