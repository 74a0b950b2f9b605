"""Stress the tuning DB: many writers at once, writers killed with SIGKILL mid-write and while they create the
DB, a tuning-lease holder that hangs, many processes selecting the same ops, a FIFO where a file is read, and a
tune stopped by SIGTERM or SIGHUP.

    python tools/db_stress.py --procs 16 --writes 200 --kills 50 --create-kills 100 --hang-waiters 8 \\
        --select-procs 16 --select-ops 200 --special-files --signals 4 [--db PATH] [--json] \\
        [--out results --write-doc docs/RELIABILITY.md]

Phase 1 starts --procs processes that each record --writes decisions into one DB, and counts rows and errors.
Phase 2 starts a writer --kills times and kills it (SIGKILL) at a random moment while it writes; the writer
appends each key to a side log (fsync) only after record() has returned, so every logged key was committed.
Each writer first takes the tuning lease its killed predecessor still holds, so the dead-pid takeover is
exercised and timed too. At the end: PRAGMA integrity_check, and every logged key must be in the DB.
Phase 3 (--create-kills): for each trial a new DB path, two writers create it at once and one is killed at a
random moment of the first 12 ms after its imports (the creation: the file, the WAL switch, the schema, the
mark); then the file must open in a fresh process with no warning (nothing moved aside, nothing left
read-only), be autosel's and pass integrity_check, and every logged key must be in it.
Phase 4 (--hang-waiters): a process takes a tuning lease and stops (SIGSTOP: alive, never finishing); that many
waiters then ask for the same lease with a budget of --hang-budget-s. Each must log once whom it waits for,
one must take the lease over within lease_seconds(budget) and record, and the others must then follow it
(waiting for the new holder, not taking over again). The workers set LEASE_CHECKS_S to 0 so the wait is
the budget's part alone (2 x budget) and the phase takes seconds.
Phase 5 (--select-procs, --select-ops): that many processes start together, each registers the same toy ops
through the public API (register_kernel, register_op) and calls select_kernel on every op in its own shuffled
order. Each op has two backends, and the workers' timer makes a random one of them faster in each tune, so two
tunes of one op pick different winners half the time. Counted: tunes (one per op is right), ops where the
processes got different backends, and ops where a process runs another backend than the DB stores.
--select-pause-ms makes each worker sleep between its miss and asking for the lease, as a process descheduled on
a busy machine does: the window in which a holder records and releases before the next one takes the lease.
Phase 6 (--special-files): a FIFO as each path autosel reads, each case in a process of its own that must return and
say so. Phase 7 (--signals N): `autosel tune --isolate` stopped N times by SIGTERM or SIGHUP; no isolation child may
be left running, no lease left, and the exit code must be 128 + the signal.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import random
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import autosel.db  # noqa: E402
from autosel.db import TuningDB  # noqa: E402
from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult  # noqa: E402

LEASE = ("stress-platform", "stress.lease", "eager")
SELECTED = "stress.sel"  # phase 5's ops are stress.sel.0, stress.sel.1, ...
HUNG_LEASE = ("stress-platform", "stress.hung", "eager")
WAITING = "waiting for the tuning lease"


def stress_decision(op: str) -> Decision:
    timing = Measurement(median_us=12.5, p20_us=12.0, p80_us=13.1, samples=40, method="cpu")
    return Decision(
        op=op, mode="eager", bucket="*", winner="triton", platform_key="stress-platform",
        versions={"torch": "2.4.0", "triton": "3.0.0"}, margin=0.05, runner_up="torch", lead_over_runner_up=0.2,
        candidates=(CandidateResult("triton", "ok", score=1.0, shapes=(ShapeResult({"tokens": 64}, 0.0, 0.0, timing),)),
                    CandidateResult("torch", "ok", score=1.2)),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%S"), autosel_version="stress",
    )


def writer(db_path: Path, tag: str, writes: int, log: Path | None, lease: bool) -> None:
    """A worker process: record `writes` decisions, logging each committed key (fsync) when log is given."""
    db = TuningDB.open(db_path, include_package=False)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND) if log else None
    start = time.monotonic()
    held = db.lease(*LEASE, ttl_s=3600, wait_s=60) if lease else None
    if held is not None:  # held until killed: the next writer finds a dead holder (kept referenced: a collected
        held.__enter__()  # one is released at once, which an earlier version of this tool did)
    print(f"ready {time.monotonic() - start:.3f}", flush=True)
    for i in range(writes):
        op = f"stress.{tag}.{i}"
        db.record(stress_decision(op))
        if fd is not None:
            os.write(fd, f"{op}\n".encode())
            os.fsync(fd)
    if held is not None:
        held.__exit__(None, None, None)
    db.close()


def creator(db_path: Path, tag: str, log: Path) -> None:
    """A worker of phase 3: say it is about to create the DB, then create it and record three decisions."""
    print("go", flush=True)
    db = TuningDB.open(db_path, include_package=False)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for i in range(3):
        op = f"stress.{tag}.{i}"
        db.record(stress_decision(op))
        os.write(fd, f"{op}\n".encode())
        os.fsync(fd)
    db.close()


def hung_holder(db_path: Path) -> None:
    """A worker of phase 4: take the lease, then stop for good (alive, as a tuner stuck in a kernel is)."""
    db = TuningDB.open(db_path, include_package=False)
    held = db.lease(*HUNG_LEASE, budget_s=3600)
    held.__enter__()
    print("held", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    held.__exit__(None, None, None)  # never reached: the phase ends with SIGKILL


def hang_waiter(db_path: Path, tag: str, budget_s: float) -> None:
    """A worker of phase 4: wait for the lease; print whether it took it over and after how long."""
    autosel.db.LEASE_CHECKS_S = 0.0  # the wait is then 2 x budget_s: the phase takes seconds
    db = TuningDB.open(db_path, include_package=False)
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the takeover's RuntimeWarning is expected here
        with db.lease(*HUNG_LEASE, budget_s=budget_s, poll_s=0.05) as took:
            waited_s = time.monotonic() - start
            if took:
                time.sleep(0.5)  # the tune
                db.record(stress_decision(f"stress.hung.{tag}"))
    print(f"{'took' if took else 'followed'} {waited_s:.3f}", flush=True)


class CoinFlipTimer:
    """Stands in for two kernels of close speed on a noisy machine, in no time: each tune (a new timer) tosses a
    coin for which backend is 30% faster, so two tunes of one op choose different winners half the time."""

    method = "fake:coin-flip"

    def __init__(self, rng: random.Random) -> None:
        self.first_is_fast, self.us = rng.random() < 0.5, {}

    def measure(self, fn, *, backend: str, shape: dict) -> list[float]:
        if backend not in self.us:
            self.us[backend] = 10.0 if (not self.us) == self.first_is_fast else 13.0
        return [self.us[backend]] * 20


def toy_inputs(shape: dict, device: str) -> tuple:
    import torch

    return (torch.randn(shape["n"], device=device),)


class _ExpectedLogs(logging.Handler):
    """Counts the lease waits and drops the run-time tune's announcement (both expected in phase 5); any other
    warning goes to stderr, where the parent counts it as an error."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.waits = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if WAITING in message:
            self.waits += 1
        elif "are timed now" not in message:
            sys.stderr.write(f"{record.levelname} {record.name}: {message}\n")


