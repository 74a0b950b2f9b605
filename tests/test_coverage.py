"""What a DB covers for a target platform (autosel check's library side): which row counts, for which target."""

from __future__ import annotations

import pytest

from autosel import coverage
from autosel.db import TuningDB, export_decisions
from autosel.decisions import CandidateResult, Decision
from autosel.platforms import PlatformInfo, installed_version
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec

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
