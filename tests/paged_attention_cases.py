"""Paged-attention batches for the attention backends' tests and benchmark: a builder of PagedBatch-shaped
namespaces with their K/V caches (pages shuffled, unused table entries filled with other pages' ids), and a
gather + scaled-dot-product reference in fp32.

The namespace carries exactly the attributes of autosel.ops.attention.PagedBatch, which the backends read
duck-typed, so these cases do not depend on that module.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

# (rtol, atol) of an attention output against the fp32 reference: the output is rounded to its dtype once, and the
# kernels round the softmax weights to it before the P @ V product.
TOL = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (5e-3, 5e-3)}


def make_batch(*, seq_lens: list[int], q_lens: list[int] | None = None, page_size: int, num_q_heads: int,
               num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: str, seed: int = 0,
               shuffle: bool = True, extra_pages: int = 3, fill: bool = True):
    """(batch, k_cache, v_cache): each sequence's pages in a random order over the cache when `shuffle`, and the
    table's unused entries pointing at other sequences' pages, so that reading past a sequence's end is wrong."""
    gen = torch.Generator().manual_seed(seed)
    q_lens = [1] * len(seq_lens) if q_lens is None else q_lens
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(pages_per_seq) + extra_pages
    order = torch.randperm(num_pages, generator=gen) if shuffle else torch.arange(num_pages)
    max_pages = max(pages_per_seq) + 1
    table = torch.randint(0, num_pages, (len(seq_lens), max_pages), generator=gen, dtype=torch.int32)
    used = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = order[used:used + n].to(torch.int32)
        used += n
    cache_shape = (num_pages, page_size, num_kv_heads, head_dim)
    if fill:
        k_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
        v_cache = torch.randn(cache_shape, generator=gen).to(dtype).to(device)
    else:  # benchmark caches: random on the device, too large to build on the host
        k_cache = torch.randn(cache_shape, dtype=dtype, device=device)
        v_cache = torch.randn(cache_shape, dtype=dtype, device=device)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    batch = SimpleNamespace(
        page_table=table.to(device), seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        q_lens=torch.tensor(q_lens, dtype=torch.int32, device=device),
        cu_q_lens=torch.tensor(cu, dtype=torch.int32, device=device), page_size=page_size,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
        scale=head_dim ** -0.5, device=device, seq_lens_list=list(seq_lens), q_lens_list=list(q_lens))
    return batch, k_cache, v_cache


def make_q(batch, *, seed: int = 1, decode: bool = True) -> torch.Tensor:
    """Queries for the batch: [batch, heads, head_dim] for decode, [sum(q_lens), heads, head_dim] for extend."""
    rows = len(batch.seq_lens_list) if decode else sum(batch.q_lens_list)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, batch.num_q_heads, batch.head_dim, generator=gen).to(batch.dtype).to(batch.device)


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch) -> torch.Tensor:
    """Gather each sequence's tokens through the page table, then causal SDPA in fp32; decode and extend alike."""
    group = batch.num_q_heads // batch.num_kv_heads
    table = batch.page_table.cpu()
    out = torch.empty_like(q)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(batch.seq_lens_list, batch.q_lens_list)):
        pos = torch.arange(seq_len)
        pages = table[b, pos // batch.page_size].long().to(k_cache.device)
        slots = (pos % batch.page_size).to(k_cache.device)
        k = k_cache[pages, slots].float().transpose(0, 1).repeat_interleave(group, 0)  # [heads, seq, dim]
        v = v_cache[pages, slots].float().transpose(0, 1).repeat_interleave(group, 0)
        qb = q[start:start + q_len].float().transpose(0, 1)  # [heads, q_len, dim]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
        ob = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=batch.scale)
        out[start:start + q_len] = ob.transpose(0, 1).to(q.dtype)
        start += q_len
    return out
