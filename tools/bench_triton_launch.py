"""Host time per call of each way to launch autosel's built-in Triton kernels, on a CUDA GPU: Triton's own launch
(`kernel[grid](...)`), torch's launcher for Triton-compiled kernels (torch._inductor.runtime.static_triton_launcher.
StaticallyLaunchedCudaKernel), autosel's C launch of a kept kernel (FastLaunch, autosel/ops/triton_launch/), and
the op's public wrapper with AUTOSEL_FAST_LAUNCH on (its whole launch in C from the tensors, where torch allows it).
Which C to keep is decided from this: only the C that beats the library by more than the noise.

    python tools/bench_triton_launch.py --out results/triton_launch.json
    python tools/bench_triton_launch.py --tokens 1,16 --calls 2000 --repeats 21

Host time, not device time: each repeat times `calls` launches back to back with time.perf_counter_ns and
synchronizes after the clock stops (torch.utils.benchmark's Timer synchronizes inside the timed block, which would
add device time). The shapes are the launch-bound ones (few tokens), where a kernel runs in 2-3 us and the host's
issue rate is the whole cost; `calls` is kept below the launch queue's depth (1024) so the host never waits for
the device. Statistic: the median over repeats, with p20/p80; the paths of one kernel run in interleaved repeats
(A B C D A B C D ...), so drift hits all alike.

Each kernel's arguments are the ones its public wrapper passes: the wrapper is called once with a recording
FastLaunch, and every path then launches exactly that (grid, arguments, constexprs, num_warps). A path that cannot
launch a kernel (torch's launcher refusing a hook or scratch memory, say) is recorded with its error, and the others
go on. The result file carries the command, the commit, the date, the GPU and the versions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
# The built-in ops with a Triton kernel of autosel's own, and the wrapper that launches it.
OPS = {
    "layernorm.rmsnorm": "rmsnorm",
    "layernorm.fused_add_rmsnorm": "fused_add_rmsnorm",
    "activation.silu_and_mul": "silu_and_mul",
    "activation.gelu_and_mul": "gelu_and_mul",
    "embeddings.rope": "rope",
}


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,16,64", help="token counts to time each kernel at (default 1,16,64)")
    parser.add_argument("--calls", type=int, default=500, help="launches per timed repeat (default 500, < 1024)")
    parser.add_argument("--repeats", type=int, default=15, help="interleaved repeats per path (default 15)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "triton_launch.json",
                        help="result file (JSON); default results/triton_launch.json")
    return parser.parse_args(argv)


def _commit() -> str:
    if os.environ.get("AUTOSEL_COMMIT"):  # a copied tree without .git, on the GPU machine
        return os.environ["AUTOSEL_COMMIT"]
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _shape(op: str, tokens: int, definition) -> dict:
    """The op's first representative shape on this machine, at `tokens` tokens (its row count)."""
    import autosel

    shape = dict(definition.shapes_for(autosel.PlatformInfo.detect())[0])
    for name in ("tokens", "n_rows", "rows", "num_tokens"):
        if name in shape:
            shape[name] = tokens
            return shape
    raise SystemExit(f"{op}: no token count among its shape's keys {sorted(shape)}; extend _shape")


def _record_launch(fn: Callable[..., Any], args: tuple) -> tuple[Any, tuple] | None:
    """Call the op's wrapper once through Triton's path, recording the launch it makes: (its FastLaunch, (grid,
    runtime arguments, constexprs, num_warps)); None when it launched nothing through a FastLaunch."""
    from autosel.ops import triton_launch

    seen: list = []
    original = triton_launch.FastLaunch.__call__

    def recording(self, grid, run_args, constexprs, num_warps):
        seen.append((self, (grid, run_args, constexprs, num_warps)))
        self.fn[grid](*run_args, *constexprs, num_warps=num_warps)

    # A call whose plan an earlier row made may launch from C without calling FastLaunch (on the H200 fused add +
    # rmsnorm and rope at 64 tokens recorded no launch): the wrapper's direct path is off while recording.
    from autosel.ops import triton_kernels

    direct = triton_kernels._DIRECT
    triton_launch.FastLaunch.__call__, triton_kernels._DIRECT = recording, None
    try:
        fn(*args)
    finally:
        triton_launch.FastLaunch.__call__, triton_kernels._DIRECT = original, direct
    return seen[0] if seen else None


