"""The `autosel` command line, run as a user would: exit codes, stdout/stderr, JSON, files written.

Toy CPU ops in a fresh registry keep every test to about a second; no test tunes a built-in op.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import use_fresh_registry
from click.testing import CliRunner

from autosel import state
from autosel import cli, tuning
from autosel.cli._common import settings_for
from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult
from autosel.platforms import PlatformInfo
from autosel.spec import CapabilityRequirement as Cap, KernelBackend as B, KernelSpec, OpDefinition

HERE = Path(__file__).parent
ROOT = HERE.parent
CPU = PlatformInfo("cpu", arch="x86_64", device_name="test cpu", multiprocessor_count=2)
OTHER_CPU = PlatformInfo("cpu", arch="x86_64", device_name="other cpu", multiprocessor_count=64)
COMMANDS = sorted(cli.main.commands)


class FakeTimer:
    """Fixed times per backend: CLI tests check what the CLI does with a decision, not CPU timing noise."""

    method = "fake"
    SPEED_US = {"torch": 100.0, "triton": 10.0}

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        fn()
        base = self.SPEED_US.get(backend, 50.0) * shape.get("n", 1024) / 1024
        return [base * (1 + 0.001 * i) for i in range(5)]


@pytest.fixture
def reg(monkeypatch):
    fresh = use_fresh_registry(monkeypatch, CPU, timer=FakeTimer())
    monkeypatch.syspath_prepend(str(HERE))
    return fresh


def toy(reg, *backends, op="toy.double"):
    import toy_kernels

    targets = {B.TORCH: "slow", B.TRITON: "fast", B.AOT: "wrong_but_fast", B.JIT: "raises"}
    for backend in backends:
        reg.register(KernelSpec(op, backend, f"toy_kernels:{targets[backend]}"))
    reg.define(OpDefinition(op, shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))


def run(*args: str):
    return CliRunner().invoke(cli.main, [str(a) for a in args])


def decision(op="toy.double", winner="triton", *, platform=CPU, versions=None, created_at="2026-01-01T00:00:00+00:00"):
    timing = Measurement(median_us=10.0, p20_us=9.0, p80_us=11.0, samples=20, method="fake")
    shapes = (ShapeResult(shape={"n": 4}, timing=timing),)
    return Decision(op=op, mode="eager", bucket="*", winner=winner, platform_key=platform.key,
                    versions=versions or {}, margin=0.03, runner_up="torch", lead_over_runner_up=0.5,
                    candidates=(CandidateResult("torch", "ok", score=1.5, shapes=shapes),
                                CandidateResult("triton", "ok", score=1.0, shapes=shapes)),
                    created_at=created_at)


def store(*decisions, db: Path | None = None):
    settings = settings_for(str(db) if db else None, full=False)
    for d in decisions:
        tuning.database(settings).record(d)


# --- every command: --help with an example, listed in the reference ---------------------------------------

@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example_and_is_in_the_reference(command):
    result = run(command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.output and f"autosel {command} " in result.output
    reference = (ROOT / "docs" / "cli.md").read_text()  # generated from this help by tools/render_docs.py
    assert f"### `autosel {command}`" in reference and f"autosel {command}" in reference


@pytest.fixture
def autosel_logger():
    import logging

    logger = logging.getLogger("autosel")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.handlers[:] = handlers
    logger.setLevel(level)


@pytest.mark.parametrize("args", [["-v", "tune"], ["tune", "-v"], ["tune", "--verbose"]])
def test_verbose_is_accepted_before_and_after_the_command(reg, autosel_logger, args):
    # `autosel show -v` failed with "No such option: -v": -v was accepted only before the command.
    toy(reg, B.TORCH, B.TRITON)
    result = run(*args, "--budget-s", "10")
    assert result.exit_code == 0, result.output
    assert "autosel: INFO: op 'toy.double' (eager mode): triton chosen" in result.stderr


@pytest.mark.parametrize("level, args", [("info", ["tune"]), ("info", ["-v", "tune"]), ("error", ["tune", "-v"])])
def test_autosel_log_logs_as_verbose_does_through_one_handler_and_verbose_wins(reg, autosel_logger, level, args):
    # AUTOSEL_LOG=info was read by no command: only -v logged.
    toy(reg, B.TORCH, B.TRITON)
    result = CliRunner().invoke(cli.main, [*args, "--budget-s", "10"], env={"AUTOSEL_LOG": level})
    assert result.exit_code == 0, result.output
    assert result.stderr.count("autosel: INFO: op 'toy.double' (eager mode): triton chosen") == 1


def test_verbose_tune_says_which_stored_decision_it_keeps(reg, autosel_logger):
    # `autosel -v tune` logged nothing when every decision was stored already.
    toy(reg, B.TORCH, B.TRITON)
    assert run("tune", "--budget-s", "10").exit_code == 0
    result = run("-v", "tune")
    assert result.exit_code == 0, result.output
    assert (f"autosel: INFO: op 'toy.double' (eager mode): triton, stored in {settings_for(None, full=False).db}; "
            "not timed again (--force times it)") in result.stderr


def test_a_misspelt_op_glob_gets_a_did_you_mean(reg):
    # `autosel tune --op toy.dubble` listed every registered op but named none as the one meant.
    toy(reg, B.TORCH, B.TRITON)
    toy(reg, B.TORCH, B.TRITON, op="toy.other")
    assert run("tune", "--op", "toy.dubble").stderr == (
        "Error: no registered op matches --op 'toy.dubble'; did you mean toy.double? registered ops: toy.double, "
        "toy.other\n")
    assert run("show", "--op", "toy.dubble").stderr == (
        "Error: no registered op or stored decision matches --op 'toy.dubble'; did you mean toy.double? known ops: "
        "toy.double, toy.other\n")


def test_doctor_notes_an_autosel_record_path_no_call_can_write(reg, monkeypatch, tmp_path):
    # AUTOSEL_RECORD under a file passed doctor; only the first kernel call warned.
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("AUTOSEL_RECORD", str(tmp_path / "file" / "shapes.jsonl"))
    result = run("doctor", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["notes"][0] == (
        f"AUTOSEL_RECORD={tmp_path / 'file' / 'shapes.jsonl'}: {tmp_path / 'file'} is a file, not a folder, so no "
        "kernel call can record its shape (the kernels run all the same); choose a path in a writable folder")
    monkeypatch.setenv("AUTOSEL_RECORD", str(tmp_path / "missing" / "shapes.jsonl"))  # created at the first call
    assert not any("AUTOSEL_RECORD" in note for note in json.loads(run("doctor", "--json").stdout)["notes"])


def test_usage_errors_exit_2():
    assert run("tune", "--budget-s", "0").exit_code == 2
    assert run("export", "--out", "x.db", "--format", "xml").exit_code == 2
    assert run("frobnicate").exit_code == 2


def test_python_dash_m_is_the_same_cli():
    result = subprocess.run([sys.executable, "-m", "autosel", "--help"], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout.startswith("Usage: autosel [OPTIONS] COMMAND")
    assert all(command in result.stdout for command in COMMANDS)


def test_installed_autosel_doctor_runs(tmp_path):
    script = Path(sys.executable).parent / "autosel"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "autosel"]
    result = subprocess.run(command + ["doctor", "--json"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] and report["platform"]["key"]
    ops = {item["op"]: item for item in report["ops"]}
    assert "activation.silu_and_mul" in ops
    flashinfer = next(b for b in ops["activation.silu_and_mul"]["backends"] if b["backend"] == "flashinfer")
    assert flashinfer["reason"]  # no CUDA device or no flashinfer package here: the reason says which
    # doctor only reads: it used to create the user DB; now it says the first tune will.
    assert report["layers"][0] == {"path": os.environ["AUTOSEL_DB"], "kind": "user", "writable": True,
                                   "schema_version": None, "rows": 0,
                                   "problem": "does not exist yet (the first tune creates it)", "fix": None}
    assert not Path(os.environ["AUTOSEL_DB"]).exists()


def test_without_torch_the_db_commands_work_and_tune_says_to_install_it(tmp_path):
    block = ("import sys; sys.modules['torch'] = None; import autosel.db; autosel.db.package_folder = lambda: None; "
             "from autosel.cli import main; main(prog_name='autosel')")  # no shipped rows: as conftest isolates
    base = [sys.executable, "-c", block]
    # An explicit environment: pytest's readline puts COLUMNS=80 into the one children inherit by default.
    doctor = subprocess.run(base + ["doctor"], capture_output=True, text=True, env=dict(os.environ))
    assert doctor.returncode == 0, doctor.stderr
    assert "pip install torch" in doctor.stdout  # built-in backends need torch: that is their reason
    show = subprocess.run(base + ["show"], capture_output=True, text=True)
    assert show.returncode == 0 and "No stored decisions" in show.stdout
    tune = subprocess.run(base + ["tune"], capture_output=True, text=True)
    assert tune.returncode == 1
    assert tune.stderr.startswith("Error: tuning runs the kernels, which needs PyTorch") and "pip install torch" in tune.stderr


# --- tune -------------------------------------------------------------------------------------------------

def test_tune_times_contested_ops_and_prints_the_table(reg):
    toy(reg, B.TORCH, B.AOT, B.JIT, B.TRITON)
    result = run("tune", "--budget-s", "10")
    assert result.exit_code == 0, result.output
    assert "toy.double" in result.stdout and "tuned" in result.stdout and "triton" in result.stdout
    assert "aot: output differs from the reference: max abs error" in result.stdout
    assert "jit: raised RuntimeError: illegal memory access (simulated)" in result.stdout
    assert "geometric mean over the shapes" in result.stdout
    assert "toy.double: triton chosen" in result.stderr  # progress lines go to stderr


def test_tune_json_and_rerun_is_stored_without_timing(reg, monkeypatch):
    toy(reg, B.TORCH, B.TRITON)
    first = json.loads(run("tune", "--json").stdout)
    outcome = first["outcomes"][0]
    assert (outcome["op"], outcome["mode"], outcome["status"], outcome["winner"]) == ("toy.double", "eager", "tuned", "triton")
    assert outcome["runner_up"] is None  # torch, 10x slower, was dropped after the first round
    assert outcome["rejected"][0]["backend"] == "torch" and outcome["rejected"][0]["status"] == "dropped"
    assert outcome["median_us"] == pytest.approx((640 * 160) ** 0.5 * 1.002)  # geomean of the medians

    import autosel.tuner

    monkeypatch.setattr(autosel.tuner.Tuner, "tune_buckets", lambda *a, **k: pytest.fail("timed a stored decision"))
    second = run("tune", "--json")
    assert second.exit_code == 0
    assert json.loads(second.stdout)["outcomes"][0]["status"] == "stored"


def test_tune_isolate_turns_a_crash_into_a_reason(reg):
    toy(reg, B.TORCH, B.TRITON, B.JIT)
    result = run("tune", "--isolate", "--isolate-timeout-s", "60", "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert outcome["winner"] == "triton"
    assert [r["backend"] for r in outcome["rejected"] if r["status"] == "rejected"] == ["jit"]
    assert outcome["rejected"][-1]["reason"].startswith("in isolation: raised RuntimeError: illegal memory access")


def test_tune_force_retunes(reg):
    toy(reg, B.TORCH, B.TRITON)
    assert run("tune").exit_code == 0
    result = run("tune", "--force", "--json")
    assert json.loads(result.stdout)["outcomes"][0]["status"] == "tuned"


def test_tune_into_db_path(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    target = tmp_path / "build.db"
    assert run("tune", "--db", target).exit_code == 0
    assert sqlite3.connect(target).execute("SELECT op, winner FROM decisions").fetchall() == [("toy.double", "triton")]
    assert not Path(os.environ["AUTOSEL_DB"]).exists()


def test_tune_into_db_path_copies_what_a_shipped_db_already_decided(reg, tmp_path, monkeypatch):
    toy(reg, B.TORCH, B.TRITON)
    first, shipped, target = tmp_path / "first.db", tmp_path / "shipped.db", tmp_path / "build.db"
    assert run("tune", "--db", first).exit_code == 0
    assert run("export", "--db", first, "--out", shipped).exit_code == 0  # as an image ships it
    monkeypatch.setenv("AUTOSEL_DB_PATH", str(shipped))
    result = run("tune", "--db", target, "--json")
    outcome = json.loads(result.stdout)["outcomes"][0]
    assert (outcome["status"], outcome["detail"]) == ("copied", f"copied from {shipped}")
    assert sqlite3.connect(target).execute("SELECT op, winner FROM decisions").fetchall() == [("toy.double", "triton")]
    plain = json.loads(run("tune", "--json").stdout)["outcomes"][0]  # the default user DB: reused, not copied
    assert plain["status"] == "stored"
    assert sqlite3.connect(os.environ["AUTOSEL_DB"]).execute("SELECT count(*) FROM decisions").fetchone() == (0,)


def test_tune_op_glob_that_matches_nothing_names_the_registered_ops(reg):
    toy(reg, B.TORCH, B.TRITON)
    result = run("tune", "--op", "nope.*")
    assert result.exit_code == 1
    assert result.stderr == "Error: no registered op matches --op 'nope.*'; registered ops: toy.double\n"


def test_tune_op_with_one_eligible_backend_says_why_nothing_is_tuned(reg):
    toy(reg, B.TORCH)
    reg.register(KernelSpec("toy.double", B.FLASHINFER, "m:x", capabilities=frozenset({Cap.CUDA})))
    result = run("tune", "--op", "toy.*")
    assert result.exit_code == 1
    assert "toy.double: torch eligible" in result.stderr and "autosel doctor" in result.stderr


def test_tune_failure_is_exit_1_after_the_table(reg):
    toy(reg, B.TORCH, B.JIT, B.AOT)  # the only correct one is torch... plus a wrong and a raising one
    reg.register(KernelSpec("toy.broken", B.JIT, "toy_kernels:raises"))
    reg.register(KernelSpec("toy.broken", B.AOT, "toy_kernels:raises"))
    import toy_kernels

    reg.define(OpDefinition("toy.broken", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs,
                            reference=toy_kernels.fast))
    result = run("tune")
    assert result.exit_code == 1
    assert "toy.broken" in result.stdout and "failed" in result.stdout
    assert result.stderr.splitlines()[-1].startswith("Error: 1 of 2 op/mode pairs could not be tuned: toy.broken")
    # Used to say "fix the kernels" twice and suggest backend=..., which a command line cannot pass.
    assert "backend=..." not in result.stderr and result.stderr.lower().count("fix the kernels") == 1


def test_tune_goes_on_past_an_op_whose_code_raises_and_lists_it_failed(reg, monkeypatch):
    # A plug-in's reference that raised, or any other exception in one op's tune, ended the whole batch with a
    # traceback; the ops after it were never tuned.
    import autosel.tuner
    import toy_kernels

    reg.register(KernelSpec("toy.badref", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.badref", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.badref", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs,
                            reference=toy_kernels.raises))
    reg.register(KernelSpec("toy.unloadable", B.TORCH, "no_such_module_xyz:ref"))  # the reference: cannot load
    reg.register(KernelSpec("toy.unloadable", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.unloadable", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    reg.register(KernelSpec("toy.buggy", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.buggy", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.buggy", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    toy(reg, B.TORCH, B.TRITON)  # registered last: tuned after both
    original = autosel.tuner.Tuner.tune_buckets

    def tune_buckets(self, definition, *args, **kwargs):
        if definition.op == "toy.buggy":
            raise AttributeError("'NoneType' object has no attribute 'shape'")
        return original(self, definition, *args, **kwargs)

    monkeypatch.setattr(autosel.tuner.Tuner, "tune_buckets", tune_buckets)
    result = run("tune", "--json")
    assert result.exit_code == 1
    status = {o["op"]: (o["status"], o["detail"]) for o in json.loads(result.stdout)["outcomes"]}
    assert status["toy.double"] == ("tuned", "")
    assert status["toy.badref"][0] == "failed" and status["toy.badref"][1].startswith(
        "op 'toy.badref': its reference raised RuntimeError: illegal memory access (simulated) at n=")
    assert status["toy.buggy"] == ("failed", "raised AttributeError: 'NoneType' object has no attribute 'shape'")
    assert status["toy.unloadable"][0] == "failed" and "no_such_module_xyz" in status["toy.unloadable"][1]


def test_tune_warning_of_a_job_that_raised_names_the_exception_on_one_line(reg, monkeypatch):
    # It printed "Warning: tuning toy.double (eager mode) raised" and then an empty line: the traceback was dropped,
    # with what was raised, and the progress bar's closing newline was left on a piped stderr.
    import autosel.tuner

    toy(reg, B.TORCH, B.TRITON)

    def tune_buckets(self, definition, *args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(autosel.tuner.Tuner, "tune_buckets", tune_buckets)
    result = run("tune")
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Warning: tuning toy.double (eager mode) raised: AttributeError: 'NoneType' object has no attribute 'shape'",
        "Error: 1 of 1 op/mode pairs could not be tuned: toy.double (eager): raised AttributeError: 'NoneType' "
        "object has no attribute 'shape'. Fix the kernels or shapes named above, or leave those ops out with --op"]


# `autosel tune` in a process of its own, on a toy op whose second candidate is the one named.
TUNE_A_TOY_OP = """
import sys
sys.path.insert(0, {tests!r})
import autosel.db, toy_kernels
from autosel import registry
from autosel.spec import KernelSpec, OpDefinition
autosel.db.package_folder = lambda: None
registry.register(KernelSpec("toy.op", "torch", "toy_kernels:slow"))
registry.register(KernelSpec("toy.op", "triton", {candidate!r}))
registry.define(OpDefinition("toy.op", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
from autosel.cli import main
main(["tune", "--op", "toy.op"] + {extra!r}, prog_name="autosel")
"""


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the isolation child through /proc")
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_a_terminated_tune_kills_its_isolation_child_releases_the_lease_and_exits_128_plus_the_signal(
        tmp_path, monkeypatch, signame):
    # The default SIGTERM/SIGHUP action skipped the `finally` that kills the child: it went on running the candidate,
    # reparented to init, and the tuning lease stayed in the DB until it expired (only Ctrl-C released both).
    import signal
    import time

    from autosel.db import _pid_alive as alive

    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    from db_stress import children_of

    db = tmp_path / "tune.db"
    script = TUNE_A_TOY_OP.format(tests=str(HERE), candidate="toy_kernels:hangs",
                                  extra=["--isolate", "--isolate-timeout-s", "600"])
    tune = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, AUTOSEL_DB=str(db)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not children and tune.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
            children = children_of(tune.pid)
        assert children, f"no isolation child started: {tune.communicate(timeout=60)}"
        time.sleep(2.0)  # the child imports torch and runs the reference, then the hanging candidate
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT op FROM leases").fetchall() == [("toy.op",)]
        tune.send_signal(getattr(signal, signame))
        out, err = tune.communicate(timeout=60)
        assert tune.returncode == 128 + getattr(signal, signame), err
        assert f"Stopped by {signame}: the op/mode pairs finished before that are stored in {db}" in err
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in children)
        with sqlite3.connect(db) as conn:
            assert conn.execute("SELECT op FROM leases").fetchall() == []
    finally:
        for pid in [tune.pid] + children:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        tune.wait()


@pytest.mark.parametrize("isolate", [False, True])
def test_tune_json_is_valid_json_when_a_candidate_prints(reg, isolate):
    # A candidate's print went to stdout between the progress and the JSON: `tune --json` was not valid JSON.
    toy(reg, B.TORCH)
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:chatty"))
    result = run("tune", "--json", *["--isolate"] * isolate)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["outcomes"][0]["status"] == "tuned"
    assert "debug: no newline" in result.stderr


@pytest.mark.parametrize("isolate", [False, True])
def test_tune_json_is_valid_json_when_a_candidate_writes_to_file_descriptor_1(tmp_path, isolate):
    # A C library's printf in a kernel writes to file descriptor 1, past sys.stdout: the same broken JSON.
    script = TUNE_A_TOY_OP.format(tests=str(HERE), candidate="toy_kernels:chatty_fd",
                                  extra=["--json"] + ["--isolate"] * isolate)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            env=dict(os.environ, AUTOSEL_DB=str(tmp_path / "tune.db")))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["outcomes"][0]["status"] == "tuned"
    assert "debug: from C" in result.stderr


@pytest.mark.parametrize("force", [False, True])
def test_tune_interrupted_keeps_what_was_tuned_and_says_how_to_go_on(reg, force):
    # Used to end in click's bare "Aborted!", saying nothing of what was kept.
    toy(reg, B.TORCH, B.TRITON)  # registered first: tuned first
    reg.register(KernelSpec("toy.stopped", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.stopped", B.TRITON, "toy_kernels:interrupted"))  # Ctrl-C while it runs
    import toy_kernels

    reg.define(OpDefinition("toy.stopped", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs))
    result = run("tune", *["--force"] * force)
    assert result.exit_code == 130
    assert "Interrupted: the op/mode pairs finished before that are stored in" in result.stderr
    assert ("without --force" in result.stderr) == force
    assert [d.op for d, _ in tuning.database().decisions()] == ["toy.double"]
    # With --force it said that the command without --force "tunes the rest": it reuses stored and shipped ones.
    db = os.environ["AUTOSEL_DB"]
    assert result.stderr.splitlines()[-1] == (
        f"Interrupted: the op/mode pairs finished before that are stored in {db}. Run the same command without "
        "--force to go on: it reuses every pair that has a stored or shipped decision, those included, and tunes the "
        "others; to time chosen ops again, keep --force and add --op GLOB." if force else
        f"Interrupted: the op/mode pairs finished before that are stored in {db}; the same command reuses them and "
        "tunes the rest.")


def test_tune_shapes_file_tunes_only_its_ops_on_its_shapes(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    toy(reg, B.TORCH, B.TRITON, op="toy.other")
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"toy.double": [{"n": 1024}, {"n": 2048}]}))
    result = run("tune", "--shapes", shapes, "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert outcome["op"] == "toy.double"
    assert [s["shape"] for s in outcome["decision"]["candidates"][0]["shapes"]] == [{"n": 1024}, {"n": 2048}]


@pytest.mark.parametrize("text, message", [
    ("{not json", "is not valid JSON (line 1, column 2"),
    ("[1, 2]", "must hold a JSON object mapping op names to lists of shapes"),
    ('{"toy.double": {"n": 4}}', "op 'toy.double' must map to a non-empty list of shape objects"),
])
def test_bad_shapes_file_is_a_clear_error(reg, tmp_path, text, message):
    toy(reg, B.TORCH, B.TRITON)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(text)
    result = run("tune", "--shapes", shapes)
    assert result.exit_code == 1 and message in result.stderr and result.stderr.startswith("Error: ")


def test_tune_from_record_tunes_exactly_the_recorded_shapes_deduplicated(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    toy(reg, B.TORCH, B.TRITON, op="toy.other")
    record = tmp_path / "record.jsonl"
    lines = [{"op": "toy.double", "shape": {"n": 512}, "mode": "eager"},
             {"op": "toy.double", "shape": {"n": 256}, "mode": "eager"},
             {"op": "toy.double", "shape": {"n": 512}, "mode": "eager"},
             {"op": "not.registered", "shape": {"n": 1}, "mode": "eager"}]
    record.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    result = run("tune", "--from-record", record, "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert outcome["op"] == "toy.double"
    assert [s["shape"] for s in outcome["decision"]["candidates"][0]["shapes"]] == [{"n": 512}, {"n": 256}]
    assert "Warning: op 'not.registered' is not registered here" in result.stderr


def test_tune_of_a_record_holding_only_modes_this_machine_does_not_time_says_so(reg, tmp_path):
    # It said no op had several backends eligible, naming two eligible backends of the op.
    toy(reg, B.TORCH, B.TRITON)
    record = tmp_path / "record.jsonl"
    record.write_text(json.dumps({"op": "toy.double", "shape": {"n": 512}, "mode": "graph"}) + "\n")
    result = run("tune", "--from-record", record)
    assert result.exit_code == 1
    assert result.stderr.endswith(f"Error: every shape in {record} is for graph mode, which this cpu machine does not "
                                  "time (eager only); tune that file on a machine that times it\n")


@pytest.mark.parametrize("how", ["--shapes", "--from-record"])
def test_tune_with_an_op_glob_matching_none_of_the_files_ops_says_so(reg, tmp_path, how):
    # It said "nothing to choose between ()", an empty list.
    toy(reg, B.TORCH, B.TRITON)
    toy(reg, B.TORCH, B.TRITON, op="toy.other")
    args = _shapes_source(tmp_path, how, {"toy.double": [{"n": 512}]})
    result = run("tune", *args, "--op", "toy.oth*")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: --op 'toy.oth*' matches none of the ops {args[1]} gives shapes for (toy.double); "
                             "drop --op, or pass a pattern that matches one of them\n")


def _shapes_source(tmp_path, how: str, shapes_by_op: dict) -> list:
    """The tune arguments that hand `shapes_by_op` over as a --shapes file or as an AUTOSEL_RECORD file."""
    if how == "--shapes":
        path = tmp_path / "shapes.json"
        path.write_text(json.dumps(shapes_by_op))
    else:
        path = tmp_path / "record.jsonl"
        path.write_text("".join(json.dumps({"op": op, "shape": s, "mode": "eager"}) + "\n"
                                for op, shapes in shapes_by_op.items() for s in shapes))
    return [how, path]


@pytest.mark.parametrize("how", ["--shapes", "--from-record"])
def test_tune_shape_without_a_key_the_input_factory_reads_is_a_clear_failure(reg, tmp_path, how):
    # A shape with a wrong key ended in a Python traceback: KeyError: 'n' inside the input factory.
    toy(reg, B.TORCH, B.TRITON)
    result = run("tune", *_shapes_source(tmp_path, how, {"toy.double": [{"tokens": 64}]}))
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert result.stderr.splitlines()[-1] == (
        "Error: 1 of 1 op/mode pairs could not be tuned: toy.double (eager): op 'toy.double': its make_inputs "
        "raised KeyError: 'n' for the shape tokens=64: the shape has no key 'n', which the op's input factory "
        "reads; give each shape the keys of the op's declared shapes. Fix the kernels or shapes named above, or "
        "leave those ops out with --op")


@pytest.mark.parametrize("how", ["--shapes", "--from-record"])
def test_tune_shapes_of_only_unknown_ops_name_them_and_the_registered_ops(reg, tmp_path, how):
    # With only an unknown op in the file, tune said "no matching op has several backends eligible".
    toy(reg, B.TORCH, B.TRITON)
    args = _shapes_source(tmp_path, how, {"toy.dubble": [{"n": 4}]})
    result = run("tune", *args)
    assert result.exit_code == 1
    # It also printed a warning saying the same ("its shapes are skipped") above the error.
    assert result.stderr.splitlines() == [f"Error: op 'toy.dubble' in {args[1]} is not registered here; "
                                          "registered ops: toy.double; the command line sees the ops that autosel "
                                          "and its plug-ins register (an `autosel.ops` entry point, README), not "
                                          "those a script registers"]


def test_tune_shapes_of_a_known_and_an_unknown_op_tunes_one_and_warns_of_the_other(reg, tmp_path):
    # The warning must stay where something is tuned: only the error-only case lost it.
    toy(reg, B.TORCH, B.TRITON)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"toy.double": [{"n": 4}], "toy.dubble": [{"n": 4}]}))
    result = run("tune", "--shapes", shapes, "--json")
    assert result.exit_code == 0, result.output
    assert [o["status"] for o in json.loads(result.stdout)["outcomes"]] == ["tuned"]
    assert result.stderr.startswith("Warning: op 'toy.dubble' is not registered here; its shapes are skipped "
                                    "(registered ops: toy.double); the command line sees the ops that autosel and "
                                    "its plug-ins register")


@pytest.mark.parametrize("how", ["--shapes", "--from-record"])
def test_tune_shapes_for_a_decided_op_are_timed_unless_it_was_decided_on_them(reg, tmp_path, how):
    # A stored decision made on other shapes kept --from-record from timing the recorded ones without --force.
    toy(reg, B.TORCH, B.TRITON)
    assert run("tune").exit_code == 0
    result = run("tune", *_shapes_source(tmp_path, how, {"toy.double": [{"n": 512}]}), "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert outcome["status"] == "tuned"
    assert [s["shape"] for s in outcome["decision"]["candidates"][0]["shapes"]] == [{"n": 512}]
    again = run("tune", *_shapes_source(tmp_path, how, {"toy.double": [{"n": 512}]}), "--json")
    [outcome] = json.loads(again.stdout)["outcomes"]
    covered = (f"stored in {os.environ['AUTOSEL_DB']}; it was decided on every given shape; --force (force=True) "
               "times them again")
    assert (outcome["status"], outcome["detail"]) == ("stored", covered)
    assert f"Warning: toy.double (eager): {covered}" not in again.stderr.splitlines()  # nothing is wrong
    forced = json.loads(run("tune", *_shapes_source(tmp_path, how, {"toy.double": [{"n": 512}]}), "--force",
                            "--json").stdout)["outcomes"][0]
    assert forced["status"] == "tuned"


@pytest.mark.parametrize("line, problem", [
    ("{oops", "not valid JSON (Expecting property name enclosed in double quotes at column 2)"),
    ("[1]", "not a JSON object"),
    ('{"shape": {"n": 1}}', "'op' is missing or not a string"),
    ('{"op": "toy.double", "shape": [1]}', "'shape' is missing or not an object"),
    ('{"op": "toy.double", "shape": {"n": 1}, "mode": "warp"}', "'mode' is 'warp', not one of eager, graph"),
])
def test_malformed_record_line_names_the_line(reg, tmp_path, line, problem):
    toy(reg, B.TORCH, B.TRITON)
    record = tmp_path / "record.jsonl"
    record.write_text('{"op": "toy.double", "shape": {"n": 8}, "mode": "eager"}\n' + line + "\n")
    result = run("tune", "--from-record", record)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {record}:2: {problem}; each line must be a JSON object like ")


def test_shapes_and_record_together_is_a_usage_error(reg, tmp_path):
    path = tmp_path / "x.json"
    path.write_text("{}")
    assert run("tune", "--shapes", path, "--from-record", path).exit_code == 2


def test_an_isolate_timeout_without_isolate_is_a_usage_error(reg):
    # It was accepted and did nothing: the candidates ran in this process, with no timeout.
    result = run("tune", "--isolate-timeout-s", "5")
    assert result.exit_code == 2 and "--isolate-timeout-s limits the child processes of --isolate" in result.stderr


def test_tune_without_torch_says_to_install_it(reg, monkeypatch):
    monkeypatch.setattr(cli._tune, "_torch_missing", lambda: True)
    result = run("tune")
    assert result.exit_code == 1 and "pip install torch" in result.stderr


# --- show -------------------------------------------------------------------------------------------------

def test_show_marks_in_use_stale_and_unknown_rows(reg):
    toy(reg, B.TORCH, B.TRITON)
    store(decision(), decision(platform=OTHER_CPU), decision(versions={"torch": "1.0"}),
          decision(op="gone.op"))
    result = run("show", "--json")
    assert result.exit_code == 0
    rows = {(r["decision"]["platform_key"], r["op"], tuple(r["decision"]["versions"].items())): r
            for r in json.loads(result.stdout)["decisions"]}
    assert rows[(CPU.key, "toy.double", ())]["status"] == "in use"
    assert rows[(CPU.key, "toy.double", ())]["layer"]["kind"] == "user"
    other = rows[(OTHER_CPU.key, "toy.double", ())]
    assert other["status"] == "stale" and other["status_detail"] == f"tuned on {OTHER_CPU.key}, this machine is {CPU.key}"
    old = rows[(CPU.key, "toy.double", (("torch", "1.0"),))]
    assert old["status"] == "stale" and old["status_detail"] == "versions differ: torch 1.0 -> (none)"
    assert rows[(CPU.key, "gone.op", ())]["status"] == "unknown op"
    text = run("show", "--op", "toy.*")
    assert text.exit_code == 0 and "in use" in text.stdout and "stale" in text.stdout and "gone.op" not in text.stdout
    assert "triton *: 10 µs, 1.00x" in text.stdout


def test_tables_fit_80_columns_without_splitting_names_and_piped_rows_stay_whole(reg, monkeypatch):
    # In 80 columns op names were split ("activa/tion.g/elu_an/d_mul"); piped output was cut at 160 columns.
    monkeypatch.delenv("COLUMNS", raising=False)
    toy(reg, B.TORCH, B.TRITON, op="activation.gelu_and_mul")
    store(decision(op="activation.gelu_and_mul"), decision(op="activation.gelu_and_mul", platform=OTHER_CPU))
    narrow = CliRunner().invoke(cli.main, ["show"], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    assert narrow.stdout.count("activation.gelu_and_mul") == 2
    assert "\n  winner: triton\n" in narrow.stdout  # too narrow for a table of whole names: one record per row
    piped = run("show").stdout
    stale = next(line for line in piped.splitlines() if "stale" in line)
    assert f"stale: tuned on {OTHER_CPU.key}, this machine is {CPU.key}" in stale  # one row, one line


def test_piped_show_prints_each_decision_on_one_line_and_a_width_keeps_a_line_per_candidate(reg, monkeypatch):
    # Piped, show's evidence cell put each candidate on a line of its own, so one decision took several lines.
    monkeypatch.delenv("COLUMNS", raising=False)
    toy(reg, B.TORCH, B.TRITON)
    store(decision(), decision(platform=OTHER_CPU))
    piped = run("show")
    assert piped.exit_code == 0
    rows = [line for line in piped.stdout.splitlines() if line.strip()]
    assert len(rows) == 5  # header, rule, one line per decision, the footnote
    assert [row.split()[0] for row in rows[2:4]] == ["toy.double", "toy.double"]
    assert all("torch: 10 µs, 1.50x; triton *: 10 µs, 1.00x" in row for row in rows[2:4])
    # A width (a terminal, or COLUMNS) keeps one line per candidate inside the cell.
    wide = CliRunner().invoke(cli.main, ["show"], env={"COLUMNS": "200"})
    assert wide.exit_code == 0
    lines = wide.stdout.splitlines()
    assert max(len(line) for line in lines) <= 200
    assert not any("; triton *" in line for line in lines)
    first = next(n for n, line in enumerate(lines) if line.lstrip().startswith("toy.double"))
    assert "torch: 10 µs, 1.50x" in lines[first] and "triton *: 10 µs, 1.00x" in lines[first + 1]


def test_show_counts_but_does_not_list_shipped_rows_of_other_platforms_unless_asked(reg, tmp_path, monkeypatch):
    # A first `autosel show` on a CPU listed 190 rows, 154 of them the shipped H200 DB's, which can never be used
    # there, and the user's own rows were lost among them.
    toy(reg, B.TORCH, B.TRITON)
    first, shipped = tmp_path / "first.db", tmp_path / "shipped.db"
    store(decision(), decision(platform=OTHER_CPU), decision(op="toy.other", platform=OTHER_CPU), db=first)
    assert run("export", "--db", first, "--out", shipped).exit_code == 0  # as an image ships it
    monkeypatch.setenv("AUTOSEL_DB_PATH", str(shipped))
    store(decision(platform=OTHER_CPU, winner="torch"))  # the user's own row for another platform stays listed
    listed = json.loads(run("show", "--json").stdout)
    assert listed["hidden_other_platforms"] == 2
    assert sorted((r["layer"]["kind"], r["decision"]["platform_key"]) for r in listed["decisions"]) == [
        ("shipped", CPU.key), ("user", OTHER_CPU.key)]
    text = run("show").stdout
    assert "2 row(s) of shipped DBs made for other platforms not listed (`autosel show --all` lists them)" in text
    everything = json.loads(run("show", "--all", "--json").stdout)
    assert everything["hidden_other_platforms"] == 0 and len(everything["decisions"]) == 4
    assert "not listed" not in run("show", "--all").stdout
    only_elsewhere = run("show", "--op", "toy.other")
    assert only_elsewhere.exit_code == 0
    assert only_elsewhere.stdout.startswith("No stored decisions for toy.other for this machine; run `autosel tune`")
    assert "1 row(s) of shipped DBs made for other platforms not listed" in only_elsewhere.stdout


def test_show_with_no_decisions_says_what_to_do(reg, tmp_path):
    from autosel.db import TuningDB

    TuningDB.open(tmp_path / "empty.db", include_package=False).close()
    result = run("show", "--db", tmp_path / "empty.db")
    assert result.exit_code == 0 and "run `autosel tune`" in result.stdout


@pytest.mark.parametrize("name, value", [("AUTOSEL_TUNE", "sometimes"), ("AUTOSEL_LOG", "loud")])
def test_show_warns_of_a_bad_variable_it_does_not_read_and_goes_on(reg, tmp_path, monkeypatch, name, value):
    # `AUTOSEL_TUNE=sometimes autosel show` said nothing, where get_kernel and `autosel tune` stop on it.
    from autosel.db import TuningDB

    TuningDB.open(tmp_path / "empty.db", include_package=False).close()
    monkeypatch.setenv(name, value)
    result = run("show", "--db", tmp_path / "empty.db")
    assert result.exit_code == 0 and "run `autosel tune`" in result.stdout
    assert result.stderr.startswith(f"Warning: {name}={value!r} is not valid; allowed values: ")
    assert result.stderr.endswith("`autosel show` does not read it and goes on, but get_kernel and `autosel tune` "
                                  "stop on it\n")


@pytest.mark.parametrize("command", [("export", "--out", "e.jsonl"), ("prune", "--dry-run"), ("prune",)],
                         ids=" ".join)
def test_export_and_prune_warn_of_a_bad_match_setting_they_do_not_read_and_go_on(reg, tmp_path, monkeypatch,
                                                                                 command):
    # `AUTOSEL_MATCH=model autosel export` exited 1, where README says export warns of a variable it does not read;
    # prune alike, and the warning said prune "reads the DBs only" (it removes rows).
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("AUTOSEL_DB", str(tmp_path / "mine.db"))
    tuning.database(settings_for(None, full=False)).record(decision())
    monkeypatch.setenv("AUTOSEL_MATCH", "model")
    result = run(*command)
    assert result.exit_code == 0, result.output
    assert result.stderr == (f"Warning: AUTOSEL_MATCH='model' is not valid; allowed values: exact, device, arch; "
                             f"`autosel {command[0]}` does not read it and goes on, but get_kernel and `autosel tune` "
                             "stop on it\n")


READ_ONLY_COMMANDS = [("show",), ("doctor",), ("report", "--out", "r.html"), ("export", "--out", "e.jsonl"),
                      ("prune", "--dry-run")]


@pytest.mark.parametrize("command", [c for c in READ_ONLY_COMMANDS if c != ("doctor",)] + [("prune",)], ids=" ".join)
def test_read_only_command_on_a_missing_db_is_an_error_and_creates_nothing(reg, tmp_path, monkeypatch, command):
    # `autosel show --db nope/none.db` used to create the folder and an empty DB, and exit 0; `autosel prune`
    # (which writes) did so still, and said "Removed 0 stale decision(s)."
    monkeypatch.chdir(tmp_path)
    result = run(*command, "--db", "nope/none.db")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: --db nope/none.db: no such file")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_doctor_on_a_missing_db_lists_it_among_the_layers_and_creates_nothing(reg, tmp_path, monkeypatch):
    # It exited 1 with "--db nope/none.db: no such file" before diagnosing anything, while README said doctor lists
    # a --db's problem among the layers.
    monkeypatch.chdir(tmp_path)
    result = run("doctor", "--json", "--db", "nope/none.db")
    assert result.exit_code == 0, result.output
    [user] = [layer for layer in json.loads(result.stdout)["layers"] if layer["kind"] == "user"]
    assert (user["path"], user["rows"]) == ("nope/none.db", 0)
    assert user["problem"] == "does not exist yet (the first tune creates it)"
    assert "does not exist yet" in run("doctor", "--db", "nope/none.db").stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", READ_ONLY_COMMANDS, ids=lambda c: c[0])
def test_read_only_command_never_moves_a_file_that_is_not_a_tuning_db(reg, tmp_path, monkeypatch, command):
    # `autosel show --db mine.jsonl` used to rename the export to mine.jsonl.corrupt-<time> and write an empty DB
    # in its place; doctor, report, export and prune --dry-run alike.
    monkeypatch.chdir(tmp_path)
    text = '{"op": "toy.double", "mode": "eager"}\n'
    (tmp_path / "mine.jsonl").write_text(text)
    result = run(*command, "--db", tmp_path / "mine.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.jsonl"]
    assert (tmp_path / "mine.jsonl").read_text() == text
    # And it is an error naming the file: show listed the shipped rows alone and exited 0, export and report
    # said to run `autosel tune` first. doctor, which describes, lists the file's problem among the layers.
    if command == ("doctor",):
        assert result.exit_code == 0 and "it is not an SQLite file (no SQLite header); not read" in result.stdout
        return
    assert result.exit_code == 1
    assert result.stderr.splitlines()[-1] == (f"Error: --db {tmp_path / 'mine.jsonl'} cannot be read: it is not an "
                                              "SQLite file (no SQLite header); pass a tuning DB that `autosel "
                                              "tune --db` or `autosel export` wrote")


def test_a_damaged_db_is_named_in_a_few_lines_with_what_to_do(reg, tmp_path):
    # Its message held SQLite's every finding: 200 lines for a 100 kB file.
    from autosel.db.tools import export_decisions

    damaged = tmp_path / "damaged.db"
    export_decisions([decision(op=f"toy.op{i}") for i in range(300)], damaged, fmt="sqlite")  # a finished file
    data = bytearray(damaged.read_bytes())
    data[4096::7] = b"\xab" * len(data[4096::7])  # every page after the first, damaged
    damaged.write_bytes(bytes(data))
    result = run("show", "--db", damaged)
    # The error alone: a warning came first, saying "Selection will move it aside" where the error says prune does.
    assert result.exit_code == 1 and len(result.stderr.splitlines()) == 1
    assert result.stderr.splitlines()[-1].startswith(f"Error: --db {damaged} cannot be read: unreadable (quick_check")
    assert result.stderr.endswith(f"`autosel prune --db {damaged}` moves it aside (kept, not deleted) and starts an "
                                  "empty one\n")
    assert damaged.read_bytes() == bytes(data)


def test_export_of_a_damaged_default_user_db_is_the_same_clear_error_as_with_db(reg, tmp_path, monkeypatch):
    # Without --db it warned, then said "no decisions in the user DB ...; run `autosel tune` first".
    from autosel.db.tools import export_decisions

    damaged = tmp_path / "damaged.db"
    export_decisions([decision(op=f"toy.op{i}") for i in range(300)], damaged, fmt="sqlite")
    data = bytearray(damaged.read_bytes())
    data[4096::7] = b"\xab" * len(data[4096::7])
    damaged.write_bytes(bytes(data))
    monkeypatch.setenv("AUTOSEL_DB", str(damaged))
    out = tmp_path / "d.jsonl"
    result = run("export", "--out", out)
    assert result.exit_code == 1 and not out.exists() and len(result.stderr.splitlines()) == 1
    assert result.stderr.splitlines()[-1].startswith(f"Error: the user DB {damaged} cannot be read: unreadable (")
    assert result.stderr.endswith("; `autosel prune` moves it aside (kept, not deleted) and starts an empty one\n")
    assert damaged.read_bytes() == bytes(data)


# --- doctor -----------------------------------------------------------------------------------------------

def test_doctor_gives_each_backends_reason(reg):
    toy(reg, B.TORCH, B.TRITON)
    reg.register(KernelSpec("toy.double", B.FLASHINFER, "flashinfer.x:y", requires=("flashinfer",)))
    reg.register(KernelSpec("toy.double", B.SGL_KERNEL, "m:x", capabilities=frozenset({Cap.cuda(min_sm=(9, 0))})))
    result = run("doctor", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    [op] = report["ops"]
    reasons = {b["backend"]: b["reason"] for b in op["backends"]}
    assert reasons["torch"] is None and reasons["triton"] is None
    assert reasons["flashinfer"] == "package 'flashinfer' is not installed (pip install flashinfer-python)"
    assert reasons["sgl_kernel"] == "needs cuda, device is cpu"
    assert op["selection"] == "none stored: measured among torch, triton on 2 shapes at first use (or by `autosel tune`)"
    assert {v["name"] for v in report["environment"]} >= {"AUTOSEL_DB", "AUTOSEL_TUNE", "AUTOSEL_RECORD"}
    text = run("doctor")
    assert "no: package 'flashinfer' is not installed (pip install flashinfer-python)" in text.stdout
    assert "OK: nothing blocks selection." in text.stdout


def test_doctor_notes_packages_whose_source_every_process_compiles(reg, tmp_path, monkeypatch):
    # The H200 image compiled torch's source in every tune process (about 10 s); doctor did not say so.
    from autosel import platforms

    toy(reg, B.TORCH, B.TRITON)
    (tmp_path / "autosel_fake_pkg3").mkdir()
    (tmp_path / "autosel_fake_pkg3" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "pycache_prefix", None)
    monkeypatch.setattr(platforms, "BYTECODE_PACKAGES", ("autosel_fake_pkg3",))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    report = json.loads(run("doctor", "--json").stdout)
    [note] = report["notes"]
    assert note.startswith("autosel_fake_pkg3: no Python bytecode is cached") and "PYTHONPYCACHEPREFIX" in note
    assert report["ok"]  # slower, not blocked
    text = run("doctor")
    assert text.exit_code == 0 and "Note: autosel_fake_pkg3: no Python bytecode" in text.stdout
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert json.loads(run("doctor", "--json").stdout)["notes"] == []


def test_doctor_says_when_a_stored_decision_is_in_use(reg):
    # The selection column said "measured among torch, triton on 2 shapes" although a stored decision was used.
    toy(reg, B.TORCH, B.TRITON)
    store(decision(winner="torch"))
    [op] = json.loads(run("doctor", "--json").stdout)["ops"]
    user_db = os.environ["AUTOSEL_DB"]
    assert op["selection"] == f"torch, the stored decision in use (user DB {user_db})"
    assert op["stored"] == {"eager": {"winner": "torch", "layer": user_db, "layer_kind": "user", "near_match": None}}
    # It named only the op-level winner while get_kernel sent some buckets to another backend.
    store(*tune_table("torch", {"[4]": "torch", "[256]": "triton", "[64]": "triton"}, "2026-01-01T00:00:01+00:00"))
    [op] = json.loads(run("doctor", "--json").stdout)["ops"]
    assert op["selection"] == (f"torch, the stored decision in use (user DB {user_db}), but 2 bucket(s) run triton "
                               "(`autosel show --op toy.double` lists them)")


@pytest.mark.parametrize("match, status, detail", [
    ("exact", "stale", f"tuned on {OTHER_CPU.key}, this machine is {CPU.key}"),
    ("device", "stale", f"tuned on {OTHER_CPU.key}, this machine is {CPU.key}"),
    ("arch", "in use", f"near match: tuned on {OTHER_CPU.key}, this machine is {CPU.key}; versions differ: "
                       "torch 2.0 -> (none)"),
])
def test_show_doctor_and_report_say_which_near_match_is_in_use_and_what_differs(reg, monkeypatch, tmp_path, match,
                                                                             status, detail):
    toy(reg, B.TORCH, B.TRITON)
    store(decision(platform=OTHER_CPU, versions={"torch": "2.0"}))
    monkeypatch.setenv("AUTOSEL_MATCH", match)
    [row] = json.loads(run("show", "--json").stdout)["decisions"]
    assert (row["status"], row["status_detail"], row["near_match"]) == (status, detail, status == "in use")
    [op] = json.loads(run("doctor", "--json").stdout)["ops"]
    if status == "in use":
        user_db = os.environ["AUTOSEL_DB"]
        assert op["selection"] == f"triton, the stored decision in use (user DB {user_db}), a {detail}"
        assert op["stored"]["eager"]["near_match"] == detail
    else:
        assert op["stored"] == {} and op["selection"].startswith("none stored")
    text = run("show").stdout
    assert (f"in use: {detail}" in text) == (match == "arch") and ("AUTOSEL_MATCH=arch" in text) == (match == "arch")
    # The report took every near row for stale: it read AUTOSEL_MATCH nowhere.
    page = tmp_path / "report.html"
    result = run("report", "--out", page)
    assert (result.exit_code == 0) == (match == "arch")
    assert (match == "arch") == ('class="badge in-use"' in (page.read_text() if page.exists() else ""))


def test_a_bad_match_setting_stops_show_and_blocks_doctor(reg, monkeypatch):
    monkeypatch.setenv("AUTOSEL_MATCH", "model")
    allowed = "AUTOSEL_MATCH='model' is not valid; allowed values: exact, device, arch"
    shown = run("show")
    assert shown.exit_code == 1 and shown.stderr.startswith(f"Error: {allowed}")
    checked = run("doctor", "--json")
    assert checked.exit_code == 1 and json.loads(checked.stdout)["config_error"] == allowed


def test_doctor_lists_how_each_builtin_op_is_called(reg):
    # The built-in ops' call signatures were documented nowhere; get_kernel("layernorm.rmsnorm")(x, w) failed on eps.
    from autosel.ops import register_builtin_ops

    register_builtin_ops(into=reg)
    ops = {item["op"]: item for item in json.loads(run("doctor", "--json").stdout)["ops"]}
    assert ops["layernorm.rmsnorm"]["signature"].startswith("(x[T, H], weight[H], eps: float) -> new [T, H]")
    assert "in place" in ops["layernorm.fused_add_rmsnorm"]["signature"]
    assert all(item["signature"] for item in ops.values())
    text = run("doctor").stdout
    assert "How each op is called" in text and "a @ b.T" in text


def test_doctor_op_with_no_eligible_backend_is_not_blocking(reg):
    reg.register(KernelSpec("gpu.only", B.FLASHINFER, "m:a", capabilities=frozenset({Cap.CUDA})))
    reg.register(KernelSpec("gpu.only", B.SGL_KERNEL, "m:b", capabilities=frozenset({Cap.CUDA})))
    result = run("doctor")
    assert result.exit_code == 0
    assert "no backend eligible here: only explicit backend=... calls work" in result.stdout


def test_doctor_bad_variable_is_blocking(reg, monkeypatch):
    monkeypatch.setenv("AUTOSEL_TUNE", "sometimes")
    result = run("doctor")
    assert result.exit_code == 1
    assert "sometimes" in result.stdout  # the environment table still shows it
    assert result.stderr.startswith("Error: selection is blocked: AUTOSEL_TUNE='sometimes' is not valid; "
                                    "allowed values: auto, off, force")


def test_doctor_blocks_on_an_autosel_backend_op_that_is_not_registered(reg, monkeypatch):
    # AUTOSEL_BACKEND=toy.dubble=torch (a typo) was accepted silently and forced nothing.
    toy(reg, B.TORCH, B.TRITON)
    monkeypatch.setenv("AUTOSEL_BACKEND", "toy.dubble=torch")
    result = run("doctor")
    assert result.exit_code == 1
    assert result.stderr == ("Error: selection is blocked: AUTOSEL_BACKEND names op 'toy.dubble', which is not "
                             "registered here (did you mean toy.double?); fix or unset the variable\n")
    monkeypatch.setenv("AUTOSEL_BACKEND", "toy.double=torch")
    assert run("doctor").exit_code == 0


def test_doctor_and_show_report_what_autosel_backend_makes_selection_do(reg, monkeypatch):
    # Doctor named the stored winner and said "OK: nothing blocks selection" under AUTOSEL_BACKEND=op=triton, while
    # get_kernel returned the forced kernel; show listed the stored row as "in use".
    toy(reg, B.TORCH, B.TRITON)
    reg.register(KernelSpec("toy.double", B.FLASHINFER, "m:x", capabilities=frozenset({Cap.CUDA})))
    store(decision(winner="triton"))
    monkeypatch.setenv("AUTOSEL_BACKEND", "toy.double=torch")
    doctor = run("doctor", "--json")
    assert doctor.exit_code == 0
    assert json.loads(doctor.stdout)["ops"][0]["selection"] == (
        "torch, forced by AUTOSEL_BACKEND (no stored decision is read, nothing is measured)")
    shown = json.loads(run("show", "--json").stdout)["decisions"]
    assert [(d["status"], d["status_detail"]) for d in shown] == [
        ("overridden", "torch, forced by AUTOSEL_BACKEND (no stored decision is read, nothing is measured)")]
    monkeypatch.setenv("AUTOSEL_BACKEND", "toy.double=flashinfer")  # registered, but it cannot run on a CPU
    doctor = run("doctor", "--json")
    assert doctor.exit_code == 1
    assert json.loads(doctor.stdout)["ops"][0]["selection"] == (
        "AUTOSEL_BACKEND forces flashinfer, which cannot run here: selection raises ValueError")
    assert doctor.stderr == (
        "Error: selection is blocked: AUTOSEL_BACKEND forces 'flashinfer' for op 'toy.double', which cannot run on "
        "device 'cpu': needs cuda, device is cpu. Force a backend usable here (torch, triton) or remove it from "
        "AUTOSEL_BACKEND; select_kernel('toy.double', backend='flashinfer') still returns it unchecked\n")
    monkeypatch.setenv("AUTOSEL_BACKEND", "toy.double=aiter")  # not registered for the op: selection's KeyError
    doctor = run("doctor", "--json")
    assert doctor.exit_code == 1 and "No 'aiter' backend registered for op 'toy.double'" in doctor.stderr
    monkeypatch.setenv("AUTOSEL_BACKEND", "aiter")  # a force for every op passes over an op without the backend
    assert run("doctor").exit_code == 0
    assert json.loads(run("show", "--json").stdout)["decisions"][0]["status"] == "in use"


def test_doctor_plugin_error_is_blocking(reg, monkeypatch):
    import importlib

    monkeypatch.setitem(importlib.import_module("autosel.registry").plugin_errors, "broken",
                        "ModuleNotFoundError: No module named 'broken_ops'")
    result = run("doctor", "--json")
    assert result.exit_code == 1
    assert json.loads(result.stdout)["plugin_errors"] == {"broken": "ModuleNotFoundError: No module named 'broken_ops'"}
    assert "plug-in 'broken' failed to load" in result.stderr


# --- export, merge, prune ---------------------------------------------------------------------------------

def test_export_jsonl_and_sqlite(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    store(decision(), decision(op="toy.other"))
    jsonl = tmp_path / "out.jsonl"
    result = run("export", "--out", jsonl, "--op", "toy.double")
    assert result.exit_code == 0 and result.stdout == f"Exported 1 decision(s) to {jsonl} (jsonl).\n"
    assert [json.loads(line)["op"] for line in jsonl.read_text().splitlines()] == ["toy.double"]
    db = tmp_path / "out.db"
    assert run("export", "--out", db, "--json").exit_code == 0
    assert sqlite3.connect(db).execute("SELECT count(*) FROM decisions").fetchone() == (2,)
    again = run("export", "--out", db)
    assert again.exit_code == 1 and "already exists" in again.stderr and "--force" in again.stderr
    assert run("export", "--out", db, "--force").exit_code == 0


def test_existing_output_error_speaks_of_force_not_the_python_argument(reg, tmp_path):
    # "already exists" told CLI users to pass overwrite=True, a Python argument.
    store(decision())
    out = tmp_path / "out.db"
    out.write_text("keep me")
    result = run("export", "--out", out)
    assert result.exit_code == 1
    assert result.stderr == (f"Error: {out} already exists; not overwriting it. Choose another --out, or pass --force "
                             "to overwrite it\n")
    assert out.read_text() == "keep me"


@pytest.mark.parametrize("command", ["export", "merge"])
def test_an_output_suffix_that_names_no_format_is_a_usage_error(reg, tmp_path, command):
    # `export --out d.json` wrote SQLite into a file named .json.
    store(decision())
    source = tmp_path / "in.jsonl"
    assert run("export", "--out", source).exit_code == 0
    out = tmp_path / "d.json"
    result = run(*(["export"] if command == "export" else ["merge", source]), "--out", out)
    assert result.exit_code == 2 and "cannot tell the format from the suffix" in result.stderr
    assert not out.exists()
    assert run(*(["export"] if command == "export" else ["merge", source]), "--out", out, "--format", "jsonl"
               ).exit_code == 0
    assert json.loads(out.read_text().splitlines()[0])["op"] == "toy.double"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs /proc, a folder nobody can create files in")
@pytest.mark.parametrize("command", ["export", "merge"])
@pytest.mark.parametrize("suffix", [".jsonl", ".db"])
def test_an_output_folder_that_cannot_be_written_is_one_error_line(reg, tmp_path, command, suffix):
    # Only creating the folder was caught: opening the file in it ended in a traceback (FileNotFoundError for
    # JSONL, sqlite3.OperationalError for SQLite); root may write anywhere else, so /proc stands for a read-only one.
    store(decision())
    source = tmp_path / "in.jsonl"
    assert run("export", "--out", source).exit_code == 0
    out = f"/proc/autosel-out{suffix}"
    result = run(*(["export"] if command == "export" else ["merge", source]), "--out", out)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: cannot write {out} (") and "choose a writable output path" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["export", "merge", "report"])
def test_an_output_under_a_file_says_that_file_is_no_folder(reg, tmp_path, command):
    # It said "cannot write .../x (File exists)" or "(Not a directory)": true of the system call, not of the path.
    store(decision())
    source = tmp_path / "in.jsonl"
    assert run("export", "--out", source).exit_code == 0
    (tmp_path / "afile").write_text("mine")
    out = tmp_path / "afile" / "sub" / "out.jsonl"
    result = run(*{"export": ["export"], "merge": ["merge", source], "report": ["report", "--all"]}[command], "--out", out)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: cannot write {out} ({tmp_path / 'afile'} is a file, not a folder); "
                                    "choose a writable")
    assert (tmp_path / "afile").read_text() == "mine"


def test_export_with_nothing_to_export_writes_nothing(reg, tmp_path):
    out = tmp_path / "empty.jsonl"
    result = run("export", "--out", out)
    assert result.exit_code == 1 and not out.exists()
    # It also said "(or pass --all-layers)" with no layer holding any, and "run `autosel tune`" to fill a --db.
    assert result.stderr == (f"Error: no decisions in the user DB {os.environ['AUTOSEL_DB']}, so {out} was not "
                             "written; run `autosel tune` first\n")
    from autosel.db import TuningDB

    TuningDB.open(tmp_path / "build.db", include_package=False).close()
    result = run("export", "--out", out, "--db", tmp_path / "build.db")
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr.endswith(f"run `autosel tune --db {tmp_path / 'build.db'}` first\n")


def test_export_all_layers_with_nothing_to_export_does_not_suggest_all_layers(reg, tmp_path):
    # It said "run `autosel tune` first (or pass --all-layers)" to a command given --all-layers.
    toy(reg, B.TORCH, B.TRITON)
    out = tmp_path / "decisions.jsonl"
    result = run("export", "--out", out, "--op", "toy.*", "--all-layers")
    assert result.exit_code == 1
    assert result.stderr == (f"Error: no decisions for toy.* in any layer, so {out} was not written; run `autosel "
                             "tune` first\n")


@pytest.mark.parametrize("db", [False, True])
def test_export_after_a_tune_that_reused_shipped_decisions_points_at_all_layers(reg, tmp_path, monkeypatch, db):
    # It said "run `autosel tune` first": a tune reuses shipped decisions without copying them into the user DB,
    # so tuning again never helped.
    toy(reg, B.TORCH, B.TRITON)
    first, shipped, user = tmp_path / "first.db", tmp_path / "shipped.db", tmp_path / "mine.db"
    assert run("tune", "--db", first).exit_code == 0
    assert run("export", "--db", first, "--out", shipped).exit_code == 0
    monkeypatch.setenv("AUTOSEL_DB_PATH", str(shipped))
    monkeypatch.setenv("AUTOSEL_DB", str(user))
    assert json.loads(run("tune", "--json").stdout)["outcomes"][0]["status"] == "stored"
    out = tmp_path / "decisions.jsonl"
    result = run("export", "--out", out, "--op", "toy.*", *["--db", user] * db)
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr == (
        f"Error: no decisions for toy.* in the user DB {user}, so {out} was not written; the shipped DBs hold 1 "
        f"({shipped}): pass --all-layers to export them too, or run `autosel tune --db {user}` first, which copies "
        "them into it\n" if db else
        f"Error: no decisions for toy.* in the user DB {user}, so {out} was not written; the shipped DBs hold 1 "
        f"({shipped}), which `autosel tune` reuses without copying them into the user DB: pass --all-layers to "
        "export them too, or run `autosel tune --db FILE`, which copies them into FILE, and `autosel export --db "
        "FILE`\n")
    assert run("export", "--out", out, "--op", "toy.*", "--all-layers").exit_code == 0
    build = user if db else tmp_path / "build.db"  # the advice, followed
    assert run("tune", "--db", build).exit_code == 0
    assert run("export", "--db", build, "--out", tmp_path / "b.jsonl").exit_code == 0


@pytest.mark.parametrize("db", [False, True])
def test_export_with_only_other_platforms_shipped_rows_does_not_say_a_tune_copies_them(reg, tmp_path, monkeypatch,
                                                                                       db):
    # On a machine the package ships no DB for, it said "run `autosel tune --db FILE`, which copies them into
    # FILE": a tune here never copies another platform's decisions, it times the ops.
    from autosel.db import TuningDB

    toy(reg, B.TORCH, B.TRITON)
    first, shipped, user = tmp_path / "first.db", tmp_path / "shipped.db", tmp_path / "mine.db"
    store(decision(platform=OTHER_CPU), db=first)
    assert run("export", "--db", first, "--out", shipped).exit_code == 0
    monkeypatch.setenv("AUTOSEL_DB_PATH", str(shipped))
    monkeypatch.setenv("AUTOSEL_DB", str(user))
    TuningDB.open(user, include_package=False).close()
    out = tmp_path / "decisions.jsonl"
    result = run("export", "--out", out, "--op", "toy.*", *["--db", user] * db)
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr == (
        f"Error: no decisions for toy.* in the user DB {user}, so {out} was not written; the shipped DBs hold 1 made "
        f"for other platforms ({shipped}), which a tune here does not use: pass --all-layers to export them too, or "
        f"run `autosel tune{' --db ' + str(user) if db else ''}` first\n")


def test_export_of_an_op_glob_matching_nothing_names_the_known_ops(reg, tmp_path):
    # It said "run `autosel tune` first", which tunes nothing for a misspelt op.
    toy(reg, B.TORCH, B.TRITON)
    store(decision(op="toy.stored"))
    result = run("export", "--out", tmp_path / "d.jsonl", "--op", "nope*")
    assert result.exit_code == 1
    assert result.stderr == ("Error: no registered op or stored decision matches --op 'nope*'; known ops: "
                             "toy.double, toy.stored\n")


def test_merge_reports_conflicts_and_exits_1_when_left_out(reg, tmp_path):
    a, b = tmp_path / "a.db", tmp_path / "b.db"
    store(decision(winner="triton"), db=a)
    store(decision(winner="torch", created_at="2026-02-01T00:00:00+00:00"), decision(op="toy.other"), db=b)
    result = run("merge", a, b, "--out", tmp_path / "m.db")
    assert result.exit_code == 1
    assert "Merged 2 input(s)" in result.stdout and "Merged 2 input(s) into" in result.stdout
    assert f"Conflict: toy.double (eager, {CPU.key}): {a} -> triton, {b} -> torch; left out" in result.stdout
    # It said to pass --prefer, and that retry then failed on the file this command had just written.
    assert result.stderr == (f"Error: 1 conflicting decision(s) were left out of {tmp_path / 'm.db'}; to keep one "
                             "of each, run the same command with --prefer newest or --prefer first and --force (to "
                             f"replace {tmp_path / 'm.db'}), or re-tune those ops\n")
    assert run("merge", a, b, "--out", tmp_path / "m.db", "--prefer", "newest").exit_code == 1  # not overwritten
    assert run("merge", a, b, "--out", tmp_path / "m.db", "--prefer", "newest", "--force").exit_code == 0
    kept = run("merge", a, b, "--out", tmp_path / "n.jsonl", "--prefer", "newest", "--json")
    assert kept.exit_code == 0
    report = json.loads(kept.stdout)
    assert report["rows"] == 2 and len(report["conflicts"]) == 1 and not report["conflicts_left_out"]
    winners = {json.loads(line)["op"]: json.loads(line)["winner"] for line in (tmp_path / "n.jsonl").read_text().splitlines()}
    assert winners == {"toy.double": "torch", "toy.other": "triton"}


def test_merge_of_nothing_but_conflicts_writes_no_file_and_names_each_conflicts_bucket(reg, tmp_path):
    # It wrote an empty pq.jsonl and said to pass --prefer, and that retry failed with "pq.jsonl already exists";
    # the conflicts of three buckets printed three identical lines.
    p, q, out = tmp_path / "p.jsonl", tmp_path / "q.jsonl", tmp_path / "pq.jsonl"
    buckets = ["*", "[256]", "[4]"]  # in the order merge reports them
    p.write_text("".join(replace(decision(), bucket=b).to_json() + "\n" for b in buckets))
    q.write_text("".join(replace(decision(winner="torch", created_at="2026-02-01T00:00:00+00:00"), bucket=b).to_json()
                         + "\n" for b in buckets))
    result = run("merge", p, q, "--out", out)
    assert result.exit_code == 1 and not out.exists()
    assert result.stdout == (f"Merged 2 input(s): no decision besides the conflicts below, so {out} was not written.\n"
                             f"Conflict: toy.double (eager, {CPU.key}): {p} -> triton, {q} -> torch; left out\n"
                             f"Conflict: toy.double (eager, bucket [256], {CPU.key}): {p} -> triton, {q} -> torch; "
                             "left out\n"
                             f"Conflict: toy.double (eager, bucket [4], {CPU.key}): {p} -> triton, {q} -> torch; "
                             "left out\n")
    assert result.stderr == (f"Error: 3 conflicting decision(s) were left out, so {out} was not written; pass --prefer "
                             "newest or --prefer first to keep one of each, or re-tune those ops\n")
    assert json.loads(run("merge", p, q, "--out", out, "--json").stdout)["written"] is False
    retry = run("merge", p, q, "--out", out, "--prefer", "newest")
    assert retry.exit_code == 0, retry.output
    assert [json.loads(line)["winner"] for line in out.read_text().splitlines()] == ["torch"] * 3
    assert "bucket [4]" in retry.stdout and "kept the newest row" in retry.stdout


def tune_table(winner: str, buckets: dict[str, str], created_at: str) -> list[Decision]:
    """One tune's table of toy.double: its op-level row and a row per bucket."""
    top = decision(winner=winner, created_at=created_at)
    return [top] + [replace(top, bucket=b, winner=w) for b, w in buckets.items()]


def test_merge_keeps_or_leaves_out_a_tuning_table_whole_never_mixing_two_tunes(reg, tmp_path):
    # Merged row by row, two tunes of one op (other shapes, one other winner) made one table of both: the newer
    # op-level row with the bucket rows of both, a table neither tune produced, which selection then ran.
    p, q = tmp_path / "p.jsonl", tmp_path / "q.jsonl"
    p.write_text("".join(d.to_json() + "\n" for d in tune_table("triton", {"[4]": "triton", "[256]": "torch"},
                                                                   "2026-01-01T00:00:00+00:00")))
    q.write_text("".join(d.to_json() + "\n" for d in tune_table("triton", {"[4]": "torch", "[8]": "torch"},
                                                                   "2026-02-01T00:00:00+00:00")))
    left_out = run("merge", p, q, "--out", tmp_path / "none.jsonl", "--json")
    assert left_out.exit_code == 1
    conflicts = {c["bucket"]: [w["winner"] for w in c["winners"]] for c in json.loads(left_out.stdout)["conflicts"]}
    assert conflicts == {"[256]": ["torch", "-"], "[4]": ["triton", "torch"], "[8]": ["-", "torch"]}
    assert not (tmp_path / "none.jsonl").exists()  # the agreeing op-level row went with its table
    for prefer, expected in (("newest", {"*": "triton", "[4]": "torch", "[8]": "torch"}),
                             ("first", {"*": "triton", "[4]": "triton", "[256]": "torch"})):
        out = tmp_path / f"{prefer}.jsonl"
        assert run("merge", p, q, "--out", out, "--prefer", prefer).exit_code == 0
        assert {json.loads(line)["bucket"]: json.loads(line)["winner"] for line in out.read_text().splitlines()} == \
            expected


def test_merge_and_export_leave_out_bucket_rows_without_their_op_level_row(reg, tmp_path, caplog):
    orphans, whole = tmp_path / "orphans.jsonl", tmp_path / "whole.jsonl"
    orphans.write_text("".join(d.to_json() + "\n" for d in tune_table("torch", {"[4]": "torch"},
                                                                         "2026-01-01T00:00:00+00:00")[1:]))
    whole.write_text(decision(op="toy.other").to_json() + "\n")
    result = run("merge", orphans, whole, "--out", tmp_path / "m.jsonl")
    assert result.exit_code == 0 and "1 decision(s)" in result.stdout
    assert "left out the bucket rows of toy.double (eager mode" in caplog.text


def test_export_all_layers_takes_each_table_from_the_layer_selection_reads(reg, tmp_path, monkeypatch):
    # The user layer's op-level row was written with a shipped layer's bucket rows of another tune.
    toy(reg, B.TORCH, B.TRITON)
    tuned, shipped, user = tmp_path / "tuned.db", tmp_path / "shipped.db", tmp_path / "mine.db"
    store(*tune_table("torch", {"[4]": "torch", "[256]": "triton"}, "2026-01-01T00:00:00+00:00"), db=tuned)
    assert run("export", "--db", tuned, "--out", shipped).exit_code == 0  # a file that can ship
    monkeypatch.setenv("AUTOSEL_DB_PATH", str(shipped))
    assert len(json.loads(run("show", "--json").stdout)["decisions"]) == 3
    store(decision(winner="triton", created_at="2026-02-01T00:00:00+00:00"), db=user)
    out = tmp_path / "all.jsonl"
    assert run("export", "--db", user, "--out", out, "--all-layers").exit_code == 0
    assert [(json.loads(line)["bucket"], json.loads(line)["winner"]) for line in out.read_text().splitlines()] == [
        ("*", "triton")]


def test_merge_help_counts_the_bucket_in_a_conflicts_key():
    assert "conflict is one key (platform, op, mode, bucket, versions)" in run("merge", "--help").output.replace(
        "\n  ", " ")


def test_merge_of_a_junk_text_file_is_an_error_not_an_empty_input(reg, tmp_path):
    # A junk text file was read as JSON Lines with every line skipped, and merge exited 0.
    good = tmp_path / "good.jsonl"
    good.write_text(decision().to_json() + "\n")
    junk = tmp_path / "notes.txt"
    junk.write_text("remember to tune gemm\nand rope\n")
    out = tmp_path / "out.db"
    result = run("merge", good, junk, "--out", out)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"Error: {junk} is neither an autosel tuning DB (SQLite) nor a JSON Lines export "
                                    "of decisions: line 1 is not valid JSON (Expecting value at column 1)")
    assert not out.exists()


def test_merge_warns_once_per_bad_line_in_the_files_terms(reg, tmp_path):
    # A bad line was reported twice (the inputs were read twice) as "Decision.__init__() missing 5 required
    # positional arguments".
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(decision().to_json() + '\n{"op": "toy.double", "winner": "torch"}\n')
    result = run("merge", mixed, "--out", tmp_path / "out.db")
    assert result.exit_code == 0, result.output
    warning = (f"Warning: {mixed}:2: skipping a line that is not a decision: it has no 'mode', 'bucket', "
               "'platform_key', 'versions', 'candidates', 'margin'; each line must be one decision as "
               "`autosel export --format jsonl` writes it\n")
    assert result.stderr == warning


def test_merge_missing_input_is_a_usage_error(tmp_path):
    assert run("merge", tmp_path / "nope.db", "--out", tmp_path / "m.db").exit_code == 2


def test_prune_removes_only_this_machines_stale_rows(reg):
    toy(reg, B.TORCH, B.TRITON)
    store(decision(), decision(versions={"torch": "1.0"}), decision(platform=OTHER_CPU, versions={"torch": "1.0"}))
    dry = run("prune", "--dry-run")
    assert dry.exit_code == 0
    assert dry.stdout.splitlines()[-1] == "Would remove 1 stale decision(s) (run without --dry-run to remove them)."
    assert "versions differ: torch 1.0 -> (none)" in dry.stdout
    assert len(tuning.database(settings_for(None, full=False)).decisions()) == 3
    result = run("prune", "--json")
    assert json.loads(result.stdout)["removed"] == 1
    left = {(d.platform_key, tuple(d.versions.items())) for d, _ in
            tuning.database(settings_for(None, full=False)).decisions()}
    assert left == {(CPU.key, ()), (OTHER_CPU.key, (("torch", "1.0"),))}


def test_prune_names_the_bucket_of_each_row(reg):
    # A stale op-level row and its bucket rows printed as identical lines.
    toy(reg, B.TORCH, B.TRITON)
    stale = decision(versions={"torch": "1.0"})
    tuning.database(settings_for(None, full=False)).record(stale, [replace(stale, bucket="[64]")])
    dry = run("prune", "--dry-run")
    assert [line.split(" winner")[0] for line in dry.stdout.splitlines()[:2]] == [
        "Would remove: toy.double (eager)", "Would remove: toy.double (eager, bucket [64])"]
    rows = json.loads(run("prune", "--dry-run", "--json").stdout)["rows"]
    assert [r["bucket"] for r in rows] == ["*", "[64]"]


# --- report -----------------------------------------------------------------------------------------------

def test_report_after_a_tune_is_one_self_contained_page(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON, B.JIT)
    assert run("tune").exit_code == 0
    out = tmp_path / "report.html"
    result = run("report", "--out", out)
    assert result.exit_code == 0 and result.stdout == f"Wrote {out}: 1 decision(s).\n"
    page = out.read_text()
    assert "<svg" in page and "toy.double" in page and "raised RuntimeError" in page and CPU.key in page
    assert "<script" not in page and "<link" not in page and "http" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")


def test_report_refuses_to_overwrite_without_force_like_export_and_merge(reg, tmp_path):
    # report overwrote an existing file while export and merge refused without --force.
    toy(reg, B.TORCH, B.TRITON)
    store(decision())
    out = tmp_path / "report.html"
    out.write_text("keep me")
    result = run("report", "--out", out)
    assert result.exit_code == 1 and "already exists" in result.stderr and "--force" in result.stderr
    assert out.read_text() == "keep me"
    assert run("report", "--out", out, "--force").exit_code == 0
    assert out.read_text().startswith("<!DOCTYPE html>")


@pytest.mark.parametrize("command", ["show", "report"])
def test_an_op_glob_matching_nothing_is_an_error_as_in_tune(reg, tmp_path, command):
    # `show --op 'nosuch*'` exited 0 (an empty table) while `tune --op 'nosuch*'` exited 1.
    toy(reg, B.TORCH, B.TRITON)
    store(decision(op="stored.only"))
    args = ["--out", tmp_path / "r.html"] if command == "report" else []
    result = run(command, "--op", "nosuch*", *args)
    assert result.exit_code == 1
    assert result.stderr == ("Error: no registered op or stored decision matches --op 'nosuch*'; known ops: "
                             "stored.only, toy.double\n")
    assert run("show", "--op", "stored.*").exit_code == 0


def test_report_with_no_decisions_is_an_error(reg, tmp_path):
    result = run("report", "--out", tmp_path / "r.html")
    assert result.exit_code == 1 and "run `autosel tune` first" in result.stderr


def test_report_and_show_say_an_op_a_script_registered_is_not_registered_in_this_process(reg, tmp_path):
    # `autosel report --op 'myeng.*'` said "no decisions ...; run `autosel tune` first" although the DB held them.
    store(decision(op="myeng.double"))
    result = run("report", "--out", tmp_path / "r.html", "--op", "myeng.*")
    assert result.exit_code == 1
    assert result.stderr == (
        "Error: no decisions in use on this machine: the DB holds 1 row(s), but the op 'myeng.double' is not "
        "registered in this process: install the package whose `autosel.ops` entry point registers it, or, for an op "
        "a script registers, register it through such an entry point so that the CLI sees it; or pass --all to "
        "include their rows\n")
    shown = json.loads(run("show", "--json").stdout)["decisions"]
    assert [(d["status"], d["status_detail"].split(":")[0]) for d in shown] == [
        ("unknown op", "op 'myeng.double' is not registered in this process")]
    assert run("report", "--out", tmp_path / "r.html", "--op", "myeng.*", "--all").exit_code == 0


class FlippingTimer(FakeTimer):
    """triton 10x faster than torch on the larger toy shape, 2x slower on the smaller one."""

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        fn()
        small = shape["n"] < 65536
        base = {"torch": 100.0, "triton": 200.0 if small else 10.0}[backend]
        return [base * (1 + 0.001 * i) for i in range(5)]


def test_tune_says_how_many_buckets_each_op_has_and_show_lists_them(reg, monkeypatch):
    import autosel.timing
    import toy_kernels

    monkeypatch.setattr(autosel.timing, "timer_for", lambda device, mode: FlippingTimer())
    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:fast"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs,
                            bucket=toy_kernels.bucket))
    result = run("tune", "--json")
    outcome = json.loads(result.stdout)["outcomes"][0]
    assert outcome["winner"] == "triton" and outcome["buckets_differ"] == 1
    assert outcome["buckets"] == [{"bucket": "[65536]", "winner": "triton"}, {"bucket": "[16384]", "winner": "torch"}]
    shown = json.loads(run("show", "--json").stdout)["decisions"]
    assert [(d["bucket"], d["winner"], d["status"]) for d in shown] == [
        ("*", "triton", "in use"), ("[16384]", "torch", "in use"), ("[65536]", "triton", "in use")]
    table = run("tune").stdout  # stored now: the table still counts the buckets
    assert "2, 1 differ" in table


