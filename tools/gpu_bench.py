"""Tune every contested built-in op twice from scratch, in every execution mode, and write what docs/ quote.

Outputs (under --out): tune1.db / tune2.db (the two DBs), results.json (every decision with evidence),
tables.md (op, shape, each backend's median per mode, the winner) and stability.md (how many decisions the
two fresh tunes agree on, and whether the disagreements lay inside the margin).

    python tools/gpu_bench.py --out "$OUT"                       # on the H200, all ops
    python tools/gpu_bench.py --out /tmp/b --op 'activation.*'   # anywhere, a subset
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from autosel import config, selector
from autosel.platforms import current_platform


def tune_once(db: Path, patterns, budget_s: float):
    settings = config.read_settings(dict(os.environ, AUTOSEL_DB=str(db), AUTOSEL_DB_PATH=""))
    began = time.perf_counter()

    def progress(event):
        if event.kind in ("started", "rejected", "dropped", "chosen"):
            print(f"  [{time.perf_counter() - began:7.1f}s] {event.op} {event.kind} {event.backend or ''} "
                  f"{event.detail}", flush=True)

    outcomes = selector.tune_ops(patterns, force=True, budget_s=budget_s, on_event=progress, settings=settings)
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--op", action="append", help="glob of ops to tune (repeatable); default all")
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--once", action="store_true", help="one tune only (no stability comparison)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    platform = current_platform()
    print(f"platform {platform.key} versions {platform.version_map}", flush=True)
    runs = []
    for index in (1, 2)[: 1 if args.once else 2]:
        db = args.out / f"tune{index}.db"
        db.unlink(missing_ok=True)
        print(f"== tune {index} into {db}", flush=True)
        runs.append(tune_once(db, args.op, args.budget_s))
    results = {"platform": platform.key, "versions": platform.version_map,
               "tune_s": [round(s, 1) for _, s in runs],
               "decisions": [o.decision.to_dict() if o.decision else {"op": o.op, "mode": o.mode, "failed": o.detail}
                             for o in runs[0][0]]}
    header = f"Platform `{platform.key}`, versions {platform.version_map}; tune took {results['tune_s']} s.\n"
    (args.out / "tables.md").write_text(header + table(runs[0][0]))
    if len(runs) == 2:
        text, counts = stability(runs[0][0], runs[1][0])
        results["stability"] = counts
        (args.out / "stability.md").write_text(header + text)
        print(text, flush=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print((args.out / "tables.md").read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
