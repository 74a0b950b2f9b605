"""CPU kernels for one toy op with really different speeds: a slow reference, a fast one, a wrong-but-fast one,
one that raises and one that returns NaN. Importable by target string ("toy_kernels:fast")."""

import torch

SIZE = 1 << 16


def slow(x: torch.Tensor) -> torch.Tensor:
    y = x
    for _ in range(64):  # the same answer, computed 64 times
        y = x * 2
    return y


def fast(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def wrong_but_fast(x: torch.Tensor) -> torch.Tensor:
    return x  # skips the work: the fastest of all, and wrong


def raises(x: torch.Tensor) -> torch.Tensor:
    raise RuntimeError("illegal memory access (simulated)")


def nan(x: torch.Tensor) -> torch.Tensor:
    return x * float("nan")


def inputs(shape: dict, device: str) -> tuple:
    return (torch.randn(shape["n"], device=device),)


SHAPES = [{"n": SIZE}, {"n": SIZE // 4}]


def segfaults(x: torch.Tensor) -> torch.Tensor:
    import ctypes

    ctypes.string_at(0)  # reads address 0: SIGSEGV, as a kernel with a bad pointer would
    return x


def hangs(x: torch.Tensor) -> torch.Tensor:
    import time

    time.sleep(3600)
    return x
