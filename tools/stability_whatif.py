"""What-ifs on two stored tunes (tune1.db and tune2.db in each DIR, as tools/stability_bench.py writes them):
how far the same two candidates' time ratio moved between the tunes, and how stable the decisions would
have been under other host-speed readings or another number of rounds a win may lose: op-level and per-shape
decisions, and the bucket rows judged again from the same evidence (pooled, as tools/stability_bench.py --compare
counts them). The figures of docs/TUNING.md section 7 that are not plain replays came from here.

    python tools/stability_whatif.py DIR [DIR ...] --drift
    python tools/stability_whatif.py DIR [DIR ...] --host-speed-range 2.0
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds 1.6       # the slower-host reading only
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds 0.625 1.6  # the rule before: 1.6x either way
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds            # no host-speed readings
    python tools/stability_whatif.py DIR [DIR ...] --may-lose 1            # on every timing method
    python tools/stability_whatif.py DIR [DIR ...] --floor cuda:graph-replay=0.05   # one method's floor
    python tools/stability_whatif.py DIR [DIR ...] --settled 1.5   # each tune*.db as if pairs had been settled

--settled replays each stored tune (its op-level, per-shape and bucket decisions) as if every candidate more
than FACTOR behind a shape's fastest after the first round had sat out that shape's later rounds, as the tuner
now does (tuner.SETTLED_FACTOR), and counts the decisions that differ from the same evidence judged whole.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import stability_bench as sb

from autosel.decisions import OP_LEVEL_BUCKET
from autosel.policy import DEFAULT_POLICY, Policy
from autosel.tuner import settled_pairs


def drift(outcomes1, outcomes2) -> None:
    """Percentiles of |log(ratio in tune 1 / ratio in tune 2)| over every pair of candidates of a shape, per
    mode; eager pairs also by whether the first candidate was launch-bound (eager over graph time > 1.5)."""
    def medians(outcomes):
        return {(o.op, o.mode, i, c.backend): s.timing.median_us for o in outcomes for c in o.decision.candidates
                if c.status == "ok" for i, s in enumerate(c.shapes) if s.timing}
    a, b = medians(outcomes1), medians(outcomes2)
    rows: dict[str, list[float]] = {}
    for kx, ky in itertools.combinations(sorted(a), 2):
        if kx[:3] != ky[:3] or kx not in b or ky not in b:
            continue
        op, mode, i, x = kx
        moved = abs(math.log(a[kx] / a[ky] / (b[kx] / b[ky])))
        rows.setdefault(mode, []).append(moved)
        graph = a.get((op, "graph", i, x))
        if mode == "eager" and graph:
            rows.setdefault("eager, launch-bound" if a[kx] / graph > 1.5 else "eager, other", []).append(moved)
    for name, values in rows.items():
        v = sorted(values)
        q = {p: math.exp(v[int(p * (len(v) - 1))]) - 1 for p in (0.5, 0.9, 0.95, 1.0)}
        print(f"  {name}: {len(v)} pairs, ratio moved p50 {q[0.5]:.1%} p90 {q[0.9]:.1%} p95 {q[0.95]:.1%} "
              f"max {q[1.0]:.1%}")


def settled(stats: dict, factor: float) -> dict:
    """The measurements as the tuner would have left them: a candidate more than `factor` times a shape's fastest
    after round one (tuner.settled_pairs) keeps that round only, and so does every candidate of a shape with fewer
    than two left."""
    first = {b: [m.round_medians_us[0] if m.round_medians_us else m.median_us for m in ms] for b, ms in stats.items()}
    pairs = settled_pairs(first, factor)
    out = {b: list(ms) for b, ms in stats.items()}
    for i in range(len(next(iter(stats.values())))):
        behind = {b for b in stats if (b, i) in pairs}
        for b in stats if len(stats) - len(behind) < 2 else behind:
            out[b][i] = dataclasses.replace(stats[b][i], round_medians_us=stats[b][i].round_medians_us[:1])
    return out


def settled_replay(db: Path, factor: float, policy: Policy) -> tuple[int, int, list[str]]:
    """(identical, decisions, differences) between db's evidence judged whole and judged settled at `factor`."""
    from heldout_whatif import bucket_groups, judged

    from autosel.db import TuningDB

    same = total = 0
    notes = []
    for d, _ in TuningDB.open(db, include_package=False, read_only=True).decisions():
        if d.bucket != OP_LEVEL_BUCKET:
            continue
        ok = [c for c in d.candidates if c.status == "ok"]
        groups = bucket_groups(d)

        def decisions(stats):
            verdict, buckets = judged(stats, groups, policy)
            return [verdict.winner, *verdict.shape_winners, *buckets.values()]

        stats = {c.backend: [s.timing for s in c.shapes] for c in ok}
        whole, pruned = decisions(stats), decisions(settled(stats, factor))
        same += sum(a == b for a, b in zip(whole, pruned))
        total += len(whole)
        notes += [f"{d.op} {d.mode}: {a} judged whole, {b} settled" for a, b in zip(whole, pruned) if a != b]
    return same, total, notes