def _tune_with_buckets(reg, monkeypatch) -> None:
    """A tune that stores toy.double's op-level row (triton) and two bucket rows, one of them torch's."""
    import autosel.timing
    import toy_kernels

    monkeypatch.setattr(autosel.timing, "timer_for", lambda device, mode: FlippingTimer())
    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:fast"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs,
                            bucket=toy_kernels.bucket))
    assert run("tune").exit_code == 0


def test_report_puts_the_bucket_rows_in_their_ops_section(reg, monkeypatch, tmp_path):
    # Each bucket row used to be a section of its own, counted as a decision.
    _tune_with_buckets(reg, monkeypatch)
    out = tmp_path / "report.html"
    result = run("report", "--out", out)
    assert result.exit_code == 0 and result.stdout == f"Wrote {out}: 1 decision(s) and 2 bucket row(s).\n"
    page = out.read_text()
    assert page.count('<section class="op">') == 1 and page.count("<svg") == 1
    assert "toy.double (eager): <b>triton</b> (1 of 2 buckets run another winner)" in page
    assert "<td><code>[16384]</code></td><td class=\"winner\">torch</td>" in page
    assert page.count('class="bucket-sep switch"') == 1


def test_export_merge_and_prune_count_rows_as_report_does(reg, monkeypatch, tmp_path):
    # export, merge and prune counted op-level and bucket rows together as "3 decision(s)"; report told them apart.
    _tune_with_buckets(reg, monkeypatch)
    said = "1 decision(s) and 2 bucket row(s)"
    assert run("report", "--out", tmp_path / "r.html").stdout == f"Wrote {tmp_path / 'r.html'}: {said}.\n"
    out = tmp_path / "e.jsonl"
    assert run("export", "--out", out).stdout == f"Exported {said} to {out} (jsonl).\n"
    assert json.loads(run("export", "--out", out, "--force", "--json").stdout)["bucket_rows"] == 2
    merged = tmp_path / "m.jsonl"
    assert run("merge", out, "--out", merged).stdout == f"Merged 1 input(s) into {merged}: {said}.\n"
    monkeypatch.setattr("autosel.inventory.version_vector", lambda platform, specs: {"torch": "0.0"})  # all stale
    pruned = run("prune", "--dry-run").stdout.splitlines()[-1]
    assert pruned == "Would remove 1 stale decision(s) and 2 bucket row(s) (run without --dry-run to remove them)."


