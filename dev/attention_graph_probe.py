"""How the graph-mode time of a paged decode plan depends on what runs just before it, on the GPU machine.

A tune times graph replays of `write q; plan.run(...)` less the writes' own replays (autosel.tuner._after_writing),
the held-out benchmark replays `plan.run(...)` back to back, and a model step runs it after the kernel that wrote
its inputs. This times each decode backend on small batches in four ways, in one graph per (backend, way), the
replays taking turns over the rounds:

- back_to_back: plan.run alone (the held-out benchmark's way);
- after_copy: q.copy_(q0) then plan.run, less the copies alone (the tuner's way: a same-dtype copy of a contiguous
  tensor is a memcpy, a copy-engine node in the graph);
- after_kernel: torch.mul(q0, 1, out=q), an elementwise kernel, then plan.run, less the kernels alone;
- after_gemv: q = h @ w_q (Llama-3-8B's query projection) then plan.run, less the projections alone;

Prints a table and writes $OUT/attention_graph_probe.json. On an H100 the first three agreed within 0.6 us at
batch 1-39; the H200's tune and held-out benchmark had differed by up to 1.8 us at batch 1.

    . dev/gpu_env.sh && python3 dev/attention_graph_probe.py     (dev/attention_heldout_run.sh runs it first)
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

import autosel
from autosel.bench.attention_heldout import COPY_BYTES, LAYOUTS
from autosel.ops import attention as att
from autosel.timing import common_drift_removed, graph_sampler

BACKENDS = ("flashinfer", "sgl_kernel", "triton")
# (layout, seq_lens): the held-out batches where the tune's graph timing and the held-out benchmark disagreed, and
# two where they agreed.
BATCHES = [("llama3-8b", [1024]), ("llama3-8b", [2383] * 2), ("llama3-8b", [262] * 3), ("mqa-48/1", [3416]),
           ("gemma2-9b", [3763] * 4), ("llama3-8b", [4389] * 6), ("llama3-8b", [792] * 39),
           ("llama3-8b", [7485] * 26), ("llama3-8b", [8192] * 64)]
ROUNDS = 7


def probe_batch(layout: str, seq_lens: list[int]) -> dict:
    heads, kv_heads, head_dim, page = LAYOUTS[layout]
    batch, k0, v0 = att.make_batch(seq_lens=seq_lens, q_lens=None, page_size=page, q_heads=heads, kv_heads=kv_heads,
                                   head_dim=head_dim, dtype=torch.bfloat16, device="cuda")
    copies = max(1, min(8, -(-COPY_BYTES // (2 * k0.numel() * k0.element_size()))))
    ks, vs = [k0] + [k0.clone() for _ in range(copies - 1)], [v0] + [v0.clone() for _ in range(copies - 1)]
    q = torch.randn(batch.total_q, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    q0 = q.clone()
    h = torch.randn(batch.total_q, 4096, device="cuda", dtype=torch.bfloat16)
    w_q = torch.randn(4096, heads * head_dim, device="cuda", dtype=torch.bfloat16) * 4096 ** -0.5
    q_flat = q.view(batch.total_q, heads * head_dim)
    writes = {"copy": lambda: q.copy_(q0), "kernel": lambda: torch.mul(q0, 1, out=q),
              "gemv": lambda: torch.matmul(h, w_q, out=q_flat)}
    calls = {f"{w} alone": fn for w, fn in writes.items()}
    plans = {}
    for name in BACKENDS:
        planner = autosel.get_kernel("attention.decode", backend=name)
        if planner.unsupported(batch):
            continue
        plans[name] = plan = planner.plan(batch)
        turn = [0]

        def run(plan=plan, turn=turn):
            turn[0] = (turn[0] + 1) % copies
            return plan.run(q, ks[turn[0]], vs[turn[0]])
        calls[f"{name} back_to_back"] = run
        for w, write in writes.items():
            calls[f"{name} after_{w}"] = lambda write=write, run=run: (write(), run())
    samplers = {key: graph_sampler(fn) for key, fn in calls.items()}
    times = {key: [] for key in samplers}
    for r in range(ROUNDS):
        keys = list(samplers)
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            times[key].append(samplers[key]())
    adjusted = dict(zip(times, common_drift_removed(list(times.values()))))
    median = {key: statistics.median(ts) for key, ts in adjusted.items()}
    row = {"layout": layout, "seq_lens": seq_lens, "us": {}}
    for name in plans:
        row["us"][name] = {"back_to_back": median[f"{name} back_to_back"],
                           **{f"after_{w}": median[f"{name} after_{w}"] - median[f"{w} alone"] for w in writes}}
    row["writes_alone_us"] = {w: median[f"{w} alone"] for w in writes}
    return row


def main() -> int:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rounds": ROUNDS, "batches": []}
    print(f"{'batch':28} {'backend':11} {'back_to_back':>12} {'after_copy':>10} {'after_kernel':>12} "
          f"{'after_gemv':>10}", flush=True)
    for layout, seq in BATCHES:
        row = probe_batch(layout, seq)
        out["batches"].append(row)
        label = f"{layout} b{len(seq)} kv{seq[0]}"
        for name, us in row["us"].items():
            print(f"{label:28} {name:11} {us['back_to_back']:12.2f} {us['after_copy']:10.2f} "
                  f"{us['after_kernel']:12.2f} {us['after_gemv']:10.2f}", flush=True)
        print(f"{label:28} {'(alone)':11} " + " ".join(f"{w} {t:.2f}" for w, t in row["writes_alone_us"].items()),
              flush=True)
        torch.cuda.empty_cache()
    path = os.path.join(os.environ.get("OUT", "."), "attention_graph_probe.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
