"""attention.decode and attention.extend on this CPU: the torch plans against a per-token loop over the pages, the
batch description's checks, the bucket function, the compiled plans, and a tune that stores per-bucket decisions."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import use_fresh_registry

from autosel import batch, checks, selector, tuning
from autosel.ops import attention, attention_torch
from autosel.ops.attention import PagedBatch, decode_bucket, extend_bucket, make_batch
from autosel.platforms import PlatformInfo

CPU = PlatformInfo("cpu", arch="x86_64", device_name="test cpu", multiprocessor_count=2)


def per_token(batch: PagedBatch, q, k_cache, v_cache) -> torch.Tensor:
    """Each query token alone, in float64: its sequence's cache positions up to its own, read page by page."""
    group = batch.num_q_heads // batch.num_kv_heads
    out, start = [], 0
    for b, (seq_len, q_len) in enumerate(zip(batch.seq_lens_list, batch.q_lens_list)):
        pages = batch.page_table[b].tolist()
        slots = [pages[p // batch.page_size] * batch.page_size + p % batch.page_size for p in range(seq_len)]
        keys = k_cache.reshape(-1, batch.num_kv_heads, batch.head_dim)[slots].double()
        values = v_cache.reshape(-1, batch.num_kv_heads, batch.head_dim)[slots].double()
        for i in range(q_len):
            upto = seq_len - q_len + i + 1
            heads = []
            for h in range(batch.num_q_heads):
                scores = keys[:upto, h // group] @ q[start + i, h].double() * batch.scale
                heads.append(torch.softmax(scores, 0) @ values[:upto, h // group])
            out.append(torch.stack(heads))
        start += q_len
    return torch.stack(out)


# (seq_lens, q_lens or None for decode, page_size, q heads, kv heads, head_dim): ragged batches, length-1 sequences,
# sequences ending mid-page, page sizes 1/16/64, head_dim 64/128/256, GQA, MQA and plain multi-head.
CASES = [
    ([1, 17, 40], None, 16, 4, 2, 64),  # a length-1 sequence; 17 and 40 end mid-page
    ([5, 1, 9], None, 1, 4, 1, 128),  # MQA, one token per page
    ([70, 3], None, 64, 2, 2, 256),  # multi-head, Gemma-2's head_dim, 64-token pages
    ([1, 1], None, 16, 8, 2, 64),  # the first decode step of two sequences
    ([12], [12], 16, 4, 2, 64),  # prefill: prefix 0
    ([30, 1, 19], [5, 1, 19], 16, 4, 1, 128),  # MQA; a length-1 sequence; prefill beside extend
    ([9, 66], [2, 3], 64, 2, 2, 256),
    ([7, 4], [3, 4], 1, 6, 2, 64),  # page size 1, GQA 3:1
]


@pytest.mark.parametrize("seq_lens, q_lens, page_size, q_heads, kv_heads, head_dim", CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_torch_plans_match_a_per_token_loop_over_the_pages(seq_lens, q_lens, page_size, q_heads, kv_heads,
                                                                head_dim, dtype):
    torch.manual_seed(0)
    batch, k_cache, v_cache = make_batch(seq_lens=seq_lens, q_lens=q_lens, page_size=page_size, q_heads=q_heads,
                                         kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, device="cpu", seed=3)
    q = torch.randn(batch.total_q, q_heads, head_dim, dtype=dtype)
    plan = (attention_torch.DecodePlan if q_lens is None else attention_torch.ExtendPlan)(batch)
    out = plan.run(q, k_cache, v_cache)
    assert out.shape == q.shape and out.dtype == dtype
    outcome = checks.compare([out], [per_token(batch, q, k_cache, v_cache).to(dtype)])
    assert outcome.ok, outcome.reason


def test_page_tables_are_out_of_order_and_hold_minus_one_past_each_sequence():
    batch, _, _ = make_batch(seq_lens=[40, 3], q_lens=None, page_size=16, q_heads=2, kv_heads=2, head_dim=64,
                             dtype=torch.bfloat16, device="cpu")
    rows = batch.page_table.tolist()
    assert rows[1][1:] == [-1, -1] and sorted(rows[0] + rows[1][:1]) != rows[0] + rows[1][:1]


def test_a_decode_plan_takes_a_new_batch_of_its_size_into_its_own_buffers():
    # What a captured CUDA graph needs: the buffers it read at capture hold the next step's batch.
    torch.manual_seed(1)
    first, k_cache, v_cache = make_batch(seq_lens=[20, 33], q_lens=None, page_size=16, q_heads=4, kv_heads=2,
                                         head_dim=64, dtype=torch.float32, device="cpu")
    plan = attention_torch.DecodePlan(first)
    slots, mask = plan.slots.data_ptr(), plan.mask.data_ptr()
    second = PagedBatch.build(page_table=first.page_table, seq_lens=[21, 34], page_size=16, num_q_heads=4,
                              num_kv_heads=2, head_dim=64, dtype=torch.float32)
    plan.update(second)
    assert (plan.slots.data_ptr(), plan.mask.data_ptr()) == (slots, mask)
    q = torch.randn(2, 4, 64)
    assert checks.compare([plan.run(q, k_cache, v_cache)], [per_token(second, q, k_cache, v_cache).float()]).ok
    with pytest.raises(ValueError, match="does not fit a plan of 2 up to 48"):
        plan.update(PagedBatch.build(page_table=[[0, 1, 2, 3]] * 2, seq_lens=[21, 49], page_size=16, num_q_heads=4,
                                     num_kv_heads=2, head_dim=64, dtype=torch.float32))


@pytest.mark.parametrize("kwargs, message", [
    (dict(seq_lens=[4, 2], q_lens=[5, 1]), "sequence 0 has q_len 5 and seq_len 4"),
    (dict(seq_lens=[40]), "sequence 0 holds 40 tokens, 3 pages of 16, but page_table rows have 2 pages"),
    (dict(seq_lens=[4], num_q_heads=6, num_kv_heads=4), "6 query heads over 4 KV heads"),
    (dict(seq_lens=[4, 4]), r"page_table has shape \(1, 2\); it must be \[batch=2, max_pages\]"),
])
def test_a_batch_a_kernel_would_read_out_of_bounds_is_refused_with_the_values(kwargs, message):
    args = dict(page_table=[[0, 1]], page_size=16, num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        PagedBatch.build(**{**args, **kwargs})


def test_a_batch_keeps_its_lengths_as_python_lists_and_int32_tensors():
    batch = PagedBatch.build(page_table=[[2, 0], [1, 3]], seq_lens=[20, 5], q_lens=[4, 5], page_size=16,
                             num_q_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    assert (batch.seq_lens_list, batch.q_lens_list, batch.cu_q_lens.tolist()) == ((20, 5), (4, 5), [0, 4, 9])
    assert {t.dtype for t in (batch.page_table, batch.seq_lens, batch.q_lens, batch.cu_q_lens)} == {torch.int32}
    assert batch.scale == 64 ** -0.5 and not batch.is_decode and batch.device == "cpu"


def _decode(seq_lens, page_size=16):
    return PagedBatch.build(page_table=[[0] * 8000] * len(seq_lens), seq_lens=seq_lens, page_size=page_size,
                            num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)


def test_decode_buckets_key_batch_size_mean_length_spread_and_layout():
    assert decode_bucket(_decode([1000] * 8)) == (8, 1024, 1, 32, 8, 128, 16, "bfloat16")
    # Mixed lengths of the same mean: one long sequence among short ones is another bucket (padding kernels pay).
    assert decode_bucket(_decode([100] * 7 + [1000 * 8 - 700])) == (8, 1024, 8, 32, 8, 128, 16, "bfloat16")
    assert decode_bucket(_decode([1000] * 8, page_size=1))[6] == 1


@pytest.mark.parametrize("spread, bucket", [("uniform", 1), ("mixed", 2), ("wide", 4)])
def test_a_representative_spread_keeps_its_bucket_through_a_recorded_shape(spread, bucket):
    # AUTOSEL_RECORD stores a batch as attention_shape; a tune rebuilds lengths from it, which must land in the
    # recorded batch's bucket again, the wide spread's included (its longest sequence about 3x the mean).
    seq = attention.lengths(64, 1024, spread)
    assert abs(sum(seq) / len(seq) - 1024) < 1024 * (0.1 if spread == "mixed" else 0.01)
    first = _decode(seq)
    assert decode_bucket(first)[:3] == (64, 1024, bucket)
    shape = attention.attention_shape(first)
    assert shape.get("spread", "uniform") == spread
    rebuilt = attention.decode_inputs(shape, "cpu")[0]
    assert decode_bucket(rebuilt) == decode_bucket(first)


def test_a_decode_batch_runs_the_nearest_tuned_bucket_and_another_dtype_the_op_level_winner():
    from autosel.dispatch import BucketTable
    from autosel.planned import PLANNED_NEAREST_WITHIN

    tuned = {decode_bucket(_decode([1024])): "triton", decode_bucket(_decode([8192] * 64)): "sgl_kernel"}
    table = BucketTable("attention.decode", "graph", "flashinfer", tuned)
    # Batch 3 at KV 200 is 2.4 powers of two from the batch-1 bucket in KV: nearest it, whatever the distance.
    assert table.route(decode_bucket(_decode([200] * 3)), within=PLANNED_NEAREST_WITHIN) == "triton"
    assert table.route(decode_bucket(_decode([200] * 3))) == "flashinfer"  # a plain op's reach: the op-level winner
    assert table.route(decode_bucket(_decode([16384] * 32)), within=PLANNED_NEAREST_WITHIN) == "sgl_kernel"
    # The layout's numbers count too: page size 64 at batch 1 is nearer the page-16 batch-1 bucket than any other.
    assert table.route(decode_bucket(_decode([1024], page_size=64)), within=PLANNED_NEAREST_WITHIN) == "triton"
    fp16 = PagedBatch.build(page_table=[[0] * 64], seq_lens=[1024], page_size=16, num_q_heads=32, num_kv_heads=8,
                            head_dim=128, dtype=torch.float16)
    assert table.route(decode_bucket(fp16), within=PLANNED_NEAREST_WITHIN) == "flashinfer"  # no fp16 bucket


def test_extend_buckets_key_new_tokens_batch_size_and_mean_length():
    batch = PagedBatch.build(page_table=[[0] * 64] * 2, seq_lens=[600, 600], q_lens=[500, 500], page_size=16,
                             num_q_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert extend_bucket(batch) == (1024, 2, 512, 1, 32, 8, 128, 16, "bfloat16")


@pytest.mark.parametrize("shapes", [attention.DECODE_SHAPES, attention.EXTEND_SHAPES])
def test_representative_batches_span_the_issues_grid_and_fit_a_gpu(shapes):
    gpu = shapes.gpu
    layouts = {(s["q_heads"], s["kv_heads"], s["head_dim"]) for s in gpu}
    assert {(32, 8, 128), (64, 8, 128), (16, 8, 256), (48, 1, 128)} <= layouts
    assert {s["page_size"] for s in gpu} >= {1, 16, 64} and {s.get("dtype", "bfloat16") for s in gpu} == {
        "bfloat16", "float16"}
    assert any(s.get("spread") == "mixed" for s in gpu)
    for shape in gpu:  # K and V of the whole batch within 4 GB of bf16 at 8 KV heads of 128 (1M tokens)
        kv = shape["kv"] if "kv" in shape else shape["prefix"] + shape["new"] // shape["batch"]
        assert shape["batch"] * kv * shape["kv_heads"] * shape["head_dim"] <= (1 << 20) * 8 * 128
    if "kv" in gpu[0]:
        assert {s["batch"] for s in gpu} >= {1, 512} and {s["kv"] for s in gpu} >= {128, 65536}
    else:
        assert max(s["new"] for s in gpu) == 8192 and {s["prefix"] for s in gpu} >= {0, 32768}


def test_every_shapes_inputs_fall_in_the_bucket_their_meta_inputs_say():
    # The stored rows are checked against the bucket of inputs built on the meta device (tuning.outdated).
    for definition in attention.DEFINITIONS:
        for shape in definition.shapes_for(CPU):
            real = definition.bucket(*definition.make_inputs(shape, "cpu"))
            assert definition.bucket(*definition.make_inputs(shape, "meta")) == real


@pytest.mark.compile
def test_a_cpu_tune_of_both_attention_ops_stores_per_bucket_decisions(monkeypatch):
    use_fresh_registry(monkeypatch, CPU, builtin=True)
    monkeypatch.setenv("AUTOSEL_BUDGET_S", "5")
    outcomes = batch.tune_ops(["attention.*"])
    assert sorted((o.op, o.status) for o in outcomes) == [("attention.decode", "tuned"), ("attention.extend", "tuned")]
    for outcome in outcomes:
        rows = {d.bucket for d, _ in tuning.database().decisions(outcome.op)}
        assert len(rows) == 1 + len(attention.DECODE_SHAPES.cpu)  # the op level and one row per CPU batch
        for candidate in outcome.decision.candidates:
            assert candidate.status in ("ok", "dropped"), candidate.reason
            assert all(s.plan_us is not None for s in candidate.shapes if s.timing is not None)
    planner = selector.get_kernel("attention.decode")
    args = attention.decode_inputs(attention.DECODE_SHAPES.cpu[1], "cpu")
    assert planner.backend_of(args[0]) in ("torch", "torch_compile")
    assert checks.compare([planner.plan(args[0]).run(*args[1:])], [per_token(*args).to(torch.bfloat16)]).ok
    assert math.isfinite(outcomes[0].decision.tune_s)
