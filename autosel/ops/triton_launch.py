"""Launching autosel's Triton kernels without paying Triton's per-call dispatch on the host every time.

`kernel[grid](*args)` runs JITFunction.run on every call: it binds the arguments, works out each one's
specialization (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), builds a cache key from them
and looks the compiled kernel up. Triton's own issues put that at about 12 us of Python per launch with many
arguments, against about 3 us for calling the compiled kernel (triton-lang/triton#6064, and the identity fast
path of facebookexperimental/triton#1231). In eager mode a launch-bound norm or activation costs the larger of its
host and device time, and on the H200's host autosel's Triton calls spent 30-50 us of host time against the
vendors' 11-22. Launched directly they spend 3-9 us less (docs/H200.md, "Triton's launch, directly", which also
splits what is left).

FastLaunch keeps the compiled kernel Triton returns for a specialization, under a key this module computes from
the same properties Triton specializes on, and launches it directly the next time: the same call Triton makes at
the end of JITFunction.run (Triton 3.3 and later). The first call of each specialization goes through Triton
unchanged (it compiles, or loads from Triton's cache); so does every call under TRITON_INTERPRET, and every call
where this Triton lacks the pieces the direct launch needs.
"""

from __future__ import annotations

from typing import Any

import torch
from triton.runtime.jit import JITFunction

try:  # the launch hooks' home from Triton 3.3 (profilers such as proton set them)
    from triton import knobs as _knobs
except ImportError:  # older Triton: every call goes through JITFunction.run
    _knobs = None

_I32, _U64 = 1 << 31, 1 << 63  # Triton's integer types: i32 below 2**31 in magnitude, u64 from 2**63, else i64


def arg_key(arg: Any) -> Any:
    """What Triton specializes a runtime argument on: a tensor's dtype and whether its address is 16-byte
    aligned; an integer's type (i32, i64 or u64), whether it is 1 and whether it divides by 16; a float's
    type alone. Two calls with equal keys run the same compiled kernel."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    if isinstance(arg, bool) or arg is None or isinstance(arg, float):
        return type(arg)
    if isinstance(arg, int):
        return arg == 1, not arg & 15, -_I32 <= arg < _I32, arg >= _U64
    raise TypeError(f"FastLaunch has no key for a {type(arg).__name__} argument; pass tensors, ints, floats, "
                    "bools or None")


def args_key(args: tuple) -> tuple:
    """arg_key of each argument, with plain tensors and ints keyed inline. This runs on every launch: for the
    rmsnorm's ten arguments on the H200's host, 3.0 us inline against 6.2 us through arg_key (call 17-1,
    docs/H200.md)."""
    return tuple([(a.dtype, not a.data_ptr() & 15) if type(a) is torch.Tensor
                  else (a == 1, not a & 15, -_I32 <= a < _I32, a >= _U64) if type(a) is int
                  else arg_key(a) for a in args])


class FastLaunch:
    """`launch(grid, args, constexprs, num_warps)` runs `fn[grid](*args, *constexprs, num_warps=num_warps)`.

    `args` are the kernel's runtime arguments and `constexprs` the values of its constexpr parameters, which
    must come after the runtime ones in its signature. The compiled kernel for each (device, num_warps,
    constexprs, args_key of the runtime arguments) is kept after its first launch; from then on the call takes
    the current device's current stream (so a CUDA graph capture records it) and launches it directly.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.compiled: dict[tuple, Any] = {}
        # Under TRITON_INTERPRET, @triton.jit makes an InterpretedFunction, which runs on the CPU: no direct launch.
        self.enabled = isinstance(fn, JITFunction) and _knobs is not None

    def __call__(self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int) -> None:
        if not self.enabled:
            self.fn[grid](*args, *constexprs, num_warps=num_warps)
            return
        device = torch.cuda.current_device()
        key = (device, num_warps, constexprs, args_key(args))
        kernel = self.compiled.get(key)
        if kernel is None:
            kernel = self.fn[grid](*args, *constexprs, num_warps=num_warps)
            kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an asynchronous compile's future
            if all(hasattr(kernel, name) for name in ("run", "function", "packed_metadata", "launch_metadata")):
                self.compiled[key] = kernel
            else:  # not the CompiledKernel this module was written for: stay on Triton's path
                self.enabled = False
            return
        stream = _current_stream(device)
        enter, leave = _knobs.runtime.launch_enter_hook, _knobs.runtime.launch_exit_hook
        metadata = None if enter is None else kernel.launch_metadata(grid, stream, *args, *constexprs)
        kernel.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                   kernel.function, kernel.packed_metadata, metadata, enter, leave, *args, *constexprs)


def _current_stream(device: int) -> int:
    """The current CUDA stream's handle, as Triton's CUDA driver looks it up (torch's raw lookup: the public
    torch.cuda.current_stream(device).cuda_stream builds a Stream object on every call)."""
    return torch._C._cuda_getCurrentRawStream(device)