@pytest.mark.parametrize("field, value", [("margin", "0.03"), ("lead_over_runner_up", "0.5"), ("tune_s", "1")])
def test_show_and_report_skip_a_row_whose_evidence_has_a_wrong_type(reg, tmp_path, field, value):
    # A number stored as a string used to crash `autosel show` and `report` (traceback, exit 1).
    toy(reg, B.TORCH, B.TRITON)
    store(decision(), decision(op="bad.op"))
    with sqlite3.connect(os.environ["AUTOSEL_DB"]) as conn:
        evidence = json.loads(conn.execute("SELECT evidence FROM decisions WHERE op = 'bad.op'").fetchone()[0])
        conn.execute("UPDATE decisions SET evidence = ? WHERE op = 'bad.op'", (json.dumps({**evidence, field: value}),))
    shown = run("show")
    assert shown.exit_code == 0 and "toy.double" in shown.stdout and "bad.op" not in shown.stdout
    assert run("report", "--all", "--out", tmp_path / "r.html").exit_code == 0


def test_doctor_leaves_a_foreign_sqlite_file_alone_and_calls_it_read_only(reg, tmp_path):
    # doctor used to switch a foreign file with a `decisions` table to WAL and add autosel's tables to it.
    path = tmp_path / "theirs.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE decisions (id INTEGER PRIMARY KEY)")
    before = path.read_bytes()
    result = run("doctor", "--json", "--db", path)
    [layer] = [item for item in json.loads(result.stdout)["layers"] if item["kind"] == "user"]
    assert (layer["writable"], layer["problem"]) == (False, "an SQLite file but not an autosel tuning DB; not read")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["theirs.db"]


