"""Tuning time and stability: tune every contested op twice from scratch, in every execution mode, each time into
an empty DB, and count how many op-level and per-bucket decisions the two tunes made alike (and, of those they
did not, how many lay inside the margin, where either pick is as fast as the other).

    autosel bench stability                        # every op; an hour or more on a CPU
    autosel bench stability --op 'activation.*' --budget-s 20
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Callable

from autosel import batch, config
from autosel.decisions import OP_LEVEL_BUCKET


def tune_once(db: Path, patterns, budget_s: float, on_event: Callable = lambda event: None):
    """One forced tune of `patterns` into the DB file `db` alone (no shipped DB read); (outcomes, seconds)."""
    settings = config.read_settings(dict(os.environ, AUTOSEL_DB=str(db), AUTOSEL_DB_PATH=""))
    began = time.perf_counter()
    outcomes = batch.tune_ops(patterns, force=True, budget_s=budget_s, on_event=on_event, settings=settings)
    return outcomes, time.perf_counter() - began


def _inside_margin(decision, shape, a, b) -> bool:
    """Whether, in the first tune's own evidence, a and b were within its margin of each other."""
    ca, cb = decision.candidate(a), decision.candidate(b)
    if ca is None or cb is None or ca.score is None or cb.score is None:
        return False
    if shape == "*":
        ta, tb = ca.score, cb.score
    else:
        index = [s for s, _ in decision.per_shape_winners].index(shape)
        if not (ca.shapes[index].timing and cb.shapes[index].timing):
            return False
        ta, tb = ca.shapes[index].timing.median_us, cb.shapes[index].timing.median_us
    return max(ta, tb) / min(ta, tb) - 1 <= decision.margin


def stability(first, second) -> tuple[dict[str, dict[str, int]], list[str]]:
    """Op-level and per-shape decisions of two tunes, compared per mode: counts per mode, and one line per
    disagreement."""
    by_key = {(o.op, o.mode): o.decision for o in second if o.decision}
    counts: dict[str, dict[str, int]] = {}
    notes = []
    for outcome in first:
        a, b = outcome.decision, by_key.get((outcome.op, outcome.mode))
        if a is None or b is None:
            continue
        c = counts.setdefault(outcome.mode, {"decisions": 0, "agree": 0, "inside_margin": 0})
        pairs = [("*", a.winner, b.winner)]
        second_shapes = dict(b.per_shape_winners)
        pairs += [(s, w, second_shapes.get(s)) for s, w in a.per_shape_winners]
        for shape, wa, wb in pairs:
            c["decisions"] += 1
            if wa == wb:
                c["agree"] += 1
                continue
            inside = _inside_margin(a, shape, wa, wb)
            c["inside_margin"] += inside
            notes.append(f"{outcome.op} {outcome.mode} {shape}: {wa} vs {wb}{' (inside the margin)' if inside else ''}")
    return counts, notes


def bucket_stability(db1: Path, db2: Path) -> tuple[dict[str, dict[str, int]], list[str]]:
    """The per-bucket decisions (rows beside the op-level ones) of two tunes' DBs, compared per mode."""
    from autosel.db import TuningDB

    rows = [{(d.op, d.mode, d.bucket): d.winner
             for d, _ in TuningDB.open(db, include_package=False, read_only=True).decisions()
             if d.bucket != OP_LEVEL_BUCKET} for db in (db1, db2)]
    both = sorted(set(rows[0]) & set(rows[1]))
    counts = {mode: {"decisions": sum(k[1] == mode for k in both),
                     "agree": sum(k[1] == mode and rows[0][k] == rows[1][k] for k in both)}
              for mode in sorted({k[1] for k in both})}
    notes = [f"{op} {mode} bucket {bucket}: {rows[0][(op, mode, bucket)]} vs {rows[1][(op, mode, bucket)]}"
             for op, mode, bucket in both if rows[0][(op, mode, bucket)] != rows[1][(op, mode, bucket)]]
    return counts, notes


def _decisions(outcomes) -> list[dict]:
    return [{"op": o.op, "mode": o.mode, "winner": o.decision.winner, "runner_up": o.decision.runner_up,
             "margin": o.decision.margin} if o.decision else {"op": o.op, "mode": o.mode, "failed": o.detail}
            for o in outcomes]


def run(*, ops: tuple[str, ...] = (), budget_s: float = 60.0, keep: Path | None = None,
        on_event: Callable = lambda event: None, on_tune: Callable[[int], None] = lambda index: None) -> dict:
    """Two fresh tunes into tune1.db and tune2.db (in `keep`, else a temporary folder); the result file's body."""
    folder = Path(keep) if keep is not None else Path(tempfile.mkdtemp(prefix="autosel-stability-"))
    folder.mkdir(parents=True, exist_ok=True)
    runs, seconds = [], []
    for index in (1, 2):
        on_tune(index)
        db = folder / f"tune{index}.db"
        db.unlink(missing_ok=True)
        outcomes, took = tune_once(db, list(ops) or None, budget_s, on_event)
        runs.append(outcomes)
        seconds.append(round(took, 1))
    op_counts, op_notes = stability(*runs)
    bucket_counts, bucket_notes = bucket_stability(folder / "tune1.db", folder / "tune2.db")
    rows = [["op-level and per-shape", mode, c["decisions"], c["agree"], c["inside_margin"]]
            for mode, c in op_counts.items()]
    rows += [["per bucket", mode, c["decisions"], c["agree"], ""] for mode, c in bucket_counts.items()]
    # A run narrowed by --op names its ops as its subject, so that it stands beside the run of every op on the page.
    return {**({"subject": ", ".join(ops)} if ops else {}), "ops": list(ops), "budget_s": budget_s, "tune_s": seconds,
            "decisions": [_decisions(r) for r in runs], "op_level": op_counts, "buckets": bucket_counts,
            "disagreements": op_notes + bucket_notes, "kept": str(folder) if keep is not None else None,
            "tables": [{"title": f"Wall time of each tune: {seconds[0]:.1f} s and {seconds[1]:.1f} s "
                                 f"(budget {budget_s:g} s an op).",
                        "columns": ["decisions", "mode", "made by both", "identical", "the others inside the margin"],
                        "rows": rows}],
            "notes": (op_notes + bucket_notes)[:20]}
