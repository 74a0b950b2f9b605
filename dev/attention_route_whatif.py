"""Replays a stored attention tune under other routing rules and scores each on a held-out run's batches.

For each rule, the tune's decode decisions are decided again from their stored evidence (Policy.judge_groups is a
pure function of it, docs/TUNING.md section 7) and each held-out batch is routed to a backend as
`get_kernel("attention.decode", mode=...).plan(batch)` would route it; the held-out run's own times then give that
backend's time over the per-batch best (geometric mean, worst) and the batches where another backend led it beyond
the margin in every round. Rules:

- bucket keeps op winner, nearest within 2x: a bucket keeps the op-level winner through a near-tie, and a batch
  runs the nearest tuned bucket within a factor of two in every number, else the op-level winner;
- bucket's fastest: a bucket's own fastest is its default through a near-tie;
- nearest at any distance: a batch runs the nearest tuned bucket however far (every number of the key counted,
  the layout's too; the dtype must match).

    python dev/attention_route_whatif.py results/attention-h200-tunes/tune1.db \\
        results/attention-heldout-cuda-sm-90-nvidia-h200-132-2026-12-05T133300.json
"""

from __future__ import annotations

import json
import lzma
import math
import sqlite3
import sys

from autosel.bench.attention_heldout import MARGIN, led_by
from autosel.decisions import Decision, parse_bucket
from autosel.dispatch import BucketTable
from autosel.policy import DEFAULT_POLICY, geomean


def open_db(path: str) -> sqlite3.Connection:
    """A stored tune's DB, read-only; a `.db.xz` (results/attention-h100-runs keeps them so) is read into memory."""
    if not path.endswith(".xz"):
        return sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    conn = sqlite3.connect(":memory:")
    conn.deserialize(lzma.decompress(open(path, "rb").read()))
    return conn


def table(db: str, mode: str, keep_op_winner: bool) -> BucketTable:
    """The decode table of `mode` from the DB's evidence, each bucket judged again."""
    rows = open_db(db).execute("select bucket, evidence from decisions where op = 'attention.decode' and "
                               "mode = ?", (mode,)).fetchall()
    decisions = {bucket: Decision.from_json(evidence) for bucket, evidence in rows}
    default = decisions.pop("*").winner
    winners = {}
    for bucket, decision in decisions.items():
        stats = {c.backend: [s.timing for s in c.shapes] for c in decision.candidates
                 if c.ok and all(s.timing for s in c.shapes)}
        verdict = DEFAULT_POLICY.judge_groups(stats, {0: range(len(next(iter(stats.values()))))},
                                              default=default if keep_op_winner else None)[0]
        winners[parse_bucket(bucket)] = verdict.winner
    return BucketTable("attention.decode", mode, default, winners)


def main(db: str, heldout: str) -> int:
    rows = [r for r in json.load(open(heldout))["results"]["rows"] if r["op"] == "attention.decode"]
    print(f"{'mode':6} {'rule':48} {'geomean':>8} {'worst':>6} {'led beyond the margin':>22}")
    for mode in ("eager", "graph"):
        for keep in (True, False):
            t = table(db, mode, keep)
            for within, near in ((1.0, "nearest within 2x"), (math.inf, "nearest at any distance")):
                ratios, led = [], 0
                for r in rows:
                    times, chosen = r[f"{mode}_us"], t.route(tuple(r["bucket"]), within)
                    ratios.append(times[chosen] / min(times.values()))
                    led += bool(led_by(r[f"{mode}_rounds_us"], chosen, MARGIN[mode]))
                rule = ("bucket keeps op winner, " if keep else "bucket's fastest, ") + near
                print(f"{mode:6} {rule:48} {geomean(ratios):8.4f} {max(ratios):6.3f} {led:>15} of {len(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