def selector(tag: str, ops: int, seed: int, pause_s: float) -> None:
    """A worker of phase 5: register the toy ops through the public API, say ready, wait for go, then
    select_kernel every op in a shuffled order; print which backend each op got and which ops it tuned.
    pause_s: sleep this long before asking for a tuning lease (after the miss)."""
    import autosel
    import autosel.timing
    import autosel.tuner

    rng = random.Random(f"{seed}-{tag}")
    autosel.timing.timer_for = lambda device, mode: CoinFlipTimer(rng)  # tune_and_record reads it at each tune
    tuned: list[str] = []
    original = autosel.tuner.Tuner.tune_buckets
    autosel.tuner.Tuner.tune_buckets = lambda self, definition, *a, **k: (
        tuned.append(definition.op) or original(self, definition, *a, **k))
    if pause_s:
        lease = TuningDB.lease
        TuningDB.lease = lambda self, *a, **k: time.sleep(pause_s) or lease(self, *a, **k)
    logs = _ExpectedLogs()
    logging.getLogger("autosel").addHandler(logs)
    names = [f"{SELECTED}.{i}" for i in range(ops)]
    for op in names:  # torch.neg and torch.negative: the same kernel under two names, so the checks pass
        autosel.register_kernel(autosel.KernelSpec(op, "torch", "torch:neg"))
        autosel.register_kernel(autosel.KernelSpec(op, "triton", "torch:negative"))
        autosel.register_op(op, shapes=[{"n": 64}, {"n": 256}], make_inputs=toy_inputs)
    rng.shuffle(names)
    print("ready", flush=True)
    sys.stdin.readline()  # the parent says go once every worker is ready, so they start together
    chosen = {op: autosel.select_kernel(op).backend.value for op in names}
    print(json.dumps({"chosen": chosen, "tuned": tuned, "waits": logs.waits}), flush=True)


