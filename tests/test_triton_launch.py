"""Tests for autosel.ops.triton_launch on the CPU: its C module builds here, and its keys split calls exactly where
Triton's specialization does.

The direct launch itself needs a GPU: tests/gpu/test_triton_launch_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from autosel.ops.triton_launch import FastLaunch, direct_module, launch_key

triton_libs = pytest.importorskip("triton._C.libtriton")


def _triton_specialization(arg):
    """Triton's own view of a runtime argument (type and specialization), where this Triton exposes it."""
    native = getattr(triton_libs, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton does not expose native_specialize_impl")
    from triton.backends.compiler import BaseBackend

    return native(BaseBackend, arg, False, True, True)


def _sample_args():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    tensors = [buffer, buffer[1:], buffer[8:], torch.zeros(8, dtype=torch.float32), torch.zeros(8)[1:],
               torch.zeros(8, dtype=torch.float16), torch.nn.Parameter(torch.zeros(8)), torch.nn.Parameter(buffer[1:])]
    ints = [0, 1, 2, 15, 16, 17, 32, 4096, 4100, -16, -3, (1 << 31) - 16, 1 << 31, (1 << 31) + 1, 1 << 40, 1 << 63]
    return tensors + ints + [1e-6, 0.5, True, False, None]


def _key(*args):
    return launch_key("prefix", args)


def test_the_c_module_builds_here():
    # Triton's helper builds it from Python's headers alone: no CUDA needed, so CPU CI checks the C compiles.
    assert direct_module() is not None


def test_equal_keys_exactly_where_triton_specializes_alike():
    args = _sample_args()
    for a, b in itertools.combinations(args, 2):
        same_key = _key(a) == _key(b)  # what FastLaunch computes
        same_triton = _triton_specialization(a) == _triton_specialization(b)
        assert same_key == same_triton, (a if not isinstance(a, torch.Tensor) else a.data_ptr() % 16,
                                         b if not isinstance(b, torch.Tensor) else b.data_ptr() % 16)


def test_a_key_is_its_arguments_keys_in_order():
    args = _sample_args()
    whole = launch_key("prefix", tuple(args))
    assert whole[0] == "prefix"
    assert whole[1] == b"".join(_key(a)[1] for a in args)  # a byte per argument
    # then each tensor's dtype (a torch.dtype, or DLPack's code for it where tensors are read through DLPack)
    assert whole[2:] == tuple(_key(a)[2] for a in args if isinstance(a, torch.Tensor))
    assert len({_key(a)[2] for a in args if isinstance(a, torch.Tensor)}) == len(
        {a.dtype for a in args if isinstance(a, torch.Tensor)})
    assert _key(args[0], args[16]) != _key(args[16], args[0])


def test_key_separates_alignment_and_divisibility():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    assert _key(buffer) != _key(buffer[1:])  # 2 bytes off: no 16-byte alignment
    assert _key(buffer) == _key(buffer[8:])  # 16 bytes off: still aligned
    assert _key(buffer) != _key(buffer.float())
    assert _key(4096) == _key(8192) != _key(4100)
    assert _key(1) != _key(17)
    assert launch_key("a", (4096,)) != launch_key("b", (4096,))


@pytest.mark.parametrize("arg", ["4096", 2 ** 64, -(2 ** 63) - 1, [1], 1.5j], ids=str)
def test_arguments_it_cannot_key_get_none(arg):
    # None sends the call through Triton's own path, which raises its own error or passes them its own way.
    assert _key(torch.zeros(2), arg) is None


def test_interpreted_kernels_are_launched_through_triton():
    """Under TRITON_INTERPRET the kernel is an InterpretedFunction: FastLaunch must not take the direct path."""
    from triton.runtime.interpreter import InterpretedFunction

    def kernel(x):  # never traced: FastLaunch only reads the decorated object's type
        pass

    assert not FastLaunch(InterpretedFunction(kernel)).enabled


@pytest.mark.parametrize("value, direct", [(None, True), ("1", True), ("on", True), ("0", False), ("off", False)])
def test_autosel_fast_launch_is_the_one_switch_for_the_c_path(monkeypatch, value, direct):
    from triton.runtime.jit import JITFunction

    def kernel(x):  # never traced: FastLaunch reads the switch and the decorated object's type
        pass

    if value is not None:
        monkeypatch.setenv("AUTOSEL_FAST_LAUNCH", value)
    launcher = FastLaunch(JITFunction(kernel))
    assert launcher.enabled is direct and (launcher.direct is not None) is direct


def test_a_bad_autosel_fast_launch_names_the_allowed_values(monkeypatch):
    from autosel.errors import ConfigError

    monkeypatch.setenv("AUTOSEL_FAST_LAUNCH", "yes")
    with pytest.raises(ConfigError, match="AUTOSEL_FAST_LAUNCH"):
        FastLaunch(None)


def test_launch_hooks_count_as_set_only_when_one_is_there(monkeypatch):
    # Triton 3.6 made the hook an always-present HookChain: read as "set", it sent every call through Triton.
    from triton import knobs

    from autosel.ops.triton_launch import hooked

    assert not hooked()
    hooks = knobs.runtime.launch_enter_hook
    if hasattr(hooks, "calls"):
        monkeypatch.setattr(hooks, "calls", [print])
    else:
        monkeypatch.setattr(knobs.runtime, "launch_enter_hook", print)
    assert hooked()


def _kernel_and_launcher(signature: dict, **metadata):
    """FastLaunch of a real JITFunction and a stand-in for the CompiledKernel Triton returns for `signature`."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    def scale(x_ptr, n, eps, BLOCK: "tl.constexpr"):  # noqa: F821 (never traced: only its parameters are read)
        pass

    launcher = FastLaunch(JITFunction(scale))
    # The driver's answer for such a kernel (a pointer, an int32, a float32, then Triton's two scratch pointers):
    # no GPU here to load one and ask.
    launcher.direct = SimpleNamespace(param_sizes=lambda function: (8, 4, 4, 8, 8))
    compiled = SimpleNamespace(name="scale", function=1, src=SimpleNamespace(signature=signature),
                               metadata=SimpleNamespace(num_warps=4, shared=0, **metadata))
    return launcher, compiled


@pytest.mark.parametrize("args, signature, metadata", [
    ((torch.zeros(4), 16, 2), {"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"}, {}),
    ((torch.zeros(4), 16, 1e-6, 64), {"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"}, {}),
    ((torch.zeros(4), 16, 1e-6), {"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"},
     {"instrumentation_mode": "gsan"}),
    ((torch.zeros(4), 16, 1e-6), {"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"},
     {"global_scratch_size": 128}),
], ids=["int-for-a-float", "constexpr-as-argument", "sanitizer", "scratch"])
def test_a_kernel_the_c_launcher_would_pass_otherwise_than_triton_is_not_kept(args, signature, metadata):
    # An int eps was packed as its bits (2 arrived as 2.8e-45), a constexpr passed as an argument shared a kernel
    # with every other value of it, and a sanitizer's or scratch memory's extra parameters were passed as nulls.
    launcher, compiled = _kernel_and_launcher(signature, **metadata)
    assert launcher._entry(compiled, args) is None


def test_a_kernel_the_c_launcher_passes_as_triton_does_is_kept_with_its_compiled_kernel():
    launcher, compiled = _kernel_and_launcher({"x_ptr": "*fp32", "n": "i32", "eps": "fp32", "BLOCK": "constexpr"})
    entry = launcher._entry(compiled, (torch.zeros(4), 16, 1e-6))
    # Triton 3.9 unloads a compiled kernel's module when the object goes: the entry holds it.
    assert entry == (1, 128, 0, b"pif", 2, compiled)
