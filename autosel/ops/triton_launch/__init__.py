"""Launching autosel's Triton kernels without paying Triton's per-call dispatch on the host every time.

`kernel[grid](*args)` runs JITFunction.run on every call: it binds the arguments, works out each one's
specialization (dtype, 16-byte alignment, integers equal to 1 or divisible by 16), builds a cache key from them
and looks the compiled kernel up; then Triton's launcher parses some twenty arguments, asks the driver about
every pointer and launches. Triton's own issues put the Python part at about 12 us per launch with many
arguments (triton-lang/triton#6064). In eager mode a launch-bound norm or activation costs the larger of its
host and device time, so that host time is what loses autosel's Triton kernels the small eager shapes
(commits fa1f314 and 996e828).

FastLaunch keeps each compiled kernel Triton returns for a specialization, under the key Triton specializes
on, and launches it directly the next time, from C: `triton_launch.c` computes the key, looks the kernel up and
calls the driver's cuLaunchKernel in one call, built at first use with the helper Triton builds its own
launchers with. The first call of each specialization goes through Triton unchanged (it compiles, or loads
from Triton's cache); so does every call under TRITON_INTERPRET, while a profiler's launch hook is set, and
where the C module cannot be built or a kernel needs what it does not pass (scratch memory, clusters).
AUTOSEL_FAST_LAUNCH=0 (autosel.config.fast_launch) turns the C path off: every call then goes through Triton.

The subpackage holds this module and its C half, triton_launch.c; tools/bench_triton_launch.py measures the host
time per call of each launch path (Triton's, torch's StaticallyLaunchedCudaKernel, this one's).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import torch
from triton.runtime.jit import JITFunction

from autosel import config

try:  # the launch hooks' home from Triton 3.3 (profilers such as proton set them)
    from triton import knobs as _knobs
except ImportError:  # older Triton: every call goes through JITFunction.run
    _knobs = None

logger = logging.getLogger(__name__)

# How the C launcher passes each type of Triton's signature, and its size in bytes ('-': a constant, not passed).
_KINDS = {"i32": ("i", 4), "i64": ("l", 8), "u64": ("K", 8), "fp32": ("f", 4), "u1": ("b", 1), "i1": ("b", 1),
          "constexpr": ("-", 0)}


@functools.cache
def direct_module() -> Any:
    """The C half (triton_launch.c), built once per machine into Triton's cache; None where it cannot be."""
    try:
        from triton.runtime.build import compile_module_from_src

        source = Path(__file__).with_name("triton_launch.c").read_text()
        return compile_module_from_src(src=source, name="autosel_triton_launch")
    except Exception as exc:  # no C compiler, no Python headers, a Triton without the helper: Triton's path
        logger.warning("autosel's Triton kernels launch through Triton's own path, a few microseconds more per "
                       "call: the direct launcher could not be built (%s: %s). A C compiler and Python's headers "
                       "are what Triton itself needs for its launchers.", type(exc).__name__, exc)
        return None


def launch_key(prefix: Any, args: tuple) -> tuple | None:
    """The key FastLaunch keeps a compiled kernel under: `prefix`, a byte per argument saying what Triton
    specializes it on (a tensor's 16-byte alignment; an integer's width, whether it is 1 and whether it divides by
    16; only the type of a float, a bool or None) and each tensor's dtype. Two calls with equal keys run the same
    compiled kernel. None for an argument of another type, or where the C module cannot be built."""
    module = direct_module()
    return None if module is None else module.key(prefix, args)


