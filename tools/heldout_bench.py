"""Held-out shapes: on shapes that are not among the representative shapes (odd token counts, other models'
sizes), the time of the dispatcher's choice, of the op-level winner and of every fixed backend, each over the
per-shape best; geometric mean and worst, per op and mode. Decisions come from the DB as get_kernel sees it
(run `autosel tune` first); every backend is checked against the reference and timed by autosel's own tuner
(three interleaved rounds, nothing dropped, nothing recorded).

    autosel tune --budget-s 20 && python tools/heldout_bench.py --out DIR
    python tools/heldout_bench.py --out DIR --op 'layernorm.*' --mode eager

Writes DIR/heldout.md (the tables) and DIR/heldout.json (every median).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
import time
from pathlib import Path

from autosel import platforms, selector, tuning
from autosel.dispatch import BucketTable
from autosel.policy import geomean
from autosel.registry import registry

TOKENS = (1, 3, 24, 100, 300, 1000, 1500, 3000, 6000, 12000)


def _rope(tokens, q_heads, kv_heads):
    return {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_size": 128, "rotary_dim": 128,
            "is_neox": True}


# Sizes of models the representative shapes do not name: Qwen2-7B (hidden 3584, intermediate 18944, 28/4
# heads), Mistral-Small-24B / Llama-3-style 6144-wide layers, Llama-2-7B (intermediate 11008), Qwen2.5-14B (40/8
# heads, intermediate 13824).
HELD_OUT = {
    "layernorm.rmsnorm": [{"tokens": t, "hidden": h} for h in (3584, 6144) for t in TOKENS],
    "layernorm.fused_add_rmsnorm": [{"tokens": t, "hidden": h} for h in (3584, 6144) for t in TOKENS],
    "activation.silu_and_mul": [{"tokens": t, "intermediate": i} for i in (11008, 13824) for t in TOKENS[::2]],
    "activation.gelu_and_mul": [{"tokens": t, "intermediate": i} for i in (11008, 13824) for t in TOKENS[::2]],
    "embeddings.rope": [_rope(t, q, kv) for q, kv in ((28, 4), (40, 8)) for t in TOKENS[::2]],
    "gemm.mm": [{"m": m, "n": n, "k": k} for n, k in ((4608, 3584), (3584, 18944)) for m in (1, 24, 300, 1500, 6000)],
}


def table_for(op: str, mode: str) -> BucketTable:
    """What get_kernel dispatches by: its dispatcher's table, or the op-level winner alone."""
    fn = selector.get_kernel(op, mode=mode)
    table = getattr(fn, "table", None)
    return table or BucketTable(op, mode, selector.select_kernel(op, mode=mode).backend.value)


def measure(op: str, mode: str, shapes: list[dict], platform) -> list[dict]:
    """Every eligible backend's median per shape (None: rejected at that shape), by autosel's tuner, with each
    shape's bucket as the tuner computed it (from the bucket rows of this measurement)."""
    from autosel.decisions import parse_bucket
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    definition = registry.definition(op)
    eligible = [s for s in registry.get(op) if s.is_available(platform)]
    tuner = Tuner(timer=timer_for(platform.torch_device, mode), device=platform.torch_device,
                  drop_factor=math.inf, budget_s=1e9)
    decision, buckets = tuner.tune_buckets(definition, eligible, reference=tuning.reference_for(definition, eligible),
                                           shapes=shapes, mode=mode, platform_key=platform.key, versions={})
    bucket_of_shape = {json.dumps(s.shape, sort_keys=True): list(parse_bucket(row.bucket))
                       for row in buckets for s in row.candidates[0].shapes}
    return [{"shape": shape, "bucket": bucket_of_shape[json.dumps(shape, sort_keys=True)],
             "us": {c.backend: (c.shapes[i].timing.median_us if c.ok and c.shapes[i].timing else None)
                    for c in decision.candidates}}
            for i, shape in enumerate(shapes)]


def summarize(rows: list[dict], table: BucketTable) -> dict[str, tuple[float, float]]:
    """(geometric mean, worst) over the shapes of each strategy's time over the per-shape best."""
    picks: dict[str, list[float]] = {"dispatcher": [], f"op-level ({table.default})": []}
    backends = sorted({b for r in rows for b in r["us"]})
    for row in rows:
        us = row["us"]
        best = min(t for t in us.values() if t)
        chosen = table.route(tuple(row["bucket"]))
        row["dispatcher"], row["best"] = chosen, min((b for b in us if us[b]), key=us.get)
        picks["dispatcher"].append((us.get(chosen) or math.inf) / best)
        picks[f"op-level ({table.default})"].append((us.get(table.default) or math.inf) / best)
        for b in backends:
            picks.setdefault(b, []).append((us.get(b) or math.inf) / best)
    return {name: (geomean(v) if all(math.isfinite(x) for x in v) else math.inf, max(v)) for name, v in picks.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--op", action="append", help="glob of ops (repeatable); default all")
    parser.add_argument("--mode", action="append", choices=("eager", "graph"), help="default: every mode here")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    platform = platforms.current_platform()
    lines = [f"Platform `{platform.key}`, versions {platform.version_map}.", "",
             "Time over the per-shape best: geometric mean, worst (inf: the pick failed a shape's check).", ""]
    results = []
    for op, _ in tuning.contested_ops(platform, args.op):
        if op not in HELD_OUT or (args.op and not any(fnmatch.fnmatchcase(op, p) for p in args.op)):
            continue
        for mode in args.mode or tuning.modes_for(platform):
            began = time.perf_counter()
            table = table_for(op, mode)
            rows = measure(op, mode, HELD_OUT[op], platform)
            summary = summarize(rows, table)
            fixed = {k: v for k, v in summary.items() if k != "dispatcher" and not k.startswith("op-level")}
            best_fixed = min(fixed, key=lambda k: fixed[k][0])
            winners: dict[str, int] = {}
            for r in rows:
                winners[r["best"]] = winners.get(r["best"], 0) + 1
            lines += [f"### {op}, {mode} ({len(rows)} shapes, {time.perf_counter() - began:.0f} s; "
                      f"per-shape winners: {', '.join(f'{b} {n}' for b, n in sorted(winners.items()))}; "
                      f"best fixed backend: {best_fixed})", "", "| pick | geomean | worst |", "|---|---|---|"]
            lines += [f"| {name} | {g:.3f} | {w:.2f} |" for name, (g, w) in summary.items()] + [""]
            results.append({"op": op, "mode": mode, "table": {"default": table.default, "winners": [
                [list(k), v] for k, v in table.winners.items()]}, "rows": rows,
                "summary": {k: list(v) for k, v in summary.items()}})
            print("\n".join(lines[-len(summary) - 4:]), flush=True)
            (args.out / "heldout.md").write_text("\n".join(lines) + "\n")
            (args.out / "heldout.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