@pytest.mark.parametrize("option", ["--budget-s", "--isolate-timeout-s"])
@pytest.mark.parametrize("value", ["nan", "inf", "0"])
def test_tune_seconds_must_be_positive_and_finite(reg, option, value):
    # nan and inf were accepted (click's FloatRange lets them through): a budget or a timeout that never ends.
    result = run("tune", option, value)
    assert result.exit_code == 2 and option in result.stderr


def test_tune_with_the_db_locked_past_the_busy_timeout_prints_the_outcome_and_exits_1(reg, monkeypatch):
    # `autosel tune` used to exit with a traceback (sqlite3.OperationalError from the lease code), then exited 0
    # although the decision it made was only in memory.
    from autosel.db import tools as db_tools

    toy(reg, B.TORCH, B.TRITON)
    store(decision(op="other.op"))  # the user DB exists, in WAL mode
    monkeypatch.setattr(db_tools, "BUSY_TIMEOUT_S", 0.2)
    state.process.memos.databases.clear()  # reopen with the short busy timeout
    other = sqlite3.connect(os.environ["AUTOSEL_DB"], isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process's long write transaction
    try:
        result = run("tune", "--json")
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert result.exit_code == 1, result.output
    assert json.loads(result.stdout)["outcomes"][0]["winner"] == "triton"
    assert result.stderr.count("Warning: ") == 1 and "kept in memory" in result.stderr
    assert result.stderr.splitlines()[-1] == (
        f"Error: the user tuning DB {os.environ['AUTOSEL_DB']} cannot be written (write failed: database is locked); "
        "the decisions tuned after that failure are lost at exit: tune them again once it can be written. Set "
        "AUTOSEL_DB to a file path this process can write, or pass --db PATH")


def unwritable(tmp_path: Path, kind: str) -> Path:
    """A DB path no process can write, even as root (chmod does not stop root): under a file, or a text file."""
    if kind == "under a file":
        (tmp_path / "file").write_text("not a folder")
        return tmp_path / "file" / "build.db"
    (tmp_path / "notes.db").write_text("not SQLite\n")
    return tmp_path / "notes.db"


@pytest.mark.parametrize("kind", ["under a file", "text file"])
@pytest.mark.parametrize("how", ["--db", "AUTOSEL_DB"])
def test_tune_into_a_db_that_cannot_be_written_exits_1_before_timing(reg, tmp_path, monkeypatch, kind, how):
    # It tuned, printed status "tuned" and exited 0 with a warning; the decisions were lost at exit.
    toy(reg, B.TORCH, B.TRITON)
    path = unwritable(tmp_path, kind)
    monkeypatch.setenv("AUTOSEL_DB", str(path))
    result = run("tune", "--force", *(["--db", path] if how == "--db" else []))
    where, remedy = ((f"--db {path}", "Pass --db a file path this process can write (a new file is created)")
                     if how == "--db" else (f"the user tuning DB {path}",
                                            "Set AUTOSEL_DB to a file path this process can write, or pass --db PATH"))
    assert (result.exit_code, result.stdout) == (1, "")
    [line] = result.stderr.splitlines()  # no "chosen" line: nothing was timed; no warning naming the other remedy
    assert line.startswith(f"Error: {where} cannot be written (") and line.endswith(f"; nothing was timed. {remedy}")


@pytest.mark.parametrize("kind", ["under a file", "text file"])
def test_prune_of_a_db_that_cannot_be_written_is_an_error(reg, tmp_path, kind):
    # It printed "Removed 0 stale decision(s)." and exited 0.
    path = unwritable(tmp_path, kind)
    result = run("prune", "--db", path)
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr.startswith(f"Error: --db {path}: no such file") if kind == "under a file" else (
        result.stderr.endswith("; nothing was removed. Pass --db a file path this process can write (a new file "
                               "is created)\n"))


# --- check ------------------------------------------------------------------------------------------------

def bucketed(reg):
    import toy_kernels

    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=toy_kernels.inputs,
                            bucket=toy_kernels.bucket))


