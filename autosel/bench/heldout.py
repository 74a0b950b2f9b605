"""Held-out quality: on shapes that were not tuned (token counts and widths drawn from a seed, none of them a
representative shape), the time of the dispatcher's pick, of the op-level winner and of every fixed backend, each
over the per-shape best; geometric mean and worst, per op and mode. Decisions come from the DB as get_kernel sees
it (run `autosel tune` first); every backend is checked against the reference and timed by autosel's own tuner
(three interleaved rounds, nothing dropped, nothing recorded).

    autosel tune && autosel bench heldout
    autosel bench heldout --op 'layernorm.*' --mode eager --seed 7

A seed draws ten token counts (none a power of two, where the representative shapes sit) and two widths per op;
a seed nobody chose a rule or a representative shape on is held out by construction, so report the seed with
the figures (the result file does).
"""

from __future__ import annotations

import fnmatch
import json
import math
import random
import time
from typing import Callable

from autosel import platforms, selector, tuning
from autosel.bench.results import BenchError
from autosel.dispatch import BucketTable
from autosel.policy import geomean
from autosel.registry import registry

OPS = ("layernorm.rmsnorm", "layernorm.fused_add_rmsnorm", "activation.silu_and_mul", "activation.gelu_and_mul",
       "embeddings.rope", "gemm.mm")
TOKENS = 10           # token counts per seed; each op gets as many shapes as the 20 a norm gets at two widths
MAX_TOKENS = 16384
HIDDEN = range(768, 16385, 64)          # a norm's row width (Falcon-7B's 4544 is a multiple of 64, not of 128)
INTERMEDIATE = range(768, 36865, 128)   # a gated activation's output width
HEADS = tuple((q, kv) for kv in (1, 2, 4, 8) for q in range(kv * 2, 129, kv * 2))  # (query heads, kv heads)
GEMM = range(1024, 16385, 256)          # a projection's n and k


def _rope(tokens, q_heads, kv_heads):
    return {"tokens": tokens, "q_heads": q_heads, "kv_heads": kv_heads, "head_size": 128, "rotary_dim": 128,
            "is_neox": True}


def _token_counts(rng: random.Random) -> tuple[int, ...]:
    """TOKENS distinct counts, log-uniform over 2..MAX_TOKENS, none a power of two."""
    found: set[int] = set()
    while len(found) < TOKENS:
        t = round(math.exp(rng.uniform(math.log(2), math.log(MAX_TOKENS))))
        if t & (t - 1):
            found.add(t)
    return tuple(sorted(found))


def held_out_shapes(seed: int) -> dict[str, list[dict]]:
    """The held-out shapes of `seed`: the norms at both widths and every token count; the other ops' first width
    at the odd-placed counts and their second at the even-placed ones, so a run costs what 20 shapes an op do."""
    rng = random.Random(seed)
    tokens = _token_counts(rng)
    halves = (tokens[1::2], tokens[::2])

    def two(values):
        return tuple(rng.sample(list(values), 2))

    rmsnorm, fused, silu, gelu = two(HIDDEN), two(HIDDEN), two(INTERMEDIATE), two(INTERMEDIATE)
    rope, mm = two(HEADS), tuple(tuple(rng.sample(list(GEMM), 2)) for _ in range(2))
    return {
        "layernorm.rmsnorm": [{"tokens": t, "hidden": h} for h in rmsnorm for t in tokens],
        "layernorm.fused_add_rmsnorm": [{"tokens": t, "hidden": h} for h in fused for t in tokens],
        "activation.silu_and_mul": [{"tokens": t, "intermediate": i} for i, ts in zip(silu, halves) for t in ts],
        "activation.gelu_and_mul": [{"tokens": t, "intermediate": i} for i, ts in zip(gelu, halves) for t in ts],
        "embeddings.rope": [_rope(t, q, kv) for (q, kv), ts in zip(rope, halves) for t in ts],
        "gemm.mm": [{"m": m, "n": n, "k": k} for (n, k), ms in zip(mm, halves) for m in ms],
    }


