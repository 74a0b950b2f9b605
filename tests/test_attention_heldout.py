"""tools/attention_heldout.py: its held-out batches (never a representative batch, within the stated limits,
the same for a seed) and its summary (time over the per-batch best, the rule's violations)."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def heldout():
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(TOOLS))  # the tool imports attention_bench from beside itself
        yield importlib.import_module("attention_heldout")


def test_decode_batches_stay_within_their_limits_and_repeat_for_a_seed(heldout):
    batches = heldout.decode_batches(40, seed=3, max_tokens=100_000)
    assert batches == heldout.decode_batches(40, seed=3, max_tokens=100_000)
    assert batches != heldout.decode_batches(40, seed=4, max_tokens=100_000)
    assert all(sum(b["seq_lens"]) <= 100_000 and b["q_lens"] is None and b["layout"] in heldout.LAYOUTS
               for b in batches)
    assert any(len(set(b["seq_lens"])) > 1 for b in batches), "mixed lengths are part of the held-out set"


def test_extend_batches_stay_within_their_limits(heldout):
    batches = heldout.extend_batches(40, seed=5, max_work=2 ** 24)
    for b in batches:
        assert sum(b["q_lens"]) <= 8192
        assert all(1 <= q <= s for q, s in zip(b["q_lens"], b["seq_lens"]))
        assert sum(q * s for q, s in zip(b["q_lens"], b["seq_lens"])) <= 2 ** 24
    assert any(q == s for b in batches for q, s in zip(b["q_lens"], b["seq_lens"])), "prefill is included"


@pytest.mark.parametrize("op", ["decode", "extend"])
def test_a_representative_batch_is_recognised_so_it_can_be_left_out(heldout, op):
    # main() drops generated batches found here: a representative batch would put in-sample figures in the table.
    from autosel.ops import attention as att

    shape = (att.DECODE_SHAPES if op == "decode" else att.EXTEND_SHAPES).gpu[0]
    seen = heldout.representative_lengths(op)
    assert len(seen) == len((att.DECODE_SHAPES if op == "decode" else att.EXTEND_SHAPES).gpu)
    count = shape["batch"]
    if op == "decode":
        key = (32, 8, 128, 16, "bfloat16", tuple(att.lengths(count, shape["kv"])), ())
    else:
        new = att.lengths(count, shape["new"] // count)
        key = (32, 8, 128, 16, "bfloat16", tuple(shape["prefix"] + q for q in new), tuple(new))
    assert key in seen


def test_bucket_of_matches_the_op_bucket_function_on_a_real_batch(heldout):
    import torch

    from autosel.ops import attention as att

    spec = {"layout": "llama3-8b", "seq_lens": [40, 300, 75], "q_lens": None}
    batch, _, _ = att.make_batch(seq_lens=spec["seq_lens"], q_lens=None, page_size=16, q_heads=32, kv_heads=8,
                                 head_dim=128, dtype=torch.bfloat16, device="cpu")
    assert heldout.bucket_of("decode", spec) == att.decode_bucket(batch)


def _row(op, batch, times, rounds, chosen, led=()):
    return {"op": op, "batch": batch, "eager_us": times, "eager_rounds_us": rounds, "autosel_eager": chosen,
            "eager_led_by": list(led)}


def test_summary_scores_autosel_and_each_backend_over_the_per_batch_best(heldout):
    rows = [_row("attention.decode", "a", {"x": 10.0, "y": 20.0}, {}, "x"),
            _row("attention.decode", "b", {"x": 30.0, "y": 15.0}, {}, "x", led=["y"]),
            _row("attention.decode", "c", {"x": 8.0}, {}, "x")]  # y cannot run batch c
    [entry] = heldout.summary(rows, ["x", "y"])
    assert entry["autosel"]["geomean"] == pytest.approx(round(math.exp(math.log(2.0) / 3), 4))
    assert entry["autosel"]["worst"] == 2.0
    assert entry["x"]["geomean"] == entry["autosel"]["geomean"]
    assert entry["y"] == {"runs_all": False, "missing": 1, "geomean_where_run": pytest.approx(math.sqrt(2), 1e-3)}
    assert entry["best_fixed"] == "x" and entry["autosel_over_best_fixed"] == 1.0
    assert entry["rule_violations"] == ["b"]