def test_check_passes_when_every_required_op_has_a_usable_decision(reg):
    toy(reg, B.TORCH, B.TRITON)
    reg.register(KernelSpec("toy.single", B.TORCH, "toy_kernels:fast"))
    store(decision())
    result = run("check", "--require", "toy.double,toy.single")
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith(f"OK: 2 required (op, mode) pair(s) have a usable decision for {CPU.key}.\n")
    report = json.loads(run("check", "--require", "toy.*", "--json").stdout)
    assert report["ok"] and report["this_machine"] and report["missing"] == []
    assert [(c["op"], c["mode"], c["winner"], c["detail"]) for c in report["checked"]] == [
        ("toy.double", "eager", "triton", f"triton (user DB {os.environ['AUTOSEL_DB']})"),
        ("toy.single", "eager", "torch", "no decision needed: torch is the only usable backend here")]


def test_check_fails_on_an_empty_db_and_names_what_is_missing(reg, tmp_path):
    toy(reg, B.TORCH, B.TRITON)
    empty = tmp_path / "empty.db"
    from autosel.db import TuningDB

    TuningDB.open(empty, include_package=False).close()
    result = run("check", "--require", "toy.double", "--require", "no.such", "--db", empty)
    assert result.exit_code == 1
    # It advised tuning no.such, which no tune can: it is not registered.
    assert result.stderr == (
        f"Error: 2 of 2 required (op, mode) pairs have no usable decision for {CPU.key}: toy.double (eager): no "
        f"usable eager decision for {CPU.key} (none stored); no.such (eager): op 'no.such' is not registered here "
        "(is the package that declares it installed?). Install the package that registers no.such or fix the name "
        "(`autosel doctor` lists the ops). Tune the others on the target (`autosel tune --db build.db`) and ship "
        "that DB, or point AUTOSEL_DB_PATH at one that holds them\n")
    assert "MISSING" in result.stdout
    report = json.loads(run("check", "--require", "toy.double", "--json", "--db", empty).stdout)
    assert report["ok"] is False and [m["op"] for m in report["missing"]] == ["toy.double"]


