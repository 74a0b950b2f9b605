"""What a DB covers for a target platform (autosel check's library side): which row counts, for which target."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autosel import coverage
from autosel.db import TuningDB, export_decisions
from autosel.decisions import CandidateResult, Decision
from autosel.platforms import PlatformInfo, installed_version
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition

HERE = PlatformInfo("cpu", arch="x86_64", device_name="build host", multiprocessor_count=8)
H200, H100 = "cuda/sm_90/NVIDIA_H200/132", "cuda/sm_90/NVIDIA_H100_80GB_HBM3/132"
TORCH = installed_version("torch")


def row(platform: str, winner: str, *, torch: str = TORCH, mode: str = "graph") -> Decision:
    return Decision(op="toy.op", mode=mode, bucket="*", winner=winner, platform_key=platform,
                    versions={"torch": torch, "cuda": "13.0"}, candidates=(CandidateResult(winner, "ok", score=1.0),),
                    margin=0.06, created_at="2026-01-01T00:00:00+00:00")


@pytest.fixture
def registry():
    reg = KernelRegistry()
    reg.register(KernelSpec("toy.op", B.TORCH, "m:a"))
    reg.register(KernelSpec("toy.op", B.TRITON, "m:b"))
    return reg


def covered(tmp_path, registry, *rows: Decision, match: str = "exact", target: str = H200) -> list[coverage.Coverage]:
    export_decisions(rows, tmp_path / "ship.db", fmt="sqlite", overwrite=True)
    with TuningDB.open(None, [tmp_path / "ship.db"], include_package=False, read_only=True) as db:
        return coverage.check(["toy.op"], db=db, registry=registry, platform=HERE, target=target, match=match,
                              modes=["graph"])


def test_modes_of_a_gpu_target_are_eager_and_graph_and_of_a_cpu_eager():
    assert coverage.modes_of(H200) == ["eager", "graph"] and coverage.modes_of(HERE.key) == ["eager"]


@pytest.mark.parametrize("match, expected", [
    ("exact", (False, None)),
    ("device", (True, "torch")),  # the target's own row under other versions
    ("arch", (True, "torch")),  # ... before another model's row whose versions agree
])
def test_the_target_s_own_rows_come_first_then_the_same_arch(tmp_path, registry, match, expected):
    [found] = covered(tmp_path, registry, row(H200, "torch", torch="1.0"), row(H100, "triton"), match=match)
    assert (found.ok, found.winner) == expected
    if found.ok:
        assert found.near == f"near match: versions differ: torch 1.0 -> {TORCH}"


def test_an_agreeing_row_of_the_target_is_exact_and_says_what_it_could_not_check(tmp_path, registry):
    [found] = covered(tmp_path, registry, row(H200, "torch", torch="1.0"), row(H200, "triton"))
    assert (found.ok, found.winner, found.near) == (True, "triton", None)
    assert found.detail.endswith("; cuda not checked (only the target can tell)")


def test_a_winner_not_registered_here_is_no_decision(tmp_path, registry):
    [found] = covered(tmp_path, registry, row(H200, "flashinfer"))
    assert not found.ok and found.detail == (f"no usable graph decision for {H200} (its stored winners flashinfer "
                                             "are not registered for toy.op here)")


def test_another_model_counts_only_with_arch(tmp_path, registry):
    [exact] = covered(tmp_path, registry, row(H100, "triton"))
    [arch] = covered(tmp_path, registry, row(H100, "triton"), match="arch")
    assert not exact.ok and exact.detail == f"no usable graph decision for {H200} (stored for: {H100})"
    assert arch.ok and arch.near == f"near match: tuned on {H100}, the target is {H200}"


def test_a_decision_that_never_timed_a_backend_eligible_here_is_not_counted_and_names_it(tmp_path, registry):
    # A backend registered after the tune (a plug-in's) was never timed: check counted the row as usable.
    old = Decision(op="toy.op", mode="eager", bucket="*", winner="torch", platform_key=HERE.key, versions={},
                   candidates=(CandidateResult("torch", "ok", score=1.0),), margin=0.05,
                   created_at="2026-01-01T00:00:00+00:00")
    export_decisions([old], tmp_path / "ship.db", fmt="sqlite", overwrite=True)
    with TuningDB.open(None, [tmp_path / "ship.db"], include_package=False, read_only=True) as db:
        [found] = coverage.check(["toy.op"], db=db, registry=registry, platform=HERE, modes=["eager"])
    assert not found.ok
    assert found.detail.startswith("the stored eager decision (torch, shipped DB ") and found.detail.endswith(
        "never timed triton, eligible here since it was made: re-tune the op (selection keeps it only where nothing "
        "can be timed: AUTOSEL_TUNE=off, CUDA-graph capture)")


def test_a_target_row_checked_with_other_tolerances_than_the_ops_now_is_not_counted(tmp_path, registry):
    # check counted it for the target, where selection passes it over (tuning.outdated) and tunes again.
    registry.define(OpDefinition("toy.op", shapes=[{"n": 1}], make_inputs=lambda shape, device: (), atol=0.02))
    then = replace(row(H200, "triton"), checked_with="rtol=None, atol=0.5, reference the op's torch backend")
    [found] = covered(tmp_path, registry, then)
    assert not found.ok and found.detail == (
        f"the stored graph decision for {H200} (triton, shipped DB {tmp_path / 'ship.db'}) was checked with "
        "rtol=None, atol=0.5, reference the op's torch backend; the op is checked with rtol=None, atol=0.02, "
        "reference the op's torch backend now: re-tune the op on the target")


def test_of_two_near_rows_of_one_layer_the_newest_counts_as_selection_takes_it(tmp_path, registry):
    # check took the first stored row where lookup_near takes the newest.
    older = row(H200, "torch", torch="1.0")
    newer = replace(row(H200, "triton", torch="0.9"), created_at="2026-02-01T00:00:00+00:00")
    [found] = covered(tmp_path, registry, older, newer, match="device")
    assert (found.ok, found.winner) == (True, "triton")
