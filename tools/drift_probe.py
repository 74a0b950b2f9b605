"""Where two fresh tunes' ratios of the same two candidates come apart: inside one process, or between
processes, and whether fresh input buffers (new addresses) inside one process reproduce the between-process
spread.

Each of --processes child processes times backends A and B of one op at one shape --repeats times with
autosel's timer for the device and mode, and prints A's time over B's per repeat, in three settings:

- alone:    A measured, then B (timer.measure), on the same inputs: how tunes measured before 2026-11-30
- together: A and B measured block by block in turn (timing.measure_together), as tunes do now
- redraw:   as together, each repeat on inputs allocated anew behind pads of random size (new addresses)

    python tools/drift_probe.py --op layernorm.rmsnorm --backends triton,sgl_kernel \\
        --shape '{"tokens": 1, "hidden": 4096}' --mode graph          # on the GPU machine
    python tools/drift_probe.py --op activation.gelu_and_mul --backends torch,torch_compile \\
        --shape '{"tokens": 16, "intermediate": 3584}' --device cpu   # anywhere

Prints, per setting, the spread of log(ratio) inside each process (pooled standard deviation) and between
the processes' median ratios, as percentages; a between-process spread well above the inside spread is a
per-process factor the tune's rounds cannot see.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import subprocess
import sys


SETTINGS = ("alone", "together", "redraw")


def child(args) -> None:
    import torch

    from autosel.registry import load_plugins, registry
    from autosel.timing import measure_together, timer_for

    load_plugins()
    definition = registry.definition(args.op)
    backends = args.backends.split(",")
    fns = {b: registry.get_backend(args.op, b).load() for b in backends}
    shape = json.loads(args.shape)
    timer = timer_for(args.device, args.mode)
    rng = random.Random()  # unseeded: each process pads differently
    ratios: dict[str, list[float]] = {}
    for setting in SETTINGS:
        torch.manual_seed(0)
        inputs = definition.make_inputs(dict(shape), args.device)
        for fn in fns.values():  # compile and warm up outside the timed repeats
            fn(*inputs)
        for _ in range(args.repeats):
            if setting == "redraw":
                # one pad in the caching allocator's small pool (under 1 MB), one in its large pool
                pads = [torch.empty(rng.randrange(1, 4096) * 256, dtype=torch.uint8, device=args.device),
                        torch.empty(rng.randrange(1 << 20, 64 << 20), dtype=torch.uint8, device=args.device)]
                torch.manual_seed(0)
                inputs = definition.make_inputs(dict(shape), args.device)
                pads.clear()
            calls = {b: (lambda f=fn: f(*inputs)) for b, fn in fns.items()}
            if setting == "alone":
                times = {b: timer.measure(call, backend=b, shape=shape) for b, call in calls.items()}
            else:
                times, failed = measure_together(timer, calls, shape=shape)
                if failed:
                    raise next(iter(failed.values()))
            a, b = (statistics.median(times[b]) for b in backends)
            ratios.setdefault(setting, []).append(a / b)
    print(json.dumps(ratios))


def spread(per_process: list[list[float]]) -> tuple[float, float, float]:
    """(median ratio, pooled sd of log ratio inside processes, sd of the processes' median log ratio), the
    last two as fractions."""
    logs = [[math.log(r) for r in rs] for rs in per_process]
    inside = math.sqrt(statistics.fmean(statistics.variance(ls) for ls in logs))
    between = statistics.stdev(statistics.median(ls) for ls in logs)
    return math.exp(statistics.median(x for ls in logs for x in ls)), math.expm1(inside), math.expm1(between)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", required=True)
    parser.add_argument("--backends", required=True, help="A,B")
    parser.add_argument("--shape", required=True, help="JSON")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--mode", default="eager", choices=("eager", "graph"))
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--processes", type=int, default=5)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    runs = []
    for _ in range(args.processes):
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], check=True,
                             capture_output=True, text=True).stdout
        runs.append(json.loads(out.strip().splitlines()[-1]))
    print(f"{args.op} {args.shape} {args.mode} on {args.device}: {args.backends.replace(',', ' / ')}, "
          f"{args.processes} processes x {args.repeats} repeats")
    for setting in SETTINGS:
        median, inside, between = spread([r[setting] for r in runs])
        per = " ".join(f"{statistics.median(r[setting]):.3f}" for r in runs)
        print(f"  {setting:8s} ratio {median:.3f}; spread inside a process {inside:.1%}, between processes "
              f"{between:.1%}; per-process medians {per}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
