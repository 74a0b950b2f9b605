"""Checks that every rank runs rank 0's decisions (issue 15 item 2), under torchrun, in three scenarios.

    torchrun --nproc-per-node 2 tools/ranks_check.py --out DIR [--budget-s 2] [--op 'layernorm.*' ...]

Backend nccl when CUDA is available (each rank on the GPU of its LOCAL_RANK), else gloo. Every contested op
(or those matching --op) is selected in eager and graph mode (mode="graph"; without CUDA both are eager) with
select_kernel and get_kernel on every rank, AUTOSEL_CHECK_RANKS=1, in three scenarios:

  fresh   a new, empty user DB per rank: rank 0 tunes, the others tune nothing and run rank 0's table
  differs rank 0 keeps its DB from `fresh`; each other rank's new DB holds the opposite of rank 0's table
          (op level and every bucket), so each must still run rank 0's and log the difference
  off     AUTOSEL_TUNE=off and new, empty DBs: the same error on every rank

The DBs shipped in the package are left out (they would answer instead of a tune). Each rank writes
DIR/rank<N>.json (what it runs: op, mode, op-level winner, bucket winners, kernel, error; the divergence warnings
it logged) and DIR/rank<N>-divergence.log; rank 0 gathers them, prints one table, writes it as a result file
(autosel.bench.results) into DIR, and exits 1 on any
disagreement, or when a rank other than 0 that should have logged a difference (all of `fresh`: nothing stored
there; all of `differs`) did not.
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import json
import logging
import os
import shlex
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from autosel import db, platforms, selector, tuning
from autosel.bench.results import write_result
from autosel.decisions import Decision, bucket_text
from autosel.platforms import version_vector

SCENARIOS = ("fresh", "differs", "off")
MODES = ("eager", "graph")
DIFFERS = "on its own would differ"  # in autosel.distributed's AUTOSEL_CHECK_RANKS warning


class Divergence(logging.Handler):
    """Keeps the AUTOSEL_CHECK_RANKS warnings of autosel.distributed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def kernel_name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def run_op(op: str, mode: str, platform) -> dict:
    """What this rank runs for (op, mode): the op-level winner, each tuned bucket's, the callable; or the error."""
    row = {"op": op, "mode": mode, "ran_mode": selector.resolve_mode(mode, platform)}
    try:
        row["winner"] = selector.select_kernel(op, mode=mode).backend.value
        fn = selector.get_kernel(op, mode=mode)
    except Exception as exc:  # an error is an outcome to compare across ranks
        return {**row, "winner": None, "buckets": {}, "kernel": None, "error": f"{type(exc).__name__}: {exc}"}
    table = getattr(fn, "table", None)  # a dispatcher; a plain kernel means every bucket runs the op-level winner
    buckets = {bucket_text(k): w for k, w in sorted(table.winners.items())} if table is not None else {}
    return {**row, "buckets": buckets, "kernel": kernel_name(fn), "error": None}


def plant_opposite(runs: list[dict], platform) -> int:
    """Store in this rank's user DB, for each (op, mode) rank 0 decided, another eligible backend at op level and
    in each bucket than rank 0's: the rows a rank whose own tune disagreed everywhere would hold."""
    database, planted = tuning.database(), set()
    for run in runs:
        key = (run["op"], run["ran_mode"])
        if run["error"] or key in planted:
            continue
        planted.add(key)
        eligible = [s for s in selector.registry.get(run["op"]) if s.is_available(platform)]
        names = [s.backend.value for s in eligible]

        def other(backend: str) -> str:
            return names[(names.index(backend) + 1) % len(names)]

        row = Decision(op=run["op"], mode=run["ran_mode"], bucket="*", winner=other(run["winner"]),
                       platform_key=platform.key, versions=version_vector(platform, eligible), candidates=(),
                       margin=0.0, method="planted by tools/ranks_check.py",
                       created_at=datetime.datetime.now(datetime.timezone.utc).isoformat())
        database.record(row, [Decision(**{**vars(row), "bucket": b, "winner": other(w)})
                              for b, w in run["buckets"].items()])
    return len(planted)


def scenario(name: str, rank: int, out: Path, ops: list[str], platform, fresh_runs: list[dict],
             divergence: Divergence) -> dict:
    os.environ["AUTOSEL_DB"] = str(out / "dbs" / (f"fresh-rank{rank}.db" if name == "differs" and rank == 0
                                                   else f"{name}-rank{rank}.db"))
    os.environ["AUTOSEL_TUNE"] = "off" if name == "off" else "auto"
    selector.clear_cache()
    planted = plant_opposite(fresh_runs, platform) if name == "differs" and rank != 0 else 0
    divergence.lines = []
    runs = [run_op(op, mode, platform) for op in ops for mode in MODES]
    return {"runs": runs, "planted": planted, "divergence": list(divergence.lines)}


def as_decided(run: dict, size: int) -> dict:
    """What a run compares on. Rank 0's error reaches the others as the same exception with " (decided on rank 0
    of N)" after its text, or as a TuningError naming it (autosel.distributed.agree): both back to rank 0's."""
    error = run["error"]
    if error is not None:
        error = error.removesuffix(f" (decided on rank 0 of {size})")
        relayed = f"TuningError: op {run['op']!r} ({run['ran_mode']} mode): rank 0 failed with "
        error = error.removeprefix(relayed)
    return {**{k: run[k] for k in ("op", "ran_mode", "winner", "buckets", "kernel")}, "error": error}


