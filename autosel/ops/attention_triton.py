"""autosel's own Triton paged decode attention: `DecodePlan` for `attention.decode`, and `supports`.

One program reads one (sequence, KV head, KV split) and handles every query head of that KV head's GQA group at
once, so each K/V page is loaded once per group instead of once per query head; the group is padded to 16 rows,
the smallest tile `tl.dot` takes. Tokens are gathered one by one through the page table (page = pos // page_size,
slot = pos % page_size), which is why any page size works, 1 included. Long sequences with few (sequence, KV head)
pairs are split along the KV axis so that the GPU's SMs all have work: each split writes its partial output and
log-sum-exp in fp32, and a second kernel merges them. Accumulation is fp32 throughout; the output has q's dtype.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from autosel.ops.attention_support import layout_reason
from autosel.ops.common import next_power_of_2, pin_triton_cache_dir
from autosel.ops.triton_launch import FastLaunch

pin_triton_cache_dir()

_HEAD_DIMS = (64, 128, 256)
_DTYPES = (torch.bfloat16, torch.float16)
# tl.dot needs at least 16 rows; a group wider than this would spill the accumulator.
_MIN_ROWS, _MAX_GROUP = 16, 64
# Splits are made no shorter than this many tokens: below it the merge costs more than the parallelism gains.
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64
_LOG2E = 1.4426950408889634
# Triton's CPU interpreter returns garbage from tl.dot on bf16 tiles (values near 1e9; fp16 tiles are right), so
# under it the two products take fp32 tiles. On a GPU they take q's dtype, with fp32 accumulation.
_DOT_FP32 = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def supports(batch) -> str | None:
    """None where DecodePlan runs this batch's case, else why not."""
    reason = layout_reason(batch, backend="autosel's Triton decode kernel", head_dims=_HEAD_DIMS, dtypes=_DTYPES)
    if reason is not None:
        return reason
    group = batch.num_q_heads // batch.num_kv_heads
    if group > _MAX_GROUP:
        return f"autosel's Triton decode kernel takes at most {_MAX_GROUP} query heads per KV head, got {group}"
    if torch.device(batch.device).type != "cuda" and not _DOT_FP32:
        return f"autosel's Triton kernels run on GPUs (or under TRITON_INTERPRET=1), the batch is on {batch.device}"
    if min(batch.seq_lens_list) < 1:
        return "every sequence of a decode batch holds at least its new token; a sequence has length 0"
    if any(q != 1 for q in batch.q_lens_list):
        return "decode takes one query token per sequence; this batch has longer q_lens (an extend batch)"
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(device: str) -> int:
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return 4  # Triton's CPU interpreter: a few splits, so that the merge path is exercised too
    return torch.cuda.get_device_properties(torch.device(device)).multi_processor_count


