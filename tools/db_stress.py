"""Stress the tuning DB: many writer processes at once, then writers killed with SIGKILL mid-write.

    python tools/db_stress.py --procs 16 --writes 200 --kills 50 [--db PATH] [--json] [--write-doc docs/RELIABILITY.md]

Phase 1 starts --procs processes that each record --writes decisions into one DB, and counts rows and errors.
Phase 2 starts a writer --kills times and kills it (SIGKILL) at a random moment while it writes; the writer
appends each key to a side log (fsync) only after record() has returned, so every logged key was committed.
Each writer first takes the tuning lease its killed predecessor still holds, so the dead-pid takeover is
exercised and timed too. At the end: PRAGMA integrity_check, and every logged key must be in the DB.
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

from autosel.db import TuningDB  # noqa: E402
from autosel.decisions import CandidateResult, Decision, Measurement, ShapeResult  # noqa: E402

LEASE = ("stress-platform", "stress.lease", "eager")


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
    if lease:  # held until killed: the next writer finds a dead holder
        db.lease(*LEASE, ttl_s=3600, wait_s=60).__enter__()
    print(f"ready {time.monotonic() - start:.3f}", flush=True)
    for i in range(writes):
        op = f"stress.{tag}.{i}"
        db.record(stress_decision(op))
        if fd is not None:
            os.write(fd, f"{op}\n".encode())
            os.fsync(fd)
    db.close()


def spawn(db: Path, tag: str, writes: int, log: Path | None = None, lease: bool = False) -> subprocess.Popen:
    cmd = [sys.executable, "-W", "error::RuntimeWarning", __file__, "--worker", tag, "--db", str(db),
           "--writes", str(writes)] + (["--log", str(log)] if log else []) + (["--lease"] if lease else [])
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


def table(results: list[dict]) -> str:
    head = ["phase", "processes", "writes", "kills", "rows", "lost", "errors", "integrity", "wall_s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(r[h]) for h in head) + " |" for r in results]
    return "\n".join(lines)


def write_doc(path: Path, command: str, results: list[dict]) -> None:
    kill = next((r for r in results if r["kills"]), None)
    takeover = f"{kill['max_lease_takeover_s']:.3f} s" if kill else "not measured"
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

`synchronous=NORMAL` in WAL mode keeps every committed transaction across a process crash; only a power loss
or OS crash can drop the last transactions (never corrupt the file). Tests: `tests/test_db.py` runs the
16 x 200 case and the lease cases on every `pytest` run.
"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=16, help="concurrent writer processes (phase 1)")
    parser.add_argument("--writes", type=int, default=200, help="decisions per writer (phase 1)")
    parser.add_argument("--kills", type=int, default=50, help="writers killed mid-write (phase 2)")
    parser.add_argument("--db", type=Path, help="DB file to use (default: a new temporary one)")
    parser.add_argument("--seed", type=int, default=0, help="seed for the kill moments")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--write-doc", type=Path, help="write the figures as Markdown here (docs/RELIABILITY.md)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--log", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--lease", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        writer(args.db, args.worker, args.writes, args.log, args.lease)
        return 0
    folder = Path(tempfile.mkdtemp(prefix="autosel-stress-"))
    db = args.db or folder / "stress.db"
    results = []
    if args.procs:
        results.append(phase_writers(db, args.procs, args.writes))
    if args.kills:
        results.append(phase_kills(db, args.kills, folder / "committed.log", args.seed))
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
