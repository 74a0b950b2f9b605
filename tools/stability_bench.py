"""Tune every contested built-in op twice from scratch, in every execution mode, and write what docs/ quote.

Outputs (under --out), for tune N = 1, 2: tuneN.db (its DB), resultsN.json (every decision with evidence),
tablesN.md (op, shape, each backend's median per mode, the winner), plainN.json (with --plain: a plain
tuner's per-shape picks); then stability.md and stability.json (how many decisions the two fresh tunes agree
on, whether the disagreements lay inside the margin, and how good each picker's picks were).

    python tools/stability_bench.py --out "$OUT"                       # on the H200, all ops
    python tools/stability_bench.py --out /tmp/b --op 'activation.*'   # anywhere, a subset

The two tunes can also run as two processes (on two GPUs of one host, at the same time), then be compared:

    CUDA_VISIBLE_DEVICES=0 python tools/stability_bench.py --out "$OUT" --index 1 --plain &
    CUDA_VISIBLE_DEVICES=1 python tools/stability_bench.py --out "$OUT" --index 2 --plain; wait
    python tools/stability_bench.py --out "$OUT" --compare
    python tools/stability_bench.py --out "$OUT" --compare --replay   # stored evidence under today's rule
    python tools/stability_bench.py --out "$OUT" --compare --margin-floor 0.05 --margin-floor 0.1   # what-if
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from autosel import batch, config, tuning
from autosel.decisions import OP_LEVEL_BUCKET
from autosel.platforms import current_platform
from autosel.policy import DEFAULT_POLICY, Policy


def tune_once(db: Path, patterns, budget_s: float):
    settings = config.read_settings(dict(os.environ, AUTOSEL_DB=str(db), AUTOSEL_DB_PATH=""))
    began = time.perf_counter()
    phase: dict[str, float] = {}

    def progress(event):
        now = time.perf_counter()
        if event.kind == "started":
            phase.update(started=now, timed=0)
        elif event.kind == "timing":
            phase["first_timed"] = now
        elif event.kind == "progress":
            phase["timed"] += 1
        if event.kind in ("started", "rejected", "dropped", "chosen"):
            detail = event.detail
            if event.kind == "chosen":  # where the op's time went: loading and checks, then the timed calls
                checks = phase.get("first_timed", now) - phase["started"]
                detail += (f"; checks {checks:.1f} s, {phase['timed']} timed calls "
                           f"{now - phase.pop('first_timed', now):.1f} s")
            print(f"  [{now - began:7.1f}s] {event.op} {event.mode} {event.kind} {event.backend or ''} {detail}",
                  flush=True)

    outcomes = batch.tune_ops(patterns, force=True, budget_s=budget_s, on_event=progress, settings=settings)
    return outcomes, time.perf_counter() - began


def table(outcomes) -> str:
    lines = []
    for outcome in outcomes:
        decision = outcome.decision
        if decision is None:
            lines.append(f"\n### {outcome.op} ({outcome.mode}): no decision: {outcome.detail}\n")
            continue
        backends = [c.backend for c in decision.candidates]
        lines.append(f"\n### {decision.op}, {decision.mode} mode: winner **{decision.winner}** "
                     f"(runner-up {decision.runner_up}, lead {decision.lead_over_runner_up or 0:.1%}, "
                     f"margin {decision.margin:.1%}, {decision.method})\n")
        lines.append("| shape | " + " | ".join(f"{b} (us)" for b in backends) + " | winner |")
        lines.append("|---" * (len(backends) + 2) + "|")
        winners = dict(decision.per_shape_winners)
        for index, shape_json in enumerate(winners):
            cells = []
            for candidate in decision.candidates:
                timing = candidate.shapes[index].timing if index < len(candidate.shapes) else None
                cells.append(f"{timing.median_us:.1f}" if timing else candidate.status)
            shape = ", ".join(f"{k}={v}" for k, v in json.loads(shape_json).items())
            lines.append(f"| {shape} | " + " | ".join(cells) + f" | {winners[shape_json]} |")
        for candidate in decision.candidates:
            if candidate.reason:
                lines.append(f"\n- {candidate.backend}: {candidate.status}: {candidate.reason}")
    return "\n".join(lines) + "\n"


def stability(first, second) -> tuple[str, dict]:
    """Op-level and per-shape decisions of two fresh tunes, compared per mode."""
    by_key = {(o.op, o.mode): o.decision for o in second if o.decision}
    counts: dict[str, dict[str, int]] = {}
    notes = []
    for outcome in first:
        a, b = outcome.decision, by_key.get((outcome.op, outcome.mode))
        if a is None or b is None:
            continue
        c = counts.setdefault(outcome.mode, {"decisions": 0, "agree": 0, "inside_margin": 0})
        pairs = [("*", a.winner, b.winner, a, b)]
        second_shapes = dict(b.per_shape_winners)
        pairs += [(s, w, second_shapes.get(s), a, b) for s, w in a.per_shape_winners]
        for shape, wa, wb, da, db_ in pairs:
            c["decisions"] += 1
            if wa == wb:
                c["agree"] += 1
                continue
            inside = _inside_margin(da, shape, wa, wb)
            c["inside_margin"] += inside
            notes.append(f"- {outcome.op} {outcome.mode} {shape}: {wa} vs {wb}"
                         f"{' (inside the margin)' if inside else ''}")
    lines = ["| mode | decisions | identical | disagreements inside the margin |", "|---|---|---|---|"]
    for mode, c in counts.items():
        lines.append(f"| {mode} | {c['decisions']} | {c['agree']} ({c['agree'] / max(1, c['decisions']):.1%}) "
                     f"| {c['inside_margin']} of {c['decisions'] - c['agree']} |")
    return "\n".join(lines + [""] + notes) + "\n", counts


class DoBench:
    """The plain tuner's eager timing on CUDA: triton.testing.do_bench (events around one call, L2 flushed)."""

    def measure(self, fn, **_):
        from triton.testing import do_bench

        return [t * 1e3 for t in do_bench(fn, warmup=5, rep=25, return_mode="all")]