def test_check_for_graph_mode_on_a_cpu_target_is_a_usage_error(reg):
    # It exited 1 saying to tune on the target, which never stores graph-mode rows on a CPU.
    toy(reg, B.TORCH, B.TRITON)
    result = run("check", "--require", "toy.double", "--mode", "graph")
    assert result.exit_code == 2 and f"{CPU.key} has no graph mode (selection there runs eager mode only)" in \
        result.stderr


def test_check_with_buckets_needs_the_bucket_rows_of_an_op_that_declares_buckets(reg):
    bucketed(reg)
    store(decision())  # an op-level row alone, as a tune before buckets left it
    assert run("check", "--require", "toy.double").exit_code == 0
    bare = run("check", "--require", "toy.double", "--buckets")
    assert bare.exit_code == 1 and "but no bucket rows beside it" in bare.stderr
    buckets = [bucket_row(n, winner) for n, winner in ((16384, "torch"), (65536, "triton"))]
    tuning.database(settings_for(None, full=False)).record(decision(), buckets)
    report = json.loads(run("check", "--require", "toy.double", "--buckets", "--json").stdout)
    assert report["ok"] and report["checked"][0]["buckets"] == 2


def bucket_row(n: int, winner: str, bucket: str | None = None) -> Decision:
    """A bucket row of toy.double timed at n elements, keyed as toy_kernels.bucket keys n (or as `bucket` says)."""
    row = decision(winner=winner)
    candidates = tuple(replace(c, shapes=tuple(replace(s, shape={"n": n}) for s in c.shapes)) for c in row.candidates)
    return replace(row, bucket=bucket or f"[{1 << (n - 1).bit_length()}]", candidates=candidates)