def spawn(db: Path, tag: str, writes: int, log: Path | None = None, lease: bool = False,
          role: str = "writer", budget_s: float = 0.0, seed: int = 0, pause_ms: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-W", "error::RuntimeWarning", __file__, "--worker", tag, "--db", str(db),
           "--writes", str(writes), "--role", role, "--hang-budget-s", str(budget_s), "--seed", str(seed),
           "--select-pause-ms", str(pause_ms)]
    cmd += (["--log", str(log)] if log else []) + (["--lease"] if lease else [])
    env = None
    if role == "select":  # selection reads the DB and the budget from the environment, as in a serving engine
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOSEL_")}
        env.update(AUTOSEL_DB=str(db), AUTOSEL_BUDGET_S="1")
    return subprocess.Popen(cmd, stdin=subprocess.PIPE if role == "select" else None, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def count_rows(db: Path) -> tuple[int, str]:
    with sqlite3.connect(db, timeout=60) as conn:
        return (conn.execute("SELECT count(*) FROM decisions").fetchone()[0],
                conn.execute("PRAGMA integrity_check").fetchone()[0])


def phase_writers(db: Path, procs: int, writes: int) -> dict:
    start = time.monotonic()
    workers = [spawn(db, f"w{n}", writes) for n in range(procs)]
    outcomes = [(w.communicate(), w.returncode) for w in workers]
    wall_s = time.monotonic() - start
    errors = [err.strip().splitlines()[-1] for (_, err), rc in outcomes if rc != 0 or err.strip()]
    rows, integrity = count_rows(db)
    return {"phase": "concurrent writers", "processes": procs, "writes": procs * writes, "kills": 0,
            "rows": rows, "lost": procs * writes - rows, "errors": len(errors), "error_lines": errors[:5],
            "integrity": integrity, "wall_s": round(wall_s, 2)}


def phase_kills(db: Path, kills: int, side: Path, seed: int) -> dict:
    rng, start, errors, lease_waits_s = random.Random(seed), time.monotonic(), [], []
    for n in range(kills):
        victim = spawn(db, f"k{n}", 10**7, log=side, lease=True)
        ready = victim.stdout.readline().split()
        if not ready or ready[0] != "ready":
            victim.kill()
            errors.append(f"writer k{n} did not start: {victim.communicate()[1].strip()[-300:]}")
            continue
        lease_waits_s.append(float(ready[1]))
        time.sleep(rng.uniform(0.0, 0.25))
        victim.send_signal(signal.SIGKILL)
        _, err = victim.communicate()
        if err.strip():
            errors.append(err.strip().splitlines()[-1])
    logged = set(side.read_text().split()) if side.exists() else set()
    with sqlite3.connect(db, timeout=60) as conn:
        present = {r[0] for r in conn.execute("SELECT op FROM decisions WHERE op GLOB 'stress.k*'")}
    _, integrity = count_rows(db)
    with warnings.catch_warnings(record=True) as caught:  # reopening must not find anything to move aside
        warnings.simplefilter("always")
        TuningDB.open(db, include_package=False).close()
    errors += [str(w.message) for w in caught]
    return {"phase": "kill -9 mid-write", "processes": kills, "writes": len(logged), "kills": kills,
            "rows": len(present), "lost": len(logged - present), "errors": len(errors), "error_lines": errors[:5],
            "integrity": integrity, "wall_s": round(time.monotonic() - start, 2),
            "max_lease_takeover_s": max(lease_waits_s, default=0.0)}


VERIFY = """
import sys, warnings, json, sqlite3
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from autosel.db import TuningDB
from autosel.db import tools as db_tools
path = Path(sys.argv[1])
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    db = TuningDB.open(path, include_package=False)
    layer = db.layers[0]
    ops = sorted(d.op for d, _ in db.decisions())
    db.close()
with sqlite3.connect(path) as conn:
    marked = conn.execute("PRAGMA application_id").fetchone()[0] == db_tools.APPLICATION_ID
    integrity = conn.execute("PRAGMA integrity_check").fetchone()[0]
print(json.dumps({"warnings": [str(w.message) for w in caught], "writable": layer.writable and layer.kind == "user",
                  "marked": marked, "integrity": integrity, "ops": ops}))
"""


def phase_create_kills(folder: Path, trials: int, seed: int) -> dict:
    rng, start, errors, logged, present, integrity = random.Random(seed), time.monotonic(), [], set(), set(), "ok"
    early = 0  # victims killed before their first commit: during imports' tail, or creating the DB
    for n in range(trials):
        db, side = folder / f"create-{n}.db", folder / f"create-{n}.log"
        victim, other = (spawn(db, f"c{n}{x}", 3, log=side, role="create") for x in "ab")
        if victim.stdout.readline().strip() != "go":
            errors.append(f"creator of trial {n} did not start: {victim.communicate()[1].strip()[-300:]}")
        time.sleep(rng.uniform(0.0, 0.012))  # creating the DB takes 4-10 ms here
        victim.send_signal(signal.SIGKILL)
        victim.communicate()
        _, err = other.communicate()
        if err.strip():
            errors.append(f"trial {n}, the writer not killed: {err.strip().splitlines()[-1]}")
        check = subprocess.run([sys.executable, "-c", VERIFY, str(db), str(REPO)], capture_output=True, text=True)
        if check.returncode:
            errors.append(f"trial {n}: reopening failed: {check.stderr.strip().splitlines()[-1]}")
            continue
        found = json.loads(check.stdout)
        errors += [f"trial {n}: {w}" for w in found["warnings"]]
        if not (found["writable"] and found["marked"]):
            errors.append(f"trial {n}: reopened as writable={found['writable']}, marked={found['marked']}")
        integrity = integrity if found["integrity"] == "ok" else found["integrity"]
        keys = set(side.read_text().split()) if side.exists() else set()
        early += not any(k.startswith(f"stress.c{n}a.") for k in keys)
        logged |= keys
        present |= keys & set(found["ops"])
        if any(p.name.startswith(f"create-{n}.db.corrupt") for p in folder.iterdir()):
            errors.append(f"trial {n}: something was moved aside")
    return {"phase": "kill -9 during creation", "processes": 2 * trials, "writes": len(logged), "kills": trials,
            "rows": len(present), "lost": len(logged - present), "errors": len(errors), "error_lines": errors[:5],
            "integrity": integrity, "wall_s": round(time.monotonic() - start, 2), "killed_before_first_commit": early}


def phase_hung_lease(db: Path, waiters: int, budget_s: float) -> dict:
    start, errors = time.monotonic(), []
    holder = spawn(db, "holder", 0, role="hold")
    if holder.stdout.readline().strip() != "held":
        holder.kill()
        raise SystemExit(f"the lease holder did not start: {holder.communicate()[1].strip()[-300:]}")
    workers = [spawn(db, f"h{n}", 0, role="wait", budget_s=budget_s) for n in range(waiters)]
    outcomes = [(w.communicate(), w.returncode) for w in workers]
    holder.send_signal(signal.SIGKILL)  # stopped processes die of SIGKILL too
    holder.communicate()
    results, waits = [], []
    for n, ((out, err), rc) in enumerate(outcomes):
        said = sum(WAITING in line for line in err.splitlines())
        if rc != 0 or said != 1 or not out.strip():
            errors.append(f"waiter h{n}: exit {rc}, said it was waiting {said} times: {err.strip()[-300:]}")
            continue
        kind, waited_s = out.split()
        results.append(kind)
        waits.append(float(waited_s))
    with sqlite3.connect(db, timeout=60) as conn:
        rows = conn.execute("SELECT count(*) FROM decisions WHERE op GLOB 'stress.hung.*'").fetchone()[0]
    _, integrity = count_rows(db)
    bound_s = 2.0 * budget_s
    if results.count("took") != 1:
        errors.append(f"{results.count('took')} waiters took the lease over, expected 1")
    if waits and max(waits) > bound_s + 5.0:
        errors.append(f"the longest wait was {max(waits):.1f} s, over the bound {bound_s:.1f} s + 5 s")
    return {"phase": "hung lease holder", "processes": waiters + 1, "writes": results.count("took"), "kills": 1,
            "rows": rows, "lost": results.count("took") - rows, "errors": len(errors), "error_lines": errors[:5],
            "integrity": integrity, "wall_s": round(time.monotonic() - start, 2),
            "takeover_s": min((w for w, k in zip(waits, results) if k == "took"), default=None),
            "max_wait_s": max(waits, default=None), "followed": results.count("followed"), "budget_s": budget_s}


def phase_select(db: Path, procs: int, ops: int, seed: int, pause_ms: float) -> dict:
    start, errors = time.monotonic(), []
    workers = [spawn(db, f"s{n}", ops, role="select", seed=seed, pause_ms=pause_ms) for n in range(procs)]
    for n, w in enumerate(workers):
        if w.stdout.readline().strip() != "ready":
            for other in workers:
                other.kill()
            raise SystemExit(f"selector s{n} did not start: {w.communicate()[1].strip()[-300:]}")
    for w in workers:  # go: all at once
        w.stdin.write("go\n")
        w.stdin.flush()
    outcomes = [(w.communicate(), w.returncode) for w in workers]
    reports = []
    for n, ((out, err), rc) in enumerate(outcomes):
        if rc != 0 or err.strip() or not out.strip():
            errors.append(f"selector s{n}: exit {rc}: {err.strip()[-300:]}")
        if out.strip():
            reports.append(json.loads(out))
    with sqlite3.connect(db, timeout=60) as conn:
        stored = dict(conn.execute("SELECT op, winner FROM decisions WHERE bucket = '*' AND op GLOB ?",
                                   (f"{SELECTED}.*",)))
    _, integrity = count_rows(db)
    tunes: dict[str, int] = {}
    for report in reports:
        for op in report["tuned"]:
            tunes[op] = tunes.get(op, 0) + 1
    got = {f"{SELECTED}.{i}": {r["chosen"][f"{SELECTED}.{i}"] for r in reports} for i in range(ops)}
    between = sorted(op for op, backends in got.items() if len(backends) > 1)
    with_db = sorted(op for op, backends in got.items() if backends != {stored.get(op)})
    again = sorted(op for op, n in tunes.items() if n > 1)
    if again:
        errors.append(f"{sum(tunes.values())} tunes for {ops} ops: {len(again)} ops tuned more than once, e.g. "
                      + ", ".join(f"{op} {tunes[op]} times" for op in again[:3]))
    if between or with_db:
        errors.append(f"{len(between)} ops where processes run different backends, {len(with_db)} where a process "
                      f"runs another backend than the DB stores, e.g. " + ", ".join(
                          f"{op}: {sorted(got[op])}, stored {stored.get(op)}" for op in (between or with_db)[:3]))
    return {"phase": "selecting the same ops", "processes": procs, "writes": sum(tunes.values()), "kills": 0,
            "rows": len(stored), "lost": ops - len(stored), "errors": len(errors), "error_lines": errors[:5],
            "integrity": integrity, "wall_s": round(time.monotonic() - start, 2), "ops": ops,
            "tunes": sum(tunes.values()), "tuned_more_than_once": len(again),
            "disagree": f"{len(between)} / {len(with_db)}", "disagree_between": len(between),
            "disagree_with_db": len(with_db), "lease_waits": sum(r["waits"] for r in reports), "pause_ms": pause_ms}


STRESS_TOY = """
import time

import torch


def reference(x):
    return x * 2


def hangs(x):
    time.sleep(3600)  # a candidate stuck in its kernel: the isolation child runs it until killed
    return x


def inputs(shape, device):
    return (torch.randn(shape["n"], device=device),)
"""

TUNE_SCRIPT = """
import sys
sys.path.insert(0, {folder!r})
from autosel import registry
from autosel.spec import KernelSpec, OpDefinition
import stress_toy
registry.register(KernelSpec("stress.hung", "torch", "stress_toy:reference"))
registry.register(KernelSpec("stress.hung", "triton", "stress_toy:hangs"))
registry.define(OpDefinition("stress.hung", shapes=[{{"n": 4096}}], make_inputs=stress_toy.inputs))
from autosel.cli import main
main(["tune", "--op", "stress.hung", "--isolate", "--isolate-timeout-s", "600"], prog_name="autosel")
"""

RECORD_SCRIPT = """
import torch
from autosel import get_kernel
get_kernel("activation.silu_and_mul", "torch")(torch.randn(4, 64))
"""


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUTOSEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(extra)
    return env


def phase_special_files(folder: Path, timeout_s: float = 60.0) -> dict:
    """Every place a path is read given a FIFO: each command or call must return within timeout_s and name it."""
    fifo, shipped = folder / "pipe.db", folder / "shipped"
    shipped.mkdir()
    os.mkfifo(fifo)
    os.mkfifo(shipped / "pipe.db")
    (folder / "toy.json").write_text("{}")
    cli = [sys.executable, "-m", "autosel"]
    user = {"AUTOSEL_DB": str(fifo)}
    cases = {
        "user DB: show": (cli + ["show"], user),
        "user DB: show --json": (cli + ["show", "--json"], user),
        "user DB: doctor": (cli + ["doctor"], user),
        "user DB: report": (cli + ["report", "--out", str(folder / "r.html")], user),
        "user DB: export": (cli + ["export", "--out", str(folder / "e.jsonl")], user),
        "user DB: prune --dry-run": (cli + ["prune", "--dry-run"], user),
        "shipped folder: show": (cli + ["show"], {"AUTOSEL_DB": str(folder / "u.db"), "AUTOSEL_DB_PATH": str(shipped)}),
        "shipped file: show": (cli + ["show"], {"AUTOSEL_DB": str(folder / "u.db"), "AUTOSEL_DB_PATH": str(fifo)}),
        "merge input": (cli + ["merge", str(fifo), "--out", str(folder / "m.jsonl")], {"AUTOSEL_DB": str(folder / "u.db")}),
        "tune --shapes": (cli + ["tune", "--shapes", str(fifo)], {"AUTOSEL_DB": str(folder / "u.db")}),
        "AUTOSEL_RECORD: a kernel call": ([sys.executable, "-c", RECORD_SCRIPT],
                                          {"AUTOSEL_DB": str(folder / "u.db"), "AUTOSEL_RECORD": str(fifo)}),
    }
    start, errors, hung = time.monotonic(), [], 0
    for name, (command, extra) in cases.items():
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=_cli_env(**extra),
                                  cwd=folder)
        except subprocess.TimeoutExpired:
            hung += 1
            errors.append(f"{name}: still waiting on the FIFO after {timeout_s:g} s (killed)")
            continue
        if "FIFO" not in done.stdout + done.stderr:
            errors.append(f"{name}: exit {done.returncode}, no word of the FIFO: {done.stderr.strip()[-200:]}")
    return {"phase": "a FIFO as each path read", "processes": len(cases), "writes": 0, "kills": 0, "rows": 0,
            "lost": 0, "errors": len(errors), "error_lines": errors[:5], "integrity": "ok", "hung": hung,
            "wall_s": round(time.monotonic() - start, 2)}