def plain_picks(outcomes) -> dict[tuple[str, str, str], str]:
    """What a plain tuner picks: one timer call per candidate and shape, its median, the minimum wins.
    The timer: do_bench (eager) or do_bench_cudagraph (graph) on CUDA, torch.utils.benchmark on CPU."""
    import statistics

    import torch

    from autosel.checks import clone_args
    from autosel.registry import registry
    from autosel.timing import timer_for

    platform = current_platform()
    picks = {}
    for outcome in outcomes:
        decision = outcome.decision
        if decision is None:
            continue
        definition = registry.definition(decision.op)
        fns = {c.backend: registry.get_backend(decision.op, c.backend).load()
               for c in decision.candidates if c.status == "ok"}
        plain_eager = platform.torch_device == "cuda" and decision.mode == "eager"
        timer = DoBench() if plain_eager else timer_for(platform.torch_device, decision.mode)
        for shape_json, _ in decision.per_shape_winners:
            shape = json.loads(shape_json)
            torch.manual_seed(0)
            base = definition.make_inputs(dict(shape), platform.torch_device)
            medians = {}
            for backend, fn in fns.items():
                args = clone_args(base)
                medians[backend] = statistics.median(timer.measure(lambda: fn(*args), backend=backend, shape=shape))
            picks[(decision.op, decision.mode, shape_json)] = min(medians, key=medians.get)
    return picks