OLD_KEYS = ("has bucket rows keyed otherwise than the op's bucket function has keyed their shapes since it was made "
            "(such as [1000], now [1024])")


@pytest.mark.parametrize("args", [[], ["--buckets"]], ids=["plain", "buckets"])
def test_check_refuses_rows_its_bucket_function_no_longer_keys_so(reg, args):
    # gemm.mm's bucket key changed at commit c134b65 ([16, 6144, 4096] became [16, "6144x4096"]): rows under the old key
    # are never looked up, and their buckets run the op-level winner without a word. Only --buckets said so (and
    # to re-tune with --force): selection took the decision as stored.
    bucketed(reg)
    tuning.database(settings_for(None, full=False)).record(
        decision(), [bucket_row(16384, "torch"), bucket_row(1000, "triton", bucket="[1000]")])
    result = run("check", "--require", "toy.double", *args)
    assert result.exit_code == 1
    assert (f"toy.double (eager): the stored eager decision (triton, user DB {os.environ['AUTOSEL_DB']}) {OLD_KEYS}: "
            "re-tune the op (selection keeps it only where nothing can be timed") in result.stderr


def test_tune_times_again_a_table_keyed_before_its_bucket_function_changed_and_show_says_why(reg):
    # `autosel tune` called it stored and `autosel show` in use, while no call looked its old-keyed rows up.
    bucketed(reg)
    tuning.database(settings_for(None, full=False)).record(
        decision(), [bucket_row(16384, "torch"), bucket_row(1000, "triton", bucket="[1000]")])
    shown = json.loads(run("show", "--json").stdout)["decisions"]
    assert [(d["status"], d["status_detail"]) for d in shown if d["bucket"] == "*"] == [
        ("stale", f"{OLD_KEYS}: `autosel tune` times the eligible backends again")]
    tuned = json.loads(run("tune", "--json").stdout)["outcomes"][0]
    assert tuned["status"] == "tuned" and [b["bucket"] for b in tuned["buckets"]] == ["[65536]", "[16384]"]
    assert json.loads(run("tune", "--json").stdout)["outcomes"][0]["status"] == "stored"  # keyed today now


def test_check_with_buckets_does_not_judge_rows_of_an_op_whose_inputs_refuse_meta_tensors(reg):
    # A user op's make_inputs may need real data; its rows' keys cannot be told, so they are not called stale.
    import toy_kernels

    def real_inputs_only(shape, device):
        if device == "meta":
            raise RuntimeError("needs real data")
        return toy_kernels.inputs(shape, device)

    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=real_inputs_only,
                            bucket=toy_kernels.bucket))
    tuning.database(settings_for(None, full=False)).record(decision(), [bucket_row(1000, "triton", bucket="[1000]")])
    result = run("check", "--require", "toy.double", "--buckets")
    assert result.exit_code == 0, result.output


def test_check_for_another_platform_compares_the_versions_installed_here(reg, monkeypatch):
    from autosel.platforms import installed_version

    toy(reg, B.TORCH, B.TRITON)
    torch_here = installed_version("torch")
    store(decision(platform=OTHER_CPU, versions={"torch": "1.0"}))
    missing = run("check", "--require", "toy.double", "--platform", OTHER_CPU.key)
    assert missing.exit_code == 1
    assert (f"no usable eager decision for {OTHER_CPU.key} with the versions installed here (torch 1.0 -> "
            f"{torch_here})") in missing.stderr
    monkeypatch.setenv("AUTOSEL_MATCH", "device")
    [near] = json.loads(run("check", "--require", "toy.double", "--platform", OTHER_CPU.key, "--json").stdout)[
        "checked"]
    assert near["ok"] and near["near"] == f"near match: versions differ: torch 1.0 -> {torch_here}"
    store(decision(platform=OTHER_CPU, versions={"torch": torch_here, "cuda": "13.0"}))
    monkeypatch.setenv("AUTOSEL_MATCH", "exact")
    [exact] = json.loads(run("check", "--require", "toy.double", "--platform", OTHER_CPU.key, "--json").stdout)[
        "checked"]
    assert exact["ok"] and exact["near"] is None and exact["detail"].endswith(
        "; cuda not checked (only the target can tell)")


@pytest.mark.parametrize("values", [[""], [","], [" , ", " "]])
def test_check_with_a_require_that_names_no_op_is_a_usage_error(reg, values):
    # `--require ""` (an unset REQUIRE build argument) exited 0: "OK: 0 required (op, mode) pair(s)".
    result = run("check", *[arg for value in values for arg in ("--require", value)])
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (f"Error: Invalid value for '--require': {', '.join(map(repr, values))} "
                                              "names no op; pass op names or globs, e.g. --require "
                                              "'layernorm.*,gemm.mm'")


def test_check_rejects_a_platform_that_is_not_a_key(reg):
    result = run("check", "--require", "toy.double", "--platform", "H200")
    assert result.exit_code == 2 and "'H200' is not a platform key device/arch/name/multiprocessors" in result.stderr


def test_tune_on_all_gpus_without_a_gpu_says_so(reg, monkeypatch):
    toy(reg, B.TORCH, B.TRITON)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    result = run("tune", "--devices", "all")
    assert (result.exit_code, result.stdout) == (1, "")
    assert result.stderr == ("Error: --devices all: no GPU is visible to torch here (torch.cuda.is_available() is "
                             "False), so there are no GPUs to spread the tune over; leave out devices (--devices) to "
                             "tune on this machine's current device\n")


@pytest.mark.parametrize("value", ["foo", "-1", "0,,1", "1.5", "all,0"])
def test_tune_devices_of_a_bad_form_is_a_usage_error_on_any_machine(reg, value):
    # "--devices foo" said "no GPU is visible to torch here", as if the value had been right.
    result = run("tune", "--devices", value)
    assert result.exit_code == 2
    assert result.stderr.splitlines()[-1] == (f"Error: Invalid value for '--devices': {value!r} is not 'all' or GPU "
                                              "indices (whole numbers from 0) separated by commas, e.g. 0,1")


