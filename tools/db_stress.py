"""Stress the tuning DB: many writers at once, writers killed with SIGKILL mid-write and while they create the
DB, and a tuning-lease holder that hangs.

    python tools/db_stress.py --procs 16 --writes 200 --kills 50 --create-kills 100 --hang-waiters 8 \
        [--db PATH] [--json] [--write-doc docs/RELIABILITY.md]

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
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
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


def spawn(db: Path, tag: str, writes: int, log: Path | None = None, lease: bool = False,
          role: str = "writer", budget_s: float = 0.0) -> subprocess.Popen:
    cmd = [sys.executable, "-W", "error::RuntimeWarning", __file__, "--worker", tag, "--db", str(db),
           "--writes", str(writes), "--role", role, "--hang-budget-s", str(budget_s)]
    cmd += (["--log", str(log)] if log else []) + (["--lease"] if lease else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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
from autosel import db_tools
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


def table(results: list[dict]) -> str:
    head = ["phase", "processes", "writes", "kills", "rows", "lost", "errors", "integrity", "wall_s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in results]
    return "\n".join(lines)


def write_doc(path: Path, command: str, results: list[dict]) -> None:
    kill = next((r for r in results if r["phase"] == "kill -9 mid-write"), None)
    takeover = f"{kill['max_lease_takeover_s']:.3f} s" if kill else "not measured"
    create = next((r for r in results if r["phase"] == "kill -9 during creation"), None)
    early = f"{create['killed_before_first_commit']} of {create['kills']}" if create else "not measured"
    hung = next((r for r in results if r["phase"] == "hung lease holder"), None)
    hung_text = (f"with a budget of {hung['budget_s']:g} s (a bound of {2 * hung['budget_s']:g} s), one waiter took "
                 f"the lease over after {hung['takeover_s']:.2f} s,\n  the other {hung['followed']} used its "
                 f"decision, and the longest wait was {hung['max_wait_s']:.2f} s" if hung and hung["takeover_s"] is not None
                 else "not measured")
    text = f"""# Reliability of the tuning DB

Figures from one run of the stress tool on this machine ({os.cpu_count()} CPU cores, {platform.system()}
{platform.release()}, Python {platform.python_version()}, SQLite {sqlite3.sqlite_version}), {time.strftime("%Y-%m-%d")}:

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
  holds; the longest wait for that takeover (dead pid on the same host) was {takeover}.
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

`synchronous=NORMAL` in WAL mode keeps every committed transaction across a process crash; only a power loss
or OS crash can drop the last transactions (never corrupt the file). Tests: `tests/test_db.py` runs the
16 x 200 case, the lease cases and a small run of every phase of this tool on every `pytest` run;
`tests/test_fuzz.py` feeds random values (hypothesis) to the public API (KernelSpec, CapabilityRequirement,
register_kernel, register_op, select_kernel, TuningDB.open with any file name) and the `AUTOSEL_*` variables,
and accepts only the documented exception types: TypeError or ValueError for a bad value (ConfigError for a
variable), KeyError for an unknown op or backend, a warning where a DB path cannot be used.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=16, help="concurrent writer processes (phase 1)")
    parser.add_argument("--writes", type=int, default=200, help="decisions per writer (phase 1)")
    parser.add_argument("--kills", type=int, default=50, help="writers killed mid-write (phase 2)")
    parser.add_argument("--create-kills", type=int, default=0, help="DBs created by two writers, one killed (phase 3)")
    parser.add_argument("--hang-waiters", type=int, default=0, help="waiters for a hung lease holder (phase 4)")
    parser.add_argument("--hang-budget-s", type=float, default=1.0, help="the waiters' tuning budget (phase 4)")
    parser.add_argument("--db", type=Path, help="DB file to use (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the kill moments")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--write-doc", type=Path, help="write the figures as Markdown here (docs/RELIABILITY.md)")
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
        else:
            writer(args.db, args.worker, args.writes, args.log, args.lease)
        return 0
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
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(table(results))
        for r in results:
            for line in r["error_lines"]:
                print(f"  {r['phase']}: {line}")
    if args.write_doc:
        shown = [a for a in (argv if argv is not None else sys.argv[1:]) if a]
        write_doc(args.write_doc, "python tools/db_stress.py " + " ".join(shown), results)
    ok = all(r["lost"] == 0 and r["errors"] == 0 and r["integrity"] == "ok" for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
