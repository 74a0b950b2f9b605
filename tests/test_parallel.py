"""autosel.parallel: tune jobs spread over worker processes. Without a GPU, two workers on this CPU stand in
for two GPUs of one kind; the toy ops' backends are 64x apart, so each decision is the same wherever it is made.
Each test that starts workers costs about two seconds (a spawned interpreter importing torch)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from conftest import use_registry

from autosel import batch, config, parallel, tuning
from autosel.decisions import Decision
from autosel.errors import DeviceError
from autosel.platforms import PlatformInfo
from autosel.registry import KernelRegistry
from autosel.spec import KernelBackend as B, KernelSpec, OpDefinition
from autosel.jobs import TuneJob, TuneOutcome

HERE = Path(__file__).parent
HOST = PlatformInfo.detect()  # what a worker on this machine detects: its jobs must be for this platform
A100 = PlatformInfo("cuda", 8, 0, arch="sm_80", device_name="NVIDIA A100-SXM4-80GB", multiprocessor_count=108)
H100 = PlatformInfo("cuda", 9, 0, arch="sm_90", device_name="NVIDIA H100 80GB HBM3", multiprocessor_count=132)


def cpu_workers(*names: str, here: str | None = None) -> list[parallel.Worker]:
    """Spawned workers on this CPU, and the worker that is this process when `here` names it."""
    return [parallel.Worker(name, {"AUTOSEL_TEST_WORKER": name}, HOST, in_process_device=0 if name == here else None)
            for name in names]


@pytest.fixture
def reg(monkeypatch):
    """toy.small, toy.large (more shapes: the longer job), toy.broken (its input factory raises)."""
    import toy_kernels

    monkeypatch.syspath_prepend(str(HERE))  # spawned workers start with this sys.path too
    fresh = KernelRegistry()
    use_registry(monkeypatch, fresh)
    shapes = {"toy.small": toy_kernels.SHAPES[1:], "toy.large": toy_kernels.SHAPES * 2, "toy.broken": [{"n": 4}]}
    for op, op_shapes in shapes.items():
        fresh.register(KernelSpec(op, B.TORCH, "toy_kernels:slow"))
        fresh.register(KernelSpec(op, B.TRITON, "toy_kernels:fast"))
        make_inputs = toy_kernels.broken_inputs if op == "toy.broken" else toy_kernels.inputs
        fresh.define(OpDefinition(op, shapes=op_shapes, make_inputs=make_inputs))
    return fresh


# What tune_ops hands run_jobs: the function that tunes one job, and the one that opens the DB once a process.
TUNING = dict(run=batch.run_job, open_db=tuning.database)


def plan(db=None) -> list[TuneJob]:
    return [j for j in batch.plan_jobs(HOST, db or tuning.database(), ["toy.*"]) if isinstance(j, TuneJob)]


def stored(db_file) -> list[tuple]:
    return sqlite3.connect(db_file).execute("SELECT op, mode, bucket, winner FROM decisions ORDER BY op").fetchall()


def test_two_workers_tune_every_job_once_into_the_one_db_and_report_a_failing_one(reg):
    events = []
    outcomes = parallel.run_jobs(plan(), cpu_workers("cpu-a", "cpu-b"),
                                 **TUNING, settings=config.settings(), budget_s=5,
                                 on_event=lambda event, worker: events.append((worker, event)))
    assert [(o.op, o.status, o.decision and o.decision.winner) for o in outcomes] == [
        ("toy.broken", "failed", None), ("toy.large", "tuned", "triton"), ("toy.small", "tuned", "triton")]
    assert "input factory failed (simulated)" in outcomes[0].detail
    assert stored(config.settings().db) == [("toy.large", "eager", "*", "triton"),
                                           ("toy.small", "eager", "*", "triton")]
    assert {worker for worker, _ in events} == {"cpu-a", "cpu-b"}
    started = sorted(event.op for _, event in events if event.kind == "started")
    assert started == ["toy.broken", "toy.large", "toy.small"]  # each job once
    assert [event.op for _, event in events if event.kind == "failed"] == ["toy.broken"]
    # Each outcome names the worker that tuned it, the one whose events started it.
    by_started = {event.op: worker for worker, event in events if event.kind == "started"}
    assert [o.device for o in outcomes] == [by_started[o.op] for o in outcomes]


def test_tune_ops_over_devices_decides_as_the_one_process_tune_does(reg, monkeypatch, tmp_path):
    monkeypatch.setattr(parallel, "gpu_workers", lambda devices: cpu_workers("cpu-a", "cpu-b"))
    spread = batch.tune_ops(["toy.*"], budget_s=5, devices=[0, 1])
    one_db = config.read_settings({"AUTOSEL_DB": str(tmp_path / "one.db")})
    alone = batch.tune_ops(["toy.*"], budget_s=5, settings=one_db)

    def decided(outcomes):
        return [(o.op, o.mode, o.status, o.platform_key, o.decision and o.decision.winner,
                 o.decision and [(c.backend, c.status) for c in o.decision.candidates]) for o in outcomes]

    assert decided(spread) == decided(alone)
    assert stored(config.settings().db) == stored(tmp_path / "one.db")


def no_process_starts(monkeypatch) -> None:
    import multiprocessing.context

    def start(self):
        raise AssertionError(f"a process was started: {self.name}")

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)


def test_one_worker_that_is_this_process_starts_no_process_and_decides_as_the_one_process_tune(reg, monkeypatch,
                                                                                                tmp_path):
    no_process_starts(monkeypatch)
    events = []
    outcomes = parallel.run_jobs(plan(), cpu_workers("cpu-here", here="cpu-here"), **TUNING, settings=config.settings(),
                                 budget_s=5, on_event=lambda event, worker: events.append((worker, event.kind)))
    one_db = config.read_settings({"AUTOSEL_DB": str(tmp_path / "one.db")})
    alone = batch.tune_ops(["toy.*"], budget_s=5, settings=one_db)
    assert [(o.op, o.status, o.decision and o.decision.winner) for o in outcomes] == [
        (o.op, o.status, o.decision and o.decision.winner) for o in alone] == [
        ("toy.broken", "failed", None), ("toy.large", "tuned", "triton"), ("toy.small", "tuned", "triton")]
    assert stored(config.settings().db) == stored(tmp_path / "one.db")
    assert {worker for worker, _ in events} == {"cpu-here"} and events.count(("cpu-here", "started")) == 3


def test_this_process_and_a_spawned_worker_tune_every_job_once(reg):
    events = []
    outcomes = parallel.run_jobs(plan(), cpu_workers("cpu-here", "cpu-b", here="cpu-here"),
                                 **TUNING, settings=config.settings(), budget_s=5,
                                 on_event=lambda event, worker: events.append((worker, event)))
    assert [(o.op, o.status) for o in outcomes] == [("toy.broken", "failed"), ("toy.large", "tuned"),
                                                    ("toy.small", "tuned")]
    assert sorted(event.op for _, event in events if event.kind == "started") == ["toy.broken", "toy.large",
                                                                                  "toy.small"]
    assert [(w, event.op) for w, event in events if event.kind == "started"][0] == ("cpu-here", "toy.large")
    assert stored(config.settings().db) == [("toy.large", "eager", "*", "triton"),
                                           ("toy.small", "eager", "*", "triton")]


def test_an_error_while_serving_the_workers_is_raised_not_a_hang(reg):
    def on_event(event, worker):
        raise RuntimeError("the progress display broke")

    with pytest.raises(RuntimeError, match="the progress display broke"):
        parallel.run_jobs(plan(), cpu_workers("cpu-here", "cpu-b", here="cpu-here"),
                          **TUNING, settings=config.settings(),
                          budget_s=5, on_event=on_event)


def test_only_one_worker_can_be_this_process(reg):
    with pytest.raises(ValueError, match="only one worker can be this process, got cpu-a, cpu-b"):
        parallel.run_jobs(plan(), [parallel.Worker(n, {}, HOST, in_process_device=0) for n in ("cpu-a", "cpu-b")],
                          **TUNING, settings=config.settings(), budget_s=5)


def test_a_worker_that_dies_fails_its_job_and_the_others_take_the_rest(reg):
    # A segfaulting kernel ends its worker: its job fails, naming that; the other worker tunes the rest.
    reg.register(KernelSpec("toy.crash", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.crash", B.TRITON, "toy_kernels:segfaults"))
    import toy_kernels

    reg.define(OpDefinition("toy.crash", shapes=[{"n": 4}] * 9, make_inputs=toy_kernels.inputs))  # the longest
    outcomes = parallel.run_jobs(plan(), cpu_workers("cpu-a", "cpu-b"),
                                 **TUNING, settings=config.settings(), budget_s=5)
    by_op = {o.op: o for o in outcomes}
    assert by_op["toy.crash"].status == "failed" and "died (exit code -11)" in by_op["toy.crash"].detail
    assert (by_op["toy.small"].status, by_op["toy.large"].status) == ("tuned", "tuned")


def test_a_worker_interrupted_by_ctrl_c_exits_quietly_and_its_job_fails_naming_that(reg, capfd):
    # Used to print a whole traceback per worker: Ctrl-C reaches every process of the terminal's group.
    reg.register(KernelSpec("toy.interrupted", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.interrupted", B.TRITON, "toy_kernels:interrupted"))
    import toy_kernels

    reg.define(OpDefinition("toy.interrupted", shapes=[{"n": 4}] * 9, make_inputs=toy_kernels.inputs))
    outcomes = parallel.run_jobs(plan(), cpu_workers("cpu-a", "cpu-b"),
                                 **TUNING, settings=config.settings(), budget_s=5)
    by_op = {o.op: o for o in outcomes}
    assert "died (exit code 130)" in by_op["toy.interrupted"].detail
    assert (by_op["toy.small"].status, by_op["toy.large"].status) == ("tuned", "tuned")
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def decision(op: str, tune_s: float, *, platform=HOST, created_at="2026-01-01T00:00:00+00:00",
             versions=None) -> Decision:
    return Decision(op=op, mode="eager", bucket="*", winner="triton", platform_key=platform.key,
                    versions=versions or {},
                    candidates=(), margin=0.0, tune_s=tune_s, created_at=created_at)


def test_jobs_go_out_longest_first_by_earlier_tune_times_else_candidates_times_shapes(reg):
    db = tuning.database()
    jobs = plan(db)
    assert [jobs[i].op for i in parallel.longest_first(jobs, db)] == ["toy.large", "toy.broken", "toy.small"]
    db.record(decision("toy.broken", 60.0))  # an earlier tune (other versions, say) took a minute
    db.record(decision("toy.small", 0.5, created_at="2026-02-01T00:00:00+00:00"))  # the newest counts
    db.record(decision("toy.small", 99.0, versions={"torch": "2.0"}))
    db.record(decision("toy.large", 500.0, platform=A100))  # another platform's time does not count
    assert [parallel.estimate_s(j, parallel.earlier_tune_s(db)) for j in jobs] == [60.0, 8.0, 0.5]
    assert [jobs[i].op for i in parallel.longest_first(jobs, db)] == ["toy.broken", "toy.large", "toy.small"]


@pytest.mark.parametrize("devices, expected", [("all", [0, 1, 2]), ("0,2", [0, 2]), (" 2, 0 ,2", [2, 0]),
                                               ([1], [1])])
def test_devices_name_gpus_in_order_once(devices, expected):
    assert parallel.parse_devices(devices, 3) == expected


@pytest.mark.parametrize("devices, count, message", [
    ("0,x", 2, "devices must be 'all' or GPU indices separated by commas such as '0,1', got '0,x'"),
    ("3", 2, "GPU 3 asked for, but this process sees 2 GPU(s) (0 to 1); pass indices among them, or 'all'"),
])
def test_devices_that_are_not_there_say_which(devices, count, message):
    with pytest.raises(DeviceError) as info:
        parallel.parse_devices(devices, count)
    assert str(info.value) == message


def test_devices_without_a_gpu_is_an_error_that_says_so(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with pytest.raises(DeviceError, match="^no GPU is visible to torch here"):
        batch.tune_ops(devices="all")


def fake_gpus(monkeypatch, kinds: list[PlatformInfo], visible: str | None) -> None:
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(kinds))
    monkeypatch.setattr(PlatformInfo, "detect", classmethod(lambda cls, device_index=0: kinds[device_index]))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)


def test_each_worker_sees_its_own_gpu_among_those_this_process_sees(monkeypatch):
    fake_gpus(monkeypatch, [A100, H100, A100], "5,6,7")
    workers = parallel.gpu_workers("all")
    assert [(w.name, w.env, w.platform.key) for w in workers] == [
        ("cuda:0", {"CUDA_VISIBLE_DEVICES": "5"}, A100.key), ("cuda:1", {"CUDA_VISIBLE_DEVICES": "6"}, H100.key),
        ("cuda:2", {"CUDA_VISIBLE_DEVICES": "7"}, A100.key)]
    fake_gpus(monkeypatch, [A100, H100], None)
    assert [w.env for w in parallel.gpu_workers("1")] == [{"CUDA_VISIBLE_DEVICES": "1"}]


def test_the_first_named_gpu_is_tuned_in_this_process_the_others_by_spawned_workers(monkeypatch):
    fake_gpus(monkeypatch, [A100, A100, A100], None)
    assert [(w.name, w.in_process_device) for w in parallel.gpu_workers("2,0")] == [("cuda:2", 2), ("cuda:0", None)]
    assert [w.in_process_device for w in parallel.gpu_workers("all")] == [0, None, None]


def test_gpus_of_two_kinds_each_get_every_job_once(reg, monkeypatch):
    # Two models on one host: every (op, mode) is planned once per kind and handed only to that kind's workers.
    fake_gpus(monkeypatch, [A100, H100, A100], None)
    handed = {}

    def run_jobs(jobs, workers, **options):
        handed.update(jobs=[(j.op, j.platform_key) for j in jobs], workers=[w.platform.key for w in workers])
        return [TuneOutcome(j.op, j.mode, "failed", None, "not run", platform_key=j.platform_key) for j in jobs]

    monkeypatch.setattr(parallel, "run_jobs", run_jobs)
    outcomes = batch.tune_ops(["toy.small"], modes=["eager"], devices="all")
    assert handed == {"jobs": [("toy.small", A100.key), ("toy.small", H100.key)],
                      "workers": [A100.key, H100.key, A100.key]}
    assert [(o.op, o.platform_key) for o in outcomes] == [("toy.small", A100.key), ("toy.small", H100.key)]


def test_the_command_spreads_the_tune_shows_each_worker_and_exits_1_for_a_failed_job(reg, monkeypatch):
    from click.testing import CliRunner

    from autosel import cli

    monkeypatch.setattr(parallel, "gpu_workers", lambda devices: cpu_workers("cpu-a", "cpu-b"))
    result = CliRunner().invoke(cli.main, ["tune", "--op", "toy.*", "--devices", "0,1", "--budget-s", "5"])
    assert result.exit_code == 1
    assert result.stderr.startswith("  toy.")  # the workers' progress lines, then the failure
    assert {"toy.small", "toy.large"} == {line.split()[0] for line in result.stderr.splitlines()
                                          if " on cpu-" in line and line.endswith(")") and "chosen" in line}
    assert "Error: 1 of 3 op/mode pairs could not be tuned: toy.broken (eager): op 'toy.broken': its make_inputs " \
           "raised RuntimeError" in result.stderr
    rows = [line.split()[:4] for line in result.stdout.splitlines() if line.strip().startswith("toy.")]
    assert [(op, mode, status) for op, mode, _, status in rows] == [
        ("toy.broken", "eager", "failed"), ("toy.large", "eager", "tuned"), ("toy.small", "eager", "tuned")]
    assert {device for _, _, device, _ in rows} <= {"cpu-a", "cpu-b"}  # the device column: which worker tuned it
