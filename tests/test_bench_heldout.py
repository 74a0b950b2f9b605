"""autosel.bench.heldout (`autosel bench heldout`): its seeded held-out shapes (built on the meta device) and one
tiny run on this CPU."""

from __future__ import annotations

import json

import pytest

from autosel.bench import heldout as bench_module
from autosel.registry import registry


@pytest.fixture
def bench():
    return bench_module


class GpuPlatform:
    torch_device = "cuda"


class CpuPlatform:
    torch_device = "cpu"


SEEDS = range(8)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_seeds_shapes_are_no_representative_shape_and_each_op_costs_what_20_norm_shapes_do(bench, seed):
    # A representative shape among them would put in-sample figures into the held-out table.
    shapes = bench.held_out_shapes(seed)
    assert sorted(shapes) == sorted(bench.OPS)
    for op, found in shapes.items():
        definition = registry.definition(op)
        representative = [*definition.shapes(GpuPlatform()), *definition.shapes(CpuPlatform())]
        assert not [s for s in found if s in representative], op
        assert len({json.dumps(s, sort_keys=True) for s in found}) == len(found), op
        assert len(found) == (20 if op.startswith("layernorm.") else 10), op
        counts = {s.get("tokens", s.get("m")) for s in found}
        assert not [t for t in counts if t & (t - 1) == 0], op  # no power of two: the buckets' own counts


def test_a_seed_draws_the_same_shapes_every_time_and_another_seed_others(bench):
    assert bench.held_out_shapes(3) == bench.held_out_shapes(3)
    assert bench.held_out_shapes(3) != bench.held_out_shapes(4)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("op", ["layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "activation.silu_and_mul",
                                "activation.gelu_and_mul", "embeddings.rope", "gemm.mm"])
def test_every_shape_builds_its_inputs_and_bucket(bench, op, seed):
    # A GPU run must work first time: each shape's inputs and bucket, on the meta device (no memory).
    from autosel.tuner import bucket_of

    definition = registry.definition(op)
    for shape in bench.held_out_shapes(seed)[op]:
        key = bucket_of(definition, definition.make_inputs(dict(shape), "meta"))
        assert key[0] == definition.bucket(*definition.make_inputs(dict(shape), "meta"))[0]


def test_tiny_run_on_this_cpu(bench, tmp_path, monkeypatch):
    from click.testing import CliRunner

    from autosel.bench.results import read_results
    from autosel.cli import main
    from autosel.dispatch import BucketTable

    # The decisions a tune would have stored: bucket (4, 64) runs torch_compile, every other the op-level torch.
    monkeypatch.setattr(bench, "table_for", lambda op, mode: BucketTable(op, mode, "torch", {(4, 64): "torch_compile"}))
    monkeypatch.setattr(bench, "held_out_shapes", lambda seed: {"layernorm.rmsnorm": [{"tokens": 3, "hidden": 64},
                                                                                      {"tokens": 24, "hidden": 96}]})
    result = CliRunner().invoke(main, ["bench", "heldout", "--op", "layernorm.rmsnorm", "--mode", "eager", "--seed",
                                       "5", "--results", str(tmp_path)])
    assert result.exit_code == 0, result.output
    [record] = read_results(tmp_path)
    assert record["kind"] == "heldout" and record["command"].endswith("--seed 5 --results " + str(tmp_path))
    body = record["results"]
    [op] = body["ops"]
    assert body["seed"] == 5 and [r["bucket"] for r in op["rows"]] == [[4, 64], [32, 96]]
    assert [r["dispatcher"] for r in op["rows"]] == ["torch_compile", "torch"]
    [row] = body["tables"][0]["rows"]
    assert row[:3] == ["layernorm.rmsnorm", "eager", 2] and row[3] >= 1.0
    # One figure per round timed (at most the tuner's three; a shape whose winner is settled after one has one).
    assert 1 <= len(op["dispatcher_over_best_fixed_per_round"]) <= 3


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
    # nothing rejected: sgl_kernel is the best
    assert bench.summarize(rows, table)["dispatcher"][1] == pytest.approx(13 / 8)


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


@pytest.mark.parametrize("args, said", [
    (["--op", "nosuch.*"], "no op matches --op 'nosuch.*'; known ops (several backends here, held-out shapes): "),
    (["--mode", "graph"], "--mode graph: this cpu machine has no graph mode; it runs eager mode only"),
])
def test_a_run_that_would_time_nothing_or_mislabel_it_is_refused(tmp_path, args, said):
    # Used to break: --op matching nothing wrote nothing and exited 0; --mode graph on a CPU timed the eager
    # decisions under a "graph" heading.
    from click.testing import CliRunner

    from autosel.cli import main

    result = CliRunner().invoke(main, ["bench", "heldout", "--results", str(tmp_path / "out"), *args])
    assert result.exit_code == 1 and said in result.output and not (tmp_path / "out").exists()


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
            # left ahead of all in every round the tuner counts (a 71-token GEMM once went unreported so)
            {"shape": {"tokens": 8}, "rounds_us": {"triton": [13.7], "flashinfer": [9.9], "sgl_kernel": [13.8]}},
            {"shape": {"tokens": 9}, "rounds_us": {"triton": [9.9], "flashinfer": [13.7]}}]  # settled on triton
    wins = bench.steady_wins(rows, "triton", rejected=("torch",))
    # shape 1: flashinfer's worst round 0.99x and sgl-kernel's 0.98x: the steadier lead is named
    assert [(r["shape"]["tokens"], b) for r, b, w in wins] == [(1, "sgl_kernel"), (5, "flashinfer"), (8, "flashinfer")]
    assert [w for r, b, w in wins] == [pytest.approx(0.98), pytest.approx(0.5), pytest.approx(9.9 / 13.7)]
