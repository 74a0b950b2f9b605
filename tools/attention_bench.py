"""Paged attention backends side by side on one GPU: median time of every backend's plan.run for decode (batch 1-256,
KV 1k-32k) and extend (512-8192 new tokens, on an empty and a 4k prefix) at Llama-3-8B's heads (32 query, 8 KV,
head_dim 128, bf16, page size 16), eager and replayed in a CUDA graph. Writes attention_bench.json (with command,
commit, versions, platform and date) and attention_bench.md to --out.

    python3 tools/attention_bench.py --out results/attention_h200

Timing is triton.testing.do_bench / do_bench_cudagraph (median, L2 flushed between eager calls). The first run of each
backend in the process also records its plan and first-call seconds, which include flashinfer's JIT compile and
Triton's when their caches are cold ("first_call_s"; the JSON says which modules were already built).
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from paged_attention_cases import TOL, make_batch, make_q, reference  # noqa: E402

BACKENDS = {"triton": "autosel.ops.attention_triton", "flashinfer": "autosel.ops.attention_flashinfer",
            "fa3": "autosel.ops.attention_fa3"}
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DECODE_BATCHES = (1, 8, 32, 64, 128, 256)
DECODE_KV = (1024, 4096, 16384, 32768)
# Batches whose sequences differ in length: (label, lengths), lengths log-uniform between the bounds (seeded).
DECODE_MIXED = [("32 of 128-32k", 32, 128, 32768), ("128 of 512-8k", 128, 512, 8192), ("64 of 1k-32k", 64, 1024, 32768)]
EXTEND = [(1, 512, 0), (1, 2048, 0), (1, 8192, 0), (1, 512, 4096), (1, 2048, 4096), (1, 8192, 4096),
          (4, 512, 1024), (4, 2048, 0)]  # (sequences, new tokens each, prefix each)


def versions() -> dict:
    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "flashinfer", "sgl_kernel"):
        try:
            out[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception as exc:  # noqa: BLE001 - a missing vendor is a fact of the run
            out[name] = f"unavailable: {type(exc).__name__}: {exc}"
    return out


def time_plan(plan, q, k_cache, v_cache, *, graph: bool) -> float:
    import triton.testing

    fn = lambda: plan.run(q, k_cache, v_cache)  # noqa: E731
    if graph:
        return 1000 * triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return 1000 * triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def bench_point(op: str, batch, k_cache, v_cache, q, modules: dict, first: set, check: bool,
                label: str | None = None) -> list[dict]:
    rows = []
    expected = reference(q, k_cache, v_cache, batch) if check else None
    for name, module in modules.items():
        row = {"op": op, "backend": name, "batch": len(batch.seq_lens_list), "q_lens": sorted(set(batch.q_lens_list)),
               "seq_lens": batch.seq_lens_list if label else sorted(set(batch.seq_lens_list))}
        if label:
            row["mixed"] = label
        reason = module.supports(batch)
        if reason is not None:
            rows.append(row | {"declined": reason})
            continue
        plan_cls = module.DecodePlan if op == "decode" else getattr(module, "ExtendPlan", None)
        if plan_cls is None:
            continue
        try:
            began = time.perf_counter()
            plan = plan_cls(batch)
            plan_s = time.perf_counter() - began
            out = plan.run(q, k_cache, v_cache)
            torch.cuda.synchronize()
            if name not in first:
                first.add(name)
                row["first_call_s"] = round(time.perf_counter() - began, 3)
            row["plan_ms"] = round(1000 * plan_s, 3)
            if expected is not None:
                row["max_abs_err"] = float((out.float() - expected.float()).abs().max())
                rtol, atol = TOL[batch.dtype]
                row["close"] = bool(torch.allclose(out.float(), expected.float(), rtol=rtol, atol=atol))
            row["eager_us"] = round(time_plan(plan, q, k_cache, v_cache, graph=False), 2)
            graph_plan = plan_cls(batch, cuda_graph=True) if name == "flashinfer" else plan
            row["graph_us"] = round(time_plan(graph_plan, q, k_cache, v_cache, graph=True), 2)
        except Exception as exc:  # noqa: BLE001 - a failing backend is a result, the others still run
            row["error"] = f"{type(exc).__name__}: {exc}"[:500]
            traceback.print_exc()
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _key(row: dict) -> tuple:
    """(op, batch, KV length(s), query length(s)) as the table shows them; a mixed batch by its label."""
    kv = f"mixed {row['mixed']}" if "mixed" in row else "/".join(map(str, row["seq_lens"]))
    return row["op"], row["batch"], kv, "/".join(map(str, row["q_lens"]))


def table(rows: list[dict]) -> str:
    names = list(BACKENDS)
    lines = []
    for mode in ("graph_us", "eager_us"):
        lines += [f"\n### {mode[:-3]} (median us)\n", "| op | batch | kv | q | " + " | ".join(names) + " | best |",
                  "|---|---|---|---|" + "---|" * (len(names) + 1)]
        keys = []
        for r in rows:
            if _key(r) not in keys:
                keys.append(_key(r))
        for k in keys:
            cells = {r["backend"]: r.get(mode) for r in rows if _key(r) == k}
            timed = {n: v for n, v in cells.items() if isinstance(v, (int, float))}
            best = min(timed, key=timed.get) if timed else "-"
            lines.append(f"| {k[0]} | {k[1]} | {k[2]} | {k[3]} | "
                         + " | ".join(f"{cells[n]:.1f}" if isinstance(cells.get(n), (int, float)) else "-"
                                      for n in names) + f" | {best} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--backends", default=",".join(BACKENDS))
    parser.add_argument("--ops", default="decode,extend")
    parser.add_argument("--check-up-to", type=int, default=65536,
                        help="check outputs against the fp32 reference where the batch holds at most this many KV tokens")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    modules = {}
    for name in args.backends.split(","):
        try:
            modules[name] = importlib.import_module(BACKENDS[name])
        except Exception as exc:  # noqa: BLE001
            print(f"{name}: not importable ({type(exc).__name__}: {exc})", flush=True)
    started = time.time()
    rows: list[dict] = []
    first: set = set()
    ops = args.ops.split(",")
    if "decode" in ops:
        for kv in DECODE_KV:
            for bs in DECODE_BATCHES:
                batch, k, v = make_batch(seq_lens=[kv] * bs, page_size=PAGE, num_q_heads=HEADS, num_kv_heads=KV_HEADS,
                                         head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda", fill=False)
                q = make_q(batch)
                rows += bench_point("decode", batch, k, v, q, modules, first, check=bs * kv <= args.check_up_to)
                del k, v
                torch.cuda.empty_cache()
    if "decode" in ops:
        gen = torch.Generator().manual_seed(0)
        for label, bs, low, high in DECODE_MIXED:
            lens = torch.exp(torch.empty(bs).uniform_(float(torch.tensor(low).log()), float(torch.tensor(high).log()),
                                                      generator=gen)).round().int().tolist()
            batch, k, v = make_batch(seq_lens=lens, page_size=PAGE, num_q_heads=HEADS, num_kv_heads=KV_HEADS,
                                     head_dim=HEAD_DIM, dtype=torch.bfloat16, device="cuda", fill=False)
            rows += bench_point("decode", batch, k, v, make_q(batch), modules, first,
                                check=sum(lens) <= args.check_up_to, label=label)
            del k, v
    if "extend" in ops:
        for seqs, new, prefix in EXTEND:
            batch, k, v = make_batch(seq_lens=[prefix + new] * seqs, q_lens=[new] * seqs, page_size=PAGE,
                                     num_q_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.bfloat16,
                                     device="cuda", fill=False)
            q = make_q(batch, decode=False)
            rows += bench_point("extend", batch, k, v, q, modules, first, check=new * (prefix + new) <= 2 ** 25)
    result = {
        "command": " ".join([sys.executable] + sys.argv),
        "commit": os.environ.get("AUTOSEL_COMMIT", "unknown"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "versions": versions(),
        "platform": _platform(), "wall_s": round(time.time() - started, 1),
        "layout": {"num_q_heads": HEADS, "num_kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE,
                   "dtype": "bfloat16"},
        "rows": rows,
    }
    (args.out / "attention_bench.json").write_text(json.dumps(result, indent=1))
    (args.out / "attention_bench.md").write_text(
        f"# Paged attention backends, {result['device']}, {result['date']}\n\n`{result['command']}` at "
        f"{result['commit']}\n" + table(rows))
    print(table(rows))
    return 0


def _platform() -> str:
    try:
        from autosel.platforms import current_platform

        return str(current_platform())
    except Exception as exc:  # noqa: BLE001
        return f"unknown ({type(exc).__name__})"


if __name__ == "__main__":
    raise SystemExit(main())
