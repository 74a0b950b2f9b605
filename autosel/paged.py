"""PagedBatch: one step's batch over a paged KV cache, the description that attention's plans (autosel.ops.attention)
are built from and that callers (an engine, autosel.integrations) build once per step. A value below both, so that
a caller describes a batch without importing the plug-in ops."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence


@dataclass(frozen=True, eq=False)  # eq=False: compared and hashed by identity (it holds tensors)
class PagedBatch:
    """One step's batch over a paged KV cache, built once per step (PagedBatch.build) and read by every plan.

    page_table: int32 [batch, max_pages], row b sequence b's pages in order (entries past its last page unused);
    seq_lens: int32 [batch], tokens in the cache per sequence, the new ones included; q_lens: int32 [batch], new
    (query) tokens per sequence (all 1 for decode); cu_q_lens: int32 [batch + 1], their prefix sums.
    seq_lens_list and q_lens_list: the same as Python lists, so that bucket keys and plans never wait for the GPU.
    """

    page_table: Any
    seq_lens: Any
    q_lens: Any
    cu_q_lens: Any
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: Any
    scale: float
    device: str
    seq_lens_list: tuple[int, ...]
    q_lens_list: tuple[int, ...]

    @classmethod
    def build(cls, *, page_table: Any, seq_lens: Sequence[int], q_lens: Sequence[int] | None = None,
              page_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: Any,
              scale: float | None = None) -> "PagedBatch":
        """A batch from its page table (a tensor on the cache's device, or nested lists) and its lengths as Python
        ints (q_lens default all 1: decode). Checks what a kernel would read out of bounds, with the values."""
        import torch

        seq = [int(n) for n in seq_lens]
        new = [1] * len(seq) if q_lens is None else [int(n) for n in q_lens]
        if not seq or len(new) != len(seq):
            raise ValueError(f"PagedBatch: seq_lens ({len(seq)} sequences) and q_lens ({len(new)}) must name the "
                             "same, at least one, sequences")
        bad = [b for b, (s, q) in enumerate(zip(seq, new)) if not 1 <= q <= s]
        if bad:
            b = bad[0]
            raise ValueError(f"PagedBatch: sequence {b} has q_len {new[b]} and seq_len {seq[b]}; each sequence needs "
                             "1 <= q_len <= seq_len (seq_len counts the new tokens too)")
        if page_size < 1 or head_dim < 1 or num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"PagedBatch: page_size={page_size}, head_dim={head_dim}, {num_q_heads} query heads over "
                             f"{num_kv_heads} KV heads: sizes must be positive and query heads a multiple of KV heads")
        if not isinstance(page_table, torch.Tensor):
            page_table = torch.tensor(page_table, dtype=torch.int32)
        if page_table.dim() != 2 or page_table.shape[0] != len(seq):
            raise ValueError(f"PagedBatch: page_table has shape {tuple(page_table.shape)}; it must be "
                             f"[batch={len(seq)}, max_pages]")
        short = [b for b, s in enumerate(seq) if -(-s // page_size) > page_table.shape[1]]
        if short:
            b = short[0]
            raise ValueError(f"PagedBatch: sequence {b} holds {seq[b]} tokens, {-(-seq[b] // page_size)} pages of "
                             f"{page_size}, but page_table rows have {page_table.shape[1]} pages")
        device = page_table.device
        cu = [0]
        for q in new:
            cu.append(cu[-1] + q)
        as_int32 = functools.partial(torch.tensor, dtype=torch.int32, device=device)
        return cls(page_table=page_table.to(torch.int32), seq_lens=as_int32(seq), q_lens=as_int32(new),
                   cu_q_lens=as_int32(cu), page_size=int(page_size), num_q_heads=int(num_q_heads),
                   num_kv_heads=int(num_kv_heads), head_dim=int(head_dim), dtype=dtype,
                   scale=float(head_dim ** -0.5 if scale is None else scale), device=str(device),
                   seq_lens_list=tuple(seq), q_lens_list=tuple(new))

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_list)

    @functools.cached_property
    def total_q(self) -> int:
        return sum(self.q_lens_list)

    @functools.cached_property
    def total_kv(self) -> int:
        return sum(self.seq_lens_list)

    @functools.cached_property
    def max_kv(self) -> int:
        return max(self.seq_lens_list)

    @functools.cached_property
    def max_q(self) -> int:
        return max(self.q_lens_list)

    @property
    def is_decode(self) -> bool:
        return self.total_q == self.batch_size