def test_tune_budget_help_says_it_bounds_the_timing_not_the_wall_time(reg):
    # The help said "Time budget per op and mode": a --budget-s 1 tune taking 30 s looked like a bug.
    help_text = " ".join(run("tune", "--help").stdout.split())
    assert "Seconds of timing per op and mode; not the wall time: each candidate's checks and first compile come " \
           "on top (torch.compile's first compile of each kernel among them)." in help_text


def _shapes_that_raise(platform):
    raise RuntimeError("no GPU table for this platform")


def _shapes_holding_a_dtype(platform):
    import torch

    return [{"n": 4, "dtype": torch.bfloat16}]


@pytest.mark.parametrize("shapes, error", [
    (_shapes_that_raise, "RuntimeError: no GPU table for this platform"),
    (_shapes_holding_a_dtype, "TypeError: shape 0 of op 'plug.bad' holds dtype=torch.bfloat16"),
], ids=["raises", "dtype in a shape"])
def test_doctor_names_an_op_whose_shapes_function_fails_on_its_row_and_goes_on(reg, shapes, error):
    # doctor crashed with a traceback when a plug-in op's shapes= function raised or returned an invalid shape.
    import toy_kernels

    for backend, target in ((B.TORCH, "slow"), (B.TRITON, "fast")):
        reg.register(KernelSpec("plug.bad", backend, f"toy_kernels:{target}"))
    reg.define(OpDefinition("plug.bad", shapes=shapes, make_inputs=toy_kernels.inputs))
    toy(reg, B.TORCH, B.TRITON)
    result = run("doctor", "--json")
    assert result.exit_code == 0, result.output
    ops = {item["op"]: item for item in json.loads(result.stdout)["ops"]}
    bad = ops["plug.bad"]
    assert bad["shapes"] == 0 and bad["shapes_error"].startswith(
        f"op 'plug.bad': its shapes function (register_op's shapes=) failed: {error}")
    assert bad["shapes_error"].endswith("Fix that function: it takes the platform and returns the representative "
                                        "shapes every candidate is checked on, as a list of dicts; until then this op "
                                        "cannot be tuned, by `autosel tune` or at first use")
    assert bad["selection"] == ("several eligible, none stored, no usable shapes: selection raises unless "
                                f"backend=...; problem: {bad['shapes_error']}")
    assert ops["toy.double"]["shapes_error"] is None and ops["toy.double"]["shapes"] == 2
    text = run("doctor")
    assert text.exit_code == 0 and "OK: nothing blocks selection." in text.stdout
    assert "problem: op 'plug.bad': its shapes function (register_op's shapes=) failed" in " ".join(text.stdout.split())


def _zeros_when_small(shape: dict, device: str) -> tuple:
    """toy_kernels.inputs, but zeros below 1024 elements, where wrong_but_fast's x equals 2x: wrong_but_fast is
    wrong only at the toy op's representative shapes, not at small recorded ones."""
    import torch

    n = shape["n"]
    return (torch.zeros(n, device=device) if n < 1024 else torch.randn(n, device=device),)


@pytest.mark.parametrize("how", ["--shapes", "--from-record"])
def test_tune_on_given_shapes_still_rejects_a_kernel_wrong_at_a_representative_shape(reg, tmp_path, how):
    # A kernel a plain tune rejected (wrong at n=65536) won a --from-record tune on n=16 and 32, whose table then
    # replaced the stored one: get_kernel ran its wrong output on every bucket the record left out.
    import torch
    import toy_kernels

    import autosel

    reg.register(KernelSpec("toy.double", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.double", B.AOT, "toy_kernels:wrong_but_fast"))  # faster than torch (FakeTimer)
    reg.define(OpDefinition("toy.double", shapes=toy_kernels.SHAPES, make_inputs=_zeros_when_small,
                            bucket=toy_kernels.bucket))
    plain = run("tune", "--json")
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["outcomes"][0]["winner"] == "torch"
    result = run("tune", *_shapes_source(tmp_path, how, {"toy.double": [{"n": 16}, {"n": 32}]}), "--json")
    assert result.exit_code == 0, result.output
    [outcome] = json.loads(result.stdout)["outcomes"]
    assert (outcome["status"], outcome["winner"]) == ("tuned", "torch")
    assert [b["winner"] for b in outcome["buckets"]] == ["torch", "torch"]
    [rejected] = outcome["rejected"]
    assert rejected["backend"] == "aot" and rejected["reason"].endswith(f"at n={toy_kernels.SIZE}")
    assert [s["shape"] for s in outcome["decision"]["candidates"][0]["shapes"]] == [{"n": 16}, {"n": 32}]
    x = torch.randn(toy_kernels.SIZE)
    assert torch.equal(autosel.get_kernel("toy.double")(x), x * 2)  # an unrecorded bucket: the op-level winner


def _raises_for_the_platform(platform) -> list:
    raise RuntimeError("no shapes for this platform (simulated)")


def _a_torch_dtype_in_a_shape(platform) -> list:
    import torch

    return [{"n": 8, "dtype": torch.bfloat16}]


@pytest.mark.parametrize("shapes, error", [
    (_raises_for_the_platform, "RuntimeError: no shapes for this platform (simulated)"),
    (_a_torch_dtype_in_a_shape,
     "TypeError: shape 0 of op 'toy.badshapes' holds dtype=torch.bfloat16, which cannot be stored as JSON"),
], ids=["raises", "dtype in a shape"])
def test_tune_goes_on_past_an_op_whose_shapes_function_fails_and_lists_it_failed(reg, shapes, error):
    # A plug-in's shapes= function that raised, or returned a torch.dtype, ended `autosel tune` of every op with a
    # traceback.
    import toy_kernels

    reg.register(KernelSpec("toy.badshapes", B.TORCH, "toy_kernels:slow"))
    reg.register(KernelSpec("toy.badshapes", B.TRITON, "toy_kernels:fast"))
    reg.define(OpDefinition("toy.badshapes", shapes=shapes, make_inputs=toy_kernels.inputs))
    toy(reg, B.TORCH, B.TRITON)  # registered after it: still tuned
    detail = f"op 'toy.badshapes': its shapes function (register_op's shapes=) failed: {error}"
    result = run("tune", "--json")
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    status = {o["op"]: (o["status"], o["detail"]) for o in json.loads(result.stdout)["outcomes"]}
    assert status["toy.double"] == ("tuned", "")
    assert status["toy.badshapes"][0] == "failed" and status["toy.badshapes"][1].startswith(detail)
    assert status["toy.badshapes"][1].endswith("Fix that function: it takes the platform and returns the "
                                               "representative shapes every candidate is checked on, as a list of "
                                               "dicts")
    table = run("tune", "--op", "toy.badshapes")
    assert table.exit_code == 1
    [line] = table.stderr.splitlines()
    assert line.startswith(f"Error: 1 of 1 op/mode pairs could not be tuned: toy.badshapes (eager): {detail}")


@pytest.mark.parametrize("suffix", [".db", ".jsonl"])
def test_merge_force_of_nothing_but_conflicts_leaves_an_existing_out_as_it_was(reg, tmp_path, suffix):
    # With --force over an existing --out, a merge whose every table conflicted replaced that file with an empty one.
    store(decision(op="toy.other"))
    out = tmp_path / f"fleet{suffix}"
    assert run("export", "--out", out).exit_code == 0
    before = out.read_bytes()
    p, q = tmp_path / "p.jsonl", tmp_path / "q.jsonl"
    p.write_text(decision().to_json() + "\n")
    q.write_text(decision(winner="torch", created_at="2026-02-01T00:00:00+00:00").to_json() + "\n")
    result = run("merge", p, q, "--out", out, "--force")
    assert result.exit_code == 1
    assert result.stdout.startswith(f"Merged 2 input(s): no decision besides the conflicts below, so {out} was not "
                                    "written.\n")
    assert result.stderr == (f"Error: 1 conflicting decision(s) were left out, so {out} was not written; pass --prefer "
                             "newest or --prefer first to keep one of each, or re-tune those ops\n")
    assert out.read_bytes() == before and sorted(f.name for f in tmp_path.iterdir() if "user.db" not in f.name) == \
        sorted([out.name, "p.jsonl", "q.jsonl"])
    assert json.loads(run("merge", p, q, "--out", out, "--force", "--json").stdout)["written"] is False
    assert out.read_bytes() == before


def test_merge_of_nothing_but_bucket_rows_without_their_op_level_row_writes_no_file(reg, tmp_path):
    # It wrote an empty --out (and with --force emptied an existing one) and said "0 decision(s)", exit 0.
    orphans = tmp_path / "orphans.jsonl"
    orphans.write_text("".join(d.to_json() + "\n" for d in tune_table("torch", {"[4]": "torch"},
                                                                         "2026-01-01T00:00:00+00:00")[1:]))
    out = tmp_path / "m.jsonl"
    result = run("merge", orphans, "--out", out)
    assert result.exit_code == 1 and not out.exists()
    assert result.stderr.endswith(f"Error: the decisions in {orphans} are bucket rows without their op-level row, "
                                  f"which selection never reads, so {out} was not written; re-tune those ops\n")
    out.write_text("keep me")
    assert run("merge", orphans, "--out", out, "--force").exit_code == 1 and out.read_text() == "keep me"


@pytest.mark.parametrize("command", ["export", "merge"])
@pytest.mark.parametrize("suffix", [".db", ".jsonl"])
def test_force_over_a_symlinked_out_writes_its_target_and_keeps_the_link(reg, tmp_path, command, suffix):
    # The temporary file went beside the link and replaced it: current.db became a regular file, rel/v3.db unchanged.
    from autosel.db.tools import read_decisions

    store(decision(op="toy.other"))
    source = tmp_path / "in.jsonl"
    assert run("export", "--out", source).exit_code == 0
    (tmp_path / "rel").mkdir()
    target, link = tmp_path / "rel" / f"v3{suffix}", tmp_path / f"current{suffix}"
    target.write_text("old")
    link.symlink_to(Path("rel") / target.name)  # relative, as `ln -s rel/v3.db current.db` makes it
    result = run(*(["export"] if command == "export" else ["merge", source]), "--out", link, "--force")
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and os.readlink(link) == str(Path("rel") / target.name)
    assert [d.op for d in read_decisions(target)] == ["toy.other"]
    assert sorted(p.name for p in tmp_path.iterdir() if "user.db" not in p.name) == sorted(["in.jsonl", "rel",
                                                                                             link.name])
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary file left behind


@pytest.mark.parametrize("command", ["export", "merge"])
@pytest.mark.parametrize("via_link", [False, True])
@pytest.mark.parametrize("force", [False, True])
def test_an_out_that_is_not_a_regular_file_is_refused_and_left_as_it_is(reg, tmp_path, command, via_link, force):
    # --force replaced a FIFO or a device node at --out (even /dev/full) with a regular file.
    import stat

    store(decision())
    source = tmp_path / "in.jsonl"
    assert run("export", "--out", source).exit_code == 0
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    out = fifo
    if via_link:
        out = tmp_path / "link.jsonl"
        out.symlink_to(fifo)
    result = run(*(["export"] if command == "export" else ["merge", source]), "--out", out, *["--force"] * force)
    assert result.exit_code == 1
    shown = f"{out} (a link to {fifo})" if via_link else str(out)
    assert result.stderr == (f"Error: {shown} is a FIFO (named pipe), not a regular file, so it was left as it is; "
                             "choose another output path (a regular file, or one that does not exist yet)\n")
    assert stat.S_ISFIFO(fifo.lstat().st_mode) and out.is_symlink() == via_link
    assert sorted(p.name for p in tmp_path.iterdir() if "user.db" not in p.name) == sorted(
        ["in.jsonl", "pipe.jsonl"] + ["link.jsonl"] * via_link)


DB_COMMANDS = [name for name in COMMANDS if any(p.name == "db" for p in cli.main.commands[name].params)]


@pytest.mark.parametrize("value", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("command", DB_COMMANDS)
def test_an_empty_db_option_is_a_usage_error_not_the_default_user_db(reg, tmp_path, command, value):
    # `autosel prune --db "$BUILD_DB"` with BUILD_DB unset pruned the default user DB; tune and export used it too.
    toy(reg, B.TORCH, B.TRITON)
    result = run(command, "--db", value, *(["--require", "toy.double"] if command == "check" else []))
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines()[-1] == (f"Error: Invalid value for '--db': {value!r} names no file; give a DB "
                                              "file path, or leave --db out to use the default user DB")
    assert not (tmp_path / "user.db").exists()


def test_doctor_on_a_db_under_a_regular_file_says_it_cannot_be_created(reg, tmp_path, monkeypatch):
    # doctor said "does not exist yet (the first tune creates it)", writable, while tune failed to create the folder.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notadb.txt").write_text("not a DB\n")
    result = run("doctor", "--json", "--db", "notadb.txt/sub.db")
    assert result.exit_code == 0, result.output
    [user] = [layer for layer in json.loads(result.stdout)["layers"] if layer["kind"] == "user"]
    assert (user["writable"], user["problem"]) == (False, "cannot be created: notadb.txt is not a folder")


def test_a_make_inputs_error_of_several_lines_is_one_error_line(reg, tmp_path):
    # torch's multi-line overload list of randn("x") was embedded whole, splitting "Error: ..." over many lines.
    toy(reg, B.TORCH, B.TRITON)
    shapes = tmp_path / "shapes.json"
    shapes.write_text(json.dumps({"toy.double": [{"n": "x"}]}))
    result = run("tune", "--shapes", shapes)
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith("Error: 1 of 1 op/mode pairs could not be tuned: toy.double (eager): op 'toy.double': its "
                           "make_inputs raised TypeError: randn() received an invalid combination of arguments")
    assert "for the shape n=x: fix the shape or the op's make_inputs." in line