def pick_quality(first, second, plain1, plain2) -> str:
    """Slowdown of each picker's per-shape choice against the pooled medians of both autosel tunes (6 rounds)."""
    from autosel.policy import geomean

    second_by_key = {(o.op, o.mode): o.decision for o in second if o.decision}
    rows = {"autosel": [], "plain": []}
    plain_agree = plain_total = 0
    for outcome in first:
        a = outcome.decision
        b = second_by_key.get((outcome.op, outcome.mode))
        if a is None or b is None:
            continue
        for index, (shape_json, winner) in enumerate(a.per_shape_winners):
            truth = {}
            for c in a.candidates:
                cb = b.candidate(c.backend)
                ta = c.shapes[index].timing if c.status == "ok" else None
                tb = cb.shapes[index].timing if cb is not None and cb.status == "ok" else None
                if ta and tb:
                    truth[c.backend] = (ta.median_us + tb.median_us) / 2
            if not truth:
                continue
            best = min(truth.values())
            key = (a.op, a.mode, shape_json)
            if winner in truth:
                rows["autosel"].append(truth[winner] / best)
            if plain1.get(key) in truth:
                rows["plain"].append(truth[plain1[key]] / best)
            if key in plain1 and key in plain2:
                plain_total += 1
                plain_agree += plain1[key] == plain2[key]
    lines = ["| picker | shapes | geomean slowdown vs best | worst |", "|---|---|---|---|"]
    for name, values in rows.items():
        if values:
            geo = geomean(values)
            lines.append(f"| {name} | {len(values)} | {geo:.3f}x | {max(values):.2f}x |")
    if plain_total:
        lines.append(f"\nPlain tuner agreed with itself on {plain_agree} of {plain_total} shapes.")
    return "\n".join(lines) + "\n"


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


@dataclass
class Stored:
    """A decision read back from a tune's DB, shaped like jobs.TuneOutcome for the comparisons."""

    op: str
    mode: str
    decision: object
    detail: str = ""


def stored_outcomes(db: Path) -> list[Stored]:
    from autosel.db import TuningDB

    found = TuningDB.open(db, include_package=False, read_only=True).decisions()
    return sorted((Stored(d.op, d.mode, d) for d, _ in found if d.bucket == OP_LEVEL_BUCKET),
                  key=lambda o: (o.op, o.mode))


def write_tune(args, index: int, platform) -> list:
    """Tune once into tune{index}.db; write its tables, its evidence and (with --plain) the plain tuner's picks."""
    db = args.out / f"tune{index}.db"
    db.unlink(missing_ok=True)
    print(f"== tune {index} into {db}", flush=True)
    outcomes, seconds = tune_once(db, args.op, args.budget_s)
    header = f"Platform `{platform.key}`, versions {platform.version_map}; tune {index} took {seconds:.1f} s.\n"
    (args.out / f"tables{index}.md").write_text(header + table(outcomes))
    (args.out / f"results{index}.json").write_text(json.dumps(
        {"platform": platform.key, "versions": platform.version_map, "tune_s": round(seconds, 1),
         "decisions": [o.decision.to_dict() if o.decision else {"op": o.op, "mode": o.mode, "failed": o.detail}
                       for o in outcomes]}, indent=1))
    print((args.out / f"tables{index}.md").read_text(), flush=True)
    if args.plain:
        picks = plain_picks(outcomes)
        (args.out / f"plain{index}.json").write_text(json.dumps([[*key, pick] for key, pick in picks.items()]))
    return outcomes


def replayed(outcomes: list, policy: Policy = DEFAULT_POLICY) -> list[Stored]:
    """The same evidence decided again under `policy` (autosel.policy)."""

    out = []
    for o in outcomes:
        d = o.decision
        stats = {c.backend: [s.timing for s in c.shapes] for c in d.candidates if c.status == "ok"}
        verdict = policy.judge(stats)
        shapes = [shape for shape, _ in d.per_shape_winners]
        out.append(Stored(o.op, o.mode, dataclasses.replace(
            d, winner=verdict.winner, margin=verdict.margin,
            per_shape_winners=tuple(zip(shapes, verdict.shape_winners)))))
    return out