def compare(results: list[dict]) -> tuple[list[list[str]], int]:
    """One table row per (scenario, op, mode): rank 0's outcome, how many ranks run the same, how many of the
    others logged a difference where one is due; and the number of failing rows."""
    rows, failures = [], 0
    size = len(results)
    for name in SCENARIOS:
        for i, zero in enumerate(results[0]["scenarios"][name]["runs"]):
            same = sum(as_decided(r["scenarios"][name]["runs"][i], size) == as_decided(zero, size) for r in results)
            said = f"op {zero['op']!r} ({zero['ran_mode']} mode):"
            warned = sum(any(line.startswith(said) for line in r["scenarios"][name]["divergence"])
                         for r in results[1:])
            due = name in ("fresh", "differs") and not zero["error"]
            ok = same == size and (warned == size - 1 or not due)
            failures += not ok
            runs = (f"error: {zero['error'][:60]}..." if zero["error"] else
                    zero["winner"] + (" | " + ", ".join(f"{b}: {w}" for b, w in zero["buckets"].items())
                                      if zero["buckets"] else ""))
            rows.append([name, zero["op"], f"{zero['mode']}->{zero['ran_mode']}", runs, f"{same}/{size}",
                         f"{warned}/{size - 1}" + ("" if due else " (none due)"), "ok" if ok else "FAIL"])
    return rows, failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the per-rank JSON, logs and DBs")
    parser.add_argument("--budget-s", type=float, default=2.0, help="AUTOSEL_BUDGET_S for rank 0's tunes")
    parser.add_argument("--op", action="append", help="only ops matching this glob (repeatable)")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # torchrun sets it; without it init_process_group fails with a traceback
        parser.error("run it under torchrun: torchrun --nproc-per-node 2 tools/ranks_check.py --out DIR")

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    known = [op for op, _ in tuning.contested_ops(platforms.current_platform())]  # the platform of this rank's device
    for pattern in args.op or ():
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):  # else an empty table passes
            parser.error(f"no op matches --op {pattern!r}; known ops (several backends here): {', '.join(known)}")
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    rank, size = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.WARNING, format=f"[rank {rank}] %(name)s: %(message)s")
    divergence = Divergence()
    logging.getLogger("autosel.distributed").addHandler(divergence)
    (args.out / "dbs").mkdir(parents=True, exist_ok=True)
    for stale in (args.out / "dbs").glob(f"*-rank{rank}.db*"):
        stale.unlink()
    os.environ.update(AUTOSEL_CHECK_RANKS="1", AUTOSEL_BUDGET_S=str(args.budget_s), AUTOSEL_DB_PATH="")
    os.environ.pop("AUTOSEL_BACKEND", None)
    os.environ.pop("AUTOSEL_MODE", None)
    db.package_folder = lambda: None  # "fresh" means nothing stored: the package's shipped DBs would answer
    platform = platforms.current_platform()
    ops = [op for op, _ in tuning.contested_ops(platform, args.op)]

    result = {"rank": rank, "world": size, "backend": dist.get_backend(), "platform": platform.key, "ops": ops,
              "torch": torch.__version__, "scenarios": {}}
    for name in SCENARIOS:
        fresh_runs = result["scenarios"].get("fresh", {}).get("runs", [])
        result["scenarios"][name] = scenario(name, rank, args.out, ops, platform, fresh_runs, divergence)
        dist.barrier()
    (args.out / f"rank{rank}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"rank{rank}-divergence.log").write_text(
        "".join(f"[{name}] {line}\n" for name in SCENARIOS for line in result["scenarios"][name]["divergence"]))

    gathered: list[dict] | None = [None] * size if rank == 0 else None  # type: ignore[list-item]
    dist.gather_object(result, gathered, dst=0)
    code = 0
    if rank == 0:
        assert gathered is not None
        if any(r["ops"] != ops for r in gathered):
            print("FAIL: the ranks see different contested ops: "
                  + "; ".join(f"rank {r['rank']}: {r['ops']}" for r in gathered))
            code = 1
        else:
            rows, failures = compare(gathered)
            print(f"{size} ranks, {dist.get_backend()}, {platform.key}, torch {torch.__version__}, "
                  f"budget {args.budget_s:g} s, {len(ops)} ops")
            header = ["scenario", "op", "mode", "rank 0 runs (op level | buckets)", "same",
                      "ranks>0 warned", "verdict"]
            widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
            for r in [header, ["-" * w for w in widths], *rows]:
                print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip())
            print(f"{failures} failing row(s) of {len(rows)}; per-rank JSON and divergence logs in {args.out}")
            write_result("ranks_check", {"subject": f"{size} ranks, {dist.get_backend()}", "failures": failures,
                                         "tables": [{"columns": header, "rows": rows}]}, folder=args.out,
                         platform=platform, command="torchrun --nproc-per-node " + shlex.join([str(size), *sys.argv]))
            code = 1 if failures else 0
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
