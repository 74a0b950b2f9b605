"""Why eager decisions flip between two tunes on an H200: how far a launch-bound call's time moves between
processes and over time, with the process free to move between cores and pinned to one core near the GPU.

    python tools/host_probe.py --out "$OUT" [--processes 6] [--watch-s 40]   # on the GPU machine

Each child process times the same launch-bound calls (the eager timer autosel tunes with, three interleaved
rounds) and also each call's host-only issue time (autosel.timing.host_and_device_us: the GPU kept busy
by a sleep kernel, so only the host's work is timed). Children alternate unpinned and pinned; one last child repeats its rounds for --watch-s
seconds. Writes probe.jsonl (one line per child) and probe.md (per call: spread of medians across children).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CALLS = [  # (op, shape): launch-bound shapes where eager decisions flipped between tunes
    ("layernorm.fused_add_rmsnorm", {"tokens": 16, "hidden": 5120}),
    ("layernorm.rmsnorm", {"tokens": 128, "hidden": 4096}),
    ("activation.silu_and_mul", {"tokens": 1, "intermediate": 14336}),
]
BACKENDS = ("torch", "triton", "flashinfer", "sgl_kernel")


def child(rounds: int, watch_s: float) -> dict:
    import torch

    from autosel import checks
    from autosel.registry import load_plugins, registry
    from autosel.timing import CudaEagerTimer, host_and_device_us

    load_plugins()
    timer = CudaEagerTimer()
    jobs = []
    for op, shape in CALLS:
        definition = registry.definition(op)
        torch.manual_seed(0)
        base = definition.make_inputs(dict(shape), "cuda")
        for backend in BACKENDS:
            fn = registry.get_backend(op, backend).load()
            call = checks.rotating_call(fn, base, timer.rotate_bytes)
            for _ in range(3):
                call()
            jobs.append((f"{op} {backend}", call))
    out = {"cpu": os.sched_getaffinity(0).__len__(), "eager": {}, "issue": {}, "t": []}
    began = time.perf_counter()
    r = 0
    while r < rounds or time.perf_counter() - began < watch_s:
        out["t"].append(round(time.perf_counter() - began, 1))
        for name, call in jobs[r % len(jobs):] + jobs[:r % len(jobs)]:
            out["eager"].setdefault(name, []).append(statistics.median(timer.measure(call, backend="", shape={})))
            out["issue"].setdefault(name, []).append(host_and_device_us(call)[0])
        r += 1
    return out


def gpu_local_cpus() -> list[int]:
    bus = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().lower()
    path = Path(f"/sys/bus/pci/devices/{bus[4:]}/local_cpulist")
    cpus = []
    for part in path.read_text().strip().split(",") if path.exists() else []:
        lo, _, hi = part.partition("-")
        cpus += range(int(lo), int(hi or lo) + 1)
    return [c for c in cpus if c in os.sched_getaffinity(0)] or sorted(os.sched_getaffinity(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--processes", type=int, default=6, help="children per setting (unpinned, pinned)")
    parser.add_argument("--watch-s", type=float, default=40.0)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.rounds, args.watch_s)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    local = gpu_local_cpus()
    pin = local[len(local) // 2]
    rows = []
    settings = [("free", None), (f"pinned to cpu {pin}", pin)] * args.processes + [("free, watched", None)]
    for label, core in settings:
        cmd = [sys.executable, __file__, "--child", "--watch-s", str(args.watch_s if "watched" in label else 0)]
        if core is not None:
            cmd = ["taskset", "-c", str(core)] + cmd
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            print(label, "failed:", done.stderr[-2000:], flush=True)
            continue
        row = dict(json.loads(done.stdout.strip().splitlines()[-1]), setting=label,
                   loadavg=os.getloadavg()[0])
        rows.append(row)
        print(label, {k: [round(x, 1) for x in v] for k, v in row["eager"].items()}, flush=True)
    with open(args.out / "probe.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    lines = [f"GPU-local cpus {local}; pinned children ran on cpu {pin}.", "",
             "| call | setting | eager medians across children (us): min / median / max | host issue (us) |",
             "|---|---|---|---|"]
    for name in rows[0]["eager"] if rows else []:
        for label in ("free", f"pinned to cpu {pin}"):
            e = [statistics.median(r["eager"][name]) for r in rows if r["setting"] == label]
            h = [statistics.median(r["issue"][name]) for r in rows if r["setting"] == label]
            if e:
                lines.append(f"| {name} | {label} | {min(e):.1f} / {statistics.median(e):.1f} / {max(e):.1f} "
                             f"| {min(h):.1f} / {statistics.median(h):.1f} / {max(h):.1f} |")
    (args.out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