def _paths(launcher, launch: tuple, wrapper: Callable[[], Any], device: int, folder: Path
           ) -> dict[str, Callable[[], Any] | str]:
    """Each launch path as a callable that launches the recorded kernel once, or the reason it cannot."""
    import torch
    from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel

    grid, run_args, constexprs, num_warps = launch
    fn = launcher.fn
    compiled = fn[grid](*run_args, *constexprs, num_warps=num_warps)
    compiled = compiled.result() if hasattr(compiled, "result") else compiled
    paths: dict[str, Callable[[], Any] | str] = {
        "triton": lambda: fn[grid](*run_args, *constexprs, num_warps=num_warps),
    }
    try:
        compiled._cubin_path = None  # torch's launcher loads the cubin from a file: written below from the binary
        static = StaticallyLaunchedCudaKernel(compiled)
        static.reload_cubin_from_raw(str(folder / f"{static.name}-{static.hash}.cubin"))
        static.load_kernel(device)
        full = (*run_args, *constexprs)
        passed = tuple(a for i, a in enumerate(full) if i not in static.full_constexprs
                       and list(compiled.src.signature.values())[i] != "constexpr")
        grid3 = (*grid, 1, 1)[:3]
        stream = torch.cuda.current_stream(device).cuda_stream
        paths["torch_static"] = lambda: static.run(*grid3, stream, *passed)
    except Exception as exc:  # torch's launcher refuses this kernel: recorded, the other paths go on
        paths["torch_static"] = f"{type(exc).__name__}: {exc}"
    if launcher.enabled:
        launcher(grid, run_args, constexprs, num_warps)  # keeps the compiled kernel: later calls launch from C
        paths["autosel_c"] = lambda: launcher(grid, run_args, constexprs, num_warps)
        paths["autosel_wrapper_c"] = wrapper
    else:
        paths["autosel_c"] = paths["autosel_wrapper_c"] = "FastLaunch is off here (AUTOSEL_FAST_LAUNCH=0, no C)"
    return paths


def _time(paths: dict[str, Callable[[], Any] | str], calls: int, repeats: int) -> dict[str, dict]:
    """Per path: the median, p20 and p80 host microseconds per call over interleaved repeats, or its error."""
    import torch

    runnable = {name: call for name, call in paths.items() if callable(call)}
    for call in runnable.values():  # warm-up, and a check that it launches
        for _ in range(10):
            call()
    torch.cuda.synchronize()
    samples: dict[str, list[float]] = {name: [] for name in runnable}
    for _ in range(repeats):
        for name, call in runnable.items():
            began = time.perf_counter_ns()
            for _ in range(calls):
                call()
            samples[name].append((time.perf_counter_ns() - began) / calls / 1000)
            torch.cuda.synchronize()  # outside the clock: the next repeat starts with an empty launch queue
    result: dict[str, dict] = {name: {"error": call} for name, call in paths.items() if not callable(call)}
    for name, values in samples.items():
        q = statistics.quantiles(values, n=10)
        result[name] = {"median_us": statistics.median(values), "p20_us": q[1], "p80_us": q[7],
                        "samples": len(values)}
    return result


def main(argv: list[str] | None = None) -> int:
    options = _parse(argv)
    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench_triton_launch: needs a CUDA GPU (torch.cuda.is_available() is False); nothing measured",
              file=sys.stderr)
        return 2
    import autosel
    from autosel.ops import triton_kernels

    device = torch.cuda.current_device()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for op, name in OPS.items():
            definition = autosel.registry.definition(op)
            wrapper_fn = getattr(triton_kernels, name)
            for tokens in [int(t) for t in options.tokens.split(",")]:
                shape = _shape(op, tokens, definition)
                args = definition.make_inputs(shape, "cuda")
                recorded = _record_launch(wrapper_fn, args)
                if recorded is None:
                    rows.append({"op": op, "shape": shape, "error": "its wrapper launched no FastLaunch kernel"})
                    continue
                launcher, launch = recorded
                paths = _paths(launcher, launch, lambda: wrapper_fn(*args), device, Path(folder))
                rows.append({"op": op, "shape": shape, "grid": list(launch[0]), "num_warps": launch[3],
                             "paths": _time(paths, options.calls, options.repeats)})
                print(op, shape, {k: round(v.get("median_us", float("nan")), 2) for k, v in rows[-1]["paths"].items()})
    result = {
        "command": " ".join([os.path.relpath(sys.argv[0], ROOT), *(sys.argv[1:] if argv is None else argv)]),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(device),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                     "autosel": autosel.__version__},
        "calls_per_repeat": options.calls, "repeats": options.repeats,
        "note": "host microseconds per call; median, p20, p80 over interleaved repeats",
        "rows": rows,
    }
    options.out.parent.mkdir(parents=True, exist_ok=True)
    options.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {options.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
