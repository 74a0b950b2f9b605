"""Held-out benchmark of attention.decode and attention.extend (`autosel bench attention-heldout`): batches that are
not among the representative ones (a seeded generator, mixed lengths included), each timed on every fixed backend
and on autosel's choice, eager and replayed in a CUDA graph, as the body of a result file (autosel.bench.results).

    autosel tune --op 'attention.*' && AUTOSEL_TUNE=off autosel bench attention-heldout
    autosel bench attention-heldout --device cpu --decode 2 --extend 1 --max-tokens 600 --max-work 20000

autosel's choice is `get_kernel(op, mode=mode).plan(batch)` on the DB as get_kernel reads it (with AUTOSEL_TUNE=off
nothing is timed to make it): its plan's class names the backend, and the time of that backend's plan on that batch
is autosel's time (the same class on the same batch, timed once). Fixed backends are
`get_kernel(op, backend=b).plan(batch)`.

Timing is autosel's own (autosel.timing): eager, blocks of back-to-back calls (block_sampler); graph, replays of a
captured graph of back-to-back calls (graph_sampler). Every call reads the next of enough K/V cache copies to exceed
128 MB, as the tuner's timers do, so small batches are not timed from the L2. The candidates of a batch take turns
sample by sample over `rounds` rounds (the order rotating), and the drift common to a round is taken out
(common_drift_removed), as in a tune.

The rule checked per batch: where a backend is ahead of autosel's choice beyond the noise margin (the tuner's floors:
6% graph, 10% eager) in every round, autosel did not run the leader.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
import time
import traceback
from types import SimpleNamespace
from typing import Any, Callable

from autosel.policy import geomean

log = logging.getLogger(__name__)

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
        # backends ahead of autosel's choice beyond the margin in every round
        row[f"{mode}_led_by"] = led_by(adjusted, chosen, MARGIN[mode]) if chosen in adjusted else []
        del samplers
    return row  # its caches and plans go with this frame; rows_in_turn empties the CUDA cache after it


def led_by(rounds_us: dict[str, list[float]], name: str, margin: float) -> list[str]:
    """The backends ahead of `name` beyond `margin` in every round (their time times 1 + margin still under its)."""
    return [other for other, ts in rounds_us.items()
            if other != name and all(t * (1 + margin) < c for t, c in zip(ts, rounds_us[name]))]


def contested(row: dict, mode: str) -> bool:
    """Whether some backend led another beyond the margin in every round of `mode` on this batch: where the choice
    of backend mattered beyond the noise."""
    rounds_us = row.get(f"{mode}_rounds_us") or {}
    return any(led_by(rounds_us, name, MARGIN[mode]) for name in rounds_us)


def summary(rows: list[dict], backends: list[str]) -> list[dict]:
    """Per op and mode: autosel's and each fixed backend's time over the per-batch best (geometric mean, worst), the
    batches each fixed backend could not run, the rule's violations, and how many batches had a backend leading
    another beyond the margin in every round, with how many of those autosel ran a backend nobody led."""
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
            led = [r for r in done if contested(r, mode)]
            entry = {"op": op, "mode": mode, "batches": len(done), "margin": MARGIN[mode],
                     "rule_violations": [r["batch"] for r in done if r.get(f"{mode}_led_by")],
                     "autosel_unmeasured": sum(1 for r in done if r.get(f"autosel_{mode}") not in r[f"{mode}_us"]),
                     "led_beyond_margin": len(led),
                     "autosel_ran_a_leader": sum(1 for r in led if r.get(f"autosel_{mode}") in r[f"{mode}_us"]
                                                 and not r.get(f"{mode}_led_by"))}
            for name, values in ratios.items():
                if name == "autosel" or (values and not missing[name]):
                    entry[name] = {"geomean": round(geomean(values), 4) if values else None,
                                   "worst": round(max(values), 4) if values else None, "batches": len(values)}
                elif values:
                    entry[name] = {"runs_all": False, "missing": missing[name],
                                   "geomean_where_run": round(geomean(values), 4)}
            complete = {n: entry[n]["geomean"] for n in backends if isinstance(entry.get(n), dict)
                        and "geomean" in entry[n]}
            if complete:
                best_fixed = min(complete, key=complete.get)
                entry["best_fixed"] = best_fixed
                if entry["autosel"]["geomean"]:
                    entry["autosel_over_best_fixed"] = round(entry["autosel"]["geomean"] / complete[best_fixed], 4)
            out.append(entry)
    return out


def held_out_batches(*, decode: int, extend: int, seed: int, max_tokens: int, max_work: int) -> list[tuple[str, dict]]:
    """(op, batch) of the run: `decode` and `extend` batches drawn from `seed`, a generated batch equal to a
    representative one dropped (the tune timed it), decode and extend interleaved so that a run cut at its deadline
    still has both ops."""
    batches = []
    for op, specs in (("decode", decode_batches(decode, seed, max_tokens)),
                      ("extend", extend_batches(extend, seed + 1, max_work))):
        seen = representative_lengths(op)
        for spec in specs:
            key = (*LAYOUTS[spec["layout"]], "bfloat16", tuple(spec["seq_lens"]), tuple(spec["q_lens"] or ()))
            if key not in seen:
                batches.append((f"attention.{op}", spec))
    decode_left = [b for b in batches if b[0] == "attention.decode"]
    extend_left = [b for b in batches if b[0] == "attention.extend"]
    ratio = max(1, len(decode_left) // max(1, len(extend_left)))
    ordered = []
    while decode_left or extend_left:
        ordered += decode_left[:ratio] + extend_left[:1]
        decode_left, extend_left = decode_left[ratio:], extend_left[1:]
    return ordered


def backends_to_time(skip: tuple[str, ...] = ()) -> list[str]:
    """The backends registered for either attention op, in registration order, less those in `skip`."""
    from autosel.registry import registry

    return list(dict.fromkeys(s.backend.value for op in ("attention.decode", "attention.extend")
                              for s in registry.get(op) if s.backend.value not in skip))


def run(batches: list[tuple[str, dict]], *, seed: int, rounds: int = 5, check_tokens: int = 65536,
        skip: tuple[str, ...] = (), deadline_s: float = math.inf, device: str = "cuda",
        on_step: Callable[[str], None] = lambda step: None,
        on_batch: Callable[[dict], None] = lambda body: None) -> dict:
    """Time every batch of `batches` (held_out_batches) on each backend and autosel's choice, eager and (on CUDA)
    graph; return the result file's body. After every batch, on_batch gets the body so far, so that a caller can
    keep a working copy a killed run leaves behind. No batch starts after `deadline_s`. Where autosel cannot choose
    for an op and mode (AUTOSEL_TUNE=off and no decision it can use), its ValueError is raised before any batch:
    every batch of that op and mode would fail with it."""
    import autosel
    from autosel import config
    from autosel.registry import registry

    started = time.time()
    settings = config.settings()
    backends = backends_to_time(skip)
    modes = ("eager", "graph") if device == "cuda" else ("eager",)
    for op, mode in dict.fromkeys((op, mode) for op, _ in batches for mode in modes):
        autosel.get_kernel(op, mode=mode)
    body = {"seed": seed, "rounds": rounds, "margins": MARGIN, "backends": backends, "device": device,
            "db": str(settings.db), "tune": settings.tune, "batches": len(batches), "rows": []}

    def measure(item):
        op, spec = item
        eligible = [b for b in backends if any(s.backend.value == b for s in registry.get(op))]
        return time_batch(op, spec, eligible, rounds, check_tokens, device, modes)

    return rows_in_turn(batches, measure, body=body, unit="batches", started=started, deadline_s=deadline_s,
                        device=device, label=lambda item: f"{item[0].split('.')[1]} {describe(item[1])}",
                        failed=lambda item: {"op": item[0], "batch": describe(item[1])}, finish=finish,
                        on_step=on_step, on_row=on_batch)


def rows_in_turn(todo: list, measure: Callable[[Any], dict], *, body: dict, unit: str, started: float,
                 deadline_s: float, device: str, label: Callable[[Any], str], failed: Callable[[Any], dict],
                 finish: Callable[[dict], dict], on_step: Callable[[str], None],
                 on_row: Callable[[dict], None]) -> dict:
    """measure() each item of `todo` into body["rows"], starting none after `deadline_s` from `started`: an item
    that raises (out of memory) is a row with its error and the others go on; the CUDA cache is emptied after each
    (its caches and plans went with measure's frame), and on_row gets the finished body so far, marked a working
    copy. A CUDA error that leaves the device unusable (a device-side assert is sticky: every later call fails with
    it) stops the run after its item, named in body["device_error"]. Returns the finished body (both attention
    benchmarks run this way)."""
    for item in todo:
        if time.time() - started > deadline_s:
            body["cut_at_deadline"] = f"{len(body['rows'])} of {len(todo)} {unit}"
            break
        on_step(label(item))
        try:
            row = measure(item)
        except Exception as exc:  # noqa: BLE001 - one item failing is a result
            log.warning("%s failed:\n%s", label(item), traceback.format_exc())
            row = {**failed(item), "error": f"{type(exc).__name__}: {exc}"[:300]}
        body["rows"].append(row)
        body["wall_s"] = round(time.time() - started, 1)
        broken = device_broken() if device == "cuda" else None
        if broken is not None:
            body["device_error"] = (f"{broken} (after {label(item)}); the {len(todo) - len(body['rows'])} {unit} "
                                    "after it were not run: a process cannot use the device again after such an "
                                    "error, so run them in a new one")
            log.error("stopped: %s", body["device_error"])
            break
        on_row(finish({**body, "working_copy": True}))
    return finish(body)


def device_broken() -> str | None:
    """The CUDA error this process's device is stuck in (a device-side assert, an illegal address), or None when it
    still runs work; empties the CUDA cache when it does. A sticky error is raised again by every later call, so
    waiting for the device is enough to find it (an error that is not sticky was cleared when it was raised)."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    except Exception as exc:  # noqa: BLE001 - torch.AcceleratorError from torch 2.8 on, RuntimeError before
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return None


def finish(body: dict) -> dict:
    """The summary, tables and notes of `body` from its rows (also what dev/carry_attention_results.py gives a run
    of the former tool)."""
    body["summary"] = summary([r for r in body["rows"] if "error" not in r], body["backends"])
    body["tables"], body["notes"] = tables(body), notes(body)
    return body


def _ratio_cell(entry: dict | None) -> str:
    if not entry:
        return "-"
    if "geomean_where_run" in entry:
        return f"({entry['geomean_where_run']:.3f}, {entry['missing']} not run)"
    return f"{entry['geomean']:.3f} / {entry['worst']:.3f}" if entry["batches"] else "-"


def tables(body: dict) -> list[dict]:
    """The page's table of one run (autosel.bench.page renders it): per op and mode, autosel's and each fixed
    backend's time over the per-batch best, autosel over the best fixed backend, and the leaders beyond the margin."""
    rows = [[s["op"], s["mode"], s["batches"], _ratio_cell(s.get("autosel")),
             *(_ratio_cell(s.get(b)) for b in body["backends"]), s.get("best_fixed", "-"),
             f"{s['autosel_over_best_fixed']:.3f}" if "autosel_over_best_fixed" in s else "-",
             s["led_beyond_margin"], s["autosel_ran_a_leader"]] for s in body["summary"]]
    return [{"title": "Time over the per-batch best (1.000: the fastest backend on that batch), geometric mean / "
                      "worst; (geometric mean, batches not run) for a backend that could not run every batch:",
             "columns": ["op", "mode", "batches", "autosel", *body["backends"], "best fixed backend",
                         "autosel / best fixed", "batches a backend led another beyond the margin every round",
                         "of those, autosel ran a backend none led"],
             "rows": rows}]


def stop_notes(body: dict, planned: str) -> list[str]:
    """How a run of either attention benchmark ended short, if it did: at its deadline, on a CUDA error, or killed
    (a working copy); `planned` is what it set out to measure ("48 batches")."""
    found = []
    if body.get("cut_at_deadline"):
        found.append(f"cut at its deadline: {body['cut_at_deadline']} measured")
    if body.get("device_error"):
        found.append(f"stopped by a CUDA error: {body['device_error']}")
    if body.get("working_copy"):
        found.append(f"working copy of a run that did not finish: {len(body['rows'])} of {planned}")
    return found


def notes(body: dict) -> list[str]:
    """The page's notes of one run: what was timed and how, a cut at the deadline, and the batches where a backend
    led autosel's choice beyond the margin in every round."""
    found = [f"{len(body['rows'])} held-out batches of seed {body['seed']} (none a representative batch), "
             f"{body['rounds']} interleaved round(s) with the common drift taken out; margins: "
             + ", ".join(f"{mode} {100 * m:.0f}%" for mode, m in body["margins"].items())
             + f"; decisions read from {body['db']} with AUTOSEL_TUNE={body['tune']}"]
    found += stop_notes(body, f"{body['batches']} batches")
    failed = [r["batch"] for r in body["rows"] if "error" in r]
    if failed:
        found.append(f"{len(failed)} batches failed as a whole (their error is in the result file): "
                     + "; ".join(failed))
    for s in body["summary"]:
        mode = s["mode"]
        led = [r for r in body["rows"] if r.get("op") == s["op"] and r.get(f"{mode}_led_by")]
        if led:
            found.append(f"{s['op']} {mode}: a backend led autosel's choice beyond the margin in every round at "
                         + "; ".join(f"{r['batch']} ({r[f'autosel_{mode}']} led by {', '.join(r[f'{mode}_led_by'])})"
                                     for r in led))
    return found
