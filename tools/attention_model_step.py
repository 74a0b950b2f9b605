"""A model step's attention through autosel's planned ops: Llama-3-8B's 32 attention blocks (RMSNorm, QKV projection,
the new token's K/V written into a paged cache, paged attention, output projection, residual; random weights) run
with one plan per step, on autosel's choice and on each fixed backend. Decode is replayed from a CUDA graph
(batch 1-256, KV 1k-32k), extend runs eager (512-8192 new tokens). Writes attention_model_step.{json,md} to --out.

    AUTOSEL_DB=<the tune's DB> AUTOSEL_TUNE=off python3 tools/attention_model_step.py --out results/attention_h200

What is left out, so that attention's share of the step is what differs: the MLP, rotary embedding, sampling, and
autosel's cheap ops (the norms run torch's rms_norm here). Layers read distinct K/V caches where 48 GB holds them,
else the caches cycle (a layer's cache is then over 50 MB, the L2, so reading one again gains nothing).
The backends' steps take turns replay by replay over --rounds rounds, as in a tune (autosel.timing).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from attention_heldout import backend_of_plan, commit, versions  # noqa: E402

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, PAGE = 4096, 32, 32, 8, 128, 16
DECODE_BATCHES, DECODE_KV, MAX_TOKENS = (1, 8, 32, 64, 128, 256), (1024, 4096, 16384, 32768), 1 << 20
EXTEND = [(1, 512), (1, 2048), (1, 8192), (4, 2048)]  # (sequences, new tokens each), empty prefix
CACHE_BYTES = 48 << 30


def _platform() -> str:
    from autosel.platforms import current_platform

    return str(current_platform())


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
            traceback.print_exc()
    times = {name: [] for name in steps}
    for r in range(rounds):
        order = list(steps)
        for name in order[r % len(order):] + order[:r % len(order)]:
            times[name].append(steps[name]())
    names = list(times)
    adjusted = dict(zip(names, common_drift_removed([times[n] for n in names]))) if names else {}
    row["step_us"] = {n: round(statistics.median(ts), 1) for n, ts in adjusted.items()}
    row["rounds_us"] = {n: [round(t, 1) for t in ts] for n, ts in adjusted.items()}
    return row  # its caches and graphs go with this frame; main empties the CUDA cache after it


def model_layers(model) -> int:
    return len(model.wqkv)


def markdown(result) -> str:
    names = result["backends"]
    lines = [f"# Llama-3-8B attention step, {result['device']}, {result['date']}", "",
             f"`{result['command']}` at {result['commit']}; DB {result['db']}; {result['layers']} layers; median us "
             "per step (* autosel's choice; ratio: autosel over the best fixed backend of the row)", "",
             "| op | mode | batch | kv | new | " + " | ".join(names) + " | autosel / best |",
             "|---|---|---|---|---|" + "---|" * len(names) + "---|"]
    for r in result["rows"]:
        t = r.get("step_us", {})
        if not t:
            lines.append(f"| {r['op']} | {r.get('mode')} | {r.get('batch')} | {r.get('kv')} | - | error: "
                         f"{r.get('error', r.get('errors'))} |")
            continue
        best = min(t.values())
        ratio = f"{t[r['autosel']] / best:.3f}" if r["autosel"] in t else f"{r['autosel']} not timed"
        lines.append(f"| {r['op'].split('.')[1]} | {r['mode']} | {r['batch']} | {r['kv']} | {r['new']} | "
                     + " | ".join((f"{t[n]:.0f}" + ("*" if n == r["autosel"] else "")) if n in t else "-"
                                  for n in names) + f" | {ratio} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--skip", default="torch_compile", help="backends not to time, comma-separated")
    parser.add_argument("--slow-max-tokens", type=int, default=65536,
                        help="time torch and torch_compile only where the batch holds at most this many KV tokens")
    parser.add_argument("--deadline-s", type=float, default=math.inf)
    parser.add_argument("--device", default="cuda",
                        help="cuda, or cpu: a check of this script (the smallest decode and extend rows, eager)")
    args = parser.parse_args(argv)
    import torch

    from autosel.registry import registry

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    skip = set(filter(None, args.skip.split(",")))
    model = Model(args.layers, args.device)
    rows_todo = [("attention.decode", [kv] * b, None, "graph") for kv in DECODE_KV for b in DECODE_BATCHES
                 if b * kv <= MAX_TOKENS]
    rows_todo += [("attention.extend", [new] * s, [new] * s, "eager") for s, new in EXTEND]
    if args.device == "cpu":
        rows_todo = [("attention.decode", [DECODE_KV[0]] * 2, None, "eager"),
                     ("attention.extend", [EXTEND[0][1]], [EXTEND[0][1]], "eager")]
    backends = list(dict.fromkeys(s.backend.value for op in ("attention.decode", "attention.extend")
                                  for s in registry.get(op) if s.backend.value not in skip))
    result = {"command": " ".join([sys.executable] + sys.argv), "commit": commit(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "versions": versions(), "platform": _platform(),
              "db": os.environ.get("AUTOSEL_DB", "default"), "layers": args.layers, "rounds": args.rounds,
              "backends": backends, "rows": []}
    for op, seq, new, mode in rows_todo:
        if time.time() - started > args.deadline_s:
            result["cut_at_deadline"] = f"{len(result['rows'])} of {len(rows_todo)} rows"
            break
        eligible = [b for b in backends if any(s.backend.value == b for s in registry.get(op))]
        try:
            row = run_row(model, op, seq, new, mode, eligible, args.rounds, args.slow_max_tokens)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            row = {"op": op, "mode": mode, "batch": len(seq), "kv": seq[0], "error": f"{type(exc).__name__}: {exc}"}
        if args.device == "cuda":
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(json.dumps({k: row.get(k) for k in ("op", "batch", "kv", "autosel", "step_us", "errors")}), flush=True)
        result["wall_s"] = round(time.time() - started, 1)
        (args.out / "attention_model_step.json").write_text(json.dumps(result, indent=1))
        (args.out / "attention_model_step.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