def choose_splits(*, batch_size: int, num_kv_heads: int, seq_len: int, sm_count: int) -> int:
    """KV splits of a sequence of the batch's mean length: enough programs for two waves of the SMs, each split at
    least _MIN_SPLIT_TOKENS."""
    programs = batch_size * num_kv_heads
    wanted = -(-2 * sm_count // programs)
    by_length = -(-seq_len // _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, by_length, _MAX_SPLITS))


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, page_table_ptr, seq_lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
                   qk_scale, tokens_per_split,
                   stride_qb, stride_qh, stride_kp, stride_kt, stride_kh, stride_vp, stride_vt, stride_vh,
                   stride_pt, stride_ob, stride_oh,
                   NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
                   HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_FP32: tl.constexpr):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + g
    g_mask = g < GROUP
    q = tl.load(q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = page_table_ptr + b.to(tl.int64) * stride_pt
    for t0 in range(start, end, BLOCK_N):
        pos = t0 + n
        n_mask = pos < end
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        slot = pos % PAGE_SIZE
        k_rows = k_ptr + page * stride_kp + slot * stride_kt + kv_head * stride_kh
        k = tl.load(k_rows[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        # Scores in the log2 domain (qk_scale holds log2(e)), so exp2 stands for exp.
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_rows = v_ptr + page * stride_vp + slot * stride_vt + kv_head * stride_vh
        v = tl.load(v_rows[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        # A split past the sequence's end saw no token (l_i == 0): it contributes weight 0 to the merge.
        empty = l_i == 0.0
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        row = (b.to(tl.int64) * NUM_Q_HEADS + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=g_mask[:, None])
        tl.store(part_lse_ptr + row, lse, mask=g_mask)


@triton.jit
def _merge_kernel(part_out_ptr, part_lse_ptr, out_ptr, stride_ob, stride_oh,
                  NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    row = (b.to(tl.int64) * NUM_Q_HEADS + h) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # the first split always holds a token, so the max is finite
    part = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(part * weight[:, None], 0) / tl.sum(weight, 0)
    tl.store(out_ptr + b.to(tl.int64) * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


# Triton's own launch path costs tens of microseconds of host time with this many arguments, more than a small
# decode's kernel (results/attention_bench_h100: 66 us eager against 14 us in a CUDA graph at batch 8, KV 1k).
_launch_decode = FastLaunch(_decode_kernel)
_launch_merge = FastLaunch(_merge_kernel)


class DecodePlan:
    """attention.decode with autosel's Triton kernel: the split count and buffers are fixed here, once a step.

    `num_splits` overrides the heuristic (tests use it to run both the one-pass and the split-and-merge path).
    """

    def __init__(self, batch, *, num_splits: int | None = None):
        reason = supports(batch)
        if reason is not None:
            raise ValueError(f"Triton paged decode cannot run this batch: {reason}")
        self.batch = batch
        group = batch.num_q_heads // batch.num_kv_heads
        block_g = max(_MIN_ROWS, next_power_of_2(group))
        # 256-wide heads take half the tokens per step so that K, V and the accumulator stay in registers.
        block_n = 64 if batch.head_dim <= 128 else 32
        max_len = max(batch.seq_lens_list)
        if num_splits is None:
            # Splits as long as a mean-length sequence's: a longer sequence takes more of them, so that in a batch of
            # mixed lengths its programs do not walk several times the others' tokens (sized by the longest, the
            # kernel ran 1.2-1.8x behind FA3 on mixed batches, results/attention_bench_h100/badc6ae).
            mean_len = -(-sum(batch.seq_lens_list) // len(batch.seq_lens_list))
            num_splits = choose_splits(batch_size=len(batch.seq_lens_list), num_kv_heads=batch.num_kv_heads,
                                       seq_len=mean_len, sm_count=_sm_count(batch.device))
            per_split = max(-(-mean_len // num_splits), -(-max_len // _MAX_SPLITS))
        else:
            per_split = -(-max_len // num_splits)
        # Whole BLOCK_N steps per split, so that only each split's last step is partly masked.
        self.tokens_per_split = -(-per_split // block_n) * block_n
        self.num_splits = -(-max_len // self.tokens_per_split)
        self.qk_scale = float(batch.scale * _LOG2E)
        rows = len(batch.seq_lens_list) * batch.num_q_heads * self.num_splits
        if self.num_splits > 1:
            self.part_out = torch.empty(rows, batch.head_dim, dtype=torch.float32, device=batch.device)
            self.part_lse = torch.empty(rows, dtype=torch.float32, device=batch.device)
        else:  # never read: the one-pass kernel writes the output itself
            self.part_out = self.part_lse = torch.empty(1, dtype=torch.float32, device=batch.device)
        self.grid = (len(batch.seq_lens_list), batch.num_kv_heads, self.num_splits)
        self.num_warps = 4 if batch.head_dim <= 128 else 8
        self.constexprs = (batch.num_q_heads, group, block_g, batch.head_dim, batch.page_size, block_n,
                           self.num_splits, _DOT_FP32)
        self.merge_grid = (len(batch.seq_lens_list), batch.num_q_heads)
        self.merge_constexprs = (batch.num_q_heads, batch.head_dim, self.num_splits,
                                 next_power_of_2(self.num_splits))

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        batch = self.batch
        if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("Triton paged decode needs q, k_cache and v_cache contiguous in head_dim "
                             f"(strides {q.stride()}, {k_cache.stride()}, {v_cache.stride()}); pass .contiguous()")
        out = torch.empty_like(q)
        _launch_decode(self.grid, (
            q, k_cache, v_cache, batch.page_table, batch.seq_lens, out, self.part_out, self.part_lse,
            self.qk_scale, self.tokens_per_split,
            q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            batch.page_table.stride(0), out.stride(0), out.stride(1)), self.constexprs, self.num_warps)
        if self.num_splits > 1:
            _launch_merge(self.merge_grid, (self.part_out, self.part_lse, out, out.stride(0), out.stride(1)),
                          self.merge_constexprs, 4)
        return out