def children_of(pid: int) -> list[int]:
    """The pids whose parent is `pid`, read from /proc (Linux)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def phase_signals(folder: Path, trials: int, seed: int) -> dict:
    """`autosel tune --isolate` stopped by SIGTERM or SIGHUP (in turn) at a random moment while its isolation child
    runs a candidate that hangs: the child must be gone, the lease released, and the exit code 128 + the signal."""
    (folder / "stress_toy.py").write_text(STRESS_TOY)
    rng, start, errors, orphans, leases, codes = random.Random(seed), time.monotonic(), [], 0, 0, []
    for n in range(trials):
        signum = (signal.SIGTERM, signal.SIGHUP)[n % 2]
        db = folder / f"signal-{n}.db"
        tune = subprocess.Popen([sys.executable, "-c", TUNE_SCRIPT.format(folder=str(folder))], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=_cli_env(AUTOSEL_DB=str(db)))
        children: list[int] = []
        deadline = time.monotonic() + 120
        while not children and tune.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            children = children_of(tune.pid)
        time.sleep(rng.uniform(0.0, 3.0))  # the child starting, running the reference, or in the hanging candidate
        tune.send_signal(signum)
        try:
            _, err = tune.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            tune.kill()
            _, err = tune.communicate()
        codes.append(tune.returncode)
        time.sleep(1.0)
        left = [pid for pid in children if autosel.db._pid_alive(pid)]
        orphans += len(left)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        held = 0
        if db.exists():
            with sqlite3.connect(db, timeout=60) as conn:
                held = conn.execute("SELECT count(*) FROM leases").fetchone()[0]
        leases += held
        if tune.returncode != 128 + signum or left or held or not children:
            errors.append(f"{signal.Signals(signum).name}: exit {tune.returncode}, {len(children)} child(ren) seen, "
                          f"{len(left)} left running, {held} lease(s) left; {err.strip()[-200:]}")
    return {"phase": "SIGTERM/SIGHUP to tune --isolate", "processes": trials, "writes": 0, "kills": trials,
            "rows": 0, "lost": orphans + leases, "errors": len(errors), "error_lines": errors[:5], "integrity": "ok",
            "orphans": orphans, "leases_left": leases, "exit_codes": sorted(set(codes)),
            "wall_s": round(time.monotonic() - start, 2)}


HEAD = ["phase", "processes", "writes", "kills", "rows", "lost", "errors", "integrity", "wall_s", "tunes", "disagree"]


def table(results: list[dict]) -> str:
    lines = ["| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(str(r.get(h, "-")) for h in HEAD) + " |" for r in results]
    return "\n".join(lines)


def machine() -> dict:
    """What the figures depend on besides the code: cores, kernel, Python, SQLite, and the load they ran under."""
    return {"cpus": os.cpu_count(), "system": f"{platform.system()} {platform.release()}",
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "load_average_5min": round(os.getloadavg()[1], 1)}


def write_results(folder: Path, command: str, results: list[dict]) -> Path:
    """The run's figures as a result file (autosel.bench.results), which docs/RELIABILITY.md and the benchmarks
    page cite."""
    from autosel.bench.results import write_result

    facts = machine()
    return write_result("reliability", {
        "machine": facts, "phases": results,
        "tables": [{"title": "", "columns": HEAD, "rows": [[r.get(h, "-") for h in HEAD] for r in results]}],
        "notes": [f"{facts['cpus']} CPU cores, {facts['system']}, Python {facts['python']}, SQLite {facts['sqlite']}; "
                  f"load average {facts['load_average_5min']:g} over the last 5 minutes (other processes share the "
                  "cores: wall times and the writes a killed writer made before its kill shrink as that grows)."]},
        folder=folder, command=command)


def write_doc(path: Path, command: str, results: list[dict], result_file: str, record: dict) -> None:
    """docs/RELIABILITY.md from one run: `record` is the run's result file as read back, `result_file` its path from
    the repository root, which the page cites."""
    facts, date = record["results"]["machine"], record["date"][:10]
    kill = next((r for r in results if r["phase"] == "kill -9 mid-write"), None)
    takeover = f"{kill['max_lease_takeover_s']:.3f} s" if kill else "not measured"
    create = next((r for r in results if r["phase"] == "kill -9 during creation"), None)
    early = f"{create['killed_before_first_commit']} of {create['kills']}" if create else "not measured"
    hung = next((r for r in results if r["phase"] == "hung lease holder"), None)
    hung_text = (f"with a budget of {hung['budget_s']:g} s (a bound of {2 * hung['budget_s']:g} s), one waiter took "
                 f"the lease over after {hung['takeover_s']:.2f} s,\n  the other {hung['followed']} used its "
                 f"decision, and the longest wait was {hung['max_wait_s']:.2f} s" if hung and hung["takeover_s"] is not None
                 else "not measured")
    select = next((r for r in results if r["phase"] == "selecting the same ops"), None)
    select_text = (f"with {select['processes']} processes, {select['ops']} ops and a pause of {select['pause_ms']:g} ms "
                   f"there were {select['tunes']} tunes and\n  {select['disagree']} disagreeing ops; "
                   f"{select['lease_waits']} lease waits (a process found another tuning the op, waited, and used its "
                   "decision)" if select else "not measured")
    special = next((r for r in results if r["phase"] == "a FIFO as each path read"), None)
    special_text = (f"{special['processes']} cases, {special['hung']} still waiting after 60 s, {special['errors']} "
                    "that did not say what the path is" if special else "not measured")
    signals = next((r for r in results if r["phase"] == "SIGTERM/SIGHUP to tune --isolate"), None)
    signals_text = (f"{signals['processes']} runs, {signals['orphans']} isolation children left running, "
                    f"{signals['leases_left']} leases left, exit codes {', '.join(map(str, signals['exit_codes']))}"
                    if signals else "not measured")
    text = f"""# Reliability of the tuning DB

