"""A model step's attention through autosel's planned ops (`autosel bench attention-step`): Llama-3-8B's 32 attention
blocks (RMSNorm, QKV projection, the new token's K/V written into a paged cache, paged attention, output projection,
residual; random weights) run with one plan per step, on autosel's choice and on each fixed backend, as the body of
a result file (autosel.bench.results). Decode is replayed from a CUDA graph (batch 1-256, KV 1k-32k), extend runs
eager (512-8192 new tokens).

    autosel tune --op 'attention.*' && AUTOSEL_TUNE=off autosel bench attention-step
    autosel bench attention-step --device cpu --layers 2     # the smallest decode and extend rows, eager

What is left out, so that attention's share of the step is what differs: the MLP, rotary embedding, sampling, and
autosel's cheap ops (the norms run torch's rms_norm here). Layers read distinct K/V caches where 48 GB holds them,
else the caches cycle (a layer's cache is then over 50 MB, the L2, so reading one again gains nothing).
The backends' steps take turns replay by replay over `rounds` rounds, as in a tune (autosel.timing).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
import traceback
from typing import Callable

from autosel.bench.attention_heldout import backend_of_plan, backends_to_time, rows_in_turn, stop_notes

log = logging.getLogger(__name__)

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 32, 8, 128, 16
DECODE_BATCHES, DECODE_KV, MAX_TOKENS = (1, 8, 32, 64, 128, 256), (1024, 4096, 16384, 32768), 1 << 20
EXTEND = [(1, 512), (1, 2048), (1, 8192), (4, 2048)]  # (sequences, new tokens each), empty prefix
CACHE_BYTES = 48 << 30


class Model:
    """The attention blocks' weights; `step(plan, x, caches, slots)` runs all layers with one plan."""

    def __init__(self, layers: int, device: str = "cuda", seed: int = 0):
        import torch

        gen = torch.Generator(device=device).manual_seed(seed)
        qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM

        def weight(rows, cols):
            return (torch.randn(rows, cols, device=device, generator=gen) * rows ** -0.5).to(torch.bfloat16)
        self.wqkv = [weight(HIDDEN, qkv) for _ in range(layers)]
        self.wo = [weight(HEADS * HEAD_DIM, HIDDEN) for _ in range(layers)]
        self.norm = [torch.ones(HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(layers)]
        self.device = device

    def step(self, plan, x, caches, slots):
        import torch.nn.functional as F

        tokens = x.shape[0]
        for layer, (wqkv, wo, norm) in enumerate(zip(self.wqkv, self.wo, self.norm)):
            k_cache, v_cache = caches[layer % len(caches)]
            h = F.rms_norm(x, (HIDDEN,), norm, 1e-5)
            q, k, v = (h @ wqkv).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
            k_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k.reshape(tokens, KV_HEADS, HEAD_DIM))
            v_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v.reshape(tokens, KV_HEADS, HEAD_DIM))
            attn = plan.run(q.reshape(tokens, HEADS, HEAD_DIM), k_cache, v_cache)
            x = x + attn.reshape(tokens, HEADS * HEAD_DIM) @ wo
        return x


