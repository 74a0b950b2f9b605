"""autosel.bench.attention_heldout (`autosel bench attention-heldout`): the held-out batches (never a representative
batch, within the stated limits, the same for a seed), the summary (time over the per-batch best, the rule's
violations, the batches with a leader beyond the margin), a tiny run on this CPU, its deadline, and the working copy
a run killed midway leaves."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from autosel.bench import attention_heldout as bench_attention
from autosel.bench.results import read_results
from autosel.cli import main


@pytest.fixture
def heldout():
    return bench_attention


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


@pytest.mark.parametrize("rounds, contested, autosel_ran_a_leader", [
    ({"x": [10.0, 10.0], "y": [12.0, 12.0]}, True, True),   # x led y beyond 10% in both rounds; autosel ran x
    ({"x": [10.0, 10.0], "y": [12.0, 10.5]}, False, False),  # y within the margin in round 2: no leader
    ({"x": [13.0, 13.0], "y": [11.0, 11.0]}, True, False),  # y led x, autosel's choice, in every round
])
def test_a_batch_counts_as_led_only_where_a_backend_led_another_beyond_the_margin_in_every_round(
        heldout, rounds, contested, autosel_ran_a_leader):
    times = {name: sorted(ts)[0] for name, ts in rounds.items()}
    row = _row("attention.decode", "a", times, rounds, "x", led=heldout.led_by(rounds, "x", heldout.MARGIN["eager"]))
    [entry] = heldout.summary([row], ["x", "y"])
    assert heldout.contested(row, "eager") is contested
    assert entry["led_beyond_margin"] == int(contested)
    assert entry["autosel_ran_a_leader"] == int(autosel_ran_a_leader)
    assert entry["rule_violations"] == ([] if autosel_ran_a_leader or not contested else ["a"])


TINY = ["--device", "cpu", "--rounds", "2", "--skip", "torch_compile,flashinfer,sgl_kernel,triton"]


@pytest.fixture
def torch_chosen(monkeypatch):
    """autosel's choice without a tune: AUTOSEL_BACKEND forces torch, the one backend the tiny runs time."""
    monkeypatch.setenv("AUTOSEL_BACKEND", "torch")
    monkeypatch.setenv("AUTOSEL_TUNE", "off")


