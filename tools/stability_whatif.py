"""What-ifs on two stored tunes (tune1.db and tune2.db in each DIR, as tools/stability_bench.py writes them):
how far the same two candidates' time ratio moved between the tunes, and how stable the decisions would
have been under other host-speed readings or another number of rounds a win may lose. The figures of docs/TUNING.md section 7 that are not plain replays came from here.

    python tools/stability_whatif.py DIR [DIR ...] --drift
    python tools/stability_whatif.py DIR [DIR ...] --host-speed-range 2.0
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds 1.6       # the slower-host reading only
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds 0.625 1.6  # the rule before: 1.6x either way
    python tools/stability_whatif.py DIR [DIR ...] --host-speeds            # no host-speed readings
    python tools/stability_whatif.py DIR [DIR ...] --may-lose 1            # on every timing method
    python tools/stability_whatif.py DIR [DIR ...] --floor cuda:graph-replay=0.05   # one method's floor
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import sys
from pathlib import Path

import stability_bench as sb

from autosel.policy import DEFAULT_POLICY


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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--drift", action="store_true")
    parser.add_argument("--host-speed-range", type=float)
    parser.add_argument("--host-speeds", type=float, nargs="*", help="the host-speed readings' factors")
    parser.add_argument("--may-lose", type=int)
    parser.add_argument("--floor", action="append", default=[], metavar="METHOD=FLOOR",
                        help="replay with this floor for one timing method (repeatable)")
    args = parser.parse_args()
    policy = DEFAULT_POLICY
    if args.host_speed_range:
        policy = dataclasses.replace(policy, host_speeds=(1 / args.host_speed_range, args.host_speed_range))
    if args.host_speeds is not None:
        policy = dataclasses.replace(policy, host_speeds=tuple(args.host_speeds))
    if args.may_lose is not None:
        policy = policy.with_may_lose(args.may_lose)
    for setting in args.floor:
        method, _, floor = setting.rpartition("=")
        try:
            policy = policy.with_floor(method, float(floor))  # also the names sharing its rule (older names)
        except ValueError as exc:
            parser.error(f"--floor {setting}: {exc}; give METHOD=FLOOR, such as cuda:graph-replay=0.05")
    for d in args.dirs:
        runs = [sb.stored_outcomes(d / f"tune{i}.db") for i in (1, 2)]
        print(d)
        if args.drift:
            drift(*runs)
            continue
        first, second = (sb.replayed(r, policy) for r in runs)
        _, counts = sb.stability(first, second)
        quality = sb.pick_quality(first, second, {}, {}).splitlines()[2]
        print("  " + ", ".join(f"{mode} {c['agree']} of {c['decisions']}" for mode, c in counts.items()) +
              f"; autosel picks {quality.split('|')[3].strip()} geomean")
    return 0


if __name__ == "__main__":
    sys.exit(main())
