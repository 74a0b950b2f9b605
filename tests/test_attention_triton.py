"""Tests for autosel.ops.attention_triton against the gather + SDPA reference, under Triton's CPU interpreter
when there is no GPU (tiny shapes: the interpreter runs each program in numpy)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paged_attention_cases import TOL, make_batch, make_q, reference
from triton_interpret import DEVICE, import_kernels, interpreter_env  # noqa: F401 - the fixture is autouse

at = import_kernels("autosel.ops.attention_triton")


def check(*, seq_lens, page_size, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
          num_splits=None, shuffle=True):
    batch, k_cache, v_cache = make_batch(seq_lens=seq_lens, page_size=page_size, num_q_heads=num_q_heads,
                                         num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                         device=DEVICE, shuffle=shuffle)
    q = make_q(batch)
    plan = at.DecodePlan(batch, num_splits=num_splits)
    out = plan.run(q, k_cache, v_cache)
    expected = reference(q, k_cache, v_cache, batch)
    rtol, atol = TOL[dtype]
    assert out.dtype == q.dtype and out.shape == q.shape
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol)
    return plan


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_ragged_batch_matches_reference(page_size, num_splits):
    # Length 1, a sequence ending mid-page, one past a page boundary, and one spanning several BLOCK_N steps.
    plan = check(seq_lens=[1, 37, 17, 130], page_size=page_size, num_splits=num_splits)
    assert plan.num_splits == (1 if num_splits == 1 else 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_head_dims_and_dtypes(head_dim, dtype):
    check(seq_lens=[9, 70], page_size=16, head_dim=head_dim, dtype=dtype, num_splits=2)


@pytest.mark.parametrize("heads", [(8, 1), (4, 4), (32, 2)], ids=["mqa", "mha", "group16"])
def test_gqa_layouts(heads):
    check(seq_lens=[3, 33], page_size=4, num_q_heads=heads[0], num_kv_heads=heads[1])


def test_split_past_a_short_sequence_is_empty():
    # Four splits sized by the longest sequence: the short sequence's later splits see no token and must weigh 0 in
    # the merge, not NaN.
    plan = check(seq_lens=[2, 250], page_size=16, num_splits=4)
    assert plan.num_splits == 4


def test_in_order_pages():
    check(seq_lens=[40, 7], page_size=8, shuffle=False, num_splits=1)


def test_choose_splits_fills_the_gpu_but_not_with_short_splits():
    assert at.choose_splits(batch_size=1, num_kv_heads=8, seq_len=32768, sm_count=132) == 33
    assert at.choose_splits(batch_size=1, num_kv_heads=8, seq_len=1000, sm_count=132) == 4
    assert at.choose_splits(batch_size=256, num_kv_heads=8, seq_len=32768, sm_count=132) == 1


def test_mixed_lengths_split_the_long_sequences_more():
    # Splits sized by the longest sequence left the long sequences' programs walking most of the batch's tokens: the
    # kernel ran 1.2-1.8x behind FA3 on mixed-length batches. One 4k sequence among fifteen of 64 tokens: a split is
    # at most a mean-length sequence's share (316 tokens, 320 in whole BLOCK_N steps; less where the device has more
    # SMs to fill), so the long sequence is cut into 13 or more splits rather than walked by one program.
    plan = check(seq_lens=[4096] + [64] * 15, page_size=16)
    assert plan.tokens_per_split <= 320 and plan.num_splits == -(-4096 // plan.tokens_per_split)


def _batch(**overrides):
    fields = dict(head_dim=128, dtype=torch.bfloat16, num_q_heads=32, num_kv_heads=8, seq_lens_list=[5],
                  q_lens_list=[1], device=DEVICE)
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"head_dim": 96}, "head_dim"),
    ({"dtype": torch.float32}, "bf16 and fp16"),
    ({"num_q_heads": 12, "num_kv_heads": 8}, "not a multiple"),
    ({"num_q_heads": 128, "num_kv_heads": 1}, "at most 64"),
    ({"q_lens_list": [3]}, "one query token"),
    ({"seq_lens_list": [0]}, "length 0"),
])
def test_supports_names_the_unsupported_case(overrides, words):
    assert words in at.supports(_batch(**overrides))
    with pytest.raises(ValueError, match="cannot run this batch"):
        at.DecodePlan(_batch(**overrides))


def test_supports_llama_layout():
    assert at.supports(_batch()) is None