def bucket_stability(db1: Path, db2: Path) -> str:
    """The per-bucket decisions (rows beside the op-level ones) of two tunes, compared per mode."""
    from autosel.db import TuningDB

    rows = [{(d.op, d.mode, d.bucket): d.winner for d, _ in TuningDB.open(db, include_package=False, read_only=True).decisions()
             if d.bucket != OP_LEVEL_BUCKET} for db in (db1, db2)]
    both = sorted(set(rows[0]) & set(rows[1]))
    lines = ["| mode | bucket decisions | identical |", "|---|---|---|"]
    for mode in sorted({k[1] for k in both}):
        keys = [k for k in both if k[1] == mode]
        same = sum(rows[0][k] == rows[1][k] for k in keys)
        lines.append(f"| {mode} | {len(keys)} | {same} ({same / max(1, len(keys)):.1%}) |")
    notes = [f"- {op} {mode} {bucket}: {rows[0][(op, mode, bucket)]} vs {rows[1][(op, mode, bucket)]}"
             for op, mode, bucket in both if rows[0][(op, mode, bucket)] != rows[1][(op, mode, bucket)]]
    return "\n".join(["Per-bucket decisions:", ""] + lines + [""] + notes) + "\n"


def compare(args, first, second) -> None:
    text, counts = stability(first, second)
    dbs = [args.out / f"tune{i}.db" for i in (1, 2)]
    if all(db.exists() for db in dbs):
        text += "\n" + bucket_stability(*dbs)
    plain = [args.out / f"plain{i}.json" for i in (1, 2)]
    if all(p.exists() for p in plain):
        picks = [{tuple(row[:3]): row[3] for row in json.loads(p.read_text())} for p in plain]
        text += "\n" + pick_quality(first, second, *picks)
    (args.out / "stability.md").write_text(text)
    (args.out / "stability.json").write_text(json.dumps(counts, indent=1))
    print(text, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--op", action="append", help="glob of ops to tune (repeatable); default all")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--once", action="store_true", help="one tune only (no stability comparison)")
    parser.add_argument("--index", type=int, choices=(1, 2), help="run only tune 1 or 2 (compare later)")
    parser.add_argument("--compare", action="store_true", help="compare the tune1.db and tune2.db already in --out")
    parser.add_argument("--plain", action="store_true", help="also run a plain tuner and compare picks")
    parser.add_argument("--replay", action="store_true",
                        help="with --compare: decide the stored evidence again under the current rule")
    parser.add_argument("--margin-floor", type=float, action="append",
                        help="with --compare: decide the stored evidence again under this floor (repeatable; "
                             "with --replay, after the current rule)")
    args = parser.parse_args(argv)
    if (args.replay or args.margin_floor) and not args.compare:
        parser.error("--replay and --margin-floor decide two stored tunes again: give them with --compare")
    if args.compare:
        missing = [f"tune{i}.db" for i in (1, 2) if not (args.out / f"tune{i}.db").is_file()]
        if missing:
            raise SystemExit(f"{args.out}: no {' or '.join(missing)} to compare; make them first with "
                             f"python tools/stability_bench.py --out {args.out} (or --index 1, then --index 2)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.compare and (args.replay or args.margin_floor):  # what-if: the stored evidence decided again
        runs = [stored_outcomes(args.out / f"tune{i}.db") for i in (1, 2)]
        for floor in ([None] if args.replay else []) + (args.margin_floor or []):  # None: today's rule
            policy = DEFAULT_POLICY if floor is None else dataclasses.replace(DEFAULT_POLICY, margin_floor=floor)
            first, second = (replayed(r, policy) for r in runs)
            text, _ = stability(first, second)
            title = "each timing method's floor" if floor is None else f"margin floor {floor:g}"
            print(f"## {title}\n\n{text}\n{pick_quality(first, second, {}, {})}", flush=True)
        return 0
    if args.compare:
        runs = [stored_outcomes(args.out / f"tune{i}.db") for i in (1, 2)]
        for index, outcomes in enumerate(runs, 1):  # a tune stopped by a time limit left its DB, not its tables
            if not (args.out / f"tables{index}.md").exists():
                (args.out / f"tables{index}.md").write_text(f"Tune {index}, read back from its DB.\n" + table(outcomes))
        compare(args, *runs)
        return 0
    platform = current_platform()
    print(f"platform {platform.key} versions {platform.version_map}", flush=True)
    indexes = [args.index] if args.index else [1] if args.once else [1, 2]
    runs = [write_tune(args, index, platform) for index in indexes]
    if len(runs) == 2:
        compare(args, *runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
