"""What-if for the nearest-bucket rule: a device call's held-out medians (heldout-*/heldout.json, every backend
timed per held-out shape) replayed under other rules for an untuned bucket, with the bucket decisions re-judged
by today's policy from the same call's tune.db; a rule may differ by mode (eager by size, graph per number).
Optionally one representative shape swapped for another with a hypothesised winner. The replay is in-sample
for the shapes it reads: a rule chosen on them needs a new set.

    python tools/heldout_whatif.py DIR                          # DIR: tune.db, heldout-eager/, heldout-graph/
    python tools/heldout_whatif.py DIR --swap layernorm.rmsnorm:64,7168:4,7168=flashinfer
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from autosel.db import TuningDB
from autosel.decisions import OP_LEVEL_BUCKET, is_number, key_order
from autosel.buckets import NEAREST_WITHIN, log_gaps
from autosel.policy import DEFAULT_POLICY, geomean
from autosel.registry import load_plugins, registry
from autosel.buckets import bucket_of


def key_of(op: str, shape: dict) -> tuple:
    """The op's own bucket function on the shape's inputs built on the meta device (no memory, no kernels)."""
    load_plugins()
    definition = registry.definition(op)
    return bucket_of(definition, definition.make_inputs(dict(shape), "meta"))


def bucket_groups(decision) -> dict[tuple, list[int]]:
    """A stored op-level decision's shapes grouped by their bucket key (key_of): key -> the shapes' indices."""
    groups: dict = {}
    for i, s in enumerate(next(c for c in decision.candidates if c.status == "ok").shapes):
        groups.setdefault(key_of(decision.op, s.shape), []).append(i)
    return groups


def judged(stats: dict, groups: dict[tuple, list[int]], policy=DEFAULT_POLICY) -> tuple:
    """(the op-level verdict, {bucket: winner}) of one op's measurements, as the tuner judges them: each bucket of
    `groups` (bucket_groups) with the op-level winner as its default."""
    verdict = policy.judge(stats)
    return verdict, {k: v.winner for k, v in policy.judge_groups(stats, groups, default=verdict.winner).items()}


def _log_size(key: tuple) -> float:  # log2 of the product of the numbers: elements (rows), m*n*k (mm)
    return math.log2(max(1, math.prod(x for x in key if is_number(x))))


def _nearest(key, tuned, allowed, distance):
    scored = [(distance(key, t, g), key_order(t), t) for t in tuned
              if (g := log_gaps(key, t)) is not None and allowed(key, t, g)]
    return min(scored, key=lambda s: s[:2])[2] if scored else None


def _gap_sum(key, tuned, gaps):
    return sum(gaps)


def _size_gap(key, tuned, gaps):
    return abs(_log_size(key) - _log_size(tuned))


# Each rule: (key, tuned keys) -> the tuned key that decides, or None (the op-level winner); or such a rule per mode.
RULES = {
    "current": lambda k, ts: _nearest(k, ts, lambda k, t, g: max(g, default=0) <= NEAREST_WITHIN, _gap_sum),
    "no limit": lambda k, ts: _nearest(k, ts, lambda k, t, g: True, _gap_sum),
    "size within 2x": lambda k, ts: _nearest(k, ts, lambda k, t, g: _size_gap(k, t, g) <= 1, _size_gap),
    "size and widths within 2x": lambda k, ts: _nearest(
        k, ts, lambda k, t, g: _size_gap(k, t, g) <= 1 and max(g[1:], default=0) <= 1, _size_gap),
    "widths within 2x, tokens any": lambda k, ts: _nearest(k, ts, lambda k, t, g: max(g[1:], default=0) <= 1,
                                                           _gap_sum),
    "widths within 2x, tokens 4x": lambda k, ts: _nearest(
        k, ts, lambda k, t, g: g[0] <= 2 and max(g[1:], default=0) <= 1, _gap_sum),
    "op-level only": lambda k, ts: None,
}
# Rules by mode: eager by size (launch cost against device time, which grows with size), graph as now.
RULES |= {f"eager: size within {2 ** n}x, graph: current": {
    "eager": lambda k, ts, n=n: _nearest(k, ts, lambda k, t, g: _size_gap(k, t, g) <= n, _size_gap),
    "graph": RULES["current"]} for n in (1, 2)}


def tables(db: Path) -> dict[tuple[str, str], tuple[str, dict]]:
    """(op, mode) -> (op-level winner, {bucket: winner}), judged again from the stored op-level evidence."""
    out = {}
    for d, _ in TuningDB.open(db, include_package=False, read_only=True).decisions():
        if d.bucket != OP_LEVEL_BUCKET:
            continue
        ok = [c for c in d.candidates if c.status == "ok"]
        stats = {c.backend: [s.timing for s in c.shapes] for c in ok}
        verdict, winners = judged(stats, bucket_groups(d))
        out[(d.op, d.mode)] = (verdict.winner, winners)
    return out


def parse_swap(text: str) -> tuple[str, tuple, tuple, str]:
    """--swap OP:T,W:T,W=BACKEND as (op, the tuned bucket dropped, the bucket in its place, the winner hypothesised)."""
    try:
        op, old, new = text.split(":")
        new, backend = new.split("=")
        return op, tuple(int(x) for x in old.split(",")), tuple(int(x) for x in new.split(",")), backend
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not OP:T,W:T,W=BACKEND, such as layernorm.rmsnorm:64,7168:4,7168=flashinfer") from None


def replay(call: Path, swap: tuple | None = None) -> list[tuple[str, str, str, dict]]:
    """Per op and mode: the best fixed backend and (geomean, worst) of each rule's picks over the per-shape best, the
    best among the backends the tune did not reject, as heldout_bench.summarize takes it. `swap`: parse_swap's."""
    if not (call / "tune.db").is_file():
        raise SystemExit(f"{call}: {'no tune.db' if call.is_dir() else 'no such folder'}; give a device call's "
                         "unpacked results (tune.db, heldout-eager/, heldout-graph/; tools/gpu_run.sh, BENCH=heldout)")
    paths = [call / f"heldout-{mode}" / "heldout.json" for mode in ("eager", "graph")]
    if not any(path.exists() for path in paths):
        raise SystemExit(f"{call}: neither {paths[0].relative_to(call)} nor {paths[1].relative_to(call)}; "
                         "run tools/heldout_bench.py --out DIR/heldout-MODE on the tune's DB first")
    tabs = tables(call / "tune.db")
    results = []
    for mode, path in zip(("eager", "graph"), paths):
        if not path.exists():
            continue
        for r in json.loads(path.read_text()):
            op, rows, rejected = r["op"], r["rows"], r.get("rejected", {})  # no "rejected" before heldout_bench had it
            if (op, mode) not in tabs:
                raise SystemExit(f"{call / 'tune.db'} holds no op-level decision for {op} in {mode} mode, which "
                                 f"{path} timed; give the tune.db that run read")
            default, winners = tabs[(op, mode)]
            winners = dict(winners)
            if swap and swap[0] == op:
                _, old, new, hypothesis = swap
                if old not in winners:
                    raise SystemExit(f"--swap: {op} has no tuned bucket {old} in {mode} mode; its tuned buckets: "
                                     + ", ".join(map(str, sorted(winners, key=key_order))))
                del winners[old]
                winners[new] = hypothesis
            ratios: dict[str, list[float]] = {}
            for row in rows:
                us, key = row["us"], tuple(row["bucket"])
                best = min(t for b, t in us.items() if t and b not in rejected)
                for b in us:
                    ratios.setdefault(b, []).append((us[b] or math.inf) / best)
                for name, rule in RULES.items():
                    rule = rule[mode] if isinstance(rule, dict) else rule
                    near = None if key in winners else rule(key, list(winners))
                    pick = winners.get(key) or (winners[near] if near is not None else default)
                    ratios.setdefault(name, []).append((us.get(pick) or math.inf) / best)
            summary = {n: (geomean(v) if all(map(math.isfinite, v)) else math.inf, max(v)) for n, v in ratios.items()}
            fixed = min((b for b in rows[0]["us"] if b not in rejected), key=lambda b: summary[b][0])
            results.append((op, mode, fixed, summary))
    if swap and not any(op == swap[0] for op, *_ in results):
        raise SystemExit(f"--swap: no held-out run here timed {swap[0]}; the ops timed: "
                         + ", ".join(sorted({op for op, *_ in results})))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("call", type=Path, help="a device call's results: tune.db, heldout-eager/, heldout-graph/")
    parser.add_argument("--swap", type=parse_swap,
                        help="OP:T,W:T,W=BACKEND: that tuned bucket replaced by another, winner hypothesised")
    args = parser.parse_args(argv)
    print("| op, mode | best fixed | " + " | ".join(RULES) + " |")
    print("|---" * (len(RULES) + 2) + "|")
    for op, mode, fixed, s in sorted(replay(args.call, args.swap)):
        print(f"| {op}, {mode} | {fixed} {s[fixed][0]:.3f}, {s[fixed][1]:.2f} | "
              + " | ".join(f"{s[n][0]:.3f}, {s[n][1]:.2f}" for n in RULES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