def test_a_tiny_run_on_this_cpu_writes_one_result_file_the_page_renders(tmp_path, torch_chosen):
    from autosel.bench import page

    args = ["bench", "attention-heldout", "--decode", "1", "--extend", "1", "--max-tokens", "100", "--max-work",
            "2000", *TINY, "--results", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    [record] = read_results(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [record["file"]], "the working copy is removed at the end"
    assert record["kind"] == "attention_heldout" and record["command"].startswith("autosel bench attention-heldout")
    body = record["results"]
    assert [r["op"] for r in body["rows"]] == ["attention.decode", "attention.extend"]
    for row in body["rows"]:
        assert row["autosel_eager"] == "torch" and row["close"] == {"torch": True}
        assert len(row["eager_rounds_us"]["torch"]) == 2 and row["eager_us"]["torch"] > 0
    assert [(s["op"], s["mode"], s["autosel"]["geomean"]) for s in body["summary"]] == \
        [("attention.decode", "eager", 1.0), ("attention.extend", "eager", 1.0)]
    text = page.render([record])
    assert "## Paged attention on held-out batches" in text
    assert "| attention.decode | eager | 1 | 1.000 / 1.000 | 1.000 / 1.000 | torch | 1.000 | 0 | 0 |" in text


def test_a_run_killed_midway_leaves_a_working_copy_with_the_batches_it_measured(tmp_path, torch_chosen, monkeypatch):
    # The tools wrote their JSON only as they went; a process killed by `timeout` must keep its batches here too.
    real, calls = bench_attention.time_batch, []

    def killed_at_the_second_batch(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill: nothing after the first batch runs
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_attention, "time_batch", killed_at_the_second_batch)
    args = ["bench", "attention-heldout", "--decode", "1", "--extend", "1", "--max-tokens", "100", "--max-work",
            "2000", *TINY, "--results", str(tmp_path)]
    CliRunner().invoke(main, args)
    [record] = read_results(tmp_path)
    assert record["file"].endswith(".partial.json") and record["kind"] == "attention_heldout"
    assert [r["op"] for r in record["results"]["rows"]] == ["attention.decode"]
    assert "working copy of a run that did not finish: 1 of 2 batches" in record["results"]["notes"]


def test_a_deadline_cuts_the_run_and_the_result_file_says_so(tmp_path, torch_chosen):
    args = ["bench", "attention-heldout", "--decode", "2", "--extend", "1", *TINY, "--deadline-s", "0",
            "--results", str(tmp_path)]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    [record] = read_results(tmp_path)
    assert record["results"]["rows"] == [] and not record["file"].endswith(".partial.json")
    assert "cut at its deadline: 0 of 3 batches measured" in record["results"]["notes"]


@pytest.mark.parametrize("args, said", [
    (["--skip", "flashinfr"], "flashinfr: not an attention backend here; known: torch,"),
    (["--device", "cuda"], "this machine has no CUDA device; pass --device cpu"),
])
def test_a_bad_option_is_refused_before_anything_is_timed(tmp_path, args, said):
    import torch

    if "--device" in args and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    result = CliRunner().invoke(main, ["bench", "attention-heldout", "--decode", "1", "--extend", "0", *args,
                                       "--results", str(tmp_path)])
    assert result.exit_code == 2 and said in result.output
    assert not tmp_path.exists() or list(tmp_path.iterdir()) == []


def test_a_sticky_cuda_error_stops_the_run_with_the_rows_so_far_and_the_error_named(heldout, monkeypatch):
    # Used to log the same device-side assert for every later row, then crash emptying the CUDA cache, writing nothing.
    torch = pytest.importorskip("torch")
    assert_text = "CUDA error: device-side assert triggered"
    stuck = []

    def synchronize():
        if stuck:  # what a sticky error does: every later call on the device raises it again
            raise RuntimeError(assert_text)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    measured, copies = [], []

    def measure(item):
        measured.append(item)
        if item == 2:
            stuck.append(item)
            raise RuntimeError(assert_text)
        return {"item": item}

    body = heldout.rows_in_turn([1, 2, 3, 4], measure, body={"rows": []}, unit="rows", started=0, deadline_s=math.inf,
                                device="cuda", label=lambda item: f"row {item}", failed=lambda item: {"item": item},
                                finish=lambda body: body, on_step=lambda step: None, on_row=copies.append)
    assert measured == [1, 2]
    assert body["rows"] == [{"item": 1}, {"item": 2, "error": f"RuntimeError: {assert_text}"}]
    assert body["device_error"].startswith(f"RuntimeError: {assert_text} (after row 2); the 2 rows after it were not")
    assert len(copies) == 1


def test_a_failing_row_on_a_device_that_still_works_does_not_stop_the_run(heldout, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def measure(item):
        if item == 1:
            raise torch.OutOfMemoryError("CUDA out of memory")  # cleared when raised: the next rows run
        return {"item": item}

    body = heldout.rows_in_turn([1, 2], measure, body={"rows": []}, unit="rows", started=0, deadline_s=math.inf,
                                device="cuda", label=str, failed=lambda item: {"item": item},
                                finish=lambda body: body, on_step=lambda step: None, on_row=lambda body: None)
    assert body["rows"] == [{"item": 1, "error": "OutOfMemoryError: CUDA out of memory"}, {"item": 2}]
    assert "device_error" not in body


def test_a_choice_autosel_cannot_make_fails_the_held_out_run_once_before_any_batch(tmp_path, monkeypatch):
    # With AUTOSEL_TUNE=off and no usable decision every batch recorded the same multiple-backends error.
    from click.testing import CliRunner

    from autosel.cli import main

    monkeypatch.setenv("AUTOSEL_TUNE", "off")
    monkeypatch.setenv("AUTOSEL_DB", str(tmp_path / "empty.db"))
    result = CliRunner().invoke(main, ["bench", "attention-heldout", "--device", "cpu", "--decode", "2", "--extend",
                                       "1", "--rounds", "1", "--results", str(tmp_path / "results")])
    assert result.exit_code == 1, result.output
    assert result.output.count("Error: autosel cannot choose a backend, so no row was run: op 'attention.") == 1
    assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists() or not list((tmp_path / "results").iterdir())