def table_for(op: str, mode: str) -> BucketTable:
    """What get_kernel dispatches by: its dispatcher's table, or the op-level winner alone."""
    fn = selector.get_kernel(op, mode=mode)
    table = getattr(fn, "table", None)
    return table or BucketTable(op, mode, selector.select_kernel(op, mode=mode).backend.value)


def measure(op: str, mode: str, eligible: list, shapes: list[dict], platform) -> list[dict]:
    """Every eligible backend's median per shape (None: rejected at that shape), by autosel's tuner, with each
    shape's bucket as the tuner computed it (from the bucket rows of this measurement)."""
    from autosel.decisions import parse_bucket
    from autosel.timing import timer_for
    from autosel.tuner import Tuner

    definition = registry.definition(op)
    tuner = Tuner(timer=timer_for(platform.torch_device, mode), device=platform.torch_device,
                  drop_factor=math.inf, budget_s=1e9)
    decision, buckets = tuner.tune_buckets(definition, eligible, reference=tuning.reference_for(definition),
                                           shapes=shapes, mode=mode, platform_key=platform.key, versions={})
    bucket_of_shape = {json.dumps(s.shape, sort_keys=True): list(parse_bucket(row.bucket))
                       for row in buckets for s in row.candidates[0].shapes}
    return [{"shape": shape, "bucket": bucket_of_shape[json.dumps(shape, sort_keys=True)],
             "us": {c.backend: (c.shapes[i].timing.median_us if c.ok and c.shapes[i].timing else None)
                    for c in decision.candidates},
             "rounds_us": {c.backend: list(c.shapes[i].timing.round_medians_us)
                           for c in decision.candidates if c.ok and c.shapes[i].timing}}
            for i, shape in enumerate(shapes)]


def rejected_by_tune(op: str, mode: str, eligible: list, platform) -> dict[str, str]:
    """The backends the stored decision rejected (each failed the check at some representative shape), with the
    reason: autosel never runs them for this op, however they fare at a held-out shape."""
    hit = tuning.database().lookup(tuning.decision_key(op, eligible, platform, mode))
    return {} if hit is None else {c.backend: c.reason or "" for c in hit[0].candidates if c.status == "rejected"}


def summarize(rows: list[dict], table: BucketTable, rejected=()) -> dict[str, tuple[float, float]]:
    """(geometric mean, worst) over the shapes of each strategy's time over the per-shape best, the best among
    the backends the tune did not reject (those in `rejected` are still listed, against that best)."""
    picks: dict[str, list[float]] = {"dispatcher": [], f"op-level ({table.default})": []}
    backends = sorted({b for r in rows for b in r["us"]})
    for row in rows:
        us = row["us"]
        best = min(t for b, t in us.items() if t and b not in rejected)
        chosen = table.route(tuple(row["bucket"]))
        row["dispatcher"], row["best"] = chosen, min((b for b in us if us[b] and b not in rejected), key=us.get)
        picks["dispatcher"].append((us.get(chosen) or math.inf) / best)
        picks[f"op-level ({table.default})"].append((us.get(table.default) or math.inf) / best)
        for b in backends:
            picks.setdefault(b, []).append((us.get(b) or math.inf) / best)
    return {name: (geomean(v) if all(math.isfinite(x) for x in v) else math.inf, max(v)) for name, v in picks.items()}


def _in_round(times: list[float], k: int) -> float:
    """A backend's median in round k; a backend the tuner stopped timing at a shape (over 1.3x the fastest after
    round 1) keeps its last round's median there."""
    return times[min(k, len(times) - 1)]


def per_round(rows: list[dict], other: str) -> list[float]:
    """Per timed round, the geometric mean over the shapes of the dispatcher's time over `other`'s, each from that
    round's medians (_in_round): how far apart the rounds put the two, so a lead smaller than that is not one.
    Empty when either failed at some shape."""
    pairs = [(r["rounds_us"].get(r["dispatcher"]), r["rounds_us"].get(other)) for r in rows]
    if not all(a and b for a, b in pairs):
        return []
    n = max(len(t) for pair in pairs for t in pair)
    return [geomean([_in_round(a, k) / _in_round(b, k) for a, b in pairs]) for k in range(n)]


