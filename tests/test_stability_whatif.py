"""tools/stability_whatif.py --settled: stored evidence cut back to what the tuner, settling pairs, would have timed."""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest

from autosel.decisions import Measurement

TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(scope="module")
def whatif():
    sys.path.insert(0, str(TOOLS))  # the tool imports stability_bench, beside it
    try:
        yield importlib.import_module("stability_whatif")
    finally:
        sys.path.remove(str(TOOLS))


def _m(rounds):
    return Measurement(median_us=rounds[0], p20_us=rounds[0], p80_us=rounds[0], samples=45, method="cuda:graph-replay",
                       round_medians_us=tuple(rounds))


def test_a_pair_far_behind_after_round_one_keeps_that_round_only(whatif):
    stats = {"a": [_m((10.0, 10.0, 10.0))], "b": [_m((20.0, 19.0, 21.0))], "c": [_m((12.0, 12.5, 11.0))]}
    cut = whatif.settled(stats, 1.3)
    assert cut["b"][0].round_medians_us == (20.0,)  # 2x behind a
    assert cut["a"][0].round_medians_us == (10.0, 10.0, 10.0) and cut["c"][0].round_medians_us == (12.0, 12.5, 11.0)
    assert stats["b"][0].round_medians_us == (20.0, 19.0, 21.0)  # the stored evidence is not changed


def test_a_shape_with_one_candidate_left_keeps_round_one_for_every_candidate(whatif):
    stats = {"a": [_m((10.0, 10.0, 10.0))], "b": [_m((20.0, 19.0, 21.0))]}
    cut = whatif.settled(stats, 1.3)
    assert [cut[b][0].round_medians_us for b in "ab"] == [(10.0,), (20.0,)]


def test_bucket_rows_are_judged_again_from_the_op_level_evidence(whatif):
    import json

    import stability_bench as sb

    from autosel.decisions import CandidateResult, Decision, ShapeResult
    from autosel.policy import DEFAULT_POLICY

    shapes = [{"tokens": 1, "hidden": 4096}, {"tokens": 4096, "hidden": 4096}]
    times = {"triton": (10.0, 50.0), "flashinfer": (10.2, 80.0)}  # level at one token; triton 1.6x at 4096
    decision = Decision(
        op="layernorm.rmsnorm", mode="graph", bucket="*", winner="triton", platform_key="p", versions={},
        candidates=tuple(CandidateResult(b, "ok", shapes=tuple(ShapeResult(s, timing=_m((t, t, t)))
                                                               for s, t in zip(shapes, ts))) for b, ts in times.items()),
        margin=0.06, per_shape_winners=tuple((json.dumps(s, sort_keys=True), "triton") for s in shapes))
    winners = whatif.bucket_winners([sb.Stored("layernorm.rmsnorm", "graph", decision)], DEFAULT_POLICY)
    assert winners == {("layernorm.rmsnorm", "graph", (1, 4096)): "triton",
                       ("layernorm.rmsnorm", "graph", (4096, 4096)): "triton"}
    times["flashinfer"] = (8.0, 80.0)  # now flashinfer leads the one-token bucket by 25%
    decision = dataclasses.replace(decision, candidates=tuple(
        CandidateResult(b, "ok", shapes=tuple(ShapeResult(s, timing=_m((t, t, t))) for s, t in zip(shapes, ts)))
        for b, ts in times.items()))
    winners = whatif.bucket_winners([sb.Stored("layernorm.rmsnorm", "graph", decision)], DEFAULT_POLICY)
    assert winners[("layernorm.rmsnorm", "graph", (1, 4096))] == "flashinfer"


@pytest.mark.parametrize("args, code, said", [
    (["--compare"], 1, "no tune1.db or tune2.db to compare; make them first with python tools/stability_bench.py"),
    (["--replay"], 2, "--replay and --margin-floor decide two stored tunes again: give them with --compare"),
    (["--margin-floor", "0.05"], 2, "give them with --compare"),
])
def test_stability_bench_refuses_a_comparison_it_cannot_make(whatif, tmp_path, capsys, args, code, said):
    import stability_bench as sb

    # Used to break: --compare without the DBs wrote empty reports and exited 0; --replay without --compare was
    # ignored while two full tunes ran.
    with pytest.raises(SystemExit) as exit_:
        sb.main(["--out", str(tmp_path / "bench"), *args])
    if code == 2:
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    else:  # raise SystemExit(message): exit status 1
        assert said in exit_.value.code
    assert not (tmp_path / "bench").exists()


def test_stability_bench_replays_today_s_rule_and_each_margin_floor(whatif, tmp_path, capsys):
    import stability_bench as sb

    from autosel.db import TuningDB
    from autosel.decisions import CandidateResult, Decision, ShapeResult

    # Used to break: --replay with --margin-floor dropped the --replay run.
    shapes = [{"tokens": 1, "hidden": 64}]
    decision = Decision(
        op="layernorm.rmsnorm", mode="eager", bucket="*", winner="torch", platform_key="p", versions={}, margin=0.1,
        candidates=tuple(CandidateResult(b, "ok", shapes=(ShapeResult(shapes[0], timing=_m((t, t, t))),))
                         for b, t in (("torch", 10.0), ("triton", 20.0))),
        per_shape_winners=(('{"hidden": 64, "tokens": 1}', "torch"),))
    for i in (1, 2):
        TuningDB.open(tmp_path / f"tune{i}.db", include_package=False).record(decision)
    assert sb.main(["--out", str(tmp_path), "--compare", "--replay", "--margin-floor", "0.05"]) == 0
    titles = [line for line in capsys.readouterr().out.splitlines() if line.startswith("## ")]
    assert titles == ["## each timing method's floor", "## margin floor 0.05"]


@pytest.mark.parametrize("args", [[], ["--drift"], ["--settled", "1.5"]])
def test_a_folder_without_the_tunes_is_an_error(whatif, tmp_path, args):
    # Used to break: an IndexError, or (--drift, --settled) the folder's name and nothing else, exit status 0.
    with pytest.raises(SystemExit) as exit_:
        whatif.main([str(tmp_path / "nosuch"), *args])
    assert exit_.value.code.startswith(f"{tmp_path / 'nosuch'}: no tune")
