"""Held-out benchmark of attention.decode and attention.extend: batches that are not among the representative ones
(a seeded generator, mixed lengths included), each timed on every fixed backend and on autosel's choice, eager and
replayed in a CUDA graph. Writes attention_heldout.json (command, commit, versions, platform, date, every batch's
times per round) and attention_heldout.md to --out, after every batch, so a run cut short keeps what it measured.

    AUTOSEL_DB=<the tune's DB> AUTOSEL_TUNE=off python3 tools/attention_heldout.py --out results/attention_h200

autosel's choice is `get_kernel(op, mode=mode).plan(batch)` on the DB the tune wrote (AUTOSEL_TUNE=off, so nothing
is timed here): its plan's class names the backend, and the time of that backend's plan on that batch is autosel's
time (the same class on the same batch, timed once). Fixed backends are `get_kernel(op, backend=b).plan(batch)`.

Timing is autosel's own (autosel.timing): eager, blocks of back-to-back calls (block_sampler); graph, replays of a
captured graph of back-to-back calls (graph_sampler). Every call reads the next of enough K/V cache copies to exceed
128 MB, as the tuner's timers do, so small batches are not timed from the L2. The candidates of a batch take turns
sample by sample over --rounds rounds (the order rotating), and the drift common to a round is taken out
(common_drift_removed), as in a tune.

The rule checked per batch: where a backend is ahead of autosel's choice beyond the noise margin (the tuner's floors:
6% graph, 10% eager) in every round, autosel did not run the leader.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from attention_bench import _platform, versions  # noqa: E402,F401 - the run's record, as the benchmark writes it

MARGIN = {"eager": 0.10, "graph": 0.06}  # autosel.policy's floors for cuda:back-to-back and graph replay
MODULE_BACKEND = {"attention_torch": "torch", "attention_compiled": "torch_compile",
                  "attention_flashinfer": "flashinfer", "attention_fa3": "sgl_kernel", "attention_triton": "triton"}
LAYOUTS = {  # name: (q heads, kv heads, head_dim, page size), weighted toward the model the docs measure
    "llama3-8b": (32, 8, 128, 16), "llama3-70b": (64, 8, 128, 16), "gemma2-9b": (16, 8, 256, 16),
    "mqa-48/1": (48, 1, 128, 16), "llama3-8b-p64": (32, 8, 128, 64)}
WEIGHTS = {"llama3-8b": 6, "llama3-70b": 2, "gemma2-9b": 1, "mqa-48/1": 1, "llama3-8b-p64": 1}
COPY_BYTES = 128 << 20  # as autosel.timing's rotate_bytes and weight_bytes: over twice an H100/H200 L2


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def _lengths(rng: random.Random, count: int, mean: float, mixed: bool) -> list[int]:
    """`count` lengths: all `mean`, or log-uniform over a spread of 4-64x around it."""
    if not mixed or count == 1:
        return [max(1, round(mean))] * count
    wide = _log_uniform(rng, 2, 8)
    return [max(1, round(_log_uniform(rng, mean / wide, mean * wide))) for _ in range(count)]


def _layout(rng: random.Random) -> str:
    return rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]


def decode_batches(count: int, seed: int, max_tokens: int) -> list[dict]:
    """Decode batches: batch 1-384, mean KV 200-24k, half of them mixed; total KV tokens at most max_tokens."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        size = max(1, round(_log_uniform(rng, 1, 384)))
        mean = min(_log_uniform(rng, 200, 24576), max_tokens / size)
        seq = _lengths(rng, size, mean, mixed=rng.random() < 0.5)
        if sum(seq) > max_tokens or max(seq) > 65536:
            continue
        out.append({"layout": _layout(rng), "seq_lens": seq, "q_lens": None})
    return out