def steady_wins(rows: list[dict], fixed: str, rejected=()) -> list[tuple[dict, str, float]]:
    """The shapes where another backend, not rejected by the tune, beat `fixed` in every timed round: (row, that
    backend, its largest time over fixed's in a round), naming per shape the backend whose lead held best (the least
    such ratio). Per-shape winners that differ only inside the rounds' spread are noise, not a place a dispatcher can
    be ahead. Rounds as per_round reads them (_in_round). A shape timed one round only was settled after it: every
    backend but the fastest was over 1.3x behind it there, and the tuner's rule counts that round in each later one
    (requiring three rounds here once left a 71-token GEMM unreported where cuBLAS ran 1.39x triton's time)."""
    wins = []
    for row in rows:
        timed = {name: times for name, times in row["rounds_us"].items() if times and all(t > 0 for t in times)}
        base = timed.get(fixed)
        if base is None:
            continue
        steady = []
        for name, times in timed.items():
            n = max(len(times), len(base))
            if name == fixed or name in rejected:
                continue
            worst = max(_in_round(times, k) / _in_round(base, k) for k in range(n))
            if worst < 1.0:
                steady.append((worst, name))
        if steady:
            worst, name = min(steady)
            wins.append((row, name, worst))
    return wins


def run(*, seed: int = 0, ops: tuple[str, ...] = (), modes: tuple[str, ...] = (),
        on_step: Callable[[str], None] = lambda step: None) -> dict:
    """Time every (op, mode) pair on the held-out shapes of `seed`; return the result file's body. Raises
    BenchError, before timing anything, where --op matches no op or a mode does not run here."""
    held_out = held_out_shapes(seed)
    platform = platforms.current_platform()
    known = [op for op, _ in tuning.contested_ops(platform) if op in held_out]
    for pattern in ops:
        if not any(fnmatch.fnmatchcase(op, pattern) for op in known):
            raise BenchError(f"no op matches --op {pattern!r}; known ops (several backends here, held-out shapes): "
                             f"{', '.join(known) or 'none'}")
    available = tuning.modes_for(platform)
    if set(modes or available) - set(available):  # get_kernel would run the eager decisions, labelled graph
        raise BenchError(f"--mode graph: this {platform.device.value} machine has no graph mode; it runs "
                         f"{', '.join(available)} mode only")
    pairs = [(op, eligible, mode) for op, eligible in tuning.contested_ops(platform, list(ops) or None)
             if op in held_out for mode in modes or available]
    results, summary_rows = [], []
    for op, eligible, mode in pairs:
        on_step(f"{op} {mode}")
        began = time.perf_counter()
        table = table_for(op, mode)
        rows = measure(op, mode, eligible, held_out[op], platform)
        rejected = rejected_by_tune(op, mode, eligible, platform)
        summary = summarize(rows, table, rejected)
        fixed = {k: v for k, v in summary.items()
                 if k != "dispatcher" and not k.startswith("op-level") and k not in rejected}
        best_fixed = min(fixed, key=lambda k: fixed[k][0])
        rounds = per_round(rows, best_fixed)
        steady = steady_wins(rows, best_fixed, rejected)
        summary_rows.append([op, mode, len(rows), round(summary["dispatcher"][0], 3),
                             round(summary["dispatcher"][1], 2), best_fixed, round(fixed[best_fixed][0], 3),
                             round(fixed[best_fixed][1], 2), len(steady)])
        results.append({"op": op, "mode": mode, "seconds": round(time.perf_counter() - began, 1), "table": {
            "default": table.default, "winners": [[list(k), v] for k, v in table.winners.items()]},
            "rows": rows, "rejected": rejected, "summary": {k: list(v) for k, v in summary.items()},
            "best_fixed": best_fixed, "dispatcher_over_best_fixed_per_round": rounds,
            "steady_wins": [[r["shape"], b, w] for r, b, w in steady]})
    return {"seed": seed, "shapes": held_out, "ops": results, "tables": [{
        "title": f"Held-out shapes of seed {seed}; time over the per-shape best (1.000 is the best possible; "
                 "inf: the pick failed a shape's check).",
        "columns": ["op", "mode", "shapes", "autosel geomean", "autosel worst", "best fixed backend",
                    "its geomean", "its worst", "shapes another backend won every round"],
        "rows": summary_rows}]}