def bucket_winners(outcomes, policy: Policy) -> dict[tuple, str]:
    """Every per-bucket decision of one stored tune, judged again under `policy` from its op-level evidence (the
    shapes grouped by the op's own bucket function), keyed (op, mode, bucket)."""
    from heldout_whatif import bucket_groups, judged

    out = {}
    for o in outcomes:
        d = o.decision
        stats = {c.backend: [s.timing for s in c.shapes] for c in d.candidates if c.status == "ok"}
        for key, winner in judged(stats, bucket_groups(d), policy)[1].items():
            out[d.op, d.mode, key] = winner
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--drift", action="store_true")
    parser.add_argument("--host-speed-range", type=float)
    parser.add_argument("--host-speeds", type=float, nargs="*", help="the host-speed readings' factors")
    parser.add_argument("--may-lose", type=int)
    parser.add_argument("--heavy-host", type=float, metavar="FACTOR",
                        help="the eager tie's heavy-launch factor (policy.Rule.heavy_host; 0: no such step)")
    parser.add_argument("--floor", action="append", default=[], metavar="METHOD=FLOOR",
                        help="replay with this floor for one timing method (repeatable)")
    parser.add_argument("--settled", type=float, metavar="FACTOR",
                        help="replay each tune*.db as if pairs FACTOR behind after round one had sat out the rest")
    args = parser.parse_args(argv)
    for d in args.dirs:  # every folder checked before any is read: a typo in the last fails at once
        if not (any(d.glob("tune*.db")) if args.settled else all((d / f"tune{i}.db").is_file() for i in (1, 2))):
            raise SystemExit(f"{d}: no {'tune*.db' if args.settled else 'tune1.db and tune2.db'}; give folders "
                             "tools/stability_bench.py wrote its two tunes into")
    policy = DEFAULT_POLICY
    if args.host_speed_range:
        policy = dataclasses.replace(policy, host_speeds=(1 / args.host_speed_range, args.host_speed_range))
    if args.host_speeds is not None:
        policy = dataclasses.replace(policy, host_speeds=tuple(args.host_speeds))
    if args.may_lose is not None:
        policy = policy.with_may_lose(args.may_lose)
    if args.heavy_host is not None:
        policy = policy.with_heavy_host(args.heavy_host or None)
    for setting in args.floor:
        method, _, floor = setting.rpartition("=")
        try:
            policy = policy.with_floor(method, float(floor))  # also the names sharing its rule (older names)
        except ValueError as exc:
            parser.error(f"--floor {setting}: {exc}; give METHOD=FLOOR, such as cuda:graph-replay=0.05")
    for d in args.dirs:
        if args.settled:
            for db in sorted(d.glob("tune*.db")):
                same, total, notes = settled_replay(db, args.settled, policy)
                print(f"{db}: {same} of {total} decisions identical", *(f"  - {n}" for n in notes), sep="\n")
            continue
        runs = [sb.stored_outcomes(d / f"tune{i}.db") for i in (1, 2)]
        print(d)
        if args.drift:
            drift(*runs)
            continue
        first, second = (sb.replayed(r, policy) for r in runs)
        _, counts = sb.stability(first, second)
        quality = sb.pick_quality(first, second, {}, {}).splitlines()[2]
        buckets = [bucket_winners(r, policy) for r in runs]
        flips = sorted(k for k in buckets[0] if k in buckets[1] and buckets[0][k] != buckets[1][k])
        both = [k for k in buckets[0] if k in buckets[1]]
        for mode in counts:
            n = sum(k[1] == mode for k in both)
            counts[mode]["bucket_agree"] = n - sum(k[1] == mode for k in flips)
            counts[mode]["buckets"] = n
        agree = sum(c["agree"] + c["bucket_agree"] for c in counts.values())
        total = sum(c["decisions"] + c["buckets"] for c in counts.values())
        print("  " + ", ".join(f"{mode} {c['agree']} of {c['decisions']}, buckets {c['bucket_agree']} of "
                               f"{c['buckets']}" for mode, c in counts.items()) +
              f"; pooled {agree} of {total} ({agree / max(1, total):.1%}); autosel picks "
              f"{quality.split('|')[3].strip()} geomean", *(f"  - {k}: {buckets[0][k]} vs {buckets[1][k]}"
                                                             for k in flips), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