For: operators who share one tuning DB between processes, and anyone judging what happens to it when a process
is killed or a file is not autosel's.

Figures from one run of the stress tool on this machine ({facts["cpus"]} CPU cores, {facts["system"]}, Python
{facts["python"]}, SQLite {facts["sqlite"]}), {date}, with a load average of
{facts["load_average_5min"]:.0f} over the last 5 minutes (other processes share the cores: wall times and the writes a
killed writer made before its kill shrink as that grows); the result file, with the commit and the raw figures:
[{result_file}](../{result_file}).

{table(results)}

Reproduce with:

    {command}

What the rows mean:

- **concurrent writers**: that many processes start together and each records its decisions into one user DB
  (WAL journal, 60 s busy timeout, one short `BEGIN IMMEDIATE` transaction per decision). `rows` is the count
  in the DB afterwards, `lost` = writes - rows; `errors` counts processes that exited non-zero or wrote
  anything to stderr (RuntimeWarnings are turned into errors in the workers).
- **kill -9 mid-write**: a writer is started, and killed with SIGKILL at a random moment (0-250 ms) while it
  writes, again and again. Each writer appends a decision's key to a side log (with fsync) only after
  `record()` returned, so `writes` is the number of decisions known to be committed; `lost` counts logged keys
  missing from the DB (`rows` can exceed `writes`: a writer killed after its commit but before logging the
  key). `integrity` is `PRAGMA integrity_check` at the end, and reopening the DB must raise no
  warning (nothing moved aside). Each writer first takes a tuning lease that its killed predecessor still
  holds; the longest wait for that takeover (dead pid on the same host) was {takeover} ({result_file}).
