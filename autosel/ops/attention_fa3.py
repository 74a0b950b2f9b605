"""FlashAttention-3 from sgl-kernel (`sgl_kernel.flash_attn.flash_attn_with_kvcache`) as plans for attention.decode
and attention.extend, and `supports`.

FA3 reads autosel's cache layout as it is (`[pages, page_size, kv_heads, head_dim]` with a page table and
`cache_seqlens`), so a plan only fixes the call's per-batch arguments: the page table, the sequence lengths, the
query offsets (cu_seqlens_q) and the longest query. Causal masking is FA3's bottom-right alignment: query i of
sequence b sits at seq_len - q_len + i. FA3 picks its own KV split count and GQA packing per call.

What runs: the sm_90a kernels only (Hopper), and of those only what the carried library keeps
(tools/trim_fa3.py): head_dim 64, 128 and 256 (query and value alike), bf16 and fp16, without softcap. Any page size
works: a page that is no multiple of FA3's KV tile takes its gather (non-TMA) path.
"""

from __future__ import annotations

import torch

from autosel.ops.attention_support import layout_reason

_HEAD_DIMS = (64, 128, 256)
_DTYPES = (torch.bfloat16, torch.float16)


def supports(batch) -> str | None:
    """None where FA3 runs this batch's case on this batch's device, else why not."""
    # fp8 would need descales autosel does not pass; other head dims are not in the carried library.
    reason = layout_reason(batch, backend="sgl-kernel's FA3 as carried (tools/trim_fa3.py)", head_dims=_HEAD_DIMS,
                           dtypes=_DTYPES)
    if reason is not None:
        return reason
    device = torch.device(batch.device)
    if device.type != "cuda":
        return f"FA3 runs on CUDA devices, the batch is on {batch.device}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"sgl-kernel's FA3 is carried for sm_90 (Hopper) only, device is sm_{major}{minor}"
    return None


class _Plan:
    def __init__(self, batch):
        reason = supports(batch)
        if reason is not None:
            raise ValueError(f"FA3 paged attention cannot run this batch: {reason}")
        from sgl_kernel.flash_attn import flash_attn_with_kvcache

        self._fn = flash_attn_with_kvcache
        self.batch = batch
        self.page_table = batch.page_table if batch.page_table.is_contiguous() else batch.page_table.contiguous()
        self.max_q_len = max(batch.q_lens_list)

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        return self._fn(q, k_cache, v_cache, cache_seqlens=batch.seq_lens, page_table=self.page_table,
                        cu_seqlens_q=batch.cu_q_lens, max_seqlen_q=self.max_q_len, softmax_scale=batch.scale,
                        causal=True)


class DecodePlan(_Plan):
    """attention.decode through FA3: q is [batch, heads, head_dim], one token per sequence (cu_seqlens_q 0..batch)."""

    def __init__(self, batch):
        if any(q != 1 for q in batch.q_lens_list):
            raise ValueError("FA3 decode takes one query token per sequence; use ExtendPlan for this batch")
        super().__init__(batch)


class ExtendPlan(_Plan):
    """attention.extend through FA3: q is [sum(q_lens), heads, head_dim], sequences concatenated in batch order."""
