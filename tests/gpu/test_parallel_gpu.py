"""On a GPU: `tune_ops(devices=...)` tunes its first GPU in this process (no process started) and, beside it, in a
spawned worker process; both write the one DB. With one GPU the spawned worker shares it, so these tests check
that the jobs run and land, not what they decide. Skipped without CUDA."""

from __future__ import annotations

import multiprocessing.context

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

from autosel import batch, config, parallel, tuning  # noqa: E402
from autosel.platforms import PlatformInfo  # noqa: E402
from autosel.jobs import TuneJob  # noqa: E402


def test_devices_all_tunes_the_first_gpu_in_this_process_in_both_modes(monkeypatch):
    def start(self):
        raise AssertionError(f"a process was started: {self.name}")

    if torch.cuda.device_count() == 1:  # with more GPUs the others get spawned workers
        monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    before = torch.cuda.current_device()
    outcomes = batch.tune_ops(["gemm.mm"], budget_s=2, devices="0")
    assert [(o.op, o.mode, o.status) for o in outcomes] == [("gemm.mm", "eager", "tuned"),
                                                            ("gemm.mm", "graph", "tuned")]
    assert {o.platform_key for o in outcomes} == {PlatformInfo.detect(device_index=0).key}
    assert torch.cuda.current_device() == before


def test_this_process_and_a_spawned_worker_on_the_same_gpu_tune_every_job_once_into_the_one_db():
    platform = PlatformInfo.detect(device_index=0)
    db = tuning.database()
    jobs = [j for j in batch.plan_jobs(platform, db, ["gemm.mm", "activation.silu_and_mul"])
            if isinstance(j, TuneJob)]
    workers = [parallel.Worker("here", {}, platform, in_process_device=0),
               parallel.Worker("spawned", {"CUDA_VISIBLE_DEVICES": "0"}, platform)]
    started = []
    # force: the spawned worker also sees the package's shipped H200 decisions (conftest hides them only here)
    outcomes = parallel.run_jobs(jobs, workers, settings=config.settings(), budget_s=2, force=True,
                                 on_event=lambda event, worker: event.kind == "started" and started.append(
                                     (event.op, event.mode)))
    assert [o.status for o in outcomes] == ["tuned"] * 4
    assert sorted(started) == sorted((j.op, j.mode) for j in jobs)  # each job once
    stored = {(d.op, d.mode) for d, _ in tuning.database().decisions() if d.bucket == "*"}
    assert stored == {(j.op, j.mode) for j in jobs}


def test_an_isolated_check_under_devices_runs_on_the_gpu_the_parent_tunes():
    # The checking child sees only the parent's current GPU (isolate.child_env) as its device 0.
    outcomes = batch.tune_ops(["gemm.mm"], modes=["eager"], budget_s=1, isolate_timeout_s=120,
                               devices=str(torch.cuda.device_count() - 1))
    assert [(o.op, o.status) for o in outcomes] == [("gemm.mm", "tuned")]
    assert all(c.status != "rejected" for c in outcomes[0].decision.candidates), outcomes[0].decision.candidates
