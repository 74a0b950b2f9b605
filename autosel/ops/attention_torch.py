"""The torch backend of attention.decode and attention.extend, and their reference: gather each sequence's pages
into a padded [batch, longest, kv_heads, head_dim] view, then one scaled_dot_product_attention with a mask.

GQA without repeating K and V: the query heads that share a KV head are laid out as extra query rows of that head
([batch, kv_heads, group * rows, head_dim]), so every SDPA kernel (flash, memory-efficient, math) sees plain
multi-head attention and K/V are read once per KV head.

The plan builds every index and mask on the batch's device with no host synchronisation (lengths come from the
batch's Python lists), and keeps them as buffers that `run` only reads: a plan built before CUDA-graph capture is
replayable, and `update(batch)` writes a new batch of the same size and longest lengths into the same buffers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(batch) -> str | None:
    """Every layout, page size and dtype: the reference must run wherever a batch can be described."""
    return None


def _padded_length(batch) -> int:
    """The longest sequence rounded up to whole pages: what the plan's buffers hold, so that `update` can take the
    next steps' batches (one token longer each) until a sequence needs another page."""
    return -(-batch.max_kv // batch.page_size) * batch.page_size


def _kv_index(batch, longest: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(slot [batch, longest] int64 into the flattened cache, valid [batch, longest] bool). Slots past a sequence's
    end point at slot 0, which exists, whatever the page table holds there."""
    device = batch.page_table.device
    positions = torch.arange(longest, device=device)
    page_of = (positions // batch.page_size).clamp(max=batch.page_table.shape[1] - 1)
    pages = batch.page_table.long()[:, page_of]
    valid = positions < batch.seq_lens.long()[:, None]
    slots = torch.where(valid, pages * batch.page_size + positions % batch.page_size, 0)
    return slots, valid


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[batch, kv_heads, longest, head_dim] of a [pages, page_size, kv_heads, head_dim] cache."""
    flat = cache.reshape(-1, cache.shape[2], cache.shape[3])
    return flat[slots].permute(0, 2, 1, 3)


class DecodePlan:
    """One query token per sequence over its pages."""

    def __init__(self, batch) -> None:
        self.batch = batch
        self.longest = _padded_length(batch)
        self.slots, valid = _kv_index(batch, self.longest)
        self.mask = valid[:, None, None, :]  # [batch, 1, 1, longest]: broadcast over heads and query rows

    def update(self, batch) -> None:
        """Take `batch` (same size, lengths no longer than this plan's) into this plan's buffers, in place."""
        if batch.batch_size != self.batch.batch_size or batch.max_kv > self.longest:
            raise ValueError(f"update: batch of {batch.batch_size} up to {batch.max_kv} tokens does not fit a plan "
                             f"of {self.batch.batch_size} up to {self.longest}; build a new plan")
        slots, valid = _kv_index(batch, self.longest)
        self.slots.copy_(slots)
        self.mask.copy_(valid[:, None, None, :])
        self.batch = batch

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return decode(q, k_cache, v_cache, self.slots, self.mask, self.batch.scale)


def decode(q, k_cache, v_cache, slots, mask, scale: float) -> torch.Tensor:
    batch, q_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    rows = q.reshape(batch, kv_heads, q_heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(rows, _gather(k_cache, slots), _gather(v_cache, slots), attn_mask=mask,
                                         scale=scale)
    return out.reshape(batch, q_heads, head_dim)


class ExtendPlan:
    """Each sequence's new tokens over its prefix and themselves, causally; queries padded to the longest q_len."""

    def __init__(self, batch) -> None:
        self.batch = batch
        self.longest, self.rows = _padded_length(batch), batch.max_q
        self._build(batch)

    def _build(self, batch) -> None:
        device = batch.page_table.device
        self.slots, _ = _kv_index(batch, self.longest)
        sequences, total = batch.batch_size, batch.total_q
        starts = batch.cu_q_lens.long()[:-1, None]
        row = torch.arange(self.rows, device=device)
        q_lens = batch.q_lens.long()[:, None]
        # Padded rows read the sequence's last query and are dropped from the output.
        self.q_index = (starts + torch.minimum(row, q_lens - 1)).clamp(max=total - 1)  # [batch, rows]
        position = batch.seq_lens.long()[:, None] - q_lens + row  # [batch, rows]: each query's cache position
        keys = torch.arange(self.longest, device=device)
        self.mask = (keys <= position[:, :, None])[:, None]  # [batch, 1, rows, longest]; slot 0 always allowed
        token_row = torch.repeat_interleave(torch.arange(sequences, device=device), batch.q_lens.long(),
                                            output_size=total)
        within = torch.arange(total, device=device) - batch.cu_q_lens.long()[token_row]
        self.out_index = token_row * self.rows + within  # [total]: each query's row in the padded output

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        return extend(q, k_cache, v_cache, self.slots, self.q_index, self.mask, self.out_index, self.batch.scale)


def extend(q, k_cache, v_cache, slots, q_index, mask, out_index, scale: float) -> torch.Tensor:
    _, q_heads, head_dim = q.shape
    sequences, rows = q_index.shape
    kv_heads = k_cache.shape[2]
    group = q_heads // kv_heads
    # [batch, rows, kv_heads, group, d] -> [batch, kv_heads, group * rows, d]: the group's heads as query rows
    padded = q[q_index].reshape(sequences, rows, kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    padded = padded.reshape(sequences, kv_heads, group * rows, head_dim)
    grouped_mask = mask.expand(sequences, group, rows, mask.shape[-1]).reshape(sequences, 1, group * rows, -1)
    out = F.scaled_dot_product_attention(padded, _gather(k_cache, slots), _gather(v_cache, slots),
                                         attn_mask=grouped_mask, scale=scale)
    out = out.reshape(sequences, kv_heads, group, rows, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(sequences * rows, q_heads, head_dim)[out_index]