- **kill -9 during creation**: for each of `kills` new DB paths, two writers start together and one of them is
  killed at a random moment of the first 12 ms after its imports, while it creates the file (the file, the
  switch to WAL, the schema and the autosel mark take 4-10 ms here); {early} were killed before their first
  commit. Afterwards a fresh process must open the file with no warning (nothing moved aside, not left
  read-only), find it marked as autosel's and intact, and every key a writer logged as committed must be in
  it. This phase found two faults, fixed since: the hot journal of a killed creator could not be rolled back
  by the read-only inspection (the DB then stayed read-only, decisions in memory, in every later process), and
  `PRAGMA journal_mode = WAL` gave up at once with "database is locked" next to another creator.
- **hung lease holder**: a process takes a tuning lease and stops (SIGSTOP: alive, never finishing, as a tuner
  stuck in a kernel). `processes - 1` waiters then ask for the same lease; each must log once whom it waits for
  (pid, host, since when) and how to stop waiting; one must take the lease over within 2 x budget (the
  workers set `LEASE_CHECKS_S`, the allowance for a tune's checks, to 0, so the phase takes seconds) and
  record a decision (`writes`, `rows`), and the others must wait for that new holder and use its decision
  instead of taking over again.
  Here {hung_text}.
  In real use a lease lasts, and a waiter waits at most, `db.lease_seconds(budget)` = 60 s + 2 x budget:
  120 s at run time (`AUTOSEL_BUDGET_S` 30 s), 300 s for `autosel tune` (`--budget-s` 120 s), instead of a
  fixed 600 s.
- **selecting the same ops**: `processes` processes start together (each, once it has imported and registered,
  waits for one "go") and register the same toy ops through the public API (`register_kernel`, `register_op`:
  two backends, `torch.neg` as torch and `torch.negative` as triton, two shapes, `AUTOSEL_BUDGET_S=1`), then
  call `select_kernel` on every op in their own shuffled order. The workers' timer (`timing.timer_for` replaced
  by a fake one) makes a random one of the two backends 30% faster in each tune: a tune takes milliseconds, and
  a second tune of an op picks the other winner half the time, so a duplicate tune tends to show as a
  disagreement. `writes` and `tunes` count the tunes (each records one decision; counted by wrapping
  `Tuner.tune_buckets` in the workers): one per op is right. `rows` counts the stored op-level decisions and
  `lost` the ops without one. `disagree` is "ops where the processes got different backends / ops where a
  process got another backend than the stored row"; both must be 0. `--select-pause-ms` makes each worker sleep
  between its miss and asking for the lease, as a process descheduled on a busy machine does.
  Here {select_text}.
  This phase checks the fix of issue 17: a process that took a free lease tuned without looking the decision
  up again, so an op recorded between its miss and its lease was tuned again and processes ran different
  backends (the issue's report: 229 tunes for 200 ops, 7-9 such ops). With that lookup taken out, 16 x 200
  gave 202 and 203 tunes and 1 or 2 disagreeing ops here, 237 tunes and 18 with a 50 ms pause, and 4 x 20
  with a 50 ms pause 25-31 tunes; the fixed code gives one tune per op and no disagreement in each case.
- **a FIFO as each path read** (`--special-files`): a FIFO (named pipe) is given, one command or call at a time
  in a process of its own, as the user DB (`show`, `show --json`, `doctor`, `report`, `export`,
  `prune --dry-run`), as a `*.db` in a shipped-DB folder and as a shipped file named directly (`show`), as a
  `merge` input, as `tune --shapes`, and as `AUTOSEL_RECORD` (a kernel call). Each must return within 60 s and
  say that the path is a FIFO; `errors` counts the cases that did not, `processes` the cases. Opening a FIFO
  waits for a writer that never comes: before `autosel.files` refused every path that is not a regular file
  without opening it, 10 of these 11 cases never returned, and the eleventh (a shipped file named directly) was
  skipped as a path that "does not exist" (at 6fb488f, each case given 10 s).
  Here: {special_text}.
- **SIGTERM/SIGHUP to tune --isolate** (`--signals N`): N runs of `autosel tune --isolate` on a toy op whose
  second candidate sleeps for an hour, each stopped by SIGTERM and SIGHUP in turn at a random moment of the
  3 s after its isolation child started (starting, running the reference, or in the hanging candidate).
  Afterwards the child must be gone, the DB must hold no tuning lease, and the exit code must be 128 + the
  signal's number (143, 129); `lost` counts children left running plus leases left, `errors` the runs that
  failed any of the three. Before `parallel.termination_raises`, the default action of both signals ended the
  process at once: each run left its child running the candidate, reparented to init, and its lease until it
  expired, and the exit status was the signal's (-15, -1 to Python; 2 runs of 2 at 6fb488f).
  Here: {signals_text}.

`synchronous=NORMAL` in WAL mode keeps every committed transaction across a process crash; only a power loss
or OS crash can drop the last transactions (never corrupt the file). Tests: `tests/test_db.py` runs the
16 x 200 case, the lease cases and a small run of every phase of this tool on every `pytest` run, and
`tests/test_selector.py` runs the last phase with 4 processes, 20 ops and a 50 ms pause (one tune per op, no
disagreement; it fails without the holder's second lookup);
`tests/test_fuzz.py` feeds random values (hypothesis) to the public API (KernelSpec, CapabilityRequirement,
register_kernel, register_op, select_kernel, TuningDB.open with any file name) and the `AUTOSEL_*` variables,
and accepts only the documented exception types: TypeError or ValueError for a bad value (ConfigError for a
variable), KeyError for an unknown op or backend, a warning where a DB path cannot be used.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", type=int, default=16, help="concurrent writer processes (phase 1)")
    parser.add_argument("--writes", type=int, default=200, help="decisions per writer (phase 1)")
    parser.add_argument("--kills", type=int, default=50, help="writers killed mid-write (phase 2)")
    parser.add_argument("--create-kills", type=int, default=0, help="DBs created by two writers, one killed (phase 3)")
    parser.add_argument("--hang-waiters", type=int, default=0, help="waiters for a hung lease holder (phase 4)")
    parser.add_argument("--hang-budget-s", type=float, default=1.0, help="the waiters' tuning budget (phase 4)")
    parser.add_argument("--select-procs", type=int, default=16, help="processes selecting the same ops (phase 5)")
    parser.add_argument("--select-ops", type=int, default=200, help="toy ops each of them selects (phase 5)")
    parser.add_argument("--select-pause-ms", type=float, default=0.0,
                        help="each selector's sleep between a miss and asking for the lease, as on a busy machine")
    parser.add_argument("--special-files", action="store_true",
                        help="give a FIFO as each path autosel reads (user DB, shipped DBs, AUTOSEL_RECORD, inputs)")
    parser.add_argument("--signals", type=int, default=0,
                        help="`autosel tune --isolate` runs stopped by SIGTERM or SIGHUP (in turn)")
    parser.add_argument("--db", type=Path, help="DB file to use (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the kill moments and the selection orders")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--out", type=Path, help="write the figures as a result file into this folder (results)")
    parser.add_argument("--write-doc", type=Path,
                        help="write the figures as Markdown here (docs/RELIABILITY.md), citing the --out result file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lease", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--role", default="writer", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if args.role == "create":
            creator(args.db, args.worker, args.log)
        elif args.role == "hold":
            hung_holder(args.db)
        elif args.role == "wait":
            hang_waiter(args.db, args.worker, args.hang_budget_s)
        elif args.role == "select":
            selector(args.worker, args.writes, args.seed, args.select_pause_ms / 1000)
        else:
            writer(args.db, args.worker, args.writes, args.log, args.lease)
        return 0
    if args.write_doc and not args.out:  # the page cites the result file that holds its figures
        parser.error("--write-doc needs --out FOLDER: the page cites the result file written there")
    if args.db is not None and args.db.is_dir():  # else every writer, then count_rows, fails to open it
        parser.error(f"--db {args.db} is a folder; give a file path in it, such as {args.db / 'stress.db'}")
    folder = Path(tempfile.mkdtemp(prefix="autosel-stress-"))
    db = args.db or folder / "stress.db"
    results = []
    if args.procs:
        results.append(phase_writers(db, args.procs, args.writes))
    if args.kills:
        results.append(phase_kills(db, args.kills, folder / "committed.log", args.seed))
    if args.create_kills:
        results.append(phase_create_kills(folder, args.create_kills, args.seed))
    if args.hang_waiters:
        results.append(phase_hung_lease(folder / "hung.db", args.hang_waiters, args.hang_budget_s))
    if args.select_procs and args.select_ops:
        results.append(phase_select(folder / "select.db", args.select_procs, args.select_ops, args.seed,
                                    args.select_pause_ms))
    if args.special_files:
        results.append(phase_special_files(folder))
    if args.signals:
        results.append(phase_signals(folder, args.signals, args.seed))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(table(results))
        for r in results:
            for line in r["error_lines"]:
                print(f"  {r['phase']}: {line}")
    if args.out:
        shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
        command = "python tools/db_stress.py " + " ".join(shown)
        written = write_results(args.out, command, results)
        print(f"wrote {written}")
        if args.write_doc:
            record = json.loads(written.read_text(encoding="utf-8"))
            cited = os.path.relpath(written.resolve(), REPO)  # as the page's link names it, from the repository root
            write_doc(args.write_doc, command, results, cited, record)
    ok = all(r["lost"] == 0 and r["errors"] == 0 and r["integrity"] == "ok" for r in results)
    if ok:  # the DBs and logs of a clean run tell nothing more; a failed run's are kept to look into
        shutil.rmtree(folder, ignore_errors=True)
    else:
        print(f"the phases' DBs and logs are kept in {folder}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
