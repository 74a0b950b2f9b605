"""Tests for autosel.ops.triton_launch on the CPU: its keys split calls exactly where Triton's specialization does.

The direct launch itself needs a GPU: tests/gpu/test_triton_launch_gpu.py."""

from __future__ import annotations

import itertools

import pytest
import torch

from autosel.ops.triton_launch import FastLaunch, arg_key, args_key

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


def test_equal_keys_exactly_where_triton_specializes_alike():
    args = _sample_args()
    for a, b in itertools.combinations(args, 2):
        same_key = args_key((a,)) == args_key((b,))  # what FastLaunch computes
        same_triton = _triton_specialization(a) == _triton_specialization(b)
        assert same_key == same_triton, (a if not isinstance(a, torch.Tensor) else a.data_ptr() % 16,
                                         b if not isinstance(b, torch.Tensor) else b.data_ptr() % 16)


def test_inline_keys_are_arg_key():
    args = _sample_args()
    assert args_key(tuple(args)) == tuple(arg_key(a) for a in args)


def test_key_separates_alignment_and_divisibility():
    buffer = torch.zeros(64, dtype=torch.bfloat16)
    assert arg_key(buffer) != arg_key(buffer[1:])  # 2 bytes off: no 16-byte alignment
    assert arg_key(buffer) == arg_key(buffer[8:])  # 16 bytes off: still aligned
    assert arg_key(4096) == arg_key(8192) != arg_key(4100)
    assert arg_key(1) != arg_key(17)


def test_unknown_argument_types_are_refused_by_name():
    with pytest.raises(TypeError, match="no key for a str argument"):
        arg_key("4096")


def test_interpreted_kernels_are_launched_through_triton():
    """Under TRITON_INTERPRET the kernel is an InterpretedFunction: FastLaunch must not take the direct path."""
    from triton.runtime.interpreter import InterpretedFunction

    def kernel(x):  # never traced: FastLaunch only reads the decorated object's type
        pass

    assert not FastLaunch(InterpretedFunction(kernel)).enabled
