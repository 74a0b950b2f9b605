"""tools/heldout_bench.py: its held-out shape sets (built on the meta device) and one tiny run on this CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from autosel.registry import registry

TOOL = Path(__file__).resolve().parents[1] / "tools" / "heldout_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("heldout_bench", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class GpuPlatform:
    torch_device = "cuda"


# Every set in the order it was made; a new one is added here and in tools/heldout_bench.py's SETS alike.
SETS = [f"set{i}" for i in range(1, 29)]


@pytest.mark.parametrize("name", SETS[1:])
def test_each_set_is_held_out_from_every_earlier_one_and_costs_what_set1_did(bench, name):
    # A shape of an earlier set (or a representative one) would put in-sample figures into a new set's table.
    assert list(bench.SETS) == SETS
    earlier = list(bench.SETS)[:list(bench.SETS).index(name)]
    for op, shapes in bench.SETS[name].items():
        representative = registry.definition(op).shapes(GpuPlatform())
        assert not [s for s in shapes if s in representative or any(s in bench.SETS[e][op] for e in earlier)], op
        assert len({json.dumps(s, sort_keys=True) for s in shapes}) == len(shapes), op
        assert len(shapes) == len(bench.SET1[op]), op  # the benchmark's device time stays where it was


@pytest.mark.parametrize("name", SETS[2:])
def test_a_later_set_has_no_token_count_or_width_of_an_earlier_set(bench, name):
    def widths(shapes):
        return {tuple(v for k, v in s.items() if k not in ("tokens", "m")) for s in shapes}

    earlier = list(bench.SETS)[:list(bench.SETS).index(name)]
    tokens = {s.get("tokens", s.get("m")) for e in earlier for op in bench.SET1 for s in bench.SETS[e][op]}
    for op, shapes in bench.SETS[name].items():
        assert not tokens & {s.get("tokens", s.get("m")) for s in shapes}, op
        assert not widths(shapes) & set().union(*(widths(bench.SETS[e][op]) for e in earlier)), op


@pytest.mark.parametrize("name", SETS[1:])
@pytest.mark.parametrize("op", ["layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "activation.silu_and_mul",
                                "activation.gelu_and_mul", "embeddings.rope", "gemm.mm"])
def test_every_shape_builds_its_inputs_and_bucket(bench, op, name):
    # The H200 run must work first time: each shape's inputs and bucket, on the meta device (no memory).
    from autosel.buckets import bucket_of

    definition = registry.definition(op)
    for shape in bench.SETS[name][op]:
        key = bucket_of(definition, definition.make_inputs(dict(shape), "meta"))
        assert key[0] == definition.bucket(*definition.make_inputs(dict(shape), "meta"))[0]


def test_tiny_run_on_this_cpu(bench, tmp_path, monkeypatch):
    from autosel.dispatch import BucketTable

    # The decisions a tune would have stored: bucket (4, 64) runs torch_compile, every other the op-level torch.
    monkeypatch.setattr(bench, "table_for", lambda op, mode: BucketTable(op, mode, "torch", {(4, 64): "torch_compile"}))
    monkeypatch.setitem(bench.SETS, "set2", {"layernorm.rmsnorm": [{"tokens": 3, "hidden": 64},
                                                                   {"tokens": 24, "hidden": 96}]})
    assert bench.main(["--out", str(tmp_path), "--op", "layernorm.rmsnorm", "--mode", "eager"]) == 0
    (result,) = json.loads((tmp_path / "heldout.json").read_text())
    assert result["shapes"] == "set2" and [r["bucket"] for r in result["rows"]] == [[4, 64], [32, 96]]
    assert [r["dispatcher"] for r in result["rows"]] == ["torch_compile", "torch"]
    assert "held-out shapes set2" in (tmp_path / "heldout.md").read_text()
    # One figure per round timed (at most the tuner's three; a shape whose winner is settled after one has one).
    assert 1 <= len(result["dispatcher_over_best_fixed_per_round"]) <= 3


def test_a_backend_the_tune_rejected_is_listed_but_not_the_per_shape_best(bench):
    from autosel.dispatch import BucketTable

    # sgl_kernel's rope failed the tune's check at a representative shape, yet passes at a held-out one and is
    # fastest there: the dispatcher can never run it, so the best it is judged against is flashinfer's.
    rows = [{"bucket": [16, 3072, True], "us": {"flashinfer": 13.0, "triton": 20.0, "sgl_kernel": 8.0}},
            {"bucket": [2048, 3072, True], "us": {"flashinfer": 31.0, "triton": 28.0, "sgl_kernel": 60.0}}]
    table = BucketTable("embeddings.rope", "eager", "flashinfer")
    summary = bench.summarize(rows, table, {"sgl_kernel": "output differs from the reference"})
    assert [r["best"] for r in rows] == ["flashinfer", "triton"]
    assert summary["dispatcher"] == pytest.approx(((31 / 28) ** 0.5, 31 / 28))
    assert summary["sgl_kernel"][1] == pytest.approx(60 / 28)
    assert bench.summarize(rows, table)["dispatcher"][1] == pytest.approx(13 / 8)  # nothing rejected: sgl_kernel is best


def test_the_dispatcher_over_the_best_fixed_backend_round_by_round(bench):
    rows = [{"dispatcher": "triton", "rounds_us": {"triton": [10.0, 12.0, 9.0], "flashinfer": [11.0, 11.0, 10.0]}},
            {"dispatcher": "flashinfer", "rounds_us": {"triton": [40.0], "flashinfer": [20.0, 22.0, 18.0]}}]
    # Round by round the dispatcher's pick against flashinfer's; triton sat out rounds 2 and 3 at the second shape,
    # where it is not the pick, so nothing is carried there.
    assert bench.per_round(rows, "flashinfer") == pytest.approx([(10 / 11) ** 0.5, (12 / 11) ** 0.5, (9 / 10) ** 0.5])
    # Against triton, whose single round at the second shape is carried into the rounds it sat out.
    assert bench.per_round(rows, "triton") == pytest.approx([(20 / 40) ** 0.5, (22 / 40) ** 0.5, (18 / 40) ** 0.5])
    rows[1]["rounds_us"].pop("triton")  # triton failed there: no comparison
    assert bench.per_round(rows, "triton") == []


@pytest.fixture
def whatif(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOL.parent))
    return importlib.import_module("heldout_whatif")


def _call(folder: Path, rows: list[dict], rejected: dict, tuned_mode: str = "eager") -> None:
    """A device call's results: a tune.db where torch wins rmsnorm eager everywhere, and one held-out run's rows."""
    from autosel.db import TuningDB
    from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult

    shapes = [{"tokens": 1, "hidden": 64}, {"tokens": 64, "hidden": 64}]
    times = {"torch": (10.0, 10.0), "triton": (20.0, 20.0)}
    decision = Decision(
        op="layernorm.rmsnorm", mode=tuned_mode, bucket="*", winner="torch", platform_key="p", versions={}, margin=0.1,
        candidates=tuple(CandidateResult(b, "ok", shapes=tuple(
            ShapeResult(s, timing=Measurement(t, t, t, 45, "cpu", round_medians_us=(t, t, t)))
            for s, t in zip(shapes, ts))) for b, ts in times.items()) + (CandidateResult("sgl_kernel", "rejected"),))
    (folder / "heldout-eager").mkdir(parents=True)
    TuningDB.open(folder / "tune.db", include_package=False).record(decision)
    (folder / "heldout-eager" / "heldout.json").write_text(json.dumps(
        [{"op": "layernorm.rmsnorm", "mode": "eager", "rows": rows, "rejected": rejected}]))


def test_the_what_if_replays_the_held_out_figures_leaving_out_the_rejected_backends(bench, whatif, tmp_path):
    from autosel.dispatch import BucketTable

    # Used to break: the what-if took the per-shape best over every backend and named sgl_kernel, which the tune
    # rejected, the best fixed backend; heldout_bench's table leaves it out of the best.
    rows = [{"bucket": [4, 64], "us": {"torch": 12.0, "triton": 10.0, "sgl_kernel": 6.0}},
            {"bucket": [32, 64], "us": {"torch": 9.0, "triton": 18.0, "sgl_kernel": 5.0}}]
    rejected = {"sgl_kernel": "output differs from the reference"}
    _call(tmp_path, rows, rejected)
    [(op, mode, fixed, replayed)] = whatif.replay(tmp_path)
    table = BucketTable(op, mode, "torch", {(1, 64): "torch", (64, 64): "torch"})
    summary = bench.summarize(rows, table, rejected)
    assert fixed == "torch" and replayed["current"] == pytest.approx(summary["dispatcher"])
    assert all(replayed[b] == pytest.approx(summary[b]) for b in ("torch", "triton", "sgl_kernel"))


@pytest.mark.parametrize("where, args, code, said", [
    ("nosuch", [], 1, "nosuch: no such folder"),
    ("graph-only", [], 1, "tune.db holds no op-level decision for layernorm.rmsnorm in eager mode"),
    ("call", ["--swap", "bad"], 2, "'bad' is not OP:T,W:T,W=BACKEND"),
    ("call", ["--swap", "layernorm.rmsnorm:8,64:4,64=triton"], 1,
     "layernorm.rmsnorm has no tuned bucket (8, 64) in eager mode; its tuned buckets: (1, 64), (64, 64)"),
    ("call", ["--swap", "gemm.mm:8,64,64:4,64,64=triton"], 1, "no held-out run here timed gemm.mm"),
])
def test_the_what_if_refuses_what_it_cannot_replay(whatif, tmp_path, capsys, where, args, code, said):
    # Used to break: a missing folder or a malformed --swap printed an empty table and exited 0; a tune.db without
    # the held-out run's decisions, or a --swap of an untuned bucket, raised KeyError.
    rows = [{"bucket": [4, 64], "us": {"torch": 12.0, "triton": 10.0}}]
    _call(tmp_path / "call", rows, {})
    _call(tmp_path / "graph-only", rows, {}, tuned_mode="graph")
    with pytest.raises(SystemExit) as exit_:
        whatif.main([str(tmp_path / where), *args])
    if code == 2:
        assert exit_.value.code == 2 and said in capsys.readouterr().err
    else:  # raise SystemExit(message): exit status 1
        assert said in exit_.value.code


@pytest.mark.parametrize("args, said", [
    (["--op", "nosuch.*"], "no op matches --op 'nosuch.*'; known ops (several backends here, held-out shapes): "),
    (["--mode", "graph"], "--mode graph: this cpu machine has no graph mode; it runs eager mode only"),
])
def test_a_run_that_would_time_nothing_or_mislabel_it_is_refused(bench, tmp_path, capsys, args, said):
    # Used to break: --op matching nothing wrote nothing and exited 0; --mode graph on a CPU timed the eager
    # decisions under a "graph" heading.
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--out", str(tmp_path / "out"), *args])
    assert exit_.value.code == 2 and said in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_steady_wins_counts_a_shape_only_where_another_backend_won_every_round(bench):
    rows = [{"shape": {"tokens": 1}, "rounds_us": {"triton": [10, 10, 10], "flashinfer": [9, 9.5, 9.9],
                                                   "sgl_kernel": [9.8, 9.0, 9.0]}},
            {"shape": {"tokens": 2}, "rounds_us": {"triton": [10, 10, 10], "flashinfer": [9, 9, 10.5]}},
            {"shape": {"tokens": 3}, "rounds_us": {"triton": [10, 10, 10], "flashinfer": [13]}},  # stopped: behind
            {"shape": {"tokens": 4}, "rounds_us": {"triton": [10, 10, 10]}},
            # the fixed backend far behind, stopped after one round: still a steady win for the others
            {"shape": {"tokens": 5}, "rounds_us": {"triton": [20.0], "flashinfer": [10, 10, 10]}},
            {"shape": {"tokens": 6}, "rounds_us": {"triton": [10, 10, 10], "torch": [1, 1, 1]}},  # rejected
            {"shape": {"tokens": 7}, "rounds_us": {"triton": [0.0, 10, 10], "flashinfer": [9, 9, 9]}},  # no time
            # every backend but one far behind after round 1: the shape is settled, one round each, and the one
            # left ahead of all in every round the tuner counts (set26's 71 x 4224 x 2304 went unreported so)
            {"shape": {"tokens": 8}, "rounds_us": {"triton": [13.7], "flashinfer": [9.9], "sgl_kernel": [13.8]}},
            {"shape": {"tokens": 9}, "rounds_us": {"triton": [9.9], "flashinfer": [13.7]}}]  # settled on triton
    wins = bench.steady_wins(rows, "triton", rejected=("torch",))
    # shape 1: flashinfer's worst round 0.99x and sgl-kernel's 0.98x: the steadier lead is named
    assert [(r["shape"]["tokens"], b) for r, b, w in wins] == [(1, "sgl_kernel"), (5, "flashinfer"), (8, "flashinfer")]
    assert [w for r, b, w in wins] == [pytest.approx(0.98), pytest.approx(0.5), pytest.approx(9.9 / 13.7)]