def new_token_slots(batch):
    """The flat cache slots ([pages * page_size]) of each sequence's new tokens, in query order."""
    import torch

    table = batch.page_table.cpu()
    slots = []
    for b, (seq, new) in enumerate(zip(batch.seq_lens_list, batch.q_lens_list)):
        for pos in range(seq - new, seq):
            slots.append(int(table[b, pos // batch.page_size]) * batch.page_size + pos % batch.page_size)
    return torch.tensor(slots, dtype=torch.long, device=batch.page_table.device)


def run_row(model, op: str, seq_lens, q_lens, mode: str, backends, rounds: int, slow_max_tokens: int) -> dict:
    import torch

    import autosel
    from autosel.ops import attention as att
    from autosel.timing import block_sampler, common_drift_removed, graph_sampler, synchronize

    device = model.device
    batch, k0, v0 = att.make_batch(seq_lens=seq_lens, q_lens=q_lens, page_size=PAGE, q_heads=HEADS,
                                   kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16, device=device)
    per_layer = 2 * k0.numel() * k0.element_size()
    distinct = max(1, min(model_layers(model), CACHE_BYTES // per_layer))
    caches = [(k0, v0)] + [(k0.clone(), v0.clone()) for _ in range(distinct - 1)]
    slots = new_token_slots(batch)
    x = torch.randn(batch.total_q, HIDDEN, device=device, dtype=torch.bfloat16)
    row = {"op": op, "mode": mode, "batch": len(seq_lens), "kv": seq_lens[0], "new": (q_lens or [1])[0],
           "distinct_caches": distinct, "errors": {}, "plan_ms": {}}
    chosen = autosel.get_kernel(op, mode=mode).plan(batch)
    row["autosel"] = backend_of_plan(chosen)
    del chosen
    steps = {}
    for name in backends:
        if name in ("torch", "torch_compile") and batch.total_kv > slow_max_tokens:
            row["errors"][name] = f"not timed: {batch.total_kv} KV tokens > --slow-max-tokens"
            continue
        try:
            planner = autosel.get_kernel(op, backend=name)
            if planner.unsupported(batch):
                continue
            synchronize(device)
            began = time.perf_counter()
            plan = planner.plan(batch)  # once per step: every layer runs it
            synchronize(device)
            row["plan_ms"][name] = round(1000 * (time.perf_counter() - began), 3)
            steps[name] = (block_sampler if mode == "eager" else graph_sampler)(
                lambda plan=plan: model.step(plan, x, caches, slots))
        except Exception as exc:  # noqa: BLE001 - a backend failing is a result
            row["errors"][name] = f"{type(exc).__name__}: {exc}"[:300]
            log.warning("%s on %s batch %d kv %d failed:\n%s", name, op, len(seq_lens), seq_lens[0],
                        traceback.format_exc())
    times = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps)
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(steps[name]())
    names = list(times)
    adjusted = dict(zip(names, common_drift_removed([times[n] for n in names]))) if names else {}
    row["step_us"] = {n: round(statistics.median(ts), 1) for n, ts in adjusted.items()}
    row["rounds_us"] = {n: [round(t, 1) for t in ts] for n, ts in adjusted.items()}
    return row  # its caches and graphs go with this frame; rows_in_turn empties the CUDA cache after it


def model_layers(model) -> int:
    return len(model.wqkv)


def rows_to_run(device: str) -> list[tuple[str, list[int], list[int] | None, str]]:
    """(op, KV lengths, new tokens per sequence or None for decode, mode) of each row: on CUDA the grid above, on
    the CPU its smallest decode and extend rows, eager (a check of the benchmark's logic)."""
    if device == "cpu":
        return [("attention.decode", [DECODE_KV[0]] * 2, None, "eager"),
                ("attention.extend", [EXTEND[0][1]], [EXTEND[0][1]], "eager")]
    rows = [("attention.decode", [kv] * b, None, "graph") for kv in DECODE_KV for b in DECODE_BATCHES
            if b * kv <= MAX_TOKENS]
    return rows + [("attention.extend", [new] * s, [new] * s, "eager") for s, new in EXTEND]


def run(*, layers: int = LAYERS, rounds: int = 5, skip: tuple[str, ...] = ("torch_compile",),
        slow_max_tokens: int = 65536, deadline_s: float = math.inf, device: str = "cuda",
        on_step: Callable[[str], None] = lambda step: None,
        on_row: Callable[[dict], None] = lambda body: None) -> dict:
    """Time each row's step on autosel's choice and every fixed backend; return the result file's body. After every
    row, on_row gets the body so far (a working copy a killed run leaves behind). No row starts after `deadline_s`.
    Where autosel cannot choose for an op and mode (AUTOSEL_TUNE=off and no decision it can use), its ValueError is
    raised before any row: every row of that op and mode would fail with it."""
    import autosel
    from autosel import config
    from autosel.registry import registry

    started = time.time()
    settings = config.settings()
    backends = backends_to_time(skip)
    todo = rows_to_run(device)
    for op, mode in dict.fromkeys((item[0], item[3]) for item in todo):
        autosel.get_kernel(op, mode=mode)
    model = Model(layers, device)
    body = {"layers": layers, "rounds": rounds, "backends": backends, "device": device, "db": str(settings.db),
            "tune": settings.tune, "slow_max_tokens": slow_max_tokens, "planned_rows": len(todo), "rows": []}

    def measure(item):
        op, seq, new, mode = item
        eligible = [b for b in backends if any(s.backend.value == b for s in registry.get(op))]
        return run_row(model, op, seq, new, mode, eligible, rounds, slow_max_tokens)

    return rows_in_turn(todo, measure, body=body, unit="rows", started=started, deadline_s=deadline_s, device=device,
                        label=lambda item: f"{item[0].split('.')[1]} batch {len(item[1])} kv {item[1][0]} {item[3]}",
                        failed=lambda item: {"op": item[0], "mode": item[3], "batch": len(item[1]), "kv": item[1][0],
                                             "new": (item[2] or [1])[0]},
                        finish=finish, on_step=on_step, on_row=on_row)


def finish(body: dict) -> dict:
    """The tables and notes of `body` from its rows (also what dev/carry_attention_results.py gives a run of the
    former tool)."""
    body["tables"], body["notes"] = tables(body), notes(body)
    return body


def tables(body: dict) -> list[dict]:
    """The page's table of one run: per row the step time on each fixed backend, the backend autosel ran, and
    autosel's step over the best fixed backend's."""
    rows = []
    for r in body["rows"]:
        times = r.get("step_us") or {}
        cells = [f"{times[b]:,.0f}" if b in times else "-" for b in body["backends"]]
        if not times:
            ratio = f"error: {r.get('error') or r.get('errors')}"
        elif r.get("autosel") in times:
            ratio = f"{times[r['autosel']] / min(times.values()):.3f}"
        else:
            ratio = f"{r.get('autosel')}: not timed"
        rows.append([r["op"].split(".")[1], r["mode"], r["batch"], r["kv"], r.get("new", "-"),
                     r.get("autosel") or "-", *cells, ratio])
    return [{"title": f"Median µs per step of {body['layers']} attention blocks; autosel's step is that of the "
                      "backend it ran; autosel / best: its step over the fastest fixed backend's on that row:",
             "columns": ["op", "mode", "sequences", "KV tokens each", "new tokens each", "autosel ran",
                         *body["backends"], "autosel / best"],
             "rows": rows}]


def notes(body: dict) -> list[str]:
    """The page's notes of one run: how it was timed, what was not, and a cut at the deadline."""
    found = [f"{body['rounds']} interleaved round(s) with the common drift taken out; decisions read from "
             f"{body['db']} with AUTOSEL_TUNE={body['tune']}"
             + (f"; torch and torch_compile timed only up to {body['slow_max_tokens']:,} KV tokens a batch"
                if body.get("slow_max_tokens") else "")]
    found += stop_notes(body, f"{body['planned_rows']} rows")
    failed = [f"{r['op']} batch {r['batch']} kv {r['kv']}: {', '.join(r['errors'])}" for r in body["rows"]
              if r.get("errors")]
    if failed:
        found.append("backends that failed or were not timed (reasons in the result file): " + "; ".join(failed))
    return found
