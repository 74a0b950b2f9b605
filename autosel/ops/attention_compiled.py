"""The torch_compile backend of attention.decode and attention.extend: the torch backend's plans, with the gather
and the attention of `run` compiled by torch.compile (dynamic shapes: one graph across batch sizes and lengths).

The plan's index building stays eager: it runs once per step, and compiling it would only add guards on lengths.
"""

from __future__ import annotations

import torch

from autosel.ops import attention_torch
from autosel.ops.common import pin_triton_cache_dir

pin_triton_cache_dir()

supports = attention_torch.supports

_decode = torch.compile(attention_torch.decode, dynamic=True)
_extend = torch.compile(attention_torch.extend, dynamic=True)


class DecodePlan(attention_torch.DecodePlan):
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return _decode(q, k_cache, v_cache, self.slots, self.mask, self.batch.scale)


class ExtendPlan(attention_torch.ExtendPlan):
    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return _extend(q, k_cache, v_cache, self.slots, self.q_index, self.mask, self.out_index, self.batch.scale)