def extend_batches(count: int, seed: int, max_work: int) -> list[dict]:
    """Extend batches: 1-8 sequences, 16-4096 new tokens each (8192 in all at most), prefixes 0 (prefill, 40%) or
    256-16k, half of them mixed; at most max_work query x KV positions."""
    rng, out = random.Random(seed), []
    while len(out) < count:
        size = max(1, round(_log_uniform(rng, 1, 8)))
        mixed = rng.random() < 0.5
        new = _lengths(rng, size, min(_log_uniform(rng, 16, 4096), 8192 / size), mixed)
        prefix = [0] * size if rng.random() < 0.4 else _lengths(rng, size, _log_uniform(rng, 256, 16384), mixed)
        seq = [p + n for p, n in zip(prefix, new)]
        if sum(new) > 8192 or sum(n * s for n, s in zip(new, seq)) > max_work:
            continue
        out.append({"layout": _layout(rng), "seq_lens": seq, "q_lens": new})
    return out


def representative_lengths(op: str) -> set[tuple]:
    """The (layout numbers, dtype, seq_lens, q_lens) of the op's GPU representative batches, to keep them out."""
    from autosel.ops import attention as att

    shapes = att.DECODE_SHAPES.gpu if op == "decode" else att.EXTEND_SHAPES.gpu
    out = set()
    for s in shapes:
        spread = s.get("spread", "uniform")
        if op == "decode":
            seq, new = att.lengths(s["batch"], s["kv"], spread), None
        else:
            new = att.lengths(s["batch"], max(1, s["new"] // s["batch"]), spread)
            seq = [s["prefix"] + q for q in new]
        out.add((s["q_heads"], s["kv_heads"], s["head_dim"], s["page_size"], s.get("dtype", "bfloat16"), tuple(seq),
                 tuple(new or ())))
    return out


def bucket_of(op: str, spec: dict) -> tuple:
    """The batch's bucket key (autosel.ops.attention's bucket function on a batch-shaped namespace)."""
    from autosel.ops import attention as att

    heads, kv_heads, head_dim, page = LAYOUTS[spec["layout"]]
    seq, new = spec["seq_lens"], spec["q_lens"] or [1] * len(spec["seq_lens"])
    ns = SimpleNamespace(batch_size=len(seq), total_kv=sum(seq), max_kv=max(seq), total_q=sum(new),
                         num_q_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, page_size=page,
                         dtype="torch.bfloat16")
    return (att.decode_bucket if op == "decode" else att.extend_bucket)(ns)


def describe(spec: dict) -> str:
    seq, new = spec["seq_lens"], spec["q_lens"]
    kv = f"{seq[0]}" if len(set(seq)) == 1 else f"{min(seq)}-{max(seq)} (mean {sum(seq) // len(seq)})"
    text = f"{spec['layout']} b{len(seq)} kv {kv}"
    if new:
        q = f"{new[0]}" if len(set(new)) == 1 else f"{min(new)}-{max(new)}"
        text += f" new {q}"
    return text


def backend_of_plan(plan) -> str:
    return MODULE_BACKEND.get(type(plan).__module__.rsplit(".", 1)[-1], type(plan).__module__)


def time_batch(op_name: str, spec: dict, backends: list[str], rounds: int, check_tokens: int,
               device: str = "cuda", modes: tuple[str, ...] = ("eager", "graph")) -> dict:
    """Every backend's and autosel's time on one batch in each mode, with the rounds and the rule's verdict."""
    import torch

    import autosel
    from autosel.ops import attention as att
    from autosel.planned import UnsupportedBatch
    from autosel.timing import block_sampler, common_drift_removed, graph_sampler, synchronize

    heads, kv_heads, head_dim, page = LAYOUTS[spec["layout"]]
    batch, k_cache, v_cache = att.make_batch(seq_lens=spec["seq_lens"], q_lens=spec["q_lens"], page_size=page,
                                             q_heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                             dtype=torch.bfloat16, device=device, seed=len(spec["seq_lens"]))
    q = torch.randn(batch.total_q, heads, head_dim, device=device, dtype=torch.bfloat16)
    copies = max(1, min(8, math.ceil(COPY_BYTES / (2 * k_cache.numel() * k_cache.element_size()))))
    ks = [k_cache] + [k_cache.clone() for _ in range(copies - 1)]
    vs = [v_cache] + [v_cache.clone() for _ in range(copies - 1)]
    row = {"op": op_name, "batch": describe(spec), "layout": spec["layout"], "seq_lens": spec["seq_lens"],
           "q_lens": spec["q_lens"], "bucket": list(bucket_of(op_name.split(".")[1], spec)), "cache_copies": copies,
           "plan_ms": {}, "errors": {}, "unsupported": {}, "close": {}}
    plans = {}
    for name in backends:
        try:
            planner = autosel.get_kernel(op_name, backend=name)
            reason = planner.unsupported(batch)
            if reason:
                row["unsupported"][name] = reason
                continue
            synchronize(device)
            began = time.perf_counter()
            plans[name] = planner.plan(batch)
            synchronize(device)
            row["plan_ms"][name] = round(1000 * (time.perf_counter() - began), 3)
        except UnsupportedBatch as exc:  # ineligible at this batch, with the reason: not a failure
            row["unsupported"][name] = str(exc)[:300]
        except Exception as exc:  # noqa: BLE001 - a backend failing on a batch is a result; the others go on
            row["errors"][name] = f"plan: {type(exc).__name__}: {exc}"[:300]
    for mode in modes:
        try:
            chosen = autosel.get_kernel(op_name, mode=mode).plan(batch)
            row[f"autosel_{mode}"] = backend_of_plan(chosen)
            del chosen
        except Exception as exc:  # noqa: BLE001
            row[f"autosel_{mode}"] = None
            row["errors"][f"autosel_{mode}"] = f"{type(exc).__name__}: {exc}"[:300]
    if batch.total_kv <= check_tokens and "torch" in plans:
        expected = plans["torch"].run(q, k_cache, v_cache).float()
        for name, plan in plans.items():
            try:
                got = plan.run(q, k_cache, v_cache).float()
                row["close"][name] = bool(torch.allclose(got, expected, rtol=2e-2, atol=2e-2))
            except Exception as exc:  # noqa: BLE001
                row["errors"][name] = f"run: {type(exc).__name__}: {exc}"[:300]
        plans = {n: p for n, p in plans.items() if n not in row["errors"]}

    def cycling(plan):
        state = [0]

        def call():
            i = state[0] = (state[0] + 1) % copies
            return plan.run(q, ks[i], vs[i])
        return call

    for mode in modes:
        samplers = {}
        for name, plan in plans.items():
            try:
                samplers[name] = (block_sampler if mode == "eager" else graph_sampler)(cycling(plan))
            except Exception as exc:  # noqa: BLE001
                row["errors"][f"{name}_{mode}"] = f"{type(exc).__name__}: {exc}"[:300]
        times = {name: [] for name in samplers}
        for r in range(rounds):
            order = list(samplers)
            order = order[r % len(order):] + order[:r % len(order)] if order else order
            for name in order:
                times[name].append(samplers[name]())
        names = list(times)
        adjusted = dict(zip(names, common_drift_removed([times[n] for n in names]))) if names else {}
        row[f"{mode}_rounds_us"] = {n: [round(t, 3) for t in ts] for n, ts in adjusted.items()}
        row[f"{mode}_us"] = {n: round(statistics.median(ts), 3) for n, ts in adjusted.items()}
        chosen = row.get(f"autosel_{mode}")
        leaders = []
        if chosen in adjusted:
            for other, ts in adjusted.items():
                if other != chosen and all(t * (1 + MARGIN[mode]) < c for t, c in zip(ts, adjusted[chosen])):
                    leaders.append(other)
        row[f"{mode}_led_by"] = leaders  # backends ahead of autosel's choice beyond the margin in every round
        del samplers
    return row  # its caches and plans go with this frame; main empties the CUDA cache after it


def geomean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def summary(rows: list[dict], backends: list[str]) -> list[dict]:
    """Per op and mode: autosel's and each fixed backend's time over the per-batch best (geometric mean, worst), the
    batches each fixed backend could not run, and the rule's violations."""
    out = []
    for op in dict.fromkeys(r["op"] for r in rows):
        for mode in ("eager", "graph"):
            done = [r for r in rows if r["op"] == op and r.get(f"{mode}_us")]
            if not done:
                continue
            ratios = {name: [] for name in ["autosel", *backends]}
            missing = {name: 0 for name in backends}
            for r in done:
                times = r[f"{mode}_us"]
                best = min(times.values())
                chosen = r.get(f"autosel_{mode}")
                if chosen in times:
                    ratios["autosel"].append(times[chosen] / best)
                for name in backends:
                    if name in times:
                        ratios[name].append(times[name] / best)
                    else:
                        missing[name] += 1
            entry = {"op": op, "mode": mode, "batches": len(done), "margin": MARGIN[mode],
                     "rule_violations": [r["batch"] for r in done if r.get(f"{mode}_led_by")],
                     "autosel_unmeasured": sum(1 for r in done if r.get(f"autosel_{mode}") not in r[f"{mode}_us"])}
            for name, values in ratios.items():
                if name == "autosel" or (values and not missing[name]):
                    entry[name] = {"geomean": round(geomean(values), 4), "worst": round(max(values), 4)
                                   if values else None, "batches": len(values)}
                elif values:
                    entry[name] = {"runs_all": False, "missing": missing[name],
                                   "geomean_where_run": round(geomean(values), 4)}
            complete = {n: entry[n]["geomean"] for n in backends if isinstance(entry.get(n), dict)
                        and "geomean" in entry[n]}
            if complete:
                best_fixed = min(complete, key=complete.get)
                entry["best_fixed"] = best_fixed
                if ratios["autosel"]:
                    entry["autosel_over_best_fixed"] = round(entry["autosel"]["geomean"] / complete[best_fixed], 4)
            out.append(entry)
    return out


def commit() -> str:
    if os.environ.get("AUTOSEL_COMMIT"):
        return os.environ["AUTOSEL_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def markdown(result: dict) -> str:
    lines = [f"# attention held-out benchmark, {result['device']}, {result['date']}", "",
             f"`{result['command']}` at {result['commit']}; DB {result['db']}; {result['rounds']} interleaved rounds; "
             f"platform {result['platform']}", "",
             "Time over the per-batch best (1.00 = the fastest backend on that batch), geometric mean / worst; "
             "'rule' lists batches where a backend led autosel's choice beyond the margin in every round.", "",
             "| op | mode | batches | autosel | " + " | ".join(result["backends"]) + " | best fixed | autosel / best "
             "fixed | rule |", "|---|---|---|---|" + "---|" * len(result["backends"]) + "---|---|---|"]
    for s in result["summary"]:
        def cell(name):
            e = s.get(name)
            if not e:
                return "-"
            if "geomean" in e:
                return f"{e['geomean']:.3f} / {e['worst']:.3f}" if e["batches"] else "-"
            return f"({e['geomean_where_run']:.3f}, {e['missing']} not run)"
        lines.append(f"| {s['op']} | {s['mode']} | {s['batches']} | {cell('autosel')} | "
                     + " | ".join(cell(b) for b in result["backends"])
                     + f" | {s.get('best_fixed', '-')} | {s.get('autosel_over_best_fixed', '-')} | "
                     f"{len(s['rule_violations'])} |")
    for mode in ("graph", "eager"):
        lines += ["", f"## {mode} (median us per call; * autosel's choice)", "",
                  "| op | batch | bucket | " + " | ".join(result["backends"]) + " | autosel / best |",
                  "|---|---|---|" + "---|" * len(result["backends"]) + "---|"]
        for r in result["rows"]:
            times, chosen = r.get(f"{mode}_us", {}), r.get(f"autosel_{mode}")
            if not times:
                continue
            best = min(times.values())
            cells = [(f"{times[b]:.1f}" + ("*" if b == chosen else "")) if b in times else "-"
                     for b in result["backends"]]
            ratio = f"{times[chosen] / best:.3f}" if chosen in times else f"{chosen}: not timed"
            led = f" (led by {', '.join(r[f'{mode}_led_by'])})" if r.get(f"{mode}_led_by") else ""
            lines.append(f"| {r['op'].split('.')[1]} | {r['batch']} | {r['bucket'][:4]} | " + " | ".join(cells)
                         + f" | {ratio}{led} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--decode", type=int, default=24, help="decode batches")
    parser.add_argument("--extend", type=int, default=12, help="extend batches")
    parser.add_argument("--seed", type=int, default=47)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=262144, help="decode: KV tokens per batch at most")
    parser.add_argument("--max-work", type=int, default=2 ** 26, help="extend: query x KV positions at most")
    parser.add_argument("--check-tokens", type=int, default=65536,
                        help="compare every backend's output with torch's where the batch holds at most this many")
    parser.add_argument("--skip", default="", help="backends not to time, comma-separated")
    parser.add_argument("--deadline-s", type=float, default=math.inf, help="start no batch after this many seconds")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu (eager only: a check of this script)")
    parser.add_argument("--list", action="store_true", help="print the batches and their buckets, time nothing")
    args = parser.parse_args(argv)
    started = time.time()
    batches = []
    for op, specs in (("decode", decode_batches(args.decode, args.seed, args.max_tokens)),
                      ("extend", extend_batches(args.extend, args.seed + 1, args.max_work))):
        seen = representative_lengths(op)
        for spec in specs:
            key = (*LAYOUTS[spec["layout"]], "bfloat16", tuple(spec["seq_lens"]), tuple(spec["q_lens"] or ()))
            if key not in seen:  # a held-out batch is never one the tune timed
                batches.append((f"attention.{op}", spec))
    # decode and extend interleaved, so that a run cut at its deadline still has both ops
    decode = [b for b in batches if b[0] == "attention.decode"]
    extend = [b for b in batches if b[0] == "attention.extend"]
    ratio = max(1, len(decode) // max(1, len(extend)))
    ordered = []
    while decode or extend:
        ordered += decode[:ratio] + extend[:1]
        decode, extend = decode[ratio:], extend[1:]
    if args.list:
        for op, spec in ordered:
            print(op, describe(spec), bucket_of(op.split(".")[1], spec))
        return 0
    import torch

    from autosel.registry import registry

    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    backends = list(dict.fromkeys(s.backend.value for op in ("attention.decode", "attention.extend")
                                  for s in registry.get(op) if s.backend.value not in skip))
    result = {"command": " ".join([sys.executable] + sys.argv), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
              "versions": versions(), "platform": _platform(),
              "db": os.environ.get("AUTOSEL_DB", "default"), "tune": os.environ.get("AUTOSEL_TUNE", ""),
              "rounds": args.rounds, "seed": args.seed, "margins": MARGIN, "backends": backends, "rows": []}
    for op, spec in ordered:
        if time.time() - started > args.deadline_s:
            result["cut_at_deadline"] = f"{len(result['rows'])} of {len(ordered)} batches"
            break
        eligible = [b for b in backends if any(s.backend.value == b for s in registry.get(op))]
        try:
            row = time_batch(op, spec, eligible, args.rounds, args.check_tokens, args.device,
                             ("eager", "graph") if args.device == "cuda" else ("eager",))
        except Exception as exc:  # noqa: BLE001 - one batch failing (out of memory) is a result
            traceback.print_exc()
            row = {"op": op, "batch": describe(spec), "error": f"{type(exc).__name__}: {exc}"[:300]}
        if args.device == "cuda":
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("op", "batch", "autosel_eager", "autosel_graph", "eager_us",
                                                  "graph_us", "errors")}), flush=True)
        result["wall_s"] = round(time.time() - started, 1)
        result["summary"] = summary(result["rows"], backends)
        (args.out / "attention_heldout.json").write_text(json.dumps(result, indent=1))
        (args.out / "attention_heldout.md").write_text(markdown(result))
    print(markdown(result))
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