class FastLaunch:
    """`launch(grid, args, constexprs, num_warps)` runs `fn[grid](*args, *constexprs, num_warps=num_warps)`.

    `args` are the kernel's runtime arguments and `constexprs` the values of its constexpr parameters, which
    must come after the runtime ones in its signature. The compiled kernel for each (device, num_warps,
    constexprs, launch_key of the runtime arguments) is kept after its first launch; from then on the call
    launches it on the current device's current stream (so a CUDA graph capture records it) from C.
    """

    def __init__(self, fn) -> None:
        self.fn = fn
        self.kept: dict[tuple, tuple] = {}
        # Under TRITON_INTERPRET, @triton.jit makes an InterpretedFunction, which runs on the CPU: no direct launch.
        self.enabled = config.fast_launch() and isinstance(fn, JITFunction) and _knobs is not None
        self.direct = direct_module() if self.enabled else None
        self.enabled = self.direct is not None
        # Whether the C module reads tensors through torch's DLPack C exchange API, so that it can also take a
        # kernel's tensors themselves (triton_launch.c's norm, act_and_mul, rope) rather than arguments prepared in
        # Python.
        self.reads_dlpack = self.enabled and self.direct.reads_dlpack()

    def __call__(self, grid: tuple, args: tuple, constexprs: tuple, num_warps: int) -> None:
        if not self.enabled:
            self.fn[grid](*args, *constexprs, num_warps=num_warps)
            return
        device = torch.cuda.current_device()
        prefix = (device, num_warps, constexprs)
        if not hooked() and self.direct.launch(self.kept, prefix, grid, _current_stream(device), args):
            return
        kernel = self.fn[grid](*args, *constexprs, num_warps=num_warps)
        kernel = kernel.result() if hasattr(kernel, "result") else kernel  # an asynchronous compile's future
        key = self.direct.key(prefix, args)
        if key is not None and key not in self.kept:
            entry = self._entry(kernel, args)
            if entry is None:  # not a kernel the C launcher can pass everything to: Triton's path from now on
                self.enabled = False
            else:
                self.kept[key] = entry

    def _entry(self, kernel: Any, args: tuple) -> tuple | None:
        """What the C launcher needs to launch `kernel` with arguments like `args` (see triton_launch.c), checked
        against the parameters the loaded kernel declares; None, with the reason logged, where it cannot launch it.
        The entry holds `kernel` itself: Triton 3.9 unloads a compiled kernel's module when the object goes."""
        metadata = getattr(kernel, "metadata", None)
        signature = list(getattr(getattr(kernel, "src", None), "signature", {}).values())
        function = getattr(kernel, "function", None)
        n_args = len(args)
        if metadata is None or function is None or len(signature) < n_args:
            return _unsupported(kernel, "not the CompiledKernel this module was written for")
        needs = [name for name in ("global_scratch_size", "profile_scratch_size", "launch_cooperative_grid",
                                   "launch_pdl", "tensordesc_meta", "instrumentation_mode")
                 if getattr(metadata, name, None)]
        if getattr(metadata, "num_ctas", 1) != 1:
            needs.append("num_ctas")
        if needs:
            return _unsupported(kernel, "it needs " + ", ".join(needs))
        if any(kind != "constexpr" for kind in signature[n_args:]):
            return _unsupported(kernel, "a runtime parameter comes after a constexpr one")
        kinds = [("p", 8) if kind.startswith("*") else _KINDS.get(kind) for kind in signature[:n_args]]
        if None in kinds:
            return _unsupported(kernel, f"a parameter of type {signature[kinds.index(None)]}")
        # The key reads an argument's Python type, the packing the signature's: they must agree (an int passed to a
        # float parameter would be packed as its bits; a constexpr passed as an argument keyed by type alone).
        for arg, (kind, _), param in zip(args, kinds, self.fn.params):
            if param.is_constexpr or not _packs(kind, arg):
                return _unsupported(kernel, f"argument {param.name}={arg!r} is passed as kind {kind!r}")
        passed = [size for kind, size in kinds if kind != "-"]
        declared = self.direct.param_sizes(function)
        # After the arguments Triton appends its scratch pointers, null here: one (Triton 3.3, 3.4) or two (3.5 on).
        if (declared is None or list(declared[:len(passed)]) != passed
                or declared[len(passed):] not in ((8,), (8, 8))):
            return _unsupported(kernel, f"its parameters are {declared} bytes, not {passed} and scratch pointers")
        return (function, 32 * metadata.num_warps, metadata.shared, "".join(k for k, _ in kinds).encode(),
                len(declared) - len(passed), kernel)


def _packs(kind: str, arg: Any) -> bool:
    """Whether the C launcher passes `arg` as Triton would for a parameter of this kind."""
    if kind == "-":
        return arg is None or (type(arg) is int and arg == 1)
    return {"p": isinstance(arg, torch.Tensor), "f": type(arg) is float, "b": type(arg) is bool}.get(
        kind, type(arg) is int)


def hooked() -> bool:
    """Whether a launch hook is set (a profiler's, such as proton's): every launch must then go through Triton,
    which calls it. From Triton 3.6 a hook is a HookChain, set when it holds a call; before, a function or None.
    Asked on every launch: written out, without a generator (0.14 against 0.39 us on this project's CPU)."""
    runtime = _knobs.runtime
    enter, leave = runtime.launch_enter_hook, runtime.launch_exit_hook
    return ((enter is not None and bool(getattr(enter, "calls", True)))
            or (leave is not None and bool(getattr(leave, "calls", True))))


def _unsupported(kernel: Any, why: str) -> None:
    logger.info("Triton kernel %s launches through Triton's own path: %s", getattr(kernel, "name", kernel), why)
    return None


def _current_stream(device: int) -> int:
    """The current CUDA stream's handle, as Triton's CUDA driver looks it up (torch's raw lookup: the public
    torch.cuda.current_stream(device).cuda_stream builds a Stream object on every call)."""
    return torch._C._cuda_getCurrentRawStream(device)
