"""Probe (stop 17, retired after it): could the bucket rows repeat better between two fresh tunes? Replays stored
stability pairs (tune1.db and tune2.db in each DIR) and held-out runs under three other rules, and prints each pair's
pooled stability (op-level, per-shape and bucket decisions, as stability_bench --compare counts them) and, for the
held-out runs, each op and mode's dispatcher over the per-shape best.

    python tools/bucket_default_whatif.py --pairs DIR [DIR ...] --heldout CALL:TUNE_DB [CALL:TUNE_DB ...]

Rules: "op-level" (today: each bucket's default is the op-level winner), "registration" (the first candidate in
registration order), "wide=F" (the op-level choice made again with F times the margin), "device-bound floor=F"
(today's defaults, with the floor F where every call compared is device-bound even at the slowest host speed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from contextlib import contextmanager
from pathlib import Path

import heldout_whatif as hw
import stability_whatif as sw

from autosel import policy as P
from autosel.db import TuningDB
from autosel.decisions import OP_LEVEL_BUCKET

POLICY = P.DEFAULT_POLICY


def wide_default(stats: dict, factor: float) -> str:
    """The op-level choose() of policy.judge, with `factor` times its margin."""
    order, everything = list(stats), [m for ms in stats.values() for m in ms]
    rule = POLICY.rule_for(everything[0].method)
    rounds = max(len(m.round_medians_us) for m in everything)
    speeds = POLICY.host_speeds if all(m.host_us and m.device_us for m in everything) else ()
    paces = [P.pace_of([stats[b][i] for b in order], rounds) for i in range(len(stats[order[0]]))]
    per_shape = {b: [P.readings_of(m, rounds, speeds, paces[i]) for i, m in enumerate(ms)] for b, ms in stats.items()}
    op = {b: [] for b in order}
    for k in range(len(per_shape[order[0]][0])):
        for b, score in P.relative_scores({b: [r[k] for r in rs] for b, rs in per_shape.items()}).items():
            op[b].append(score)
    return P.choose(order, op, P.typical_margin(everything, rule.floor) * factor, rule.may_lose)


@contextmanager
def device_bound_floor(floor: float):
    """policy.typical_margin with `floor` where every measurement is device-bound at the slowest host speed."""
    real, slowest = P.typical_margin, max(POLICY.host_speeds)

    def margin(measurements, base):
        bound = all(m.host_us and m.device_us and m.device_us >= slowest * m.host_us for m in measurements)
        return real(measurements, min(base, floor) if bound else base)
    P.typical_margin = margin
    try:
        yield
    finally:
        P.typical_margin = real


def default_for(rule: str, stats: dict) -> str:
    if rule == "registration":
        return next(iter(stats))
    if rule.startswith("wide="):
        return wide_default(stats, float(rule.split("=")[1]))
    return POLICY.judge(stats).winner


def judged(decisions, rule: str) -> dict:
    """(op, mode) -> (op-level winner, {bucket: winner}) of stored op-level decisions judged again under `rule`."""
    out = {}
    with device_bound_floor(float(rule.split("=")[1])) if rule.startswith("device") else _nothing():
        for d in decisions:
            stats = {c.backend: [s.timing for s in c.shapes] for c in d.candidates if c.status == "ok"}
            groups: dict = {}
            for i, (shape, _) in enumerate(d.per_shape_winners):
                groups.setdefault(hw.key_of(d.op, json.loads(shape)), []).append(i)
            verdict = POLICY.judge(stats)
            buckets = POLICY.judge_groups(stats, groups, default=default_for(rule, stats))
            out[d.op, d.mode] = (verdict, {k: v.winner for k, v in buckets.items()})
    return out


@contextmanager
def _nothing():
    yield


def op_level(db: Path) -> list:
    return [d for d, _ in TuningDB.open(db, include_package=False).decisions() if d.bucket == OP_LEVEL_BUCKET]


def pooled(pair: Path, rule: str) -> tuple[int, int]:
    a, b = (judged(op_level(pair / f"tune{i}.db"), rule) for i in (1, 2))
    same = total = 0
    for key in a.keys() & b.keys():
        (va, ba), (vb, bb) = a[key], b[key]
        picks = [(va.winner, vb.winner), *zip(va.shape_winners, vb.shape_winners),
                 *((ba[k], bb[k]) for k in ba.keys() & bb.keys())]
        same += sum(x == y for x, y in picks)
        total += len(picks)
    return same, total


def heldout(call: Path, db: Path, rule: str) -> dict:
    """(op, mode) -> (geomean, worst) of the dispatcher over the per-shape best on the call's set5 rows."""
    tables = judged(op_level(db), rule)
    out = {}
    for mode in ("eager", "graph"):
        path = call / f"heldout5-{mode}" / "heldout.json"
        for r in json.loads(path.read_text()) if path.exists() else []:
            verdict, winners = tables[r["op"], mode]
            ratios = []
            for row in r["rows"]:
                us, key = row["us"], tuple(row["bucket"])
                best = min(t for b, t in us.items() if t and b not in r.get("rejected", {}))
                near = None if key in winners else hw.RULES["current"](key, list(winners))
                pick = winners.get(key) or (winners[near] if near is not None else verdict.winner)
                ratios.append((us.get(pick) or math.inf) / best)
            out[r["op"], mode] = (P.geomean(ratios), max(ratios))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=Path, nargs="*", default=[])
    parser.add_argument("--heldout", nargs="*", default=[], metavar="CALL:TUNE_DB")
    parser.add_argument("--rules", nargs="*", default=["op-level", "registration", "wide=1.5", "wide=2",
                                                        "device-bound floor=0.06", "device-bound floor=0.03"])
    args = parser.parse_args()
    for rule in args.rules:
        counts = [pooled(d, rule) for d in args.pairs]
        same, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
        print(f"{rule}: " + ", ".join(f"{s}" for s, _ in counts) + f" of {counts[0][1] if counts else 0} each; "
              f"pooled {same} of {total} ({same / max(1, total):.2%})")
        for spec in args.heldout:
            call, db = spec.split(":")
            worst = {k: v for k, v in heldout(Path(call), Path(db), rule).items() if k[1] == "eager"}
            print(f"  {Path(call).name} eager: " + ", ".join(f"{op.split('.')[-1]} {g:.3f}/{w:.2f}"
                                                            for (op, _), (g, w) in sorted(worst.items())))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    sys.exit(main())
